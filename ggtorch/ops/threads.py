"""How many CPU threads torch computes with: the cores other processes leave free.

torch's OpenMP threads spin at the end of each parallel region until every thread of their team
arrives. When another process keeps cores busy with threads that spin too (llama.cpp evaluating a
model, a second torch job), a team member that lost its core holds the whole team until the
scheduler gives it a time slice, at every one of the thousands of regions of a step: steps run
tens of times slower, not the 2× that losing a core costs. A team no larger than the cores nobody
else uses has no such waits, and an idle machine keeps torch's own count.

So the long-running loops (training steps, generated tokens, perplexity batches, merged tensors)
call :func:`follow_free_cores` between their steps; in a process that chose to follow the free cores
(:func:`start_following`: the ``ggtorch`` command does, a notebook's process only when it asks), at most
every :data:`INTERVAL` seconds it
reads the CPU time the other processes took from ``/proc/stat`` and sets the team size to the
CPUs of this process's affinity they left, at most torch's default and at least one. It is
called from the computing thread because OpenMP's team size belongs to the thread that sets it.

A thread count the user chose is kept as is: ``--threads`` (:func:`pin_threads`),
``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` in the environment (torchrun sets
``OMP_NUM_THREADS=1`` when it starts several processes), or a ``torch.set_num_threads`` call
between two of these checks. Only Linux has ``/proc/stat``; elsewhere torch's count stays.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

import torch

INTERVAL = 0.5
"""Seconds between two readings: /proc/stat counts in clock ticks (10 ms), so shorter windows
misread a core's use; longer ones react later to a process that starts."""

BUSY_SHARE = 0.4
"""A CPU the other processes use for this share of the time or more is counted as theirs: a
process that holds a core 40% of the time already preempts a team member at most regions."""

USER_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
PROC_STAT = "/proc/stat"


@dataclass(frozen=True)
class CpuTimes:
    """Busy CPU seconds of the allowed CPUs (all processes) and of this process, at one moment."""

    wall: float
    busy: float
    own: float


def read_busy_seconds(stat_text: str, cpus: set[int], ticks_per_second: float) -> float:
    """Busy seconds of ``cpus`` summed from ``/proc/stat``'s per-CPU lines.

    Busy is user + nice + system + irq + softirq + steal (a hypervisor's stolen time is a core
    this process cannot use either); idle and iowait are free time. guest time is already in user.
    """
    ticks = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        fields = [int(v) for v in rest.split()]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
        ticks += user + nice + system + irq + softirq + steal
    return ticks / ticks_per_second


def threads_for(others_busy: float, n_cpus: int, ceiling: int) -> int:
    """The team size when the other processes keep ``others_busy`` CPUs busy on average."""
    taken = math.floor(others_busy + (1.0 - BUSY_SHARE))
    return max(1, min(ceiling, n_cpus - taken))


class _FreeCores:
    """The state of :func:`follow_free_cores` in this process."""

    def __init__(self) -> None:
        self.following = False
        """Whether this process sizes torch's team to the free cores (:func:`start_following`)."""
        self.pinned = any(os.environ.get(k) for k in USER_ENV) or not os.path.isfile(PROC_STAT)
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        self.ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.ceiling = torch.get_num_threads()
        self.chosen = self.ceiling
        self.last: CpuTimes | None = None

    def sample(self) -> CpuTimes | None:
        try:
            with open(PROC_STAT) as f:
                text = f.read()
        except OSError:
            return None
        return CpuTimes(time.monotonic(), read_busy_seconds(text, self.cpus, self.ticks), time.process_time())

    def follow(self) -> int:
        if self.pinned or not self.following:
            return torch.get_num_threads()
        if torch.get_num_threads() != self.chosen:  # someone called torch.set_num_threads: theirs
            self.pinned = True
            return torch.get_num_threads()
        now = time.monotonic()
        if self.last is not None and now - self.last.wall < INTERVAL:
            return self.chosen
        current = self.sample()
        if current is None:
            self.pinned = True
            return self.chosen
        if self.last is not None:
            wall = current.wall - self.last.wall
            others = max(0.0, (current.busy - self.last.busy) - (current.own - self.last.own)) / wall
            chosen = threads_for(others, len(self.cpus), self.ceiling)
            if chosen != self.chosen:
                torch.set_num_threads(chosen)
                self.chosen = chosen
        self.last = current
        return self.chosen


_state: _FreeCores | None = None


def _free_cores() -> _FreeCores:
    global _state
    if _state is None:
        _state = _FreeCores()
    return _state


def follow_free_cores() -> int:
    """Size torch's thread team to the CPUs other processes leave free, where this process follows them
    (:func:`start_following`); returns the team size.

    Cheap (one clock read) except every :data:`INTERVAL` seconds; the first call only takes the
    first reading.
    """
    return _free_cores().follow()


def start_following() -> None:
    """From now on this process's torch team follows the free cores: the ``ggtorch`` command's choice for itself,
    or a library caller's that asks for it (``manage_process=True``). A library call never changes a process's
    thread count unasked."""
    _free_cores().following = True


def stop_following() -> None:
    """Stop following the free cores and give torch back the thread count it had before (unless someone set
    their own meanwhile)."""
    state = _free_cores()
    if state.following and not state.pinned and torch.get_num_threads() == state.chosen != state.ceiling:
        torch.set_num_threads(state.ceiling)
    state.following = False
    state.chosen = torch.get_num_threads()
    state.last = None


def pin_threads(n: int) -> None:
    """The user's thread count: set it, and never change it afterwards."""
    torch.set_num_threads(n)
    _free_cores().pinned = True
