"""Bad command-line input: one clear line on stderr naming the problem and the fix, exit status 2, no
traceback, and nothing silently ignored or accepted."""

import json

import pytest
from cli_checks import H100, TINY, profile_with, usage_error, user_error

from hyperoffload import cli, commands
from hyperoffload.cli import main


@pytest.fixture
def no_capture(monkeypatch):
    """The checks under test run before the step is captured (minutes for a large one): capturing fails them."""
    def refuse(*args, **kwargs):
        raise AssertionError("the step was captured before the bad input was refused")

    monkeypatch.setattr(commands, "_capture", refuse)


def test_a_long_error_stays_on_one_line(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # rich wraps at the terminal's width, 80 on a pipe
    err = user_error(capsys, ["inspect", "--workload", "llama9", "--mode", "train"])
    assert len(err) > 80 and "unknown workload 'llama9'" in err


def test_a_value_starting_with_a_dash_says_how_to_pass_it(capsys):
    err = usage_error(capsys, ["plan", *TINY, *H100, "--budget", "-5%"])
    assert "--budget: expected one argument" in err and "--budget=VALUE" in err


@pytest.mark.parametrize("flag, value, hint", [
    ("--h2d-bw", "fast", "write it like 25GB/s"),
    ("--copy-latency", "-1us", "write it like 10us"),
    ("--device-memory", "lots", "such as 40GiB"),
])
def test_a_unit_flag_says_how_to_write_it(capsys, flag, value, hint):
    err = usage_error(capsys, ["simulate", *TINY, *H100, f"{flag}={value}"])
    assert f"argument {flag}: cannot read {value!r}" in err and hint in err and "parse_" not in err


def test_run_link_says_how_to_write_it(capsys):
    err = usage_error(capsys, ["run", *TINY, "--budget", "50%", "--link", "abc"])
    assert "cannot read 'abc' as a bandwidth" in err


@pytest.mark.parametrize("flag, value", [("--h2d-bw", "1e400GB/s"), ("--copy-latency", "1e400s"),
                                         ("--device-memory", "1e400GiB")])
def test_an_infinite_quantity_is_refused(capsys, flag, value):
    err = usage_error(capsys, ["simulate", *TINY, *H100, flag, value])
    assert f"{value!r} is too large" in err


def test_an_infinite_budget_is_refused_as_the_flags_are_read(capsys):
    err = usage_error(capsys, ["plan", *TINY, *H100, "--budget", "1e400"])
    assert "'1e400'" in err and "40GiB" in err


def test_a_negative_bandwidth_names_what_was_typed(capsys):
    err = usage_error(capsys, ["simulate", *TINY, *H100, "--h2d-bw=-5GB/s"])
    assert "cannot read '-5GB/s' as a bandwidth" in err


@pytest.mark.parametrize("key, value", [("memory", "1e400GiB"), ("launch", "1e400s"), ("bfloat16", "1e400TFLOP/s")])
def test_a_profile_with_an_infinite_quantity_is_refused(capsys, tmp_path, key, value):
    path = profile_with(tmp_path, key, value)
    err = user_error(capsys, ["hardware", str(path)])
    assert str(path) in err and f"{value!r} is too large" in err


def test_a_binary_profile_is_named(capsys, tmp_path):
    path = tmp_path / "mine.toml"
    path.write_bytes(b"\xff\xfe\x00")
    err = user_error(capsys, ["hardware", str(path)])
    assert f"{path} is not a text file" in err and "codec" not in err


def test_a_folder_given_as_profile_is_named(capsys, tmp_path):
    path = tmp_path / "mine.toml"
    path.mkdir()
    err = user_error(capsys, ["simulate", *TINY, "--hardware", str(path)])
    assert f"cannot read the hardware profile {path}" in err and "Errno" not in err


@pytest.mark.parametrize("command, flag", [("simulate", "--trace"), ("simulate", "--plot"), ("plan", "--graph"),
                                           ("compare", "--plot"), ("sweep", "--plot")])
def test_an_output_in_a_missing_folder_is_refused_first(capsys, tmp_path, no_capture, command, flag):
    target = tmp_path / "missing" / "out.json"
    extra = {"plan": ["--budget", "50%"], "compare": ["--budget", "50%"],
             "sweep": ["--vary", "budget", "--values", "50%"]}.get(command, [])
    err = user_error(capsys, [command, *TINY, *H100, *extra, flag, str(target)])
    assert f"{flag} {target}: the folder {target.parent} does not exist" in err


def test_an_output_under_a_file_or_at_a_folder_is_refused(capsys, tmp_path, no_capture):
    afile = tmp_path / "afile"
    afile.write_text("")
    err = user_error(capsys, ["plan", *TINY, *H100, "--budget", "50%", "--graph", str(afile / "x.py")])
    assert f"{afile} is a file, not a folder" in err
    err = user_error(capsys, ["simulate", *TINY, *H100, "--trace", str(tmp_path)])
    assert f"--trace {tmp_path} is a folder" in err


@pytest.mark.parametrize("step, flag", [
    (["--mode", "train", "--context", "5"], "--context"),
    (["--mode", "prefill", "--context", "5"], "--context"),
    (["--mode", "decode", "--seq", "64"], "--seq"),
    (["--mode", "prefill", "--master-weights"], "--master-weights"),
    (["--mode", "decode", "--reselection", "0.5"], "--reselection"),  # tiny-llama has no NSA block pool
])
def test_a_step_flag_the_step_ignores_is_refused(capsys, step, flag):
    err = user_error(capsys, ["inspect", "--workload", "tiny-llama", *step])
    assert err.startswith(f"error: {flag} ") and "drop" in err


def test_reselection_outside_deepseek_decode_is_refused(capsys):
    err = user_error(capsys, ["inspect", "--workload", "tiny-deepseek", "--mode", "prefill", "--reselection", "0.5"])
    assert "--reselection applies to decode steps of DeepSeek-style workloads" in err


def test_nsa_block_on_a_hugging_face_model_is_refused(capsys, tmp_path):
    err = user_error(capsys, ["inspect", "--workload", f"hf:{tmp_path}", "--mode", "train", "--nsa-block", "4"])
    assert "--nsa-block applies to the built-in DeepSeek-style workloads" in err


@pytest.mark.parametrize("policies, message", [(",", "names no policy"), ("none,none", "'none' more than once")])
def test_a_policy_list_with_no_or_repeated_names_is_refused(capsys, no_capture, policies, message):
    err = user_error(capsys, ["compare", *TINY, *H100, "--budget", "50%", "--policies", policies])
    assert message in err


def test_sweep_over_budgets_refuses_a_budget_as_well(capsys, no_capture):
    err = user_error(capsys, ["sweep", *TINY, *H100, "--vary", "budget", "--values", "90%,50%", "--budget", "70%"])
    assert "drop --budget 70%" in err


@pytest.mark.parametrize("value", ["0", "abc", "-4"])
def test_sweep_over_nsa_blocks_refuses_a_bad_block(capsys, no_capture, value):
    args = ["sweep", "--workload", "tiny-deepseek", "--mode", "decode", *H100, "--budget", "50%",
            "--vary", "nsa-block", f"--values=16,{value}"]
    err = user_error(capsys, args)
    assert f"--values {value!r}: an NSA block is a positive whole number of tokens" in err


def test_sweep_over_nsa_blocks_refuses_a_block_as_well(capsys, no_capture):
    args = ["sweep", "--workload", "tiny-deepseek", "--mode", "decode", *H100, "--budget", "50%",
            "--vary", "nsa-block", "--values", "16,32", "--nsa-block", "8"]
    assert "drop --nsa-block 8" in user_error(capsys, args)


def test_sweep_over_bandwidths_reads_the_values_before_capturing(capsys, no_capture):
    err = user_error(capsys, ["sweep", *TINY, *H100, "--budget", "50%", "--vary", "h2d-bw", "--values", "8GB/s,16GB"])
    assert "cannot read '16GB' as a bandwidth" in err


def test_valid_commands_still_work(capsys, tmp_path):
    trace = tmp_path / "step.json"
    assert main(["plan", *TINY, *H100, "--budget", "50%", "--json", "--trace", str(trace)]) == 0
    assert json.loads(capsys.readouterr().out)["feasible"] and trace.exists()
    assert main(["inspect", "--workload", "tiny-deepseek", "--mode", "decode", "--reselection", "0.5",
                 "--context", "31", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_bytes"] > 0


def test_a_budget_above_the_device_memory_is_planned_with_a_note(capsys):
    """Budgets above the device's memory are what-ifs the tables use on purpose: planned, with one line saying
    the plan does not fit that device and what to give instead; ``--json`` stays one object on stdout."""
    assert main(["plan", *TINY, *H100, "--budget", "50%", "--device-memory", "1MiB", "--json"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["device_memory_bytes"] == 2**20 and result["budget_bytes"] > 2**20
    note = [line for line in captured.err.splitlines() if "device memory" in line]
    assert len(note) == 1 and "does not fit that device" in note[0] and "at most 1.00 MiB" in note[0]
    assert main(["plan", *TINY, *H100, "--budget", "50%", "--json"]) == 0
    assert "device memory" not in capsys.readouterr().err


def test_hideable_says_when_the_smallest_feasible_budget_sets_it(capsys):
    """On an H100 the link could hide moving far more than tiny-llama's step can ever give up, so "hideable"
    is the smallest budget the planner meets; the user is told, not left to wonder at the slowdown."""
    from hyperoffload.policies import minimum_budget
    from hyperoffload.workloads import capture_workload, get_workload

    assert main(["plan", *TINY, *H100, "--budget", "hideable", "--json"]) == 0
    captured = capsys.readouterr()
    least = minimum_budget(capture_workload(get_workload("tiny-llama"), "train").program)[0]
    assert json.loads(captured.out)["budget_bytes"] == least
    assert "'hideable' is the smallest budget this planner can meet" in captured.err
    # where the link sets it (a slow one), no note
    assert main(["plan", *TINY, *H100, "--h2d-bw", "1GB/s", "--d2h-bw", "1GB/s", "--budget", "hideable", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["budget_bytes"] > least and "smallest budget" not in captured.err


@pytest.mark.parametrize("check, message", [
    ({"identical_to_eager": False, "max_abs_diff": 8.9e-8, "live_bytes_agree": True},
     "the results differ from eager by up to 8.9e-08 (the size of float rounding"),
    ({"identical_to_eager": True, "max_abs_diff": 0.0, "live_bytes_agree": False},
     "the measured live bytes differ from the analysis"),
    ({"identical_to_eager": False, "max_abs_diff": 0.5, "live_bytes_agree": True},
     "the results differ from eager by up to 0.5"),
])
def test_a_failed_verify_says_what_differs(capsys, monkeypatch, check, message):
    monkeypatch.setattr(commands, "_verify", lambda args, peak, err: {**check, "measured_peak_bytes": 1,
                                                                 "analysed_peak_bytes": 1})
    assert main(["inspect", *TINY, "--verify"]) == 1
    err = capsys.readouterr().err
    assert "verification failed: " + message in " ".join(err.split())
    assert ("float rounding" in err) == (check["max_abs_diff"] == 8.9e-8)


@pytest.mark.parametrize("args, flag", [(["run", *TINY, "--budget", "50%", "--link", "0GB/s"], "--link"),
                                        (["plan", *TINY, *H100, "--budget", "50%", "--device-memory", "0"],
                                         "--device-memory"),
                                        (["simulate", *TINY, *H100, "--h2d-bw", "0GB/s"], "--h2d-bw")])
def test_a_zero_rate_or_size_names_the_flag(capsys, args, flag):
    err = usage_error(capsys, args)
    assert f"argument {flag}: must be more than zero" in err


def test_an_nsa_block_below_the_compression_block_names_the_flag(capsys):
    err = user_error(capsys, ["inspect", "--workload", "tiny-deepseek", "--mode", "decode", "--nsa-block", "7"])
    assert "block of 7 tokens (--nsa-block" in err and "give 8 or more" in err


def test_kv_policies_on_a_training_step_say_they_plan_as_none(capsys):
    assert main(["compare", *TINY, *H100, "--budget", "50%", "--policies", "kv-naive,hyperoffload", "--json"]) == 0
    captured = capsys.readouterr()
    assert "kv-naive moves only a decode step's KV cache" in captured.err and "hyperoffload" not in captured.err
    assert {row["policy"] for row in json.loads(captured.out)} == {"kv-naive", "hyperoffload"}


def test_a_baseline_over_the_budget_is_not_told_to_use_a_hyperoffload_option(capsys):
    """``plan --policy none`` at half the peak: the arena line says by how much it is over, the allocator model
    replays at the budget asked for (it fails there), and --static-layout, which only hyperoffload takes, is
    not suggested."""
    assert main(["plan", *TINY, *H100, "--budget", "50%", "--policy", "none"]) == 0
    out = capsys.readouterr().out
    line = out[out.index("memory:"):]
    assert "MiB over the budget" in line and "--static-layout" not in line
    assert main(["plan", *TINY, *H100, "--budget", "50%", "--policy", "none", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["allocator_failures"] > 0


def test_a_bare_small_budget_asks_whether_a_percentage_was_meant(capsys):
    err = user_error(capsys, ["plan", *TINY, *H100, "--budget", "50"])
    assert "reads as 50 bytes" in err and "write 50%" in err


def test_a_profile_file_names_itself_for_out_of_range_values_and_refuses_memory_without_a_unit(capsys, tmp_path):
    text = (tmp_path / "x.toml")
    base = ('name = "x"\nhbm_bw = "1TB/s"\nh2d_bw = "1GB/s"\nd2h_bw = "1GB/s"\nh2d_latency = "1us"\n'
            'd2h_latency = "1us"\nlaunch = "1us"\ncompute_efficiency = 0.5\nmemory_efficiency = 0.5\n'
            '[peak_flops]\nfloat32 = "1TFLOP/s"\n')
    for memory in ('80', '"80"'):  # a TOML number, or a string with no unit
        text.write_text(f'memory = {memory}\nduplex_share = 0.8\n' + base)
        err = user_error(capsys, ["simulate", *TINY, "--hardware", str(text)])
        assert str(text) in err and 'memory = "80GiB"' in err
    text.write_text('memory = "80GiB"\nduplex_share = 1.7\n' + base)
    err = user_error(capsys, ["simulate", *TINY, "--hardware", str(text)])
    assert str(text) in err and "duplex_share must be in (0, 1]" in err
