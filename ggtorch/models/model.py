"""One transformer in plain torch for every supported family, computing what llama.cpp's graphs compute.

One file, nanoGPT style: RMSNorm, rope, Attention, MLP, MoE, Block, Transformer. What a family changes
(models/families.py) arrives through ModelConfig switches: rope layout and partial rope, q/k norms,
fused q/k/v, biases, post norms, GeGLU, embedding scale, soft-capping, sliding-window layers,
rope factors, YaRN, layers without rope, attention temperature, attention sinks, routed experts (with
biases and OpenAI's clamped SwiGLU for gpt-oss), granite's embedding, residual and logit scales, qwen35's gated
attention and multi-section rope. A hybrid family's recurrent layers hold a Gated DeltaNet (models/delta_net.py)
where the others hold Attention, chosen per layer from the config. Module paths follow
``ggtorch.models.names`` (``layers.{i}.attn.q`` ...), so GGUF tensors map one-to-one onto modules.
Linear layers are ``ggtorch.ops.matmul.Linear`` (an ``nn.Linear``) or, for weights kept in their ggml
blocks, ``ggtorch.quant.modules.QuantLinear``: this file only calls them, and keeps biases as separate
parameters so every Linear is bias-free.

Shapes: B batch, T tokens in this call, S = start_pos + T keys, C n_embd, H query heads,
Hkv key/value heads, D head_dim, R n_rot (rotated dims of a head), F n_ff, V n_vocab.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ggtorch.models.attention import attention, causal_mask, softcap
from ggtorch.models.config import ModelConfig
from ggtorch.models.delta_net import GatedDeltaNet, RecurrentState
from ggtorch.models.norm import RMSNorm
from ggtorch.ops import fused, policy
from ggtorch.ops.experts import Experts
from ggtorch.ops.fused import geglu, rms_norm, swiglu
from ggtorch.ops.matmul import Linear


def rope_angles_at(positions: torch.Tensor, n_rot: int, freq_base: float, freq_scale: float,
                   freq_factors: torch.Tensor | None = None, attn_factor: float = 1.0, *,
                   ext_factor: float = 0.0, n_ctx_orig: int = 0, beta_fast: float = 32.0,
                   beta_slow: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (*positions.shape, n_rot/2) of theta = p * freq_scale * base^(-2i/n_rot) / freq_factors[i],
    for any positions (packed records restart at 0).

    Mirrors ggml_rope_cache_init: the angle is built in f32 by multiplying the position by
    theta_scale = base^(-2/n_rot) once per pair (a running product, not a fresh power), so
    the rounding is ggml's and long positions do not drift from llama.cpp. ``attn_factor`` multiplies
    cos and sin, as ggml's rope_yarn does with its ``mscale`` (LongRoPE). A non-zero ``ext_factor`` is
    ggml's YaRN (rope_yarn; its other parameters as ggml_rope_ext's): along the ramp of
    :func:`yarn_corr_dims` each angle moves from the unscaled one to the scaled one, and the magnitude
    grows by 1 + 0.1 ln(1 / freq_scale).
    """
    theta_scale = _f32(freq_base) ** (_f32(-2.0) / n_rot)
    steps = theta_scale.to(positions.device).expand(*positions.shape, n_rot // 2).clone()
    steps[..., 0] = positions.to(torch.float32)
    theta_extrap = torch.cumprod(steps, dim=-1)  # (..., n_rot/2)
    if freq_factors is not None:
        theta_extrap = theta_extrap / freq_factors.float()
    theta = theta_extrap * freq_scale
    if ext_factor:
        low, high = yarn_corr_dims(n_rot, n_ctx_orig, freq_base, beta_fast, beta_slow)
        pair = torch.arange(n_rot // 2, dtype=torch.float32, device=positions.device)
        ramp_mix = (1 - ((pair - low) / max(0.001, high - low)).clamp(0, 1)) * ext_factor
        theta = theta * (1 - ramp_mix) + theta_extrap * ramp_mix
        mscale = (_f32(attn_factor) * (1 + _f32(0.1) * torch.log(1 / _f32(freq_scale)))).to(positions.device)
        return torch.cos(theta) * mscale, torch.sin(theta) * mscale
    cos, sin = torch.cos(theta), torch.sin(theta)
    if attn_factor != 1.0:
        cos, sin = cos * attn_factor, sin * attn_factor
    return cos, sin


@functools.cache
def rope_section_turns(sections: tuple[int, ...], n_rot: int) -> torch.Tensor:
    """Per rotated pair, whether a text token's position turns it under ggml's interleaved multi-section rope
    (IMROPE, ggml_mrope_cache_init): pair i, in sector i mod sum(sections), takes the time, height or width position
    (all the token's position for text) when sector mod 3 is 0, 1 or 2 and the sector lies below 3 x that section's
    size; otherwise the fourth position, which llama.cpp sets to 0 for text. Made once per layout (a CPU tensor
    nobody writes to), not at every forward."""
    total = sum(sections)
    turns = []
    for pair in range(n_rot // 2):
        sector = pair % total
        kind = sector % 3
        turns.append(sector < 3 * sections[kind])
    return torch.tensor(turns)


def yarn_corr_dims(n_rot: int, n_ctx_orig: int, freq_base: float, beta_fast: float,
                   beta_slow: float) -> tuple[float, float]:
    """The pairs between which YaRN's ramp runs (ggml_rope_yarn_corr_dims, in f32): pair i turns
    n_ctx_orig / (2π base^(2i/n_rot)) times over the original context; pairs turning more than
    ``beta_fast`` times keep their angle, those turning less than ``beta_slow`` times take the scaled one."""
    def pair_turning(turns: float) -> float:
        ratio = _f32(n_ctx_orig) / (_f32(turns) * 2 * _f32(math.pi))
        return float(n_rot * torch.log(ratio) / (2 * torch.log(_f32(freq_base))))

    return max(0.0, math.floor(pair_turning(beta_fast))), min(n_rot - 1.0, math.ceil(pair_turning(beta_slow)))


def yarn_attn_factor(config: ModelConfig) -> float:
    """llama.cpp's ``yarn_attn_factor`` of a YaRN model, in f32 as llama-context.cpp computes it:
    get_mscale(factor, 1) [/ get_mscale(factor, yarn_log_mul)], divided by the 1 + 0.1 ln(factor) ggml's
    rope multiplies in again, times ``rope.scaling.attn_factor``. Without a log multiplier it is 1 up to
    rounding; mistral3's files carry one."""
    factor = 1 / _f32(config.rope_freq_scale)

    def get_mscale(mscale: float) -> torch.Tensor:
        return _f32(0.1) * mscale * torch.log(factor) + 1 if factor > 1 else _f32(1.0)

    magnitude = get_mscale(1.0)
    if config.yarn_log_mul:
        magnitude = magnitude / get_mscale(config.yarn_log_mul)
    magnitude = magnitude * (1 / (1 + _f32(0.1) * torch.log(factor)))
    return float(magnitude * _f32(config.rope_attn_factor))


def attention_temperature(positions: torch.Tensor, beta: float, floor_scale: int) -> torch.Tensor:
    """Llama 4's per-position query scale 1 + beta ln(floor(p / floor_scale) + 1), as llama-graph.cpp's
    llm_graph_input_attn_temp fills it: the floor in f32, the rest in double (f32 on MPS, which has no
    double), stored as f32."""
    wide = policy.current(positions.device).wide_dtype
    steps = torch.floor(positions.to(torch.float32) / floor_scale).to(wide)
    return (torch.log(steps + 1.0) * _f32(beta).to(steps) + 1.0).float()


def _f32(value: float) -> torch.Tensor:
    """A float32 scalar: the angle constants are computed in C's float, not Python's double."""
    return torch.tensor(value, dtype=torch.float32)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool = False) -> torch.Tensor:
    """Rotate the first R = 2·cos.shape[-1] dims of each head by theta_i; the rest pass unchanged.

    ggml's NORM mode rotates adjacent pairs (x[2i], x[2i+1]); NEOX mode pairs x[i] with x[i + R/2].
    x: (B, T, H, D); cos, sin: (T, R/2), or (B, T, R/2) for per-row positions. Computed in f32,
    returned in x's dtype.
    """
    n_rot = 2 * cos.shape[-1]
    if n_rot < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :n_rot], cos, sin, neox), x[..., n_rot:]), dim=-1)
    if fused.rope_takes(x, cos, sin):  # CPU: one pass in fused.c, in x's dtype
        return fused.rope(x, cos, sin, neox)
    if neox:
        return _RealRope.apply(x.float(), cos.unsqueeze(-2), sin.unsqueeze(-2), True).to(x.dtype)
    if not policy.current(x.device).complex_rope:  # complex support varies elsewhere (MPS, ...)
        return rope_pairs(x.float(), cos, sin).to(x.dtype)
    rotation = torch.complex(cos, sin).unsqueeze(-2)  # (T|B,T, 1, D/2)
    return _Rope.apply(x.float(), rotation).to(x.dtype)



def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NORM rope of f32 ``x`` with real ops only (the same products and sums as the complex multiply)."""
    return _RealRope.apply(x, cos.unsqueeze(-2), sin.unsqueeze(-2), False)


class _Rope(torch.autograd.Function):
    """Each pair as a complex number times ``cos + i·sin``: (x0·c - x1·s, x0·s + x1·c), the same
    f32 products and sums as ggml's rope, in one kernel instead of real multiplies, a pair swap and
    an add. Backward rotates by -theta, the conjugate, and saves only the angles, no activation."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(rotation)
        return _times(x, rotation)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        (rotation,) = ctx.saved_tensors
        return _times(g, rotation.conj()), None


def _times(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """f32 x (..., D) with its adjacent pairs multiplied, as complex numbers, by rotation (..., D/2)."""
    pairs = torch.view_as_complex(x.contiguous().unflatten(-1, (-1, 2)))
    return torch.view_as_real(pairs * rotation).flatten(-2)


class _RealRope(torch.autograd.Function):
    """Rope with real ops: (x0·c - x1·s, x0·s + x1·c) written straight into the output's pair slots, for
    NEOX's halves (dim i with dim i + D/2, which as complex numbers would need interleaving copies each
    way) or NORM's adjacent pairs (devices without complex64). Backward rotates by -theta and saves only
    the angles."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,  # type: ignore[override]
                halves: bool) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.halves = halves
        return _rotate(x, cos, sin, halves)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        return _rotate(g, cos, -sin, ctx.halves), None, None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, halves: bool) -> torch.Tensor:
    """x (..., D) with pair i rotated by angle i; cos, sin (..., 1, D/2) broadcast over heads. Pair i is
    (x[i], x[i + D/2]) with ``halves``, else (x[2i], x[2i+1])."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    (x0, x1), (out0, out1) = (_pair_views(t, cos.shape[-1], halves) for t in (x, out))
    torch.mul(x0, cos, out=out0).sub_(x1 * sin)
    torch.mul(x0, sin, out=out1).add_(x1 * cos)
    return out


def _pair_views(t: torch.Tensor, half: int, halves: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The first and second members of every pair of ``t``'s last dim, as views."""
    return (t[..., :half], t[..., half:]) if halves else (t[..., 0::2], t[..., 1::2])


@dataclass
class KVCache:
    """Keys and values of every layer for the positions seen so far, preallocated to max_len.

    ``length`` is the number of positions filled; Transformer.forward writes the next T positions
    and advances it, so generating N tokens costs one T=1 forward per token.
    """

    k: list[torch.Tensor]  # per layer (B, Hkv, max_len, D); empty for a recurrent or K/V-sharing layer
    v: list[torch.Tensor]
    length: int = 0
    max_len: int = field(init=False)
    states: list[RecurrentState | None] = field(default_factory=list)
    """Per layer, a recurrent layer's state (None for attention layers)."""

    def __post_init__(self) -> None:
        self.max_len = max(t.shape[2] for t in self.k)

    @classmethod
    def empty(cls, config: ModelConfig, batch_size: int, max_len: int, device: torch.device | str,
              dtype: torch.dtype) -> KVCache:
        def zeros(layer: int) -> torch.Tensor:  # a recurrent layer or one reading another's K/V keeps none
            length = 0 if config.is_recurrent(layer) or not config.has_kv(layer) else max_len
            return torch.zeros(batch_size, config.n_head_kv_at(layer), length, config.head_dim_at(layer),
                               device=device, dtype=dtype)

        k = [zeros(i) for i in range(config.n_layer)]
        v = [zeros(i) for i in range(config.n_layer)]
        states = [RecurrentState() if config.is_recurrent(i) else None for i in range(config.n_layer)]
        return cls(k, v, states=states)


@dataclass
class Rope:
    """The angles of one forward for one kind of layer (global or sliding-window)."""

    cos: torch.Tensor
    sin: torch.Tensor
    neox: bool
    q_scale: torch.Tensor | None = None
    """Per position (T, or B, T), what queries are multiplied by after rope: :func:`attention_temperature`."""


def _with_bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y + bias.to(y.dtype)


def _bias(config: ModelConfig, kind: str, *shape: int) -> nn.Parameter | None:
    """A bias parameter for ``kind`` when the file has one (filled by the loader)."""
    return nn.Parameter(torch.zeros(shape)) if kind in config.biases else None


def has_forward_hooks(module: nn.Module) -> bool:
    """Whether a forward hook would see a call of ``module`` or of a module inside it.

    torch offers no public query, so this reads its registries: each module's own, and the
    global ones of ``register_module_forward_hook``."""
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


GroupForward = Callable[[tuple[nn.Module, ...], torch.Tensor], "tuple[torch.Tensor, ...] | None"]
"""A module's ``group_forward`` hook: the outputs of its layers that read one input, or None to call them one by
one."""


def shared_input(owner: nn.Module, layers: tuple[nn.Module, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``tuple(layer(x) for layer in layers)`` for layers of ``owner`` that read the same x (q, k and v; gate and
    up), or what ``owner.group_forward(layers, x)`` returns for them: a hook whoever replaced those layers may set
    (a wrapper that computes them in one go, reading x once for all), None by default or when it cannot this time.
    Layers watched by forward hooks are called one by one, so each hook sees its call."""
    together: GroupForward | None = owner.group_forward
    if together is not None and not any(has_forward_hooks(m) for m in layers):
        outputs = together(layers, x)
        if outputs is not None:
            return outputs
    return tuple(layer(x) for layer in layers)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rope (models/attention.py: flash, or products for
    short training sequences on CPU; explicit scores under soft-capping)."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        c = config
        self.n_head, self.n_head_kv, self.head_dim = c.n_head, c.n_head_kv_at(layer), c.head_dim_at(layer)
        n_embd_q, n_embd_kv = c.n_embd_q_at(layer), c.n_embd_kv_at(layer)
        n_embd_q_proj = n_embd_q * (2 if c.family.attn_output_gate else 1)
        self.widths = (n_embd_q_proj, n_embd_kv, n_embd_kv)
        self.has_kv = c.has_kv(layer)
        """False in a layer that reads an earlier layer's K/V (gemma4's last ``shared_kv_layers``): it has no k, v."""
        self.k_as_v = c.k_as_v(layer)
        """No ``attn_v``: V is the K projection's output (gemma4's global layers in its larger models)."""
        self.returns_kv = any(c.kv_source(j) == layer for j in range(layer + 1, c.n_layer))
        """Later layers read this layer's K/V: forward returns them with its output."""
        self.group_forward: GroupForward | None = None
        """How q, k and v run together (:func:`shared_input`); None: one by one."""
        if c.fused_qkv:
            self.qkv = Linear(c.n_embd, sum(self.widths), bias=False)
            self.qkv_bias = _bias(c, "attn_qkv", sum(self.widths))
        else:
            self.q = Linear(c.n_embd, n_embd_q_proj, bias=False)
            self.q_bias = _bias(c, "attn_q", n_embd_q_proj)
            self.k_bias = self.v_bias = None
            if self.has_kv:
                self.k = Linear(c.n_embd, n_embd_kv, bias=False)
                self.k_bias = _bias(c, "attn_k", n_embd_kv)
                if not self.k_as_v:
                    self.v = Linear(c.n_embd, n_embd_kv, bias=False)
                    self.v_bias = _bias(c, "attn_v", n_embd_kv)
        self.o = Linear(n_embd_q, c.n_embd, bias=False)
        self.o_bias = _bias(c, "attn_output", c.n_embd)
        self.sinks = nn.Parameter(torch.zeros(c.n_head)) if c.family.attn_sinks else None
        """gpt-oss's ``attn_sinks``: per head, a logit that joins the softmax's denominator."""
        if c.family.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, c.rms_eps)
            if self.has_kv:
                self.k_norm = RMSNorm(self.head_dim, c.rms_eps)
        self.qk_norm = c.family.qk_norm
        self.v_norm_eps = c.rms_eps if c.family.v_norm else 0.0
        """gemma4: values get an RMS norm without a gain (0: no norm)."""
        self.output_gate = c.family.attn_output_gate
        """qwen35: each query head comes with a gate of its width; the output is multiplied by sigmoid(gate)."""
        self.prescale = c.family.query_prescale
        self.scale = c.kq_scale
        self.softcap = c.attn_softcap
        self.window = c.sliding_window if c.is_swa(layer) else 0
        """Keys a query sees in a sliding-window layer (0: all earlier ones)."""
        step = c.family.no_rope_step
        self.use_rope = not (step and (layer + 1) % step == 0)
        """False in a NoPE layer (smollm3): q and k are not rotated."""

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        if hasattr(self, "qkv"):
            q, k, v = _with_bias(self.qkv(x), self.qkv_bias).split(self.widths, dim=-1)
            return (q, k, v) if self.has_kv else (q, None, None)
        if not self.has_kv:
            return _with_bias(self.q(x), self.q_bias), None, None
        if self.k_as_v:
            q, k = shared_input(self, (self.q, self.k), x)
            k = _with_bias(k, self.k_bias)
            return _with_bias(q, self.q_bias), k, k
        q, k, v = shared_input(self, (self.q, self.k, self.v), x)
        return _with_bias(q, self.q_bias), _with_bias(k, self.k_bias), _with_bias(v, self.v_bias)

    def forward(self, x: torch.Tensor, rope: Rope, kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                start_pos: int = 0, attn_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None,
                shared_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The attention's output (B, T, C); with ``returns_kv`` also its keys and values (B, Hkv, S, D) for the
        layers that read them, which pass them as ``shared_kv`` (they compute none)."""
        B, T, _ = x.shape
        q, k, v = self._qkv(x)
        gate = None
        if self.output_gate:  # per head: the query, then its gate
            q, gate = q.view(B, T, self.n_head, 2 * self.head_dim).split(self.head_dim, dim=-1)
        q = q.reshape(B, T, self.n_head, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
        if self.use_rope:
            q = apply_rope(q, rope.cos, rope.sin, rope.neox)
        if rope.q_scale is not None:
            q = q * rope.q_scale[..., None, None].to(q.dtype)
        scale = self.scale
        if self.prescale:  # llama.cpp scales q after rope and multiplies scores by 1
            q, scale = q * scale, 1.0
        q = q.transpose(1, 2)  # (B, H, T, D)
        if k is None or v is None:
            if shared_kv is None:
                raise ValueError("this layer reads an earlier layer's keys and values: pass them as shared_kv")
            k, v = shared_kv  # (B, Hkv, S, D), normed and turned by the layer that computed them
        else:
            k, v = self._keys_values(k, v, rope, B, T)
            if kv is not None:
                k_cache, v_cache = kv  # (B, Hkv, max_len, D)
                k_cache[:, :, start_pos:start_pos + T] = k
                v_cache[:, :, start_pos:start_pos + T] = v
                k, v = k_cache[:, :, :start_pos + T], v_cache[:, :, :start_pos + T]  # (B, Hkv, S, D)
        y = self._attend(q, k, v, scale, attn_mask, positions, gate)
        return (y, (k, v)) if self.returns_kv else y

    def _keys_values(self, k: torch.Tensor, v: torch.Tensor, rope: Rope, B: int,
                     T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This call's keys and values (B, Hkv, T, D): normed, keys turned."""
        k = k.view(B, T, self.n_head_kv, self.head_dim)
        v = v.view(B, T, self.n_head_kv, self.head_dim)
        if self.qk_norm:
            k = self.k_norm(k)
        if self.v_norm_eps:
            v = fused.rms_norm(v, torch.ones(self.head_dim, device=v.device), self.v_norm_eps)
        if self.use_rope:
            k = apply_rope(k, rope.cos, rope.sin, rope.neox)
        return k.transpose(1, 2), v.transpose(1, 2)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                attn_mask: torch.Tensor | None, positions: torch.Tensor | None,
                gate: torch.Tensor | None) -> torch.Tensor:
        """Attention of q (B, H, T, D) over k, v (B, Hkv, S, D), projected out (B, T, C)."""
        B, _, T, _ = q.shape
        S = k.shape[2]
        mask, causal = None, T > 1
        if attn_mask is not None:  # packed records: (B, 1, T, T), True where a query may attend
            mask, causal = attn_mask, False
        elif (causal and S > T) or self.window:
            # Queries sit at positions start_pos..S-1: is_causal would align them to 0..T-1.
            mask, causal = causal_mask(T, S, q.device), False
        if self.window:
            mask = mask & _window_mask(T, S, self.window, q.device, positions)
        y = attention(q, k, v, scale=scale, causal=causal, mask=mask, sinks=self.sinks,
                      softcap=self.softcap)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)
        if gate is not None:
            y = (y.float() * torch.sigmoid(gate.float()).reshape(B, T, -1)).to(y.dtype)
        return _with_bias(self.o(y), self.o_bias)


def _window_mask(T: int, S: int, window: int, device: torch.device,
                 positions: torch.Tensor | None) -> torch.Tensor:
    """True where a key lies less than ``window`` positions before its query (llama.cpp's
    LLAMA_SWA_TYPE_STANDARD masks p_query - p_key >= window). With packed rows, positions (B, T)
    restart per record, and the segment mask keeps records apart."""
    if positions is not None:
        return (positions[:, :, None] - positions[:, None, :] < window)[:, None]  # (B, 1, T, T)
    query = torch.arange(S - T, S, device=device)[:, None]
    return query - torch.arange(S, device=device)[None, :] < window  # (T, S)


class MLP(nn.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or GELU (GeGLU); phi3 keeps
    gate and up in one matrix (``fused_up``: the gate is its first half)."""

    def __init__(self, config: ModelConfig, n_ff: int | None = None, *, shared: bool = False) -> None:
        """``n_ff``: another hidden width than the config's (a layer's own, gemma4; qwen2moe's shared expert, which
        has no biases: ``shared``)."""
        super().__init__()
        c = config
        n_ff = c.n_ff if n_ff is None else n_ff
        self.fused = c.family.fused_up
        self.group_forward: GroupForward | None = None
        """How gate and up run together (:func:`shared_input`); None: one by one."""
        if not self.fused:
            self.gate = Linear(c.n_embd, n_ff, bias=False)
            self.gate_bias = None if shared else _bias(c, "ffn_gate", n_ff)
        self.up = Linear(c.n_embd, 2 * n_ff if self.fused else n_ff, bias=False)
        self.up_bias = None if shared else _bias(c, "ffn_up", n_ff)
        self.down = Linear(n_ff, c.n_embd, bias=False)
        self.down_bias = None if shared else _bias(c, "ffn_down", c.n_embd)
        self.gelu = c.family.activation == "gelu"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_ffn(self, x)


def gated_ffn(ffn: MLP | DenseAndExperts, x: torch.Tensor) -> torch.Tensor:
    """down(act(gate(x)) * up(x)) with ``ffn``'s matrices and biases: an MLP's forward, and the dense half of
    gemma4's MoE layers (whose matrices sit beside its experts)."""
    if ffn.fused:
        gate, up = ffn.up(x).chunk(2, dim=-1)
    else:
        gate, up = shared_input(ffn, (ffn.gate, ffn.up), x)
        gate, up = _with_bias(gate, ffn.gate_bias), _with_bias(up, ffn.up_bias)
    hidden = geglu(gate, up) if ffn.gelu else swiglu(gate, up)
    return _with_bias(ffn.down(hidden), ffn.down_bias)


class MoE(nn.Module):
    """Routed experts as llama.cpp's build_moe_ffn computes them, plus qwen2moe's gated shared expert.

    Per token: probabilities = softmax(router(x) + router bias) in f32; the top ``n_expert_used`` experts
    (ties as torch.topk breaks them; llama.cpp's argsort may pick the other of two exactly equal ones);
    their probabilities, divided by their sum (clamped to 2^-14, llama.cpp's guard) when the family
    normalizes, or (gpt-oss's softmax_weight gating) the softmax of their logits alone; the output is the
    weighted sum of those experts' gated FFNs, each with its own biases if the file has them. Gradients
    reach x through the experts and through the weights (the router's softmax), not through the choice.

    Only routed experts run: the token rows are grouped by expert once, each expert multiplies its own rows
    (ggtorch.ops.experts.grouped) and the results go back to their tokens.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        assert c.n_ff_exp is not None
        self.router = Linear(c.n_embd, c.n_expert, bias=False)
        self.router_bias = _bias(c, "ffn_gate_inp", c.n_expert)
        if c.fused_gate_up_exps:  # gemma4: one stack, each expert's gate rows then its up rows
            self.gate_up_exps = Experts(c.n_expert, 2 * c.n_ff_exp, c.n_embd)
        else:
            self.gate_exps = Experts(c.n_expert, c.n_ff_exp, c.n_embd)
            self.up_exps = Experts(c.n_expert, c.n_ff_exp, c.n_embd)
        self.down_exps = Experts(c.n_expert, c.n_embd, c.n_ff_exp)
        self.gate_exps_bias = _bias(c, "ffn_gate_exps", c.n_expert, c.n_ff_exp)
        self.up_exps_bias = _bias(c, "ffn_up_exps", c.n_expert, c.n_ff_exp)
        self.down_exps_bias = _bias(c, "ffn_down_exps", c.n_expert, c.n_embd)
        self.n_expert, self.n_used = c.n_expert, c.n_expert_used
        self.normalize = c.family.normalize_expert_weights
        self.gating = c.family.expert_gating
        self.activation = {"swiglu_oai": swiglu_oai, "gelu": geglu}.get(c.family.activation, swiglu)
        self.shared: MLP | None = None
        if c.family.shared_expert:
            assert c.n_ff_shexp is not None
            self.shared = MLP(c, c.n_ff_shexp, shared=True)
            self.shared_gate = nn.Parameter(torch.zeros(c.n_embd))
            """``ffn_gate_inp_shexp``: the shared expert's output is scaled by sigmoid(shared_gate · x)."""

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        """(N, E) f32: how strongly each row of x (N, C) calls on each expert, the router's bias included."""
        logits = self.router(x).float()
        return logits if self.router_bias is None else logits + self.router_bias.float()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights (N, k) f32, experts (N, k)) of the rows of x (N, C), best expert first."""
        logits = self.router_logits(x)  # (N, E)
        if self.gating == "softmax_weight":
            top, experts = torch.topk(logits, self.n_used, dim=-1)  # (N, k)
            return torch.softmax(top, dim=-1), experts
        weights, experts = torch.topk(torch.softmax(logits, dim=-1), self.n_used, dim=-1)  # (N, k)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=6.103515625e-5)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, C)
        weights, experts = self.route(x)
        y = self._routed(x, experts)  # (N, k, C)
        out = (y.float() * weights.unsqueeze(-1)).sum(dim=1)  # (N, C), f32 as llama.cpp's ggml_mul
        if self.shared is not None:
            gate = torch.sigmoid((x.float() @ self.shared_gate.float()).unsqueeze(-1))  # (N, 1)
            out = out + self.shared(x).float() * gate
        return out.to(y.dtype).reshape(shape)

    def _ffn(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The experts' FFNs of ``rows`` grouped by expert, ``counts[e]`` rows for expert e."""
        ids = None  # each row's expert, for the experts' biases (llama.cpp's ggml_add_id)
        if self.down_exps_bias is not None or self.gate_exps_bias is not None or self.up_exps_bias is not None:
            ids = torch.arange(len(counts), device=rows.device).repeat_interleave(
                torch.tensor(counts, device=rows.device), output_size=rows.shape[0])
        if hasattr(self, "gate_up_exps"):
            gate, up = self.gate_up_exps(rows, counts).chunk(2, dim=-1)
        else:
            gate = _expert_bias(self.gate_exps(rows, counts), self.gate_exps_bias, ids)
            up = _expert_bias(self.up_exps(rows, counts), self.up_exps_bias, ids)
        return _expert_bias(self.down_exps(self.activation(gate, up), counts), self.down_exps_bias, ids)

    def _routed(self, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """(N, k, C): each token's chosen experts' outputs, computing only routed experts."""
        N, k = experts.shape
        flat = experts.reshape(-1)  # (N·k), slot j of token n at n·k + j
        order = torch.argsort(flat, stable=True)  # slots grouped by expert
        counts = torch.bincount(flat, minlength=self.n_expert).tolist()
        y = self._ffn(x[order // k], counts)  # (N·k, C) in expert order
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return y[back].reshape(N, k, -1)


class DenseAndExperts(MoE):
    """gemma4's MoE layer: its dense MLP (``ffn_gate/up/down`` after ``ffn_norm``, then ``post_ffw_norm_1``) plus
    routed experts (after ``pre_ffw_norm_2``, then ``post_ffw_norm_2``), summed. The router reads the residual
    stream itself: RMS-normed without a gain, times 1/sqrt(n_embd) and ``ffn_gate_inp.scale`` (llama.cpp's gemma4
    graph). Softmax over all experts, top k, weights renormalized, GeGLU experts."""

    def __init__(self, config: ModelConfig, n_ff: int) -> None:
        super().__init__(config)
        c = config
        self.fused = False
        self.group_forward: GroupForward | None = None
        """How the dense gate and up run together (:func:`shared_input`); None: one by one."""
        self.gate = Linear(c.n_embd, n_ff, bias=False)
        self.up = Linear(c.n_embd, n_ff, bias=False)
        self.down = Linear(n_ff, c.n_embd, bias=False)
        self.gate_bias = self.up_bias = self.down_bias = None
        self.gelu = True
        self.router_scale = nn.Parameter(torch.ones(c.n_embd))
        self.pre_norm_2 = RMSNorm(c.n_embd, c.rms_eps)
        self.post_norm_1 = RMSNorm(c.n_embd, c.rms_eps)
        self.post_norm_2 = RMSNorm(c.n_embd, c.rms_eps)
        self.router_input_scale = float(1 / torch.tensor(c.n_embd, dtype=torch.float32, device="cpu").sqrt())
        """1/sqrtf(n_embd) as llama.cpp's f32 computes it."""
        self.eps = c.rms_eps

    def router_input(self, residual: torch.Tensor) -> torch.Tensor:
        """What the router multiplies: rows of the residual stream RMS-normed, times 1/sqrt(n_embd) and the scale."""
        unit = torch.ones(residual.shape[-1], device=residual.device)
        return rms_norm(residual, unit, self.eps) * self.router_input_scale * self.router_scale.to(residual.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        """``x``: the residual stream after ``ffn_norm`` (the dense MLP's input); ``residual``: before it."""
        if residual is None:
            raise ValueError("gemma4's MoE layer reads the residual stream too: pass it as residual")
        dense = self.post_norm_1(gated_ffn(self, x))
        shape = residual.shape
        flat = residual.reshape(-1, shape[-1])
        weights, experts = self.route(self.router_input(flat))
        y = self._routed(self.pre_norm_2(flat), experts)  # (N, k, C)
        routed = (y.float() * weights.unsqueeze(-1)).sum(dim=1).to(y.dtype).reshape(shape)
        return dense + self.post_norm_2(routed)


def _expert_bias(y: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor | None) -> torch.Tensor:
    """Rows of ``y`` plus their own expert's bias row (``bias`` (E, out), ``ids`` each row's expert)."""
    return y if bias is None or ids is None else y + bias[ids].to(y.dtype)


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0) -> torch.Tensor:
    """OpenAI's SwiGLU (gpt-oss), as ggml_swiglu_oai computes it: x·sigmoid(alpha·x)·(y + 1) with the gate
    x clamped to ``limit`` from above and y = up clamped to [-limit, limit]. llama.cpp fixes alpha and limit
    for gpt-oss; no key carries them. Past a clamp the gradient is zero, as for torch.clamp."""
    x = gate.clamp(max=limit)
    return x * torch.sigmoid(x * alpha) * (up.clamp(-limit, limit) + 1)


class Block(nn.Module):
    """One transformer layer (pre-norm residual, gemma's post norms when the family has them); the
    unit the trainer checkpoints."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        c = config
        self.attn_norm = RMSNorm(c.n_embd, c.rms_eps)
        self.recurrent = c.is_recurrent(layer)
        """A Gated DeltaNet layer (qwen35): its mixer is no attention, its cache a RecurrentState."""
        self.attn: Attention | GatedDeltaNet = GatedDeltaNet(c, layer) if self.recurrent else Attention(c, layer)
        self.ffn_norm_name = c.family.ffn_norm
        """The attribute holding the norm before the FFN, named after its tensor kind (gpt-oss: attn_post_norm)."""
        setattr(self, self.ffn_norm_name, RMSNorm(c.n_embd, c.rms_eps))
        n_ff = c.n_ff_at(layer)
        self.ffn: MLP | MoE = MLP(c, n_ff)
        if c.n_expert:
            self.ffn = DenseAndExperts(c, n_ff) if c.family.dense_beside_experts else MoE(c)
        self.post_norms = c.family.post_norms
        if self.post_norms:
            self.attn_post_norm = RMSNorm(c.n_embd, c.rms_eps)
            self.ffn_post_norm = RMSNorm(c.n_embd, c.rms_eps)
        self.sliding = c.is_swa(layer)
        """Whether the layer attends within a sliding window (its own rope in gemma3)."""
        self.residual_multiplier = c.residual_multiplier
        """granite's ``residual_scale``: each branch's output is multiplied by it before its residual add (0: not)."""
        if c.n_embd_per_layer:  # gemma4 E2B/E4B: the layer's own embedding, gated in after the FFN
            self.inp_gate = Linear(c.n_embd, c.n_embd_per_layer, bias=False)
            self.proj = Linear(c.n_embd_per_layer, c.n_embd, bias=False)
            self.post_norm = RMSNorm(c.n_embd, c.rms_eps)
        self.out_scale = nn.Parameter(torch.ones(1)) if c.layer_output_scale else None
        """gemma4's ``layer_output_scale``: the block's output is multiplied by it (None: not)."""

    def forward(self, x: torch.Tensor, rope: Rope,
                kv: tuple[torch.Tensor, torch.Tensor] | RecurrentState | None = None, start_pos: int = 0,
                attn_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None, *,
                shared_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                per_layer_input: torch.Tensor | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The block's output (B, T, C); for a layer whose K/V later layers read (``attn.returns_kv``) also those
        K/V, which the later layers take as ``shared_kv``. ``per_layer_input`` (B, T, n_embd_per_layer): gemma4's
        input of this layer."""
        kv_out = None
        if isinstance(self.attn, Attention):
            out = self.attn(self.attn_norm(x), rope, kv, start_pos, attn_mask, positions, shared_kv)
            h, kv_out = out if isinstance(out, tuple) else (out, None)
        else:
            h = self.attn(self.attn_norm(x), rope, kv, start_pos, attn_mask, positions)
        if self.post_norms:
            h = self.attn_post_norm(h)
        if self.residual_multiplier:
            h = h * self.residual_multiplier
        x = x + h
        normed = getattr(self, self.ffn_norm_name)(x)
        h = self.ffn(normed, x) if isinstance(self.ffn, DenseAndExperts) else self.ffn(normed)
        if self.post_norms:
            h = self.ffn_post_norm(h)
        if self.residual_multiplier:
            h = h * self.residual_multiplier
        x = x + h
        if per_layer_input is not None:
            gate = F.gelu(self.inp_gate(x), approximate="tanh")
            x = x + self.post_norm(self.proj(gate * per_layer_input.to(gate.dtype)))
        if self.out_scale is not None:
            x = x * self.out_scale.to(x.dtype)
        return x if kv_out is None else (x, kv_out)


class Transformer(nn.Module):
    """Token ids (B, T) -> next-token logits (B, T, V)."""

    def __init__(self, config: ModelConfig, *, init_weights: bool = True) -> None:
        """``init_weights=False`` leaves the weights uninitialized, for a loader that assigns
        every one (built on the meta device, normal_ would import torch._dynamo for nothing)."""
        super().__init__()
        c = self.config = config
        empty = None if init_weights else torch.empty(c.n_vocab, c.n_embd)
        self.tok_embd = nn.Embedding(c.n_vocab, c.n_embd, _weight=empty)
        if c.n_embd_per_layer:  # gemma4 E2B/E4B: every layer's own input, from a second table and the embedding
            width = c.n_layer * c.n_embd_per_layer
            self.per_layer_tok_embd = nn.Embedding(c.n_vocab, width, _weight=None if init_weights else
                                                   torch.empty(c.n_vocab, width))
            self.per_layer_model_proj = Linear(c.n_embd, width, bias=False)
            self.per_layer_proj_norm = RMSNorm(c.n_embd_per_layer, c.rms_eps)
        self.layers = nn.ModuleList(Block(c, i) for i in range(c.n_layer))
        self.output_norm = RMSNorm(c.n_embd, c.rms_eps)
        self.output = Linear(c.n_embd, c.n_vocab, bias=False)
        self.output_bias = _bias(c, "output", c.n_vocab)
        if init_weights:
            self.apply(_init_weights)
        self.rope_freqs: torch.Tensor | None
        self.rope_factors_long: torch.Tensor | None
        self.rope_factors_short: torch.Tensor | None
        for name, present in (("rope_freqs", c.rope_freqs), ("rope_factors_long", c.rope_long_short),
                              ("rope_factors_short", c.rope_long_short)):
            # per-pair divisors of the rope frequencies, filled by the loader
            self.register_buffer(name, torch.ones(c.n_rot // 2) if present else None)
        if c.tied_output:
            self.output.weight = self.tok_embd.weight  # one Parameter, as llama.cpp reuses token_embd
        self.n_ctx = c.n_ctx_orig_yarn
        """The context the model runs with: above ``n_ctx_orig`` LongRoPE takes its long factors,
        as llama.cpp decides from its context size. Generation and training set it."""
        self.block_wrapper: Callable[..., torch.Tensor] | None = None
        """How each block is called: ``block_wrapper(block, x, rope, kv, start_pos, mask, positions)`` in place of
        ``block(...)`` when set (training's activation checkpointing wraps the call; a profiler could); None: the
        block itself."""

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Transformer:
        """After .to()/.cuda(): a tied output shares the embedding's raw blocks again.

        Module._apply converts each module's buffers separately, which would give a tied
        QuantLinear its own copy of the embedding's buffer; Parameters stay shared on their own.
        """
        super()._apply(fn, recurse)
        if self.config.tied_output and hasattr(self.tok_embd, "raw") and hasattr(self.output, "raw"):
            self.output.raw = self.tok_embd.raw
        return self

    @property
    def plain_head(self) -> bool:
        """Whether the logits are exactly ``self.output(hidden)``: no output bias, no logit scale, no
        soft-capping, so a loss may apply the output projection itself (ggtorch.training.loss.output_cross_entropy)."""
        return self.output_bias is None and not self.config.final_softcap and not self.config.logit_scale

    @property
    def head_map(self) -> tuple[float, float] | None:
        """(multiplier, cap) of the elementwise map :meth:`head` applies to the output projection's f32 logits
        (``cap · tanh(l · multiplier / cap)``; cap 0: none), or None when the head adds a bias: what lets a loss
        take the vocabulary a slab at a time."""
        if self.output_bias is not None:
            return None
        c = self.config
        return (float(1 / _f32(c.logit_scale)) if c.logit_scale else 1.0), c.final_softcap

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (f32) from the normed hidden states: output projection, bias, granite's logit scale, final
        soft-capping."""
        logits = _with_bias(self.output(hidden), self.output_bias).float()
        if self.config.logit_scale:  # granite: ggml_scale by 1.0f / logit_scale
            logits = logits * float(1 / _f32(self.config.logit_scale))
        if self.config.final_softcap:
            logits = softcap(logits, self.config.final_softcap)
        return logits

    def new_cache(self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None) -> KVCache:
        """An empty KV cache on the model's device for up to max_len (default n_ctx_train) positions."""
        ref = self.output_norm.weight
        return KVCache.empty(self.config, batch_size, max_len or self.config.n_ctx_train, ref.device,
                             dtype or torch.float32)

    def _ropes(self, start_pos: int, T: int, device: torch.device,
               positions: torch.Tensor | None) -> tuple[Rope, Rope | None]:
        """Angles of the global layers and, when the model has any, of the sliding-window ones."""
        c = self.config
        factors = self.rope_freqs
        if c.rope_long_short:
            long = self.n_ctx > c.n_ctx_orig_yarn
            factors = self.rope_factors_long if long else self.rope_factors_short
        neox = c.family.rope == "neox"
        attn_factor = yarn_attn_factor(c) if c.rope_yarn else c.rope_attn_factor
        yarn = {"ext_factor": 1.0 if c.rope_yarn else 0.0, "n_ctx_orig": c.n_ctx_orig_yarn,
                "beta_fast": c.yarn_beta_fast, "beta_slow": c.yarn_beta_slow}
        where = positions if positions is not None else torch.arange(start_pos, start_pos + T, device=device)
        q_scale = attention_temperature(where, c.attn_temp_scale, c.n_ctx_orig_yarn) if c.attn_temp_scale else None

        def angles(n_rot: int, base: float, scale: float, freq_factors: torch.Tensor | None) -> Rope:
            cos, sin = rope_angles_at(where, n_rot, base, scale, freq_factors, attn_factor, **yarn)
            if c.rope_sections:  # pairs of the fourth position kind stay at position 0
                cos0, sin0 = rope_angles_at(torch.zeros_like(where), n_rot, base, scale, freq_factors, attn_factor,
                                            **yarn)
                turns = rope_section_turns(c.rope_sections, n_rot).to(cos.device)
                cos, sin = torch.where(turns, cos, cos0), torch.where(turns, sin, sin0)
            return Rope(cos, sin, neox, q_scale)

        assert c.n_rot is not None
        rope = angles(c.n_rot, c.rope_freq_base, c.rope_freq_scale, factors)
        if not any(c.swa_layers):
            return rope, None
        swa_layer = c.swa_layers.index(True)
        return rope, angles(c.n_rot_at(swa_layer), c.rope_freq_base_swa, c.rope_freq_scale_swa,
                            factors if c.family.swa_rope_factors else None)

    def per_layer_inputs(self, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """gemma4's per-layer inputs (B, T, n_layer, n_embd_per_layer) of ``tokens`` and their scaled embeddings
        ``x``, as llama.cpp's project_per_layer_inputs: the rows of ``per_layer_token_embd`` times
        sqrt(n_embd_per_layer), plus the RMS-normed projection of x times 1/sqrt(n_embd), times 1/sqrt(2)."""
        c = self.config
        B, T = tokens.shape
        rows = self.per_layer_tok_embd(tokens).view(B, T, c.n_layer, c.n_embd_per_layer)
        rows = rows * _f32(c.n_embd_per_layer).sqrt().item()
        proj = self.per_layer_model_proj(x) * (1 / _f32(c.n_embd).sqrt()).item()
        proj = self.per_layer_proj_norm(proj.view(B, T, c.n_layer, c.n_embd_per_layer))
        return (proj + rows.to(proj.dtype)) * (1 / _f32(2.0).sqrt()).item()

    def forward(self, tokens: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None,
                last_only: bool = False, *, positions: torch.Tensor | None = None,
                segments: torch.Tensor | None = None, hidden_only: bool = False) -> torch.Tensor:
        """Logits for ``tokens`` (B, T) at positions start_pos..start_pos+T-1.

        With a cache, the positions continue from ``cache.length`` (``start_pos`` is ignored),
        the new keys/values are stored and the cache advances by T. ``last_only`` returns only
        the last position's logits (B, 1, V): generation needs nothing else. ``hidden_only``
        stops before the output projection and returns the normed hidden states (B, T, C), for a
        loss that applies the head itself (see :attr:`plain_head`).

        Packed training rows (several records in one row) pass ``positions`` (B, T), each
        record's own rope positions from 0, and ``segments`` (B, T), a record id per token: a
        token attends only to earlier tokens of its own segment, so each record is computed as
        if it were alone. Both are for cache-free calls.
        """
        B, T = tokens.shape
        if cache is not None:
            if positions is not None or segments is not None:
                raise ValueError("positions/segments are for packed training rows, not for a KV cache")
            start_pos = cache.length
            if start_pos + T > cache.max_len:
                raise ValueError(f"KV cache holds {cache.max_len} positions; {start_pos} + {T} do not fit")
        x = self.tok_embd(tokens)  # (B, T, C)
        if self.config.family.embedding_scale:
            x = x * torch.tensor(self.config.n_embd, dtype=torch.float32).sqrt()  # ggml_scale by sqrtf(n_embd)
        if self.config.embedding_multiplier:  # granite's embedding_scale
            x = x * self.config.embedding_multiplier
        rope, rope_swa = self._ropes(start_pos, T, x.device, positions)
        mask = None if segments is None else segment_mask(segments)
        per_layer = self.per_layer_inputs(tokens, x) if self.config.n_embd_per_layer else None
        kv_of: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # K/V that later layers read, by layer
        for i, block in enumerate(self.layers):
            kv = None
            if cache is not None:
                kv = cache.states[i] if block.recurrent else (cache.k[i], cache.v[i])
            layer_rope = rope_swa if block.sliding and rope_swa is not None else rope
            extra: dict[str, torch.Tensor | tuple[torch.Tensor, torch.Tensor]] = {}
            if not self.config.has_kv(i):
                extra["shared_kv"] = kv_of[self.config.kv_source(i)]
            if per_layer is not None:
                extra["per_layer_input"] = per_layer[:, :, i]
            if self.block_wrapper is None:
                out = block(x, layer_rope, kv, start_pos, mask, positions, **extra)  # (B, T, C)
            else:
                out = self.block_wrapper(block, x, layer_rope, kv, start_pos, mask, positions, **extra)
            if isinstance(out, tuple):
                x, kv_of[i] = out
            else:
                x = out
        if cache is not None:
            cache.length += T
        x = self.output_norm(x)
        if last_only:
            x = x[:, -1:]
        if hidden_only:
            return x  # (B, T, C)
        return self.head(x)  # (B, T, V)


Llama = Transformer
"""The name the model had when ggtorch ran llama alone; kept for the public API."""


def segment_mask(segments: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) attention mask: causal within each segment, nothing across (block diagonal)."""
    T = segments.shape[1]
    same = segments[:, :, None] == segments[:, None, :]  # (B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()
    return (same & causal)[:, None]


def _init_weights(module: nn.Module) -> None:
    """Small normal init for a model built from a config alone (training from scratch)."""
    if isinstance(module, nn.Linear | nn.Embedding | Experts):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
