"""GGUF LoRA adapters in today's llama.cpp format: write, read, validate.

The format (llama.cpp ``src/llama-adapter.cpp``): ``general.type = adapter``,
``adapter.type = lora``, ``adapter.lora.alpha`` (FLOAT32), and per adapted base tensor a pair
``<base name>.lora_a`` / ``<base name>.lora_b``. In torch order an ordinary weight
``W (n_out, n_in)`` has ``lora_a (r, n_in)`` and ``lora_b (n_out, r)``; ``token_embd.weight``
``(n_vocab, n_embd)`` has them flipped: ``lora_a (n_vocab, r)``, ``lora_b (n_embd, r)``.
llama.cpp applies ``s · B(A x)`` with ``s = user_scale · alpha / r`` (``r`` = ``b.ne0``, the
last torch axis of ``lora_b``), or ``user_scale`` alone when alpha is 0 or absent.

An adapter here is plain data (:class:`LoraAdapter`): named tensor pairs keyed by base tensor
name. Attaching it to a model, or extracting it from one, is done by :mod:`ggtorch.lora`'s
modules through :func:`adapter_from_model` / :func:`load_adapter_into`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from gguf import GGMLQuantizationType

from ggtorch.errors import BadGGUF, GGTorchError, Unsupported
from ggtorch.io.encode import encode
from ggtorch.io.gguf import GGUFFile, TensorOut, read_gguf, require_kind, write_gguf
from ggtorch.lora.attach import lora_modules, lora_pairs, wrap
from ggtorch.lora.config import NORM_KINDS
from ggtorch.lora.layers import LoRANorm
from ggtorch.models import names
from ggtorch.quant import dequantize

TOKEN_EMBD = "token_embd.weight"
NORM_SUFFIX = "_norm.weight"

ADAPTER_DTYPES: dict[str, GGMLQuantizationType] = {
    "f32": GGMLQuantizationType.F32,
    "f16": GGMLQuantizationType.F16,
    "bf16": GGMLQuantizationType.BF16,
    "q8_0": GGMLQuantizationType.Q8_0,
}
"""dtype names accepted for writing -> ggml type (Q8_0 falls back to F16 for rows not a multiple of 32)."""


@dataclass
class LoraPair:
    """One adapted base tensor: A and B in the GGUF LoRA orientation (torch order), f32."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return int(self.b.shape[-1])


@dataclass
class LoraAdapter:
    """A LoRA adapter as data: pairs keyed by base tensor name (``blk.0.attn_q.weight``)."""

    architecture: str
    alpha: float
    """0 means: no alpha/r factor (llama.cpp's convention for adapters without alpha)."""
    pairs: dict[str, LoraPair]
    metadata: dict[str, Any] = field(default_factory=dict)
    """Extra keys carried along (base model name, ranks, training summary)."""

    def scale(self, name: str, user_scale: float = 1.0) -> float:
        """The factor llama.cpp multiplies B(A x) by for this tensor."""
        rank = self.pairs[name].rank
        return user_scale * self.alpha / rank if self.alpha else user_scale

    def delta(self, name: str, user_scale: float = 1.0) -> torch.Tensor:
        """ΔW in the base tensor's torch orientation, scaled as llama.cpp scales it."""
        pair = self.pairs[name]
        if name == TOKEN_EMBD:
            d = pair.a @ pair.b.T  # (n_vocab, r) @ (r, n_embd)
        else:
            d = pair.b @ pair.a  # (n_out, r) @ (r, n_in), per expert for a stack
        return d * self.scale(name, user_scale)


def expected_pair_shapes(name: str, base_shape: tuple[int, ...],
                         rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Torch shapes of (lora_a, lora_b) for a base tensor, as llama.cpp checks them; an expert stack
    (E, out, in) has one pair per expert, (E, r, in) and (E, out, r)."""
    *experts, n_rows, n_cols = base_shape
    if name == TOKEN_EMBD:
        return (n_rows, rank), (n_cols, rank)
    return (*experts, rank, n_cols), (*experts, n_rows, rank)


def validate_against_base(adapter: LoraAdapter, base: GGUFFile, source: str = "adapter") -> None:
    """The checks llama.cpp makes when loading, with messages that say what to do. Tensors the base lacks or that
    do not fit it are counted over the whole adapter: an adapter of another model is named as one, not blamed on
    its first tensor."""
    made_for = adapter.metadata.get("adapter.base_model") or adapter.metadata.get("general.name")
    of_model = f" (it names its base '{made_for}')" if made_for else ""
    if adapter.architecture != base.architecture:
        raise GGTorchError(f"{source}: the adapter is for a {adapter.architecture} model{of_model}, the base model "
                           f"{base.path} is a {base.architecture}; pass the model it was trained on")
    misfits: list[str] = []
    for name, pair in adapter.pairs.items():
        if name not in base.tensors:
            misfits.append(f"'{name}', which the base does not have")
            continue
        base_shape = base.tensors[name].shape
        if len(base_shape) not in (2, 3):
            raise GGTorchError(f"{source}: adapter targets '{name}' of shape {base_shape}; only matrices and "
                               "expert stacks can carry a LoRA in llama.cpp's format")
        if pair.a.dim() != len(base_shape) or pair.b.dim() != len(base_shape):
            raise GGTorchError(f"{source}: '{name}' lora_a/lora_b must be {len(base_shape)}-D like the base tensor")
        a_rank = pair.a.shape[1] if name == TOKEN_EMBD else pair.a.shape[-2]
        if a_rank != pair.rank:
            raise GGTorchError(f"{source}: '{name}' has lora_a of rank {a_rank} but lora_b of rank "
                               f"{pair.rank}; the file is inconsistent")
        exp_a, exp_b = expected_pair_shapes(name, base_shape, pair.rank)
        if tuple(pair.a.shape) != exp_a or tuple(pair.b.shape) != exp_b:
            misfits.append(f"'{name}' (lora_a {tuple(pair.a.shape)} / lora_b {tuple(pair.b.shape)} against the "
                           f"base tensor's {base_shape}, which takes {exp_a} / {exp_b})")
    if misfits:
        raise GGTorchError(f"{source}: {len(misfits)} of the adapter's {len(adapter.pairs)} tensors do not fit the "
                           f"base model {base.path}, e.g. {misfits[0]}: the adapter was made for another "
                           f"model{of_model}; pass the model it was trained on")
    if TOKEN_EMBD in adapter.pairs and "output.weight" not in base.tensors:  # an adapter that fits, all but this
        raise GGTorchError(f"{source}: adapter targets token_embd.weight, but {base.path} ties its output "
                           "to token_embd and llama.cpp aborts on such an adapter; drop that tensor")


def write_adapter(path: str | os.PathLike[str], adapter: LoraAdapter, dtype: str = "f32") -> Path:
    """Write ``adapter`` as a GGUF LoRA llama.cpp loads (``--lora FILE``), atomically."""
    if dtype not in ADAPTER_DTYPES:
        raise Unsupported(f"adapter dtype '{dtype}' is not supported; use one of {', '.join(ADAPTER_DTYPES)}")
    norms = [n for n in adapter.pairs if n.endswith(NORM_SUFFIX)]
    if norms:
        raise GGTorchError(f"llama.cpp's adapter format cannot carry norm-vector deltas ({norms[0]}, ...); "
                           "merge them into the model with export-lora, or train without --rank-*-norm")
    ranks = sorted({p.rank for p in adapter.pairs.values()})
    metadata = {
        "general.type": "adapter",
        "adapter.type": "lora",
        "adapter.lora.alpha": float(adapter.alpha),
        "adapter.lora.ranks": ",".join(map(str, ranks)),
        **adapter.metadata,
    }
    tensors = []
    for name, pair in adapter.pairs.items():
        for suffix, t in (("lora_a", pair.a), ("lora_b", pair.b)):
            ggml_type, data = encode(t, ADAPTER_DTYPES[dtype], name=f"{name}.{suffix}", fallback=True)
            tensors.append(TensorOut(f"{name}.{suffix}", ggml_type, tuple(t.shape), data))
    path = Path(path)
    write_gguf(path, adapter.architecture, metadata, tensors)
    return path


def read_adapter(path: str | os.PathLike[str]) -> LoraAdapter:
    """Read a GGUF LoRA (ggtorch's or llama.cpp's convert_lora_to_gguf.py output)."""
    f = require_kind(read_gguf(path), "LoRA adapter")
    if f.get("adapter.type") != "lora":
        raise Unsupported(f"{f.path}: a {f.get('adapter.type')} adapter; ggtorch reads LoRA adapters "
                          "(adapter.type 'lora'), as written by --lora-out or llama.cpp's convert_lora_to_gguf.py")
    alpha = float(f.get("adapter.lora.alpha", 0.0) or 0.0)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for name, info in f.tensors.items():
        if name.endswith(".lora_a") or name.endswith(".lora_b"):
            base_name, suffix = name.rsplit(".", 1)
            t = dequantize(info.raw(), info.ggml_type, info.shape, torch.float32, name=name)
            halves.setdefault(base_name, {})[suffix] = t
        elif name.endswith(NORM_SUFFIX):
            continue  # llama.cpp skips plain norm tensors in adapters
        else:
            raise BadGGUF(f"{f.path}: unexpected tensor '{name}' in a LoRA adapter "
                          "(expected <name>.lora_a / <name>.lora_b)")
    pairs = {}
    for base_name, h in halves.items():
        if set(h) != {"lora_a", "lora_b"}:
            missing = ({"lora_a", "lora_b"} - set(h)).pop()
            raise BadGGUF(f"{f.path}: '{base_name}' has no {missing} tensor; the adapter is incomplete")
        pairs[base_name] = LoraPair(h["lora_a"], h["lora_b"])
    if not pairs:
        raise BadGGUF(f"{f.path}: the adapter holds no LoRA tensors")
    extra = {k: v for k, v in f.metadata.items()
             if not k.startswith(("general.architecture", "general.type", "adapter.type", "adapter.lora.alpha"))}
    return LoraAdapter(f.architecture, alpha, pairs, extra)


def adapter_from_model(model: torch.nn.Module, base: GGUFFile, metadata: dict[str, Any] | None = None,
                       drop_norms: bool = False) -> LoraAdapter:
    """The attached LoRA of ``model`` as an adapter for ``base`` (f32 copies of A and B).

    Each module's scale is ``alpha / rank``; the file stores one alpha, so the alpha written is
    that of the adapters (all ggtorch adapters share it). Norm adapters cannot be written:
    they raise unless ``drop_norms``.
    """
    norms = [m.gguf_name for _, m in lora_modules(model) if isinstance(m, LoRANorm)]
    if norms and not drop_norms:
        raise GGTorchError(f"llama.cpp's adapter format cannot carry norm-vector deltas ({norms[0]}, ...); "
                           "merge them into the model with export-lora, or drop them from the adapter")
    pairs: dict[str, LoraPair] = {}
    alphas = set()
    for name, (a, b, scale) in lora_pairs(model).items():
        pair = LoraPair(a.detach().float().cpu().clone(), b.detach().float().cpu().clone())
        pairs[name] = pair
        alphas.add(round(scale * pair.rank, 6))
    if not pairs:
        raise GGTorchError("the model has no LoRA adapters attached; nothing to write")
    if len(alphas) != 1:
        raise GGTorchError(f"adapters with different alphas ({sorted(alphas)}) cannot share one GGUF LoRA file")
    adapter = LoraAdapter(base.architecture, float(alphas.pop()), pairs, dict(metadata or {}))
    validate_against_base(adapter, base, "the trained adapter")
    return adapter


def combine_adapters(adapters: list[tuple[LoraAdapter, float]]) -> LoraAdapter:
    """Several adapters with user scales as one: A's stacked (scaled), B's side by side.

    ``Σ s_i B_i A_i = [B_1 … B_n] · [s_1 A_1; …; s_n A_n]``, exactly; the result has alpha 0
    (llama.cpp's "no alpha/r factor"), so its scale is 1.
    """
    if not adapters:
        raise GGTorchError("no adapters to combine")
    arch = adapters[0][0].architecture
    pieces: dict[str, list[LoraPair]] = {}
    for adapter, user_scale in adapters:
        if adapter.architecture != arch:
            raise GGTorchError(f"cannot stack adapters for '{arch}' and '{adapter.architecture}'")
        for name, pair in adapter.pairs.items():
            pieces.setdefault(name, []).append(LoraPair(pair.a * adapter.scale(name, user_scale), pair.b))
    pairs = {}
    for name, ps in pieces.items():
        if name == TOKEN_EMBD:
            pairs[name] = LoraPair(torch.cat([p.a for p in ps], dim=1), torch.cat([p.b for p in ps], dim=1))
        else:  # the rank axis: A's rows, B's columns (per expert for a stack)
            pairs[name] = LoraPair(torch.cat([p.a for p in ps], dim=-2), torch.cat([p.b for p in ps], dim=-1))
    return LoraAdapter(arch, 0.0, pairs)


def load_adapter_into(model: torch.nn.Module, base: GGUFFile, adapters: list[tuple[LoraAdapter, float]],
                      norms: Sequence[tuple[Mapping[str, LoraPair], float]] = ()) -> torch.nn.Module:
    """Attach ``adapters`` (each with a user scale, stacked) to a model without LoRA, as llama.cpp applies them.

    ``norms``: norm-gain adapters (a ggtorch checkpoint's or the old finetune's, Δg = s·(b @ a)[0]) with their user
    scales, which llama.cpp's format cannot hold and a merge or this model applies."""
    for adapter, _ in adapters:
        validate_against_base(adapter, base)
    pairs = dict(combine_adapters(adapters).pairs) if adapters else {}  # combined: alpha 0, so each scale is 1
    norm_pieces: dict[str, list[LoraPair]] = {}
    for gains, user_scale in norms:
        for name, pair in gains.items():
            norm_pieces.setdefault(name, []).append(LoraPair(pair.a * user_scale, pair.b))
    for name, ps in norm_pieces.items():
        pairs[name] = LoraPair(torch.cat([p.a for p in ps], dim=0), torch.cat([p.b for p in ps], dim=1))
    for name in pairs:
        parsed = names.parse_gguf_name(name)
        if parsed is None or (name in norm_pieces) != (parsed[0] in NORM_KINDS):
            raise GGTorchError(f"adapter tensor '{name}' is not a weight of this model that a LoRA can adapt")
    with torch.no_grad():
        for name, pair in pairs.items():
            kind, bid = names.parse_gguf_name(name)  # type: ignore[misc]  # checked above
            module = wrap(model, kind, bid, pair.rank)
            module.scale = 1.0
            module.lora_a.copy_(pair.a)
            module.lora_b.copy_(pair.b)
            module.requires_grad_(False)
    return model
