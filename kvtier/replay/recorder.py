"""Record the requests an engine serves as a Mooncake-format trace.

The README's "Choosing a policy" compares policies on one's own traffic by
replaying it (``kvtier replay``); this writes that traffic from a running
engine (``trace_path`` in the config). One JSON line per finished request,
the format :mod:`kvtier.replay.trace` reads:

* ``timestamp``: its arrival at the scheduler, in ms since the recorder opened;
* ``input_length``: 512 tokens per full block, Mooncake's block
  (``MOONCAKE_BLOCK_TOKENS``): the views that serve a trace as an engine
  does (``kvtier replay --gpu-blocks``, ``kvtier bench serve --trace``) map
  one Mooncake block to one engine block, so the engine's own block of
  ``block_size`` tokens is recorded as one; the partial last block is not;
* ``output_length``: ``OUTPUT_LENGTH`` (1): the reply's length is not
  known here, and its full blocks are in ``hash_ids`` already (vLLM places
  every full block of a request, the reply's too, also where it offers only
  the prompt's for storing: ``offload_prompt_only``, its default); one
  token is the least a client can ask for (vLLM refuses ``max_tokens`` 0),
  so ``vllm bench serve --dataset-name timed_trace`` can send every line;
* ``hash_ids``: one 64-bit BLAKE2b digest of each full block's hash, in
  prefix order, the blocks the engine's own cache served included, so that
  ``kvtier replay --gpu-blocks`` can put an engine cache in front again.

The file holds no token and no engine hash, only digests of them; the same
prompt prefix gives the same ids across requests of one engine (and across
engines whose block hashes agree). Lines are written in arrival order: a
finished request's line waits while a request that arrived before it
(``arrive``) still runs, at most ``MAX_REORDER`` lines, and a request that
never reports its finish is waited for only while ``MAX_RUNNING`` later
ones have not arrived. A request that finishes with no full block is left
out, and so is one whose finish vLLM has not reported when the engine stops
(it reports it once the request's stores complete).

The scheduler's thread only copies the request's key positions and queues
them; a writer thread digests, formats and writes, so a slow disk delays
the file, not the engine. Memory: at most ``MAX_QUEUED`` requests' positions
wait in the queue (a request that finds it full is dropped and counted),
``MAX_REORDER`` lines for an earlier arrival and ``MAX_RUNNING`` arrival
stamps, and at most ``max_requests`` lines are written, after which
recording stops.
"""

from __future__ import annotations

import contextlib
import hashlib
import heapq
import itertools
import json
import logging
import math
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import IO

from kvtier.errors import KVTierError
from kvtier.keys import key_group, key_hash
from kvtier.replay.trace import MOONCAKE_BLOCK_TOKENS

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUESTS = 100_000
"""Lines a recorder writes before it stops: about 200 MB of trace for requests
of 100 blocks (about 21 bytes per id: up to 20 digits and a comma)."""
OUTPUT_LENGTH = 1
"""Every line's ``output_length`` (module doc: the least a client may ask)."""
MAX_QUEUED = 256
"""Finished requests waiting for the writer thread; more are dropped (counted)."""
MAX_REORDER = 4096
"""Finished requests' lines the writer holds back for a request that arrived
before them and still runs; past it the oldest is written (out of order)."""
MAX_RUNNING = 65_536
"""Arrivals awaiting their finish; past it the oldest is no longer waited for
(a finish vLLM never reports must not hold the trace back for ever)."""
CLOSE_TIMEOUT_S = 5.0
"""What ``close`` waits for the writer to write what is queued."""
PID_FIELD = "{pid}"
"""Replaced in the path by the process id: engines of one data-parallel
deployment share one config, and each needs a file of its own."""

Positions = list[tuple[bytes, int]]
"""A request's keys with the end-token position of each (vLLM's ``ReqContext``)."""


class TraceRecorderError(KVTierError, OSError):
    """The trace file cannot be created; the message names the path."""


def trace_hash_id(block_hash: bytes) -> int:
    """The trace id of an engine block hash: its 64-bit BLAKE2b digest."""
    digest = hashlib.blake2b(block_hash, digest_size=8, person=b"kvtier-trace").digest()
    return int.from_bytes(digest, "big")


def trace_line(arrival_ms: float, positions: Positions) -> str | None:
    """The Mooncake line of one request, or None when it has no full block.
    With several KV-cache groups, the keys of the lowest group stand for the
    blocks (every group's key of a block has the same position)."""
    if not positions:
        return None
    group = min(key_group(key) for key, _ in positions)
    ordered = sorted((pos, key) for key, pos in positions if key_group(key) == group)
    return json.dumps({
        "timestamp": round(arrival_ms),
        "input_length": len(ordered) * MOONCAKE_BLOCK_TOKENS,
        "output_length": OUTPUT_LENGTH,
        "hash_ids": [trace_hash_id(key_hash(key)) for _, key in ordered],
    }, separators=(",", ":"))


class TraceRecorder:
    """Writes finished requests as Mooncake lines to a new file (see the module).

    Owns the file (created here, never overwritten: ``TraceRecorderError``
    when it exists, unless empty, or cannot be made), a queue of at most
    ``MAX_QUEUED`` requests and the writer thread that empties it.
    Invariants: at most ``max_requests`` lines are written (requests with no
    full block count for none); ``record`` never blocks; after a write
    error or ``close`` nothing more is written; a line is written once no
    request that arrived before it runs (bounds: ``MAX_REORDER``,
    ``MAX_RUNNING``). ``arrive`` and ``record`` are called from one thread
    (the scheduler's). ``stats()``: recorded, dropped (queue full), and
    whether it stopped.
    """

    def __init__(self, path: str | os.PathLike[str],
                 max_requests: int = DEFAULT_MAX_REQUESTS) -> None:
        if isinstance(max_requests, bool) or not isinstance(max_requests, int) or (
                max_requests < 1):
            raise ValueError(f"max_requests must be an int >= 1, got {max_requests!r}")
        self.path = Path(str(path).replace(PID_FIELD, str(os.getpid())))
        self.max_requests = max_requests
        self._file = self._create()
        self._start = time.monotonic()
        self._queue: queue.Queue[tuple[float, float, Positions] | None] = queue.Queue(
            MAX_QUEUED)
        self._running: OrderedDict[float, int] = OrderedDict()  # arrival stamp -> requests
        self._accepted = 0
        self.recorded = 0
        self.dropped = 0
        self.stopped = False
        self._thread = threading.Thread(target=self._write_all, name="kvtier-trace",
                                        daemon=True)
        self._thread.start()
        logger.info("kvtier: recording requests to %s (at most %d)", self.path, max_requests)

    def _create(self) -> IO[str]:
        """The new trace file; an empty one is taken over (a start that failed
        after creating it holds nothing), any other never overwritten."""
        mode = "x"
        if self.path.is_file():
            if self.path.stat().st_size:
                raise TraceRecorderError(f"trace_path {self.path} exists: a trace is never "
                                         "overwritten; remove it or give a new path")
            mode = "a"
        try:
            return self.path.open(mode, encoding="utf-8")
        except OSError as exc:
            raise TraceRecorderError(f"trace_path {self.path}: cannot create it: "
                                     f"{exc.strerror or exc}") from None

    def now_ms(self) -> float:
        """Milliseconds since the recorder opened: a request's arrival stamp."""
        return (time.monotonic() - self._start) * 1000.0

    def arrive(self) -> float:
        """A request reached the scheduler: its arrival stamp (``now_ms``), held
        as running until ``record`` gets it back, so that requests that arrived
        later and finish first are written after it."""
        stamp = self.now_ms()
        running = self._running
        running[stamp] = running.get(stamp, 0) + 1
        if len(running) > MAX_RUNNING:
            running.popitem(last=False)
        return stamp

    def _finished(self, arrival_ms: float) -> float:
        """Forget one request of ``arrival_ms`` as running; return the earliest
        arrival still running (infinity when none)."""
        running = self._running
        count = running.get(arrival_ms)
        if count is not None:
            if count > 1:
                running[arrival_ms] = count - 1
            else:
                del running[arrival_ms]
        return next(iter(running), math.inf)

    def record(self, arrival_ms: float, positions: Iterable[tuple[bytes, int]]) -> None:
        """Queue one finished request (its keys with their end-token positions)
        that arrived at ``arrival_ms`` (from ``arrive``, or any stamp)."""
        earliest_running = self._finished(arrival_ms)
        if self.stopped or self._accepted >= self.max_requests:
            return
        items = list(positions)
        if not items:  # no full block: nothing to replay
            return
        try:
            self._queue.put_nowait((arrival_ms, earliest_running, items))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                logger.warning("kvtier: the trace writer falls behind (%s): finished "
                               "requests are left out of the trace while it does", self.path)
            return
        self._accepted += 1
        if self._accepted == self.max_requests:
            logger.info("kvtier: trace %s reached trace_max_requests=%d: recording stops",
                        self.path, self.max_requests)

    def _write_all(self) -> None:
        """Write the queued requests in arrival order (class doc) until ``close``,
        then the lines still held back."""
        held: list[tuple[float, int, str]] = []  # (arrival, finish order, line), a heap
        finish_order = itertools.count()
        while (item := self._queue.get()) is not None:
            arrival_ms, earliest_running, positions = item
            line = None if self.stopped else trace_line(arrival_ms, positions)
            if line is not None:
                heapq.heappush(held, (arrival_ms, next(finish_order), line))
            while held and (held[0][0] <= earliest_running or len(held) > MAX_REORDER):
                self._write(heapq.heappop(held)[2])
        while held:
            self._write(heapq.heappop(held)[2])

    def _write(self, line: str) -> None:
        """One line to the file; a write error stops recording (one warning)."""
        if self.stopped:
            return
        try:
            self._file.write(line + "\n")
            self._file.flush()  # whole lines on disk while the engine runs
        except (OSError, ValueError) as exc:
            self.stopped = True
            logger.warning("kvtier: cannot write the trace %s (%s): recording stops",
                           self.path, exc)
            return
        self.recorded += 1

    def close(self) -> None:
        """Write what is queued (waiting at most ``CLOSE_TIMEOUT_S``), then close the file."""
        if not self._thread.is_alive():
            return
        with contextlib.suppress(queue.Full):  # a writer stuck that long: join says so
            self._queue.put(None, timeout=CLOSE_TIMEOUT_S)
        self._thread.join(CLOSE_TIMEOUT_S)
        self.stopped = True
        if self._thread.is_alive():
            logger.warning("kvtier: the trace writer of %s did not finish in %.0f s",
                           self.path, CLOSE_TIMEOUT_S)
            return
        try:
            self._file.close()
        except OSError as exc:
            logger.warning("kvtier: cannot close the trace %s: %s", self.path, exc)
        logger.info("kvtier: trace %s: %d requests recorded, %d dropped", self.path,
                    self.recorded, self.dropped)

    def stats(self) -> dict[str, int | bool]:
        return {"recorded": self.recorded, "dropped": self.dropped, "stopped": self.stopped}
