"""What the package's commands share."""

from __future__ import annotations

import argparse


def at_least_one(text: str) -> int:
    """An argparse type: a whole number of 1 or more (argparse then exits 2 with the message)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value
