"""Data-parallel runs under ``torchrun``: process-group setup and the few collectives the trainer needs.

Without torchrun's environment (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT``)
everything here is a no-op for one process, so a plain ``ggtorch finetune`` is unchanged. Under
torchrun every rank joins one process group (gloo on CPU, NCCL on CUDA, or ``--dist-backend``);
gradients are averaged by :class:`torch.nn.parallel.DistributedDataParallel`, and the helpers
below agree on the seed, the step's loss and token count, and check that every rank trains the
same data with the same options.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ggtorch.errors import BadFlag, GGTorchError
from ggtorch.ops import policy

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
BACKENDS = ("gloo", "nccl", "mpi", "xccl")

TIMEOUT = timedelta(minutes=30)
"""How long a collective waits for a rank that is still working (a long save, a slow load)."""
CLOSE_TIMEOUT = timedelta(seconds=60)
"""How long close() waits for the other ranks before leaving the group anyway."""


class RankFailed(GGTorchError):
    """An error every rank detects at once (e.g. a NaN loss after the all-reduce): rank 0 reports it."""

    on_every_rank = True


class OtherRankFailed(GGTorchError):
    """Another rank failed and reports why; this rank exits with an error status, silently."""

    quiet = True


def launched_by_torchrun() -> bool:
    """True when torchrun (or another launcher with its variables) started this process."""
    return all(v in os.environ for v in TORCHRUN_VARS)


def env_rank() -> int:
    """This process's global rank as torchrun set it (0 without torchrun), before any group exists."""
    return int(os.environ.get("RANK", "0")) if launched_by_torchrun() else 0


def env_world_size() -> int:
    """The number of ranks torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1")) if launched_by_torchrun() else 1


@dataclass
class Distributed:
    """This process's place in the run: rank, world size, the device it trains on, the backend."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    owns_group: bool = False
    """True when :func:`setup` created the process group (so :meth:`close` destroys it)."""

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 writes every file and prints progress; the others only compute."""
        return self.rank == 0

    # --- collectives (identity for one process) ----------------------------------------------
    def reduce_sum(self, values: list[float], device: torch.device) -> list[float]:
        """Element-wise sum over ranks, in float64 (token counts, loss sums, flags)."""
        if not self.enabled:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t.tolist()

    def broadcast_int(self, value: int, device: torch.device) -> int:
        """Rank 0's ``value`` on every rank (e.g. a seed drawn from the clock)."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.broadcast(t, src=0)
        return int(t.item())

    def check_same(self, what: str, values: list[int], device: torch.device) -> None:
        """Refuse a run whose ranks disagree on ``values`` (different options or data on some node)."""
        if not self.enabled:
            return
        t = torch.tensor([v & 0x7FFF_FFFF_FFFF_FFFF for v in values], dtype=torch.int64, device=device)
        lo, hi = t.clone(), t.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        if not torch.equal(lo, hi):
            raise RankFailed(f"the {self.world_size} ranks disagree on {what}; start every rank with the same "
                             "flags, and give every node the same model and data files")

    def agree_on_errors(self, work: Callable[[], None], device: torch.device) -> None:
        """Run ``work`` (which runs no collective); if it fails on any rank, fail on every rank.

        The lowest failing rank raises its own error (the one message the user sees); the
        others raise :class:`OtherRankFailed`. Errors that are not GGTorchErrors (bugs)
        propagate at once; torchrun then stops the ranks waiting here.
        """
        if not self.enabled:
            work()
            return
        error: GGTorchError | None = None
        try:
            work()
        except GGTorchError as e:
            error = e
        first = torch.tensor([self.rank if error is not None else self.world_size], dtype=torch.int64, device=device)
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        failed = int(first.item())
        if failed == self.world_size:
            return
        if error is not None and failed == self.rank:
            raise error
        raise OtherRankFailed(f"rank {failed} failed (see its error)")

    def wrap(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """``model`` under DDP when this run has several ranks, else ``model`` itself."""
        return data_parallel(model, device) if self.enabled else model

    def close(self) -> None:
        """Leave the process group if this object created it.

        The ranks meet at a barrier first: gloo drops a pair's connection as soon as one side
        destroys its group, and a peer still finishing its last collective then aborts the
        process ("terminate called without an active exception") after a run that succeeded.
        The barrier is bounded, so a rank that already died cannot hang the others here.
        """
        if self.owns_group and dist.is_initialized():
            try:
                if dist.get_backend() == "gloo":
                    dist.monitored_barrier(timeout=CLOSE_TIMEOUT)
                else:
                    dist.barrier()
            except (RuntimeError, ValueError, dist.DistError):
                pass  # a rank is gone or the group is broken: leave anyway, nothing is left to sync
            dist.destroy_process_group()
        self.owns_group = False


def data_parallel(model: torch.nn.Module, device: torch.device) -> DistributedDataParallel:
    """``model`` in DistributedDataParallel over its trainable parameters only.

    Frozen parameters and buffers (the base weights, quantized or not) are left out of DDP's
    start-up broadcast and of every later sync: each rank loaded them from the same file. Only
    the trainable (LoRA, or all weights in full training) gradients are reduced. Needs an
    initialized process group.
    """
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    buffers = [n for n, _ in model.named_buffers()]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen + buffers)
    # with every buffer ignored, DDP has no buffers to sync at start or before each forward
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def default_backend(device: torch.device) -> str:
    return policy.current(device).dist_backend


def rank_device(device: torch.device, local_rank: int, world_size: int) -> torch.device:
    """The device a rank trains on: ``cuda`` without an index becomes ``cuda:LOCAL_RANK``."""
    if device.type == "cuda" and device.index is None and world_size > 1:
        return torch.device("cuda", local_rank)
    return device


def setup(device: torch.device, backend: str | None = None) -> tuple[Distributed, torch.device]:
    """Join torchrun's process group (if launched by it); return the rank info and this rank's device.

    An already initialized group (e.g. created by the caller's own launcher code) is used as is.
    """
    if backend is not None and backend not in BACKENDS:
        raise BadFlag(f"--dist-backend must be one of {', '.join(BACKENDS)}, got '{backend}'")
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local = int(os.environ.get("LOCAL_RANK", rank))
        device = rank_device(device, local, world)
        return Distributed(rank, world, local, dist.get_backend(), owns_group=False), device
    if not launched_by_torchrun():
        return Distributed(), device
    rank, world, local = (int(os.environ[v]) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    device = rank_device(device, local, world)
    if world == 1:
        return Distributed(rank, world, local), device
    if not dist.is_available():
        raise BadFlag("this torch build has no torch.distributed; run without torchrun")
    chosen = backend or default_backend(device)
    if chosen == "nccl" and device.type != "cuda":
        raise BadFlag(f"--dist-backend nccl needs --device cuda (this run uses {device}); use gloo on CPU")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kwargs: dict[str, Any] = {"device_id": device} if chosen == "nccl" else {}
    dist.init_process_group(chosen, timeout=TIMEOUT, **kwargs)
    return Distributed(rank, world, local, chosen, owns_group=True), device
