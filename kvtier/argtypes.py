"""Argument types shared by kvtier's command-line tools, and the check of an
int argument that library code shares."""

from __future__ import annotations

import argparse
import math
from collections.abc import Collection


def require_positive_int(name: str, value: object) -> int:
    """``value`` if it is an int >= 1 (bools refused); ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def is_positive_seconds(value: object) -> bool:
    """Whether ``value`` is a finite number of seconds > 0 (bools, NaN and
    infinity are not: a NaN interval compares false with everything, so a
    timer built on it never fires)."""
    return (not isinstance(value, bool) and isinstance(value, (int, float))
            and 0 < value < math.inf)


def positive_int(text: str) -> int:
    """Parse an int >= 1 (an argparse ``type``)."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """Parse an int >= 0 (an argparse ``type``)."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40}


def parse_byte_size(text: str) -> int:
    """Parse a byte count >= 1: ``8000000000``, ``8e9``, ``8G``/``8GB`` (10**9) or
    ``8Gi``/``8GiB`` (2**30); ``ValueError`` saying what is wrong. The one parser
    of sizes: the command-line flags (``byte_size``) and the byte-size settings
    (``kvtier.vllm.settings.BYTE_KEYS``) both read sizes with it."""
    if not isinstance(text, str):
        raise TypeError(f"a byte count to parse is text, got {type(text).__name__}")
    raw = text.strip().upper().removesuffix("B")
    number = raw.rstrip("KMGTI")
    unit = raw[len(number):]
    try:
        value = float(number) * _UNITS[unit]
    except (KeyError, ValueError):
        raise ValueError(f"not a byte count: {text!r} (e.g. 8000000000, 8G, 8GiB)") from None
    if value != value or value < 1 or value > 1 << 62 or value != int(value):
        raise ValueError(f"not a whole byte count >= 1: {text!r}")
    return int(value)


def byte_size(text: str) -> int:
    """``parse_byte_size`` as an argparse ``type`` (its error is argparse's)."""
    try:
        return parse_byte_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def int_list(text: str) -> list[int]:
    """Parse ``N[,N...]`` of ints >= 1, duplicates dropped (argparse type)."""
    return list(dict.fromkeys(positive_int(part.strip()) for part in text.split(",")))


MAX_SEEDS = 100
"""Most seeds one seed list takes: each seed is a whole set of runs, so more is
almost surely a typo (``0-1000000`` for ``0-10``)."""
MAX_SEED = (1 << 64) - 1
"""The largest seed: a key seed is the 8-byte BLAKE2b key of
``kvtier.replay.rekey.rekeyed``."""


def seed_list(text: str) -> list[int]:
    """Parse ``S[,S...]``, each part a seed or an inclusive range ``A-B``, of
    ints in [0, 2**64), duplicates dropped, at most ``MAX_SEEDS`` (argparse
    type: ``ArgumentTypeError`` naming the bad part)."""
    seeds: dict[int, None] = {}
    for part in text.split(","):
        low, sep, high = part.strip().partition("-")
        if sep and not low:
            raise argparse.ArgumentTypeError(f"seeds are >= 0, got {part.strip()!r}")
        first = _seed(low, part)
        last = _seed(high, part) if sep else first
        if last < first:
            raise argparse.ArgumentTypeError(f"range {part.strip()!r} runs backwards")
        if last - first < MAX_SEEDS:  # else the range alone is too long
            seeds.update(dict.fromkeys(range(first, last + 1)))
        if len(seeds) > MAX_SEEDS or last - first >= MAX_SEEDS:
            raise argparse.ArgumentTypeError(
                f"at most {MAX_SEEDS} seeds (each is a whole set of runs)")
    return list(seeds)


def _seed(text: str, part: str) -> int:
    """One seed of ``part``; ``ArgumentTypeError`` naming ``part``."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a seed or a range A-B: {part.strip()!r}") from None
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"a seed is in [0, 2**64), got {value}")
    return value


def name_list(text: str) -> list[str]:
    """Parse ``NAME[,NAME...]``, duplicates dropped (argparse type)."""
    names = [part.strip() for part in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"empty name in {text!r}")
    return list(dict.fromkeys(names))


def policy_list(text: str) -> list[str]:
    """Parse ``POLICY[,POLICY...]``, each a registered eviction policy or a
    ``module:Class`` that loads (argparse type; the error names the policy)."""
    from kvtier.policies import policy_class  # the policies need not load for other types

    names = name_list(text)
    for name in names:
        try:
            policy_class(name)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return names


def known_name_list(text: str, known: Collection[str], what: str) -> list[str]:
    """``name_list``, each name one of ``known`` (argparse type helper; an
    unknown name is reported with ``what`` it should have been)."""
    names = name_list(text)
    bad = [n for n in names if n not in known]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {bad[0]!r} (choose from {', '.join(known)})")
    return names
