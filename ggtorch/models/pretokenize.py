"""llama.cpp's byte-level BPE pre-tokenizers, by ``tokenizer.ggml.pre``: the regexes each splits text with
before merging, and the vocabulary flags its type sets (src/llama-vocab.cpp, ``llm_tokenizer_bpe``).
"""

from __future__ import annotations

import dataclasses

LLAMA3_PRE_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""llama.cpp's regex for LLAMA_VOCAB_PRE_TYPE_LLAMA3 (the tokenizer.json one with ASCII-only case folding)."""

QWEN2_PRE_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""llama.cpp's regex for LLAMA_VOCAB_PRE_TYPE_QWEN2: Llama 3's with single digits."""

QWEN35_PRE_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""llama.cpp's regex for LLAMA_VOCAB_PRE_TYPE_QWEN35 (Qwen3.5/3.6): Qwen2's with combining marks (p{M}) kept in
words."""

GPT2_PRE_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
"""GPT-2's regex; LLAMA_VOCAB_PRE_TYPE_SMOLLM runs it after splitting off single digits."""

GPT4O_PRE_REGEX = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""llama.cpp's regex for LLAMA_VOCAB_PRE_TYPE_GPT4O (Phi-4-mini): the case classes spelled as lookaheads."""

TEKKEN_PRE_REGEX = (
    r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
    r"|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""llama.cpp's regex for LLAMA_VOCAB_PRE_TYPE_TEKKEN (Mistral Nemo and later)."""


DEFAULT_PRE_REGEXES = (r"[\p{P}\$\+<=>\^~\|]+", GPT2_PRE_REGEX, r"\p{N}+", r"[0-9][0-9][0-9]")
"""llama.cpp's regexes for LLAMA_VOCAB_PRE_TYPE_DEFAULT (``tokenizer.ggml.pre = default``)."""

_CJK = "\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff&&[^\\s]"
"""The CJK and Hangul ranges both DeepSeek pre-tokenizers isolate.

llama.cpp runs a regex without ``\\p{..}`` through std::wregex after turning every non-ASCII whitespace
character into ``\\v``, so an explicit range never matches whitespace (U+0800-U+4E00 holds U+3000 and
U+2000-U+200A): ``&&[^\\s]`` says the same to Oniguruma. The DeepSeek regexes spell their non-ASCII
characters as escapes, because some have canonical equivalents that editors silently substitute."""

DEEPSEEK_LLM_PRE_REGEXES = (
    "[\u000d\u000a]",
    ("\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
     "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
     "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
     "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
     "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-"
     "\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
     "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
     "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
     "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
     "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
     "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"),
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002&&[^\\s]]+",
    "\\s+$",
    f"[{_CJK}]+",
    "\\p{N}+",
)
"""llama.cpp's regexes for LLAMA_VOCAB_PRE_TYPE_DEEPSEEK_LLM (DeepSeek LLM 7B/67B, llama architecture)."""

DEEPSEEK_CODER_PRE_REGEXES = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", f"[{_CJK}]+", r"\p{N}")
"""llama.cpp's regexes for LLAMA_VOCAB_PRE_TYPE_DEEPSEEK_CODER (DeepSeek-Coder, llama architecture)."""

SEED_CODER_PRE_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
    r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""llama.cpp's regex for LLAMA_VOCAB_PRE_TYPE_SEED_CODER (Seed-Coder, llama architecture)."""

PORO_PRE_REGEX = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"
"""llama.cpp's regex for LLAMA_VOCAB_PRE_TYPE_PORO/BLOOM/GPT3_FINNISH; VIKING splits off digits after it."""


@dataclasses.dataclass(frozen=True)
class PreTokenizer:
    """What one LLAMA_VOCAB_PRE_TYPE sets in llama.cpp: its regexes (``llm_tokenizer_bpe``) and vocab flags."""

    regexes: tuple[str, ...]
    """Applied in order, each splitting the pieces the previous one made (``unicode_regex_split``)."""
    add_bos: bool = False
    """Whether a BOS is added when the GGUF has no ``tokenizer.ggml.add_bos_token``."""
    clean_spaces: bool = True
    """Whether detokenizing joins " ," and " 's" (``clean_up_tokenization_spaces``)."""
    ignore_merges: bool = False
    """Whether a pre-tokenized word that is a token is taken whole, before any merge."""


_LLAMA3 = PreTokenizer((LLAMA3_PRE_REGEX,), add_bos=True, ignore_merges=True)
_QWEN2 = PreTokenizer((QWEN2_PRE_REGEX,), clean_spaces=False)
_QWEN35 = PreTokenizer((QWEN35_PRE_REGEX,), clean_spaces=False)
_GPT4O = PreTokenizer((GPT4O_PRE_REGEX,), clean_spaces=False)

_STARCODER = PreTokenizer((r"\p{N}", GPT2_PRE_REGEX))

BPE_PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": PreTokenizer(DEFAULT_PRE_REGEXES),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"), _LLAMA3),
    **dict.fromkeys(("dbrx", "smaug-bpe"), PreTokenizer((LLAMA3_PRE_REGEX,))),  # Phi-4 (phi3) is "dbrx"
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open", "grok-2"), _QWEN2),
    "qwen35": _QWEN35,
    **dict.fromkeys(("megrez", "stablelm2"), dataclasses.replace(_QWEN2, clean_spaces=True)),
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0",
                     "mellum", "modern-bert", "mpt", "olmo", "jais", "exaone4"), PreTokenizer((GPT2_PRE_REGEX,))),
    **dict.fromkeys(("starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2"), _STARCODER),
    **dict.fromkeys(("smollm", "command-r"), dataclasses.replace(_STARCODER, clean_spaces=False)),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
    "tekken": PreTokenizer((TEKKEN_PRE_REGEX,), add_bos=True, clean_spaces=False, ignore_merges=True),
    "deepseek-llm": PreTokenizer(DEEPSEEK_LLM_PRE_REGEXES, clean_spaces=False),
    "deepseek-coder": PreTokenizer(DEEPSEEK_CODER_PRE_REGEXES, clean_spaces=False),
    "seed-coder": PreTokenizer((SEED_CODER_PRE_REGEX,), clean_spaces=False),
    "viking": PreTokenizer((PORO_PRE_REGEX, r"\p{N}"), clean_spaces=False),
}
"""``tokenizer.ggml.pre`` values ggtorch tokenizes, as llama-vocab.cpp maps them to their pre-tokenizer types."""
