"""Argument types shared by kvtier's command-line tools."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """Parse an int >= 1 (an argparse ``type``)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
