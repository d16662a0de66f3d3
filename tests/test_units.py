"""Bandwidths and sizes: one parser with tc's meaning, shared by the planner and the emulated cluster.

The table is written from tc(8)'s RATES section ("bit or a bare number: bits per second", "bps: bytes
per second", units compared case-insensitively), not from the parser.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest

from pipetrain.bench.cluster import link_bits_per_s
from pipetrain.planning import parse_bandwidth, parse_bytes

BYTES_PER_S = {
    # tc's bit units
    "1bit": 1 / 8, "1gbit": 1.25e8, "100mbit": 1.25e7, "500kbit": 62_500, "1tbit": 1.25e11,
    "1kibit": 1024 / 8, "2.5gbit": 3.125e8, "1e9bit": 1.25e8,
    # tc's byte units: "mbps" is megaBYTES per second
    "8bps": 8, "10kbps": 1e4, "10mbps": 1e7, "1gbps": 1e9, "1tbps": 1e12, "1kibps": 1024, "1mibps": 2 ** 20,
    # tc reads units in any case
    "10Mbit": 1.25e6, "10GBIT": 1.25e9, "10MBps": 1e7, "10Mbps": 1e7, "10MBPS": 1e7, "25Gbps": 25e9,
    # the other spellings
    "10Gbit": 1.25e9, "100Mbit/s": 1.25e7, "10 bits/s": 1.25, "2.5 Gbit": 3.125e8,
    "1.25GB/s": 1.25e9, "1.25GB": 1.25e9, "3 bytes/s": 3, "64KiB/s": 65536,
}


@pytest.mark.parametrize("text, expected", BYTES_PER_S.items())
def test_bandwidth_spellings(text: str, expected: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("text", [t for t in BYTES_PER_S if BYTES_PER_S[t] * 8 >= 1])
def test_the_cluster_emulates_what_the_planner_plans(text: str) -> None:
    assert link_bits_per_s(text) == round(BYTES_PER_S[text] * 8)
    assert isinstance(link_bits_per_s(text), int)


def test_numbers_and_sizes() -> None:
    assert parse_bandwidth(5e8) == 5e8 and link_bits_per_s(5e8) == 4 * 10**9  # a Python number: bytes/s
    assert parse_bytes("16GiB") == 16 * 2 ** 30 and parse_bytes("512MB") == 512e6
    assert parse_bytes("8Gbit") == 1e9 and parse_bytes("1024") == 1024  # a bare size is bytes, as in tc


@pytest.mark.parametrize("parse, text, message", [
    (parse_bandwidth, "fast", "cannot read bandwidth 'fast'; write it like 10Gbit"),
    (parse_bandwidth, "10G", "cannot read bandwidth '10G'"),
    (parse_bandwidth, "", "cannot read bandwidth ''"),
    (parse_bandwidth, "1gbps/s", "cannot read bandwidth '1gbps/s'"),
    (parse_bandwidth, "-1Gbit", "cannot read bandwidth '-1Gbit'"),
    (parse_bandwidth, "0bit", "bandwidth '0bit' must be positive"),
    (parse_bandwidth, "10Gb", "'10Gb' is ambiguous .* write 10Gbit for bits or 10GB/s for bytes"),
    (parse_bandwidth, "25 Gb/s", "'25 Gb/s' is ambiguous .* write 25Gbit for bits or 25GB/s for bytes"),
    (parse_bandwidth, "1e9", "'1e9' has no unit .* write 1e9bit for bits/s or 1e9B/s for bytes/s"),
    (parse_bytes, "1GB/s", "size '1GB/s' is a rate, not a size"),
    (parse_bytes, "1mbps", "size '1mbps' is a rate, not a size"),
    (parse_bytes, "16Gb", "'16Gb' is ambiguous .* write 16Gbit for bits or 16GB for bytes"),
    (link_bits_per_s, "fast", "cannot read bandwidth 'fast'"),
])
def test_junk_fails_with_one_line(parse: Callable[[str], float], text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as e:
        parse(text)
    assert "\n" not in str(e.value)
