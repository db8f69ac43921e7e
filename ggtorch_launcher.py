"""The ``ggtorch`` command's entry point, outside the package so that it runs before ``import ggtorch``.

Importing ggtorch (torch, transformers' tokenizers, the API) takes a second or two; a Ctrl-C in that time would end
in Python's traceback of the import. Here it ends as a Ctrl-C during a command does: one line and exit status 130.
"""

import sys


def main() -> None:
    """Import the CLI, then run it; an interrupted import says so in one line."""
    try:
        from ggtorch.cli.main import entry
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        sys.exit(130)
    entry()
