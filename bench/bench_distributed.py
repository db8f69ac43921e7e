"""Data-parallel overhead: ``ggtorch finetune`` tokens/s in 1 process vs N torchrun ranks (gloo, 1 thread each).

Each rank trains ``--batch`` sequences per optimizer step (the per-rank batch), so N ranks
process N times the tokens of one process per step; ideal scaling is N× the tokens/s. What is
lost is the gradient all-reduce (DDP over the LoRA parameters only), the two small all-reduces
of the step's token count and loss, and each rank building every rank's batch of the step.

tok/s: median over the steps after ``--warmup`` of the global tokens of a step / its time on
rank 0 (read from the JSONL training log). Prints one Markdown table row per world size.

Usage: python bench/bench_distributed.py [--model M.gguf] [--ctx 64] [--batch 8] [--steps 20] [--ranks 2]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("GGTORCH_SHARED", REPO.parent / "shared"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(world: int, args: list[str], folder: Path) -> list[float]:
    """tokens/s of each step of a finetune in ``world`` processes (``world`` 1: no torchrun)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
                 "--master-addr", "127.0.0.1", "--master-port", str(free_port())] if world > 1
                else [sys.executable])
    log = folder / f"log-{world}.jsonl"
    cmd = [*launcher, "-m", "ggtorch", "finetune", *args, "--log-file", str(log)]
    subprocess.run(cmd, cwd=folder, env=env, check=True, stdout=subprocess.DEVNULL)
    return [r["tokens_per_second"] for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "iter"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=SHARED / "models" / "stories260K.gguf")
    p.add_argument("--data", type=Path, default=SHARED / "data" / "tinyshakespeare.txt")
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="first steps not timed")
    p.add_argument("--ranks", type=int, default=2)
    a = p.parse_args()
    args = ["--model-base", str(a.model), "--train-data", str(a.data), "-c", str(a.ctx), "-b", str(a.batch),
            "-n", str(a.steps + a.warmup), "--threads", "1", "--seed", "1", "--save-every", "0",
            "--checkpoint-in", "none.gguf", "--checkpoint-out", "", "--lora-out", ""]
    load = os.getloadavg()[0]
    results = {}
    with tempfile.TemporaryDirectory(prefix="ggtorch-bench-ddp-") as tmp:
        for world in (1, a.ranks):
            results[world] = statistics.median(run(world, args, Path(tmp))[a.warmup:])
    one = results[1]
    print(f"# {a.model.name}, ctx {a.ctx}, batch {a.batch} per rank, {a.steps} timed steps, 1 thread per "
          f"process, gloo on loopback; torch {torch.__version__}, {os.cpu_count()} cores, load {load:.2f}")
    print("| processes | tok/s (all ranks) | vs 1 process | scaling efficiency |")
    print("|---:|---:|---:|---:|")
    for world, tps in results.items():
        print(f"| {world} | {tps:.0f} | {tps / one:.2f}× | {tps / (world * one):.0%} |")


if __name__ == "__main__":
    main()
