"""Files written whole or not at all: a temp file in the target's directory,
renamed over the target (``os.replace``) once complete; and private directories."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

_O_NEW = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
          | getattr(os, "O_CLOEXEC", 0))


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temp path in ``path``'s directory that becomes ``path`` (``os.replace``)
    when the block ends without an exception; on an exception the temp file is
    removed and ``path`` is left as it was.

    The temp file is created here, new (``O_EXCL``, never through a symlink),
    under an unguessable name and with the umask's mode; the caller writes it
    by its path. Outputs often go to shared directories (``/tmp``): a
    predictable name would let another user put a symlink there first, and
    the write would go through it to any file of the caller's.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    os.close(os.open(tmp, _O_NEW, 0o666))
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def make_private_dirs(path: Path) -> None:
    """Create ``path`` and its missing parents, each 0700 (``os.makedirs`` would
    give the parents the umask's mode: 0777 under umask 0). Existing ones stay."""
    missing: list[Path] = []
    while not os.path.lexists(path):
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            os.mkdir(directory, 0o700)
