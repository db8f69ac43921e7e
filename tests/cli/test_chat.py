"""``ggtorch chat``: a chat-finetuned adapter answers and stops at the end of its turn; the scripted forms, and the
interactive loop on a pseudo-terminal (streamed output, Ctrl-C ends an answer and not the session)."""

from __future__ import annotations

import os
import pty
import select
import signal
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import ggtorch
from ggtorch.io.gguf import read_gguf
from ggtorch.training.config import FinetuneConfig
from ggtorch.training.trainer import Trainer
from tests.cli.test_main import assert_one_line_error
from tests.data.test_chat import QA
from tests.helpers import run_cli
from tests.llama_cpp_files import template_file
from tests.llama_models import rewrite_gguf

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def eos_chat_model(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """stories260K with Mistral Nemo's template, which ends each answer with the EOS token (an end of turn).

    stories260K ties its output to its embedding, in which EOS's row equals those of the tokens its stories never
    used (EOS scores as high as ``8`` or ``+`` whatever the adapter does): the output is untied here, as a copy with
    a little noise, so that EOS has a row of its own, as in the models people chat-finetune."""
    template = template_file("mistralai-Mistral-Nemo-Instruct-2407").read_text(encoding="utf-8")
    embedding = np.array(read_gguf(stories260k).tensors["token_embd.weight"].data).view(np.float32).reshape(512, 64)
    noise = np.random.default_rng(0).standard_normal(embedding.shape).astype(np.float32)
    return rewrite_gguf(stories260k, tmp_path_factory.mktemp("nemo") / "chat.gguf",
                        set_keys={"tokenizer.chat_template": template},
                        add_tensors={"output.weight": embedding + 0.05 * noise})


@pytest.fixture(scope="module")
def chat_adapter(eos_chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA trained on the QA conversations: the answers and the end-of-turn token after them."""
    out = tmp_path_factory.mktemp("chat-lora") / "chat-lora.gguf"
    records = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in QA]
    config = FinetuneConfig(model_base=str(eos_chat_model), train_data="", ctx=64, batch=4, adam_iter=40, warmup=0,
                            adam_alpha=0.01, lora_r=8, seed=1, use_checkpointing=False, save_every=0,
                            checkpoint_in="", checkpoint_out="", lora_out=str(out), threads=1)
    trainer = Trainer(config, records=records, log_records=False)
    trainer.train()
    trainer.close()
    return out


def test_a_chat_finetune_answers_and_stops_at_the_end_of_its_turn(eos_chat_model: Path, chat_adapter: Path) -> None:
    for question, answer in QA:
        result = run_cli(["chat", "-m", eos_chat_model, "--lora", chat_adapter, "--prompt", question, "-n", "40"])
        assert result.exit_code == 0, result.output
        assert result.stdout == f"{answer}\n"
        assert "stopped at the token limit" not in result.stderr, result.stderr
    base = run_cli(["chat", "-m", eos_chat_model, "--prompt", QA[0][0], "-n", "40"])
    assert base.exit_code == 0 and "[40 tokens" in base.stderr  # the base model does not know when to stop


def test_stdin_lines_are_a_conversation(eos_chat_model: Path, chat_adapter: Path) -> None:
    questions = [q for q, _ in QA[:3]]
    result = run_cli(["chat", "-m", eos_chat_model, "--lora", chat_adapter, "-n", "40"],
                     input="\n".join(questions) + "\n")
    assert result.exit_code == 0, result.output
    conversation = ggtorch.load_model(eos_chat_model, lora=[chat_adapter]).conversation()
    expected = [conversation.ask(q, max_tokens=40).answer for q in questions]  # one conversation, as the API has it
    assert result.stdout.splitlines() == expected and expected[0] == QA[0][1]
    cached = [int(line.split("; ")[1].split()[0]) for line in result.stderr.splitlines() if "from the cache" in line]
    assert len(cached) == 3 and cached[0] == 0 and cached[2] > cached[1] > 0  # the history stays in the cache


def test_thinking_goes_to_stderr_or_nowhere(stories260k: Path, tmp_path: Path) -> None:
    path = rewrite_gguf(stories260k, tmp_path / "qwen35.gguf",
                        set_keys={"tokenizer.chat_template": template_file("Qwen3.5-4B").read_text()})
    shown = run_cli(["chat", "-m", path, "--prompt", "Hi", "-n", "6"])
    hidden = run_cli(["chat", "-m", path, "--prompt", "Hi", "-n", "6", "--hide-thinking"])
    assert shown.exit_code == hidden.exit_code == 0, shown.output + hidden.output
    assert shown.stdout == hidden.stdout == "\n"  # no answer yet: six tokens of thinking
    thought = shown.stderr.splitlines()[0]
    assert thought.strip() and thought not in hidden.stderr


def test_chat_refuses_a_model_without_a_template_in_one_line(stories260k: Path) -> None:
    assert_one_line_error(run_cli(["chat", "-m", stories260k, "--prompt", "Hi"]), "no chat template",
                          "--chat-template FILE")


def _read_until(fd: int, wanted: bytes, timeout: float = 60.0) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while wanted not in out:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"{wanted!r} did not come in {timeout:.0f} s; got {out!r}")
        ready, _, _ = select.select([fd], [], [], remaining)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
    return out


def test_the_interactive_loop_on_a_terminal(eos_chat_model: Path) -> None:
    """A real pseudo-terminal: an answer streams (its first words come before its end), Ctrl-C ends that answer and
    not the session, /reset starts over, the next message is answered, Ctrl-D leaves with status 0. The base model
    knows no end of turn, so its answers run to -n."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: ggtorch chat on the terminal
        os.chdir(REPO)
        os.execv(sys.executable, [sys.executable, "-m", "ggtorch", "chat", "-m", str(eos_chat_model), "-n", "400",
                                  "-t", "1"])
    try:
        assert b"Ctrl-C stops an answer" in _read_until(fd, b"> ")
        os.write(fd, b"Tell me a story.\r")
        first = _read_until(fd, b"\n", timeout=30)  # the echoed message
        first += _read_until(fd, b" ", timeout=30)  # the first words of the answer
        assert b"tokens in" not in first  # they came while the answer was being written
        os.write(fd, b"\x03")
        interrupted = _read_until(fd, b"> ")
        assert b"interrupted]" in interrupted and b"[400 tokens" not in interrupted
        os.write(fd, b"/reset\r")
        assert b"a new conversation" in _read_until(fd, b"> ")
        os.write(fd, b"Who is Tom?\r")
        assert b"[400 tokens" in _read_until(fd, b"> ")
        os.write(fd, b"\x04")
        _read_until(fd, b"\n")
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.close(fd)
