"""Test models made the way users' files are made: a tiny random transformers model, converted by llama.cpp.

tests/families.py writes its presets with gguf-py directly, so they carry our reading of llama.cpp's
keys and tensor layouts. Here the GGUF comes from llama.cpp's own convert_hf_to_gguf.py (q/k
permutations, norm shifts, fused tensors and metadata are the converter's), and the HF model the file
was converted from is a reference that never went through GGUF at all.

The converter ships in the llama-cpp-python sdist only (not in the wheel: tests/llama_cpp_files.py fetches it);
it is run with the sdist's own gguf-py, which knows architectures the installed gguf release may not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from tests.llama_cpp_files import vocab_file

N_VOCAB = 32000
"""llama2's sentencepiece vocabulary, the tokenizer every family here is converted with."""


def _converter_env() -> dict[str, str]:
    """This environment without NO_LOCAL_GGUF: the converter puts its own gguf-py first on sys.path."""
    return {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}


def convert(script: Path, hf_dir: Path, out: Path, outtype: str = "f32") -> Path:
    """Run llama.cpp's converter on ``hf_dir`` (its gguf-py first on sys.path, as the script arranges)."""
    run = subprocess.run([sys.executable, str(script), str(hf_dir), *_arguments(hf_dir, out, outtype)],
                         capture_output=True, text=True, env=_converter_env())
    if run.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py {hf_dir.name} failed:\n{run.stderr[-4000:]}")
    return out


def _arguments(hf_dir: Path, out: Path, outtype: str) -> list[str]:
    """The converter's options for ``hf_dir``: ``--no-mtp`` for a Qwen3.5 checkpoint, which transformers saves without
    the next-token-prediction block the converter otherwise requires (a released checkpoint carries one)."""
    config = json.loads((hf_dir / "config.json").read_text())
    no_mtp = ["--no-mtp"] if config.get("model_type") in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5") else []
    return ["--outfile", str(out), "--outtype", outtype, *no_mtp]


_FORKING_CONVERTER = r"""
import importlib.util, json, os, sys, traceback
script = sys.argv[1]
sys.path.insert(0, os.path.dirname(script))
spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", script)
module = sys.modules["convert_hf_to_gguf"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
import torch._dynamo  # what the converter's lazy tensors import on their first operation
print("ready", flush=True)
for line in sys.stdin:
    argv, log = json.loads(line)
    pid = os.fork()
    if pid == 0:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        code = 0
        try:
            sys.argv = [script, *argv]
            module.main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else int(e.code is not None)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
"""
"""A process that imports the converter once (with torch, transformers and its gguf-py) and forks a child for each
conversion a line of stdin asks for, answering with its exit code."""


class Converter:
    """``Converter(script)(hf_dir, out)``: :func:`convert`, each run forked from one process that imported the
    converter once instead of a new interpreter importing torch and transformers again (seconds each). Where
    there is no fork (Windows), each run is :func:`convert`'s process. The process starts at the first run, so a
    session that converts nothing starts none."""

    def __init__(self, script: Path) -> None:
        self.script, self.proc = script, None

    def __call__(self, hf_dir: Path, out: Path, outtype: str = "f32") -> Path:
        if not hasattr(os, "fork"):
            return convert(self.script, hf_dir, out, outtype)
        if self.proc is None:
            self.proc = subprocess.Popen([sys.executable, "-c", _FORKING_CONVERTER, str(self.script)],
                                         env=_converter_env(), text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            if self.proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"{self.script} did not import; run it by hand to see why")
        log = out.with_name(out.name + ".log")
        self.proc.stdin.write(json.dumps([[str(hf_dir), *_arguments(hf_dir, out, outtype)], str(log)]) + "\n")
        self.proc.stdin.flush()
        if int(self.proc.stdout.readline()) != 0:
            raise RuntimeError(f"convert_hf_to_gguf.py {hf_dir.name} failed:\n{log.read_text()[-4000:]}")
        return out

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def _gemma3():  # -> PretrainedConfig
    from transformers import Gemma3TextConfig

    # Six layers: llama.cpp's gemma3 has every sixth layer global (the converter writes no pattern),
    # which is also transformers' default layer_types.
    return Gemma3TextConfig(vocab_size=N_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
                            sliding_window=16, max_position_embeddings=256)


def _gemma2():  # -> PretrainedConfig
    from transformers import Gemma2Config

    return Gemma2Config(vocab_size=N_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
                        sliding_window=16, attn_logit_softcapping=2.0, final_logit_softcapping=10.0,
                        max_position_embeddings=256)


PHI3_ADDED_TOKENS = {"<|endoftext|>": 32000, "<|assistant|>": 32001, "<|end|>": 32007, "<|user|>": 32010}
"""Phi-3's added tokens after llama2's vocabulary: llama.cpp looks <|endoftext|> up in any vocabulary
of a model named phi3 and refuses to load one without it. Its embedding has 32064 rows, as Phi-3-mini's."""


def _phi3():  # -> PretrainedConfig
    from transformers import Phi3Config

    return Phi3Config(vocab_size=32064, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                      original_max_position_embeddings=256, pad_token_id=0, tie_word_embeddings=False)


def _mistral():  # -> PretrainedConfig
    from transformers import LlamaConfig

    # Mistral's shape: grouped-query attention, untied output, rope base 1e6.
    return LlamaConfig(vocab_size=N_VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False)


def _qwen2():  # -> PretrainedConfig
    from transformers import Qwen2Config

    return Qwen2Config(vocab_size=QWEN_N_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=1e6,
                       tie_word_embeddings=False)


def _qwen3():  # -> PretrainedConfig
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=QWEN_N_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                       rope_theta=1e6, tie_word_embeddings=True)


def _gpt_oss():  # -> PretrainedConfig
    from transformers import GptOssConfig

    # YaRN 4 over an original context of 64, so the ramp moves angles within 48 tokens. truncate=True: ggml always
    # floors/ceils the correction range (ggml_rope_yarn_corr_dims), the GGUF has no key for it, and transformers'
    # gpt-oss default (False) would differ from llama.cpp on every file converted from it.
    return GptOssConfig(vocab_size=QWEN_N_VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=8,
                        num_experts_per_tok=2, sliding_window=16, max_position_embeddings=256, rms_norm_eps=1e-5,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                                         "truncate": True},
                        tie_word_embeddings=False)


def _qwen35():  # -> PretrainedConfig
    from transformers import Qwen3_5TextConfig

    # Qwen3.5's hybrid at small widths: layers 0-2 Gated DeltaNet with 2 key heads and 4 value heads (so the
    # converter reorders value heads for ggml's broadcast), layer 3 gated attention, half of each 32-wide head
    # rotated in interleaved sections 3/3/2 (the released 11/11/10 scaled), tied as the small releases are.
    return Qwen3_5TextConfig(vocab_size=QWEN_N_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                             linear_conv_kernel_dim=4, max_position_embeddings=256, tie_word_embeddings=True,
                             rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5,
                                              "mrope_section": [3, 3, 2], "mrope_interleaved": True})


def _qwen35moe():  # -> PretrainedConfig
    from transformers import Qwen3_5MoeTextConfig

    # _qwen35's layers with top-2 of 8 routed experts and a gated shared expert in each, untied as the MoE releases
    return Qwen3_5MoeTextConfig(vocab_size=QWEN_N_VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                                linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                                moe_intermediate_size=64, shared_expert_intermediate_size=64, num_experts=8,
                                num_experts_per_tok=2, max_position_embeddings=256, tie_word_embeddings=False,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                 "partial_rotary_factor": 0.5, "mrope_section": [3, 3, 2],
                                                 "mrope_interleaved": True})


def _gemma4_common() -> dict:
    """Gemma 4's small releases at tiny widths: sliding heads of 16 and global heads of 32 ("proportional" rope, a
    quarter of the pairs turning), window 16, the final soft-cap."""
    return dict(vocab_size=N_VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=16, max_position_embeddings=256,
                final_logit_softcapping=30.0, pad_token_id=0)


def _gemma4():  # -> PretrainedConfig
    from transformers import Gemma4TextConfig

    # E2B's design: layers 0-2 and 4 slide, 3 and 5 are global; 4 and 5 read the K/V of 2 and 3, with the double-wide
    # MLP; per-layer embeddings of 8
    return Gemma4TextConfig(num_hidden_layers=6, layer_types=["sliding_attention"] * 3 + [
        "full_attention", "sliding_attention", "full_attention"], num_kv_shared_layers=2, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=N_VOCAB, use_double_wide_mlp=True, **_gemma4_common())


def _gemma4moe():  # -> PretrainedConfig
    from transformers import Gemma4TextConfig

    # 26B-A4B's design: the dense MLP beside top-2 of 8 experts in every layer, global layers with one KV head and no
    # v_proj (attention_k_eq_v), no per-layer embeddings
    return Gemma4TextConfig(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                            hidden_size_per_layer_input=0, attention_k_eq_v=True, num_global_key_value_heads=1,
                            enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
                            **_gemma4_common())


GEMMA4_ROUTER_DIMS = 16
"""Hidden values only gemma4moe's routers read (as GPT_OSS_ROUTER_DIMS)."""


def _gemma4_weights(model) -> None:  # model: Gemma4ForCausalLM
    """Gemma 4 scales q.k by 1: q and k norm gains of D^-1/4 (the 1/sqrt(D) trained models learn) keep its softmax
    from being so peaked that quantization's rounding moves the logits by units. In the MoE, routers of gain 32
    (the init's would route on near-equal probabilities, which any rounding reorders), per-expert scales away from 1,
    and routers that read only the last GEMMA4_ROUTER_DIMS hidden values, which no layer writes."""
    import torch

    r = GEMMA4_ROUTER_DIMS
    for layer in model.model.layers:
        attn = layer.self_attn
        for norm in (attn.q_norm, getattr(attn, "k_norm", None)):
            if norm is not None:
                norm.weight.mul_(norm.weight.shape[0] ** -0.25)
        if not hasattr(layer, "router"):
            continue
        router = layer.router
        torch.nn.init.normal_(router.proj.weight, std=32.0 / router.proj.weight.shape[1] ** 0.5)
        router.per_expert_scale.copy_(torch.rand_like(router.per_expert_scale) + 0.5)
        router.proj.weight[:, :-r] = 0.0
        attn.o_proj.weight[-r:] = 0.0
        layer.mlp.down_proj.weight[-r:] = 0.0
        layer.experts.down_proj[:, -r:] = 0.0  # (E, hidden, width)


GPT_OSS_ROUTER_DIMS = 32
"""Hidden values only gpt-oss's router reads (tests/families.py's Shape.router_dims)."""


def _gpt_oss_weights(model) -> None:  # model: GptOssForCausalLM
    """gpt-oss's init (std 0.02, zero biases) would leave its quirks idle: tests/families.py's gpt_oss scales instead.

    q/k/v/o rows of gain 1 (o 0.5) and biases of 0.3, sinks N(0, 1), router rows of gain 4 and biases of 0.3, expert
    gate/up rows of gain 2 and biases of 5 (a real share of values past the SwiGLU's clamps at 7), down rows of gain
    0.1. The router reads only the last GPT_OSS_ROUTER_DIMS hidden values, which attention and experts never write:
    they hold the token's embedding, so llama.cpp's activation rounding on quantized files cannot flip its choices."""
    import torch

    r = GPT_OSS_ROUTER_DIMS
    for layer in model.model.layers:
        attn, router, experts = layer.self_attn, layer.mlp.router, layer.mlp.experts
        for proj, gain in ((attn.q_proj, 1.0), (attn.k_proj, 1.0), (attn.v_proj, 1.0), (attn.o_proj, 0.5)):
            torch.nn.init.normal_(proj.weight, std=gain / proj.in_features ** 0.5)
            torch.nn.init.normal_(proj.bias, std=0.3)
        torch.nn.init.normal_(attn.sinks)
        torch.nn.init.normal_(router.weight, std=4.0 / router.weight.shape[1] ** 0.5)
        torch.nn.init.normal_(router.bias, std=0.3)
        torch.nn.init.normal_(experts.gate_up_proj, std=2.0 / experts.gate_up_proj.shape[1] ** 0.5)  # (E, in, 2 out)
        torch.nn.init.normal_(experts.gate_up_proj_bias, std=5.0)
        torch.nn.init.normal_(experts.down_proj, std=0.1 / experts.down_proj.shape[1] ** 0.5)  # (E, in, out)
        torch.nn.init.normal_(experts.down_proj_bias, std=0.3)
        router.weight[:, :-r] = 0.0
        attn.o_proj.weight[-r:] = 0.0
        attn.o_proj.bias[-r:] = 0.0
        experts.down_proj[..., -r:] = 0.0
        experts.down_proj_bias[:, -r:] = 0.0


QWEN_N_VOCAB = 151936
"""Qwen's embedding rows (its BPE vocabulary and special tokens, padded)."""
QWEN_EOS = 151643
HF_FAMILIES: dict[str, tuple[str, Callable, dict[str, int] | None]] = {
    # name: (HF class, its config, added tokens after llama2's sentencepiece vocabulary or None for Qwen's BPE)
    "gemma3": ("Gemma3ForCausalLM", _gemma3, {}),
    "gemma2": ("Gemma2ForCausalLM", _gemma2, {}),
    "phi3": ("Phi3ForCausalLM", _phi3, PHI3_ADDED_TOKENS),
    "mistral": ("LlamaForCausalLM", _mistral, {}),
    "qwen2": ("Qwen2ForCausalLM", _qwen2, None),
    "qwen3": ("Qwen3ForCausalLM", _qwen3, None),
    "gpt_oss": ("GptOssForCausalLM", _gpt_oss, None),
    "qwen35": ("Qwen3_5ForCausalLM", _qwen35, None),
    "qwen35moe": ("Qwen3_5MoeForCausalLM", _qwen35moe, None),
    "gemma4": ("Gemma4ForCausalLM", _gemma4, {}),
    "gemma4moe": ("Gemma4ForCausalLM", _gemma4moe, {}),
}
EMBEDDING_GAIN = 10.0
"""On the init's std of 0.02: logits with a std of a few units, so argmax is not a coin flip."""


def hf_model(name: str, seed: int = 0):  # -> transformers.PreTrainedModel
    """A tiny random HF model of a family, in eval mode, with norm weights away from their init (and gpt-oss's
    weights at scales where its quirks matter)."""
    import torch
    import transformers

    class_name, config, added_tokens = HF_FAMILIES[name]
    torch.manual_seed(seed)
    config = config()
    config.bos_token_id, config.eos_token_id = (1, 2) if added_tokens is not None else (QWEN_EOS, QWEN_EOS)
    model = getattr(transformers, class_name)(config).eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.add_(0.1 * torch.randn_like(param))
        model.get_input_embeddings().weight.mul_(EMBEDDING_GAIN)
        if not config.tie_word_embeddings:
            model.get_output_embeddings().weight.mul_(EMBEDDING_GAIN)
        if class_name == "GptOssForCausalLM":
            _gpt_oss_weights(model)
        if class_name == "Gemma4ForCausalLM":
            _gemma4_weights(model)
    return model


def write_hf_model(name: str, hf_dir: Path, seed: int = 0) -> Path:
    """Save ``hf_model(name)`` with the tokenizer files the converter reads, made from llama.cpp's vocabularies."""
    hf_model(name, seed).save_pretrained(hf_dir)
    added_tokens = HF_FAMILIES[name][2]
    if added_tokens is None:
        return write_qwen2_tokenizer(hf_dir, vocab_file("qwen2"))
    if HF_FAMILIES[name][0] == "Gemma4ForCausalLM":
        return write_gemma4_tokenizer(hf_dir, vocab_file("llama-spm"))
    write_spm_tokenizer(hf_dir, vocab_file("llama-spm"))
    tokenizer_config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
                        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    if added_tokens:
        (hf_dir / "added_tokens.json").write_text(json.dumps(added_tokens), encoding="utf-8")
    return hf_dir


QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
               r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
"""Qwen2's pre-tokenizer regex: with it, the converter recognises the tokenizer as "qwen2" by its hash."""


def write_qwen2_tokenizer(hf_dir: Path, vocab_gguf: Path) -> Path:
    """Qwen2's tokenizer.json rebuilt from llama.cpp's qwen2 vocabulary file (tokens, merges, special tokens)."""
    from ggtorch.io.gguf import read_gguf

    meta = read_gguf(vocab_gguf).metadata
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    normal, control = 1, 3  # llama.cpp's token types
    byte_level = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True}
                         for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind == control],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", **byte_level}]},
        "post_processor": {"type": "ByteLevel", **byte_level},
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, (t, kind) in enumerate(zip(tokens, types, strict=True)) if kind == normal},
                  "merges": list(meta["tokenizer.ggml.merges"])},
    }
    (hf_dir / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    tokenizer_config = {"tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|endoftext|>",
                        "pad_token": "<|endoftext|>", "add_prefix_space": False, "errors": "replace"}
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    return hf_dir


def write_gemma4_tokenizer(hf_dir: Path, vocab_gguf: Path) -> Path:
    """A Gemma 4 style ``tokenizer.json`` (BPE over text with spaces as ``▁``, byte fallback, merges) rebuilt from a
    llama.cpp vocabulary file: Gemma 4's own (its merges), or llama-spm's, whose merges are ordered by the merged
    piece's score as sentencepiece's BPE merges (transformers' generate_merges): Gemma 4's 262k vocabulary would make
    every table of a tiny model large. The converter reads it as it reads Gemma 4's (gguf-py's LlamaHfVocab)."""
    from transformers.convert_slow_tokenizer import generate_merges

    from ggtorch.io.gguf import read_gguf

    meta = read_gguf(vocab_gguf).metadata
    pieces, scores, kinds = (meta[f"tokenizer.ggml.{k}"] for k in ("tokens", "scores", "token_type"))
    vocab = {piece: i for i, piece in enumerate(pieces)}
    merges = [(m[:m.find(" ", 1)], m[m.find(" ", 1) + 1:]) for m in meta.get("tokenizer.ggml.merges", ())] \
        or generate_merges(vocab, {p: s for p, s in zip(pieces, scores, strict=True) if len(p) > 1})
    control = 3  # llama.cpp's (and sentencepiece's) token type
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": p, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True}
                         for i, (p, kind) in enumerate(zip(pieces, kinds, strict=True)) if kind == control],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\n+"}, "behavior": "Isolated", "invert": False},
        "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": [f"{a} {b}" for a, b in merges]},
    }
    (hf_dir / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                        "unk_token": "<unk>", "pad_token": "<unk>", "add_bos_token": True, "add_eos_token": False}
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config), encoding="utf-8")
    return hf_dir


def write_spm_tokenizer(hf_dir: Path, vocab_gguf: Path) -> Path:
    """A sentencepiece ``tokenizer.model`` rebuilt from llama.cpp's llama-spm vocabulary file: its pieces, scores and
    types (llama.cpp's token types are sentencepiece's), a BPE model with byte fallback and llama's normalizer, as
    Llama 2's tokenizer.model holds them (tests/models/test_converted.py checks it against llama.cpp's test
    vectors)."""
    from sentencepiece import sentencepiece_model_pb2 as spm

    from ggtorch.io.gguf import read_gguf

    meta = read_gguf(vocab_gguf).metadata
    model = spm.ModelProto()
    for piece, score, kind in zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"],
                                  meta["tokenizer.ggml.token_type"], strict=True):
        model.pieces.add(piece=piece, score=score, type=kind)
    trainer = model.trainer_spec
    trainer.model_type = spm.TrainerSpec.BPE
    trainer.vocab_size = len(model.pieces)
    trainer.byte_fallback = trainer.allow_whitespace_only_pieces = True
    trainer.unk_id, trainer.pad_id = meta["tokenizer.ggml.unknown_token_id"], -1
    trainer.bos_id, trainer.eos_id = meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]
    normalizer = model.normalizer_spec
    normalizer.name, normalizer.add_dummy_prefix, normalizer.remove_extra_whitespaces = "identity", True, False
    normalizer.escape_whitespaces = True
    (hf_dir / "tokenizer.model").write_bytes(model.SerializeToString())
    return hf_dir / "tokenizer.model"
