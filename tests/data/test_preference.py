"""Preference records as TRL's two shapes, encoded as pairs; bad records refused with one line naming them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ggtorch.data import Record, RecordEncoder, RecordOptions, detect_format
from ggtorch.data.preference import PreferenceData, encode_pairs, pair_examples
from ggtorch.errors import BadData
from ggtorch.io.gguf import read_gguf
from ggtorch.models.tokenizer import Tokenizer
from tests.data.test_chat import TEMPLATE


@pytest.fixture(scope="module")
def tokenizer(stories260k: Path) -> Tokenizer:
    return Tokenizer.from_gguf(read_gguf(stories260k))


def test_a_text_pair_is_the_prompt_as_written_then_each_answer_and_eos(tokenizer: Tokenizer) -> None:
    """As TRL's text form: prompt and answer tokenized apart and joined, EOS after the answer, only the answer
    (and its EOS) trained; the two sequences share their prompt tokens."""
    record = Record({"prompt": "Tom has a ball.", "chosen": " It is red.", "rejected": " It is a cat."}, "line 1")
    (pair,) = encode_pairs([record], RecordEncoder(tokenizer))
    prompt = [tokenizer.bos_id, *tokenizer.encode("Tom has a ball.", add_special=False)]
    for enc, answer in ((pair.chosen, " It is red."), (pair.rejected, " It is a cat.")):
        expected = [*prompt, *tokenizer.encode(answer, add_special=False), tokenizer.eos_id]
        assert enc.tokens.tolist() == expected
        assert enc.trained.tolist() == [False] * len(prompt) + [True] * (len(expected) - len(prompt))


def test_a_conversational_pair_is_rendered_with_the_chat_template(tokenizer: Tokenizer) -> None:
    """The prompt's messages and each side's assistant turn through the template: what it writes for the answer's
    turn is trained, the rest not; a plain string answer is one assistant message."""
    encoder = RecordEncoder(tokenizer, TEMPLATE)
    prompt = [{"role": "user", "content": "Where is Tom?"}]
    record = Record({"prompt": prompt, "chosen": [{"role": "assistant", "content": "In the park."}],
                     "rejected": "At home."}, "line 2")
    (pair,) = encode_pairs([record], encoder)
    for enc, answer in ((pair.chosen, "In the park."), (pair.rejected, "At home.")):
        chat = Record({"messages": [*prompt, {"role": "assistant", "content": answer}]}, "x")
        from ggtorch.data.records import to_example

        alone = encoder.encode(to_example(chat, "chat"))
        assert enc.tokens.tolist() == alone.tokens.tolist() and enc.trained.tolist() == alone.trained.tolist()
        trained = enc.tokens[enc.trained].tolist()
        assert tokenizer.decode(trained).startswith(answer)


@pytest.mark.parametrize(("data", "message"), [
    ({"chosen": "a", "rejected": "b"}, "record 3: missing field 'prompt'"),
    ({"prompt": "p", "rejected": "b"}, "record 3: missing field 'chosen'"),
    ({"prompt": "p", "chosen": "a", "rejected": None}, "record 3: missing field 'rejected'"),
    ({"prompt": "p", "chosen": "same", "rejected": "same"}, "record 3: 'chosen' and 'rejected' are identical"),
    ({"prompt": "p", "chosen": 3, "rejected": "b"}, "record 3: field 'chosen' must be a string"),
    ({"prompt": "p", "chosen": "a", "rejected": "  "}, "record 3: empty 'rejected' answer"),
    ({"prompt": 7, "chosen": "a", "rejected": "b"}, "record 3: field 'prompt' must be a string or a list"),
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "user", "content": "a"}], "rejected": "b"},
     "record 3: field 'chosen' must hold the assistant's turn(s) only"),
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": [], "rejected": "b"},
     "record 3: field 'chosen' must be a list of assistant messages"),
])
def test_a_bad_record_is_named_in_one_line(data: dict, message: str) -> None:
    with pytest.raises(BadData) as e:
        pair_examples(Record(data, "record 3"), "records")
    assert str(e.value).startswith(f"records {message}") and "\n" not in str(e.value)


def _records(n: int, long: bool = False) -> list[dict]:
    tail = " and then they all went home and had a nap" * (6 if long else 0)
    return [{"prompt": f"Tom had {i} apples.", "chosen": f" He ate one{tail}. The end.",
             "rejected": f" He was sad{tail}."} for i in range(n)]


def _answer_tokens(batch, answer: int) -> list[int]:
    """The targets tagged with ``answer``, in row-major order."""
    return batch.targets[batch.answers == answer].tolist()


def _first_epoch(seed: int, count: int) -> np.ndarray:
    """The documented order of epoch 0: numpy's PCG64 from (seed, epoch)'s permutation."""
    return np.random.Generator(np.random.PCG64([seed, 0])).permutation(count)


@pytest.mark.parametrize("batching", ["pack", "pad"])
def test_a_batch_holds_both_sides_of_its_pairs_each_answer_tagged(tokenizer: Tokenizer, batching: str) -> None:
    """--batch counts pairs; answer 2p is pair p's chosen answer and 2p + 1 its rejected one, tagged on exactly the
    trained targets of that sequence; packed rows keep each sequence in its own segment."""
    records = [Record(r, f"line {i + 1}") for i, r in enumerate(_records(6))]
    data = PreferenceData(records, tokenizer, n_ctx=64, options=RecordOptions(batching=batching), seed=3)
    order = [int(i) for i in _first_epoch(data.seed, data.n_samples)[:4]]
    batch = data.next_batch(4)
    assert batch.n_pairs == 4 and data.next_sample == 4 and data.last_used == 4
    assert (batch.answers >= 0).sum() == batch.n_counted  # every trained target has its answer, no other one
    for p, index in enumerate(order):
        pair = data.fitted[index]
        for answer, (enc,) in ((2 * p, pair.chosen), (2 * p + 1, pair.rejected)):
            assert _answer_tokens(batch, answer) == enc.tokens[1:][enc.trained[1:]].tolist()
    if batching == "pad":
        assert batch.inputs.shape[0] == 8 and batch.segments is None
    else:
        assert batch.inputs.shape[0] < 8
        for answer in range(8):  # one segment per sequence
            rows, _ = (batch.answers == answer).nonzero(as_tuple=True)
            assert len(set(rows.tolist())) == 1


def test_split_answers_keep_every_token_of_each_side(tokenizer: Tokenizer) -> None:
    """--long-records split: a sequence longer than the context becomes pieces, all tagged with its answer, so its
    log-probability is the sum over the pieces; truncate keeps the start."""
    records = [Record(r, f"line {i + 1}") for i, r in enumerate(_records(2, long=True))]
    whole = encode_pairs(records, RecordEncoder(tokenizer))
    split = PreferenceData(records, tokenizer, n_ctx=24, options=RecordOptions(long_records="split"), seed=1)
    assert split.counts.split == 4
    batch = split.next_batch(2)
    pairs = [whole[int(i)] for i in _first_epoch(split.seed, split.n_samples)[:2]]
    for p, pair in enumerate(pairs):
        for answer, enc in ((2 * p, pair.chosen), (2 * p + 1, pair.rejected)):
            assert _answer_tokens(batch, answer) == enc.tokens[1:][enc.trained[1:]].tolist()
    truncated = PreferenceData(records, tokenizer, n_ctx=24, seed=1)
    assert truncated.counts.truncated == 4 and "truncated" in truncated.warnings[0]


def test_the_order_resumes_and_a_changed_set_restarts(tokenizer: Tokenizer) -> None:
    records = [Record(r, f"line {i + 1}") for i, r in enumerate(_records(5))]
    data = PreferenceData(records, tokenizer, n_ctx=64, seed=7)
    data.next_batch(3)
    state = data.state_dict()
    expected = data.next_batch(4)  # across the epoch's end
    resumed = PreferenceData(records, tokenizer, n_ctx=64, seed=7)
    assert resumed.load_state_dict(state) == []
    got = resumed.next_batch(4)
    assert torch.equal(got.inputs, expected.inputs) and torch.equal(got.answers, expected.answers)
    assert resumed.epoch == 1
    changed = PreferenceData(records[:4], tokenizer, n_ctx=64, seed=7)
    assert "changed" in changed.load_state_dict(state)[0] and changed.next_sample == 0


def test_pairs_without_answer_tokens_in_the_context_are_dropped(tokenizer: Tokenizer) -> None:
    long_prompt = {"prompt": "Tom had many apples. " * 20, "chosen": " Yes.", "rejected": " No."}
    records = [Record(r, f"line {i + 1}") for i, r in enumerate([*_records(2), long_prompt])]
    data = PreferenceData(records, tokenizer, n_ctx=32, seed=1)
    assert data.n_samples == 2 and data.counts.dropped == 1 and "dropped" in data.warnings[-1]
    with pytest.raises(BadData, match="no pair has answer tokens"):
        PreferenceData([records[-1]], tokenizer, n_ctx=32, seed=1)


def test_sft_on_preference_records_names_the_objective_flag() -> None:
    with pytest.raises(BadData, match="--objective dpo"):
        detect_format([Record(_records(1)[0], "line 1")])
