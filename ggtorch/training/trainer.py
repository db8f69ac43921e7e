"""The training loop: llama.cpp's old ``finetune`` semantics on torch machinery.

A :class:`Trainer` trains a :class:`~ggtorch.training.run.Run` (model, what is trained, data,
optimizer, built from the config): steps, evaluation, saves, callbacks, Ctrl-C and data-parallel
ranks. The CLI and the notebook API both drive it; callbacks see every step, evaluation and save.

Differences from the old program, on purpose (also in ``--help`` and the docs):
- one optimizer step consumes exactly ``grad_acc`` batches (the old one evaluated one extra
  batch per run and threw its gradient away), so a resumed run equals an uninterrupted one;
- the adapter is trained with scale alpha/r, as today's llama.cpp applies it (identical for
  the default alpha = r; the old program trained with scale 1);
- the first progress line shows the real loss, not 0.
"""

from __future__ import annotations

import contextlib
import gc
import math
import re
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ggtorch.data import Batch
from ggtorch.errors import GGTorchError, NonFiniteValues, OutOfMemory
from ggtorch.io.checkpoint import save_checkpoint
from ggtorch.models.generate import computing
from ggtorch.ops import fused, malloc, policy, threads
from ggtorch.ops.dtypes import DTYPES
from ggtorch.quant.autograd import keeping_dequantized
from ggtorch.training.config import NAN_SKIP_LIMIT, RunConfig
from ggtorch.training.distributed import RankFailed
from ggtorch.training.generation import Sample, answer_hits, answer_matches, greedy_text
from ggtorch.training.log import TrainLog
from ggtorch.training.loss import model_cross_entropy
from ggtorch.training.memory import GIB, current_rss, ways_to_lower
from ggtorch.training.preference import METRICS, AnswerLogps, adapters_off, answer_logps, metric_sums
from ggtorch.training.run import (
    Run,
    disable_block_checkpointing,
    enable_block_checkpointing,
    output_name,
    resolve_device,
)
from ggtorch.training.weights import FullWeights

__all__ = ["DTYPES", "Callback", "Interrupted", "NonFiniteLoss", "Sample", "StepResult", "Trainer",
           "disable_block_checkpointing", "enable_block_checkpointing", "output_name", "resolve_device"]


class NonFiniteLoss(RankFailed):
    """A step's loss was NaN or inf (on every rank alike: the loss is all-reduced first)."""


class Interrupted(GGTorchError):
    """The run was stopped with Ctrl-C after saving; the CLI exits with 130."""


@dataclass
class StepResult:
    """What one optimizer step did; passed to callbacks and written to the log."""

    iteration: int
    loss: float
    sched: float
    lr: float
    samples: int
    n_samples: int
    epoch: int
    tokens: int
    seconds: float
    tokens_per_second: float
    eta_seconds: float
    memory_gib: float = 0.0
    """The process's memory after the step: resident GiB on a CPU, GiB torch holds on a CUDA device."""
    skipped: bool = False
    """f16's loss scaler found inf/NaN gradients: no update (the iteration did not advance), the scale was halved."""
    metrics: dict[str, float] | None = None
    """Preference objectives: TRL's means over the step's pairs (rewards of chosen and rejected, their margin,
    accuracy, the answers' log-probabilities); None for the cross-entropy."""


OUT_OF_MEMORY_MESSAGES = ("can't allocate memory", "not enough memory", "out of memory")
"""How torch's allocators word a failed allocation in a RuntimeError (CPU, MPS; CUDA's is OutOfMemoryError)."""


def _is_out_of_memory(e: BaseException) -> bool:
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(e, RuntimeError) and any(m in str(e).lower() for m in OUT_OF_MEMORY_MESSAGES)


ALLOCATION_UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def _failed_allocation(message: str) -> str | None:
    """'N MiB more could not be allocated' from an allocator's message: the CPU's "tried to allocate 123 bytes",
    CUDA's "Tried to allocate 2.00 GiB"; None when it names no size."""
    asked = re.search(r"tried to allocate ([\d.]+) ?(bytes|[KMGT]iB)", message, re.IGNORECASE)
    if asked is None:
        return None
    return f"{float(asked.group(1)) * ALLOCATION_UNITS[asked.group(2)] / 2**20:.0f} MiB more could not be allocated"


class Callback:
    """Hooks a notebook or the CLI can override; each does nothing by default.

    Subclassing is optional: the trainer calls whichever of these methods an object has.
    """

    def on_step(self, trainer: Trainer, result: StepResult) -> None:
        """After each optimizer step."""

    def on_eval(self, trainer: Trainer, iteration: int, loss: float) -> None:
        """After each validation loss."""

    def on_save(self, trainer: Trainer, paths: list[Path]) -> None:
        """After each save, with the files written."""

    def on_sample(self, trainer: Trainer, samples: list[Sample]) -> None:
        """After each sample of --sample-prompt's texts (rank 0 only), with one Sample per prompt."""


class Trainer:
    """A training run's loop; ``train()`` runs ``adam_iter`` steps, stoppable and resumable.

    A :class:`FinetuneConfig` trains LoRA adapters on a (possibly quantized) base. A
    :class:`TrainConfig` trains every weight of an F32/F16/BF16 base or of a new model over a
    vocabulary: checkpoints then hold all weights, and the output is a GGUF model.
    """

    def __init__(self, config: RunConfig, callbacks: Sequence[Callback] = (), *,
                 log_records: bool = True, records: Sequence[Mapping[str, Any]] | None = None,
                 val_records: Sequence[Mapping[str, Any]] | None = None, manage_process: bool = False) -> None:
        """``records``/``val_records``: train (and validate) on a list of dicts instead of
        ``config.train_data``/``val_data`` (the record formats of docs/chat-data.md).

        ``manage_process``: tune the process for training as the ``ggtorch`` command does: glibc keeps the memory
        a step frees for the next one (:mod:`ggtorch.ops.malloc`, for the process's life) and torch's thread
        count follows the cores other processes leave free until :meth:`close` (:mod:`ggtorch.ops.threads`).
        Without it a run leaves its process (a notebook's) as it found it."""
        self.manage_process = manage_process
        if manage_process:
            malloc.keep_freed_memory()  # steps reuse each other's pages instead of faulting them in again
            threads.start_following()
        self.callbacks = list(callbacks)
        self.run = run = Run(config, records, val_records)
        self.config = run.config
        """The run's options, ``auto`` resolved (``--dtype auto`` -> the device's dtype)."""
        # the run's objects, under the names the API, the CLI and notebooks use
        self.dist, self.device, self.seed = run.dist, run.device, run.seed
        self.base, self.model_config, self.tokenizer, self.model = run.base, run.model_config, run.tokenizer, run.model
        self.weights = run.weights
        self.params, self.lora_config = run.weights.params, run.weights.lora_config
        self.optimizer, self.data, self.val_batches = run.optimizer, run.data, run.val_batches
        self.counters, self.warnings, self.resumed_from = run.counters, run.warnings, run.resumed_from
        self.notes = run.notes
        self.objective = run.objective
        self.forward_model = self.dist.wrap(self.model, self.device)
        """What the training step calls: ``self.model`` itself, or its DDP wrapper under torchrun."""

        main = log_records and self.dist.is_main  # only rank 0 writes
        self.log = TrainLog(run.log_path() if main else None, config.tensorboard if main else None)
        self.history: list[StepResult] = []
        self.skipped_steps = 0
        """Steps whose update was dropped in this process: by --on-nan skip, or by f16's loss scaler."""
        self._last_save_iteration = self.iteration
        self._last_checkpoint: tuple[Path, int] | None = ((run.resumed_from, self.iteration) if run.resumed_from
                                                          else None)
        """The newest checkpoint written (or resumed from) and its iteration: what a stop leaves to resume."""
        self._target_iteration = self.iteration + config.adam_iter  # train(n) resets it; step() alone may run first
        self._smooth: float | None = None
        self._skipped_in_a_row = 0
        self._stop_requested = False
        self._stop_agreed = False
        self._interrupted = False
        self._kept_matrices: list[torch.Tensor] = []  # --keep-dequantized-mib: reused from step to step
        self.last_eval_metrics: dict[str, float] | None = None
        """The metrics of the last evaluation besides its loss: a preference objective's means over the held-out
        pairs, or for chat and prompt/response records the answer tokens' accuracy (and with --eval-generate the
        exact match and the records it compared)."""
        self._sampled_at: int | None = None
        """The iteration of this Trainer's last sample (None: none yet, so the next shows the base too)."""

    @property
    def iteration(self) -> int:
        return self.optimizer.iteration

    @property
    def allocator(self) -> str:
        """The memory allocator this process runs on (``glibc``, ``jemalloc``, ...), as a run reports it."""
        return malloc.current()

    @property
    def full(self) -> bool:
        """Whether every weight is trained (``ggtorch train``) rather than LoRA adapters."""
        return isinstance(self.weights, FullWeights)

    def state(self) -> dict[str, Any]:
        """Everything besides the trained tensors that an exact resume needs."""
        return self.run.state()

    def model_tensors(self) -> dict[str, torch.Tensor]:
        """GGUF name -> current weight of a fully trained model, in the base file's tensor order."""
        return self.weights.model_tensors()

    def _notify(self, event: str, *args: Any) -> None:
        """Call ``event`` on every callback that has it."""
        for cb in self.callbacks:
            method = getattr(cb, event, None)
            if method is not None:
                method(self, *args)

    # --- saving --------------------------------------------------------------------------------
    def save(self, checkpoint: bool = True) -> list[Path]:
        """Write checkpoint and adapter (full training: model), each under its iteration and LATEST name.

        ``checkpoint=False`` writes only the adapter or model (``--only-write-lora/-model``).
        """
        written: list[Path] = []
        # only rank 0 writes; the others wait for it (none runs ahead) and stop with it if it fails
        self.dist.agree_on_errors(lambda: written.extend(self._save(checkpoint)) if self.dist.is_main else None,
                                  self.device)
        self._last_save_iteration = self.iteration
        return written

    def _kept(self) -> str:
        """Which saved checkpoint a run that stops now leaves to resume from, for its message."""
        if self._last_checkpoint is None:
            return "no checkpoint of this run was saved"
        path, iteration = self._last_checkpoint
        return f"the last checkpoint with finite weights, {path} (iteration {iteration}), is kept"

    def _save(self, checkpoint: bool) -> list[Path]:
        c = self.config
        written: list[Path] = []
        values = list(dict.fromkeys([str(self.iteration), c.fn_latest]))
        try:
            if c.checkpoint_out and checkpoint:
                tensors = self.weights.checkpoint_tensors()
                meta = {**self.weights.checkpoint_metadata(), **self._counter_metadata()}
                for value in values:
                    path = Path(output_name(c.checkpoint_out, c.pattern_fn_it, value))
                    save_checkpoint(path, self.base, meta, tensors, self.state())
                    written.append(path)
                    self._last_checkpoint = (path, self.iteration)
            template = getattr(c, self.weights.output_field)
            if template:
                paths = [output_name(template, c.pattern_fn_it, value) for value in values]
                written += self.weights.write_outputs(paths, self._output_metadata())
        except NonFiniteValues as e:
            raise NonFiniteLoss(f"the trained weights hold NaN or inf at iteration {self.iteration} ({e}); training "
                                f"stopped and {self._kept()}. Lower --adam-alpha (or --adam-gclip), or use "
                                "--dtype f32 if you trained in f16") from None
        self._last_save_iteration = self.iteration
        if not written:
            return written
        self.log.write("save", iteration=self.iteration, files=[str(p) for p in written])
        self._notify("on_save", written)
        return written

    def _counter_metadata(self) -> dict[str, int]:
        return {"training.iteration_count": self.iteration,
                "training.sample_count": self.counters["samples"],
                "training.token_count": self.counters["tokens"],
                "training.epoch_count": self.data.epoch}

    def _output_metadata(self) -> dict[str, Any]:
        """What an adapter file records of the training that made it."""
        return {"training.iteration_count": self.iteration,
                "training.token_count": self.counters["tokens"],
                "training.data": "records" if self.run.records_given else Path(self.config.train_data).name}

    # --- the loop ------------------------------------------------------------------------------
    def _autocast(self) -> Any:
        dtype = DTYPES[self.config.dtype]
        if dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def _keeping_dequantized(self) -> Any:
        """--keep-dequantized-mib: a forward keeps that many bytes of decoded quantized matrices for its backward,
        decoded into the memory the previous micro-batch kept them in (each micro-batch's backward runs
        before the next forward)."""
        mib = getattr(self.config, "keep_dequantized_mib", 0)  # a LoRA option (FinetuneConfig)
        return keeping_dequantized(mib << 20, self._kept_matrices) if mib else nullcontext()

    def _next_batches(self) -> tuple[list[Batch], int]:
        """This rank's ``grad_acc`` micro-batches of the step and the samples the whole step used.

        Each micro-step takes ``world_size`` consecutive batches of the shared stream and rank r
        keeps the r-th, so N ranks consume exactly what one process with ``--grad-acc`` x N does,
        and the stream position stays global (a checkpoint resumes with any number of ranks).
        """
        mine = []
        used = 0
        for _ in range(self.config.grad_acc):
            for rank in range(self.dist.world_size):
                batch = self.data.next_batch(self.config.batch)
                used += self.data.last_used
                if rank == self.dist.rank:
                    mine.append(batch)
        return mine, used

    @staticmethod
    def _forward(model: torch.nn.Module, batch: Batch, hidden_only: bool = False) -> torch.Tensor:
        """Logits of a batch on the model's device (packed rows pass their positions and segments).

        ``hidden_only``: the normed hidden states instead, for ``output_cross_entropy``. With gradients, the outputs
        of RMSNorm and the gated units that backward needs are made again from their inputs instead of kept
        (:func:`ggtorch.ops.fused.recompute_outputs`)."""
        with fused.recompute_outputs() if torch.is_grad_enabled() else nullcontext():
            return model(batch.inputs, positions=batch.positions, segments=batch.segments, hidden_only=hidden_only)

    def step(self) -> StepResult:
        """One optimizer step over ``grad_acc`` micro-batches (on every rank under torchrun).

        The step loss is the sum of the cross-entropy over every counted position of all
        micro-batches of all ranks over their number (for plain text: the mean of the micro-batch
        means, as ggml). DDP averages gradients over ranks, so each rank's part is scaled by
        world_size / global count; only the last micro-batch's backward synchronizes.
        """
        with policy.using(self.run.policy):
            return self._step()

    def _step(self) -> StepResult:
        c = self.config
        threads.follow_free_cores()
        t0 = time.perf_counter()
        self.model.train()
        self.optimizer.zero_grad()
        batches, samples_used = self._next_batches()
        counts = [self._count(batch) for batch in batches]
        rows = float(sum(batch.inputs.shape[0] for batch in batches))
        global_count, global_rows = self.dist.reduce_sum([float(sum(counts)), rows], self.device)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        metric_totals = [0.0] * len(METRICS) if self.objective is not None else []
        for i, (batch, count) in enumerate(zip(batches, counts, strict=True)):
            batch = batch.to(self.device)
            last = i == len(batches) - 1
            reference = self._reference_logps(batch) if count else None
            with self._autocast(), self._keeping_dequantized(), \
                    (nullcontext() if last or not self.dist.enabled else self.forward_model.no_sync()):
                # the output projection runs inside the loss: the (N, n_vocab) logits never exist
                hidden = self._forward(self.forward_model, batch, hidden_only=True)
                loss, sums = self._loss(hidden, batch, count, reference)
                weighted = loss * (count * self.dist.world_size / global_count)
                (weighted if self.run.scaler is None else self.run.scaler.scale(weighted)).backward()
            loss_sum += loss.detach().double() * count
            if sums:
                metric_totals = [a + b for a, b in zip(metric_totals, sums, strict=True)]
        loss_total, stop, *metric_totals = self.dist.reduce_sum(
            [float(loss_sum), float(self._stop_requested), *metric_totals], self.device)
        loss_value = loss_total / global_count if global_count else float("nan")
        self._stop_agreed = bool(stop)  # Ctrl-C on any rank stops every rank after this same step
        if not math.isfinite(loss_value):
            raise NonFiniteLoss(
                f"the loss became {loss_value} at iteration {self.iteration + 1}; training stopped and {self._kept()}. "
                "Lower --adam-alpha, or use --dtype f32 if you trained in f16")
        sched = self.optimizer.sched
        lr = self.optimizer.lr
        if self._update():
            return self._overflowed(loss_value, sched, lr, time.perf_counter() - t0)
        tokens = int(global_rows) * c.ctx  # every rank's rows (a preference batch's rows vary with its pairs)
        self.counters["samples"] += samples_used  # with fill, a row can use several samples
        self.counters["tokens"] += tokens
        seconds = time.perf_counter() - t0
        remaining = self._target_iteration - self.iteration
        result = self._result(loss_value, sched, lr, seconds,
                              tokens_per_second=tokens / seconds if seconds > 0 else 0.0,
                              eta_seconds=self._smoothed_seconds(seconds) * remaining,
                              metrics=self._metrics(metric_totals, global_count))
        self.history.append(result)
        self.log.write("iter", **asdict(result))
        self._notify("on_step", result)
        return result

    def _update(self) -> bool:
        """The optimizer step; under f16's loss scaler unscaled first, skipped when a gradient is inf or NaN (every
        rank alike: DDP gave them the same gradients). Returns whether it was skipped."""
        scaler = self.run.scaler
        if scaler is None:
            self.optimizer.step()
            return False
        scale = scaler.get_scale()
        scaler.step(self.optimizer)
        scaler.update()
        return scaler.get_scale() < scale

    def _overflowed(self, loss: float, sched: float, lr: float, seconds: float) -> StepResult:
        """A step whose f16 gradients overflowed: logged as a skip, counted, not an iteration (nor in history)."""
        self.skipped_steps += 1
        self.log.write("skip", iteration=self.iteration + 1, reason="f16 gradients overflowed",
                       loss_scale=self.run.scaler.get_scale(), skipped_steps=self.skipped_steps)
        return self._result(loss, sched, lr, seconds, tokens_per_second=0.0, eta_seconds=0.0, skipped=True)

    def _result(self, loss: float, sched: float, lr: float, seconds: float, **rest: Any) -> StepResult:
        """The StepResult of the step just run, where the run and its data stand now."""
        return StepResult(iteration=self.iteration, loss=loss, sched=sched, lr=lr,
                          samples=min(self.data.next_sample + 1, self.data.n_samples), n_samples=self.data.n_samples,
                          epoch=self.data.epoch, tokens=self.counters["tokens"], seconds=seconds,
                          memory_gib=self._memory_bytes() / GIB, **rest)

    def _memory_bytes(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return current_rss()

    def _count(self, batch: Batch) -> int:
        """What a micro-batch's loss is a mean over: its counted targets, or its pairs for a preference objective."""
        return batch.n_counted if self.objective is None else batch.n_pairs

    def _loss(self, hidden: torch.Tensor, batch: Batch, count: int, reference: AnswerLogps | None
              ) -> tuple[torch.Tensor, list[float]]:
        """The micro-batch's loss from the model's normed hidden states (mean cross-entropy of the counted targets,
        or the preference objective's mean over pairs) and, for a preference objective, its metrics' sums."""
        if not count:  # still a backward through the output (DDP expects one from every rank)
            return self.model.output(hidden).sum() * 0.0, []
        if self.objective is None:
            return model_cross_entropy(self.model, hidden, batch.targets), []
        policy_logps = answer_logps(self.model, hidden, batch.targets, batch.answers, 2 * batch.n_pairs)
        result = self.objective(policy_logps, reference)
        return result.loss, metric_sums(result)

    @torch.no_grad()
    def _reference_logps(self, batch: Batch) -> AnswerLogps | None:
        """The reference model's log-probabilities of a preference batch's answers (DPO, IPO): --ref-model's, or
        the base's with the adapters switched off (one forward without gradients); None when not needed."""
        if self.objective is None or not self.objective.needs_reference:
            return None
        model = self.run.reference if self.run.reference is not None else self.model
        with self._autocast(), (adapters_off(model) if self.run.reference is None else nullcontext()):
            hidden = self._forward(model, batch, hidden_only=True)
            return answer_logps(model, hidden, batch.targets, batch.answers, 2 * batch.n_pairs)

    @staticmethod
    def _metrics(totals: Sequence[float], count: float) -> dict[str, float] | None:
        """A preference step's (or evaluation's) metric means from their sums over ``count`` pairs."""
        if not totals:
            return None
        return {name: total / count for name, total in zip(METRICS, totals, strict=True)}

    def _smoothed_seconds(self, seconds: float) -> float:
        """The old finetune's smoothed time per iteration (gain 0.7) for the ETA."""
        self._smooth = seconds if self._smooth is None else 0.7 * self._smooth + 0.3 * seconds
        return self._smooth

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Held-out loss: cross-entropy summed over the counted targets of all batches / their number."""
        if not self.val_batches:
            return None
        with policy.using(self.run.policy):
            return self._evaluate()

    def _evaluate(self) -> float:
        self.model.eval()
        total, count, hits = 0.0, 0, 0
        metric_totals = [0.0] * len(METRICS) if self.objective is not None else []
        scored = self.run.answer_data is not None  # chat or prompt/response records: their answers are scored
        for batch in self.val_batches[self.dist.rank::self.dist.world_size]:  # ranks share the work
            n = self._count(batch)
            if n:
                batch = batch.to(self.device)
                reference = self._reference_logps(batch)
                with self._autocast():
                    hidden = self._forward(self.model, batch, hidden_only=True)
                    if self.objective is None:
                        total += float(model_cross_entropy(self.model, hidden, batch.targets, "sum"))
                        hits += answer_hits(self.model, hidden, batch.targets) if scored else 0
                    else:
                        loss, sums = self._loss(hidden, batch, n, reference)
                        total += float(loss) * n
                        metric_totals = [a + b for a, b in zip(metric_totals, sums, strict=True)]
                count += n
        matches, compared = self._exact_matches()
        total, count, hits, matches, compared, *metric_totals = self.dist.reduce_sum(
            [total, float(count), float(hits), float(matches), float(compared), *metric_totals], self.device)
        loss = total / count
        metrics = self._metrics(metric_totals, count)
        if scored:
            metrics = {"answer_accuracy": hits / count}
            if compared:
                metrics |= {"exact_match": matches / compared, "exact_match_records": int(compared)}
        self.log.write("eval", iteration=self.iteration, loss=loss, **({"metrics": metrics} if metrics else {}))
        self.last_eval_metrics = metrics
        self._notify("on_eval", self.iteration, loss)
        return loss

    def _exact_matches(self) -> tuple[int, int]:
        """--eval-generate: of this rank's share of the validation records it compares, how many answers generated
        greedily equal their reference; and that share's size."""
        prompts = self.run.answer_prompts[self.dist.rank::self.dist.world_size]
        if not prompts:
            return 0, 0
        data = self.run.answer_data
        assert data is not None
        with self._generating():
            matches = sum(answer_matches(self.model, self.tokenizer, p, data.encoder.end_texts) for p in prompts)
        return matches, len(prompts)

    # --- samples -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _generating(self) -> Iterator[None]:
        """Greedy generation inside a run: eval mode (no dropout), the run's autocast and kernels, no gradients, and
        the random state as it was after, so a run that samples trains the same numbers; the mode is restored."""
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        compute = DTYPES[self.config.dtype]
        with torch.random.fork_rng(devices=devices), torch.no_grad(), policy.using(self.run.policy), \
                computing(self.model, compute if compute != torch.float32 else None):
            yield

    def sample(self) -> list[Sample]:
        """Greedy continuations of --sample-prompt's texts by the model as it is now, logged (``sample`` records)
        and passed to ``on_sample``; this Trainer's first also with the adapter off (the base's, beside them). Rank
        0 alone samples; the others return [] at once."""
        prompts = self.run.sample_prompts
        if not prompts or not self.dist.is_main:
            return []
        end_texts = self.run.answer_data.encoder.end_texts if self.run.answer_data is not None else ()
        with_base = self._sampled_at is None and self.lora_config is not None
        n = self.config.sample_tokens
        samples = []
        with self._generating():
            for p in prompts:
                text = greedy_text(self.model, self.tokenizer, p.tokens, n, end_texts)
                base = None
                if with_base:
                    with adapters_off(self.model):
                        base = greedy_text(self.model, self.tokenizer, p.tokens, n, end_texts)
                samples.append(Sample(self.iteration, p.text, text, base))
        self._sampled_at = self.iteration
        for s in samples:
            beside = {"base_text": s.base_text} if s.base_text is not None else {}
            self.log.write("sample", iteration=s.iteration, prompt=s.prompt, text=s.text, **beside)
        self._notify("on_sample", samples)
        return samples

    def _sample_every(self) -> int | None:
        """Iterations between samples: --sample-every, by default --save-every's (0 or less: at the end of a run
        only); None: no samples."""
        c = self.config
        if not c.sample_prompt or c.sample_every == 0:
            return None
        every = c.sample_every if c.sample_every is not None else c.save_every
        return max(every, 0)

    def request_stop(self) -> None:
        """Stop after the current step and save; ``train()`` then returns (call it again to go on).

        A callback or a notebook button calls this. Ctrl-C does too, and then ``train()`` raises
        :class:`Interrupted` after saving, so the CLI exits with 130.
        """
        self._stop_requested = True

    def _stopping(self) -> bool:
        """Stop now? Under torchrun only what all ranks agreed on in the last step counts."""
        return self._stop_agreed if self.dist.enabled else self._stop_requested

    def train(self, n_iterations: int | None = None) -> list[StepResult]:
        """Run ``n_iterations`` (default ``adam_iter``) optimizer steps; save as configured."""
        c = self.config
        n = c.adam_iter if n_iterations is None else n_iterations
        self._target_iteration = self.iteration + n
        first_epoch = self.data.epoch
        self._stop_requested = self._stop_agreed = False
        self._interrupted = False
        self.log.write("start", iteration=self.iteration, seed=self.seed, config=asdict(c),
                       trainable_parameters=sum(p.numel() for _, p, _ in self.params),
                       resumed_from=str(self.resumed_from) if self.resumed_from else None)
        results = []
        sample_every = self._sample_every()
        self.run.hold_outputs()  # the outputs stay this run's while it trains; between train() calls, nobody's
        with self._outputs_held(), _sigint_requests_stop(self):
            while self.iteration < self._target_iteration and not self._stopping():
                try:
                    result = self.step()
                    if result.skipped:
                        continue
                    results.append(result)
                except (MemoryError, RuntimeError) as e:  # torch.OutOfMemoryError is a RuntimeError
                    if not _is_out_of_memory(e):
                        raise
                    raise self._out_of_memory(e) from None
                except NonFiniteLoss:
                    if c.on_nan != "skip":
                        raise
                    self._skip_step()
                    continue
                self._skipped_in_a_row = 0
                if c.save_every > 0 and self.iteration - self._last_save_iteration >= c.save_every:
                    self.save()
                if c.eval_every > 0 and self.iteration % c.eval_every == 0:
                    self.evaluate()
                if sample_every and self.iteration % sample_every == 0:
                    self.sample()
                if c.epochs > 0 and self.data.epoch - first_epoch >= c.epochs:
                    break
                if self.optimizer.should_stop(results[-1].loss):
                    break
            if self.iteration != self._last_save_iteration:
                self.save()
            if sample_every is not None and self._sampled_at != self.iteration:
                self.sample()
            self.log.write("end", iteration=self.iteration, steps=len(results),
                           loss=results[-1].loss if results else None,
                           seconds=sum(r.seconds for r in results), skipped_steps=self.skipped_steps,
                           stopped=self._stopping(),
                           interrupted=self._interrupted)
        # Ctrl-C here, or (under torchrun) on another rank: the CLI exits 130. A stop a callback asked for returns.
        if self._interrupted or (self.dist.enabled and self._stop_agreed and not self._stop_requested):
            raise Interrupted(f"interrupted at iteration {self.iteration}; saved, resume with "
                              f"--checkpoint-in {output_name(c.checkpoint_out, c.pattern_fn_it, c.fn_latest)}")
        return results

    @contextlib.contextmanager
    def _outputs_held(self) -> Iterator[None]:
        try:
            yield
        finally:
            self.run.release_outputs()

    def _out_of_memory(self, e: BaseException) -> OutOfMemory:
        """The error of a step that ran out of memory: what was kept, how to resume with less."""
        c = self.config
        latest = output_name(c.checkpoint_out, c.pattern_fn_it, c.fn_latest) if c.checkpoint_out else None
        if latest and Path(latest).is_file():
            kept = (f"the last checkpoint, {latest} (iteration {self._last_save_iteration}), is kept: resume with "
                    f"--checkpoint-in {latest} and")
        else:
            kept = "no checkpoint of this run was saved yet; start again with"
        detail = _failed_allocation(str(e)) or " ".join(str(e).split())[:200]
        return OutOfMemory(f"out of memory in iteration {self.iteration + 1} ({detail}); {kept} "
                           f"{ways_to_lower(c)}")

    def _skip_step(self) -> None:
        """--on-nan skip: drop this step's gradients (no update; its batches are used up) and go on."""
        self.optimizer.zero_grad()
        self._skipped_in_a_row += 1
        self.skipped_steps += 1
        self.log.write("skip", iteration=self.iteration + 1, reason="non-finite loss",
                       in_a_row=self._skipped_in_a_row)
        if self._skipped_in_a_row >= NAN_SKIP_LIMIT:
            raise NonFiniteLoss(
                f"the loss was NaN/inf in {NAN_SKIP_LIMIT} steps in a row at iteration {self.iteration + 1}; "
                f"training stopped and {self._kept()}. Lower --adam-alpha, or use --dtype f32")

    def close(self) -> None:
        """Close the log (flushing --tensorboard's event files) and leave the process group, the DDP wrapper dropped
        first: left to the interpreter's exit, its reducer would free the gloo group (joining the group's threads)
        during finalization, where that can abort a run that succeeded ("terminate called without an active
        exception")."""
        self.log.close()
        if self.manage_process:
            threads.stop_following()
        if self.forward_model is not self.model:
            self.forward_model = self.model
            gc.collect()
        self.run.close()


class _sigint_requests_stop:
    """First Ctrl-C: finish the step, save, stop. Second Ctrl-C: exit at once."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.previous: Callable[..., Any] | int | None = None

    def _handler(self, signum: int, frame: Any) -> None:
        if self.trainer._interrupted:
            raise KeyboardInterrupt
        self.trainer._interrupted = True
        self.trainer.request_stop()

    def __enter__(self) -> _sigint_requests_stop:
        try:
            self.previous = signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not the main thread (e.g. some notebook runners): no handler
            self.previous = None
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
