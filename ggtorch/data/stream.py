"""The training sample stream (epochs, reshuffles, checkpointable state) and held-out batches."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ggtorch.data.batch import Batch, HeldOutSource
from ggtorch.data.batches import Shuffled, build_batch, shuffle_samples
from ggtorch.data.records import is_record_source
from ggtorch.data.samples import (
    DataOptions,
    Samples,
    TokenizerLike,
    Vocab,
    make_samples,
    resolve_seed,
    samples_hash,
    stream_samples,
)
from ggtorch.data.text import check_utf8, encode_utf8, read_text_file
from ggtorch.errors import BadData, BadFlag
from ggtorch.rng import MT19937


@dataclass
class DataState:
    """The data order as checkpointed (the old ``training.shuffle.*`` keys and the epoch count)."""

    rng_state: str
    """libstdc++ text of the std::mt19937 state *before* the current permutation."""
    next_sample: int = 0
    epoch: int = 0
    samples_hash: int = 0
    sample_count: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataState:
        return cls(rng_state=str(d.get("rng_state", "")), next_sample=int(d.get("next_sample", 0)),
                   epoch=int(d.get("epoch", 0)), samples_hash=int(d.get("samples_hash", 0)),
                   sample_count=int(d.get("sample_count", 0)))


class TrainingData:
    """The old finetune's sample stream, a :class:`~ggtorch.data.batch.DataStream`: ``next_batch``
    advances it; ``state_dict`` resumes it exactly."""

    def __init__(self, data: bytes | str, tokenizer: TokenizerLike | Vocab, n_ctx: int,
                 options: DataOptions | None = None, seed: int | None = None, name: str = "the training text"):
        self.options = options or DataOptions()
        self.vocab = Vocab.from_tokenizer(tokenizer)
        self.n_ctx = n_ctx
        self.seed = resolve_seed(self.options.seed if seed is None else seed)
        self.name = name
        raw = encode_utf8(data, name) if isinstance(data, str) else check_utf8(data, name, self.options.utf8_errors)
        if not raw:
            raise BadData(f"{name} is empty; pass a file with text to train on")
        self._set_samples(make_samples(raw, self.vocab, n_ctx, self.options))
        self.samples_used = 0
        """Samples consumed by next_batch so far in this process (fill can use several per row)."""
        self.last_used = 0

    def _set_samples(self, samples: Samples) -> None:
        if len(samples.tokens) == 0:
            raise BadData(f"{self.name} gives no tokens; pass a file with text to train on")
        self.samples = samples
        self.warnings = list(samples.warnings)
        self.hash = samples_hash(samples)
        self.state = self._fresh_state(epoch=0)
        self._reshuffle()

    def _fresh_state(self, epoch: int) -> DataState:
        return DataState(rng_state=MT19937(self.seed).state(), next_sample=0, epoch=epoch,
                         samples_hash=self.hash, sample_count=self.samples.count)

    def _reshuffle(self) -> None:
        self.shuffled, self._rng_next = shuffle_samples(self.state.rng_state, self.samples.begins,
                                                        self.samples.sizes)

    @property
    def n_samples(self) -> int:
        return self.samples.count

    @property
    def n_tokens(self) -> int:
        return len(self.samples.tokens)

    @property
    def epoch(self) -> int:
        return self.state.epoch

    @property
    def next_sample(self) -> int:
        return self.state.next_sample

    def summary(self) -> str:
        return f"{self.n_tokens:,} tokens, {self.n_samples:,} samples of ctx {self.n_ctx}"

    def next_batch(self, n_batch: int) -> Batch:
        """The next ``n_batch`` rows of ``n_ctx`` tokens; reshuffles at an epoch end."""
        inputs, targets, used = build_batch(self.samples.tokens, self.shuffled, self.state.next_sample,
                                            n_batch, self.n_ctx, self.vocab, self.options)
        self.last_used = used
        self.samples_used += used
        self.state.next_sample += used
        if self.state.next_sample >= self.n_samples:
            # as llama.cpp: a batch crossing the end wrapped within the old order; the rest is dropped
            self.state.epoch += 1
            self.state.rng_state = self._rng_next
            self.state.next_sample = 0
            self._reshuffle()
        return Batch(inputs, targets)

    def state_dict(self) -> dict[str, Any]:
        return self.state.to_dict()

    def load_state_dict(self, state: dict[str, Any], force_reshuffle: bool | None = None) -> list[str]:
        """Continue a checkpointed order; restart it (keeping the epoch count) if the data changed.

        Returns the warnings (also appended to ``self.warnings``), like the old program's messages.
        """
        st = DataState.from_dict(state)
        force = self.options.force_reshuffle if force_reshuffle is None else force_reshuffle
        notes = []
        changed = st.samples_hash != self.hash or st.sample_count != self.n_samples
        if changed:
            notes.append("train data seems to have changed (or the checkpoint's sample hash is from another "
                         "program): restarting the shuffled epoch")
        if force:
            notes.append("forced reshuffling of data: restarting with a newly shuffled epoch")
        if not st.rng_state or changed or force:
            st = self._fresh_state(epoch=st.epoch)
        else:
            try:
                MT19937.from_state(st.rng_state)
            except ValueError as e:
                raise BadData(f"the checkpoint's data-order state is malformed ({e}); pass --force-reshuffle "
                              "to start a fresh order") from None
        self.state = st
        self._reshuffle()
        self.warnings += notes
        return notes

    # --- held-out data -----------------------------------------------------------------------

    def split_validation(self, fraction: float, n_batch: int) -> list[Batch]:
        """``--val-split``: hold out the end of the data; return its eval batches; train on the rest.

        Without a sample start the last ``fraction`` of the token stream is held out (cut on
        a token boundary, so training sees exactly the tokens it would have seen); with one, the
        last ``fraction`` of the samples. Call before training or loading a state: the
        sample list changes and the shuffle restarts from the seed.
        """
        if not 0.0 < fraction < 1.0:
            raise BadFlag(f"--val-split must be in (0, 1), got {fraction}")
        s = self.samples
        if not self.options.sample_start:
            n_val = max(1, round(len(s.tokens) * fraction))
            cut = len(s.tokens) - n_val
            if cut < 1:
                raise BadData(f"{self.name} has {len(s.tokens)} tokens: too few to hold out {fraction:.0%}")
            val = eval_windows(s.tokens[cut:], self.n_ctx)
            kept = Samples(s.tokens[:cut], *stream_samples(cut, self.n_ctx), list(s.warnings))
        else:
            n_val = max(1, round(s.count * fraction))
            n_train = s.count - n_val
            if n_train < 1:
                raise BadData(f"{self.name} has {s.count} samples: too few to hold out {fraction:.0%}; "
                              "use --val-data with a separate file")
            cut = int(s.begins[n_train])
            val = Samples(s.tokens[cut:], s.begins[n_train:] - cut, s.sizes[n_train:])
            kept = Samples(s.tokens[:cut], s.begins[:n_train], s.sizes[:n_train], list(s.warnings))
        self._set_samples(kept)
        return eval_batches(val, n_batch, self.n_ctx, self.vocab, self.options)

    def held_out_batches(self, source: HeldOutSource, n_batch: int, name: str = "--val-data") -> list[Batch]:
        """``--val-data``: batches of a separate text file; records are refused (train on records too)."""
        if not isinstance(source, str | os.PathLike):
            raise BadFlag("validation records need record training data (a .jsonl/.parquet file, a folder "
                          "or records=[...]); pass a text file with --val-data")
        if is_record_source(source):
            raise BadFlag(f"{name} {source} holds records but --train-data is plain text; "
                          "pass a text file (or train on records too)")
        return self.eval_batches_from_text(read_text_file(source, name), n_batch, name)

    def eval_batches_from_text(self, data: bytes | str, n_batch: int, name: str = "--val-data") -> list[Batch]:
        """``--val-data``: eval batches of a separate text, split with this run's sample options."""
        raw = encode_utf8(data, name) if isinstance(data, str) else check_utf8(data, name, self.options.utf8_errors)
        samples = make_samples(raw, self.vocab, self.n_ctx, self.options)
        if len(samples.tokens) == 0:
            raise BadData(f"{name} gives no tokens; pass a file with text to evaluate on")
        if not self.options.sample_start:
            samples = eval_windows(samples.tokens, self.n_ctx)
        return eval_batches(samples, n_batch, self.n_ctx, self.vocab, self.options)


def eval_windows(tokens: np.ndarray, n_ctx: int) -> Samples:
    """Held-out samples for a plain token stream: consecutive non-overlapping windows of ``n_ctx``."""
    begins = np.arange(0, len(tokens), n_ctx, dtype=np.int64)
    sizes = np.minimum(n_ctx, len(tokens) - begins)
    return Samples(tokens, begins, sizes)


def eval_batches(samples: Samples, n_batch: int, n_ctx: int, vocab: Vocab, options: DataOptions) -> list[Batch]:
    """Every held-out sample once, in file order, one per row (no shuffle, offsets or fill).

    The last batch may have fewer rows; nothing is padded or repeated.
    """
    order = Shuffled(np.zeros(samples.count, dtype=np.int64), samples.begins, samples.sizes)
    plain = DataOptions(separate_with_eos=options.separate_with_eos, separate_with_bos=options.separate_with_bos)
    batches = []
    for start in range(0, samples.count, n_batch):
        rows = min(n_batch, samples.count - start)
        inputs, targets, _ = build_batch(samples.tokens, order, start, rows, n_ctx, vocab, plain)
        batches.append(Batch(inputs, targets))
    return batches
