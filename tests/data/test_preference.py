"""Preference records as TRL's two shapes, encoded as pairs; bad records refused with one line naming them."""

from __future__ import annotations

from pathlib import Path

import pytest

from ggtorch.data import Record, RecordEncoder
from ggtorch.data.preference import encode_pairs, pair_examples
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
