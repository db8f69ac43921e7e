"""Old llama.cpp finetune adapters (ggla ``lora-*.bin``) and checkpoints, converted and merged.

The old files are written here by writers that follow the old finetune's own description of its formats (its
``ggla`` header, then each tensor's name, shape and data; its GGUF checkpoint keys), not by inverting ggtorch's
reader.
The reference logits are ggtorch's f32 model with the old formula applied to its weights
directly (W += s·B·Aᵀ with the old layout's A (n_in, r), B (n_out, r)); llama.cpp runs the
converted adapter (or the merged model) and must agree.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from ggtorch.models import names
from ggtorch.models.config import ModelConfig
from ggtorch.models.loader import build_model
from tests.export.test_merge import base_gguf, cli, one_line_error
from tests.llama_models import llama_cpp_logits
from tests.lora.test_adapter_file import llama_cpp_with_adapter
from tests.models.test_model import TOLERANCE, random_tokens

N_TOKENS = 24
KINDS = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_down", "ffn_up"]


def old_tensors(base_path: Path, rank: int, rank_tok_embd: int,
                seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Base name -> (A (n_in, r), B (n_out, r)) in the old finetune's order, norms with rank 1."""
    f = base_gguf(base_path)
    order = ["token_embd", "output_norm", "output"] + [
        f"blk.{i}.{k}" for i in range(f.get("llama.block_count")) for k in KINDS]
    rng = np.random.default_rng(seed)
    out = {}
    for stem in order:
        name = f"{stem}.weight"
        shape = f.tensors[name].shape
        n_out, n_in = shape if len(shape) == 2 else (1, shape[0])
        r = 1 if len(shape) == 1 else rank_tok_embd if stem == "token_embd" else rank
        a = (rng.standard_normal((n_in, r)) / np.sqrt(r + n_in)).astype(np.float32)
        b = (rng.standard_normal((n_out, r)) * 0.2).astype(np.float32)
        out[name] = (a, b)
    return out


def write_ggla(path: Path, lora_r: int, lora_alpha: int, tensors: dict[str, tuple[np.ndarray, np.ndarray]]) -> Path:
    """§9: u32 magic/version/r/alpha; per tensor n_dims, name_len, type, ne[], name, pad to 32, data."""
    with open(path, "wb") as f:
        f.write(struct.pack("<4I", 0x67676C61, 1, lora_r, lora_alpha))
        for name, (a, b) in tensors.items():
            for suffix, arr in (("loraA", a), ("loraB", b)):
                ne = list(reversed(arr.shape))  # ne0 = the contiguous axis
                while len(ne) > 1 and ne[-1] == 1:  # ggml_n_dims: trailing 1s do not count
                    ne.pop()
                key = f"{name}.{suffix}".encode()
                f.write(struct.pack("<3I", len(ne), len(key), 0))  # type 0 = F32
                f.write(struct.pack(f"<{len(ne)}I", *ne))
                f.write(key)
                f.write(b"\0" * (-f.tell() % 32))
                f.write(np.ascontiguousarray(arr, dtype=np.float32).tobytes())
    return path


def write_old_checkpoint(path: Path, base_path: Path, tensors: dict[str, tuple[np.ndarray, np.ndarray]]) -> Path:
    """§8: an old finetune checkpoint (GGUF, training.type = finetune_lora, old layout, 1-D norm b)."""
    f = base_gguf(base_path)
    w = gguf.GGUFWriter(path, "llama")
    w.add_string("training.type", "finetune_lora")
    w.add_uint32("general.file_type", 0)
    for key in ("context_length", "embedding_length", "feed_forward_length", "attention.head_count",
                "attention.head_count_kv", "block_count"):
        w.add_uint32(f"llama.{key}", f.get(f"llama.{key}"))
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for kind in ["token_embd", "output_norm", "output", *KINDS]:
        stem = kind if kind in ("token_embd", "output_norm", "output") else f"blk.0.{kind}"
        w.add_uint32(f"training.lora.rank.{kind}", tensors[f"{stem}.weight"][0].shape[1])
    w.add_uint32("training.file_version", 1)
    w.add_uint64("training.iteration_count", 10)
    w.add_string("optimizer.type", "adam")
    nx = 0
    for name, (a, b) in tensors.items():
        w.add_tensor(f"{name}.lora_a", a)
        w.add_tensor(f"{name}.lora_b", b[0] if name.endswith("_norm.weight") else b)
        nx += a.size + b.size
    w.add_uint64("optimizer.parameter_count", nx)
    w.add_tensor("optimizer.adam.first_moments", np.zeros(nx, np.float32))
    w.add_tensor("optimizer.adam.second_moments", np.zeros(nx, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def reference_logits(base_path: Path, tensors: dict[str, tuple[np.ndarray, np.ndarray]], scale: dict[str, float],
                     tokens: list[int], with_norms: bool) -> np.ndarray:
    """ggtorch's f32 model with W += s·B·Aᵀ (norms: g += s·A·b) applied to its weights here."""
    f = base_gguf(base_path)
    model = build_model(f, ModelConfig.from_gguf(f))
    with torch.no_grad():
        for name, (a, b) in tensors.items():
            is_norm = name.endswith("_norm.weight")
            if is_norm and not with_norms:
                continue
            module = model.get_submodule(names.gguf_to_module(name))
            delta = torch.from_numpy(b @ a.T) * scale[name]
            # a new tensor: the weight may be a view of the (session-cached) file mapping
            module.weight.data = module.weight.data + (delta[0] if is_norm else delta)
        return model(torch.tensor([tokens]))[0].numpy()


@pytest.mark.parametrize("user_scale", [1.0, 0.5])
def test_old_ggla_adapter_converts_and_llama_cpp_applies_it(random_llama: Callable[..., Path], tmp_path: Path,
                                                            user_scale: float) -> None:
    base_path = random_llama("F32")
    tensors = old_tensors(base_path, rank=4, rank_tok_embd=2)  # mixed ranks: alpha/lora_r folded into A
    old = write_ggla(tmp_path / "lora-old.bin", lora_r=4, lora_alpha=8, tensors=tensors)
    new = tmp_path / "new.gguf"
    one_line_error(*cli("convert-old-lora", old, "-o", new), "--drop-norms")
    code, output = cli("convert-old-lora", old, "-o", new, "--drop-norms", "-m", base_path)
    assert code == 0, output

    tokens = random_tokens(32000, N_TOKENS)
    ours = reference_logits(base_path, tensors, dict.fromkeys(tensors, 8 / 4 * user_scale), tokens, with_norms=False)
    ref = llama_cpp_logits(llama_cpp_with_adapter(base_path, new, user_scale), tokens)
    assert np.abs(ours - ref).max() <= TOLERANCE["F32"]
    base = llama_cpp_logits(llama_cpp_with_adapter(base_path, None), tokens)
    assert np.abs(ref - base).max() > 1.0  # the adapter matters


def test_old_checkpoint_converts_and_merges_with_its_norms(random_llama: Callable[..., Path], tmp_path: Path) -> None:
    base_path = random_llama("F32")
    tensors = old_tensors(base_path, rank=4, rank_tok_embd=4, seed=1)
    ck = write_old_checkpoint(tmp_path / "checkpoint-10.gguf", base_path, tensors)
    tokens = random_tokens(32000, N_TOKENS)
    ones = dict.fromkeys(tensors, 1.0)  # old checkpoints hold what training used: scale 1

    new = tmp_path / "new.gguf"
    code, output = cli("convert-old-lora", ck, "-o", new, "--drop-norms")
    assert code == 0, output
    ours = reference_logits(base_path, tensors, ones, tokens, with_norms=False)
    ref = llama_cpp_logits(llama_cpp_with_adapter(base_path, new), tokens)
    assert np.abs(ours - ref).max() <= TOLERANCE["F32"]

    merged = tmp_path / "merged.gguf"
    code, output = cli("export-lora", "-m", base_path, "--lora", ck, "-o", merged)
    assert code == 0, output
    ours = reference_logits(base_path, tensors, ones, tokens, with_norms=True)
    ref = llama_cpp_logits(llama_cpp_with_adapter(merged, None), tokens)
    assert np.abs(ours - ref).max() <= 10 * TOLERANCE["F32"]


def test_broken_old_files_are_refused(random_llama: Callable[..., Path], tmp_path: Path) -> None:
    base_path = random_llama("F32")
    tensors = old_tensors(base_path, rank=4, rank_tok_embd=4)
    old = write_ggla(tmp_path / "lora.bin", 4, 4, tensors)
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(old.read_bytes()[:-100])
    one_line_error(*cli("convert-old-lora", truncated, "-o", tmp_path / "x.gguf"), "truncated")
    cut_in_header = tmp_path / "cut.bin"  # the file ends inside the first tensor's ne[] (fuzz found it)
    cut_in_header.write_bytes(old.read_bytes()[:30])
    one_line_error(*cli("convert-old-lora", cut_in_header, "-o", tmp_path / "x.gguf"), "truncated tensor header")
    huge = bytearray(old.read_bytes())  # a shape whose element count overflows 64 bits
    struct.pack_into("<2I", huge, 28, 2**32 - 1, 2**32 - 1)
    (tmp_path / "huge.bin").write_bytes(bytes(huge))
    one_line_error(*cli("convert-old-lora", tmp_path / "huge.bin", "-o", tmp_path / "x.gguf"), "runs past the end")
    half = {k: v for k, v in tensors.items() if k != "output.weight"}
    half["output.weight"] = (tensors["output.weight"][0], tensors["output.weight"][1][:, :3])
    one_line_error(*cli("convert-old-lora", write_ggla(tmp_path / "rank.bin", 4, 4, half), "-o",
                            tmp_path / "x.gguf", "--drop-norms"), "rank 4 but B of rank 3")
    one_line_error(*cli("convert-old-lora", base_path, "-o", tmp_path / "x.gguf"), "not an old llama.cpp")
    assert not (tmp_path / "x.gguf").exists()
