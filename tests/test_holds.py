"""BlockHolds keeps the policy's blocked set equal to writes | pins | leases."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvtier.holds import BlockHolds


def _keys(rng: random.Random, pool: list[bytes], k: int) -> list[bytes]:
    return [rng.choice(pool) for _ in range(k)]


@pytest.mark.parametrize("seed", range(5))
def test_random_holds_match_a_model(seed: int) -> None:
    rng = random.Random(seed)
    pool = [bytes([i]) for i in range(12)]
    blocked: set[bytes] = set()
    holds = BlockHolds(blocked)
    writing: set[bytes] = set()
    pins: Counter[bytes] = Counter()
    internal: Counter[bytes] = Counter()
    leases: Counter[bytes] = Counter()
    for _ in range(2000):
        op = rng.randrange(7)
        free = [k for k in pool if k not in writing and not pins[k] and not leases[k]]
        ready = [k for k in pool if k not in writing]
        if op == 0 and free:  # a store: new blocks, held by nothing yet
            keys = list(dict.fromkeys(_keys(rng, free, 3)))
            holds.write(keys)
            writing.update(keys)
        elif op == 1 and writing:
            keys = rng.sample(sorted(writing), rng.randint(1, len(writing)))
            holds.written(keys)
            writing.difference_update(keys)
        elif op == 2 and ready:  # pins may repeat a key
            keys = _keys(rng, ready, 3)
            holds.pin(keys)
            pins.update(keys)
        elif op == 3 and +pins:
            keys = list((+pins - internal).elements())[:2]
            holds.unpin(keys)
            pins.subtract(keys)
        elif op == 4 and ready:
            keys = list(dict.fromkeys(_keys(rng, ready, 2)))
            holds.lease(keys)
            leases.update(keys)
        elif op == 5 and +leases:
            keys = list(dict.fromkeys(list((+leases).elements())[:2]))
            holds.unlease(keys)
            leases.subtract(keys)
        elif op == 6 and ready:
            keys = _keys(rng, ready, 2)
            holds.pin_internal(keys)
            pins.update(keys)
            internal.update(keys)
            released = [*list((+internal).elements())[:1], b"never pinned"]
            holds.unpin_internal(released)
            pins.subtract(released[:1])
            internal.subtract(released[:1])
        assert blocked == writing | set(+pins) | set(+leases)
        assert holds.pins == dict(+pins) and holds.leases == dict(+leases)
        assert holds.internal == dict(+internal)


def test_clear_rebinds_the_policy_set_and_keeps_the_containers() -> None:
    old: set[bytes] = set()
    holds = BlockHolds(old)
    writing, pins = holds.writing, holds.pins
    holds.write([b"a"])
    holds.pin([b"b"])
    new: set[bytes] = set()
    holds.clear(new)
    assert holds.writing is writing and holds.pins is pins and not writing and not pins
    holds.lease([b"c"])
    assert new == {b"c"} and holds.blocked is new


def test_a_pinned_and_leased_block_stays_blocked_until_both_end() -> None:
    blocked: set[bytes] = set()
    holds = BlockHolds(blocked)
    holds.lease([b"k"])
    holds.pin([b"k"])
    holds.unlease([b"k"])
    assert b"k" in blocked
    holds.unpin([b"k"])
    assert b"k" not in blocked
