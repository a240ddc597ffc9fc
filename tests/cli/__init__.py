"""Command-line tests: the ``hyperoffload`` commands, called through ``hyperoffload.cli.main`` or run in a
subprocess, with what they print, the errors they name and their exit status."""
