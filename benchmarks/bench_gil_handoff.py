"""A promotion's disk read beside a thread that keeps running Python, as an
engine's scheduler loop does while requests wait for their blocks: with
CPython's switch interval (5 ms), and under ``quick_handoffs`` (what the
cascade's I/O threads run their jobs in), side by side.

Each round reads ``--blocks`` blocks of ``--block-kib`` KiB with one
``get_into`` (what a ``PromotionJob`` calls) of a disk tier, or with
``--tier redis`` of a Redis tier on a redis-server started for the run, on a
second thread, in
these modes: ``alone`` (nothing else runs), ``busy`` (a thread counts in a
Python loop meanwhile) and ``quick X us`` (the same, the read inside
``quick_handoffs(X)``, one mode per ``--intervals`` value; by default
``IO_SWITCH_INTERVAL_S``, what the I/O threads use). Printed: the median
milliseconds per read of each mode over ``--rounds`` rounds (modes
interleaved) and its ratio to ``alone``. Then, for the busy modes, reads
back to back for ``--window`` seconds (I/O saturated, as under a stream of
writes): reads per second, the busy thread's loop rate against its rate
alone just before (what the I/O costs the engine's thread when it never
pauses), and that loss per read. Last, what a low interval costs two threads
that both keep running Python (a call hung in a tier keeps the interval low):
their loops per second together, at CPython's default and at each interval,
medians over the rounds (a third of the window each).

    python benchmarks/bench_gil_handoff.py [--blocks 108] [--block-kib 32] [--rounds 5]
        [--window 3] [--intervals 100,30,10,3] [--tier disk|redis]
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from kvtier import block_key
from kvtier.tiers import DiskTier, RedisTier, Tier
from kvtier.tiers.gil_handoff import IO_SWITCH_INTERVAL_S, quick_handoffs
from kvtier.tiers.redis_server import RedisServer

T = TypeVar("T")

Read = Callable[[], object]


def intervals_us(text: str) -> list[float]:
    """``--intervals``: switch intervals in microseconds, each a finite number > 0
    (``argparse`` type: a bad one is a usage error naming it)."""
    values = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(
                f"{part!r} is not a switch interval in microseconds (a number > 0)")
        values.append(value)
    return values


def quick_label(us: float) -> str:
    """A quick mode's name in the tables: ``quick 10 us``."""
    return f"quick {us:g} us"


def rotated(items: list[T], turn: int) -> list[T]:
    """``items`` starting at ``turn`` (modulo their number): each round's order."""
    k = turn % len(items)
    return items[k:] + items[:k]


class BusyThread:
    """A thread counting in a Python loop until stopped; its loop rate."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self.count = 0
        self.rate = 0.0
        self._thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        n, stop = 0, self._stop
        while not stop.is_set():
            n += 1
        self.count = n

    def __enter__(self) -> BusyThread:
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.rate = self.count / (time.perf_counter() - self._started)


def on_a_thread(fn: Callable[[], None]) -> None:
    """Run ``fn`` on a thread of its own (as on an I/O thread) and wait."""
    thread = threading.Thread(target=fn)
    thread.start()
    thread.join()


def quick(read: Read, interval_s: float) -> Read:
    """``read`` inside ``quick_handoffs(interval_s)``."""
    def quick_read() -> object:
        with quick_handoffs(interval_s):
            return read()
    return quick_read


def one_read(mode: str, interval_s: float | None, read: Read) -> float:
    """Seconds of one read in ``mode`` (under quick hand-offs at ``interval_s``
    unless None)."""
    took: list[float] = []
    run_read = read if interval_s is None else quick(read, interval_s)

    def run() -> None:
        start = time.perf_counter()
        run_read()
        took.append(time.perf_counter() - start)

    if mode == "alone":
        on_a_thread(run)
    else:
        with BusyThread():
            time.sleep(0.05)  # running at full speed before the read starts
            on_a_thread(run)
    return took[0]


def saturated(interval_s: float | None, read: Read, window_s: float) -> tuple[float, float]:
    """(reads per second, the busy thread's loop rate) with reads back to
    back for ``window_s`` beside the busy thread (under quick hand-offs at
    ``interval_s`` unless None)."""
    one = read if interval_s is None else quick(read, interval_s)
    reads = 0

    def loop() -> None:
        nonlocal reads
        end = time.perf_counter() + window_s
        while time.perf_counter() < end:
            one()
            reads += 1

    with BusyThread() as busy:
        start = time.perf_counter()
        on_a_thread(loop)
        elapsed = time.perf_counter() - start
    return reads / elapsed, busy.rate


def two_threads_rate(interval_s: float, window_s: float) -> float:
    """Loops per second of two busy threads together, the switch interval at
    ``interval_s`` meanwhile."""
    saved = sys.getswitchinterval()
    sys.setswitchinterval(interval_s)
    try:
        with BusyThread() as one, BusyThread() as two:
            time.sleep(window_s)
    finally:
        sys.setswitchinterval(saved)
    return one.rate + two.rate


def alone_rate(seconds: float) -> float:
    """The busy thread's loop rate with nothing else running."""
    with BusyThread() as busy:
        time.sleep(seconds)
    return busy.rate


@contextlib.contextmanager
def tier_to_read(args: argparse.Namespace, capacity: int) -> Iterator[Tier]:
    """The ``--tier`` to read, closed (its server stopped) afterwards."""
    if args.tier == "disk":
        with tempfile.TemporaryDirectory(dir=args.dir) as root, \
                DiskTier(root, "bench-gil", capacity) as tier:
            yield tier
        return
    server = RedisServer(config={"maxmemory": str(2 * capacity),
                                 "maxmemory-policy": "allkeys-lru"}).start()
    try:
        with RedisTier(server.url, "bench-gil", socket_timeout_s=30.0) as tier:
            yield tier
    finally:
        server.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=108,
                    help="blocks per read (default: %(default)s)")
    ap.add_argument("--block-kib", type=int, default=32,
                    help="size of a block, KiB (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds of each timing, modes interleaved, the median reported "
                    "(default: %(default)s)")
    ap.add_argument("--window", type=float, default=3.0,
                    help="seconds of back-to-back reads per busy mode")
    ap.add_argument("--intervals", type=intervals_us, default=[IO_SWITCH_INTERVAL_S * 1e6],
                    metavar="US[,US...]",
                    help="switch intervals of the quick modes, microseconds (default: "
                    "the I/O threads')")
    ap.add_argument("--tier", choices=("disk", "redis"), default="disk",
                    help="the tier read: disk, or a redis-server started for the run")
    ap.add_argument("--dir", default=None, help="directory of the disk tier (default: a temp dir)")
    args = ap.parse_args(argv)
    # each mode's switch interval under quick hand-offs (None: CPython's own)
    modes: dict[str, float | None] = {"alone": None, "busy": None}
    modes.update({quick_label(us): us * 1e-6 for us in args.intervals})
    size = args.block_kib << 10
    took: dict[str, list[float]] = {m: [] for m in modes}
    load: dict[str, tuple[float, float]] = {}
    with tier_to_read(args, 4 * args.blocks * (size + 4096)) as tier:
        keys = [block_key(i) for i in range(args.blocks)]
        tier.put([(k, os.urandom(size)) for k in keys])
        buffers = [bytearray(size) for _ in keys]

        def read() -> object:
            return tier.get_into(keys, buffers)

        for r in range(args.rounds):
            for mode in rotated(list(modes), r):
                took[mode].append(one_read(mode, modes[mode], read))
        for mode in list(modes)[1:]:
            base_rate = alone_rate(args.window)
            per_s, rate = saturated(modes[mode], read, args.window)
            load[mode] = (per_s, rate / base_rate)
    intervals = [sys.getswitchinterval(), *(us * 1e-6 for us in args.intervals)]
    twos: dict[float, list[float]] = {x: [] for x in intervals}
    for r in range(args.rounds):  # a third of the window each
        for x in rotated(intervals, r):
            twos[x].append(two_threads_rate(x, args.window / 3))
    print_results(args, took, load, twos)
    return 0


def print_results(args: argparse.Namespace, took: dict[str, list[float]],
                  load: dict[str, tuple[float, float]], twos: dict[float, list[float]]) -> None:
    base = statistics.median(took["alone"])
    print(f"{args.blocks} blocks of {args.block_kib} KiB per {args.tier} read; switch interval "
          f"{sys.getswitchinterval() * 1e3:g} ms (busy), I/O threads' "
          f"{IO_SWITCH_INTERVAL_S * 1e6:g} us; medians of {args.rounds} rounds")
    print(f"{'mode':14s} {'ms/read':>9s} {'x alone':>8s}")
    for mode, times in took.items():
        ms = statistics.median(times) * 1e3
        print(f"{mode:14s} {ms:9.1f} {ms / (base * 1e3):8.1f}")
    print(f"reads back to back for {args.window:g} s:")
    for mode, (per_s, rate) in load.items():
        print(f"{mode:14s} {per_s:9.1f} reads/s; busy thread at {rate:.2f} x its rate alone, "
              f"{(1 - rate) / per_s * 100:.2f} % of it per read/s")
    print(f"two threads running Python, {args.window / 3:g} s a round, medians of "
          f"{args.rounds} rounds:")
    base_two = statistics.median(twos[next(iter(twos))])
    for interval, rates in twos.items():
        rate = statistics.median(rates)
        print(f"interval {interval * 1e6:7g} us {rate / 1e6:6.2f} M loops/s together "
              f"({rate / base_two:.2f} x)")


if __name__ == "__main__":
    sys.exit(main())
