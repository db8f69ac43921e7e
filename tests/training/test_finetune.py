"""``ggtorch finetune`` end to end on the real stories260K model: learning, exact resume, outputs, refusals."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from ggtorch.training.config import FinetuneConfig
from ggtorch.training.trainer import Trainer
from tests.helpers import losses, run_cli
from tests.llama_models import GGML_TYPE_F32, llama_cpp_logits

SMALL = ["-c", "32", "-b", "4", "--warmup", "2", "--adam-alpha", "0.01", "--seed", "7"]


def run(args: list[str], cwd: Path) -> tuple[int, str]:
    result = run_cli(args, cwd, catch_exceptions=False)
    return result.exit_code, result.output


def run_whole_and_resumed(common: list[str], tmp_path: Path) -> tuple[Path, Path]:
    """``common`` for 6 iterations in folder one; for 3, then resumed for 3, in folder two."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    code, out = run([*common, "-n", "6", "--checkpoint-in", ""], one)
    assert code == 0, out
    code, out = run([*common, "-n", "3", "--checkpoint-in", ""], two)
    assert code == 0, out
    code, out = run([*common, "-n", "3", "--checkpoint-in", "checkpoint-LATEST.gguf"], two)
    assert code == 0, out
    assert "resumed from checkpoint-LATEST.gguf at iteration 3" in out
    return one, two


def test_resume_is_exact(stories260k: Path, texts: dict[str, Path], tmp_path: Path) -> None:
    """6 iterations in one run == 3, stop, resume for 3: same adapter bytes and loss sequence."""
    common = ["finetune", "--model-base", str(stories260k), "--train-data", str(texts["train"]), *SMALL,
              "--save-every", "0", "--lora-dropout", "0.1"]
    one, two = run_whole_and_resumed(common, tmp_path)
    assert (one / "ggml-lora-LATEST-f32.gguf").read_bytes() == (two / "ggml-lora-LATEST-f32.gguf").read_bytes()
    assert (one / "ggml-lora-6-f32.gguf").read_bytes() == (two / "ggml-lora-6-f32.gguf").read_bytes()
    assert losses(one / "checkpoint-log.jsonl") == losses(two / "checkpoint-log.jsonl")
    assert len(losses(one / "checkpoint-log.jsonl")) == 6


@pytest.mark.parametrize("base", ["F32", "Q8_0"])
def test_finetune_lowers_heldout_loss(base: str, stories260k: Path, stories_q8: Path, texts: dict[str, Path],
                                      tmp_path: Path) -> None:
    model = stories260k if base == "F32" else stories_q8
    config = FinetuneConfig(model_base=str(model), train_data=str(texts["train"]), val_data=str(texts["heldout"]),
                            ctx=64, batch=8, adam_iter=40, warmup=5, adam_alpha=0.01, seed=3, save_every=0,
                            checkpoint_in="", checkpoint_out="", lora_out=str(tmp_path / "a-ITERATION.gguf"),
                            log_file=str(tmp_path / "log.jsonl"))
    trainer = Trainer(config)
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    trainer.close()
    print(f"{base}: held-out loss {before:.4f} -> {after:.4f}")
    assert after < before - 0.1, (before, after)
    assert (tmp_path / "a-40.gguf").is_file() and (tmp_path / "a-LATEST.gguf").is_file()


@pytest.fixture(scope="module")
def finetuned(stories260k: Path, stories_q8: Path, random_llama: Callable[..., Path], texts: dict[str, Path],
              tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Path, Trainer]]:
    """A short finetune per base (cached): (base path, adapter path, trainer with the trained model)."""
    bases = {"stories-F32": lambda: stories260k, "stories-Q8_0": lambda: stories_q8,
             "random-Q4_0": lambda: random_llama("Q4_0"), "random-Q4_K_M": lambda: random_llama("Q4_K_M")}
    cache: dict[str, tuple[Path, Path, Trainer]] = {}

    def get(name: str) -> tuple[Path, Path, Trainer]:
        if name not in cache:
            base = bases[name]()
            out = tmp_path_factory.mktemp(name) / "lora.gguf"
            config = FinetuneConfig(model_base=str(base), train_data=str(texts["train"]), ctx=16, batch=2,
                                    adam_iter=4, warmup=0, adam_alpha=0.02, seed=1, save_every=0, checkpoint_in="",
                                    checkpoint_out="", lora_out=str(out), use_checkpointing=False,
                                    dtype="f32")  # its logits are checked against llama.cpp's f32
            trainer = Trainer(config)
            trainer.train()
            trainer.close()
            cache[name] = (base, out, trainer)
        return cache[name]

    return get


# The base-parity tolerances of tests/models/test_llama.py (why: see there).
PARITY = {"stories-F32": 1e-4, "stories-Q8_0": 0.6, "random-Q4_0": 0.6, "random-Q4_K_M": 0.6}


@pytest.mark.parametrize("scale", [1.0, 0.5])
@pytest.mark.parametrize("name", list(PARITY))
def test_llama_cpp_runs_the_finetuned_adapter(finetuned: Callable[[str], tuple[Path, Path, Trainer]], name: str,
                                              scale: float) -> None:
    """After a short finetune, llama.cpp + the written adapter == ggtorch's base + adapter, on held-out tokens.

    The random untied models adapt every matrix kind, token_embd and output included.
    """
    import llama_cpp

    from ggtorch.lora import lora_modules
    from ggtorch.lora.adapter_file import read_adapter

    base, adapter_path, trainer = finetuned(name)
    kinds = {n.split(".")[-2] if n.startswith("blk.") else n.split(".")[0] for n in read_adapter(adapter_path).pairs}
    expected = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_down", "ffn_up"}
    assert kinds == (expected | {"token_embd", "output"} if name.startswith("random") else expected)
    n_vocab = trainer.model_config.n_vocab
    tokens = [1] + np.random.default_rng(5).integers(3, n_vocab, 23).tolist()
    modules = [m for _, m in lora_modules(trainer.model)]
    scales = [m.scale for m in modules]
    try:
        for m in modules:
            m.scale *= scale
        with torch.no_grad():
            trainer.model.eval()
            ours = trainer.model(torch.tensor([tokens]))[0].numpy()
    finally:
        for m, s in zip(modules, scales, strict=True):
            m.scale = s
    llm = llama_cpp.Llama(model_path=str(base), lora_path=str(adapter_path), lora_scale=scale, logits_all=True,
                          n_ctx=32, n_threads=2, verbose=False, type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
    ref = llama_cpp_logits(llm, tokens)
    assert np.abs(ours - ref).max() <= PARITY[name]
    del llm
    plain = llama_cpp.Llama(model_path=str(base), logits_all=True, n_ctx=32, n_threads=2, verbose=False,
                            type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
    effect = np.abs(ref - llama_cpp_logits(plain, tokens)).max()
    print(f"{name} scale {scale}: max |ggtorch - llama.cpp| {np.abs(ours - ref).max():.3g}, "
          f"adapter effect {effect:.3g}")
    assert effect > 2 * PARITY[name]  # the adapter moves the logits well beyond the tolerance


def test_help_lists_old_flags_in_groups() -> None:
    code, out = run(["finetune", "--help"], Path.cwd())
    assert code == 0
    for heading in ("Model and data", "Outputs and checkpoints", "Training", "LoRA", "Optimizer (ggml AdamW)",
                    "Samples (as the old finetune built them)", "Accepted for compatibility, ignored"):
        assert heading in out
    for flag in ("--adam-decay-min-ndim", "--cos-decay-restart", "--rank-ffn_gate", "--fill-with-next-samples",
                 "--use-checkpointing / --no-checkpointing", "-ngl", "--only-write-lora", "--device"):
        assert flag in out, flag


def test_old_command_line_runs_with_notes(stories260k: Path, texts: dict[str, Path], tmp_path: Path) -> None:
    """A command line of the old program, ggml-only flags included, runs (underscore spellings too)."""
    code, out = run(["finetune", "--model-base", str(stories260k), "--train-data", str(texts["train"]),
                     "--threads", "1", "--adam-iter", "2", "--batch", "2", "--ctx", "16", "--lora-r", "2",
                     "--rank-ffn_gate", "3", "--no-flash", "-ngl", "0", "--mem-compute", "8",
                     "--checkpoint-out", "ck-ITERATION.gguf", "--lora-out", "l-ITERATION.gguf"], tmp_path)
    assert code == 0, out
    assert "--use-flash / --no-flash is a ggml" in out and "--n-gpu-layers is a ggml" in out
    assert {"ck-2.gguf", "ck-LATEST.gguf", "l-2.gguf", "l-LATEST.gguf"} <= {p.name for p in tmp_path.iterdir()}


@pytest.mark.parametrize("args, message", [
    (["--train-data", "missing.txt"], "missing.txt"),
    (["--train-data", "{empty}"], "empty"),
    (["--checkpoint-out", "no/such/dir/ck.gguf"], "does not exist"),
    (["--checkpoint-in", "{model}"], "is a model, not a training checkpoint"),
    (["--ctx", "0"], "--ctx must be at least 1"),
])
def test_bad_input_is_one_clear_line(args: list[str], message: str, stories260k: Path, texts: dict[str, Path],
                                     tmp_path: Path) -> None:
    args = [a.format(empty=texts["empty"], model=stories260k) for a in args]
    base = ["finetune", "--model-base", str(stories260k), "--train-data", str(texts["train"]), "-n", "1",
            "-c", "16", "-b", "1"]
    code, out = run(base + args, tmp_path)
    assert code == 1
    assert message in out and "Traceback" not in out
    assert out.count("error:") == 1


def test_checkpoint_of_another_base_is_refused(stories260k: Path, random_llama: Callable[..., Path],
                                               texts: dict[str, Path], tmp_path: Path) -> None:
    code, out = run(["finetune", "--model-base", str(stories260k), "--train-data", str(texts["train"]), "-n", "1",
                     "-c", "16", "-b", "1"], tmp_path)
    assert code == 0, out
    code, out = run(["finetune", "--model-base", str(random_llama("F32")), "--train-data", str(texts["train"]),
                     "-n", "1", "-c", "16", "-b", "1", "--checkpoint-in", "checkpoint-LATEST.gguf"], tmp_path)
    assert code == 1 and "trained on base model 'stories260K'" in out


def test_short_text_and_long_context_warn(stories260k: Path, texts: dict[str, Path], tmp_path: Path) -> None:
    code, out = run(["finetune", "--model-base", str(stories260k), "--train-data", str(texts["tiny"]), "-n", "1",
                     "-c", "600", "-b", "1", "--no-checkpointing"], tmp_path)
    assert code == 0, out
    assert "above the model's training context 512" in out
    assert "fewer than the context of 600" in out


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(stories260k: Path, texts: dict[str, Path],
                                                           tmp_path: Path) -> None:
    code, out = run(["finetune", "--model-base", str(stories260k), "--train-data", str(texts["train"]), "-n", "2",
                     "-c", "16", "-b", "1", "--save-every", "1"], tmp_path)
    assert code == 0, out
    code, out = run(["finetune", "--model-base", str(stories260k), "--train-data", str(texts["train"]), "-n", "20",
                     "-c", "16", "-b", "1", "--save-every", "1", "--checkpoint-in", "checkpoint-LATEST.gguf",
                     "--adam-alpha", "1e30", "--adam-gclip", "0", "--warmup", "0"], tmp_path)
    assert code == 1 and ("the loss became" in out or "the trained weights hold NaN or inf" in out), out
    assert "Traceback" not in out
    from ggtorch.io.checkpoint import load_checkpoint

    latest = load_checkpoint(tmp_path / "checkpoint-LATEST.gguf")
    assert all(torch.isfinite(t).all() for t in latest.tensors.values())
    assert latest.iteration >= 2
    assert f"the last checkpoint with finite weights, checkpoint-LATEST.gguf (iteration {latest.iteration})" in out


def test_plot_draws_the_loss_curve(stories260k: Path, texts: dict[str, Path], tmp_path: Path) -> None:
    code, out = run(["finetune", "--model-base", str(stories260k), "--train-data", str(texts["train"]), "-n", "3",
                     "-c", "16", "-b", "2"], tmp_path)
    assert code == 0, out
    code, out = run(["plot", "checkpoint-log.jsonl", "-o", "loss.png"], tmp_path)
    assert code == 0, out
    png = (tmp_path / "loss.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 5000


def test_only_write_lora_writes_the_checkpoints_adapter(stories260k: Path, texts: dict[str, Path],
                                                        tmp_path: Path) -> None:
    code, out = run(["finetune", "--model-base", str(stories260k), "--train-data", str(texts["train"]), "-n", "3",
                     "-c", "16", "-b", "2", "--rank-wq", "0"], tmp_path)
    assert code == 0, out
    trained = (tmp_path / "ggml-lora-3-f32.gguf").read_bytes()
    for p in tmp_path.glob("ggml-lora-*"):
        p.unlink()
    code, out = run(["finetune", "--model-base", str(stories260k), "--train-data", str(texts["train"]),
                     "-c", "16", "-b", "2", "--rank-wq", "0", "--checkpoint-in", "checkpoint-LATEST.gguf",
                     "--only-write-lora", "--lora-out", "out-ITERATION.gguf"], tmp_path)
    assert code == 0, out
    assert (tmp_path / "out-3.gguf").read_bytes() == trained  # named with the checkpoint's iteration
    assert not list(tmp_path.glob("checkpoint-4*"))  # no training happened


def test_bf16_autocast_trains(stories260k: Path, texts: dict[str, Path], tmp_path: Path) -> None:
    config = FinetuneConfig(model_base=str(stories260k), train_data=str(texts["train"]), ctx=32, batch=4,
                            adam_iter=6, warmup=1, adam_alpha=0.01, seed=2, dtype="bf16", checkpoint_in="",
                            checkpoint_out="", lora_out="", log_file=str(tmp_path / "log.jsonl"))
    trainer = Trainer(config)
    results = trainer.train()
    trainer.close()
    assert all(np.isfinite(r.loss) for r in results)
    a = [p for _, p, _ in trainer.params][1]
    assert a.dtype == torch.float32 and a.abs().sum() > 0  # LoRA weights stay f32 under autocast


@pytest.mark.parametrize(("dtype", "speed", "warned"), [("bf16", 0.3, True), ("f16", 1.4, False), ("f32", 0.3, False)])
def test_a_compute_dtype_slower_than_f32_on_this_cpu_is_named(dtype: str, speed: float, warned: bool,
                                                             stories260k: Path, texts: dict[str, Path],
                                                             tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run warns with the measured speed when --dtype multiplies slower than f32 (the probe itself:
    tests/ops/test_dtypes.py); f32 is never probed."""
    from ggtorch.ops.dtypes import DTYPES
    from ggtorch.training import run

    probed: list[torch.dtype] = []
    monkeypatch.setattr(run, "cpu_matmul_speed_vs_f32", lambda d: probed.append(d) or speed)
    config = FinetuneConfig(model_base=str(stories260k), train_data=str(texts["train"]), ctx=32, batch=2,
                            adam_iter=1, dtype=dtype, checkpoint_in="", checkpoint_out="", lora_out="",
                            log_file=str(tmp_path / "log.jsonl"))
    trainer = Trainer(config)
    trainer.close()
    assert probed == ([] if dtype == "f32" else [DTYPES[dtype]])
    named = [w for w in trainer.warnings if w.startswith(f"--dtype {dtype}: ")]
    assert len(named) == warned, trainer.warnings
    if warned:
        assert "at 0.30x its f32 speed" in named[0] and "--dtype f32 trains faster here" in named[0]


def test_bf16_compute_holds_float_base_matrices_in_bf16_with_the_same_result(stories260k: Path,
                                                                              texts: dict[str, Path],
                                                                              tmp_path: Path) -> None:
    """Autocast rounds every frozen f32 weight to bf16 in every step; the default rounds it once at
    load instead. Same numbers (losses and adapter bit for bit), half the memory, no per-step cast."""
    runs = {}
    for base_dtype in ("quantized", "f32"):
        config = FinetuneConfig(model_base=str(stories260k), train_data=str(texts["train"]), ctx=32, batch=4,
                                adam_iter=4, warmup=1, adam_alpha=0.01, seed=2, dtype="bf16", checkpoint_in="",
                                checkpoint_out="", lora_out="", base_dtype=base_dtype,
                                log_file=str(tmp_path / f"log-{base_dtype}.jsonl"))
        trainer = Trainer(config)
        runs[base_dtype] = ([r.loss for r in trainer.train()], [p.detach().clone() for _, p, _ in trainer.params],
                            trainer.model.layers[0].attn.q.base.weight.dtype)
        trainer.close()
    assert runs["quantized"][2] == torch.bfloat16 and runs["f32"][2] == torch.float32
    assert runs["quantized"][0] == runs["f32"][0]
    assert all(torch.equal(a, b) for a, b in zip(runs["quantized"][1], runs["f32"][1], strict=True))


def test_ctrl_c_saves_and_a_second_ctrl_c_exits_at_once(stories260k: Path, texts: dict[str, Path],
                                                        tmp_path: Path) -> None:
    import signal
    import subprocess
    import sys
    import time

    cmd = [sys.executable, "-m", "ggtorch", "finetune", "--model-base", str(stories260k), "--train-data",
           str(texts["train"]), "-n", "100000", "-c", "16", "-b", "2", "--save-every", "0", "-t", "1",
           "--tensorboard", "board"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = tmp_path / "checkpoint-log.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and (not log.is_file() or len(losses(log)) < 3):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "interrupted at iteration" in out and "Traceback" not in out
    from ggtorch.io.checkpoint import load_checkpoint

    latest = load_checkpoint(tmp_path / "checkpoint-LATEST.gguf")
    assert latest.iteration == len(losses(log)) >= 3
    from tests.training.test_log import events

    # --tensorboard's writer was flushed and closed on the way out: it holds every iteration the log does
    assert [value for _, value in events(tmp_path / "board")["train/loss"]] == pytest.approx(losses(log), rel=1e-6)

    # A second Ctrl-C while the first is being handled: out at once, LATEST still the good one.
    proc = subprocess.Popen(cmd + ["--checkpoint-in", "checkpoint-LATEST.gguf"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    n_before = len(losses(log))
    while time.time() < deadline + 120 and len(losses(log)) < n_before + 2:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "Traceback" not in out
    load_checkpoint(tmp_path / "checkpoint-LATEST.gguf")  # loadable whatever the timing


def test_block_checkpointing_on_and_off_gives_the_same_gradients(stories260k: Path) -> None:
    """enable_block_checkpointing recomputes each Block in backward (the same numbers), and
    disable_block_checkpointing puts the stored-activation forward back."""
    from ggtorch.lora import LoraConfig, attach_lora, trainable_parameters
    from ggtorch.models.loader import load_model_file
    from ggtorch.models.model import Block
    from ggtorch.training.trainer import disable_block_checkpointing, enable_block_checkpointing

    model = load_model_file(stories260k).model
    attach_lora(model, LoraConfig(rank=2), seed=1)
    params = [p for _, p, _ in trainable_parameters(model)]
    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    ids = torch.tensor([[1, 5, 9, 33, 70, 2], [1, 4, 8, 16, 32, 64]])
    blocks = [m for m in model.modules() if isinstance(m, Block)]

    def grads() -> list[torch.Tensor]:
        for p in params:
            p.grad = None
        model(ids).float().logsumexp(-1).sum().backward()
        return [p.grad.clone() for p in params]

    calls = []
    for b in blocks:
        b.register_forward_hook(lambda m, args, out: calls.append(m))
    plain = grads()
    assert len(calls) == len(blocks)
    assert enable_block_checkpointing(model) == len(blocks) > 0
    checkpointed = grads()
    assert len(calls) == 2 * len(blocks) + len(blocks)  # each block again in backward
    assert disable_block_checkpointing(model) == len(blocks) and disable_block_checkpointing(model) == 0
    again = grads()
    assert len(calls) == 4 * len(blocks)
    for a, b, c in zip(plain, checkpointed, again, strict=True):
        assert a.abs().max() > 0
        torch.testing.assert_close(b, a, rtol=0, atol=0)
        torch.testing.assert_close(c, a, rtol=0, atol=0)


def _count_decoded_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A one-item list counting the rows quant.autograd decodes from now on (set it to 0 between counts)."""
    from ggtorch.quant import autograd

    decoded_rows = [0]
    real = autograd.dequantize

    def counting(raw, ggml_type, shape, dtype=torch.float32, name=None, out=None):  # noqa: ANN001, ANN202
        decoded_rows[0] += shape[0]
        return real(raw, ggml_type, shape, dtype, name, out)

    monkeypatch.setattr(autograd, "dequantize", counting)
    return decoded_rows


@pytest.mark.parametrize("chunk_bytes", [None, 4096], ids=["whole matrices", "row chunks"])
def test_checkpointing_decodes_a_quantized_base_twice_per_step_with_the_same_gradients(
        stories_q8: Path, chunk_bytes: int | None, monkeypatch: pytest.MonkeyPatch, cpu_policy) -> None:
    """Inside a checkpointed block, each quantized matrix decoded by the recomputation is kept for its own
    backward: per step every block matrix is decoded twice (forward, recomputation), not three times, and
    the gradients are the same bit for bit (also when W is multiplied in row chunks)."""
    from ggtorch.lora import LoraConfig, attach_lora, trainable_parameters
    from ggtorch.models.loader import load_model_file
    from ggtorch.models.model import Block
    from ggtorch.quant.modules import QuantLinear
    from ggtorch.training.trainer import enable_block_checkpointing

    if chunk_bytes is not None:
        cpu_policy(dequantize_chunk_bytes=chunk_bytes)  # 16 rows of 64 f32 values per chunk
    model = load_model_file(stories_q8, keep_quantized=True).model
    attach_lora(model, LoraConfig(rank=2), seed=1)
    params = [p for _, p, _ in trainable_parameters(model)]
    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.05, generator=torch.Generator().manual_seed(p.numel()))
    blocks = [b for b in model.modules() if isinstance(b, Block)]
    block_rows = sum(m.shape[0] for b in blocks for m in b.modules() if isinstance(m, QuantLinear))
    # the first block's q/k/v read the frozen embedding's rows, which take no gradient: their backward
    # never needs W, so they are decoded twice either way
    assert not any(p.requires_grad for p in model.tok_embd.parameters())
    first_qkv_rows = sum(getattr(blocks[0].attn, n).base.shape[0] for n in ("q", "k", "v"))
    decoded_rows = _count_decoded_rows(monkeypatch)
    ids = torch.tensor([[1, 5, 9, 33, 70, 2], [1, 4, 8, 16, 32, 64]])
    enable_block_checkpointing(model)

    def step() -> tuple[list[torch.Tensor], int]:
        for p in params:
            p.grad = None
        decoded_rows[0] = 0
        model(ids).float().logsumexp(-1).sum().backward()
        return [p.grad.clone() for p in params], decoded_rows[0]

    kept, kept_rows = step()
    cpu_policy(keep_dequantized_bytes=0)  # decode again in backward, as before
    again, again_rows = step()
    assert again_rows - kept_rows == block_rows - first_qkv_rows  # one decode of every other block matrix saved
    for a, b in zip(kept, again, strict=True):
        assert a.abs().max() > 0
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_keep_dequantized_mib_decodes_once_per_step_with_the_same_training(
        stories_q8: Path, texts: dict[str, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """--keep-dequantized-mib without checkpointing: each forward keeps the quantized matrices it decodes
    (up to the budget, in the order they run; a partial budget: tests/quant/test_autograd.py) for their
    backward. With room for all of them, a step decodes every block matrix once instead of twice; the trained
    LoRA weights are the same bit for bit after two steps either way. The second step decodes into the
    memory the first kept its matrices in."""
    from ggtorch.models.model import Block
    from ggtorch.quant.modules import QuantLinear

    decoded_rows = _count_decoded_rows(monkeypatch)

    def train(mib: int) -> tuple[list[int], list[torch.Tensor], int, list[list[int]]]:
        config = FinetuneConfig(model_base=str(stories_q8), train_data=str(texts["train"]), ctx=16, batch=2,
                                adam_iter=2, warmup=0, adam_alpha=0.02, seed=1, save_every=0, checkpoint_in="",
                                checkpoint_out="", lora_out=str(tmp_path / f"lora-{mib}.gguf"),
                                use_checkpointing=False, keep_dequantized_mib=mib)
        trainer = Trainer(config, log_records=False)
        rows, memory = [], []
        for _ in range(2):
            decoded_rows[0] = 0
            trainer.step()
            rows.append(decoded_rows[0])
            memory.append([m.data_ptr() for m in trainer._kept_matrices])
        weights = [p.detach().clone() for _, p, _ in trainer.params]
        matrices = [m for b in trainer.model.modules() if isinstance(b, Block)
                    for m in b.modules() if isinstance(m, QuantLinear)]
        trainer.close()
        return rows, weights, sum(m.shape[0] for m in matrices), memory

    plain_rows, plain, block_rows, _ = train(0)
    kept_rows, kept, _, memory = train(64)
    assert kept_rows[0] == kept_rows[1] and plain_rows[0] == plain_rows[1]
    assert memory[0] and memory[0] == memory[1]
    # the first block's q/k/v take no input gradient (the frozen embedding's rows): never kept, as before
    assert block_rows // 2 < plain_rows[0] - kept_rows[0] < block_rows
    for a, b in zip(plain, kept, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("flags", [{"use_checkpointing": True}, {"base_dtype": "f32", "use_checkpointing": False}])
def test_keep_dequantized_mib_refuses_settings_where_it_does_nothing(flags: dict[str, object]) -> None:
    from ggtorch.errors import BadFlag

    with pytest.raises(BadFlag, match="--keep-dequantized-mib"):
        FinetuneConfig(keep_dequantized_mib=16, **flags)
