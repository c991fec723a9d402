"""IOPool: shutdown waits at most its timeout in all, whatever the threads do."""

from __future__ import annotations

import threading
import time

from kvtier.tiers.io_pool import IOPool, ProbeJob


class _HungTier:
    """A tier whose existence checks never return until released (a lost
    mount or a stopped server: a fault no real part gives on demand)."""

    name = "hung"
    available = True

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)

    def contains(self, keys: list[bytes]) -> list[bool]:
        self.entered.release()
        self.release.wait(60)
        return [False] * len(keys)


def test_shutdown_waits_its_timeout_once_not_once_per_thread() -> None:
    threads, timeout_s = 4, 0.5
    tier = _HungTier()
    pool = IOPool(threads, max_queue=8)
    for i in range(threads):
        assert pool.submit(ProbeJob(tier, [bytes([i])]))  # type: ignore[arg-type]
    for _ in range(threads):
        assert tier.entered.acquire(timeout=10)  # every thread is stuck in the tier
    start = time.monotonic()
    pool.shutdown(timeout_s)
    waited = time.monotonic() - start
    tier.release.set()
    # one thread after another would wait threads * timeout_s (2 s)
    assert waited < threads * timeout_s * 0.75, waited
