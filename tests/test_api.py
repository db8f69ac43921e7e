"""The notebook API (``import ggtorch``): each call checked against llama.cpp or a known output."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

import ggtorch
from ggtorch import FinetuneConfig, GGUFModel, StepResult, Trainer
from tests.llama_models import llama_cpp_logits, open_llama_cpp
from tests.lora.test_adapter_file import llama_cpp_with_adapter
from tests.models.test_generate import REFERENCE_TEXT


@pytest.fixture(scope="session")
def text(texts: dict[str, Path]) -> Path:
    return texts["train"]


def small_run(stories260k: Path, text: Path, out: Path, **options: object) -> FinetuneConfig:
    defaults: dict[str, object] = dict(
        model_base=str(stories260k), train_data=str(text), ctx=32, batch=4, adam_iter=6, adam_alpha=0.01, warmup=2,
        seed=5, save_every=0, threads=1, checkpoint_in="", checkpoint_out=str(out / "ck-ITERATION.gguf"),
        lora_out=str(out / "lora-ITERATION.gguf"), dtype="f32")  # logits checked against llama.cpp's f32
    return FinetuneConfig(**{**defaults, **options})  # type: ignore[arg-type]


def test_every_public_name_is_exported_documented_and_typed() -> None:
    for name in ggtorch.__all__:
        obj = getattr(ggtorch, name)
        assert obj.__doc__ and obj.__doc__.strip(), f"ggtorch.{name} has no docstring"
        if callable(obj) and not isinstance(obj, type):
            hints = obj.__annotations__
            assert "return" in hints, f"ggtorch.{name} has no return annotation"
    assert (Path(ggtorch.__file__).parent / "py.typed").is_file()


def test_load_model_generates_llama_cpps_known_text(stories260k: Path) -> None:
    model = ggtorch.load_model(stories260k)
    assert model.generate("", 120).startswith(REFERENCE_TEXT)
    quantized_path_model = ggtorch.load_model(stories260k, dtype="bf16")
    assert quantized_path_model.model.layers[0].attn.q.weight.dtype == torch.bfloat16


def test_perplexity_equals_llama_cpps_logits(stories260k: Path, text: Path) -> None:
    model = ggtorch.load_model(stories260k)
    body = text.read_text()[:3000]
    result = model.perplexity(body, n_ctx=64)
    tokens = model.tokenizer.encode(body, add_special=True)
    llm = open_llama_cpp(stories260k, n_ctx=64)
    nll, count = 0.0, 0
    for c in range(len(tokens) // 64):  # llama-perplexity: BOS first, score the second half
        chunk = [model.tokenizer.bos_id] + tokens[c * 64 + 1:(c + 1) * 64]
        logits = llama_cpp_logits(llm, chunk).astype(np.float64)
        for i in range(32, 63):
            row = logits[i]
            nll += np.log(np.exp(row - row.max()).sum()) + row.max() - row[tokens[c * 64 + i + 1]]
            count += 1
    assert result.n_scored == count
    assert result.perplexity == pytest.approx(math.exp(nll / count), rel=1e-4)


def test_bad_device_and_dtype_name_the_fix(stories260k: Path) -> None:
    with pytest.raises(ggtorch.BadFlag, match="cpu"):
        ggtorch.load_model(stories260k, device="cuda:7")
    with pytest.raises(ggtorch.BadFlag, match="f32"):
        ggtorch.load_model(stories260k, dtype="f64")
    with pytest.raises(ggtorch.BadFlag, match="model_base"):
        ggtorch.finetune(train_data="x.txt")


class Recorder:
    def __init__(self, stop_at: int | None = None) -> None:
        self.steps: list[int] = []
        self.evals: list[tuple[int, float]] = []
        self.saves: list[list[Path]] = []
        self.stop_at = stop_at

    def on_step(self, trainer: Trainer, result: StepResult) -> None:
        self.steps.append(result.iteration)
        if result.iteration == self.stop_at:
            trainer.request_stop()

    def on_eval(self, trainer: Trainer, iteration: int, loss: float) -> None:
        self.evals.append((iteration, loss))

    def on_save(self, trainer: Trainer, paths: list[Path]) -> None:
        self.saves.append(paths)


def test_finetune_with_callbacks_stops_and_resumes_in_the_same_process(stories260k: Path, text: Path,
                                                                       tmp_path: Path) -> None:
    """Stop from a callback at 3, train 3 more on the same Trainer == 6 uninterrupted iterations."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    whole = Recorder()
    run = ggtorch.finetune(small_run(stories260k, text, tmp_path / "a", val_split=0.1, eval_every=3),
                           callbacks=[whole], progress=False)
    assert whole.steps == [1, 2, 3, 4, 5, 6]
    assert [it for it, _ in whole.evals] == [3, 6, 6]  # every 3, and once more at the end of the run
    assert [p.name for p in whole.saves[-1]] == ["ck-6.gguf", "ck-LATEST.gguf", "lora-6.gguf", "lora-LATEST.gguf"]

    stopping = Recorder(stop_at=3)
    split = ggtorch.finetune(small_run(stories260k, text, tmp_path / "b", val_split=0.1, eval_every=3),
                             callbacks=[stopping], progress=False)
    assert stopping.steps == [1, 2, 3] and split.iteration == 3
    assert (tmp_path / "b" / "lora-3.gguf").is_file()  # a stop saves
    split.train(3)
    assert stopping.steps == [1, 2, 3, 4, 5, 6]
    assert [r.loss for r in split.history] == [r.loss for r in run.history]
    assert (tmp_path / "a" / "lora-6.gguf").read_bytes() == (tmp_path / "b" / "lora-6.gguf").read_bytes()
    ax = ggtorch.plot_losses(split)  # drawn from the run's log: both halves, and the evaluations
    train_line = ax.get_lines()[0]
    assert list(train_line.get_xdata()) == [1, 2, 3, 4, 5, 6]
    assert list(train_line.get_ydata()) == pytest.approx([r.loss for r in run.history])
    import matplotlib.pyplot as plt

    plt.close("all")


def test_trained_model_and_adapter_match_llama_cpp(stories260k: Path, text: Path, tmp_path: Path) -> None:
    run = ggtorch.finetune(small_run(stories260k, text, tmp_path), progress=False)
    tuned = GGUFModel.from_trainer(run)
    adapter_path = tuned.save_adapter(tmp_path / "api-adapter.gguf")
    tokens = tuned.tokenizer.encode("ROMEO: But soft, what light", add_special=True)
    with torch.no_grad():
        ours = tuned.model(torch.tensor([tokens]))[0].numpy()
    theirs = llama_cpp_logits(llama_cpp_with_adapter(stories260k, adapter_path), tokens)
    np.testing.assert_allclose(ours, theirs, atol=1e-3)
    # the same adapter loaded onto a fresh model through the API, and merged into a GGUF
    fresh = ggtorch.load_model(stories260k).load_adapter(adapter_path)
    with torch.no_grad():
        np.testing.assert_allclose(fresh.model(torch.tensor([tokens]))[0].numpy(), theirs, atol=1e-3)
    ggtorch.merge_adapters(stories260k, [(adapter_path, 1.0)], tmp_path / "merged.gguf", outtype="f32")
    merged = llama_cpp_logits(open_llama_cpp(tmp_path / "merged.gguf", n_ctx=64), tokens)
    # one adapter given as its path alone, as a text: the same file (it was read as one path per letter)
    ggtorch.merge_adapters(stories260k, str(adapter_path), tmp_path / "merged-one.gguf", outtype="f32")
    assert (tmp_path / "merged-one.gguf").read_bytes() == (tmp_path / "merged.gguf").read_bytes()
    np.testing.assert_allclose(merged, theirs, atol=1e-3)
    assert np.abs(theirs - llama_cpp_logits(open_llama_cpp(stories260k, n_ctx=64), tokens)).max() > 0.05


def test_add_lora_trains_only_the_adapter(stories260k: Path) -> None:
    model = ggtorch.load_model(stories260k).add_lora(rank=2, ranks={"attn_q": 8, "ffn_down": 0})
    trainable = {n for n, p in model.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n for n in trainable)
    assert any("attn.q.lora_a" in n for n in trainable) and not any("ffn.down" in n for n in trainable)
    q = model.model.layers[0].attn.q
    assert q.lora_a.shape[0] == 8 and model.model.layers[0].attn.k.lora_a.shape[0] == 2
    # rank 8 on 5 layers' q (64 -> 64) + rank 2 on k, v, o, gate, up (n_embd 64, kv 32, ff 172)
    assert model.trainable_parameters == sum(p.numel() for p in model.model.parameters() if p.requires_grad)


def test_progress_bar_counts_iterations(stories260k: Path, text: Path, tmp_path: Path) -> None:
    bar = ggtorch.ProgressBar()
    ggtorch.finetune(small_run(stories260k, text, tmp_path, adam_iter=4), callbacks=[bar], progress=False)
    assert bar.bar is not None and bar.bar.n == 4 and bar.bar.total == 4
    bar.close()


def test_finetune_on_a_list_of_records(stories260k: Path, tmp_path: Path) -> None:
    """records= takes the place of train_data: the answers-only loss of the same records as the Trainer's."""
    records = [{"prompt": f"What is {i} plus {i}?", "response": f"It is {2 * i}."} for i in range(12)]
    options = dict(model_base=str(stories260k), train_data="", ctx=64, batch=2, adam_iter=3, seed=4, threads=1,
                   checkpoint_in="", checkpoint_out="", lora_out=str(tmp_path / "qa.gguf"), save_every=0)
    run = ggtorch.finetune(records=records, val_records=records[:2], progress=False, **options)
    twin = Trainer(FinetuneConfig(**options, overwrite=True), records=records, val_records=records[:2],
                   log_records=False)
    assert [r.loss for r in run.history] == [r.loss for r in twin.train()]
    twin.close()
    assert run.evaluate() is not None and (tmp_path / "qa.gguf").is_file()


@pytest.mark.parametrize("data, option", [
    ({"records": [{"prompt": "a", "response": "b"}]}, {"train_data": "other.txt"}),
    ({"val_records": [{"prompt": "a", "response": "b"}]}, {"val_data": "val.txt"}),
    ({"val_records": [{"prompt": "a", "response": "b"}]}, {"val_split": 0.1}),
])
def test_records_and_a_data_option_together_are_refused(data: dict, option: dict) -> None:
    """The records would win and the log would name the file: one source of the run's data, said before any work."""
    keyword, name = next(iter(data)), next(iter(option))
    with pytest.raises(ggtorch.BadFlag, match=rf"^{keyword}= and {name}= both give the run's data; pass one of them"):
        ggtorch.finetune(model_base="m.gguf", run=False, progress=False, **data, **option)


@pytest.mark.parametrize("scale", [1e30, -1e30, math.nan, 101.0])
def test_an_adapter_scale_without_meaning_is_refused(tmp_path: Path, scale: float) -> None:
    """export-lora's --lora-scaled and the API's (path, scale) share one check, before any file is read."""
    with pytest.raises(ggtorch.BadFlag, match=r"the scale must be in \[-100, 100\]"):
        ggtorch.merge_adapters("base.gguf", [("adapter.gguf", scale)], tmp_path / "out.gguf")


def test_single_steps_without_train(stories260k: Path, text: Path, tmp_path: Path) -> None:
    """A notebook may drive the run one step at a time: step() == the steps train() would take."""
    (tmp_path / "s").mkdir()
    stepped = ggtorch.finetune(small_run(stories260k, text, tmp_path / "s"), run=False, progress=False)
    losses = [stepped.step().loss for _ in range(3)]
    (tmp_path / "t").mkdir()
    trained = ggtorch.finetune(small_run(stories260k, text, tmp_path / "t", adam_iter=3), progress=False)
    assert losses == [r.loss for r in trained.history] and stepped.iteration == 3
    stepped.close()
