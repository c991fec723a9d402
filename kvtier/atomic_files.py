"""Files written whole or not at all: a temp file in the target's directory,
renamed over the target (``os.replace``) once complete."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temp path in ``path``'s directory that becomes ``path`` (``os.replace``)
    when the block ends without an exception; on an exception the temp file is
    removed and ``path`` is left as it was."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
