"""Errors a user can act on.

Every message names the problem and the fix. The CLI prints ``str(error)`` on one line and
exits non-zero; nothing below the CLI prints or exits.
"""

import importlib
from types import ModuleType


class GGTorchError(Exception):
    """Base of every error ggtorch raises on purpose."""


class BadGGUF(GGTorchError):
    """A GGUF file that is missing, truncated, malformed or lacks a required key."""


class Unsupported(GGTorchError):
    """A well-formed input that ggtorch does not handle (architecture, ggml type, ...)."""


class BadFlag(GGTorchError):
    """A command-line flag or config value out of range or inconsistent with another."""


class BadData(GGTorchError):
    """Training or evaluation data that cannot be used as given."""


class NonFiniteValues(GGTorchError):
    """A tensor about to be written holds NaN or inf: the file is not written (no file of ggtorch's ever holds one)."""


class OutOfMemory(GGTorchError):
    """A step needed more memory than the machine (or the device, or a limit set on the process) gave."""


class MissingExtra(GGTorchError):
    """A feature's optional package is not installed; the message names the ggtorch extra that installs it."""


def optional_module(name: str, extra: str, feature: str, package: str | None = None) -> ModuleType:
    """Module ``name``, which ``feature`` needs and the extra ``ggtorch[extra]`` installs; MissingExtra (one line,
    the install command) when it cannot be imported. ``package``: the distribution a user lacks when that is not
    ``name``'s top package (``torch.utils.tensorboard`` needs ``tensorboard``)."""
    package = package or name.partition(".")[0]
    try:
        return importlib.import_module(name)
    except ImportError as e:
        missing = e.name is not None and (e.name == package or e.name.startswith(package + "."))
        why = "is not installed" if missing else f"cannot be imported ({e})"
        raise MissingExtra(f"{feature} needs {package}, which {why}: pip install 'ggtorch[{extra}]'") from None


def flag(option: str) -> str:
    """The long flag of a run option (``adam_alpha`` -> ``--adam-alpha``): what every message calls it."""
    return "--" + option.replace("_", "-")
