import json

import pytest

from hyperoffload.cost import op_time, roofline_time, transfer_time
from hyperoffload.hardware import PRESET_NAMES, HardwareError, get_hardware, list_hardware, load_hardware_file
from hyperoffload.hardware.cpu import cpu_emulated, load_or_measure
from hyperoffload.ir import Op, Phase, ValueKind
from programs import program, value

REQUIRED = {"a100-80g", "h100-sxm", "h200", "gh200", "ascend-910b", "ascend-910c", "mi300x", "cpu-emulated"}


def test_every_preset_loads_with_a_source_for_every_number():
    assert REQUIRED <= set(PRESET_NAMES)
    for h in list_hardware():
        for field in ("memory_bytes", "hbm_bw", "h2d_bw", "d2h_bw", "peak_flops", "duplex_share", "launch_s",
                      "h2d_latency_s", "compute_efficiency", "memory_efficiency"):
            assert h.sources.get(field), f"{h.name}: no source for {field}"


def test_preset_numbers_follow_the_references():
    h100 = get_hardware("h100-sxm")
    assert h100.memory_bytes == 80 * 2**30
    assert h100.flops_for("bfloat16") == 989e12 and h100.hbm_bw == 3.35e12 and h100.h2d_bw == 55e9
    gh200 = get_hardware("gh200")
    assert gh200.h2d_bw == 350e9 and gh200.d2h_bw == 297e9 and gh200.duplex_share == 0.5
    # dtypes without their own figure fall back to float32's, or the slowest listed
    assert h100.flops_for("int64") == 67e12
    assert get_hardware("ascend-910c").flops_for("float32") == 752e12


USER_PROFILE = '''name = "mine"
memory = "24GiB"
hbm_bw = "1TB/s"
h2d_bw = "16GB/s"
d2h_bw = 12e9
h2d_latency = "10us"
d2h_latency = 1e-5
duplex_share = 0.6
launch = "4us"
compute_efficiency = 0.7
memory_efficiency = 0.8
[peak_flops]
bfloat16 = "100TFLOP/s"
'''


def test_user_profile_from_toml(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(USER_PROFILE + '[sources]\nh2d_bw = "my measurement"\n')
    h = get_hardware(str(path))
    assert (h.memory_bytes, h.h2d_bw, h.d2h_bw, h.h2d_latency_s) == (24 * 2**30, 16e9, 12e9, 1e-5)
    assert h.sources["h2d_bw"] == "my measurement"
    changed = h.replace(h2d_bw=25e9)
    assert changed.h2d_bw == 25e9 and changed.sources["h2d_bw"] == "set by the user"


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.replace('h2d_bw = "16GB/s"', 'h2d_bw = "fast"'), "h2d_bw = 'fast'"),
    (lambda t: t.replace('duplex_share = 0.6', 'duplex_share = 1.5'), r"duplex_share must be in \(0, 1\]"),
    (lambda t: t.replace('memory = "24GiB"\n', ''), r"missing key\(s\) \['memory'\]"),
    (lambda t: 'colour = "red"\n' + t, r"unknown key\(s\) \['colour'\]"),
    (lambda t: t.replace('name = "mine"', 'name = "mine'), "not valid TOML"),
])
def test_malformed_profiles_are_clear_errors(tmp_path, edit, message):
    path = tmp_path / "bad.toml"
    path.write_text(edit(USER_PROFILE))
    with pytest.raises(HardwareError, match=message):
        load_hardware_file(path)


def test_unknown_hardware_lists_the_names():
    with pytest.raises(HardwareError, match="unknown hardware 'tpu'.*h100-sxm"):
        get_hardware("tpu")


def test_cpu_calibration_is_measured_once_and_cached(tmp_path):
    cache = tmp_path / "cpu.json"
    first = load_or_measure(cache)
    assert cache.is_file()
    assert all(rate > 0 for rate in first.matmul_flops.values()) and first.memory_bw > 0 and first.op_overhead_s > 0
    assert load_or_measure(cache) == first  # read back, not measured again
    cache.write_text(json.dumps({**json.loads(cache.read_text()), "key": "another machine"}))
    assert load_or_measure(cache).key != "another machine"  # a stale cache is replaced
    h = cpu_emulated(first, h2d_bw=3e9, latency_s=1e-4)
    assert h.h2d_bw == 3e9 and h.d2h_latency_s == 1e-4 and h.name == "cpu-emulated"


def make_op(flops, read, written, target="aten.mul.Tensor"):
    return Op(id=0, name="op", target=target, inputs=(0,), outputs=(1,), phase=Phase.FORWARD, flops=flops,
              bytes_read=read, bytes_written=written)


def test_roofline_takes_the_slower_of_compute_and_memory_plus_launch():
    h = get_hardware("h100-sxm")
    prog = program([value(0, 8, ValueKind.INPUT), value(1, 8)], [make_op(1, 8, 8)], [0], [1])
    values = prog.values
    compute_bound = make_op(10**12, 8, 8)
    memory_bound = make_op(1, 10**9, 10**9)
    # float32 (the test values' dtype): 67 TFLOP/s at 0.75 efficiency
    assert roofline_time(compute_bound, prog, h) == pytest.approx(1e12 / (67e12 * 0.75) + 5e-6)
    assert roofline_time(memory_bound, prog, h) == pytest.approx(2e9 / (3.35e12 * 0.85) + 5e-6)
    view = make_op(0, 0, 0, target="aten.view.default")
    assert op_time(view, prog, h) == 0.0
    assert values[0].dtype == "float32"


def test_transfer_time_is_latency_plus_bytes_over_bandwidth():
    assert transfer_time(10**9, 50e9, 8e-6) == pytest.approx(0.02 + 8e-6)


def test_the_detail_table_shows_profile_file_keys_whose_values_read_back():
    """A row of ``hardware NAME`` can be copied into a profile file: its key is one the file takes and its
    value, units and all, reads back to the profile's figure (to the table's rounding)."""
    import pytest

    from hyperoffload.hardware.profile import _OPTIONAL, _READERS
    from hyperoffload.report.hardware import hardware_detail

    h = get_hardware("h100-sxm").replace(issue_s=2e-6)  # issue is optional: shown where set
    table = hardware_detail(h)
    keys, values = table.columns[0]._cells, table.columns[1]._cells
    readers = {**_READERS, **_OPTIONAL}
    assert "issue" in keys and set(keys) - {"peak_flops"} <= set(readers)
    for key, text in zip(keys, values):
        if key == "peak_flops":
            continue
        field, read = readers[key]
        assert read(text) == pytest.approx(getattr(h, field), rel=1e-2), key
