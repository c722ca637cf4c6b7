"""Byte counts as people write them ("8M", "512KiB", 8388608): one parser for the
configuration and every command line."""

from __future__ import annotations

from typing import Any

MiB = 1 << 20

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": MiB, "mb": MiB,
          "mib": MiB, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_byte_count(value: Any) -> int | None:
    """``value`` as bytes: a whole number, or a string with an optional binary unit
    (k, M, G; "MiB" and "MB" mean the same). None when it is neither."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        number = text.rstrip("kmgib ")
        unit = text[len(number):].strip()
        try:
            if unit in _UNITS:
                return int(float(number) * _UNITS[unit])
        except ValueError:
            pass
    return None
