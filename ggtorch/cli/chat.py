"""``ggtorch chat``: talk to a model (with the adapters just trained) through its chat template.

Three forms: ``--prompt TEXT`` answers one message; a stdin that is not a terminal is read as one user message per
line (a script's conversation, one answer per line out); a terminal gets the interactive loop, where ``/reset``
starts over, ``/exit`` or Ctrl-D leaves, and Ctrl-C stops the answer being written (not the session). Answers
stream to stdout; a reasoning model's thinking goes to stderr (dimmed on a terminal) or nowhere with
``--hide-thinking``, so stdout holds the answers alone.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable

import click

from ggtorch.api import GGUFModel
from ggtorch.cli.options import (
    RunLoraArgsCommand,
    load_with_adapters,
    model_options,
    run_lora_options,
    sampling_options,
    sampling_params,
)
from ggtorch.data.conversation import Conversation, Reply
from ggtorch.models.generate import SamplingParams, check_n_tokens
from ggtorch.ops.threads import pin_threads

COMMANDS = {"/reset": "forget the conversation (the system prompt stays)", "/exit": "leave (Ctrl-D too)",
            "/help": "this list"}
"""The interactive loop's commands, kept few: everything else is a message."""


def _show_piece(hide_thinking: bool) -> Callable[[str, bool], None]:
    dim = sys.stderr.isatty()

    def show(text: str, thinking: bool) -> None:
        if not thinking:
            click.echo(text, nl=False)
        elif not hide_thinking:
            click.echo(click.style(text, dim=True) if dim else text, nl=False, err=True)
    return show


def _turn(conversation: Conversation, text: str, params: SamplingParams, n_predict: int,
          show: Callable[[str, bool], None]) -> Reply:
    """One message and its streamed answer; Ctrl-C ends the answer where it is (the conversation keeps it)."""
    reply = Reply()
    start = time.perf_counter()
    stream = conversation.send(text, params, n_predict, reply)
    thinking = False
    try:
        for piece in stream:
            if thinking and not piece.thinking:
                click.echo("", err=True)  # the thinking ends on its own line
            thinking = piece.thinking
            show(piece.text, piece.thinking)
    except KeyboardInterrupt:
        stream.close()
        reply.stopped = "interrupted"
    elapsed = time.perf_counter() - start
    click.echo("")
    note = {"end of turn": "", "length": ", stopped at the token limit (-n) or the context",
            "interrupted": ", interrupted"}[reply.stopped]
    click.echo(f"[{reply.n_tokens} tokens in {elapsed:.2f} s, {reply.n_tokens / max(elapsed, 1e-9):.1f} tokens/s; "
               f"{conversation.reused} prompt tokens from the cache{note}]", err=True)
    return reply


def _interactive(conversation: Conversation, params: SamplingParams, n_predict: int,
                 show: Callable[[str, bool], None]) -> None:
    try:
        import readline  # noqa: F401  # line editing and history for input()
    except ImportError:  # not on every platform
        pass
    click.echo("Type a message. " + "; ".join(f"{c}: {what}" for c, what in COMMANDS.items())
               + "; Ctrl-C stops an answer.", err=True)
    while True:
        try:
            line = input("> ")
        except EOFError:
            click.echo("", err=True)
            return
        except KeyboardInterrupt:  # at the prompt: a new line, as a shell gives
            click.echo("\n(/exit or Ctrl-D leaves)", err=True)
            continue
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return
        if text == "/reset":
            conversation.reset()
            click.echo("(a new conversation)", err=True)
            continue
        if text == "/help":
            for command, what in COMMANDS.items():
                click.echo(f"  {command:<7} {what}", err=True)
            continue
        _turn(conversation, line, params, n_predict, show)


def _scripted(conversation: Conversation, lines: Iterable[str], params: SamplingParams, n_predict: int,
              show: Callable[[str, bool], None]) -> None:
    for line in lines:
        if line.strip():
            _turn(conversation, line.rstrip("\n"), params, n_predict, show)


@click.command(name="chat", cls=RunLoraArgsCommand, context_settings={"help_option_names": ["-h", "--help"]})
@model_options
@click.option("-p", "--prompt", default=None, help="Answer this one message and exit (else stdin's lines, one "
              "message each, or the interactive loop on a terminal).")
@click.option("-sys", "--system-prompt", "system", default=None, help="The conversation's system message.")
@click.option("--chat-template", "--chat-template-file", "chat_template", default=None, metavar="FILE",
              help="Jinja chat template file to use instead of the model's tokenizer.chat_template.")
@click.option("-n", "--n-predict", "n_predict", type=int, default=1024, show_default=True,
              help="Most tokens an answer may have (it ends earlier at the template's end of turn).")
@sampling_options
@click.option("--hide-thinking", is_flag=True, help="Leave a reasoning model's <think> block out (else it is "
              "written to stderr, apart from the answer).")
@run_lora_options
def chat(model_path: str, device: str, dtype: str, keep_quantized: bool, threads: int | None, prompt: str | None,
         system: str | None, chat_template: str | None, n_predict: int, temp: float, top_k: int, top_p: float,
         seed: int, hide_thinking: bool, lora_scaled: tuple[str, ...]) -> None:
    """Chat with a model through its chat template, streaming the answers (KV cache kept across turns)."""
    if threads:
        pin_threads(threads)
    params = sampling_params(temp, top_k, top_p, seed)  # the API's checks, before the load
    check_n_tokens(n_predict)
    loaded: GGUFModel = load_with_adapters(model_path, device, dtype, keep_quantized, lora_scaled)
    conversation = loaded.conversation(system, chat_template)
    show = _show_piece(hide_thinking)
    if prompt is not None:
        _turn(conversation, prompt, params, n_predict, show)
    elif not sys.stdin.isatty():
        _scripted(conversation, sys.stdin, params, n_predict, show)
    else:
        _interactive(conversation, params, n_predict, show)
