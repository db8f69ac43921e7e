"""What bench_moe.py and bench_hybrid.py share: child processes that each time a few LoRA steps, and rounds of them.

Each configuration runs in a fresh interpreter (so its peak RSS is its own), the configurations alternating round
after round (the machine's speed drifts by 10-25% within minutes, which one short run per configuration would put
into the ratios); a configuration's figure is its fastest round.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

MEASURE = r"""
import json, resource, statistics, sys, time
import torch
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
gen = torch.Generator().manual_seed(0)

def peak_rss_gib():
    # VmHWM: this process's own peak since its exec. Linux's ru_maxrss keeps, across fork and exec, the parent's
    # resident set at the fork, which a parent holding a freshly built model would put into every child's figure.
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

def measure(step):
    times, loss = [], None
    for i in range(spec["steps"] + 1):
        tokens = torch.randint(0, spec["n_vocab"], (spec["batch"], spec["ctx"] + 1), generator=gen)
        start = time.perf_counter()
        loss = step(tokens)
        if i:
            times.append(time.perf_counter() - start)
    print(json.dumps({"peak_rss_gib": peak_rss_gib(), "step_s": statistics.median(times), "loss": float(loss)}))
"""
"""The head of every child's source: its spec from argv, ``measure(step)`` timing ``spec["steps"]`` steps on random
batches after one untimed step and printing the median step time and the peak RSS (VmHWM) as its last line."""

GGTORCH_STEPS = r"""
from ggtorch.lora import trainable_parameters
from ggtorch.ops import fused, malloc
from ggtorch.training.loss import model_cross_entropy
from ggtorch.training.optim import AdamConfig, GGMLAdamW

malloc.keep_freed_memory()  # as the ggtorch command sets glibc's malloc up for a run
optimizer = GGMLAdamW(trainable_parameters(model), AdamConfig())

def step(tokens):
    optimizer.zero_grad()
    with fused.recompute_outputs():  # as the Trainer's forward: norm and gated-unit outputs made again in backward
        hidden = model(tokens[:, :-1], hidden_only=True)
    loss = model_cross_entropy(model, hidden, tokens[:, 1:])
    loss.backward()
    optimizer.step()
    return float(loss)

measure(step)
"""
"""The tail of a ggtorch child, after the source that builds ``model`` with its adapters: AdamW and the timed steps,
each the Trainer's step without activation checkpointing (``--no-checkpointing``): the forward under
``recompute_outputs``, the fused output projection and cross-entropy, glibc's malloc set up as the ``ggtorch``
command sets it."""

PEER_STEPS = r"""
import torch.nn.functional as F

model.train()
params = [p for p in model.parameters() if p.requires_grad]
optimizer = torch.optim.AdamW(params, lr=1e-3)

def step(tokens):
    optimizer.zero_grad(set_to_none=True)
    logits = model(input_ids=tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    return float(loss)

measure(step)
"""
"""The tail of a transformers + peft child, after the source that builds the peft ``model``: torch's AdamW and the
timed steps."""


def run_rounds(configs: Sequence[tuple[str, str]], spec_of: Callable[[str], dict[str, Any]],
               rounds: int) -> dict[str, list[dict[str, float]]]:
    """Each (label, child source) of ``configs`` run ``rounds`` times, alternating: its results by label."""
    results: dict[str, list[dict[str, float]]] = {label: [] for label, _ in configs}
    for _ in range(rounds):
        for label, child in configs:
            out = subprocess.run([sys.executable, "-c", MEASURE + child, json.dumps(spec_of(label))],
                                 capture_output=True, text=True, cwd=ROOT)
            if out.returncode:
                sys.exit(f"{label} failed:\n{out.stderr[-3000:]}")
            results[label].append(json.loads(out.stdout.strip().splitlines()[-1]))
    return results


def fastest(runs: list[dict[str, float]]) -> dict[str, float]:
    """A configuration's figure over its rounds: the fastest round's step time, and the highest peak RSS of
    any round (memory does not drift with the machine's speed; the highest is what a user must have)."""
    return {"step_s": min(r["step_s"] for r in runs), "peak_rss_gib": max(r["peak_rss_gib"] for r in runs)}


def print_table(results: dict[str, list[dict[str, float]]], tokens: int) -> dict[str, dict[str, float]]:
    """The markdown table of each configuration's fastest round and every round's step time; the figures."""
    figures = {label: fastest(runs) for label, runs in results.items()}
    print("| configuration | s/step | tok/s | peak RSS GiB |\n|---|---:|---:|---:|")
    for label, r in figures.items():
        print(f"| {label} | {r['step_s']:.2f} | {tokens / r['step_s']:.0f} | {r['peak_rss_gib']:.2f} |")
    print("\ns/step of every round, in the order run:")
    for label, runs in results.items():
        print(f"- {label}: " + ", ".join(f"{r['step_s']:.2f}" for r in runs))
    return figures
