"""Mutations of valid GGUF files and the loaders they go through, shared by
tests/test_fuzz_gguf.py (small fixed budget) and bench/fuzz_gguf.py (long runs).

A mutation is drawn by hypothesis: byte flips (biased towards the header, where a lie
does the most damage), truncation, inserted garbage, or overwriting one header field
(a count, a length, a type, a dimension, an offset) with an extreme value.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGUFReader
from hypothesis import strategies as st

from ggtorch.adapters import LoraAdapter, LoraPair, read_adapter, write_adapter
from ggtorch.checkpoint import load_checkpoint, save_checkpoint
from ggtorch.errors import GGTorchError
from ggtorch.gguf_io import read_gguf
from ggtorch.models.loader import load_llama

EXTREMES = [0, 1, 2, 3, 31, 32, 255, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**48, 2**63 - 1, 2**63, 2**64 - 1]


@dataclass(frozen=True)
class Seed:
    """A valid file to mutate, where its header ends, where its header fields start, and its loader."""

    name: str
    blob: bytes
    header_end: int
    field_offsets: tuple[int, ...]
    load: Callable[[Path], object]


def field_offsets(path: Path) -> tuple[int, tuple[int, ...]]:
    """Header length and the byte offset of every part (length, type, count, value) of every field."""
    reader = GGUFReader(path)
    offsets = []
    for field in [*reader.fields.values(), *(t.field for t in reader.tensors)]:
        offs = field.offset
        for part in field.parts:
            offsets.append(offs)
            offs += part.nbytes
    return int(reader.data_offset), tuple(sorted(set(offsets)))


def make_seeds(folder: Path, stories260k: Path) -> list[Seed]:
    """A model (stories260K), an adapter and a checkpoint, each written by ggtorch's own writers."""
    base = read_gguf(stories260k)
    g = torch.Generator().manual_seed(0)
    adapter = LoraAdapter("llama", 8.0, {
        "blk.0.attn_q.weight": LoraPair(torch.randn(2, 64, generator=g), torch.randn(64, 2, generator=g)),
        "blk.1.ffn_up.weight": LoraPair(torch.randn(2, 64, generator=g), torch.randn(172, 2, generator=g)),
    }, {"general.name": "fuzz"})
    adapter_path = write_adapter(folder / "adapter.gguf", adapter)
    ck_path = folder / "checkpoint.gguf"
    p = torch.nn.Parameter(torch.randn(4, 8, generator=g))
    opt = torch.optim.AdamW([p], lr=1e-3)
    p.grad = torch.ones_like(p)
    opt.step()
    save_checkpoint(ck_path, base, {"training.iteration_count": 3}, {"blk.0.attn_q.weight.lora_a": p.detach()},
                    {"optimizer": opt.state_dict(), "rng": torch.get_rng_state(), "step": 3})
    seeds = []
    for name, path, load in (("model", stories260k, load_llama), ("adapter", adapter_path, read_adapter),
                             ("checkpoint", ck_path, load_checkpoint)):
        header_end, offsets = field_offsets(path)
        load(path)  # the unmutated file loads
        seeds.append(Seed(name, path.read_bytes(), header_end, offsets, load))
    return seeds


@dataclass(frozen=True)
class Mutation:
    """One edit of a file, small enough to print as a falsifying example."""

    kind: str  # flip | truncate | insert | field
    pos: int
    value: int = 0  # xor mask (flip), overwrite value (field)
    width: int = 0  # bytes overwritten (field)
    garbage: bytes = b""  # inserted bytes (insert)

    def apply(self, blob: bytes) -> bytes:
        out = bytearray(blob)
        if self.kind == "flip":
            out[self.pos] ^= self.value
        elif self.kind == "truncate":
            del out[self.pos:]
        elif self.kind == "insert":
            out[self.pos:self.pos] = self.garbage
        else:
            out[self.pos:self.pos + self.width] = self.value.to_bytes(self.width, "little")[:len(out) - self.pos]
        return bytes(out)


@st.composite
def mutation(draw: st.DrawFn, seed: Seed) -> Mutation:
    """A byte flip, truncation or insertion (biased to the header), or a header field overwrite."""
    kind = draw(st.sampled_from(["flip", "truncate", "insert", "field"]))
    pos = draw(st.integers(0, seed.header_end - 1) | st.integers(0, len(seed.blob) - 1))
    if kind == "flip":
        return Mutation(kind, pos, draw(st.integers(1, 255)))
    if kind == "truncate":
        return Mutation(kind, pos)
    if kind == "insert":
        return Mutation(kind, pos, garbage=draw(st.binary(min_size=1, max_size=64)))
    width = draw(st.sampled_from([1, 4, 8]))
    value = draw(st.sampled_from(EXTREMES) | st.integers(0, 2**64 - 1)) % (1 << (8 * width))
    return Mutation(kind, draw(st.sampled_from(seed.field_offsets)), value, width)


def mutations(seed: Seed) -> st.SearchStrategy[list[Mutation]]:
    """One to four edits applied in order (several flips reach past the first check)."""
    return st.lists(mutation(seed), min_size=1, max_size=4)


def apply_all(blob: bytes, edits: list[Mutation]) -> bytes:
    for m in edits:
        if m.pos < len(blob):
            blob = m.apply(blob)
    return blob


def check_outcome(seed: Seed, edits: list[Mutation], path: Path, time_limit: float = 20.0) -> str:
    """Load a mutated file; it loads or raises a GGTorchError with a message. Returns the outcome."""
    path.write_bytes(apply_all(seed.blob, edits))
    start = time.perf_counter()
    try:
        seed.load(path)
        outcome = "loaded"
    except GGTorchError as e:
        assert str(e).strip(), f"{seed.name}: {type(e).__name__} without a message"
        outcome = type(e).__name__
    except Exception as e:  # noqa: BLE001 - the point: anything else is a bug, reported briefly
        raise AssertionError(f"{seed.name}: {type(e).__name__} escaped the loader: {str(e)[:300]}") from None
    elapsed = time.perf_counter() - start
    assert elapsed < time_limit, f"{seed.name}: loading a mutated file took {elapsed:.1f} s"
    return outcome

