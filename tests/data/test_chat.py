"""Instruction and chat records: rendering, token/mask layout, masked loss, packing, learning, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ggtorch.data import (
    IGNORE_INDEX,
    ChatTemplate,
    Encoded,
    RecordData,
    RecordEncoder,
    RecordOptions,
    collate,
    load_records,
    read_records,
)
from ggtorch.data.chat import answer_spans
from ggtorch.data.records import Example
from ggtorch.errors import BadData
from ggtorch.io.gguf import read_gguf
from ggtorch.models.loader import load_model_file
from ggtorch.models.tokenizer import Tokenizer
from ggtorch.training.config import FinetuneConfig
from ggtorch.training.trainer import Trainer
from tests.llama_cpp_files import template_file, vocab_file
from tests.llama_models import rewrite_gguf
from tests.training.test_finetune import losses, run, run_whole_and_resumed

# A ChatML-style template that also uses bos_token and raise_exception.
TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is Tom?"},
     {"role": "assistant", "content": "In the park."}, {"role": "user", "content": "And Lily?"},
     {"role": "assistant", "content": "At home."}],
    [{"role": "user", "content": "Count: one, two"}, {"role": "assistant", "content": "three, four"}],
]
QA = [("What color is the sky?", "Blue."), ("Who is the cat?", "Tom."), ("Where is the ball?", "Under the bed."),
      ("What does the dog say?", "Woof woof.")]


@pytest.fixture(autouse=True)
def one_thread():
    """These tests run tiny models: one thread is faster than two fighting other processes."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def chat_model(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """stories260K with TEMPLATE as its tokenizer.chat_template."""
    return rewrite_gguf(stories260k, tmp_path_factory.mktemp("chat") / "chat.gguf",
                        set_keys={"tokenizer.chat_template": TEMPLATE})


@pytest.fixture(scope="module")
def tokenizer(chat_model: Path) -> Tokenizer:
    return Tokenizer.from_gguf(read_gguf(chat_model))


def reference_render(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The template rendered by plain jinja2 as Hugging Face's apply_chat_template sets it up."""
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(TEMPLATE).render(messages=messages, bos_token="<s>", eos_token="</s>",
                                            add_generation_prompt=add_generation_prompt)


def llama_cpp_tokenizer(path: Path):
    import llama_cpp

    return llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)


def chat_example(messages: list[dict[str, str]]) -> Example:
    return Example("chat", "test", messages=tuple((m["role"], m["content"]) for m in messages))


# --- rendering and layout ------------------------------------------------------------------

def test_the_gguf_template_renders_as_jinja2_does(chat_model: Path, tokenizer: Tokenizer) -> None:
    f = read_gguf(chat_model)
    assert f.get("tokenizer.chat_template") == TEMPLATE
    encoder = RecordEncoder(tokenizer, f.get("tokenizer.chat_template"))
    for messages in CONVERSATIONS:
        for gen in (False, True):
            assert encoder.template.render(messages, gen) == reference_render(messages, gen)
        pieces = encoder.pieces(chat_example(messages))
        assert "".join(text for text, _ in pieces) == reference_render(messages)
        answers = [text for text, trained in pieces if trained]
        assert answers == [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]


# Hugging Face template features: the tojson filter (no HTML escaping) and the {% generation %} tag.
HF_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>{% generation %}{{ m['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] | tojson }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.mark.parametrize("template", [TEMPLATE, HF_TEMPLATE], ids=["chatml", "hf-features"])
def test_prompts_are_what_llama_cpp_python_builds(tokenizer: Tokenizer, template: str) -> None:
    """llama-cpp-python's Jinja2ChatFormatter (its chat completion path) as a second reference."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    encoder = RecordEncoder(tokenizer, template)
    conversations = [*CONVERSATIONS, [{"role": "user", "content": 'Say "<b>&</b>" \u00e9'},
                                      {"role": "assistant", "content": "Done."}]]
    for messages in conversations:
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                theirs = Jinja2ChatFormatter(template, "</s>", "<s>")(messages=messages[:i]).prompt
                assert encoder.template.render(messages[:i], add_generation_prompt=True) == theirs
        answers = [text for text, trained in encoder.pieces(chat_example(messages)) if trained]
        expected_end = "<|im_end|>" if template == TEMPLATE else "</s>"
        assert answers == [m["content"] + expected_end for m in messages if m["role"] == "assistant"]


def test_token_and_mask_layout_of_one_short_example(chat_model: Path, tokenizer: Tokenizer) -> None:
    """[user Hi, assistant Yo]: written out by hand; token ids from llama.cpp's tokenizer.

    The render is tokenized once, as llama.cpp tokenizes a conversation: the answer's tokens
    are those of the whole render, not of "Yo<|im_end|>" alone (which would start with the
    sentencepiece space prefix, a "▁" the model never generates after "assistant\n").
    """
    llm = llama_cpp_tokenizer(chat_model)

    def tok(text: str) -> list[int]:
        return llm.tokenize(text.encode(), add_bos=False, special=True)

    prompt, answer, tail = "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "Yo<|im_end|>", "\n"
    encoder = RecordEncoder(tokenizer, TEMPLATE)
    assert encoder.pieces(chat_example(CONVERSATIONS[0])) == [(prompt, False), (answer, True), (tail, False)]
    full, p, pa = tok(prompt + answer + tail), tok(prompt), tok(prompt + answer)
    assert full[:len(pa)] == pa and pa[:len(p)] == p  # the answer's ends fall between tokens
    a = full[len(p):len(pa)]
    assert tok(answer) == [tok(" ")[-1], *a]  # alone, it would take a space prefix
    assert p[0] == tokenizer.bos_id == 1  # "<s>" in the template is the BOS token, not added twice
    enc = encoder.encode(chat_example(CONVERSATIONS[0]))
    assert enc.tokens.tolist() == full
    assert enc.trained.tolist() == [False] * len(p) + [True] * len(a) + [False] * (len(full) - len(pa))

    n = len(full)
    batch = collate([[enc]], n_ctx=n - 1 + 3, pad_id=tokenizer.eos_id, pack=False)
    assert batch.inputs[0].tolist() == full[:-1] + [2, 2, 2]
    assert batch.targets[0].tolist() == [-100] * (len(p) - 1) + a + [-100] * (n - len(pa)) + [-100] * 3
    assert batch.positions is None and batch.segments is None


# --- real chat templates ----------------------------------------------------------------------

REAL_TEMPLATES = {
    # template file (llama.cpp's models/templates): vocabulary, end-of-turn text, whether it takes a system message
    "Qwen-Qwen2.5-7B-Instruct": ("qwen2", "<|im_end|>", True),
    "Qwen-Qwen3-0.6B": ("qwen2", "<|im_end|>", True),
    "meta-llama-Llama-3.2-3B-Instruct": ("llama-bpe", "<|eot_id|>", True),
    "microsoft-Phi-3.5-mini-instruct": ("phi-3", "<|end|>", True),
    "google-gemma-2-2b-it": ("gemma2-like", "<end_of_turn>", False),
    "Qwen3.5-4B": ("qwen35", "<|im_end|>", True),
    "google-gemma-4-31B-it": ("gemma-4", "<turn|>", True),
}
REAL_CHATS = [
    # short answers that also occur earlier: in the user's message and in the role headers ("a" in "assistant")
    [("user", "Say a"), ("assistant", "a"), ("user", "Where is Tom?"), ("assistant", "In the park.")],
    [("user", "Is the sky blue? Answer Yes or No."), ("assistant", "Yes"), ("user", "Is grass green? Yes or No."),
     ("assistant", "Yes"), ("user", "Write two lines."), ("assistant", "Line one.\nLine two.")],
    [("user", "Traduis « thé »"), ("assistant", "tea ☕ (thé)")],
]
SYSTEM = ("system", "You are a helpful assistant. Answer briefly.")


@pytest.fixture(scope="module")
def real_tokenizers(llama_cpp: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Tokenizer, Path]]:
    """The vocabularies the real templates go with; Gemma's is llama-spm with Gemma 2's tokens added."""
    from gguf import TokenType

    from tests.models.test_tokenizer import write_gemma_like_vocab

    paths = {name: vocab_file(name) for name in ("qwen2", "llama-bpe", "phi-3", "qwen35", "gemma-4")}
    paths["gemma2-like"] = write_gemma_like_vocab(tmp_path_factory.mktemp("gemma") / "gemma2-like.gguf",
                                                  read_gguf(vocab_file("llama-spm")),
                                                  TokenType.USER_DEFINED)
    return {name: (Tokenizer.from_gguf(read_gguf(path)), path) for name, path in paths.items()}


def trained_texts(tokenizer: Tokenizer, enc: Encoded) -> list[str]:
    """Each run of consecutive trained tokens, decoded as llama.cpp detokenizes (special texts kept)."""
    at = np.flatnonzero(enc.trained)
    runs = np.split(at, np.flatnonzero(np.diff(at) > 1) + 1) if len(at) else []
    return [tokenizer.decode(enc.tokens[run].tolist(), remove_special=False, unparse_special=True) for run in runs]


REAL_CASES = [(name, chat, system) for name, (_, _, takes_system) in REAL_TEMPLATES.items()
              for chat in range(len(REAL_CHATS)) for system in (False, True) if takes_system or not system]


@pytest.mark.parametrize(("name", "chat", "system"), REAL_CASES,
                         ids=[f"{n}-chat{c}{'-system' if s else ''}" for n, c, s in REAL_CASES])
def test_real_templates_train_exactly_each_answer_and_its_end_of_turn(
        real_tokenizers: dict[str, tuple[Tokenizer, Path]], name: str, chat: int, system: bool) -> None:
    """The trained tokens, decoded, are each assistant content followed by the template's end-of-turn
    marker; the tokens are llama.cpp's tokenization of the whole render."""
    vocab, end_of_turn, _ = REAL_TEMPLATES[name]
    tokenizer, path = real_tokenizers[vocab]
    messages = [SYSTEM, *REAL_CHATS[chat]] if system else REAL_CHATS[chat]
    records = load_records([{"messages": [{"role": r, "content": c} for r, c in messages]}], "records")
    data = RecordData(records, tokenizer, 512, seed=1, model_template=template_file(name).read_text(encoding="utf-8"))
    enc = data.encoded[0]
    assert trained_texts(tokenizer, enc) == [c + end_of_turn for r, c in messages if r == "assistant"]

    render = data.encoder.template.render([{"role": r, "content": c} for r, c in messages])
    expected = llama_cpp_tokenizer(path).tokenize(render.encode(), add_bos=False, special=True)
    if tokenizer.add_bos and expected[0] != tokenizer.bos_id:
        expected.insert(0, tokenizer.bos_id)
    assert enc.tokens.tolist() == expected


def test_qwen3_reasoning_is_context_not_answer(real_tokenizers: dict[str, tuple[Tokenizer, Path]]) -> None:
    """Qwen3 writes the last answer's reasoning_content in a <think> block and drops earlier turns'
    reasoning: the answers train, the reasoning does not."""
    tokenizer, _ = real_tokenizers["qwen2"]
    template = template_file("Qwen-Qwen3-0.6B").read_text(encoding="utf-8")
    messages = [{"role": "user", "content": "Where is Tom?"},
                {"role": "assistant", "content": "In the park.", "reasoning_content": "Tom likes the park."},
                {"role": "user", "content": "And Lily?"},
                {"role": "assistant", "content": "At home.", "reasoning_content": "Lily is sick.\nShe stays in."}]
    data = RecordData(load_records([{"messages": messages}], "records"), tokenizer, 512, seed=1,
                      model_template=template)
    enc = data.encoded[0]
    assert trained_texts(tokenizer, enc) == ["In the park.<|im_end|>", "At home.<|im_end|>"]
    whole = tokenizer.decode(enc.tokens.tolist(), remove_special=False, unparse_special=True)
    assert "Tom likes the park." not in whole  # Qwen3 drops an earlier turn's reasoning
    assert "<|im_start|>assistant\n<think>\nLily is sick.\nShe stays in.\n</think>\n\nAt home.<|im_end|>" in whole


@pytest.mark.parametrize(("name", "vocab", "last"), [
    ("Qwen-Qwen3-0.6B", "qwen2", "<think>\nEnd politely.\n</think>\n\nBye.<|im_end|>"),
    # its generation prompt opens the <think> block itself: what follows it trains
    ("Qwen3.5-4B", "qwen35", "End politely.\n</think>\n\nBye.<|im_end|>"),
])
def test_answers_with_inline_reasoning_train_what_the_template_writes(
        real_tokenizers: dict[str, tuple[Tokenizer, Path]], name: str, vocab: str, last: str) -> None:
    """Reasoning templates cut an inline <think> block out of an earlier answer and rewrite the last one's: the
    answer is located by rendering (the conversation before it with the generation prompt), and what the template
    writes for each assistant turn trains, up to its end-of-turn."""
    tokenizer, _ = real_tokenizers[vocab]
    template = template_file(name).read_text(encoding="utf-8")
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "<think>Greet back.</think>Hello."},
                {"role": "user", "content": "Bye"},
                {"role": "assistant", "content": "<think>End politely.</think>Bye."}]
    data = RecordData(load_records([{"messages": messages}], "records"), tokenizer, 512, seed=1,
                      model_template=template)
    enc = data.encoded[0]
    assert trained_texts(tokenizer, enc) == ["Hello.<|im_end|>", last]
    whole = tokenizer.decode(enc.tokens.tolist(), remove_special=False, unparse_special=True)
    assert "Greet back." not in whole  # the template drops an earlier turn's reasoning


@pytest.mark.parametrize(("name", "end_texts", "written"), [
    # each drops an earlier answer's reasoning; the last: DeepSeek-R1 drops it too, Qwen3.5 and QwQ write it (Qwen3.5
    # after the <think> its generation prompt opens), GLM-4.6 writes it and ends a turn with no end-of-turn text but
    # the next turn's <|user|> (its end-of-generation token)
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", ["<｜end▁of▁sentence｜>"],
     ["Hello.<｜end▁of▁sentence｜>", "Bye.<｜end▁of▁sentence｜>"]),
    ("Qwen3.5-4B", ["<|im_end|>"], ["Hello.<|im_end|>", "End politely.\n</think>\n\nBye.<|im_end|>"]),
    ("Qwen-QwQ-32B", ["<|im_end|>"], ["Hello.<|im_end|>", "<think>End politely.</think>Bye.<|im_end|>"]),
    ("GLM-4.6", ["<|user|>", "<|observation|>", "<|endoftext|>"],
     ["\n<think></think>\nHello.<|user|>", "\n<think>End politely.</think>\nBye."]),
])
def test_reasoning_templates_train_what_they_write_for_each_turn(name: str, end_texts: list[str],
                                                                 written: list[str]) -> None:
    """The spans of a conversation whose answers hold inline <think> blocks, in llama.cpp's real templates: each is
    what the template writes after the generation prompt for that turn, up to its end-of-turn text."""
    template = ChatTemplate(template_file(name).read_text(encoding="utf-8"), "", "")
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>Greet back.</think>Hello."},
                {"role": "user", "content": "Bye"},
                {"role": "assistant", "content": "<think>End politely.</think>Bye."}]
    text, spans = answer_spans(template, messages, "record 1", end_texts)
    assert [text[start:end] for start, end in spans] == written


def test_gemma4_strips_its_thought_channel_and_trains_the_answer() -> None:
    """Gemma 4's template cuts an answer's ``<|channel>thought ... <channel|>`` out of every assistant turn: what
    it writes, the answer and its ``<turn|>``, trains; the thought is in no render."""
    template = ChatTemplate(template_file("google-gemma-4-31B-it").read_text(encoding="utf-8"), "<bos>", "<eos>")
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "<|channel>thought\nGreet back.<channel|>Hello."},
                {"role": "user", "content": "Bye"},
                {"role": "assistant", "content": "<|channel>thought\nEnd politely.<channel|>Bye."}]
    text, spans = answer_spans(template, messages, "record 1", ["<turn|>"])
    assert [text[start:end] for start, end in spans] == ["Hello.<turn|>", "Bye.<turn|>"]
    assert "Greet back." not in text and "End politely." not in text


def test_an_answer_the_template_does_not_write_is_refused_by_record_and_template(tokenizer: Tokenizer) -> None:
    """A template that writes no assistant turn at all: no render locates the answer."""
    template = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}\n{% endif %}{% endfor %}"
    records = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}]
    with pytest.raises(BadData) as e:
        RecordData(load_records(records, "records"), tokenizer, 512, seed=1, model_template=template)
    assert str(e.value) == ("--train-data record 1: the model's chat template (tokenizer.chat_template) does not "
                            "write assistant message 1's content into its render of the conversation, so the answer "
                            "cannot be located; fix the record or pass a template that writes it with --chat-template")


def test_pieces_that_do_not_spell_the_render_fall_back_to_piecewise_tokens(tokenizer: Tokenizer) -> None:
    """When token pieces cannot be matched to the render (here: every piece reads "?"), each answer and
    the text between them are tokenized on their own, and the mask follows those pieces."""

    class Unmatched:
        def __init__(self, inner: Tokenizer) -> None:
            self.inner = inner
            self.tokens, self.bos_id, self.eos_id, self.n_vocab = inner.tokens, inner.bos_id, inner.eos_id, 512

        def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
            return self.inner.encode(text, add_special, parse_special)

        def piece_bytes(self, token: int, special: bool = False) -> bytes:
            return b"?"

    example = chat_example(CONVERSATIONS[1])
    enc = RecordEncoder(Unmatched(tokenizer), TEMPLATE).encode(example)
    pieces = RecordEncoder(tokenizer, TEMPLATE).pieces(example)
    tokens = [tokenizer.encode(text, add_special=False, parse_special=True) for text, _ in pieces]
    assert enc.tokens.tolist() == sum(tokens, [])
    assert enc.trained.tolist() == sum(([trained] * len(t) for (_, trained), t in zip(pieces, tokens, strict=True)),
                                       [])
    assert enc.tokens.tolist() != RecordEncoder(tokenizer, TEMPLATE).encode(example).tokens.tolist()


def test_generation_blocks_name_the_trained_spans(tokenizer: Tokenizer) -> None:
    """{% generation %} decides, not the content search: here it leaves the answer's end marker out and
    takes a header in."""
    template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}<|assistant|>"
                "{{ m['content'] }}{% endgeneration %}<|end|>\n{% else %}<|user|>{{ m['content'] }}<|end|>\n"
                "{% endif %}{% endfor %}")
    encoder = RecordEncoder(tokenizer, template)
    pieces = encoder.pieces(chat_example(CONVERSATIONS[1][1:]))
    assert [text for text, trained in pieces if trained] == ["<|assistant|>In the park.", "<|assistant|>At home."]
    assert "".join(text for text, _ in pieces) == encoder.template.render(CONVERSATIONS[1][1:])
    assert "\ue000" not in encoder.template.render(CONVERSATIONS[1][1:])


def test_prompt_response_default_template_and_eos(tokenizer: Tokenizer) -> None:
    llm_free = RecordEncoder(tokenizer)
    ex = Example("prompt-response", "test", instruction="Who?", response="Tom.")
    assert llm_free.pieces(ex) == [("### Instruction:\nWho?\n\n### Response:\n", False), ("Tom.", True)]
    ex2 = Example("prompt-response", "test", instruction="Add", input="1 and 2", response="3")
    assert llm_free.pieces(ex2)[0] == ("### Instruction:\nAdd\n\n### Input:\n1 and 2\n\n### Response:\n", False)
    enc = llm_free.encode(ex)
    prompt = tokenizer.encode("### Instruction:\nWho?\n\n### Response:\n", add_special=False, parse_special=True)
    answer = tokenizer.encode("Tom.", add_special=False, parse_special=True)
    assert enc.tokens.tolist() == [1, *prompt, *answer, 2]
    assert enc.trained.tolist() == [False] * (1 + len(prompt)) + [True] * (len(answer) + 1)
    assert RecordEncoder(tokenizer, train_on_prompt=True).encode(ex).trained.all()


# --- files, formats --------------------------------------------------------------------------

def test_jsonl_parquet_folder_and_list_give_the_same_records(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": c} for c in CONVERSATIONS]
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n", encoding="utf-8")
    pq.write_table(pa.Table.from_pylist(rows[2:]), tmp_path / "d" / "b.parquet")
    from_folder = read_records(tmp_path / "d")
    assert [dict(r.data) for r in from_folder] == rows
    assert [r.where for r in from_folder] == ["a.jsonl line 1", "a.jsonl line 2", "b.parquet row 1"]
    assert [r.data for r in load_records(rows, "records")] == rows


@pytest.mark.parametrize(("record", "fmt"), [
    ({"messages": CONVERSATIONS[0]}, "chat"),
    ({"prompt": "a", "response": "b"}, "prompt-response"),
    ({"instruction": "a", "input": "", "output": "b"}, "prompt-response"),
    ({"text": "Once upon a time"}, "text"),
])
def test_format_is_detected_and_reported(chat_model: Path, tokenizer: Tokenizer, record: dict, fmt: str) -> None:
    data = RecordData(load_records([record], "records"), tokenizer, 64, seed=1, model_template=TEMPLATE)
    assert data.format == fmt
    assert data.summary().startswith(f"1 {fmt} records")
    forced = RecordData(load_records([{"text": "x", "prompt": "Hi", "response": "Yo"}], "records"), tokenizer, 64,
                        RecordOptions(data_format="text"), seed=1)
    assert forced.format == "text" and forced.pieces[0].trained[1:].all()


# --- masked loss -------------------------------------------------------------------------------

def _loss_and_grads(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor):
    model.zero_grad()
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))  # ignore_index=-100
    loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_masked_prompt_targets_do_not_change_loss_or_grads(stories260k: Path, tokenizer: Tokenizer) -> None:
    model = load_model_file(stories260k, keep_quantized=False).model
    for p in model.parameters():
        p.requires_grad_(True)
    enc = RecordEncoder(tokenizer).encode(Example("prompt-response", "t", instruction="Who is it?", response="Tom."))
    prompt_at = int(np.flatnonzero(~enc.trained)[3])
    answer_at = int(np.flatnonzero(enc.trained)[1])
    n_ctx = len(enc) - 1
    base = collate([[enc]], n_ctx, 2, pack=False)
    loss0, grads0 = _loss_and_grads(model, base.inputs, base.targets)

    def with_target(at: int) -> torch.Tensor:
        changed = enc.tokens.copy()
        changed[at] = (changed[at] + 7) % tokenizer.n_vocab
        return collate([[Encoded(changed, enc.trained)]], n_ctx, 2, pack=False).targets

    loss1, grads1 = _loss_and_grads(model, base.inputs, with_target(prompt_at))
    assert loss1 == loss0
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1, strict=True))
    loss2, grads2 = _loss_and_grads(model, base.inputs, with_target(answer_at))
    assert abs(loss2 - loss0) > 1e-3
    assert any(not torch.allclose(a, b) for a, b in zip(grads0, grads2, strict=True))


def test_step_loss_is_the_sum_over_counted_targets_of_all_micro_batches(chat_model: Path) -> None:
    """grad_acc 2, micro-batches with different counts: loss = sum CE / total count (not mean of means)."""
    records = [{"prompt": q, "response": a} for q, a in QA[:2]]  # answers of 6 and 4 tokens
    config = FinetuneConfig(model_base=str(chat_model), train_data="", ctx=64, batch=1, grad_acc=2, adam_iter=1,
                            checkpoint_in="", checkpoint_out="", lora_out="", seed=3, batching="pad",
                            dtype="f32")  # the loss is checked in f32
    trainer = Trainer(config, records=records, log_records=False)
    twin = RecordData(load_records(records, "records"), trainer.tokenizer, 64, RecordOptions(batching="pad"),
                      seed=trainer.seed)
    batches = [twin.next_batch(1), twin.next_batch(1)]
    with torch.no_grad():
        ce = [F.cross_entropy(trainer.model(b.inputs).reshape(-1, 512), b.targets.reshape(-1), reduction="sum")
              for b in batches]
    counts = [int((b.targets != IGNORE_INDEX).sum()) for b in batches]
    assert counts[0] != counts[1]
    expected = float(sum(ce)) / sum(counts)
    mean_of_means = float(sum(c / n for c, n in zip(ce, counts, strict=True))) / 2
    assert abs(expected - mean_of_means) > 1e-3
    result = trainer.train(1)[0]
    assert result.loss == pytest.approx(expected, rel=1e-5)
    trainer.close()


# --- packing -----------------------------------------------------------------------------------

def test_a_packed_row_gives_each_record_its_own_loss(stories260k: Path, tokenizer: Tokenizer) -> None:
    model = load_model_file(stories260k, keep_quantized=False).model.eval()
    encoder = RecordEncoder(tokenizer)
    encs = [encoder.encode(Example("prompt-response", "t", instruction=q, response=a)) for q, a in QA[:3]]
    n_ctx = sum(len(e) - 1 for e in encs) + 5
    packed = collate([encs], n_ctx, 2, pack=True)
    assert packed.segments[0].tolist() == sum(([i] * (len(e) - 1) for i, e in enumerate(encs)), []) + [-1] * 5
    with torch.no_grad():
        logits = model(packed.inputs, positions=packed.positions, segments=packed.segments)
        ce = F.cross_entropy(logits[0], packed.targets[0], reduction="none")
        for i, e in enumerate(encs):
            alone = collate([[e]], len(e) - 1, 2, pack=False)
            ce_alone = F.cross_entropy(model(alone.inputs)[0], alone.targets[0], reduction="none")
            seg = packed.segments[0] == i
            counted = packed.targets[0][seg] != IGNORE_INDEX
            assert torch.allclose(ce[seg][counted], ce_alone[counted], atol=1e-5)
            assert float(ce[seg][counted].mean()) == pytest.approx(float(ce_alone[counted].mean()), abs=1e-5)


def test_one_segment_from_position_zero_is_the_default_forward(stories260k: Path) -> None:
    """positions/segments describe the default causal layout exactly: same logits; a cache refuses them."""
    model = load_model_file(stories260k).model.eval()
    tokens = torch.randint(3, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(24).expand(2, 24)
    with torch.no_grad():
        plain = model(tokens)
        packed = model(tokens, positions=positions, segments=torch.zeros(2, 24, dtype=torch.long))
        assert torch.allclose(plain, packed, atol=1e-5)
        with pytest.raises(ValueError, match="not for a KV cache"):
            model(tokens, cache=model.new_cache(2, 32), positions=positions)


def test_long_records_are_truncated_or_split_and_counted(tokenizer: Tokenizer) -> None:
    long_answer = " ".join(["the cat sat on the mat"] * 20)
    records = load_records([{"prompt": "Tell me", "response": long_answer}, {"prompt": "Hi", "response": "Yo"}],
                           "records")
    full = RecordEncoder(tokenizer).encode(Example("prompt-response", "t", instruction="Tell me",
                                                   response=long_answer))
    n_ctx = 40
    cut = RecordData(records, tokenizer, n_ctx, RecordOptions(long_records="truncate"), seed=1)
    assert (cut.counts.truncated, cut.counts.split, cut.n_samples) == (1, 0, 2)
    assert cut.pieces[0].tokens.tolist() == full.tokens[:n_ctx + 1].tolist()
    assert any("truncated" in w for w in cut.warnings)
    split = RecordData(records, tokenizer, n_ctx, RecordOptions(long_records="split"), seed=1)
    pieces = split.pieces[:-1]
    assert split.counts.split == 1 and len(pieces) == -(-(len(full) - 1) // n_ctx)
    # every target of the long record is predicted exactly once, across its pieces
    assert sum(len(p) - 1 for p in pieces) == len(full) - 1
    assert np.concatenate([p.tokens[1:] for p in pieces]).tolist() == full.tokens[1:].tolist()


def test_order_is_per_epoch_from_the_seed_and_resumes_exactly(tokenizer: Tokenizer) -> None:
    records = load_records([{"prompt": q, "response": a} for q, a in QA * 3], "records")

    def make() -> RecordData:
        return RecordData(records, tokenizer, 48, seed=11)

    one = make()
    stream = [one.next_batch(2) for _ in range(8)]
    assert one.epoch >= 1
    again = make()
    assert all(torch.equal(a.inputs, b.inputs) for a, b in zip(stream, [again.next_batch(2) for _ in range(8)],
                                                                 strict=True))
    part = make()
    for _ in range(3):
        part.next_batch(2)
    state = json.loads(json.dumps(part.state_dict()))
    resumed = make()
    assert resumed.load_state_dict(state) == []
    for expected in stream[3:]:
        got = resumed.next_batch(2)
        assert all(torch.equal(getattr(expected, f), getattr(got, f)) for f in ("inputs", "targets", "positions",
                                                                                 "segments"))
    other_seed = RecordData(records, tokenizer, 48, seed=12)
    assert not torch.equal(other_seed.next_batch(2).inputs, stream[0].inputs)


# --- end to end -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qa_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qa")
    (root / "train.jsonl").write_text("".join(json.dumps({"instruction": q, "output": a}) + "\n" for q, a in QA),
                                      encoding="utf-8")
    (root / "val.jsonl").write_text(json.dumps({"prompt": QA[0][0], "response": QA[0][1]}) + "\n", encoding="utf-8")
    return {p.stem: p for p in root.iterdir()}


def test_finetuned_adapter_answers_in_llama_cpp(stories260k: Path, qa_files: dict[str, Path], tmp_path: Path) -> None:
    """40 steps on four question/answer records; llama.cpp + the adapter answers them greedily."""
    import llama_cpp

    code, out = run(["finetune", "--model-base", str(stories260k), "--train-data", str(qa_files["train"]),
                     "--val-data", str(qa_files["val"]), "-c", "64", "-b", "4", "-n", "40", "--warmup", "0",
                     "--adam-alpha", "0.01", "--lora-r", "8", "--seed", "1", "--no-checkpointing",
                     "--save-every", "0", "-t", "1"], tmp_path)
    assert code == 0, out
    assert "data: 4 prompt-response records (default prompt template)" in out
    assert "loss on responses only), packed into ctx 64" in out
    curve = losses(tmp_path / "checkpoint-log.jsonl")
    assert curve[-1] < 0.5 * curve[0]

    llm = llama_cpp.Llama(model_path=str(stories260k), lora_path=str(tmp_path / "ggml-lora-LATEST-f32.gguf"),
                          n_ctx=128, n_threads=1, verbose=False)
    base = llama_cpp.Llama(model_path=str(stories260k), n_ctx=128, n_threads=1, verbose=False)
    tokenizer = Tokenizer.from_gguf(read_gguf(stories260k))
    encoder = RecordEncoder(tokenizer)
    answered = 0
    for q, a in QA:
        ex = Example("prompt-response", "t", instruction=q, response=a)
        prompt_text, answer_text = (text for text, _ in encoder.pieces(ex))
        prompt = llm.tokenize(prompt_text.encode(), add_bos=True, special=True)
        assert prompt == encoder.encode(ex).tokens[:len(prompt)].tolist()  # what training saw before the answer
        answer = tokenizer.encode(answer_text, add_special=False)

        def greedy(model, prompt=prompt, n=len(answer)) -> list[int]:  # noqa: B008
            model.reset()
            out = []
            for token in model.generate(prompt, top_k=1, temp=0.0):
                out.append(token)
                if len(out) == n:
                    return out
            return out

        got = greedy(llm)
        answered += got == answer
        assert greedy(base) != answer  # the base model does not know them
    assert answered == len(QA), out


def test_chat_finetune_answers_through_llama_cpp_chat_completion(chat_model: Path, tmp_path: Path) -> None:
    """Chat records rendered with the GGUF's own template; llama-cpp-python's chat completion (which
    renders that template itself) answers with the trained answers, greedily, through the adapter.

    stories260K learns the answers in 40 steps but not yet the `<|im_end|>` characters after them,
    so the check is that each reply starts with its answer.
    """
    import llama_cpp

    records = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in QA]
    config = FinetuneConfig(model_base=str(chat_model), train_data="", ctx=96, batch=4, adam_iter=40, warmup=0,
                            adam_alpha=0.01, lora_r=8, seed=1, use_checkpointing=False, save_every=0,
                            checkpoint_in="", checkpoint_out="", lora_out=str(tmp_path / "chat-lora.gguf"))
    trainer = Trainer(config, records=records, log_records=False)
    assert trainer.data.summary().startswith("4 chat records (model's chat template")
    trainer.train()
    trainer.close()
    replies = {}
    for adapter in (tmp_path / "chat-lora.gguf", None):
        llm = llama_cpp.Llama(model_path=str(chat_model), lora_path=str(adapter) if adapter else None, n_ctx=128,
                              n_threads=1, verbose=False)
        assert llm.chat_format == "chat_template.default"  # the GGUF's tokenizer.chat_template
        replies[adapter is not None] = [
            llm.create_chat_completion(messages=[{"role": "user", "content": q}], temperature=0.0, max_tokens=12,
                                       stop=["<|im_end|>"])["choices"][0]["message"]["content"] for q, _ in QA]
        del llm
    assert all(reply.lstrip().startswith(a) for reply, (_, a) in zip(replies[True], QA, strict=True)), replies
    assert not any(reply.lstrip().startswith(a) for reply, (_, a) in zip(replies[False], QA, strict=True))


def test_record_resume_is_exact(stories260k: Path, qa_files: dict[str, Path], tmp_path: Path) -> None:
    common = ["finetune", "--model-base", str(stories260k), "--train-data", str(qa_files["train"]), "-c", "64",
              "-b", "1", "--grad-acc", "2", "--warmup", "2", "--adam-alpha", "0.01", "--seed", "7",
              "--save-every", "0", "--lora-dropout", "0.1"]
    one, two = run_whole_and_resumed(common, tmp_path)
    assert (one / "ggml-lora-LATEST-f32.gguf").read_bytes() == (two / "ggml-lora-LATEST-f32.gguf").read_bytes()
    assert losses(one / "checkpoint-log.jsonl") == losses(two / "checkpoint-log.jsonl")


def test_val_split_holds_out_records(chat_model: Path) -> None:
    records = [{"messages": c} for c in CONVERSATIONS] * 3
    config = FinetuneConfig(model_base=str(chat_model), train_data="", ctx=64, batch=2, adam_iter=2, warmup=0,
                            checkpoint_in="", checkpoint_out="", lora_out="", seed=3, val_split=0.34)
    trainer = Trainer(config, records=records, log_records=False)
    assert trainer.data.counts.records == 6
    before = trainer.evaluate()
    trainer.train()
    assert trainer.evaluate() != before
    with_list = Trainer(config.replace(val_split=0.0), records=records[:6], val_records=records[6:],
                        log_records=False)
    assert len(with_list.val_batches) == 1 and with_list.evaluate() == pytest.approx(before, rel=1e-6)
    trainer.close(), with_list.close()


def test_train_command_takes_records_with_padding(stories260k: Path, qa_files: dict[str, Path],
                                                  tmp_path: Path) -> None:
    """`ggtorch train` (all weights) on records, one record per row, split long ones."""
    code, out = run(["train", "--model-base", str(stories260k), "--train-data", str(qa_files["train"]),
                     "--batching", "pad", "--long-records", "split", "-c", "64", "-b", "2", "-n", "2",
                     "--seed", "1", "--save-every", "0", "--model-out", "m.gguf", "-t", "1"], tmp_path)
    assert code == 0, out
    assert "4 prompt-response records" in out and "padded into ctx 64" in out
    assert (tmp_path / "m.gguf").is_file()


# --- refusals -----------------------------------------------------------------------------------

BAD = [
    ('{"prompt": "a", "response": "b"}\n{"prompt": "c", "response": \n', {}, "bad.jsonl line 2: not valid JSON"),
    ('{"prompt": "a", "response": "b"}\n{"prompt": "c"}\n', {}, "bad.jsonl line 2: missing field 'response'"),
    ('{"prompt": "a", "response": "  "}\n', {}, "bad.jsonl line 1: empty response"),
    ('[1, 2]\n', {}, "bad.jsonl line 1: expected a JSON object"),
    ('{"foo": 1}\n', {}, "cannot tell the format from its keys (foo)"),
    ('{"messages": [{"role": "user", "content": "a"}]}\n', {}, "line 1: no 'assistant' message"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]}\n', {},
     "message 1 is an empty assistant response"),
    ('{"messages": [{"role": "tool", "content": "a"}, {"role": "assistant", "content": "b"}]}\n', {},
     "bad.jsonl line 1: the model's chat template (tokenizer.chat_template) failed to render (unknown role tool)"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n',
     {"chat_template": "{{ messages[0]['content'] }} {% if add_generation_prompt %}A:{% endif %}"},
     "does not write assistant message 1's content into its render of the conversation"),
    ('{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}\n',
     {"chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %"}, "cannot be compiled"),
]


@pytest.mark.parametrize(("content", "options", "message"), BAD, ids=[m[:30] for _, _, m in BAD])
def test_bad_records_are_one_clear_error(chat_model: Path, tokenizer: Tokenizer, tmp_path: Path, content: str,
                                         options: dict[str, str], message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content, encoding="utf-8")
    if "chat_template" in options:
        (tmp_path / "t.jinja").write_text(options["chat_template"], encoding="utf-8")
        options = {"chat_template": str(tmp_path / "t.jinja")}
    with pytest.raises(BadData) as e:
        RecordData(read_records(path), tokenizer, 64, RecordOptions(**options), seed=1, model_template=TEMPLATE)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_chat_records_without_a_template_ask_for_one(tokenizer: Tokenizer) -> None:
    with pytest.raises(BadData, match="has no tokenizer.chat_template; pass one with --chat-template"):
        RecordData(load_records([{"messages": CONVERSATIONS[0]}], "records"), tokenizer, 64, seed=1)


def test_template_failure_is_a_bad_data_error_not_a_crash(tokenizer: Tokenizer) -> None:
    template = ChatTemplate("{{ messages[5]['content'] }}", "<s>", "</s>")
    with pytest.raises(BadData, match="failed to render"):
        template.render([("user", "a")], where="r")


# --- templates that do not do what they say ----------------------------------------------------

# TEMPLATE without its generation prompt: the assistant header is written before each answer, never as a prompt;
# it cuts an answer's reasoning out, as reasoning templates do
IGNORES_GENERATION_PROMPT = (TEMPLATE.replace("{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", "")
                             .replace("{{ m['content'] }}", "{{ m['content'].split('</think>')[-1] }}"))


@pytest.mark.parametrize("records", [
    [{"messages": CONVERSATIONS[0]}],
    # an answer the render rewrites is located by the generation prompt: the header would train with it
    [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>Greet.</think>Yo"}]}],
], ids=["plain", "located-by-rendering"])
def test_a_template_that_ignores_add_generation_prompt_is_refused_by_name(tokenizer: Tokenizer, tmp_path: Path,
                                                                         records: list[dict]) -> None:
    """Its header would train as part of every answer located by rendering, and generation with it would not be
    prompted with the header: one message naming the template, the header and the fix."""
    path = tmp_path / "t.jinja"
    path.write_text(IGNORES_GENERATION_PROMPT, encoding="utf-8")
    assert IGNORES_GENERATION_PROMPT != TEMPLATE
    with pytest.raises(BadData) as e:
        RecordData(load_records(records, "records"), tokenizer, 64, RecordOptions(chat_template=str(path)), seed=1,
                   model_template=TEMPLATE)
    assert str(e.value) == (
        f"--train-data record 1: the chat template {path} ignores add_generation_prompt: it writes the assistant "
        'header "<|im_start|>assistant\\n" before each answer but not as the generation prompt, so the header would '
        "train as part of the answers; pass --chat-template with a template that writes it when "
        "add_generation_prompt is true")
    data = RecordData(load_records(records, "records"), tokenizer, 64, seed=1, model_template=TEMPLATE)
    assert all("assistant" not in text for text in trained_texts(tokenizer, data.encoded[0]))


def test_no_real_template_is_taken_for_one_that_ignores_the_generation_prompt() -> None:
    """Every template llama.cpp ships renders an answer after its own generation prompt (or writes no header, as
    Mistral's ``[/INST]`` answer), so none is refused."""
    from ggtorch.data.chat import check_generation_prompt

    paths = sorted(template_file("Qwen-Qwen2.5-7B-Instruct").parent.glob("*.jinja"))
    assert len(paths) > 50
    for path in paths:
        check_generation_prompt(ChatTemplate(path.read_text(encoding="utf-8"), "<s>", "</s>", path.name), "probe")
