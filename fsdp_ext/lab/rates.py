"""Link rates as users write them ("200mbit", "1gbit"), checked before anything is built."""

from __future__ import annotations

import re

__all__ = ["format_rate", "parse_rate"]

_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit)\s*$", re.IGNORECASE)


def parse_rate(rate: str | int, *, name: str = "link") -> int:
    """Bits per second of ``rate``: an int, or a number with a unit (bit, kbit, mbit, gbit).

    Byte units are refused on purpose: tc reads "mbps" as megabytes per second, which is
    the classic way to get a link eight times faster than intended.
    """
    if isinstance(rate, bool):
        raise ValueError(f"{name} must be a rate like 200mbit or 1gbit, got {rate!r}")
    if isinstance(rate, int):
        bits = rate
    else:
        match = _RATE.match(str(rate))
        if match is None:
            raise ValueError(
                f"{name} must be a rate like 200mbit or 1gbit (units: bit, kbit, mbit, gbit), "
                f"got {rate!r}"
            )
        bits = round(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if not 10**5 <= bits <= 10**11:
        raise ValueError(f"{name} must be between 100kbit and 100gbit, got {rate!r}")
    return bits


def format_rate(bits: int) -> str:
    """The shortest exact spelling: 200000000 -> "200mbit"."""
    for unit in ("gbit", "mbit", "kbit"):
        if bits % _UNITS[unit] == 0:
            return f"{bits // _UNITS[unit]}{unit}"
    return f"{bits}bit"
