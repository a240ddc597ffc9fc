"""Every number a user can give is checked where it comes in (a TOML profile, ``Hardware(...)``, a command-line flag,
a budget, a calibration cache): NaN, infinity, a bool or text where a number belongs, and values out of range are
refused with one message naming the field or flag; nothing hangs and nothing ends in a traceback."""

import json
import math
import signal
import warnings

import pytest

from hyperoffload.budgets import parse_budget
from hyperoffload.cli import main
from hyperoffload.hardware import HardwareError, get_hardware, list_hardware, load_hardware_file
from hyperoffload.hardware.cpu import CalibrationCacheWarning, _key, load_or_measure
from hyperoffload.hardware.profile import MAX_MEMORY_BYTES
from hyperoffload.plans import Instr, Kind, Plan, PlanError
from hyperoffload.simulate import simulate
from hyperoffload.units import parse_bandwidth, parse_bytes, parse_duration, parse_flops
from programs import op, program, simple_hardware, value
from cli_checks import H100, TINY, profile_with, usage_error, user_error

H100_PROFILE = get_hardware("h100-sxm")


@pytest.fixture
def no_hang():
    """Turn a simulation that never ends into a failure rather than a test run that never ends (a safety stop, not
    a timing check: a correct simulator of these plans takes milliseconds)."""
    def stop(*_):
        raise AssertionError("did not finish: the event loop spins for ever")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


# -- Hardware(...): one rule per field -------------------------------------------------------------------------

@pytest.mark.parametrize("field, bad, rule", [
    ("h2d_latency_s", math.nan, "h2d_latency_s must be a finite number >= 0 s"),
    ("d2h_latency_s", math.inf, "d2h_latency_s must be a finite number >= 0 s"),
    ("launch_s", math.nan, "launch_s must be a finite number >= 0 s"),
    ("issue_s", math.inf, "issue_s must be a finite number >= 0 s"),
    ("h2d_latency_s", 1e30, "at most 3600 s"),
    ("h2d_bw", math.inf, "h2d_bw must be a finite number > 0 bytes/s"),
    ("hbm_bw", "5", "hbm_bw must be a finite number > 0 bytes/s, got '5' (str, not a number)"),
    ("memory_bytes", True, "memory_bytes must be a whole number of bytes > 0 and at most 2**62"),
    ("memory_bytes", math.inf, "memory_bytes must be a whole number of bytes"),
    ("memory_bytes", 2**63, "at most 2**62"),
    ("memory_bytes", 80e9, "a whole number of bytes"),
    ("compute_efficiency", True, "compute_efficiency must be in (0, 1], got True (bool, not a number)"),
])
def test_a_profile_field_out_of_its_rule_is_refused_naming_it(field, bad, rule):
    with pytest.raises(HardwareError) as error:
        H100_PROFILE.replace(**{field: bad})
    assert str(error.value).startswith("h100-sxm: ") and rule in str(error.value)


@pytest.mark.parametrize("rates, rule", [({"bfloat16": math.inf}, "peak_flops['bfloat16'] must be a finite number > 0"),
                                         ({"float32": True}, "peak_flops['float32'] must be a finite number > 0"),
                                         ({"float32": "1e12"}, "peak_flops['float32'] must be a finite number > 0"),
                                         ({"bfloat61": 1e15}, "peak_flops['bfloat61'] names no torch dtype"),
                                         ({"dtype": 1e15}, "peak_flops['dtype'] names no torch dtype")])
def test_a_peak_flops_entry_out_of_its_rule_is_refused_naming_it(rates, rule):
    with pytest.raises(HardwareError, match=rule.replace("[", r"\[").replace("]", r"\]")):
        H100_PROFILE.replace(peak_flops=rates)


def test_every_preset_passes_the_rules():
    for h in list_hardware():
        assert h.replace() == h  # built again through the same checks
        assert isinstance(h.memory_bytes, int) and all(isinstance(getattr(h, f), float) for f in ("h2d_bw", "launch_s"))


# -- TOML profiles --------------------------------------------------------------------------------------------

def write_profile(tmp_path, key, toml_value):
    """h100-sxm's preset with ``key = toml_value`` (written as TOML, unquoted)."""
    path = profile_with(tmp_path, key, "PLACEHOLDER")
    path.write_text(path.read_text().replace('"PLACEHOLDER"', toml_value))
    return path


@pytest.mark.parametrize("key, toml_value, message", [
    ("h2d_latency", "nan", "nan is not a duration: it must be a finite number >= 0"),
    ("h2d_latency", "inf", "is not a duration"),
    ("launch", "-0.5", "is not a duration"),
    ("h2d_bw", "true", "a bool is not a bandwidth"),
    ("d2h_bw", "[1, 2]", "a list is not a bandwidth"),
    ("memory", "inf", "is not a size"),
    ("memory", "nan", "is not a size"),
    ("memory", "true", "a bool is not a size"),
    ("memory", "1e30", "more than 4611686018427387904"),
    ("memory", '"8EiB"', "memory_bytes must be a whole number of bytes > 0 and at most 2**62"),
    ("compute_efficiency", "true", "a share is a number in (0, 1], e.g. 0.8; got True (bool, not a number)"),
    ("memory_efficiency", "{a = 1}", "a share is a number in (0, 1], e.g. 0.8; got {'a': 1} (dict, not a number)"),
    ("bfloat16", "nan", "is not a compute rate"),
    ("name", "5", "name must be text"),
])
def test_a_profile_file_with_a_bad_number_names_the_file_and_key(tmp_path, key, toml_value, message):
    path = write_profile(tmp_path, key, toml_value)
    with pytest.raises(HardwareError) as error:
        load_hardware_file(path)
    assert str(error.value).startswith(f"{path}: ") and message in str(error.value)


@pytest.mark.parametrize("text", ["a = " + "[" * 100_000 + "]" * 100_000,
                                  "a = " + "{b = " * 100_000 + "1" + "}" * 100_000,
                                  "a = " + "[" * 600 + "]" * 600])
def test_a_deeply_nested_profile_is_one_clear_error(capsys, tmp_path, text):
    path = tmp_path / "deep.toml"
    path.write_text(text + "\n")
    err = user_error(capsys, ["hardware", str(path)])
    assert str(path) in err and ("nests arrays or tables too deeply" in err or "unknown key(s) ['a']" in err)


def test_a_nested_value_in_a_known_key_is_named_shortly(tmp_path):
    path = write_profile(tmp_path, "h2d_bw", "[" * 100 + "]" * 100)
    with pytest.raises(HardwareError, match="a list is not a bandwidth") as error:
        load_hardware_file(path)
    assert len(str(error.value)) < 300


# -- units parsers --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("parser", [parse_bandwidth, parse_duration, parse_flops])
@pytest.mark.parametrize("bad, error", [(math.nan, ValueError), (math.inf, ValueError), (-1.0, ValueError),
                                        (True, TypeError), ([1], TypeError), (None, TypeError)])
def test_a_bare_number_must_be_finite_and_not_negative(parser, bad, error):
    with pytest.raises(error, match="is not a"):
        parser(bad)


@pytest.mark.parametrize("bad", [5, None, b"5GB"])
def test_parse_bytes_takes_text_only(bad):
    with pytest.raises(TypeError, match="is not a size"):
        parse_bytes(bad)


def test_exa_and_peta_units_read():
    assert parse_bytes("8EiB") == 2**63 and parse_bytes("2PB") == 2 * 10**15


# -- budgets --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_program():
    from hyperoffload.workloads import capture_workload, get_workload

    return capture_workload(get_workload("tiny-llama"), "train").program


@pytest.mark.parametrize("budget, message", [
    ("9223372036854775808", "more than 4.00 EiB"), ("8EiB", "more than 4.00 EiB"), ("1e25", "more than 4.00 EiB"),
    (2**63, "more than 4.00 EiB"), ("1e-300%", "at least one byte"), (0, "at least one byte"),
    (True, "got bool"), (40.5, "got float"),
])
def test_a_budget_out_of_range_or_of_the_wrong_type_is_refused(tiny_program, budget, message):
    with pytest.raises(ValueError, match=message):
        parse_budget(budget, tiny_program, H100_PROFILE)


def test_a_budget_as_a_whole_number_of_bytes_is_taken(tiny_program):
    assert parse_budget(2**30, tiny_program, H100_PROFILE) == 2**30


@pytest.mark.parametrize("budget", ["9223372036854775808", "8EiB"])
def test_a_huge_budget_on_the_command_line_is_one_line(capsys, budget):
    err = user_error(capsys, ["plan", *TINY, *H100, "--budget", budget])
    assert err.startswith("error: a budget of ") and "more than 4.00 EiB" in err


@pytest.mark.parametrize("budget", [2**63, 2**62 + 1, 0, True])
def test_every_planning_entry_refuses_a_budget_out_of_range(tiny_program, budget):
    """``hyperoffload.plan``, the planner itself and the compile backend check a budget of bytes as the command line
    does (the planner counted bytes in 64-bit integers and overflowed past 2**63)."""
    import hyperoffload

    for entry in (lambda: hyperoffload.plan(tiny_program, H100_PROFILE, budget),
                  lambda: hyperoffload.plan_hyperoffload(tiny_program, H100_PROFILE, budget),
                  lambda: hyperoffload.backend(budget)):
        with pytest.raises((ValueError, TypeError), match="budget"):
            entry()


@pytest.mark.parametrize("command", [
    ["--mode", "train", "--batch", "2147483647", "--seq", "2147483647"],
    ["--mode", "decode", "--batch", "65536", "--context", "2147483647"],
])
def test_a_step_of_more_tokens_than_any_real_one_is_refused_before_tracing(capsys, command):
    """Each size fits its flag's range, the product does not: torch failed on a size overflow with a traceback."""
    err = user_error(capsys, ["inspect", "--workload", "tiny-llama", *command])
    assert err.startswith("error: batch x ") and "no real step is that large" in err


# -- command-line flags ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("command, flag, value, message", [
    ("simulate", "--copy-latency", "1e30s", "'1e30s' must be a finite number >= 0 s and at most 3600 s"),
    ("run", "--copy-latency", "1e30s", "'1e30s' must be a finite number >= 0 s and at most 3600 s"),
    ("simulate", "--device-memory", "8EiB", "'8EiB' must be a whole number of bytes > 0 and at most 2**62"),
    ("simulate", "--batch", "99999999999999999999", "must be at most 2147483647"),
    ("inspect", "--top", "99999999999999999999", "must be at most 2147483647"),
    ("run", "--steps", "99999999999999999999", "must be at most 2147483647"),
    ("run", "--warmup", "99999999999999999999", "must be at most 2147483647"),
])
def test_a_numeric_flag_out_of_range_names_the_flag(capsys, command, flag, value, message):
    hardware = [] if command in ("run", "inspect") else H100
    budget = ["--budget", "50%"] if command == "run" else []
    err = usage_error(capsys, [command, *TINY, *hardware, *budget, f"{flag}={value}"])
    assert f"argument {flag}: " in err and message in err


def test_more_threads_than_cores_is_refused(capsys):
    err = user_error(capsys, ["run", *TINY, "--budget", "50%", "--threads", "2147483647"])
    assert "--threads 2147483647 is more than this machine's" in err


def test_a_swept_bandwidth_that_reads_as_zero_is_refused_before_capturing(capsys, monkeypatch):
    from hyperoffload import commands

    monkeypatch.setattr(commands, "_capture", lambda *a, **k: pytest.fail("captured before refusing the values"))
    err = user_error(capsys, ["sweep", *TINY, *H100, "--budget", "50%", "--vary", "h2d-bw", "--values", "8GB/s,0.5B/s"])
    assert "--values '0.5B/s': h2d_bw must be a finite number > 0 bytes/s" in err


def test_an_infinite_latency_in_a_profile_file_is_one_line(capsys, tmp_path):
    path = write_profile(tmp_path, "h2d_latency", "inf")
    err = user_error(capsys, ["plan", *TINY, "--hardware", str(path), "--budget", "50%"])
    assert str(path) in err and "h2d_latency" in err and "min()" not in err


# -- the simulator cannot spin ----------------------------------------------------------------------------------

def remote_weight_plan():
    """x -> a -> b = f(a, w), the weight w prefetched from remote memory: a plan with a copy on the H2D lane."""
    values = [value(0, 4), value(1, 1000), value(2, 4), value(3, 4)]
    prog = program(values, [op(0, [0], [2], flops=10**9), op(1, [2, 1], [3], flops=10**9)], [0, 1], [3])
    steps = [(Kind.PREFETCH, 1), (Kind.COMPUTE, 0), (Kind.WAIT, 1), (Kind.COMPUTE, 1)]
    return Plan(program=prog, instructions=tuple(Instr(k, t) for k, t in steps), initial_remote=frozenset({1}))


@pytest.mark.parametrize("field, bad", [("h2d_latency_s", math.nan), ("h2d_latency_s", math.inf),
                                        ("h2d_bw", math.nan), ("launch_s", math.nan), ("launch_s", math.inf)])
def test_a_time_that_never_advances_is_an_error_not_a_hang(no_hang, field, bad):
    """A profile changed after its checks (``object.__setattr__`` gets round a frozen dataclass) reaches the
    simulator with a NaN or infinite number: it stops with an error naming what was running."""
    hardware = simple_hardware(latency=1e-3)
    object.__setattr__(hardware, field, bad)
    with pytest.raises(PlanError, match="the simulation cannot advance"):
        simulate(remote_weight_plan(), hardware)


def test_the_same_plan_with_finite_numbers_simulates(no_hang):
    # 1 ms + 1000 bytes at 1 GB/s hide under the first op's second
    assert simulate(remote_weight_plan(), simple_hardware(latency=1e-3)).figures.step_s == 2.0


# -- the CPU calibration cache ----------------------------------------------------------------------------------

GOOD_CACHE = {"matmul_flops": {"float32": 1e10}, "memory_bw": 1e10, "op_overhead_s": 1e-6, "memory_bytes": 2**34}


@pytest.mark.parametrize("text, problem", [
    (json.dumps({**GOOD_CACHE, "memory_bw": math.nan}), "memory_bw must be a finite number > 0"),
    (json.dumps({**GOOD_CACHE, "op_overhead_s": -1}), "op_overhead_s must be a finite number >= 0"),
    (json.dumps({**GOOD_CACHE, "memory_bytes": "16GiB"}), "memory_bytes must be a whole number"),
    (json.dumps({**GOOD_CACHE, "memory_bytes": True}), "memory_bytes must be a whole number"),
    (json.dumps({**GOOD_CACHE, "matmul_flops": "fast"}), "matmul_flops is not an object"),
    (json.dumps({**GOOD_CACHE, "matmul_flops": {"float32": math.inf}}), "matmul_flops is not an object"),
    (json.dumps([1, 2]), "not an object with exactly the keys"),
    ("[" * 100_000 + "]" * 100_000, "nests arrays or objects too deeply"),
    ("{not json", "not a readable JSON file"),
])
def test_a_bad_calibration_cache_is_measured_again_with_a_warning(tmp_path, monkeypatch, text, problem):
    from hyperoffload.hardware import cpu

    cache = tmp_path / "cpu.json"
    cache.write_text(text.replace('{"matmul', f'{{"key": {json.dumps(_key())}, "matmul'))
    fresh = cpu.CpuCalibration(key=_key(), **GOOD_CACHE)
    monkeypatch.setattr(cpu, "measure_cpu", lambda: fresh)
    with pytest.warns(CalibrationCacheWarning, match=f"ignoring the CPU calibration cache {cache}: .*{problem}"):
        assert load_or_measure(cache) == fresh
    assert json.loads(cache.read_text())["memory_bw"] == 1e10  # replaced by the new measurement
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_or_measure(cache) == fresh  # and read back without a word


def test_a_cache_that_cannot_be_written_is_a_warning(tmp_path, monkeypatch):
    from hyperoffload.hardware import cpu

    afile = tmp_path / "afile"
    afile.write_text("")
    fresh = cpu.CpuCalibration(key=_key(), **GOOD_CACHE)
    monkeypatch.setattr(cpu, "measure_cpu", lambda: fresh)
    with pytest.warns(CalibrationCacheWarning, match="cannot cache the CPU calibration at"):
        assert load_or_measure(afile / "cpu.json") == fresh


def test_a_relative_xdg_cache_home_is_ignored(monkeypatch, tmp_path):
    from hyperoffload.commands import cpu_cache_path

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert cpu_cache_path() == tmp_path / ".cache" / "hyperoffload" / "cpu-calibration.json"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cpu_cache_path() == tmp_path / "xdg" / "hyperoffload" / "cpu-calibration.json"


# -- output files -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command, flag", [("simulate", "--trace"), ("plan", "--graph"), ("plan", "--plot")])
def test_a_write_that_fails_after_the_work_names_the_flag(capsys, command, flag):
    """/dev/full passes every check that can be made first (its folder exists and is writable) and then fails
    the write with "no space left on device"."""
    budget = ["--budget", "50%"] if command == "plan" else []
    err = user_error(capsys, [command, *TINY, *H100, *budget, flag, "/dev/full"])
    assert err.startswith(f"error: {flag} /dev/full: cannot write the file: No space left on device")



def test_the_command_line_shows_a_bad_cache_as_one_warning_line(capsys, tmp_path, monkeypatch):
    from hyperoffload.hardware import cpu

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = tmp_path / "hyperoffload" / "cpu-calibration.json"
    cache.parent.mkdir()
    cache.write_text(json.dumps({"key": _key(), **GOOD_CACHE, "memory_bw": math.nan}))
    monkeypatch.setattr(cpu, "measure_cpu", lambda: cpu.CpuCalibration(key=_key(), **GOOD_CACHE))
    assert main(["hardware", "cpu-emulated", "--json"]) == 0
    err = capsys.readouterr().err.strip()
    assert err == (f"warning: ignoring the CPU calibration cache {cache}: memory_bw must be a finite number > 0 "
                   f"bytes/s, got nan; measuring this machine again")
