"""The one place ggtorch decides, per device, which kernel runs each op and what sizes the chunked ops work in.

A :class:`Policy` is a small frozen record chosen for a device (:func:`for_device`): on CPU the C loops
(decoders, LoRA's rank-r products, the fused norm/gated-unit/rope/softmax loops, training attention) and
oneDNN's f32 products where they are faster, written-out attention for short training sequences, and the
chunk and slab sizes of dequantization and the loss; on CUDA, MPS and other devices torch's own kernels. A
module asks :func:`current` for the policy of its operands' device and follows it; no module keeps a switch
of its own. A run (the Trainer) computes under its policy (:func:`using`), and a test that wants another path
(torch's fallback of a C loop, a smaller chunk) sets a policy the same way instead of patching a module.

Whether a C library could be built is not the policy's to say: an op whose policy allows its C loops still
falls back to torch where the library is missing (no compiler, an unwritable cache; :mod:`ggtorch.ops.clib`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import platform
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ggtorch.ops.dtypes import cpu_matmul_speed_vs_f32


@dataclass(frozen=True)
class Policy:
    """One device's kernel choices and working sizes."""

    device_type: str
    """``cpu``, ``cuda``, ``mps``, ...: the device whose operands this policy is for."""

    # --- which kernel runs each op ---------------------------------------------------------------------------------
    c_dequantize: bool = False
    """Q4_0, Q8_0, Q4_K, Q5_K and Q6_K blocks decode in one pass in ``quant/native.c``."""
    c_lowrank: bool = False
    """LoRA's rank-r products run in ``ops/lowrank.c``, one pass over each activation."""
    c_fused: bool = False
    """RMSNorm, SwiGLU/GeGLU, rope and the loss's slab softmax run in ``ops/fused.c``."""
    c_attention: bool = False
    """Training attention over short sequences runs in ``ops/attention.c`` (f32; bf16 where the CPU has bf16 dot
    products)."""
    compiled_dequantize: bool = False
    """Each chunk of quantized blocks decodes in one fused kernel (torch.compile of the type's decoder: Triton on
    CUDA) instead of a dozen elementwise ones, each a pass over memory and a launch; the eager decoders stay the
    reference it equals bit for bit."""
    onednn_f32: bool = False
    """f32 matrix products run on oneDNN's inner product instead of torch.mm (MKL): faster on AMD's CPUs, slower
    on Intel's (``bench/bench_gemm.py``)."""
    written_attention_max_tokens: int = 0
    """Training self-attention over at most this many tokens writes its scores out (in C, or as batched products a
    block of queries at a time) instead of a flash kernel: faster on CPU up to there, at the price of the saved
    probabilities (0: never)."""
    flex_attention: str = ""
    """Training attention (any mask, soft-cap or sinks) runs through FlexAttention (``ops/flex_attention.py``):
    ``compiled`` as one fused kernel per mask kind (CUDA), ``eager`` as torch's reference of it (the CPU's tests),
    '' not at all (the CPU's written-out attention and SDPA)."""
    written_attention_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)
    """The dtypes whose attention may be written out."""
    fused_adamw: bool = False
    """torch has a fused AdamW kernel for this device (one launch for every parameter)."""
    in_place_softmax: bool = False
    """torch's softmax may write its output over its input on this device (the loss reuses the logits' memory)."""
    complex_rope: bool = False
    """Rope rotates through complex multiplication (torch's complex kernels exist here); else through sin/cos."""
    device_rng: bool = False
    """The device has an RNG state of its own that activation checkpointing saves and restores (dropout)."""
    wide_dtype: torch.dtype = torch.float64
    """Where ggml and llama.cpp compute in double (the gradient norm's sum of squares, Llama 4's attention
    temperature): float64, or float32 on a device without it (MPS)."""
    dist_backend: str = "gloo"
    """torch.distributed's backend for ranks on this device: NCCL between GPUs, gloo elsewhere."""
    auto_dtype: str = "f32"
    """What ``--dtype auto`` computes a loaded model in (generate, perplexity, the API's ``load_model``): bf16 where
    the device multiplies bf16 natively (CUDA from compute capability 8.0, Ampere), f32 elsewhere. A CPU keeps f32
    here: its logits are then llama.cpp's to f32 rounding."""
    train_dtype: str = "f32"
    """What ``--dtype auto`` trains in: the device's :attr:`auto_dtype`, except on a CPU that multiplies bf16
    natively and at least :data:`BF16_TRAIN_SPEEDUP` times faster than f32 (AMX, AVX512-BF16, Arm's BF16; measured
    by ``ops.dtypes.cpu_matmul_speed_vs_f32``), where a step's products, most of its time at the sizes people
    train, run in bf16 (weights, their gradients and AdamW's state stay f32)."""
    tf32: bool = False
    """f32 matrix products may round their operands to TF32 on the tensor cores (CUDA from Ampere): the products of
    an f32 run (a LoRA's, a full finetune's) run several times faster, at bf16-like operand precision with f32
    accumulation; set only while a run computes (:func:`using`)."""

    # --- working sizes ---------------------------------------------------------------------------------------------
    lowrank_max_rank: int = 8
    """Widest rank r the rank-r C loops take (lowrank.c's own limit): from 16 on, oneDNN's and BLAS's blocked kernels
    (and bf16's dot-product instructions) are as fast or faster than one pass over the activation per four columns
    of r."""
    decode_step_values: int = 1 << 22
    """Values dequantization decodes per step: big enough to amortize per-op overhead, small enough that a huge
    tensor never needs several copies of itself; one step fills one f32 chunk of :attr:`dequantize_chunk_bytes`."""
    dequantize_chunk_bytes: int = 16 << 20
    """The dequantized temporary of a quantized product, per chunk of whole rows (bytes in the compute dtype): every
    matrix of a 110M-shape layer and TinyLlama's attention matrices fit whole, and it stays below the 32 MiB from
    which a ggtorch run's glibc maps every block afresh (:mod:`ggtorch.ops.malloc`)."""
    keep_dequantized_bytes: int = 64 << 20
    """Largest decoded matrix a product keeps for its own backward inside a checkpointed block; bigger ones are
    decoded again, chunk by chunk."""
    loss_chunk_bytes: int = 4 << 20
    """f32 logits per chunk of the plain cross-entropy: large enough to amortize per-op overhead, small enough to
    stay in cache between the exp and the write of the gradient."""
    head_chunk_bytes: int = 32 << 20
    """f32 logits per chunk of the loss's whole-row paths (a LoRA on the output; a head of more than one
    projection): about 256 rows of a 32,000-word vocabulary, 32 of a 262,144-word one."""
    slab_rows: int = 1024
    """Rows per chunk of the loss's vocabulary-slab path: enough for the output GEMMs' full speed."""
    slab_bytes: int = 4 << 20
    """f32 logits per chunk of the vocabulary-slab path (rows x slab columns): small enough that the exp and the
    gradient's product read them from cache."""
    eval_head_bytes: int = 64 << 20
    """f32 logits perplexity holds at once: a 262k-word vocabulary's (tokens x V) never exist whole."""
    delta_rule_chunk: int = 64
    """Tokens per chunk of the gated delta rule (``ops/delta_rule.py``): each chunk solves one triangular system of
    this size and advances the state once; llama.cpp's chunked graph takes 64 too."""

    def replace(self, **changes: object) -> Policy:
        """This policy with some choices changed (a test's, or a notebook's experiment)."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def cpu_vendor() -> str:
    """The CPU's vendor string (``GenuineIntel``, ``AuthenticAMD``, ...), or '' when unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()  # Windows names the vendor here; elsewhere an architecture


BF16_TRAIN_SPEEDUP = 1.5
"""How much faster than f32 a CPU must multiply bf16 matrices for ``--dtype auto`` to train in bf16: CPUs with bf16
dot products measure 2x (AVX512-BF16) to 10x (AMX) at the probe's size, those without 0.3x."""

_by_device: dict[str, Policy] = {}


def for_device(device_type: str) -> Policy:
    """The policy ggtorch runs with on a device type (chosen once per process): the C loops and written-out
    attention on CPU, oneDNN's f32 products on CPUs other than Intel's; torch's kernels elsewhere."""
    chosen = _by_device.get(device_type)
    if chosen is None:
        chosen = _by_device[device_type] = choose(device_type)
    return chosen


def choose(device_type: str) -> Policy:
    """The policy for a device type, decided now from what this machine is (:func:`for_device` keeps the first)."""
    if device_type == "cpu":
        fast_bf16 = cpu_matmul_speed_vs_f32(torch.bfloat16) >= BF16_TRAIN_SPEEDUP
        return Policy("cpu", c_dequantize=True, c_lowrank=True, c_fused=True, c_attention=True,
                      onednn_f32="GenuineIntel" not in cpu_vendor(), written_attention_max_tokens=512,
                      fused_adamw=True, in_place_softmax=True, complex_rope=True,
                      train_dtype="bf16" if fast_bf16 else "f32")
    if device_type == "cuda":
        return cuda_policy(torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0))
    if device_type == "mps":
        return Policy("mps", device_rng=True, wide_dtype=torch.float32)
    return Policy(device_type, device_rng=device_type == "xpu")


def cuda_policy(capability: tuple[int, int]) -> Policy:
    """The policy for a CUDA device of this compute capability: torch's kernels, compiled decoders and
    FlexAttention, bf16 and TF32 from Ampere (8.0). Its sizes are the CPU's times 16 to 64: a kernel launch costs
    microseconds whatever its size, so a GPU wants few large chunks (a Llama-3-8B matrix decodes whole, the loss
    crosses a 128k vocabulary in a few slabs), and its memory is tens of GiB, not a cache."""
    ampere = capability >= (8, 0)
    return Policy("cuda", compiled_dequantize=True, flex_attention="compiled", fused_adamw=True,
                  in_place_softmax=True, complex_rope=True, device_rng=True, dist_backend="nccl",
                  auto_dtype="bf16" if ampere else "f32", train_dtype="bf16" if ampere else "f32", tf32=ampere,
                  decode_step_values=1 << 26, dequantize_chunk_bytes=256 << 20, keep_dequantized_bytes=512 << 20,
                  loss_chunk_bytes=256 << 20, head_chunk_bytes=512 << 20, slab_rows=8192, slab_bytes=256 << 20,
                  eval_head_bytes=1 << 30)


RUN_DEVICES = ("cpu", "cuda", "mps")
"""The torch device types a run or a loaded model may be placed on (meta, xla, ...: torch names them, but no
weight of a file lands there)."""


def auto_device() -> str:
    """The device ``--device auto`` trains on: CUDA, else MPS, else the CPU."""
    if torch.cuda.is_available():
        return "cuda"
    if torch.backends.mps.is_available():
        return "mps"
    return "cpu"


def auto_dtype(device: torch.device | str) -> str:
    """What ``--dtype auto`` means on ``device`` (:attr:`Policy.auto_dtype`)."""
    return current(device).auto_dtype


_active: Policy | None = None
"""The policy :func:`using` set, or None. A plain module global, which torch.compile reads (and guards on) as it
traces; one per process, as a process runs one training at a time."""


def current(device: torch.device | str) -> Policy:
    """The policy for operands on ``device``: the one :func:`using` set for its device type, else
    :func:`for_device`'s."""
    device_type = device if isinstance(device, str) else device.type
    active = _active
    return active if active is not None and active.device_type == device_type else for_device(device_type)


@contextlib.contextmanager
def using(policy: Policy) -> Iterator[Policy]:
    """Within, ops on ``policy.device_type`` follow ``policy`` (nested calls restore the outer one)."""
    global _active
    outer, _active = _active, policy
    precision = torch.get_float32_matmul_precision()
    if policy.tf32:
        torch.set_float32_matmul_precision("high")
    try:
        yield policy
    finally:
        _active = outer
        torch.set_float32_matmul_precision(precision)
