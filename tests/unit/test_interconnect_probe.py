"""The all-gathers ``measure_interconnect`` times are configuration (``InterconnectProbe``), checked when made and
reported with the figures they gave."""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from hyperoffload.runtime.interconnect import Interconnect, InterconnectProbe, measure_interconnect


@pytest.mark.parametrize("fields", [{"small_bytes": 0}, {"small_bytes": 8 << 20, "large_bytes": 4 << 10},
                                    {"small_bytes": 1 << 20, "large_bytes": 1 << 20}, {"repeats": 0}])
def test_a_probe_that_cannot_tell_bandwidth_from_latency_is_refused(fields):
    with pytest.raises(ValueError, match="probe needs"):
        InterconnectProbe(**fields)


def test_the_figures_name_the_sizes_that_were_gathered():
    probe = InterconnectProbe(small_bytes=1024, large_bytes=1 << 20, repeats=2)
    link = Interconnect(ranks=2, bw=1e9, latency_s=1e-5, small_s=2e-5, large_s=5e-4, probe=probe)
    figures = link.as_dict()
    assert (figures["all_gather_small_bytes"], figures["all_gather_large_bytes"]) == (1024, 1 << 20)
    # By default a 4 KiB gather sets the latency and an 8 MiB one the bandwidth, five timed repeats of each.
    default = Interconnect(ranks=2, bw=1.0, latency_s=0.0, small_s=0.0, large_s=0.0).probe
    assert (default.small_bytes, default.large_bytes, default.repeats) == (4096, 8 << 20, 5)


def test_one_rank_has_no_interconnect_to_measure(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        with pytest.raises(ValueError, match="2 ranks or more"):
            measure_interconnect(probe=InterconnectProbe(repeats=1))
    finally:
        dist.destroy_process_group()
