"""The training commands' click options, generated from the run config's fields.

Each field of :class:`~ggtorch.training.config.FinetuneConfig` / ``TrainConfig`` becomes one
option: its long flag and other spellings, help, choices and ``[default: ...]`` all come from the
field (:mod:`ggtorch.training.config`). ``--help`` lists them under the old programs' headings.
Values come from, in increasing priority: the field defaults, ``--config FILE``, and the
command line. Flags of the old programs that only made sense for ggml's memory management are
accepted and ignored with a note (IGNORED).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click
from click.core import ParameterSource

from ggtorch.api import GGUFModel, load_model
from ggtorch.errors import BadFlag, flag
from ggtorch.models.generate import SamplingParams
from ggtorch.ops.dtypes import DTYPES
from ggtorch.training.config import (
    FILES,
    OptionInfo,
    RunConfig,
    check_value,
    choices,
    option_info,
    read_config_file,
    value_type,
)

C = TypeVar("C", bound=RunConfig)

IGNORED_GROUP = "Accepted for compatibility, ignored"
IGNORED: list[tuple[tuple[str, ...], type, str]] = [
    (("--use-flash/--no-flash",), bool, "ggml flash attention (torch picks its own kernel)."),
    (("-ngl", "--n-gpu-layers"), int, "ggml GPU offload; use --device cuda instead."),
    (("--use-alloc/--no-alloc",), bool, "ggml allocator (torch manages memory)."),
    (("--mem-model",), float, "ggml memory buffer size (not needed)."),
    (("--mem-lora",), float, "ggml memory buffer size (not needed)."),
    (("--mem-compute",), float, "ggml memory buffer size (not needed)."),
    (("--mem-compute0",), float, "ggml memory buffer size (not needed)."),
    (("--mem-compute1",), float, "ggml memory buffer size (not needed)."),
]
"""Old flags accepted for compatibility and ignored: (spellings, value type, help)."""


def _ignored_name(decls: tuple[str, ...]) -> str:
    return "ignored_" + decls[-1].split("/")[0].lstrip("-").replace("-", "_")


IGNORED_FLAGS = {_ignored_name(decls): decls[-1].replace("/", " / ") for decls, _, _ in IGNORED}
"""Parameter name -> how --help spells an ignored flag, for the note."""


class GroupedOption(click.Option):
    """A click option that knows its --help heading."""

    def __init__(self, decls: Sequence[str], group: str, **kwargs: Any) -> None:
        super().__init__(list(decls), **kwargs)
        self.group = group


class GroupedCommand(click.Command):
    """A command whose --help lists options under headings, in the order of ``groups``."""

    def __init__(self, *args: Any, groups: Sequence[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.groups = tuple(groups)

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        params = self.get_params(ctx)
        for title in self.groups:
            rows = [p.get_help_record(ctx) for p in params if getattr(p, "group", None) == title]
            with formatter.section(title):
                formatter.write_dl([r for r in rows if r])
        help_option = self.get_help_option(ctx)
        if help_option is not None:
            with formatter.section("Other"):
                formatter.write_dl([help_option.get_help_record(ctx)])


def field_option(config_cls: type[RunConfig], f: dataclasses.Field[Any]) -> GroupedOption:
    """The click option of one field: short spellings, the long flag (with a switch's 'off' form), aliases."""
    info = option_info(f)
    long = flag(f.name) + (f"/{info.off}" if info.off else "")
    decls = [*(s for s in info.flags if not s.startswith("--")), long, *(s for s in info.flags if s.startswith("--"))]
    kind = value_type(config_cls, f)
    allowed = choices(config_cls, f)
    if kind is bool:
        typed: dict[str, Any] = {} if info.off else {"is_flag": True}
    elif kind is tuple:  # repeatable: each use adds one text
        typed = {"type": str, "multiple": True}
    else:
        typed = {"type": click.Choice(allowed) if allowed else kind}
    show_default = info.default_text if f.default is None and info.default_text else f.default != ()
    return GroupedOption([*decls, f.name], info.group, default=f.default, show_default=show_default,
                         help=help_text(info), **typed)


def help_text(info: OptionInfo) -> str:
    """An option's --help: its help, then its range where it declares one (the range the config checks)."""
    allowed = info.range_text()
    return f"{info.help} Must be {allowed}." if allowed else info.help


def _params(config_cls: type[RunConfig], groups: Sequence[str]) -> list[click.Parameter]:
    """Every field's option, grouped; within a group the command's own options before the shared ones."""
    own = set(vars(config_cls).get("__annotations__", {}))
    ordered = sorted(dataclasses.fields(config_cls), key=lambda f: f.name not in own)  # stable: keeps field order
    params: list[click.Parameter] = []
    for title in groups:
        params += [field_option(config_cls, f) for f in ordered if option_info(f).group == title]
        if title == FILES:
            params.append(GroupedOption(["--config", "config_file"], FILES, default=None,
                                        help="YAML/TOML file of options (keys = long flag names); flags override it."))
    for decls, kind, help_text in IGNORED:
        typed = {} if kind is bool else {"type": kind}
        params.append(GroupedOption([*decls, _ignored_name(decls)], IGNORED_GROUP, default=None, help=help_text,
                                    **typed))
    return params


def config_command(config_cls: type[RunConfig], groups: Sequence[str]) -> Callable[[Callable[..., Any]], click.Command]:
    """``@click.command`` for a training command: one option per field of ``config_cls``, headed by ``groups``."""
    return click.command(cls=GroupedCommand, groups=(*groups, IGNORED_GROUP), params=_params(config_cls, groups),
                         context_settings={"help_option_names": ["-h", "--help"]})


def threads_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``-t/--threads`` of the commands not generated from a run config, as the run config's field says it."""
    f = next(f for f in dataclasses.fields(RunConfig) if f.name == "threads")
    info = option_info(f)

    def check(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
        check_value(RunConfig, f, value)  # the run config's own check: one message, one range
        return value

    return click.option(*info.flags, flag(f.name), "threads", type=int, default=None, callback=check,
                        show_default=info.default_text, help=help_text(info))(fn)


_SCALED = "--lora-scaled"


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def normalize_lora_args(args: list[str], short: bool = True) -> list[str]:
    """Every adapter flag spelling as ``--lora-scaled FILE:SCALE`` (one per file, order kept).

    Spellings: ``--lora F`` (comma lists too), ``--lora-scaled F:S`` (comma lists too), ``--lora-scaled F S``
    (llama.cpp's tools); with ``short``, the old export-lora's ``-l F`` and ``-s F S`` too (commands whose ``-s`` is
    a seed leave them out)."""
    plain, scaled = ("--lora", "-l") if short else ("--lora",), (_SCALED, "-s") if short else (_SCALED,)
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":  # what follows is no option
            out += args[i:]
            break
        flag, eq, inline = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        if flag in plain + scaled:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
            if value is None:
                raise BadFlag(f"{flag} needs a file name")
            i += 1 if eq else 2
            if flag in plain:
                out += [x for f in value.split(",") if f for x in (_SCALED, f"{f}:1.0")]
                continue
            head, _, tail = value.rpartition(":")
            if head and _is_number(tail):  # FILE:SCALE[,FILE:SCALE...]
                out += [x for f in value.split(",") if f for x in (_SCALED, f)]
            elif i < len(args) and _is_number(args[i]):  # FILE SCALE
                out += [_SCALED, f"{value}:{args[i]}"]
                i += 1
            else:
                raise BadFlag(f"{flag} {value}: expected FILE:SCALE or FILE SCALE, e.g. {flag} adapter.gguf:0.5")
            continue
        out.append(arg)
        i += 1
    return out


class LoraArgsCommand(click.Command):
    """A command whose adapter flags are normalized before click parses them (export-lora's, with -l and -s)."""

    short_lora_flags = True

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            args = normalize_lora_args(list(args), self.short_lora_flags)
        except BadFlag as e:
            raise click.UsageError(str(e), ctx) from None
        return super().parse_args(ctx, args)


class RunLoraArgsCommand(LoraArgsCommand):
    """A command that runs a model with adapters: llama.cpp's ``--lora`` and ``--lora-scaled`` only."""

    short_lora_flags = False


def file_scale(spec: str) -> tuple[str, float]:
    """``FILE:SCALE`` (normalized by :func:`normalize_lora_args`) as (path, scale)."""
    path, _, scale = spec.rpartition(":")
    return path, float(scale)  # a number (normalize_lora_args checked); read_source refuses one f32 cannot hold


def run_lora_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--lora FILE`` and ``--lora-scaled FILE SCALE`` (repeatable) of the commands that run a model, as
    llama.cpp's tools take them; the command receives ``lora_scaled``: ``FILE:SCALE`` strings in order."""
    fn = click.option(_SCALED, "lora_scaled", multiple=True, metavar="FILE SCALE",
                      help="An adapter with a user scale (also FILE:SCALE; 1 applies it as trained, -1 "
                      "removes it).")(fn)
    return click.option("--lora", multiple=True, metavar="FILE", expose_value=False,  # arrives as --lora-scaled F:1
                        help="Apply a LoRA adapter (repeatable, summed): a GGUF adapter, a PEFT folder or a training "
                        "checkpoint.")(fn)


def config_from_cli(ctx: click.Context, values: dict[str, Any], config_cls: type[C]) -> tuple[C, list[str]]:
    """Field defaults < --config file < flags given on the command line; notes for ignored flags."""
    def given(name: str) -> bool:
        return ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE

    notes = [f"note: {spelled} is a ggml memory/offload setting; ggtorch ignores it"
             + (" (use --device cuda)" if "gpu" in name else "")
             for name, spelled in IGNORED_FLAGS.items() if given(name)]
    options = read_config_file(values["config_file"], config_cls) if values["config_file"] else {}
    options.update({name: values[name] for name in config_cls.field_names() if given(name)})
    return config_cls(**options), notes


def model_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Flags every command that loads a model shares."""
    fn = threads_option(fn)
    fn = click.option("--keep-quantized", is_flag=True,
                      help="Keep quantized weights as ggml blocks (less memory, slower).")(fn)
    fn = click.option("--dtype", type=click.Choice(["auto", *sorted(DTYPES)]), default="auto", show_default=True,
                      help="Float type of the (dequantized) weights; auto: bf16 where the device multiplies it "
                      "natively (CUDA from Ampere), else f32.")(fn)
    fn = click.option("--device", default="auto", show_default=True,
                      help="torch device: auto (CUDA, else MPS, else the CPU), cpu, cuda, cuda:1, mps.")(fn)
    fn = click.option("-m", "--model", "model_path", required=True, help="GGUF model file.")(fn)
    return fn


def load_with_adapters(model_path: str, device: str, dtype: str, keep_quantized: bool,
                       lora_scaled: tuple[str, ...]) -> GGUFModel:
    """The model of ``-m`` with the ``--lora``/``--lora-scaled`` adapters applied; on stderr, what was applied."""
    specs = [file_scale(s) for s in lora_scaled]
    loaded = load_model(model_path, device=device, dtype=dtype, keep_quantized=keep_quantized, lora=specs)
    for path, scale in specs:
        click.echo(f"adapter: {path}" + (f" (scale {scale:g})" if scale != 1.0 else ""), err=True)
    return loaded


def sampling_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--temp``, ``--top-k``, ``--top-p`` and ``-s`` of the commands that write text, as llama.cpp's tools
    spell them; :func:`sampling_params` checks them (the API's one check) before a model loads."""
    fn = click.option("-s", "--seed", type=int, default=-1, show_default=True,
                      help="Sampling seed; -1 picks one at random.")(fn)
    fn = click.option("--top-p", type=float, default=0.95, show_default=True,
                      help="Top-p (1 disables); used when --temp > 0.")(fn)
    fn = click.option("--top-k", type=int, default=40, show_default=True,
                      help="Top-k (0 disables); used when --temp > 0.")(fn)
    return click.option("--temp", type=float, default=0.0, show_default=True,
                        help="Temperature; 0 is greedy (argmax).")(fn)


def sampling_params(temp: float, top_k: int, top_p: float, seed: int) -> SamplingParams:
    """The sampling flags as the API's :class:`SamplingParams` (its checks); a seed of -1 picks one at random."""
    return SamplingParams(temp, top_k, top_p, None if seed == -1 else seed)
