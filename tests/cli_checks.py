"""Shared pieces of the command-line tests (tests/cli): common flags, running a command that must fail with
one clear line, and a hardware profile with one field changed."""

import pytest

from hyperoffload import cli
from hyperoffload.cli import main

TINY = ["--workload", "tiny-llama", "--mode", "train"]
H100 = ["--hardware", "h100-sxm"]


def usage_error(capsys, args) -> str:
    """Run ``args``, expect argparse's exit status 2, and return stderr's last line (argparse prints the usage
    above it)."""
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def user_error(capsys, args) -> str:
    """Run ``args``, expect status 2 from the command, and return its stderr, checked to be one line."""
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def profile_with(tmp_path, key: str, value: str):
    preset = (cli.Path(cli.__file__).parent / "hardware" / "presets" / "h100-sxm.toml").read_text()
    lines = [f'{key} = "{value}"' if line.startswith(f"{key} =") else line for line in preset.splitlines()]
    path = tmp_path / "mine.toml"
    path.write_text("\n".join(lines) + "\n")
    return path
