"""Hugging Face configs as untrusted input, through the command line: code a model folder names (``auto_map``) runs
only with --trust-remote-code; a bad config.json is one clear error naming the field, before transformers reads it;
long captures report progress and stop cleanly on Ctrl-C."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from hf_configs import LLAMA  # noqa: E402
from hf_configs import remote_code_folder  # noqa: E402

from hyperoffload.capture import CaptureError  # noqa: E402
from hyperoffload.capture.hf import build_hf_model  # noqa: E402
from hyperoffload.cli import main  # noqa: E402

SRC = Path(__file__).resolve().parents[2] / "src"


def _cli(tmp_path: Path, args: list[str], stdin) -> subprocess.CompletedProcess:
    """The command line in a fresh process, as a user or CI runs it; transformers' module cache under tmp_path."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "HF_MODULES_CACHE": str(tmp_path / "modules")}
    return subprocess.run([sys.executable, "-m", "hyperoffload.cli", *args], cwd=tmp_path, env=env, timeout=300,
                          capture_output=True, text=True, **stdin)


# A pipe that answers transformers' "Do you wish to run the custom code? [y/N]" prompt, and no stdin at all.
@pytest.mark.parametrize("stdin", [{"input": "y\ny\n"}, {"stdin": subprocess.DEVNULL}], ids=["answered", "closed"])
def test_a_model_folders_code_never_runs_without_the_flag(tmp_path, stdin) -> None:
    folder = remote_code_folder(tmp_path)
    run = _cli(tmp_path, ["inspect", "--workload", f"hf:{folder}", "--mode", "prefill", "--seq", "8"], stdin)
    assert run.returncode == 2, run.stderr
    err = run.stderr.strip()
    assert "\n" not in err and "Traceback" not in err
    assert "modeling_evil.py" in err and "--trust-remote-code" in err and "auto_map" in err
    assert not (folder / "MARKER").exists()
    assert not (tmp_path / "modules").exists()  # nothing was copied to transformers' module cache either


def test_a_model_folders_code_runs_with_the_flag(tmp_path) -> None:
    folder = remote_code_folder(tmp_path)
    run = _cli(tmp_path, ["inspect", "--workload", f"hf:{folder}", "--mode", "prefill", "--seq", "8", "--json",
                          "--trust-remote-code"], {"stdin": subprocess.DEVNULL})
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["task"] == "causal-lm"
    assert (folder / "MARKER").exists()


def test_the_remote_code_flag_is_for_hf_workloads_only(capsys) -> None:
    assert main(["inspect", "--workload", "tiny-llama", "--mode", "train", "--trust-remote-code"]) == 2
    assert "--trust-remote-code applies to Hugging Face models" in capsys.readouterr().err


# (config.json text, what the one-line error says)
BAD_CONFIGS = {
    "unknown dtype": (json.dumps({**LLAMA, "torch_dtype": "float9"}), r"field torch_dtype is \"float9\", not a "
                                                                       r"weight dtype; use one of: float32"),
    "unknown new dtype": (json.dumps({**LLAMA, "dtype": "Tensor"}), r"field dtype is \"Tensor\""),
    "dtype not a name": (json.dumps({**LLAMA, "dtype": 16}), r"field dtype is 16"),
    "negative width": (json.dumps({**LLAMA, "hidden_size": -32}), r"field hidden_size must be at least 1 channels, "
                                                                   r"got -32"),
    "no layers": (json.dumps({**LLAMA, "num_hidden_layers": 0}), r"field num_hidden_layers must be at least 1"),
    "zero vocabulary": (json.dumps({**LLAMA, "vocab_size": 0}), r"field vocab_size must be at least 1"),
    "a million layers": (json.dumps({**LLAMA, "num_hidden_layers": 10**6}),
                         r"field num_hidden_layers = 1,000,000 is more than any real model has \(at most 1,024 "
                         r"layers accepted\)"),
    "a huge vocabulary": (json.dumps({**LLAMA, "vocab_size": 10**12}), r"field vocab_size = 1,000,000,000,000"),
    "a nested size": (json.dumps({"model_type": "t5", "d_model": 32, "encoder": {"num_layers": 10**7}}),
                      r"field encoder\.num_layers = 10,000,000"),
    "a fractional size": (json.dumps({**LLAMA, "hidden_size": 32.5}), r"field hidden_size must be a whole number"),
    "a list": ("[1, 2, 3]", r"holds a JSON list, not an object of config fields"),
    "a string": ('"llama"', r"holds a JSON str"),
    "malformed": ('{"model_type": "llama",', r"is not valid JSON: .* line 1 column"),
    "deeply nested": ("[" * 200_000 + "]" * 200_000, r"nests objects or lists deeper than a JSON reader follows"),
    "nested past the limit": ('{"a": ' * 40 + "1" + "}" * 40, r"nests objects or lists 17 levels deep"),
    "a hub attention kernel": (json.dumps({**LLAMA, "attn_implementation": "kernels-community/flash-attn"}),
                               r"field attn_implementation is \"kernels-community/flash-attn\"; a kernel named by "
                               r"repository would be downloaded and run"),
    "auto_map not an object": (json.dumps({**LLAMA, "auto_map": "modeling_x.X"}),
                               r"field auto_map must be an object"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_a_bad_config_is_one_clear_error(tmp_path, capsys, case: str) -> None:
    text, message = BAD_CONFIGS[case]
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(CaptureError, match=message):
        build_hf_model(str(tmp_path))
    assert main(["inspect", "--workload", f"hf:{tmp_path}", "--mode", "train"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err and err.startswith("error:")


def test_progress_on_a_pipe_is_a_line_per_tenth() -> None:
    from rich.console import Console

    from hyperoffload.commands import _capture_progress

    stream = io.StringIO()
    with _capture_progress(Console(file=stream), "Capturing...", quiet_s=0.0) as report:
        for done in range(1, 401):
            report("tracing layers", done, 400)
    lines = stream.getvalue().splitlines()
    assert lines == [f"tracing layers: {n} of 400" for n in range(40, 401, 40)]


def test_ctrl_c_during_a_capture_is_one_line_and_exit_130(tmp_path, capsys, monkeypatch) -> None:
    import hyperoffload.capture.hf as hf

    (tmp_path / "config.json").write_text(json.dumps(LLAMA))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(hf, "capture_hf", interrupted)
    assert main(["inspect", "--workload", f"hf:{tmp_path}", "--mode", "train"]) == 130
    err = capsys.readouterr().err.strip()
    assert err == "interrupted"
