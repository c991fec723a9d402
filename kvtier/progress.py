"""Progress on the terminal for kvtier's long commands (replay, bench, verify).

``make_progress`` gives a tqdm bar on stderr when that is a terminal (lines
printed through it go to stdout without breaking the bar), else ``NoProgress``:
plain lines, no bar.
"""

from __future__ import annotations

import sys
from typing import Protocol, TextIO


class Progress(Protocol):
    """What the replay command needs of a progress display."""

    def update(self, n: int) -> None: ...
    def describe(self, text: str) -> None: ...
    def write(self, line: str) -> None: ...
    def close(self) -> None: ...


class NoProgress:
    """No bar: lines go straight to stdout."""

    def update(self, n: int) -> None:
        """Ignore progress."""

    def describe(self, text: str) -> None:
        """Ignore descriptions."""

    def write(self, line: str) -> None:
        """Print ``line`` to stdout now."""
        print(line, flush=True)

    def close(self) -> None:
        """Nothing to close."""


class TqdmProgress:
    """A tqdm bar on ``stream`` (stderr); lines go to stdout without breaking the bar."""

    def __init__(self, total: int | None, stream: TextIO, unit: str = "req") -> None:
        """``total`` None: a counter of ``unit`` with its rate, no bar (total unknown)."""
        from tqdm import tqdm

        self._tqdm = tqdm
        self._bar = tqdm(total=total, file=stream, unit=unit, leave=False)

    def update(self, n: int) -> None:
        """Advance by ``n`` requests."""
        self._bar.update(n)

    def describe(self, text: str) -> None:
        """Show ``text`` before the bar."""
        self._bar.set_description_str(text)

    def write(self, line: str) -> None:
        """Print ``line`` to stdout above the bar."""
        self._tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()

    def close(self) -> None:
        """Remove the bar."""
        self._bar.close()


def make_progress(total: int | None, enabled: bool, stream: TextIO | None = None,
                  unit: str = "req") -> Progress:
    """A tqdm bar (counting ``unit``; ``total`` None: a counter, the total being
    unknown) when ``enabled``, ``stream`` (stderr) is a TTY and tqdm is installed."""
    stream = sys.stderr if stream is None else stream
    if enabled and stream.isatty():
        try:
            return TqdmProgress(total, stream, unit)
        except ImportError:
            pass
    return NoProgress()
