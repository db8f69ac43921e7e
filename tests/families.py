"""Random-weight models of every supported family, written with gguf-py around a real vocabulary.

Nothing here uses ggtorch: each file is written by gguf-py's ``GGUFWriter`` with the metadata and
tensors llama.cpp's loader expects for that architecture (src/models/<family>.cpp), so it is an
independent input for comparing ggtorch with llama.cpp. FAMILY_PRESETS holds one model per family and
per quirk worth a test (biases, tied outputs, q/k norms, head size != n_embd / n_head, soft-caps, sliding
windows crossing a 48-token sequence, gemma3's own rope base for local layers, phi3's fused matrices,
partial rope and LongRoPE factors, Llama 3's rope_freqs, YaRN, gpt-oss's attention sinks, biased experts
and clamped SwiGLU, Granite's four multipliers).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

import gguf
import numpy as np

from tests.fixtures import STORIES260K
from tests.llama_cpp_files import vocab_file


@dataclass(frozen=True)
class Shape:
    """Shape and options of a random model. Fields a family does not use are ignored."""

    n_embd: int = 64
    n_ff: int = 160
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int | None = None
    """Written as ``attention.key_length``/``value_length`` when set (None: n_embd // n_head, no key)."""
    n_rot: int | None = None
    """``rope.dimension_count`` (None: head size)."""
    n_ctx: int = 512
    rms_eps: float = 1e-6
    rope_freq_base: float | None = 10000.0
    """None: no ``rope.freq_base`` key (llama.cpp then uses 10000)."""
    tied_output: bool = False
    logit_scale: float = 4.0
    embd_std: float | None = None
    """Standard deviation of token_embd's values (None: 1, or logit_scale / sqrt(n_embd) when tied)."""
    # llama / qwen2 extras
    qkv_bias: bool = False
    output_bias: bool = False
    rope_freqs: bool = False
    """llama: a ``rope_freqs.weight`` (Llama 3.1 style per-pair frequency divisors)."""
    # phi3
    fused_qkv: bool = False
    longrope: bool = False
    """phi3: ``rope_factors_long/short.weight`` and ``rope.scaling.attn_factor``."""
    n_ctx_orig: int | None = None
    """``rope.scaling.original_context_length`` (None: not written)."""
    # gemma
    sliding_window: int | None = None
    """``attention.sliding_window`` (None: key absent)."""
    swa_pattern: int | None = None
    """``attention.sliding_window_pattern`` as a u32 period (None: key absent)."""
    rope_freq_base_swa: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    rope_scaling_linear: float | None = None
    """``rope.scaling.type = linear`` and ``rope.scaling.factor`` (gemma3 4B+ style global layers)."""
    rope_scaling_yarn: float | None = None
    """``rope.scaling.type = yarn`` and ``rope.scaling.factor`` (Qwen's 128k files); the ramp's original
    context is ``n_ctx_orig``."""
    n_expert: int = 0
    """``expert_count`` (0: a dense FFN). Experts get ``expert_used_count`` = n_expert_used."""
    n_expert_used: int = 0
    n_ff_exp: int | None = None
    """``expert_feed_forward_length`` (None: not written; llama.cpp's default then applies)."""
    n_ff_shexp: int | None = None
    """qwen2moe: ``expert_shared_feed_forward_length`` (None: not written, n_ff)."""
    router_gain: float = 2.0
    """Scale of the router's random rows: large enough that, for these presets' tokens, no two experts'
    probabilities are close, so llama.cpp (quantized activations included) routes every token as ggtorch does.
    The gain alone guarantees nothing (rounding moves the logits by a share of the same gain): gpt_oss, whose
    biased experts make larger activations, also needs ``router_dims``."""
    expert_gain: float = 1.0
    """Scale of the experts' gate and up rows."""
    expert_bias: float = 0.3
    """gpt-oss: scale of the experts' gate and up biases."""
    expert_down_gain: float = 0.5
    """Scale of the experts' down rows."""
    router_dims: int = 0
    """gpt-oss: the router reads only the last ``router_dims`` values of the residual stream, which attention and
    experts never write (zero rows and biases there). They hold the token's embedding, which llama.cpp's quantized
    path reads exactly (get_rows), so its activation rounding moves top-k choices only through the norm's common
    scale; a larger router_gain cannot do this, the rounding moves the logits by a share of that same gain
    (0: the router reads everything)."""
    delta_net: tuple[int, int, int, int] = (2, 4, 16, 4)
    """qwen35's Gated DeltaNet layers: (key heads, value heads, head width, convolution taps)."""
    full_attention_interval: int | None = None
    """qwen35: ``full_attention_interval`` (None: key absent, llama.cpp's 4)."""
    rope_sections: tuple[int, ...] = (3, 3, 2, 0)
    """qwen35: ``rope.dimension_sections`` (the released 11 11 10 0 scaled to 8 pairs: every pair turns; 3 3 1 1
    leaves pair 5 at the 4th position, 0 for text)."""
    nextn_layers: int = 0
    """qwen35: next-token-prediction blocks written after the trunk (``nextn_predict_layers``)."""
    extra_kv: dict = field(default_factory=dict)
    """More metadata written as-is (key -> python value; ints become u32, floats f32)."""
    # gemma4
    swa_layers: tuple[bool, ...] = ()
    """gemma4: ``attention.sliding_window_pattern`` as a bool per layer."""
    head_dim_swa: int | None = None
    """gemma4: sliding layers' head size (``attention.key_length_swa``) and rope width (``rope.dimension_count_swa``,
    all of it)."""
    n_head_kv_global: int | None = None
    """gemma4: KV heads of the global layers (``head_count_kv`` written as an array when set)."""
    n_ff_layers: tuple[int, ...] = ()
    """gemma4: ``feed_forward_length`` as an array (the converter's double-wide MLP of K/V-sharing layers)."""
    shared_kv_layers: int = 0
    """gemma4: ``attention.shared_kv_layers``: the last layers read an earlier layer's K/V."""
    n_embd_per_layer: int = 0
    """gemma4: ``embedding_length_per_layer_input`` (0: no per-layer embeddings)."""
    rope_share: float = 1.0
    """gemma4: the share of a global head's pairs that turn ("proportional" rope: ``rope_freqs`` of 1e30 stop the
    others)."""
    k_eq_v: bool = False
    """gemma4: global layers have no ``attn_v`` (V is the K projection)."""


# name -> (GGUF architecture, vocabulary name, Shape)
FAMILY_PRESETS: dict[str, tuple[str, str, Shape]] = {
    # Qwen2/2.5: q/k/v biases, NEOX rope, base 1e6; untied (7B style) and tied (0.5B-3B style). The tied one
    # carries Qwen's own 151k vocabulary, phi3 Phi-3's and the MoE presets llama's 32k one (their router gains are
    # set for its tokens); the others stories260K's 512 tokens (gguf-py and transformers read large ones slowly)
    "qwen2": ("qwen2", "stories", Shape(qkv_bias=True, rope_freq_base=1e6)),
    "qwen2_tied": ("qwen2", "qwen2", Shape(qkv_bias=True, rope_freq_base=1e6, tied_output=True)),
    # Qwen3: q/k RMS norms per head, key_length (32) != n_embd / n_head (16), tied
    "qwen3": ("qwen3", "stories", Shape(head_dim=32, rope_freq_base=1e6, tied_output=True)),
    # Gemma2: explicit small soft-caps so they matter, window 16 < 48 tokens, key_length != n_embd/n_head
    "gemma2": ("gemma2", "stories", Shape(n_layer=4, head_dim=32, n_ff=128, sliding_window=16,
                                            attn_softcap=2.0, final_softcap=10.0)),
    # Gemma2 with every optional key absent: window 4096, caps 50/30, swa rope base = rope base
    "gemma2_defaults": ("gemma2", "stories", Shape(n_layer=2, head_dim=32, n_ff=128, rope_freq_base=None)),
    # Gemma3: 6 layers, default pattern (layers 0-4 local, 5 global), global rope 1e6 with linear
    # scaling 8, local rope base from the struct default 10000 (key absent), no final soft-cap
    "gemma3": ("gemma3", "stories", Shape(n_layer=6, head_dim=32, n_ff=128, sliding_window=16,
                                            rope_freq_base=1e6, rope_scaling_linear=8.0, tied_output=True)),
    # Gemma3 with an explicit pattern 2 (layers 0, 2 local; 1, 3 global), explicit local base,
    # a final soft-cap key, an output.weight (optional for gemma3)
    "gemma3_pattern": ("gemma3", "stories", Shape(n_layer=4, head_dim=32, n_ff=128, sliding_window=16,
                                                    swa_pattern=2, rope_freq_base=1e6, rope_freq_base_swa=5000.0,
                                                    final_softcap=10.0)),
    # Phi3: fused qkv (GQA), fused gate|up, partial rope (16 of 24 dims), LongRoPE factors;
    # original context 4096 >= n_ctx_seq (256) -> short factors; sliding_window key present (ignored)
    "phi3": ("phi3", "phi-3", Shape(n_embd=96, n_ff=128, n_head=4, n_head_kv=2, n_rot=16, fused_qkv=True,
                                    longrope=True, n_ctx=8192, n_ctx_orig=4096, sliding_window=16)),
    # Phi3 whose original context (128) < n_ctx_seq (256): long factors + attn_factor
    "phi3_long": ("phi3", "phi-3", Shape(n_embd=96, n_ff=128, n_head=4, n_head_kv=2, n_rot=16, fused_qkv=True,
                                         longrope=True, n_ctx=4096, n_ctx_orig=128)),
    # Phi3 with separate q/k/v and no rope factors (allowed by the loader), tied output
    "phi3_sep": ("phi3", "phi-3", Shape(n_embd=96, n_ff=128, n_head=4, n_head_kv=4, tied_output=True)),
    # Llama 3.x: rope_freqs, base 500000, BPE vocab; and the tied (3.2 1B/3B) variant
    "llama3_rope_freqs": ("llama", "stories", Shape(rope_freqs=True, rope_freq_base=500000.0, rms_eps=1e-5)),
    "llama3_tied": ("llama", "stories", Shape(rope_freqs=True, rope_freq_base=500000.0, rms_eps=1e-5,
                                              tied_output=True)),
    # YaRN (Qwen's 128k files: factor 4 over an original 32k). An original context of 64 puts the ramp on the
    # pairs that turn within 48 tokens, so the mix of scaled and unscaled angles moves the logits; NEOX and NORM
    "qwen3_yarn": ("qwen3", "stories", Shape(head_dim=32, rope_freq_base=1e6, tied_output=True,
                                             rope_scaling_yarn=4.0, n_ctx_orig=64)),
    "llama_yarn": ("llama", "stories", Shape(rope_scaling_yarn=2.0, n_ctx_orig=100, rms_eps=1e-5)),
    "qwen3moe": ("qwen3moe", "llama-spm", Shape(head_dim=32, n_ff=96, rope_freq_base=1e6, n_expert=8,
                                                n_expert_used=2, n_ff_exp=64)),
    "qwen2moe": ("qwen2moe", "llama-spm", Shape(qkv_bias=True, rope_freq_base=1e6, n_ff=96, n_expert=6,
                                                n_expert_used=2, n_ff_exp=32, n_ff_shexp=64)),
    "llama_moe": ("llama", "llama-spm", Shape(n_ff=64, n_expert=4, n_expert_used=2, rms_eps=1e-5)),
    # Ministral 3 style mistral3: llama's block with YaRN (own betas, log multiplier 0.5 so the magnitude is not 1)
    # and Llama 4's attention temperature over an original context of 16, so it steps at positions 16 and 32
    "mistral3": ("mistral3", "stories", Shape(n_head=4, n_head_kv=1, head_dim=32, rope_freq_base=1e6, rms_eps=1e-5,
                                              rope_scaling_yarn=4.0, n_ctx_orig=16, extra_kv={
                                                  "mistral3.rope.scaling.yarn_beta_fast": 16.0,
                                                  "mistral3.rope.scaling.yarn_beta_slow": 2.0,
                                                  "mistral3.rope.scaling.yarn_log_multiplier": 0.5,
                                                  "mistral3.attention.temperature_scale": 0.1})),
    # SmolLM3: llama's block, tied, without rope in layer 3 (every fourth)
    "smollm3": ("smollm3", "stories", Shape(n_layer=4, n_ff=96, rope_freq_base=5e6, rms_eps=1e-6, tied_output=True)),
    # Mistral-style llama: SPM vocab, GQA 4:1, base 1e6, head_dim 32 != n_embd/n_head (Nemo style)
    "mistral_headdim": ("llama", "stories", Shape(n_head=4, n_head_kv=1, head_dim=32, rope_freq_base=1e6,
                                                  rms_eps=1e-5)),
    # gpt-oss: even layers slide (window 16), attention sinks, q/k/v/output biases, router and expert biases,
    # top-2 of 8 by raw logits, SwiGLU clamped at 7 (large gate/up biases put a real share of values past the clamps
    # without steep rows, which would make quantized runs chaotic), routes that activation rounding cannot flip,
    # YaRN 4 over an original context of 64 (context_length 256, as gpt-oss's 131072 = 32 x 4096) with the beta keys
    # the converter writes (llama.cpp reads none for gpt-oss)
    "gpt_oss": ("gpt-oss", "llama-spm", Shape(n_layer=4, head_dim=32, n_ff=96, qkv_bias=True, rms_eps=1e-5,
                                              n_ctx=256, rope_freq_base=150000.0, rope_scaling_yarn=4.0, n_ctx_orig=64,
                                              sliding_window=16, n_expert=8, n_expert_used=2, n_ff_exp=96,
                                              router_gain=4.0, expert_gain=2.0, expert_bias=5.0,
                                              expert_down_gain=0.1, router_dims=32, extra_kv={
                                                  "gpt-oss.rope.scaling.yarn_beta_fast": 32.0,
                                                  "gpt-oss.rope.scaling.yarn_beta_slow": 1.0})),
    # Granite 3.x (granite): llama's block (NORM rope, untied, GQA) with the converter's four multipliers: embeddings
    # times embedding_scale, attention and FFN outputs times residual_scale before their residual adds, kq scale
    # attention.scale (1/16, not 1/sqrt(16)), logits divided by logit_scale; head_dim is never written. Small
    # embeddings (as muP-trained ones are) so the blocks' scaled outputs move the residual stream; output rows of gain
    # 24 over granite.logit_scale 8 give logits of std ~3
    # Qwen3.5 (qwen35): layers 0-2 Gated DeltaNet (2 key heads, 4 value heads of 16: a value head reads key head
    # h mod 2), layer 3 gated attention with q/k norms, partial multi-section rope (16 of 32 dims), tied like the
    # 0.8B-9B releases, and one MTP block after the trunk that llama.cpp's main graph skips
    "qwen35": ("qwen35", "stories", Shape(n_layer=4, head_dim=32, n_rot=16, rope_freq_base=1e7, tied_output=True,
                                          nextn_layers=1)),
    # Qwen3.5/3.6-35B-A3B style (qwen35moe): the same hybrid with top-2 of 8 routed experts (normalized weights)
    # and a sigmoid-gated shared expert in every layer, llama's 32k vocabulary; rope sections that leave one pair
    # unturned; as gpt_oss, a router that reads only dims no layer writes (quantization's rounding, amplified by the
    # DeltaNet layers' norms, would flip its top-2 otherwise)
    "qwen35moe": ("qwen35moe", "llama-spm", Shape(n_layer=4, head_dim=32, n_rot=16, rope_freq_base=1e7, n_ff=96,
                                                n_expert=8, n_expert_used=2, n_ff_exp=64, n_ff_shexp=64,
                                                rope_sections=(3, 3, 1, 1), router_gain=4.0, router_dims=32)),
    # Gemma 4 E2B style (gemma4): layers 0-2 and 4 slide (window 16, heads of 16, base 10000), 3 and 5 are global
    # (heads of 32, one KV head, base 1e6, a quarter of the pairs turning); layers 4 and 5 compute no K/V and read
    # those of layers 2 and 3, with twice the FFN width; per-layer embeddings of 8; a layer output scale; the final
    # soft-cap; tied
    "gemma4": ("gemma4", "stories", Shape(n_layer=6, head_dim=32, n_ff=128, rope_freq_base=1e6, tied_output=True,
                                          sliding_window=16, swa_layers=(True, True, True, False, True, False),
                                          head_dim_swa=16, n_head_kv_global=1, n_ff_layers=(128,) * 4 + (256,) * 2,
                                          shared_kv_layers=2, n_embd_per_layer=8, rope_share=0.25,
                                          final_softcap=30.0, logit_scale=2.0)),
    # Gemma 4 26B-A4B style: every layer's dense MLP beside top-2 of 8 GeGLU experts (fused gate|up stacks, a scale per
    # expert), global layers without attn_v; a router that reads only dims no layer writes (as gpt_oss), of gain 32
    # (gemma4's router reads the residual RMS-normed and divided by sqrt(n_embd): a smaller gain routes on near-ties)
    "gemma4moe": ("gemma4", "stories", Shape(n_layer=4, head_dim=32, n_ff=64, rope_freq_base=1e6, tied_output=True,
                                             sliding_window=16, swa_layers=(True, False, True, False), head_dim_swa=16,
                                             n_head_kv_global=1, rope_share=0.25, k_eq_v=True, n_expert=8,
                                             n_expert_used=2, n_ff_exp=32, router_gain=32.0, router_dims=16,
                                             final_softcap=30.0)),
    "granite": ("granite", "stories", Shape(rms_eps=1e-5, logit_scale=24.0, embd_std=0.1, extra_kv={
        "granite.embedding_scale": 12.0, "granite.residual_scale": 0.22, "granite.attention.scale": 0.0625,
        "granite.logit_scale": 8.0})),
}


@functools.cache
def gguf_py_reader(path: Path) -> gguf.GGUFReader:
    """gguf-py's reader of a vocabulary or fixture file the tests do not change, once per session: it takes seconds
    on a 150k-token vocabulary, which both the presets and the reader tests (tests/io/test_gguf_hostile.py) need."""
    return gguf.GGUFReader(str(path))


def _vocab_keys(vocab_gguf: Path) -> list[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """(key, value, type, array element type) of every tokenizer.* key of a vocabulary GGUF."""
    r = gguf_py_reader(Path(vocab_gguf))
    out = []
    for key, f in r.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        out.append((key, f.contents(), vtype, sub))
    return out


def _add(w: gguf.GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        w.add_array(key, list(value))
    else:
        raise TypeError(f"{key}: {value!r}")


def llama3_rope_factors(head_dim: int, base: float, factor: float = 8.0, low: float = 1.0, high: float = 4.0,
                        old_ctx: int = 64) -> np.ndarray:
    """The converter's llama3 rope_freqs formula (conversion/llama.py), with a tiny old context so
    the tiny model's few frequencies fall in all three bands."""
    freqs = 1.0 / (base ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    lo_wl, hi_wl = old_ctx / low, old_ctx / high
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < hi_wl:
            out.append(1.0)
        elif wl > lo_wl:
            out.append(factor)
        else:
            s = (old_ctx / wl - low) / (high - low)
            out.append(1 / ((1 - s) / factor + s))
    return np.array(out, dtype=np.float32)


def write_random_model(path: str | Path, arch: str, vocab_gguf: str | Path, shape: Shape | None = None,
                       seed: int = 0) -> Path:
    """Write an F32 GGUF of ``arch`` (llama, qwen2, qwen2moe, qwen3, qwen3moe, gemma2, gemma3, phi3, gpt-oss, ...)
    with random weights and ``vocab_gguf``'s tokenizer. Returns the path."""
    s = shape or Shape()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    vkeys = _vocab_keys(Path(vocab_gguf))
    n_vocab = len(next(v for k, v, _, _ in vkeys if k == "tokenizer.ggml.tokens"))
    hd = s.head_dim or s.n_embd // s.n_head
    n_rot = s.n_rot or hd
    nq, nkv = s.n_head * hd, s.n_head_kv * hd
    rng = np.random.default_rng(seed)

    def lin(n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) * (gain / math.sqrt(n_in))).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def vec(n: int, scale: float) -> np.ndarray:
        return (scale * rng.standard_normal(n)).astype(np.float32)

    w = gguf.GGUFWriter(str(path), arch)
    a = arch
    w.add_string("general.name", f"tiny-random-{arch}")
    w.add_uint32("general.file_type", 0)
    w.add_uint32(f"{a}.context_length", s.n_ctx)
    w.add_uint32(f"{a}.embedding_length", s.n_embd)
    if not s.n_ff_layers:
        w.add_uint32(f"{a}.feed_forward_length", s.n_ff)
    w.add_uint32(f"{a}.block_count", s.n_layer + s.nextn_layers)
    w.add_uint32(f"{a}.attention.head_count", s.n_head)
    if s.n_head_kv_global is None:
        w.add_uint32(f"{a}.attention.head_count_kv", s.n_head_kv)
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", s.rms_eps)
    if s.head_dim is not None:
        w.add_uint32(f"{a}.attention.key_length", hd)
        w.add_uint32(f"{a}.attention.value_length", hd)
    if s.n_rot is not None or arch in ("llama", "mistral3", "smollm3", "granite", "phi3"):
        w.add_uint32(f"{a}.rope.dimension_count", n_rot)
    if s.rope_freq_base is not None:
        w.add_float32(f"{a}.rope.freq_base", s.rope_freq_base)
    if arch in ("llama", "mistral3", "smollm3", "granite"):  # LlamaModel's converter (ggtorch reads it for llama)
        w.add_uint32(f"{a}.vocab_size", n_vocab)
    if s.n_ctx_orig is not None:
        w.add_uint32(f"{a}.rope.scaling.original_context_length", s.n_ctx_orig)
    if s.sliding_window is not None:
        w.add_uint32(f"{a}.attention.sliding_window", s.sliding_window)
    if s.swa_pattern is not None:
        w.add_uint32(f"{a}.attention.sliding_window_pattern", s.swa_pattern)
    if s.rope_freq_base_swa is not None:
        w.add_float32(f"{a}.rope.freq_base_swa", s.rope_freq_base_swa)
    if s.attn_softcap is not None:
        w.add_float32(f"{a}.attn_logit_softcapping", s.attn_softcap)
    if s.final_softcap is not None:
        w.add_float32(f"{a}.final_logit_softcapping", s.final_softcap)
    if s.rope_scaling_linear is not None:
        w.add_string(f"{a}.rope.scaling.type", "linear")
        w.add_float32(f"{a}.rope.scaling.factor", s.rope_scaling_linear)
    if s.rope_scaling_yarn is not None:
        w.add_string(f"{a}.rope.scaling.type", "yarn")
        w.add_float32(f"{a}.rope.scaling.factor", s.rope_scaling_yarn)
    if s.n_expert:
        w.add_uint32(f"{a}.expert_count", s.n_expert)
        w.add_uint32(f"{a}.expert_used_count", s.n_expert_used)
        if s.n_ff_exp is not None:
            w.add_uint32(f"{a}.expert_feed_forward_length", s.n_ff_exp)
        if s.n_ff_shexp is not None:
            w.add_uint32(f"{a}.expert_shared_feed_forward_length", s.n_ff_shexp)
    longrope_attn = None
    if arch == "phi3" and s.longrope:
        scale = s.n_ctx / s.n_ctx_orig
        longrope_attn = math.sqrt(1 + math.log(scale) / math.log(s.n_ctx_orig)) if scale > 1.0 else 1.0
        w.add_float32(f"{a}.rope.scaling.attn_factor", longrope_attn)
    if arch in ("qwen35", "qwen35moe"):
        hk, hv, dd, taps = s.delta_net
        w.add_uint32(f"{a}.ssm.conv_kernel", taps)
        w.add_uint32(f"{a}.ssm.state_size", dd)
        w.add_uint32(f"{a}.ssm.group_count", hk)
        w.add_uint32(f"{a}.ssm.time_step_rank", hv)
        w.add_uint32(f"{a}.ssm.inner_size", hv * dd)
        w.add_array(f"{a}.rope.dimension_sections", list(s.rope_sections))
        if s.full_attention_interval is not None:
            w.add_uint32(f"{a}.full_attention_interval", s.full_attention_interval)
        if s.nextn_layers:
            w.add_uint32(f"{a}.nextn_predict_layers", s.nextn_layers)
    if arch == "gemma4":
        _gemma4_keys(w, s)
    for k, v in s.extra_kv.items():
        _add(w, k, v)
    for key, value, vtype, sub in vkeys:
        w.add_key_value(key, value, vtype, sub)

    t: dict[str, np.ndarray] = {}
    emb_std = s.embd_std or (1.0 if not s.tied_output else s.logit_scale / math.sqrt(s.n_embd))
    t["token_embd.weight"] = (emb_std * rng.standard_normal((n_vocab, s.n_embd))).astype(np.float32)
    t["output_norm.weight"] = norm(s.n_embd)
    if not s.tied_output and arch != "gemma2":  # gemma2 never reads output.weight (an extra tensor fails the load)
        t["output.weight"] = lin(n_vocab, s.n_embd, s.logit_scale)
    if s.output_bias:
        t["output.bias"] = vec(n_vocab, 0.5)
    if s.rope_freqs:
        t["rope_freqs.weight"] = llama3_rope_factors(n_rot, s.rope_freq_base or 10000.0)
    if arch == "phi3" and s.longrope:
        t["rope_factors_long.weight"] = rng.uniform(1.0, 4.0, n_rot // 2).astype(np.float32)
        t["rope_factors_short.weight"] = rng.uniform(1.0, 1.5, n_rot // 2).astype(np.float32)

    gemma = arch in ("gemma2", "gemma3")
    interval = s.full_attention_interval or 4
    if arch == "gemma4":
        t |= _random_gemma4(s, n_vocab, lin, norm, vec, rng)
    for i in range(0 if arch == "gemma4" else s.n_layer + s.nextn_layers):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = norm(s.n_embd)
        if arch in ("qwen35", "qwen35moe"):
            if i < s.n_layer and (i + 1) % interval:
                t |= _random_delta_net(p, s, lin, norm, vec, rng) | _random_ffn(p, arch, s, lin, vec)
            else:
                t |= _random_gated_attention(p, s, hd, lin, norm) | _random_ffn(p, arch, s, lin, vec)
            for name in ("ssm_out.weight", "attn_output.weight", "ffn_down_shexp.weight"):
                if s.router_dims and p + name in t:  # the router's dims stay the token's embedding
                    t[p + name][-s.router_dims:] = 0.0
            if i >= s.n_layer:  # an MTP block: a full-attention block plus the NextN tensors
                t[p + "nextn.eh_proj.weight"] = lin(s.n_embd, 2 * s.n_embd)
                t[p + "nextn.enorm.weight"] = norm(s.n_embd)
                t[p + "nextn.hnorm.weight"] = norm(s.n_embd)
            continue
        if s.fused_qkv:
            t[p + "attn_qkv.weight"] = np.concatenate([lin(nq, s.n_embd), lin(nkv, s.n_embd), lin(nkv, s.n_embd)])
        else:
            t[p + "attn_q.weight"] = lin(nq, s.n_embd)
            t[p + "attn_k.weight"] = lin(nkv, s.n_embd)
            t[p + "attn_v.weight"] = lin(nkv, s.n_embd)
        if s.qkv_bias:
            t[p + "attn_q.bias"] = vec(nq, 0.3)
            t[p + "attn_k.bias"] = vec(nkv, 0.3)
            t[p + "attn_v.bias"] = vec(nkv, 0.3)
        if arch in ("qwen3", "qwen3moe", "gemma3"):
            t[p + "attn_q_norm.weight"] = norm(hd)
            t[p + "attn_k_norm.weight"] = norm(hd)
        t[p + "attn_output.weight"] = lin(s.n_embd, nq, 0.5)
        if arch == "gpt-oss":
            t[p + "attn_output.bias"] = vec(s.n_embd, 0.3)
            t[p + "attn_sinks.weight"] = vec(s.n_head, 1.0)
        if s.router_dims:
            for name in ("attn_output.weight", "attn_output.bias"):
                t[p + name][-s.router_dims:] = 0.0
        if gemma:
            t[p + "post_attention_norm.weight"] = norm(s.n_embd)
        # gpt-oss's FFN norm is named post_attention_norm (llama.cpp's ATTN_POST_NORM); it has no ffn_norm
        t[p + ("post_attention_norm.weight" if arch == "gpt-oss" else "ffn_norm.weight")] = norm(s.n_embd)
        if s.n_expert:
            t |= _random_experts(p, arch, s, lin, vec)
        elif arch == "phi3":
            t[p + "ffn_up.weight"] = np.concatenate([lin(s.n_ff, s.n_embd), lin(s.n_ff, s.n_embd)])  # gate | up
            t[p + "ffn_down.weight"] = lin(s.n_embd, s.n_ff, 0.5)
        else:
            t[p + "ffn_gate.weight"] = lin(s.n_ff, s.n_embd)
            t[p + "ffn_up.weight"] = lin(s.n_ff, s.n_embd)
            t[p + "ffn_down.weight"] = lin(s.n_embd, s.n_ff, 0.5)
        if gemma:
            t[p + "post_ffw_norm.weight"] = norm(s.n_embd)

    for name, arr in t.items():
        w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path




def _gemma4_keys(w: gguf.GGUFWriter, s: Shape) -> None:
    """The keys llama_model_gemma4::load_arch_hparams reads beyond gemma3's, as the converter writes them."""
    a = "gemma4"
    w.add_array(f"{a}.attention.sliding_window_pattern", list(s.swa_layers))
    if s.n_head_kv_global is not None:
        w.add_array(f"{a}.attention.head_count_kv",
                    [s.n_head_kv if swa else s.n_head_kv_global for swa in s.swa_layers])
    if s.n_ff_layers:
        w.add_array(f"{a}.feed_forward_length", list(s.n_ff_layers))
    hd_swa = s.head_dim_swa or s.head_dim
    w.add_uint32(f"{a}.attention.key_length_swa", hd_swa)
    w.add_uint32(f"{a}.attention.value_length_swa", hd_swa)
    w.add_uint32(f"{a}.rope.dimension_count_swa", hd_swa)
    w.add_float32(f"{a}.rope.freq_base_swa", 10000.0)
    w.add_uint32(f"{a}.attention.shared_kv_layers", s.shared_kv_layers)
    w.add_uint32(f"{a}.embedding_length_per_layer_input", s.n_embd_per_layer)


def _random_gemma4(s: Shape, n_vocab: int, lin, norm, vec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A gemma4 model's tensors but token_embd and output_norm (llama_model_gemma4::load_arch_tensors): per-layer head
    sizes and KV heads, no K/V in the sharing layers, no attn_v in global layers with ``k_eq_v``, rope_freqs that stop
    all but ``rope_share`` of a global head's pairs, per-layer embeddings, a layer output scale, and in a MoE the
    dense MLP beside the experts with their norms, router scale and per-expert scales. gemma4 scales q·k by 1, so the
    q and k norms' gains carry the 1/sqrt(head size) (D^-1/4 each, as trained models learn them): with unit gains the
    softmax is so peaked that quantization's rounding moves either program's logits by units."""
    hd_full, hd_swa = s.head_dim or s.n_embd // s.n_head, s.head_dim_swa or s.head_dim
    n_turn = int(hd_full // 2 * s.rope_share)
    t = {"rope_freqs.weight": np.array([1.0] * n_turn + [1e30] * (hd_full // 2 - n_turn), dtype=np.float32)}
    n_pl = s.n_embd_per_layer
    if n_pl:
        t["per_layer_token_embd.weight"] = vec(n_vocab * s.n_layer * n_pl, 1.0).reshape(n_vocab, s.n_layer * n_pl)
        t["per_layer_model_proj.weight"] = lin(s.n_layer * n_pl, s.n_embd)
        t["per_layer_proj_norm.weight"] = norm(n_pl)
    n_kv = s.n_layer - s.shared_kv_layers
    written = []  # (tensor, rows) the router must not see
    for i, swa in enumerate(s.swa_layers):
        p = f"blk.{i}."
        hd = hd_swa if swa else hd_full
        kv_heads = s.n_head_kv if swa or s.n_head_kv_global is None else s.n_head_kv_global
        n_ff = s.n_ff_layers[i] if s.n_ff_layers else s.n_ff
        t |= {p + "attn_norm.weight": norm(s.n_embd), p + "attn_q.weight": lin(s.n_head * hd, s.n_embd),
              p + "attn_q_norm.weight": norm(hd) * hd ** -0.25,
              p + "attn_output.weight": lin(s.n_embd, s.n_head * hd, 0.5),
              p + "post_attention_norm.weight": norm(s.n_embd), p + "ffn_norm.weight": norm(s.n_embd),
              p + "ffn_gate.weight": lin(n_ff, s.n_embd), p + "ffn_up.weight": lin(n_ff, s.n_embd),
              p + "ffn_down.weight": lin(s.n_embd, n_ff, 0.5), p + "post_ffw_norm.weight": norm(s.n_embd),
              p + "layer_output_scale.weight": rng.uniform(0.5, 1.0, 1).astype(np.float32)}
        written += [p + "attn_output.weight", p + "ffn_down.weight"]
        if i < n_kv:
            t[p + "attn_k.weight"] = lin(kv_heads * hd, s.n_embd)
            t[p + "attn_k_norm.weight"] = norm(hd) * hd ** -0.25
            if swa or not s.k_eq_v:
                t[p + "attn_v.weight"] = lin(kv_heads * hd, s.n_embd)
        if n_pl:
            t |= {p + "inp_gate.weight": lin(n_pl, s.n_embd, 0.2), p + "proj.weight": lin(s.n_embd, n_pl, 0.5),
                  p + "post_norm.weight": norm(s.n_embd)}
            written.append(p + "proj.weight")
        if s.n_expert:
            ff = s.n_ff_exp or s.n_ff
            t |= {p + "ffn_gate_inp.weight": lin(s.n_expert, s.n_embd, s.router_gain),
                  p + "ffn_gate_inp.scale": norm(s.n_embd),
                  p + "ffn_gate_up_exps.weight": np.stack([lin(2 * ff, s.n_embd, s.expert_gain)
                                                           for _ in range(s.n_expert)]),
                  p + "ffn_down_exps.weight": np.stack([lin(s.n_embd, ff, s.expert_down_gain)
                                                        for _ in range(s.n_expert)]),
                  p + "ffn_down_exps.scale": rng.uniform(0.5, 1.5, s.n_expert).astype(np.float32),
                  p + "pre_ffw_norm_2.weight": norm(s.n_embd), p + "post_ffw_norm_1.weight": norm(s.n_embd),
                  p + "post_ffw_norm_2.weight": norm(s.n_embd)}
            written.append(p + "ffn_down_exps.weight")
            if s.router_dims:
                t[p + "ffn_gate_inp.weight"][:, :-s.router_dims] = 0.0
    if s.router_dims:  # the router's dims stay the token's embedding (norms and scales keep zeros zero)
        for name in written:
            t[name][..., -s.router_dims:, :] = 0.0
    return t


def _random_ffn(p: str, arch: str, s: Shape, lin, vec) -> dict[str, np.ndarray]:
    """A layer's FFN: routed experts when the shape has some, else gate, up and down."""
    if s.n_expert:
        return _random_experts(p, arch, s, lin, vec)
    return {p + "ffn_gate.weight": lin(s.n_ff, s.n_embd), p + "ffn_up.weight": lin(s.n_ff, s.n_embd),
            p + "ffn_down.weight": lin(s.n_embd, s.n_ff, 0.5)}


def _random_delta_net(p: str, s: Shape, lin, norm, vec, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A qwen35 Gated DeltaNet layer (llama_model_qwen35::load_arch_tensors), its FFN norm named post_attention_norm.
    Decay rates a = -exp(A_log) with A_log in [-1, 1] and dt biases around 0 make states that forget over a few
    to a few dozen tokens, so 48 tokens cross several chunks of the chunked rule with a state that matters. Key rows
    lie near their query rows (as trained models' do, roughly): with independent ones, a token's read of its own
    write, (k.q) v, has a q.k near 0 often enough that quantization's rounding flips its sign, which the per-head
    norm after the rule turns into a unit-sized change, and a quantized file's logits would be noise."""
    hk, hv, dd, taps = s.delta_net
    channels = 2 * hk * dd + hv * dd
    qkv = lin(channels, s.n_embd)
    keys = hk * dd
    conv = (rng.standard_normal((channels, taps)) / math.sqrt(taps)).astype(np.float32)
    for w in (qkv, conv):  # each key channel near its query channel, in the projection and the convolution
        w[keys:2 * keys] = 0.95 * w[:keys] + 0.3 * w[keys:2 * keys]
    return {p + "attn_qkv.weight": qkv, p + "attn_gate.weight": lin(hv * dd, s.n_embd),
            p + "ssm_conv1d.weight": conv,
            p + "ssm_dt.bias": vec(hv, 0.5), p + "ssm_a": -np.exp(rng.uniform(-1, 1, hv)).astype(np.float32),
            p + "ssm_beta.weight": lin(hv, s.n_embd, 0.3), p + "ssm_alpha.weight": lin(hv, s.n_embd, 0.3),
            p + "ssm_norm.weight": norm(dd), p + "ssm_out.weight": lin(s.n_embd, hv * dd, 0.3),
            p + "post_attention_norm.weight": norm(s.n_embd)}


def _random_gated_attention(p: str, s: Shape, hd: int, lin, norm) -> dict[str, np.ndarray]:
    """A qwen35 full-attention layer: attn_q twice as wide (per head the query, then its gate), q/k norms."""
    nq, nkv = s.n_head * hd, s.n_head_kv * hd
    return {p + "attn_q.weight": lin(2 * nq, s.n_embd), p + "attn_k.weight": lin(nkv, s.n_embd),
            p + "attn_v.weight": lin(nkv, s.n_embd), p + "attn_output.weight": lin(s.n_embd, nq, 0.5),
            p + "attn_q_norm.weight": norm(hd), p + "attn_k_norm.weight": norm(hd),
            p + "post_attention_norm.weight": norm(s.n_embd)}


def _random_experts(p: str, arch: str, s: Shape, lin, vec) -> dict[str, np.ndarray]:
    """A MoE layer's tensors: router, expert stacks (llama's experts are n_ff wide, the qwen families'
    and gpt-oss's expert_feed_forward_length, else n_ff / n_expert_used, as llama.cpp reads them), qwen2moe's
    shared expert, gpt-oss's router and per-expert biases ((n_expert, width) in numpy order)."""
    nff = s.n_ff if arch == "llama" else (s.n_ff_exp or s.n_ff // s.n_expert_used)
    t = {p + "ffn_gate_inp.weight": lin(s.n_expert, s.n_embd, s.router_gain),
         p + "ffn_gate_exps.weight": np.stack([lin(nff, s.n_embd, s.expert_gain) for _ in range(s.n_expert)]),
         p + "ffn_up_exps.weight": np.stack([lin(nff, s.n_embd, s.expert_gain) for _ in range(s.n_expert)]),
         p + "ffn_down_exps.weight": np.stack([lin(s.n_embd, nff, s.expert_down_gain) for _ in range(s.n_expert)])}
    if arch == "gpt-oss":
        t |= {p + "ffn_gate_inp.bias": vec(s.n_expert, 0.3),
              p + "ffn_gate_exps.bias": vec(s.n_expert * nff, s.expert_bias).reshape(s.n_expert, nff),
              p + "ffn_up_exps.bias": vec(s.n_expert * nff, s.expert_bias).reshape(s.n_expert, nff),
              p + "ffn_down_exps.bias": vec(s.n_expert * s.n_embd, 0.3).reshape(s.n_expert, s.n_embd)}
    if s.router_dims:
        t[p + "ffn_gate_inp.weight"][:, :-s.router_dims] = 0.0
        t[p + "ffn_down_exps.weight"][:, -s.router_dims:] = 0.0
        if p + "ffn_down_exps.bias" in t:
            t[p + "ffn_down_exps.bias"][:, -s.router_dims:] = 0.0
    if arch in ("qwen2moe", "qwen35moe"):
        nsh = s.n_ff_shexp or s.n_ff
        t |= {p + "ffn_gate_inp_shexp.weight": vec(s.n_embd, 1.0 / math.sqrt(s.n_embd)),
              p + "ffn_gate_shexp.weight": lin(nsh, s.n_embd), p + "ffn_up_shexp.weight": lin(nsh, s.n_embd),
              p + "ffn_down_shexp.weight": lin(s.n_embd, nsh, 0.5)}
    return t


VOCABULARIES = ("qwen2", "phi-3", "llama-spm", "stories")
"""The vocabularies presets use: llama.cpp's vocabulary files (tests/llama_cpp_files.py), and stories260K's (a real
512-token sentencepiece vocabulary, tests/fixtures: the architecture tests need real tokens, not many). Gemma's own
is not among them: its presets use a llama sentencepiece vocabulary."""


def vocabulary_file(name: str) -> Path:
    """The GGUF a vocabulary of :data:`VOCABULARIES` is read from."""
    if name == "stories":
        return STORIES260K
    return vocab_file(name)


def write_preset(name: str, out_dir: Path, seed: int = 0, vocab_gguf: Path | None = None) -> Path:
    """Write FAMILY_PRESETS[name] as ``out_dir/name-f32.gguf`` around its vocabulary (or ``vocab_gguf``'s: a
    machine without llama.cpp's files); ``NAME-wide`` is the preset with rows of 256 values (n_embd and n_ff
    multiples of 256), so that llama.cpp's K-quants quantize its matrices instead of falling back to legacy types."""
    base, _, wide = name.partition("-")
    arch, vocab, shape = FAMILY_PRESETS[base]
    if wide:
        head = 64 if shape.head_dim else None
        shape = replace(shape, n_embd=256, n_ff=512, head_dim=head, n_rot=32 if shape.n_rot else None,
                        n_ff_exp=256 if shape.n_ff_exp else None, n_ff_shexp=256 if shape.n_ff_shexp else None)
        if arch == "gemma4":
            shape = replace(shape, head_dim_swa=32, n_ff_layers=tuple(4 * n for n in shape.n_ff_layers))
        if shape.full_attention_interval is None and arch in ("qwen35", "qwen35moe"):
            # a DeltaNet layer and an attention layer: at these widths K-quants' rounding through four hybrid
            # layers moves the logits past the quantized tolerance in either program, not only between them
            shape = replace(shape, n_layer=2, full_attention_interval=2, nextn_layers=0)
    return write_random_model(out_dir / f"{name}-f32.gguf", arch, vocab_gguf or vocabulary_file(vocab), shape, seed)


def eval_tokens(n_vocab: int, n: int = 48, seed: int = 1234) -> list[int]:
    """Random token ids below n_vocab: what the parity tests evaluate (48 crosses every sliding window)."""
    return [int(x) for x in np.random.default_rng(seed).integers(0, n_vocab, n)]
