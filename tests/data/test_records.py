"""Reading records: every string is text before any tokenizer sees it."""

from __future__ import annotations

from pathlib import Path

import pytest

from ggtorch.data import DataOptions, PreferenceData, RecordData, TrainingData, load_records
from ggtorch.errors import BadData
from ggtorch.io.gguf import read_gguf
from ggtorch.models.tokenizer import Tokenizer
from tests.data.test_chat import TEMPLATE
from tests.llama_cpp_files import vocab_file

# Each record kind with a lone surrogate (JSON's "\ud800", as a user's file holds it) in one field; the field named.
SURROGATE_RECORDS = [
    ('{"text": "a \\ud800 b"}', "text", RecordData),
    ('{"prompt": "Hi \\ud800", "response": "Yo"}', "prompt", RecordData),
    ('{"prompt": "Hi", "response": "Yo \\udfff"}', "response", RecordData),
    ('{"instruction": "Hi", "input": "\\ud800", "output": "Yo"}', "input", RecordData),
    ('{"instruction": "Hi", "output": "Yo \\ud800"}', "output", RecordData),
    ('{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo\\ud800"}]}',
     "messages[1].content", RecordData),
    ('{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", '
     '"reasoning_content": "\\udc80"}]}', "messages[1].reasoning_content", RecordData),
    ('{"prompt": "Hi \\ud800", "chosen": "Yo", "rejected": "No"}', "prompt", PreferenceData),
    ('{"prompt": "Hi", "chosen": "Yo", "rejected": "No \\ud800"}', "rejected", PreferenceData),
    ('{"prompt": [{"role": "user", "content": "Hi"}], "chosen": [{"role": "assistant", "content": "\\ud800"}], '
     '"rejected": "No"}', "chosen[0].content", PreferenceData),
]


@pytest.fixture(scope="module")
def tokenizers(stories260k: Path) -> dict[str, Tokenizer]:
    """A sentencepiece vocabulary (its TypeError was the traceback) and a byte-level BPE one."""
    return {"spm": Tokenizer.from_gguf(read_gguf(stories260k)),
            "bpe": Tokenizer.from_gguf(read_gguf(vocab_file("llama-bpe")))}


@pytest.mark.parametrize("vocab", ["spm", "bpe"])
@pytest.mark.parametrize(("line", "field", "stream"), SURROGATE_RECORDS, ids=[f for _, f, _ in SURROGATE_RECORDS])
def test_a_lone_surrogate_is_one_message_naming_file_line_and_field(
        tokenizers: dict[str, Tokenizer], tmp_path: Path, vocab: str, line: str, field: str, stream: type) -> None:
    """In every record kind, on either vocabulary: one BadData naming the file, the line and the field, with the fix,
    before any tokenizer sees the string."""
    path = tmp_path / "data.jsonl"
    good = '{"prompt": "a", "chosen": "b", "rejected": "c"}' if stream is PreferenceData else '{"text": "fine"}'
    path.write_text(f"{good}\n\n{line}\n", encoding="utf-8")
    with pytest.raises(BadData) as e:
        stream(load_records(path, "--train-data"), tokenizers[vocab], 64, seed=1, model_template=TEMPLATE)
    message = str(e.value)
    assert message.startswith(f"--train-data data.jsonl line 3: field '{field}' holds a lone surrogate (U+D")
    assert message.endswith("which is not text; write the character it stands for (a pair such as "
                            "\\ud83d\\ude00 is fine) or remove it")
    assert "\n" not in message
    message.encode("utf-8")  # the message itself prints


def test_records_from_python_are_checked_the_same_way(tokenizers: dict[str, Tokenizer]) -> None:
    records = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]},
               {"messages": [{"role": "user", "content": "\ud800"}, {"role": "assistant", "content": "Yo"}]}]
    with pytest.raises(BadData, match=r"^records record 2: field 'messages\[0\]\.content' holds a lone surrogate "
                                      r"\(U\+D800 at character 0\)"):
        RecordData(load_records(records, "records"), tokenizers["spm"], 64, seed=1, model_template=TEMPLATE)


def test_a_valid_surrogate_pair_is_text(tokenizers: dict[str, Tokenizer], tmp_path: Path) -> None:
    """JSON writes a character outside the BMP as a pair of escapes: that is one character, and trains."""
    path = tmp_path / "data.jsonl"
    path.write_text('{"text": "smile \\ud83d\\ude00"}\n', encoding="utf-8")
    data = RecordData(load_records(path, "--train-data"), tokenizers["bpe"], 64, seed=1)
    assert data.n_samples == 1


@pytest.mark.parametrize("options", [DataOptions(sample_start="\ud800"),
                                     DataOptions(sample_start="\\n\udcff", escape=True)], ids=["plain", "escape"])
def test_a_sample_start_that_is_not_text_is_one_message(tokenizers: dict[str, Tokenizer], options: DataOptions
                                                        ) -> None:
    """--sample-start from a command line holding bytes that are not UTF-8 (Python gives them as lone surrogates)."""
    with pytest.raises(BadData, match=r"^--sample-start holds a lone surrogate \(U\+D[0-9A-F]{3} at character \d\), "
                                      r"which is not text"):
        TrainingData(b"one two three", tokenizers["spm"], 8, options, seed=1)


def test_training_text_given_as_a_string_is_checked(tokenizers: dict[str, Tokenizer]) -> None:
    with pytest.raises(BadData, match=r"^the training text holds a lone surrogate \(U\+D800 at character 4\)"):
        TrainingData("one \ud800 two", tokenizers["spm"], 8, seed=1)
