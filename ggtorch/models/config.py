"""LlamaConfig: the hyperparameters of a llama, read from GGUF metadata.

Keys are read through gguf-py's ``Keys`` constants with the ``{arch}`` placeholder filled
in, with llama.cpp's defaults and fallbacks (see src/models/llama.cpp and
src/llama-model.cpp there), so a file llama.cpp loads gets the same numbers here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gguf import Keys

from ggtorch.errors import BadGGUF, Unsupported
from ggtorch.io.gguf import GGUFFile
from ggtorch.models import names

ARCH = "llama"

# gguf-py dropped the constant for the pre-2023 key; llama.cpp still reads it as a fallback
# for Keys.Rope.SCALING_FACTOR (LLM_KV_ROPE_SCALE_LINEAR).
ROPE_SCALE_LINEAR = "{arch}.rope.scale_linear"


@dataclass
class LlamaConfig:
    """Shapes and constants of a llama model (ggml's hparams, named after llama.cpp's fields)."""

    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int = 2048
    """Context length the model was trained with (``llama.context_length``)."""
    rms_eps: float = 1e-5
    n_rot: int | None = None
    """Rotary dimensions per head; llama.cpp requires it to equal head_dim for llama."""
    rope_freq_base: float = 10000.0
    rope_freq_scale: float = 1.0
    """Linear rope scaling: 1 / ``rope.scaling.factor`` (positions are multiplied by it)."""
    tied_output: bool = False
    """No ``output.weight`` in the file: the output projection reuses ``token_embd``."""
    rope_freqs: bool = False
    """The file has ``rope_freqs.weight``: per-pair divisors of the rope frequencies (Llama 3.1+)."""

    def __post_init__(self) -> None:
        if self.n_rot is None:
            self.n_rot = self.head_dim
        for name in ("n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "n_ff", "n_ctx_train", "n_rot"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise BadGGUF(f"llama hyperparameter {name} = {value!r} must be a positive integer")
        if self.n_embd % self.n_head:
            raise BadGGUF(f"embedding length {self.n_embd} is not divisible by head count {self.n_head}")
        if self.n_head % self.n_head_kv:
            raise BadGGUF(f"head count {self.n_head} is not divisible by KV head count {self.n_head_kv}")
        if self.n_rot != self.head_dim:
            raise Unsupported(f"rope dimension count {self.n_rot} differs from the head size {self.head_dim}; "
                              "llama.cpp's llama requires them equal")
        for name in ("rms_eps", "rope_freq_base", "rope_freq_scale"):
            value = getattr(self, name)
            if not value > 0:
                raise BadGGUF(f"llama hyperparameter {name} = {value!r} must be positive")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_embd_kv(self) -> int:
        """Width of K and V (grouped-query attention: fewer KV heads than query heads)."""
        return self.head_dim * self.n_head_kv

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> LlamaConfig:
        """Read the config from a GGUF's metadata; Unsupported for other architectures."""
        arch = f.architecture
        if arch != ARCH:
            raise Unsupported(f"{f.path}: unsupported architecture '{arch}'; ggtorch supports only 'llama'")

        def key(template: str) -> str:
            return template.format(arch=arch)

        def required(template: str) -> Any:
            return _scalar(f, key(template), f.require(key(template)))

        def optional(template: str, default: Any) -> Any:
            k = key(template)
            return _scalar(f, k, f.metadata[k]) if k in f.metadata else default

        n_head = _int(f, Keys.Attention.HEAD_COUNT, required(Keys.Attention.HEAD_COUNT))
        n_embd = _int(f, Keys.LLM.EMBEDDING_LENGTH, required(Keys.LLM.EMBEDDING_LENGTH))
        n_vocab = optional(Keys.LLM.VOCAB_SIZE, None)
        if n_vocab is None:
            tokens = f.get(Keys.Tokenizer.LIST)
            if tokens is None:
                raise BadGGUF(f"{f.path}: neither '{key(Keys.LLM.VOCAB_SIZE)}' nor '{Keys.Tokenizer.LIST}' "
                              "is present, so the vocabulary size is unknown")
            n_vocab = len(tokens)

        scaling_type = optional(Keys.Rope.SCALING_TYPE, "none")
        if scaling_type not in ("none", "linear"):
            raise Unsupported(f"{f.path}: rope scaling type '{scaling_type}' is not supported (only none/linear)")
        factor = optional(Keys.Rope.SCALING_FACTOR, None)
        if factor is None:
            factor = optional(ROPE_SCALE_LINEAR, 0.0)
        # llama.cpp: a factor of 0 (absent) means no scaling.
        freq_scale = 1.0 if float(factor) == 0.0 else 1.0 / float(factor)

        return cls(
            n_vocab=int(n_vocab),
            n_embd=n_embd,
            n_layer=_int(f, Keys.LLM.BLOCK_COUNT, required(Keys.LLM.BLOCK_COUNT)),
            n_head=n_head,
            n_head_kv=_int(f, Keys.Attention.HEAD_COUNT_KV, optional(Keys.Attention.HEAD_COUNT_KV, n_head)),
            n_ff=_int(f, Keys.LLM.FEED_FORWARD_LENGTH, required(Keys.LLM.FEED_FORWARD_LENGTH)),
            n_ctx_train=_int(f, Keys.LLM.CONTEXT_LENGTH, required(Keys.LLM.CONTEXT_LENGTH)),
            rms_eps=float(required(Keys.Attention.LAYERNORM_RMS_EPS)),
            n_rot=_int(f, Keys.Rope.DIMENSION_COUNT, optional(Keys.Rope.DIMENSION_COUNT, n_embd // max(n_head, 1))),
            rope_freq_base=float(optional(Keys.Rope.FREQ_BASE, 10000.0)),
            rope_freq_scale=freq_scale,
            tied_output=names.gguf_name("output") not in f.tensors,
            rope_freqs=names.ROPE_FREQS in f.tensors,
        )


def _scalar(f: GGUFFile, key: str, value: Any) -> Any:
    """A per-layer array (allowed by GGUF for some keys) must be uniform for a plain llama."""
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise Unsupported(f"{f.path}: '{key}' varies per layer ({value[:4]}...); ggtorch supports uniform layers")
        return value[0]
    return value


def _int(f: GGUFFile, template: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadGGUF(f"{f.path}: '{template.format(arch=ARCH)}' = {value!r} must be an integer")
    return value
