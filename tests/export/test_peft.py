"""PEFT interop, checked against the real consumers: transformers + peft one way, llama.cpp the other.

transformers loads the same GGUF base through its own GGUF support (it undoes llama.cpp's q/k
row permutation itself), so a wrong permutation of the LoRA deltas on either side shows up in
the logits.
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

from ggtorch.errors import BadData, GGTorchError, Unsupported
from ggtorch.export.peft import gguf_rows_to_hf, hf_rows_to_gguf, import_peft
from ggtorch.io.gguf import read_gguf
from ggtorch.lora.adapter_file import (
    LoraAdapter,
    adapter_from_model,
    combine_adapters,
    load_adapter_into,
    write_adapter,
)
from ggtorch.models.config import ModelConfig
from ggtorch.models.loader import build_model
from tests.helpers import run_cli
from tests.llama_models import RandomLlamaShape, llama_cpp_logits
from tests.lora.test_adapter_file import ggtorch_logits, llama_cpp_with_adapter, trained_looking_model
from tests.models.test_model import random_tokens

pytest.importorskip("transformers")
pytest.importorskip("peft")

SHAPE = RandomLlamaShape(n_embd=256, n_ff=768, n_layer=2, n_head=8, n_head_kv=4)
N_TOKENS = 32
TOL = 1e-4
"""All three (ggtorch, transformers, llama.cpp) compute in f32 with f32 adapters: only summation
order differs. Measured max |Δlogit| ≤ 8.6e-6 (transformers+peft vs ggtorch) and ≤ 1.9e-5 (llama.cpp
with the converted adapter vs peft; 4.3e-3 with an f16 adapter), on logits of std ~4 that the
adapters move by 9-24."""
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base_path(random_llama: Callable[..., Path]) -> Path:
    return random_llama("F32", SHAPE)


@pytest.fixture(scope="module")
def hf_model(base_path: Path) -> torch.nn.Module:
    """transformers' LlamaForCausalLM from the GGUF (dequantized by transformers, not by ggtorch)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_path.parent), gguf_file=base_path.name,
                                                 dtype=torch.float32)
    return model.eval()


def hf_logits(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def test_qk_row_permutation_matches_llama_cpps_converter() -> None:
    """hf_rows_to_gguf is convert_hf_to_gguf.py's LlamaModel.permute (formula re-written here)."""
    def converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = torch.randn(4 * 32, 5)
    for n_head in (4, 2):
        expected = converter_permute(w.numpy(), n_head)
        assert torch.equal(hf_rows_to_gguf(w, n_head), torch.from_numpy(expected))
        assert torch.equal(gguf_rows_to_hf(hf_rows_to_gguf(w, n_head), n_head), w)
        assert not torch.equal(hf_rows_to_gguf(w, n_head), w)


@pytest.fixture(scope="module")
def adapter_variants(base_path: Path) -> dict[str, tuple[LoraAdapter, float]]:
    """(adapter, scale ggtorch applies it at) for each case: the export must bake the scale in."""
    f, model = trained_looking_model(base_path, ranks={"attn_q": 2, "attn_k": 3, "ffn_down": 8})
    mixed = adapter_from_model(model, f, {"general.name": "mixed ranks"})
    layer0 = LoraAdapter(mixed.architecture, mixed.alpha,
                         {k: v for k, v in mixed.pairs.items() if k.startswith("blk.0.attn_")})
    return {
        # every kind incl. token_embd and output; ranks 2/3/4/8 -> rank_pattern
        "mixed_ranks": (mixed, 1.0),
        # alpha 0 ("no alpha/r") with ranks differing per tensor -> alpha_pattern
        "alpha0": (combine_adapters([(mixed, 0.5)]), 1.0),
        # only some modules -> full module names in target_modules
        "layer0_attn": (layer0, 1.0),
    }


@pytest.mark.parametrize("variant", ["mixed_ranks", "alpha0", "layer0_attn"])
def test_transformers_with_exported_peft_folder_equals_ggtorch(base_path: Path, hf_model: torch.nn.Module,
                                                               adapter_variants: dict, tmp_path: Path,
                                                               variant: str) -> None:
    from peft import PeftModel

    adapter, scale = adapter_variants[variant]
    f = read_gguf(base_path)
    tokens = random_tokens(32000, N_TOKENS)
    ours_model = load_adapter_into(build_model(f, ModelConfig.from_gguf(f)), f, [(adapter, scale)])
    ours = ggtorch_logits(ours_model, tokens)

    gguf_adapter = write_adapter(tmp_path / "adapter.gguf", adapter)
    result = run_cli(["export-peft", str(gguf_adapter), "--base", str(base_path),
                                       "-o", str(tmp_path / "peft")])
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["task_type"] == "CAUSAL_LM" and config["base_model_name_or_path"] == "random-llama-256x2"

    base_logits = hf_logits(hf_model, tokens)
    assert np.abs(base_logits - ggtorch_logits(build_model(f, ModelConfig.from_gguf(f)), tokens)).max() <= TOL
    theirs = hf_logits(PeftModel.from_pretrained(copy.deepcopy(hf_model), str(tmp_path / "peft")), tokens)
    assert np.abs(theirs - ours).max() <= TOL
    assert np.abs(theirs - base_logits).max() > 100 * TOL  # the adapter matters


PEFT_CONFIGS = {
    "plain": dict(r=8, lora_alpha=16, target_modules=ALL_LINEAR),
    # per-module ranks and alphas, rank-stabilized scale (alpha/sqrt(r)), embeddings and lm_head too
    "patterns_rslora": dict(r=8, lora_alpha=16, target_modules=ALL_LINEAR + ["embed_tokens", "lm_head"],
                            rank_pattern={"model.layers.1.mlp.down_proj": 4, "k_proj": 2},
                            alpha_pattern={"v_proj": 4.0}, use_rslora=True),
}


@pytest.mark.parametrize("case,outtype,tol", [("plain", "f32", TOL), ("patterns_rslora", "f32", TOL),
                                              ("plain", "f16", 0.02)])
def test_peft_adapter_survives_convert_lora_into_llama_cpp(base_path: Path, hf_model: torch.nn.Module,
                                                           tmp_path: Path, case: str, outtype: str,
                                                           tol: float) -> None:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)  # peft draws lora_A from torch's global generator
    peft_model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(task_type="CAUSAL_LM", **PEFT_CONFIGS[case]))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name or "lora_embedding" in name:  # B (and embedding A) start at 0
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    tokens = random_tokens(32000, N_TOKENS, seed=2)
    ref = hf_logits(peft_model, tokens)
    peft_model.save_pretrained(str(tmp_path / "peft"))

    out = tmp_path / "converted.gguf"
    result = run_cli(["convert-lora", str(tmp_path / "peft"), "--base", str(base_path),
                                       "--outfile", str(out), "--outtype", outtype])
    assert result.exit_code == 0, result.output
    theirs = llama_cpp_logits(llama_cpp_with_adapter(base_path, out), tokens)
    assert np.abs(theirs - ref).max() <= tol
    assert np.abs(ref - hf_logits(hf_model, tokens)).max() > 100 * tol


# --- bad input --------------------------------------------------------------------------------

def write_peft_folder(d: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}))
    save_file(tensors, str(d / "adapter_model.safetensors"))
    return d


def q_pair(n_out: int, n_in: int, r: int = 4, layer: int = 0, module: str = "self_attn.q_proj"
           ) -> dict[str, torch.Tensor]:
    key = f"base_model.model.model.layers.{layer}.{module}"
    return {f"{key}.lora_A.weight": torch.randn(r, n_in), f"{key}.lora_B.weight": torch.randn(n_out, r)}


def test_bad_peft_folders_are_refused(base_path: Path, stories260k: Path, tmp_path: Path) -> None:
    base = read_gguf(base_path)
    ok = q_pair(256, 256)
    assert import_peft(write_peft_folder(tmp_path / "ok", {"target_modules": ["q_proj"]}, ok), base).alpha == 8

    (tmp_path / "empty").mkdir()
    with pytest.raises(BadData, match="no adapter_config.json"):
        import_peft(tmp_path / "empty", base)
    with pytest.raises(BadData, match="no such folder"):
        import_peft(tmp_path / "missing", base)

    pickled = write_peft_folder(tmp_path / "bin", {}, ok)
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    with pytest.raises(Unsupported, match="adapter_model.bin.*safe_serialization=True"):
        import_peft(pickled, base)

    with pytest.raises(Unsupported, match=r"target_modules \['rotary_emb'\]"):
        import_peft(write_peft_folder(tmp_path / "t1", {"target_modules": ["q_proj", "rotary_emb"]}, ok), base)
    with pytest.raises(Unsupported, match="'model.layers.0.self_attn.qkv_proj'.*not a llama module"):
        import_peft(write_peft_folder(tmp_path / "t2", {}, q_pair(256, 256, module="self_attn.qkv_proj")), base)
    with pytest.raises(Unsupported, match="DoRA"):
        import_peft(write_peft_folder(tmp_path / "dora", {"use_dora": True}, ok), base)
    with pytest.raises(Unsupported, match="peft_type 'IA3'"):
        import_peft(write_peft_folder(tmp_path / "ia3", {"peft_type": "IA3"}, ok), base)

    with pytest.raises(GGTorchError, match=r"against the base tensor's \(256, 256\)"):
        import_peft(write_peft_folder(tmp_path / "shape", {}, q_pair(128, 256)), base)
    with pytest.raises(GGTorchError, match="1 of the adapter's 1 tensors do not fit the base model.*'blk.0.attn_q"):
        import_peft(write_peft_folder(tmp_path / "other", {}, ok), read_gguf(stories260k))  # n_embd 64
    with pytest.raises(GGTorchError, match="blk.7.attn_q.weight.*does not have"):
        import_peft(write_peft_folder(tmp_path / "layer", {}, q_pair(256, 256, layer=7)), base)
    with pytest.raises(BadData, match="rank 4 in adapter_model.safetensors but 8 in adapter_config.json"):
        import_peft(write_peft_folder(tmp_path / "rank", {"r": 8}, ok), base)
    with pytest.raises(BadData, match="not a valid regular expression"):
        import_peft(write_peft_folder(tmp_path / "regex", {"rank_pattern": {"q_proj(": 2}}, ok), base)
    half = {k: v for k, v in ok.items() if "lora_A" in k}
    with pytest.raises(BadData, match="has no lora_B"):
        import_peft(write_peft_folder(tmp_path / "half", {}, half), base)

    resized = ok | {"base_model.model.model.embed_tokens.base_layer.weight": torch.zeros(32001, 256)}
    with pytest.raises(GGTorchError, match="resized vocabulary"):
        import_peft(write_peft_folder(tmp_path / "resized", {}, resized), base)

    lm_head = {"base_model.model.lm_head.lora_A.weight": torch.randn(4, 64),
               "base_model.model.lm_head.lora_B.weight": torch.randn(512, 4)}
    with pytest.raises(GGTorchError, match="ties its output"):
        import_peft(write_peft_folder(tmp_path / "tied", {}, lm_head), read_gguf(stories260k))


def test_convert_lora_reports_bad_input_in_one_line(base_path: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    result = run_cli(["convert-lora", str(tmp_path / "empty"), "--base", str(base_path),
                                       "-o", str(tmp_path / "out.gguf")])
    assert result.exit_code == 1
    assert result.output.startswith("error: ") and "no adapter_config.json" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "out.gguf").exists()
