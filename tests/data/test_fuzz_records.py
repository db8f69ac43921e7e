"""Fuzz: chat and prompt/response records of any shape either train or are refused with one GGTorchError.

Records as a careless data set holds them: roles a template does not know, missing or non-text contents, empty
conversations, answers first, reasoning fields, lists where text goes; rendered with llama.cpp's real Qwen3 template
and a template that writes only user and assistant turns, tokenized by a real vocabulary.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from ggtorch.data import RecordData, load_records
from ggtorch.errors import GGTorchError
from ggtorch.io.gguf import read_gguf
from ggtorch.models.tokenizer import Tokenizer
from tests.llama_cpp_files import template_file

ROLES = st.sampled_from(["user", "assistant", "system", "wizard", "tool", "", "USER"]) | st.text(max_size=6)
TEXTS = st.text(max_size=40) | st.sampled_from(["", " ", "<|im_end|>", "<think>x</think>y", "\n\n"])
CONTENTS = TEXTS | st.none() | st.integers() | st.lists(TEXTS, max_size=2)
MESSAGE = st.dictionaries(st.sampled_from(["role", "content", "reasoning_content", "name"]),
                          ROLES | CONTENTS, max_size=4)
CHAT = st.fixed_dictionaries({"messages": st.lists(MESSAGE, max_size=4) | TEXTS | st.none()})
PROMPT = st.dictionaries(st.sampled_from(["prompt", "response", "instruction", "input", "output", "text"]),
                         CONTENTS, max_size=3)
USER_ASSISTANT = ("{% for m in messages %}{% if m['role'] == 'user' %}Q: {{ m['content'] }}\n"
                  "{% elif m['role'] == 'assistant' %}A: {{ m['content'] }}</s>\n{% endif %}{% endfor %}")


@pytest.fixture(scope="module")
def tokenizer(stories260k: Path) -> Tokenizer:
    return Tokenizer.from_gguf(read_gguf(stories260k))


@pytest.fixture(scope="module")
def templates(llama_cpp: Path) -> list[str]:
    return [template_file("Qwen-Qwen3-0.6B").read_text(encoding="utf-8"), USER_ASSISTANT]


@pytest.mark.parametrize("which", [0, 1])
def test_any_chat_records_train_or_are_refused(tokenizer: Tokenizer, templates: list[str], which: int) -> None:
    @seed(62 + which)
    @settings(max_examples=120, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(records=st.lists(CHAT | PROMPT, min_size=1, max_size=3))
    def run(records: list[dict]) -> None:
        try:
            data = RecordData(load_records(records, "records"), tokenizer, 64, seed=1,
                              model_template=templates[which])
        except GGTorchError:  # one message; anything else escaping is the bug this looks for
            return
        assert data.encoded and all(len(e.tokens) == len(e.trained) for e in data.encoded)

    run()
