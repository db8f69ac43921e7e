"""The llama model in plain torch, computing what llama.cpp's llm_build_llama computes.

One file, nanoGPT style: RMSNorm, rope, Attention, MLP, Block, Llama. Module paths follow
``ggtorch.models.names`` (``layers.{i}.attn.q`` ...), so GGUF tensors map one-to-one onto
modules. Linear layers are ``ggtorch.ops.matmul.Linear`` (an ``nn.Linear``) or, for weights kept
in their ggml blocks, ``ggtorch.quant.modules.QuantLinear``: this file only calls them.

Shapes: B batch, T tokens in this call, S = start_pos + T keys, C n_embd, H query heads,
Hkv key/value heads, D head_dim, V n_vocab.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn

from ggtorch.models.attention import attention
from ggtorch.models.config import LlamaConfig
from ggtorch.ops.fused import recompute_outputs, rms_norm, swiglu
from ggtorch.ops.matmul import Linear


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in f32 whatever the activation dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_angles(start_pos: int, n_tokens: int, n_rot: int, freq_base: float, freq_scale: float,
                device: torch.device, freq_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (T, n_rot/2) of theta = p * freq_scale * base^(-2i/n_rot) / freq_factors[i].

    Mirrors ggml_rope_cache_init: the angle is built in f32 by multiplying the position by
    theta_scale = base^(-2/n_rot) once per pair (a running product, not a fresh power), so
    the rounding is ggml's and long positions do not drift from llama.cpp.
    """
    positions = torch.arange(start_pos, start_pos + n_tokens, dtype=torch.float32, device=device)
    return rope_angles_at(positions, n_rot, freq_base, freq_scale, freq_factors)


def rope_angles_at(positions: torch.Tensor, n_rot: int, freq_base: float, freq_scale: float,
                   freq_factors: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (*positions.shape, n_rot/2) for arbitrary positions (packed records restart at 0).

    The same running product as :func:`rope_angles`, so a position gets the same angle either way.
    """
    theta_scale = torch.tensor(freq_base, dtype=torch.float32) ** (torch.tensor(-2.0, dtype=torch.float32) / n_rot)
    steps = torch.full((*positions.shape, n_rot // 2), float(theta_scale), dtype=torch.float32,
                       device=positions.device)
    steps[..., 0] = positions.to(torch.float32)
    theta = torch.cumprod(steps, dim=-1)  # (..., n_rot/2)
    if freq_factors is not None:
        theta = theta / freq_factors.float()
    theta = theta * freq_scale
    return torch.cos(theta), torch.sin(theta)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs (x[2i], x[2i+1]) by theta_i: ggml's NORM mode, not NeoX halves.

    x: (B, T, H, D); cos, sin: (T, D/2), or (B, T, D/2) for per-row positions. Computed in f32,
    returned in x's dtype.
    """
    if x.device.type not in COMPLEX_DEVICES:
        return rope_pairs(x.float(), cos, sin).to(x.dtype)
    rotation = torch.complex(cos, sin).unsqueeze(-2)  # (T|B,T, 1, D/2)
    return _Rope.apply(x.float(), rotation).to(x.dtype)


COMPLEX_DEVICES = ("cpu", "cuda")
"""Devices whose complex64 multiply apply_rope uses; elsewhere (MPS, ...) complex support varies, so
rope there takes :func:`rope_pairs`, the same formula written with real tensors."""


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rope of f32 ``x`` with real ops only (the same products and sums, autograd's backward)."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)


class _Rope(torch.autograd.Function):
    """Each pair as a complex number times ``cos + i·sin``: (x0·c - x1·s, x0·s + x1·c), the same
    f32 products and sums as ggml's rope, in one kernel (ten times faster than the same formula as
    real multiplies, a pair swap and an add). Backward rotates by -theta, the conjugate, and saves
    only the angles, no activation."""

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


@dataclass
class KVCache:
    """Keys and values of every layer for the positions seen so far, preallocated to max_len.

    ``length`` is the number of positions filled; Llama.forward writes the next T positions
    and advances it, so generating N tokens costs one T=1 forward per token.
    """

    k: list[torch.Tensor]  # per layer (B, Hkv, max_len, D)
    v: list[torch.Tensor]
    length: int = 0
    max_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.max_len = self.k[0].shape[2]

    @classmethod
    def empty(cls, config: LlamaConfig, batch_size: int, max_len: int, device: torch.device | str,
              dtype: torch.dtype) -> KVCache:
        shape = (batch_size, config.n_head_kv, max_len, config.head_dim)
        k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.n_layer)]
        return cls(k, v)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rope (models/attention.py: flash, or products for
    short training sequences on CPU)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_head, self.n_head_kv, self.head_dim = config.n_head, config.n_head_kv, config.head_dim
        self.q = Linear(config.n_embd, config.n_head * config.head_dim, bias=False)
        self.k = Linear(config.n_embd, config.n_embd_kv, bias=False)
        self.v = Linear(config.n_embd, config.n_embd_kv, bias=False)
        self.o = Linear(config.n_head * config.head_dim, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None, start_pos: int = 0,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q = apply_rope(self.q(x).view(B, T, self.n_head, self.head_dim), cos, sin)
        k = apply_rope(self.k(x).view(B, T, self.n_head_kv, self.head_dim), cos, sin)
        v = self.v(x).view(B, T, self.n_head_kv, self.head_dim)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H|Hkv, T, D)
        if kv is not None:
            k_cache, v_cache = kv  # (B, Hkv, max_len, D)
            k_cache[:, :, start_pos:start_pos + T] = k
            v_cache[:, :, start_pos:start_pos + T] = v
            k, v = k_cache[:, :, :start_pos + T], v_cache[:, :, :start_pos + T]  # (B, Hkv, S, D)
        S = k.shape[2]
        mask, causal = None, T > 1
        if causal and S > T:
            # Queries sit at positions start_pos..S-1: is_causal would align them to 0..T-1.
            mask = torch.ones(T, S, dtype=torch.bool, device=x.device).tril(diagonal=S - T)
            causal = False
        if attn_mask is not None:  # packed records: (B, 1, T, T), True where a query may attend
            mask, causal = attn_mask, False
        y = attention(q, k, v, scale=1.0 / math.sqrt(self.head_dim), causal=causal, mask=mask)  # (B, H, T, D)
        return self.o(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate = Linear(config.n_embd, config.n_ff, bias=False)
        self.up = Linear(config.n_embd, config.n_ff, bias=False)
        self.down = Linear(config.n_ff, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(swiglu(self.gate(x), self.up(x)))


class Block(nn.Module):
    """One transformer layer (pre-norm residual); the unit the trainer checkpoints."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.n_embd, config.rms_eps)
        self.attn = Attention(config)
        self.ffn_norm = RMSNorm(config.n_embd, config.rms_eps)
        self.ffn = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None, start_pos: int = 0,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, kv, start_pos, attn_mask)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    """Token ids (B, T) -> next-token logits (B, T, V)."""

    def __init__(self, config: LlamaConfig, *, init_weights: bool = True) -> None:
        """``init_weights=False`` leaves the weights uninitialized, for a loader that assigns
        every one (built on the meta device, normal_ alone would cost ~1.3 s: it imports torch._dynamo)."""
        super().__init__()
        self.config = config
        empty = None if init_weights else torch.empty(config.n_vocab, config.n_embd)
        self.tok_embd = nn.Embedding(config.n_vocab, config.n_embd, _weight=empty)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.output_norm = RMSNorm(config.n_embd, config.rms_eps)
        self.output = Linear(config.n_embd, config.n_vocab, bias=False)
        if init_weights:
            self.apply(_init_weights)
        self.rope_freqs: torch.Tensor | None
        if config.rope_freqs:
            self.register_buffer("rope_freqs", torch.ones(config.n_rot // 2))  # filled by the loader
        else:
            self.rope_freqs = None
        if config.tied_output:
            self.output.weight = self.tok_embd.weight  # one Parameter, as llama.cpp reuses token_embd

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Llama:
        """After .to()/.cuda(): a tied output shares the embedding's raw blocks again.

        Module._apply converts each module's buffers separately, which would give a tied
        QuantLinear its own copy of the embedding's buffer; Parameters stay shared on their own.
        """
        super()._apply(fn, recurse)
        if self.config.tied_output and hasattr(self.tok_embd, "raw") and hasattr(self.output, "raw"):
            self.output.raw = self.tok_embd.raw
        return self

    def new_cache(self, batch_size: int, max_len: int | None = None, dtype: torch.dtype | None = None) -> KVCache:
        """An empty KV cache on the model's device for up to max_len (default n_ctx_train) positions."""
        ref = self.output_norm.weight
        return KVCache.empty(self.config, batch_size, max_len or self.config.n_ctx_train, ref.device,
                             dtype or torch.float32)

    def forward(self, tokens: torch.Tensor, start_pos: int = 0, cache: KVCache | None = None,
                last_only: bool = False, *, positions: torch.Tensor | None = None,
                segments: torch.Tensor | None = None, hidden_only: bool = False) -> torch.Tensor:
        """Logits for ``tokens`` (B, T) at positions start_pos..start_pos+T-1.

        With a cache, the positions continue from ``cache.length`` (``start_pos`` is ignored),
        the new keys/values are stored and the cache advances by T. ``last_only`` returns only
        the last position's logits (B, 1, V): generation needs nothing else. ``hidden_only``
        stops before the output projection and returns the normed hidden states (B, T, C), for a
        loss that applies ``self.output`` itself (ggtorch.training.loss.output_cross_entropy).

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
        c = self.config
        if positions is None:
            cos, sin = rope_angles(start_pos, T, c.n_rot, c.rope_freq_base, c.rope_freq_scale, x.device,
                                   self.rope_freqs)
        else:
            cos, sin = rope_angles_at(positions, c.n_rot, c.rope_freq_base, c.rope_freq_scale,
                                      self.rope_freqs)  # (B, T, n_rot/2)
        mask = None if segments is None else segment_mask(segments)
        with recompute_outputs() if torch.is_grad_enabled() else nullcontext():
            for i, block in enumerate(self.layers):
                kv = (cache.k[i], cache.v[i]) if cache is not None else None
                x = block(x, cos, sin, kv, start_pos, mask)  # (B, T, C)
        if cache is not None:
            cache.length += T
        x = self.output_norm(x)
        if last_only:
            x = x[:, -1:]
        if hidden_only:
            return x  # (B, T, C)
        return self.output(x).float()  # (B, T, V)


def segment_mask(segments: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, T) attention mask: causal within each segment, nothing across (block diagonal)."""
    T = segments.shape[1]
    same = segments[:, :, None] == segments[:, None, :]  # (B, T, T)
    causal = torch.ones(T, T, dtype=torch.bool, device=segments.device).tril()
    return (same & causal)[:, None]


def _init_weights(module: nn.Module) -> None:
    """Small normal init for a model built from a config alone (training from scratch)."""
    if isinstance(module, nn.Linear | nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
