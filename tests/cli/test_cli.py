import json
import subprocess
import sys
from importlib.metadata import version

import pytest

import hyperoffload
from hyperoffload.cli import main

KEYS = {"num_ops", "params_bytes", "grads_bytes", "optimizer_bytes", "activation_bytes", "kv_bytes", "peak_bytes"}


def run_json(capsys, *args):
    assert main(["inspect", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_inspect_json_train(capsys):
    figures = run_json(capsys, "--workload", "tiny-llama", "--mode", "train")
    assert KEYS <= figures.keys()
    assert figures["grads_bytes"] == figures["params_bytes"]
    assert figures["optimizer_bytes"] == 2 * figures["params_bytes"] + 4
    assert figures["activation_bytes"] > 0 and figures["kv_bytes"] == 0
    assert figures["peak_bytes"] >= figures["params_bytes"] + figures["optimizer_bytes"]
    assert sum(figures["peak_by_kind"].values()) == figures["peak_bytes"]
    sizes = [v["bytes"] for v in figures["peak_values"]]
    assert sizes == sorted(sizes, reverse=True)


def test_inspect_json_decode_sizes_follow_flags(capsys):
    small = run_json(capsys, "--workload", "tiny-llama", "--mode", "decode", "--context", "15", "--batch", "1")
    large = run_json(capsys, "--workload", "tiny-llama", "--mode", "decode", "--context", "31", "--batch", "1")
    assert small["kv_bytes"] * 2 == large["kv_bytes"]  # 16 vs 32 cached positions
    assert small["grads_bytes"] == small["optimizer_bytes"] == 0


def test_inspect_table(capsys):
    assert main(["inspect", "--workload", "tiny-llama", "--mode", "prefill", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "peak device memory, no offload" in out and "Largest values live at the peak" in out


def test_unknown_workload_is_a_clear_error(capsys):
    assert main(["inspect", "--workload", "llama9", "--mode", "train"]) == 2
    err = capsys.readouterr().err
    assert "unknown workload 'llama9'" in err and "tiny-llama" in err


@pytest.mark.parametrize("flag", [["--seq", "0"], ["--batch", "-1"], ["--batch", "two"], ["--mode", "serve"]])
def test_bad_flags_exit_2(flag, capsys):
    args = ["inspect", "--workload", "tiny-llama", "--mode", "train", *flag]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 2


def test_console_script_reports_errors_without_traceback():
    result = subprocess.run([sys.executable, "-m", "hyperoffload.cli", "inspect", "--workload", "nope", "--mode",
                             "train"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "unknown workload" in result.stderr


def test_workloads_lists_presets(capsys):
    assert main(["workloads"]) == 0
    out = capsys.readouterr().out
    assert "llama3-8b" in out and "llama3-70b" in out


def test_inspect_verify_executes_and_agrees(capsys):
    figures = run_json(capsys, "--workload", "tiny-llama", "--mode", "train", "--verify")
    check = figures["verify"]
    assert check["identical_to_eager"] and check["live_bytes_agree"] and check["max_abs_diff"] == 0.0
    assert check["measured_peak_bytes"] == check["analysed_peak_bytes"] == figures["peak_bytes"]


def test_inspect_verify_refuses_a_step_too_large_for_this_machine(capsys):
    assert main(["inspect", "--workload", "llama3-8b", "--mode", "prefill", "--verify"]) == 2
    assert "--verify executes the step for real" in capsys.readouterr().err


def test_inspect_hugging_face_config(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    config.save_pretrained(tmp_path)
    figures = run_json(capsys, "--workload", f"hf:{tmp_path}", "--mode", "train", "--seq", "16", "--verify")
    assert figures["model_type"] == "qwen2" and figures["seq"] == 16
    assert 0 < figures["grads_bytes"] <= figures["params_bytes"]  # buffers (RoPE tables) count as parameters
    assert figures["verify"]["identical_to_eager"] and figures["verify"]["live_bytes_agree"]


def test_plan_and_run_hugging_face_decode(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    config.save_pretrained(tmp_path)
    step = ["--workload", f"hf:{tmp_path}", "--mode", "decode", "--context", "40"]
    figures = run_json(capsys, *step)
    assert figures["mode"] == "decode" and figures["context"] == 40 and figures["kv_bytes"] > 0
    assert main(["plan", *step, "--hardware", "h100-sxm", "--budget", "70%", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["feasible"] and planned["peak_bytes"] <= planned["budget_bytes"]
    assert main(["run", *step, "--budget", "70%", "--link", "1GB/s", "--steps", "1", "--warmup", "0", "--json"]) == 0
    ran = json.loads(capsys.readouterr().out)
    assert ran["max_abs_diff"] == 0.0 and ran["feasible"]


def test_inspect_hugging_face_config_missing(tmp_path, capsys):
    assert main(["inspect", "--workload", f"hf:{tmp_path}", "--mode", "train"]) == 2
    assert "no Hugging Face config" in capsys.readouterr().err


def test_simulate_json_on_a_preset_with_overrides(capsys):
    args = ["simulate", "--workload", "tiny-llama", "--mode", "train", "--hardware", "h100-sxm", "--json"]
    assert main(args) == 0
    base = json.loads(capsys.readouterr().out)
    for key in ("compute_s", "step_s", "exposed_s", "lower_bound_s", "slowdown", "peak_bytes", "h2d_bytes",
                "d2h_bytes", "stalls", "workload", "hardware"):
        assert key in base
    assert base["hardware"] == "h100-sxm" and base["step_s"] == base["compute_s"] and base["stalls"] == 0
    assert base["fits"] is True
    assert main([*args, "--h2d-bw", "10GB/s", "--device-memory", "1MiB"]) == 0
    changed = json.loads(capsys.readouterr().out)
    assert changed["fits"] is False and changed["device_memory_bytes"] == 2**20


def test_simulate_writes_trace_and_plot(tmp_path, capsys):
    trace, plot = tmp_path / "step.json", tmp_path / "step.png"
    assert main(["simulate", "--workload", "tiny-llama", "--mode", "decode", "--hardware", "a100-80g",
                 "--trace", str(trace), "--plot", str(plot)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("ph") == "X" for e in events) and any(e.get("ph") == "C" for e in events)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hardware_list_and_detail(capsys):
    assert main(["hardware"]) == 0
    out = capsys.readouterr().out
    assert "h100-sxm" in out and "ascend-910c" in out and "cpu-emulated" in out
    assert main(["hardware", "gh200", "--json"]) == 0
    profile = json.loads(capsys.readouterr().out)
    assert profile["h2d_bw"] == 350e9 and "C2C" in profile["sources"]["h2d_bw"]


def test_bad_hardware_input(capsys, tmp_path):
    assert main(["simulate", "--workload", "tiny-llama", "--mode", "train", "--hardware", "tpu9"]) == 2
    assert "unknown hardware 'tpu9'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["simulate", "--workload", "tiny-llama", "--mode", "train", "--hardware", "h100-sxm", "--h2d-bw", "25GB"])
    assert main(["hardware", str(tmp_path / "missing.toml")]) == 2
    assert "no hardware file" in capsys.readouterr().err


def test_version_prints_the_installed_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"hyperoffload {version('hyperoffload')}\n"


def test_version_falls_back_to_the_package_version_from_an_uninstalled_tree(capsys, monkeypatch):
    """Run from a source tree that was never installed (``PYTHONPATH=src``, as on a GPU machine), no
    distribution is found and the package's own version is printed."""
    import importlib.metadata

    import hyperoffload

    monkeypatch.setattr(importlib.metadata, "distributions", lambda **_: iter(()))
    monkeypatch.setattr(hyperoffload, "__version__", "9.9.9")
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out == "hyperoffload 9.9.9\n"


def test_help_answers_without_importing_torch():
    """``--help`` and the parser need only names (workloads, modes, hardware presets, Hugging Face tasks), kept in
    modules that import nothing heavy; the commands themselves load on use."""
    code = ("import sys\nfrom hyperoffload.cli import build_parser\nparser = build_parser()\n"
            "for argv in (['--help'], ['plan', '--help'], ['run', '--help']):\n"
            "    try:\n        parser.parse_args(argv)\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in ('torch', 'numpy', 'rich', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert "--budget" in done.stdout and "tiny-llama" in done.stdout and "h100-sxm" in done.stdout


def test_the_names_the_flags_offer_are_the_registries_names():
    from hyperoffload.capture.hf_tasks import TASKS
    from hyperoffload.capture.task_names import TASK_NAMES
    from hyperoffload.hardware.preset_files import PRESET_NAMES
    from hyperoffload.hardware.presets_index import list_hardware
    from hyperoffload.workloads.catalog import WORKLOAD_NAMES
    from hyperoffload.workloads.presets import WORKLOADS

    assert WORKLOAD_NAMES == tuple(WORKLOADS)
    assert TASK_NAMES == tuple(task.name for task in TASKS)
    assert set(PRESET_NAMES) - {"cpu-emulated"} == {h.name for h in list_hardware()} - {"cpu-emulated"}


def test_import_hyperoffload_loads_the_api_on_first_use():
    """``import hyperoffload`` imports nothing heavy; each attribute of the API loads when first read, and a
    function named like a submodule (``hyperoffload.simulate``) stays the function once that submodule is imported."""
    code = ("import sys, hyperoffload\nheavy = 'torch' in sys.modules\n"
            "import hyperoffload.simulate, hyperoffload.verify, hyperoffload.compare\n"
            "print(heavy, callable(hyperoffload.simulate), callable(hyperoffload.verify), "
            "callable(hyperoffload.compare), hyperoffload.train_step.__module__, sorted(set(hyperoffload.__all__) "
            "- set(dir(hyperoffload))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "True", "True", "hyperoffload.compile.train_step", "[]"]
    for name in hyperoffload.__all__:
        assert getattr(hyperoffload, name) is not None
