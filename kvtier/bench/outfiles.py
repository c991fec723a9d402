"""The benchmarks' result files: earlier results are moved aside, never emptied,
and a file is written whole or not at all."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from kvtier.atomic_files import atomic_path


def aside_path(path: Path, number: int) -> Path:
    """``path`` with ``.number`` appended (``runs.jsonl`` -> ``runs.jsonl.1``)."""
    return path.with_name(f"{path.name}.{number}")


def free_number(*paths: Path) -> int:
    """The smallest N >= 1 for which no ``PATH.N`` of ``paths`` exists."""
    number = 1
    while any(os.path.lexists(aside_path(p, number)) for p in paths):
        number += 1
    return number


def move_aside(main: Path, *companions: Path) -> Path | None:
    """Rename ``main``, if it holds anything, to ``main.N`` and each of
    ``companions`` that exists to ``companion.N``, N the first number free
    for all of them; return ``main``'s new path. None (nothing moved) when
    ``main`` is absent or empty."""
    if not main.is_file() or main.stat().st_size == 0:
        return None
    number = free_number(main, *companions)
    for path in (*companions, main):  # main last: its old name stays until the end
        if path.exists():
            os.replace(path, aside_path(path, number))
    return aside_path(main, number)


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[BinaryIO]:
    """A binary file (created with the umask's mode) that becomes ``path`` when
    the block ends without an exception (``atomic_path``)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        yield f


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` whole or not at all (``atomic_output``)."""
    with atomic_output(path) as f:
        f.write(text.encode())
