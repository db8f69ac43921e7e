"""The old finetune's data pipeline: samples, shuffle, batches and resume, against hand-written batches.

Most cases use a character tokenizer (token id = code point, BOS 1, EOS 2) so that expected
rows can be written out by hand; ``ids("ab")`` is just ``[97, 98]``. The mt19937 engine and
the shuffle are checked against a Mersenne Twister written out in this file and known
``std::mt19937`` outputs; tokenization against llama.cpp itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ggtorch.data import (
    DataOptions,
    DataState,
    Shuffled,
    TrainingData,
    Vocab,
    build_batch,
    make_samples,
    process_escapes,
    read_text_file,
    resolve_seed,
    shuffle_samples,
)
from ggtorch.errors import BadData
from ggtorch.io.gguf import read_gguf
from ggtorch.rng import MT19937

B, E = 1, 2  # BOS, EOS of the character vocabulary


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def char_vocab(n_vocab: int = 256, max_token_text_len: int = 1) -> Vocab:
    return Vocab(tokenize=ids, bos_id=B, eos_id=E, n_vocab=n_vocab, max_token_text_len=max_token_text_len)


# --- an independent Mersenne Twister (MT19937 reference algorithm) -----------------------------

class RefMT:
    """Matsumoto & Nishimura's genrand_int32, written out from the paper's reference code."""

    def __init__(self, seed: int | None = None, words: list[int] | None = None, pos: int = 624):
        if words is None:
            assert seed is not None
            words = [seed & 0xFFFFFFFF]
            for i in range(1, 624):
                words.append((1812433253 * (words[-1] ^ (words[-1] >> 30)) + i) & 0xFFFFFFFF)
        self.mt, self.i = list(words), pos

    def __call__(self) -> int:
        if self.i >= 624:
            for k in range(624):
                y = (self.mt[k] & 0x80000000) | (self.mt[(k + 1) % 624] & 0x7FFFFFFF)
                self.mt[k] = self.mt[(k + 397) % 624] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
            self.i = 0
        y = self.mt[self.i]
        self.i += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        return y ^ (y >> 18)

    def text(self) -> str:
        return " ".join(map(str, self.mt)) + f" {self.i}"


def ref_shuffle(state: str, sizes: list[int]) -> tuple[list[int], list[int], str]:
    """shuffle_samples from the old train.cpp, in plain Python: (order, offsets, state after)."""
    nums = [int(x) for x in state.split()]
    rng = RefMT(words=nums[:624], pos=nums[624])
    rnd = [rng() for _ in sizes]
    order = sorted(range(len(sizes)), key=lambda i: (rnd[i], i))
    offs = [int((sizes[order[j]] - 1) * (rng() / 4294967294.0)) for j in range(len(sizes))]
    return order, offs, rng.text()


# --- mt19937 -------------------------------------------------------------------------------------

def test_mt19937_known_outputs() -> None:
    rng = MT19937()
    assert rng() == 3499211612  # std::mt19937 default seed 5489, first output
    rng = MT19937(5489)
    rng.discard(9999)
    assert rng() == 4123659995  # the 10000th output, required by the C++ standard


@pytest.mark.parametrize("seed", [0, 1, 42, 0xFFFFFFFF, -1 & 0xFFFFFFFF])
def test_mt19937_matches_reference_and_text_state(seed: int) -> None:
    ref, mine = RefMT(seed), MT19937(seed)
    assert mine.state() == ref.text()  # libstdc++ text of std::mt19937(seed): 624 words, then 624
    assert mine.state().split()[0] == str(seed) and mine.state().split()[-1] == "624"
    assert [mine() for _ in range(700)] == [ref() for _ in range(700)]
    assert mine.state() == ref.text()
    resumed = MT19937.from_state(mine.state())
    assert list(resumed.draw(1300)) == [ref() for _ in range(1300)]


def test_mt19937_rejects_malformed_state() -> None:
    with pytest.raises(ValueError):
        MT19937.from_state("1 2 3")
    with pytest.raises(ValueError):
        MT19937.from_state(" ".join(["1"] * 624) + " 625")


def test_options_defaults_and_from_finetune() -> None:
    o = DataOptions()
    assert (o.sample_start, o.include_sample_start, o.escape, o.overlapping_samples, o.fill_with_next_samples,
            o.separate_with_eos, o.separate_with_bos, o.sample_random_offsets, o.force_reshuffle, o.seed) == \
        ("", False, False, False, False, False, True, False, False, -1)  # the old finetune's defaults
    from ggtorch.training.config import FinetuneConfig

    cfg = FinetuneConfig(sample_start="<s>", fill_with_next_samples=True, separate_with_bos=False, seed=11)
    o = DataOptions.from_finetune(cfg)
    assert (o.sample_start, o.fill_with_next_samples, o.separate_with_bos, o.seed) == ("<s>", True, False, 11)
    assert resolve_seed(5) == 5 and resolve_seed(-2) == 0xFFFFFFFE  # std::mt19937(unsigned(seed))


# --- text ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("src, expected", [
    ("a\\nb", b"a\nb"), ("\\r\\t\\'\\\"\\\\", b"\r\t'\"\\"), ("\\x41\\x7a", b"Az"), ("\\xe2\\x96\\x81", "▁".encode()),
    ("\\q", b"\\q"), ("end\\", b"end\\"), ("\\xZZ", b"\\xZZ"), ("\\x4", b"\\x4"), ("\\x-1", b"\xff"),
    ("\\x 9", b"\t"), ("é\\n", "é\n".encode()),
])
def test_process_escapes(src: str, expected: bytes) -> None:
    assert process_escapes(src) == expected


def test_non_utf8_names_the_byte_offset(tmp_path) -> None:
    data = b"hello\n w\xc3\xb6rld \xff and more"
    with pytest.raises(BadData, match=r"byte 14 \(0xff\)"):
        TrainingData(data, char_vocab(), n_ctx=4)
    replaced = TrainingData(data, char_vocab(n_vocab=70000), n_ctx=4, options=DataOptions(utf8_errors="replace"))
    assert replaced.samples.tokens[13] == 0xFFFD  # ö is one token


def test_read_text_file_errors(tmp_path) -> None:
    with pytest.raises(BadData, match="--train-data .*no such file"):
        read_text_file(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(BadData, match="--val-data .*empty"):
        read_text_file(tmp_path / "empty.txt", "--val-data")
    (tmp_path / "t.txt").write_bytes(b"abc\xff")
    assert read_text_file(tmp_path / "t.txt") == b"abc\xff"


# --- samples (tokenize_file) -------------------------------------------------------------------

def samples_of(text: str | bytes, n_ctx: int, vocab: Vocab | None = None, **opts) -> list[list[int]]:
    data = text.encode() if isinstance(text, str) else text
    s = make_samples(data, vocab or char_vocab(), n_ctx, DataOptions(**opts))
    return [s.tokens[b:b + n].tolist() for b, n in zip(s.begins, s.sizes, strict=True)]


def test_samples_every_token_position() -> None:
    # T = 6, n_ctx = 3: begins 0, 1, 2 (E = T - n_ctx = 3 is left out)
    assert samples_of("abcdef", 3) == [ids("abc"), ids("bcd"), ids("cde")]
    assert samples_of("abcd", 3) == [ids("abc")]  # E = 1: only begin 0
    assert samples_of("abc", 3) == [ids("abc")]  # E = 0
    s = make_samples(b"ab", char_vocab(), 3, DataOptions())
    assert s.begins.tolist() == [0] and s.sizes.tolist() == [2]  # shorter than a context: one short sample
    assert any("fewer than the context" in w for w in s.warnings)


def test_samples_sample_start() -> None:
    text = "#ab#cde#f"
    assert samples_of(text, 4, sample_start="#") == [ids("ab"), ids("cde"), ids("f")]
    assert samples_of(text, 4, sample_start="#", include_sample_start=True) == [ids("#ab"), ids("#cde"), ids("#f")]
    # overlapping: each sample runs max_token_text_len * n_ctx = 4 bytes (past the next start)
    assert samples_of(text, 4, sample_start="#", overlapping_samples=True) == [ids("ab#c"), ids("cde#"), ids("f")]
    assert samples_of(text, 2, char_vocab(max_token_text_len=3), sample_start="#", overlapping_samples=True,
                      include_sample_start=True) == [ids("#ab#cd"), ids("#cde#f"), ids("#f")]
    # multi-byte pattern, found again only after the previous match
    assert samples_of("xx--a----b", 4, sample_start="--") == [ids("a"), [], ids("b")]


def test_samples_utf8_end_moves_to_next_character() -> None:
    # "é" is 2 bytes: a 2-byte window from "a" ends inside it and is moved to its end
    assert samples_of("#aé#b", 2, sample_start="#", overlapping_samples=True) == [ids("aé"), ids("b")]
    assert samples_of("#aé#b", 2, sample_start="#", overlapping_samples=True, include_sample_start=True) == \
        [ids("#a"), ids("#b")]


def test_samples_empty_and_missing_pattern() -> None:
    s = make_samples(b"##a", char_vocab(), 4, DataOptions(sample_start="#"))
    assert s.begins.tolist() == [0, 0] and s.sizes.tolist() == [0, 1]
    assert any("1 empty samples" in w for w in s.warnings)
    # pattern absent: one sample at byte 0, still skipping len(pattern) bytes as llama.cpp did
    s = make_samples(b"abc", char_vocab(), 4, DataOptions(sample_start="#"))
    assert s.tokens.tolist() == ids("bc") and any("not found" in w for w in s.warnings)
    assert samples_of("abc", 4, sample_start="#", include_sample_start=True) == [ids("abc")]


def test_samples_escape() -> None:
    text = "one\ntwo\\nthree\nfour"
    assert samples_of(text, 8, sample_start="\\n", escape=True) == [ids("two\\nthree"), ids("four")]
    assert samples_of(text, 8, sample_start="\\n") == [ids("three\nfour")]  # literal backslash-n
    assert samples_of("a\tb\tc", 8, sample_start="\\x09", escape=True) == [ids("b"), ids("c")]


# --- batches (get_example_targets_batch) -------------------------------------------------------

SAMPLES = "#ab#cde#f"  # samples A = ab, C = cde, F = f (sample start '#')


def batch(order: list[int], offsets: list[int] | None = None, n_batch: int = 3, n_ctx: int = 4, start: int = 0,
          text: str = SAMPLES, vocab: Vocab | None = None, **opts) -> tuple[list, list, int]:
    s = make_samples(text.encode(), vocab or char_vocab(), n_ctx, DataOptions(sample_start="#"))
    sh = Shuffled(np.asarray(offsets or [0] * len(order)), s.begins[order], s.sizes[order])
    inputs, targets, used = build_batch(s.tokens, sh, start, n_batch, n_ctx, vocab or char_vocab(),
                                        DataOptions(**opts))
    assert inputs.dtype == targets.dtype == torch.int64 and inputs.shape == targets.shape == (n_batch, n_ctx)
    assert inputs[:, 0].eq(B).all() and torch.equal(inputs[:, 1:], targets[:, :-1])
    return inputs.tolist(), targets.tolist(), used


a, b, c, d, e, f = ids("abcdef")


def test_batch_default_pads_with_eos() -> None:
    inputs, targets, used = batch([0, 1, 2])
    assert targets == [[a, b, E, E], [c, d, e, E], [f, E, E, E]]
    assert inputs == [[B, a, b, E], [B, c, d, e], [B, f, E, E]]
    assert used == 3
    _, targets, used = batch([2, 0, 1], n_batch=2, start=2)  # order F, A, C from position 2: C then (wrap) F
    assert targets == [[c, d, e, E], [f, E, E, E]] and used == 2


def test_batch_cut_at_context() -> None:
    _, targets, _ = batch([1], n_batch=1, n_ctx=2)
    assert targets == [[c, d]]


@pytest.mark.parametrize("eos, bos, rows, used", [
    (False, True, [[a, b, B, c], [f, B, a, b], [c, d, e, B]], 5),  # the defaults
    (True, True, [[a, b, E, B], [c, d, e, E], [f, E, B, a]], 4),
    (True, False, [[a, b, E, c], [f, E, a, b], [c, d, e, E]], 5),
    (False, False, [[a, b, c, d], [f, a, b, c], [f, a, b, c]], 8),
])
def test_batch_fill_with_next_samples(eos: bool, bos: bool, rows: list, used: int) -> None:
    inputs, targets, n = batch([0, 1, 2], fill_with_next_samples=True, separate_with_eos=eos, separate_with_bos=bos)
    assert targets == rows and n == used
    assert inputs == [[B, *r[:-1]] for r in rows]


def test_batch_separators_matter_only_with_fill() -> None:
    assert batch([0, 1, 2], separate_with_eos=True, separate_with_bos=False)[1] == batch([0, 1, 2])[1]


def test_batch_fill_over_empty_samples() -> None:
    # samples: '' , a, bc; an empty next sample emits EOS at the switch position
    _, targets, used = batch([0, 1, 2], n_batch=1, text="##a#bc", fill_with_next_samples=True,
                             separate_with_bos=False)
    assert targets == [[a, b, c, E]] and used == 4


def test_batch_random_offsets() -> None:
    _, targets, used = batch([0, 1, 2], offsets=[1, 2, 0], sample_random_offsets=True)
    assert targets == [[b, E, E, E], [e, E, E, E], [f, E, E, E]] and used == 3
    _, targets, _ = batch([0, 1, 2], offsets=[1, 2, 0], n_batch=1, sample_random_offsets=True,
                          fill_with_next_samples=True)
    assert targets == [[b, B, c, d]]  # the next sample starts at offset 0
    _, targets, _ = batch([0, 1, 2], offsets=[1, 2, 0])  # offsets ignored without the flag
    assert targets == [[a, b, E, E], [c, d, e, E], [f, E, E, E]]


def test_batch_clamps_tokens_to_vocab() -> None:
    _, targets, _ = batch([0, 1, 2], vocab=char_vocab(n_vocab=100))  # d = 100, e = 101, f = 102 -> 99
    assert targets == [[a, b, E, E], [c, 99, 99, E], [99, E, E, E]]


# --- shuffle and the training stream -------------------------------------------------------------

def test_shuffle_matches_independent_permutation() -> None:
    sizes = np.asarray([5, 1, 0, 9, 3, 7, 2, 8, 4, 6, 1000000007], dtype=np.int64)
    begins = np.arange(len(sizes), dtype=np.int64) * 10
    state = MT19937(1234).state()
    sh, after = shuffle_samples(state, begins, sizes)
    order, offs, ref_after = ref_shuffle(state, sizes.tolist())
    assert sh.begins.tolist() == [10 * i for i in order]
    assert sh.sizes.tolist() == [int(sizes[i]) for i in order]
    assert [o for o, s in zip(sh.offsets.tolist(), sh.sizes.tolist(), strict=True) if s > 0] == \
        [o for o, i in zip(offs, order, strict=True) if sizes[i] > 0]
    assert after == ref_after


def stream(text: str = "#ab#cde#f#gh#ijk", n_ctx: int = 4, seed: int = 7, **opts) -> TrainingData:
    return TrainingData(text.encode(), char_vocab(), n_ctx=n_ctx, options=DataOptions(sample_start="#", **opts),
                        seed=seed)


def test_stream_order_epochs_and_reshuffle() -> None:
    data = stream()
    per_sample = [ids(w) for w in ("ab", "cde", "f", "gh", "ijk")]
    sizes = [len(w) for w in per_sample]
    order0, _, state1 = ref_shuffle(MT19937(7).state(), sizes)
    order1, _, _ = ref_shuffle(state1, sizes)

    def row(i: int) -> list[int]:
        return (per_sample[i] + [E] * 4)[:4]

    assert data.next_batch(2).targets.tolist() == [row(order0[0]), row(order0[1])]
    assert data.next_batch(2).targets.tolist() == [row(order0[2]), row(order0[3])]
    assert data.epoch == 0 and data.next_sample == 4
    # the third batch crosses the end: it wraps within the old order, then an epoch ends
    assert data.next_batch(2).targets.tolist() == [row(order0[4]), row(order0[0])]
    assert data.epoch == 1 and data.next_sample == 0
    assert data.next_batch(2).targets.tolist() == [row(order1[0]), row(order1[1])]
    assert order0 != order1
    assert data.epoch == 1 and data.next_sample == 2
    assert data.state.rng_state == state1  # the state before the current permutation
    assert data.samples_used == 8


def test_resume_equals_uninterrupted() -> None:
    opts = dict(fill_with_next_samples=True, separate_with_eos=True, sample_random_offsets=True)
    whole = stream(**opts)
    expected = [whole.next_batch(3) for _ in range(9)]
    first = stream(**opts)
    got = [first.next_batch(3) for _ in range(4)]
    saved = json.loads(json.dumps(first.state_dict()))
    resumed = stream(seed=99, **opts)  # the seed only matters for a fresh order
    assert resumed.load_state_dict(saved) == []
    got += [resumed.next_batch(3) for _ in range(5)]
    for b1, b2 in zip(expected, got, strict=True):
        assert torch.equal(b1.inputs, b2.inputs) and torch.equal(b1.targets, b2.targets)
    assert resumed.epoch == whole.epoch > 0 and resumed.state == whole.state


def test_changed_data_or_force_reshuffle_restarts_order() -> None:
    data = stream()
    for _ in range(4):
        data.next_batch(2)
    saved = data.state_dict()
    fresh_rows = stream().next_batch(2).targets

    other = stream("#ab#cde#f#gh#ijx")  # same sample count, different text
    notes = other.load_state_dict(saved)
    assert any("changed" in n for n in notes)
    assert other.next_sample == 0 and other.epoch == 1  # the epoch count is kept
    assert torch.equal(other.next_batch(2).targets, stream("#ab#cde#f#gh#ijx").next_batch(2).targets)  # fresh order

    forced = stream()
    notes = forced.load_state_dict(saved, force_reshuffle=True)
    assert any("forced" in n for n in notes) and forced.next_sample == 0 and forced.epoch == 1
    assert torch.equal(forced.next_batch(2).targets, fresh_rows)

    same = stream()
    assert same.load_state_dict(saved) == [] and same.next_sample == data.next_sample

    with pytest.raises(BadData, match="malformed.*--force-reshuffle"):
        stream().load_state_dict({**saved, "rng_state": "1 2 3"})
    assert stream().load_state_dict({**saved, "rng_state": "1 2 3"}, force_reshuffle=True)


def test_old_program_hash_restarts_with_warning() -> None:
    data = stream()
    old = {"rng_state": MT19937(123).state(), "next_sample": 3, "epoch": 2, "samples_hash": 0x1234_5678_9ABC_DEF0,
           "sample_count": data.n_samples}  # the old program's std::hash of the file name never matches ours
    notes = data.load_state_dict(old)
    assert any("changed" in n for n in notes) and notes == data.warnings[-len(notes):]
    assert data.state == DataState(**{**stream().state_dict(), "epoch": 2})  # fresh order, epochs kept


def test_short_text_is_one_padded_sample() -> None:
    data = TrainingData("abc", char_vocab(), n_ctx=6)
    assert data.n_samples == 1 and any("fewer than the context" in w for w in data.warnings)
    batch = data.next_batch(2)
    inputs, targets = batch.inputs, batch.targets
    assert targets.tolist() == [[a, b, c, E, E, E]] * 2
    assert inputs.tolist() == [[B, a, b, c, E, E]] * 2
    assert data.epoch == 1  # two uses of the single sample complete an epoch


def test_empty_text_is_bad_data() -> None:
    with pytest.raises(BadData, match="empty"):
        TrainingData(b"", char_vocab(), n_ctx=4)


# --- held-out data ------------------------------------------------------------------------------

def test_val_split_token_stream() -> None:
    data = TrainingData("abcdefghij", char_vocab(), n_ctx=3, seed=1)
    val = data.split_validation(0.3, n_batch=4)  # last 3 tokens held out
    assert data.n_tokens == 7 and data.n_samples == 4  # abcdefg: begins 0..3
    assert [(b.inputs.tolist(), b.targets.tolist()) for b in val] == [([[B, *ids("hi")]], [ids("hij")])]
    seen = {tuple(x) for _ in range(4) for x in data.next_batch(1).targets.tolist()}
    assert seen == {tuple(ids(w)) for w in ("abc", "bcd", "cde", "def")}


def test_val_split_samples() -> None:
    data = stream()  # samples ab, cde, f, gh, ijk
    val = data.split_validation(0.4, n_batch=8)
    assert data.n_samples == 3
    assert [b.targets.tolist() for b in val] == [[[*ids("gh"), E, E], [*ids("ijk"), E]]]


def test_val_data_batches() -> None:
    data = TrainingData("abcdefgh", char_vocab(), n_ctx=2)
    val = data.eval_batches_from_text(b"xyz12", n_batch=2)
    assert [b.targets.tolist() for b in val] == [[ids("xy"), ids("z1")], [[ord("2"), E]]]
    assert [b.inputs.tolist() for b in val] == [[[B, ord("x")], [B, ord("z")]], [[B, ord("2")]]]
    with pytest.raises(BadData, match="byte 1"):
        data.eval_batches_from_text(b"a\xfe", n_batch=2)


# --- with the real tokenizer, against llama.cpp -------------------------------------------------

@pytest.fixture(scope="module")
def llama_vocab(stories260k):
    """llama.cpp's tokenizer of stories260K (the reference for what the old finetune tokenized)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(model_path=str(stories260k), vocab_only=True, verbose=False)


@pytest.fixture(scope="module", params=["ggtorch", "llama.cpp"])
def tokenizer(request, stories260k, llama_vocab):
    """ggtorch's Tokenizer; and llama.cpp's own tokenizer behind a Vocab, which checks the sample
    logic with a real SPM tokenizer even where ggtorch's tokenizer is not available."""
    if request.param == "llama.cpp":
        texts = read_gguf(stories260k).metadata["tokenizer.ggml.tokens"]
        return Vocab(tokenize=lambda t: llama_vocab.tokenize(t.encode(), add_bos=False, special=False),
                     bos_id=llama_vocab.token_bos(), eos_id=llama_vocab.token_eos(), n_vocab=len(texts),
                     max_token_text_len=max(len(t.encode()) for t in texts))
    tokenizer_module = pytest.importorskip("ggtorch.models.tokenizer")
    return tokenizer_module.Tokenizer.from_gguf(read_gguf(stories260k))


@pytest.fixture(scope="module")
def shakespeare_bytes(shakespeare: Path) -> bytes:
    text = shakespeare.read_bytes()[:3000]
    return text[:text.rindex(b"\n") + 1]


def test_real_max_token_text_len(llama_vocab, stories260k) -> None:
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llama_vocab.model)
    longest = max(len(llama_cpp.llama_vocab_get_text(vocab, i)) for i in range(llama_cpp.llama_vocab_n_tokens(vocab)))
    texts = read_gguf(stories260k).metadata["tokenizer.ggml.tokens"]
    v = Vocab(tokenize=ids, bos_id=1, eos_id=2, n_vocab=len(texts), max_token_text_len=0)
    assert Vocab.from_tokenizer(v) is v
    tok = pytest.importorskip("ggtorch.models.tokenizer").Tokenizer.from_gguf(read_gguf(stories260k))
    assert Vocab.from_tokenizer(tok, token_texts=texts).max_token_text_len == longest == 9
    assert Vocab.from_tokenizer(tok).max_token_text_len == longest  # from the tokenizer's raw vocab texts


def test_real_whole_text_samples_and_batch(tokenizer, llama_vocab, shakespeare_bytes) -> None:
    n_ctx = 32
    data = TrainingData(shakespeare_bytes, tokenizer, n_ctx=n_ctx, seed=3)
    expected = llama_vocab.tokenize(shakespeare_bytes, add_bos=False, special=False)
    assert data.samples.tokens.tolist() == expected
    assert data.n_samples == len(expected) - n_ctx
    order, _, _ = ref_shuffle(MT19937(3).state(), [n_ctx] * data.n_samples)
    batch = data.next_batch(2)
    inputs, targets = batch.inputs, batch.targets
    for k in range(2):
        window = expected[order[k]:order[k] + n_ctx]
        assert targets[k].tolist() == window
        assert inputs[k].tolist() == [llama_vocab.token_bos(), *window[:-1]]


def test_real_sample_start_tokenizes_each_sample(tokenizer, llama_vocab, shakespeare_bytes) -> None:
    data = TrainingData(shakespeare_bytes, tokenizer, n_ctx=64,
                        options=DataOptions(sample_start="\\n\\n", escape=True, include_sample_start=False))
    pieces = shakespeare_bytes.split(b"\n\n")[1:]  # text before the first blank line is not a sample
    s = data.samples
    got = [s.tokens[b:b + n].tolist() for b, n in zip(s.begins, s.sizes, strict=True)]
    # each sample is tokenized on its own (SPM adds a leading space to each), as llama_tokenize per sample
    assert got == [llama_vocab.tokenize(p, add_bos=False, special=False) for p in pieces]


# --- build_batch against the per-token loop of get_example_targets_batch --------------------------

def ref_batch(tokens, offs, begins, sizes, start, n_batch, n_ctx, bos, eos, n_vocab, sep_eos, sep_bos, fill, rand):
    """get_example_targets_batch token by token, as the C code reads."""
    count, used = len(begins), 0
    inputs = [[0] * n_ctx for _ in range(n_batch)]
    targets = [[0] * n_ctx for _ in range(n_batch)]
    for k in range(n_batch):
        idx = (start + used) % count
        o, bg, sz = (offs[idx] if rand else 0), begins[idx], sizes[idx]
        used += 1
        inputs[k][0] = bos
        done_eos, done_bos = not sep_eos, not sep_bos
        for i in range(n_ctx):
            tok = eos
            if o >= sz and fill:
                if not done_eos:
                    done_eos = True
                elif not done_bos:
                    done_bos = True
                    tok = bos
                else:
                    done_eos, done_bos = not sep_eos, not sep_bos
                    o, idx = 0, (start + used) % count
                    bg, sz = begins[idx], sizes[idx]
                    used += 1
            if o < sz:
                tok = min(max(tokens[bg + o], 0), n_vocab - 1)
                o += 1
            targets[k][i] = tok
            if i + 1 < n_ctx:
                inputs[k][i + 1] = tok
    return inputs, targets, used


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 7), min_size=1, max_size=6), n_batch=st.integers(1, 4),
       n_ctx=st.integers(1, 9), start=st.integers(0, 10), flags=st.tuples(*[st.booleans()] * 4),
       seed=st.integers(0, 2**32 - 1))
def test_build_batch_equals_token_loop(sizes, n_batch, n_ctx, start, flags, seed) -> None:
    sep_eos, sep_bos, fill, rand = flags
    rng = np.random.default_rng(seed)
    tokens = rng.integers(-3, 40, size=sum(sizes)).astype(np.int64)  # some out of the 0..31 vocab
    begins = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    sh, _ = shuffle_samples(MT19937(seed).state(), begins, np.asarray(sizes, dtype=np.int64))
    vocab = Vocab(tokenize=ids, bos_id=1, eos_id=2, n_vocab=32, max_token_text_len=1)
    opts = DataOptions(separate_with_eos=sep_eos, separate_with_bos=sep_bos, fill_with_next_samples=fill,
                       sample_random_offsets=rand)
    inputs, targets, used = build_batch(tokens, sh, start, n_batch, n_ctx, vocab, opts)
    ref = ref_batch(tokens.tolist(), sh.offsets.tolist(), sh.begins.tolist(), sh.sizes.tolist(), start,
                    n_batch, n_ctx, 1, 2, 32, sep_eos, sep_bos, fill, rand)
    assert (inputs.tolist(), targets.tolist(), used) == ref


def test_real_overlapping_samples_use_longest_token_text(tokenizer, llama_vocab, shakespeare_bytes) -> None:
    n_ctx = 8  # each sample spans 9 * 8 bytes: stories260K's longest token text is 9 bytes ("▁friend")
    data = TrainingData(shakespeare_bytes, tokenizer, n_ctx=n_ctx,
                        options=DataOptions(sample_start="\n\n", escape=True, overlapping_samples=True))
    s = data.samples
    starts, pos = [], shakespeare_bytes.find(b"\n\n")
    while pos != -1:
        starts.append(pos + 2)
        pos = shakespeare_bytes.find(b"\n\n", pos + 2)
    expected = [llama_vocab.tokenize(shakespeare_bytes[p:p + 72], add_bos=False, special=False) for p in starts]
    assert [s.tokens[b:b + n].tolist() for b, n in zip(s.begins, s.sizes, strict=True)] == expected
    assert any("exceed the context" in w for w in data.warnings)
