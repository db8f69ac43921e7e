"""One-pass CPU decoders (``native.c``) for Q4_0, Q8_0, Q4_K, Q5_K and Q6_K, built on first use.

A quantized base is decoded chunk by chunk in every forward and backward, right after matrix
products that have filled the caches with other data. The torch decoders take several passes over
each chunk (widen, subtract, scale: each its own kernel, each reading and writing the f32 chunk);
the C loops read a block once and write each value once, in f32 or rounded to bf16 as torch rounds
(the compute dtype of ``--dtype bf16``). They mirror ggml's scalar
``dequantize_row_*`` and give the same values bit for bit (tests/quant/test_native.py checks them
against the torch decoders and llama.cpp).

The library is compiled with the system's C compiler (``cc``, or ``$CC``) for the CPU it runs on
into ``$XDG_CACHE_HOME/ggtorch`` (``~/.cache/ggtorch``), once per source, compiler and CPU, and
loaded with ctypes: no build step at install time and no Python headers. Without a compiler, or on
any other device, :func:`ggtorch.quant.dequantize` keeps the torch decoders, which give the same values.

A decode is split over torch's intra-op threads on torch's own OpenMP runtime, which the library is
linked to by path (:func:`torch_openmp`): threads of their own would compete for the cores with
torch's workers, which spin for a while after every product. Where that runtime cannot be found, the
library is built without OpenMP and decodes on the calling thread.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch.autograd.graph import increment_version

log = logging.getLogger(__name__)

ENABLED = True
"""Decode the types :func:`native_types` lists with the C library on CPU; False keeps the torch decoders."""

TYPES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K,
                   GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K})
"""The types ``native.c`` decodes (its TYPES table): known without building it, and checked against the
library by :func:`native_types`."""

SOURCE = Path(__file__).with_name("native.c")
FLAGS = ("-O3", "-ffp-contract=off", "-fPIC")
"""Compiler flags besides the CPU's (``-march=native`` when the compiler takes it) and OpenMP's."""


def cache_dir() -> Path:
    """Where built libraries are kept: ``$XDG_CACHE_HOME/ggtorch`` or ``~/.cache/ggtorch``."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ggtorch"


def _cpu_identity() -> str:
    """The CPU model and features: a library built with -march=native runs only where they match."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() + platform.machine()
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features", "CPU part")]
    return platform.machine() + "\n".join(sorted(set(keep)))


def torch_openmp() -> Path | None:
    """The GNU OpenMP runtime torch runs its CPU kernels on, as this process has loaded it: the one in
    torch's own folder (pip wheels bundle it), else the only one loaded; None when unsure (other
    packages bundle their own copies), without /proc, or for another runtime."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    loaded = {Path(fields[-1]) for fields in map(str.split, maps)
              if len(fields) >= 6 and Path(fields[-1]).name.startswith("libgomp")}
    in_torch = [p for p in loaded if Path(torch.__file__).parent in p.parents]
    found = in_torch or (list(loaded) if len(loaded) == 1 else [])
    return found[0] if len(found) == 1 and found[0].exists() else None


def _commands(cc: list[str], openmp: Path | None, march: list[str], obj: str, target: str) -> list[list[str]]:
    """The compiler runs that build the library: with OpenMP, compiled with -fopenmp and linked to torch's
    runtime itself (not the compiler's -lgomp, which could load a second runtime with its own threads)."""
    if openmp is None:
        return [[*cc, *FLAGS, *march, "-shared", str(SOURCE), "-o", target]]
    return [[*cc, *FLAGS, *march, "-fopenmp", "-c", str(SOURCE), "-o", obj],
            [*cc, "-shared", obj, str(openmp), "-o", target]]


def _compile(cc: list[str], openmp: Path | None, target: Path) -> bool:
    """Build the library at ``target`` (written whole or not at all: ranks of one run may build it at once)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        obj, built = str(Path(tmp) / "native.o"), str(Path(tmp) / "native.so")
        for march in (["-march=native"], []):
            try:
                for cmd in _commands(cc, openmp, march, obj, built):
                    subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True)
            except subprocess.CalledProcessError as e:
                log.info("ggtorch: %s failed: %s", shlex.join(e.cmd), (e.stderr or "").strip()[-500:])
                continue
            except (OSError, subprocess.SubprocessError) as e:
                log.info("ggtorch: could not compile %s: %s", SOURCE.name, e)
                return False
            os.replace(built, target)
            return True
    return False


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The built library, building it first when needed; None when there is no compiler or it fails."""
    cc = shlex.split(os.environ.get("CC", "")) or ([shutil.which("cc")] if shutil.which("cc") else [])
    if not cc or not SOURCE.exists():
        log.info("ggtorch: no C compiler (cc or $CC); quantized matrices decode through torch")
        return None
    openmp = torch_openmp()
    key = hashlib.sha256(SOURCE.read_bytes() + repr((cc, FLAGS, str(openmp), _cpu_identity())).encode())
    target = cache_dir() / f"native-{key.hexdigest()[:16]}.so"
    if not target.exists() and not _compile(cc, openmp, target):
        return None
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as e:
        log.info("ggtorch: could not load %s: %s", target, e)
        return None
    lib.ggtorch_dequantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int,
                                      ctypes.c_int]
    lib.ggtorch_dequantize.restype = ctypes.c_int
    lib.ggtorch_native_types.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    lib.ggtorch_native_types.restype = ctypes.c_int
    return lib


@functools.cache
def native_types() -> frozenset[GGMLQuantizationType]:
    """The ggml types the C library decodes here (empty when it cannot be built)."""
    lib = _library()
    if lib is None:
        return frozenset()
    ids = (ctypes.c_int * 16)()
    n = lib.ggtorch_native_types(ids, len(ids))
    built = frozenset(GGMLQuantizationType(ids[i]) for i in range(min(n, len(ids))))
    if built != TYPES:  # native.c's table and TYPES disagree: trust neither
        log.info("ggtorch: %s decodes %s, not %s; quantized matrices decode through torch", SOURCE.name,
                 sorted(t.name for t in built), sorted(t.name for t in TYPES))
        return frozenset()
    return built


def decodes(blocks: torch.Tensor, ggml_type: GGMLQuantizationType) -> bool:
    """Whether :func:`decode` takes these blocks: CPU bytes in one piece, a type the library has, enabled."""
    return (ENABLED and blocks.device.type == "cpu" and blocks.dtype == torch.uint8 and blocks.is_contiguous()
            and ggml_type in native_types())


OUT_DTYPES = (torch.float32, torch.bfloat16)
"""What the library writes: f32, or bf16 rounded from it to nearest even, as ``.to(torch.bfloat16)`` rounds."""


def decode(blocks: torch.Tensor, ggml_type: GGMLQuantizationType, out: torch.Tensor) -> torch.Tensor:
    """Decode ``blocks`` ((n_blocks, type_size) uint8, :func:`decodes` true) into ``out``, a contiguous
    f32 or bf16 CPU tensor of n_blocks × block size values, on torch's intra-op thread count; returns ``out``."""
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if blocks.dim() != 2 or blocks.shape[1] != type_size:
        raise ValueError(f"blocks must be (n_blocks, {type_size}) for {ggml_type.name}, not {tuple(blocks.shape)}")
    if (out.dtype not in OUT_DTYPES or out.device.type != "cpu" or not out.is_contiguous()
            or out.numel() != blocks.shape[0] * block_size):
        raise ValueError(f"out must be a contiguous float32 or bfloat16 CPU tensor of {blocks.shape[0] * block_size} "
                         "values")
    lib = _library()
    assert lib is not None
    if lib.ggtorch_dequantize(int(ggml_type), blocks.data_ptr(), out.data_ptr(), blocks.shape[0],
                              torch.get_num_threads(), out.dtype == torch.bfloat16) != 0:
        raise ValueError(f"the native decoders have no {ggml_type.name}")
    if not out.is_inference():  # written in place: a graph that saved out must see it changed, as after copy_
        increment_version(out)
    return out
