"""``export-lora`` and PEFT interop on every model family, checked against llama.cpp and transformers + peft.

Bases: tests/families.py's presets (gguf-py), quantized by llama.cpp. Adapters: every matrix kind the
family has (fused attn_qkv and gate|up ffn_up on phi3), rank 4, random B, as after training.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ggtorch.io.gguf import read_gguf
from ggtorch.lora.adapter_file import adapter_from_model, write_adapter
from ggtorch.models import names
from tests.export.test_merge import export_lora, merge_logits
from tests.families import eval_tokens
from tests.helpers import run_cli
from tests.llama_models import llama_cpp_logits
from tests.lora.test_adapter_file import ggtorch_logits, llama_cpp_with_adapter, trained_looking_model
from tests.lora.test_families import EXPECTED_KINDS, kind_of
from tests.models.test_experts import routing_margins
from tests.models.test_families import GELU_TABLE_TOLERANCE, load, transformers_model
from tests.models.test_model import TOLERANCE

N_TOKENS = 24
ROUTING_MARGIN = 0.004
"""Probability gap between a token's last chosen expert and the next one above which a requantized merge
must route it as the base plus adapter do."""
FAMILIES = list(EXPECTED_KINDS)


@pytest.fixture(scope="module")
def family_adapter(family_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
                   ) -> Callable[[str, str], Path]:
    """``family_adapter(name, ftype)`` -> an adapter on every matrix kind of that base, written once."""
    root = tmp_path_factory.mktemp("family_adapters")
    cache: dict[tuple[str, str], Path] = {}

    def make(name: str, ftype: str) -> Path:
        if (name, ftype) not in cache:
            f, model = trained_looking_model(family_model(name, ftype))
            adapter = adapter_from_model(model, f)
            assert {kind_of(n) for n in adapter.pairs} == EXPECTED_KINDS[name]
            cache[name, ftype] = write_adapter(root / f"{name}-{ftype}.gguf", adapter)
        return cache[name, ftype]

    return make


@pytest.mark.parametrize("ftype", ["F32", "Q8_0"])
@pytest.mark.parametrize("name", FAMILIES)
def test_merge_equals_llama_cpp_base_plus_adapter(family_model: Callable[..., Path],
                                                  family_adapter: Callable[[str, str], Path], tmp_path: Path,
                                                  name: str, ftype: str) -> None:
    base_path = family_model(name, ftype)
    adapter = family_adapter(name, ftype)
    out = tmp_path / "merged.gguf"
    code, output = export_lora("-m", base_path, "--lora", adapter, "-o", out)
    assert code == 0, output

    f, g = read_gguf(base_path), read_gguf(out)
    assert g.architecture == f.architecture and g.metadata == f.metadata
    adapted = set(read_gguf(adapter).tensors)
    for tname, t in f.tensors.items():
        assert g.tensors[tname].ggml_type == t.ggml_type, tname  # Q8_0 re-quantizes exactly as it was
        if f"{tname}.lora_a" not in adapted:  # norms, biases, rope factors: byte for byte
            assert np.array_equal(g.tensors[tname].data, t.data), tname

    tokens = eval_tokens(len(f.get("tokenizer.ggml.tokens")), N_TOKENS)
    ref, merged, base, f32 = merge_logits(base_path, adapter, out, family_model(name), tokens)
    if ftype == "F32":
        # gemma: llama.cpp's fp16 GELU table flips entries on the merge's last-bit differences
        tol = GELU_TABLE_TOLERANCE if name.startswith("gemma") else TOLERANCE["F32"]
        assert np.abs(merged - ref).max() <= tol, f"{name}: {np.abs(merged - ref).max():.3g}"
    else:  # as tests/export/test_merge.py: within what quantizing the base itself cost
        within = np.abs(merged - ref).max(axis=-1) <= 1.5 * np.abs(base - f32).max()
        if f.get(f"{f.architecture}.expert_count"):
            # Requantizing W + ΔW moves hidden states by about what quantizing W did; a token whose top-k
            # experts were a near tie may then route differently. Tokens routed decisively must agree.
            decisive = (routing_margins(load(out), tokens) > ROUTING_MARGIN).numpy()
            assert decisive.mean() >= 0.6 and within[decisive].all(), f"{name}: {within}, {decisive}"
        else:
            assert within.all(), f"{name}: {np.abs(merged - ref).max():.3g}"
    assert np.median(np.abs(merged - ref)) < 0.5 * np.median(np.abs(ref - base))  # the adapter matters


# --- PEFT both ways ------------------------------------------------------------------------------

PEFT_TARGETS: dict[str, list[str]] = {
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens", "lm_head"],
    "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gemma2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gemma3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens", "lm_head"],
    "llama3_tied": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen3moe": ["q_proj", "k_proj", "v_proj", "o_proj", "embed_tokens", "lm_head"],
    "qwen2moe": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens",
                 "lm_head"],  # gate/up/down: the shared expert's
    "mistral3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens",
                 "lm_head"],
    "smollm3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "granite": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens",
                "lm_head"],
    "gpt_oss": ["q_proj", "k_proj", "v_proj", "o_proj", "embed_tokens", "lm_head"],
}
PEFT_FAMILIES = list(PEFT_TARGETS)
"""Not llama_moe: transformers loads a llama GGUF with experts as a dense llama (random MLPs), silently."""
NO_EXPERTS = {"ffn_gate_exps": 0, "ffn_up_exps": 0, "ffn_down_exps": 0}


def present_ranks(base_path: Path, ranks: dict[str, int]) -> dict[str, int]:
    """``ranks`` of the tensor kinds ``base_path`` has: a rank for a kind a family lacks is refused (issue 69)."""
    kinds = {parsed[0] for n in read_gguf(base_path).tensors if (parsed := names.parse_gguf_name(n))}
    return {k: r for k, r in ranks.items() if k in kinds}
"""Routed experts have no PEFT counterpart (ggtorch.export.peft.EXPERT_REFUSAL)."""
"""Preset -> the Hugging Face modules of its family a PEFT LoRA targets (every matrix llama.cpp adapts)."""
PEFT_TOL = 1e-4
"""transformers, peft and ggtorch all compute in f32 with f32 adapters (and the GELU formula)."""


@pytest.fixture(scope="session")
def hf_model(family_model: Callable[..., Path]) -> Callable[[str], torch.nn.Module]:
    """``hf_model(name)``: transformers' model of the F32 preset (tests/models/test_families.py's
    transformers_model, loaded once per session)."""
    pytest.importorskip("peft")
    return lambda name: transformers_model(name, family_model(name))


def trained_peft_folder_converted(hf: torch.nn.Module, targets: list[str], base_path: Path,
                                  tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    """peft's LoRA (rank 4, alpha 8) on ``targets`` of ``hf``, its B (and embedding A) drawn as after training,
    saved, and ``ggtorch convert-lora``'s GGUF of it for ``base_path``: (the peft model, the GGUF adapter)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)  # peft draws lora_A from torch's global generator
    peft_model = get_peft_model(hf, LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules=targets))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for pname, p in peft_model.named_parameters():
            if "lora_B" in pname or "lora_embedding" in pname:  # B (and embedding A) start at 0
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    peft_model.save_pretrained(str(tmp_path / "peft"))
    out = tmp_path / "converted.gguf"
    result = run_cli(["convert-lora", str(tmp_path / "peft"), "--base", str(base_path), "--outfile", str(out)])
    assert result.exit_code == 0, result.output
    return peft_model, out


def hf_logits(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


@pytest.mark.parametrize("name", PEFT_FAMILIES)
def test_transformers_with_exported_peft_folder_equals_ggtorch(family_model: Callable[..., Path],
                                                               hf_model: Callable[[str], torch.nn.Module],
                                                               tmp_path: Path, name: str) -> None:
    from peft import PeftModel

    base_path = family_model(name)
    f, model = trained_looking_model(base_path, ranks={**present_ranks(base_path, {"attn_output": 2, "ffn_down": 8,
                                                                                  "ffn_down_shexp": 8}),
                                                       **NO_EXPERTS})  # rank_pattern too
    tokens = eval_tokens(model.config.n_vocab, N_TOKENS)
    ours = ggtorch_logits(model, tokens)
    adapter = write_adapter(tmp_path / "adapter.gguf", adapter_from_model(model, f))
    result = run_cli(["export-peft", str(adapter), "--base", str(base_path), "-o", str(tmp_path / "peft")])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(t for t in PEFT_TARGETS[name]
                                                      if t not in ("embed_tokens", "lm_head")
                                                      or EXPECTED_KINDS[name] & {"token_embd", "output"})

    hf = hf_model(name)
    theirs = hf_logits(PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path / "peft")), tokens)
    assert np.abs(theirs - ours).max() <= PEFT_TOL, f"{name}: {np.abs(theirs - ours).max():.3g}"
    assert np.abs(theirs - hf_logits(hf, tokens)).max() > 100 * PEFT_TOL  # the adapter matters


@pytest.mark.parametrize("name", PEFT_FAMILIES)
def test_peft_adapter_survives_convert_lora_into_llama_cpp(family_model: Callable[..., Path],
                                                           hf_model: Callable[[str], torch.nn.Module],
                                                           tmp_path: Path, name: str) -> None:
    base_path = family_model(name)
    peft_model, out = trained_peft_folder_converted(copy.deepcopy(hf_model(name)), PEFT_TARGETS[name], base_path,
                                                    tmp_path)
    assert {kind_of(n.rsplit(".", 1)[0]) for n in read_gguf(out).tensors} == EXPECTED_KINDS[name] - NO_EXPERTS.keys()
    tokens = eval_tokens(peft_model.config.vocab_size, N_TOKENS)
    ref = hf_logits(peft_model, tokens)
    theirs = llama_cpp_logits(llama_cpp_with_adapter(base_path, out), tokens)
    # gemma: llama.cpp's CPU GELU is an fp16 table, transformers computes the formula
    tol = GELU_TABLE_TOLERANCE if name.startswith("gemma") else PEFT_TOL
    assert np.abs(theirs - ref).max() <= tol, f"{name}: {np.abs(theirs - ref).max():.3g}"
    assert np.abs(ref - hf_logits(hf_model(name), tokens)).max() > 100 * tol


def test_peft_export_refuses_expert_adapters_by_name(family_model: Callable[..., Path], tmp_path: Path) -> None:
    base_path = family_model("qwen3moe")
    f, model = trained_looking_model(base_path)
    adapter = write_adapter(tmp_path / "adapter.gguf", adapter_from_model(model, f))
    result = run_cli(["export-peft", str(adapter), "--base", str(base_path), "-o", str(tmp_path / "peft")])
    assert result.exit_code != 0 and "'blk.0.ffn_gate_exps.weight': transformers stores a MoE's routed experts" \
        in result.output and "--rank-exps 0" in result.output, result.output
    assert "Traceback" not in result.output and not (tmp_path / "peft" / "adapter_config.json").exists()


def test_peft_refuses_q_k_v_fused_on_one_side_only(family_model: Callable[..., Path], tmp_path: Path) -> None:
    """phi3 with separate q/k/v (llama.cpp loads it; Hugging Face's Phi-3 has only qkv_proj): one message
    each way, no folder or adapter that would load wrongly."""
    base_path = family_model("phi3_sep")
    f, model = trained_looking_model(base_path)
    adapter = write_adapter(tmp_path / "adapter.gguf", adapter_from_model(model, f))
    result = run_cli(["export-peft", str(adapter), "--base", str(base_path), "-o", str(tmp_path / "peft")])
    assert result.exit_code != 0 and "fuses q/k/v (qkv_proj)" in result.output, result.output
    assert not (tmp_path / "peft" / "adapter_config.json").exists()

    c = model.config
    d = tmp_path / "fused"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 4,
                                                       "target_modules": ["qkv_proj"]}))
    key = "base_model.model.model.layers.0.self_attn.qkv_proj"
    save_file({f"{key}.lora_A.weight": torch.zeros(4, c.n_embd),
               f"{key}.lora_B.weight": torch.zeros(c.n_embd_q + 2 * c.n_embd_kv, 4)},
              str(d / "adapter_model.safetensors"))
    result = run_cli(["convert-lora", str(d), "--base", str(base_path), "--outfile", str(tmp_path / "c.gguf")])
    assert result.exit_code != 0 and "stores that projection as blk.0.attn_q.weight" in result.output, result.output
