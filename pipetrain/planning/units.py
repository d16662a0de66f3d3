"""Bandwidths and sizes written the way people write them: ``10Gbit``, ``1.25GB/s``, ``16GiB``."""
from __future__ import annotations

import re

_PREFIX = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
           "ki": 2 ** 10, "mi": 2 ** 20, "gi": 2 ** 30, "ti": 2 ** 40}
# number, prefix, unit, optional "/s" or "ps"
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(ki|mi|gi|ti|k|m|g|t)?"
                       r"(bits?|bytes?|b)?(/s|ps)?\s*$", re.IGNORECASE)


def _parse(text: str | float, what: str, example: str) -> float:
    """Bytes (per second) from a quantity: the prefix applied, bits turned into bytes; must be > 0."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = _QUANTITY.match(text)
        if not m or (m.group(2) and not m.group(3)):
            raise ValueError(f"cannot read {what} {text!r}; write it like {example}")
        number, prefix, unit = float(m.group(1)), (m.group(2) or "").lower(), m.group(3) or ""
        # "Gb" is bits and "GB" bytes, as in networking; spelled-out "bit"/"byte" may take any case.
        is_bits = unit.lower().startswith("bit") or unit == "b"
        value = number * _PREFIX[prefix] / (8 if is_bits else 1)
    if value <= 0:
        raise ValueError(f"{what} {text!r} must be positive")
    return value


def parse_bandwidth(text: str | float) -> float:
    """Bytes per second from ``10Gbit``, ``1gbit``, ``100Mbit/s``, ``25Gbps``, ``1.25GB/s`` or a
    number (bytes per second).

    Raises:
        ValueError: not a bandwidth, or not positive.
    """
    return _parse(text, "bandwidth", "10Gbit, 100Mbit or 1.25GB/s")


def parse_bytes(text: str | float) -> float:
    """Bytes from ``16GiB``, ``16GB``, ``512MiB`` or a number of bytes.

    Raises:
        ValueError: not a size, or not positive.
    """
    return _parse(text, "size", "16GiB or 512MB")


def format_bandwidth(bytes_per_s: float) -> str:
    """``1.25e9`` -> ``10 Gbit/s``."""
    bits = bytes_per_s * 8
    for prefix, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if bits >= scale:
            return f"{bits / scale:g} {prefix}bit/s"
    return f"{bits:g} bit/s"


def format_bytes(n: float) -> str:
    """``1.5 * 2**30`` -> ``1.5 GiB``."""
    for prefix, scale in (("Ti", 2 ** 40), ("Gi", 2 ** 30), ("Mi", 2 ** 20), ("Ki", 2 ** 10)):
        if n >= scale:
            return f"{n / scale:.3g} {prefix}B"
    return f"{n:.0f} B"
