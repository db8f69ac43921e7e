"""LoRA steps on full-size files of the shapes people hold: Llama-3-8B, Qwen3-30B-A3B and Qwen3.5/3.6-35B-A3B's
qwen35moe hybrid in Q4_K_M.

Not a test. Writes each model streamed, tensor by tensor, with random valid Q4_K / Q6_K blocks typed as
llama-quantize's Q4_K_M types them (llama.cpp's src/llama-quant.cpp: output Q6_K; attn_v (a DeltaNet layer's
attn_qkv with them) and ffn_down Q6_K in the layers ``use_more_bits`` picks; the rest Q4_K; norms, routers and
convolutions F32): no full-size f32 tensor is ever in memory. The keys come from one period of layers of the
same shape (one layer; a hybrid's three DeltaNet layers and one attention layer) written by tests/families.py,
the tokenizer from llama.cpp's own vocabulary files (Llama 3's 128,256 tokens; Qwen2's 151,936 for Qwen3;
Qwen3.5's 248,320). Then, each in a fresh process:

- ggtorch: ``ggtorch finetune``'s run (the Trainer) with its defaults (``--dtype auto``, ``--use-checkpointing``
  auto, the routed experts' default rank), LoRA r16 on q/k/v/o/gate/up/down (token_embd and output off, as the
  peer), batch x context tokens of text; load time, the first step and the steady ones, tokens/s, peak resident
  and anonymous memory (sampled every 50 ms; VmHWM), the memory estimate, and one more
  step under torch.profiler: where its time goes (decoding blocks, matrix products, attention, the rest: each op's
  own time, grouped by name);
- the matrix rate: torch.mm and oneDNN (ggtorch.ops.matmul) on the model's own product shapes with batch x
  context rows, forward and input gradient, f32 and bf16, the faster kernel; the step's useful work (4 x the
  matrix parameters a token passes x tokens; routed experts only for an MoE) over it;
- the peer a user would pick at 8B, transformers + peft with the model built in bf16 from its config (random
  weights of the same shapes: 16 GB, the GGUF dequantized would be 32), LoRA r16 on the same seven projections,
  the same tokens, AdamW. The MoE shape's bf16 weights alone are 61 GB: its peer is asked to build it under an
  address-space limit of the machine's memory, and its own error stands in the table.

Rounds alternate the sides (``--rounds``); a figure is the median of the steady steps of a round, each round shown.

    python bench/bench_scale.py --model llama3-8b --threads 2 [--ctx 256] [--rounds 2] [--peer]
    python bench/bench_scale.py --model qwen35-2b --threads 2 --contexts 256,1024,4096
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_dequant import best_time  # noqa: E402  (this folder)
from bench_vs_peft import peak_rss_bytes  # noqa: E402

LORA_RANK = 16
TEXT = ROOT / "tests" / "fixtures" / "tinyshakespeare.txt"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Model:
    """A full-size shape: the family, its vocabulary and tests/families.py's Shape fields."""

    arch: str
    vocab: str
    shape: dict[str, Any]
    hf: dict[str, Any]
    """transformers' config of the same shape (the peer)."""
    peer_fits: bool = True
    """False where the peer's bf16 weights alone exceed the machine's memory: it is asked to build the model under
    an address-space limit of the machine's memory (without one the kernel's OOM killer would end it, and maybe
    more than it), and its own error is the row."""


MODELS = {
    "llama3-8b": Model("llama", "llama-bpe",
                       dict(n_embd=4096, n_ff=14336, n_layer=32, n_head=32, n_head_kv=8, rope_freq_base=500000.0,
                            rms_eps=1e-5, n_ctx=8192),
                       dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0,
                            rms_norm_eps=1e-5, max_position_embeddings=8192, tie_word_embeddings=False)),
    "qwen3-30b-a3b": Model("qwen3moe", "qwen2",
                           dict(n_embd=2048, n_ff=6144, n_layer=48, n_head=32, n_head_kv=4, head_dim=128,
                                n_expert=128, n_expert_used=8, n_ff_exp=768, rope_freq_base=1e6, n_ctx=40960),
                           dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
                                moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
                                num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                vocab_size=151936, rope_theta=1e6, max_position_embeddings=40960,
                                tie_word_embeddings=False),
                           peer_fits=False),
    "qwen35moe-35b-a3b": Model("qwen35moe", "qwen35",
                               dict(n_embd=2048, n_ff=512, n_layer=40, n_head=16, n_head_kv=2, head_dim=256, n_rot=64,
                                    n_expert=256, n_expert_used=8, n_ff_exp=512, n_ff_shexp=512,
                                    delta_net=(16, 32, 128, 4), full_attention_interval=4, rope_freq_base=1e7,
                                    rope_sections=(11, 11, 10, 0), n_ctx=262144),
                               dict(model_type="qwen3_5_moe_text"),  # transformers' defaults are this shape
                               peer_fits=False),
    "qwen35-2b": Model("qwen35", "qwen35",
                       dict(n_embd=2048, n_ff=6144, n_layer=24, n_head=8, n_head_kv=2, head_dim=256, n_rot=64,
                            delta_net=(16, 16, 128, 4), full_attention_interval=4, rope_freq_base=1e7,
                            rope_sections=(11, 11, 10, 0), tied_output=True, n_ctx=262144),
                       dict(model_type="qwen3_5_text", hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
                            num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                            linear_num_value_heads=16, tie_word_embeddings=True)),
    "smoke": Model("llama", "llama-bpe", dict(n_embd=256, n_ff=512, n_layer=2, n_head=4, n_head_kv=2),
                   dict(model_type="llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128256, tie_word_embeddings=False)),
}


# --- the file -------------------------------------------------------------------------------------------------------


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """llama-quant.cpp's choice of the layers whose attn_v and ffn_down get more bits."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


ATTENTION_V = (".attn_v.weight", ".attn_qkv.weight", ".attn_kv_b.weight")
"""llama-quant.cpp's attn_v category: one counter runs over them all (a DeltaNet layer's attn_qkv included)."""


def q4_k_m_type(name: str, shape: tuple[int, ...], n_layer: int,
                attention_v_index: tuple[int, int] | None = None) -> Any:
    """The type llama-quantize's Q4_K_M gives a tensor of these shapes (dense, MoE with n_expert != 8, qwen35's
    hybrids): llama-quant.cpp's tensor_get_type. ``attention_v_index``: (i, n) of a tensor of the attn_v category
    among the n the file has (None: its layer among n_layer, as where every layer has one)."""
    from gguf import GGMLQuantizationType as T

    if (len(shape) == 1 or shape[-1] % 256 or name.endswith("_norm.weight") or "ffn_gate_inp.weight" in name
            or "ssm_conv1d" in name):
        return T.F32
    if name == "output.weight":
        return T.Q6_K
    layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
    if ".ffn_down" in name and use_more_bits(layer, n_layer):
        return T.Q6_K
    if name.endswith(ATTENTION_V) and use_more_bits(*(attention_v_index or (layer, n_layer))):
        return T.Q6_K
    return T.Q4_K


def q4_k_m_types(shapes: dict[str, tuple[int, ...]], n_layer: int) -> dict[str, Any]:
    """:func:`q4_k_m_type` of each tensor of a file (name -> shape, blocks in layer order), the attn_v category
    counted as llama-quant.cpp counts it."""
    v_names = sorted((n for n in shapes if n.startswith("blk.") and n.endswith(ATTENTION_V)),
                     key=lambda n: int(n.split(".")[1]))
    types = {n: q4_k_m_type(n, shape, n_layer, (v_names.index(n), len(v_names)) if n in v_names else None)
             for n, shape in shapes.items()}
    if "output.weight" not in shapes:  # a tied embedding is typed as the output it also is
        types["token_embd.weight"] = q4_k_m_type("output.weight", shapes["token_embd.weight"], n_layer)
    return types


def random_blocks(rng: np.random.Generator, ggml_type: Any, shape: tuple[int, ...]) -> np.ndarray:
    """Random valid blocks of ``ggml_type`` for a tensor of ``shape`` (torch order), values of about
    1/sqrt(row width) as a trained model's: random quants and sub-block scales, a finite f16 scale per block."""
    from gguf import GGML_QUANT_SIZES
    from gguf import GGMLQuantizationType as T

    n = int(np.prod(shape))
    if ggml_type == T.F32:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32).reshape(shape)
    block, size = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, (n // block, size), dtype=np.uint8)
    std = 1.0 / np.sqrt(shape[-1])
    if ggml_type == T.Q4_K:  # d, dmin, scales[12], qs[128]: d * sc * q - dmin * m, q in 0..15, sc and m in 0..63
        blocks[:, 0:2] = np.frombuffer(np.float16(std / (31 * 4.6)).tobytes(), np.uint8)
        blocks[:, 2:4] = np.frombuffer(np.float16(7.5 * std / (31 * 4.6)).tobytes(), np.uint8)
    elif ggml_type == T.Q5_K:  # d, dmin, scales[12], qh[32], qs[128]: d * sc * q - dmin * m, q in 0..31
        blocks[:, 0:2] = np.frombuffer(np.float16(std / (31 * 9.2)).tobytes(), np.uint8)
        blocks[:, 2:4] = np.frombuffer(np.float16(15.5 * std / (31 * 9.2)).tobytes(), np.uint8)
    elif ggml_type == T.Q6_K:  # ql[128], qh[64], scales[16] (int8), d: d * scale * (q - 32)
        blocks[:, 208:210] = np.frombuffer(np.float16(std / (64 * 18.5)).tobytes(), np.uint8)
    else:
        raise ValueError(f"no random blocks for {ggml_type.name}")
    return blocks


def write_model(name: str, folder: Path, seed: int = 0) -> Path:
    """``folder/NAME-Q4_K_M.gguf``, written once (a file there is whole: the writer renames a complete one)."""
    import torch
    from gguf import GGMLQuantizationType as T

    from ggtorch.io.gguf import read_gguf, write_gguf_streaming
    from tests.families import Shape, vocabulary_file, write_random_model

    m = MODELS[name]
    path = folder / f"{name}-Q4_K_M.gguf"
    if path.exists():
        return path
    vocab = read_gguf(vocabulary_file(m.vocab))
    n_vocab = len(vocab.metadata["tokenizer.ggml.tokens"])
    # the keys of the shape from one period of layers at full width (a hybrid's: its DeltaNet layers and one
    # attention layer), its vocabulary a 512-token stand-in (tests/fixtures)
    period = m.shape.get("full_attention_interval") or 1
    template = read_gguf(write_random_model(folder / "template.gguf", m.arch, vocabulary_file("stories"),
                                            Shape(**{**m.shape, "n_layer": period})))
    n_layer = m.shape["n_layer"]
    metadata = {k: v for k, v in template.metadata.items() if not k.startswith("tokenizer.")}
    types = {k: v for k, v in template.value_types.items() if not k.startswith("tokenizer.")}
    metadata |= {k: v for k, v in vocab.metadata.items() if k.startswith("tokenizer.")}
    types |= {k: v for k, v in vocab.value_types.items() if k.startswith("tokenizer.")}
    metadata[f"{m.arch}.block_count"] = n_layer
    metadata["general.file_type"] = 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    metadata["general.name"] = f"random {name}"
    if f"{m.arch}.vocab_size" in metadata:
        metadata[f"{m.arch}.vocab_size"] = n_vocab
    shapes: dict[str, tuple[int, ...]] = {}
    sources: dict[str, str] = {}  # each tensor's template tensor: the same one, or its layer of the period
    for t in template.tensors.values():
        shape = (n_vocab, *t.shape[1:]) if t.name in ("token_embd.weight", "output.weight") else t.shape
        j = int(t.name.split(".")[1]) if t.name.startswith("blk.") else None
        names = [t.name] if j is None else [t.name.replace(f"blk.{j}.", f"blk.{i}.", 1)
                                            for i in range(j, n_layer, period)]
        shapes |= {n: shape for n in names}
        sources |= {n: t.name for n in names}
    tensor_types = q4_k_m_types(shapes, n_layer)
    infos = [(n, tensor_types[n], shape) for n, shape in shapes.items()]
    rng = np.random.default_rng(seed)

    def values(name: str, ggml_type: Any, shape: tuple[int, ...]) -> np.ndarray:
        """Random blocks, or for a tensor kept in F32 (norms, routers, a DeltaNet layer's decay, gates and
        convolution) the template's own values for its layer of the period: tests/families.py draws them as a
        working model's, where ones would make a decay grow instead of fade."""
        if ggml_type == T.F32:
            source = template.tensors[sources[name]]
            if source.ggml_type == T.F32 and tuple(source.shape) == tuple(shape):
                return source.raw().view(torch.float32).reshape(shape).numpy()
        return random_blocks(rng, ggml_type, shape)

    infos.sort(key=lambda info: (info[0].startswith("blk."), int(info[0].split(".")[1]) if info[0].startswith(
        "blk.") else 0))
    write_gguf_streaming(path, m.arch, metadata, infos, (values(n, t, s) for n, t, s in infos), types)
    (folder / "template.gguf").unlink()
    return path


def matrix_shapes(path: Path) -> tuple[list[tuple[int, int, int]], int]:
    """(out, in, how many a token passes) of each distinct product, and the matrix parameters a token passes:
    every layer matrix and the output head (an MoE's routed experts: the used ones only); the embedding is a
    lookup."""
    from ggtorch.io.gguf import read_gguf
    from ggtorch.models.config import ModelConfig

    f = read_gguf(path)
    config = ModelConfig.from_gguf(f)
    passes: dict[tuple[int, int], int] = {}
    for name, info in f.tensors.items():
        if len(info.shape) < 2 or name == "token_embd.weight" or "ffn_gate_inp" in name:
            continue
        *stack, n_out, n_in = info.shape
        used = config.n_expert_used if stack else 1
        passes[n_out, n_in] = passes.get((n_out, n_in), 0) + used
    return [(o, i, k) for (o, i), k in passes.items()], sum(o * i * k for (o, i), k in passes.items())


# --- the children ---------------------------------------------------------------------------------------------------


class MemorySampler:
    """The process's peak anonymous and resident memory, read from /proc every 50 ms (the kernel keeps a peak of
    the resident set, VmHWM, but not of its anonymous part)."""

    def __init__(self) -> None:
        self.peak = {"RssAnon": 0, "VmRSS": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for line in Path("/proc/self/status").read_text().splitlines():
                key = line.split(":")[0]
                if key in self.peak:
                    self.peak[key] = max(self.peak[key], int(line.split()[1]) * 1024)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peak


STEP_PARTS = {"decode": ("ggtorch::dequantize_",),
              "products": ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::matmul"),
              "attention": ("ggtorch::attention", "ggtorch::attention_backward", "aten::_flash_attention_forward",
                            "aten::_scaled_dot_product_flash_attention_for_cpu",
                            "aten::_scaled_dot_product_flash_attention_for_cpu_backward")}
"""The ops of each part of a step, by the profiler's names (each op's own time, so nothing counts twice)."""


def step_shares(self_times: dict[str, float]) -> dict[str, float]:
    """Each part's share of a profiled step's op time (name -> own time), the ops of no part as "rest"."""
    total = sum(self_times.values()) or 1.0
    shares = {part: sum(self_times.get(name, 0.0) for name in names) / total for part, names in STEP_PARTS.items()}
    return shares | {"rest": 1.0 - sum(shares.values())}


def child_ggtorch(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from ggtorch.training.config import FinetuneConfig
    from ggtorch.training.trainer import Trainer

    torch.set_num_threads(spec["threads"])
    sampler = MemorySampler()
    t0 = time.perf_counter()
    config = FinetuneConfig(model_base=spec["model"], train_data=spec["text"], ctx=spec["ctx"], batch=spec["batch"],
                            adam_iter=spec["steps"] + 1, lora_r=LORA_RANK, rank_tok_embd=0, rank_out=0, seed=1,
                            checkpoint_in="", checkpoint_out="", lora_out="", save_every=0, threads=spec["threads"],
                            log_file=str(Path(spec["workdir"]) / "ggtorch-log.jsonl"), overwrite=True)
    trainer = Trainer(config, log_records=False, manage_process=spec.get("manage_process", True))
    load = time.perf_counter() - t0
    results = trainer.train()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled_step = trainer.step().seconds
    shares = step_shares({e.key: e.self_cpu_time_total for e in prof.key_averages()})
    memory = trainer.run.memory
    out = {"load_s": load, "step_s": [r.seconds for r in results], "loss": [r.loss for r in results],
           "shares": shares, "profiled_step_s": profiled_step, "dtype": trainer.config.dtype,
           "checkpointing": trainer.config.use_checkpointing, "estimate_gib": memory.total / 2**30,
           "estimate_resident_gib": memory.resident / 2**30, "estimate_mapped_gib": memory.mapped / 2**30,
           "trained_params": dict(memory.trained_params)}
    trainer.close()
    peak = sampler.stop()
    return out | {"peak_rss_gib": peak_rss_bytes() / 2**30, "peak_anon_gib": peak["RssAnon"] / 2**30}


def child_peer(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(spec["threads"])
    if not MODELS[spec["name"]].peer_fits:
        import resource

        limit = int(Path("/proc/meminfo").read_text().split("MemTotal:")[1].split()[0]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    sampler = MemorySampler()
    t0 = time.perf_counter()
    config = AutoConfig.for_model(**MODELS[spec["name"]].hf)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, lora_dropout=0.0,
                                             target_modules=LORA_TARGETS))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    load = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    step_s, losses = [], []
    for _ in range(spec["steps"] + 1):
        tokens = torch.randint(0, config.vocab_size, (spec["batch"], spec["ctx"] + 1), generator=gen)
        t = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        logits = model(input_ids=tokens[:, :-1]).logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        optimizer.step()
        step_s.append(time.perf_counter() - t)
        losses.append(float(loss))
    peak = sampler.stop()
    return {"load_s": load, "step_s": step_s, "loss": losses, "peak_rss_gib": peak_rss_bytes() / 2**30,
            "peak_anon_gib": peak["RssAnon"] / 2**30}


def child_gemm(spec: dict[str, Any]) -> dict[str, Any]:
    """GFLOP/s of the step's products on this machine: per dtype, the faster of torch.mm and oneDNN over the sum of
    the model's forward and input-gradient products, each shape weighted by how many a token passes."""
    import torch

    from ggtorch.ops import matmul, policy

    torch.set_num_threads(spec["threads"])
    n = spec["rows"]
    out: dict[str, Any] = {}
    with policy.using(policy.current("cpu").replace(onednn_f32=True)):
        for name, dtype in (("f32", torch.float32), ("bf16", torch.bfloat16)):
            totals = {"torch.mm": 0.0, "oneDNN": 0.0}
            flops = 0.0
            for o, i, k in spec["shapes"]:
                w = torch.randn(o, i, dtype=dtype) * 0.02
                x, dy = torch.randn(n, i, dtype=dtype), torch.randn(n, o, dtype=dtype)
                flops += 2 * 2.0 * n * o * i * k
                products = {"torch.mm": (partial(torch.mm, x, w.T), partial(torch.mm, dy, w)),
                            "oneDNN": (partial(matmul.mm_t, x, w), partial(matmul.mm, dy, w))}
                for kernel, (fwd, grad) in products.items():
                    totals[kernel] += k * (best_time(fwd, 2) + best_time(grad, 2))
            out[name] = {kernel: flops / seconds / 1e9 for kernel, seconds in totals.items()}
    return out


CHILDREN = {"ggtorch": child_ggtorch, "peer": child_peer, "gemm": child_gemm}


def run_child(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One side in a fresh interpreter: its last stdout line, parsed."""
    done = subprocess.run([sys.executable, __file__, "--child", kind, "--spec", json.dumps(spec)],
                          capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        lines = (done.stderr or done.stdout).strip().splitlines()
        return {"error": lines[-1:] or [f"exit status {done.returncode}"]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- the table ------------------------------------------------------------------------------------------------------


def steady(result: dict[str, Any]) -> float:
    return statistics.median(result["step_s"][1:])


def shares_text(result: dict[str, Any]) -> str:
    """A ggtorch run's step parts, "decode / products / attention / rest" as percentages."""
    return " / ".join(f"{v:.0%}" for v in result["shares"].values())


def context_table(name: str, model: Path, contexts: list[int], args: argparse.Namespace, workdir: Path) -> None:
    """Issue 70's cost as the work grows: one ggtorch run a context length, batch 1, the defaults."""
    rows = []
    for ctx in contexts:
        spec = {"name": name, "model": str(model), "text": str(TEXT), "ctx": ctx, "batch": 1, "steps": args.steps,
                "threads": args.threads, "workdir": str(workdir)}
        rows.append((ctx, run_child("ggtorch", spec)))
        print(json.dumps(rows[-1], default=str)[:2000])
    print(f"\n{name}, Q4_K_M, batch 1, {args.threads} threads, LoRA r{LORA_RANK}, the defaults")
    print("| context | dtype, checkpointing | first s | steady s/step | tokens/s | s per 1k tokens | peak anon GiB | "
          "peak RSS GiB | estimate GiB | decode / products / attention / rest |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for ctx, res in rows:
        if "error" in res:
            print(f"| {ctx} | error: {res['error']} |")
            continue
        s = steady(res)
        print(f"| {ctx} | {res['dtype']}, {'on' if res['checkpointing'] else 'off'} | {res['step_s'][0]:.1f} | "
              f"{s:.1f} | {ctx / s:.1f} | {1000 * s / ctx:.1f} | {res['peak_anon_gib']:.2f} | "
              f"{res['peak_rss_gib']:.2f} | {res['estimate_gib']:.2f} | {shares_text(res)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(MODELS), default="llama3-8b")
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2, help="timed steps after the first, per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--peer", action="store_true",
                        help="run transformers + peft in bf16 too (8B: ~20 GiB; the MoE: its error building the model)")
    parser.add_argument("--contexts", help="comma-separated context lengths (batch 1): ggtorch's s/step, memory and "
                        "where the step goes at each, one round each, instead of the rounds against the rate and peer")
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "ggtorch-bench-scale"))
    parser.add_argument("--child", choices=list(CHILDREN), help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(CHILDREN[args.child](json.loads(args.spec))))
        return

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = write_model(args.model, workdir)
    print(f"{model.name}: {model.stat().st_size / 2**30:.2f} GiB ({time.perf_counter() - t0:.0f} s to write or find)")
    if args.contexts:
        context_table(args.model, model, [int(c) for c in args.contexts.split(",")], args, workdir)
        return
    shapes, per_token = matrix_shapes(model)
    tokens = args.batch * args.ctx
    useful = 4.0 * per_token * tokens
    spec = {"name": args.model, "model": str(model), "text": str(TEXT),
            "ctx": args.ctx, "batch": args.batch, "steps": args.steps, "threads": args.threads,
            "workdir": str(workdir), "rows": tokens, "shapes": shapes}
    sides = ["ggtorch", "peer"] if args.peer else ["ggtorch"]
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        results = {"gemm": run_child("gemm", spec)}
        for side in sides if r % 2 == 0 else sides[::-1]:
            results[side] = run_child(side, spec)
        rounds.append(results)
        print(json.dumps(results, default=str)[:4000])
    print(f"\n{args.model}, Q4_K_M, {args.batch} x {args.ctx} tokens, {args.threads} threads, LoRA r{LORA_RANK}; "
          f"useful work {useful / 1e12:.2f} TFLOP a step ({per_token / 1e9:.2f}B matrix parameters a token passes)")
    print("| round | side | load s | first s | steady s/step | tokens/s | share of f32 / bf16 rate | peak anon GiB | "
          "peak RSS GiB | estimate GiB | decode / products / attention / rest |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for i, results in enumerate(rounds, 1):
        gemm = results["gemm"]
        f32, bf16 = max(gemm["f32"].values()), max(gemm["bf16"].values())
        for side in sides:
            res = results[side]
            if "error" in res:
                print(f"| {i} | {side} | error: {res['error']} |")
                continue
            s = steady(res)
            rate = useful / s / 1e9
            extra = (f"{res['estimate_gib']:.2f} ({res['estimate_mapped_gib']:.2f} mapped) | "
                     f"{shares_text(res)} |" if side == "ggtorch" else "- | - |")
            label = f"{side} ({res['dtype']}, checkpointing {'on' if res['checkpointing'] else 'off'})" \
                if side == "ggtorch" else f"{side} (bf16)"
            print(f"| {i} | {label} | {res['load_s']:.0f} | {res['step_s'][0]:.1f} | {s:.1f} | {tokens / s:.1f} | "
                  f"{rate / f32:.0%} / {rate / bf16:.0%} | {res['peak_anon_gib']:.2f} | {res['peak_rss_gib']:.2f} | "
                  f"{extra}")
        print(f"| {i} | GEMM GFLOP/s | f32 {f32:.0f} (torch.mm {gemm['f32']['torch.mm']:.0f}, oneDNN "
              f"{gemm['f32']['oneDNN']:.0f}); bf16 {bf16:.0f} (torch.mm {gemm['bf16']['torch.mm']:.0f}, oneDNN "
              f"{gemm['bf16']['oneDNN']:.0f}) |")


if __name__ == "__main__":
    main()
