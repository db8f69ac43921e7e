"""Merge LoRA adapters into a GGUF model: ``W + Σ user_scale·(alpha/r)·B·A`` (llama.cpp's export-lora).

Sources: GGUF LoRA adapters, ggtorch training checkpoints (whose norm-gain adapters only a
merge can keep) and the old llama.cpp finetune's adapters/checkpoints. The output carries
every metadata key (with its GGUF type) and every untouched tensor byte for byte; merged
tensors are computed in f32 and written in the chosen type, one tensor at a time (the writer
pulls them from a generator), so peak memory is about one tensor.

``outtype="same"`` writes each merged tensor in its base type when ggtorch quantizes that type
bit-exactly like llama.cpp (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, ...); K-quant and IQ
tensors become Q8_0 (finer than any of them; F16 if rows are not a multiple of 32), unlike
llama.cpp's export-lora, which turns every merged non-F32 tensor into F16.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ggtorch.errors import BadFlag, BadGGUF, GGTorchError, NonFiniteValues, Unsupported
from ggtorch.export.old_formats import OLD_CHECKPOINT_TYPE, LoraWithNorms, is_ggla, read_old
from ggtorch.export.peft import import_peft
from ggtorch.io.checkpoint import CHECKPOINT_TYPE, load_checkpoint
from ggtorch.io.encode import fallback_type, quantize
from ggtorch.io.gguf import GGUFFile, read_gguf, require_kind, write_gguf_streaming
from ggtorch.io.lock import writing
from ggtorch.io.model_file import FILE_TYPES
from ggtorch.io.model_file import OUTTYPES as MODEL_OUTTYPES
from ggtorch.io.paths import Input, Output, check_input
from ggtorch.lora.adapter_file import NORM_SUFFIX, LoraAdapter, LoraPair, read_adapter, validate_against_base
from ggtorch.ops.dtypes import finite_in_f32
from ggtorch.ops.threads import follow_free_cores
from ggtorch.quant import dequantize

T = GGMLQuantizationType

OUTTYPES: dict[str, GGMLQuantizationType | None] = {"same": None, **MODEL_OUTTYPES}
"""--outtype -> the type of every merged matrix (``same``: each its base's, see plan_merge)."""
_FLOAT_TYPES = (T.F32, T.F16, T.BF16)


@dataclass
class MergeSource:
    """One adapter to merge, with its user scale; ``norms`` are gain deltas Δg = s·(b @ a)[0]."""

    path: Path
    adapter: LoraAdapter
    norms: dict[str, LoraPair]
    user_scale: float = 1.0


@dataclass
class MergePlan:
    """What a merge writes: merged tensor name -> (base type, written type), and general.file_type."""

    merged: dict[str, tuple[GGMLQuantizationType, GGMLQuantizationType]]
    file_type: int | None

    def fallbacks(self) -> Counter[tuple[GGMLQuantizationType, GGMLQuantizationType]]:
        """(base type, written type) -> count, for merged tensors not written in their base type."""
        return Counter(v for v in self.merged.values() if v[0] != v[1])


def read_source(path: str | os.PathLike[str], user_scale: float = 1.0, base: GGUFFile | None = None) -> MergeSource:
    """Any file that holds a LoRA: GGUF adapter, ggtorch checkpoint, old ggla adapter or checkpoint, or a PEFT
    folder (read against ``base``, whose Hugging Face module names it uses)."""
    path = Path(path)
    if not finite_in_f32(user_scale):
        raise BadFlag(f"--lora-scaled {path}:{user_scale}: the scale must be a finite number (within f32's range)")
    if path.is_dir():
        if base is None:
            raise BadFlag(f"--lora {path}: a PEFT folder is read against its base model; convert it first with "
                          f"`ggtorch convert-lora {path} --base BASE.gguf --outfile adapter.gguf`")
        return MergeSource(path, import_peft(path, base), {}, user_scale)
    check_input(Input("--lora", path))
    if is_ggla(path):
        return _from_old(path, read_old(path), user_scale)
    f = read_gguf(path)
    kind = f.get("training.type")
    if kind == CHECKPOINT_TYPE:
        return _from_checkpoint(path, user_scale)
    if kind == OLD_CHECKPOINT_TYPE:
        return _from_old(path, read_old(path), user_scale)
    require_kind(f, "LoRA adapter", "training checkpoint", flag="--lora")
    return MergeSource(path, read_adapter(path), {}, user_scale)


def _from_old(path: Path, old: LoraWithNorms, user_scale: float) -> MergeSource:
    return MergeSource(path, old.adapter, old.norms, user_scale)


def _from_checkpoint(path: Path, user_scale: float) -> MergeSource:
    """A ggtorch checkpoint: matrices scaled alpha/r as trained, norms with scale 1."""
    ck = load_checkpoint(path)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in ck.tensors.items():
        if name.endswith((".lora_a", ".lora_b")):
            base, suffix = name.rsplit(".", 1)
            halves.setdefault(base, {})[suffix] = t
    pairs, norms = {}, {}
    for base, h in halves.items():
        if set(h) != {"lora_a", "lora_b"}:
            raise BadGGUF(f"{path}: '{base}' has only one of its LoRA halves; the checkpoint is incomplete")
        (norms if base.endswith(NORM_SUFFIX) else pairs)[base] = LoraPair(h["lora_a"].float(), h["lora_b"].float())
    if not halves:
        raise BadGGUF(f"{path}: the checkpoint holds no LoRA tensors")
    alpha = float(ck.metadata.get("training.lora.alpha", 0.0))
    arch = str(ck.metadata.get("training.base.architecture", "llama"))
    return MergeSource(path, LoraAdapter(arch, alpha, pairs), norms, user_scale)


def validate_source(src: MergeSource, base: GGUFFile) -> None:
    """llama.cpp's adapter checks for the matrices, and the same for norm gains."""
    validate_against_base(src.adapter, base, str(src.path))
    for name, pair in src.norms.items():
        info = base.tensors.get(name)
        if info is None or len(info.shape) != 1:
            raise GGTorchError(f"{src.path}: norm adapter '{name}' has no 1-D tensor of that name in {base.path}")
        rank = pair.b.shape[-1]
        if tuple(pair.a.shape) != (rank, info.shape[0]) or tuple(pair.b.shape) != (1, rank):
            raise GGTorchError(f"{src.path}: norm adapter '{name}' lora_a {tuple(pair.a.shape)} / lora_b "
                               f"{tuple(pair.b.shape)} do not fit the gain of {info.shape[0]} values "
                               f"(expected {(rank, info.shape[0])} / {(1, rank)}); "
                               "the adapter was made for another model")


def plan_merge(base: GGUFFile, sources: list[MergeSource], outtype: str = "same") -> MergePlan:
    """Which tensors get merged and in which type they are written."""
    if outtype not in OUTTYPES:
        raise Unsupported(f"--outtype '{outtype}' is not supported; use one of {', '.join(OUTTYPES)}")
    targets = {n for s in sources for n in (*s.adapter.pairs, *s.norms)}
    requested = OUTTYPES[outtype]
    merged = {}
    for name, info in base.tensors.items():
        if name not in targets:
            continue
        if len(info.shape) == 1:  # norm gains stay float (F32 unless the base had F16/BF16)
            out = info.ggml_type if info.ggml_type in _FLOAT_TYPES and requested is None else T.F32
        else:
            out = fallback_type(requested or info.ggml_type, info.shape)
        merged[name] = (info.ggml_type, out)
    return MergePlan(merged, _file_type(base, merged))


def _file_type(base: GGUFFile, merged: dict[str, tuple[GGMLQuantizationType, GGMLQuantizationType]]) -> int | None:
    """general.file_type after the merge: kept while the dominant matrix type is unchanged, else that type's."""
    def dominant(types: dict[str, GGMLQuantizationType]) -> GGMLQuantizationType | None:
        counts: Counter[GGMLQuantizationType] = Counter()
        for name, info in base.tensors.items():
            if len(info.shape) >= 2:
                counts[types.get(name, info.ggml_type)] += info.n_elements
        return counts.most_common(1)[0][0] if counts else None

    before = dominant({})
    after = dominant({n: out for n, (_, out) in merged.items()})
    current = base.get("general.file_type")
    if after == before or after not in FILE_TYPES:
        return current
    return int(FILE_TYPES[after])


def merged_weight(base: GGUFFile, name: str, sources: list[MergeSource]) -> torch.Tensor:
    """The base tensor in f32 plus every source's delta, added in order as llama.cpp does.

    An expert stack with a per-expert scale (gemma4's ``ffn_down_exps.scale``) scales its product, not an adapter's
    (llama.cpp's build_lora_mm_id): each expert's delta is divided by its scale, so that the merged model computes
    what the base with the adapter computes."""
    follow_free_cores()
    info = base.tensors[name]
    w = dequantize(info.raw(), info.ggml_type, info.shape, torch.float32, name=name)
    scale_name = name.removesuffix(".weight") + ".scale"
    unscale = None
    if len(info.shape) == 3 and scale_name in base.tensors:
        scale = base.tensors[scale_name]
        unscale = 1 / dequantize(scale.raw(), scale.ggml_type, scale.shape, torch.float32, name=scale_name)
    for src in sources:
        if name in src.adapter.pairs:
            delta = src.adapter.delta(name, src.user_scale)
            w = (delta if unscale is None else delta * unscale.reshape(-1, 1, 1)) + w
        elif name in src.norms:
            pair = src.norms[name]
            w = (pair.b @ pair.a)[0] * src.user_scale + w
    return w


def merge_to_gguf(base_path: str | os.PathLike[str], sources: list[MergeSource], out_path: str | os.PathLike[str],
                  outtype: str = "same") -> MergePlan:
    """Write ``out_path``: the base model with every source merged in (atomically, streamed)."""
    if not sources:
        raise GGTorchError("no adapters to merge; pass --lora FILE or --lora-scaled FILE SCALE")
    with writing([Input("-m", base_path), *(Input("--lora", src.path) for src in sources)], [Output("-o", out_path)]):
        return _merge_to_gguf(base_path, sources, out_path, outtype)


def _merge_to_gguf(base_path: str | os.PathLike[str], sources: list[MergeSource], out_path: str | os.PathLike[str],
                   outtype: str) -> MergePlan:
    """:func:`merge_to_gguf` once its files are checked and ``out_path`` is locked."""
    base = require_kind(read_gguf(base_path), "model", flag="-m")
    for src in sources:
        validate_source(src, base)
    plan = plan_merge(base, sources, outtype)
    infos = [(n, plan.merged[n][1] if n in plan.merged else t.ggml_type, t.shape) for n, t in base.tensors.items()]

    def data() -> Iterator[np.ndarray]:
        for name, info in base.tensors.items():
            if name in plan.merged:
                merged = merged_weight(base, name, sources)
                if not bool(torch.isfinite(merged).all()):
                    raise NonFiniteValues(f"merging gives NaN or inf in '{name}' (an adapter holding them, or a scale "
                                          f"too large), so {out_path} was not written")
                yield quantize(merged, plan.merged[name][1], name)
            else:
                yield info.data

    metadata = dict(base.metadata)
    # the writer aligns tensor data to GGUF's default 32 bytes; a copied other alignment would lie
    metadata.pop("general.alignment", None)
    if plan.file_type is not None:
        metadata["general.file_type"] = plan.file_type
    write_gguf_streaming(out_path, base.architecture, metadata, infos, data(), base.value_types)
    return plan
