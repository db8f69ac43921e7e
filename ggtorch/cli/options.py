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

from ggtorch.errors import flag
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
