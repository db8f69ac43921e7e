"""Peak memory and time of a LoRA step on a Gemma 3 270M-shaped model with its 262,144-token vocabulary.

Not a test. Builds a random-weight gemma3 GGUF of Gemma 3 270M's shape (n_embd 640, 18 layers,
n_ff 2048, 4 heads / 1 KV head of 256, sliding window 512 on 5 layers in 6, tied output) around a
gemma-like 262,144-token vocabulary (tests/models/test_tokenizer.py), quantizes it with llama.cpp,
then runs LoRA steps in a child process, as `ggtorch finetune` holds the model (quantized base kept
quantized, checkpointing per block), and prints the child's peak RSS and the median step time.

    python bench/bench_family_memory.py --ftype Q4_K_M --batch 4 --ctx 256 --threads 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = r"""
import json, resource, statistics, sys, time
import torch
from ggtorch.io.gguf import read_gguf
from ggtorch.lora import LoraConfig, attach_lora, trainable_parameters
from ggtorch.models.config import ModelConfig
from ggtorch.models.loader import build_model
from ggtorch.training.loss import model_cross_entropy
from ggtorch.training.optim import AdamConfig, GGMLAdamW
from ggtorch.training.run import enable_block_checkpointing

path, batch, ctx, steps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
torch.set_num_threads(threads)
f = read_gguf(path)
config = ModelConfig.from_gguf(f)
model = build_model(f, config, keep_quantized=True)
attach_lora(model, LoraConfig(rank=4), seed=0)
enable_block_checkpointing(model)
optimizer = GGMLAdamW(trainable_parameters(model), AdamConfig())
gen = torch.Generator().manual_seed(0)
times = []
for step in range(steps + 1):
    tokens = torch.randint(0, config.n_vocab, (batch, ctx + 1), generator=gen)
    start = time.perf_counter()
    optimizer.zero_grad()
    hidden = model(tokens[:, :-1], hidden_only=True)
    loss = model_cross_entropy(model, hidden, tokens[:, 1:])
    loss.backward()
    optimizer.step()
    if step:
        times.append(time.perf_counter() - start)
print(json.dumps({"peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  "step_s": statistics.median(times), "loss": float(loss)}))
"""


def build(folder: Path, ftype: str) -> Path:
    from gguf import TokenType

    from ggtorch.io.gguf import read_gguf
    from tests.families import Shape, write_random_model
    from tests.llama_cpp_files import vocab_file
    from tests.llama_models import quantize_with_llama_cpp
    from tests.models.test_tokenizer import write_gemma_like_vocab

    spm = read_gguf(vocab_file("llama-spm"))
    vocab = write_gemma_like_vocab(folder / "vocab.gguf", spm, TokenType.CONTROL)
    shape = Shape(n_embd=640, n_ff=2048, n_layer=18, n_head=4, n_head_kv=1, head_dim=256, n_ctx=32768,
                  sliding_window=512, rope_freq_base=1e6, rope_freq_base_swa=10000.0, tied_output=True)
    f32 = write_random_model(folder / "gemma3-270m-f32.gguf", "gemma3", vocab, shape)
    return quantize_with_llama_cpp(f32, folder / f"gemma3-270m-{ftype}.gguf", ftype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ftype", default="Q4_K_M")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ggtorch-bench-") as tmp:
        path = build(Path(tmp), args.ftype)
        out = subprocess.run([sys.executable, "-c", CHILD, str(path), str(args.batch), str(args.ctx), str(args.steps),
                              str(args.threads)], capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            sys.exit(f"the LoRA step failed:\n{out.stderr[-3000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        size = path.stat().st_size / 2**30
    print(f"gemma3 270M shape, {args.ftype} ({size:.2f} GiB file), LoRA r4, batch {args.batch} x ctx {args.ctx}: "
          f"peak RSS {result['peak_rss_gib']:.2f} GiB, {result['step_s']:.1f} s per step "
          f"({args.batch * args.ctx / result['step_s']:.0f} tok/s), loss {result['loss']:.2f}")


if __name__ == "__main__":
    main()
