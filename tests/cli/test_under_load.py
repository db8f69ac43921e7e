"""ggtorch beside a llama.cpp process that evaluates a model on its default threads.

Two programs whose threads both spin at their barriers share the CPUs badly: with torch's default
team beside llama.cpp, a stories260K step took 0.8-1.2 s instead of 19 ms on this 2-core machine.
With the default thread count following the free cores (ggtorch.ops.threads), a finetune step and
a generated token beside llama.cpp stay within LOAD_BOUND of the same command alone on one thread.
Medians over many steps, and a generous bound: this machine is shared.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.llama_models import RandomLlamaShape

pytestmark = pytest.mark.serial  # measures other processes' load on the CPUs

LOAD_BOUND = 5.0
"""Loaded default-threads step time / idle one-thread step time may reach this (issue 23)."""

LOOP_SHAPE = RandomLlamaShape(n_embd=512, n_ff=1536, n_layer=4)
"""Big enough that llama.cpp's evaluation, not Python, keeps its threads busy."""

LOOP = r"""
import sys, time
from tests.llama_models import plain_cpu_reference
plain_cpu_reference()
import llama_cpp
llm = llama_cpp.Llama(model_path=sys.argv[1], n_ctx=256, verbose=False)  # llama-cpp-python's default threads
end = time.monotonic() + float(sys.argv[2])
print("ready", flush=True)
while time.monotonic() < end:
    llm.reset()
    llm.eval(list(range(1, 129)))
"""
ROOT = Path(__file__).resolve().parents[2]
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


@pytest.fixture
def llama_cpp_busy(random_llama) -> Iterator[subprocess.Popen[str]]:
    """A llama.cpp process evaluating 128 tokens in a loop for at most 3 minutes (killed at the end)."""
    pytest.importorskip("llama_cpp")
    model = random_llama(shape=LOOP_SHAPE)
    proc = subprocess.Popen([sys.executable, "-c", LOOP, str(model), "180"], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env=CLEAN_ENV)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready", "llama.cpp did not start"
        time.sleep(1.0)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _median_step(stories260k: Path, train: Path, tmp_path: Path, *flags: str) -> float:
    """Median seconds of steps 5.. of a 30-step stories260K finetune (batch 2 x 32) run by the CLI."""
    log = tmp_path / f"log{len(list(tmp_path.iterdir()))}.jsonl"
    cmd = [sys.executable, "-m", "ggtorch", "finetune", "--model-base", str(stories260k), "--train-data", str(train),
           "-n", "30", "-c", "32", "-b", "2", "--save-every", "0", "--seed", "1", "--overwrite", "--lora-out",
           str(tmp_path / "a.gguf"), "--log-file", str(log), *flags]
    subprocess.run(cmd, cwd=tmp_path, env=CLEAN_ENV, check=True, capture_output=True, timeout=600)
    seconds = [json.loads(line)["seconds"] for line in log.read_text().splitlines() if '"iter"' in line]
    return statistics.median(seconds[5:])


def _tokens_per_second(stories260k: Path, *flags: str) -> float:
    cmd = [sys.executable, "-m", "ggtorch", "generate", "-m", str(stories260k), "-p", "Once", "-n", "400",
           "--ignore-eos", *flags]
    done = subprocess.run(cmd, env=CLEAN_ENV, check=True, capture_output=True, text=True, timeout=600)
    return float(re.search(r"([\d.]+) tokens/s", done.stderr).group(1))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the load-following default reads /proc/stat")
def test_finetune_and_generate_beside_llama_cpp(stories260k: Path, texts: dict[str, Path], tmp_path: Path,
                                                request: pytest.FixtureRequest) -> None:
    idle_step = _median_step(stories260k, texts["train"], tmp_path, "-t", "1")
    idle_tps = _tokens_per_second(stories260k, "-t", "1")

    busy = request.getfixturevalue("llama_cpp_busy")
    cpu0, wall0 = _cpu_seconds(busy.pid), time.monotonic()
    loaded_step = _median_step(stories260k, texts["train"], tmp_path)
    loaded_tps = _tokens_per_second(stories260k)
    llama_cpp_cores = (_cpu_seconds(busy.pid) - cpu0) / (time.monotonic() - wall0)
    assert busy.poll() is None, "the llama.cpp loop ended before ggtorch did"
    assert llama_cpp_cores > 0.7, f"llama.cpp used {llama_cpp_cores:.2f} cores: no real load to test against"

    assert loaded_step < LOAD_BOUND * idle_step, (
        f"beside llama.cpp (using {llama_cpp_cores:.2f} cores) a default-threads finetune step took "
        f"{loaded_step * 1e3:.1f} ms, more than {LOAD_BOUND:g}x the idle one-thread step ({idle_step * 1e3:.1f} ms): "
        "the thread count no longer follows the free cores (ggtorch/ops/threads.py)")
    assert loaded_tps > idle_tps / LOAD_BOUND, (
        f"beside llama.cpp, generate ran at {loaded_tps:.0f} tokens/s, below 1/{LOAD_BOUND:g} of its idle "
        f"one-thread speed ({idle_tps:.0f} tokens/s)")
