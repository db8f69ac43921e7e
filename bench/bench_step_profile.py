"""Where a ggtorch LoRA step's time goes: every aten op of a few training steps timed and sorted by kind.

Not a test. For rows of ``bench/bench_vs_peft.py`` (same model files, same ``Trainer`` config), this runs the
steps under a dispatch mode that times every aten op, forward, backward and optimizer alike, and sorts them
into kinds: the matrix products of the base and output matrices (their GFLOP/s counted from the operands'
shapes and set against the GEMM peak, measured here as bench_vs_peft.py measures it), LoRA's low-rank
products, attention's batched products, dequantization (a decode's whole wall time), softmax and exp, casts and
copies, views, the optimizer, and the elementwise rest. On CPU an op runs before it returns, so the wall time
around it is its cost; on CUDA the mode synchronizes around every op (slow, but each op's own time).

Plain steps and steps under the mode alternate: the ops' total is set beside the median plain step, and what a
plain step spends outside the ops (Python code, each call's way from Python into torch before the op starts, the
autograd engine) is the difference, as uncertain as the plain steps' spread, which the report gives. The GEMM peak
is measured before and after a case's steps, the higher counting; the machine's speed drifts by 10-25% within
minutes, so a product's share of it above 100% says that the steps met a faster spell than both measurements of the
peak did.

    python bench/bench_step_profile.py --threads 2            # the headline rows; writes its BENCHMARKS.md section
    python bench/bench_step_profile.py --cases "110M F32 bf16 b4x256" --out ""   # print only
"""

from __future__ import annotations

import argparse
import collections
import datetime
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vs_peft import (  # noqa: E402  (this folder's sibling)
    ROOT,
    SHAPES,
    Case,
    Turns,
    child_gemm,
    finetune_config,
    full_cases,
    keep_faster,
    machine,
    model_file,
    read_into_page_cache,
    training_text,
    wrapping_dequantization,
    write_section,
)

HEADING = "## Where a step's time goes (`python bench/bench_step_profile.py"
DEFAULT_CASES = ("110M F32 f32 b4x256", "110M F32 bf16 b4x256", "1.1B Q4_0 f32 b1x256",
                 "gemma3-270M Q8_0 bf16 b4x256 vs peer f32")
WARMUP = 2
"""Untimed steps before a case's plain and timed ones."""

LOW_RANK = 16
"""A product with a dimension under this is a low-rank one (LoRA's A and B at the ranks people train with)."""

PRODUCTS = {"mm", "addmm", "addmm_", "_linear_pointwise", "bmm", "baddbmm", "baddbmm_"}
SOFTMAX = {"softmax", "_softmax", "log_softmax", "_log_softmax", "_softmax_backward_data", "exp", "exp_", "amax",
           "logsumexp"}
COPIES = {"_to_copy", "copy_", "clone", "_copy_from"}

KINDS = ("matrix products", "low-rank products", "attention products", "dequantization", "softmax, exp, max",
         "casts and copies", "elementwise and reductions", "optimizer", "views")
"""Every kind an op is counted in, in the order the table shows them."""


def product_dims(name: str, shapes: Sequence[tuple[int, ...]]) -> tuple[int, int, int, int] | None:
    """(batch, M, K, N) of a matrix product op from its tensor operands' shapes, or None for any other op.

    ``mm(a, b)``; ``addmm(c, a, b)`` and ``addmm_``; oneDNN's ``_linear_pointwise(x, w, ...)``, which is
    ``x @ w.T`` over x's leading dims; ``bmm(a, b)``; ``baddbmm(c, a, b)``."""
    if name not in PRODUCTS:
        return None
    if name == "_linear_pointwise":
        x, w = shapes[0], shapes[1]
        return 1, math.prod(x[:-1]), x[-1], w[0]
    a, b = (shapes[1], shapes[2]) if name.startswith(("addmm", "baddbmm")) else (shapes[0], shapes[1])
    if name.startswith(("bmm", "baddbmm")):
        return a[0], a[1], a[2], b[2]
    return 1, a[0], a[1], b[1]


def op_kind(name: str, is_view: bool, dims: tuple[int, int, int, int] | None, inside: str | None) -> str:
    """The kind (one of :data:`KINDS`) an aten op's time is counted in; ``inside``: the kind of the marked call
    it runs in (a dequantization, a low-rank product of ggtorch.ops.lowrank), which takes its ops' time."""
    if inside is not None:
        return inside
    if dims is not None:
        if name.startswith(("bmm", "baddbmm")):
            return "attention products"
        return "low-rank products" if min(dims[1:]) < LOW_RANK else "matrix products"
    if is_view:
        return "views"
    if name.startswith(("_foreach", "_fused_adam")):
        return "optimizer"
    if name in SOFTMAX:
        return "softmax, exp, max"
    if name in COPIES:
        return "casts and copies"
    return "elementwise and reductions"


@dataclass
class Tally:
    """Seconds and product FLOPs per kind, seconds per (op, operand shapes), and the ops counted."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    flops: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    ops: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    calls: int = 0


class OpTimer(TorchDispatchMode):
    """Times every aten op run while it is active into a :class:`Tally`; ``inside`` (a stack of kinds) marks the
    ops of a marked call with its kind (see :func:`marking`)."""

    def __init__(self, tally: Tally, device: torch.device) -> None:
        super().__init__()
        self.tally, self.inside = tally, []
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        self.sync()
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        self.sync()
        seconds = time.perf_counter() - start
        name = func.overloadpacket.__name__
        shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
        if func.namespace == "ggtorch":  # a C loop: its kind, whatever call it runs in
            kind, label, flops = c_op(name)
            if flops is not None:
                self.tally.flops[kind] += flops(*args)
        else:
            dims = product_dims(name, shapes)
            kind = op_kind(name, func.is_view, dims, self.inside[0] if self.inside else None)
            if dims is not None:
                self.tally.flops[kind] += 2.0 * math.prod(dims)
            label = f"{name} {shapes[:3]}"
        self.tally.seconds[kind] += seconds
        self.tally.ops[(kind, label)] += seconds
        self.tally.calls += 1
        return out


def marked(timer: OpTimer, kind: str, fn: Callable[..., Any], label: str = "outside aten ops",
           flops: Callable[..., float] | None = None) -> Callable[..., Any]:
    """``fn`` whose calls count as ``kind``: the aten ops they run, and the rest of their wall time (C loops run
    outside any aten op, under ``label``), with ``flops(*args)`` multiply-adds × 2 when given."""

    def call(*args: Any, **kwargs: Any) -> Any:
        outermost, start = not timer.inside, time.perf_counter()
        in_ops = timer.tally.seconds[kind]
        timer.inside.append(kind)
        try:
            return fn(*args, **kwargs)
        finally:
            timer.inside.pop()
            if outermost:
                rest = time.perf_counter() - start - (timer.tally.seconds[kind] - in_ops)
                timer.tally.seconds[kind] += rest
                timer.tally.ops[(kind, label)] += rest
                if flops is not None:
                    timer.tally.flops[kind] += flops(*args)

    return call


def _rank_r(x: torch.Tensor, small: torch.Tensor, *rest: Any) -> float:
    """lowrank_project's and lowrank_reduce's multiply-adds × 2: x (N, K) with (r, K) or (N, r)."""
    return 2.0 * x.shape[0] * x.shape[1] * min(small.shape)


def _expand(y: torch.Tensor, h: torch.Tensor, *rest: Any) -> float:
    """lowrank_expand_'s: y (N, M) += h (N, r) @ (r, M)."""
    return 2.0 * y.numel() * h.shape[1]


def _triangle(products: int, q: torch.Tensor, *rest: Any) -> float:
    """attention.c's: ``products`` products over a causal triangle of q (B, H, T, D) (backward computes the scores
    again)."""
    B, H, T, D = q.shape
    return products * 2.0 * B * H * D * T * (T + 1) / 2


C_OPS: dict[str, tuple[str, Callable[..., float] | None]] = {
    "dequantize_": ("dequantization", None),
    "lowrank_project": ("low-rank products", _rank_r),
    "lowrank_reduce": ("low-rank products", _rank_r),
    "lowrank_expand_": ("low-rank products", _expand),
    **dict.fromkeys(("rms_norm", "rms_norm_backward", "glu", "glu_backward", "rope"),
                    ("elementwise and reductions", None)),
    "softmax_slab_": ("softmax, exp, max", None),
    "attention": ("attention products", partial(_triangle, 2)),
    "attention_backward": ("attention products", partial(_triangle, 5)),
}
"""ggtorch's C loops (its ``ggtorch::`` torch ops: quant/native.c, ops/lowrank.c, ops/fused.c, ops/attention.c),
each with its kind and, for products, its FLOPs."""


def c_op(name: str) -> tuple[str, str, Callable[..., float] | None]:
    """The kind, label and FLOPs of the ``ggtorch::`` op ``name``."""
    kind, flops = C_OPS[name]
    return kind, f"{name} (C loops)", flops


@contextmanager
def marking(timer: OpTimer) -> Iterator[None]:
    """Inside, every dequantization the training path makes through torch's ops counts as dequantization (the C
    loops are ``ggtorch::`` ops, which the timer counts by name)."""
    with wrapping_dequantization(partial(marked, timer, "dequantization")):
        yield


@dataclass
class Profile:
    """One case's steps, by kind."""

    case: str
    """The bench_vs_peft.py row's label."""
    step_s: float
    """Median seconds of a plain step (no mode)."""
    step_range: tuple[float, float]
    """The fastest and slowest plain step: the spread that the time outside the ops is read against."""
    ops_per_step: float
    """aten ops a step runs."""
    ops_s: dict[str, float]
    """Seconds per step by kind."""
    gflops: dict[str, float | None]
    """GFLOP/s of each kind of product within the steps."""
    peak: float | None
    """The GEMM peak (GFLOP/s) of the case's compute dtype, measured here."""
    useful_share: float | None
    """4 × base matrix parameters per token / the plain step / the peak: bench_vs_peft's share of the peak."""
    top: list[tuple[str, str, float]]
    """The costliest ops beside the matrix products: (kind, op and operand shapes, seconds per step)."""


def profile_trainer(trainer: Any, steps: int) -> tuple[list[float], Tally]:
    """The seconds of ``steps`` plain steps of ``trainer``, and the :class:`Tally` of as many under
    :class:`OpTimer`, the two kinds alternating so that both meet the same spells of the machine."""
    plain = []
    tally = Tally()
    timer = OpTimer(tally, trainer.device)
    for _ in range(steps):
        plain.append(trainer.step().seconds)
        with marking(timer), timer:
            trainer.step()
    return plain, tally


def profile_case(case: Case, workdir: Path, threads: int, steps: int) -> Profile:
    """Build or reuse the case's model file, measure the GEMM peak, then profile a Trainer on the case."""
    from ggtorch.training.trainer import Trainer

    shape = SHAPES[case.shape]
    path = model_file(workdir, shape, case.ftype)
    text = training_text(workdir)
    read_into_page_cache(path)
    rows = case.batch * case.ctx
    gemm = {"threads": threads, "rows": rows, "shapes": sorted(set(shape.matrices()))}
    peak = child_gemm(gemm, Turns(False))  # sets torch's threads, as the Trainer will
    # the warm-up, then the plain and the timed steps: the run's whole length, for its learning-rate schedule
    spec = {"model": str(path), "text": str(text), "threads": threads, **asdict(case), "warmup": WARMUP,
            "steps": 2 * steps}
    trainer = Trainer(finetune_config(spec), log_records=False, manage_process=True)
    for _ in range(WARMUP):
        trainer.step()
    plain_steps, tally = profile_trainer(trainer, steps)
    plain = statistics.median(plain_steps)
    trainer.close()
    # measured before and after the steps, the higher counting, as bench_vs_peft.py does
    keep_faster(peak, child_gemm(gemm, Turns(False)))
    ops_s = {kind: s / steps for kind, s in tally.seconds.items()}
    gflops = {kind: tally.flops[kind] / tally.seconds[kind] / 1e9 if tally.flops[kind] and tally.seconds[kind] else None
              for kind in KINDS}
    best = peak.get(case.dtype)
    useful = shape.gflops(rows / plain)
    top = [(kind, op, s / steps) for (kind, op), s in tally.ops.most_common() if kind != "matrix products"][:6]
    return Profile(case.label, plain, (min(plain_steps), max(plain_steps)), tally.calls / steps, ops_s, gflops, best,
                   useful / best if best else None, top)


def table(p: Profile) -> str:
    """The profile of one case as markdown."""
    total = sum(p.ops_s.values())
    lines = [f"### {p.case}", "",
             f"A plain step {p.step_s:.3f} s ({p.step_range[0]:.3f}-{p.step_range[1]:.3f}); its {p.ops_per_step:.0f} "
             f"ops {total:.3f} s under the timer, so {p.step_s - total:+.3f} s of a plain step is outside them "
             "(Python: the callers, each call's way into torch, the autograd engine; a difference of two "
             "measurements, as uncertain as the plain steps' spread)."
             + (f" The step's useful work (4 × base matrix parameters per token) runs at {p.useful_share:.0%} of the "
                f"GEMM peak, {p.peak:.0f} GFLOP/s." if p.useful_share and p.peak else ""), "",
             "| kind | ms per step | share of the ops | GFLOP/s (share of the peak) |", "|---|---:|---:|---:|"]
    for kind in KINDS:
        seconds = p.ops_s[kind]
        if seconds < 5e-4:
            continue
        gf = p.gflops[kind]
        rate = "" if gf is None else f"{gf:.0f}" + (f" ({gf / p.peak:.0%})" if p.peak else "")
        lines.append(f"| {kind} | {seconds * 1e3:.0f} | {seconds / total:.0%} | {rate} |")
    lines += ["", "Costliest ops beside the matrix products (ms per step): "
              + "; ".join(f"{op} {s * 1e3:.0f} ({kind})" for kind, op, s in p.top) + ".", ""]
    return "\n".join(lines)


def section(profiles: list[Profile], command: str, threads: int) -> str:
    """The report's section: the machine, how it was measured, and each case's table."""
    info = machine()
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = "" if info["load"] is None else f" (load {info['load']:.2f})"
    head = (f"{HEADING.split('(')[0]}(`{command}`)\n\n"
            f"{info['cpu']}, {info['cores']} cores, torch {info['torch']}, {threads} threads, {now}{load}. Every aten "
            "op of the steps is timed by a dispatch mode and counted by kind (the script's docstring says how): matrix "
            "products are the base's and the output's, low-rank ones LoRA's, attention products its batched ones; "
            "GFLOP/s counts each product's multiply-adds from its operands' shapes, against the GEMM peak measured "
            "before and after the case's steps (the machine's speed drifts by 10-25% within minutes: above 100%, the "
            "steps met a faster spell than the peak).\n\n")
    return head + "\n".join(table(p) for p in profiles)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES), help="comma list of bench_vs_peft.py row labels")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--steps", type=int, default=3, help="steps timed plainly, then as many under the timer")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "ggtorch-bench-vs-peft",
                    help="bench_vs_peft.py's model cache")
    ap.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"),
                    help="the report whose section to rewrite ('' to print only)")
    args = ap.parse_args()
    by_label = {c.label: c for c in full_cases(False)}
    wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in wanted if c not in by_label]
    if unknown or args.steps < 1:
        ap.error(f"unknown case {unknown[0]!r}; one of: {', '.join(by_label)}" if unknown else "--steps must be >= 1")
    args.workdir.mkdir(parents=True, exist_ok=True)
    profiles = []
    for label in wanted:
        p = profile_case(by_label[label], args.workdir, args.threads, args.steps)
        print(table(p), flush=True)
        profiles.append(p)
    if args.out:
        command = f"python bench/bench_step_profile.py --threads {args.threads}"
        if wanted != list(DEFAULT_CASES):
            command += f' --cases "{",".join(wanted)}"'
        write_section(Path(args.out), HEADING, section(profiles, command, args.threads))


if __name__ == "__main__":
    main()
