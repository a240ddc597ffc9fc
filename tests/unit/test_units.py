import pytest

from hyperoffload.units import format_bytes, format_count, parse_bytes


@pytest.mark.parametrize("text, expected", [("40GiB", 40 * 2**30), ("60GB", 60 * 10**9), ("1024", 1024),
                                            ("1.5 MiB", 1572864), ("2kb", 2000)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "12 parsecs", "-5GB"])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match="cannot read"):
        parse_bytes(text)


def test_format():
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(1002 * 2**20) == "1002 MiB"
    assert format_count(1.5e12) == "1.50 T"


def test_rates_and_durations():
    from hyperoffload.units import parse_bandwidth, parse_duration, parse_flops

    assert parse_bandwidth("25GB/s") == 25e9
    assert parse_bandwidth("1GiB/s") == 2**30
    assert parse_bandwidth(3.5e9) == 3.5e9
    assert parse_duration("10us") == 1e-05 and parse_duration("2ms") == 0.002 and parse_duration(0.5) == 0.5
    assert parse_flops("989TFLOP/s") == 989e12
    for bad, parser in (("25GB", parse_bandwidth), ("fast", parse_duration), ("9 TFLOPS", parse_flops)):
        with pytest.raises(ValueError, match="cannot read"):
            parser(bad)
