"""The trainer's view of data: one Batch type, and the DataStream protocol text and records both implement."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import pytest
import torch

from ggtorch.data import (
    IGNORE_INDEX,
    Batch,
    DataStream,
    RecordData,
    TrainingData,
    collate,
    load_records,
)
from ggtorch.data.chat import Encoded
from ggtorch.errors import BadData, BadFlag
from ggtorch.io.gguf import read_gguf
from ggtorch.models.tokenizer import Tokenizer
from ggtorch.training import loss
from tests.data.test_samples import char_vocab

QA = [{"prompt": "What color is the sky?", "response": "Blue."}, {"prompt": "Who is the cat?", "response": "Tom."},
      {"prompt": "Where is the ball?", "response": "Under the bed."}]


@pytest.fixture(scope="module")
def tokenizer(stories260k: Path) -> Tokenizer:
    return Tokenizer.from_gguf(read_gguf(stories260k))


def streams(tokenizer: Tokenizer) -> list[TrainingData | RecordData]:
    return [TrainingData("Once upon a time there was a cat. " * 8, tokenizer, n_ctx=16, seed=1),
            RecordData(load_records(QA, "records"), tokenizer, 128, seed=1)]


def protocol_members() -> tuple[list[str], list[str]]:
    """(attribute names, method and property names) the DataStream protocol declares."""
    attributes = list(DataStream.__annotations__)
    methods = [n for n, v in vars(DataStream).items()
               if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, property))]
    return attributes, methods


def test_text_and_record_streams_implement_the_protocol(tokenizer: Tokenizer) -> None:
    """Every member of DataStream, with the protocol's parameter names, on both kinds of stream."""
    attributes, methods = protocol_members()
    assert {"next_batch", "held_out_batches", "split_validation", "summary", "n_samples"} <= set(methods)
    for stream in streams(tokenizer):
        for name in attributes:
            assert hasattr(stream, name), f"{type(stream).__name__} lacks '{name}'"
        for name in methods:
            declared = vars(DataStream)[name]
            implemented = getattr(type(stream), name, None)
            assert implemented is not None, f"{type(stream).__name__} lacks '{name}'"
            if isinstance(declared, property):
                assert isinstance(implemented, property), name
                continue
            assert list(inspect.signature(implemented).parameters) == list(inspect.signature(declared).parameters), \
                f"{type(stream).__name__}.{name}"
        batch = stream.next_batch(2)
        assert isinstance(batch, Batch) and batch.inputs.shape == batch.targets.shape == (2, stream.n_ctx)
        assert isinstance(stream.summary(), str) and stream.summary()


def test_text_summary_is_the_runs_data_line(tokenizer: Tokenizer) -> None:
    text = streams(tokenizer)[0]
    assert text.summary() == f"{text.n_tokens:,} tokens, {text.n_samples:,} samples of ctx 16"


def test_batch_counts_its_targets_and_moves_whole() -> None:
    targets = torch.tensor([[5, IGNORE_INDEX, 7], [IGNORE_INDEX, IGNORE_INDEX, 1]])
    plain = Batch(torch.zeros(2, 3, dtype=torch.long), targets)
    assert plain.n_counted == 3
    moved = plain.to(torch.device("meta"))
    assert moved.inputs.is_meta and moved.targets.is_meta and moved.positions is None and moved.segments is None
    packed = Batch(plain.inputs, targets, torch.arange(3).expand(2, 3), torch.zeros(2, 3, dtype=torch.long))
    moved = packed.to(torch.device("meta"))
    assert moved.positions is not None and moved.positions.is_meta and moved.segments.is_meta


def test_packed_rows_carry_positions_and_padded_rows_do_not() -> None:
    pieces = [Encoded(torch.tensor([1, 5, 6]).numpy(), torch.tensor([False, True, True]).numpy()),
              Encoded(torch.tensor([1, 7]).numpy(), torch.tensor([False, True]).numpy())]
    packed = collate([pieces], n_ctx=4, pad_id=2, pack=True)
    assert packed.positions.tolist() == [[0, 1, 0, 0]] and packed.segments.tolist() == [[0, 0, 1, -1]]
    padded = collate([[p] for p in pieces], n_ctx=4, pad_id=2, pack=False)
    assert padded.positions is None and padded.segments is None
    assert padded.targets.tolist() == [[5, 6, IGNORE_INDEX, IGNORE_INDEX], [7, IGNORE_INDEX, IGNORE_INDEX,
                                                                          IGNORE_INDEX]]


def test_one_ignore_index_for_data_and_loss() -> None:
    """The loss leaves out exactly the targets the data marks as not trained."""
    assert loss.IGNORE_INDEX is IGNORE_INDEX
    logits = torch.randn(3, 10)
    targets = torch.tensor([4, IGNORE_INDEX, 2])
    assert torch.equal(loss.cross_entropy(logits, targets, "none")[1], torch.tensor(0.0))
    assert loss.cross_entropy(logits, targets) == pytest.approx(float(loss.cross_entropy(logits[[0, 2]],
                                                                                         targets[[0, 2]])))


def test_held_out_text_refuses_records(tmp_path: Path) -> None:
    data = TrainingData("abcdefgh", char_vocab(), n_ctx=2)
    (tmp_path / "val.txt").write_bytes(b"xyz12")
    got = data.held_out_batches(tmp_path / "val.txt", 2, "--val-data")
    want = data.eval_batches_from_text(b"xyz12", 2)
    assert [b.targets.tolist() for b in got] == [b.targets.tolist() for b in want]
    with pytest.raises(BadFlag, match="validation records need record training data"):
        data.held_out_batches(QA, 2, "val_records")
    (tmp_path / "val.jsonl").write_text(json.dumps(QA[0]) + "\n")
    with pytest.raises(BadFlag, match=r"--val-data .*val\.jsonl holds records but --train-data is plain text"):
        data.held_out_batches(tmp_path / "val.jsonl", 2, "--val-data")


def test_held_out_records_from_a_list_or_a_file(tokenizer: Tokenizer, tmp_path: Path) -> None:
    records = RecordData(load_records(QA, "records"), tokenizer, 128, seed=1)
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in QA[:2]))
    from_list = records.held_out_batches(QA[:2], 4, "val_records")
    from_file = records.held_out_batches(tmp_path / "val.jsonl", 4, "--val-data")
    assert len(from_list) == len(from_file) == 1
    assert torch.equal(from_list[0].targets, from_file[0].targets)
    assert from_list[0].n_counted > 0
    with pytest.raises(BadData, match="val_records record 1: missing field .response."):
        records.held_out_batches([{"prompt": "no answer"}], 4, "val_records")
