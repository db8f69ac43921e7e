"""The ``ggtorch`` command: ``ggtorch.cli.main`` holds the click group and its entry point."""
