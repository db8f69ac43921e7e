"""PEFT both ways for families transformers' GGUF loader cannot read (Qwen3.5, Gemma 4): against the Hugging Face
checkpoint a GGUF was converted from by llama.cpp's converter (tests/converted.py), which also reorders a Gated
DeltaNet's value heads; the PEFT side must move them back. Gemma against llama.cpp's CPU is within its fp16 GELU
table (tests/models/test_families.py)."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from ggtorch.io.gguf import read_gguf
from ggtorch.lora.adapter_file import adapter_from_model, write_adapter
from tests.export.test_families import PEFT_TOL, hf_logits, present_ranks, trained_peft_folder_converted
from tests.families import eval_tokens
from tests.helpers import run_cli
from tests.llama_models import llama_cpp_logits
from tests.lora.test_adapter_file import ggtorch_logits, llama_cpp_with_adapter, trained_looking_model
from tests.lora.test_families import kind_of
from tests.models.test_converted import converted  # noqa: F401 (the session fixture)
from tests.models.test_families import GELU_TABLE_TOLERANCE

TARGETS = {
    "qwen35": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
               "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"],  # tied: no embed_tokens, lm_head
    # gate/up/down_proj: the shared expert's (the routed experts are fused parameters, no modules)
    "qwen35moe": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
                  "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "embed_tokens", "lm_head"],
    # tied; the layers reading another's K/V have no k_proj/v_proj on either side
    "gemma4": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "per_layer_input_gate",
               "per_layer_projection"],
    # the dense MLP's gate/up/down beside the experts (fused parameters, no modules); global layers have no v_proj
    "gemma4moe": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
"""Every module of transformers' model llama.cpp's graph adapts that a PEFT LoRA can target."""
KINDS = {"qwen35": {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "attn_qkv",
                    "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out"},
         "qwen35moe": {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_shexp", "ffn_up_shexp",
                       "ffn_down_shexp", "attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out", "token_embd",
                       "output"},
         "gemma4": {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "per_layer_inp_gate",
                    "per_layer_proj"},
         "gemma4moe": {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}}
NO_EXPERTS = {"ffn_gate_exps": 0, "ffn_up_exps": 0, "ffn_down_exps": 0, "ffn_gate_up_exps": 0}
N_TOKENS = 24


def hf_model(hf_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()


@pytest.mark.parametrize("name", list(TARGETS))
def test_exported_peft_folder_on_the_checkpoint_equals_ggtorch(converted: Callable[..., Path],  # noqa: F811
                                                               tmp_path: Path, name: str) -> None:
    from peft import PeftModel

    base_path = converted(name)
    f, model = trained_looking_model(base_path, ranks={**present_ranks(base_path, {"ssm_out": 2, "attn_gate": 8}),
                                                       **NO_EXPERTS})  # rank_pattern
    tokens = eval_tokens(model.config.n_vocab, N_TOKENS)
    ours = ggtorch_logits(model, tokens)
    adapter = write_adapter(tmp_path / "adapter.gguf", adapter_from_model(model, f))
    result = run_cli(["export-peft", str(adapter), "--base", str(base_path), "-o", str(tmp_path / "peft")])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert {m.rsplit(".", 1)[-1] for m in config["target_modules"]} == set(TARGETS[name])
    hf = hf_model(converted(name, "HF"))
    theirs = hf_logits(PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path / "peft")), tokens)
    assert np.abs(theirs - ours).max() <= PEFT_TOL, f"{np.abs(theirs - ours).max():.3g}"
    assert np.abs(theirs - hf_logits(hf, tokens)).max() > 100 * PEFT_TOL  # the adapter matters


@pytest.mark.parametrize("name", list(TARGETS))
def test_a_peft_adapter_of_the_checkpoint_converts_into_llama_cpp(converted: Callable[..., Path],  # noqa: F811
                                                                   tmp_path: Path, name: str) -> None:
    base_path = converted(name)
    peft_model, out = trained_peft_folder_converted(hf_model(converted(name, "HF")), TARGETS[name], base_path,
                                                    tmp_path)
    assert {kind_of(n.rsplit(".", 1)[0]) for n in read_gguf(out).tensors} == KINDS[name]
    tokens = eval_tokens(peft_model.config.vocab_size, N_TOKENS)
    ref = hf_logits(peft_model, tokens)
    theirs = llama_cpp_logits(llama_cpp_with_adapter(base_path, out), tokens)
    tol = GELU_TABLE_TOLERANCE if name.startswith("gemma") else PEFT_TOL
    assert np.abs(theirs - ref).max() <= tol, f"{np.abs(theirs - ref).max():.3g}"
    with peft_model.disable_adapter():
        assert np.abs(ref - hf_logits(peft_model, tokens)).max() > 100 * PEFT_TOL  # the adapter matters
