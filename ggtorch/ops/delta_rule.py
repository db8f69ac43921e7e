"""The gated delta rule of Gated DeltaNet (Qwen3.5's linear-attention layers), a chunk of tokens at a time.

Per head a state S (Dk x Dv) runs over the tokens: S <- exp(g_t) S, then S <- S + k_t u_t^T with the new value
u_t = beta_t (v_t - S^T k_t), and the output is o_t = S^T q_t (llama.cpp's build_delta_net_autoregressive). A loop
over tokens would be T small products; here the tokens of a chunk go together (DeltaNet's WY form, as llama.cpp's
build_delta_net_chunking and flash-linear-attention's chunk_gated_delta_rule compute it). Within a chunk, with G the
running sum of g and S0 the state before it, the new values are U = W - Kc S0, where (I + M) W = diag(beta) V and
(I + M) Kc = diag(beta exp(G)) K solve one unit lower-triangular system (M[t, s] = beta_t exp(G_t - G_s) k_t.k_s for
s < t); the outputs and the next state are then a few matrix products per chunk. Gradients come from autograd
through the same products, so the backward is chunked as well. Those products are most of a hybrid model's
activations (some 60 MiB a layer at Qwen3.5-0.8B's widths and 512 tokens): the mixer that calls the rule in training
keeps only its inputs and runs it again in backward (``models/delta_net.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ggtorch.ops import policy


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor | None = None, chunk: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs (B, T, H, Dv) in v's dtype and the final state (B, H, Dk, Dv) in f32.

    q, k (B, T, H, Dk), already normalized and (q) scaled; v (B, T, H, Dv); g (B, T, H) the log decay of each
    token (<= 0); beta (B, T, H) its write strength in [0, 1]; ``state`` the state before the first token (None:
    zeros, a sequence's start). Computed in f32 in chunks of the device policy's ``delta_rule_chunk`` tokens.
    """
    B, T, H, Dk = k.shape
    dtype = v.dtype
    Dv = v.shape[-1]
    size = chunk or policy.current(q.device).delta_rule_chunk
    pad = (-T) % size  # padded tokens (g = beta = 0, k = 0) leave the state as it is
    n = (T + pad) // size

    def chunked(x: torch.Tensor) -> torch.Tensor:  # (B, T, H, ...) -> (B, H, n, size, ...) f32
        x = x.float().transpose(1, 2)
        if pad:
            x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
        return x.reshape(B, H, n, size, *x.shape[3:])

    q, k, v, g, beta = chunked(q), chunked(k), chunked(v), chunked(g), chunked(beta)
    cum = g.cumsum(-1)  # (B, H, n, C): G
    lower = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    # exp(G_t - G_s) for s <= t, 0 above the diagonal (masked before exp: those differences may overflow)
    decay = torch.exp((cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")))
    system = (k @ k.transpose(-1, -2) * decay * beta[..., None]).tril(-1)
    system = system + torch.eye(size, dtype=system.dtype, device=system.device)
    rhs = torch.cat((v * beta[..., None], k * (beta * cum.exp())[..., None]), dim=-1)
    w, kc = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split((Dv, Dk), dim=-1)
    scores = q @ k.transpose(-1, -2) * decay  # (B, H, n, C, C): within the chunk, s <= t
    q_decayed = q * cum.exp()[..., None]  # what reads the state of the chunk's start
    k_to_end = k * torch.exp(cum[..., -1:] - cum)[..., None]  # each token's write, decayed to the chunk's end
    chunk_decay = cum[..., -1].exp()[..., None, None]  # (B, H, n, 1, 1)
    s = q.new_zeros(B, H, Dk, Dv) if state is None else state.float()
    outputs = []
    for i in range(n):
        u = w[:, :, i] - kc[:, :, i] @ s  # (B, H, C, Dv): the new values
        outputs.append(q_decayed[:, :, i] @ s + scores[:, :, i] @ u)
        s = s * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    o = torch.stack(outputs, dim=2).reshape(B, H, n * size, Dv)[:, :, :T]
    return o.transpose(1, 2).to(dtype), s
