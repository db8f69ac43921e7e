"""The chunked gated delta rule against the rule itself, written here token by token in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ggtorch.ops import policy
from ggtorch.ops.delta_rule import gated_delta_rule


def recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's build_delta_net_autoregressive one token at a time, in the inputs' dtype: decay the state, write
    beta (v - S^T k) at k, read S^T q."""
    B, T, H, Dk = k.shape
    s = torch.zeros(B, H, Dk, v.shape[-1], dtype=q.dtype) if state is None else state.to(q.dtype)
    out = []
    for t in range(T):
        s = s * g[:, t].exp()[..., None, None]
        u = (v[:, t] - torch.einsum("bhkv,bhk->bhv", s, k[:, t])) * beta[:, t, :, None]
        s = s + k[:, t, :, :, None] * u[:, :, None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]))
    return torch.stack(out, dim=1), s


def inputs(T: int, seed: int = 0, B: int = 2, H: int = 3, D: int = 8, decay: float = 1.0) -> list[torch.Tensor]:
    """Normalized q and k (q scaled), decays that forget over a few to a few dozen tokens, write strengths in
    (0, 1), float64."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, D, generator=gen, dtype=torch.float64), dim=-1) / D ** 0.5
    k = F.normalize(torch.randn(B, T, H, D, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(B, T, H, D, generator=gen, dtype=torch.float64)
    g = -F.softplus(torch.randn(B, T, H, generator=gen, dtype=torch.float64)) * decay
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    return [q, k, v, g, beta]


@pytest.mark.parametrize("T,chunk", [(1, 64), (37, 4), (64, 64), (130, 64), (100, 16)])
def test_outputs_and_final_state_equal_the_token_by_token_rule(T: int, chunk: int) -> None:
    q, k, v, g, beta = inputs(T)
    state = torch.randn(2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
    with policy.using(policy.for_device("cpu").replace(delta_rule_chunk=chunk)):
        out, final = gated_delta_rule(*(t.float() for t in (q, k, v, g, beta)), state.float())
    ref, ref_final = recurrence(q, k, v, g, beta, state)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(final.double(), ref_final, rtol=0, atol=2e-6)


def test_strong_decay_underflows_to_forgetting_not_to_nan() -> None:
    """Decays of -30 a token: exp of a chunk's running sum underflows to 0 in f32, which must mean forgotten."""
    q, k, v, g, beta = inputs(80, decay=30.0)
    out, final = gated_delta_rule(*(t.float() for t in (q, k, v, g, beta)))
    ref, ref_final = recurrence(q, k, v, g, beta)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=2e-6)


def test_two_calls_carrying_the_state_equal_one() -> None:
    """Generation's use: the state after the first tokens continues the rule for the next."""
    q, k, v, g, beta = (t.float() for t in inputs(50))
    whole, whole_state = gated_delta_rule(q, k, v, g, beta)
    first, state = gated_delta_rule(q[:, :29], k[:, :29], v[:, :29], g[:, :29], beta[:, :29])
    second, final = gated_delta_rule(q[:, 29:], k[:, 29:], v[:, 29:], g[:, 29:], beta[:, 29:], state)
    torch.testing.assert_close(torch.cat((first, second), dim=1), whole, rtol=0, atol=5e-6)
    torch.testing.assert_close(final, whole_state, rtol=0, atol=5e-6)


def test_gradients_equal_autograd_through_the_recurrence() -> None:
    """Every input's gradient (the initial state's too) from the chunked rule in f32 against float64 autograd
    through the token-by-token rule, for a loss that weighs every output and the final state."""
    torch.manual_seed(0)
    leaves = [t.requires_grad_() for t in inputs(100)]
    state = torch.randn(2, 3, 8, 8, dtype=torch.float64, requires_grad=True)
    w_out, w_state = torch.randn(2, 100, 3, 8, dtype=torch.float64), torch.randn(2, 3, 8, 8, dtype=torch.float64)
    ref, ref_state = recurrence(*leaves, state)
    ((ref * w_out).sum() + (ref_state * w_state).sum()).backward()
    expected = [t.grad.clone() for t in (*leaves, state)]
    ours = [t.detach().float().requires_grad_() for t in (*leaves, state)]
    with policy.using(policy.for_device("cpu").replace(delta_rule_chunk=32)):
        out, final = gated_delta_rule(*ours)
    ((out * w_out.float()).sum() + (final * w_state.float()).sum()).backward()
    for name, got, want in zip(("q", "k", "v", "g", "beta", "state"), (t.grad for t in ours), expected, strict=True):
        scale = want.abs().max().item()
        assert (got.double() - want).abs().max().item() <= 2e-5 * max(scale, 1.0), name


def test_bf16_inputs_give_bf16_outputs_computed_in_f32() -> None:
    q, k, v, g, beta = (t.float() for t in inputs(40))
    out, _ = gated_delta_rule(q, k, v.bfloat16(), g, beta)
    full, _ = gated_delta_rule(q, k, v.bfloat16().float(), g, beta)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, full.bfloat16(), rtol=0, atol=0)
