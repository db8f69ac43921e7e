"""The Python API: what a notebook calls, and what the ``ggtorch`` commands are thin layers over.

Three objects cover the work:

- :func:`load_model` → :class:`GGUFModel`: a GGUF llama in torch with its tokenizer; generate,
  perplexity, attach trainable LoRA, load/save adapters, merge them in.
- :func:`finetune` / :func:`train` → :class:`~ggtorch.training.trainer.Trainer`: a training run configured
  by the same options as the CLI (a :class:`~ggtorch.training.config.FinetuneConfig` or keyword
  arguments), with callbacks, a progress bar that renders as a widget in Jupyter, stoppable
  (``trainer.request_stop()``) and resumable (``trainer.train(more)``, or a new run with
  ``checkpoint_in``).
- Files: :func:`merge_adapters` (llama.cpp's export-lora), :func:`export_peft` and
  :func:`import_peft` (PEFT folders), :func:`read_adapter`/:func:`write_adapter`,
  :func:`load_checkpoint`.

Example::

    import ggtorch
    base = ggtorch.load_model("stories260K.gguf")
    print(base.generate("Once upon a time", n_tokens=40))
    run = ggtorch.finetune(model_base="stories260K.gguf", train_data="tinyshakespeare.txt",
                           ctx=64, batch=8, adam_iter=40, lora_out="lora.gguf", checkpoint_out="")
    ggtorch.plot_losses(run)
    print(ggtorch.GGUFModel.from_trainer(run).generate("Once upon a time", n_tokens=40))
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import torch

from ggtorch.data.conversation import ChatPiece, Conversation
from ggtorch.data.packing import read_template_file
from ggtorch.errors import BadData, BadFlag
from ggtorch.export.merge import MergePlan, MergeSource, merge_to_gguf, read_source, validate_source
from ggtorch.export.peft import export_peft as _export_peft
from ggtorch.export.peft import import_peft as _import_peft
from ggtorch.io.checkpoint import Checkpoint, load_checkpoint
from ggtorch.io.gguf import GGUFFile, read_gguf
from ggtorch.io.model_file import write_model
from ggtorch.lora import LoraConfig, attach_lora, count_trainable_parameters, lora_modules, merge_lora
from ggtorch.lora.adapter_file import LoraAdapter, adapter_from_model, load_adapter_into, read_adapter, write_adapter
from ggtorch.models.config import ModelConfig
from ggtorch.models.generate import (
    PerplexityResult,
    SamplingParams,
    check_n_tokens,
    computing,
    generate,
    perplexity,
)
from ggtorch.models.init import init_tensors, new_config, new_metadata
from ggtorch.models.loader import load_model_file
from ggtorch.models.model import Transformer
from ggtorch.models.tokenizer import Tokenizer
from ggtorch.ops import policy
from ggtorch.ops.dtypes import DTYPES
from ggtorch.training.config import FinetuneConfig, RunConfig, TrainConfig
from ggtorch.training.log import LoggedRun, draw_runs, plot_loss, pyplot
from ggtorch.training.trainer import Callback, Sample, StepResult, Trainer, resolve_device

__all__ = ["Checkpoint", "GGUFModel", "LoraAdapter", "ProgressBar", "export_peft", "finetune", "import_peft",
           "load_checkpoint", "load_model", "merge_adapters", "new_model", "plot_losses", "read_adapter", "train",
           "write_adapter"]


ADAPTER_SCALE_MAX = 100.0
"""The largest scale (either sign) an adapter is applied or merged with: 1 applies it as trained, -1 takes it back
out, 0.5 halves it. Far beyond, the merged weights leave the base's range (a scale of 1e30 wrote weights of 4.8e26
and a model whose perplexity is nan)."""


AdapterSpec = str | os.PathLike[str] | tuple[str | os.PathLike[str], float]
"""An adapter to apply or merge: its path, or (path, user scale) as ``--lora-scaled FILE SCALE``."""


def adapter_scale(path: str | os.PathLike[str], scale: Any) -> float:
    """The user scale of adapter ``path`` (export-lora's ``--lora-scaled FILE:SCALE``, the API's ``(path, scale)``),
    refused outside ±:data:`ADAPTER_SCALE_MAX`: the one check of the CLI and the API."""
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise BadFlag(f"--lora-scaled {path}:{scale}: the scale must be a number") from None
    if not -ADAPTER_SCALE_MAX <= value <= ADAPTER_SCALE_MAX:
        raise BadFlag(f"--lora-scaled {path}:{scale}: the scale must be in [-{ADAPTER_SCALE_MAX:g}, "
                      f"{ADAPTER_SCALE_MAX:g}] (1 applies the adapter as trained, -1 removes it), got {value:g}")
    return value


def read_lora_source(spec: AdapterSpec, base: GGUFFile | None = None) -> MergeSource:
    """The LoRA ``spec`` names, with its scale checked: the one reader of ``--lora`` for every command and the API.
    ``base``: the model it is for (a PEFT folder is read against it)."""
    path, scale = (spec[0], adapter_scale(spec[0], spec[1])) if isinstance(spec, tuple) else (spec, 1.0)
    return read_source(path, scale, base)


def read_lora_sources(specs: Sequence[AdapterSpec], base: GGUFFile) -> list[MergeSource]:
    """The adapters ``specs`` name, each checked against ``base`` as llama.cpp checks them on load."""
    sources = [read_lora_source(spec, base) for spec in specs]
    for src in sources:
        validate_source(src, base)
    return sources


def _torch_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``dtype`` as a torch dtype; ``auto``: the device's (bf16 on CUDA from Ampere, else f32)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return DTYPES[policy.auto_dtype(device)]
    if dtype not in DTYPES:
        raise BadFlag(f"dtype '{dtype}' is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


@dataclass
class GGUFModel:
    """A GGUF model in torch: the module, its tokenizer and config, and the file it came from."""

    model: Transformer
    tokenizer: Tokenizer
    config: ModelConfig
    gguf: GGUFFile
    autocast: torch.dtype | None = None
    """The dtype generate and perplexity compute in under autocast: a bf16 or f16 run's, whose model holds its float
    matrices in that dtype beside an f32 residual stream (None: the model's own dtypes)."""
    _chat: Conversation | None = field(default=None, init=False, repr=False)
    """The conversation :meth:`chat` continues (its KV cache), made on first use."""

    @classmethod
    def from_trainer(cls, trainer: Trainer) -> GGUFModel:
        """The model a run is training (LoRA attached), to generate or evaluate with mid-run, computing as the run
        does (a bf16 run's model under bf16 autocast; call ``model`` itself under the same autocast)."""
        dtype = DTYPES[trainer.config.dtype]
        return cls(trainer.model, trainer.tokenizer, trainer.model_config, trainer.base,
                   autocast=dtype if dtype != torch.float32 else None)

    def _computing(self) -> contextlib.AbstractContextManager[None]:
        """Eval mode (and the run's autocast) while generate or perplexity runs; training mode as it was after."""
        return computing(self.model, self.autocast)

    @property
    def device(self) -> torch.device:
        return self.model.output_norm.weight.device

    def generate(self, prompt: str = "", n_tokens: int = 64, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = True) -> str:
        """The text the model writes after ``prompt`` (BOS added as llama.cpp does; greedy by default)."""
        with self._computing():
            return generate(self.model, self.tokenizer, prompt, n_tokens, temperature, top_k, top_p, seed,
                            stop_at_eos)

    def perplexity(self, text: str, n_ctx: int = 512, batch_size: int = 1) -> PerplexityResult:
        """llama-perplexity's number for ``text`` (comparable with llama.cpp's output)."""
        tokens = self.tokenizer.encode(text, add_special=True)
        bos = self.tokenizer.bos_id if tokens and tokens[0] == self.tokenizer.bos_id else None
        with self._computing():
            return perplexity(self.model, tokens, n_ctx, bos_id=bos, batch_size=batch_size)

    def conversation(self, system: str | None = None,
                     chat_template: str | os.PathLike[str] | None = None) -> Conversation:
        """A chat with this model, rendered with its chat template (or the template file ``chat_template``):
        ``send(text)`` streams a reply, ``ask(text)`` returns it, and the KV cache is kept between turns."""
        if chat_template is not None:
            source, name = read_template_file(chat_template), f"chat template {chat_template}"
        else:
            source, name = self.gguf.get("tokenizer.chat_template"), "model's chat template (tokenizer.chat_template)"
            if source is None:
                raise BadData(f"{self.gguf.path} has no chat template (tokenizer.chat_template); pass one with "
                              "--chat-template FILE (chat_template= in Python)")
        return Conversation(self.model, self.tokenizer, source, name, system=system, autocast=self.autocast)

    def chat_stream(self, messages: Sequence[Mapping[str, Any]], n_tokens: int = 1024, temperature: float = 0.0,
                    top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> Iterator[ChatPiece]:
        """The reply to ``messages`` (``{"role", "content"}`` dicts, the last one the user's) as it is written:
        pieces of text, each saying whether it is reasoning (``<think>``) or answer. The model's template
        renders them; a call that continues the previous call's conversation reuses its KV cache."""
        check_n_tokens(n_tokens)
        params = SamplingParams(temperature, top_k, top_p, seed)
        if self._chat is None:
            self._chat = self.conversation()
        return self._chat.reply_to(messages, params, n_tokens)

    def chat(self, messages: Sequence[Mapping[str, Any]], n_tokens: int = 1024, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = None) -> str:
        """The answer to ``messages`` (greedy by default; a reasoning model's thinking left out: see
        :meth:`chat_stream`)."""
        return "".join(p.text for p in self.chat_stream(messages, n_tokens, temperature, top_k, top_p, seed)
                       if not p.thinking)

    def add_lora(self, rank: int = 4, alpha: float | None = None, ranks: Mapping[str, int] | None = None,
                 dropout: float = 0.0, seed: int = 0) -> GGUFModel:
        """Freeze the model and attach trainable LoRA (``ranks`` per tensor kind, e.g. ``{"attn_q": 8}``).

        Kinds are GGUF's: attn_q, attn_k, attn_v, attn_output, ffn_gate, ffn_up, ffn_down,
        token_embd, output (norms only by explicit rank). A MoE model's routed experts (ffn_*_exps) default to
        rank x 8 / their number, at least 1 (``--rank-exps``'s default). Returns self.
        """
        config = LoraConfig(rank=rank, alpha=alpha, ranks=dict(ranks or {}), dropout=dropout)
        attach_lora(self.model, config, seed=seed)
        self.model.to(self.device)
        return self

    def load_adapter(self, *adapters: AdapterSpec) -> GGUFModel:
        """Apply LoRA adapters as llama.cpp's ``--lora`` / ``--lora-scaled`` do: paths, or (path, scale) pairs.

        A path is a GGUF adapter, a PEFT folder (read against this model), a ggtorch training checkpoint (its
        adapter, norm gains included) or an old finetune's adapter or checkpoint. Adapters are summed, each with
        its scale; one made for another model is refused, naming both. Returns self."""
        if not adapters:
            raise BadFlag("load_adapter needs at least one adapter (a GGUF adapter, a PEFT folder or a checkpoint)")
        return self._apply(read_lora_sources(adapters, self.gguf))

    def _apply(self, sources: Sequence[MergeSource]) -> GGUFModel:
        load_adapter_into(self.model, self.gguf, [(s.adapter, s.user_scale) for s in sources if s.adapter.pairs],
                          [(s.norms, s.user_scale) for s in sources if s.norms])
        self.model.to(self.device)
        return self

    def adapter(self, metadata: Mapping[str, Any] | None = None, drop_norms: bool = False) -> LoraAdapter:
        """The attached LoRA as an adapter for this model's GGUF file."""
        if not lora_modules(self.model):
            raise BadFlag("the model has no LoRA attached; call add_lora() or load_adapter() first")
        return adapter_from_model(self.model, self.gguf, dict(metadata or {}), drop_norms=drop_norms)

    def save_adapter(self, path: str | os.PathLike[str], dtype: str = "f32",
                     metadata: Mapping[str, Any] | None = None) -> Path:
        """Write the attached LoRA as a GGUF adapter llama.cpp loads (``--lora path``)."""
        return write_adapter(path, self.adapter(metadata), dtype)

    def merge_lora(self) -> GGUFModel:
        """Fold the attached LoRA into the weights (dequantized weights become floats). Returns self."""
        merge_lora(self.model)
        return self

    @property
    def trainable_parameters(self) -> int:
        return count_trainable_parameters(self.model)

    def weight_bytes(self) -> int:
        """Bytes of every parameter and buffer (quantized blocks counted as stored; shared storage once)."""
        seen: set[int] = set()
        total = 0
        for t in [*self.model.parameters(), *self.model.buffers()]:
            key = t.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
        return total


def load_model(path: str | os.PathLike[str], *, device: str | torch.device = "auto",
               dtype: str | torch.dtype = "auto", keep_quantized: bool = False,
               lora: AdapterSpec | Sequence[AdapterSpec] | None = None) -> GGUFModel:
    """Open a GGUF model (memory-mapped) and build it on ``device`` (``auto``: CUDA, else MPS, else the CPU).

    ``keep_quantized=True`` keeps quantized matrices as ggml blocks, dequantized on the fly
    (a fraction of the memory); otherwise every weight becomes ``dtype`` (f32, bf16 or f16; ``auto``: bf16 where
    the device multiplies it natively, else f32). ``lora``: adapters to apply (see :meth:`GGUFModel.load_adapter`),
    read and checked against the file before the weights are built.
    """
    torch_device = resolve_device(str(device))
    if isinstance(lora, (str, os.PathLike)) or (isinstance(lora, tuple) and len(lora) == 2
                                                and isinstance(lora[1], (int, float))):
        lora = [lora]  # one adapter given alone, with or without its scale
    sources = read_lora_sources(list(lora), read_gguf(path)) if lora else []  # checked before the weights are built
    loaded = load_model_file(path, device=torch_device, dtype=_torch_dtype(dtype, torch_device),
                             keep_quantized=keep_quantized)
    model = GGUFModel(loaded.model, loaded.tokenizer, loaded.config, loaded.gguf)
    return model._apply(sources) if sources else model


class ProgressBar(Callback):
    """A tqdm progress bar over the run's iterations (a widget in Jupyter, text in a terminal).

    The bar shows the loss, throughput and the latest validation loss (and answer accuracy), with --sample-prompt's
    samples written above it; pass it in ``callbacks`` or let :func:`finetune` add one.
    """

    def __init__(self, total: int | None = None, leave: bool = True) -> None:
        from tqdm.auto import tqdm

        self._tqdm = tqdm
        self.total = total
        self.leave = leave
        self.bar: Any = None
        self.last_eval: float | None = None
        self.last_accuracy: float | None = None

    def on_step(self, trainer: Trainer, result: StepResult) -> None:
        if self.bar is None:
            total = self.total or getattr(trainer, "_target_iteration", trainer.config.adam_iter)
            self.bar = self._tqdm(total=total, initial=result.iteration - 1, unit="it", leave=self.leave,
                                  desc="finetune" if trainer.lora_config is not None else "train")
        postfix = {"loss": f"{result.loss:.4f}", "tok/s": f"{result.tokens_per_second:.0f}"}
        if self.last_eval is not None:
            postfix["val"] = f"{self.last_eval:.4f}"
        if self.last_accuracy is not None:
            postfix["val acc"] = f"{self.last_accuracy:.3f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

    def on_eval(self, trainer: Trainer, iteration: int, loss: float) -> None:
        self.last_eval = loss
        self.last_accuracy = (trainer.last_eval_metrics or {}).get("answer_accuracy")

    def on_sample(self, trainer: Trainer, samples: list[Sample]) -> None:
        """Each sample above the bar (tqdm.write keeps the bar whole)."""
        for sample in samples:
            for line in sample.lines():
                self._tqdm.write(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


C = TypeVar("C", bound=RunConfig)


def _config(config_cls: type[C], config: C | None, options: Mapping[str, Any]) -> C:
    """``config`` (or the defaults) with ``options`` applied; an unknown option names the closest one."""
    config_cls.check_names(options, f"ggtorch.{config_cls.command}()")
    if config is None:
        return config_cls(**options)
    return replace(config, **options) if options else config


def _run(config: RunConfig, callbacks: Sequence[Callback], progress: bool, run: bool,
         records: Sequence[Mapping[str, Any]] | None = None,
         val_records: Sequence[Mapping[str, Any]] | None = None, manage_process: bool = False) -> Trainer:
    bar = ProgressBar() if progress else None
    trainer = Trainer(config, [*callbacks, *([bar] if bar else [])], records=records, val_records=val_records,
                      manage_process=manage_process)
    if run:
        try:
            trainer.train()
            trainer.evaluate()
        finally:
            if bar is not None:
                bar.close()
            trainer.log.close()
    return trainer


def finetune(config: FinetuneConfig | None = None, *, callbacks: Sequence[Callback] = (), progress: bool = True,
             run: bool = True, records: Sequence[Mapping[str, Any]] | None = None,
             val_records: Sequence[Mapping[str, Any]] | None = None, manage_process: bool = False,
             **options: Any) -> Trainer:
    """A LoRA finetune, configured as ``ggtorch finetune`` is: ``options`` are FinetuneConfig's fields.

    ``options`` override ``config`` (or FinetuneConfig's defaults, llama.cpp's old ones); an
    unknown one is an error naming the closest option. With
    ``run=False`` the Trainer is returned before training, to call ``train(n)`` step by step.
    Training again with the same Trainer continues where it stopped; the log is reopened.
    ``records`` (and ``val_records``) train on a list of dicts instead of ``train_data``: chat
    (``{"messages": [...]}``) or prompt/response records, as in docs/chat-data.md.
    ``manage_process=True`` tunes the process as the ``ggtorch`` command does (glibc keeps freed memory for the
    next step; torch's thread count follows the cores other processes leave free while the run lives); without
    it a notebook's process stays as it was.
    """
    config = _config(FinetuneConfig, config, options)
    if not config.model_base:
        raise BadFlag("model_base (--model-base) is required: the GGUF model to finetune")
    for keyword, passed, option in (("records", records, "train_data"), ("val_records", val_records, "val_data"),
                                    ("val_records", val_records, "val_split")):
        if passed is not None and config.given(option) and getattr(config, option):  # '' names no data
            raise BadFlag(f"{keyword}= and {option}= both give the run's data; pass one of them")
    return _run(config, callbacks, progress, run, records, val_records, manage_process)


def train(config: TrainConfig | None = None, *, callbacks: Sequence[Callback] = (), progress: bool = True,
          run: bool = True, manage_process: bool = False, **options: Any) -> Trainer:
    """Train every weight, as ``ggtorch train`` does: a new model (``vocab_model=``) or a full finetune.

    ``options`` are TrainConfig's fields and override ``config``, and ``manage_process`` is as in :func:`finetune`.
    """
    return _run(_config(TrainConfig, config, options), callbacks, progress, run, manage_process=manage_process)


def new_model(vocab: str | os.PathLike[str], out: str | os.PathLike[str], *, embd: int = 256, ff: int = 768,
              head: int = 8, head_kv: int | None = None, layer: int = 4, ctx: int = 512, init: str = "scaled",
              outtype: str = "f32", seed: int = 0) -> Path:
    """Write an untrained llama GGUF over ``vocab``'s tokenizer (any GGUF with one), as ``outtype``.

    What ``ggtorch train --vocab-model`` starts from; useful for sizing and memory experiments.
    ``init='ggml'`` is train-text-from-scratch's init, ``'scaled'`` GPT-2's.
    """
    vocab_file = read_gguf(vocab)
    config = new_config(vocab_file, n_embd=embd, n_ff=ff, n_head=head, n_head_kv=head_kv or head, n_layer=layer,
                        n_ctx=ctx)
    metadata, value_types = new_metadata(vocab_file, config, Path(out).stem)
    return write_model(out, metadata, value_types, init_tensors(config, seed, init), outtype)


def plot_losses(run: Trainer | str | os.PathLike[str], ax: Any = None) -> Any:
    """Draw the training (and validation) loss of a run or of a log file; returns the matplotlib Axes.

    In a notebook the figure shows inline. A Trainer is drawn from its log file when it has one
    (every iteration since the first run), else from the steps it ran in this process.
    """
    if ax is None:
        _, ax = pyplot().subplots(figsize=(7, 4))
    if isinstance(run, Trainer):
        log_path = run.log.path
        if log_path is not None and Path(log_path).is_file():
            plot_loss(log_path, ax=ax)
        else:
            draw_runs(ax, [LoggedRun("this run", [(r.iteration, r.loss) for r in run.history])])
        return ax
    plot_loss(run, ax=ax)
    return ax


def merge_adapters(base: str | os.PathLike[str],
                   adapters: str | os.PathLike[str] | Iterable[str | os.PathLike[str] | tuple[Any, float]],
                   out: str | os.PathLike[str], outtype: str = "same") -> MergePlan:
    """llama.cpp's export-lora: write ``out`` = ``base`` with the adapters (or checkpoints) merged in.

    ``outtype='same'`` re-quantizes merged tensors to their base type where ggtorch's quantizer
    is bit-exact with llama.cpp's; 'f32', 'f16', 'bf16', 'q8_0' force one type. One adapter may be given
    as its path alone (a text is a path, never a sequence of one-letter paths).
    """
    if isinstance(adapters, (str, os.PathLike)):
        adapters = [adapters]
    adapters = list(adapters)
    folders = any(Path(a[0] if isinstance(a, tuple) else a).is_dir() for a in adapters)
    base_file = read_gguf(base) if folders else None  # a PEFT folder is read against the base
    return merge_to_gguf(base, [read_lora_source(a, base_file) for a in adapters], out, outtype)


def export_peft(adapter: str | os.PathLike[str] | LoraAdapter, base: str | os.PathLike[str],
                out_dir: str | os.PathLike[str]) -> Path:
    """Write a GGUF adapter as a PEFT folder that peft loads onto the Hugging Face model of ``base``."""
    loaded = read_adapter(adapter) if not isinstance(adapter, LoraAdapter) else adapter
    return _export_peft(loaded, read_gguf(base), out_dir)


def import_peft(peft_dir: str | os.PathLike[str], base: str | os.PathLike[str],
                out: str | os.PathLike[str] | None = None, dtype: str = "f32") -> LoraAdapter:
    """A PEFT LoRA folder as a GGUF adapter for ``base`` (written to ``out`` when given)."""
    adapter = _import_peft(peft_dir, read_gguf(base))
    if out is not None:
        write_adapter(out, adapter, dtype)
    return adapter

