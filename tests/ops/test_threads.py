"""The default thread count: the CPUs other processes leave free, read from /proc/stat."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from ggtorch.ops import threads
from ggtorch.ops.threads import _FreeCores, read_busy_seconds, threads_for

STAT = """cpu  900 0 300 5000 40 0 10 0 0 0
cpu0 500 0 100 2500 20 0 5 0 0 0
cpu1 400 0 200 2500 20 0 5 7 0 0
intr 12345 1 2
ctxt 999
"""


def test_busy_seconds_count_user_nice_system_irq_softirq_steal_of_the_allowed_cpus() -> None:
    assert read_busy_seconds(STAT, {0}, 100) == pytest.approx((500 + 100 + 5) / 100)
    assert read_busy_seconds(STAT, {1}, 100) == pytest.approx((400 + 200 + 5 + 7) / 100)
    assert read_busy_seconds(STAT, {0, 1}, 50) == pytest.approx((605 + 612) / 50)
    assert read_busy_seconds(STAT, {2}, 100) == 0  # the aggregate "cpu" line is never counted


@pytest.mark.parametrize(("others", "n_cpus", "ceiling", "expected"), [
    (0.0, 2, 2, 2),    # idle machine: torch's own count
    (0.3, 2, 2, 2),    # an occasional process does not take a core
    (0.45, 2, 2, 1),   # one that holds a core 40% of the time or more does
    (1.0, 2, 2, 1),    # llama.cpp generating on one thread
    (2.0, 2, 2, 1),    # everything busy: still one thread
    (3.0, 8, 4, 4),    # torch's default (physical cores) below the free logical CPUs
    (6.0, 8, 4, 2),
])
def test_team_size_is_the_cpus_left_free(others: float, n_cpus: int, ceiling: int, expected: int) -> None:
    assert threads_for(others, n_cpus, ceiling) == expected


def _spinning_child(seconds: float) -> subprocess.Popen[bytes]:
    code = f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass\n"
    return subprocess.Popen([sys.executable, "-c", code])


@pytest.fixture
def two_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torch at 2 threads (its default on a 2-core machine, whatever earlier tests set) with no thread variable
    pinning it, on a machine of at least two CPUs; torch's count restored afterwards."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs")
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@pytest.mark.serial  # measures other processes' load on the CPUs
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_a_busy_process_takes_a_thread_and_gives_it_back(two_threads: None) -> None:
    """A process spinning on one CPU lowers the team by one; once it ends, the team grows back."""
    cores = _FreeCores()
    cores.following = True  # what start_following() sets for the process (the ggtorch command does)
    child = _spinning_child(30)
    try:
        time.sleep(0.3)
        cores.follow()
        time.sleep(threads.INTERVAL + 0.3)
        assert cores.follow() == cores.ceiling - 1 == torch.get_num_threads(), "a spinning process took no thread"
    finally:
        child.kill()
        child.wait()
    cores.follow()
    time.sleep(threads.INTERVAL + 0.3)
    assert cores.follow() == cores.ceiling == torch.get_num_threads(), (
        "the team did not grow back after the other process ended (is something else busy on this machine?)")


def test_what_the_user_set_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    saved = torch.get_num_threads()
    try:
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert _FreeCores().pinned
        monkeypatch.delenv("OMP_NUM_THREADS")
        monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
        torch.set_num_threads(2)
        cores = _FreeCores()
        cores.following = True
        torch.set_num_threads(1)  # a notebook's own choice between two checks
        assert cores.follow() == 1 and cores.pinned
    finally:
        torch.set_num_threads(saved)


@pytest.mark.serial  # measures other processes' load on the CPUs
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/stat is Linux's")
def test_a_process_that_did_not_ask_keeps_its_thread_count(monkeypatch: pytest.MonkeyPatch, two_threads: None) -> None:
    """A library call (a notebook's finetune) leaves torch's thread count alone unless the process asked to follow
    the free cores; one that asked and stops gets torch's count back."""
    monkeypatch.setattr(threads, "_state", None)
    child = _spinning_child(30)
    try:
        threads.follow_free_cores()
        time.sleep(threads.INTERVAL + 0.3)
        assert threads.follow_free_cores() == 2 == torch.get_num_threads()  # not asked: untouched
        threads.start_following()
        threads.follow_free_cores()
        time.sleep(threads.INTERVAL + 0.3)
        assert threads.follow_free_cores() == 1 == torch.get_num_threads()
        threads.stop_following()
        assert torch.get_num_threads() == 2
    finally:
        child.kill()
        child.wait()
