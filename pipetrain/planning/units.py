"""Bandwidths and sizes as people and ``tc`` write them: ``10Gbit``, ``10mbps``, ``1.25GB/s``, ``16GiB``.

[Note: tc's units] One parser serves the planner and the emulated cluster (:mod:`pipetrain.bench.cluster`
hands ``tc`` the rate this module reads, as an integer in ``bit``), so a ``--link`` is planned at the
rate it is emulated at. Every unit ``tc`` knows means what it means to ``tc``, in any case (tc
compares them case-insensitively):

===============================================  ==================================================
``bit kbit mbit gbit tbit`` (and ``kibit`` ...)  bits per second
``bps kbps mbps gbps tbps`` (and ``kibps`` ...)  BYTES per second: ``10mbps`` is 80 Mbit/s, not 10
===============================================  ==================================================

Also read: ``bits``, ``bit/s``, ``bits/s`` (bits); ``B``, ``byte``, ``bytes``, ``B/s``, ``byte/s``
(bytes). Prefixes: ``k m g t`` are powers of 1000, ``ki mi gi ti`` powers of 1024, any case.
Refused as ambiguous: a lone lowercase ``b`` (``10Gb``, ``10Gb/s``), which networking reads as bits
while ``tc``'s case-blind ``Gbps`` is bytes (a factor of 8 on one letter's case), and a rate written
as a bare number (``"1e9"``), bits to ``tc`` but bytes to many readers. A Python number is bytes
(per second). Sizes follow the same rules, a bare number being bytes (as in ``tc``).
"""
from __future__ import annotations

import re

_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
           "ki": 2 ** 10, "mi": 2 ** 20, "gi": 2 ** 30, "ti": 2 ** 40}
# a number, then optionally a prefix and either tc's "bps" or a unit with an optional "/s"
_QUANTITY = re.compile(r"\s*(?P<number>[0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*"
                       r"(?:(?P<prefix>[kmgt]i?)?(?:(?P<tc_bytes>bps)|(?P<unit>bits?|bytes?|b)(?P<per_s>/s)?))?\s*",
                       re.IGNORECASE)


def _parse(text: str | float, what: str, example: str, rate: bool) -> float:
    """Bytes (per second when ``rate``) from a quantity: the prefix applied, bits turned into bytes."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _QUANTITY.fullmatch(text)
        if not m:
            raise ValueError(f"cannot read {what} {text!r}; write it like {example}")
        unit, scaled = m["unit"] or "", m["number"] + (m["prefix"] or "")
        if unit == "b":  # see [Note: tc's units]
            raise ValueError(f"{what} {text!r} is ambiguous (a lone lowercase 'b' may be bits or bytes); "
                             f"write {scaled}bit for bits or {scaled}B{'/s' if rate else ''} for bytes")
        if rate and not (m["tc_bytes"] or unit):
            raise ValueError(f"{what} {text!r} has no unit (tc reads a bare number as bits/s); "
                             f"write {m['number']}bit for bits/s or {m['number']}B/s for bytes/s")
        if not rate and (m["tc_bytes"] or m["per_s"]):
            raise ValueError(f"{what} {text!r} is a rate, not a size; write it like {example}")
        bits = unit.lower().startswith("bit")
        value = float(m["number"]) * _PREFIX[(m["prefix"] or "").lower()] / (8 if bits else 1)
    if value <= 0:
        raise ValueError(f"{what} {text!r} must be positive; write it like {example}")
    return value


def parse_bandwidth(text: str | float, name: str = "bandwidth") -> float:
    """Bytes per second from a rate in tc's units or the usual spellings (see [Note: tc's units]).

    ``10Gbit``, ``1gbit``, ``100Mbit/s`` are bits per second; ``1.25GB/s``, ``10GB`` and ``tc``'s
    ``10mbps``, ``1gbps`` are BYTES per second: ``mbps`` means megabytes per second, as in ``tc``.
    A Python number is bytes per second. ``name`` is what error messages call it.

    Raises:
        ValueError: not a bandwidth, ambiguous (``10Gb/s``, a string without a unit), or not positive.
    """
    return _parse(text, name, "10Gbit or 100mbit (bits/s), 1.25GB/s or 10mbps (bytes/s, as tc)", rate=True)


def parse_bytes(text: str | float, name: str = "size") -> float:
    """Bytes from ``16GiB``, ``16GB``, ``512MiB``, ``8Gbit`` or a number of bytes; ``name`` is what
    error messages call it.

    Raises:
        ValueError: not a size (a rate such as ``1GB/s`` included), ambiguous (``16Gb``), or not positive.
    """
    return _parse(text, name, "16GiB or 512MB", rate=False)


def format_bandwidth(bytes_per_s: float) -> str:
    """``1.25e9`` -> ``10 Gbit/s``."""
    bits = bytes_per_s * 8
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if bits >= scale:
            return f"{bits / scale:.3g} {prefix}bit/s"
    return f"{bits:.3g} bit/s"


def format_bytes(n: float) -> str:
    """``1.5 * 2**30`` -> ``1.5 GiB``."""
    for prefix, scale in (("Ti", 2 ** 40), ("Gi", 2 ** 30), ("Mi", 2 ** 20), ("Ki", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.3g} {prefix}B"
    return f"{n:.0f} B"
