"""bench/gpu_check.py, the script a session lent a GPU runs, runs here end to end at toy sizes on the CPU (so a GPU's
minutes go to running it, not to fixing it), and its finetune's adapter passes the llama.cpp check it is for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import worker_env

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_runs_at_toy_sizes_and_its_adapter_loads_in_llama_cpp(tmp_path: Path) -> None:
    out = tmp_path / "report"
    done = subprocess.run([sys.executable, "bench/gpu_check.py", "--device", "cpu", "--smoke", "--parts", "abc",
                           "--out", str(out)], cwd=ROOT, env=worker_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    names = [c["check"] for c in report["checks"]]
    assert all(c["ok"] for c in report["checks"]) and "b resume is exact" in names
    assert {"a qwen3 Q4_K_M bf16", "a gemma4 Q8_0 f32"} <= set(names)
    sides = {r["side"] for r in report["rows"]}
    assert {"ggtorch Q4_K_M", "peft bf16"} <= sides
    verified = subprocess.run([sys.executable, "bench/gpu_check.py", "--verify", str(out)], cwd=ROOT,
                              env=worker_env(), capture_output=True, text=True, timeout=300)
    assert verified.returncode == 0, verified.stdout + verified.stderr
