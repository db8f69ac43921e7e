"""Generation and perplexity: stories260K's known greedy text, sampling definitions, llama.cpp's perplexity."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ggtorch.errors import BadData, BadFlag
from ggtorch.models.generate import (
    SamplingParams,
    filter_top_k,
    filter_top_p,
    generate,
    generate_tokens,
    iter_tokens,
    perplexity,
    sample,
)
from ggtorch.models.loader import LoadedModel, load_model_file
from tests.llama_models import llama_cpp_logits, open_llama_cpp

# llama.cpp's greedy decoding of stories260K (tests/fixtures) from BOS alone.
REFERENCE_TEXT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball. She wanted to play with it, but it was too high.\n"
    "Lily's mom said, \"Lily, let's go to the park.\" Lily was sad and didn't know"
)


@pytest.fixture(scope="module")
def stories(stories260k: Path) -> LoadedModel:
    return load_model_file(stories260k)


def test_greedy_generation_from_bos_reproduces_reference(stories: LoadedModel) -> None:
    tok = stories.tokenizer
    new = generate_tokens(stories.model, [tok.bos_id], 120, stop_ids=tok.eog_ids)
    text = tok.decode(new)
    assert text.startswith(REFERENCE_TEXT), text
    assert generate(stories.model, tok, "", 120).startswith(REFERENCE_TEXT)


def test_generation_uses_the_cache_and_equals_full_forward(stories: LoadedModel) -> None:
    model, prompt = stories.model, stories.tokenizer.encode("Once upon a time")
    seen: list[int] = []
    handle = model.register_forward_pre_hook(lambda _m, args, kwargs: seen.append(args[0].shape[1]), with_kwargs=True)
    try:
        new = generate_tokens(model, prompt, 20)
    finally:
        handle.remove()
    assert seen == [len(prompt)] + [1] * 19  # the prompt once, then one position per new token
    with torch.no_grad():
        full = model(torch.tensor([prompt + new]))[0]
    # greedy through the cache picks what a full forward over the same text picks at every step
    assert full[len(prompt) - 1:-1].argmax(-1).tolist() == new


def test_seeded_sampling_is_reproducible(stories: LoadedModel) -> None:
    model, prompt = stories.model, [stories.tokenizer.bos_id]
    params = SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=123)
    a = generate_tokens(model, prompt, 40, params)
    assert a == generate_tokens(model, prompt, 40, params)
    assert a != generate_tokens(model, prompt, 40, SamplingParams(temperature=1.0, top_k=40, top_p=0.95, seed=7))


def test_top_k_one_is_greedy(stories: LoadedModel) -> None:
    model, prompt = stories.model, [stories.tokenizer.bos_id]
    assert generate_tokens(model, prompt, 30, SamplingParams(temperature=0.8, top_k=1, seed=1)) == \
        generate_tokens(model, prompt, 30)


def test_top_k_keeps_exactly_the_k_largest() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    kept = torch.isfinite(filter_top_k(logits, 7))
    for row, mask in zip(logits, kept, strict=True):
        assert set(mask.nonzero().flatten().tolist()) == set(row.argsort(descending=True)[:7].tolist())


def nucleus(probs: list[float], p: float) -> set[int]:
    """Reference top-p: walk tokens by falling probability, stop once the kept mass reaches p."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = set(), 0.0
    for i in order:
        kept.add(i)
        mass += probs[i]
        if mass >= p:
            break
    return kept


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_keeps_the_smallest_set_reaching_p(p: float) -> None:
    logits = torch.randn(3, 50, dtype=torch.float64, generator=torch.Generator().manual_seed(1)) * 2
    kept = torch.isfinite(filter_top_p(logits, p))
    for row, mask in zip(logits, kept, strict=True):
        assert set(mask.nonzero().flatten().tolist()) == nucleus(torch.softmax(row, -1).tolist(), p)


def test_samples_stay_inside_top_k_and_top_p() -> None:
    logits = torch.tensor([[3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0, -2.0]]).repeat(500, 1)
    gen = torch.Generator().manual_seed(0)
    k_draws = set(sample(logits, SamplingParams(temperature=1.5, top_k=3), gen).tolist())
    assert k_draws == {0, 1, 2}
    allowed = nucleus(torch.softmax(logits[0], -1).tolist(), 0.8)
    p_draws = set(sample(logits, SamplingParams(temperature=1.5, top_p=0.8), gen).tolist())
    assert p_draws == allowed


def test_bad_sampling_flags_are_rejected() -> None:
    for kwargs in ({"temperature": -1.0}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(BadFlag):
            SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": math.nan}, "--temp: temperature nan must be >= 0 and finite"),
    ({"temperature": math.inf}, "--temp: temperature inf must be >= 0 and finite"),
    ({"top_p": math.nan}, "--top-p: top-p nan must be in (0, 1]"),
    ({"top_k": 2.5}, "--top-k: top-k 2.5 must be >= 0, a whole number"),
    ({"seed": -5}, "-s: seed -5 must be in [0, 18446744073709551615]"),
])
def test_sampling_values_without_meaning_are_refused_with_the_range(kwargs: dict, message: str) -> None:
    with pytest.raises(BadFlag) as refused:
        SamplingParams(**kwargs)
    assert str(refused.value).startswith(message)


def test_a_tiny_temperature_samples_the_most_likely_token() -> None:
    """A temperature far below a logit's spacing sharpens to greedy instead of overflowing to nan probabilities."""
    logits = torch.tensor([[3.0, 30.0, -2.0, 29.5]])
    for temperature in (1e-30, 1e-45):
        assert sample(logits, SamplingParams(temperature=temperature, seed=0), torch.Generator()).tolist() == [1]


@pytest.mark.parametrize("n_tokens", [0, -2])
def test_no_tokens_to_generate_is_refused_as_the_cli_refuses_it(stories: LoadedModel, n_tokens: int) -> None:
    with pytest.raises(BadFlag, match=f"-n: n_tokens {n_tokens} must be >= 1"):
        generate(stories.model, stories.tokenizer, "Once", n_tokens)


def test_generation_beyond_context_is_refused(stories: LoadedModel) -> None:
    with pytest.raises(BadFlag, match="context"):
        list(iter_tokens(stories.model, [1], stories.config.n_ctx_train))


def reference_perplexity(llm, tokens: list[int], n_ctx: int, bos: int) -> float:
    """llama-perplexity's definition, from llama.cpp's logits (tools/perplexity/perplexity.cpp)."""
    first, nll, count = n_ctx // 2, 0.0, 0
    for c in range(len(tokens) // n_ctx):
        chunk = tokens[c * n_ctx:(c + 1) * n_ctx]
        logits = llama_cpp_logits(llm, [bos] + chunk[1:]).astype(np.float64)
        for i in range(first, n_ctx - 1):
            row = logits[i]
            log_z = row.max() + math.log(np.exp(row - row.max()).sum())
            nll += log_z - row[chunk[i + 1]]
            count += 1
    return math.exp(nll / count)


def test_perplexity_equals_llama_cpp_definition(stories: LoadedModel, shakespeare: Path) -> None:
    text = shakespeare.read_text()[:3000]
    n_ctx = 128
    tokens = stories.tokenizer.encode(text, add_special=True)
    llm = open_llama_cpp(stories.gguf.path, n_ctx=n_ctx)
    assert tokens == llm.tokenize(text.encode(), add_bos=True, special=False)
    expected = reference_perplexity(llm, tokens, n_ctx, stories.tokenizer.bos_id)
    result = perplexity(stories.model, tokens, n_ctx, bos_id=stories.tokenizer.bos_id, batch_size=2)
    assert result.n_chunks == len(tokens) // n_ctx >= 4
    assert result.n_scored == result.n_chunks * (n_ctx - 1 - n_ctx // 2)
    assert f"{result.perplexity:.3g}" == f"{expected:.3g}"
    assert result.perplexity == pytest.approx(expected, rel=1e-4)


def test_perplexity_needs_two_contexts_of_text(stories: LoadedModel) -> None:
    with pytest.raises(BadData, match="at least 256"):
        perplexity(stories.model, list(range(200)), 128)


def test_generation_stops_after_a_stop_token(stories: LoadedModel) -> None:
    model, prompt = stories.model, [stories.tokenizer.bos_id]
    params = SamplingParams(temperature=1.0, seed=5)
    free = generate_tokens(model, prompt, 60, params)
    stop = free[10]  # a token the run does produce; generation must end at its first occurrence
    stopped = generate_tokens(model, prompt, 60, params, stop_ids={stop})
    assert stopped == free[: free.index(stop) + 1]
