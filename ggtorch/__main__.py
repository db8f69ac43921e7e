"""``python -m ggtorch``: the same as the ``ggtorch`` command (also what torchrun launches)."""

from ggtorch.cli.main import entry

entry()
