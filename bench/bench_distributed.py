"""Data-parallel overhead: ``ggtorch finetune`` tokens/s in 1 process vs N torchrun ranks (gloo, 1 thread each).

Each rank trains ``--batch`` sequences per optimizer step (the per-rank batch), so N ranks
process N times the tokens of one process per step; ideal scaling is N× the tokens/s. What is
lost is the gradient all-reduce (DDP over the LoRA parameters only), the two small all-reduces
of the step's token count and loss, and each rank building every rank's batch of the step.

tok/s: median over the steps after ``--warmup`` of the global tokens of a step / its time on
rank 0 (read from the JSONL training log). Prints a Markdown table, one row per world size, and rewrites
its section of BENCHMARKS.md (``--out``; bench_vs_peft.py keeps it when it rewrites the rest).

Usage: python bench/bench_distributed.py [--model M.gguf] [--ctx 64] [--batch 8] [--steps 20] [--ranks 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_peft import write_section  # noqa: E402  (this folder's sibling)

from tests.fixtures import SHAKESPEARE, STORIES260K  # noqa: E402  (bench_vs_peft put the repository on sys.path)

HEADING = "## Data-parallel overhead (torchrun, `python bench/bench_distributed.py"
"""The start of this command's section of BENCHMARKS.md, up to its options."""


def run(world: int, args: list[str], folder: Path) -> list[float]:
    """tokens/s of each step of a finetune in ``world`` processes (``world`` 1: no torchrun)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
                if world > 1 else [sys.executable])
    log = folder / f"log-{world}.jsonl"
    cmd = [*launcher, "-m", "ggtorch", "finetune", *args, "--log-file", str(log)]
    subprocess.run(cmd, cwd=folder, env=env, check=True, stdout=subprocess.DEVNULL)
    return [r["tokens_per_second"] for r in map(json.loads, log.read_text().splitlines()) if r["kind"] == "iter"]


def _allreduce_worker(rank: int, world: int, store: str, numel: int, repeats: int, out: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    grads, small = torch.ones(numel), torch.ones(2)
    timings = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(grads)  # DDP's gradient bucket(s)
        dist.all_reduce(small)  # the step's token count
        dist.all_reduce(small)  # the step's loss and stop flag
        timings.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(statistics.median(timings))
    dist.destroy_process_group()


def collectives_ms(numel: int, world: int, repeats: int = 50) -> float:
    """Median ms of one step's collectives alone (gradient all-reduce + two scalar all-reduces), gloo."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_allreduce_worker, args=(r, world, f"{tmp}/store", numel, repeats, queue))
                 for r in range(world)]
        for p in procs:
            p.start()
        result = queue.get(timeout=120)
        for p in procs:
            p.join()
    return 1000 * result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=STORIES260K)
    p.add_argument("--data", type=Path, default=SHAKESPEARE)
    p.add_argument("--ctx", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="first steps not timed")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "BENCHMARKS.md"),
                   help="the report whose section to rewrite ('' to print only)")
    a = p.parse_args()
    args = ["--model-base", str(a.model), "--train-data", str(a.data), "-c", str(a.ctx), "-b", str(a.batch),
            "-n", str(a.steps + a.warmup), "--threads", "1", "--seed", "1", "--save-every", "0",
            "--checkpoint-in", "none.gguf", "--checkpoint-out", "", "--lora-out", ""]
    load = os.getloadavg()[0]
    results = {}
    with tempfile.TemporaryDirectory(prefix="ggtorch-bench-ddp-") as tmp:
        for world in (1, a.ranks):
            results[world] = statistics.median(run(world, args, Path(tmp))[a.warmup:])
        start = json.loads((Path(tmp) / "log-1.jsonl").read_text().splitlines()[0])
    n_trainable = int(start["trainable_parameters"])
    sync_ms = collectives_ms(n_trainable, a.ranks)
    one = results[1]
    lines = [f"{a.model.name}, ctx {a.ctx}, batch {a.batch} per rank, {a.steps} timed steps, 1 thread per process, "
             f"gloo on this machine; torch {torch.__version__}, {os.cpu_count()} cores, load {load:.2f}", "",
             "| processes | tok/s (all ranks) | ms per step | vs 1 process | scaling efficiency |",
             "|---:|---:|---:|---:|---:|"]
    for world, tps in results.items():
        ms = 1000 * world * a.batch * a.ctx / tps
        lines.append(f"| {world} | {tps:.0f} | {ms:.0f} | {tps / one:.2f}× | {tps / (world * one):.0%} |")
    lines += ["", f"The collectives of one step alone ({a.ranks} ranks: all-reduce of {n_trainable:,} f32 gradients "
              f"+ 2 scalar all-reduces): {sync_ms:.2f} ms"]
    print("\n".join(lines), flush=True)
    if a.out:
        options = "".join(f" --{name} {getattr(a, name)}" for name in ("ctx", "batch", "steps", "warmup", "ranks")
                          if getattr(a, name) != p.get_default(name))
        section = (f"{HEADING}{options}`)\n\n"
                   "`ggtorch finetune` of stories260K in 1 process and under `torchrun` with 2 ranks (gloo, 1 thread "
                   "each, `--batch` per rank): tokens/s over all ranks, and the step's collectives timed alone.\n\n"
                   + "\n".join(lines) + "\n")
        write_section(Path(a.out), HEADING, section)


if __name__ == "__main__":
    main()
