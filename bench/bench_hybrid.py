"""A LoRA step of a 2026 family at the widths of its smallest release: ggtorch vs transformers + peft on the same
weights.

Not a test. ``--family qwen35`` builds a random transformers ``Qwen3_5ForCausalLM`` at Qwen3.5-0.8B's widths
(n_embd 1024, 8 heads of 256 over 2 KV heads, DeltaNet layers of 16 key and 16 value heads of 128, n_ff 3584, the
248,320-word vocabulary, tied) with fewer layers (``--layers``, 8: six DeltaNet, two attention). ``--family gemma4``
builds a ``Gemma4ForCausalLM`` at Gemma 4 E2B's widths (n_embd 1536, 8 heads over 1 KV head, sliding heads of 256
and global heads of 512, window 512, n_ff 6144 and twice that in the layers reading another's K/V, per-layer
embeddings of 256, Gemma 4's own 262,144-word vocabulary, tied) with fewer layers (``--layers``, 10: four sliding
layers and a global one, twice; the last five read the K/V of layers 3 and 4 as E2B's last 20 read 13's and 14's).
Each checkpoint is saved, converted with llama.cpp's converter (as users' files are made) and quantized to Q8_0 with
llama.cpp. Then LoRA steps (rank 8, on every matrix llama.cpp's graph adapts that PEFT can target: q/k/v/o,
gate/up/down, and qwen35's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a and out_proj or gemma4's per_layer_input_gate
and per_layer_projection) run in child processes, one configuration each; the median step time and the child's peak
RSS are printed:

- ggtorch on the F32 GGUF (the peer's weights exactly) and on the Q8_0 GGUF (kept quantized), each step the
  Trainer's with ``--no-checkpointing`` (``step_rounds.GGTORCH_STEPS``);
- transformers + peft on the checkpoint the GGUF was converted from, in f32 (qwen35's delta rule is transformers'
  torch chunked implementation; flash-linear-attention's kernels are for GPUs).

Both sides train on the same random batches with AdamW, no activation checkpointing. The configurations run in
alternating rounds (``--rounds``), each configuration's fastest round counting (the machine's speed drifts by
10-25% within minutes); every round is printed.

    python bench/bench_hybrid.py --batch 2 --ctx 256 --threads 2
    python bench/bench_hybrid.py --family gemma4 --batch 2 --ctx 256 --threads 2
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from step_rounds import GGTORCH_STEPS, PEER_STEPS, print_table, run_rounds  # noqa: E402  (this folder's sibling)

GGTORCH = r"""
from ggtorch.io.gguf import read_gguf
from ggtorch.lora import LoraConfig, attach_lora
from ggtorch.models.config import ModelConfig
from ggtorch.models.loader import build_model

f = read_gguf(spec["model"])
model = build_model(f, ModelConfig.from_gguf(f), keep_quantized=True)
attach_lora(model, LoraConfig(rank=8, ranks={"token_embd": 0, "output": 0}), seed=0)
""" + GGTORCH_STEPS

PEER = r"""
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(spec["hf"], dtype=torch.float32)
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=8, target_modules=spec["targets"]))
""" + PEER_STEPS

TARGETS = {"qwen35": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv",
                      "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"],
           "gemma4": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                      "per_layer_input_gate", "per_layer_projection"]}
"""The peer's LoRA targets: the modules of llama.cpp's adapted matrices (ggtorch adapts the same by default)."""
N_VOCAB = 248320
"""Qwen3.5's vocabulary size (its embedding's rows); the converter pads Qwen's 151,936 tokens to it."""
TOKENS = {"qwen35": 151936, "gemma4": 262144}
"""Token ids the random batches draw from."""
WIDTHS = {"qwen35": "Qwen3.5-0.8B's", "gemma4": "Gemma 4 E2B's"}


def build(folder: Path, family: str, n_layer: int) -> dict[str, Path]:
    """The checkpoint, its conversion by llama.cpp (F32) and that quantized to Q8_0 by llama.cpp."""
    from tests.converted import convert
    from tests.llama_cpp_files import converter_script
    from tests.llama_models import quantize_with_llama_cpp

    hf = folder / "hf"
    (_qwen35 if family == "qwen35" else _gemma4)(hf, n_layer)
    f32 = convert(converter_script(), hf, folder / f"{family}-F32.gguf")
    return {"hf": hf, "F32": f32, "Q8_0": quantize_with_llama_cpp(f32, folder / f"{family}-Q8_0.gguf", "Q8_0")}


def _gemma4(hf: Path, n_layer: int) -> None:
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    from tests.converted import write_gemma4_tokenizer
    from tests.llama_cpp_files import vocab_file

    types = (["sliding_attention"] * 4 + ["full_attention"]) * (n_layer // 5)
    n_kv = 5 * max(1, round(3 * n_layer / 35))  # E2B: 15 of 35 layers compute K/V, the last a sliding and a global
    config = Gemma4TextConfig(vocab_size=262144, hidden_size=1536, intermediate_size=6144, num_hidden_layers=n_layer,
                              num_attention_heads=8, num_key_value_heads=1, head_dim=256, global_head_dim=512,
                              sliding_window=512, layer_types=types, num_kv_shared_layers=n_layer - n_kv,
                              hidden_size_per_layer_input=256, vocab_size_per_layer_input=262144,
                              use_double_wide_mlp=True, final_logit_softcapping=30.0, max_position_embeddings=4096,
                              tie_word_embeddings=True, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    Gemma4ForCausalLM(config).save_pretrained(hf)
    write_gemma4_tokenizer(hf, vocab_file("gemma-4"))


def _qwen35(hf: Path, n_layer: int) -> None:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from tests.converted import write_qwen2_tokenizer
    from tests.llama_cpp_files import vocab_file

    config = Qwen3_5TextConfig(vocab_size=N_VOCAB, hidden_size=1024, intermediate_size=3584,
                               num_hidden_layers=n_layer, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                               linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                               linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=4096,
                               tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                                "mrope_interleaved": True})
    torch.manual_seed(0)
    Qwen3_5ForCausalLM(config).save_pretrained(hf)
    write_qwen2_tokenizer(hf, vocab_file("qwen2"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=list(TARGETS), default="qwen35")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (qwen35: 8, every fourth is "
                        "attention; gemma4: 10, every fifth is global, a multiple of 5)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process, after one untimed")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="processes per configuration, the configurations "
                        "alternating; each configuration's fastest counts")
    args = parser.parse_args()
    family = args.family
    layers = args.layers or {"qwen35": 8, "gemma4": 10}[family]
    if args.rounds < 1 or args.steps < 1 or layers < 4 or (family == "gemma4" and layers % 5):
        parser.error("--rounds and --steps must be at least 1, --layers at least 4 (gemma4: a multiple of 5)")
    configs = [("ggtorch, F32 GGUF", GGTORCH, "F32"), ("ggtorch, Q8_0 GGUF kept quantized", GGTORCH, "Q8_0"),
               ("transformers + peft (f32), the checkpoint", PEER, "hf")]
    sources = {label: source for label, _, source in configs}
    with tempfile.TemporaryDirectory(prefix="ggtorch-bench-hybrid-") as tmp:
        files = build(Path(tmp), family, layers)

        def spec_of(label: str) -> dict[str, object]:
            return {"model": str(files[sources[label]]), "hf": str(files["hf"]), "batch": args.batch,
                    "ctx": args.ctx, "steps": args.steps, "threads": args.threads, "n_vocab": TOKENS[family],
                    "targets": TARGETS[family]}

        rounds = run_rounds([(label, child) for label, child, _ in configs], spec_of, args.rounds)
    print(f"{family} at {WIDTHS[family]} widths, {layers} layers, LoRA rank 8 on every adapted matrix, batch "
          f"{args.batch} x ctx {args.ctx}, {args.threads} threads, median of {args.steps} steps per process, "
          f"fastest of {args.rounds} alternating rounds\n")
    results = print_table(rounds, args.batch * args.ctx)
    peer = results[configs[-1][0]]
    for label, _, _ in configs[:-1]:
        r = results[label]
        print(f"\n{label} vs transformers + peft: {peer['step_s'] / r['step_s']:.2f}x the speed, "
              f"{r['peak_rss_gib'] / peer['peak_rss_gib']:.0%} of the peak RSS")


if __name__ == "__main__":
    main()
