"""Mutations of valid files from strangers and the loaders they go through, shared by
tests/test_fuzz_gguf.py (small fixed budget) and bench/fuzz_gguf.py (long runs).

The files: GGUF model, adapter and checkpoint; an old llama.cpp ggla adapter; and the two
files of a PEFT adapter folder (adapter_config.json, adapter_model.safetensors), each mutated
while its companion stays valid.

A mutation is drawn by hypothesis: byte flips (biased towards the header, where a lie
does the most damage), truncation, inserted garbage, or overwriting one header field
(a count, a length, a type, a dimension, an offset) with an extreme value.
"""

from __future__ import annotations

import math
import re
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from gguf import GGUFReader
from hypothesis import strategies as st

from ggtorch.errors import GGTorchError
from ggtorch.export.old_formats import convert_old
from ggtorch.export.peft import export_peft, import_peft
from ggtorch.io.checkpoint import load_checkpoint, save_checkpoint
from ggtorch.io.gguf import GGUFFile, read_gguf
from ggtorch.lora.adapter_file import LoraAdapter, LoraPair, read_adapter, write_adapter
from ggtorch.models.loader import load_model_file
from tests.export.test_old_formats import write_ggla
from tests.families import FAMILY_PRESETS, write_random_model

EXTREMES = [0, 1, 2, 3, 31, 32, 255, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**48, 2**63 - 1, 2**63, 2**64 - 1]


@dataclass(frozen=True)
class Seed:
    """A valid file to mutate, where its header ends, where its header fields start, and its loader."""

    name: str
    blob: bytes
    header_end: int
    field_offsets: tuple[int, ...]
    load: Callable[[Path], object]
    filename: str = ""
    """The name the mutated file must have ('' = any); PEFT loaders look for fixed names."""
    companions: tuple[tuple[str, bytes], ...] = ()
    """Valid files written beside the mutated one (the rest of a PEFT folder)."""


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
    models = [("model", stories260k)] + [(f"model-{name}", family_model_over(folder, name, stories260k))
                                         for name in FAMILY_SEEDS]
    for name, path, load in (*((n, p, load_model_file) for n, p in models), ("adapter", adapter_path, read_adapter),
                             ("checkpoint", ck_path, load_checkpoint)):
        header_end, offsets = field_offsets(path)
        load(path)  # the unmutated file loads
        seeds.append(Seed(name, path.read_bytes(), header_end, offsets, load))
    return seeds + [ggla_seed(folder, adapter), *peft_seeds(folder, adapter, base)]


FAMILY_SEEDS = ("qwen2", "qwen3", "gemma2", "gemma3_pattern", "phi3", "mistral3", "smollm3", "qwen35", "qwen35moe",
                "gemma4", "gemma4moe")
"""Presets of tests/families.py fuzzed as models too: their own keys and tensors (biases, q/k norms,
sliding-window pattern, soft-caps, fused matrices, LongRoPE factors, YaRN and temperature keys, DeltaNet keys,
tensors and layer patterns, MTP blocks, gemma4's per-layer arrays, K/V sharing, per-layer embeddings and experts
beside a dense MLP) meet mutated headers."""


def family_model_over(folder: Path, name: str, vocab: Path) -> Path:
    """A family preset over stories260K's 512-token vocabulary: small enough to load hundreds of times."""
    arch, _, shape = FAMILY_PRESETS[name]
    return write_random_model(folder / f"{name}.gguf", arch, vocab, shape)


def ggla_seed(folder: Path, adapter: LoraAdapter) -> Seed:
    """The fuzz adapter as the old finetune's ggla file (A stored transposed, as it wrote it)."""
    tensors = {name: (pair.a.T.numpy(), pair.b.numpy()) for name, pair in adapter.pairs.items()}
    path = write_ggla(folder / "lora-old.bin", lora_r=2, lora_alpha=8, tensors=tensors)
    blob = path.read_bytes()
    offsets, offs = [0, 4, 8, 12], 16
    while offs < len(blob):  # per tensor: n_dims, name_len, type, ne[n_dims], name, pad to 32, data
        n_dims, name_len, _ = struct.unpack_from("<3I", blob, offs)
        ne = struct.unpack_from(f"<{n_dims}I", blob, offs + 12)
        offsets += [offs + 4 * i for i in range(3 + n_dims)]
        offs += 12 + 4 * n_dims + name_len
        offs += -offs % 32 + 4 * math.prod(ne)
    convert_old(path)
    return Seed("ggla", blob, 16 + 64, tuple(offsets), convert_old)


def _number_offsets(text: bytes, start: int = 0) -> tuple[int, ...]:
    """Byte offsets of every number in a JSON text: where a lie about a rank or a shape goes."""
    return tuple(start + m.start() for m in re.finditer(rb"-?\d+", text))


def peft_seeds(folder: Path, adapter: LoraAdapter, base: GGUFFile) -> list[Seed]:
    """The fuzz adapter as a PEFT folder; one seed mutates the config, one the safetensors file."""
    peft_dir = export_peft(adapter, base, folder / "peft")
    config = (peft_dir / "adapter_config.json").read_bytes()
    weights = (peft_dir / "adapter_model.safetensors").read_bytes()
    (header_len,) = struct.unpack_from("<Q", weights, 0)

    def load(path: Path) -> object:
        return import_peft(path.parent, base)

    load(peft_dir / "adapter_config.json")
    return [
        Seed("peft-config", config, len(config), _number_offsets(config), load, "adapter_config.json",
             (("adapter_model.safetensors", weights),)),
        Seed("peft-weights", weights, 8 + header_len, (0, *_number_offsets(weights[8:8 + header_len], 8)), load,
             "adapter_model.safetensors", (("adapter_config.json", config),)),
    ]


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
    """Load a mutated file; it loads or raises a GGTorchError with a message. Returns the outcome.

    The file goes to ``path`` (or beside it under the seed's fixed name, with its companions).
    """
    if seed.filename:
        path = path.parent / seed.filename
        for name, blob in seed.companions:
            (path.parent / name).write_bytes(blob)
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

