"""An independent float64 forward of every supported family: the second reference beside llama.cpp.

Written with numpy from llama.cpp's graphs (src/models/<family>.cpp) and its hyperparameter rules,
sharing no code with ggtorch; weights come from gguf-py's reader and its numpy dequantizers. Rope
angles are built as ggml builds them (an f32 running product, ggml_rope_cache_init); everything else
is float64. GELU is the exact tanh formula (``gelu="tanh"``) or ggml-cpu's fp16 table (``"ggml"``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import gguf
import numpy as np

NEOX_ARCHS = {"qwen2", "qwen2moe", "qwen3", "qwen3moe", "gemma2", "gemma3", "phi3", "gpt-oss", "qwen35", "qwen35moe",
              "gemma4"}
NORM_ARCHS = {"llama", "mistral3", "smollm3", "granite"}
SUPPORTED = NEOX_ARCHS | NORM_ARCHS


@dataclass
class Config:
    arch: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int
    head_dim_k: int
    head_dim_v: int
    n_rot: int
    rms_eps: float
    rope_neox: bool
    rope_freq_base: float
    rope_freq_scale: float
    rope_attn_factor: float
    n_ctx_orig: int
    rope_yarn: bool = False
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_log_mul: float = 0.0
    attn_temp_scale: float = 0.0
    # per layer
    is_swa: list[bool] = field(default_factory=list)
    n_swa: int = 0
    rope_freq_base_swa: float = 10000.0
    rope_freq_scale_swa: float = 1.0
    # attention
    q_prescale: float | None = None
    """gemma/phi3: Q multiplied by this before QK^T (then kq_scale = 1)."""
    kq_scale: float = 1.0
    attn_softcap: float = 0.0
    final_softcap: float = 0.0
    embd_scale: float = 1.0
    residual_scale: float = 1.0
    """granite: attention and FFN outputs multiplied by this before their residual adds."""
    logit_scale: float = 1.0
    """granite: the logits divided by this."""
    # experts
    n_expert: int = 0
    n_expert_used: int = 0
    # qwen35: Gated DeltaNet layers, gated attention, multi-section rope
    recurrent: list[bool] = field(default_factory=list)
    ssm_k_heads: int = 0
    ssm_v_heads: int = 0
    ssm_state: int = 0
    rope_sections: tuple[int, ...] = ()
    # gemma4: per-layer shapes, K/V sharing, per-layer embeddings
    n_head_kv_layers: list[int] = field(default_factory=list)
    head_dim_swa: int = 0
    n_rot_swa: int = 0
    n_kv_shared: int = 0
    n_embd_per_layer: int = 0


@dataclass
class Model:
    config: Config
    w: dict[str, np.ndarray]
    meta: dict


def _meta(reader: gguf.GGUFReader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _tensors(reader: gguf.GGUFReader) -> dict[str, np.ndarray]:
    out = {}
    for t in reader.tensors:
        if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            a = np.array(t.data, dtype=np.float64)
        else:
            a = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)
        shape = tuple(int(x) for x in reversed(t.shape))  # torch/numpy order: ne reversed
        out[t.name] = a.reshape(shape)
    return out


def _scalar(v):
    if isinstance(v, list):
        if any(x != v[0] for x in v):
            raise NotImplementedError(f"per-layer hparam array {v[:4]}...")
        return v[0]
    return v


def _first(v):
    """A per-layer array's first entry (gemma4's arrays are read per layer where they matter)."""
    return v[0] if isinstance(v, list) else v


def make_config(meta: dict, tensors: dict[str, np.ndarray]) -> Config:
    """Hyperparameters with llama.cpp's keys, defaults and per-arch rules (families.md §1, §2)."""
    arch = meta["general.architecture"]
    if arch not in SUPPORTED:
        raise NotImplementedError(arch)

    def g(key, default=None, required=False):
        k = key.format(a=arch)
        if k in meta:
            return _scalar(meta[k])
        if required:
            raise KeyError(k)
        return default

    n_embd = int(g("{a}.embedding_length", required=True))
    n_head = int(g("{a}.attention.head_count", required=True))
    n_head_kv = int(_first(meta.get(f"{arch}.attention.head_count_kv", n_head)))
    hdk = int(g("{a}.attention.key_length", n_embd // n_head))
    hdv = int(g("{a}.attention.value_length", n_embd // n_head))
    n_rot = int(g("{a}.rope.dimension_count", hdk))
    n_ctx_train = int(g("{a}.context_length", required=True))
    scaling_type = g("{a}.rope.scaling.type", "linear")
    factor = g("{a}.rope.scaling.factor", None)
    if factor is None:
        factor = g("{a}.rope.scale_linear", 0.0)
    freq_scale = 1.0 if float(factor) == 0.0 else 1.0 / float(factor)
    if scaling_type == "none":
        freq_scale = 1.0
    n_layer = int(g("{a}.block_count", required=True)) - int(g("{a}.nextn_predict_layers", 0))
    n_vocab = g("{a}.vocab_size", None) if arch == "llama" else None
    if n_vocab is None:
        n_vocab = len(meta["tokenizer.ggml.tokens"])
    c = Config(
        arch=arch, n_vocab=int(n_vocab), n_embd=n_embd, n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
        n_ff=int(_first(meta.get(f"{arch}.feed_forward_length", 0))), n_ctx_train=n_ctx_train, head_dim_k=hdk,
        head_dim_v=hdv,
        n_rot=n_rot, rms_eps=float(g("{a}.attention.layer_norm_rms_epsilon", required=True)),
        rope_neox=arch in NEOX_ARCHS, rope_freq_base=float(g("{a}.rope.freq_base", 10000.0)),
        rope_freq_scale=freq_scale, rope_attn_factor=float(g("{a}.rope.scaling.attn_factor", 1.0)),
        n_ctx_orig=int(g("{a}.rope.scaling.original_context_length", n_ctx_train)),
        rope_yarn=scaling_type == "yarn", is_swa=[False] * n_layer, n_expert=int(g("{a}.expert_count", 0)),
        n_expert_used=int(g("{a}.expert_used_count", 0)),
    )
    c.kq_scale = 1.0 / math.sqrt(hdk)

    def swa_pattern(default_period: int) -> list[bool]:
        pat = meta.get(f"{arch}.attention.sliding_window_pattern")
        if isinstance(pat, list):  # per-layer bool array
            return [bool(x) for x in pat[:n_layer]]
        period = int(pat) if pat is not None else default_period
        return [period == 0 or (il % period < period - 1) for il in range(n_layer)]

    if arch in ("llama", "mistral3", "smollm3", "granite"):
        if n_rot != hdk:
            raise ValueError(f"invalid n_rot: {n_rot}, expected {hdk}")
    if arch == "mistral3":
        c.yarn_beta_fast = float(g("{a}.rope.scaling.yarn_beta_fast", 32.0))
        c.yarn_beta_slow = float(g("{a}.rope.scaling.yarn_beta_slow", 1.0))
        c.yarn_log_mul = float(g("{a}.rope.scaling.yarn_log_multiplier", 0.0))
        c.attn_temp_scale = float(g("{a}.attention.temperature_scale", 0.0))
    elif arch == "granite":  # src/models/granite.cpp: a zero or absent optional scale is no scale
        c.logit_scale = float(g("{a}.logit_scale", required=True))
        c.embd_scale = float(g("{a}.embedding_scale", 0.0)) or 1.0
        c.residual_scale = float(g("{a}.residual_scale", 0.0)) or 1.0
        c.kq_scale = float(g("{a}.attention.scale", 0.0)) or c.kq_scale
    elif arch == "gemma2":
        c.n_swa = int(g("{a}.attention.sliding_window", 4096))
        c.is_swa = swa_pattern(2)
        c.rope_freq_base_swa = float(g("{a}.rope.freq_base_swa", c.rope_freq_base))
        c.rope_freq_scale_swa = c.rope_freq_scale
        c.attn_softcap = float(g("{a}.attn_logit_softcapping", 50.0))
        c.final_softcap = float(g("{a}.final_logit_softcapping", 30.0))
        c.q_prescale = 1.0 / math.sqrt(n_embd // n_head) if n_layer == 46 else 1.0 / math.sqrt(hdk)
        c.kq_scale = 1.0
        c.embd_scale = math.sqrt(n_embd)
    elif arch == "gemma3":
        n_swa = int(g("{a}.attention.sliding_window", 0))
        if n_swa > 0:
            c.n_swa = n_swa
            c.is_swa = swa_pattern(6)
            c.rope_freq_base_swa = float(g("{a}.rope.freq_base_swa", 10000.0))
        c.rope_freq_scale_swa = 1.0
        c.final_softcap = float(g("{a}.final_logit_softcapping", 0.0))
        c.q_prescale = 1.0 / math.sqrt(n_embd // n_head) if n_layer == 62 else 1.0 / math.sqrt(hdk)
        c.kq_scale = 1.0
        c.embd_scale = math.sqrt(n_embd)
    elif arch == "phi3":
        c.q_prescale = 1.0 / math.sqrt(hdk)
        c.kq_scale = 1.0
        # phi3 ignores attention.sliding_window (llama.cpp disables SWA for it)
    elif arch == "gpt-oss":  # src/models/openai-moe.cpp: no yarn beta keys read, the betas stay 32 and 1
        c.n_swa = int(g("{a}.attention.sliding_window", required=True))
        c.is_swa = swa_pattern(2)
        c.rope_freq_base_swa = float(g("{a}.rope.freq_base_swa", c.rope_freq_base))
        c.rope_freq_scale_swa = c.rope_freq_scale
        c.kq_scale = 1.0 / math.sqrt(n_rot)  # the graph's head size is n_rot
    elif arch == "gemma4":  # src/models/gemma4.cpp, llama_model_gemma4::load_arch_hparams
        c.n_swa = int(g("{a}.attention.sliding_window", required=True))
        c.is_swa = [bool(x) for x in meta[f"{arch}.attention.sliding_window_pattern"][:n_layer]]
        kv = meta.get(f"{arch}.attention.head_count_kv", n_head)
        c.n_head_kv_layers = [int(x) for x in kv] if isinstance(kv, list) else [int(kv)] * n_layer
        c.head_dim_swa = int(meta.get(f"{arch}.attention.key_length_swa", hdk))
        c.n_rot_swa = int(meta.get(f"{arch}.rope.dimension_count_swa", n_rot))
        c.rope_freq_base_swa = float(g("{a}.rope.freq_base_swa", 10000.0))
        c.rope_freq_scale_swa = 1.0
        c.n_kv_shared = int(g("{a}.attention.shared_kv_layers", 0))
        c.n_embd_per_layer = int(g("{a}.embedding_length_per_layer_input", required=True))
        c.final_softcap = float(g("{a}.final_logit_softcapping", 0.0))
        c.kq_scale = 1.0
        c.embd_scale = math.sqrt(n_embd)
    elif arch in ("qwen35", "qwen35moe"):  # src/models/qwen35.cpp, qwen35moe.cpp, llama_model_qwen35::load_arch_hparams
        pattern = meta.get(f"{arch}.attention.recurrent_layers")
        if pattern is not None:
            c.recurrent = [bool(x) for x in pattern[:n_layer]]
        else:
            interval = int(g("{a}.full_attention_interval", 4))
            c.recurrent = [(il + 1) % interval != 0 for il in range(n_layer)]
        c.ssm_k_heads = int(g("{a}.ssm.group_count", required=True))
        c.ssm_v_heads = int(g("{a}.ssm.time_step_rank", required=True))
        c.ssm_state = int(g("{a}.ssm.state_size", required=True))
        c.rope_sections = tuple(int(x) for x in meta[f"{arch}.rope.dimension_sections"])
    return c


def load(path: str) -> Model:
    reader = gguf.GGUFReader(str(path))
    meta = _meta(reader)
    w = _tensors(reader)
    return Model(make_config(meta, w), w, meta)


# ---------------------------------------------------------------- ops

def rms_norm(x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * weight if weight is not None else y


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


_SQRT_2_OVER_PI = np.float32(0.79788456080286535587989211986876)
_GELU_A = np.float32(0.044715)


def gelu(x: np.ndarray, mode: str = "ggml") -> np.ndarray:
    """tanh-approximation GELU. mode="ggml": ggml-cpu's f32 path (GGML_GELU_FP16): x <= -10 -> 0,
    x >= 10 -> x, else fp16(gelu_f32(fp16(x)))."""
    if mode == "tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2 / math.pi) * x * (1.0 + 0.044715 * x * x)))
    x32 = x.astype(np.float32)
    h = x32.astype(np.float16).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        inner = _SQRT_2_OVER_PI * h * (np.float32(1.0) + _GELU_A * h * h)
        g = (np.float32(0.5) * h * (np.float32(1.0) + np.tanh(inner))).astype(np.float32)
    g = g.astype(np.float16).astype(np.float64)
    return np.where(x32 <= -10.0, 0.0, np.where(x32 >= 10.0, x, g))


def rope_cos_sin(n_tokens: int, n_rot: int, base: float, freq_scale: float, factors: np.ndarray | None,
                 mscale: float, yarn_orig_ctx: int | None = None, betas: tuple[float, float] = (32.0, 1.0),
                 mscale_all_dim: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin (T, n_rot/2) like ggml_rope_cache_init: theta_i = p * base^(-2i/n_rot) as an f32
    running product, divided by factors[i], times freq_scale; cos/sin times mscale.

    ``yarn_orig_ctx``: YaRN as the paper and transformers' ``_compute_yarn_parameters`` define it
    (beta_fast, beta_slow, truncated correction range, attention factor 0.1 ln(factor) + 1, divided by
    0.1 mscale_all_dim ln(factor) + 1 when given), in float64 from those formulas rather than ggml's code."""
    theta_scale = np.float32(base) ** (np.float32(-2.0) / np.float32(n_rot))
    extrap = np.empty((n_tokens, n_rot // 2), dtype=np.float32)
    for p in range(n_tokens):
        th = np.float32(p)
        for i in range(n_rot // 2):
            ff = np.float32(factors[i]) if factors is not None else np.float32(1.0)
            extrap[p, i] = th / ff
            th = np.float32(th * theta_scale)
    t = (np.float32(freq_scale) * extrap).astype(np.float64)
    if yarn_orig_ctx is not None:
        def correction_dim(rotations: float) -> float:
            return n_rot * math.log(yarn_orig_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))
        low = max(math.floor(correction_dim(betas[0])), 0)
        high = min(math.ceil(correction_dim(betas[1])), n_rot - 1)
        ramp = np.clip((np.arange(n_rot // 2) - low) / max(high - low, 0.001), 0, 1)
        keep = 1 - ramp  # the share of the unscaled angle
        t = t * (1 - keep) + extrap.astype(np.float64) * keep
        factor = 1 / freq_scale
        if factor > 1:
            mscale *= (0.1 * math.log(factor) + 1) / ((0.1 * mscale_all_dim * math.log(factor) + 1)
                                                      if mscale_all_dim else 1.0)
    return np.cos(t) * mscale, np.sin(t) * mscale


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, n_rot: int, neox: bool) -> np.ndarray:
    """x (T, H, D): rotate the first n_rot dims; NORM pairs (2i, 2i+1), NEOX pairs (i, i + n_rot/2).
    Dims from n_rot on pass through unchanged (partial rope)."""
    out = x.copy()
    c, s = cos[:, None, :], sin[:, None, :]
    if neox:
        half = n_rot // 2
        x0, x1 = x[..., :half], x[..., half:n_rot]
        out[..., :half] = x0 * c - x1 * s
        out[..., half:n_rot] = x0 * s + x1 * c
    else:
        x0, x1 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = x0 * c - x1 * s
        out[..., 1:n_rot:2] = x0 * s + x1 * c
    return out


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)


# ---------------------------------------------------------------- forward

def forward(model: Model, tokens: list[int], n_ctx_seq: int = 256, gelu_mode: str = "ggml") -> np.ndarray:
    """Logits (T, n_vocab) float64 of ``tokens`` at positions 0..T-1.

    ``n_ctx_seq``: llama.cpp's per-sequence context size, which picks phi3's long/short rope
    factors. llama.cpp pads n_ctx up to a multiple of 256, so n_ctx=64 gives 256.
    """
    c, w = model.config, model.w
    if c.arch == "gemma4":
        return gemma4_forward(model, tokens, gelu_mode)
    T = len(tokens)
    x = w["token_embd.weight"][np.asarray(tokens)] * c.embd_scale  # (T, C)
    H, Hkv, Dk, Dv = c.n_head, c.n_head_kv, c.head_dim_k, c.head_dim_v
    group = H // Hkv

    def rope_factors():
        if "rope_freqs.weight" in w:
            return w["rope_freqs.weight"]
        if n_ctx_seq > c.n_ctx_orig:
            return w.get("rope_factors_long.weight")
        return w.get("rope_factors_short.weight")

    factors = rope_factors()
    if c.arch in ("qwen2", "qwen3", "gemma2", "gemma3", "gpt-oss"):
        factors = None  # these graphs pass no freq factors to ggml_rope_ext
    pos = np.arange(T)
    causal = pos[None, :] <= pos[:, None]  # [query i, key j]

    for il in range(c.n_layer):
        p = f"blk.{il}."
        swa = c.is_swa[il]
        base = c.rope_freq_base_swa if swa else c.rope_freq_base
        fscale = c.rope_freq_scale_swa if swa else c.rope_freq_scale
        cos, sin = rope_cos_sin(T, c.n_rot, base, fscale, factors, c.rope_attn_factor,
                                c.n_ctx_orig if c.rope_yarn else None, (c.yarn_beta_fast, c.yarn_beta_slow),
                                c.yarn_log_mul)
        if c.rope_sections:
            still = ~imrope_text_pairs(c.rope_sections, c.n_rot)  # pairs of the 4th position, 0 for text
            cos[:, still], sin[:, still] = c.rope_attn_factor, 0.0

        h = rms_norm(x, w[p + "attn_norm.weight"], c.rms_eps)
        if c.recurrent and c.recurrent[il]:
            x = x + gated_delta_net(h, w, p, c)
            h = rms_norm(x, w[p + "post_attention_norm.weight"], c.rms_eps)
            x = x + (moe_ffn(h, w, p, c) if c.n_expert else dense_ffn(h, w, p, c, gelu_mode))
            continue
        nq, nk = H * Dk, Hkv * Dk
        if p + "attn_qkv.weight" in w:
            qkv = h @ w[p + "attn_qkv.weight"].T
            if p + "attn_qkv.bias" in w:
                qkv = qkv + w[p + "attn_qkv.bias"]
            q, k, v = qkv[:, :nq], qkv[:, nq:nq + nk], qkv[:, nq + nk:]
        else:
            q, k, v = (h @ w[p + f"attn_{n}.weight"].T for n in "qkv")
        gate = None
        if c.arch in ("qwen35", "qwen35moe"):  # attn_q holds, per head, the query and then its output gate
            qg = q.reshape(T, H, 2 * Dk)
            q, gate = qg[..., :Dk].reshape(T, H * Dk), qg[..., Dk:].reshape(T, H * Dk)
        if p + "attn_q.bias" in w:
            q = q + w[p + "attn_q.bias"]
            k = k + w[p + "attn_k.bias"]
            v = v + w[p + "attn_v.bias"]
        q, k, v = q.reshape(T, H, Dk), k.reshape(T, Hkv, Dk), v.reshape(T, Hkv, Dv)
        if p + "attn_q_norm.weight" in w:
            q = rms_norm(q, w[p + "attn_q_norm.weight"], c.rms_eps)
            k = rms_norm(k, w[p + "attn_k_norm.weight"], c.rms_eps)
        if not (c.arch == "smollm3" and (il + 1) % 4 == 0):  # SmolLM3's NoPE layers
            q = apply_rope(q, cos, sin, c.n_rot, c.rope_neox)
            k = apply_rope(k, cos, sin, c.n_rot, c.rope_neox)
        if c.attn_temp_scale:  # Llama 4's attention temperature, as transformers' get_llama_4_attn_scale
            q = q * (1 + c.attn_temp_scale * np.log(1 + np.floor(pos / c.n_ctx_orig)))[:, None, None]
        if c.q_prescale is not None:
            q = q * c.q_prescale
        kk = np.repeat(k, group, axis=1)  # query head h reads kv head h // group
        vv = np.repeat(v, group, axis=1)
        scores = np.einsum("ihd,jhd->hij", q, kk)
        if c.attn_softcap:
            scores = c.attn_softcap * np.tanh(scores / c.attn_softcap)
        allowed = causal & ((pos[:, None] - pos[None, :] < c.n_swa) if swa else True)
        scores = scores * c.kq_scale + np.where(allowed, 0.0, -np.inf)[None]
        if p + "attn_sinks.weight" in w:  # a head's sink logit joins its softmax's denominator only
            sinks = np.broadcast_to(w[p + "attn_sinks.weight"][:, None, None], (H, T, 1))
            probs = softmax(np.concatenate([scores, sinks], axis=-1), axis=-1)[..., :-1]
        else:
            probs = softmax(scores, axis=-1)
        att = np.einsum("hij,jhd->ihd", probs, vv).reshape(T, H * Dv)
        if gate is not None:
            att = att / (1.0 + np.exp(-gate))
        att = att @ w[p + "attn_output.weight"].T
        if p + "attn_output.bias" in w:
            att = att + w[p + "attn_output.bias"]
        if p + "post_attention_norm.weight" in w and c.arch not in ("gpt-oss", "qwen35", "qwen35moe"):
            att = rms_norm(att, w[p + "post_attention_norm.weight"], c.rms_eps)
        x = x + att * c.residual_scale

        ffn_norm = "post_attention_norm.weight" if c.arch in ("gpt-oss", "qwen35", "qwen35moe") else "ffn_norm.weight"
        h = rms_norm(x, w[p + ffn_norm], c.rms_eps)
        if c.n_expert:
            f = moe_ffn(h, w, p, c)
        elif c.arch == "phi3":
            y = h @ w[p + "ffn_up.weight"].T
            nff = y.shape[-1] // 2
            f = (silu(y[:, :nff]) * y[:, nff:]) @ w[p + "ffn_down.weight"].T
        else:
            gt = h @ w[p + "ffn_gate.weight"].T + w.get(p + "ffn_gate.bias", 0.0)
            up = h @ w[p + "ffn_up.weight"].T + w.get(p + "ffn_up.bias", 0.0)
            act = gelu(gt, gelu_mode) if c.arch in ("gemma2", "gemma3") else silu(gt)
            f = (act * up) @ w[p + "ffn_down.weight"].T + w.get(p + "ffn_down.bias", 0.0)
        if p + "post_ffw_norm.weight" in w:
            f = rms_norm(f, w[p + "post_ffw_norm.weight"], c.rms_eps)
        x = x + f * c.residual_scale

    x = rms_norm(x, w["output_norm.weight"], c.rms_eps)
    out_w = w.get("output.weight", w["token_embd.weight"])
    if c.arch == "gemma2":
        out_w = w["token_embd.weight"]  # gemma2 always ties (an output.weight would fail the load)
    logits = x @ out_w.T
    if "output.bias" in w and c.arch in ("qwen2", "phi3"):
        logits = logits + w["output.bias"]
    if c.final_softcap:
        logits = c.final_softcap * np.tanh(logits / c.final_softcap)
    return logits / c.logit_scale


def swiglu_oai(gate: np.ndarray, up: np.ndarray, alpha: float = 1.702, limit: float = 7.0) -> np.ndarray:
    """gpt-oss's SwiGLU (ggml's swiglu_oai): the gate clamped above at limit, the up both ways, x * sigmoid(alpha x)
    times (up + 1)."""
    x = np.minimum(gate, limit)
    return x / (1.0 + np.exp(-alpha * x)) * (np.clip(up, -limit, limit) + 1.0)


def moe_ffn(h: np.ndarray, w: dict, p: str, c: Config) -> np.ndarray:
    """Routed experts token by token (llama.cpp's build_moe_ffn, softmax gating): the top
    expert_used_count probabilities, divided by their sum except in qwen2moe (norm_w false there),
    SwiGLU experts, weighted sum; qwen2moe adds its shared expert times sigmoid(gate . h). gpt-oss
    (SOFTMAX_WEIGHT gating): the top expert_used_count of the biased router logits, weighted by the softmax
    of those logits alone, biased experts with swiglu_oai."""
    if c.arch == "gpt-oss":
        return _moe_ffn_gpt_oss(h, w, p, c)
    probs = softmax(h @ w[p + "ffn_gate_inp.weight"].T, axis=-1)  # (T, E)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        chosen = np.argsort(-probs[t], kind="stable")[: c.n_expert_used]
        weights = probs[t, chosen]
        if c.arch != "qwen2moe":
            weights = weights / max(weights.sum(), 6.103515625e-5)
        for e, weight in zip(chosen, weights, strict=True):
            hidden = silu(w[p + "ffn_gate_exps.weight"][e] @ h[t]) * (w[p + "ffn_up_exps.weight"][e] @ h[t])
            out[t] += weight * (w[p + "ffn_down_exps.weight"][e] @ hidden)
    if c.arch in ("qwen2moe", "qwen35moe"):  # qwen35moe.cpp: the shared expert as Qwen3Next's
        shared = (silu(h @ w[p + "ffn_gate_shexp.weight"].T) * (h @ w[p + "ffn_up_shexp.weight"].T))
        gate = 1.0 / (1.0 + np.exp(-(h @ w[p + "ffn_gate_inp_shexp.weight"])))
        out += (shared @ w[p + "ffn_down_shexp.weight"].T) * gate[:, None]
    return out


def _moe_ffn_gpt_oss(h: np.ndarray, w: dict, p: str, c: Config) -> np.ndarray:
    logits = h @ w[p + "ffn_gate_inp.weight"].T + w[p + "ffn_gate_inp.bias"]  # (T, E)
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        chosen = np.argsort(-logits[t], kind="stable")[: c.n_expert_used]
        weights = softmax(logits[t, chosen])
        for e, weight in zip(chosen, weights, strict=True):
            gate = w[p + "ffn_gate_exps.weight"][e] @ h[t] + w[p + "ffn_gate_exps.bias"][e]
            up = w[p + "ffn_up_exps.weight"][e] @ h[t] + w[p + "ffn_up_exps.bias"][e]
            down = w[p + "ffn_down_exps.weight"][e] @ swiglu_oai(gate, up) + w[p + "ffn_down_exps.bias"][e]
            out[t] += weight * down
    return out


def dense_ffn(h: np.ndarray, w: dict, p: str, c: Config, gelu_mode: str) -> np.ndarray:
    """A gated FFN of gate, up and down (SwiGLU)."""
    return (silu(h @ w[p + "ffn_gate.weight"].T) * (h @ w[p + "ffn_up.weight"].T)) @ w[p + "ffn_down.weight"].T


def imrope_text_pairs(sections: tuple[int, ...], n_rot: int) -> np.ndarray:
    """Per rotated pair, whether ggml's interleaved multi-section rope (IMROPE) turns it by a text token's position:
    pair i of sector s = i mod sum(sections) takes the t/h/w position when s mod 3 is 0/1/2 and s < 3 x that
    section; the other pairs take the 4th position, which llama.cpp sets to 0 for text."""
    total = sum(sections)
    out = np.zeros(n_rot // 2, dtype=bool)
    for i in range(n_rot // 2):
        sector = i % total
        out[i] = (sector % 3 == 0 and sector < 3 * sections[0]) or (sector % 3 == 1 and sector < 3 * sections[1]) \
            or (sector % 3 == 2 and sector < 3 * sections[2])
    return out


def gated_delta_net(h: np.ndarray, w: dict, p: str, c: Config) -> np.ndarray:
    """qwen35's linear-attention layer token by token in float64 (llama.cpp's build_layer_attn_linear with
    build_delta_net_autoregressive at each step): fused q|k|v, causal depthwise convolution, SiLU, L2 norms, the
    gated delta rule over a state per value head, gated RMS norm, output projection."""
    T = h.shape[0]
    Hk, Hv, D = c.ssm_k_heads, c.ssm_v_heads, c.ssm_state
    mixed = h @ w[p + "attn_qkv.weight"].T  # (T, channels)
    z = h @ w[p + "attn_gate.weight"].T
    beta = 1.0 / (1.0 + np.exp(-(h @ w[p + "ssm_beta.weight"].T)))  # (T, Hv)
    alpha = h @ w[p + "ssm_alpha.weight"].T + w[p + "ssm_dt.bias"]
    g = np.log1p(np.exp(alpha)) * w[p + "ssm_a"]  # softplus times the (negative) rate
    kernel = w[p + "ssm_conv1d.weight"]  # (channels, K)
    K = kernel.shape[1]
    padded = np.concatenate([np.zeros((K - 1, mixed.shape[1])), mixed])
    conv = np.stack([sum(padded[t + j] * kernel[:, j] for j in range(K)) for t in range(T)])
    conv = silu(conv)
    q = conv[:, :Hk * D].reshape(T, Hk, D)
    k = conv[:, Hk * D:2 * Hk * D].reshape(T, Hk, D)
    v = conv[:, 2 * Hk * D:].reshape(T, Hv, D)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + c.rms_eps) / math.sqrt(D)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + c.rms_eps)
    state = np.zeros((Hv, D, D))  # per value head: key dim x value dim
    out = np.zeros((T, Hv, D))
    for t in range(T):
        for hv in range(Hv):
            hk = hv % Hk  # ggml's broadcast: value head hv reads key head hv mod Hk
            s = state[hv] * np.exp(g[t, hv])
            u = beta[t, hv] * (v[t, hv] - s.T @ k[t, hk])
            s = s + np.outer(k[t, hk], u)
            state[hv] = s
            out[t, hv] = s.T @ q[t, hk]
    o = rms_norm(out, w[p + "ssm_norm.weight"], c.rms_eps) * silu(z.reshape(T, Hv, D))
    return o.reshape(T, Hv * D) @ w[p + "ssm_out.weight"].T


def gemma4_forward(model: Model, tokens: list[int], gelu_mode: str) -> np.ndarray:
    """gemma4 as src/models/gemma4.cpp computes it: per-layer head sizes and KV heads, q/k norms and a gain-free V
    norm, q.k scaled by 1, global layers turning with rope_freqs as divisors, the last shared_kv_layers reading the
    K/V of layer n_kv - 2 (sliding) or n_kv - 1 (global), GeGLU MLP and, in MoE layers, experts beside it, the
    per-layer embeddings gated in after the FFN, the layer output scale, the final soft-cap."""
    c, w = model.config, model.w
    T = len(tokens)
    ids = np.asarray(tokens)
    x = w["token_embd.weight"][ids] * np.float32(math.sqrt(c.n_embd))
    L, P = c.n_layer, c.n_embd_per_layer
    per_layer = None
    if P:
        rows = w["per_layer_token_embd.weight"][ids].reshape(T, L, P) * math.sqrt(P)
        proj = (x @ w["per_layer_model_proj.weight"].T / math.sqrt(c.n_embd)).reshape(T, L, P)
        per_layer = (rms_norm(proj, w["per_layer_proj_norm.weight"], c.rms_eps) + rows) / math.sqrt(2.0)
    pos = np.arange(T)
    causal = pos[None, :] <= pos[:, None]
    n_kv = L - c.n_kv_shared
    kv_of: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for il in range(L):
        p = f"blk.{il}."
        swa = c.is_swa[il]
        D = c.head_dim_swa if swa else c.head_dim_k
        n_rot = c.n_rot_swa if swa else c.n_rot
        Hkv = c.n_head_kv_layers[il]
        if swa:
            cos, sin = rope_cos_sin(T, n_rot, c.rope_freq_base_swa, 1.0, None, 1.0)
        else:
            cos, sin = rope_cos_sin(T, n_rot, c.rope_freq_base, c.rope_freq_scale, w["rope_freqs.weight"], 1.0)
        h = rms_norm(x, w[p + "attn_norm.weight"], c.rms_eps)
        q = rms_norm((h @ w[p + "attn_q.weight"].T).reshape(T, c.n_head, D), w[p + "attn_q_norm.weight"], c.rms_eps)
        q = apply_rope(q, cos, sin, n_rot, True)
        if il < n_kv:
            k = h @ w[p + "attn_k.weight"].T
            v = h @ w[p + "attn_v.weight"].T if p + "attn_v.weight" in w else k
            k = apply_rope(rms_norm(k.reshape(T, Hkv, D), w[p + "attn_k_norm.weight"], c.rms_eps), cos, sin, n_rot,
                           True)
            v = rms_norm(v.reshape(T, Hkv, D), None, c.rms_eps)
            kv_of[il] = (k, v)
        else:
            k, v = kv_of[n_kv - (2 if swa else 1)]
        group = c.n_head // k.shape[1]
        scores = np.einsum("ihd,jhd->hij", q, np.repeat(k, group, axis=1))
        allowed = causal & ((pos[:, None] - pos[None, :] < c.n_swa) if swa else True)
        probs = softmax(scores + np.where(allowed, 0.0, -np.inf)[None], axis=-1)
        att = np.einsum("hij,jhd->ihd", probs, np.repeat(v, group, axis=1)).reshape(T, c.n_head * D)
        att = rms_norm(att @ w[p + "attn_output.weight"].T, w[p + "post_attention_norm.weight"], c.rms_eps)
        attn_out = x + att
        h = rms_norm(attn_out, w[p + "ffn_norm.weight"], c.rms_eps)
        f = (gelu(h @ w[p + "ffn_gate.weight"].T, gelu_mode) * (h @ w[p + "ffn_up.weight"].T)) \
            @ w[p + "ffn_down.weight"].T
        if p + "ffn_gate_inp.weight" in w:
            f = rms_norm(f, w[p + "post_ffw_norm_1.weight"], c.rms_eps)
            f = f + rms_norm(_gemma4_experts(attn_out, w, p, c, gelu_mode), w[p + "post_ffw_norm_2.weight"],
                             c.rms_eps)
        x = attn_out + rms_norm(f, w[p + "post_ffw_norm.weight"], c.rms_eps)
        if per_layer is not None:
            g = gelu(x @ w[p + "inp_gate.weight"].T, gelu_mode) * per_layer[:, il]
            x = x + rms_norm(g @ w[p + "proj.weight"].T, w[p + "post_norm.weight"], c.rms_eps)
        if p + "layer_output_scale.weight" in w:
            x = x * w[p + "layer_output_scale.weight"][0]
    x = rms_norm(x, w["output_norm.weight"], c.rms_eps)
    logits = x @ w.get("output.weight", w["token_embd.weight"]).T
    if c.final_softcap:
        logits = c.final_softcap * np.tanh(logits / c.final_softcap)
    return logits


def _gemma4_experts(residual: np.ndarray, w: dict, p: str, c: Config, gelu_mode: str) -> np.ndarray:
    """gemma4's routed experts: the router reads rms_norm(residual) / sqrt(n_embd) * ffn_gate_inp.scale; softmax,
    top k, renormalized; each expert GeGLU over pre_ffw_norm_2(residual), its down product times its scale."""
    h = rms_norm(residual, w[p + "pre_ffw_norm_2.weight"], c.rms_eps)
    router_in = rms_norm(residual, None, c.rms_eps) / math.sqrt(c.n_embd) * w[p + "ffn_gate_inp.scale"]
    probs = softmax(router_in @ w[p + "ffn_gate_inp.weight"].T, axis=-1)
    gate_up = w[p + "ffn_gate_up_exps.weight"]
    ff = gate_up.shape[1] // 2
    scales = w.get(p + "ffn_down_exps.scale")
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        chosen = np.argsort(-probs[t], kind="stable")[: c.n_expert_used]
        weights = probs[t, chosen] / max(probs[t, chosen].sum(), 6.103515625e-5)
        for e, weight in zip(chosen, weights, strict=True):
            y = gate_up[e] @ h[t]
            down = w[p + "ffn_down_exps.weight"][e] @ (gelu(y[:ff], gelu_mode) * y[ff:])
            out[t] += weight * down * (scales[e] if scales is not None else 1.0)
    return out
