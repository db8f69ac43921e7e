"""ggtorch.training.optim against ggml's AdamW and train.cpp's schedule, written out here independently.

The references below follow ggml.c ``ggml_opt_adam`` and common/train.cpp ``learning_schedule``
from the formulas (numpy, float32 where ggml used float, float64 for the schedule) and never
call ggtorch.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ggtorch.errors import BadFlag
from ggtorch.training.config import FinetuneConfig
from ggtorch.training.optim import AdamConfig, GGMLAdamW, clip_global_norm_, learning_schedule

F = np.float32


# --- independent references ----------------------------------------------------------------
def ref_schedule(step: int, warmup: int, decay_steps: int, mult: float, cos_min: float,
                 alpha: float, min_alpha: float, restart: bool) -> float:
    """train.cpp learning_schedule in float64 (cycle lengths truncate the C float product)."""

    def cosine(s: int, d: int) -> float:
        s = min(s, d)
        return (1 - cos_min) * 0.5 * (1 + math.cos(math.pi * s / d)) + cos_min

    if step < warmup:
        raw = step / warmup
    elif restart:
        s, d = step - warmup, decay_steps
        while s > d:
            s -= d
            d = int(F(mult) * F(d))
        raw = cosine(s, d)
    else:
        raw = cosine(step, decay_steps)  # llama.cpp: step, not step - warmup
    m = min_alpha / alpha
    return m + raw * (1 - m)


def ref_sched_of(cfg: AdamConfig, step: int) -> float:
    return ref_schedule(step, cfg.warmup, cfg.cos_decay_steps, cfg.cos_decay_restart, cfg.cos_decay_min,
                        cfg.alpha, cfg.min_alpha, cfg.enable_restart)


class RefGGMLAdam:
    """ggml_opt_adam's update on flat float32 vectors, one np array per tensor."""

    def __init__(self, xs: list[np.ndarray], n_dims: list[int], cfg: AdamConfig) -> None:
        self.xs = [x.astype(np.float32).copy() for x in xs]
        self.n_dims, self.cfg = n_dims, cfg
        self.m = [np.zeros_like(x) for x in self.xs]
        self.v = [np.zeros_like(x) for x in self.xs]
        self.iter = 0
        self.clipped = 0

    def step(self, gs: list[np.ndarray], sched: float) -> None:
        c = self.cfg
        self.iter += 1
        gnorm = F(1)
        if c.gclip > 0:
            total = sum(float(np.sum((g * g).astype(np.float64))) for g in gs)  # float squares, double sum
            norm = math.sqrt(total)
            if norm > c.gclip:
                gnorm = F(c.gclip / norm)
                self.clipped += 1
        sched = F(sched)
        alpha, b1, b2 = F(c.alpha), F(c.beta1), F(c.beta2)
        beta1h = alpha * sched / (F(1) - b1 ** F(self.iter))
        beta2h = F(1) / (F(1) - b2 ** F(self.iter))
        decay = F(c.decay) * alpha
        for i, g in enumerate(gs):
            p_decay = (decay if self.n_dims[i] >= c.decay_min_ndim else F(0)) * sched
            g_ = g.astype(np.float32) * gnorm
            self.m[i] = self.m[i] * b1 + g_ * (F(1) - b1)
            self.v[i] = self.v[i] * b2 + g_ * g_ * (F(1) - b2)
            mh = self.m[i] * beta1h
            vh = np.sqrt(self.v[i] * beta2h) + F(c.eps)
            self.xs[i] = self.xs[i] * (F(1) - p_decay) - mh / vh


# name, torch shape, ggml n_dims: LoRA a/b pairs, a norm's b (ne [r, 1] -> 1-D), a vector, a 3-D tensor
SHAPES = [("blk.0.attn_q.weight.lora_a", (4, 16), 2), ("blk.0.attn_q.weight.lora_b", (12, 4), 2),
          ("blk.0.attn_norm.weight.lora_b", (1, 4), 1), ("bias", (7,), 1), ("cube", (2, 3, 5), 3)]


def make_params(seed: int = 0) -> list[tuple[str, torch.nn.Parameter, int]]:
    gen = torch.Generator().manual_seed(seed)
    return [(name, torch.nn.Parameter(torch.randn(shape, generator=gen)), n) for name, shape, n in SHAPES]


def random_grads(n_steps: int, seed: int = 1, gclip: float = 1.0) -> list[list[np.ndarray]]:
    """Gradients whose global norm is spread around gclip: some steps clip, some do not."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_steps):
        gs = [rng.standard_normal(shape).astype(np.float32) for _, shape, _ in SHAPES]
        norm = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in gs))
        target = (gclip or 1.0) * float(rng.choice([0.3, 0.8, 1.5, 4.0]))
        out.append([(g * F(target / norm)).astype(np.float32) for g in gs])
    return out


def run_ggtorch(cfg: AdamConfig, grads: list[list[np.ndarray]],
                params: list[tuple[str, torch.nn.Parameter, int]] | None = None) -> GGMLAdamW:
    params = params or make_params()
    opt = GGMLAdamW(params, cfg)
    for gs in grads:
        opt.zero_grad()
        for (_, p, _), g in zip(params, gs, strict=True):
            p.grad = torch.from_numpy(g.copy())
        opt.step()
    return opt


CONFIGS = {
    "restarts+clip+min_alpha": AdamConfig(alpha=1e-2, min_alpha=1e-3, decay=0.1, warmup=5, cos_decay_steps=10,
                                          enable_restart=True, cos_decay_restart=1.5, cos_decay_min=0.2),
    "no-restart-quirk": AdamConfig(alpha=2e-2, decay=0.5, warmup=10, cos_decay_steps=30, cos_decay_min=0.1,
                                   beta1=0.8, beta2=0.99),
    "no-clip-decay-3d-only": AdamConfig(alpha=5e-3, decay=1.0, decay_min_ndim=3, warmup=0, cos_decay_steps=20,
                                        enable_restart=True, cos_decay_restart=2.0, gclip=0.0),
}
TOL = 1e-6  # absolute, on parameters of size ~1 after 50 steps of size ~alpha (measured: 2.4e-7, 1-2 ulp)


# --- (1) 50 steps against the numpy ggml AdamW ----------------------------------------------------
def _without_fused_kernel(cpu_policy) -> None:
    """As on a device that has no fused AdamW kernel: torch's per-op implementation."""
    cpu_policy(fused_adamw=False)


@pytest.mark.parametrize("kernel", ["fused", "default"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_fifty_steps_equal_ggml_adamw(name: str, kernel: str, cpu_policy) -> None:
    """torch's fused AdamW (CPU has it) and, where a device has none, its default implementation."""
    if kernel == "default":
        _without_fused_kernel(cpu_policy)
    cfg = CONFIGS[name]
    grads = random_grads(50, gclip=cfg.gclip)
    params = make_params()
    ref = RefGGMLAdam([p.detach().numpy() for _, p, _ in params], [n for _, _, n in params], cfg)
    for t, gs in enumerate(grads, start=1):
        ref.step(gs, ref_sched_of(cfg, t - 1))  # update t uses the schedule of iteration t-1
    opt = run_ggtorch(cfg, grads, params)

    assert opt.fused == (kernel == "fused")
    assert opt.iteration == 50
    if cfg.gclip > 0:
        assert 0 < ref.clipped < 50, "the gradients must clip on some steps and not on others"
    start = make_params()
    for (pname, p, _), x, (_, p0, _) in zip(params, ref.xs, start, strict=True):
        np.testing.assert_allclose(p.detach().numpy(), x, rtol=0, atol=TOL, err_msg=pname)
        assert (p.detach() - p0.detach()).abs().max() > 1000 * TOL, f"{pname} barely moved: the test would be void"


def test_tolerance_separates_the_ggml_details() -> None:
    """Decaying the 1-D tensors, or using sched(t) instead of sched(t-1), lands far outside TOL."""
    cfg = CONFIGS["restarts+clip+min_alpha"]
    grads = random_grads(50, gclip=cfg.gclip)
    params = make_params()
    x0, dims = [p.detach().numpy() for _, p, _ in params], [n for _, _, n in params]
    all_decay = RefGGMLAdam(x0, [9] * len(dims), cfg)
    shifted = RefGGMLAdam(x0, dims, cfg)
    for t, gs in enumerate(grads, start=1):
        all_decay.step(gs, ref_sched_of(cfg, t - 1))
        shifted.step(gs, ref_sched_of(cfg, t))
    opt_x = [p.detach().numpy() for p in run_ggtorch(cfg, grads, params).params]
    assert np.abs(opt_x[3] - all_decay.xs[3]).max() > 100 * TOL  # "bias" (1-D) must not decay
    assert max(np.abs(a - b).max() for a, b in zip(opt_x, shifted.xs, strict=True)) > 100 * TOL


def test_first_update_of_a_fresh_run_has_sched_zero() -> None:
    """With warm-up and no min-alpha, update 1 uses sched(0) = 0: weights unchanged, moments set."""
    params = make_params()
    before = [p.detach().clone() for _, p, _ in params]
    opt = run_ggtorch(AdamConfig(), random_grads(1), params)
    assert all(torch.equal(p.detach(), b) for (_, p, _), b in zip(params, before, strict=True))
    assert all(float(opt.state[p]["exp_avg"].abs().sum()) > 0 for _, p, _ in params)
    assert opt.sched == pytest.approx(0.01) and opt.lr == pytest.approx(1e-5)


def test_param_without_grad_is_still_updated_like_ggml() -> None:
    """ggml updates every tensor each step (decay, moment decay); torch would skip a grad-less one."""
    cfg = AdamConfig(alpha=1e-2, warmup=0)
    params = make_params()
    ref = RefGGMLAdam([p.detach().numpy() for _, p, _ in params], [n for _, _, n in params], cfg)
    opt = GGMLAdamW(params, cfg)
    for t, gs in enumerate(random_grads(5), start=1):
        gs = [g if i != 1 else np.zeros_like(g) for i, g in enumerate(gs)]
        ref.step(gs, ref_sched_of(cfg, t - 1))
        opt.zero_grad()
        for i, ((_, p, _), g) in enumerate(zip(params, gs, strict=True)):
            if i != 1:
                p.grad = torch.from_numpy(g.copy())
        opt.step()
    for (_, p, _), x in zip(params, ref.xs, strict=True):
        np.testing.assert_allclose(p.detach().numpy(), x, rtol=0, atol=TOL)


def test_clipping_rule() -> None:
    rng = np.random.default_rng(3)
    gs = [rng.standard_normal(s).astype(np.float32) for s in [(5, 3), (4,)]]
    norm = math.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in gs))
    below = [torch.from_numpy(g.copy()) for g in gs]
    got = clip_global_norm_(below, norm * 1.0001)
    assert float(got) == pytest.approx(norm, rel=1e-12)
    assert all(torch.equal(a, torch.from_numpy(b)) for a, b in zip(below, gs, strict=True))  # untouched, no +1e-6
    above = [torch.from_numpy(g.copy()) for g in gs]
    clip_global_norm_(above, 0.5)
    scale = F(0.5 / norm)
    for a, b in zip(above, gs, strict=True):
        np.testing.assert_array_equal(a.numpy(), b * scale)
    assert math.sqrt(sum(float((a.double() ** 2).sum()) for a in above)) == pytest.approx(0.5, rel=1e-6)


# --- (2) the schedule -------------------------------------------------------------------------
GRID = [
    dict(warmup=w, enable_restart=r, min_alpha=ma, cos_decay_min=cm, cos_decay_restart=mult, cos_decay_steps=d)
    for w in (0, 10, 100) for r in (False, True) for ma in (0.0, 2e-4) for cm in (0.0, 0.1, 0.5)
    for mult, d in ((1.1, 50), (2.0, 7), (1.0, 13))
]


@pytest.mark.parametrize("settings", GRID, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_schedule_equals_formula(settings: dict) -> None:
    cfg = AdamConfig(**settings)
    for step in list(range(0, 400)) + [1000, 1001, 5000, 123457]:
        assert learning_schedule(step, cfg) == pytest.approx(ref_sched_of(cfg, step), abs=1e-6), step


def test_schedule_hand_values() -> None:
    d = AdamConfig()
    assert learning_schedule(0, d) == 0.0
    assert learning_schedule(50, d) == pytest.approx(0.5, abs=1e-7)
    assert learning_schedule(99, d) == pytest.approx(0.99, abs=1e-7)
    # the defaults' jump at the end of warm-up: cosine over step 100 of 1000, not over step 0
    assert learning_schedule(100, d) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(0.1 * math.pi)), abs=1e-7)
    assert learning_schedule(100, d) == pytest.approx(0.977975, abs=1e-6)
    assert learning_schedule(1000, d) == pytest.approx(0.1, abs=1e-7)
    assert learning_schedule(10**6, d) == pytest.approx(0.1, abs=1e-7)
    # min-alpha: lr = min_alpha + (alpha - min_alpha)·raw
    assert learning_schedule(0, AdamConfig(min_alpha=1e-4)) == pytest.approx(0.1, abs=1e-7)
    # restarts, warm-up 0, cycle 10 doubling: 10 -> floor, 11 -> 1 step into a 20-step cycle
    r = AdamConfig(warmup=0, enable_restart=True, cos_decay_steps=10, cos_decay_restart=2.0, cos_decay_min=0.0)
    assert learning_schedule(10, r) == pytest.approx(0.0, abs=1e-7)
    assert learning_schedule(11, r) == pytest.approx(0.5 * (1 + math.cos(math.pi / 20)), abs=1e-7)
    assert learning_schedule(30, r) == pytest.approx(0.0, abs=1e-7)
    assert learning_schedule(31, r) == pytest.approx(0.5 * (1 + math.cos(math.pi / 40)), abs=1e-7)
    # with restarts the cosine starts after warm-up: no jump
    rw = AdamConfig(enable_restart=True)
    assert learning_schedule(100, rw) == 1.0


def test_decay_groups_follow_ggml_n_dims() -> None:
    opt = GGMLAdamW(make_params(), AdamConfig(decay=0.3, decay_min_ndim=2))
    wd = {id(p): decay for params, decay in opt.groups for p in params}
    assert [wd[id(p)] for p in opt.params] == [0.3, 0.3, 0.0, 0.0, 0.3]


# --- (3) exact resume -----------------------------------------------------------------------------
def _only_plain(obj: object) -> bool:
    if isinstance(obj, dict):
        return all(isinstance(k, str) and _only_plain(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return all(_only_plain(v) for v in obj)
    return obj is None or isinstance(obj, (bool, int, float, str, torch.Tensor))


@pytest.mark.parametrize("kernel", ["fused", "default"])
@pytest.mark.parametrize("k", [0, 1, 7])
def test_state_dict_resume_is_bit_exact(k: int, kernel: str, cpu_policy) -> None:
    if kernel == "default":
        _without_fused_kernel(cpu_policy)
    cfg = AdamConfig(alpha=1e-2, warmup=3, cos_decay_steps=8, enable_restart=True, opt_past=3,
                     opt_max_no_improvement=50)
    grads = random_grads(15)
    losses = [3.0 / (1 + 0.1 * i) + 0.05 * math.sin(i) for i in range(15)]

    def drive(opt: GGMLAdamW, params: list, start: int, stop: int) -> list[bool]:
        stops = []
        for i in range(start, stop):
            opt.zero_grad()
            for (_, p, _), g in zip(params, grads[i], strict=True):
                p.grad = torch.from_numpy(g.copy())
            opt.step()
            stops.append(opt.should_stop(losses[i]))
        return stops

    whole_params = make_params()
    whole = GGMLAdamW(whole_params, cfg)
    whole_stops = drive(whole, whole_params, 0, 15)

    first_params = make_params()
    first = GGMLAdamW(first_params, cfg)
    stops = drive(first, first_params, 0, k)
    state = first.state_dict()
    assert _only_plain(state)
    drive(first, first_params, k, k + 2)  # the saved state must not alias the live one
    resumed_params = [(n, torch.nn.Parameter(p.detach().clone()), d) for n, p, d in make_params()]
    # weights as they were at k: replay the first k steps on a copy to get them
    replay = GGMLAdamW(resumed_params, cfg)
    drive(replay, resumed_params, 0, k)
    resumed = GGMLAdamW(resumed_params, cfg)
    resumed.load_state_dict(state)
    assert resumed.iteration == k and resumed.sched == learning_schedule(k, cfg)
    stops += drive(resumed, resumed_params, k, 15)

    assert stops == whole_stops
    assert resumed.iteration == whole.iteration == 15
    for (_, a, _), (_, b, _) in zip(resumed_params, whole_params, strict=True):
        assert torch.equal(a.detach(), b.detach())
    sa, sb = resumed.state_dict(), whole.state_dict()
    for name in resumed.names:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sa["moments"][name][key], sb["moments"][name][key])
    assert sa["convergence"] == sb["convergence"]


def test_resume_takes_this_runs_hyperparameters() -> None:
    """As in llama.cpp, alpha/decay/schedule come from the new run's flags, not the checkpoint."""
    params = make_params()
    opt = run_ggtorch(AdamConfig(alpha=1e-2, warmup=0), random_grads(3), params)
    new = GGMLAdamW(params, AdamConfig(alpha=5e-3, warmup=0, decay=0.0))
    new.load_state_dict(opt.state_dict())
    assert new.lr == pytest.approx(5e-3 * learning_schedule(3, new.cfg), rel=1e-12)
    assert all(decay == 0.0 for _, decay in new.groups)


def test_resume_refuses_mismatches() -> None:
    params = make_params()
    state = run_ggtorch(AdamConfig(opt_past=2), random_grads(2), params).state_dict()
    with pytest.raises(BadFlag, match="--opt-past"):
        GGMLAdamW(make_params(), AdamConfig(opt_past=3)).load_state_dict(state)
    other = [(n + ".x", p, d) for n, p, d in make_params()]
    with pytest.raises(BadFlag, match="--rank"):
        GGMLAdamW(other, AdamConfig(opt_past=2)).load_state_dict(state)
    wrong = [(n, torch.nn.Parameter(torch.zeros(p.numel() + 1)), d) for n, p, d in make_params()]
    with pytest.raises(BadFlag, match="shape"):
        GGMLAdamW(wrong, AdamConfig(opt_past=2)).load_state_dict(state)


# --- (4) convergence tests ------------------------------------------------------------------------
def stop_index(cfg: AdamConfig, losses: list[float]) -> int | None:
    opt = GGMLAdamW(make_params(), cfg)
    for i, loss in enumerate(losses):
        if opt.should_stop(loss):
            return i
    return None


def test_defaults_never_stop() -> None:
    for losses in ([2.0] * 300, [5.0 - 0.01 * i for i in range(300)], [1.0 + 0.01 * i for i in range(300)]):
        assert stop_index(AdamConfig(), losses) is None


def test_epsf_stops_on_a_small_relative_change() -> None:
    cfg = AdamConfig(epsf=1e-3)
    assert stop_index(cfg, [2.0, 1.5, 1.4999, 1.0]) == 2  # |1.4999-1.5|/1.4999 < 1e-3
    assert stop_index(cfg, [2.0, 1.5, 1.4, 1.3]) is None


def test_opt_past_compares_losses_past_apart() -> None:
    cfg = AdamConfig(opt_past=3, opt_delta=1e-3)
    # the first loss only seeds the ring; loss j is compared with loss j-3 once j-1 >= past
    assert stop_index(cfg, [5.0, 4.0, 3.0, 2.0, 4.0, 1.0]) == 4  # 4.0 equals the loss 3 before
    assert stop_index(cfg, [5.0, 4.0, 3.0, 5.0, 0.5, 0.4]) is None  # losses 0 and 3: too early to test
    assert stop_index(cfg, [5.0, 4.0, 3.0, 2.0, 1.0, 0.5, 0.25, 1.0]) == 7


def test_max_no_improvement_counts_losses_without_a_new_best() -> None:
    cfg = AdamConfig(opt_max_no_improvement=2)
    assert stop_index(cfg, [3.0, 2.0, 2.5, 2.1, 1.0]) == 3
    assert stop_index(cfg, [3.0, 2.0, 2.5, 1.9, 2.0, 1.8, 1.7]) is None
    assert stop_index(cfg, [3.0, 3.0, 3.0]) == 2  # equal to the best is no improvement


# --- (5) configuration ---------------------------------------------------------------------------
def test_defaults_are_the_old_finetunes() -> None:
    d = AdamConfig()
    assert (d.alpha, d.min_alpha, d.decay, d.decay_min_ndim, d.beta1, d.beta2, d.gclip, d.eps, d.epsf) == \
        (1e-3, 0.0, 0.1, 2, 0.9, 0.999, 1.0, 1e-8, 0.0)
    assert (d.warmup, d.cos_decay_steps, d.cos_decay_restart, d.cos_decay_min, d.enable_restart) == \
        (100, 1000, 1.1, 0.1, False)
    assert (d.opt_past, d.opt_delta, d.opt_max_no_improvement) == (0, 1e-5, 0)
    assert AdamConfig.from_finetune(FinetuneConfig()) == d
    assert AdamConfig.from_finetune(FinetuneConfig(adam_alpha=3e-4, warmup=7)) == AdamConfig(alpha=3e-4, warmup=7)


@pytest.mark.parametrize("field, value, flag", [
    ("alpha", 0.0, "--adam-alpha"), ("alpha", -1e-3, "--adam-alpha"), ("alpha", float("nan"), "--adam-alpha"),
    ("min_alpha", -1e-4, "--adam-min-alpha"), ("min_alpha", 1.0, "--adam-min-alpha"),
    ("decay", -0.1, "--adam-decay"), ("decay_min_ndim", -1, "--adam-decay-min-ndim"),
    ("decay_min_ndim", 1.5, "--adam-decay-min-ndim"),
    ("beta1", 1.0, "--adam-beta1"), ("beta2", -0.5, "--adam-beta2"), ("gclip", -1.0, "--adam-gclip"),
    ("eps", -1e-8, "eps"), ("epsf", -1.0, "--adam-epsf"), ("warmup", -1, "--warmup"),
    ("cos_decay_steps", 0, "--cos-decay-steps"), ("cos_decay_restart", 0.9, "--cos-decay-restart"),
    ("cos_decay_min", 1.5, "--cos-decay-min"), ("enable_restart", "yes", "--enable-restart"),
    ("opt_past", -1, "--opt-past"), ("opt_delta", -1e-5, "--opt-delta"),
    ("opt_max_no_improvement", -2, "--opt-max-no-improvement"), ("alpha", "1e-3", "--adam-alpha"),
])
def test_bad_values_name_the_flag(field: str, value: object, flag: str) -> None:
    with pytest.raises(BadFlag, match=flag):
        AdamConfig(**{field: value})


def test_no_parameters_is_a_clear_error() -> None:
    with pytest.raises(BadFlag, match="nothing to train"):
        GGMLAdamW([], AdamConfig())
