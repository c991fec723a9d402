"""Races between the cascade's I/O threads and the state
they share (tiers, breakers), each test failing on the code before its fix."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import TracebackType

import numpy as np

from kvtier import block_key
from kvtier.tiers import DiskTier, KVLayout
from kvtier.tiers.breaker import BreakerState, CircuitBreaker
from kvtier.tiers.ranks import RankedTier, ShardedSlot

SIZE = 4096


def _quiet_keys(tier: RankedTier) -> int:
    return sum(len(keys) for keys in tier._quiet.values())


def test_orphan_shards_deleted_without_events_are_not_kept(tmp_path: Path) -> None:
    """A block one rank cannot store has its other shards deleted (no orphan
    shard); the keys of those deletes were remembered for the event pass,
    which never runs without events (vLLM's default): the set grew by every
    such block for the life of the engine."""
    layout = [KVLayout("m", "bfloat16", 16, 2, 2, 64, tp_rank=r, tp_size=2).namespace()
              for r in range(2)]
    roomy = DiskTier(tmp_path / "disk", layout[0], 64 << 20, free_reserve_bytes=0)
    full = DiskTier(tmp_path / "disk", layout[1], 1 << 20, free_reserve_bytes=0,
                    free_space=lambda _path: 0)  # the file system is full: drops every store
    tier = RankedTier([roomy, full])  # events off
    parts = [np.full(SIZE, 7, dtype=np.uint8), np.full(SIZE, 9, dtype=np.uint8)]
    try:
        for i in range(200):
            assert tier.put([(block_key(i), ShardedSlot(parts))]) == [False]
        assert roomy.contains([block_key(0)]) == [False]  # the orphan shard is gone
        assert _quiet_keys(tier) == 0, "orphan deletes kept for an event pass that never runs"
    finally:
        tier.close()


def test_orphan_deletes_with_events_are_forgotten_after_the_put(tmp_path: Path) -> None:
    """With events, the keys are read back by the put's own event pass: none left."""
    layout = [KVLayout("m", "bfloat16", 16, 2, 2, 64, tp_rank=r, tp_size=2).namespace()
              for r in range(2)]
    roomy = DiskTier(tmp_path / "disk", layout[0], 64 << 20, free_reserve_bytes=0,
                     enable_events=True)
    full = DiskTier(tmp_path / "disk", layout[1], 1 << 20, free_reserve_bytes=0,
                    free_space=lambda _path: 0, enable_events=True)
    tier = RankedTier([roomy, full], enable_events=True)
    parts = [np.zeros(SIZE, dtype=np.uint8), np.zeros(SIZE, dtype=np.uint8)]
    try:
        for i in range(20):
            assert tier.put([(block_key(i), ShardedSlot(parts))]) == [False]
        assert _quiet_keys(tier) == 0
        assert tier.take_events() == []  # never whole: neither stored nor removed
    finally:
        tier.close()


class _PausingLock:
    """The breaker's lock; ``pause_after_open`` makes one thread stop right
    after it released the lock having opened the breaker, before it told
    anyone: the window where another thread's change can overtake it."""

    def __init__(self, breaker: CircuitBreaker, thread_name: str) -> None:
        self._inner = threading.Lock()
        self._breaker = breaker
        self._thread_name = thread_name
        self.paused = threading.Event()
        self.resume = threading.Event()

    def __enter__(self) -> bool:
        return self._inner.__enter__()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._inner.__exit__(kind, exc, tb)
        if (threading.current_thread().name == self._thread_name
                and self._breaker._state == "open" and not self.paused.is_set()):
            self.paused.set()
            self.resume.wait(10)


def test_breaker_changes_are_announced_in_the_order_they_happened() -> None:
    """An I/O thread's failure opens the breaker, and the probe that follows
    succeeds and closes it again before the failing thread told anyone
    (it is paused right after the lock). Each announced its own
    change after releasing the lock, so the failing thread, paused there,
    announced "open" last: the Redis tier's last event and log line said the
    server was refused while its breaker was closed and serving."""
    changes: list[BreakerState] = []
    now = [100.0]
    breaker = CircuitBreaker(1, 60.0, 60.0, on_change=changes.append, clock=lambda: now[0])
    lock = _PausingLock(breaker, "failing-call")
    breaker._lock = lock  # type: ignore[assignment]
    permit = breaker.allow()
    assert permit
    failing = threading.Thread(target=breaker.record_failure, args=(permit,),
                               name="failing-call")
    failing.start()
    try:
        assert lock.paused.wait(10)
        now[0] += 60.0
        probe = breaker.allow()  # the probe, which succeeds
        assert probe
        breaker.record_success(probe)
    finally:
        lock.resume.set()
        failing.join(10)
    assert not failing.is_alive()
    assert breaker.state == "closed"
    assert changes == ["open", "closed"], changes


def test_closing_the_disk_lookups_answers_the_callers_waiting() -> None:
    # Fault: close() emptied the queue but the callers waiting on it slept
    # their whole timeout (and were counted as timeouts) for an answer that
    # could no longer come; a tier closing at shutdown held its threads so long.
    from kvtier.tiers.disk_lookups import DeadlineLookups

    lookups = DeadlineLookups(timeout_s=5.0)
    release = threading.Event()
    started = threading.Event()

    def hung() -> list[bool]:
        started.set()
        release.wait(10)
        return [True]

    answers: list[object] = []
    first = threading.Thread(target=lambda: answers.append(lookups.run(hung)))
    first.start()
    assert started.wait(5)
    t0 = time.monotonic()
    second = threading.Thread(target=lambda: answers.append(lookups.run(lambda: [True])))
    second.start()
    time.sleep(0.05)  # queued behind the hung one
    lookups.close()
    second.join(5)
    waited = time.monotonic() - t0
    release.set()
    first.join(5)
    assert waited < 2.0, f"a waiting caller slept {waited:.1f} s after close()"
    assert None in answers
