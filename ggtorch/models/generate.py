"""Text generation (greedy / temperature / top-k / top-p with a KV cache) and perplexity.

Sampling follows llama.cpp's default sampler chain order: top-k, then top-p on the
softmax of the raw logits, then temperature, then a draw. Perplexity is llama.cpp's
``llama-perplexity`` (tools/perplexity/perplexity.cpp), so the numbers are comparable.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass

import torch

from ggtorch.errors import BadData, BadFlag
from ggtorch.models.model import Transformer
from ggtorch.models.tokenizer import Tokenizer
from ggtorch.ops import policy
from ggtorch.ops.threads import follow_free_cores

SEED_MAX = 2**64 - 1
"""The largest sampling seed: torch.Generator's 64 bits."""


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_whole(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is picked. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0
    """Keep the k most likely tokens; 0 keeps all."""
    top_p: float = 1.0
    """Keep the most likely tokens until their probabilities sum to at least top_p; 1 keeps all."""
    seed: int | None = None

    def __post_init__(self) -> None:
        """The one check of the sampling options: ``ggtorch generate``'s flags and the API's keywords build this."""
        if not _is_number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise BadFlag(f"--temp: temperature {self.temperature!r} must be >= 0 and finite (0 is greedy)")
        if not _is_whole(self.top_k) or self.top_k < 0:
            raise BadFlag(f"--top-k: top-k {self.top_k!r} must be >= 0, a whole number (0 disables it)")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise BadFlag(f"--top-p: top-p {self.top_p!r} must be in (0, 1] (1 disables it)")
        if self.seed is not None and (not _is_whole(self.seed) or not 0 <= self.seed <= SEED_MAX):
            raise BadFlag(f"-s: seed {self.seed!r} must be in [0, {SEED_MAX}], a whole number (-1 on the command "
                          "line, None in Python, picks one at random)")


@contextlib.contextmanager
def computing(model: Transformer, autocast: torch.dtype | None = None) -> Iterator[None]:
    """Eval mode (no dropout) and ``autocast`` (a bf16 or f16 run's compute dtype; None: the model's own dtypes)
    while a model generates or is evaluated; its training mode as it was after."""
    was_training = model.training
    model.eval()
    try:
        with torch.autocast(model.output_norm.weight.device.type, dtype=autocast or torch.float32,
                            enabled=autocast is not None):
            yield
    finally:
        model.train(was_training)


def check_n_tokens(n_tokens: int) -> None:
    """The one check of how many tokens to generate (``ggtorch generate -n``, the API's ``n_tokens``)."""
    if not _is_whole(n_tokens) or n_tokens < 1:
        raise BadFlag(f"-n: n_tokens {n_tokens!r} must be >= 1, a whole number")


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Logits (..., V) with all but the k largest set to -inf (ties at the k-th value kept)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Logits (..., V) keeping the smallest most-likely set whose probability reaches p.

    As llama.cpp's llama_sampler_top_p_apply: tokens sorted by probability are kept up to and
    including the first one at which the cumulative sum reaches p (at least one is kept).
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    # keep a token if the mass before it is still below p
    drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= p
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids (B,) from last-position logits (B, V)."""
    if params.temperature == 0.0:
        return logits.argmax(dim=-1)
    logits = filter_top_p(filter_top_k(logits.float(), params.top_k), params.top_p)
    # the largest logit subtracted first: a tiny temperature then sharpens to greedy instead of overflowing to nan
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits / params.temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def check_fits(model: Transformer, n_prompt: int, n_tokens: int) -> None:
    """Refuse a generation the model's context cannot hold, saying which part to shorten."""
    check_n_tokens(n_tokens)
    n_ctx = model.config.n_ctx_train
    if n_prompt >= n_ctx:
        raise BadData(f"the prompt is {n_prompt} tokens and the model's context holds {n_ctx}, with room for "
                      "the text it writes; shorten the prompt")
    if n_prompt + n_tokens > n_ctx:
        raise BadFlag(f"the prompt ({n_prompt} tokens) and {n_tokens} new tokens exceed the model's context of "
                      f"{n_ctx}; ask for at most {n_ctx - n_prompt} new tokens (-n)")


@torch.no_grad()
def iter_tokens(model: Transformer, prompt_tokens: Sequence[int], n_tokens: int,
                params: SamplingParams = SamplingParams(), stop_ids: Collection[int] = ()) -> Iterator[int]:
    """Yield up to n_tokens new token ids after prompt_tokens, one forward of T=1 per token.

    The prompt is evaluated once into a KV cache; each new token then costs one position.
    Stops early after a token of ``stop_ids`` (which is yielded), e.g. the tokenizer's eog_ids.
    """
    if not prompt_tokens:
        raise BadData("generation needs at least one prompt token (e.g. BOS)")
    check_fits(model, len(prompt_tokens), n_tokens)
    device = model.output_norm.weight.device
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device)
        generator.manual_seed(params.seed)
    cache = model.new_cache(1, len(prompt_tokens) + n_tokens)
    tokens = torch.tensor([list(prompt_tokens)], dtype=torch.long, device=device)  # (1, T)
    for _ in range(n_tokens):
        follow_free_cores()
        logits = model(tokens, cache=cache, last_only=True)[:, -1]  # (1, V)
        tokens = sample(logits, params, generator)[:, None]  # (1, 1)
        token = int(tokens[0, 0])
        yield token
        if token in stop_ids:
            return


def generate_tokens(model: Transformer, prompt_tokens: Sequence[int], n_tokens: int,
                    params: SamplingParams = SamplingParams(), stop_ids: Collection[int] = ()) -> list[int]:
    """The new token ids (see iter_tokens)."""
    return list(iter_tokens(model, prompt_tokens, n_tokens, params, stop_ids))


def generate(model: Transformer, tokenizer: Tokenizer, prompt: str, n_tokens: int, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int | None = None, stop_at_eos: bool = True) -> str:
    """The text the model writes after ``prompt`` (tokenized with BOS as llama.cpp does).

    Stops at an end-of-generation token (EOS, EOT, ...) unless ``stop_at_eos`` is False.
    """
    params = SamplingParams(temperature, top_k, top_p, seed)
    prompt_tokens = tokenizer.encode(prompt, add_special=True)
    stop = tokenizer.eog_ids if stop_at_eos else frozenset()
    new = generate_tokens(model, prompt_tokens, n_tokens, params, stop)
    if new and new[-1] in stop:
        new = new[:-1]
    return tokenizer.decode(new, prev_ids=prompt_tokens)


def llama_cpp_context(n_ctx: int) -> int:
    """The per-sequence context llama.cpp runs with when asked for ``n_ctx``: padded up to a multiple
    of 256 (what decides LongRoPE's long or short factors there)."""
    return -(-n_ctx // 256) * 256


@dataclass(frozen=True)
class PerplexityResult:
    """llama-perplexity's final estimate: exp(mean NLL) over the scored tokens."""

    perplexity: float
    nll: float
    """Mean negative log-likelihood (nats per token)."""
    n_scored: int
    n_chunks: int


@torch.no_grad()
def perplexity(model: Transformer, tokens: Sequence[int], n_ctx: int, bos_id: int | None = None,
               batch_size: int = 1) -> PerplexityResult:
    """Perplexity as llama.cpp's llama-perplexity computes it.

    ``tokens`` is the whole text tokenized once (with BOS when the vocabulary adds it). It is
    cut into len(tokens) // n_ctx chunks of n_ctx tokens (the tail is dropped); each chunk's
    first token is replaced by ``bos_id`` (when given, i.e. when the vocabulary adds BOS) and
    evaluated from position 0. With first = n_ctx // 2, the logits at positions
    first .. n_ctx - 2 are scored against the tokens at first + 1 .. n_ctx - 1, so each chunk
    contributes n_ctx - 1 - first tokens, each with at least first tokens of context.
    """
    if n_ctx < 4:
        raise BadFlag(f"context {n_ctx} is too small for perplexity; use at least 4")
    if n_ctx > model.config.n_ctx_train:
        raise BadFlag(f"context {n_ctx} exceeds the model's training context {model.config.n_ctx_train}")
    if len(tokens) < 2 * n_ctx:
        raise BadData(f"the text tokenizes to {len(tokens)} tokens; perplexity with a context of {n_ctx} "
                      f"needs at least {2 * n_ctx}")
    device = model.output_norm.weight.device
    n_chunks = len(tokens) // n_ctx
    first = n_ctx // 2
    chunks = torch.tensor(list(tokens[: n_chunks * n_ctx]), dtype=torch.long, device=device).view(n_chunks, n_ctx)
    targets = chunks[:, first + 1:]  # (n_chunks, n_ctx - 1 - first)
    if bos_id is not None:
        chunks = chunks.clone()
        chunks[:, 0] = bos_id
    nll = torch.zeros((), dtype=torch.float64, device=device)
    rows = max(1, policy.current(device).eval_head_bytes // (4 * model.config.n_vocab))  # a few rows' logits at a time
    saved_ctx, model.n_ctx = model.n_ctx, llama_cpp_context(n_ctx)  # LongRoPE's factors follow the context
    try:
        for start in range(0, n_chunks, batch_size):
            follow_free_cores()
            hidden = model(chunks[start:start + batch_size], hidden_only=True)[:, first:n_ctx - 1]  # (b, n, C)
            hidden, scored = hidden.reshape(-1, hidden.shape[-1]), targets[start:start + batch_size].reshape(-1)
            for r0 in range(0, hidden.shape[0], rows):
                logprobs = torch.log_softmax(model.head(hidden[r0:r0 + rows]), dim=-1)  # (rows, V)
                nll -= logprobs.gather(-1, scored[r0:r0 + rows, None]).double().sum()
    finally:
        model.n_ctx = saved_ctx
    n_scored = n_chunks * (n_ctx - 1 - first)
    mean = float(nll) / n_scored
    return PerplexityResult(math.exp(mean), mean, n_scored, n_chunks)
