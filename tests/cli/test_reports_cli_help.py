"""``python -m hyperoffload``: the same command as the console script; its help answers without torch, and a
malformed budget or an unknown profile is refused with status 2 before any model is traced."""

import subprocess
import sys

import pytest

from hyperoffload import commands
from hyperoffload.cli import EXIT_USER_ERROR, main

PLAN = ["plan", "--workload", "tiny-llama", "--mode", "train"]


def _run_module(*argv: str, importtime: bool = False) -> subprocess.CompletedProcess:
    flags = ["-X", "importtime"] if importtime else []
    return subprocess.run([sys.executable, *flags, "-m", "hyperoffload", *argv], capture_output=True, text=True,
                          timeout=120)


def _imported(stderr: str) -> set[str]:
    """The modules ``-X importtime`` says were imported (its lines end in ``| <indent>module``)."""
    return {line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("argv, shown", [(["--help"], "{inspect,workloads,simulate,plan,compare,sweep,run,hardware}"),
                                         (["plan", "--help"], "--budget SIZE|PCT%|hideable")])
def test_help_through_python_m_answers_without_torch(argv, shown):
    done = _run_module(*argv, importtime=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage: hyperoffload") and shown in done.stdout
    modules = _imported(done.stderr)
    assert "hyperoffload.cli" in modules  # the report is of this run's imports
    heavy = sorted(m for m in modules if m.split(".")[0] in ("torch", "numpy"))
    assert heavy == []


def test_python_m_runs_the_console_scripts_entry_point():
    import tomllib
    from pathlib import Path

    import hyperoffload.__main__ as module_entry
    from hyperoffload import cli

    pyproject = Path(cli.__file__).parents[2] / "pyproject.toml"
    scripts = tomllib.loads(pyproject.read_text())["project"]["scripts"]
    assert scripts["hyperoffload"] == f"{cli.__name__}:{cli.main_entry.__name__}"
    assert module_entry.main_entry is cli.main_entry


def test_a_malformed_budget_exits_2_naming_it():
    done = _run_module(*PLAN, "--hardware", "h100-sxm", "--budget", "5x0GB")
    assert done.returncode == EXIT_USER_ERROR
    assert "argument --budget: cannot read '5x0GB' as a budget" in done.stderr and "Traceback" not in done.stderr


def test_an_unknown_profile_exits_2_naming_it():
    done = _run_module(*PLAN, "--hardware", "nope", "--budget", "50%")
    assert done.returncode == EXIT_USER_ERROR
    assert "error: unknown hardware 'nope'" in done.stderr and "Traceback" not in done.stderr


def _no_capture(*args, **kwargs):
    raise AssertionError("the step was captured before the flags were checked")


def test_neither_refusal_traces_the_model(monkeypatch, capsys):
    monkeypatch.setattr(commands, "_capture", _no_capture)
    with pytest.raises(SystemExit) as exit_info:
        main([*PLAN, "--hardware", "h100-sxm", "--budget", "5x0GB"])
    assert exit_info.value.code == EXIT_USER_ERROR
    assert main([*PLAN, "--hardware", "nope", "--budget", "50%"]) == EXIT_USER_ERROR
    assert "unknown hardware 'nope'" in capsys.readouterr().err
