"""The native CPU decoders (ggtorch/quant/native.c) against llama.cpp's ``to_float`` and the torch decoders.

The torch decoders stay the path on every other device and where no C compiler is found, so both must give
llama.cpp's values: each test here decodes the same blocks both ways. ``test_dequant.py`` checks the torch
decoders alone against llama.cpp and gguf-py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from ggtorch.quant import DEQUANTIZERS, dequantize, native
from tests.quant.test_dequant import assert_bits_equal, random_blocks

NATIVE = (T.Q4_0, T.Q8_0, T.Q4_K, T.Q5_K, T.Q6_K)
"""The types native.c decodes (written out here, not read from ggtorch)."""

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler (cc) on this machine")

F16_SPECIALS = np.array([0.0, -0.0, 6e-8, -3e-5, 65504.0, np.inf, -np.inf, np.nan, 1.0, -0.02], dtype=np.float16)
"""Scale values whose f16 -> f32 widening has its own branch in native.c: zeros, subnormals, the largest finite,
infinities, NaN, and ordinary values."""


@pytest.fixture(autouse=True)
def _native_on(cpu_policy):
    cpu_policy(c_dequantize=True)


def _torch_decoded(raw: torch.Tensor, ggml_type: T) -> torch.Tensor:
    """The torch decoder's values for ``raw`` (flat f32)."""
    return DEQUANTIZERS[ggml_type](raw.reshape(-1, GGML_QUANT_SIZES[ggml_type][1])).reshape(-1)


def test_the_library_builds_here_and_has_its_types() -> None:
    assert native.native_types() == native.TYPES == frozenset(NATIVE)


@pytest.mark.parametrize("ggml_type", NATIVE, ids=lambda t: t.name)
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_random_blocks_decode_as_llama_cpp_and_torch_do(ggml_type: T, threads: int, ggml_to_float,
                                                        monkeypatch) -> None:
    """Odd block counts split over 1-3 threads (uneven shares), every block decoded as both references do."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    bs = GGML_QUANT_SIZES[ggml_type][0]
    for shape in [(bs,), (7, 3 * bs), (301, 2 * bs)]:
        raw = torch.from_numpy(random_blocks(ggml_type, shape, seed=threads))
        assert native.decodes(raw.reshape(-1, GGML_QUANT_SIZES[ggml_type][1]), ggml_type)
        got = dequantize(raw, ggml_type, shape)
        assert got.shape == shape
        assert_bits_equal(got, ggml_to_float(raw.numpy(), ggml_type), f"{ggml_type.name} {shape} vs llama.cpp")
        assert_bits_equal(got, _torch_decoded(raw, ggml_type).numpy(), f"{ggml_type.name} {shape} vs torch")


@pytest.mark.parametrize("ggml_type", NATIVE, ids=lambda t: t.name)
def test_special_scales_decode_as_llama_cpp_does(ggml_type: T, ggml_to_float) -> None:
    """Every f16 scale field set to zeros, subnormals, infinities, NaN: the same values (NaN where llama.cpp
    has NaN) as llama.cpp and the torch decoder."""
    bs, ts = GGML_QUANT_SIZES[ggml_type]
    blocks = random_blocks(ggml_type, (len(F16_SPECIALS) * bs,), seed=3).reshape(-1, ts)
    offsets = {T.Q4_0: (0,), T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}[ggml_type]
    for k, offset in enumerate(offsets):
        scales = np.roll(F16_SPECIALS, k)  # d and dmin meet different specials
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    raw = torch.from_numpy(blocks)
    got = dequantize(raw, ggml_type, (blocks.shape[0] * bs,))
    assert_bits_equal(got, ggml_to_float(blocks, ggml_type), f"{ggml_type.name} vs llama.cpp")
    assert_bits_equal(got, _torch_decoded(raw, ggml_type).numpy(), f"{ggml_type.name} vs torch")


@pytest.mark.parametrize("ggml_type", NATIVE, ids=lambda t: t.name)
def test_special_scales_decode_to_bf16_as_torch_rounds(ggml_type: T) -> None:
    """The same special scales decoded straight to bf16 (blocks with finite scales take a rounding that skips the
    NaN check; 4-bit types pick their values from a table per scale where the CPU has AVX-512): torch's f32 values
    cast by torch, NaN where it has NaN."""
    bs, ts = GGML_QUANT_SIZES[ggml_type]
    nan_payload = np.array([0x7FFF], dtype=np.uint16).view(np.float16)  # rounds past the sign if taken for a number
    specials = np.concatenate([F16_SPECIALS, nan_payload])
    blocks = random_blocks(ggml_type, (len(specials) * 3 * bs,), seed=4).reshape(-1, ts)
    offsets = {T.Q4_0: (0,), T.Q8_0: (0,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}[ggml_type]
    for k, offset in enumerate(offsets):
        scales = np.tile(np.roll(specials, k), 3)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    raw = torch.from_numpy(blocks)
    got = native.decode(raw, ggml_type, torch.empty(blocks.shape[0] * bs, dtype=torch.bfloat16))
    expected = _torch_decoded(raw, ggml_type).to(torch.bfloat16)
    assert torch.equal(got.isnan(), expected.isnan())
    assert expected.isnan().any() and not expected.isnan().all()
    numbers = ~expected.isnan()
    assert torch.equal(got[numbers].view(torch.int16), expected[numbers].view(torch.int16))


@pytest.mark.parametrize("ggml_type", NATIVE, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_into_out_and_other_dtypes(ggml_type: T, dtype: torch.dtype, cpu_policy) -> None:
    """Into a given ``out`` or new memory, in f32, bf16 (rounded in C) and f16 (decoded in f32 chunks, each
    cast): the torch decoders' f32 values cast by torch."""
    cpu_policy(decode_step_values=3 * 256)  # several chunks, the last one short
    shape = (5, 7 * 256)
    raw = torch.from_numpy(random_blocks(ggml_type, shape, seed=5))
    expected = _torch_decoded(raw, ggml_type).to(dtype).reshape(shape)
    out = torch.full(shape, 7.0, dtype=dtype)
    assert dequantize(raw, ggml_type, shape, dtype, out=out).data_ptr() == out.data_ptr()
    assert torch.equal(out, expected)
    assert torch.equal(dequantize(raw, ggml_type, shape, dtype), expected)


@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_rounds_to_nearest_even_as_torch_does(threads: int, monkeypatch) -> None:
    """Q8_0 with d = 1 + 2**-8: q·d lands exactly halfway between two bf16 values for odd q (ties go to the even
    neighbour), beside non-ties, infinities and NaN scales: bit for bit torch's ``.to(torch.bfloat16)``."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    scales = np.array([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 65504.0, np.inf, np.nan, 2**-20], dtype=np.float16)
    blocks = np.zeros((len(scales) * 40, 34), dtype=np.uint8)
    blocks[:, :2] = np.tile(scales, 40).view(np.uint8).reshape(-1, 2)
    blocks[:, 2:] = np.arange(blocks.shape[0] * 32, dtype=np.int64).reshape(-1, 32).astype(np.uint8)  # every int8
    raw = torch.from_numpy(blocks)
    got = native.decode(raw, T.Q8_0, torch.empty(raw.shape[0] * 32, dtype=torch.bfloat16))
    expected = _torch_decoded(raw, T.Q8_0).to(torch.bfloat16)
    assert torch.equal(got.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(got[finite].view(torch.int16), expected[finite].view(torch.int16))
    f32 = _torch_decoded(raw, T.Q8_0)
    assert (f32[finite].view(torch.int32) & 0xFFFF == 0x8000).sum() > 100  # ties were there to be rounded


def test_a_view_of_blocks_or_another_device_keeps_the_torch_decoders() -> None:
    raw = torch.from_numpy(random_blocks(T.Q4_0, (4, 64)))  # (4, 36): two blocks per row
    assert not native.decodes(raw[:, :18], T.Q4_0)  # every other block: not one piece
    assert not native.decodes(raw.reshape(-1, 18), T.Q4_1)  # a type native.c has not
    assert not native.decodes(raw.reshape(-1, 18).to("meta"), T.Q4_0)
    every_other = raw[:, :18]
    assert torch.equal(dequantize(every_other, T.Q4_0, (4, 32)), _torch_decoded(every_other.contiguous(), T.Q4_0)
                       .reshape(4, 32))


def test_a_policy_without_c_decoders_means_the_torch_decoders(monkeypatch, cpu_policy) -> None:
    cpu_policy(c_dequantize=False)
    monkeypatch.setattr(native, "decode", lambda *a: pytest.fail("native.decode called while disabled"))
    raw = torch.from_numpy(random_blocks(T.Q4_K, (2, 256)))
    assert torch.equal(dequantize(raw, T.Q4_K, (2, 256)), _torch_decoded(raw, T.Q4_K).reshape(2, 256))


def test_decode_refuses_a_wrong_output() -> None:
    raw = torch.from_numpy(random_blocks(T.Q8_0, (2, 32))).reshape(2, 34)
    for bad in (torch.empty(63), torch.empty(64, dtype=torch.float16), torch.empty(128)[::2]):
        with pytest.raises(ValueError, match="out must be"):
            native.decode(raw, T.Q8_0, bad)


def test_decoding_runs_on_torch_s_openmp_runtime_and_loads_no_other() -> None:
    """In a fresh process: the library links the OpenMP runtime torch loaded, not a second copy (whose
    threads would compete with torch's spinning workers for the cores)."""
    code = """
import torch
from pathlib import Path
def gomps():
    return {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line}
from ggtorch.ops import clib
from ggtorch.quant import native  # (ggtorch's imports may load other packages' runtimes: before counts them)
from gguf import GGMLQuantizationType as T
before = gomps()
assert native.native_types(), "not built"
native.decode(torch.zeros(64, 18, dtype=torch.uint8), T.Q4_0, torch.empty(64 * 32))
print(clib.torch_openmp() is not None, gomps() == before, len(before))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    found, same, n = run.stdout.split()
    if n == "0":
        pytest.skip("this torch build loads no GNU OpenMP runtime")
    assert found == "True" and same == "True", run.stdout


def _finetune(model, tmp_path, env: dict[str, str]) -> subprocess.CompletedProcess:
    text = tmp_path / "train.txt"
    text.write_text("The cat sat on the mat. " * 200)
    cmd = [sys.executable, "-m", "ggtorch", "finetune", "--model-base", str(model), "--train-data", str(text),
           "--lora-out", str(tmp_path / "lora.gguf"), "--adam-iter", "1", "--ctx", "16", "--batch", "1",
           "--save-every", "0", "--threads", "1", "--overwrite"]  # each run a new one, over the last
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})


def test_without_a_compiler_finetune_trains_on_torch_s_decoders_and_says_so(stories_q8, stories260k,
                                                                            tmp_path) -> None:
    """A failed build is no error: the run trains (through the torch decoders) and names the fix once; a base with
    nothing the library decodes (F32) neither builds it nor gets the note."""
    float_base = _finetune(stories260k, tmp_path, {"CC": "false", "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert float_base.returncode == 0, float_base.stderr
    assert "no C compiler" not in float_base.stdout
    broken = _finetune(stories_q8, tmp_path, {"CC": "false", "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert broken.returncode == 0, broken.stderr
    assert broken.stdout.count("note: no C compiler (cc) found, so the Q8_0 blocks decode through torch") == 1, \
        broken.stdout
    assert (tmp_path / "lora.gguf").exists()
    built = _finetune(stories_q8, tmp_path, {"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert built.returncode == 0, built.stderr
    assert "no C compiler" not in built.stdout
    assert [p.suffix for p in (tmp_path / "cache" / "ggtorch").glob("native-*")] == [".so"]


def test_writing_into_out_counts_as_an_in_place_change() -> None:
    """A graph that saved ``out`` (a kept decoded matrix) must see it overwritten, as after ``copy_``."""
    raw = torch.from_numpy(random_blocks(T.Q8_0, (2, 32))).reshape(2, 34)
    out = torch.empty(64)
    before = out._version
    native.decode(raw, T.Q8_0, out)
    assert out._version > before
    with torch.inference_mode():  # inference tensors have no version to count
        native.decode(raw, T.Q8_0, torch.empty(64))
