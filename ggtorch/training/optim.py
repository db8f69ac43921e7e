"""ggml-exact AdamW for the LoRA finetune, built on torch's functional AdamW (``torch.optim.adamw.adamw``).

The old finetune ran ggml's ``ggml_opt_adam`` (ggml.c) with the schedule of ``learning_schedule``
(common/train.cpp). One update t (1-based, continuing across resumed runs) is, per element::

    g' = g * gnorm                       gnorm = gclip/|g| when |g| > gclip, else 1 (|g| over ALL params)
    m  = beta1*m + (1-beta1)*g'          v = beta2*v + (1-beta2)*g'^2
    x  = x*(1 - p_decay) - alpha*sched/(1-beta1^t) * m / (sqrt(v/(1-beta2^t)) + eps)

with ``p_decay = adam_decay*alpha*sched`` for tensors whose ggml n_dims >= decay_min_ndim and 0
otherwise, and ``sched = learning_schedule(t-1)``: ggml evaluated the gradient (and the schedule)
before incrementing its iteration counter. That is torch's AdamW (eps after the square root of
the bias-corrected v, decoupled decay ``x *= 1 - lr*weight_decay``) with ``lr = alpha*sched``,
``weight_decay = adam_decay`` (0 for the low-dimensional group), preceded by the clipping above, which is
what :class:`GGMLAdamW` wires together. It calls the functional form and keeps the state itself: the
``torch.optim.Optimizer`` class imports ``torch._dynamo`` on construction, seconds of every run's start.

Hyper-parameters are not part of the saved state (as in llama.cpp, each run takes them from its
own flags); moments, step counts, the iteration and the convergence-test state are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np
import torch
from torch.optim.adamw import adamw

from ggtorch.errors import BadFlag, flag
from ggtorch.ops import policy

_F = np.float32
_PI_F = _F(3.14159265359)  # train.cpp writes pi as the float literal 3.14159265359f

OPTION_NAMES: dict[str, str] = {
    "alpha": "adam_alpha", "min_alpha": "adam_min_alpha", "decay": "adam_decay",
    "decay_min_ndim": "adam_decay_min_ndim", "beta1": "adam_beta1", "beta2": "adam_beta2",
    "gclip": "adam_gclip", "epsf": "adam_epsf", "warmup": "warmup", "cos_decay_steps": "cos_decay_steps",
    "cos_decay_restart": "cos_decay_restart", "cos_decay_min": "cos_decay_min",
    "enable_restart": "enable_restart", "opt_past": "opt_past", "opt_delta": "opt_delta",
    "opt_max_no_improvement": "opt_max_no_improvement",
}
"""AdamConfig field -> the run option that sets it (a FinetuneConfig/TrainConfig field; its long
flag is the name with dashes). ``from_finetune`` reads the options through it and messages name
the flag the user typed. ``eps`` has no option: ggml's fixed value."""


def _flag(name: str) -> str:
    option = OPTION_NAMES.get(name)
    return flag(option) if option else f"{name} (ggml's Adam epsilon, no command-line flag)"


@dataclass
class AdamConfig:
    """The old finetune's optimizer settings, with its defaults (common/train.cpp).

    A run config's optimizer options take their defaults from here; OPTION_NAMES links them.
    """

    alpha: float = 1e-3
    """Base learning rate."""
    min_alpha: float = 0.0
    """Learning-rate floor: lr = min_alpha + (alpha - min_alpha)·schedule."""
    decay: float = 0.1
    """Decoupled weight decay; per step x *= 1 - decay·alpha·sched."""
    decay_min_ndim: int = 2
    """Only tensors with at least this many ggml dimensions are decayed."""
    beta1: float = 0.9
    """First-moment decay."""
    beta2: float = 0.999
    """Second-moment decay."""
    gclip: float = 1.0
    """Global gradient-norm limit; 0 disables clipping."""
    eps: float = 1e-8
    """Added after the square root of the bias-corrected v; ggml's fixed value (no option)."""
    epsf: float = 0.0
    """Stop when |loss - previous loss| / loss < epsf; 0 never stops."""
    warmup: int = 100
    """Linear warm-up iterations."""
    cos_decay_steps: int = 1000
    """Length of the cosine decay, or of its first cycle with restarts."""
    cos_decay_restart: float = 1.1
    """Cycle-length multiplier after each restart."""
    cos_decay_min: float = 0.1
    """Cosine decay floor, as a fraction of the schedule."""
    enable_restart: bool = False
    """Cosine decay with restarts."""
    opt_past: int = 0
    """Delta convergence test over this many past losses; 0 disables."""
    opt_delta: float = 1e-5
    """Stop when the loss changed by less than this fraction over opt_past iterations."""
    opt_max_no_improvement: int = 0
    """Stop after this many iterations without a new best loss; 0 disables."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "bool":
                if not isinstance(value, bool):
                    raise BadFlag(f"{_flag(f.name)} is a switch (true/false), got {value!r}")
            elif f.type == "int":
                if isinstance(value, bool) or not isinstance(value, int):
                    raise BadFlag(f"{_flag(f.name)} must be a whole number, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise BadFlag(f"{_flag(f.name)} must be a finite number, got {value!r}")

        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise BadFlag(f"{_flag(name)} must be {what}, got {getattr(self, name)}")

        need(self.alpha > 0, "alpha", "positive")
        need(0 <= self.min_alpha <= self.alpha, "min_alpha", f"between 0 and {_flag('alpha')} ({self.alpha})")
        need(self.decay >= 0, "decay", ">= 0")
        need(self.decay_min_ndim >= 0, "decay_min_ndim", ">= 0")
        need(0 <= self.beta1 < 1, "beta1", "in [0, 1)")
        need(0 <= self.beta2 < 1, "beta2", "in [0, 1)")
        need(self.gclip >= 0, "gclip", ">= 0 (0 disables clipping)")
        need(self.eps >= 0, "eps", ">= 0")
        need(self.epsf >= 0, "epsf", ">= 0 (0 disables the test)")
        need(self.warmup >= 0, "warmup", ">= 0")
        need(self.cos_decay_steps >= 1, "cos_decay_steps", "at least 1")
        # below 1 the cycle shrinks to 0 and llama.cpp's restart loop never ends
        need(self.cos_decay_restart >= 1, "cos_decay_restart", ">= 1 (cycles may not shrink)")
        need(0 <= self.cos_decay_min <= 1, "cos_decay_min", "in [0, 1]")
        need(self.opt_past >= 0, "opt_past", ">= 0 (0 disables the test)")
        need(self.opt_delta >= 0, "opt_delta", ">= 0")
        need(self.opt_max_no_improvement >= 0, "opt_max_no_improvement", ">= 0 (0 disables the test)")

    @classmethod
    def from_finetune(cls, config: Any) -> AdamConfig:
        """The optimizer part of a run config (any object with the options of OPTION_NAMES)."""
        return cls(**{name: getattr(config, option) for name, option in OPTION_NAMES.items()})


# --- schedule (common/train.cpp), in float32 as the C code -------------------------------------
def _cosine_decay(step: int, decay_steps: int, minimum: np.float32) -> np.float32:
    """train.cpp ``cosine_decay``: half a cosine from 1 to ``minimum`` over ``decay_steps``."""
    step = min(step, decay_steps)
    # cosf, as the double cosine rounded to float (glibc's cosf is within half an ulp of that)
    c = _F(0.5) * (_F(1) + _F(math.cos(float(_PI_F * _F(step) / _F(decay_steps)))))
    return (_F(1) - minimum) * c + minimum


def _cosine_decay_restart(step: int, decay_steps: int, minimum: np.float32, mult: np.float32) -> np.float32:
    """train.cpp ``cosine_decay_restart``; cycle lengths truncate ``float(mult) * float(length)``."""
    while step > decay_steps:
        step -= decay_steps
        longer = int(mult * _F(decay_steps))
        if longer == decay_steps:  # cycles stopped growing: the loop would only subtract
            step = (step - 1) % decay_steps + 1 if step > decay_steps else step
            break
        decay_steps = longer
    return _cosine_decay(step, decay_steps, minimum)


def learning_schedule(step: int, cfg: AdamConfig) -> float:
    """train.cpp ``learning_schedule(step)``: the factor on alpha after ``step`` updates.

    Warm-up ``step/warmup``, then cosine decay: with restarts over ``step - warmup``, without
    restarts over ``step`` itself (llama.cpp's quirk, kept: a small jump at the end of warm-up).
    The min-alpha rule maps the result r to ``m + r(1 - m)`` with ``m = min_alpha/alpha``.
    """
    minimum = _F(cfg.cos_decay_min)
    if step < cfg.warmup:
        raw = _F(step) / _F(cfg.warmup)
    elif cfg.enable_restart:
        raw = _cosine_decay_restart(step - cfg.warmup, cfg.cos_decay_steps, minimum, _F(cfg.cos_decay_restart))
    else:
        raw = _cosine_decay(step, cfg.cos_decay_steps, minimum)
    m = _F(cfg.min_alpha) / _F(cfg.alpha)
    return float(m + raw * (_F(1) - m))


# --- clipping ------------------------------------------------------------------------------------
def clip_global_norm_(grads: Sequence[torch.Tensor], gclip: float) -> torch.Tensor:
    """Scale ``grads`` in place by gclip/norm when the global norm exceeds gclip (ggml's rule).

    Unlike ``clip_grad_norm_`` there is no +1e-6 and nothing changes at or below the limit. The
    sum of squares is accumulated in float64 (ggml's ``ggml_float``; float32 on MPS, which has
    no float64). Vectorized with ``_foreach`` ops per device and no host sync. Returns the norm.
    """
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    first = next(iter(by_device))
    acc = policy.current(first).wide_dtype
    norms = [torch.stack(torch._foreach_norm(gs, 2, dtype=acc)).to(first) for gs in by_device.values()]
    total = torch.linalg.vector_norm(torch.cat(norms), 2)
    # gclip/norm >= 1 exactly when norm <= gclip: clamping to 1 multiplies by 1.0, a no-op
    scale = (gclip / total).clamp(max=1.0)
    for device, gs in by_device.items():
        for dtype in {g.dtype for g in gs}:
            same = [g for g in gs if g.dtype == dtype]
            torch._foreach_mul_(same, scale.to(device=device, dtype=dtype))
    return total


# --- the optimizer ---------------------------------------------------------------------------------
@dataclass
class _Convergence:
    """ggml_opt_adam's stopping state: previous/best loss, no-improvement count, past losses."""

    n_losses: int = 0
    fx_prev: float | None = None
    fx_best: float | None = None
    n_no_improvement: int = 0
    past: list[float] | None = None


class GGMLAdamW:
    """torch's AdamW update with ggml's schedule and global-norm clipping: steps exactly as ggml's AdamW.

    ``params`` holds ``(name, parameter, ggml n_dims)`` as ``lora.trainable_parameters`` returns
    them; names key the saved moments. Usage per iteration::

        opt.zero_grad()
        for each of n_accum micro-batches: (loss / n_accum).backward()
        opt.step()

    ``step`` expects each ``.grad`` to be the MEAN of the micro-batch gradients (ggml adds
    ``grad/n_accum`` per micro-batch), clips it in place, updates and advances the schedule.
    """

    def __init__(self, params: Sequence[tuple[str, torch.nn.Parameter, int]], cfg: AdamConfig) -> None:
        if not params:
            raise BadFlag("nothing to train: no trainable parameters (check the --rank-* / --lora-r flags)")
        names = [name for name, _, _ in params]
        if len(set(names)) != len(names):
            raise ValueError("trainable parameter names must be unique")
        self.cfg = cfg
        self.names = names
        self.params = [p for _, p, _ in params]
        self.n_dims = [n for _, _, n in params]
        decayed = [n >= cfg.decay_min_ndim for n in self.n_dims]
        self.groups = [([p for p, d in zip(self.params, decayed, strict=True) if d == wanted],
                        cfg.decay if wanted else 0.0) for wanted in (True, False)]
        """(parameters, weight decay): the ggml-decayed tensors and the others."""
        self.fused = all(policy.current(p.device).fused_adamw for p in self.params)
        """One kernel per tensor's update instead of a dozen ops (most of an optimizer step over a LoRA's or
        a small model's many small tensors). Both compute the update above; they differ only in float
        rounding (a few ulp), which the ggml tests' tolerance covers."""
        self.state: dict[torch.nn.Parameter, dict[str, torch.Tensor]] = {}
        """Per parameter: its update count ``step`` and moments ``exp_avg``, ``exp_avg_sq`` (torch's names)."""
        self.iteration = 0
        """ggml's opt->iter: updates done, 1-based after the first, continuing across resumes."""
        self.grad_norm: torch.Tensor | None = None
        """Global gradient norm before clipping, of the last step (a device tensor, not synced)."""
        self._conv = _Convergence(past=[0.0] * cfg.opt_past if cfg.opt_past else None)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The parameters as torch's optimizers group them: what ``torch.amp.GradScaler`` unscales (f16 runs)."""
        return [{"params": self.params}]

    @property
    def sched(self) -> float:
        """Schedule factor the next update uses: learning_schedule(iteration)."""
        return learning_schedule(self.iteration, self.cfg)

    @property
    def lr(self) -> float:
        """Learning rate of the next update, alpha·sched."""
        return self.cfg.alpha * self.sched

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    @property
    def _step_dtype(self) -> torch.dtype:
        """torch's: f32, or the default float type for the per-op implementation."""
        return torch.float64 if torch.get_default_dtype() == torch.float64 and not self.fused else torch.float32

    def _state(self, p: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        """``p``'s step count and moments, zero before its first update. The step count lives where torch's
        kernels read it: beside the parameter in f32 for the fused one, else on the CPU."""
        if p not in self.state:
            self.state[p] = {"step": torch.zeros((), dtype=self._step_dtype, device=p.device if self.fused else "cpu"),
                             "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                             "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
        return self.state[p]

    def step(self) -> None:
        """Clip (in place, on ``.grad``), update every parameter, advance schedule and iteration.

        A parameter without a gradient is updated with a zero one, as ggml updates every tensor.
        """
        for p in self.params:
            if p.grad is None:  # ggml updates every tensor; torch would skip one without a grad
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params]
        if self.cfg.gclip > 0:
            self.grad_norm = clip_global_norm_(grads, self.cfg.gclip)
        else:
            self.grad_norm = None
        lr = self.lr
        with torch.no_grad():
            for params, decay in self.groups:
                if not params:
                    continue
                states = [self._state(p) for p in params]
                adamw(params, [p.grad for p in params], [s["exp_avg"] for s in states],
                      [s["exp_avg_sq"] for s in states], [], [s["step"] for s in states],
                      fused=True if self.fused else None, amsgrad=False,
                      beta1=self.cfg.beta1, beta2=self.cfg.beta2, lr=lr, weight_decay=decay, eps=self.cfg.eps,
                      maximize=False)
        self.iteration += 1

    def should_stop(self, loss: float) -> bool:
        """ggml_opt_adam's convergence tests on the loss of each step (all off by default).

        Call once per step with that step's loss. The first loss only initializes (ggml's
        evaluation before its loop); then, in float32 as ggml: |loss - prev|/loss < epsf; with
        opt_past, |past[t % opt_past] - loss|/loss < opt_delta once t >= opt_past (t counts the
        losses after the first); with opt_max_no_improvement, that many losses in a row without a
        new best. The decision comes one update later than in ggml, which evaluated the loss of
        the updated weights before deciding; our loss of step k is ggml's loss after update k-1.
        """
        with np.errstate(all="ignore"):  # a zero or NaN loss compares as in C, without warnings
            return self._should_stop(_F(loss))

    def _should_stop(self, fx: np.float32) -> bool:
        c, cfg = self._conv, self.cfg
        j = c.n_losses
        c.n_losses += 1
        if j == 0:
            c.fx_prev = c.fx_best = float(fx)
            if c.past is not None:
                c.past[0] = float(fx)
            return False
        t = j - 1
        if abs(fx - _F(c.fx_prev)) / fx < _F(cfg.epsf):
            return True
        if c.past is not None:
            slot = t % cfg.opt_past
            if cfg.opt_past <= t and abs((_F(c.past[slot]) - fx) / fx) < _F(cfg.opt_delta):
                return True
            c.past[slot] = float(fx)
        if cfg.opt_max_no_improvement > 0:
            if _F(c.fx_best) > fx:
                c.fx_best = float(fx)
                c.n_no_improvement = 0
            else:
                c.n_no_improvement += 1
                if c.n_no_improvement >= cfg.opt_max_no_improvement:
                    return True
        c.fx_prev = float(fx)
        return False

    # --- exact resume ------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Moments and step per parameter name, schedule, iteration and convergence state.

        Only plain containers, numbers, strings and tensors (copies), as checkpoints store them.
        """
        moments = {}
        for name, p in zip(self.names, self.params, strict=True):
            st = self.state.get(p, {})
            moments[name] = {k: v.detach().clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
        c = self._conv
        return {
            "iteration": self.iteration,
            "moments": moments,
            "scheduler": {"last_epoch": self.iteration},  # the schedule's step, as torch's LambdaLR kept it
            "convergence": {"n_losses": c.n_losses, "fx_prev": c.fx_prev, "fx_best": c.fx_best,
                            "n_no_improvement": c.n_no_improvement,
                            "past": list(c.past) if c.past is not None else None},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue a saved run; hyper-parameters stay this run's (llama.cpp did the same)."""
        moments = state["moments"]
        missing = [n for n in self.names if n not in moments]
        extra = [n for n in moments if n not in set(self.names)]
        if missing or extra:
            raise BadFlag(f"the checkpoint's optimizer state is for other LoRA tensors (missing {missing[:3]}, "
                          f"unexpected {extra[:3]}); pass the same --lora-r/--rank-* flags as the run that wrote it")
        conv = state["convergence"]
        saved_past = len(conv["past"]) if conv["past"] is not None else 0
        if saved_past != self.cfg.opt_past:
            raise BadFlag(f"--opt-past {self.cfg.opt_past} differs from the checkpoint's {saved_past}; "
                          f"pass --opt-past {saved_past} to resume it")
        for name, p in zip(self.names, self.params, strict=True):
            saved = moments[name]
            if not saved:
                self.state.pop(p, None)
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                if tuple(saved[key].shape) != tuple(p.shape):
                    raise BadFlag(f"the checkpoint's optimizer state for {name} has shape "
                                  f"{tuple(saved[key].shape)}, the tensor has {tuple(p.shape)}; "
                                  "pass the LoRA ranks the checkpoint was trained with")
            self.state[p] = {
                "step": saved["step"].detach().to(p.device if self.fused else "cpu", self._step_dtype).clone(),
                "exp_avg": saved["exp_avg"].detach().to(p.device, p.dtype).clone(),
                "exp_avg_sq": saved["exp_avg_sq"].detach().to(p.device, p.dtype).clone(),
            }
        self.iteration = int(state["iteration"])
        if int(state["scheduler"]["last_epoch"]) != self.iteration:
            raise ValueError("inconsistent optimizer state: schedule step differs from the iteration")
        self._conv = _Convergence(n_losses=int(conv["n_losses"]), fx_prev=conv["fx_prev"], fx_best=conv["fx_best"],
                                  n_no_improvement=int(conv["n_no_improvement"]),
                                  past=[float(x) for x in conv["past"]] if conv["past"] is not None else None)
