"""Aging PLFU's history in steps (``PLFUPolicy.AGE_STEP``) decides as aging it at once.

A history larger than ``AGE_AT_ONCE`` entries is halved over several calls; every
call must still read the counts that halving them all at once would have left.
The check: two copies of a policy, one aging in steps every few entries, one at
once, served the same requests (several in flight, some removed) choose the
same victims and admit the same keys, request for request, and report the same
history; a negative control shows the comparison catches a step that reads an
un-aged count.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Callable

import pytest
from helpers.policy_contract import OPS, exercise, plfu_invariants
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier
from kvtier.policies import AdaptivePolicy, PLFUPolicy, make_policy, plfu
from kvtier.policies.shadows import PLFUShadow


class _SteppedPLFU(PLFUPolicy):
    AGE_AT_ONCE = AGE_STEP = 1


def _workload(seed: int, n: int) -> list[list[bytes]]:
    """Requests that reuse prefixes of earlier ones (popular ones more) and add new blocks."""
    rng = random.Random(seed)
    pool: list[list[bytes]] = []
    out, next_id = [], 0
    for _ in range(n):
        keys: list[bytes] = []
        if pool and rng.random() < 0.6:
            doc = pool[min(len(pool) - 1, int(rng.paretovariate(1.1)) - 1)]
            keys = doc[:rng.randint(1, len(doc))]
        new = rng.randint(1, 24)
        keys = keys + [kvtier.block_key(i) for i in range(next_id, next_id + new)]
        next_id += new
        if rng.random() < 0.4:
            pool.insert(0, keys)
            del pool[300:]
        out.append(keys)
    return out


class _Cache:
    """A policy and its resident keys, driven the way the manager drives it."""

    def __init__(self, pol: PLFUPolicy) -> None:
        self.pol, self.resident = pol, set[bytes]()

    def store(self, keys: list[bytes]) -> tuple[int, list[bytes]]:
        """Admission, room and store of a request's missing keys."""
        pol, resident = self.pol, self.resident
        missing = [key for key in keys if key not in resident]
        n = pol.admit(missing) if pol.wants_admission else len(missing)
        missing = missing[:n]
        victims: list[bytes] = []
        over = len(resident) + len(missing) - pol.capacity
        if over > 0:
            victims = pol.evict(over, ()) or []
            resident.difference_update(victims)
        pol.insert(missing)
        resident.update(missing)
        return n, victims

    def remove(self) -> bytes | None:
        if not self.resident:
            return None
        key = min(self.resident)
        self.pol.remove(key)
        self.resident.discard(key)
        return key


def first_difference(stepped: PLFUPolicy, at_once: PLFUPolicy, seed: int,
                     requests: int = 4000, in_flight: int = 4) -> int | None:
    """Serve both policies the same requests; the first request at which they
    differ (admission, victims, removal or history), None if none does.
    Returns -1 when the stepped one never aged in steps (the check saw nothing)."""
    at_once.age_in_steps = False
    caches = [_Cache(stepped), _Cache(at_once)]
    rng = random.Random(seed)
    running: list[list[bytes]] = []
    stepping = 0
    for r, keys in enumerate(_workload(seed, requests)):
        remove = rng.random() < 0.02
        done = running.pop(rng.randrange(len(running))) if len(running) >= in_flight else None
        seen = []
        for cache in caches:
            seen.append((cache.store(keys), cache.remove() if remove else None))
            if done is not None:
                cache.pol.on_access(done, ())
        running.append(keys)
        stepping += bool(stepped._aging)
        if seen[0] != seen[1]:
            return r
        if r % 97 == 0:
            aging = stepped._aging_left
            if stepped.history != at_once.history:
                return r
            assert stepped._aging_left == aging  # reading the history moves no count
    return None if stepping else -1


@pytest.mark.parametrize("policy", ["plfu", "default"])
@pytest.mark.parametrize(("capacity", "step", "in_flight"),
                         [(200, 1, 4), (300, 16, 1), (500, 4, 12)])
def test_aging_in_steps_decides_as_aging_at_once(policy: str, capacity: int, step: int,
                                                 in_flight: int) -> None:
    stepped, at_once = make_policy(policy, capacity), make_policy(policy, capacity)
    assert isinstance(stepped, PLFUPolicy) and isinstance(at_once, PLFUPolicy)
    stepped.AGE_AT_ONCE = stepped.AGE_STEP = step
    assert first_difference(stepped, at_once, seed=capacity + step, in_flight=in_flight) is None


def test_a_short_history_ages_in_steps_as_at_once() -> None:
    """A history of twice the cache: main keys whose count fell to 1 are
    still there at the next aging, which must keep them at 1."""
    stepped, at_once = PLFUPolicy(200, history_factor=2), PLFUPolicy(200, history_factor=2)
    stepped.AGE_AT_ONCE = stepped.AGE_STEP = 1
    assert first_difference(stepped, at_once, seed=5) is None


def test_negative_control_a_step_that_reads_unaged_counts_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without moving a request's counts out of the aging first, its reads find
    no count for a key the history knows: the comparison must see it."""
    stepped, at_once = PLFUPolicy(200), PLFUPolicy(200)
    stepped.AGE_AT_ONCE = stepped.AGE_STEP = 1
    monkeypatch.setattr(stepped, "_age_keys", lambda keys: None)
    assert first_difference(stepped, at_once, seed=5) not in (None, -1)


def test_negative_control_a_main_key_that_loses_its_count_is_caught(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A main key keeps a count of 1 through aging; a step that drops it is caught."""
    settle = plfu._settle_aged
    monkeypatch.setattr(plfu, "_settle_aged",
                        lambda keys, before, counts, main: settle(keys, before, counts, {}))
    # a short history: main keys whose count fell to 1 live to the next aging
    stepped, at_once = PLFUPolicy(200, history_factor=2), PLFUPolicy(200, history_factor=2)
    stepped.AGE_AT_ONCE = stepped.AGE_STEP = 1
    assert first_difference(stepped, at_once, seed=5) not in (None, -1)


def test_a_call_ages_a_bounded_number_of_entries() -> None:
    """Each request moves at most ``AGE_STEP`` plus four per key out of the aging."""
    pol = PLFUPolicy(2000)
    pol.AGE_AT_ONCE = pol.AGE_STEP = 64
    cache, stepped = _Cache(pol), 0
    for keys in _workload(7, 6000):
        cache.store(keys)
        before = pol._aging_left
        pol.on_access(keys, ())
        if before:
            stepped += 1
            assert before - pol._aging_left <= pol.AGE_STEP + 4 * len(keys)
    assert stepped > 100
    assert pol._aging_left <= len(pol._aging) <= pol.history_limit


def _collections_during(call: Callable[[], object]) -> int:
    """Garbage collections of any generation that ``call`` sets off, with the
    collector's default thresholds."""
    threshold = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    try:
        gc.collect()
        before = sum(stats["collections"] for stats in gc.get_stats())
        call()
        return sum(stats["collections"] for stats in gc.get_stats()) - before
    finally:
        gc.set_threshold(*threshold)


def test_an_aging_step_makes_no_object_per_entry() -> None:
    """Thousands of counts moved in one step set off no garbage collection:
    a step makes no (key, count) tuple per entry, which in a server's process
    would start collections that walk everything young. The control lists
    the same entries as tuples and does set collections off."""
    pol = PLFUPolicy(2000)
    pol.AGE_AT_ONCE, pol.AGE_STEP = 64, 16  # an aging that lasts, with most entries left
    cache = _Cache(pol)
    for keys in _workload(11, 20_000):
        cache.store(keys)
        pol.on_access(keys, ())
        if pol._aging_left > 8_000:
            break
    left = pol._aging_left
    assert left > 8_000
    assert _collections_during(lambda: pol._age_some(left)) == 0
    assert pol._aging_left == 0 and not pol._aging
    control = dict.fromkeys((kvtier.block_key(i) for i in range(left)), 1)
    assert _collections_during(lambda: list(control.items())) > 0


def test_shadows_age_at_once() -> None:
    """The shadows read their history's counts directly, so never age in steps."""
    pol = AdaptivePolicy(4096)
    assert all(not s.policy.age_in_steps for s in pol.shadows if isinstance(s, PLFUShadow))
    assert pol.age_in_steps


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), OPS, st.integers(0, 2**32))
def test_random_operations_keep_the_contract_while_aging_in_steps(
        capacity: int, ops: list, seed: int) -> None:
    exercise(_SteppedPLFU(capacity, history_factor=2), ops, random.Random(seed),
             invariants=plfu_invariants)


@pytest.mark.parametrize("bad", ["no", 0, None])
def test_age_in_steps_must_be_a_bool(bad: object) -> None:
    with pytest.raises(ValueError, match="age_in_steps must be True or False"):
        PLFUPolicy(16, age_in_steps=bad)  # type: ignore[arg-type]
