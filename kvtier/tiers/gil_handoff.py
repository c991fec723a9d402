"""Quick GIL hand-offs while the tier cascade's I/O threads have work.

Every file or socket call an I/O thread makes (``open``, ``pread``,
``close``, ``send``...) lets go of the GIL, and getting it back waits for the
thread that took it to give it up: at once if that thread blocks, but after
``sys.getswitchinterval()`` (5 ms by default) if it keeps running Python. An
engine's scheduler loop does keep running Python, and does so exactly while
requests wait for promotions (vLLM steps again and again until their blocks
are in). A disk read makes five such calls per block, so 108 blocks that
take 6 ms alone took 2.6 s beside a spinning thread, past the cascade's
2-second promotion timeout: the request then computed what the disk held
(``benchmarks/bench_gil_handoff.py``).

:func:`quick_handoffs` lowers the switch interval to
``IO_SWITCH_INTERVAL_S`` while at least one I/O job of the process runs and
puts the former value back when the last one ends. The interval only
matters while a thread waits for the GIL, so an idle cascade changes
nothing; while jobs run, the engine's thread is interrupted no more often
than before (once per call of an I/O thread), only sooner. The interval is
the interpreter's, so one counter serves every cascade of the process, and
a value someone else set meanwhile is left as it is. A call hung in a tier
keeps its job running, and the interval low, until it returns: two other
threads both running Python then take turns every 10 us instead of 5 ms,
which costs them nothing measurable (the benchmark's last rows).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kvtier.argtypes import is_positive_seconds

IO_SWITCH_INTERVAL_S = 0.00001
"""The switch interval while I/O jobs run: a call's GIL hand-off waits at
most this long (10 us; CPython's default is 5 ms). Below it the thread's
wake-up sets the pace: a 108-block read beside a busy thread took 58.9 /
34.9 / 29.2 / 26.8 ms at 100 / 30 / 10 / 3 us, while the busy thread gave
up about the same share of its rate per read at each
(``benchmarks/bench_gil_handoff.py --intervals 100,30,10,3``; docs/costs.md,
"Disk and Redis I/O beside a busy scheduler")."""


class _Handoffs:
    """The process's count of running I/O jobs and the interval to restore.

    Invariants: ``saved`` is not None exactly while ``running`` > 0 and the
    interval was lowered by this object (to ``lowered``, as
    ``sys.getswitchinterval`` reads it back); at most one lowering is
    outstanding. Bounded: three numbers."""

    __slots__ = ("lock", "running", "saved", "lowered")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.saved: float | None = None
        self.lowered = 0.0

    def enter(self, interval_s: float) -> None:
        with self.lock:
            self.running += 1
            if self.running == 1:
                current = sys.getswitchinterval()
                if current > interval_s:
                    sys.setswitchinterval(interval_s)
                    self.saved, self.lowered = current, sys.getswitchinterval()

    def exit(self) -> None:
        with self.lock:
            self.running -= 1
            if self.running == 0 and self.saved is not None:
                if sys.getswitchinterval() == self.lowered:  # nobody changed it since
                    sys.setswitchinterval(self.saved)
                self.saved = None


_HANDOFFS = _Handoffs()


@contextmanager
def quick_handoffs(interval_s: float = IO_SWITCH_INTERVAL_S) -> Iterator[None]:
    """Run the block with the switch interval at most ``interval_s`` (for
    every thread of the process), then restore it once no other block of
    this kind runs. ``ValueError`` unless ``interval_s`` is a finite number
    of seconds > 0 (``sys.setswitchinterval`` refuses others only once a job
    runs, on an I/O thread)."""
    if not is_positive_seconds(interval_s):
        raise ValueError(f"switch interval must be a finite number of seconds > 0, "
                         f"got {interval_s!r}")
    _HANDOFFS.enter(interval_s)
    try:
        yield
    finally:
        _HANDOFFS.exit()
