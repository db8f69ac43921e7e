"""ggtorch vs transformers+peft: LoRA finetune throughput and memory on identical work.

Not a test. One command builds random-weight models (``tests/llama_models.py`` and
``tests/families.py``: written by gguf-py, quantized by llama.cpp's own quantizer), then for every
case runs one step loop per side, each in its own child process so that peak RSS is per side, the two
processes taking turns a step at a time (:func:`run_sides`) so that both meet the same machine:

- ggtorch: the real training path, :class:`ggtorch.training.trainer.Trainer` (what ``ggtorch finetune``
  runs) on the GGUF, base kept as it is in the file (``--base-dtype quantized``, the default);
- peer: transformers loads the same GGUF (it dequantizes every tensor), peft wraps it.

Like for like: both sides of a row run on the same allocator. Every row runs with both on the
system malloc (what the README's setup gives a user), both with the glibc thresholds a ggtorch run
sets itself (``ggtorch.ops.malloc``; the peer gets them from the environment); when jemalloc is
installed, the 110M and gemma3-270M rows run again with both on jemalloc. Both train LoRA rank 4 (alpha 4) on
q/k/v/o/gate/up/down from the same token stream (ggtorch's data pipeline over the same text, same
seed), with AdamW (lr 1e-3, decay 0.1, clip 1.0) and the same batch, context and threads. Tokens/s
is the median over the timed optimizer steps after each side's warm-up: three steps for the peer,
one for ggtorch (``GGTORCH_WARMUP``).
``f32``/``bf16`` is the compute dtype: ggtorch runs bf16 autocast over its base; the peer runs its
model in bf16 (what a transformers user does), and the ggtorch bf16 rows are also compared with the
peer in f32 (gemma3-270M's bf16 row only with it: ``vs peer f32``).

GFLOP/s counts the useful matmul work of a LoRA step, 4 × (parameters of the base's matrices)
per token (forward plus input gradient; attention, LoRA and recomputation are not counted), and
is set against a GEMM peak measured in the same run: the best over the model's matrix shapes of
torch.mm and of oneDNN (ggtorch.ops.matmul with oneDNN forced), f32 and bf16. For a quantized base,
ggtorch's child times every dequantization of one more step (the share of the step it takes).

The full finetune against llama.cpp's own training comes from the sibling command
``bench/bench_full_finetune.py``, run here too.

Run from the repository root: ``python bench/bench_vs_peft.py [--quick] [--threads N]``.
It prints a table and writes ``BENCHMARKS.md`` (``--out``), keeping the sections the sibling commands wrote
(:data:`KEPT_COMMANDS`) and the last run on each other CPU (:data:`OTHER_CPU`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fixtures import SHAKESPEARE  # noqa: E402
from tests.llama_cpp_files import vocab_file  # noqa: E402

TEXT_BYTES = 200_000
"""Enough text for every case (samples start at every token) while tokenizing in a second."""

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_RANK = 4
LR, DECAY, GCLIP = 1e-3, 0.1, 1.0
ALLOCATORS = ("system", "jemalloc")


@dataclass(frozen=True)
class Shape:
    """A model shape, named: a llama (tests.llama_models) or another family (tests.families)."""

    name: str
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ctx: int = 2048
    arch: str = "llama"
    head_dim: int | None = None
    n_vocab: int = 32000
    tied: bool = False
    softcaps: tuple[float, float] | None = None
    """gemma2's attention and final logit soft-caps (its GGUF keys; transformers' Gemma2Config defaults)."""

    def matrices(self) -> list[tuple[int, int]]:
        """(out, in) of every matrix a token passes through (the output projection, tied or not)."""
        hd = self.head_dim or self.n_embd // self.n_head
        q, kv = self.n_head * hd, self.n_head_kv * hd
        layer = [(q, self.n_embd), (kv, self.n_embd), (kv, self.n_embd), (self.n_embd, q),
                 (self.n_ff, self.n_embd), (self.n_ff, self.n_embd), (self.n_embd, self.n_ff)]
        return layer * self.n_layer + [(self.n_vocab, self.n_embd)]

    def flops_per_token(self) -> float:
        """Forward + input-gradient matmul FLOPs per token (2 per multiply-add, twice)."""
        return 4.0 * sum(o * i for o, i in self.matrices())

    def gflops(self, tokens_per_second: float) -> float:
        """GFLOP/s of a LoRA step's useful work (:meth:`flops_per_token`) at that many tokens/s."""
        return tokens_per_second * self.flops_per_token() / 1e9


SHAPES = {
    "110M": Shape("110M", n_embd=768, n_ff=2048, n_layer=12, n_head=12, n_head_kv=12),
    "1.1B": Shape("1.1B", n_embd=2048, n_ff=5632, n_layer=22, n_head=32, n_head_kv=4),
    # Gemma 3 270M: its 262,144-token vocabulary, tied embedding, 4 heads of 256 over 1 KV head
    "gemma3-270M": Shape("gemma3-270M", n_embd=640, n_ff=2048, n_layer=18, n_head=4, n_head_kv=1,
                         arch="gemma3", head_dim=256, n_vocab=262144, tied=True),
    # Gemma 2's head at those widths: its 256,000-token vocabulary behind the final soft-cap, so the loss takes
    # ggtorch's path for a head of more than one projection (training.loss.head_cross_entropy)
    "gemma2-256k": Shape("gemma2-256k", n_embd=640, n_ff=2048, n_layer=18, n_head=4, n_head_kv=1,
                         arch="gemma2", head_dim=256, n_vocab=256000, tied=True, softcaps=(50.0, 30.0)),
}


@dataclass(frozen=True)
class Case:
    """One row of the table: the same work for both sides, on the same allocator."""

    shape: str
    ftype: str
    dtype: str  # compute: f32 | bf16
    ctx: int
    batch: int
    checkpointing: bool = False
    warmup: int = 1
    """Warm-up steps of the peer; ggtorch's are at most :data:`GGTORCH_WARMUP`."""
    steps: int = 3
    repeat: int = 1
    """Runs per side, alternating ggtorch, peer, ggtorch, ...; the table shows each side's fastest."""
    malloc: str = "system"
    """The allocator both sides run on: ``system`` (the C library's) or ``jemalloc``."""
    keep_mib: int = 0
    """ggtorch's --keep-dequantized-mib (0: the default, each quantized matrix decoded again in backward)."""
    peer_dtype: str = ""
    """The peer's compute dtype when it is not :attr:`dtype` (gemma3-270M's bf16 row runs against the peer in
    f32 of the row before it, whose runs it shares: :attr:`peer_case`)."""
    group: str = ""
    """Rows next to each other with the same group run all their processes together, taking turns (the
    110M f32 and bf16 rows: the bf16 row's ratio to the peer in f32 then compares steps that took turns)."""
    relay: bool = False
    """In a group, this row's ggtorch side starts when the row before has ended its own, and takes turns with
    the group's first row's peer process, which goes on with more steps (:func:`run_relay`): the peer of
    :attr:`peer_case` is measured in the same spells without a third process resident (gemma3-270M's bf16 row),
    or the same peer work is not loaded and warmed up twice (a Q4_K_M row after the Q4_0 row of its shape:
    transformers dequantizes either file at load to an f32 model of the same shapes, so the peer's step is the
    same computation). Run without its group (``--only``), the row measures its own peer."""

    @property
    def peer_case(self) -> Case:
        """The case whose peer runs measure this one: the peer has no --keep-dequantized-mib, so a keep
        row shares the peer of the same row without it instead of measuring the same work again; a row
        with a :attr:`peer_dtype` shares the peer of the row in that dtype. The group a row runs in does not
        change its peer's work."""
        return replace(self, keep_mib=0, dtype=self.peer_dtype or self.dtype, peer_dtype="", relay=False, group="")

    def side_warmup(self, side: str) -> int:
        """Warm-up steps of ``side`` in this case."""
        return min(self.warmup, GGTORCH_WARMUP) if side == "ggtorch" else self.warmup

    @property
    def label(self) -> str:
        ck = " ckpt" if self.checkpointing else ""
        keep = f" keep{self.keep_mib}" if self.keep_mib else ""
        peer = f" vs peer {self.peer_dtype}" if self.peer_dtype else ""
        return f"{self.shape} {self.ftype} {self.dtype} b{self.batch}x{self.ctx}{ck}{keep}{peer}"


GGTORCH_WARMUP = 1
"""ggtorch's warm-up steps: its first step faults its memory in (a Trainer keeps glibc from returning it),
its second already runs at the pace of the later ones, where the peer's third and fourth are still slower."""

KEEP_MIB = 8192
"""--keep-dequantized-mib of the row that shows what keeping decoded matrices buys: room for every one."""


def full_cases(jemalloc: bool) -> list[Case]:
    """The rows of a full run; the 110M and gemma3-270M rows once more on jemalloc when it is installed. Not
    the 1.1B ones, the slowest rows, whose peer at b1×256 allocates no block as big as those glibc always mmaps."""
    # Three warm-up steps of the peer: its second and third steps run 20-40% slower than the later ones;
    # ggtorch only its first (GGTORCH_WARMUP).
    base = Case("110M", "F32", "f32", ctx=256, batch=4, warmup=3, steps=2)
    rows = [
        # the 110M targets' rows: each side's best of two pairs of runs (a single run of the peer moved 13%
        # between two otherwise equal full runs)
        replace(base, repeat=2, group="110M F32"),
        replace(base, dtype="bf16", repeat=2, group="110M F32"),
        # the Q4_K_M rows take turns with the Q4_0 row's peer process (a relay, Case.relay): the same peer work,
        # loaded and warmed up once instead of twice
        replace(base, ftype="Q4_0", repeat=2, group="110M Q4"),
        replace(base, ftype="Q4_K_M", repeat=2, group="110M Q4", relay=True),
        replace(base, checkpointing=True, steps=1),
        # the 1.1B targets' rows: the median of four timed steps (the peer's ~8 s steps vary by 5% alone, more
        # taking turns; with two, two full runs of the same code gave the Q4_0 row 1.32x and 1.55x)
        replace(base, shape="1.1B", ftype="Q4_0", batch=1, steps=4, group="1.1B Q4"),
        replace(base, shape="1.1B", ftype="Q4_K_M", batch=1, steps=4, group="1.1B Q4", relay=True),
        # not a target: what --keep-dequantized-mib buys (one decode per matrix and step) and costs (memory),
        # against the peer runs of the row above (Case.peer_case)
        replace(base, shape="1.1B", ftype="Q4_0", batch=1, steps=4, keep_mib=KEEP_MIB),
        # gemma3-270M: ggtorch in f32 against the peer in f32, then ggtorch in bf16 against the same peer process,
        # which takes more steps in turn with it (a relay: beside the peer's 8 GiB, a third process resident slowed
        # the peer more than ggtorch, memory pressure that flattered ggtorch; alone, the bf16 row met other spells
        # than its peer's and two full runs gave 2.55x and 2.12x)
        replace(base, shape="gemma3-270M", ftype="Q8_0", group="gemma3-270M"),
        replace(base, shape="gemma3-270M", ftype="Q8_0", dtype="bf16", peer_dtype="f32", group="gemma3-270M",
                relay=True),
        # not a target: a soft-capped head over a 256,000-word vocabulary, so that its loss's speed shows
        replace(base, shape="gemma2-256k", ftype="Q8_0"),
    ]
    if jemalloc:  # one run per side, to keep the second pairing short
        rows += [replace(c, malloc="jemalloc", repeat=1) for c in rows
                 if c.shape in ("110M", "gemma3-270M") and not c.checkpointing]
    return rows


def together(cases: list[Case]) -> list[list[Case]]:
    """``cases`` in runs of neighbours that share a :attr:`Case.group` (a case without one runs alone)."""
    runs: list[list[Case]] = []
    for case in cases:
        if runs and case.group and runs[-1][-1].group == case.group:
            runs[-1].append(case)
        else:
            runs.append([case])
    return runs


def quick_cases() -> list[Case]:
    base = Case("110M", "F32", "f32", ctx=64, batch=4, warmup=1, steps=3)
    return [base, replace(base, ftype="Q4_0"), replace(base, dtype="bf16")]


# --- model files ------------------------------------------------------------------------------


def model_file(workdir: Path, shape: Shape, ftype: str) -> Path:
    """The random model of ``shape`` in ``ftype``, built once and cached in ``workdir``."""
    from tests.llama_models import quantize_with_llama_cpp

    folder = workdir / shape.name
    folder.mkdir(parents=True, exist_ok=True)
    f32 = folder / "model-F32.gguf"
    if not f32.exists():
        tmp = folder / "model-F32.gguf.tmp"
        write_f32_model(tmp, shape, workdir)
        tmp.rename(f32)
    if ftype == "F32":
        return f32
    path = folder / f"model-{ftype}.gguf"
    if not path.exists():
        tmp = folder / f"model-{ftype}.gguf.tmp"
        quantize_with_llama_cpp(f32, tmp, ftype)
        tmp.rename(path)
    return path


def write_f32_model(path: Path, shape: Shape, workdir: Path) -> None:
    """A llama by tests.llama_models, any other family by tests.families (Gemma 3's own hyperparameters)."""
    if shape.arch == "llama":
        from tests.llama_models import RandomLlamaShape, write_random_llama

        llama = RandomLlamaShape(n_embd=shape.n_embd, n_ff=shape.n_ff, n_layer=shape.n_layer, n_head=shape.n_head,
                                 n_head_kv=shape.n_head_kv, n_ctx=shape.n_ctx)
        write_random_llama(path, vocab_file("llama-spm"), llama, seed=0)
        return
    from tests import families

    attn_softcap, final_softcap = shape.softcaps or (None, None)
    family = families.Shape(n_embd=shape.n_embd, n_ff=shape.n_ff, n_layer=shape.n_layer, n_head=shape.n_head,
                            n_head_kv=shape.n_head_kv, head_dim=shape.head_dim, n_ctx=shape.n_ctx,
                            tied_output=shape.tied, sliding_window=512, rope_freq_base=1e6,
                            rope_freq_base_swa=10000.0, attn_softcap=attn_softcap, final_softcap=final_softcap)
    families.write_random_model(path, shape.arch, padded_vocab(workdir, shape.n_vocab), family, seed=0)


def padded_vocab(workdir: Path, n_vocab: int) -> Path:
    """The llama SPM vocabulary grown to ``n_vocab`` tokens with unused ones (``<unused_N>``, type
    UNUSED, as Gemma's own vocabulary has thousands): the training text tokenizes as with the llama
    vocabulary, while the embedding and the logits have the real vocabulary's size."""
    import gguf

    path = workdir / f"vocab-{n_vocab}.gguf"
    if path.exists():
        return path
    reader = gguf.GGUFReader(str(vocab_file("llama-spm")))
    tmp = path.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), "llama")
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if isinstance(value, list):
            n_more = n_vocab - len(value)
            value = value + {"tokenizer.ggml.tokens": [f"<unused_{i}>" for i in range(n_more)],
                             "tokenizer.ggml.scores": [0.0] * n_more,
                             "tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * n_more}[key]
        w.add_key_value(key, value, field.types[0], field.types[-1] if len(field.types) > 1 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    tmp.rename(path)
    return path


def training_text(workdir: Path) -> Path:
    """The text both sides train on, the first :data:`TEXT_BYTES` of Shakespeare, written once into ``workdir``."""
    text = workdir / "train.txt"
    if not text.exists():
        text.write_bytes(SHAKESPEARE.read_bytes()[:TEXT_BYTES])
    return text


def read_into_page_cache(path: Path) -> None:
    """Read ``path`` once, so every side starts from a warm page cache. This VM evicts idle file
    pages within minutes, and the side that runs first would otherwise fault a cold file in
    (the 1.1B F32 file: up to a minute more in its warm-up step; in one pass it takes 12-21 s)."""
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


# --- children ---------------------------------------------------------------------------------


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM), in bytes."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def finetune_config(spec: dict[str, Any]) -> Any:
    """The FinetuneConfig both sides take their data (and ggtorch everything) from; its log goes to
    ``spec["log_file"]``, else to a file of this process's own in the temporary folder (never the working folder,
    which another run may share)."""
    from ggtorch.training.config import FinetuneConfig

    log_file = spec.get("log_file") or str(Path(tempfile.gettempdir()) / f"ggtorch-bench-{os.getpid()}-log.jsonl")

    return FinetuneConfig(
        model_base=spec["model"], train_data=spec["text"], checkpoint_in="", checkpoint_out="", lora_out="",
        save_every=0, seed=1, ctx=spec["ctx"], batch=spec["batch"], threads=spec["threads"],
        adam_iter=spec["warmup"] + spec["steps"], use_checkpointing=spec["checkpointing"], dtype=spec["dtype"],
        lora_r=LORA_RANK, lora_alpha=LORA_RANK, rank_tok_embd=0, rank_out=0,
        adam_alpha=LR, adam_decay=DECAY, adam_gclip=GCLIP, warmup=0, keep_dequantized_mib=spec.get("keep_mib", 0),
        log_file=log_file)


def child_ggtorch(spec: dict[str, Any], turns: Turns) -> dict[str, Any]:
    """Trainer.train over the case; per-step seconds from its StepResults."""
    import torch

    from ggtorch.training.trainer import Trainer

    n_steps = spec["warmup"] + spec["steps"]

    class CPUClock:
        """Process CPU time at every step end, then this side's next turn (a callback: Trainer.train runs the
        loop; the mark comes first, so a wait for the turn counts in neither clock)."""

        def __init__(self) -> None:
            self.marks = [time.process_time()]

        def on_step(self, trainer: Any, result: Any) -> None:
            self.marks.append(time.process_time())
            if len(self.marks) <= n_steps:
                turns.pause()
            else:
                turns.end()

    torch.set_num_threads(spec["threads"])
    turns.pause()  # imported: load in turn
    t0 = time.perf_counter()
    clock = CPUClock()
    trainer = Trainer(finetune_config(spec), callbacks=[clock], log_records=False, manage_process=True)
    load = time.perf_counter() - t0
    turns.pause()
    clock.marks = [time.process_time()]
    results = trainer.train()
    cpu = [b - a for a, b in zip(clock.marks, clock.marks[1:], strict=False)]
    out = {"load_s": load, "step_s": [r.seconds for r in results], "cpu_s": cpu, "loss": [r.loss for r in results],
           "warmup": spec["warmup"]}
    if spec["checkpointing"]:
        out["peak_rss"] = peak_rss_bytes()  # of the checkpointed steps, before any step without it
        out["alternating_s"] = alternate(checkpointing_steps(trainer), cold="plain")
    if spec["ftype"] != "F32":
        out["peak_rss"] = peak_rss_bytes()  # of the timed steps, before the timing wrappers
        with timing_dequantization() as seconds:
            step = trainer.step().seconds
        out["dequant"] = {"step_s": step, "dequant_s": sum(seconds)}
    trainer.close()
    return out


@contextmanager
def wrapping_dequantization(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """While the block runs, every dequantization the training path makes (the quantized products, the
    quantized embedding's rows, the fused loss's output matrix) goes through ``wrap(dequantize)``."""
    from ggtorch.quant import autograd, modules

    saved = {m: m.dequantize for m in (autograd, modules)}  # products and rows; whole matrices and loss slabs
    wrapped = wrap(saved[autograd])
    for m in saved:
        m.dequantize = wrapped
    try:
        yield
    finally:
        for m, fn in saved.items():
            m.dequantize = fn


@contextmanager
def timing_dequantization() -> Iterator[list[float]]:
    """Time every dequantization the training path makes while the block runs: the list it yields gets
    each call's seconds. CPU work is synchronous, so wall time around the call is its cost."""
    seconds: list[float] = []

    def timing(dequantize: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            result = dequantize(*args, **kwargs)
            seconds.append(time.perf_counter() - t)
            return result

        return timed

    with wrapping_dequantization(timing):
        yield seconds


def alternate(steps: dict[str, Callable[[], float]], cold: str, rounds: int = 2) -> dict[str, list[float]]:
    """Seconds of each kind of step, the kinds taking turns in this one process, so they are
    compared on the same machine state (the table's rows are minutes apart, and the machine's
    speed drifts). The ``cold`` kind, not yet run in this process, takes one untimed step first."""
    steps[cold]()
    times: dict[str, list[float]] = {kind: [] for kind in steps}
    for _ in range(rounds):
        for kind, step in steps.items():
            times[kind].append(step())
    return times


def checkpointing_steps(trainer: Any) -> dict[str, Callable[[], float]]:
    """A step of ``trainer`` without and with block checkpointing, for :func:`alternate`."""
    from ggtorch.training.trainer import disable_block_checkpointing, enable_block_checkpointing

    def plain() -> float:
        disable_block_checkpointing(trainer.model)
        return trainer.step().seconds

    def checkpointed() -> float:
        disable_block_checkpointing(trainer.model)
        enable_block_checkpointing(trainer.model)
        return trainer.step().seconds

    return {"plain": plain, "checkpointed": checkpointed}


def child_peer(spec: dict[str, Any], turns: Turns) -> dict[str, Any]:
    """transformers (GGUF dequantized on load) + peft, the same batches, a plain AdamW loop."""
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ggtorch.data import DataOptions, TrainingData, read_text_file
    from ggtorch.io.gguf import read_gguf
    from ggtorch.models.tokenizer import Tokenizer

    torch.set_num_threads(spec["threads"])
    config = finetune_config(spec)
    dtype = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
    turns.pause()  # imported: load in turn
    t0 = time.perf_counter()
    path = Path(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    if spec["checkpointing"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, lora_dropout=0.0,
                                             target_modules=LORA_TARGETS))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=DECAY)
    load = time.perf_counter() - t0
    tokenizer = Tokenizer.from_gguf(read_gguf(path))
    data = TrainingData(read_text_file(config.train_data), tokenizer, n_ctx=config.ctx,
                        options=DataOptions.from_finetune(config), seed=config.seed)
    step_s, cpu_s, losses = [], [], []
    for _ in range(spec["warmup"] + spec["steps"]):
        turns.pause()
        batch = data.next_batch(config.batch)
        inputs, targets = batch.inputs, batch.targets
        t, c = time.perf_counter(), time.process_time()
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=inputs).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, GCLIP)
        optimizer.step()
        step_s.append(time.perf_counter() - t)
        cpu_s.append(time.process_time() - c)
        losses.append(float(loss))
    turns.end()
    return {"load_s": load, "step_s": step_s, "cpu_s": cpu_s, "loss": losses, "warmup": spec["warmup"]}


GEMM_MAX_OUT = 32000
"""Output columns at most of a GEMM the peak is measured on: a wider output projection (gemma's 262,144 words)
is measured as a 32,000-column slab, at the rate per FLOP of the whole product (ggtorch's loss runs it in
slabs anyway) in an eighth of the time."""


def child_gemm(spec: dict[str, Any], turns: Turns) -> dict[str, Any]:
    """Best GEMM GFLOP/s over the model's matrix shapes with N = batch*ctx rows, f32 and bf16, of
    torch.mm and of ggtorch.ops.matmul (oneDNN for f32 on CPU, what ggtorch's layers run): the peak
    is the faster of the two, so ggtorch's fraction of it is not flattered by its own kernel."""
    import torch
    from bench_dequant import best_time  # this folder (a child runs as python bench/bench_vs_peft.py)

    from ggtorch.ops import matmul, policy

    torch.set_num_threads(spec["threads"])
    n = spec["rows"]
    out: dict[str, Any] = {}
    kernels = {"torch.mm": torch.mm, "ggtorch.ops.matmul": matmul.mm}
    # the oneDNN column measures oneDNN, whichever ggtorch picks on this CPU; a caller in this process
    # (bench_step_profile.py) trains afterwards as ggtorch routes
    with policy.using(policy.current("cpu").replace(onednn_f32=True)):
        for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
            per_shape: dict[str, float] = {}
            per_kernel = dict.fromkeys(kernels, 0.0)
            for o, i in sorted({(min(o, GEMM_MAX_OUT), i) for o, i in spec["shapes"]}):
                x = torch.randn(n, i, dtype=dtype)
                w = torch.randn(i, o, dtype=dtype)
                flops = 2.0 * n * i * o
                reps = max(2, min(20, int(2e9 / flops)))
                for kernel, fn in kernels.items():
                    gflops = flops / best_time(partial(fn, x, w), reps) / 1e9  # a peak: the fastest repetition
                    per_shape[f"{kernel} {n}x{i}x{o}"] = gflops
                    per_kernel[kernel] = max(per_kernel[kernel], gflops)
            out[name] = max(per_kernel.values())
            out[f"{name}_kernels"] = per_kernel
            out[f"{name}_shapes"] = per_shape
    return out


CHILDREN = {"ggtorch": child_ggtorch, "peer": child_peer, "gemm": child_gemm}


def run_child(kind: str, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run one side in a fresh interpreter; its result JSON, or {"error": ...}."""
    return run_sides({kind: spec}, timeout)[kind]


def child_command(kind: str, spec: dict[str, Any], result_path: Path) -> list[str]:
    """The command line of a child of this script that runs ``kind`` and writes its result JSON."""
    return [sys.executable, str(Path(__file__).resolve()), "--child", kind, "--spec", json.dumps(spec),
            "--result", str(result_path)]


def run_sides(specs: dict[str, dict[str, Any]], timeout: float,
              command: Callable[[str, dict[str, Any], Path], list[str]] = child_command) -> dict[str, dict[str, Any]]:
    """Run each side (a name and its spec, whose ``kind`` is the child's, by default the name) in its own
    fresh interpreter (``command``); each one's result JSON, or {"error": ...}.

    Two or more sides take turns (:func:`turn_order`): the children import their libraries at once (nothing
    timed), each loads while the others wait, then the parent lets one child run one step at a time, so every
    side's timed steps meet the same spells of the machine (whose speed drifts by 10-25% within minutes) instead
    of the minutes a side after side run puts between them. ``timeout``: seconds each side may keep the others
    waiting (its imports and load, its steps, its end)."""
    turns = len(specs) > 1
    children: dict[str, _Child] = {}
    failed: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="ggtorch-bench-") as tmp:
        try:
            for i, (name, spec) in enumerate(specs.items()):
                kind = spec.get("kind", name)
                children[name] = _Child.start(command, kind, {**spec, "turns": turns}, Path(tmp) / str(i), timeout)
            if turns:
                for name, child in children.items():  # imported
                    if not _reports_idle(child):
                        failed.add(name)
                for name, child in children.items():  # one load at a time: untimed, but CPU work
                    if name not in failed and not _takes_turn(child):
                        failed.add(name)
                for name in turn_order({n: s["warmup"] + s["steps"] for n, s in specs.items()}):
                    if name not in failed and not _takes_turn(children[name]):
                        failed.add(name)
            # released one at a time, the last started first: a peer ends at once, while a ggtorch child has its
            # extra steps to time (dequantization, checkpointing), which must run alone too
            results = {name: children[name].result() for name in reversed(children)}
            return {name: results[name] for name in children}
        finally:
            for child in children.values():
                child.kill()


def run_relay(legs: dict[str, dict[str, Any]], peer: tuple[str, dict[str, Any]], timeout: float,
              command: Callable[[str, dict[str, Any], Path], list[str]] = child_command) -> dict[str, dict[str, Any]]:
    """Each leg's side (a name and its spec, run one after the other) takes turns with one peer process that
    runs through all of them: the peer and the first leg import their libraries at once, the peer loads, then
    the leg; each later leg's child imports and loads while the peer waits. Each leg takes turns with the peer
    step by step (:func:`turn_order`, the peer's warm-up in the first leg only) and then ends alone, the next
    starting after it, so only two processes are resident at a time. The peer's child runs its
    warm-up and every leg's timed steps (``steps`` of its spec is ignored); its result is given to each leg
    as the peer's run: its warm-up and that leg's timed steps. Returns every leg's result and the peer's, by
    name (the peer's split per leg under ``"<peer name> <leg name>"``)."""
    peer_name, peer_spec = peer
    peer_steps = {name: spec["steps"] for name, spec in legs.items()}
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="ggtorch-bench-") as tmp:
        spec = {**peer_spec, "steps": sum(peer_steps.values()), "turns": True}
        child = _Child.start(command, peer_spec.get("kind", peer_name), spec, Path(tmp) / "peer", timeout)
        try:
            for i, (name, leg_spec) in enumerate(legs.items()):
                leg = _Child.start(command, leg_spec.get("kind", name), {**leg_spec, "turns": True},
                                   Path(tmp) / str(i), timeout)
                try:
                    leg_ok = _reports_idle(leg)  # imported
                    if i == 0:
                        peer_ok = _reports_idle(child) and _takes_turn(child)  # imported, then loaded
                    leg_ok = leg_ok and _takes_turn(leg)
                    peer_turns = (peer_spec["warmup"] if i == 0 else 0) + peer_steps[name]
                    for side in turn_order({name: leg_spec["warmup"] + leg_spec["steps"], peer_name: peer_turns}):
                        if side == name and leg_ok:
                            leg_ok = _takes_turn(leg)
                        elif side != name and peer_ok:
                            peer_ok = _takes_turn(child)
                    results[name] = leg.result()  # its extra steps alone, the peer waiting
                finally:
                    leg.kill()
            peer_result = child.result()
        finally:
            child.kill()
    results[peer_name] = peer_result
    warmup = peer_spec["warmup"]
    start = warmup
    for name, n in peer_steps.items():
        part = dict(peer_result)
        for key in ("step_s", "cpu_s", "loss"):
            if key in peer_result:
                part[key] = peer_result[key][:warmup] + peer_result[key][start:start + n]
        results[f"{peer_name} {name}"] = part
        start += n
    return results


def turn_order(steps: dict[str, int]) -> list[str]:
    """Which side runs each step when the sides take turns: the steps a side has beyond the fewest (its
    longer warm-up) first, then one step of each side in turn, so that the sides' last steps, the timed
    ones, alternate."""
    fewest = min(steps.values())
    extra = [side for side, n in steps.items() for _ in range(n - fewest)]
    return extra + [side for _ in range(fewest) for side in steps]


@dataclass
class _Child:
    """A side's child process: the protocol on its stdin/stdout (:class:`Turns`), its stderr in a file."""

    proc: subprocess.Popen[str]
    result_path: Path
    errors_path: Path
    t0: float
    timeout: float
    """Seconds the parent waits for this child in all."""
    waited: float = 0.0
    killed: bool = False

    @classmethod
    def start(cls, command: Callable[[str, dict[str, Any], Path], list[str]], kind: str, spec: dict[str, Any],
              tmp: Path, timeout: float) -> _Child:
        tmp.mkdir()
        result_path, errors_path = tmp / "result.json", tmp / "stderr.txt"
        env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]), MKL_NUM_THREADS=str(spec["threads"]),
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
                   TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
        env = malloc_env(env, spec.get("malloc", "system"))
        with errors_path.open("w") as errors:
            proc = subprocess.Popen(command(kind, spec, result_path), env=env, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=errors, text=True)
        return cls(proc, result_path, errors_path, time.perf_counter(), timeout)

    def send(self, line: str) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it has exited: its next line is end of file, and result() says why

    def read_line(self) -> str | None:
        """The child's next protocol line ('' at its end), or None when its time runs out first."""
        assert self.proc.stdout is not None
        t = time.monotonic()
        ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, self.timeout - self.waited))
        line = self.proc.stdout.readline() if ready else None
        self.waited += time.monotonic() - t
        return line

    def result(self) -> dict[str, Any]:
        """Let the child go on alone (its stdin closes), wait for it, and read what it wrote."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass  # it has exited already
        try:
            code = self.proc.wait(timeout=max(0.0, self.timeout - self.waited))
        except subprocess.TimeoutExpired:
            self.kill()
        if self.killed:
            return {"error": f"timed out after {self.timeout:.0f} s"}
        if code != 0 or not self.result_path.exists():
            tail = self.errors_path.read_text(errors="replace").strip().splitlines()[-3:]
            return {"error": f"exit {code}: {' | '.join(tail)}"}
        result = json.loads(self.result_path.read_text())
        result["wall_s"] = time.perf_counter() - self.t0
        return result

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
            self.killed = True


def _takes_turn(child: _Child) -> bool:
    """Let ``child`` run its next part (a load or a step) and wait until it is idle again (:func:`_reports_idle`)."""
    child.send("go")
    return _reports_idle(child)


def _reports_idle(child: _Child) -> bool:
    """Wait until ``child`` reports it is idle; False when it exits or its time runs out first (its turns are
    then skipped, the others go on, and its result says why), stopping a child that overran."""
    line = child.read_line()
    if line is None:
        child.kill()
    return line is not None and line.strip() == "idle"


class Turns:
    """A child's half of taking turns (:func:`run_sides`): it reports ``idle`` when it has imported its
    libraries, when it has loaded and after each step, and waits for ``go`` before the next. The protocol has
    the process's stdout to itself (a duplicate of it); file descriptor 1, which libraries print to, then points
    at stderr. Does nothing for a child that runs alone."""

    def __init__(self, on: bool) -> None:
        self.out = None
        if on:
            self.out = os.fdopen(os.dup(1), "w")
            os.dup2(2, 1)

    def pause(self) -> None:
        """Report idle, then wait for this side's turn."""
        if self.out is not None:
            self._idle()
            if sys.stdin.readline().strip() != "go":
                raise SystemExit("the benchmark stopped taking turns")

    def end(self) -> None:
        """Report idle for good (this side's steps in turn are done), then wait until the parent lets this
        child go on alone (it closes stdin): the others' last steps are not to share the machine with
        whatever this one does next."""
        if self.out is not None:
            self._idle()
            sys.stdin.read()

    def _idle(self) -> None:
        assert self.out is not None
        self.out.write("idle\n")
        self.out.flush()


def malloc_env(env: dict[str, str], malloc: str) -> dict[str, str]:
    """``env`` for a child on ``malloc``: jemalloc preloaded as ``ggtorch finetune`` would relaunch
    itself, or the system malloc (jemalloc taken out of LD_PRELOAD, the CLI's relaunch turned off)
    with the thresholds a ggtorch run sets itself (``ggtorch.ops.malloc``) given to both sides, so
    that the peer runs on the same glibc settings; a user's own ``MALLOC_*_`` values win on both."""
    from ggtorch.cli import allocator
    from ggtorch.ops import malloc as glibc

    preload = ":".join(p for p in env.get("LD_PRELOAD", "").split(":") if p and "libjemalloc" not in p)
    clean = {k: v for k, v in env.items() if k not in ("LD_PRELOAD", allocator.RELAUNCHED, allocator.ENV)}
    if preload:
        clean["LD_PRELOAD"] = preload
    if malloc == "system":
        if glibc.user_tuned(clean):
            return clean
        return {**clean, "MALLOC_MMAP_THRESHOLD_": str(glibc.MMAP_THRESHOLD),
                "MALLOC_TRIM_THRESHOLD_": str(glibc.TRIM_THRESHOLD)}
    return allocator.relaunch_env(clean, allocator.find_jemalloc()) or clean


def child_main(kind: str, spec_json: str, result_path: str) -> None:
    spec = json.loads(spec_json)
    turns = Turns(spec.get("turns", False))  # first: nothing printed may reach the protocol

    from ggtorch.ops import malloc

    result = CHILDREN[kind](spec, turns)
    result.setdefault("peak_rss", peak_rss_bytes())  # a child may report the peak of its timed part
    result["malloc"] = malloc.current()
    Path(result_path).write_text(json.dumps(result))


# --- the parent -------------------------------------------------------------------------------


def best_run(runs: list[dict[str, Any]], case: Case) -> dict[str, Any]:
    """The fastest of a side's runs ({} if it ran none; an error only if every run failed)."""
    ok = [r for r in runs if "error" not in r and tokens_per_second(r, case)]
    if ok:
        return max(ok, key=lambda r: tokens_per_second(r, case) or 0.0)
    return runs[-1] if runs else {}


def tokens_per_second(result: dict[str, Any], case: Case, key: str = "step_s") -> float | None:
    """Median over the steps after the side's warm-up, as its child reports it, else the case's
    (tokens per optimizer step = batch*ctx).

    ``key="cpu_s"``: tokens per second of process CPU time, which other processes on a busy
    machine disturb much less than wall time (the ratio of the sides stays meaningful)."""
    steps = result.get(key) or []
    timed = steps[result.get("warmup", case.warmup):] or steps
    if not timed:
        return None
    return case.batch * case.ctx / statistics.median(timed)


def machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {f}" in text)
    except OSError:
        pass
    try:
        mem = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        mem = 0
    import peft
    import transformers

    return {"cpu": cpu, "cores": os.cpu_count(), "flags": flags, "memory_gib": mem / 2**30,
            "torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
            "python": platform.python_version(), "load": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def cpu_line(info: dict[str, Any]) -> str:
    """The machine as the report's ``- CPU:`` line names it: model, cores, the vector features that matter, RAM."""
    return f"{info['cpu']}, {info['cores']} cores ({info['flags']}), {info['memory_gib']:.0f} GiB RAM"


def gib(n: float | None) -> str:
    return "—" if n is None else f"{n / 2**30:.2f}"


def fmt(x: float | None, spec: str = ".0f") -> str:
    return "—" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="three small cases (ctx 64), under 2 minutes")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads per side")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "ggtorch-bench-vs-peft",
                    help="where the model files are built and cached")
    ap.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md", help="the report to (re)write")
    ap.add_argument("--only", default="",
                    help="run only cases whose label contains this text (a comma list: any of them)")
    ap.add_argument("--sides", default="ggtorch,peer", help="comma list of ggtorch,peer")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per child before giving up")
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child_main(args.child, args.spec, args.result)
        return

    # SIGTERM unwinds like Ctrl-C, so subprocess.run kills the running child instead of orphaning it
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = time.perf_counter()
    from ggtorch.cli.allocator import find_jemalloc

    jemalloc = find_jemalloc()
    cases = quick_cases() if args.quick else full_cases(jemalloc is not None)
    if args.only:
        wanted = [w for w in args.only.split(",") if w]
        cases = [c for c in cases if any(w in c.label for w in wanted)]
    sides = [s for s in args.sides.split(",") if s]
    args.workdir.mkdir(parents=True, exist_ok=True)
    text = training_text(args.workdir)
    info = machine()
    info["jemalloc"] = jemalloc
    print(f"{info['cpu']}, {info['cores']} cores, torch {info['torch']}, {args.threads} threads, "
          f"jemalloc {jemalloc or 'not installed'}", flush=True)

    gemm: dict[tuple[str, int], dict[str, Any]] = {}
    peer_runs: dict[Case, list[dict[str, Any]]] = {}  # by Case.peer_case: a keep row shares its twin's peer
    rows = []
    building = 0.0
    for group in together(cases):
        t = time.perf_counter()
        built = 0.0
        pending: list[_Pending] = []
        for case in group:
            shape = SHAPES[case.shape]
            t_build = time.perf_counter()
            try:
                path = model_file(args.workdir, shape, case.ftype)
            except Exception as e:  # a disk or llama.cpp failure costs this case, not the whole run
                print(f"{case.label}: cannot build the model file: {e}", flush=True)
                err = {"error": f"model file: {e}"}
                rows.append({"case": case, "gemm": {}, **{side: err for side in sides},
                             **{f"{side}_tps": None for side in sides}})
                continue
            took = time.perf_counter() - t_build
            built += took
            if took > 1:
                print(f"  built {path.name} for {shape.name} in {took:.0f} s", flush=True)
            n_rows = case.batch * case.ctx
            if (case.shape, n_rows) not in gemm:
                gemm[(case.shape, n_rows)] = run_child("gemm", {"threads": args.threads, "rows": n_rows,
                                                                "shapes": sorted(set(shape.matrices()))}, args.timeout)
            spec = {"model": str(path), "text": str(text), "threads": args.threads, **asdict(case)}
            read_into_page_cache(path)
            pending.append(plan(case, spec, {"case": case, "gemm": gemm[(case.shape, n_rows)]}, sides, peer_runs))
        building += built
        relay = len(pending) > 1 and all(p.case.relay for p in pending[1:]) and "ggtorch" in sides
        for _ in range(max((p.case.repeat for p in pending), default=0)):
            if relay:  # the rows' ggtorch sides one after the other, each in turn with the first row's peer
                relayed = relay_group(pending, sides, args.timeout)
                for p in pending:
                    for side in sides:
                        p.runs[side].append(relayed[p.side_name(side)])
                continue
            # every measured side of the group in its own process, all taking turns step by step (run_sides), so
            # a slow spell of the machine hits them alike
            results = run_sides({p.side_name(side): p.side_spec(side) for p in pending for side in p.measured},
                                args.timeout)
            for p in pending:
                for side in p.measured:
                    p.runs[side].append(results[p.side_name(side)])
        for p in pending:
            case, row, runs = p.case, p.row, p.runs
            if "peer" in p.measured and not (relay and case.relay):
                peer_runs[case.peer_case] = runs["peer"]
            row["wall_s"] = time.perf_counter() - t - built
            row["together"] = len(pending)
            for side in sides:
                row[side] = best_run(runs[side], case)
                row[f"{side}_tps"] = tokens_per_second(row[side], case) if row[side] else None
                row[f"{side}_cpu_tps"] = tokens_per_second(row[side], case, "cpu_s") if row[side] else None
                row[f"{side}_all_tps"] = [tokens_per_second(r, case) for r in runs[side]]
            rows.append(row)
            print_row(row, sides)
    for (shape_name, n_rows), peak in gemm.items():  # once more at the end: one slow spell can't set the peak
        if args.quick:
            continue
        again = run_child("gemm", {"threads": args.threads, "rows": n_rows,
                                   "shapes": sorted(set(SHAPES[shape_name].matrices()))}, args.timeout)
        keep_faster(peak, again)
    full = None if args.quick or args.only else full_finetune(args.threads, args.timeout)
    total = time.perf_counter() - t_start - building
    print(f"total {total:.0f} s (and {building:.0f} s building model files)", flush=True)
    previous = args.out.read_text(encoding="utf-8") if args.out.exists() else ""
    args.out.write_text(report(rows, sides, info, args, total, full) + kept_sections(previous)
                        + other_cpu_runs(previous, cpu_line(info)))
    print(f"wrote {args.out}", flush=True)


@dataclass
class _Pending:
    """A row being measured: its case, the spec its children get, the row the report reads, and each side's
    runs so far (the peer's taken from its twin when it is not measured again)."""

    case: Case
    spec: dict[str, Any]
    row: dict[str, Any]
    measured: list[str]
    """The sides this row runs children for."""
    runs: dict[str, list[dict[str, Any]]]

    def side_name(self, side: str) -> str:
        """The side's name among all the children of its group (run_sides)."""
        return f"{side} {self.case.label}"

    def side_spec(self, side: str) -> dict[str, Any]:
        """What the side's child gets: the case (for the peer, its :attr:`Case.peer_case`), its kind and warm-up."""
        case = self.case.peer_case if side == "peer" else self.case
        return {**self.spec, **asdict(case), "kind": side, "warmup": case.side_warmup(side)}


def relay_group(pending: list[_Pending], sides: list[str], timeout: float) -> dict[str, dict[str, Any]]:
    """One run of a relay group (:attr:`Case.relay`): every row's ggtorch side in order against the first row's
    peer (:func:`run_relay`), or the ggtorch sides alone one after the other without a peer side. Each row's
    results by :meth:`_Pending.side_name`, the peer's being its share of the peer's steps."""
    legs = {p.side_name("ggtorch"): p.side_spec("ggtorch") for p in pending}
    if "peer" not in sides:
        return {name: run_sides({name: spec}, timeout)[name] for name, spec in legs.items()}
    first = pending[0]
    results = run_relay(legs, (first.side_name("peer"), first.side_spec("peer")), timeout)
    peer = first.side_name("peer")
    return {**{name: results[name] for name in legs},
            **{p.side_name("peer"): results[f"{peer} {p.side_name('ggtorch')}"] for p in pending}}


def plan(case: Case, spec: dict[str, Any], row: dict[str, Any], sides: list[str],
         peer_runs: dict[Case, list[dict[str, Any]]]) -> _Pending:
    """``case`` ready to run. Its peer is not measured again when an earlier group measured its
    :attr:`Case.peer_case` (``peer_runs``): it gets those runs."""
    shared = "peer" in sides and case.peer_case in peer_runs
    measured = [side for side in sides if not (side == "peer" and shared)]
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in sides}
    if shared:
        runs["peer"] = list(peer_runs[case.peer_case])
    return _Pending(case, spec, row, measured, runs)


KEPT_COMMANDS = ("bench/bench_moe.py", "bench/bench_step_profile.py", "bench/bench_distributed.py",
                 "bench/bench_hybrid.py", "bench/bench_dpo.py", "bench/bench_scale.py")
"""Benchmarks whose sections of BENCHMARKS.md another command writes: a rerun of this one keeps them."""


def sections(report: str) -> list[str]:
    """``report`` cut before each ``## `` heading (the text before the first one included)."""
    return re.split(r"(?m)^(?=## )", report)


def replace_section(report: str, heading: str, new: str) -> str:
    """``report`` with its ``## `` section whose heading starts with ``heading`` replaced by ``new`` (added at
    the end if absent)."""
    kept = [s for s in sections(report) if not s.startswith(heading)]
    return "".join(kept).rstrip() + "\n\n" + new.rstrip() + "\n"


def write_section(path: Path, heading: str, new: str) -> None:
    """Rewrite the report at ``path`` (or start it) with ``new`` in place of its section under ``heading``: how the
    sibling commands of :data:`KEPT_COMMANDS` write their own sections."""
    path.write_text(replace_section(path.read_text(encoding="utf-8") if path.exists() else "", heading, new))
    print(f"wrote its section of {path}", flush=True)


def joined(parts: list[str]) -> str:
    """``## `` sections as the report appends them: each after a blank line, ending in one newline."""
    return "".join("\n" + s.rstrip() + "\n" for s in parts)


def sibling_section(section: str) -> bool:
    """Whether a ``## `` section's heading names one of :data:`KEPT_COMMANDS`."""
    return section.startswith("## ") and any(c in section.splitlines()[0] for c in KEPT_COMMANDS)


def kept_sections(previous: str) -> str:
    """The ``## `` sections of the previous report that a sibling command wrote (:func:`sibling_section`)."""
    return joined([s for s in sections(previous) if sibling_section(s)])


OTHER_CPU = "## The last run on another CPU: "
"""The heading of a previous report kept because it ran on another CPU than this run: the machines a newcomer
gets are not all alike (AMD's Zen 4, Intel's Cascade Lake), so the report keeps the last run of each CPU."""


def report_cpu(text: str) -> str | None:
    """The ``- CPU:`` line's value of a report or archived run (its first one), or None."""
    found = re.search(r"(?m)^- CPU: (.+)$", text)
    return found.group(1).strip() if found else None


def other_cpu_runs(previous: str, cpu: str) -> str:
    """The previous report's runs on CPUs other than ``cpu``: its own main part when it ran on another CPU (its
    headings one level down, under an :data:`OTHER_CPU` heading), and the archived runs it kept, one per CPU."""
    parts = sections(previous)
    archived = [s for s in parts if s.startswith(OTHER_CPU)]
    main = [s for s in parts[1:] if not s.startswith(OTHER_CPU) and not sibling_section(s)]
    runs = [s for s in archived if report_cpu(s) != cpu]
    previous_cpu = report_cpu("".join(main))
    if previous_cpu and previous_cpu != cpu:
        runs = [s for s in runs if report_cpu(s) != previous_cpu]
        preamble = "\n".join(ln for ln in parts[0].splitlines() if not ln.startswith("# ")).strip()
        body = re.sub(r"(?m)^## ", "### ", "".join(main)).rstrip()
        runs.insert(0, f"{OTHER_CPU}{previous_cpu.split(',')[0]}\n\n{preamble}\n\n{body}\n")
    return joined(runs)


def keep_faster(peak: dict[str, Any], again: dict[str, Any]) -> None:
    """Merge a second GEMM measurement into ``peak`` (in place, so the rows holding it see it):
    the higher GFLOP/s of each dtype, kernel and shape."""
    for key, value in again.items():
        if isinstance(value, dict):
            merged = peak.setdefault(key, {})
            for name, gflops in value.items():
                merged[name] = max(merged.get(name, 0.0), gflops)
        elif isinstance(value, int | float):
            peak[key] = max(peak.get(key, 0.0), value)


def ggtorch_gflops(row: dict[str, Any]) -> float | None:
    tps = row.get("ggtorch_tps")
    return None if tps is None else SHAPES[row["case"].shape].gflops(tps)


def peak(row: dict[str, Any]) -> float | None:
    """The faster kernel's GEMM peak (torch.mm or oneDNN) for the row's compute dtype, GFLOP/s."""
    return row["gemm"].get(row["case"].dtype)


def share_of_peak(row: dict[str, Any]) -> float | None:
    gf, best = ggtorch_gflops(row), peak(row)
    return gf / best if gf and best else None


def needed_share_of_peak(row: dict[str, Any], times: float, peer: dict[str, Any] | None = None) -> float | None:
    """The share of the row's GEMM peak ggtorch's useful work would run at to be ``times`` the peer's tok/s (the
    peer of row ``peer`` when given: the bf16 row's target is against the peer in f32)."""
    tps, best = (peer or row).get("peer_tps"), peak(row)
    return times * SHAPES[row["case"].shape].gflops(tps) / best if tps and best else None


def dequant_share(row: dict[str, Any]) -> float | None:
    """The share of one ggtorch step its dequantizations took (None for a float base)."""
    d = row.get("ggtorch", {}).get("dequant")
    return d["dequant_s"] / d["step_s"] if d and d.get("step_s") else None


def print_row(row: dict[str, Any], sides: list[str]) -> None:
    case = row["case"]
    parts = [f"{case.label:30s} {case.malloc:8s}"]
    for side in sides:
        r = row[side]
        if not r:
            continue
        if "error" in r:
            parts.append(f"{side}: ERROR {r['error']}")
            continue
        parts.append(f"{side} {fmt(row[f'{side}_tps']):>6s} tok/s rss {gib(r.get('peak_rss'))} GiB "
                     f"load {fmt(r.get('load_s'), '.1f')} s process {fmt(r.get('wall_s'))} s")
    if case.repeat > 1:
        parts.append("runs " + "; ".join(f"{side} " + "/".join(fmt(t) for t in row[f"{side}_all_tps"])
                                         for side in sides if row[f"{side}_all_tps"]))
    if ratio(row):
        parts.append(f"ratio {ratio(row):.2f}x")
    if row.get("ggtorch_cpu_tps") and row.get("peer_cpu_tps"):
        parts.append(f"(by CPU time {row['ggtorch_cpu_tps'] / row['peer_cpu_tps']:.2f}x)")
    share = share_of_peak(row)
    if share:
        parts.append(f"{ggtorch_gflops(row):.0f} GFLOP/s = {share:.0%} of {peak(row):.0f} {case.dtype} GEMM")
    if dequant_share(row) is not None:
        parts.append(f"dequantization {dequant_share(row):.0%} of a step")
    if row.get("wall_s"):  # where the full run's 15 minutes go
        n = row.get("together", 1)
        parts.append(f"[{n} rows together {row['wall_s']:.0f} s]" if n > 1 else f"[row {row['wall_s']:.0f} s]")
    print("  ".join(parts), flush=True)


def full_finetune(threads: int, timeout: float) -> dict[str, Any]:
    """bench/bench_full_finetune.py's figures, run here (seconds): ggtorch's and llama.cpp's tokens/s."""
    print("full finetune vs llama.cpp (bench/bench_full_finetune.py) ...", flush=True)
    cmd = [sys.executable, str(ROOT / "bench" / "bench_full_finetune.py"), "--threads", str(threads)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (subprocess.SubprocessError, OSError) as e:
        return {"error": str(e)}
    full = parse_full_finetune(proc.stdout)
    if proc.returncode != 0 or full is None:
        return {"error": f"exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-300:]}"}
    print(proc.stdout, flush=True)
    return full


def parse_full_finetune(stdout: str) -> dict[str, Any] | None:
    """bench_full_finetune.py's output as the report's figures: each side's tokens/s (its fastest round),
    every round's, and the first line (what was run); None when a side's figure is missing."""
    found = {side: re.search(rf"^{re.escape(side)}\s+(\d+) tokens/s$", stdout, re.M)
             for side in ("ggtorch", "llama.cpp")}
    if not all(found.values()):
        return None
    rounds: dict[str, list[float]] = {side: [] for side in found}
    for side, tok_s in re.findall(r"^round \d+ (ggtorch|llama\.cpp): (\d+) tokens/s", stdout, re.M):
        rounds[side].append(float(tok_s))
    return {"what": stdout.splitlines()[0], "rounds": rounds,
            **{side: float(m.group(1)) for side, m in found.items() if m}}


def report(rows: list[dict[str, Any]], sides: list[str], info: dict[str, Any], args: argparse.Namespace,
           total: float, full: dict[str, Any] | None = None) -> str:
    """BENCHMARKS.md: machine, method, headline, table, targets with margins, full finetune, GEMM peaks."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    cmd = ("python bench/bench_vs_peft.py" + (" --quick" if args.quick else "") + f" --threads {args.threads}"
           + (f' --only "{args.only}"' if args.only else "")
           + (f" --sides {args.sides}" if args.sides != "ggtorch,peer" else ""))
    jemalloc = info.get("jemalloc")
    lines = [
        "# Benchmarks: ggtorch vs transformers + peft",
        "",
        f"Generated by `{cmd}` on {now} in {total / 60:.1f} min (not counting the model files' first build); "
        "do not edit by hand, re-run the command.",
        "",
        "## Machine",
        "",
        f"- CPU: {cpu_line(info)}",
        f"- torch {info['torch']}, transformers {info['transformers']}, peft {info['peft']}, "
        f"Python {info['python']}; {args.threads} torch threads per side",
        "- allocators: every row runs with both sides on the system malloc (glibc), what the README's setup gives, "
        "both with the thresholds a ggtorch run sets itself (`MALLOC_MMAP_THRESHOLD_` 32 MiB, "
        "`MALLOC_TRIM_THRESHOLD_` never: `ggtorch/ops/malloc.py`), which the peer gets from the environment; "
        + (f"jemalloc is installed ({jemalloc}): the 110M and gemma3-270M rows run again with both sides on it"
           if jemalloc else "jemalloc is not installed on this machine, so there is no jemalloc / jemalloc pairing "
           "(`ggtorch finetune` relaunches itself on jemalloc when it is installed, `apt install libjemalloc2`)"),
        f"- load average when the run started: {fmt(info['load'], '.2f')} "
        "(other processes on the machine make every number lower and noisier)",
        "",
        "## Method",
        "",
        "Random-weight models written by gguf-py and quantized by llama.cpp (`tests/llama_models.py`, "
        "`tests/families.py`). 110M: a llama, n_embd 768, n_ff 2048, 12 layers, 12 heads, 32,000-token vocabulary, "
        "untied output; 1.1B: TinyLlama's shape (n_embd 2048, n_ff 5632, 22 layers, 32 heads, 4 KV heads); "
        "gemma3-270M: a Gemma 3 of 270M's shape (n_embd 640, n_ff 2048, 18 layers, 4 heads of 256 over 1 KV head, "
        "sliding window 512 on five layers of six) with a 262,144-token vocabulary (the llama vocabulary grown with "
        "unused tokens) whose Q8_0 embedding is the output projection; gemma2-256k: a Gemma 2 at the same widths "
        "(sliding window 512 on every other layer) with Gemma 2's 256,000-token vocabulary and soft-caps (attention "
        "50, final 30, transformers' Gemma2Config defaults, which its GGUF loader keeps): a head of more than one "
        "projection, whose loss ggtorch takes a chunk of tokens at a time (`training.loss.head_cross_entropy`).",
        "Both sides train LoRA rank 4 (alpha 4) on q/k/v/o/gate/up/down with AdamW (lr 1e-3, weight decay 0.1, "
        "gradient clipping 1.0) on the same token stream, each side in its own process, both on the row's allocator. "
        "The two processes take turns: they import their libraries at once, each loads while the other waits, then "
        "they run one step at a time, the peer's "
        "extra warm-up steps first and then one step of each side in turn, so both sides' timed steps meet the same "
        "spells of the machine, whose speed drifts by 10-25% within minutes. The 110M f32 and bf16 rows run their four "
        "processes together, taking turns the same way, so that the bf16 row's ratio to the peer in f32 compares steps "
        "that took turns too. The gemma3-270M rows are a relay: the peer in f32 loads once and takes turns first with "
        "ggtorch in f32, then, when that process has ended, with ggtorch in bf16, for as many more timed steps (each "
        "row's peer figure is from the peer's steps in its own turns), so only two processes are resident at a time: "
        "beside the peer's 8 GiB a third one slowed the peer more than ggtorch (memory pressure). Each Q4_K_M row is a "
        "relay after the Q4_0 row of its shape, against the Q4_0 row's peer process: transformers dequantizes either "
        "file at load to an f32 model of the same shapes, so the peer's step is the same work, loaded and warmed up "
        "once (the peer's load time and RSS in the Q4_K_M rows are those of the Q4_0 file). ggtorch runs its "
        "`Trainer` "
        "(what `ggtorch finetune` runs) with the base kept as stored in the GGUF (with bf16 compute, float matrices "
        "are held in bf16, as autocast would round them in every step); the peer loads the GGUF with transformers "
        "(dequantized on load) and wraps it with peft. Compute bf16 means bf16 autocast for ggtorch and a bf16 model "
        "for the peer. tok/s: median over the timed steps after each side's warm-up: three steps for the peer, whose "
        "second and third steps run 20-40% slower than its later ones, one for ggtorch, whose second step already runs "
        "at its later pace; on the system malloc, the 110M rows without checkpointing run the pair of processes twice "
        "and show each side's faster run (all runs are listed below the table), on jemalloc once. By CPU time: the "
        "same ratio from each side's process CPU time per step. RSS: peak resident set of the side's process (VmHWM). "
        "Load: model + LoRA setup. Before each row the model file is read once, so both sides start from a warm page "
        "cache. GFLOP/s counts 4 × base matrix parameters per token (forward + input gradient) against the best GEMM "
        "GFLOP/s over the model's matrix shapes (rows = batch × ctx; a vocabulary wider than 32,000 words as a "
        "32,000-column slab) of torch.mm and oneDNN (`ggtorch.ops.matmul` with oneDNN forced), measured in the same "
        "run (twice per shape, before its first row and after the last row; the higher counts). Dequantization: every "
        "dequantization of one more ggtorch step, timed call by call, over that step's time. Cases ending in ckpt run "
        "both sides with gradient checkpointing; in keepN, ggtorch runs with `--keep-dequantized-mib N` (a forward "
        "keeps up to N MiB of decoded matrices for its backward) against the "
        "peer runs of the same row without it (the peer has no such option).",
        "",
    ]
    lines += ["## Headline", ""] + [f"- {h}" for h in headline(rows)] + [""]
    lines += [
        "## Results",
        "",
        "| case | malloc (both sides) | ggtorch tok/s | peer tok/s | ggtorch / peer | by CPU time | ggtorch GFLOP/s "
        "| % of GEMM peak | dequantization % of step | ggtorch RSS GiB | peer RSS GiB | RSS ratio | ggtorch load s "
        "| peer load s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        case = row["case"]
        g, p = row.get("ggtorch", {}), row.get("peer", {})
        gt, pt = row.get("ggtorch_tps"), row.get("peer_tps")
        share, dq, r, rss = share_of_peak(row), dequant_share(row), ratio(row), rss_ratio(row)
        cells = [case.label, case.malloc, fmt(gt) if "error" not in g else "error",
                 fmt(pt) if "error" not in p else "error", f"{r:.2f}×" if r else "—",
                 f"{row['ggtorch_cpu_tps'] / row['peer_cpu_tps']:.2f}×"
                 if row.get("ggtorch_cpu_tps") and row.get("peer_cpu_tps") else "—", fmt(ggtorch_gflops(row)),
                 f"{share:.0%} of {peak(row):.0f}" if share else "—", f"{dq:.0%}" if dq is not None else "—",
                 gib(g.get("peak_rss")), gib(p.get("peak_rss")), f"{rss:.0%}" if rss else "—",
                 fmt(g.get("load_s"), ".1f"), fmt(p.get("load_s"), ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    repeated = [row for row in rows if row["case"].repeat > 1]
    if repeated:
        lines += ["", "Every run of the repeated rows (tok/s, in the order run):", ""]
        lines += [f"- {row['case'].label} ({row['case'].malloc}): " + "; ".join(
            f"{side} " + ", ".join(fmt(t) for t in row[f"{side}_all_tps"]) for side in sides
            if row.get(f"{side}_all_tps")) for row in repeated]
    effect = allocator_effect(rows, sides)
    if effect:
        lines += ["", "Each side on jemalloc against the system malloc, same case (tok/s, system → jemalloc):", ""]
        lines += [f"- {e}" for e in effect]
    errors = [(row["case"].label, side, row[side]["error"]) for row in rows for side in sides
              if "error" in row.get(side, {})]
    if errors:
        lines += ["", "Errors:", ""] + [f"- {label} ({side}): {err}" for label, side, err in errors]
    lines += ["", "## Targets", "",
              "Each with its margin: how far the measured value is past the threshold (+) or short of it (−), "
              "relative to the threshold.", ""]
    lines += [f"  - {t.strip()}" if t.startswith("  ") else f"- {t}" for t in targets(rows, full)]
    if full:
        lines += ["", "## Full finetune vs llama.cpp (`python bench/bench_full_finetune.py "
                  f"--threads {args.threads}`)", ""]
        if "error" in full:
            lines.append(f"bench_full_finetune.py failed: {full['error']}")
        else:
            lines += [f"Every weight trained, AdamW, one sequence per step; llama.cpp's own training "
                      f"(`llama_opt_epoch`, F32) against `ggtorch train --model-base` (f32 weights, compute and "
                      f"AdamW state). {full['what']}.", "",
                      "Each side's figure is its fastest round; every round is listed, in the order run.", "",
                      "| side | tok/s | every round |", "|---|---:|---|",
                      *(f"| {side} | {fmt(full[side])} | {', '.join(map(fmt, full['rounds'][side]))} |"
                        for side in ("ggtorch", "llama.cpp")), "",
                      f"ggtorch / llama.cpp: {full['ggtorch'] / full['llama.cpp']:.2f}×"]
    lines += ["", "GEMM peaks measured (GFLOP/s, best over the model's shapes; the peak is the faster of torch.mm "
              "and oneDNN, shown as ggtorch.ops.matmul):", ""]
    for (shape, n), g in sorted(rows_gemm(rows).items()):
        lines.append(f"- {shape}, {n} rows: f32 {fmt(g.get('f32'))} ({kernels_text(g.get('f32_kernels'))}), "
                     f"bf16 {fmt(g.get('bf16'))} ({kernels_text(g.get('bf16_kernels'))})")
    return "\n".join(lines) + "\n"


def kernels_text(per_kernel: dict[str, float] | None) -> str:
    return ", ".join(f"{k} {fmt(v)}" for k, v in (per_kernel or {}).items())


def rows_gemm(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["case"].shape, r["case"].batch * r["case"].ctx): r["gemm"] for r in rows}


def find(rows: list[dict[str, Any]], **want: Any) -> dict[str, Any] | None:
    defaults = {"shape": "110M", "ftype": "F32", "dtype": "f32", "ctx": 256, "batch": 4, "checkpointing": False,
                "malloc": "system", "keep_mib": 0}
    want = defaults | want
    for row in rows:
        if all(getattr(row["case"], k) == v for k, v in want.items()):
            return row
    return None


def ratio(row: dict[str, Any] | None, peer_row: dict[str, Any] | None = None) -> float | None:
    """ggtorch's tok/s over the peer's (of ``peer_row`` when given: the bf16 row against the peer in f32)."""
    peer_row = peer_row or row
    g, p = (row or {}).get("ggtorch_tps"), (peer_row or {}).get("peer_tps")
    return g / p if g and p else None


def rss_ratio(row: dict[str, Any] | None) -> float | None:
    g, p = ((row or {}).get(side, {}).get("peak_rss") for side in ("ggtorch", "peer"))
    return g / p if g and p else None


def target(what: str, value: float | None, threshold: float, at_least: bool = True, unit: str = "×") -> str:
    """One target line: threshold, measured value, margin and verdict."""
    show = (lambda v: f"{v:.2f}×") if unit == "×" else (lambda v: f"{100 * v:.0f}%")
    rule = f"{'≥' if at_least else '≤'} {show(threshold)}"
    if value is None:
        return f"{what} {rule} — not measured in this run"
    margin = value / threshold - 1 if at_least else 1 - value / threshold
    verdict = "**met**" if margin >= 0 else "**missed**"
    return f"{what} {rule} — {show(value)} (margin {100 * margin:+.0f}%, {verdict})"


QUANTIZED_TARGETS = (("110M", 4, "Q4_0"), ("110M", 4, "Q4_K_M"), ("1.1B", 1, "Q4_0"), ("1.1B", 1, "Q4_K_M"))
"""(shape, batch, base type) of the quantized-base targets, all at context 256."""


def targets(rows: list[dict[str, Any]], full: dict[str, Any] | None = None) -> list[str]:
    """Issue 24's targets for each allocator pairing measured, with values, margins and verdicts."""
    out = []
    for malloc in ALLOCATORS:
        if not any(r["case"].malloc == malloc for r in rows):
            continue
        f32, bf16 = find(rows, malloc=malloc), find(rows, dtype="bf16", malloc=malloc)
        out.append(f"both sides on {malloc} malloc:")
        out.append("  " + target("f32 LoRA step, 110M b4×256: ggtorch / peer", ratio(f32), 1.3))
        out.append("  " + target("the same step: share of the faster f32 GEMM peak",
                                 share_of_peak(f32) if f32 else None, 0.8, unit="%"))
        out.append("  " + target("bf16 autocast, 110M b4×256: share of the bf16 GEMM peak",
                                 share_of_peak(bf16) if bf16 else None, 0.7, unit="%"))
        out.append("  " + target("bf16 autocast: ggtorch / the peer in f32", ratio(bf16, f32), 2.5))
        need = needed_share_of_peak(bf16, 2.5, f32) if bf16 and f32 else None
        if need:
            out.append(f"  (2.5 times the peer's tokens/s in f32 would take {need:.0%} of the bf16 GEMM peak)")
        if ratio(bf16):
            out.append(f"  (bf16 against the peer in bf16, not a target: {ratio(bf16):.2f}×)")
        for shape, batch, ftype in QUANTIZED_TARGETS:
            q = find(rows, shape=shape, batch=batch, ftype=ftype, malloc=malloc)
            if q is None and malloc != "system":
                continue
            out.append("  " + target(f"{ftype} base, {shape} b{batch}×256: ggtorch / peer", ratio(q), 1.2))
            out.append("  " + target(f"{ftype} base, {shape} b{batch}×256: dequantization's share of a step",
                                     dequant_share(q) if q else None, 0.2, at_least=False, unit="%"))
            keep = find(rows, shape=shape, batch=batch, ftype=ftype, malloc=malloc, keep_mib=KEEP_MIB)
            if keep is not None and ratio(keep) is not None:
                out.append(f"  (not a target: with --keep-dequantized-mib {KEEP_MIB}, {ratio(keep):.2f}× the peer, "
                           f"dequantization {dequant_share(keep) or 0:.0%} of a step, at {rss_ratio(keep) or 0:.0%} "
                           "of its peak RSS)")
        g = find(rows, shape="gemma3-270M", ftype="Q8_0", malloc=malloc)
        gb = find(rows, shape="gemma3-270M", ftype="Q8_0", dtype="bf16", malloc=malloc)
        if g is not None or malloc == "system":
            out.append("  " + target("gemma3-270M (262,144 tokens, tied Q8_0) b4×256: ggtorch / peer", ratio(g), 2.0))
            need = needed_share_of_peak(g, 2.0) if g else None
            if need:
                out.append(f"  (in f32, twice the peer's tokens/s would take {need:.0%} of the f32 GEMM peak)")
            out.append("  " + target("gemma3-270M: ggtorch's peak RSS / the peer's", rss_ratio(g), 0.3,
                                     at_least=False, unit="%"))
            out.append("  " + target("gemma3-270M, bf16 autocast: ggtorch / the peer in f32", ratio(gb), 2.0))
            out.append("  " + target("gemma3-270M, bf16 autocast: ggtorch's peak RSS / the peer's in f32",
                                     rss_ratio(gb), 0.3, at_least=False, unit="%"))
        ck = find(rows, checkpointing=True, malloc=malloc)
        relative = _alternating_ratio(ck, "plain", "checkpointed")
        if relative:
            out.append(f"  (not a target: gradient checkpointing costs {100 * (1 - relative):.0f}% of ggtorch's "
                       "throughput, steps with and without it alternating in one process)")
    if full is not None:
        value = full["ggtorch"] / full["llama.cpp"] if "error" not in full else None
        out.append(target("full finetune, ggtorch / llama.cpp's training (bench/bench_full_finetune.py)", value, 2.5))
    return out


def headline(rows: list[dict[str, Any]]) -> list[str]:
    """The ratios against the peer: first those a newcomer reproduces (both sides on the system malloc),
    then the same ratios with both sides on jemalloc where this run measured them."""
    out = []
    for malloc in ALLOCATORS:
        on = "" if malloc == "system" else f", both sides on {malloc}"
        for label, row, peer_row in (
                ("f32 LoRA, 110M b4×256", find(rows, malloc=malloc), None),
                ("bf16 autocast against the peer in f32, 110M b4×256", find(rows, dtype="bf16", malloc=malloc),
                 find(rows, malloc=malloc)),
                *((f"{ft} base, {sh} b{b}×256", find(rows, shape=sh, batch=b, ftype=ft, malloc=malloc), None)
                  for sh, b, ft in QUANTIZED_TARGETS),
                ("gemma3-270M Q8_0 b4×256", find(rows, shape="gemma3-270M", ftype="Q8_0", malloc=malloc), None),
                ("gemma3-270M Q8_0 b4×256, bf16 autocast against the peer in f32",
                 find(rows, shape="gemma3-270M", ftype="Q8_0", dtype="bf16", malloc=malloc), None)):
            r = ratio(row, peer_row)
            if r is not None:
                out.append(f"{label}{on}: ggtorch {r:.2f}× the peer's tokens/s")
    return out or ["no row with both sides in this run"]


def allocator_effect(rows: list[dict[str, Any]], sides: list[str]) -> list[str]:
    """Each side's tok/s on jemalloc over its tok/s on the system malloc, for every case run on both:
    how much of a ratio against the peer is the allocator's."""
    out = []
    for row in rows:
        case = row["case"]
        if case.malloc == "system":
            continue
        base = next((r for r in rows if r["case"].malloc == "system"
                     and replace(r["case"], malloc=case.malloc, repeat=case.repeat) == case), None)
        if base is None:
            continue
        parts = [f"{side} {fmt(base[f'{side}_tps'])} → {fmt(row[f'{side}_tps'])} tok/s "
                 f"({row[f'{side}_tps'] / base[f'{side}_tps']:.2f}×)" for side in sides
                 if row.get(f"{side}_tps") and base.get(f"{side}_tps")]
        if parts:
            out.append(f"{case.label}: " + ", ".join(parts))
    return out


def _alternating_ratio(row: dict[str, Any] | None, numerator: str, denominator: str) -> float | None:
    """median seconds of ``numerator`` steps / of ``denominator`` steps, from a row whose ggtorch
    child alternated the two kinds (:func:`alternate`); None without such steps."""
    times = (row or {}).get("ggtorch", {}).get("alternating_s") or {}
    if not times.get(numerator) or not times.get(denominator):
        return None
    return statistics.median(times[numerator]) / statistics.median(times[denominator])


if __name__ == "__main__":
    main()
