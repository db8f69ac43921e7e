"""bench/bench_step_profile.py counts a real step's products in full and in the right kind.

The profile is only worth reading if every op lands in one kind and the product FLOPs it reports
are the step's: checked here on stories260K's LoRA step against the matrix work counted from the
model's own layers, and on a quantized base, where every decode's ops must count as dequantization.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.test_bench_report import _bench_module


@pytest.fixture(scope="module")
def profile() -> Any:
    _bench_module("bench_vs_peft")  # the module the profile imports its helpers from, by that name
    return _bench_module("bench_step_profile")


def test_product_dims_follow_each_ops_operands(profile: Any) -> None:
    assert profile.product_dims("mm", [(8, 3), (3, 5)]) == (1, 8, 3, 5)
    assert profile.product_dims("addmm_", [(8, 5), (8, 4), (4, 5)]) == (1, 8, 4, 5)
    # oneDNN's x @ w.T over x's leading dims
    assert profile.product_dims("_linear_pointwise", [(2, 6, 3), (7, 3)]) == (1, 12, 3, 7)
    assert profile.product_dims("bmm", [(4, 8, 3), (4, 3, 5)]) == (4, 8, 3, 5)
    assert profile.product_dims("baddbmm_", [(4, 8, 5), (4, 8, 3), (4, 3, 5)]) == (4, 8, 3, 5)
    assert profile.product_dims("add", [(8, 3), (8, 3)]) is None


def test_op_kinds(profile: Any) -> None:
    kind = profile.op_kind
    assert kind("mm", False, (1, 1024, 768, 2048), None) == "matrix products"
    assert kind("mm", False, (1, 1024, 768, 4), None) == "low-rank products"
    assert kind("bmm", False, (48, 128, 64, 256), None) == "attention products"
    assert kind("mm", False, (1, 1024, 768, 2048), "dequantization") == "dequantization"  # inside a decode: its op
    assert kind("empty", False, None, "low-rank products") == "low-rank products"
    assert kind("transpose", True, None, None) == "views"
    assert kind("_fused_adamw_", False, None, None) == "optimizer"
    assert kind("_to_copy", False, None, None) == "casts and copies"
    assert kind("exp_", False, None, None) == kind("softmax", False, None, None) == "softmax, exp, max"
    assert kind("silu", False, None, None) == "elementwise and reductions"


def _trainer(model: Path, text: Path, tmp_path: Path) -> Any:
    from bench_vs_peft import finetune_config

    from ggtorch.training.trainer import Trainer

    spec = {"model": str(model), "text": str(text), "ctx": 64, "batch": 2,
            "threads": 1, "warmup": 1, "steps": 4, "checkpointing": False, "dtype": "f32",
            "log_file": str(tmp_path / "log.jsonl")}
    return Trainer(finetune_config(spec), log_records=False)


def _matrices(trainer: Any) -> list[tuple[str, int, int]]:
    """(name, out, in) of every base matrix a token passes through, from the model's own modules."""
    from ggtorch.lora.layers import LoRALinear

    out = []
    for name, module in trainer.model.named_modules():
        if isinstance(module, LoRALinear):
            base = module.base
            o, i = base.shape if hasattr(base, "shape") else tuple(base.weight.shape)
            out.append((name, o, i))
    return out


def _matrix_flops(trainer: Any, tokens: int) -> float:
    """The base's and output's product FLOPs of one LoRA step, counted from the model's own layers: every
    matrix once forward and once for its input's gradient (the output matrix by the fused loss's slabs), except
    the first block's q, k and v, whose input (the embedding's normed rows) nothing trainable precedes."""
    layers = _matrices(trainer)
    config = trainer.model.config
    assert len(layers) == 7 * config.n_layer
    first = sum(o * i for name, o, i in layers if name in ("layers.0.attn.q", "layers.0.attn.k", "layers.0.attn.v"))
    every = sum(o * i for _, o, i in layers) + config.n_vocab * config.n_embd
    return 2.0 * tokens * (2 * every - first)


def test_a_lora_step_s_products_are_all_counted(profile: Any, stories260k: Path, shakespeare: Path,
                                                tmp_path: Path) -> None:
    trainer = _trainer(stories260k, shakespeare, tmp_path)
    trainer.step()
    _, tally = profile.profile_trainer(trainer, 1)
    assert tally.flops["matrix products"] == _matrix_flops(trainer, 2 * 64)
    assert tally.flops["attention products"] > 0
    # LoRA's six rank-r products per layer (in ggtorch.ops.lowrank's C loops, or torch's where it cannot be built),
    # but the first block's q, k and v, whose input takes no gradient: five
    rank, tokens = trainer.model.layers[0].attn.q.rank, 2 * 64
    first = sum(i for name, _, i in _matrices(trainer) if name in ("layers.0.attn.q", "layers.0.attn.k",
                                                                       "layers.0.attn.v"))
    low_rank = 2.0 * tokens * rank * (3 * sum(o + i for _, o, i in _matrices(trainer)) - first)
    assert tally.flops["low-rank products"] == pytest.approx(low_rank)
    assert tally.seconds["dequantization"] == 0.0  # an F32 base decodes nothing
    assert sum(tally.seconds.values()) == pytest.approx(sum(tally.ops.values()))
    from ggtorch.ops import fused

    if fused._library() is not None and fused._library().ggtorch_rope_built():  # fused.c's loops, ggtorch:: ops
        for name in ("rms_norm", "rms_norm_backward", "glu", "glu_backward", "rope", "softmax_slab_"):
            kind, label, _ = profile.c_op(name)
            assert tally.ops[(kind, label)] > 0, name


def test_a_quantized_base_s_decodes_are_dequantization(profile: Any, stories_q8: Path, shakespeare: Path,
                                                       tmp_path: Path) -> None:
    trainer = _trainer(stories_q8, shakespeare, tmp_path)
    trainer.step()
    _, tally = profile.profile_trainer(trainer, 1)
    assert tally.seconds["dequantization"] > 0
    # the products of the decoded matrices are the same work as an F32 base's, and none runs inside a decode
    assert tally.flops["matrix products"] == _matrix_flops(trainer, 2 * 64)
    assert tally.flops["dequantization"] == 0.0
    # Q8_0 decodes in native.c's loops (the ggtorch::dequantize_ op) where a compiler built them: their time counts
    from ggtorch.quant import native

    if native.native_types():
        assert tally.ops[profile.c_op("dequantize_")[:2]] > 0
    assert sum(tally.seconds.values()) == pytest.approx(sum(tally.ops.values()))


def test_the_section_replaces_its_own_only(profile: Any, tmp_path: Path) -> None:
    import bench_vs_peft

    report = "# Benchmarks\n\n## Results\n\nrows\n\n" + profile.HEADING + " --threads 2`)\n\nold\n\n## Mixture\n\nmoe\n"
    new = profile.HEADING + " --threads 1`)\n\nnew\n"
    out = bench_vs_peft.replace_section(report, profile.HEADING, new)
    assert "old" not in out and out.count(profile.HEADING) == 1 and out.endswith("new\n")
    assert "## Results\n\nrows" in out and "## Mixture\n\nmoe" in out
    assert bench_vs_peft.replace_section("# Benchmarks\n", profile.HEADING, new).startswith(
        "# Benchmarks\n\n" + profile.HEADING)
    # write_section does the same to a file, and starts one that does not exist yet
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(report)
    bench_vs_peft.write_section(path, profile.HEADING, new)
    assert path.read_text() == out
    fresh = tmp_path / "new.md"
    bench_vs_peft.write_section(fresh, profile.HEADING, new)
    assert fresh.read_text() == bench_vs_peft.replace_section("", profile.HEADING, new)


def test_bench_vs_peft_keeps_the_section_when_it_rewrites_the_report(profile: Any) -> None:
    import bench_vs_peft

    section = profile.section([], "python bench/bench_step_profile.py --threads 2", 2)
    report = "# Benchmarks\n\n## Results\n\nrows\n\n" + section
    kept = bench_vs_peft.kept_sections(report)
    assert kept.strip() == section.strip() and "rows" not in kept


@pytest.mark.parametrize("routing", [True, False])
def test_the_gemm_peak_leaves_ggtorch_s_routing_as_it_was(profile: Any, routing: bool, cpu_policy) -> None:
    """child_gemm forces oneDNN for its own column; the profile then trains in the same process, which must
    route its products as ggtorch does on this CPU."""
    import bench_vs_peft

    from ggtorch.ops import policy

    cpu_policy(onednn_f32=routing)
    peak = bench_vs_peft.child_gemm({"threads": 1, "rows": 8, "shapes": [(16, 16)]}, bench_vs_peft.Turns(False))
    assert policy.current("cpu").onednn_f32 is routing
    assert peak["f32"] > 0 and peak["bf16"] > 0
