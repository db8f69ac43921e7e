"""f32 GEMM on this CPU: torch.mm (MKL) against ggtorch.ops.matmul (oneDNN), the products training runs.

For each matrix of a 110M and a TinyLlama-shaped llama, the forward product ``x @ W.T`` and the
input gradient ``dY @ W`` with N rows (batch x context), plus the fused loss's 256-row chunks of
the output projection; best of several repetitions each, the ratio ggtorch/torch.mm last.
Run from the repository root: ``python bench/bench_gemm.py [--rows 1024] [--threads N]``.
"""

from __future__ import annotations

import argparse
import os
from functools import partial

import torch
from bench_dequant import best_time  # this folder: run as python bench/bench_gemm.py

from ggtorch.ops import matmul, policy

SHAPES = {  # (out, in) of the distinct matrices
    "110M": [(768, 768), (2048, 768), (768, 2048), (32000, 768)],
    "1.1B": [(2048, 2048), (256, 2048), (5632, 2048), (2048, 5632), (32000, 2048)],
}


def _compare(name: str, shapes: list[tuple[int, int]], n_rows: int) -> list[float]:
    """torch.mm's time over oneDNN's for each product of one model's matrices, forward and input gradient."""
    ratios = []
    for out_f, in_f in shapes:
        w = torch.randn(out_f, in_f)
        for n in [n_rows] + ([256] if out_f == 32000 else []):
            x, dy = torch.randn(n, in_f), torch.randn(n, out_f)
            flops = 2.0 * n * in_f * out_f
            for label, ref, ours in (
                    (f"fwd {n}x{in_f} -> {out_f}", partial(torch.matmul, x, w.T), partial(matmul.mm_t, x, w)),
                    (f"grad {n}x{out_f} -> {in_f}", partial(torch.matmul, dy, w), partial(matmul.mm, dy, w))):
                reps = max(3, min(20, int(3e9 / flops)))
                t_ref, t_ours = best_time(ref, reps), best_time(ours, reps)
                ratios.append(t_ref / t_ours)
                print(f"{name:>8} {label:>28} {flops / t_ref / 1e9:14.0f} {flops / t_ours / 1e9:13.0f} "
                      f"{t_ref / t_ours:5.2f}x", flush=True)
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1024, help="rows of x (batch x context)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    big = torch.ones(args.rows, 768)
    print(f"torch {torch.__version__}, {args.threads} threads, f32, CPU vendor {policy.cpu_vendor() or '?'}; "
          f"ggtorch's f32 products on oneDNN here: {matmul.uses_onednn(big, torch.ones(768, 768))} "
          "(the ggtorch column below is oneDNN either way)")
    print(f"{'model':>8} {'product (rows x in -> out)':>28} {'torch.mm GF/s':>14} {'ggtorch GF/s':>13} {'ratio':>6}")
    with policy.using(policy.current("cpu").replace(onednn_f32=True)):
        ratios = [ratio for name, shapes in SHAPES.items() for ratio in _compare(name, shapes, args.rows)]
    geo = torch.tensor(ratios).log().mean().exp().item()
    print(f"geometric mean ggtorch/torch.mm: {geo:.2f}x")


if __name__ == "__main__":
    main()
