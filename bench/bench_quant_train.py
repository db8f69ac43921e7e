"""Forward+backward time per token of LoRA training: quantized base vs dequantized f32 vs bf16.

Not a test. Builds a random-weight llama of about 112M parameters (n_embd 1024, n_ff 2816,
4 layers, the 32000-token vocabulary) with ``tests/llama_models.py``, quantizes it with
llama.cpp's own quantizer per type, attaches rank-4 LoRA to every matrix and times one
forward+backward of a (batch, ctx) token batch in four setups:

- ``quant``: base kept as ggml blocks, dequantized on the fly (f32 compute)
- ``quant+bf16``: the same under bf16 autocast
- ``f32``: base dequantized to f32 up front
- ``bf16``: base dequantized to bf16 up front, bf16 autocast

Run from the repository root: ``python bench/bench_quant_train.py [--quick]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ggtorch.io.gguf import read_gguf  # noqa: E402
from ggtorch.lora import LoraConfig, attach_lora, trainable_parameters  # noqa: E402
from ggtorch.models.loader import load_model_file  # noqa: E402
from tests.llama_cpp_files import vocab_file  # noqa: E402
from tests.llama_models import RandomLlamaShape, quantize_with_llama_cpp, write_random_llama  # noqa: E402

SHAPE = RandomLlamaShape(n_embd=1024, n_ff=2816, n_layer=4, n_head=16, n_head_kv=8)
SETUPS = {  # name -> (keep_quantized, base dtype, autocast dtype or None)
    "quant": (True, torch.float32, None),
    "quant+bf16": (True, torch.float32, torch.bfloat16),
    "f32": (False, torch.float32, None),
    "bf16": (False, torch.bfloat16, torch.bfloat16),
}


def model_file(workdir: Path, ftype: str) -> Path:
    """The benchmark model in ``ftype``, built once and cached in ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    f32 = workdir / "bench-llama-f32.gguf"
    if not f32.exists():
        write_random_llama(f32, vocab_file("llama-spm"), SHAPE, seed=0)
    if ftype == "F32":
        return f32
    path = workdir / f"bench-llama-{ftype}.gguf"
    if not path.exists():
        quantize_with_llama_cpp(f32, path, ftype)
    return path


def time_setup(path: Path, setup: str, batch: int, ctx: int, reps: int) -> float:
    """Median seconds per token of forward+backward (after one warm-up step)."""
    keep_quantized, dtype, autocast = SETUPS[setup]
    model = load_model_file(path, keep_quantized=keep_quantized, dtype=dtype).model
    attach_lora(model, LoraConfig(rank=4), seed=1)
    params = [p for _, p, _ in trainable_parameters(model)]
    gen = torch.Generator().manual_seed(0)
    times = []
    for i in range(reps + 1):
        tokens = torch.randint(0, model.config.n_vocab, (batch, ctx + 1), generator=gen)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=autocast) if autocast else nullcontext():
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        if i:
            times.append(time.perf_counter() - t0)
        for p in params:
            p.grad = None
    return statistics.median(times) / (batch * ctx)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="Q4_0 and Q8_0 only, 2 timed steps, ctx 64")
    ap.add_argument("--types", default="Q8_0,Q4_0,Q5_K_M,Q4_K_M,Q6_K,IQ4_XS", help="llama.cpp ftypes")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ggtorch-bench"))
    args = ap.parse_args()
    if args.quick:
        args.types, args.reps, args.ctx = "Q4_0,Q8_0", 2, 64
    if args.threads:
        torch.set_num_threads(args.threads)
    f32_tensors = read_gguf(model_file(args.workdir, "F32")).tensors.values()
    n_params = sum(math.prod(t.shape) for t in f32_tensors)
    print(f"model: {n_params / 1e6:.0f}M parameters, batch {args.batch} x ctx {args.ctx}, "
          f"{torch.get_num_threads()} threads; ms per token of forward+backward (lower is better)")
    header = f"{'type':8s}" + "".join(f"{s:>12s}" for s in SETUPS) + f"{'quant/f32':>11s}"
    print(header)
    for ftype in args.types.split(","):
        path = model_file(args.workdir, ftype)
        ms = {s: 1e3 * time_setup(path, s, args.batch, args.ctx, args.reps) for s in SETUPS}
        print(f"{ftype:8s}" + "".join(f"{ms[s]:12.2f}" for s in SETUPS) + f"{ms['quant'] / ms['f32']:11.2f}x",
              flush=True)


if __name__ == "__main__":
    main()
