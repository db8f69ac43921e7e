"""Gated DeltaNet, the linear-attention mixer of Qwen3.5's hybrid layers, as llama.cpp's qwen35 graph computes it.

In a recurrent layer this module takes attention's place (``layers.{i}.attn``): one fused projection gives q, k and v
(``attn_qkv``), a short causal convolution over the tokens mixes each channel with the few before it, SiLU; q and k
are L2-normalized per head and q scaled by 1/sqrt(head width); each value head runs a state through the gated delta
rule (``ggtorch.ops.delta_rule``) with its decay g = softplus(alpha(x) + dt_bias) * a and write strength
beta = sigmoid(beta(x)); the outputs are RMS-normed per head, multiplied by SiLU of the gate z (``attn_gate``) and
projected back (``ssm_out``). Value head h reads key head h mod the key-head count (ggml's broadcast; llama.cpp's
converter orders the value heads for it). Computed in f32 whatever the activation dtype, as ggml does.

Shapes: B batch, T tokens, Hk key heads, Hv value heads, D head width (keys and values alike), K convolution taps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ggtorch.models.config import ModelConfig
from ggtorch.models.norm import RMSNorm
from ggtorch.ops.delta_rule import gated_delta_rule
from ggtorch.ops.fused import rms_norm
from ggtorch.ops.matmul import Linear
from ggtorch.ops.recompute import checkpoint


@dataclass
class RecurrentState:
    """What a DeltaNet layer carries from one call to the next in generation: the last K - 1 inputs of its
    convolution (B, K - 1, channels) and the delta rule's state (B, Hv, D, D); None before the first token."""

    conv: torch.Tensor | None = None
    ssm: torch.Tensor | None = None


class GatedDeltaNet(nn.Module):
    """A recurrent layer's mixer: (B, T, C) -> (B, T, C), called like Attention."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        c = config
        self.n_k_heads, self.n_v_heads, self.head_dim = c.ssm_k_heads, c.ssm_v_heads, c.ssm_state
        self.key_dim = c.ssm_k_heads * c.ssm_state
        channels = c.ssm_conv_channels
        self.qkv = Linear(c.n_embd, channels, bias=False)
        self.gate = Linear(c.n_embd, c.ssm_inner, bias=False)
        """z: the output's gate, SiLU(z) per value channel."""
        self.beta = Linear(c.n_embd, c.ssm_v_heads, bias=False)
        self.alpha = Linear(c.n_embd, c.ssm_v_heads, bias=False)
        self.out = Linear(c.ssm_inner, c.n_embd, bias=False)
        self.norm = RMSNorm(c.ssm_state, c.rms_eps)
        self.conv = nn.Parameter(torch.zeros(channels, c.ssm_conv_kernel))
        """``ssm_conv1d``: per channel, the weights of its K taps, oldest first."""
        self.dt_bias = nn.Parameter(torch.zeros(c.ssm_v_heads))
        self.a = nn.Parameter(torch.zeros(c.ssm_v_heads))
        """``ssm_a`` = -exp(A_log): the decay rate of each value head (negative)."""
        self.eps = c.rms_eps
        self.group_forward = None
        """Unused: the projections run one by one (the attribute LoRA's attach sets on every mixer)."""

    def forward(self, x: torch.Tensor, rope: object = None, kv: RecurrentState | None = None, start_pos: int = 0,
                attn_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``kv``: the layer's state in generation (read and advanced); ``positions`` of packed rows (each record
        starts at 0) keep the records apart. Rope and the attention mask mean nothing here."""
        mixed = self.qkv(x).float()  # (B, T, channels)
        z = self.gate(x)
        beta = torch.sigmoid(self.beta(x).float())  # (B, T, Hv)
        g = F.softplus(self.alpha(x).float() + self.dt_bias.float()) * self.a.float()  # (B, T, Hv), <= 0
        if kv is None:  # whole sequences: in training, only these four inputs are kept for backward
            o = checkpoint(self._gated_outputs, mixed, z, beta, g, positions)
        else:
            o, _ = self._mix(mixed, beta, g, kv)
            o = self._gate(o, z)
        return self.out(o.to(x.dtype))

    def _gated_outputs(self, mixed: torch.Tensor, z: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                       positions: torch.Tensor | None) -> torch.Tensor:
        """From the projections to what ``ssm_out`` reads, sequences starting afresh at each record of packed rows.
        Under autograd a recomputed region (:func:`ggtorch.ops.recompute.checkpoint`): the convolution, the norms
        and the delta rule's chunks keep 8-10 tensors the size of ``mixed`` for backward, which makes them
        again from these inputs for one more pass of the rule, as flash-linear-attention's kernels recompute
        theirs."""
        if positions is None:
            o, _ = self._mix(mixed, beta, g, None)
        else:
            packed = _Records(positions)
            o, _ = self._mix(packed.pad(mixed), packed.pad(beta), packed.pad(g), None)
            o = packed.unpad(o)
        return self._gate(o, z)

    def _gate(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """The rule's outputs (B, T, Hv, D) RMS-normed per head and gated by SiLU(z): (B, T, Hv·D)."""
        B, T = o.shape[:2]
        o = rms_norm(o, self.norm.weight, self.eps) * F.silu(z.float().view(B, T, self.n_v_heads, self.head_dim))
        return o.reshape(B, T, -1)

    def _mix(self, mixed: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
             state: RecurrentState | None) -> tuple[torch.Tensor, RecurrentState | None]:
        """Convolution, normalization and the delta rule over whole sequences (B, T, ...): outputs (B, T, Hv, D)."""
        B, T, _ = mixed.shape
        taps = self.conv.shape[1]
        before = state.conv if state is not None and state.conv is not None else mixed.new_zeros(B, taps - 1,
                                                                                             mixed.shape[-1])
        window = torch.cat((before, mixed), dim=1)  # (B, K - 1 + T, channels)
        conv = window[:, 0:T] * self.conv[:, 0].float()
        for tap in range(1, taps):  # ggml_ssm_conv's sum, oldest tap first
            conv = conv + window[:, tap:tap + T] * self.conv[:, tap].float()
        conv = F.silu(conv)
        q, k, v = conv.split((self.key_dim, self.key_dim, self.n_v_heads * self.head_dim), dim=-1)
        q, k = (_l2_norm(t.reshape(B, T, self.n_k_heads, self.head_dim), self.eps) for t in (q, k))
        repeat = self.n_v_heads // self.n_k_heads
        if repeat > 1:  # value head h reads key head h mod Hk (ggml_repeat tiles)
            q, k = q.repeat(1, 1, repeat, 1), k.repeat(1, 1, repeat, 1)
        q = q * self.head_dim ** -0.5
        v = v.reshape(B, T, self.n_v_heads, self.head_dim)
        o, ssm = gated_delta_rule(q, k, v, g, beta, state.ssm if state is not None else None)
        if state is not None:
            state.conv, state.ssm = window[:, -(taps - 1):].detach(), ssm.detach()
        return o, state


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim: llama.cpp's build_gdn_l2_norm (an RMS norm with eps / n, then
    1/sqrt(n))."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


class _Records:
    """Packed rows (several records one after the other, each at positions from 0) laid out one record per row,
    padded at the end, so that a recurrence starts afresh at each record; and back."""

    def __init__(self, positions: torch.Tensor) -> None:
        B, T = positions.shape
        flat = positions.reshape(-1)
        starts = flat == 0
        starts[::T] = True  # every row begins a record
        index = torch.arange(flat.numel(), device=flat.device)
        self.record = starts.cumsum(0) - 1  # (B·T): each token's record
        self.offset = index - torch.cummax(torch.where(starts, index, 0), dim=0).values  # its place in the record
        self.shape = (int(self.record[-1]) + 1, int(self.offset.max()) + 1)
        self.rows = (B, T)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (records, longest, ...), zeros after each record's end."""
        flat = x.reshape(-1, *x.shape[2:])
        out = flat.new_zeros(*self.shape, *x.shape[2:])
        return out.index_put((self.record, self.offset), flat)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """(records, longest, ...) -> (B, T, ...)."""
        return x[self.record, self.offset].reshape(*self.rows, *x.shape[2:])
