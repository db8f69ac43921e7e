"""OpenAI-style tool-call records: rendered through the template's own tool support, the calls trained."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from ggtorch.data import PreferenceData, RecordData, load_records
from ggtorch.errors import BadData
from ggtorch.io.gguf import read_gguf
from ggtorch.models.tokenizer import Tokenizer
from tests.data.test_chat import TEMPLATE, llama_cpp_tokenizer, trained_texts
from tests.llama_cpp_files import template_file, vocab_file

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
RECORD = {"tools": TOOLS, "messages": [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "22 C, sunny"},
    {"role": "assistant", "content": "It is 22 C and sunny in Paris."}]}
ANSWER = "It is 22 C and sunny in Paris."
# per template: its vocabulary, and what trains (the call as the template writes it, the answer; each with its
# end-of-turn), written out from the template's text
CASES = {
    "Qwen-Qwen2.5-7B-Instruct": ("qwen2", [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        ANSWER + "<|im_end|>"]),
    "meta-llama-Llama-3.1-8B-Instruct": ("llama-bpe", [
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>', ANSWER + "<|eot_id|>"]),
    # Hermes 3's own vocabulary adds <|im_start|> and <|im_end|> to Llama 3.1's: Qwen2's has them as special tokens
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": ("qwen2", [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
        ANSWER + "<|im_end|>"]),
}


@pytest.fixture(scope="module")
def tokenizers(llama_cpp: Path) -> dict[str, Tokenizer]:
    return {name: Tokenizer.from_gguf(read_gguf(vocab_file(name))) for name in ("qwen2", "llama-bpe")}


def transformers_render(template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]],
                        bos: str, eos: str) -> str:
    """transformers' ``apply_chat_template`` (TRL's renderer): the independent reading of the template."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                  bos_token=bos, eos_token=eos)
    return tok.apply_chat_template(messages, tools=tools, chat_template=template, tokenize=False)


def without_content(record: dict[str, Any]) -> dict[str, Any]:
    """The record as TRL's tool-calling format writes it: a tool-call turn has no 'content' key."""
    out = copy.deepcopy(record)
    for m in out["messages"]:
        if m.get("content") is None:
            m.pop("content", None)
    return out


@pytest.mark.parametrize("null", [True, False], ids=["content-null", "content-absent"])
@pytest.mark.parametrize("name", list(CASES))
def test_tool_calls_render_as_transformers_renders_them_and_train_as_answers(
        tokenizers: dict[str, Tokenizer], name: str, null: bool) -> None:
    """The render is transformers' (tools passed, messages as TRL writes them); the call and the final answer
    train, each with its end-of-turn; the tool's result and the tool list are prompt; the tokens are llama.cpp's
    tokenization of the render."""
    vocab, expected = CASES[name]
    tokenizer = tokenizers[vocab]
    template = template_file(name).read_text(encoding="utf-8")
    record = RECORD if null else without_content(RECORD)
    data = RecordData(load_records([record], "records"), tokenizer, 1024, seed=1, model_template=template)
    enc = data.encoded[0]
    assert trained_texts(tokenizer, enc) == expected

    clean = without_content(RECORD)
    render = data.encoder.template.render(clean["messages"], tools=TOOLS)
    assert render == transformers_render(template, clean["messages"], TOOLS, data.encoder.bos_token,
                                         data.encoder.eos_token)
    assert "22 C, sunny" in render and "The weather in a city" in render
    tokens = llama_cpp_tokenizer(vocab_file(vocab)).tokenize(render.encode(), add_bos=False, special=True)
    if tokenizer.add_bos and tokens[0] != tokenizer.bos_id:
        tokens.insert(0, tokenizer.bos_id)
    assert enc.tokens.tolist() == tokens


def test_preference_records_take_tools_too(tokenizers: dict[str, Tokenizer]) -> None:
    """A conversational preference pair whose answers are tool calls: each side's call trains."""
    template = template_file("Qwen-Qwen2.5-7B-Instruct").read_text(encoding="utf-8")
    other = {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}}
    record = {"tools": TOOLS, "prompt": [{"role": "user", "content": "Weather in Paris?"}],
              "chosen": [{"role": "assistant", "content": None, "tool_calls": [CALL]}],
              "rejected": [{"role": "assistant", "content": None, "tool_calls": [other]}]}
    data = PreferenceData(load_records([record], "records"), tokenizers["qwen2"], 1024, seed=1,
                          model_template=template)
    pair = data.pairs[0]
    assert [trained_texts(tokenizers["qwen2"], side) for side in (pair.chosen, pair.rejected)] == [
        [f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call><|im_end|>']
        for city in ("Paris", "Lyon")]


NO_TOOLS = [
    (RECORD, "record 1: the model's chat template (tokenizer.chat_template) has no tool support (it never reads "
     "'tools'), so the record's 'tools' list would be left out of its render; pass --chat-template with a template "
     "that renders tools (the model's own, e.g. Qwen2.5's, Llama 3.1's or Hermes') or drop them from the record"),
    ({"messages": RECORD["messages"]}, "record 1: the model's chat template (tokenizer.chat_template) has no tool "
     "support (it never reads 'tool_calls'), so the record's tool calls (message 1) would be left out of its render"),
]


@pytest.mark.parametrize(("record", "message"), NO_TOOLS, ids=["tools", "tool_calls"])
def test_tools_a_template_cannot_render_are_refused_by_name(tokenizers: dict[str, Tokenizer], record: dict[str, Any],
                                                            message: str) -> None:
    with pytest.raises(BadData) as e:
        RecordData(load_records([record], "records"), tokenizers["qwen2"], 1024, seed=1, model_template=TEMPLATE)
    assert str(e.value).startswith("--train-data " + message)
    assert "\n" not in str(e.value)


BAD_SHAPES = [
    ({**RECORD, "tools": '[{"type": "function"}]'}, "field 'tools' must be a list of function schemas (JSON "
     "objects), got str; a JSON string of the list must be parsed first"),
    ({"messages": [RECORD["messages"][0], {"role": "assistant", "content": None}]},
     "message 1 must be an object with string 'role' and 'content' (or, for an assistant's tool calls, "
     "'tool_calls' and a null 'content')"),
    ({"messages": [RECORD["messages"][0], {"role": "assistant", "content": None, "tool_calls": "get_weather"}]},
     "message 1's 'tool_calls' must be a list of {type, function: {name, arguments}} objects, in an assistant "
     "message"),
]


@pytest.mark.parametrize(("record", "message"), BAD_SHAPES, ids=["tools-string", "null-content", "calls-string"])
def test_malformed_tool_records_are_one_clear_error(tokenizers: dict[str, Tokenizer], record: dict[str, Any],
                                                   message: str) -> None:
    template = template_file("Qwen-Qwen2.5-7B-Instruct").read_text(encoding="utf-8")
    with pytest.raises(BadData) as e:
        RecordData(load_records([record], "records"), tokenizers["qwen2"], 1024, seed=1, model_template=template)
    assert str(e.value) == f"--train-data record 1: {message}"
