"""``ggtorch export-lora``: merged GGUFs checked against llama.cpp applying the same adapters.

References: llama.cpp's logits with the adapters applied at run time (llama_adapter_lora_init +
llama_set_adapters_lora), llama.cpp's quantizer (ggml_quantize_chunk) for the re-quantized
tensors, and the base file's bytes for everything the merge must not touch.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from ggtorch.io.checkpoint import save_checkpoint
from ggtorch.io.encode import QUANTIZABLE_TYPES
from ggtorch.io.gguf import GGUFFile, read_gguf
from ggtorch.lora import LoraConfig, attach_lora, lora_modules, lora_tensors_by_gguf_name
from ggtorch.lora.adapter_file import LoraAdapter, LoraPair, adapter_from_model, read_adapter, write_adapter
from ggtorch.models.config import ModelConfig
from ggtorch.models.loader import build_model
from ggtorch.quant import dequantize
from tests.helpers import run_cli
from tests.llama_models import llama_cpp_logits, rewrite_gguf
from tests.lora.test_adapter_file import llama_cpp_with_adapter
from tests.models.test_model import random_tokens

T = GGMLQuantizationType
N_TOKENS = 24
UNTOUCHED = ("blk.1.ffn_down.weight", "token_embd.weight")  # left out of the test adapter


def llama_cpp_stacked(model_path: Path, adapters: list[tuple[Path, float]]):  # -> llama_cpp.Llama
    """llama.cpp with several adapters applied at run time, each with its scale."""
    import llama_cpp

    first, scale = adapters[0]
    llm = llama_cpp_with_adapter(model_path, first, scale)
    ptrs = [llm._lora_adapter]
    for path, _ in adapters[1:]:
        p = llama_cpp.llama_adapter_lora_init(llm._model.model, str(path).encode())
        assert p is not None, path
        llm._stack.callback(llama_cpp.llama_adapter_lora_free, p)
        ptrs.append(p)
    arr = (llama_cpp.llama_adapter_lora_p_ctypes * len(ptrs))(*ptrs)
    scales = (ctypes.c_float * len(ptrs))(*[s for _, s in adapters])
    assert llama_cpp.llama_set_adapters_lora(llm._ctx.ctx, arr, len(ptrs), scales) == 0
    return llm


@functools.cache
def base_gguf(path: Path) -> GGUFFile:
    """A base model read once per session (reading a 32000-token vocabulary takes seconds)."""
    return read_gguf(path)


def write_test_adapter(base_path: Path, out: Path, alpha: float = 8.0, seed: int = 0) -> Path:
    """A trained-looking adapter (rank 4, random B) on every matrix except UNTOUCHED."""
    f = base_gguf(base_path)
    model = build_model(f, ModelConfig.from_gguf(f), keep_quantized=True)
    attach_lora(model, LoraConfig(rank=4, alpha=alpha), seed=1)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=gen) * 0.1)
    adapter = adapter_from_model(model, f)
    pairs = {n: p for n, p in adapter.pairs.items() if n not in UNTOUCHED}
    return write_adapter(out, LoraAdapter(adapter.architecture, adapter.alpha, pairs))


@pytest.fixture(scope="module")
def test_adapter(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``test_adapter(base_path, alpha=8.0, seed=0)`` -> the adapter file, written once per module."""
    root = tmp_path_factory.mktemp("adapters")
    cache: dict[tuple[Path, float, int], Path] = {}

    def make(base_path: Path, alpha: float = 8.0, seed: int = 0) -> Path:
        key = (base_path, alpha, seed)
        if key not in cache:
            cache[key] = write_test_adapter(base_path, root / f"a{len(cache)}.gguf", alpha, seed)
        return cache[key]

    return make


def merge_logits(base_path: Path, adapter: Path, merged_path: Path, f32_path: Path,
                 tokens: list[int]) -> tuple[np.ndarray, ...]:
    """llama.cpp's logits of: base + adapter at run time, the merged model, the base alone, the F32 original."""
    return tuple(llama_cpp_logits(llama_cpp_with_adapter(model, lora), tokens)
                 for model, lora in ((base_path, adapter), (merged_path, None), (base_path, None), (f32_path, None)))


def cli(*args: str | Path) -> tuple[int, str]:
    """``ggtorch ARGS``: (exit code, output); an unexpected exception is raised, not turned into a code."""
    result = run_cli(args)
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


def export_lora(*args: str | Path) -> tuple[int, str]:
    return cli("export-lora", *args)


def test_f32_merge_equals_llama_cpp_base_plus_adapter(random_llama: Callable[..., Path], tmp_path: Path,
                                                      test_adapter: Callable[..., Path]) -> None:
    base_path = random_llama("F32")
    adapter = test_adapter(base_path)
    out = tmp_path / "merged.gguf"
    code, output = export_lora("-m", base_path, "--lora", adapter, "-o", out, "-t", "1")
    assert code == 0, output

    tokens = random_tokens(32000, N_TOKENS)
    ref = llama_cpp_logits(llama_cpp_with_adapter(base_path, adapter), tokens)
    merged = llama_cpp_logits(llama_cpp_with_adapter(out, None), tokens)
    base = llama_cpp_logits(llama_cpp_with_adapter(base_path, None), tokens)
    assert np.abs(merged - ref).max() <= 1e-4  # f32 both ways; measured 7e-6
    assert np.abs(ref - base).max() > 1.0  # the adapter matters

    f, g = base_gguf(base_path), read_gguf(out)
    assert g.metadata == f.metadata and g.value_types == f.value_types
    assert list(g.tensors) == list(f.tensors)
    for name, t in f.tensors.items():
        assert g.tensors[name].ggml_type == t.ggml_type and g.tensors[name].shape == t.shape
        if name in UNTOUCHED or name.endswith("_norm.weight"):
            assert np.array_equal(g.tensors[name].data, t.data), name


def test_two_adapters_stack_with_their_scales(random_llama: Callable[..., Path], tmp_path: Path,
                                              test_adapter: Callable[..., Path]) -> None:
    base_path = random_llama("F32")
    a1, a2 = test_adapter(base_path), test_adapter(base_path, alpha=2.0, seed=5)
    tokens = random_tokens(32000, N_TOKENS)
    ref = llama_cpp_logits(llama_cpp_stacked(base_path, [(a1, 0.7), (a2, 0.5)]), tokens)
    out = tmp_path / "m.gguf"
    code, output = export_lora("-m", base_path, "--lora-scaled", f"{a1}:0.7", "-s", a2, "0.5",
                           "--outtype", "f32", "-o", out)
    assert code == 0, output
    merged = llama_cpp_logits(llama_cpp_with_adapter(out, None), tokens)
    assert np.abs(merged - ref).max() <= 1e-4  # measured 6e-6


@pytest.mark.parametrize("ftype", ["Q8_0", "Q4_0"])
def test_requantized_merge_keeps_types_and_matches_llama_cpp(random_llama: Callable[..., Path], tmp_path: Path,
                                                             ggml_quantize: Callable[..., np.ndarray],
                                                             test_adapter: Callable[..., Path], ftype: str) -> None:
    base_path = random_llama(ftype)
    adapter = test_adapter(base_path)
    out = tmp_path / "merged.gguf"
    code, output = export_lora("-m", base_path, "--lora", adapter, "-o", out, "--outtype", "same")
    assert code == 0, output

    f, g = base_gguf(base_path), read_gguf(out)
    assert g.metadata == f.metadata  # the dominant type is unchanged: general.file_type kept
    ad = read_adapter(adapter)
    for name, t in f.tensors.items():
        # llama.cpp's Q4_0 mix has a Q6_K output.weight: the one tensor written as Q8_0
        expected = t.ggml_type if name not in ad.pairs or t.ggml_type in QUANTIZABLE_TYPES else T.Q8_0
        assert g.tensors[name].ggml_type == expected, name
        if name not in ad.pairs:
            assert np.array_equal(g.tensors[name].data, t.data), name
    assert ("Q6_K tensor(s) written as Q8_0" in output) == (f.tensors["output.weight"].ggml_type == T.Q6_K)
    # a merged tensor's bytes are llama.cpp's quantization of W + ΔW
    name = "blk.0.attn_q.weight"
    t = f.tensors[name]
    w = dequantize(t.raw(), t.ggml_type, t.shape) + ad.delta(name)
    ref_bytes = ggml_quantize(w.numpy(), t.ggml_type)
    assert np.array_equal(g.tensors[name].data.reshape(ref_bytes.shape), ref_bytes)

    tokens = random_tokens(32000, N_TOKENS)
    ref, merged, base, f32 = merge_logits(base_path, adapter, out, random_llama("F32"), tokens)
    # Quantization tolerance = what quantizing the base itself cost. Measured: Q8_0 merge 0.28 vs
    # base 0.25, Q4_0 merge 2.0 vs base 2.7; the adapter moves logits by ~8.
    assert np.abs(merged - ref).max() <= 1.5 * np.abs(base - f32).max()
    assert np.abs(merged - ref).max() < 0.5 * np.abs(ref - base).max()


def test_k_quant_merge_falls_back_to_q8_0(random_llama: Callable[..., Path], tmp_path: Path,
                                          test_adapter: Callable[..., Path]) -> None:
    base_path = random_llama("Q4_K_M")
    adapter = test_adapter(base_path)
    out = tmp_path / "merged.gguf"
    code, output = export_lora("-m", base_path, "--lora", adapter, "-o", out)
    assert code == 0, output
    assert "written as Q8_0" in output
    f, g = base_gguf(base_path), read_gguf(out)
    for name, t in f.tensors.items():
        exact = t.ggml_type in QUANTIZABLE_TYPES or name in UNTOUCHED or len(t.shape) == 1
        assert g.tensors[name].ggml_type == (t.ggml_type if exact else T.Q8_0), name
    tokens = random_tokens(32000, N_TOKENS)
    ref, merged, base, f32 = merge_logits(base_path, adapter, out, random_llama("F32"), tokens)
    # Q8_0 is finer than Q4_K: measured merge error 0.34 vs 2.1 for the base's own quantization
    assert np.abs(merged - ref).max() <= 0.5 * np.abs(base - f32).max()


def test_checkpoint_with_norm_adapters_merges(random_llama: Callable[..., Path], tmp_path: Path) -> None:
    """Norm-gain adapters exist only in checkpoints; a merge is how they reach llama.cpp."""
    base_path = random_llama("F32")
    f = base_gguf(base_path)
    model = build_model(f, ModelConfig.from_gguf(f))
    config = LoraConfig(rank=4, alpha=8.0, ranks={"attn_norm": 2, "ffn_norm": 1, "output_norm": 1})
    attach_lora(model, config, seed=3)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, m in lora_modules(model):
            m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=gen) * 0.1)
    tensors = lora_tensors_by_gguf_name(model)
    assert "blk.0.attn_norm.weight.lora_a" in tensors
    ck = tmp_path / "ck.gguf"
    save_checkpoint(ck, f, config.metadata(), tensors, {})
    out = tmp_path / "merged.gguf"
    code, output = export_lora("-m", base_path, "--lora", ck, "-o", out)
    assert code == 0, output

    g = read_gguf(out)
    for norm in ("blk.1.attn_norm.weight", "output_norm.weight"):  # g + (b @ a)[0], written out here
        a, b = tensors[f"{norm}.lora_a"], tensors[f"{norm}.lora_b"]
        expected = torch.from_numpy(f.tensors[norm].data.view(np.float32)) + (b @ a)[0]
        np.testing.assert_allclose(g.tensors[norm].data.view(np.float32), expected.numpy(), rtol=0, atol=1e-6)
    tokens = random_tokens(32000, N_TOKENS)
    with torch.no_grad():
        ours = model(torch.tensor([tokens]))[0].numpy()
    merged = llama_cpp_logits(llama_cpp_with_adapter(out, None), tokens)
    assert np.abs(merged - ours).max() <= 1e-3  # ggtorch vs llama.cpp on f32 weights


def one_line_error(code: int, output: str, match: str) -> None:
    assert code == 1
    lines = output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and match in lines[0], output


def test_bad_inputs_are_one_line_errors(random_llama: Callable[..., Path], stories260k: Path, tmp_path: Path,
                                        test_adapter: Callable[..., Path]) -> None:
    base_path = random_llama("F32")
    adapter = test_adapter(base_path)
    out = tmp_path / "m.gguf"

    def export(lora: Path) -> tuple[int, str]:
        return export_lora("-m", base_path, "--lora", lora, "-o", out)

    one_line_error(*export(rewrite_gguf(adapter, tmp_path / "qwen.gguf", arch="qwen2")),
                   "the adapter is for a qwen2 model, the base model")
    ad = read_adapter(adapter)
    narrow = {n: LoraPair(p.a[:, :128], p.b) if n != "token_embd.weight" else p for n, p in ad.pairs.items()}
    other_shapes = write_adapter(tmp_path / "narrow.gguf", LoraAdapter("llama", ad.alpha, narrow))
    one_line_error(*export(other_shapes), "do not fit")
    a = read_gguf(adapter).tensors["blk.0.attn_q.weight.lora_a"]
    bad_rank = rewrite_gguf(adapter, tmp_path / "rank.gguf",
                            add_tensors={"blk.0.attn_q.weight.lora_a": a.data.view(np.float32).reshape(a.shape)[:3]})
    one_line_error(*export(bad_rank), "rank 3 but lora_b of rank 4")
    one_line_error(*export(stories260k), "is a model, not a LoRA adapter or training checkpoint")
    one_line_error(*export(tmp_path / "missing.gguf"), "missing.gguf: no such file")
    assert not out.exists()


def test_lora_flag_spellings_normalize_alike() -> None:
    """llama.cpp's current (FILE:SCALE, comma lists) and old (-s FILE SCALE, -l FILE) spellings."""
    from ggtorch.cli.options import normalize_lora_args

    expected = ["--lora-scaled", "a.gguf:1.0", "--lora-scaled", "b.gguf:0.5", "-o", "x"]
    assert normalize_lora_args(["--lora", "a.gguf", "--lora-scaled", "b.gguf:0.5", "-o", "x"]) == expected
    assert normalize_lora_args(["-l", "a.gguf", "-s", "b.gguf", "0.5", "-o", "x"]) == expected
    assert normalize_lora_args(["--lora-scaled", "a.gguf:1.0,b.gguf:0.5", "-o", "x"]) == expected
    assert normalize_lora_args(["--lora=a.gguf", "--lora-scaled", "b.gguf", "0.5", "-o", "x"]) == expected
    code, output = export_lora("-m", "x.gguf", "--lora-scaled", "b.gguf", "-o", "y.gguf")
    assert code == 2 and "expected FILE:SCALE or FILE SCALE" in output


def test_outtype_f16_on_a_q8_0_base_sets_file_type(random_llama: Callable[..., Path], tmp_path: Path,
                                                  test_adapter: Callable[..., Path]) -> None:
    base_path = random_llama("Q8_0")
    adapter = test_adapter(base_path)
    out = tmp_path / "merged-f16.gguf"
    code, output = export_lora("-m", base_path, "--lora", adapter, "-o", out, "--outtype", "f16")
    assert code == 0, output
    f, g = base_gguf(base_path), read_gguf(out)
    ad = read_adapter(adapter)
    for name, t in f.tensors.items():
        assert g.tensors[name].ggml_type == (T.F16 if name in ad.pairs else t.ggml_type), name
    # most matrix elements are now F16 (output.weight is as big as token_embd): LLAMA_FTYPE_MOSTLY_F16
    assert f.metadata["general.file_type"] == 7 and g.metadata["general.file_type"] == 1
    assert g.value_types["general.file_type"] == f.value_types["general.file_type"]
    tokens = random_tokens(32000, N_TOKENS)
    ref, merged, base, f32 = merge_logits(base_path, adapter, out, random_llama("F32"), tokens)
    assert np.abs(merged - ref).max() <= 1.5 * np.abs(base - f32).max()
