"""The expected peak memory printed before the first step, against the peak the run reaches.

Each run is the real CLI in a fresh child process (a Python wrapper that starts it and reads the
child's peak resident set size from ``getrusage(RUSAGE_CHILDREN)``): LoRA on a quantized base with
checkpointing, the same without checkpointing keeping every decoded matrix for its backward
(--keep-dequantized-mib), LoRA on a base dequantized to f32 without checkpointing, and a full finetune. The
model has real widths (n_embd 1024, n_ff 2816, 4 layers, the 32000-token vocabulary). The estimate
must be within ESTIMATE_TOLERANCE of the measured peak.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ggtorch.training.memory import GIB, MemoryEstimate
from tests.helpers import run_cli
from tests.training.test_memory import REAL_SHAPE

ESTIMATE_TOLERANCE = 0.25

WRAPPER = r"""
import resource, subprocess, sys
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stdout.write(done.stdout)
sys.stderr.write(done.stderr)
print(f"peak-bytes {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}")
sys.exit(done.returncode)
"""

CONFIGS = {
    "LoRA, Q4_0 base kept quantized, checkpointing, b4 x 256": ("finetune", "Q4_0", ["-b", "4", "-c", "256"]),
    "LoRA, Q8_0 base as f32, no checkpointing, b2 x 128": (
        "finetune", "Q8_0", ["-b", "2", "-c", "128", "--base-dtype", "f32", "--no-checkpointing"]),
    "LoRA, Q4_0 base kept quantized, no checkpointing, every matrix kept decoded, b2 x 128": (
        "finetune", "Q4_0", ["-b", "2", "-c", "128", "--no-checkpointing", "--keep-dequantized-mib", "1024"]),
    "full finetune of the F32 model, b2 x 128": ("train", "F32", ["-b", "2", "-c", "128"]),
}


def run_and_measure(command: str, model: Path, train: Path, cwd: Path, flags: list[str]) -> tuple[float, float]:
    """(estimated GiB as printed, measured peak GiB) of two steps of ``command``."""
    output = ["--lora-out", "a.gguf"] if command == "finetune" else ["--model-out", "m.gguf"]
    cmd = [sys.executable, "-m", "ggtorch", command, "--model-base", str(model), "--train-data", str(train),
           "-n", "2", "-t", "1", "--save-every", "0", "--checkpoint-out", "", *output, *flags]
    done = subprocess.run([sys.executable, "-c", WRAPPER, *cmd], cwd=cwd, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr
    estimate = re.search(r"expected peak memory: ([\d.]+) GiB", done.stdout)
    assert estimate, f"no memory line before the first step:\n{done.stdout}"
    assert done.stdout.index("expected peak memory") < done.stdout.index("iter="), "printed after a step"
    peak = int(re.search(r"peak-bytes (\d+)", done.stdout).group(1))
    return float(estimate.group(1)), peak / GIB


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_estimate_is_within_a_quarter_of_the_measured_peak(name: str, random_llama, texts: dict[str, Path],
                                                           tmp_path: Path) -> None:
    command, ftype, flags = CONFIGS[name]
    estimate, measured = run_and_measure(command, random_llama(ftype, REAL_SHAPE), texts["train"], tmp_path, flags)
    print(f"{name}: estimated {estimate:.2f} GiB, measured {measured:.2f} GiB")
    assert abs(estimate / measured - 1) <= ESTIMATE_TOLERANCE, (
        f"{name}: the estimate {estimate:.2f} GiB is more than {ESTIMATE_TOLERANCE:.0%} away from the measured "
        f"peak {measured:.2f} GiB (ggtorch/training/memory.py)")


def test_the_line_adds_its_parts() -> None:
    m = MemoryEstimate(runtime=1 << 30, weights=2 << 30, trained=1 << 29, activations=1 << 29, loss=1 << 30)
    assert m.total == 5 << 30
    assert m.describe() == ("expected peak memory: 5.00 GiB (weights 2.00, trained tensors + AdamW 0.50, "
                            "activations 0.50, loss 1.00, runtime 1.00)")


def test_force_starts_a_run_the_estimate_refuses(stories260k: Path, texts: dict[str, Path], tmp_path: Path) -> None:
    args = ["finetune", "--model-base", stories260k, "--train-data", texts["train"], "-b", "1000000",
            "--only-write-lora", "--lora-out", "a.gguf"]
    refused = run_cli(args, cwd=tmp_path)
    assert refused.exit_code == 1 and "or pass --force to start anyway" in refused.stderr
    assert not (tmp_path / "a.gguf").exists()
    forced = run_cli([*args, "--force"], cwd=tmp_path)
    assert forced.exit_code == 0, forced.output
    assert "expected peak memory:" in forced.stdout and (tmp_path / "a.gguf").is_file()


@pytest.mark.slow
def test_a_dpo_runs_estimate_counts_two_sequences_per_pair(random_llama, texts: dict[str, Path],
                                                          tmp_path: Path) -> None:
    """DPO, 2 pairs per step on a Q4_0 base kept quantized: four sequences of about the context's length each (and the
    reference's forward without gradients), within the same tolerance of the measured peak."""
    text = texts["train"].read_text(encoding="utf-8")
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": text[i:i + 200], "chosen": text[i + 200:i + 500],
                                         "rejected": text[i + 5000:i + 5300]}) + "\n"
                             for i in range(0, 8 * 1000, 1000)), encoding="utf-8")
    flags = ["--objective", "dpo", "-b", "2", "-c", "128", "--batching", "pad"]
    estimate, measured = run_and_measure("finetune", random_llama("Q4_0", REAL_SHAPE), pairs, tmp_path, flags)
    print(f"DPO b2 pairs x 128: estimated {estimate:.2f} GiB, measured {measured:.2f} GiB")
    assert abs(estimate / measured - 1) <= ESTIMATE_TOLERANCE, (estimate, measured)
