"""Tokenizer: llama.cpp's own test vectors, and llama.cpp itself (llama_cpp, vocab-only) as the reference.

Every expected value comes from llama.cpp: its ``.inp``/``.out`` vectors, ``llama_tokenize``,
``llama_token_to_piece`` and ``llama_detokenize`` on the same GGUF files.
"""

from __future__ import annotations

import ctypes
import dataclasses
import random
import re
import time
from collections.abc import Callable
from pathlib import Path

import llama_cpp
import pytest

from ggtorch.errors import Unsupported
from ggtorch.io.gguf import GGUFFile, read_gguf, write_gguf
from ggtorch.models.tokenizer import Tokenizer

VOCAB_NAMES = ("llama-spm", "llama-bpe")
SEPARATOR = "\n__ggml_vocab_test__\n"


class LlamaCppVocab:
    """llama.cpp's tokenizer for one GGUF, through llama_cpp's low-level API."""

    def __init__(self, path: Path) -> None:
        self.llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self.vocab = self.llm._model.vocab

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=parse_special)

    def piece(self, token: int, special: bool) -> bytes:
        buf = ctypes.create_string_buffer(256)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        assert n >= 0
        return buf.raw[:n]

    def eog_ids(self, n_vocab: int) -> set[int]:
        return {i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(self.vocab, i)}

    def detokenize(self, ids: list[int], remove_special: bool, unparse_special: bool) -> str:
        """``llama_detokenize`` itself (not llama_cpp's Python-side per-piece concatenation)."""
        cap = 64 + 64 * len(ids)
        buf = ctypes.create_string_buffer(cap)
        arr = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
        n = llama_cpp.llama_detokenize(self.vocab, arr, len(ids), buf, cap, remove_special, unparse_special)
        assert n >= 0
        return buf.raw[:n].decode("utf-8", errors="replace")


@pytest.fixture(scope="module")
def vocab_paths(shared: Path, stories260k: Path) -> dict[str, Path]:
    return {"stories260K": stories260k, **{n: shared / "vocab" / f"ggml-vocab-{n}.gguf" for n in VOCAB_NAMES}}


@pytest.fixture(scope="module")
def gguf(vocab_paths: dict[str, Path]) -> Callable[[str], GGUFFile]:
    """Each GGUF read once per module (reading the 128k-token BPE vocabulary is slow in gguf-py)."""
    files: dict[str, GGUFFile] = {}

    def get(name: str) -> GGUFFile:
        if name not in files:
            files[name] = read_gguf(vocab_paths[name])
        return files[name]

    return get


@pytest.fixture(scope="module")
def ours(gguf: Callable[[str], GGUFFile]) -> Callable[[str], Tokenizer]:
    return lambda name: Tokenizer.from_gguf(gguf(name))


@pytest.fixture(scope="module")
def ref(vocab_paths: dict[str, Path]) -> Callable[[str], LlamaCppVocab]:
    refs: dict[str, LlamaCppVocab] = {}

    def get(name: str) -> LlamaCppVocab:
        if name not in refs:
            refs[name] = LlamaCppVocab(vocab_paths[name])
        return refs[name]

    return get


@pytest.fixture(scope="module")
def shakespeare(shared: Path) -> str:
    return (shared / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")


def read_vectors(path: Path) -> list[tuple[str, list[int]]]:
    """The (text, ids) pairs as llama.cpp's tests/test-tokenizer-0.cpp reads them.

    Texts are separated by "\\n__ggml_vocab_test__\\n" (the newline before the marker belongs to
    the separator, so a text keeps only its own newlines); a trailing separator ends the file.
    """
    raw = Path(f"{path}.inp").read_bytes().decode("utf-8")
    texts = raw.split(SEPARATOR)
    if raw.endswith(SEPARATOR):
        texts.pop()
    lines = Path(f"{path}.out").read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    assert len(texts) == len(lines), f"{path}: {len(texts)} texts but {len(lines)} lines of ids"
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines, strict=True)]


# --- llama.cpp's test vectors ------------------------------------------------------------------

@pytest.mark.parametrize("name", VOCAB_NAMES)
def test_every_llama_cpp_test_vector(name: str, vocab_paths: dict[str, Path],
                                     ours: Callable[[str], Tokenizer]) -> None:
    vectors = read_vectors(vocab_paths[name])
    assert len(vectors) == 46
    tok = ours(name)
    wrong = [(text, tok.encode(text, add_special=False), ids) for text, ids in vectors
             if tok.encode(text, add_special=False) != ids]
    assert not wrong, f"{len(wrong)}/{len(vectors)} lines differ, first: {wrong[0]!r}"


def test_stories260k_once_upon_a_time(ours: Callable[[str], Tokenizer]) -> None:
    tok = ours("stories260K")
    assert tok.encode("Once upon a time") == [1, 403, 407, 261, 378]
    assert (tok.bos_id, tok.eos_id, tok.n_vocab) == (1, 2, 512)
    assert tok.decode([1, 403, 407, 261, 378]) == "Once upon a time"


# --- against llama.cpp directly ----------------------------------------------------------------

HANDPICKED = [
    "", " ", "  ", "\n", "\n\n\n", "\t", " \t\n ", "Hello world", " Hello world", "Hello  world ",
    "Once upon a time, there was a little girl named Lily.", "I'm sure you'll've DON'T", "3333333 12.5%",
    "🦙 llamas 😶‍🌫️ 日本語のテキスト", "Äpfel ½ månad naïve", "\u2581already escaped\u2581", "tab\tand\rreturn\r\n",
    "<s>Hello</s> <unk>", "<|begin_of_text|>Hi<|eot_id|>", "a<s>b", "<s>", " </s> ", "text with \x00 nul",
]

PARSE_MODES = [(True, False), (False, False), (True, True), (False, True)]


@pytest.mark.parametrize("name", ["stories260K", *VOCAB_NAMES])
def test_encode_equals_llama_cpp(name: str, ours: Callable[[str], Tokenizer], ref: Callable[[str], LlamaCppVocab],
                                 shakespeare: str) -> None:
    """Hand-picked edge cases and tinyshakespeare lines, in every add_special/parse_special mode."""
    tok, llama = ours(name), ref(name)
    texts = HANDPICKED + shakespeare.split("\n")[:300] + [shakespeare[50_000:60_000]]
    for add_special, parse_special in PARSE_MODES:
        for text in texts:
            assert tok.encode(text, add_special, parse_special) == llama.tokenize(text, add_special, parse_special), \
                (text, add_special, parse_special)


FUZZ_ALPHABET = [*"abcXYZ 019'\"\n\t\r.,!?-_<>|", "  ", "'s", "'LL", "<s>", "</s>", "<unk>", "<|eot_id|>",
                 "é", "ñ", "ß", "日本", "🦙", "😶‍🌫️", "\u00a0", "\u2581", "\u3000", "\u0085", "\u200b", "\ufeff",
                 "½", "²", "٣", "ـ", "ี"]


@pytest.mark.parametrize("name", ["stories260K", *VOCAB_NAMES])
def test_encode_equals_llama_cpp_on_random_strings(name: str, ours: Callable[[str], Tokenizer],
                                                   ref: Callable[[str], LlamaCppVocab]) -> None:
    tok, llama, rng = ours(name), ref(name), random.Random(1234)
    for _ in range(400):
        text = "".join(rng.choice(FUZZ_ALPHABET) for _ in range(rng.randint(1, 30)))
        parse_special = rng.random() < 0.5
        assert tok.encode(text, True, parse_special) == llama.tokenize(text, True, parse_special), \
            (text, parse_special)


def test_whole_tinyshakespeare_equals_llama_cpp_in_seconds(ours: Callable[[str], Tokenizer],
                                                          ref: Callable[[str], LlamaCppVocab],
                                                          shakespeare: str) -> None:
    tok = ours("stories260K")
    start = time.perf_counter()
    ids = tok.encode(shakespeare)
    elapsed = time.perf_counter() - start
    assert ids == ref("stories260K").tokenize(shakespeare)
    assert elapsed < 20, f"tokenizing 1.1 MB took {elapsed:.1f} s"
    assert tok.decode(ids) == shakespeare


@pytest.mark.parametrize("name", ["stories260K", *VOCAB_NAMES])
def test_every_piece_equals_llama_cpp(name: str, ours: Callable[[str], Tokenizer],
                                      ref: Callable[[str], LlamaCppVocab]) -> None:
    tok, llama = ours(name), ref(name)
    for special in (False, True):
        wrong = [i for i in range(tok.n_vocab) if tok.piece_bytes(i, special) != llama.piece(i, special)]
        assert not wrong, f"special={special}: token {wrong[0]}: {tok.piece_bytes(wrong[0], special)!r} " \
                          f"vs {llama.piece(wrong[0], special)!r}"
    assert tok.token_to_piece(tok.n_vocab - 1) == llama.piece(tok.n_vocab - 1, False).decode("utf-8", "replace")


@pytest.mark.parametrize("name", ["stories260K", *VOCAB_NAMES])
def test_end_of_generation_tokens_equal_llama_cpp(name: str, ours: Callable[[str], Tokenizer],
                                                  ref: Callable[[str], LlamaCppVocab]) -> None:
    tok = ours(name)
    assert tok.eog_ids == ref(name).eog_ids(tok.n_vocab)
    assert tok.eos_id in tok.eog_ids


@pytest.mark.parametrize("name", ["stories260K", *VOCAB_NAMES])
def test_decode_equals_llama_detokenize(name: str, ours: Callable[[str], Tokenizer],
                                        ref: Callable[[str], LlamaCppVocab]) -> None:
    """decode is llama_detokenize, except that the space prefix is also dropped after a BOS (as llama_cpp does).

    llama.cpp keeps it there, so ``decode(encode(text))`` would not give ``text`` back.
    """
    tok, llama = ours(name), ref(name)
    texts = [*HANDPICKED, "Hello , world ! ' quoted ' it 's he 'll we 're they 've I 'm", "don 't"]
    for text in texts:
        ids = llama.tokenize(text, add_special=False, parse_special=True)
        for remove_special, unparse_special in PARSE_MODES:
            expected = llama.detokenize(ids, remove_special, unparse_special)
            if remove_special and ids[:1] == [tok.bos_id] and tok.add_space_prefix and expected.startswith(" "):
                expected = expected[1:]  # the one documented difference: the prefix space goes after a BOS too
            assert tok.decode(ids, remove_special, unparse_special) == expected, \
                (text, remove_special, unparse_special)
        with_bos = llama.tokenize(text, add_special=True)
        if tok.add_space_prefix:  # llama_cpp's own detokenize drops that space (for any vocabulary: not for BPE)
            assert tok.decode(with_bos) == llama.llm.detokenize(with_bos).decode("utf-8", errors="replace"), text
        else:
            assert tok.decode(with_bos) == llama.detokenize(with_bos, True, False), text


@pytest.mark.parametrize("name", ["stories260K", *VOCAB_NAMES])
def test_decode_encode_round_trips(name: str, ours: Callable[[str], Tokenizer], shakespeare: str) -> None:
    tok = ours(name)
    texts = ["Once upon a time", " leading space", "two  spaces\nand lines\n\n", "🦙 Äpfel 日本語", "x",
             *shakespeare.split("\n\n")[:50]]
    if tok.clean_spaces:  # llama.cpp's BPE detokenizer joins " ,", " ' " and " 's" (also 'm 're 've): skip those
        texts = [t for t in texts if not re.search(r" [?!.,]| ' | '(s|m|re|ve)", t)]
    assert len(texts) > 20
    for text in texts:
        assert tok.decode(tok.encode(text)) == text
        assert tok.decode(tok.encode(text, add_special=False)) == text


@pytest.mark.parametrize("name", ["stories260K", *VOCAB_NAMES])
def test_decode_after_a_prompt_keeps_the_continuation_space(name: str, ours: Callable[[str], Tokenizer]) -> None:
    tok = ours(name)
    prompt, whole = tok.encode("Once upon a time"), tok.encode("Once upon a time there was 🦙")
    assert whole[:len(prompt)] == prompt
    assert tok.decode(whole[len(prompt):], prev_ids=prompt) == " there was 🦙"
    assert tok.decode(whole[len(prompt):]) == ("there was 🦙" if tok.add_space_prefix else " there was 🦙")


def test_bos_eos_flags_follow_the_gguf(gguf: Callable[[str], GGUFFile], ours: Callable[[str], Tokenizer]) -> None:
    bpe = ours("llama-bpe")  # no add_bos_token key: llama.cpp's llama-bpe default adds BOS, no EOS
    assert "tokenizer.ggml.add_bos_token" not in gguf("llama-bpe").metadata
    assert (bpe.add_bos, bpe.add_eos, bpe.bos_id, bpe.eos_id) == (True, False, 128000, 128001)
    assert bpe.encode("Hi")[0] == 128000 and bpe.encode("Hi", add_special=False)[0] != 128000


@pytest.mark.parametrize(("changes", "label"), [
    ({"user_defined": ["▁time", "an"]}, "user-defined tokens"),
    ({"tokenizer.ggml.add_space_prefix": False}, "no space prefix"),
    ({"tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.add_eos_token": True}, "EOS, no BOS"),
    ({"control": ["<|im_end|>"], "user_defined": ["<|im_start|>"]}, "chat markers"),
])
def test_vocab_variants_equal_llama_cpp(changes: dict, label: str, gguf: Callable[[str], GGUFFile],
                                        tmp_path: Path) -> None:
    """stories260K's vocabulary rewritten with other token types / flags, tokenized by both."""
    f = gguf("stories260K")
    metadata = dict(f.metadata)
    tokens, types = list(metadata["tokenizer.ggml.tokens"]), list(metadata["tokenizer.ggml.token_type"])
    free_slots = iter(range(len(tokens) - 1, 0, -1))  # the last (rarest) merges give up their slot
    for kind, gguf_type in (("user_defined", 4), ("control", 3)):
        for text in changes.get(kind, []):
            if text not in tokens:
                tokens[next(free_slots)] = text
            types[tokens.index(text)] = gguf_type
    metadata.update({k: v for k, v in changes.items() if k.startswith("tokenizer.")})
    metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"] = tokens, types
    path = tmp_path / "variant.gguf"
    write_gguf(path, "llama", metadata, [], f.value_types)

    tok, llama = Tokenizer.from_gguf(read_gguf(path)), LlamaCppVocab(path)
    assert tok.eog_ids == llama.eog_ids(tok.n_vocab)
    texts = ["Once upon a time there was an ant", "\u2581time and time again", "banana time", " time", "time",
             "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant", "<s>a</s>", ""]
    for text in texts:
        for add_special, parse_special in PARSE_MODES:
            ids = tok.encode(text, add_special, parse_special)
            assert ids == llama.tokenize(text, add_special, parse_special), (label, text, add_special, parse_special)
            assert tok.decode(ids, False, True) == llama.detokenize(ids, False, True), (label, text)


def test_unsupported_vocabularies_name_the_problem(gguf: Callable[[str], GGUFFile]) -> None:
    f = gguf("stories260K")
    for model, pre, needle in (("gpt2", "qwen2", "qwen2"), ("gpt2", None, "(none)"), ("bert", None, "bert")):
        metadata = {**f.metadata, "tokenizer.ggml.model": model}
        if pre is not None:
            metadata["tokenizer.ggml.pre"] = pre
        with pytest.raises(Unsupported, match=r"not supported") as err:
            Tokenizer(dataclasses.replace(f, metadata=metadata))
        assert needle in str(err.value)


def test_building_is_fast_and_cached_per_file(gguf: Callable[[str], GGUFFile]) -> None:
    f = gguf("llama-bpe")
    start = time.perf_counter()
    Tokenizer(f)
    elapsed = time.perf_counter() - start
    assert elapsed < 10, f"building the 128k-token BPE tokenizer took {elapsed:.1f} s"
    assert Tokenizer.from_gguf(f) is Tokenizer.from_gguf(f)
    assert Tokenizer.from_gguf(gguf("llama-spm")) is not Tokenizer.from_gguf(f)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        Tokenizer.from_gguf(f).decode([-1])
