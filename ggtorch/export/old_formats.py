"""The old llama.cpp ``finetune``'s adapters, read and converted to today's GGUF LoRA.

Two files came out of the old program (reference: shared/reference/llama-cpp-finetune-semantics.md
§8, §9): the ``--lora-out`` adapter (binary "ggla": little-endian u32 header magic, version 1,
lora_r, lora_alpha; then per tensor n_dims, name length, ggml type, ne[], name, zero padding to
an absolute file offset multiple of 32, raw data) and the ``--checkpoint-out`` GGUF
(``training.type = finetune_lora``). Both store ``loraA ne=[r, n_in]`` / ``loraB ne=[r, n_out]``
(torch ``(n_in, r)`` / ``(n_out, r)``) and ΔW = B·Aᵀ; today's llama.cpp refuses both.

Conversion (§10): ordinary tensors get ``lora_a = Aᵀ``, ``lora_b = B``; token_embd gets
``lora_a = B``, ``lora_b = A``. Norm-gain adapters (the old finetune always trained them) have
no place in today's format: they are kept apart as ``norms`` (``a (r, n_embd)``, ``b (1, r)``,
Δg = (b·a)[0], scale folded in) so that a merge can still apply them.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ggtorch.errors import BadGGUF, GGTorchError
from ggtorch.io.gguf import read_gguf
from ggtorch.lora.adapter_file import NORM_SUFFIX, TOKEN_EMBD, LoraAdapter, LoraPair

GGLA_MAGIC = 0x67676C61
OLD_CHECKPOINT_TYPE = "finetune_lora"
_GGLA_TYPES = {0: np.float32, 1: np.float16}  # the only types the old loader applied


@dataclass
class LoraWithNorms:
    """An adapter in today's orientation plus the norm-gain deltas today's format cannot hold."""

    adapter: LoraAdapter
    norms: dict[str, LoraPair]
    """Base norm name -> pair with ``a (r, n)``, ``b (1, r)``; Δg = (b @ a)[0] (already scaled)."""


def is_ggla(path: str | os.PathLike[str]) -> bool:
    """Whether the file starts with the old adapter's magic."""
    with open(path, "rb") as f:
        head = f.read(4)
    return len(head) == 4 and struct.unpack("<I", head)[0] == GGLA_MAGIC


def read_ggla(path: str | os.PathLike[str]) -> LoraWithNorms:
    """Read an old ``--lora-out`` adapter (ggla v1, F32/F16 tensors)."""
    path = Path(path)
    buf = path.read_bytes()
    if len(buf) < 16 or struct.unpack_from("<I", buf, 0)[0] != GGLA_MAGIC:
        raise BadGGUF(f"{path}: not an old llama.cpp adapter (no 'ggla' magic)")
    version, lora_r, lora_alpha = struct.unpack_from("<III", buf, 4)
    if version != 1:
        raise BadGGUF(f"{path}: ggla version {version}; only version 1 (the old finetune's) is known")
    if lora_r == 0:
        raise BadGGUF(f"{path}: ggla header has lora_r = 0; the file is corrupt")
    offs = 16
    old: dict[str, torch.Tensor] = {}
    while offs < len(buf):
        if offs + 12 > len(buf):
            raise BadGGUF(f"{path}: truncated tensor header at byte {offs}")
        n_dims, name_len, type_id = struct.unpack_from("<III", buf, offs)
        offs += 12
        if not 1 <= n_dims <= 2 or type_id not in _GGLA_TYPES or name_len > 4096:
            raise BadGGUF(f"{path}: bad tensor header at byte {offs - 12} (n_dims {n_dims}, type {type_id}); "
                          "only 1-D/2-D F32/F16 tensors occur in old adapters")
        if offs + 4 * n_dims > len(buf):
            raise BadGGUF(f"{path}: truncated tensor header at byte {offs - 12}")
        ne = struct.unpack_from(f"<{n_dims}I", buf, offs)
        offs += 4 * n_dims
        name = buf[offs:offs + name_len].decode("utf-8", errors="replace")
        offs += name_len
        offs += -offs % 32
        dtype = _GGLA_TYPES[type_id]
        count = math.prod(ne)  # Python ints: a lying shape cannot overflow
        nbytes = count * np.dtype(dtype).itemsize
        if offs + nbytes > len(buf):
            raise BadGGUF(f"{path}: tensor '{name}' runs past the end of the file; it is truncated")
        arr = np.frombuffer(buf, dtype=dtype, count=count, offset=offs).astype(np.float32)
        offs += nbytes
        old[name] = torch.from_numpy(arr.reshape(tuple(reversed(ne))).copy())
    halves = _split(path, old, ".loraA", ".loraB")
    return _convert(path, halves, lora_alpha / lora_r)


def read_old_checkpoint(path: str | os.PathLike[str]) -> LoraWithNorms:
    """The adapter inside an old finetune checkpoint (trained with scale 1, so it applies with scale 1)."""
    f = read_gguf(path)
    if f.get("training.type") != OLD_CHECKPOINT_TYPE:
        raise BadGGUF(f"{f.path}: not an old llama.cpp finetune checkpoint "
                      f"(training.type = '{f.get('training.type')}', expected '{OLD_CHECKPOINT_TYPE}')")
    old: dict[str, torch.Tensor] = {}
    for name, info in f.tensors.items():
        if not name.endswith((".lora_a", ".lora_b")):
            continue  # optimizer state
        if info.ggml_type != GGMLQuantizationType.F32:
            raise BadGGUF(f"{f.path}: tensor '{name}' is {info.ggml_type.name}; old checkpoints hold F32 only")
        old[name] = torch.from_numpy(info.data.view(np.float32).copy()).reshape(info.shape)
    halves = _split(f.path, old, ".lora_a", ".lora_b")
    converted = _convert(f.path, halves, 1.0)
    if f.architecture != "llama":
        raise BadGGUF(f"{f.path}: old finetune checkpoints are llama only, this one says '{f.architecture}'")
    return converted


def read_old(path: str | os.PathLike[str]) -> LoraWithNorms:
    """An old adapter (ggla) or old checkpoint (GGUF), told apart by their first bytes."""
    if not Path(path).is_file():
        raise BadGGUF(f"{path}: no such file; pass an old lora-*.bin adapter or finetune checkpoint")
    return read_ggla(path) if is_ggla(path) else read_old_checkpoint(path)


def convert_old(path: str | os.PathLike[str], drop_norms: bool = False) -> LoraAdapter:
    """Today's GGUF LoRA for an old adapter or checkpoint; norm adapters refused unless dropped."""
    old = read_old(path)
    if old.norms and not drop_norms:
        names = sorted(old.norms)
        raise GGTorchError(f"{path}: holds {len(names)} norm-gain adapters ({names[0]}, ...), which today's "
                           "llama.cpp adapter format cannot carry; pass --drop-norms to leave them out, or "
                           "keep them by merging into the model with `ggtorch export-lora --lora` on this file")
    return old.adapter


def _split(path: Path, old: dict[str, torch.Tensor], suffix_a: str,
           suffix_b: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Old tensors grouped as base name -> (A, B); a missing half or a stray name is an error."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in old.items():
        for which, suffix in (("a", suffix_a), ("b", suffix_b)):
            if name.endswith(suffix):
                halves.setdefault(name[: -len(suffix)], {})[which] = t
                break
        else:
            raise BadGGUF(f"{path}: unexpected tensor '{name}' (expected <name>{suffix_a} / <name>{suffix_b})")
    out = {}
    for base, h in halves.items():
        if set(h) != {"a", "b"}:
            raise BadGGUF(f"{path}: '{base}' has only one of its LoRA halves; the file is incomplete")
        out[base] = (h["a"], h["b"])
    if not out:
        raise BadGGUF(f"{path}: holds no LoRA tensors")
    return out


def _convert(path: Path, halves: dict[str, tuple[torch.Tensor, torch.Tensor]], scale: float) -> LoraWithNorms:
    """Old orientation -> today's, with ``scale`` (alpha / lora_r, or 1) kept exact for every rank."""
    pairs: dict[str, LoraPair] = {}
    norms: dict[str, LoraPair] = {}
    for base, (a, b) in halves.items():
        if a.dim() != 2 or b.dim() not in (1, 2):
            raise BadGGUF(f"{path}: '{base}' LoRA halves of shapes {tuple(a.shape)} / {tuple(b.shape)} "
                          "are not the old layout")
        rank = a.shape[1]
        b = b.reshape(1, -1) if base.endswith(NORM_SUFFIX) else b
        if b.shape[-1] != rank:
            raise BadGGUF(f"{path}: '{base}' has A of rank {rank} but B of rank {b.shape[-1]}; "
                          "the file is inconsistent")
        if base.endswith(NORM_SUFFIX):
            norms[base] = LoraPair(a.T.contiguous() * scale, b.contiguous())
        elif base == TOKEN_EMBD:
            pairs[base] = LoraPair(b.contiguous(), a.contiguous())
        else:
            pairs[base] = LoraPair(a.T.contiguous(), b.contiguous())
    # one alpha per file: alpha = scale * r is exact when every rank is the same, else fold the scale into A
    ranks = {p.rank for p in pairs.values()}
    if len(ranks) == 1 and scale != 1.0:
        alpha = scale * ranks.pop()
    else:
        alpha = 0.0
        if scale != 1.0:
            for name, p in pairs.items():
                pairs[name] = LoraPair(p.a * scale, p.b)
    meta = {"adapter.ggtorch.converted_from": path.name}
    return LoraWithNorms(LoraAdapter("llama", alpha, pairs, meta), norms)
