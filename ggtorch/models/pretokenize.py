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
_GPT4O = PreTokenizer((GPT4O_PRE_REGEX,), clean_spaces=False)

BPE_PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano"), _LLAMA3),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2"), _QWEN2),
    "megrez": dataclasses.replace(_QWEN2, clean_spaces=True),
    "smollm": PreTokenizer((r"\p{N}", GPT2_PRE_REGEX), clean_spaces=False),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie"), _GPT4O),
    "tekken": PreTokenizer((TEKKEN_PRE_REGEX,), add_bos=True, clean_spaces=False, ignore_merges=True),
}
"""``tokenizer.ggml.pre`` values ggtorch tokenizes, as llama-vocab.cpp maps them to their pre-tokenizer types."""
