"""The cascade's I/O jobs run with quick GIL hand-offs, and the interpreter's
switch interval is theirs only while they run.

Fault: each file call of an I/O thread gave up the GIL and waited a whole
switch interval (5 ms) to get it back from a scheduler loop running Python,
so a promotion of 108 disk blocks, 6 ms alone, took about 2 s in a real
engine and ran past ``promotion_timeout_s``: the requests computed what the
disk held (tests/test_vllm_interrupts.py, "promoted"). The speed itself is
measured in benchmarks/bench_gil_handoff.py, not asserted here.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest

from kvtier.tiers import gil_handoff
from kvtier.tiers.gil_handoff import IO_SWITCH_INTERVAL_S, quick_handoffs
from kvtier.tiers.io_pool import IOPool, ProbeJob

DEFAULT_S = 0.005


@pytest.fixture(autouse=True)
def default_interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(DEFAULT_S)
    yield
    sys.setswitchinterval(before)


class _IntervalTier:
    """A tier that notes the switch interval its calls run under."""

    name = "interval"
    available = True

    def __init__(self) -> None:
        self.seen: list[float] = []
        self.release = threading.Event()

    def contains(self, keys: list[bytes]) -> list[bool]:
        self.seen.append(sys.getswitchinterval())
        self.release.wait(30)
        return [False] * len(keys)


def test_an_io_job_runs_with_quick_handoffs_and_the_interval_comes_back() -> None:
    tier = _IntervalTier()
    pool = IOPool(2, max_queue=4)
    try:
        jobs = [ProbeJob(tier, [bytes([i])]) for i in range(2)]  # type: ignore[arg-type]
        for job in jobs:
            assert pool.submit(job)
        while len(tier.seen) < 2:
            threading.Event().wait(0.01)
        assert sys.getswitchinterval() <= IO_SWITCH_INTERVAL_S * 1.01  # while they run
        tier.release.set()
        done: list[object] = []
        while len(done) < 2:
            done += pool.take_done()
            threading.Event().wait(0.01)
    finally:
        tier.release.set()
        pool.shutdown(5)
    assert all(s <= IO_SWITCH_INTERVAL_S * 1.01 for s in tier.seen)
    assert sys.getswitchinterval() == pytest.approx(DEFAULT_S)


def test_overlapping_blocks_restore_once_the_last_one_ends() -> None:
    first, second = quick_handoffs(), quick_handoffs()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert sys.getswitchinterval() <= IO_SWITCH_INTERVAL_S * 1.01  # the second still runs
    second.__exit__(None, None, None)
    assert sys.getswitchinterval() == pytest.approx(DEFAULT_S)
    assert gil_handoff._HANDOFFS.running == 0


def test_an_interval_set_meanwhile_is_left_alone() -> None:
    with quick_handoffs():
        sys.setswitchinterval(0.002)  # the application's own choice
    assert sys.getswitchinterval() == pytest.approx(0.002)


def test_a_lower_interval_is_not_raised() -> None:
    sys.setswitchinterval(IO_SWITCH_INTERVAL_S / 2)
    with quick_handoffs():
        assert sys.getswitchinterval() == pytest.approx(IO_SWITCH_INTERVAL_S / 2)
    assert sys.getswitchinterval() == pytest.approx(IO_SWITCH_INTERVAL_S / 2)


def test_a_block_that_raises_still_restores() -> None:
    with pytest.raises(RuntimeError), quick_handoffs():
        raise RuntimeError("a tier call failed")
    assert sys.getswitchinterval() == pytest.approx(DEFAULT_S)
    assert gil_handoff._HANDOFFS.running == 0


@pytest.mark.parametrize("bad", [0, -0.001, float("nan"), float("inf"), True, "0.1"])
def test_a_bad_interval_is_refused_naming_it(bad: object) -> None:
    with pytest.raises(ValueError, match="switch interval"), \
            quick_handoffs(bad):  # type: ignore[arg-type]
        pass
    assert sys.getswitchinterval() == pytest.approx(DEFAULT_S)
    assert gil_handoff._HANDOFFS.running == 0
