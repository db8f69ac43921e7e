"""PEFT LoRA adapter folders <-> ggtorch adapters, for every supported family, both ways.

A PEFT folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` with Hugging
Face module names (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``).
Only the GGUF base model is needed on either side, never the Hugging Face folder.

Module names follow the family's Hugging Face model: llama, qwen2, qwen3, gemma2 and gemma3 have
``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``; phi3 fuses them as ``qkv_proj``
(GGUF ``attn_qkv``) and ``gate_up_proj`` (GGUF ``ffn_up``, gate rows first on both sides); qwen2moe's
shared expert is ``mlp.shared_expert.*_proj``. A GGUF whose q/k/v are fused where the Hugging Face model
splits them, or the reverse, has no PEFT counterpart and is refused, as are routed experts' adapters
(transformers keeps experts as fused 3-D parameters, not modules).

Three layout differences between the two worlds:

- **q/k rows (llama only).** llama.cpp's converter (``LlamaModel.permute`` in
  convert_hf_to_gguf.py) stores attn_q / attn_k with the rows of each head reordered from
  Hugging Face's "two halves" rope layout to ggml's "interleaved pairs": per head, HF row
  ``p·hd/2 + j`` becomes GGUF row ``2j + p``. ``ΔW = B·A`` follows its rows, so only ``lora_B``
  is permuted; attn_k uses the KV head count. The other families use ggml's NEOX rope, which is
  Hugging Face's layout: the converter stores their rows as they are.
- **token embeddings.** PEFT's ``lora_embedding_A (r, n_vocab)`` / ``lora_embedding_B
  (n_embd, r)`` give ``ΔE = Aᵀ·Bᵀ``; GGUF LoRA holds ``lora_a (n_vocab, r)`` = Aᵀ and
  ``lora_b (n_embd, r)`` = B.
- **scales.** GGUF LoRA has one alpha and scales each tensor by ``alpha / r``; PEFT has a
  default ``r`` and ``lora_alpha`` with per-module ``rank_pattern`` / ``alpha_pattern``, and
  ``use_rslora`` (``alpha / √r``). On import, a module whose PEFT scale differs from
  ``lora_alpha / r`` gets the ratio folded into its ``lora_B``, so llama.cpp applies the
  same ``ΔW`` (user scales stay linear).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import re
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ggtorch.errors import BadData, GGTorchError, NonFiniteValues, Unsupported
from ggtorch.io.atomic import atomic_paths, failure
from ggtorch.io.gguf import GGUFFile
from ggtorch.lora.adapter_file import TOKEN_EMBD, LoraAdapter, LoraPair, validate_against_base
from ggtorch.models import names
from ggtorch.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_FILES = (CONFIG_FILE, WEIGHTS_FILE)
"""What export_peft writes into its folder."""
PICKLE_WEIGHTS_FILE = "adapter_model.bin"
BASE_LAYER_SUFFIX = ".base_layer.weight"
PEFT_PREFIX = "base_model.model."
"""What PeftModel puts before the base model's module names in saved keys."""

# tensor kind -> Hugging Face LlamaForCausalLM module path ({bid}: layer index); qwen2, qwen3,
# gemma2 and gemma3 name their modules alike
HF_MODULES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output": "lm_head",
    "attn_q": "model.layers.{bid}.self_attn.q_proj",
    "attn_k": "model.layers.{bid}.self_attn.k_proj",
    "attn_v": "model.layers.{bid}.self_attn.v_proj",
    "attn_output": "model.layers.{bid}.self_attn.o_proj",
    "ffn_gate": "model.layers.{bid}.mlp.gate_proj",
    "ffn_up": "model.layers.{bid}.mlp.up_proj",
    "ffn_down": "model.layers.{bid}.mlp.down_proj",
}
_NO_FFN: dict[str, str] = {kind: path for kind, path in HF_MODULES.items() if not kind.startswith("ffn_")}
_SHARED_EXPERT: dict[str, str] = {"ffn_gate_shexp": "model.layers.{bid}.mlp.shared_expert.gate_proj",
                                  "ffn_up_shexp": "model.layers.{bid}.mlp.shared_expert.up_proj",
                                  "ffn_down_shexp": "model.layers.{bid}.mlp.shared_expert.down_proj"}
_DELTA_NET: dict[str, str] = {"attn_qkv": "model.layers.{bid}.linear_attn.in_proj_qkv",
                              "attn_gate": "model.layers.{bid}.linear_attn.in_proj_z",
                              "ssm_beta": "model.layers.{bid}.linear_attn.in_proj_b",
                              "ssm_alpha": "model.layers.{bid}.linear_attn.in_proj_a",
                              "ssm_out": "model.layers.{bid}.linear_attn.out_proj"}
"""Qwen3.5's Gated DeltaNet modules (Qwen3_5GatedDeltaNet); its full-attention layers have q/k/v/o_proj."""
FAMILY_HF_MODULES: dict[str, dict[str, str]] = {
    "phi3": {"token_embd": "model.embed_tokens", "output": "lm_head",
             "attn_qkv": "model.layers.{bid}.self_attn.qkv_proj",
             "attn_output": "model.layers.{bid}.self_attn.o_proj",
             "ffn_up": "model.layers.{bid}.mlp.gate_up_proj",
             "ffn_down": "model.layers.{bid}.mlp.down_proj"},
    "qwen3moe": _NO_FFN,
    "gpt-oss": _NO_FFN,
    "qwen2moe": _NO_FFN | _SHARED_EXPERT,
    "qwen35": HF_MODULES | _DELTA_NET,
    "qwen35moe": _NO_FFN | _SHARED_EXPERT | _DELTA_NET,
    "gemma4": HF_MODULES | {"per_layer_inp_gate": "model.layers.{bid}.per_layer_input_gate",
                            "per_layer_proj": "model.layers.{bid}.per_layer_projection"},
}
"""Architectures whose Hugging Face module names differ from HF_MODULES: Phi3ForCausalLM's, the MoE
models (qwen3moe, qwen2moe, gpt-oss, qwen35moe), whose routed experts are no modules (below) and whose FFN is qwen2moe's
shared expert, Qwen3.5's linear-attention layers, and Gemma 4's per-layer embedding gate and projection (its MoE
layers keep the dense MLP's names beside the experts)."""
EXPERT_REFUSAL = ("transformers stores a MoE's routed experts as fused 3-D parameters (mlp.experts.gate_up_proj, "
                  "mlp.experts.down_proj), not as modules a PEFT LoRA can target, so expert adapters have no "
                  "PEFT counterpart: train with --rank-exps 0 for a PEFT export, or merge the adapter into the "
                  "model with export-lora")
HF_CLASSES: dict[str, str] = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                              "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
                              "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
                              "mistral3": "Ministral3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                              "gpt-oss": "GptOssForCausalLM", "granite": "GraniteForCausalLM",
                              "qwen35": "Qwen3_5ForCausalLM", "qwen35moe": "Qwen3_5MoeForCausalLM",
                              "gemma4": "Gemma4ForCausalLM"}
"""The Hugging Face model class of each family, for messages."""
HF_LEAVES: dict[str, str] = {path.rsplit(".", 1)[-1]: kind for kind, path in HF_MODULES.items()}
"""``q_proj`` -> ``attn_q``: the names PEFT's ``target_modules`` usually lists."""
_ALL_LEAVES: tuple[str, ...] = tuple(dict.fromkeys(
    path.rsplit(".", 1)[-1] for table in (HF_MODULES, *FAMILY_HF_MODULES.values()) for path in table.values()))
"""Module leaves of every family: what a PEFT config may target."""


def hf_modules(architecture: str = "llama") -> dict[str, str]:
    """Tensor kind -> Hugging Face module path in the model of ``architecture``."""
    return FAMILY_HF_MODULES.get(architecture, HF_MODULES)


def _hf_patterns(architecture: str) -> list[tuple[str, re.Pattern[str]]]:
    return [(kind, re.compile(re.escape(p).replace(re.escape("{bid}"), r"(\d+)") + "$"))
            for kind, p in hf_modules(architecture).items()]
_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<half>lora_A\.weight|lora_B\.weight|lora_embedding_A|lora_embedding_B)$")

# PEFT config features a GGUF LoRA cannot express: (key, value that is fine, why not)
_REFUSED_OPTIONS: tuple[tuple[str, Any, str], ...] = (
    ("use_dora", False, "DoRA's magnitude vectors have no GGUF LoRA equivalent; merge the adapter with peft "
                        "(merge_and_unload) and convert the merged model instead"),
    ("fan_in_fan_out", False, "fan_in_fan_out is for GPT-2 style Conv1D layers, which llama does not have"),
    ("modules_to_save", None, "fully trained modules (modules_to_save) are not LoRA pairs; merge the adapter "
                              "with peft and convert the merged model instead"),
    ("lora_bias", False, "LoRA biases have no place in llama.cpp's adapter format"),
    ("trainable_token_indices", None, "trainable token rows are not LoRA pairs"),
)


def _fusion_hint(architecture: str) -> str:
    if architecture in ("qwen35", "qwen35moe"):
        return ""
    if architecture == "phi3":
        return (f"; Hugging Face's {architecture} fuses q/k/v (qkv_proj) and gate/up (gate_up_proj), so a "
                "LoRA on separate attn_q/attn_k/attn_v or ffn_gate has no PEFT counterpart")
    return (f"; Hugging Face's {architecture} has separate q_proj/k_proj/v_proj, so a LoRA on a fused "
            "attn_qkv has no PEFT counterpart")


def hf_module_name(gguf_name: str, architecture: str = "llama") -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj`` (GGTorchError if not adaptable)."""
    modules = hf_modules(architecture)
    parsed = names.parse_gguf_name(gguf_name)
    if parsed is not None and parsed[0] in names.EXPERT_KINDS:
        raise GGTorchError(f"'{gguf_name}': {EXPERT_REFUSAL}")
    if parsed is None or parsed[0] not in modules:
        raise GGTorchError(f"'{gguf_name}' has no LoRA counterpart in a Hugging Face {architecture}; "
                           f"adaptable tensors: {', '.join(modules)}{_fusion_hint(architecture)}")
    kind, bid = parsed
    return modules[kind].format(bid=bid)


def gguf_tensor_name(hf_module: str, architecture: str = "llama") -> str | None:
    """``model.layers.3.self_attn.q_proj`` -> ``blk.3.attn_q.weight``; None for an unknown module."""
    for kind, pattern in _hf_patterns(architecture):
        m = pattern.match(hf_module)
        if m:
            return names.gguf_name(kind, int(m.group(1)) if m.groups() else None)
    return None


def hf_rows_to_gguf(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Reorder the rows of a q/k matrix (or its lora_B) from Hugging Face's layout to GGUF's."""
    rest = t.shape[1:]
    return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *rest).transpose(1, 2).reshape(t.shape)


def gguf_rows_to_hf(t: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of :func:`hf_rows_to_gguf`: per head, interleaved rope pairs back to two halves."""
    rest = t.shape[1:]
    return t.reshape(n_head, t.shape[0] // n_head // 2, 2, *rest).transpose(1, 2).reshape(t.shape)


def _value_head_order(kind: str, config: ModelConfig, to_hf: bool) -> tuple[str, torch.Tensor] | None:
    """Where a Gated DeltaNet's value heads sit in a LoRA pair, and the order that moves them between the layouts
    (None: nothing to move). Hugging Face groups value heads by key head (k0: v0 v1, k1: v0 v1); llama.cpp's
    converter tiles them (v0 of k0, v0 of k1, v1 of k0, ...) for ggml's broadcast, in the rows of attn_qkv's v part,
    attn_gate, ssm_beta and ssm_alpha, and in the columns of ssm_out. Returns ("b" rows or "a" columns, index) with
    ``new = old[index]`` along that dimension."""
    if not config.family.linear_attention or kind not in ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha",
                                                          "ssm_out"):
        return None
    k_heads, per_key = config.ssm_k_heads, config.ssm_v_heads // config.ssm_k_heads
    if per_key == 1:
        return None
    width = 1 if kind in ("ssm_beta", "ssm_alpha") else config.ssm_state
    n = config.ssm_v_heads * width
    tiled = (per_key, k_heads, width)  # llama.cpp's order, outermost first
    grouped = (k_heads, per_key, width)  # Hugging Face's
    index = torch.arange(n).reshape(tiled if to_hf else grouped).transpose(0, 1).reshape(n)
    if kind == "attn_qkv":  # only the v rows, after q and k
        keys = 2 * config.ssm_k_heads * config.ssm_state
        index = torch.cat((torch.arange(keys), keys + index))
    return ("a" if kind == "ssm_out" else "b"), index


def _reorder_value_heads(kind: str, config: ModelConfig, a: torch.Tensor, b: torch.Tensor,
                         to_hf: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A LoRA pair's (a, b) with a DeltaNet's value heads moved to the other layout (see _value_head_order)."""
    order = _value_head_order(kind, config, to_hf)
    if order is None:
        return a, b
    where, index = order
    return (a[:, index], b) if where == "a" else (a, b[index])


def _rope_heads(config: ModelConfig) -> dict[str, int]:
    """Heads whose rows the converter permuted, per tensor kind: llama's NORM rope only."""
    if config.family.rope != "norm":
        return {}
    return {"attn_q": config.n_head, "attn_k": config.n_head_kv}


def _other_qkv_layout(gguf_name: str) -> str | None:
    """The tensor that holds a q/k/v projection in the other layout: attn_qkv <-> attn_q (None: not q/k/v)."""
    parsed = names.parse_gguf_name(gguf_name)
    if parsed is None or parsed[0] not in ("attn_qkv", "attn_q", "attn_k", "attn_v"):
        return None
    return names.gguf_name("attn_q" if parsed[0] == "attn_qkv" else "attn_qkv", parsed[1])


def _kind(gguf_name: str) -> str:
    parsed = names.parse_gguf_name(gguf_name)
    assert parsed is not None
    return parsed[0]


# ---------------------------------------------------------------------------------------------
# ggtorch adapter -> PEFT folder


def export_peft(adapter: LoraAdapter, base: GGUFFile, out_dir: str | os.PathLike[str],
                base_model_name: str | None = None, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``adapter`` (for the GGUF ``base``) as a PEFT LoRA folder peft can load onto the HF model.

    ``base_model_name`` goes to ``base_model_name_or_path``; by default the base's
    ``general.source.huggingface.repository`` or ``general.name``.
    """
    validate_against_base(adapter, base)
    config = ModelConfig.from_gguf(base)
    heads = _rope_heads(config)
    tensors: dict[str, torch.Tensor] = {}
    ranks: dict[str, int] = {}
    for name, pair in adapter.pairs.items():
        module = hf_module_name(name, base.architecture)
        key = PEFT_PREFIX + module
        kind = _kind(name)
        if name == TOKEN_EMBD:
            tensors[f"{key}.lora_embedding_A"] = pair.a.T
            tensors[f"{key}.lora_embedding_B"] = pair.b
        else:
            b = gguf_rows_to_hf(pair.b, heads[kind]) if kind in heads else pair.b
            a, b = _reorder_value_heads(kind, config, pair.a, b, to_hf=True)
            tensors[f"{key}.lora_A.weight"] = a
            tensors[f"{key}.lora_B.weight"] = b
        ranks[module] = pair.rank
    r = Counter(ranks.values()).most_common(1)[0][0]
    # alpha 0 means "scale 1" in GGUF LoRA: in PEFT that is alpha = r for every module
    lora_alpha = adapter.alpha if adapter.alpha else r
    alpha_pattern = {} if adapter.alpha else {m: k for m, k in ranks.items() if k != r}
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name or str(
            base.get("general.source.huggingface.repository") or base.get("general.name", base.path.stem)),
        "r": r,
        "lora_alpha": lora_alpha,
        "rank_pattern": {m: k for m, k in ranks.items() if k != r},
        "alpha_pattern": alpha_pattern,
        "target_modules": _target_modules(ranks, config, base.architecture),
        "lora_dropout": 0.0,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "inference_mode": True,
    }
    for key, value in tensors.items():
        if not bool(torch.isfinite(value).all()):
            raise NonFiniteValues(f"the adapter's '{key}' holds NaN or inf values, so no PEFT folder was written")
    out = Path(out_dir)
    made = _make_folder(out)
    config_bytes = (json.dumps(peft_config, indent=2) + "\n").encode()
    try:
        with atomic_paths([out / WEIGHTS_FILE, out / CONFIG_FILE],
                          [safetensors_size, lambda _: len(config_bytes)]) as (weights_tmp, config_tmp):
            try:
                save_file({k: v.detach().to("cpu", dtype).contiguous() for k, v in tensors.items()},
                          str(weights_tmp), metadata={"format": "pt"})
            except SafetensorError as e:  # its Rust writer's io error (a full disk): the OSError it stands for
                raise OSError(str(e)) from None
            config_tmp.write_bytes(config_bytes)
    except BaseException:
        for folder in made:  # a folder this call made holds nothing now: nothing of a failed export stays
            with contextlib.suppress(OSError):
                folder.rmdir()
        raise
    return out


def _make_folder(out: Path) -> list[Path]:
    """Make ``out`` and its missing parents; the ones made, innermost first (WriteFailed naming the disk)."""
    missing = [p for p in (out, *out.parents) if not p.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise failure(out, e, "nothing was written") from None
    return missing


def safetensors_size(path: Path) -> int:
    """The size a safetensors file's own header says it has (8 + header + data): what must have reached the disk."""
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little")
        try:
            header = json.loads(f.read(n)) if len(head) == 8 else None
        except ValueError:
            header = None
    if not isinstance(header, dict):
        raise OSError(errno.EIO, "the safetensors header did not reach the disk whole")
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
    return 8 + n + max(ends, default=0)


def _target_modules(ranks: dict[str, int], config: ModelConfig, architecture: str) -> list[str]:
    """Leaf names (``q_proj``) when each adapted leaf is adapted everywhere, else full module names.

    PEFT wraps every module a target matches; full names keep it from wrapping modules the
    adapter does not cover.
    """
    modules = hf_modules(architecture)
    kinds = {m.rsplit(".", 1)[-1]: k for k, m in modules.items()}
    leaves = {m.rsplit(".", 1)[-1] for m in ranks}
    every = {modules[kinds[leaf]].format(bid=i) for leaf in leaves for i in range(config.n_layer)}
    return sorted(leaves) if every == set(ranks) else sorted(ranks)


# ---------------------------------------------------------------------------------------------
# PEFT folder -> ggtorch adapter


def read_peft_config(peft_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """``adapter_config.json`` of a PEFT LoRA folder, checked for what GGUF LoRA can express."""
    d = Path(peft_dir)
    if not d.is_dir():
        raise BadData(f"{d}: no such folder; pass a PEFT adapter folder (adapter_config.json + "
                      f"{WEIGHTS_FILE})")
    path = d / CONFIG_FILE
    if not path.is_file():
        raise BadData(f"{d}: not a PEFT adapter folder (no {CONFIG_FILE}); pass the folder that "
                      "PeftModel.save_pretrained wrote")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadData(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise BadData(f"{path}: expected a JSON object")
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise Unsupported(f"{path}: peft_type '{peft_type}' is not LoRA; only LoRA adapters convert to GGUF LoRA")
    for key, fine, why in _REFUSED_OPTIONS:
        value = cfg.get(key, fine)
        if value not in (fine, None, False, [], {}):
            raise Unsupported(f"{path}: {key} = {value!r}: {why}")
    if cfg.get("bias", "none") != "none":
        raise Unsupported(f"{path}: bias = '{cfg['bias']}': trained biases have no place in llama.cpp's adapter "
                          "format; train with bias='none'")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        unknown = [t for t in targets if t.rsplit(".", 1)[-1] not in _ALL_LEAVES]
        if unknown:
            raise Unsupported(f"{path}: target_modules {unknown} are not LoRA targets ggtorch knows; "
                              f"supported: {', '.join(_ALL_LEAVES)}")
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), (int, float)) or cfg[key] <= 0:
            raise BadData(f"{path}: '{key}' must be a positive number, not {cfg.get(key)!r}")
    return cfg


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module name or its dotted tail."""
    for key, value in patterns.items():
        try:
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        except re.error as e:
            raise BadData(f"rank_pattern / alpha_pattern key {key!r} is not a valid regular expression ({e})") from None
    return default


def _read_peft_tensors(d: Path) -> dict[str, torch.Tensor]:
    path = d / WEIGHTS_FILE
    if not path.is_file():
        if (d / PICKLE_WEIGHTS_FILE).is_file():
            raise Unsupported(f"{d}: holds {PICKLE_WEIGHTS_FILE} (a pickle, which can run code when read); "
                              f"re-save it with save_pretrained(..., safe_serialization=True) to get {WEIGHTS_FILE}")
        raise BadData(f"{d}: no {WEIGHTS_FILE} beside {CONFIG_FILE}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise BadData(f"{path}: not a readable safetensors file ({e})") from None


def _check_saved_base_layer(key: str, t: torch.Tensor, base: GGUFFile) -> None:
    """peft saves embed_tokens / lm_head whole beside their LoRA (``save_embedding_layers``).

    Like convert_lora_to_gguf.py, ggtorch ignores them: the GGUF base supplies those weights.
    A copy of another shape means a resized vocabulary, which a LoRA on this base cannot carry.
    """
    module = key.removesuffix(BASE_LAYER_SUFFIX).removeprefix(PEFT_PREFIX)
    name = gguf_tensor_name(module, base.architecture)
    if name is None or name not in base.tensors:
        raise Unsupported(f"'{key}': a saved copy of '{module}', which {base.path} does not have")
    if tuple(t.shape) != base.tensors[name].shape:
        raise GGTorchError(f"'{key}' has shape {tuple(t.shape)} but {base.path}'s {name} is "
                           f"{base.tensors[name].shape}: the adapter was trained with a resized vocabulary "
                           "or on another model; merge it with peft and convert the merged model instead")


def import_peft(peft_dir: str | os.PathLike[str], base: GGUFFile) -> LoraAdapter:
    """A PEFT LoRA folder as a GGUF LoRA adapter for ``base``, checked against it."""
    d = Path(peft_dir)
    cfg = read_peft_config(d)
    config = ModelConfig.from_gguf(base)
    heads = _rope_heads(config)
    halves: dict[str, dict[str, torch.Tensor]] = {}
    modules: dict[str, str] = {}  # gguf name -> HF module
    for key, t in _read_peft_tensors(d).items():
        if key.endswith(BASE_LAYER_SUFFIX):
            _check_saved_base_layer(key, t, base)
            continue
        m = _LORA_KEY.match(key)
        if m is None:
            raise Unsupported(f"{d / WEIGHTS_FILE}: tensor '{key}' is not a LoRA A/B weight "
                              "(biases, DoRA magnitudes and saved base modules cannot go into a GGUF LoRA)")
        module = m.group("module").removeprefix(PEFT_PREFIX)
        name = gguf_tensor_name(module, base.architecture)
        if name is None:
            leaves = ", ".join(m.rsplit(".", 1)[-1] for m in hf_modules(base.architecture).values())
            hf_class = HF_CLASSES.get(base.architecture, base.architecture)
            raise Unsupported(f"{d / WEIGHTS_FILE}: '{key}' adapts '{module}', which is not a {base.architecture} "
                              f"module ggtorch knows (supported: {leaves} of a {hf_class})")
        other = _other_qkv_layout(name)
        if name not in base.tensors and other in base.tensors:
            raise Unsupported(f"{d / WEIGHTS_FILE}: '{key}' adapts '{module}', but {base.path} stores that "
                              f"projection as {other}; a PEFT LoRA cannot be converted across that layout")
        half = "a" if "A" in m.group("half") else "b"
        if (name == TOKEN_EMBD) != ("embedding" in m.group("half")):
            raise BadData(f"{d / WEIGHTS_FILE}: '{key}': embed_tokens carries lora_embedding_A/B, "
                          "linear layers lora_A/B.weight")
        halves.setdefault(name, {})[half] = t.float()
        modules[name] = module
    if not halves:
        raise BadData(f"{d / WEIGHTS_FILE}: holds no LoRA tensors")
    output = names.gguf_name("output")
    if output in halves and output not in base.tensors:
        raise GGTorchError(f"{d}: the adapter changes lm_head, but {base.path} ties its output to the token "
                           "embeddings (no output.weight); llama.cpp cannot apply it")

    lora_alpha = float(cfg["lora_alpha"])
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    pairs: dict[str, LoraPair] = {}
    for name, h in halves.items():
        if set(h) != {"a", "b"}:
            raise BadData(f"{d / WEIGHTS_FILE}: '{modules[name]}' has no lora_{'B' if 'a' in h else 'A'}; "
                          "the adapter is incomplete")
        if h["a"].dim() != 2 or h["b"].dim() != 2:
            raise BadData(f"{d / WEIGHTS_FILE}: '{modules[name]}' lora_A/lora_B must be matrices")
        if name == TOKEN_EMBD:
            a, b = h["a"].T.contiguous(), h["b"]
        else:
            a, b = h["a"], h["b"]
            kind = _kind(name)
            if kind in heads and b.shape[0] % (2 * heads[kind]) == 0:  # else validation names the shape
                b = hf_rows_to_gguf(b, heads[kind])
            order = _value_head_order(kind, config, to_hf=False)
            if order is not None and (b.shape[0] if order[0] == "b" else a.shape[1]) == order[1].numel():
                a, b = _reorder_value_heads(kind, config, a, b, to_hf=False)
        rank = int(b.shape[-1])
        stated = int(_pattern_value(rank_pattern, modules[name], cfg["r"]))
        if rank != stated:
            raise BadData(f"{d}: '{modules[name]}' has rank {rank} in {WEIGHTS_FILE} but {stated} in {CONFIG_FILE}")
        alpha = float(_pattern_value(alpha_pattern, modules[name], lora_alpha))
        peft_scale = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
        fold = peft_scale / (lora_alpha / rank)
        pairs[name] = LoraPair(a.contiguous(), (b * fold if fold != 1.0 else b).contiguous())

    metadata = {
        "general.name": f"{d.resolve().name} (PEFT)",
        "adapter.base_model": str(base.get("general.name", base.path.stem)),
        "adapter.peft.base_model_name_or_path": str(cfg.get("base_model_name_or_path") or ""),
    }
    adapter = LoraAdapter(base.architecture, lora_alpha, pairs, metadata)
    validate_against_base(adapter, base, str(d))
    return adapter
