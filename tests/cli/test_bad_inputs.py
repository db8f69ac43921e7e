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
    ("generate -m {missing}.gguf", "no such file"),
    ("generate -m {text}", "not a GGUF file"),
    ("generate -m {S} -n 0", "Invalid value for '-n' / '--n-predict'"),
    ("generate -m {S} --device nonsense", "--device: 'nonsense' is not a device name"),
    ("generate -m {S} --device cuda:3", "has no CUDA; use --device cpu"),
    ("generate -m {S} --dtype f64", "Invalid value for '--dtype'"),
    ("generate -m {S} --temp -1", "temperature -1.0 must be >= 0"),
    ("generate -m {S} --temp 1 --top-p 2", "top-p 2.0 must be in (0, 1]"),
    ("generate -m {S} --temp 1 --top-k -3", "top-k -3 must be >= 0"),
    ("generate -m {S} -n 600 --ignore-eos", "exceed the model's context of 512"),
    # perplexity
    ("perplexity -m {S} -f {missing}.txt", "no such text file"),
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
    ("finetune --model-base {S} --train-data {text} --checkpoint-in {S}", "not a ggtorch training checkpoint"),
    ("finetune --model-base {S} --train-data {text} --checkpoint-out {missing}/c.gguf", "does not exist"),
    ("finetune --model-base {S} --train-data {text} --lora-out {text}/a.gguf", "does not exist"),
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
    ("finetune --model-base {S} --train-data {text} --rank-wq -1", "--rank-wq must be >= 0"),
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
    ("finetune --model-base {S} --train-data {text} --norm-rms-eps -1", "rms_eps = -1.0 must be positive"),
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
    # demo
    ("demo --base-iterations 0", "Invalid value for '--base-iterations'"),
    ("demo --lora-iterations x", "'x' is not a valid integer"),
    ("demo -t 0", "Invalid value for '-t' / '--threads'"),
    ("demo -o {text}", "cannot create the output folder"),
    # plot
    ("plot {missing}.jsonl", "no such log file"),
    ("plot {empty}", "the log holds no iterations yet"),
    ("plot {latin1}", "not UTF-8 text"),
    ("plot {log_text}", "not a JSON line"),
    ("plot {log_list}", "not a log record"),
    ("plot {log_nokeys}", "lacks a numeric iteration and loss"),
    ("plot {log_ok} -o {missing}/x.png", "cannot write the plot"),
    # PEFT conversion
    ("convert-lora {missing} -m {S} -o {tmp}/x.gguf", "no such folder"),
    ("convert-lora {empty_dir} -m {S} -o {tmp}/x.gguf", "no adapter_config.json"),
    ("export-peft {missing}.gguf -m {S} -o {tmp}/peft", "no such file"),
    ("export-peft {S} -m {S} -o {tmp}/peft", "not a GGUF LoRA adapter"),
    # train
    ("train --vocab-model {missing}.gguf --train-data {text}", "no such file"),
    ("train --vocab-model {S} --model-base {S} --train-data {text}", "pass exactly one of --vocab-model"),
    ("train --vocab-model {S} --train-data {text} --embd 0", "--embd must be at least 1"),
    ("train --model-base {S} --train-data {missing}.txt", "missing.txt"),
    # export-lora (merge)
    ("export-lora -m {S} --lora {missing}.gguf -o {tmp}/m.gguf", "no such adapter file"),
    ("export-lora -m {S} --lora {S} -o {tmp}/m.gguf", "not a LoRA adapter"),
    ("export-lora -m {S} --lora-scaled {adapter}:abc -o {tmp}/m.gguf", "expected FILE:SCALE or FILE SCALE"),
    # old llama.cpp adapters
    ("convert-old-lora {missing}.bin -o {tmp}/o.gguf", "no such file"),
    ("convert-old-lora {S} -o {tmp}/o.gguf", "not an old llama.cpp finetune checkpoint"),
    ("convert-old-lora {text} -o {tmp}/o.gguf", "not a GGUF file"),
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
            "extra_tensor": str(root / "extra.gguf"), "no_embd": str(root / "noembd.gguf")}


def invoke(args: list[str]) -> tuple[int, str, BaseException | None]:
    result = run_cli(args)
    return result.exit_code, result.output, result.exception


@pytest.mark.parametrize(("line", "message"), ROWS, ids=[r[0].split("{")[0] + str(i) for i, r in enumerate(ROWS)])
def test_bad_input_is_refused_with_its_message(inputs: dict[str, str], line: str, message: str,
                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # default outputs of a row that wrongly ran would land here
    code, out, exc = invoke(line.format(**inputs).split())
    assert exc is None or isinstance(exc, SystemExit), f"traceback: {type(exc).__name__}: {exc}\n{out}"
    assert code != 0, out
    assert message in out, out
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
