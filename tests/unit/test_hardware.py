import json

import pytest

from hyperoffload.cost import op_time, roofline_time, transfer_time
from hyperoffload.hardware import PRESET_NAMES, HardwareError, get_hardware, list_hardware, load_hardware_file
from hyperoffload.hardware.cpu import cpu_emulated, load_or_measure
from hyperoffload.ir import Op, Phase, ValueKind
from programs import program, value

REQUIRED = {"a100-80g", "h100-sxm", "h200", "gh200", "ascend-910b", "ascend-910c", "mi300x", "cpu-emulated",
            "dgx-h100", "hgx-h200", "gh200-nvl", "ascend-910c-superpod"}
MULTI_DEVICE = ("dgx-h100", "hgx-h200", "gh200-nvl", "ascend-910c-superpod")
INTERCONNECT = ("devices_per_node", "nodes", "intra_node_bw", "intra_node_latency_s", "inter_node_bw",
                "inter_node_latency_s", "host_memory_bytes", "host_link_shared_by")


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


def test_every_multi_device_preset_has_a_source_for_every_interconnect_field():
    for name in MULTI_DEVICE:
        h = get_hardware(name)
        assert h.device_count > 1, name
        for field in INTERCONNECT:
            assert h.sources.get(field), f"{name}: no source for {field}"


def test_single_device_presets_keep_one_device_and_no_network():
    for h in list_hardware():
        if h.name in MULTI_DEVICE:
            continue
        assert (h.devices_per_node, h.nodes, h.device_count, h.host_link_shared_by) == (1, 1, 1, 1), h.name
        assert (h.intra_node_bw, h.inter_node_bw, h.host_memory_bytes) == (0, 0, 0), h.name


def test_multi_device_presets_reuse_their_single_device_numbers():
    """A node's device is the single-device preset's device: the same memory, compute and host link (gh200-nvl is
    the HBM3e variant of gh200: its own memory, the same compute and NVLink-C2C)."""
    per_device = ("peak_flops", "h2d_bw", "d2h_bw", "h2d_latency_s", "duplex_share", "launch_s", "compute_efficiency",
                  "memory_efficiency")
    for multi, single in (("dgx-h100", "h100-sxm"), ("hgx-h200", "h200"), ("gh200-nvl", "gh200"),
                          ("ascend-910c-superpod", "ascend-910c")):
        m, s = get_hardware(multi), get_hardware(single)
        for field in per_device:
            assert getattr(m, field) == getattr(s, field), (multi, field)
        if multi != "gh200-nvl":
            assert (m.memory_bytes, m.hbm_bw) == (s.memory_bytes, s.hbm_bw), multi


def test_interconnect_numbers_follow_the_references():
    dgx = get_hardware("dgx-h100")
    assert (dgx.devices_per_node, dgx.nodes, dgx.device_count) == (8, 32, 256)
    assert (dgx.intra_node_bw, dgx.inter_node_bw, dgx.host_memory_bytes) == (450e9, 50e9, 2 * 2**40)
    assert (dgx.intra_node_latency_s, dgx.inter_node_latency_s) == (3.4e-6, 14e-6)
    nvl = get_hardware("gh200-nvl")
    assert (nvl.devices_per_node, nvl.nodes, nvl.intra_node_bw, nvl.inter_node_bw) == (2, 16, 450e9, 450e9)
    assert nvl.host_memory_bytes == 960e9 and nvl.host_link_shared_by == 1
    pod = get_hardware("ascend-910c-superpod")
    assert (pod.device_count, pod.intra_node_bw, pod.inter_node_bw) == (384, 392e9, 380e9)
    assert pod.host_memory_bytes == 0 and "Not published" in pod.sources["host_memory_bytes"]


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


def test_a_user_profile_may_describe_its_machine(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(USER_PROFILE.replace("[peak_flops]", 'devices_per_node = 4\nnodes = "2"\nintra_node_bw = "100GB/s"\n'
                                         'intra_node_latency = "2us"\ninter_node_bw = 25e9\ninter_node_latency = 1e-5\n'
                                         'host_memory = "512GiB"\nhost_link_shared_by = 2\n[peak_flops]')
                    + '[sources]\nintra_node_bw = "my nccl-tests run"\nhost_memory = "free -g"\n')
    h = load_hardware_file(path)
    assert (h.devices_per_node, h.nodes, h.device_count, h.host_link_shared_by) == (4, 2, 8, 2)
    assert (h.intra_node_bw, h.intra_node_latency_s, h.inter_node_bw, h.inter_node_latency_s) == (100e9, 2e-6, 25e9,
                                                                                                 1e-5)
    assert h.host_memory_bytes == 512 * 2**30
    assert h.sources["intra_node_bw"] == "my nccl-tests run" and h.sources["host_memory_bytes"] == "free -g"
    bigger = h.replace(nodes=4)
    assert bigger.device_count == 16 and bigger.sources["nodes"] == "set by the user"
    assert isinstance(bigger.nodes, int) and isinstance(bigger.intra_node_bw, float)


@pytest.mark.parametrize("lines, message", [
    ('devices_per_node = 0', r"devices_per_node must be a whole number >= 1"),
    ('devices_per_node = 8.5', r"devices_per_node = 8.5: a count is a whole number"),
    ('nodes = "8.5"', r"nodes = '8.5' .*: a count is a whole number written without a unit"),
    ('nodes = true', r"nodes = True .*: a count is a whole number"),
    ('nodes = 4', r"nodes = 4 needs inter_node_bw.*inter_node_bw = \"50GB/s\""),
    ('devices_per_node = 8', r"devices_per_node = 8 needs intra_node_bw.*intra_node_bw = \"450GB/s\""),
    ('devices_per_node = 2\nintra_node_bw = "1GB/s"\nhost_link_shared_by = 4',
     r"host_link_shared_by = 4 is more than the node's devices_per_node = 2"),
    ('intra_node_bw = "-1GB/s"', r"intra_node_bw = '-1GB/s' .*: cannot read"),
    ('inter_node_bw = nan', r"inter_node_bw = nan.*is not a bandwidth"),
    ('intra_node_latency = "2h"', r"intra_node_latency = '2h' .*: cannot read '2h' as a duration"),
    ('inter_node_latency = 7200', r"inter_node_latency_s must be a finite number >= 0 s and at most 3600 s"),
    ('host_memory = 512', r"host_memory = 512: a bare number is bytes, so host_memory would be 512 bytes.*512GiB"),
    ('host_memory = "-1TB"', r"host_memory = '-1TB' .*: cannot read"),
    ('nodes = 2000000\ninter_node_bw = "1GB/s"', r"nodes must be a whole number >= 1 and at most 2\*\*20"),
])
def test_bad_interconnect_values_are_clear_errors(tmp_path, lines, message):
    path = tmp_path / "bad.toml"
    path.write_text(USER_PROFILE.replace("[peak_flops]", lines + "\n[peak_flops]"))
    with pytest.raises(HardwareError, match=message):
        load_hardware_file(path)


def test_host_memory_zero_says_not_stated(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(USER_PROFILE.replace("[peak_flops]", "host_memory = 0\n[peak_flops]"))
    assert load_hardware_file(path).host_memory_bytes == 0


@pytest.mark.parametrize("changes, message", [
    ({"devices_per_node": 8}, "devices_per_node = 8 needs intra_node_bw"),
    ({"nodes": 2, "devices_per_node": 1}, "nodes = 2 needs inter_node_bw"),
    ({"intra_node_bw": -1.0}, r"intra_node_bw must be a finite number >= 0 bytes/s \(0: no such link\)"),
    ({"nodes": 2.0, "inter_node_bw": 1e9}, "nodes must be a whole number >= 1"),
    ({"host_memory_bytes": 2**63}, "host_memory_bytes must be a whole number of bytes >= 0"),
    ({"host_link_shared_by": True}, "host_link_shared_by must be a whole number >= 1"),
])
def test_replace_checks_the_interconnect_fields(changes, message):
    with pytest.raises(HardwareError, match=message):
        get_hardware("h100-sxm").replace(**changes)


def test_the_detail_table_shows_interconnect_rows_only_where_a_profile_has_them():
    from hyperoffload.report.hardware import hardware_detail

    def keys(h):
        return hardware_detail(h).columns[0]._cells

    assert "devices_per_node" not in keys(get_hardware("h100-sxm"))
    shown = keys(get_hardware("dgx-h100"))
    assert {"devices_per_node", "nodes", "intra_node_bw", "intra_node_latency", "inter_node_bw",
            "inter_node_latency", "host_memory", "host_link_shared_by"} <= set(shown)
    assert "host_memory" in keys(get_hardware("ascend-910c-superpod"))  # 0, with a source saying why


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

    h = get_hardware("dgx-h100").replace(issue_s=2e-6)  # issue is optional: shown where set
    table = hardware_detail(h)
    keys, values = table.columns[0]._cells, table.columns[1]._cells
    readers = {**_READERS, **_OPTIONAL}
    assert "issue" in keys and "intra_node_bw" in keys and set(keys) - {"peak_flops"} <= set(readers)
    for key, text in zip(keys, values):
        if key == "peak_flops":
            continue
        field, read = readers[key]
        assert read(text) == pytest.approx(getattr(h, field), rel=1e-2), key
