"""Test models: random-weight llamas around a real vocabulary, quantized by llama.cpp itself.

Nothing here uses ggtorch's own quantization or model code, so the files are an
independent reference: the GGUF is written with gguf-py's writer (through ggtorch's thin
``write_gguf``), and every quantized type comes from llama.cpp's ``llama_model_quantize``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType

from ggtorch.io.gguf import TensorOut, read_gguf, write_gguf


@dataclass(frozen=True)
class RandomLlamaShape:
    n_embd: int = 256
    n_ff: int = 768
    n_layer: int = 2
    n_head: int = 8
    n_head_kv: int = 4
    n_ctx: int = 512
    tied_output: bool = False
    rope_freq_base: float = 10000.0
    rms_eps: float = 1e-5
    logit_scale: float = 4.0
    """Std of the logits at init: big enough that argmax is not a coin flip between ties."""


def write_random_llama(path: Path, vocab_gguf: Path, shape: RandomLlamaShape | None = None,
                       seed: int = 0) -> Path:
    """Write an F32 llama GGUF with random weights and ``vocab_gguf``'s tokenizer."""
    shape = shape or RandomLlamaShape()
    vocab = read_gguf(vocab_gguf)
    tok_keys = {k: v for k, v in vocab.metadata.items() if k.startswith("tokenizer.")}
    n_vocab = len(tok_keys["tokenizer.ggml.tokens"])
    s = shape
    head_dim = s.n_embd // s.n_head
    metadata = {
        "general.name": f"random-llama-{s.n_embd}x{s.n_layer}",
        "general.file_type": 0,
        "llama.context_length": s.n_ctx,
        "llama.embedding_length": s.n_embd,
        "llama.feed_forward_length": s.n_ff,
        "llama.block_count": s.n_layer,
        "llama.attention.head_count": s.n_head,
        "llama.attention.head_count_kv": s.n_head_kv,
        "llama.rope.dimension_count": head_dim,
        "llama.rope.freq_base": float(s.rope_freq_base),
        "llama.attention.layer_norm_rms_epsilon": float(s.rms_eps),
        "llama.vocab_size": n_vocab,
        **tok_keys,
    }
    value_types = {k: v for k, v in vocab.value_types.items() if k in tok_keys}

    rng = np.random.default_rng(seed)

    def linear(n_out: int, n_in: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in), dtype=np.float32) * (gain / np.sqrt(n_in))).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    kv = head_dim * s.n_head_kv
    arrays: dict[str, np.ndarray] = {
        "token_embd.weight": rng.standard_normal((n_vocab, s.n_embd), dtype=np.float32),
        "output_norm.weight": norm(s.n_embd),
    }
    if not s.tied_output:
        arrays["output.weight"] = linear(n_vocab, s.n_embd, s.logit_scale)
    for i in range(s.n_layer):
        arrays |= {
            f"blk.{i}.attn_norm.weight": norm(s.n_embd),
            f"blk.{i}.attn_q.weight": linear(s.n_embd, s.n_embd),
            f"blk.{i}.attn_k.weight": linear(kv, s.n_embd),
            f"blk.{i}.attn_v.weight": linear(kv, s.n_embd),
            f"blk.{i}.attn_output.weight": linear(s.n_embd, s.n_embd, 0.5),
            f"blk.{i}.ffn_norm.weight": norm(s.n_embd),
            f"blk.{i}.ffn_gate.weight": linear(s.n_ff, s.n_embd),
            f"blk.{i}.ffn_up.weight": linear(s.n_ff, s.n_embd),
            f"blk.{i}.ffn_down.weight": linear(s.n_embd, s.n_ff, 0.5),
        }
    tensors = [TensorOut(name, GGMLQuantizationType.F32, a.shape, a) for name, a in arrays.items()]
    write_gguf(path, "llama", metadata, tensors, value_types)
    return path


def quantize_with_llama_cpp(src: Path, dst: Path, ftype: str) -> Path:
    """Quantize ``src`` to ``dst`` with llama.cpp's own quantizer (``LLAMA_FTYPE_MOSTLY_<ftype>``)."""
    import llama_cpp  # test-only dependency: the reference implementation

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({ftype}) failed with {rc}")
    return dst


GGML_TYPE_F32 = 0  # ggml_type enum value, for llama.cpp's type_k / type_v


def plain_cpu_reference() -> None:
    """Make every llama.cpp model of this process load without ggml's extra CPU buffer types.

    On CPUs with AMX, llama.cpp repacks Q4_0/Q4_1/Q8_0 weights into its AMX buffer type, whose
    matmul crashes (segfault in llama_decode) on the small models the tests use; the reference
    is ggml's plain CPU path, the one every other CPU runs. ``llama_cpp.Llama`` has no option for
    ``use_extra_bufts``, so the default model parameters it starts from are changed instead.
    """
    import llama_cpp.llama_cpp as lib  # test-only dependency: the reference implementation

    if getattr(lib.llama_model_default_params, "plain_cpu", False):
        return
    defaults = lib.llama_model_default_params

    def without_extra_buffer_types():  # -> llama_model_params
        params = defaults()
        params.use_extra_bufts = False
        return params

    without_extra_buffer_types.plain_cpu = True  # type: ignore[attr-defined]
    lib.llama_model_default_params = without_extra_buffer_types


def open_llama_cpp(path: Path, n_ctx: int, f32_kv_cache: bool = True, **extra):  # -> llama_cpp.Llama
    """A llama.cpp context that keeps the logits of every position (the reference model).

    The KV cache is F32 when asked (llama.cpp's default is F16, which rounds K and V).
    n_batch = n_ctx so a whole sequence is one decode call. YaRN's betas are left to the file, as
    llama.cpp's own tools leave them (llama_cpp.Llama would otherwise pass 32 and 1 over mistral3's keys).
    ``extra``: more llama_cpp.Llama arguments (an adapter: ``lora_path``, ``lora_scale``).
    """
    import llama_cpp  # test-only dependency: the reference implementation

    kv = {"type_k": GGML_TYPE_F32, "type_v": GGML_TYPE_F32} if f32_kv_cache else {}
    return llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                           n_threads=2, n_threads_batch=2, verbose=False, yarn_beta_fast=-1.0, yarn_beta_slow=-1.0,
                           **kv, **extra)


def llama_cpp_logits(llm, tokens: list[int]) -> np.ndarray:
    """llama.cpp's logits (len(tokens), n_vocab) for one sequence evaluated from position 0."""
    llm.reset()
    llm.eval(list(tokens))
    return np.array(llm.scores[: len(tokens)], dtype=np.float32)


def rewrite_gguf(src: Path, dst: Path, arch: str | None = None, drop_keys: tuple[str, ...] = (),
                 set_keys: dict | None = None, drop_tensors: tuple[str, ...] = (),
                 add_tensors: dict[str, np.ndarray] | None = None) -> Path:
    """Copy ``src`` to ``dst`` with metadata keys/tensors dropped, set or added: broken inputs for tests.

    Added tensors are F32 arrays (they may replace a tensor of the same name with another shape).
    """
    f = read_gguf(src)
    arch = arch or f.architecture
    metadata = {k: v for k, v in f.metadata.items() if k not in drop_keys}
    metadata |= set_keys or {}
    value_types = {k: v for k, v in f.value_types.items() if k in metadata and k not in (set_keys or {})}
    add_tensors = add_tensors or {}
    tensors = [TensorOut(t.name, t.ggml_type, t.shape, t.data) for t in f.tensors.values()
               if t.name not in drop_tensors and t.name not in add_tensors]
    tensors += [TensorOut(name, GGMLQuantizationType.F32, a.shape, a.astype(np.float32))
                for name, a in add_tensors.items()]
    write_gguf(dst, arch, metadata, tensors, value_types)
    return dst
