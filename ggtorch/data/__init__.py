"""Training samples, shuffling and batches exactly as the old llama.cpp finetune built them.

Mirrors ``tokenize_file``, ``shuffle_samples``, ``get_example_targets_batch`` and the
reshuffle logic of ``train_opt_callback`` in the old ``common/train.cpp``, so that a command
line of the old program sees the same samples in the same order:

- ``--sample-start ""``: the whole text is tokenized once; sample ``j`` starts at token ``j``.
- ``--sample-start STR``: samples start at each byte position of STR and are tokenized one by one.
- Samples are permuted by a ``std::mt19937`` whose libstdc++ text state is checkpointed
  (the state *before* the current permutation plus the next sample), reshuffled per epoch.
- A batch row is ``[BOS, t0 … t_{N-2}]`` with targets ``[t0 … t_{N-1}]``, padded with EOS
  or filled with the following samples.

Instruction and chat datasets (JSONL/Parquet records, chat templates, answer-only loss,
packing) live in ``records``, ``chat`` and ``packing``. Both kinds implement :class:`DataStream`
and yield :class:`Batch` objects (module ``batch``), so the trainer never asks which one it has.

Targets are class ids (the trainer computes ggml's cross-entropy from them) instead of the
old dense one-hot tensor. Everything here runs once per batch on the host; the tensors it
returns are moved to the device by the trainer.
"""

from ggtorch.data.batch import IGNORE_INDEX, Batch, DataStream, HeldOutSource
from ggtorch.data.batches import Shuffled, build_batch, shuffle_samples
from ggtorch.data.chat import PROMPT_TEMPLATE, PROMPT_TEMPLATE_WITH_INPUT, ChatTemplate, Encoded, RecordEncoder
from ggtorch.data.packing import (
    RecordData,
    RecordOptions,
    collate,
    fit_to_context,
    group_rows,
    load_records,
)
from ggtorch.data.preference import PreferenceData, PreferencePair, encode_pairs, pair_examples
from ggtorch.data.records import (
    FORMATS,
    Example,
    Record,
    detect_format,
    is_record_source,
    read_records,
    records_from_dicts,
)
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
from ggtorch.data.stream import DataState, TrainingData, eval_batches, eval_windows
from ggtorch.data.text import check_utf8, process_escapes, read_text_file

__all__ = ["FORMATS", "IGNORE_INDEX", "PROMPT_TEMPLATE", "PROMPT_TEMPLATE_WITH_INPUT", "Batch", "ChatTemplate",
           "DataOptions", "DataState", "DataStream", "Encoded", "Example", "HeldOutSource", "PreferenceData",
           "PreferencePair", "Record", "RecordData", "RecordEncoder", "RecordOptions", "Samples", "Shuffled",
           "TokenizerLike", "TrainingData", "Vocab", "build_batch", "check_utf8", "collate", "detect_format",
           "encode_pairs", "eval_batches", "eval_windows", "fit_to_context", "group_rows", "is_record_source",
           "load_records", "make_samples", "pair_examples", "process_escapes", "read_records", "read_text_file",
           "records_from_dicts", "resolve_seed", "samples_hash", "shuffle_samples", "stream_samples"]
