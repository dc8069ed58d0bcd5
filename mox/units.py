"""Byte sizes as users write them: 536870912, "512MiB", "2GiB", "1.5GB"."""

from __future__ import annotations

import re

from mox.errors import InvalidRequestError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2,
          "mib": 1 << 20, "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4,
          "tb": 1000**4, "tib": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(size: int | str | None) -> int | None:
    """None stays None (no budget); ints are bytes; strings take a unit suffix."""
    if size is None or (isinstance(size, int) and not isinstance(size, bool)):
        if isinstance(size, int) and size < 0:
            raise InvalidRequestError(f"size must be >= 0, got {size}")
        return size
    match = _SIZE.match(str(size))
    unit = match and _UNITS.get(match.group(2).lower())
    if not match or unit is None:
        raise InvalidRequestError(f"cannot read size {size!r}; write e.g. 512MiB, 2GiB, 1000000")
    return int(float(match.group(1)) * unit)
