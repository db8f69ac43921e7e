"""Dequantization throughput per ggml type: ggtorch vs gguf-py (numpy), side by side.

ggtorch's ``dequantize`` takes the native C decoders (ggtorch/quant/native.c) for the types they have on
CPU, and the torch decoders for the rest; the "torch decoders" column is those alone, every other device's
path. Throughput is GB/s of float32 output. The input is random bytes of the type's block size
(scales included: the cost of decoding does not depend on the values). Not a test.

    python bench/bench_dequant.py            # 4096 x 4096 values per type, best of 3
    python bench/bench_dequant.py --quick    # 1024 x 4096, best of 2
    python bench/bench_dequant.py --quick --threads 1 --types q4_0,q4_k
"""

from __future__ import annotations

import argparse
import time
import warnings
from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from ggtorch.ops import policy
from ggtorch.quant import SUPPORTED_TYPES, dequantize


def best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: lazy tables, allocator
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller tensors, fewer repeats")
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--types", default="", help="comma-separated type names (default: all supported)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (default: torch's choice; on a shared, busy machine 1 "
                             "avoids OpenMP threads spinning against other processes)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = args.rows or (1024 if args.quick else 4096)
    repeats = 2 if args.quick else 3
    types = sorted(SUPPORTED_TYPES, key=int)
    if args.types:
        types = [GGMLQuantizationType[name.strip().upper()] for name in args.types.split(",")]

    rng = np.random.default_rng(0)
    gb = rows * args.cols * 4 / 1e9
    print(f"{rows} x {args.cols} values per type, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, best of {repeats}")
    print(f"{'type':8s} {'ggtorch GB/s':>13s} {'torch decoders':>15s} {'gguf-py GB/s':>13s} {'ratio':>7s}")
    for qtype in types:
        bs, ts = GGML_QUANT_SIZES[qtype]
        raw_np = rng.integers(0, 256, size=(rows, args.cols // bs * ts), dtype=np.uint8)
        raw = torch.from_numpy(raw_np)
        t_torch = best_time(lambda: dequantize(raw, qtype, (rows, args.cols)), repeats)  # noqa: B023
        with policy.using(policy.current("cpu").replace(c_dequantize=False)):
            t_eager = best_time(lambda: dequantize(raw, qtype, (rows, args.cols)), repeats)  # noqa: B023
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            t_numpy = best_time(lambda: gguf_dequantize(raw_np, qtype), repeats)  # noqa: B023
        print(f"{qtype.name:8s} {gb / t_torch:13.2f} {gb / t_eager:15.2f} {gb / t_numpy:13.2f} "
              f"{t_numpy / t_torch:6.1f}x", flush=True)
    if GGMLQuantizationType.F32 in types:
        print("F32: gguf-py returns a view of the bytes (no work); ggtorch returns an owned copy.")


if __name__ == "__main__":
    main()
