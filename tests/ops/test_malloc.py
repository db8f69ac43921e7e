"""glibc keeps a step's freed memory for the next step once a run starts (ggtorch.ops.malloc).

The reference is the kernel's own count of this process's page faults (getrusage): a step's
worth of tensors allocated, written and freed again faults its pages in every time when every
tensor is mmapped (the user's setting in the last test), and not at all once the thresholds are
set. glibc's own defaults move with the heap's history (they grow with the blocks freed so far),
so no test pins them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ggtorch.ops import malloc

ROUNDS = """
import json, resource, sys
import torch

SIZES = [n << 20 for n in range(1, 8)] * 2  # floats: 4 to 28 MiB tensors, as a step's activations

def faults_of_a_round() -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    activations = [torch.ones(n) for n in SIZES]
    del activations
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

mode, model, text = sys.argv[1:4]
kept = None
if mode == "kept":
    from ggtorch.ops.malloc import keep_freed_memory
    kept = keep_freed_memory()
elif mode in ("trainer", "library"):
    import torch
    from ggtorch.ops import malloc
    from ggtorch.training.config import FinetuneConfig
    from ggtorch.training.trainer import Trainer
    threads = torch.get_num_threads()
    trainer = Trainer(FinetuneConfig(model_base=model, train_data=text, ctx=16, batch=1, adam_iter=1, save_every=0),
                      log_records=False, manage_process=mode == "trainer")
    trainer.step()
    trainer.close()
    kept = {"asked": malloc.asked(), "threads_kept": torch.get_num_threads() == threads}
print(json.dumps({"kept": kept, "faults": [faults_of_a_round() for _ in range(8)]}))
"""

PAGES_OF_A_ROUND = 2 * sum(range(1, 8)) * (4 << 20) // 4096


def _glibc_process_env() -> dict[str, str]:
    """This environment without anything that replaces or tunes the C library's malloc."""
    if not malloc.is_glibc():
        pytest.skip("the C library is not glibc")
    drop = {"LD_PRELOAD", "GLIBC_TUNABLES", *malloc.USER_ENV}
    return {k: v for k, v in os.environ.items() if k not in drop}


def _rounds(mode: str, env: dict[str, str], model: Path, text: Path, folder: Path) -> dict:
    """The rounds in a process of their own, in ``folder`` (a run's default outputs go to its working folder)."""
    proc = subprocess.run([sys.executable, "-c", ROUNDS, mode, str(model), str(text)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=folder)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("mode", ["kept", "trainer"])
def test_a_run_stops_faulting_in_the_memory_it_freed(mode: str, stories260k: Path, texts: dict[str, Path],
                                                     tmp_path: Path) -> None:
    env = _glibc_process_env()
    run = _rounds(mode, env, stories260k, texts["train"], tmp_path)
    assert run["kept"] in (True, {"asked": True, "threads_kept": True})
    # later rounds reuse the pages of the first: at most the heap grows now and then by a tensor that a
    # small live object left no room for (it keeps what it grew), never a round's worth every round
    assert sum(run["faults"][1:]) < PAGES_OF_A_ROUND // 2


def test_a_library_run_leaves_the_process_as_it_was(stories260k: Path, texts: dict[str, Path], tmp_path: Path) -> None:
    """A notebook's ``ggtorch.finetune`` (manage_process=False) sets no malloc threshold and no thread count."""
    run = _rounds("library", _glibc_process_env(), stories260k, texts["train"], tmp_path)
    assert run["kept"] == {"asked": False, "threads_kept": True}


def test_the_users_own_malloc_settings_win(stories260k: Path, texts: dict[str, Path], tmp_path: Path) -> None:
    env = {**_glibc_process_env(), "MALLOC_TRIM_THRESHOLD_": "1"}  # fixes the mmap threshold at 128 KiB too
    run = _rounds("kept", env, stories260k, texts["train"], tmp_path)
    assert run["kept"] is False
    assert min(run["faults"][2:]) > PAGES_OF_A_ROUND * 0.9  # every tensor mmapped and unmapped: all faulted again


@pytest.mark.parametrize(("environ", "tuned"), [
    ({}, False),
    ({"MALLOC_ARENA_MAX": "2"}, False),  # not one of the thresholds this module sets
    ({"MALLOC_MMAP_THRESHOLD_": "131072"}, True),
    ({"MALLOC_TOP_PAD_": "0"}, True),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, True),
    ({"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=512"}, False),
])
def test_user_tuned(environ: dict[str, str], tuned: bool) -> None:
    assert malloc.user_tuned(environ) is tuned
