"""Resumable training checkpoints as GGUF files.

A checkpoint holds everything a run needs to continue exactly where it stopped: the trained
tensors (LoRA pairs under their adapter names), the optimizer's moments and step, the
schedule, RNG states, the data order and the training counters, plus the identity of the
base model so that resuming on another base is refused.

Layout: plain keys for what people and other tools look at (``training.type``, counters,
base identity, LoRA ranks), named tensors for the trained weights, and one JSON string
(``training.state``) for the nested optimizer/scheduler/data state, whose tensors are stored
as GGUF tensors named ``state.<n>`` and referenced from the JSON. Floats in JSON round-trip
exactly (Python writes the shortest repr that reads back to the same double).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ggtorch.errors import BadGGUF, GGTorchError
from ggtorch.io.encode import STORAGE_TYPES, encode
from ggtorch.io.gguf import GGUFFile, TensorOut, read_gguf, require_kind, write_gguf

CHECKPOINT_TYPE = "ggtorch.finetune_lora"
"""``training.type`` of ggtorch's checkpoints (the old llama.cpp finetune wrote ``finetune_lora``)."""
FILE_VERSION = 1
STATE_PREFIX = "state."

def base_identity(base: GGUFFile) -> dict[str, Any]:
    """What identifies a base model for resuming: architecture, name and a hash of its tensors.

    The hash covers every tensor's name, ggml type and shape (not the data: hashing GBs on
    every start would be slow), so a re-quantized or reshaped base is told apart.
    """
    h = hashlib.sha256()
    for name in sorted(base.tensors):
        t = base.tensors[name]
        h.update(f"{name}|{t.ggml_type.name}|{','.join(map(str, t.shape))};".encode())
    return {
        "training.base.architecture": base.architecture,
        "training.base.name": str(base.get("general.name", base.path.stem)),
        "training.base.tensor_hash": h.hexdigest(),
    }


def _pack(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON-able copy of a nested state, tensors replaced by references into ``tensors``."""
    if isinstance(obj, torch.Tensor):
        name = f"{STATE_PREFIX}{len(tensors)}"
        tensors[name] = obj
        return {"__tensor__": name, "dtype": str(obj.dtype).removeprefix("torch."), "shape": list(obj.shape)}
    if isinstance(obj, dict):
        if not all(isinstance(k, (str, int)) for k in obj):
            raise TypeError("checkpoint state keys must be str or int")
        return {"__dict__": [[k, _pack(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"__list__" if isinstance(obj, list) else "__tuple__": [_pack(v, tensors) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot store {type(obj).__name__} in checkpoint state")


def _unpack(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            t = tensors[obj["__tensor__"]]
            return t.reshape(obj["shape"])
        if "__dict__" in obj:
            return {k: _unpack(v, tensors) for k, v in obj["__dict__"]}
        if "__list__" in obj:
            return [_unpack(v, tensors) for v in obj["__list__"]]
        if "__tuple__" in obj:
            return tuple(_unpack(v, tensors) for v in obj["__tuple__"])
    return obj


@dataclass
class Checkpoint:
    """A loaded checkpoint: plain metadata, named trained tensors and the nested state."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    state: dict[str, Any] = field(default_factory=dict)

    @property
    def iteration(self) -> int:
        return int(self.metadata.get("training.iteration_count", 0))

    def check_base(self, base: GGUFFile) -> None:
        """Refuse a checkpoint made on another base model, naming both."""
        expected = base_identity(base)
        for key, value in expected.items():
            if self.metadata.get(key) != value:
                raise GGTorchError(
                    f"{self.path}: this checkpoint was trained on base model "
                    f"'{self.metadata.get('training.base.name')}' "
                    f"({self.metadata.get('training.base.architecture')}, tensor hash "
                    f"{str(self.metadata.get('training.base.tensor_hash'))[:12]}…), not on {base.path} "
                    f"('{expected['training.base.name']}', hash {expected['training.base.tensor_hash'][:12]}…); "
                    "pass the --model-base it was trained on, or another --checkpoint-in to start fresh")


def save_checkpoint(path: str | os.PathLike[str], base: GGUFFile, metadata: dict[str, Any],
                    tensors: dict[str, torch.Tensor], state: dict[str, Any]) -> None:
    """Write a checkpoint atomically (a crash mid-save leaves any previous file intact)."""
    state_tensors: dict[str, torch.Tensor] = {}
    packed = json.dumps(_pack(state, state_tensors), separators=(",", ":"))
    meta = {
        "training.type": CHECKPOINT_TYPE,
        "training.file_version": FILE_VERSION,
        **base_identity(base),
        **metadata,
        "training.state": packed,
    }
    outs = []
    for name, t in {**tensors, **state_tensors}.items():
        ggml_type, data = encode(t, name=name)  # the dtype as it is: resuming continues bit for bit
        outs.append(TensorOut(name, ggml_type, tuple(t.shape) if t.dim() > 0 else (1,), data))
    write_gguf(path, base.architecture, meta, outs)


def _from_bytes(data: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of torch dtype ``dtype`` (``"float32"``) from the bytes ``encode`` stored it as;
    a copy, so the checkpoint's file mapping is not kept alive."""
    torch_dtype = getattr(torch, dtype)
    if torch_dtype not in STORAGE_TYPES:
        raise ValueError(f"a checkpoint does not store {dtype} tensors")
    return torch.from_numpy(np.array(data, dtype=np.uint8)).view(torch_dtype).reshape(shape)


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read a ggtorch checkpoint; refuse other GGUF files with a message that says what they are."""
    f = require_kind(read_gguf(path), "training checkpoint", flag="--checkpoint-in")
    kind = f.get("training.type")
    if kind != CHECKPOINT_TYPE:
        what = "an old llama.cpp finetune checkpoint" if kind == "finetune_lora" else f"a '{kind}' checkpoint"
        raise BadGGUF(f"{f.path}: not a ggtorch training checkpoint (it is {what}); "
                      + ("convert it with `ggtorch convert-old-lora`, or " if kind == "finetune_lora" else "")
                      + "pass a file written by ggtorch's --checkpoint-out")
    try:
        packed = json.loads(f.require("training.state"))
    except json.JSONDecodeError as e:
        raise BadGGUF(f"{f.path}: corrupt training state ({e})") from None
    try:
        return _decode(f, packed)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as e:
        # json and tensor shapes that the GGUF layer cannot vouch for: a corrupt or edited file
        raise BadGGUF(f"{f.path}: corrupt training state ({type(e).__name__}: {e}); "
                      "use an earlier checkpoint or start fresh") from None


def _decode(f: GGUFFile, packed: Any) -> Checkpoint:
    """The checkpoint's tensors and state from a parsed file and its packed state."""
    dtypes = _tensor_dtypes(packed)
    tensors: dict[str, torch.Tensor] = {}
    state_tensors: dict[str, torch.Tensor] = {}
    for name, info in f.tensors.items():
        if name.startswith(STATE_PREFIX):
            dtype, shape = dtypes.get(name, ("float32", info.shape))
            state_tensors[name] = _from_bytes(info.data, dtype, tuple(shape) or (1,))
        else:
            if info.ggml_type != GGMLQuantizationType.F32:
                raise BadGGUF(f"{f.path}: trained tensor '{name}' is {info.ggml_type.name}, expected F32")
            tensors[name] = _from_bytes(info.data, "float32", info.shape)
    missing = set(dtypes) - set(state_tensors)
    if missing:
        raise BadGGUF(f"{f.path}: checkpoint is missing state tensors {sorted(missing)[:3]}; it is corrupt")
    state = _unpack(packed, state_tensors)
    meta = {k: v for k, v in f.metadata.items() if k != "training.state"}
    return Checkpoint(Path(f.path), meta, tensors, state)


def _tensor_dtypes(packed: Any) -> dict[str, tuple[str, list[int]]]:
    """Every tensor reference in a packed state: name -> (dtype, shape)."""
    found: dict[str, tuple[str, list[int]]] = {}

    def walk(obj: Any) -> None:
        if isinstance(obj, dict):
            if "__tensor__" in obj:
                found[obj["__tensor__"]] = (obj["dtype"], obj["shape"])
                return
            for v in obj.values():
                walk(v)
        elif isinstance(obj, list):
            for v in obj:
                walk(v)

    walk(packed)
    return found
