"""``ggtorch demo``: the whole GGUF → finetune → llama.cpp adapter loop, offline, in about a minute.

Nothing is downloaded and the user gives no file: the texts come with every Python.

1. Vocabulary: a 1024-token sentencepiece BPE vocabulary (llama's SPM kind, byte fallback) is
   trained on the standard library's documentation (``pydoc_data.topics``) and written as a
   vocabulary-only GGUF.
2. Base model: a small llama is trained from scratch on that documentation (``ggtorch train``),
   written as F32 GGUF and quantized to Q8_0.
3. Finetune: LoRA adapters are trained on the Q8_0 base, which stays quantized, on a second
   text, The Zen of Python (``import this``); the loss is printed as it falls.
4. Output: the adapter in llama.cpp's GGUF LoRA format, and a greedy generation from the same
   prompt without and with it.

Every file lands in one folder, named at the end with the command lines to run next.
"""

from __future__ import annotations

import codecs
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import click
from gguf import GGUFValueType, Keys, TokenType

from ggtorch.api import GGUFModel, finetune, load_model, train
from ggtorch.cli.options import threads_option
from ggtorch.errors import BadFlag
from ggtorch.io.atomic import write_text
from ggtorch.io.gguf import write_gguf
from ggtorch.io.model_file import write_model
from ggtorch.models.config import ARCH
from ggtorch.training.trainer import StepResult, Trainer

BASE_PROMPT = "The "
LORA_PROMPT = "Beautiful is"


def documentation_text() -> str:
    """The reference documentation Python installs with pydoc (about 460 kB of English and code)."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[k] for k in sorted(topics))


def zen_text() -> str:
    """The Zen of Python, which ``import this`` prints (stored ROT13-encoded in ``this.s``)."""
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # importing `this` prints the poem
        import this
    return codecs.decode(this.s, "rot13") + "\n"


# sentencepiece piece kinds -> llama.cpp token types
def _token_type(sp: object, i: int) -> int:
    if sp.is_unknown(i):  # type: ignore[attr-defined]
        return TokenType.UNKNOWN
    if sp.is_control(i):  # type: ignore[attr-defined]
        return TokenType.CONTROL
    if sp.is_byte(i):  # type: ignore[attr-defined]
        return TokenType.BYTE
    if sp.is_unused(i):  # type: ignore[attr-defined]
        return TokenType.UNUSED
    return TokenType.NORMAL


def write_spm_vocab(path: str | os.PathLike[str], text: str, n_vocab: int = 1024, name: str = "ggtorch demo vocab",
                    ) -> Path:
    """Train a llama-style sentencepiece BPE vocabulary on ``text`` and write it as a vocabulary GGUF.

    The same settings as llama's tokenizer: BPE with byte fallback, no normalization, a dummy
    prefix space, <unk>/<s>/</s> = 0/1/2, BOS added. llama.cpp and ggtorch tokenize with the
    GGUF's tokens/scores/types, so the file is all either needs.
    """
    import io

    import sentencepiece as spm

    lines = [line for line in text.splitlines() if line.strip()]
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=n_vocab, model_type="bpe",
        byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False,
        add_dummy_prefix=True, split_digits=True, allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2,
        pad_id=-1, num_threads=1, minloglevel=2, max_sentence_length=1 << 16)
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    n = sp.vocab_size()
    metadata = {
        Keys.General.NAME: name,
        Keys.Tokenizer.MODEL: "llama",
        Keys.Tokenizer.LIST: [sp.id_to_piece(i) for i in range(n)],
        Keys.Tokenizer.SCORES: [float(sp.get_score(i)) for i in range(n)],
        Keys.Tokenizer.TOKEN_TYPE: [int(_token_type(sp, i)) for i in range(n)],
        Keys.Tokenizer.UNK_ID: sp.unk_id(),
        Keys.Tokenizer.BOS_ID: sp.bos_id(),
        Keys.Tokenizer.EOS_ID: sp.eos_id(),
        Keys.Tokenizer.ADD_BOS: True,
        Keys.Tokenizer.ADD_EOS: False,
    }
    # llama.cpp reads token types only as int32 (the writer's default for ints is uint32)
    types = {Keys.Tokenizer.TOKEN_TYPE: (GGUFValueType.ARRAY, GGUFValueType.INT32)}
    write_gguf(path, ARCH, metadata, [], value_types=types)  # vocabulary only, like llama.cpp's ggml-vocab-*.gguf
    return Path(path)


@dataclass
class DemoSettings:
    """Sizes and lengths of the demo run; the defaults take about a minute on 2 cores."""

    out_dir: Path = Path("ggtorch-demo")
    n_vocab: int = 1024
    embd: int = 128
    ff: int = 384
    head: int = 4
    layer: int = 4
    ctx: int = 64
    base_iterations: int = 300
    lora_iterations: int = 60
    lora_rank: int = 16
    threads: int | None = None
    seed: int = 1
    gen_tokens: int = 48


@dataclass
class DemoResult:
    """What the demo made and measured (also printed)."""

    out_dir: Path
    files: dict[str, Path] = field(default_factory=dict)
    base_loss: tuple[float, float] = (0.0, 0.0)
    lora_loss: tuple[float, float] = (0.0, 0.0)
    without_adapter: str = ""
    with_adapter: str = ""
    seconds: float = 0.0


class _Reporter:
    """Prints a training line about every tenth of a run (the first and last always)."""

    def __init__(self, say: Callable[[str], None], label: str, total: int) -> None:
        self.say, self.label, self.total = say, label, total
        self.every = max(1, total // 10)
        self.start = time.perf_counter()

    def on_step(self, trainer: Trainer, r: StepResult) -> None:
        done = r.iteration - (trainer.history[0].iteration - 1 if trainer.history else 0)
        if done == 1 or done % self.every == 0 or done == self.total:
            self.say(f"  {self.label} iter {done:4d}/{self.total}  loss {r.loss:7.4f}  "
                     f"{r.tokens_per_second:6.0f} tok/s  {time.perf_counter() - self.start:5.1f} s")


def run_demo(settings: DemoSettings | None = None, say: Callable[[str], None] = print) -> DemoResult:
    """Run the demo into ``settings.out_dir`` (created; files in it are overwritten)."""
    s = settings or DemoSettings()
    out = Path(s.out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadFlag(f"cannot create the output folder {out}: {e.strerror or e}; pass another --out") from None
    if not os.access(out, os.W_OK):
        raise BadFlag(f"the output folder {out} is not writable; pass another --out")
    t0 = time.perf_counter()
    result = DemoResult(out)
    files = result.files
    files["base text"] = out / "python-docs.txt"
    docs = documentation_text()
    write_text(files["base text"], docs)
    files["finetune text"] = out / "zen-of-python.txt"
    write_text(files["finetune text"], zen_text())

    say(f"1/4 vocabulary: sentencepiece BPE, {s.n_vocab} tokens, trained on Python's documentation")
    files["vocabulary"] = write_spm_vocab(out / "vocab.gguf", docs, s.n_vocab)

    say(f"2/4 base model from scratch: {s.layer} layers, n_embd {s.embd}, ctx {s.ctx}, "
        f"{s.base_iterations} iterations on {files['base text'].name}")
    files["base model (F32)"] = out / "base-f32.gguf"
    base_run = train(vocab_model=str(files["vocabulary"]), train_data=str(files["base text"]),
                     model_out=str(files["base model (F32)"]), checkpoint_out="", checkpoint_in="", overwrite=True,
                     log_file=str(out / "base-train-log.jsonl"), embd=s.embd, ff=s.ff, head=s.head, layer=s.layer,
                     ctx=s.ctx, batch=16, adam_iter=s.base_iterations, adam_alpha=0.003, warmup=20, init="scaled",
                     use_checkpointing=False, threads=s.threads, seed=s.seed, save_every=0,
                     callbacks=[_Reporter(say, "base", s.base_iterations)], progress=False, manage_process=True)
    result.base_loss = (base_run.history[0].loss, base_run.history[-1].loss)
    files["base model (Q8_0)"] = write_model(out / "base-q8_0.gguf", base_run.base.metadata,
                                             base_run.base.value_types, base_run.model_tensors(), "q8_0")
    base_run.close()
    say(f"    wrote {files['base model (F32)'].name} and {files['base model (Q8_0)'].name} "
        f"(loss {result.base_loss[0]:.2f} -> {result.base_loss[1]:.2f})")

    say(f"3/4 LoRA finetune of the Q8_0 model (kept quantized), rank {s.lora_rank}, {s.lora_iterations} "
        f"iterations on {files['finetune text'].name}")
    files["adapter"] = out / "lora-zen.gguf"
    lora_run = finetune(model_base=str(files["base model (Q8_0)"]), train_data=str(files["finetune text"]),
                        lora_out=str(files["adapter"]), checkpoint_out=str(out / "lora-checkpoint.gguf"),
                        checkpoint_in="", overwrite=True, log_file=str(out / "lora-train-log.jsonl"),
                        lora_r=s.lora_rank,
                        ctx=s.ctx, batch=8, adam_iter=s.lora_iterations, adam_alpha=0.003, warmup=5,
                        use_checkpointing=False, threads=s.threads, seed=s.seed, save_every=0,
                        callbacks=[_Reporter(say, "lora", s.lora_iterations)], progress=False,
                        manage_process=True)
    result.lora_loss = (lora_run.history[0].loss, lora_run.history[-1].loss)
    lora_run.close()
    files["checkpoint"] = out / "lora-checkpoint.gguf"
    say(f"    wrote {files['adapter'].name} (llama.cpp's GGUF LoRA format; loss {result.lora_loss[0]:.2f} -> "
        f"{result.lora_loss[1]:.2f})")

    say(f"4/4 greedy generation from {LORA_PROMPT!r} with the Q8_0 model")
    model: GGUFModel = load_model(files["base model (Q8_0)"], keep_quantized=True)
    result.without_adapter = model.generate(LORA_PROMPT, s.gen_tokens)
    result.with_adapter = model.load_adapter(files["adapter"]).generate(LORA_PROMPT, s.gen_tokens)
    result.seconds = time.perf_counter() - t0
    return result


def next_steps(result: DemoResult) -> list[str]:
    """The command lines a user runs next, on the demo's files and then on their own model."""
    f = result.files
    return [
        "# run the demo's model with its adapter (llama-cli takes the same --lora flag)",
        f"ggtorch generate -m {f['base model (Q8_0)']} --lora {f['adapter']} -p {LORA_PROMPT!r} -n 48",
        "# the same finetune from the command line (the old llama.cpp flags)",
        f"ggtorch finetune --model-base {f['base model (Q8_0)']} --train-data {f['finetune text']} "
        f"--lora-r 16 -c 64 -b 8 --adam-iter 60 --adam-alpha 0.003 "
        f"--checkpoint-out {result.out_dir / 'checkpoint-ITERATION.gguf'} "
        f"--lora-out {result.out_dir / 'lora-ITERATION.gguf'}",
        "# your own model: LoRA on a GGUF of any family in the README (quantized bases stay quantized)",
        "ggtorch finetune --model-base YOUR-MODEL.gguf --train-data YOUR-TEXT.txt -c 256 -b 4 --adam-iter 200",
        "ggtorch chat -m YOUR-MODEL.gguf --lora ggml-lora-LATEST-f32.gguf",
        "# or merge it into a new GGUF",
        "ggtorch export-lora -m YOUR-MODEL.gguf --lora ggml-lora-LATEST-f32.gguf -o merged.gguf",
    ]


# --- the `ggtorch demo` command ----------------------------------------------------------
@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-o", "--out", "out_dir", default="ggtorch-demo", show_default=True,
              help="Folder for every file the demo writes (created; files in it are overwritten).")
@click.option("--base-iterations", type=click.IntRange(min=1), default=DemoSettings.base_iterations,
              show_default=True, help="Training steps of the base model from scratch.")
@click.option("--lora-iterations", type=click.IntRange(min=1), default=DemoSettings.lora_iterations,
              show_default=True, help="LoRA finetune steps.")
@threads_option
@click.option("-s", "--seed", type=int, default=DemoSettings.seed, show_default=True, help="Seed of every random draw.")
def demo(out_dir: str, base_iterations: int, lora_iterations: int, threads: int | None, seed: int) -> None:
    """Offline demo (about a minute): train a small GGUF model, quantize it, LoRA-finetune it, compare.

    \b
    Uses only text every Python carries: a base model is trained from scratch on Python's own
    documentation, written as GGUF and quantized to Q8_0; LoRA adapters are trained on the
    quantized model with The Zen of Python and written in llama.cpp's adapter format; then the
    model continues the same prompt without and with the adapter.
    """
    settings = DemoSettings(out_dir=Path(out_dir), base_iterations=base_iterations, lora_iterations=lora_iterations,
                            threads=threads, seed=seed)
    result = run_demo(settings, say=click.echo)
    for title, text in (("without the adapter", result.without_adapter), ("with the adapter", result.with_adapter)):
        click.echo(f"\n{title}:")
        for line in (LORA_PROMPT + text).rstrip().splitlines():
            click.echo(f"  {line}")
    click.echo(f"\ndone in {result.seconds:.0f} s. Files in {result.out_dir.resolve()}:")
    for label, path in result.files.items():
        click.echo(f"  {path.name:<22} {label}")
    click.echo("\nnext:")
    for line in next_steps(result):
        click.echo(f"  {line}")
