"""ggtorch DPO vs TRL's DPOTrainer + peft: one LoRA DPO step on the same model and the same pairs.

Not a test. The model is bench_vs_peft's random 110M llama (``--shape``), F32, written by gguf-py. The pairs are
windows of tinyshakespeare: a prompt of about ``--prompt-tokens`` tokens, its true continuation as the chosen answer
and another window as the rejected one (about ``--answer-tokens`` each), encoded once by ggtorch (prompt and answers
tokenized apart, EOS after each answer); the peer gets exactly those token ids through TRL's own collator.

- ggtorch: ``ggtorch.finetune(..., objective="dpo")``'s Trainer on the GGUF, one sequence per row (``--batching
  pad``, the context the longest sequence), the reference the base with the adapter off;
- peer: transformers loads the same GGUF (dequantized on load), TRL's DPOTrainer wraps it with peft (its reference:
  the adapter disabled), and the loop calls its ``compute_loss``, backward, gradient clipping and AdamW.

Both: LoRA rank 4 (alpha 4) on q/k/v/o/gate/up/down, beta 0.1, AdamW lr 1e-3, decay 0.1, clip 1.0, f32, no
gradient checkpointing, ``--pairs`` pairs per step, the same threads. Each side runs in its own process (peak RSS is
that process's VmHWM), the sides alternating ``--rounds`` times; tok/s is the tokens of the step's sequences
(both sides of every pair, padding not counted) over the median step time after one warm-up step, per run.

Run from the repository root: ``python bench/bench_dpo.py [--threads 2]``; it prints a Markdown section for
BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_vs_peft import LORA_RANK, LORA_TARGETS, SHAPES, cpu_line, machine, model_file, peak_rss_bytes  # noqa: E402

from tests.fixtures import SHAKESPEARE  # noqa: E402

BETA, LR, DECAY, GCLIP = 0.1, 1e-3, 0.1, 1.0


def make_pairs(tokenizer: Any, n: int, prompt_tokens: int, answer_tokens: int) -> list[dict[str, str]]:
    """Text records from token windows of the play: prompt, its continuation (chosen), another window (rejected)."""
    import numpy as np

    ids = tokenizer.encode(SHAKESPEARE.read_text(encoding="utf-8")[:400_000], add_special=False)
    rng = np.random.default_rng(0)
    records = []
    for _ in range(n):
        start = int(rng.integers(0, len(ids) - 4 * (prompt_tokens + answer_tokens)))
        other = int(rng.integers(0, len(ids) - answer_tokens))
        prompt = ids[start:start + prompt_tokens]
        chosen = ids[start + prompt_tokens:start + prompt_tokens + answer_tokens]
        rejected = ids[other:other + answer_tokens]
        records.append({"prompt": tokenizer.decode(prompt), "chosen": tokenizer.decode(chosen),
                        "rejected": tokenizer.decode(rejected)})
    return records


def encoded_pairs(model: Path, records: list[dict[str, str]]) -> list[dict[str, list[int]]]:
    """ggtorch's encoding of the records, as TRL's collator takes them (prompt ids, then each answer's)."""
    from ggtorch.data import RecordEncoder
    from ggtorch.data.preference import encode_pairs
    from ggtorch.data.records import Record
    from ggtorch.io.gguf import read_gguf
    from ggtorch.models.tokenizer import Tokenizer

    encoder = RecordEncoder(Tokenizer.from_gguf(read_gguf(model)))
    out = []
    for pair in encode_pairs([Record(r, f"pair {i}") for i, r in enumerate(records)], encoder):
        sides = []
        for enc in (pair.chosen, pair.rejected):
            start = int(enc.trained.argmax())
            sides.append((enc.tokens[:start].tolist(), enc.tokens[start:].tolist()))
        out.append({"prompt_ids": sides[0][0], "chosen_ids": sides[0][1], "rejected_ids": sides[1][1]})
    return out


def child_ggtorch(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from ggtorch import api

    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    trainer = api.finetune(model_base=spec["model"], records=spec["records"], objective="dpo", beta=BETA,
                           batch=spec["pairs"], ctx=spec["ctx"], batching="pad", seed=1, threads=spec["threads"],
                           lora_r=LORA_RANK, lora_alpha=LORA_RANK, rank_tok_embd=0, rank_out=0, lora_dropout=0.0,
                           adam_alpha=LR, adam_decay=DECAY, adam_gclip=GCLIP, warmup=0, use_checkpointing=False,
                           dtype="f32", checkpoint_out="", lora_out="", save_every=0, progress=False, run=False,
                           device="cpu", log_file=str(Path(spec["work"]) / f"ggtorch-{os.getpid()}.jsonl"))
    load = time.perf_counter() - t0
    steps = [trainer.step() for _ in range(spec["steps"] + 1)]
    out = {"load_s": load, "step_s": [r.seconds for r in steps], "loss": [r.loss for r in steps],
           "peak_rss": peak_rss_bytes()}
    trainer.close()
    return out


def child_trl(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
    from trl import DPOConfig, DPOTrainer
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    path = Path(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    # transformers dequantized the file into an f32 model but marks it "quantized with GGUF", which its Trainer
    # refuses to train: the mark goes, the weights are those it loaded
    model.hf_quantizer, model.is_quantized = None, False
    args = DPOConfig(output_dir=spec["work"], beta=BETA, loss_type=["sigmoid"],
                     per_device_train_batch_size=spec["pairs"], report_to="none", use_cpu=True, max_length=None,
                     gradient_checkpointing=False, seed=1)
    peft = LoraConfig(r=LORA_RANK, lora_alpha=LORA_RANK, lora_dropout=0.0, target_modules=LORA_TARGETS)
    dpo = DPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(spec["records"]),
                     processing_class=tokenizer, peft_config=peft)
    model = dpo.model
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=LR, weight_decay=DECAY)
    collate = DataCollatorForPreference(pad_token_id=tokenizer.eos_token_id or 0)
    load = time.perf_counter() - t0
    pairs, n = spec["encoded"], spec["pairs"]
    step_s, losses = [], []
    for step in range(spec["steps"] + 1):
        start = step * n % len(pairs)
        inputs = collate(pairs[start:start + n])
        t = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = dpo.compute_loss(model, inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, GCLIP)
        optimizer.step()
        step_s.append(time.perf_counter() - t)
        losses.append(float(loss))
    return {"load_s": load, "step_s": step_s, "loss": losses, "peak_rss": peak_rss_bytes()}


def run_child(side: str, spec: dict[str, Any], work: Path) -> dict[str, Any]:
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    result_path = work / f"result-{side}.json"
    done = subprocess.run([sys.executable, __file__, "--child", side, str(spec_path), str(result_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{side} failed:\n{done.stderr[-3000:]}")
    return json.loads(result_path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="110M", choices=["110M"])
    parser.add_argument("--pairs", type=int, default=2, help="pairs per step")
    parser.add_argument("--prompt-tokens", type=int, default=160)
    parser.add_argument("--answer-tokens", type=int, default=96)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run (after one warm-up step)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side, alternating")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--child", nargs=3, metavar=("SIDE", "SPEC", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        side, spec_path, result_path = args.child
        spec = json.loads(Path(spec_path).read_text())
        result = child_ggtorch(spec) if side == "ggtorch" else child_trl(spec)
        Path(result_path).write_text(json.dumps(result))
        return

    from ggtorch.io.gguf import read_gguf
    from ggtorch.models.tokenizer import Tokenizer

    info = machine()  # the load before the runs
    work = Path(tempfile.gettempdir()) / "ggtorch-bench"
    work.mkdir(exist_ok=True)
    model = model_file(work, SHAPES[args.shape], "F32")
    n_records = args.pairs * (args.steps + 1)
    records = make_pairs(Tokenizer.from_gguf(read_gguf(model)), n_records, args.prompt_tokens, args.answer_tokens)
    encoded = encoded_pairs(model, records)
    lengths = [len(p["prompt_ids"]) + len(p[side]) for p in encoded for side in ("chosen_ids", "rejected_ids")]
    ctx = max(lengths) - 1
    tokens_per_step = sum(lengths) / len(encoded) * args.pairs
    spec = {"model": str(model), "records": records, "encoded": encoded, "pairs": args.pairs, "ctx": ctx,
            "steps": args.steps, "threads": args.threads, "work": str(work)}
    runs: dict[str, list[dict[str, Any]]] = {"ggtorch": [], "TRL + peft": []}
    for _ in range(args.rounds):
        for side, kind in (("ggtorch", "ggtorch"), ("TRL + peft", "trl")):
            result = run_child(kind, spec, work)
            result["tok_s"] = tokens_per_step / statistics.median(result["step_s"][1:])
            runs[side].append(result)
            print(f"{side}: {result['tok_s']:.0f} tok/s, peak RSS {result['peak_rss'] / 2**30:.2f} GiB, "
                  f"losses {[round(x, 4) for x in result['loss']]}", flush=True)
    print(report(args, info, runs, ctx, tokens_per_step))


def report(args: argparse.Namespace, info: dict[str, Any], runs: dict[str, list[dict[str, Any]]], ctx: int,
           tokens: float) -> str:
    import trl

    def spread(values: list[float], fmt: str) -> str:
        return fmt.format(statistics.median(values)) + (f" ({fmt.format(min(values))}-{fmt.format(max(values))})"
                                                        if len(values) > 1 else "")

    ours, theirs = ([r["tok_s"] for r in runs[side]] for side in ("ggtorch", "TRL + peft"))
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
    lines = [f"## DPO step vs TRL + peft (`python bench/bench_dpo.py --threads {args.threads}`)", "",
             f"{time.strftime('%Y-%m-%d')}, {cpu_line(info)}, {args.threads} threads, load {info['load']:.2f} "
             f"before; torch {info['torch']}, transformers {info['transformers']}, peft {info['peft']}, "
             f"TRL {trl.__version__}. {args.shape} F32 f32, {args.pairs} pairs per step (~{tokens:.0f} tokens of "
             f"sequences, ggtorch's rows {ctx} wide), {args.rounds} alternating runs per side, median over "
             f"{args.steps} timed steps each; figures: median (min-max) over the runs.", "",
             "| side | tok/s | peak RSS GiB | load s |", "|---|---|---|---|"]
    for side, values in runs.items():
        lines.append(f"| {side} | {spread([r['tok_s'] for r in values], '{:.0f}')} | "
                     f"{spread([r['peak_rss'] / 2**30 for r in values], '{:.2f}')} | "
                     f"{spread([r['load_s'] for r in values], '{:.1f}')} |")
    lines += ["", f"ggtorch / TRL tokens/s per round: {', '.join(f'{r:.2f}x' for r in ratios)}."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
