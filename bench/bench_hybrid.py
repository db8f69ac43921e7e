"""A Qwen3.5 LoRA step at the widths of its smallest release: ggtorch vs transformers + peft on the same weights.

Not a test. Builds a random transformers ``Qwen3_5ForCausalLM`` at Qwen3.5-0.8B's widths (n_embd 1024, 8 heads of
256 over 2 KV heads, DeltaNet layers of 16 key and 16 value heads of 128, n_ff 3584, the 248,320-word vocabulary,
tied) with fewer layers (``--layers``, 8: six DeltaNet, two attention), saves it, converts it with llama.cpp's
converter (as users' files are made) and quantizes that to Q8_0 with llama.cpp. Then it times LoRA steps (rank 8,
on every matrix llama.cpp's graph adapts: q/k/v/o, gate/up/down and the DeltaNet's in_proj_qkv, in_proj_z,
in_proj_b, in_proj_a and out_proj) in child processes, one configuration each, and prints the median step time and
the child's peak RSS:

- ggtorch on the F32 GGUF (the peer's weights exactly) and on the Q8_0 GGUF (kept quantized);
- transformers + peft on the checkpoint the GGUF was converted from, in f32 (its delta rule is transformers' torch
  chunked implementation; flash-linear-attention's kernels are for GPUs).

Both sides train on the same random batches with AdamW, no activation checkpointing. The configurations run in
alternating rounds (``--rounds``), each configuration's fastest round counting (the machine's speed drifts by
10-25% within minutes); every round is printed.

    python bench/bench_hybrid.py --batch 2 --ctx 256 --threads 2
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
from ggtorch.models.loader import build_llama

f = read_gguf(spec["model"])
model = build_llama(f, ModelConfig.from_gguf(f), keep_quantized=True)
attach_lora(model, LoraConfig(rank=8, ranks={"token_embd": 0, "output": 0}), seed=0)
""" + GGTORCH_STEPS

PEER = r"""
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(spec["hf"], dtype=torch.float32)
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv", "in_proj_z",
           "in_proj_b", "in_proj_a", "out_proj"]
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=8, target_modules=targets))
""" + PEER_STEPS

N_VOCAB = 248320
"""Qwen3.5's vocabulary size (its embedding's rows); the converter pads Qwen's 151,936 tokens to it."""


def build(folder: Path, n_layer: int) -> dict[str, Path]:
    """The checkpoint, its conversion by llama.cpp (F32) and that quantized to Q8_0 by llama.cpp."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from tests.converted import convert, write_qwen2_tokenizer
    from tests.llama_cpp_files import converter_script, vocab_file
    from tests.llama_models import quantize_with_llama_cpp

    config = Qwen3_5TextConfig(vocab_size=N_VOCAB, hidden_size=1024, intermediate_size=3584,
                               num_hidden_layers=n_layer, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                               linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
                               linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=4096,
                               tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151643,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e7,
                                                "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                                "mrope_interleaved": True})
    torch.manual_seed(0)
    hf = folder / "hf"
    Qwen3_5ForCausalLM(config).save_pretrained(hf)
    write_qwen2_tokenizer(hf, vocab_file("qwen2"))
    f32 = convert(converter_script(), hf, folder / "qwen35-F32.gguf")
    return {"hf": hf, "F32": f32, "Q8_0": quantize_with_llama_cpp(f32, folder / "qwen35-Q8_0.gguf", "Q8_0")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (every fourth is attention)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per process, after one untimed")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="processes per configuration, the configurations "
                        "alternating; each configuration's fastest counts")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1 or args.layers < 4:
        parser.error("--rounds and --steps must be at least 1, --layers at least 4")
    configs = [("ggtorch, F32 GGUF", GGTORCH, "F32"), ("ggtorch, Q8_0 GGUF kept quantized", GGTORCH, "Q8_0"),
               ("transformers + peft (f32), the checkpoint", PEER, "hf")]
    sources = {label: source for label, _, source in configs}
    with tempfile.TemporaryDirectory(prefix="ggtorch-bench-hybrid-") as tmp:
        files = build(Path(tmp), args.layers)

        def spec_of(label: str) -> dict[str, object]:
            return {"model": str(files[sources[label]]), "hf": str(files["hf"]), "batch": args.batch,
                    "ctx": args.ctx, "steps": args.steps, "threads": args.threads, "n_vocab": 151936}

        rounds = run_rounds([(label, child) for label, child, _ in configs], spec_of, args.rounds)
    print(f"qwen35 at Qwen3.5-0.8B's widths, {args.layers} layers, LoRA rank 8 on every adapted matrix, batch "
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
