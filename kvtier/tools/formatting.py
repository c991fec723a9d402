"""Sizes, ages and aligned tables for the operator tools' text output."""

from __future__ import annotations

from collections.abc import Sequence

_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")
_AGE_UNITS = (("w", 604_800), ("d", 86_400), ("h", 3_600), ("m", 60))


def human_bytes(n: int) -> str:
    """``n`` bytes as ``"512 B"``, ``"1.5 KiB"``, ``"7.9 MiB"``..."""
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    index = 0
    while value >= 1024 and index < len(_UNITS) - 1:
        value /= 1024
        index += 1
    return f"{value:.1f} {_UNITS[index]}"


def human_age(seconds: float | None) -> str:
    """An age as ``"42s"``, ``"5m"``, ``"3h"``, ``"2d"``, ``"4w"`` (``"-"`` for None)."""
    if seconds is None:
        return "-"
    for unit, size in _AGE_UNITS:
        if seconds >= size:
            return f"{int(seconds // size)}{unit}"
    return f"{int(max(seconds, 0.0))}s"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """Aligned lines: the first ``left`` columns left-justified, the rest right."""
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row, strict=True)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return [line(headers), *map(line, rows)]


def printable(text: str, limit: int = 120) -> str:
    """``text`` without control characters (``?`` instead), at most ``limit`` long."""
    clean = "".join(c if c.isprintable() else "?" for c in text)
    return clean if len(clean) <= limit else clean[: limit - 3] + "..."


def plural(n: int, word: str, many: str | None = None) -> str:
    """``"1 block"``, ``"2 blocks"``."""
    return f"{n} {word if n == 1 else (many or word + 's')}"
