"""Bad inputs across every command: each row a command line and the message it must print.

No row may end in a Python traceback: a refusal is one ``error: ...`` line (ggtorch's own
errors) or click's usage error, and a non-zero exit status.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ggtorch.cli.main import main
from ggtorch.io.gguf import read_gguf, write_gguf
from tests.helpers import run_cli
from tests.llama_models import rewrite_gguf

# {S}: stories260K; other {names}: files made by the `inputs` fixture.
ROWS: list[tuple[str, str]] = [
    # info
    ("info {missing}.gguf", "no such file"),
    ("info {text}", "not a GGUF file"),
    ("info {truncated}", "runs past the end of the file"),
    ("info", "Missing argument 'MODEL.gguf'"),
    # generate
    ("chat -m {missing}.gguf --prompt hi", "no such file"),
    ("chat -m {S} --prompt hi", "has no chat template (tokenizer.chat_template); pass one with --chat-template FILE"),
    ("chat -m {S} --chat-template {missing}.jinja --prompt hi", "no such file"),
    ("chat -m {S} --chat-template {bad_template} --prompt hi", "failed to render"),
    ("chat -m {S} --chat-template {user_assistant} -n 0 --prompt hi", "-n: n_tokens 0 must be >= 1"),
    ("chat -m {S} --chat-template {user_assistant} --lora {missing}.gguf --prompt hi", "no such file"),
    ("chat -m {S} --chat-template {user_assistant} --lora-scaled {adapter} 1e9 --prompt hi", "the scale must be in"),
    ("perplexity -m {S} -f {text} --lora {empty_dir}", "adapter_config.json"),
    ("generate -m {missing}.gguf", "no such file"),
    ("generate -m {text}", "not a GGUF file"),
    ("generate -m {S} -n 0", "-n: n_tokens 0 must be >= 1"),
    ("generate -m {S} --temp nan", "--temp: temperature nan must be >= 0 and finite"),
    ("generate -m {S} --temp inf", "--temp: temperature inf must be >= 0 and finite"),
    ("generate -m {S} -t 100000", "--threads must be at least 1 and at most"),
    ("generate -m {S} --device nonsense", "--device: 'nonsense' is not a device name"),
    ("generate -m {S} --device cuda:3", "has no CUDA; use --device cpu"),
    ("generate -m {S} --dtype f64", "Invalid value for '--dtype'"),
    ("generate -m {S} --temp -1", "temperature -1.0 must be >= 0"),
    ("generate -m {S} --temp 1 --top-p 2", "top-p 2.0 must be in (0, 1]"),
    ("generate -m {S} --temp 1 --top-k -3", "top-k -3 must be >= 0"),
    ("generate -m {S} -n 600 --ignore-eos", "exceed the model's context of 512"),
    # perplexity
    ("perplexity -m {S} -f {missing}.txt", "-f {missing}.txt: no such file"),
    ("perplexity -m {S} -f {tmp}", "is a folder; -f takes a file"),
    ("perplexity -m {S} -f {latin1}", "not UTF-8 text"),
    ("perplexity -m {S} -f {text} -c 2", "Invalid value for '-c'"),
    ("perplexity -m {S} -f {text} -c 64", "perplexity with a context of 64 needs at least 128"),
    ("perplexity -m {S} -f {text} -c 4096", "context 4096 exceeds the model's training context 512"),
    ("perplexity -m {S} -f {text} -b 0", "Invalid value for '-b'"),
    # finetune: files
    ("finetune --model-base {missing}.gguf --train-data {text}", "no such file"),
    ("finetune --model-base {truncated} --train-data {text}", "corrupt GGUF file"),
    ("finetune --model-base {S} --train-data {missing}.txt", "--train-data"),
    ("finetune --model-base {S} --train-data {latin1}", "is not valid UTF-8: byte 2 (0xff)"),
    ("finetune --model-base {S} --train-data {empty}", "the file is empty"),
    ("finetune --model-base {S} --train-data {text} --val-data {missing}.txt", "--val-data"),
    ("finetune --model-base {S} --train-data {text} --checkpoint-in {S}",
     "--checkpoint-in {S} is a model, not a training checkpoint: pass it where a model goes"),
    ("finetune --model-base {S} --train-data {text} --checkpoint-out {missing}/c.gguf", "does not exist"),
    ("finetune --model-base {S} --train-data {text} --lora-out {text}/a.gguf", "{text} is a file, not a folder"),
    ("finetune --model-base {S} --train-data {text} --config {missing}.yaml", "--config"),
    ("finetune --model-base {S} --train-data {text} --config {text}", "expected a mapping"),
    # finetune/train: tensors (checked before the memory estimate reads them)
    ("finetune --model-base {extra_tensor} --train-data {text}", "tensor 'blk.0.bogus.weight' is not part of a llama"),
    ("finetune --model-base {no_embd} --train-data {text}", "required tensor 'token_embd.weight' is missing"),
    ("train --model-base {no_embd} --train-data {text}", "required tensor 'token_embd.weight' is missing"),
    # finetune: memory (the estimate before loading, against MemAvailable)
    ("finetune --model-base {S} --train-data {text} -b 1000000",
     "and the memory available (MemAvailable) is"),
    ("finetune --model-base {S} --train-data {text} -b 1000000 -c 64",
     "lower it with a smaller --batch or --ctx, or pass --force"),
    ("finetune --model-base {S} --train-data {text} -b 1000000 --no-checkpointing --base-dtype f32",
     "--use-checkpointing, --base-dtype quantized, or pass --force"),
    ("train --vocab-model {S} --train-data {text} -b 1000000",
     "lower it with a smaller --batch or --ctx, or pass --force"),
    # finetune: values
    ("finetune --model-base {S} --train-data {text} --lora-r 0", "--lora-r must be at least 1"),
    ("finetune --model-base {S} --train-data {text} --rank-wq -1", "--rank-wq must be at least 0 and at most 4096"),
    ("finetune --model-base {S} --train-data {text} --lora-r 100000",
     "--lora-r must be at least 1 and at most 4096, got 100000"),
    ("finetune --model-base {S} --train-data {text} -t 100000", "--threads must be at least 1 and at most"),
    ("finetune --model-base {S} --train-data {text} --beta 1e30", "--beta must be in (0, 100], got 1e+30"),
    ("finetune --model-base {S} --train-data {text} --objective orpo --beta 0.5",
     "--beta applies to --objective dpo or ipo, not orpo (TRL's ORPOConfig.beta is --orpo-lambda here)"),
    ("finetune --model-base {S} --train-data {text} --rank-qkv 8",
     "--rank-qkv 8 sets the LoRA rank of attn_qkv, which this llama model does not have"),
    ("finetune --model-base {S} --train-data {text} --lora-alpha -1", "--lora-alpha must be a positive"),
    ("finetune --model-base {S} --train-data {text} --lora-dropout 1.5", "--lora-dropout must be in [0, 1)"),
    ("finetune --model-base {S} --train-data {text} -n -1", "--adam-iter must be at least 1"),
    ("finetune --model-base {S} --train-data {text} -n abc", "'abc' is not a valid integer"),
    ("finetune --model-base {S} --train-data {text} -c 0", "--ctx must be at least 1"),
    ("finetune --model-base {S} --train-data {text} -b 0", "--batch must be at least 1"),
    ("finetune --model-base {S} --train-data {text} -t 0", "--threads must be at least 1"),
    ("finetune --model-base {S} --train-data {text} --adam-alpha -1", "--adam-alpha must be positive"),
    ("finetune --model-base {S} --train-data {text} --adam-beta1 1.5", "--adam-beta1 must be in [0, 1)"),
    ("finetune --model-base {S} --train-data {text} --adam-beta2 1", "--adam-beta2 must be in [0, 1)"),
    ("finetune --model-base {S} --train-data {text} --adam-decay -1", "--adam-decay must be >= 0"),
    ("finetune --model-base {S} --train-data {text} --adam-gclip -1", "--adam-gclip must be >= 0"),
    ("finetune --model-base {S} --train-data {text} --adam-min-alpha -1", "--adam-min-alpha must be between"),
    ("finetune --model-base {S} --train-data {text} --warmup -1", "--warmup must be >= 0"),
    ("finetune --model-base {S} --train-data {text} --cos-decay-steps 0", "--cos-decay-steps must be at least 1"),
    ("finetune --model-base {S} --train-data {text} --cos-decay-min 2", "--cos-decay-min must be in [0, 1]"),
    ("finetune --model-base {S} --train-data {text} --cos-decay-restart -1", "--cos-decay-restart must be >= 1"),
    ("finetune --model-base {S} --train-data {text} --val-split 2", "--val-split must be in [0, 1)"),
    ("finetune --model-base {S} --train-data {text} --norm-rms-eps -1",
     "--norm-rms-eps must be above 0, got -1.0; leave it out to use the model's value"),
    ("finetune --model-base {S} --train-data {text} --device nonsense", "--device: 'nonsense' is not a device"),
    ("finetune --model-base {S} --train-data {text} --nonsense-flag", "No such option '--nonsense-flag'"),
    ("finetune --model-base {S} --train-data {text} --on-nan maybe", "Invalid value for '--on-nan'"),
    ("finetune --model-base {S} --train-data {text} --rank-ffn-norm 1", "--rank-ffn-norm train norm adapters"),
    ("finetune --model-base {S} --train-data {latin1} --utf8-errors ignore", "Invalid value for '--utf8-errors'"),
    # finetune: instruction and chat records
    ("finetune --model-base {S} --train-data {bad_json}", "bad.jsonl line 2: not valid JSON"),
    ("finetune --model-base {S} --train-data {no_response}", "noresp.jsonl line 1: missing field 'response'"),
    ("finetune --model-base {S} --train-data {empty_response}", "emptyresp.jsonl line 1: empty response"),
    ("finetune --model-base {S} --train-data {chat}", "has no tokenizer.chat_template; pass one with --chat-template"),
    ("finetune --model-base {S} --train-data {chat} --chat-template {bad_template}", "failed to render (no roles"),
    ("finetune --model-base {S} --train-data {chat} --chat-template {missing}.jinja", "--chat-template"),
    ("finetune --model-base {S} --train-data {text} --val-data {chat}", "holds records but --train-data is plain"),
    ("finetune --model-base {S} --train-data {empty_dir}", "holds no .jsonl or .parquet files"),
    ("finetune --model-base {S} --train-data {chat} --batching zip", "Invalid value for '--batching'"),
    # finetune: samples and answer metrics
    ("finetune --model-base {S} --train-data {text} --sample-prompt Once --sample-every -1",
     "--sample-every must be at least 0, got -1"),
    ("finetune --model-base {S} --train-data {text} --sample-every 2",
     "--sample-every applies to the samples of --sample-prompt, and none is given"),
    ("finetune --model-base {S} --train-data {text} --sample-prompt " + "x" * 3000,
     "exceeds the model's context of 512; shorten it or lower --sample-tokens"),
    ("finetune --model-base {S} --train-data {text} --sample-prompt Once --sample-tokens 511",
     "with --sample-tokens 511 new ones it exceeds the model's context of 512"),
    ("finetune --model-base {S} --train-data {text} --eval-generate -1", "--eval-generate must be at least 0"),
    # demo
    ("demo --base-iterations 0", "Invalid value for '--base-iterations'"),
    ("demo --lora-iterations x", "'x' is not a valid integer"),
    ("demo -t 0", "--threads must be at least 1"),
    ("demo -o {text}", "cannot create the output folder"),
    # plot
    ("plot {missing}.jsonl", "LOG.jsonl {missing}.jsonl: no such file"),
    ("plot {empty}", "the log holds no iterations yet"),
    ("plot {latin1}", "not UTF-8 text"),
    ("plot {log_text}", "not a JSON line"),
    ("plot {log_list}", "not a log record"),
    ("plot {log_nokeys}", "lacks a numeric iteration and loss"),
    ("plot {log_ok} -o {missing}/x.png", "the folder {missing} does not exist"),
    ("plot {log_ok} -o {tmp}/x.xyz", "cannot write the plot"),
    ("plot {log_ok} -o {log_ok}", "-o {log_ok} would write over LOG.jsonl {log_ok}"),
    # PEFT conversion
    ("convert-lora {missing} -m {S} -o {tmp}/x.gguf", "no such folder"),
    ("convert-lora {empty_dir} -m {S} -o {tmp}/x.gguf", "no adapter_config.json"),
    ("export-peft {missing}.gguf -m {S} -o {tmp}/peft", "no such file"),
    ("export-peft {S} -m {S} -o {tmp}/peft", "{S} is a model, not a LoRA adapter"),
    ("export-peft {adapter} -m {S} -o {adapter}", "--outdir {adapter} is a file; --outdir takes a folder"),
    ("export-peft {adapter} -m {S} -o {tmp}/" + "p" * 300, "this filesystem takes at most 255"),
    # train
    ("train --vocab-model {missing}.gguf --train-data {text}", "no such file"),
    ("train --vocab-model {S} --model-base {S} --train-data {text}", "pass exactly one of --vocab-model"),
    ("train --vocab-model {S} --train-data {text} --embd 0", "--embd must be at least 1"),
    ("train --model-base {S} --train-data {missing}.txt", "missing.txt"),
    # export-lora (merge)
    ("export-lora -m {S} --lora {missing}.gguf -o {tmp}/m.gguf", "--lora {missing}.gguf: no such file"),
    ("export-lora -m {S} --lora {S} -o {tmp}/m.gguf", "--lora {S} is a model, not a LoRA adapter or training"),
    ("export-lora -m {S} --lora-scaled {adapter}:abc -o {tmp}/m.gguf", "expected FILE:SCALE or FILE SCALE"),
    # old llama.cpp adapters
    ("convert-old-lora {missing}.bin -o {tmp}/o.gguf", "no such file"),
    ("convert-old-lora {S} -o {tmp}/o.gguf", "not an old llama.cpp finetune checkpoint"),
    ("convert-old-lora {text} -o {tmp}/o.gguf", "not a GGUF file"),
    # no output may be an input (compared as the files they name: links, '..', name templates), nor two outputs one
    ("finetune --model-base {model} --train-data {text} --lora-out {model}",
     "--lora-out {model} would write over --model-base {model}"),
    ("finetune --model-base {model} --train-data {text} --lora-out {model_link} --checkpoint-out ''",
     "would write over --model-base {model}"),
    ("finetune --model-base {model} --train-data {text} --lora-out {tmp}/sub/../model.gguf",
     "would write over --model-base {model}"),
    ("finetune --model-base {latest_model} --train-data {text} --checkpoint-out {tmp}/base-ITERATION.gguf",
     "--checkpoint-out {tmp}/base-ITERATION.gguf would write over --model-base {latest_model}"),
    ("finetune --model-base {S} --train-data {text} --checkpoint-out {tmp}/x.gguf --lora-out {tmp}/x.gguf",
     "--checkpoint-out {tmp}/x.gguf and --lora-out {tmp}/x.gguf would write the same file"),
    ("finetune --model-base {S} --train-data {text} --lora-out {tmp}/a-ITERATION.gguf --log-file {tmp}/a-LATEST.gguf",
     "would write the same file"),
    ("finetune --model-base {S} --train-data {text} --log-file {text}",
     "--log-file {text} would write over --train-data"),
    ("train --model-base {model} --train-data {text} --model-out {model}",
     "--model-out {model} would write over --model-base {model}"),
    ("export-lora -m {model} --lora {adapter} -o {model}", "-o {model} would write over -m {model}"),
    ("export-lora -m {S} --lora {adapter} -o {adapter}", "-o {adapter} would write over --lora {adapter}"),
    ("convert-old-lora {text} -o {text}", "-o {text} would write over OLD {text}"),
    ("convert-lora {empty_dir} -m {S} -o {S}", "--outfile {S} would write over --base {S}"),
    # a resumable run is never replaced by accident
    ("finetune --model-base {S} --train-data {text} --checkpoint-in {checkpoint} --lora-out {checkpoint}",
     "--lora-out {checkpoint} would write over --checkpoint-in {checkpoint}"),
    ("finetune --model-base {S} --train-data {text} --checkpoint-in {missing}.gguf",
     "--checkpoint-in {missing}.gguf: no such file; pass --checkpoint-in '' (or leave it out) to start a new run"),
    ("finetune --model-base {S} --train-data {text} --checkpoint-out {run}/checkpoint-ITERATION.gguf",
     "{run}/checkpoint-LATEST.gguf is there from another run (a checkpoint at iteration 1)"),
    ("finetune --model-base {S} --train-data {text} --checkpoint-out {run}/checkpoint-ITERATION.gguf",
     "resume it with --checkpoint-in {run}/checkpoint-LATEST.gguf, or pass --overwrite"),
    ("finetune --model-base {S} --train-data {text} --checkpoint-out '' --lora-out {run}/ggml-lora-ITERATION-f32.gguf",
     "{run}/ggml-lora-LATEST-f32.gguf is there from another run"),
    # numbers checked as they will be used
    ("finetune --model-base {S} --train-data {text} --adam-alpha 1e39",
     "--adam-alpha must be a finite number within f32's range"),
    ("finetune --model-base {S} --train-data {text} --lora-alpha 1e39", "--lora-alpha must be a finite number"),
    ("finetune --model-base {S} --train-data {text} --rope-freq-base 0",
     "--rope-freq-base must be above 0, got 0.0; leave it out to use the model's value"),
    ("export-lora -m {S} --lora-scaled {adapter}:nan -o {tmp}/m.gguf", "the scale must be in [-100, 100]"),
    ("export-lora -m {S} --lora-scaled {adapter}:1e39 -o {tmp}/m.gguf", "the scale must be in [-100, 100]"),
    ("export-lora -m {S} --lora-scaled {adapter}:1e30 -o {tmp}/m.gguf",
     "the scale must be in [-100, 100] (1 applies the adapter as trained, -1 removes it), got 1e+30"),
    ("export-lora -m {S} --lora {nan_adapter} -o {tmp}/m.gguf", "merging gives NaN or inf in 'blk.0.attn_q.weight'"),
    # config files typed exactly like flags
    ("finetune --model-base {S} --train-data {text} --config {cfg_bool}",
     "--config {cfg_bool}: train-on-prompt must be true or false, got the text 'false'"),
    ("finetune --model-base {S} --train-data {text} --config {cfg_list}",
     "--config {cfg_list}: ctx must be a whole number, got a list"),
    ("finetune --model-base {S} --train-data {text} --config {cfg_float}",
     "--config {cfg_float}: batch must be a whole number, got 2.5"),
    ("finetune --model-base {S} --train-data {text} --config {cfg_str}",
     "--config {cfg_str}: adam-alpha must be a number, got the text '0.1'"),
    ("finetune --model-base {S} --train-data {text} --config {cfg_null}",
     "--config {cfg_null}: lora-r must be a whole number, got nothing (null)"),
    ("finetune --model-base {S} --train-data {text} --config {cfg_unknown}",
     "--config {cfg_unknown}: unknown option(s) lora_rank"),
    ("finetune --model-base {S} --train-data {text} --config {cfg_binary}", "--config {cfg_binary}: not a text file"),
    ("finetune --model-base {S} --train-data {text} --config {cfg_toml}", "cannot parse it as TOML"),
    # every path check: a folder for a file, a file for a folder, names too long, outputs' folders
    ("info {tmp}", "{tmp} is a folder, not a GGUF file"),
    ("generate -m {tmp}", "{tmp} is a folder, not a GGUF file"),
    ("finetune --model-base {tmp} --train-data {text}", "--model-base {tmp} is a folder; --model-base takes a file"),
    ("finetune --model-base {S} --train-data {text} --log-file {tmp}", "--log-file {tmp} is a folder"),
    ("finetune --model-base {S} --train-data {text} --lora-out {tmp}/" + "l" * 300 + ".gguf",
     "this filesystem takes at most 255"),
    ("finetune --model-base {S} --train-data {text} --chat-template {tmp}", "--chat-template {tmp} is a folder"),
    ("export-lora -m {S} --lora {adapter} -o {tmp}", "-o {tmp} is a folder; -o takes a file name"),
    ("convert-lora {adapter} -m {S} -o {tmp}/x.gguf", "PEFT_DIR {adapter} is a file; PEFT_DIR takes a folder"),
    # each kind of file given where another goes is named as what it is
    ("generate -m {adapter}", "{adapter} is a LoRA adapter, not a model: pass it where adapters go"),
    ("finetune --model-base {checkpoint} --train-data {text}", "{checkpoint} is a training checkpoint, not a model"),
    ("perplexity -m {vocab} -f {text}", "{vocab} is a vocabulary, not a model"),
    ("export-lora -m {adapter} --lora {adapter} -o {tmp}/m.gguf", "-m {adapter} is a LoRA adapter, not a model"),
    ("finetune --model-base {S} --train-data {text} --checkpoint-in {adapter}",
     "--checkpoint-in {adapter} is a LoRA adapter, not a training checkpoint"),
    ("export-lora -m {S} --lora {other_adapter} -o {tmp}/m.gguf",
     "1 of the adapter's 1 tensors do not fit the base model {S}"),
    # another model's adapter with a token_embd pair, on a base whose output is tied: named as another model's
    ("export-peft {other_embd} -m {S} -o {tmp}/peft-other",
     "2 of the adapter's 2 tensors do not fit the base model {S}"),
    ("export-lora -m {S} --lora {other_embd} -o {tmp}/m.gguf", "2 of the adapter's 2 tensors do not fit"),
    ("generate -m {S} --device meta", "--device meta: ggtorch runs models on cpu, cuda, mps, not on a meta device"),
    ("finetune --model-base {S} --train-data {text} --objective ipo --beta 1e-30",
     "--beta 1e-30 with --objective ipo: IPO's loss aims at a margin of 1/(2 beta) = 5e+29, whose square overflows "
     "f32, so every loss would be inf; raise --beta"),
    ("train --vocab-model {adapter} --train-data {text}", "--vocab-model {adapter} is a LoRA adapter"),
    # messages that point where the fix is
    ("generate -m {S} -p " + "x" * 3000, "shorten the prompt"),
    ("generate -m {S} -p Once -n 511", "ask for at most 510 new tokens (-n)"),
    ("generate -m {no_heads}", "'llama.attention.head_count' is 0; a model has at least 1"),
    ("finetune --model-base {S} --train-data {chat_wizard} --chat-template {user_assistant}",
     "does not write message 0 (role 'wizard') into its render"),
]


# Commands without rows yet; every command still gets the no-argument check below.
NOT_YET_IN_TABLE: set[str] = set()
RUNS_WITHOUT_ARGUMENTS = {"demo"}  # every option has a default: no arguments is its use (tests/cli/test_demo.py)


@pytest.fixture(scope="module")
def inputs(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from ggtorch.lora.adapter_file import LoraAdapter, LoraPair, write_adapter

    root = tmp_path_factory.mktemp("bad-inputs")
    (root / "text.txt").write_text("hello world, " * 3 + "\n", encoding="utf-8")
    (root / "latin1.txt").write_bytes(b"ab\xff\xfecd\n")
    (root / "empty.txt").write_bytes(b"")
    (root / "truncated.gguf").write_bytes(stories260k.read_bytes()[:5000])
    (root / "list.jsonl").write_text('{"kind": "iter", "iteration": 1, "loss": 2.0}\n[1, 2]\n', encoding="utf-8")
    (root / "text.jsonl").write_text("not json\nnor this\n", encoding="utf-8")
    (root / "nokeys.jsonl").write_text('{"kind": "iter"}\n', encoding="utf-8")
    (root / "ok.jsonl").write_text('{"kind": "iter", "iteration": 1, "loss": 2.0}\n', encoding="utf-8")
    (root / "empty_dir").mkdir()
    (root / "bad.jsonl").write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c", "resp\n', encoding="utf-8")
    (root / "noresp.jsonl").write_text('{"prompt": "a"}\n', encoding="utf-8")
    (root / "emptyresp.jsonl").write_text('{"prompt": "a", "response": ""}\n', encoding="utf-8")
    (root / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "a"}, '
                                     '{"role": "assistant", "content": "b"}]}\n', encoding="utf-8")
    (root / "bad.jinja").write_text("{{ raise_exception('no roles here') }}", encoding="utf-8")
    pair = LoraPair(torch.zeros(2, 64), torch.zeros(64, 2))
    write_adapter(root / "adapter.gguf", LoraAdapter("llama", 4.0, {"blk.0.attn_q.weight": pair}))
    write_adapter(root / "other.gguf", LoraAdapter("llama", 4.0, {"blk.0.attn_q.weight": LoraPair(
        torch.zeros(2, 96), torch.zeros(96, 2))}, {"adapter.base_model": "another-96"}))
    write_adapter(root / "other-embd.gguf", LoraAdapter("llama", 4.0, {
        "blk.0.attn_q.weight": LoraPair(torch.zeros(2, 96), torch.zeros(96, 2)),
        "token_embd.weight": LoraPair(torch.zeros(512, 2), torch.zeros(96, 2))}, {"adapter.base_model": "another-96"}))
    nan = np.full((2, 64), np.nan, dtype=np.float32)
    write_raw_adapter(root / "nan.gguf", {"blk.0.attn_q.weight.lora_a": nan,
                                          "blk.0.attn_q.weight.lora_b": np.ascontiguousarray(nan.T)})
    shutil.copy(stories260k, root / "model.gguf")
    (root / "model-link.gguf").symlink_to(root / "model.gguf")
    (root / "sub").mkdir()
    shutil.copy(stories260k, root / "base-LATEST.gguf")
    rewrite_gguf(stories260k, root / "noheads.gguf", set_keys={"llama.attention.head_count": 0})
    vocab = read_gguf(stories260k)
    write_gguf(root / "vocab.gguf", "llama", {k: v for k, v in vocab.metadata.items() if k.startswith("tokenizer.")},
               [], vocab.value_types)
    for name, text in CONFIGS.items():
        (root / name).write_text(text, encoding="utf-8")
    (root / "cfg_binary.yaml").write_bytes(bytes(range(256)))
    (root / "wizard.jsonl").write_text('{"messages": [{"role": "wizard", "content": "What is 2+2?"}, '
                                       '{"role": "assistant", "content": "4"}]}\n', encoding="utf-8")
    (root / "user_assistant.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'user' %}Q: {{ m['content'] }}\n"
        "{% elif m['role'] == 'assistant' %}A: {{ m['content'] }}</s>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}A: {% endif %}", encoding="utf-8")
    run = root / "run"
    run.mkdir()
    code = run_cli(["finetune", "--model-base", stories260k, "--train-data", root / "text.txt", "-c", "8", "-b", "1",
                    "-n", "1", "--lora-r", "2", "-t", "1", "--checkpoint-in", "",
                    "--checkpoint-out", run / "checkpoint-ITERATION.gguf",
                    "--lora-out", run / "ggml-lora-ITERATION-f32.gguf"]).exit_code
    assert code == 0
    rewrite_gguf(stories260k, root / "extra.gguf", add_tensors={"blk.0.bogus.weight": np.zeros((4, 64))})
    rewrite_gguf(stories260k, root / "noembd.gguf", drop_tensors=("token_embd.weight",))
    return {"S": str(stories260k), "tmp": str(root), "missing": str(root / "missing"),
            "text": str(root / "text.txt"), "latin1": str(root / "latin1.txt"), "empty": str(root / "empty.txt"),
            "truncated": str(root / "truncated.gguf"), "adapter": str(root / "adapter.gguf"),
            "log_list": str(root / "list.jsonl"), "log_text": str(root / "text.jsonl"),
            "log_nokeys": str(root / "nokeys.jsonl"), "log_ok": str(root / "ok.jsonl"),
            "empty_dir": str(root / "empty_dir"), "bad_json": str(root / "bad.jsonl"),
            "no_response": str(root / "noresp.jsonl"), "empty_response": str(root / "emptyresp.jsonl"),
            "chat": str(root / "chat.jsonl"), "bad_template": str(root / "bad.jinja"),
            "extra_tensor": str(root / "extra.gguf"), "no_embd": str(root / "noembd.gguf"),
            "other_adapter": str(root / "other.gguf"), "other_embd": str(root / "other-embd.gguf"),
            "nan_adapter": str(root / "nan.gguf"),
            "model": str(root / "model.gguf"), "model_link": str(root / "model-link.gguf"),
            "latest_model": str(root / "base-LATEST.gguf"), "no_heads": str(root / "noheads.gguf"),
            "vocab": str(root / "vocab.gguf"), "checkpoint": str(run / "checkpoint-LATEST.gguf"), "run": str(run),
            "chat_wizard": str(root / "wizard.jsonl"), "user_assistant": str(root / "user_assistant.jinja"),
            "cfg_binary": str(root / "cfg_binary.yaml"), **{name.split(".")[0]: str(root / name) for name in CONFIGS}}


CONFIGS = {"cfg_bool.yaml": 'train-on-prompt: "false"\n', "cfg_list.yaml": "ctx: [1, 2]\n",
           "cfg_float.yaml": "batch: 2.5\n", "cfg_str.yaml": "adam-alpha: '0.1'\n", "cfg_null.yaml": "lora-r:\n",
           "cfg_unknown.yaml": "lora-rank: 4\n", "cfg_toml.toml": "ctx = [\n"}
"""Config files of the wrong types, each a row above."""


def write_raw_adapter(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    """A LoRA adapter written by gguf-py as it is given (ggtorch's writer refuses non-finite values)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", 2.0)
    for name, value in tensors.items():
        w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def invoke(args: list[str]) -> tuple[int, str, BaseException | None]:
    result = run_cli(["" if a == "''" else a for a in args])  # '' in a row: an empty argument, as a shell passes it
    return result.exit_code, result.output, result.exception


@pytest.mark.parametrize(("line", "message"), ROWS, ids=[r[0].split("{")[0] + str(i) for i, r in enumerate(ROWS)])
def test_bad_input_is_refused_with_its_message(inputs: dict[str, str], line: str, message: str,
                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # default outputs of a row that wrongly ran would land here
    code, out, exc = invoke(line.format(**inputs).split())
    assert exc is None or isinstance(exc, SystemExit), f"traceback: {type(exc).__name__}: {exc}\n{out}"
    assert code != 0, out
    assert message.format(**inputs) in " ".join(out.split()), out
    assert "Traceback" not in out
    assert not list(tmp_path.iterdir()), "a refused command wrote files"


def test_every_command_is_in_the_table() -> None:
    """A new command gets rows here: the table covers everything registered on the CLI."""
    covered = {line.split()[0] for line, _ in ROWS}
    uncovered = set(main.commands) - covered - NOT_YET_IN_TABLE
    assert not uncovered, f"add bad-input rows for: {sorted(uncovered)}"


@pytest.mark.parametrize("command", sorted(set(main.commands) - RUNS_WITHOUT_ARGUMENTS))
def test_every_command_without_arguments_refuses_cleanly(command: str) -> None:
    code, out, exc = invoke([command])
    assert exc is None or isinstance(exc, SystemExit), f"traceback: {type(exc).__name__}: {exc}\n{out}"
    # click's usage error (exit 2) or, where every flag has a default, ggtorch's one line (exit 1)
    assert (code == 2 and "Missing" in out) or (code == 1 and out.startswith("error: ")), out


REAL_PROCESS_ROWS = [
    # (command line, the one error line it must print): the console script and `python -m ggtorch`
    # in a process of their own, where nothing catches what the CLI lets through
    ("ggtorch info {truncated}", "error: {truncated}: "),
    ("ggtorch generate -m {gpt2}", "error: {gpt2}: unsupported architecture 'gpt2'; ggtorch supports "
                                   "llama, qwen2, qwen2moe, qwen3, qwen3moe, gemma2, gemma3, phi3"),
    ("python -m ggtorch finetune --model-base {S} --train-data {missing}", "error: --train-data"),
]


@pytest.mark.parametrize(("line", "message"), REAL_PROCESS_ROWS, ids=[r[0].split()[1] for r in REAL_PROCESS_ROWS])
def test_real_process_prints_one_line_not_a_traceback(inputs: dict[str, str], tmp_path: Path, line: str,
                                                      message: str) -> None:
    gpt2 = rewrite_gguf(Path(inputs["S"]), tmp_path / "gpt2.gguf", arch="gpt2")
    values = {**inputs, "gpt2": str(gpt2)}
    args = line.format(**values).split()
    exe = [sys.executable, "-m", "ggtorch"] if args[0] == "python" else [shutil.which("ggtorch") or "ggtorch"]
    proc = subprocess.run(exe + args[3 if args[0] == "python" else 1:], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message.format(**values)), proc.stderr


def test_ctrl_c_while_the_command_starts_is_one_line(tmp_path: Path) -> None:
    """Ctrl-C while the console script imports torch (sent as soon as torch's library is mapped, a second or more
    before the command could run): 'interrupted' and exit status 130, never the import's traceback (the entry
    point, ggtorch_launcher, runs before the import).

    A race: the command may finish before the signal reaches it (a fast machine, or a read of the process's maps that
    missed torch). Whichever side wins, the user sees one line: 'interrupted' with 130, or the command's own error."""
    import signal
    import time

    proc = subprocess.Popen([shutil.which("ggtorch") or "ggtorch", "info", str(tmp_path / "missing.gguf")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if "libtorch" in maps.read_text():
                break
        except OSError:
            pass
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)  # a no-op on a process that has ended
    out, err = proc.communicate(timeout=120)
    lines = err.strip().splitlines()
    assert "Traceback" not in err and out == "", err
    if proc.returncode == 130:
        assert lines[-1] == "interrupted", err
    else:  # it had printed its error before the signal came (and was exiting, or had exited)
        assert proc.returncode in (1, -signal.SIGINT) and len(lines) == 1 and "missing.gguf" in lines[0], err
