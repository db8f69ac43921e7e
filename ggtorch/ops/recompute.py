"""Activation checkpointing: a function's tensors saved for backward are dropped in forward and
recomputed, by running the function again, when backward first needs one of them.

This is what ``torch.utils.checkpoint.checkpoint(fn, ..., use_reentrant=False)`` does for ggtorch's
blocks, loss chunks and the regions a layer keeps only the inputs of (Gated DeltaNet's mixer); same graph,
same gradients, the same random numbers for dropout. torch's imports ``torch._dynamo`` on its first call,
seconds at the start of every run.

A checkpoint inside another's region (a DeltaNet mixer in a checkpointed block) is a plain call: the
outer region already drops and recomputes everything in it, and a second level would only run the
inner function a third time.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ggtorch.ops import policy

_regions = contextvars.ContextVar("ggtorch_checkpoint_regions", default=0)
"""How many checkpointed regions the running code is inside (their forwards or recomputations)."""


@contextlib.contextmanager
def _region() -> Iterator[None]:
    token = _regions.set(_regions.get() + 1)
    try:
        yield
    finally:
        _regions.reset(token)


class _Frame:
    """One checkpointed call: what it takes to run it again, and the tensors a recomputation saved."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.n_saved = 0
        """Tensors the forward saved (and dropped): their indices are what autograd holds."""
        self.recomputed: dict[int, torch.Tensor] = {}
        """Index -> tensor of the last recomputation, each given to backward once."""
        devices = {a.device for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
        # accelerators whose default generator a recomputation restores (torch.<type>.get_rng_state)
        self.rng_devices = sorted((d for d in devices if policy.current(d).device_rng), key=str)
        self.rng_states = (torch.get_rng_state(), [_get_rng(d) for d in self.rng_devices])
        self.autocast = {t: (torch.get_autocast_dtype(t), torch.is_autocast_cache_enabled())
                         for t in {"cpu", *(d.type for d in devices)} if torch.is_autocast_enabled(t)}
        """Device type -> (dtype, cache) of each autocast active in forward, active again in recomputation."""

    def pack(self, _: torch.Tensor) -> int:
        self.n_saved += 1
        return self.n_saved - 1

    def unpack(self, index: int) -> torch.Tensor:
        if index not in self.recomputed:  # the first unpack of this backward (or of another one)
            self._recompute()
        return self.recomputed.pop(index)

    def _recompute(self) -> None:
        saved: list[torch.Tensor] = []

        def record(t: torch.Tensor) -> None:  # nothing to unpack: this graph is thrown away
            saved.append(t.detach() if t.requires_grad else t)

        with self._restored_rng(), self._autocast(), torch.enable_grad(), _region(), \
                torch.autograd.graph.saved_tensors_hooks(record, _refuse):
            self.fn(*self.args, **self.kwargs)
        if len(saved) != self.n_saved:
            raise RuntimeError(f"a checkpointed function saved {len(saved)} tensors when recomputed, "
                               f"{self.n_saved} the first time: it must compute the same thing again")
        self.recomputed = dict(enumerate(saved))

    @contextlib.contextmanager
    def _restored_rng(self) -> Iterator[None]:
        """The random state of the forward for the recomputation, the caller's own afterwards."""
        cpu, others = self.rng_states
        outer = (torch.get_rng_state(), [_get_rng(d) for d in self.rng_devices])
        torch.set_rng_state(cpu)
        for d, state in zip(self.rng_devices, others, strict=True):
            _set_rng(d, state)
        try:
            yield
        finally:
            torch.set_rng_state(outer[0])
            for d, state in zip(self.rng_devices, outer[1], strict=True):
                _set_rng(d, state)

    def _autocast(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for device_type, (dtype, cache) in self.autocast.items():
            stack.enter_context(torch.autocast(device_type, dtype=dtype, cache_enabled=cache))
        return stack


def _get_rng(device: torch.device) -> torch.Tensor:
    return torch.mps.get_rng_state() if device.type == "mps" else getattr(torch, device.type).get_rng_state(
        device.index or 0)


def _set_rng(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "mps":
        torch.mps.set_rng_state(state)
    else:
        getattr(torch, device.type).set_rng_state(state, device.index or 0)


def _refuse(_: Any) -> torch.Tensor:
    raise RuntimeError("a recomputation's own graph is never run backward")


def checkpoint(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, keeping for backward only its arguments: the tensors it saves are
    computed again in backward, one recomputation per backward pass. Without grad, or inside another
    checkpointed region, just the call."""
    if not torch.is_grad_enabled() or _regions.get():
        return fn(*args, **kwargs)
    frame = _Frame(fn, args, kwargs)
    with _region(), torch.autograd.graph.saved_tensors_hooks(frame.pack, frame.unpack):
        return fn(*args, **kwargs)
