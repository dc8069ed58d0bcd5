"""argparse types for the CLI's numbers and devices: a bad value is argparse's one-line usage
error naming the option, never a traceback from deep in the server or the harness."""

from __future__ import annotations

import argparse
import math


def count(text: str) -> int:
    """An integer of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def whole(text: str) -> int:
    """An integer of at least 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, not {value}")
    return value


def positive(text: str) -> float:
    """A finite number above 0 (seconds, rates, means)."""
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number above 0, not {text}")
    return value


def non_negative(text: str) -> float:
    """A finite number of at least 0 (a grace period that may be none)."""
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, not {text}")
    return value


def byte_size(text: str) -> int:
    """A size above 0 bytes, e.g. 1MiB."""
    from mox.errors import InvalidRequestError
    from mox.units import parse_size

    try:
        value = parse_size(text)
    except InvalidRequestError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not value:
        raise argparse.ArgumentTypeError(f"must be above 0 bytes, not {text}")
    return value


def port(text: str) -> int:
    """A TCP port; 0 asks the system for a free one."""
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], not {value}")
    return value


def device(text: str) -> str:
    """cpu, or cuda / cuda:N where this machine has that GPU (the router's own check)."""
    from mox.errors import InvalidRequestError
    from mox.router.served_model import resolve_device

    try:
        resolve_device(text)
    except InvalidRequestError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text
