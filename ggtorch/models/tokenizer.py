"""GGUF vocabularies as tokenizers that tokenize and detokenize exactly like llama.cpp.

Three vocabulary kinds are supported:

- ``tokenizer.ggml.model = llama`` (sentencepiece BPE: LLaMA 1/2, Mistral 7B, Phi-3, Gemma 2/3):
  a sentencepiece ``ModelProto`` is built from the GGUF's tokens, scores and types and does
  the merging. ``tokenizer.ggml.add_space_prefix`` (false in Gemma files) decides the
  leading space; ``tokenizer.ggml.remove_extra_whitespaces`` is read by llama.cpp but used
  only by its T5 tokenizer, so it changes nothing here.
- ``tokenizer.ggml.model = gpt2`` (byte-level BPE: Llama 3, Qwen2/2.5/3, SmolLM, Phi-4-mini): a
  ``tokenizers`` BPE from the GGUF's tokens and merges, behind the pre-tokenizer regexes
  llama.cpp uses for that ``tokenizer.ggml.pre`` (``BPE_PRE_TOKENIZERS``).
- ``tokenizer.ggml.model = gemma4`` (Gemma 4): BPE merges over the UTF-8 text itself with spaces written as ``▁``,
  split only into runs of newlines and of other text, ``<0xXX>`` tokens for what no merge covers
  (llama.cpp's LLAMA_VOCAB_PRE_TYPE_GEMMA4); a BOS is always added.

Everything around the merging mirrors ``src/llama-vocab.cpp`` rather than the libraries'
own conventions: special tokens are split out first (``tokenizer_st_partition``, with the
whitespace stripping llama.cpp gives Phi-3's special tokens), the sentencepiece path escapes
spaces and adds the space prefix itself (``llama_escape_whitespace``, no NFKC, no
extra-whitespace removal), every token text is mergeable as in llama.cpp's ``text_to_token``,
and decoding goes through a per-token piece table built like llama.cpp's ``token_to_piece``
(byte tokens become raw bytes, control tokens render empty).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Iterable, Sequence

import sentencepiece as spm
from gguf import Keys, TokenType
from sentencepiece import sentencepiece_model_pb2 as spm_pb2
from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from ggtorch.errors import BadGGUF, Unsupported
from ggtorch.io.gguf import GGUFFile
from ggtorch.models.pretokenize import BPE_PRE_TOKENIZERS, PreTokenizer

SPACE_ESCAPE = "\u2581"
"""``▁``: how sentencepiece vocabularies spell a space (``llama_escape_whitespace``)."""

CONTROL_LOOKING_TEXTS = frozenset({
    "</s>", "<EOT>", "<MID>", "<PAD>", "<PRE>", "<REPO>", "<SUF>", "<end_of_turn>", "<end_of_utterance>",
    "<eos>", "<fim-middle>", "<fim-pad>", "<fim-prefix>", "<fim-repo>", "<fim-suffix>", "<fim_middle>",
    "<fim_pad>", "<fim_prefix>", "<fim_suffix>", "<reponame>", "<turn|>", "<|calls|>", "<|call|>",
    "<|code_middle|>", "<|code_prefix|>", "<|code_suffix|>", "<|end_of_text|>", "<|endoftext|>", "<|end|>",
    "<|eom_id|>", "<|eot_id|>", "<|file_sep|>", "<|fim_middle|>", "<|fim_pad|>", "<|fim_prefix|>",
    "<|fim_repo|>", "<|fim_suffix|>", "<|flush|>", "<|im_end|>", "<|middle|>", "<|prefix|>", "<|repo_name|>",
    "<|return|>", "<|suffix|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>",
    "<｜fim▁hole｜>", "[EOS]", "[EOT]", "[PAD]", "[e~[", "_<EOT>", "▁<MID>", "▁<PRE>", "▁<SUF>",
})
"""End-of-generation / fill-in-the-middle texts llama.cpp's vocab loader forces to CONTROL whatever their GGUF type."""

EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
    # FIM pad / repo / file-separator tokens also end generation
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", "<|fim_repo|>", "<|repo_name|>", "<fim-repo>",
    "<REPO>", "<reponame>", "<|file_sep|>",
})
"""Texts whose tokens llama.cpp treats as end of generation (``llama_vocab_is_eog``)."""

USER_DEFINED_TEXTS = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})
"""gpt-oss's markers, which llama.cpp makes user-defined whatever their GGUF type."""


_C_SPACES = frozenset(" \t\n\v\f\r")
"""The characters C's ``isspace`` accepts, which llama.cpp strips after a stripping special token."""


class Attr:
    """llama.cpp's ``llama_token_attr`` bits (the part tokenization uses), as plain ints for speed."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5


_ATTR_OF_TYPE = {int(TokenType.NORMAL): Attr.NORMAL, int(TokenType.UNKNOWN): Attr.UNKNOWN,
                 int(TokenType.CONTROL): Attr.CONTROL, int(TokenType.USER_DEFINED): Attr.USER_DEFINED,
                 int(TokenType.UNUSED): Attr.UNUSED, int(TokenType.BYTE): Attr.BYTE}


def _byte_level_table() -> dict[int, str]:
    """GPT-2's byte -> printable character map (``unicode_byte_to_utf8``): bytes that print keep their character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


BYTE_TO_CHAR = _byte_level_table()
CHAR_TO_BYTE = {c: b for b, c in BYTE_TO_CHAR.items()}
_BYTE_LEVEL_CHARS = frozenset(CHAR_TO_BYTE)
_BYTE_LEVEL_TO_LATIN1 = str.maketrans({c: chr(b) for c, b in CHAR_TO_BYTE.items()})


def _read_token_attrs(f: GGUFFile, tokens: Sequence[str]) -> list[int]:
    types = f.get(Keys.Tokenizer.TOKEN_TYPE)
    if types is None:
        attrs = [Attr.NORMAL] * len(tokens)
    elif len(types) < len(tokens):
        raise BadGGUF(f"{f.path}: {Keys.Tokenizer.TOKEN_TYPE} has {len(types)} entries for {len(tokens)} tokens; "
                      "re-convert the model")
    else:
        attrs = [_ATTR_OF_TYPE.get(t, Attr.UNDEFINED) for t in types[:len(tokens)]]
    for i, text in enumerate(tokens):
        if text in CONTROL_LOOKING_TEXTS:
            attrs[i] |= Attr.CONTROL
    return attrs


def _apply_marker_fixes(tokens: Sequence[str], attrs: list[int], eog: set[int]) -> None:
    """The fixes by token text llama.cpp's vocab loader makes last, in place on ``attrs`` and ``eog``.

    gpt-oss's channel markers become user-defined, so they always render. When ``<|return|>``
    and ``<|call|>`` (o200k_harmony) or ``<|calls|>`` and ``<|flush|>`` (solar-open) end
    generation, ``<|end|>`` does not and becomes user-defined. When ``<|tool_response>`` (Gemma 4)
    or ``<|plamo:eos|>`` ends generation, ``</s>`` is a normal token, even if it is the EOS.
    """
    for i, text in enumerate(tokens):
        if text in USER_DEFINED_TEXTS:
            attrs[i] = Attr.USER_DEFINED
    eog_texts = {tokens[i]: i for i in eog}
    has_call = "<|call|>" in eog_texts or "<|calls|>" in eog_texts
    if "<|end|>" in eog_texts and has_call and ("<|return|>" in eog_texts or "<|flush|>" in eog_texts):
        eog.discard(eog_texts["<|end|>"])
        attrs[eog_texts["<|end|>"]] = Attr.USER_DEFINED
    if "</s>" in eog_texts and ("<|tool_response>" in eog_texts or "<|plamo:eos|>" in eog_texts):
        eog.discard(eog_texts["</s>"])
        attrs[eog_texts["</s>"]] = Attr.NORMAL


def _special_id(f: GGUFFile, key: str, default: int | None, n_vocab: int) -> int | None:
    """A special token id from its key, with llama.cpp's default; out-of-range values fall back like llama.cpp."""
    if default is not None and default >= n_vocab:
        default = None
    value = f.get(key)
    if value is None or not 0 <= int(value) < n_vocab:
        return default
    return int(value)


def _clean_spaces(text: bytes) -> bytes:
    """llama.cpp's ``clean_spaces`` detokenizer passes, in place on the bytes as the C code does.

    " ," -> ",", " ' " -> "'", " 's" -> "'s" (also 'm, 're, 've).
    """
    buf = bytearray(text)
    space, quote = 0x20, 0x27

    def run(step) -> None:
        n = len(buf)
        total = 1 if n else 0
        i = 1
        while i < n:
            total, i = step(total, i, n)
        del buf[total:]

    def punctuation(total: int, i: int, n: int) -> tuple[int, int]:
        x = buf[i]
        if buf[i - 1] == space and x in b"?!.,":
            total -= 1
        buf[total] = x
        return total + 1, i + 1

    def lone_apostrophe(total: int, i: int, n: int) -> tuple[int, int]:
        x = buf[i]
        if x == quote and i + 1 < n and buf[i - 1] == space and buf[i + 1] == space:
            total -= 1
            i += 1
            buf[i] = 0
        buf[total] = x
        return total + 1, i + 1

    def contraction(total: int, i: int, n: int) -> tuple[int, int]:
        x = buf[i]
        if buf[i - 1] == space and x == quote and i + 1 < n:
            x1 = buf[i + 1]
            if x1 in b"sm" or (i + 2 < n and bytes(buf[i + 1:i + 3]) in (b"re", b"ve")):
                total -= 1
        buf[total] = x
        return total + 1, i + 1

    if any(b" " + bytes([c]) in buf for c in b"?!.,"):
        run(punctuation)
    if b" '" in buf:
        run(lone_apostrophe)
        run(contraction)
    return bytes(buf)


class Tokenizer:
    """A GGUF vocabulary: ``encode``/``decode`` equal llama.cpp's ``llama_tokenize``/``llama_detokenize``."""

    def __init__(self, f: GGUFFile) -> None:
        self.model = str(f.require(Keys.Tokenizer.MODEL))
        self.pre = str(f.get(Keys.Tokenizer.PRE, "") or "")
        pre_tokenizer = None
        if self.model == "llama":
            default_ids = (1, 2, 0)
            self.add_bos, self.add_eos, self.add_space_prefix, self.clean_spaces = True, False, True, False
        elif self.model == "gpt2":
            pre_tokenizer = BPE_PRE_TOKENIZERS.get(self.pre)
            if not self.pre:
                raise Unsupported(f"{f.path}: the BPE vocabulary has no tokenizer.ggml.pre: the file was converted "
                                  "before llama.cpp recorded pre-tokenizers, and llama.cpp itself warns that it "
                                  "tokenizes such a file badly; re-convert it with a current convert_hf_to_gguf.py")
            if pre_tokenizer is None:
                raise Unsupported(f"{f.path}: BPE pre-tokenizer '{self.pre}' (tokenizer.ggml.pre) is not supported; "
                                  f"ggtorch knows {len(BPE_PRE_TOKENIZERS)} of llama.cpp's (llama-bpe, qwen2, "
                                  "gpt-4o, tekken, dbrx, deepseek-coder, ...: ggtorch/models/pretokenize.py)")
            default_ids = (None, None, None)
            self.add_bos, self.add_eos, self.add_space_prefix = pre_tokenizer.add_bos, False, False
            self.clean_spaces = pre_tokenizer.clean_spaces
        elif self.model == "gemma4":
            default_ids = (None, None, None)
            self.add_bos, self.add_eos, self.add_space_prefix, self.clean_spaces = True, False, False, True
        else:
            raise Unsupported(f"{f.path}: tokenizer.ggml.model '{self.model}' is not supported; ggtorch handles "
                              "'llama' (sentencepiece), 'gpt2' (byte-level BPE) and 'gemma4' (BPE over text)")
        self.add_space_prefix = bool(f.get(Keys.Tokenizer.ADD_PREFIX, self.add_space_prefix))

        tokens = list(f.require(Keys.Tokenizer.LIST))
        tokens = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]  # llama.cpp renames empty tokens
        if len(set(tokens)) != len(tokens):
            raise BadGGUF(f"{f.path}: {Keys.Tokenizer.LIST} holds duplicate token texts; re-convert the model")
        self.tokens: list[str] = tokens
        """The raw vocabulary strings (``llama_token_get_text``)."""
        self.n_vocab = len(tokens)
        self.attrs = _read_token_attrs(f, tokens)
        scores = f.get(Keys.Tokenizer.SCORES)
        if scores is not None and len(scores) < self.n_vocab:
            raise BadGGUF(f"{f.path}: {Keys.Tokenizer.SCORES} has {len(scores)} entries for {self.n_vocab} tokens; "
                          "re-convert the model")
        self.scores: list[float] = ([float(s) for s in scores[:self.n_vocab]] if scores is not None
                                    else [0.0] * self.n_vocab)

        id_keys = (Keys.Tokenizer.BOS_ID, Keys.Tokenizer.EOS_ID, Keys.Tokenizer.UNK_ID)
        bos, eos, unk = (_special_id(f, key, d, self.n_vocab) for key, d in zip(id_keys, default_ids, strict=True))
        # llama.cpp adds Gemma 4's BOS whatever the file says (its workaround for early conversions)
        self.add_bos = bool(f.get(Keys.Tokenizer.ADD_BOS, self.add_bos)) or self.model == "gemma4"
        self.add_eos = bool(f.get(Keys.Tokenizer.ADD_EOS, self.add_eos))
        for flag, tid, what in ((self.add_bos, bos, "BOS"), (self.add_eos, eos, "EOS")):
            if flag and tid is None:
                raise BadGGUF(f"{f.path}: the vocabulary asks to add a {what} token but has no valid "
                              f"{what.lower()} token id; set tokenizer.ggml.{what.lower()}_token_id")
        self.bos_id: int = -1 if bos is None else bos
        self.eos_id: int = -1 if eos is None else eos
        self.unk_id: int = -1 if unk is None else unk
        eog_keys = (Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID, Keys.Tokenizer.FIM_PAD_ID,
                    Keys.Tokenizer.FIM_REP_ID, Keys.Tokenizer.FIM_SEP_ID)
        eog = {i for i in (_special_id(f, key, None, self.n_vocab) for key in eog_keys) if i is not None}
        eog |= {i for i, text in enumerate(tokens) if text in EOG_TEXTS}
        if eos is not None:
            eog.add(eos)
        _apply_marker_fixes(tokens, self.attrs, eog)
        self.eog_ids: frozenset[int] = frozenset(eog)
        """Tokens that end generation (``llama_vocab_is_eog``): EOS, EOT/EOM, and end-of-turn texts."""

        # tokenizer_st_partition's cache: control, user-defined and unknown tokens, longest text first
        special = [i for i, a in enumerate(self.attrs) if a & (Attr.CONTROL | Attr.USER_DEFINED | Attr.UNKNOWN)]
        special.sort(key=lambda i: -len(tokens[i].encode("utf-8")))
        self._always_split = [(tokens[i], i) for i in special
                              if not self.attrs[i] & (Attr.CONTROL | Attr.UNKNOWN)]
        self._parse_split = [(tokens[i], i) for i in special]

        self._pieces = [self._piece(i, special=False) for i in range(self.n_vocab)]
        self._special_pieces = list(self._pieces)
        for i in special:
            self._special_pieces[i] = self._piece(i, special=True)
        self._rstrip = self._phi3_rstrip(f, special)
        if self.model == "gemma4":
            self._hf = self._build_text_bpe(f)
            self._newline_runs = {t: i for i, t in enumerate(tokens) if t and not t.strip("\n")}
        elif pre_tokenizer is None:
            self._sp = self._build_sentencepiece()
        else:
            self._hf = self._build_byte_level_bpe(f, pre_tokenizer)

    # --- building -------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> Tokenizer:
        """The tokenizer of ``f``'s vocabulary, built once per opened file."""
        cached = _CACHE.get(id(f))
        if cached is not None and cached[0]() is f:
            return cached[1]
        tok = cls(f)
        _CACHE[id(f)] = (weakref.ref(f), tok)
        weakref.finalize(f, _CACHE.pop, id(f), None)
        return tok

    def _phi3_rstrip(self, f: GGUFFile, special: list[int]) -> frozenset[int]:
        """Special tokens that swallow the whitespace after them, as llama.cpp sets them for Phi-3.

        llama.cpp decides by ``general.name`` (containing "phi-3" or "phi3", any case): every
        special token strips, as does ``</s>``, except ``<unk>``, ``<s>`` and ``<|endoftext|>``.
        """
        name = str(f.get(Keys.General.NAME, "") or "").lower()
        if "phi-3" not in name and "phi3" not in name:
            return frozenset()
        ids = {self.tokens[i]: i for i in special}
        ids.update((t, i) for i, t in enumerate(self.tokens) if t == "</s>")
        for text in ("<unk>", "<s>", "<|endoftext|>"):
            ids.pop(text, None)
        return frozenset(ids.values())

    def _piece(self, token: int, special: bool) -> bytes:
        """llama.cpp's ``token_to_piece(token, lstrip=0, special)`` for this vocabulary, as bytes."""
        attr, text = self.attrs[token], self.tokens[token]
        if attr & (Attr.UNKNOWN | Attr.CONTROL) and not special:
            return b""
        if attr & (Attr.UNKNOWN | Attr.CONTROL | Attr.USER_DEFINED):
            return text.encode("utf-8")
        if attr & Attr.NORMAL:
            if self.model in ("llama", "gemma4"):
                return text.replace(SPACE_ESCAPE, " ").encode("utf-8")
            return self._byte_level_decode(text)
        if attr & Attr.BYTE:
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                return b"\x00"
        return b""  # unused / undefined tokens render as nothing

    @staticmethod
    def _byte_level_decode(text: str) -> bytes:
        """``llama_decode_text``: byte-level characters back to bytes; others marked like llama.cpp does."""
        if _BYTE_LEVEL_CHARS.issuperset(text):
            return text.translate(_BYTE_LEVEL_TO_LATIN1).encode("latin-1")
        out = bytearray()
        for ch in text:
            b = CHAR_TO_BYTE.get(ch)
            if b is not None:
                out.append(b)
            else:
                out += b"[UNK_BYTE_0x" + ch.encode("utf-8").hex().encode() + text.encode("utf-8") + b"]"
        return bytes(out)

    def _build_sentencepiece(self) -> spm.SentencePieceProcessor:
        """A sentencepiece BPE model that merges exactly like llama.cpp's ``llm_tokenizer_spm``.

        Every piece is NORMAL except the unknown token and the ``<0xXX>`` byte tokens: llama.cpp
        merges into any vocabulary text and never re-segments unused pieces, while sentencepiece
        would skip control/user-defined texts and re-split unused ones. The normalizer is the
        identity; ``encode`` escapes spaces and adds the space prefix itself.
        """
        piece_type = spm_pb2.ModelProto.SentencePiece.Type
        byte_ids = {}
        for i, (text, attr) in enumerate(zip(self.tokens, self.attrs, strict=True)):
            if attr & Attr.BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                byte_ids.setdefault(text, i)
        byte_fallback = len(byte_ids) == 256
        unk = next((i for i, a in enumerate(self.attrs) if a & Attr.UNKNOWN), self.unk_id if self.unk_id >= 0 else 0)

        proto = spm_pb2.ModelProto()
        proto.trainer_spec.model_type = spm_pb2.TrainerSpec.BPE
        proto.trainer_spec.vocab_size = self.n_vocab
        proto.trainer_spec.byte_fallback = byte_fallback
        proto.trainer_spec.unk_id = unk
        proto.trainer_spec.bos_id = -1
        proto.trainer_spec.eos_id = -1
        proto.trainer_spec.pad_id = -1
        proto.trainer_spec.unk_piece = self.tokens[unk]
        norm = proto.normalizer_spec
        norm.name = "identity"
        norm.add_dummy_prefix = False
        norm.remove_extra_whitespaces = False
        norm.escape_whitespaces = False
        for i, (text, score) in enumerate(zip(self.tokens, self.scores, strict=True)):
            piece = proto.pieces.add()
            piece.piece = text
            piece.score = score
            if i == unk:
                piece.type = piece_type.UNKNOWN
            elif byte_fallback and byte_ids.get(text) == i:
                piece.type = piece_type.BYTE
            else:
                piece.type = piece_type.NORMAL
        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(proto.SerializeToString())
        except RuntimeError as e:  # sentencepiece refuses e.g. a piece holding a NUL byte
            raise BadGGUF(f"the vocabulary (tokenizer.ggml.tokens) is corrupt: {e}; "
                          "re-download or re-convert the model") from None
        return sp

    def _merges(self, f: GGUFFile) -> list[tuple[str, str]]:
        merges = []
        for m in f.require(Keys.Tokenizer.MERGES):
            pos = m.find(" ", 1)  # llama.cpp splits a merge at the first space after its first character
            if pos < 0:
                raise BadGGUF(f"{f.path}: merge {m!r} has no space; re-convert the model")
            merges.append((m[:pos], m[pos + 1:]))
        return merges

    def _build_text_bpe(self, f: GGUFFile) -> HFTokenizer:
        """Gemma 4's tokenizer as llama.cpp runs it (LLAMA_VOCAB_PRE_TYPE_GEMMA4): BPE merges over the UTF-8 text
        itself (no byte-level alphabet), spaces already escaped to ``▁``, the text split only into runs of newlines
        and runs of anything else; a symbol left outside the vocabulary becomes its ``<0xXX>`` byte tokens."""
        vocab = {text: i for i, text in enumerate(self.tokens)}
        try:
            bpe = models.BPE(vocab=vocab, merges=self._merges(f), byte_fallback=True, ignore_merges=False)
        except Exception as e:  # tokenizers raises its own exception types for inconsistent merges
            raise BadGGUF(f"{f.path}: the BPE merges do not fit the vocabulary ({e}); re-convert the model") from None
        hf = HFTokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated", invert=False)
        return hf

    def _build_byte_level_bpe(self, f: GGUFFile, pre_tokenizer: PreTokenizer) -> HFTokenizer:
        """A ``tokenizers`` byte-level BPE that merges like llama.cpp's ``llm_tokenizer_bpe``.

        Each regex isolates its matches and leaves the text between them as pieces of their
        own, as llama.cpp's ``unicode_regex_split`` does; the next regex splits those pieces.
        """
        vocab = {text: i for i, text in enumerate(self.tokens)}
        try:
            bpe = models.BPE(vocab=vocab, merges=self._merges(f), ignore_merges=pre_tokenizer.ignore_merges)
        except Exception as e:  # tokenizers raises its own exception types for inconsistent merges
            raise BadGGUF(f"{f.path}: the BPE merges do not fit the vocabulary ({e}); re-convert the model") from None
        hf = HFTokenizer(bpe)
        hf.pre_tokenizer = pre_tokenizers.Sequence([
            *(pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in pre_tokenizer.regexes),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
        return hf

    # --- encoding -------------------------------------------------------------------------

    def _partition(self, text: str, parse_special: bool) -> list[str | int]:
        """``tokenizer_st_partition``: split out special token texts, longest first, into token ids.

        User-defined tokens are always split out; control and unknown ones only with ``parse_special``.
        After a token that strips (Phi-3's), the whitespace that follows it is dropped.
        """
        fragments: list[str | int] = [text]
        for tok_text, tok_id in (self._parse_split if parse_special else self._always_split):
            if tok_text not in text:
                continue
            strip = tok_id in self._rstrip
            split: list[str | int] = []
            for frag in fragments:
                if isinstance(frag, int) or tok_text not in frag:
                    split.append(frag)
                    continue
                start = 0
                while (match := frag.find(tok_text, start)) >= 0:
                    if match > start:
                        split.append(frag[start:match])
                    split.append(tok_id)
                    start = match + len(tok_text)
                    if strip:
                        while start < len(frag) and frag[start] in _C_SPACES:
                            start += 1
                if start < len(frag):
                    split.append(frag[start:])
            fragments = split
        return fragments

    def _encode_texts(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        if self.model == "llama":
            return self._sp.encode(texts)
        if self.model == "gemma4":
            return [self._encode_gemma4(text) for text in texts]
        return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]

    def _encode_gemma4(self, text: str) -> list[int]:
        """One fragment: spaces escaped; a run of newlines that is a token stays whole (llama.cpp's fix for
        Gemma 4), the rest goes through the merges."""
        out: list[int] = []
        for run in re.findall(r"\n+|[^\n]+", text.replace(" ", SPACE_ESCAPE)):
            whole = self._newline_runs.get(run)
            out.extend([whole] if whole is not None else self._hf.encode(run, add_special_tokens=False).ids)
        return out

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        """Token ids of ``text`` as llama.cpp's ``llama_tokenize(text, add_special, parse_special)``."""
        fragments = self._partition(text, parse_special) if text else []
        texts: list[str] = []
        prev_special = True  # the sentencepiece path prefixes a space at the start and after a special token
        for frag in fragments:
            if isinstance(frag, str):
                if self.model == "llama":
                    if self.add_space_prefix and prev_special:
                        frag = " " + frag
                    frag = frag.replace(" ", SPACE_ESCAPE)
                texts.append(frag)
            prev_special = isinstance(frag, int)
        encoded = iter(self._encode_texts(texts))
        out = [self.bos_id] if add_special and self.add_bos else []
        for frag in fragments:
            if isinstance(frag, int):
                out.append(frag)
            else:
                out.extend(next(encoded))
        if add_special and self.add_eos:
            out.append(self.eos_id)
        return out

    # --- decoding -------------------------------------------------------------------------

    def piece_bytes(self, token: int, special: bool = False) -> bytes:
        """The bytes ``token`` stands for (``llama_token_to_piece``); control tokens are empty unless ``special``."""
        return (self._special_pieces if special else self._pieces)[self._check_id(token)]

    def token_to_piece(self, token: int, special: bool = False) -> str:
        """``piece_bytes`` as text; a lone byte token of a multi-byte character becomes U+FFFD."""
        return self.piece_bytes(token, special).decode("utf-8", errors="replace")

    def _check_id(self, token: int) -> int:
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token id {token} is outside the vocabulary (0..{self.n_vocab - 1})")
        return token

    def decode_bytes(self, ids: Iterable[int], remove_special: bool = True, unparse_special: bool = False) -> bytes:
        """The bytes of ``ids`` as llama.cpp's ``llama_detokenize(ids, remove_special, unparse_special)``.

        ``remove_special`` drops a leading BOS / trailing EOS when the vocabulary adds them.
        The space the sentencepiece path prefixes is removed from the first piece, also after a
        dropped BOS (llama-cpp-python's ``detokenize`` does the same; llama.cpp keeps it there),
        so that ``decode(encode(text)) == text``.
        """
        ids = [int(i) for i in ids]
        if ids and (min(ids) < 0 or max(ids) >= self.n_vocab):
            self._check_id(min(ids) if min(ids) < 0 else max(ids))
        if remove_special and self.add_bos and ids and ids[0] == self.bos_id:
            ids = ids[1:]
        if remove_special and self.add_eos and ids and ids[-1] == self.eos_id:
            ids = ids[:-1]
        table = self._special_pieces if unparse_special else self._pieces
        pieces = [table[i] for i in ids]
        if self.add_space_prefix and pieces and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]
        text = b"".join(pieces)
        return _clean_spaces(text) if self.clean_spaces else text

    def decode(self, ids: Iterable[int], remove_special: bool = True, unparse_special: bool = False,
               prev_ids: Sequence[int] | None = None) -> str:
        """Text of ``ids`` (``decode_bytes``; invalid UTF-8 becomes U+FFFD).

        With ``prev_ids`` (e.g. the prompt), the text ``ids`` add after ``prev_ids``: the first
        piece keeps its leading space, as when streaming a continuation.
        """
        if prev_ids is None:
            return self.decode_bytes(ids, remove_special, unparse_special).decode("utf-8", errors="replace")
        prev = list(prev_ids)
        head = self.decode_bytes(prev, remove_special, unparse_special)
        full = self.decode_bytes(prev + [int(i) for i in ids], remove_special, unparse_special)
        return full[len(head):].decode("utf-8", errors="replace")


_CACHE: dict[int, tuple[weakref.ref, Tokenizer]] = {}
"""Tokenizers by ``id(GGUFFile)``; an entry leaves when its file object is collected."""
