"""A mixture-of-experts LoRA step: routed-only experts vs every expert computed, and vs transformers + peft.

Not a test. Builds a random-weight qwen3moe GGUF (16 experts, top 2; n_embd 512, 8 layers, experts 1024
wide, llama's 32,000-token vocabulary: as in Qwen3-30B-A3B, the routed experts are most of a token's
work), quantizes it to Q4_K_M with llama.cpp, then times LoRA steps
in child processes, one configuration each, and prints the median step time and the child's peak RSS:

- ggtorch, quantized base kept quantized, block checkpointing, LoRA on attention and on every expert,
  with only routed experts computed (what ggtorch runs) and with every expert run on every token
  (each MoE layer's ``_routed`` replaced here: the same numbers, E/k times the expert work);
- ggtorch (quantized base, and ``--base-dtype f32``: dequantized on load) and the peer with LoRA on
  attention only (q, k, v, o: what peft can target on transformers' fused experts), the peer being
  transformers (which dequantizes the GGUF to f32 on load) + peft with gradient checkpointing, on the
  same file and the same random batches.

The configurations run in alternating rounds (``--rounds``, 2), each round one process per configuration:
a configuration's figure is its fastest round, and every round is printed below the table. The machine's
speed drifts by 10-25% within minutes, which a single short run per configuration would put into the ratios
(bench_vs_peft.py and bench_full_finetune.py do the same).

    python bench/bench_moe.py --batch 2 --ctx 256 --threads 2
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
import types
from ggtorch.io.gguf import read_gguf
from ggtorch.lora import LoraConfig, attach_lora
from ggtorch.models.config import ModelConfig
from ggtorch.models.loader import build_model
from ggtorch.models.model import MoE
from ggtorch.training.run import enable_block_checkpointing

f = read_gguf(spec["model"])
model = build_model(f, ModelConfig.from_gguf(f), keep_quantized=spec["base"] == "quantized")
no_experts = {k: 0 for k in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "token_embd", "output")}
attach_lora(model, LoraConfig(rank=8, ranks=no_experts if spec["lora"] == "attention"
                              else {"token_embd": 0, "output": 0}), seed=0)
def every_expert(moe, x, experts):  # (N, k, C): every expert on every token, the routed ones kept
    N = x.shape[0]
    y = moe._ffn(x.repeat(moe.n_expert, 1), [N] * moe.n_expert).reshape(moe.n_expert, N, -1)
    return y[experts, torch.arange(N).unsqueeze(-1)]

for m in model.modules():
    if isinstance(m, MoE) and spec["experts"] == "dense":
        m._routed = types.MethodType(every_expert, m)
enable_block_checkpointing(model)
""" + GGTORCH_STEPS

PEER = r"""
from pathlib import Path
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

path = Path(spec["model"])
model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                             head_dim=spec["head_dim"], moe_intermediate_size=spec["n_ff_exp"],
                                             norm_topk_prob=True)
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
""" + PEER_STEPS

CONFIGS = [  # (label, child, experts, lora, base)
    ("ggtorch, LoRA on attention + experts, routed experts only", GGTORCH, "routed", "all", "quantized"),
    ("ggtorch, LoRA on attention + experts, every expert computed", GGTORCH, "dense", "all", "quantized"),
    ("ggtorch, LoRA on attention", GGTORCH, "routed", "attention", "quantized"),
    ("ggtorch --base-dtype f32, LoRA on attention", GGTORCH, "routed", "attention", "f32"),
    ("transformers + peft (f32), LoRA on attention", PEER, "routed", "attention", "f32"),
]


def build(folder: Path, ftype: str) -> tuple[Path, dict[str, int]]:
    from tests.families import Shape, vocabulary_file, write_random_model
    from tests.llama_models import quantize_with_llama_cpp

    shape = Shape(n_embd=512, n_ff=2048, n_layer=8, n_head=8, n_head_kv=4, head_dim=64, n_ctx=4096,
                  rope_freq_base=1e6, n_expert=16, n_expert_used=2, n_ff_exp=1024)
    vocab = vocabulary_file("llama-spm")
    f32 = write_random_model(folder / "qwen3moe-f32.gguf", "qwen3moe", vocab, shape)
    path = quantize_with_llama_cpp(f32, folder / f"qwen3moe-{ftype}.gguf", ftype)
    return path, {"n_vocab": 32000, "head_dim": 64, "n_ff_exp": 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ftype", default="Q4_K_M")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per process, after one untimed")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="processes per configuration, the configurations "
                        "alternating; each configuration's fastest counts")
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    children = {label: (child, experts, lora, base) for label, child, experts, lora, base in CONFIGS}
    with tempfile.TemporaryDirectory(prefix="ggtorch-bench-moe-") as tmp:
        path, dims = build(Path(tmp), args.ftype)
        size = path.stat().st_size / 2**20

        def spec_of(label: str) -> dict[str, object]:
            _, experts, lora, base = children[label]
            return {"model": str(path), "batch": args.batch, "ctx": args.ctx, "steps": args.steps,
                    "threads": args.threads, "experts": experts, "lora": lora, "base": base, **dims}

        rounds = run_rounds([(label, c[0]) for label, c in children.items()], spec_of, args.rounds)
    tokens = args.batch * args.ctx
    print(f"qwen3moe, 16 experts top 2, {args.ftype} ({size:.0f} MiB file), batch {args.batch} x ctx {args.ctx}, "
          f"{args.threads} threads, median of {args.steps} steps per process, fastest of {args.rounds} "
          "alternating rounds\n")
    results = print_table(rounds, tokens)
    (routed, dense, ours, ours_f32, peer) = (results[c[0]] for c in CONFIGS)
    print(f"\nrouted-only vs every expert: {dense['step_s'] / routed['step_s']:.2f}x the speed, "
          f"{routed['peak_rss_gib'] / dense['peak_rss_gib']:.0%} of the peak RSS")
    for label, r in (("quantized base", ours), ("f32 base", ours_f32)):
        print(f"ggtorch ({label}) vs transformers + peft, attention LoRA: {peer['step_s'] / r['step_s']:.2f}x the "
              f"speed, {r['peak_rss_gib'] / peer['peak_rss_gib']:.0%} of the peak RSS")


if __name__ == "__main__":
    main()
