"""Conversations: the tokens a model is fed are the template's own render tokenized by llama.cpp, the KV cache kept
between turns gives the replies a fresh start gives, and reasoning is told apart from the answer."""

from __future__ import annotations

from pathlib import Path

import jinja2
import pytest
import torch

import ggtorch
from ggtorch.data.conversation import THINK_CLOSE, THINK_OPEN, ChatPiece, Conversation, _held_back, split_reasoning
from ggtorch.errors import BadData
from tests.data.test_chat import TEMPLATE, chat_model, llama_cpp_tokenizer  # noqa: F401  # chat_model: a fixture
from tests.llama_cpp_files import template_file
from tests.llama_models import rewrite_gguf

TURNS = ["Where is Tom?", "And Lily?", "Tell me a story."]


def fed_tokens(model: torch.nn.Module) -> list[int]:
    """A list that collects every token id the model is run on, in order (a forward pre-hook)."""
    fed: list[int] = []
    model.register_forward_pre_hook(lambda _, args: fed.extend(args[0].flatten().tolist()))
    return fed


def reference_tokens(path: Path, messages: list[dict[str, str]]) -> list[int]:
    """The template rendered by plain jinja2 as apply_chat_template sets it up, tokenized by llama.cpp."""
    text = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(TEMPLATE).render(
        messages=messages, bos_token="<s>", eos_token="</s>", add_generation_prompt=True)
    return llama_cpp_tokenizer(path).tokenize(text.encode(), add_bos=not text.startswith("<s>"), special=True)


def test_the_model_is_fed_the_templates_render_and_its_own_answers(chat_model: Path) -> None:  # noqa: F811
    loaded = ggtorch.load_model(chat_model)
    fed = fed_tokens(loaded.model)
    conversation = loaded.conversation(system="Be brief.")
    for text in TURNS:
        reply = conversation.ask(text, max_tokens=12)
        assert reply.stopped == "length" and reply.n_tokens == 12
    # every turn's prompt is the reference render of the conversation so far, and the cache holds each prompt and
    # the answer tokens the model wrote; a turn evaluates only what the cache does not hold yet
    messages = conversation.messages
    assert [m["role"] for m in messages] == ["system", "user", "assistant"] * 1 + ["user", "assistant"] * 2
    prompts = [reference_tokens(chat_model, messages[:i]) for i in (2, 4, 6)]
    assert conversation.prompt_tokens(messages[:2]) == prompts[0]
    assert fed[:len(prompts[0])] == prompts[0]
    assert len(fed) < sum(map(len, prompts)) + 3 * 12  # the history was not evaluated again each turn
    assert conversation.reused >= len(prompts[1])  # the last turn found the second prompt in the cache


def test_replies_with_the_cache_equal_replies_from_a_fresh_start(chat_model: Path) -> None:  # noqa: F811
    loaded = ggtorch.load_model(chat_model)
    kept = loaded.conversation()
    answers = [kept.ask(text, max_tokens=10).answer for text in TURNS]
    assert kept.reused > 0
    for i, text in enumerate(TURNS):
        fresh = Conversation(loaded.model, loaded.tokenizer, TEMPLATE)
        fresh.messages = kept.messages[:2 * i]
        assert fresh.ask(text, max_tokens=10).answer == answers[i]
        assert fresh.reused == 0
    # the API's stateless call continues the same cache when the messages extend the previous call's
    first = loaded.chat([{"role": "user", "content": TURNS[0]}], n_tokens=10)
    second = loaded.chat([{"role": "user", "content": TURNS[0]}, {"role": "assistant", "content": first},
                          {"role": "user", "content": TURNS[1]}], n_tokens=10)
    assert (first, second) == tuple(answers[:2]) and loaded._chat is not None and loaded._chat.reused > 0


def test_a_conversation_longer_than_the_context_is_refused(chat_model: Path) -> None:  # noqa: F811
    conversation = ggtorch.load_model(chat_model).conversation()
    with pytest.raises(BadData, match="start a new one"):
        conversation.ask("word " * 600)
    conversation.reset()
    assert conversation.messages == [] and conversation.ask("Hi", max_tokens=2).n_tokens == 2


def test_a_model_without_a_template_is_told_to_pass_one(stories260k: Path) -> None:
    with pytest.raises(BadData, match="--chat-template FILE"):
        ggtorch.load_model(stories260k).conversation()


@pytest.mark.parametrize("text,opened,expected", [
    ("Hello there.", False, ("", "Hello there.")),
    ("<think>\nweighing it\n</think>\n\nBlue.", False, ("weighing it", "Blue.")),
    ("\n<think>a</think>b", False, ("a", "b")),
    ("still thinking", True, ("still thinking", "")),
    ("done\n</think>\n\nTom.", True, ("done", "Tom.")),
    ("<think>half", False, ("half", "")),
])
def test_reasoning_is_split_from_the_answer(text: str, opened: bool, expected: tuple[str, str]) -> None:
    assert split_reasoning(text, opened) == expected


def test_a_marker_being_written_is_held_back() -> None:
    assert [_held_back(t) for t in ("ab<", "ab</th", "ab</think>", "ab<thin", "abc")] == [1, 4, 0, 5, 0]
    # streamed a character at a time, the pieces given out join to the split of the whole text
    whole = f"{THINK_OPEN}\nweighing it\n{THINK_CLOSE}\n\nBlue sky <b>."
    shown = ["", ""]
    for n in range(1, len(whole) + 1):
        stable = whole[:n][:n - _held_back(whole[:n])]
        for i, part in enumerate(split_reasoning(stable, False)):
            assert part.startswith(shown[i])  # never takes back what was shown
            shown[i] = part
    assert tuple(shown) == split_reasoning(whole, False)


def test_a_template_that_opens_the_reasoning_streams_thinking(stories260k: Path, tmp_path: Path) -> None:
    """Qwen3.5's template ends its generation prompt with ``<think>``: what an untrained model writes is thinking,
    and the turn enters the conversation as reasoning (the template drops it from earlier turns)."""
    path = rewrite_gguf(stories260k, tmp_path / "qwen35-template.gguf",
                        set_keys={"tokenizer.chat_template": template_file("Qwen3.5-4B").read_text()})
    conversation = ggtorch.load_model(path).conversation()
    pieces = list(conversation.send("Hi", max_tokens=8))
    assert pieces and all(isinstance(p, ChatPiece) and p.thinking for p in pieces)
    assert conversation.messages[-1]["content"] == "" and conversation.messages[-1]["reasoning_content"]
    assert conversation.render(conversation.messages[:1]).endswith("<|im_start|>assistant\n<think>\n")
