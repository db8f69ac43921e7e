"""Issue 61's run on a lent GPU: correctness against the CPU, a finetune and its resume, the benchmark, the CUDA
tests; one report. Not a test.

Everything is built here from ggtorch's own writer (the GPU machine has no llama.cpp and no network): the family
presets of tests/families.py at K-quant widths around stories260K's committed vocabulary, as F32, Q8_0 (ggtorch's
quantizer, bit-exact with llama.cpp's) and Q4_K_M-like files (Q4_K, with Q6_K for attn_v, ffn_down and the output,
as llama-quantize's Q4_K_M types them; random valid blocks, since what is checked is the device's arithmetic on the
blocks, not a quantizer).

Parts run in the order b, c, a, d.

a. every preset x type: logits on the device against the CPU's (f32 relative error within ``F32_TOLERANCE``; the
   device's bf16 autocast within ``BF16_TOLERANCE``), and the LoRA gradients of one step;
b. a finetune of stories260K on the device (its policy: TF32 on Ampere and newer) whose losses track the CPU's
   run within ``LOSS_TOLERANCE``; the same run stopped halfway and resumed, whose adapter equals the whole run's;
   the adapter is left in the report folder for ``--verify`` (llama.cpp, on the CPU side);
c. the benchmark: a LoRA step (rank 16 on every matrix, bf16, activation checkpointing) of a Llama-3-8B-shaped model
   held in Q4_K_M blocks against transformers + peft on the same weights in bf16 (and peft + bitsandbytes 4-bit
   QLoRA where bitsandbytes imports), tokens/s, peak memory and MFU against the bf16 matrix rate measured in the
   same run; a Qwen3-30B-A3B-shaped MoE step (layers cut) with routed experts;
d. ``pytest -m cuda``.

Each part's time is bounded (``--budget`` seconds in all); what did not fit is said in the report.

    python3 bench/gpu_check.py --out "$OUT"           # on the GPU (gguf carried as a wheel)
    python bench/gpu_check.py --device cpu --smoke     # here: every part at toy sizes, on the CPU
    python bench/gpu_check.py --verify DIR             # here afterwards: the adapter of part b in llama.cpp
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gguf import GGML_QUANT_SIZES  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from ggtorch.io.encode import encode  # noqa: E402
from ggtorch.io.gguf import TensorOut, read_gguf, write_gguf, write_gguf_streaming  # noqa: E402
from ggtorch.lora import LoraConfig, attach_lora, trainable_parameters  # noqa: E402
from ggtorch.models.loader import load_model_file  # noqa: E402
from ggtorch.ops import policy  # noqa: E402
from ggtorch.quant import dequantize  # noqa: E402
from ggtorch.training.loss import model_cross_entropy  # noqa: E402
from tests.families import FAMILY_PRESETS, write_preset  # noqa: E402
from tests.fixtures import SHAKESPEARE, STORIES260K  # noqa: E402

F32_TOLERANCE = 1e-4
"""Largest |device - CPU| / max|CPU| of f32 logits and LoRA gradients: the same products summed in other orders."""
BF16_TOLERANCE = 4e-2
"""The same for bf16 autocast on the device against bf16 autocast on the CPU: bf16 keeps 8 bits of mantissa, and
the two round different partial sums."""
LOSS_TOLERANCE = 5e-3
"""Largest |device - CPU| of a finetune's per-step loss over 30 steps (TF32 products on the device)."""
Q4_K_M_TYPES = {"attn_v.weight": T.Q6_K, "ffn_down.weight": T.Q6_K, "output.weight": T.Q6_K}
"""Tensors llama-quantize's Q4_K_M gives Q6_K (it does for half the ffn_down; all of them here); the rest Q4_K."""


# --- files ---------------------------------------------------------------------------------------------------------
def random_blocks(ggml_type: T, n_rows: int, n_cols: int, rng: np.random.Generator, scale: float) -> np.ndarray:
    """Valid random blocks of a K-quant: random bits, f16 super-block scales of about ``scale``."""
    bs, ts = GGML_QUANT_SIZES[ggml_type]
    raw = np.frombuffer(rng.bytes(n_rows * n_cols // bs * ts), dtype=np.uint8).reshape(-1, ts).copy()
    d = (np.abs(rng.standard_normal(raw.shape[0])) * scale + scale / 4).astype(np.float16).view(np.uint8)
    if ggml_type == T.Q6_K:  # ql[128] qh[64] scales[16] d
        raw[:, 208:210] = d.reshape(-1, 2)
    else:  # Q4_K: d, dmin, scales[12], qs[128]
        raw[:, 0:2] = d.reshape(-1, 2)
        raw[:, 2:4] = (d.view(np.float16) / 4).view(np.uint8).reshape(-1, 2)
    return raw.reshape(n_rows, -1)


def matrix_type(name: str, wanted: str) -> T:
    if wanted == "Q8_0":
        return T.Q8_0
    return next((t for suffix, t in Q4_K_M_TYPES.items() if name.endswith(suffix)), T.Q4_K)


def quantized_copy(src: Path, wanted: str, rng: np.random.Generator) -> Path:
    """``src`` with its matrices as ``wanted`` (Q8_0 or Q4_K_M), norms, routers and vectors F32 as llama.cpp keeps
    them."""
    f = read_gguf(src)
    out = []
    for t in f.tensors.values():
        cols = t.shape[-1]
        if len(t.shape) >= 2 and t.name.endswith(".weight") and "ffn_gate_inp" not in t.name and cols % 256 == 0:
            ggml_type = matrix_type(t.name, wanted)
            values = dequantize(torch.from_numpy(np.asarray(t.data)).reshape(-1), t.ggml_type, t.shape)
            if ggml_type == T.Q8_0:
                ggml_type, data = encode(values, T.Q8_0, name=t.name)
            else:
                rows = math.prod(t.shape[:-1])
                data = random_blocks(ggml_type, rows, cols, rng, float(values.std()) / 24)
            out.append(TensorOut(t.name, ggml_type, t.shape, data))
        else:
            out.append(TensorOut(t.name, t.ggml_type, t.shape, t.data))
    dst = src.with_name(src.name.replace("-f32", f"-{wanted}"))
    write_gguf(dst, f.architecture, dict(f.metadata), out, dict(f.value_types))
    return dst


# --- a. parity ------------------------------------------------------------------------------------------------------
def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def lora_step(path: Path, device: torch.device, tokens: torch.Tensor, autocast: bool) -> tuple[torch.Tensor, list]:
    """Logits and LoRA gradients of one loss on ``device`` (bf16 autocast or f32)."""
    model = load_model_file(path, device=device, keep_quantized=True).model
    attach_lora(model, LoraConfig(rank=4), seed=1)
    with torch.no_grad():
        for _, p, _ in trainable_parameters(model):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    tokens = tokens.to(device)
    with policy.using(policy.current(device)), torch.autocast(device.type, torch.bfloat16, enabled=autocast):
        logits = model(tokens[:, :-1])
        loss = model_cross_entropy(model, model(tokens[:, :-1], hidden_only=True), tokens[:, 1:])
        loss.backward()
    return logits, [p.grad for _, p, _ in trainable_parameters(model)]


def parity(device: torch.device, work: Path, presets: list[str], report: Report) -> None:
    rng = np.random.default_rng(0)
    for name in presets:
        f32 = write_preset(f"{name}-wide", work, vocab_gguf=STORIES260K)
        for wanted in ("F32", "Q8_0", "Q4_K_M"):
            tokens = torch.randint(0, 512, (2, 49), generator=torch.Generator().manual_seed(1))
            with report.case(f"a {name} {wanted}"):
                path = f32 if wanted == "F32" else quantized_copy(f32, wanted, rng)
                for autocast, limit in ((False, F32_TOLERANCE), (True, BF16_TOLERANCE)):
                    cpu_logits, cpu_grads = lora_step(path, torch.device("cpu"), tokens, autocast)
                    logits, grads = lora_step(path, device, tokens, autocast)
                    err = max(relative_error(logits, cpu_logits),
                              max(relative_error(g, c) for g, c in zip(grads, cpu_grads, strict=True)))
                    report.check(f"a {name} {wanted} {'bf16' if autocast else 'f32'}", err <= limit,
                                 f"relative error {err:.2e} of logits and LoRA gradients (limit {limit:.0e})")


# --- b. a finetune and its resume -----------------------------------------------------------------------------------
def finetune(device: str, folder: Path, n: int, resume: bool = False, adam_iter: int = 30) -> list[float]:
    from ggtorch.training.config import FinetuneConfig
    from ggtorch.training.trainer import Trainer

    folder.mkdir(parents=True, exist_ok=True)
    text = folder / "train.txt"
    text.write_text(SHAKESPEARE.read_text(encoding="utf-8")[:20000], encoding="utf-8")
    config = FinetuneConfig(model_base=str(STORIES260K), train_data=str(text), ctx=64, batch=8, adam_iter=n,
                            seed=3, warmup=2, adam_alpha=0.01, device=device, dtype="f32",
                            checkpoint_in=str(folder / "checkpoint-LATEST.gguf") if resume else "",
                            overwrite=not resume,
                            checkpoint_out=str(folder / "checkpoint-ITERATION.gguf"),
                            lora_out=str(folder / "lora-ITERATION.gguf"), log_file=str(folder / "log.jsonl"))
    trainer = Trainer(config)
    try:
        return [r.loss for r in trainer.train()]
    finally:
        trainer.close()


def finetune_check(device: torch.device, work: Path, out: Path, n: int, report: Report) -> None:
    with report.case("b finetune"):
        cpu = finetune("cpu", work / "cpu", n)
        gpu = finetune(str(device), out / "finetune", n)
        err = max(abs(a - b) for a, b in zip(gpu, cpu, strict=True))
        report.check("b losses track the CPU", err <= LOSS_TOLERANCE,
                     f"max |loss difference| {err:.2e} over {n} steps (limit {LOSS_TOLERANCE:.0e}); "
                     f"first {gpu[0]:.4f}, last {gpu[-1]:.4f} (CPU {cpu[-1]:.4f})")
        half = work / "resumed"
        finetune(str(device), half, n // 2)
        finetune(str(device), half, n - n // 2, resume=True)
        same = (half / f"lora-{n}.gguf").read_bytes() == (out / "finetune" / f"lora-{n}.gguf").read_bytes()
        report.check("b resume is exact", same, f"{n // 2} + {n - n // 2} steps against {n}: adapters "
                     + ("equal byte for byte" if same else "differ"))


def verify(folder: Path) -> int:
    """On the CPU side, with llama-cpp-python: the device's adapter in llama.cpp against ggtorch's CPU logits."""
    from ggtorch.api import load_model
    from tests.llama_models import llama_cpp_logits, open_llama_cpp

    adapter = folder / "finetune" / "lora-LATEST.gguf"
    tokens = [1, *range(20, 60)]
    model = load_model(STORIES260K, device="cpu", dtype="f32").load_adapter(adapter)
    with torch.no_grad():
        ours = model.model(torch.tensor([tokens]))[0].numpy()
    theirs = llama_cpp_logits(open_llama_cpp(STORIES260K, 64, lora_path=str(adapter)), tokens)
    err = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    print(f"adapter {adapter}: llama.cpp vs ggtorch relative error {err:.2e}")
    return 0 if err <= F32_TOLERANCE else 1


# --- c. the benchmark -----------------------------------------------------------------------------------------------
LLAMA3_8B = dict(n_embd=4096, n_ff=14336, n_layer=32, n_head=32, n_head_kv=8, n_vocab=128256)
QWEN3_30B_A3B = dict(n_embd=2048, n_ff_exp=768, n_layer=4, n_head=32, n_head_kv=4, head_dim=128, n_vocab=151936,
                     n_expert=128, n_expert_used=8)
SMOKE = dict(n_embd=256, n_ff=512, n_layer=2, n_head=4, n_head_kv=2, n_vocab=512)
SMOKE_MOE = dict(n_embd=256, n_ff_exp=256, n_layer=2, n_head=4, n_head_kv=2, head_dim=64, n_vocab=512, n_expert=8,
                 n_expert_used=2)


def write_shaped(path: Path, arch: str, s: dict[str, int], rng: np.random.Generator) -> Path:
    """A GGUF of ``arch`` at shape ``s`` in Q4_K_M blocks, streamed tensor by tensor (an 8B file never sits in memory
    whole), with stories260K's tokenizer keys (the benchmark feeds token ids)."""
    voc = read_gguf(STORIES260K)
    meta = {k: v for k, v in voc.metadata.items() if k.startswith("tokenizer.")}
    types = {k: v for k, v in voc.value_types.items() if k in meta}
    tokens = list(meta["tokenizer.ggml.tokens"])
    pad = s["n_vocab"] - len(tokens)
    meta["tokenizer.ggml.tokens"] = tokens + [f"<unused{i}>" for i in range(pad)]
    meta["tokenizer.ggml.scores"] = list(meta["tokenizer.ggml.scores"]) + [0.0] * pad
    meta["tokenizer.ggml.token_type"] = list(meta["tokenizer.ggml.token_type"]) + [5] * pad
    hd = s.get("head_dim", s["n_embd"] // s["n_head"])
    meta |= {f"{arch}.{k}": v for k, v in dict(
        context_length=8192, embedding_length=s["n_embd"], block_count=s["n_layer"],
        feed_forward_length=s.get("n_ff", s.get("n_ff_exp")), rope_dimension_count=hd,
        **{"attention.head_count": s["n_head"], "attention.head_count_kv": s["n_head_kv"],
           "attention.layer_norm_rms_epsilon": 1e-5, "attention.key_length": hd, "attention.value_length": hd},
        rope_freq_base=500000.0).items()}
    if "n_expert" in s:
        meta |= {f"{arch}.expert_count": s["n_expert"], f"{arch}.expert_used_count": s["n_expert_used"],
                 f"{arch}.expert_feed_forward_length": s["n_ff_exp"]}
    e, kv = s["n_embd"], s["n_head_kv"] * hd
    specs: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (s["n_vocab"], e))]
    for i in range(s["n_layer"]):
        p = f"blk.{i}."
        specs += [(p + "attn_norm.weight", (e,)), (p + "attn_q.weight", (s["n_head"] * hd, e)),
                  (p + "attn_k.weight", (kv, e)), (p + "attn_v.weight", (kv, e)),
                  (p + "attn_output.weight", (e, s["n_head"] * hd)), (p + "ffn_norm.weight", (e,))]
        if arch == "qwen3moe":
            x, f = s["n_expert"], s["n_ff_exp"]
            specs += [(p + "attn_q_norm.weight", (hd,)), (p + "attn_k_norm.weight", (hd,)),
                      (p + "ffn_gate_inp.weight", (x, e)), (p + "ffn_gate_exps.weight", (x, f, e)),
                      (p + "ffn_up_exps.weight", (x, f, e)), (p + "ffn_down_exps.weight", (x, e, f))]
        else:
            specs += [(p + "ffn_gate.weight", (s["n_ff"], e)), (p + "ffn_up.weight", (s["n_ff"], e)),
                      (p + "ffn_down.weight", (e, s["n_ff"]))]
    specs += [("output_norm.weight", (e,)), ("output.weight", (s["n_vocab"], e))]

    def typed(name: str, shape: tuple[int, ...]) -> T:
        return T.F32 if len(shape) == 1 or "ffn_gate_inp" in name else matrix_type(name, "Q4_K_M")

    def data() -> Iterator[np.ndarray]:
        for name, shape in specs:
            if typed(name, shape) == T.F32:
                yield (np.ones(shape, np.float32) if len(shape) == 1 else
                       rng.standard_normal(shape, dtype=np.float32) * 0.02)
            else:
                yield random_blocks(typed(name, shape), math.prod(shape[:-1]), shape[-1], rng, 2e-4)

    write_gguf_streaming(path, arch, meta, [(n, typed(n, sh), sh) for n, sh in specs], data(), types)
    return path


def bf16_matrix_rate(device: torch.device, n: int) -> float:
    """FLOP/s of an n x n x n bf16 product on this device (the mean of ten after three warm-ups)."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(device)
    return 10 * 2 * n**3 / (time.perf_counter() - start)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device: torch.device) -> float:
    """GiB: the device allocator's peak since the last reset (the process's VmHWM on the CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    from ggtorch.training.memory import _proc_bytes

    return (_proc_bytes("/proc/self/status", "VmHWM") or 0) / 2**30


def timed_steps(step: Callable[[torch.Tensor], Any], device: torch.device, batch: int, ctx: int, n_vocab: int,
                steps: int) -> float:
    """Median seconds of ``steps`` steps after one untimed one, on random batches."""
    gen = torch.Generator().manual_seed(0)
    times = []
    for i in range(steps + 1):
        tokens = torch.randint(0, n_vocab, (batch, ctx + 1), generator=gen).to(device)
        sync(device)
        start = time.perf_counter()
        step(tokens)
        sync(device)
        if i:
            times.append(time.perf_counter() - start)
    return float(np.median(times))


def ggtorch_step(path: Path, device: torch.device, rank: int) -> tuple[torch.nn.Module, Callable]:
    from ggtorch.training.optim import AdamConfig, GGMLAdamW
    from ggtorch.training.run import enable_block_checkpointing

    model = load_model_file(path, device=device, keep_quantized=True, dtype=torch.bfloat16).model
    attach_lora(model, LoraConfig(rank=rank), seed=1)
    enable_block_checkpointing(model)
    optimizer = GGMLAdamW(trainable_parameters(model), AdamConfig())
    run_policy = policy.current(device)

    def step(tokens: torch.Tensor) -> None:
        with policy.using(run_policy), torch.autocast(device.type, torch.bfloat16):
            optimizer.zero_grad()
            loss = model_cross_entropy(model, model(tokens[:, :-1], hidden_only=True), tokens[:, 1:])
            loss.backward()
            optimizer.step()

    return model, step


def peft_step(path: Path, device: torch.device, rank: int, four_bit: bool) -> Callable:
    """transformers' LlamaForCausalLM on ``path``'s weights (decoded by ggtorch) in bf16, or quantized to 4 bits by
    bitsandbytes (QLoRA), + peft LoRA on every matrix; AdamW; gradient checkpointing."""
    import transformers
    from peft import LoraConfig as PeftConfig
    from peft import get_peft_model

    if four_bit:
        import bitsandbytes  # noqa: F401  (QLoRA's 4-bit layers; fails fast where its wheel was not carried)
    f = read_gguf(path)
    m = {k.split(".", 1)[1]: v for k, v in f.metadata.items() if k.startswith("llama.")}
    config = transformers.LlamaConfig(
        vocab_size=len(f.metadata["tokenizer.ggml.tokens"]), hidden_size=m["embedding_length"],
        intermediate_size=m["feed_forward_length"], num_hidden_layers=m["block_count"],
        num_attention_heads=m["attention.head_count"], num_key_value_heads=m["attention.head_count_kv"],
        rms_norm_eps=m["attention.layer_norm_rms_epsilon"], rope_theta=m["rope_freq_base"], tie_word_embeddings=False,
        attn_implementation="sdpa", torch_dtype=torch.bfloat16)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 where it trains: an 8B model never exists in f32
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    names = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
    per_layer = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
                 "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                 "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    state = {}
    for t in f.tensors.values():
        stem = t.name.removesuffix(".weight")
        if stem.startswith("blk."):
            _, i, kind = stem.split(".", 2)
            hf = f"model.layers.{i}.{per_layer[kind]}.weight"
        else:
            hf = names[stem] + ".weight"
        raw = torch.from_numpy(np.asarray(t.data)).to(device)
        state[hf] = dequantize(raw.reshape(-1).view(torch.uint8), t.ggml_type, t.shape, torch.bfloat16)
    model.load_state_dict(state)
    del state
    if four_bit:  # QLoRA as its users load it: a saved checkpoint, quantized to NF4 by bitsandbytes on load
        folder = path.with_suffix(".hf")
        model.save_pretrained(folder)
        del model
        free(device)
        model = transformers.LlamaForCausalLM.from_pretrained(
            folder, dtype=torch.bfloat16, device_map={"": device},
            quantization_config=transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                                bnb_4bit_compute_dtype=torch.bfloat16))
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    model = get_peft_model(model, PeftConfig(r=rank, lora_alpha=rank, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    def step(tokens: torch.Tensor) -> None:
        optimizer.zero_grad()
        model(input_ids=tokens[:, :-1], labels=tokens[:, 1:].contiguous(), use_cache=False).loss.backward()
        optimizer.step()

    return step


def train_flops_per_token(s: dict[str, int], ctx: int) -> float:
    """A LoRA step's useful FLOPs per token: forward and input gradient of every frozen product (4 x params; no
    weight gradients), and attention's two products in both (8 x n_layer x ctx x n_head x head_dim, causal halves
    it). Recomputation is not useful work: MFU does not count it."""
    hd = s.get("head_dim", s["n_embd"] // s["n_head"])
    e, q, kv = s["n_embd"], s["n_head"] * hd, s["n_head_kv"] * hd
    ffn = 3 * e * (s["n_expert_used"] * s["n_ff_exp"] if "n_expert" in s else s["n_ff"])
    params = s["n_layer"] * (e * q * 2 + e * kv * 2 + ffn) + s["n_vocab"] * e
    return 4 * params + 8 * s["n_layer"] * ctx * q / 2


def benchmark(device: torch.device, work: Path, smoke: bool, report: Report) -> None:
    rng = np.random.default_rng(1)
    rank, steps = 16, 3 if smoke else 5
    rate = bf16_matrix_rate(device, 512 if smoke else 8192)
    report.note(f"bf16 matrix rate: {rate / 1e12:.1f} TFLOP/s (the MFU denominator)")
    shape = SMOKE if smoke else LLAMA3_8B
    with report.case("c dense"):
        path = write_shaped(work / "llama3-8b-shape-Q4_K_M.gguf", "llama", shape, rng)
        shapes = [(1, 64)] if smoke else [(4, 2048), (8, 1024)]
        for batch, ctx in shapes:
            rows = {}
            for label, make in (("ggtorch Q4_K_M", lambda: ggtorch_step(path, device, rank)[1]),
                                ("peft bf16", lambda: peft_step(path, device, rank, four_bit=False)),
                                ("peft + bitsandbytes QLoRA", lambda: peft_step(path, device, rank, four_bit=True))):
                if "QLoRA" in label and importlib.util.find_spec("bitsandbytes") is None:
                    report.note(f"{label}: not run, bitsandbytes is not installed (carry its wheel)")
                    continue
                with report.case(f"c {label} b{batch}x{ctx}"):
                    free(device)
                    step = make()
                    seconds = timed_steps(step, device, batch, ctx, shape["n_vocab"], steps)
                    del step
                    tokens_s = batch * ctx / seconds
                    mfu = train_flops_per_token(shape, ctx) * tokens_s / rate
                    rows[label] = (tokens_s, peak_memory(device))
                    report.row("c", {"model": "Llama-3-8B shape", "side": label, "batch": f"b{batch}x{ctx}",
                                     "tok/s": round(tokens_s, 1), "peak GiB": round(rows[label][1], 2),
                                     "MFU": round(mfu, 3)})
            if "ggtorch Q4_K_M" in rows:
                for peer in ("peft bf16", "peft + bitsandbytes QLoRA"):
                    if peer in rows:
                        ours, theirs = rows["ggtorch Q4_K_M"], rows[peer]
                        report.note(f"b{batch}x{ctx} vs {peer}: {ours[0] / theirs[0]:.2f}x the tokens/s at "
                                    f"{ours[1] / theirs[1]:.0%} of its peak memory")
            if {"ggtorch Q4_K_M", "peft bf16"} <= rows.keys():
                break  # the first shape both sides fit is the benchmark (b4x2048 before b8x1024)
    with report.case("c moe"):
        moe = SMOKE_MOE if smoke else QWEN3_30B_A3B
        path = write_shaped(work / "qwen3-30b-a3b-shape-Q4_K_M.gguf", "qwen3moe", moe, rng)
        free(device)
        batch, ctx = (1, 64) if smoke else (4, 2048)
        seconds = timed_steps(ggtorch_step(path, device, rank)[1], device, batch, ctx, moe["n_vocab"], steps)
        report.row("c", {"model": f"Qwen3-30B-A3B shape, {moe['n_layer']} layers", "side": "ggtorch Q4_K_M",
                         "batch": f"b{batch}x{ctx}", "tok/s": round(batch * ctx / seconds, 1),
                         "peak GiB": round(peak_memory(device), 2),
                         "MFU": round(train_flops_per_token(moe, ctx) * batch * ctx / seconds / rate, 3)})


def free(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


# --- the report -----------------------------------------------------------------------------------------------------
class Report:
    """Checks, table rows and notes, written to ``report.md`` and ``report.json`` after every case (a run cut off
    by its time limit still leaves what it did)."""

    def __init__(self, out: Path, budget: float) -> None:
        self.out, self.deadline = out, time.monotonic() + budget
        self.checks: list[dict[str, Any]] = []
        self.rows: list[dict[str, Any]] = []
        self.notes: list[str] = []

    @contextlib.contextmanager
    def case(self, name: str) -> Iterator[None]:
        """One case: skipped past the deadline; an exception becomes a failed check, not the end of the run."""
        if time.monotonic() > self.deadline:
            self.notes.append(f"{name}: not run (time budget spent)")
            self.write()
            return
        start = time.monotonic()
        try:
            yield
        except Exception as e:  # noqa: BLE001 (the report says what failed; the next case runs)
            self.check(name, False, f"{type(e).__name__}: {e}".splitlines()[0][:300])
            traceback.print_exc()
        self.notes.append(f"{name}: {time.monotonic() - start:.1f} s")
        self.write()

    def check(self, name: str, ok: bool, detail: str) -> None:
        self.checks.append({"check": name, "ok": ok, "detail": detail})
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)

    def row(self, table: str, row: dict[str, Any]) -> None:
        self.rows.append({"table": table, **row})
        print(row, flush=True)

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(text, flush=True)

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "report.json").write_text(json.dumps(
            {"checks": self.checks, "rows": self.rows, "notes": self.notes}, indent=1))
        lines = [f"# gpu_check {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", "", *environment(), "",
                 f"{sum(c['ok'] for c in self.checks)} of {len(self.checks)} checks pass", ""]
        lines += [f"- {'PASS' if c['ok'] else 'FAIL'} {c['check']}: {c['detail']}" for c in self.checks]
        if self.rows:
            keys = list(self.rows[0])
            lines += ["", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in self.rows]
        lines += ["", *[f"- {n}" for n in self.notes]]
        (self.out / "report.md").write_text("\n".join(lines) + "\n")


def environment() -> list[str]:
    import transformers

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "CPU"
    return [f"device {device}; torch {torch.__version__} (CUDA {torch.version.cuda}); transformers "
            f"{transformers.__version__}; Python {platform.python_version()}"]


def cuda_tests(report: Report) -> None:
    with report.case("d pytest -m cuda"):
        done = subprocess.run([sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-n0", "-p", "no:cacheprovider",
                               "tests/test_cuda.py"], cwd=ROOT, capture_output=True, text=True, timeout=240)
        tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]
        report.check("d pytest -m cuda", done.returncode == 0, tail)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-check")))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--smoke", action="store_true", help="every part at toy sizes (a dry run on the CPU)")
    parser.add_argument("--budget", type=float, default=440.0, help="seconds for all parts")
    parser.add_argument("--parts", default="abcd")
    parser.add_argument("--verify", type=Path, help="check part b's adapter in llama.cpp (CPU side) and exit")
    args = parser.parse_args()
    if args.verify:
        return verify(args.verify)
    device = torch.device(args.device)
    report = Report(args.out, args.budget)
    presets = ["qwen3", "gemma4"] if args.smoke else list(FAMILY_PRESETS)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        # the finetune and the benchmark first: each preset of part a compiles its own attention kernels, and what
        # the budget leaves out is said in the report (--parts runs it another time)
        if "b" in args.parts:
            finetune_check(device, work, args.out, 6 if args.smoke else 30, report)
        if "c" in args.parts:
            benchmark(device, work, args.smoke, report)
        if "a" in args.parts:
            parity(device, work, presets, report)
        if "d" in args.parts:
            cuda_tests(report)
    report.write()
    print(f"report: {args.out / 'report.md'}")
    return 0 if all(c["ok"] for c in report.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
