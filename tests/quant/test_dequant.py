"""ggtorch.quant.dequantize against two independent references, bit for bit.

References: llama.cpp's own ``to_float`` (libggml through ctypes, the ``ggml_to_float``
fixture) and gguf-py's numpy port ``gguf.quants.dequantize``. Data: tensors llama.cpp itself
quantized (``random_llama``), and random blocks with finite f16 scales in odd shapes. The tests
taking ``decoders`` run twice: with the native CPU decoders of the types they have (the default
on CPU) and with the torch decoders alone (every other device's path).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from ggtorch.errors import BadGGUF, Unsupported
from ggtorch.io.gguf import read_gguf
from ggtorch.ops import policy
from ggtorch.quant import SUPPORTED_TYPES, block_size, dequantize, row_nbytes, type_size


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The decoders' tensors here are small: one thread avoids OpenMP workers spinning
    against the other processes of a busy CI box (measured: 10-50x slowdowns at 2 threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["native", "torch"])
def decoders(request, cpu_policy) -> str:
    """Which decoders ``dequantize`` takes on CPU: the native ones where they exist, or torch's only."""
    cpu_policy(c_dequantize=request.param == "native")
    return request.param


# Byte offsets of each type's f16 scale fields (from the block structs in ggml-common.h).
# Random blocks get finite values there; every other byte stays random.
F16_FIELDS: dict[T, tuple[int, ...]] = {
    T.Q4_0: (0,),
    T.Q4_1: (0, 2),
    T.Q5_0: (0,),
    T.Q5_1: (0, 2),
    T.Q8_0: (0,),
    T.Q2_K: (80, 82),
    T.Q3_K: (108,),
    T.Q4_K: (0, 2),
    T.Q5_K: (0, 2),
    T.Q6_K: (208,),
    T.IQ4_NL: (0,),
    T.IQ4_XS: (0,),
    T.IQ2_XXS: (0,),
    T.IQ2_XS: (0,),
    T.IQ2_S: (0,),
    T.IQ3_XXS: (0,),
    T.IQ3_S: (0,),
    T.IQ1_S: (0,),
    T.IQ1_M: (),  # its f16 d is spread over the top nibbles of the scales: see random_blocks
    T.TQ1_0: (52,),
    T.TQ2_0: (64,),
    T.MXFP4: (),  # e8m0 scale: every byte is a valid scale
    T.NVFP4: (),  # ue4m3 scales: every byte is a valid scale
}
pytestmark = pytest.mark.xdist_group("llama.cpp IQ grids")
"""With tests/quant/test_autograd.py's on one worker: llama.cpp builds its IQ1 and IQ2 grids once per process."""

FLOAT_TYPES = (T.F32, T.F16, T.BF16)
RANDOM_BLOCK_TYPES = [*FLOAT_TYPES, *F16_FIELDS]

# llama.cpp ftypes and the ggml type that dominates each file (llama.cpp mixes in others).
FTYPES: dict[str, T] = {
    "F16": T.F16,
    "BF16": T.BF16,
    "Q8_0": T.Q8_0,
    "Q4_0": T.Q4_0,
    "Q4_1": T.Q4_1,
    "Q5_0": T.Q5_0,
    "Q5_1": T.Q5_1,
    "Q2_K": T.Q2_K,
    "Q3_K_M": T.Q3_K,
    "Q4_K_M": T.Q4_K,
    "Q5_K_M": T.Q5_K,
    "Q6_K": T.Q6_K,
    "IQ4_NL": T.IQ4_NL,
    "IQ4_XS": T.IQ4_XS,
}


def assert_bits_equal(got: torch.Tensor, ref: np.ndarray, what: str) -> None:
    """Same f32 bit patterns everywhere; NaN only where the reference has NaN (payloads may differ)."""
    got_np = got.detach().to("cpu", torch.float32).numpy().reshape(-1)
    ref = np.asarray(ref, dtype=np.float32).reshape(-1)
    assert got_np.shape == ref.shape, what
    same = got_np.view(np.uint32) == ref.view(np.uint32)
    both_nan = np.isnan(got_np) & np.isnan(ref)
    bad = ~(same | both_nan)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} values differ, first at {i}: "
                             f"{got_np[i]!r} vs {ref[i]!r}")


def random_blocks(ggml_type: T, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random raw bytes for a tensor of ``shape``, with finite f16 scales (rows × row bytes)."""
    rng = np.random.default_rng(seed)
    bs, ts = GGML_QUANT_SIZES[ggml_type]
    n_rows = int(np.prod(shape[:-1], dtype=np.int64))
    raw = rng.integers(0, 256, size=(n_rows, shape[-1] // bs * ts), dtype=np.uint8)
    blocks = raw.reshape(-1, ts)
    for offset in F16_FIELDS.get(ggml_type, ()):
        scales = (rng.standard_normal(blocks.shape[0]) * 0.05).astype(np.float16)
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    if ggml_type == T.IQ1_M:  # clear bit 14 of d (bit 6 of the last byte): a finite exponent
        blocks[:, -1] &= 0xBF
    return raw


@pytest.mark.parametrize("ftype", list(FTYPES))
def test_llama_cpp_quantized_tensors(ftype: str, random_llama, ggml_to_float, decoders: str) -> None:
    """Every tensor of a model llama.cpp quantized decodes like llama.cpp and gguf-py decode it."""
    f = read_gguf(random_llama(ftype))
    seen = set()
    for info in f.tensors.values():
        seen.add(info.ggml_type)
        got = dequantize(info.raw(), info.ggml_type, info.shape, name=info.name)
        assert got.shape == info.shape and got.dtype == torch.float32
        what = f"{info.name} {info.ggml_type.name}"
        assert_bits_equal(got, ggml_to_float(info.data, info.ggml_type), f"{what} vs llama.cpp")
        assert_bits_equal(got, gguf_dequantize(info.data, info.ggml_type), f"{what} vs gguf-py")
    assert FTYPES[ftype] in seen


# IQ1_S/IQ1_M/IQ2_S are left out here only for time: llama.cpp's ggml_quantize_init builds
# their search tables for 5-15 s. Their decoders are pure functions of the bits, which
# test_random_blocks covers against both references.
CHUNK_TYPES = sorted((t for t in SUPPORTED_TYPES if t not in (*FLOAT_TYPES, T.IQ1_S, T.IQ1_M, T.IQ2_S)), key=int)


@pytest.mark.parametrize("ggml_type", CHUNK_TYPES, ids=lambda t: t.name)
def test_ggml_quantize_chunk_output(ggml_type: T, ggml_quantize, ggml_to_float, decoders: str) -> None:
    """Quantized types, including those no llama.cpp ftype here produces (IQ2_XXS, IQ2_XS,
    IQ3_*, TQ*, MXFP4, NVFP4), on realistic blocks made by llama.cpp's own quantizer."""
    rng = np.random.default_rng(int(ggml_type))
    cols = 2 * block_size(ggml_type) if block_size(ggml_type) > 32 else 8 * block_size(ggml_type)
    data = rng.standard_normal((6, cols), dtype=np.float32) * np.float32(0.02)
    data[0] = 0  # all-zero blocks: zero scales
    raw = ggml_quantize(data, ggml_type)
    got = dequantize(torch.from_numpy(raw), ggml_type, data.shape)
    assert_bits_equal(got, ggml_to_float(raw, ggml_type), f"{ggml_type.name} vs llama.cpp")
    assert_bits_equal(got, gguf_dequantize(raw, ggml_type), f"{ggml_type.name} vs gguf-py")
    # and the round trip is a plausible approximation, so the blocks are not degenerate
    assert torch.corrcoef(torch.stack([got[1:].reshape(-1), torch.from_numpy(data[1:]).reshape(-1)]))[0, 1] > 0.5


ODD_SHAPES = [
    pytest.param(lambda bs: (bs,), id="1-block"),
    pytest.param(lambda bs: (1, 5 * bs), id="1-row"),
    pytest.param(lambda bs: (7, 3 * bs), id="7-rows"),
    pytest.param(lambda bs: (3, 2, bs), id="3d"),
    pytest.param(lambda bs: (max(1, 300_000 // (4 * bs)), 4 * bs), id="many-rows"),
]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # MXFP4 scales up to 2^127
@pytest.mark.parametrize("make_shape", ODD_SHAPES)
@pytest.mark.parametrize("ggml_type", RANDOM_BLOCK_TYPES, ids=lambda t: t.name)
def test_random_blocks(ggml_type: T, make_shape, ggml_to_float, decoders: str) -> None:
    shape = make_shape(block_size(ggml_type))
    raw = random_blocks(ggml_type, shape)
    got = dequantize(torch.from_numpy(raw), ggml_type, shape)
    assert got.shape == shape
    assert_bits_equal(got, ggml_to_float(raw, ggml_type), f"{ggml_type.name} {shape} vs llama.cpp")
    assert_bits_equal(got, gguf_dequantize(raw, ggml_type), f"{ggml_type.name} {shape} vs gguf-py")


@pytest.mark.parametrize("ggml_type", RANDOM_BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_output_dtype_is_f32_result_cast(ggml_type: T, dtype: torch.dtype) -> None:
    shape = (4, 2 * block_size(ggml_type))
    raw = torch.from_numpy(random_blocks(ggml_type, shape, seed=1))
    f32 = dequantize(raw, ggml_type, shape)
    got = dequantize(raw, ggml_type, shape, dtype=dtype)
    assert got.dtype == dtype
    assert torch.equal(got.view(torch.int16), f32.to(dtype).view(torch.int16))


@pytest.mark.parametrize("ggml_type", RANDOM_BLOCK_TYPES, ids=lambda t: t.name)
def test_raw_layout_does_not_matter(ggml_type: T) -> None:
    """Flat bytes, (rows, row bytes), and a copy at an odd address all give the same values."""
    shape = (5, 2 * block_size(ggml_type))
    raw = torch.from_numpy(random_blocks(ggml_type, shape, seed=2))
    ref = dequantize(raw.reshape(-1), ggml_type, shape)
    assert torch.equal(dequantize(raw, ggml_type, shape).view(torch.int32), ref.view(torch.int32))
    padded = torch.zeros(raw.numel() + 1, dtype=torch.uint8)
    padded[1:] = raw.reshape(-1)
    assert torch.equal(dequantize(padded[1:], ggml_type, shape).view(torch.int32), ref.view(torch.int32))


@pytest.mark.parametrize("ggml_type", sorted(SUPPORTED_TYPES, key=int), ids=lambda t: t.name)
def test_stays_on_the_raw_device(ggml_type: T) -> None:
    """On the meta device any host round trip (.cpu(), .item(), numpy, a CPU-only table)
    raises, so this checks what a CUDA run needs without a GPU: every op and table follows raw."""
    bs, ts = GGML_QUANT_SIZES[ggml_type]
    raw = torch.empty((3, 2 * ts), dtype=torch.uint8, device="meta")
    out = dequantize(raw, ggml_type, (3, 2 * bs), dtype=torch.bfloat16)
    assert (out.device.type, out.shape, out.dtype) == ("meta", (3, 2 * bs), torch.bfloat16)


@pytest.mark.parametrize("ggml_type", [T.F16, T.Q4_0, T.Q6_K], ids=lambda t: t.name)
def test_empty_tensor(ggml_type: T) -> None:
    out = dequantize(torch.zeros(0, dtype=torch.uint8), ggml_type, (0, block_size(ggml_type)))
    assert out.shape == (0, block_size(ggml_type)) and out.dtype == torch.float32


@pytest.mark.parametrize("ggml_type, dtype", [(T.F32, torch.float32), (T.F16, torch.float16),
                                              (T.BF16, torch.bfloat16)], ids=["F32", "F16", "BF16"])
def test_result_never_aliases_raw(ggml_type: T, dtype: torch.dtype) -> None:
    raw = torch.from_numpy(random_blocks(ggml_type, (2, 8), seed=3))
    before = raw.clone()
    out = dequantize(raw, ggml_type, (2, 8), dtype=dtype)
    out += 1
    assert torch.equal(raw, before)


def test_sizes_come_from_gguf() -> None:
    for t in SUPPORTED_TYPES:
        assert (block_size(t), type_size(t)) == GGML_QUANT_SIZES[t]
    assert row_nbytes(T.Q4_0, 4096) == 4096 // 32 * 18
    assert row_nbytes(T.F16, 7) == 14
    with pytest.raises(ValueError, match="Q4_K"):
        row_nbytes(T.Q4_K, 100)


def test_wrong_byte_count_is_a_clear_error() -> None:
    raw = torch.zeros(18 * 3 - 1, dtype=torch.uint8)
    with pytest.raises(BadGGUF, match=r"blk\.0\.attn_q\.weight.*53 bytes.*Q4_0.*54"):
        dequantize(raw, T.Q4_0, (1, 96), name="blk.0.attn_q.weight")
    with pytest.raises(BadGGUF, match=r"output\.weight.*not a whole number of Q8_0 blocks"):
        dequantize(torch.zeros(34, dtype=torch.uint8), T.Q8_0, (2, 16), name="output.weight")


def test_unsupported_type_names_type_and_tensor() -> None:
    with pytest.raises(Unsupported, match=r"blk\.3\.ffn_up\.weight.*Q8_1"):
        dequantize(torch.zeros(40, dtype=torch.uint8), T.Q8_1, (32,), name="blk.3.ffn_up.weight")


@pytest.mark.parametrize("ggml_type", [T.F32, T.BF16, T.Q4_0, T.Q6_K, T.IQ2_XS], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_into_out_is_the_same_values_in_out_s_memory(ggml_type: T, dtype: torch.dtype, cpu_policy) -> None:
    """``out=``: written in place (also over several decoding steps and for float types) with the
    values of a plain call; an ``out`` of the wrong size or dtype is refused before anything is written."""
    shape = (6, 4 * block_size(ggml_type))
    raw = torch.from_numpy(random_blocks(ggml_type, shape, seed=3))
    ref = dequantize(raw, ggml_type, shape, dtype)
    for values_per_step in (policy.current("cpu").decode_step_values, block_size(ggml_type) * 3):  # one; several
        cpu_policy(decode_step_values=values_per_step)
        out = torch.full((ref.numel(),), 7.0, dtype=dtype)
        got = dequantize(raw, ggml_type, shape, dtype, out=out)
        assert got.shape == shape and got.data_ptr() == out.data_ptr()
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
    for bad in (torch.empty(ref.numel() + 1, dtype=dtype), torch.empty(ref.numel(), dtype=torch.float16),
                torch.empty(shape[::-1], dtype=dtype).T):
        with pytest.raises(ValueError, match="out must be"):
            dequantize(raw, ggml_type, shape, dtype, out=bad)
