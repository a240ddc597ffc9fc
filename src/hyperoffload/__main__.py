"""``python -m hyperoffload``: the ``hyperoffload`` command, as the installed console script runs it."""

from hyperoffload.cli import main_entry

if __name__ == "__main__":
    main_entry()
