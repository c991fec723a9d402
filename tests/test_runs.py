"""Running requests' kept-ahead blocks as one entry of a KeyOrder (``kvtier.policies.runs``).

``KeyOrder.keep_run_ahead`` must give, key for key, the order that moving
every present key of the request to the newest end gives (the former
``keep_ahead``), under any interleaving of other requests' inserts, moves,
keep-aheads, evictions and removals. The randomized test below checks the
whole order after every operation against a plain ``OrderedDict`` doing the
moves; its negative control is a keep-ahead that skips a shared head.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Container, Sequence
from dataclasses import dataclass, field

import pytest

from kvtier.policies.order import KeyOrder


class Reference:
    """The order, by moving every key (an ``OrderedDict``, oldest first)."""

    def __init__(self) -> None:
        self.d: OrderedDict[bytes, None] = OrderedDict()

    def add_many(self, keys: list[bytes]) -> None:
        for k in keys:
            self.d[k] = None

    def move_present(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            if k in self.d:
                self.d.move_to_end(k)

    def keep_run_ahead(self, run: object, keys: Sequence[bytes], start: int,
                       new: Container[bytes]) -> None:
        self.move_present(list(reversed([k for k in keys if k not in new])))

    def end_run(self, run: object) -> None:
        pass

    def discard(self, key: bytes) -> bool:
        return self.d.pop(key, 0) is None

    def take_oldest(self, n: int, *skip: Container[bytes]) -> list[bytes] | None:
        out = [k for k in self.d if not any(k in s for s in skip)][:n]
        if len(out) < n:
            return None
        for k in out:
            del self.d[k]
        return out

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.d)

    def __len__(self) -> int:
        return len(self.d)


class SkipsSharedHead(Reference):
    """A wrong keep-ahead: the request's first key stays where it is."""

    def keep_run_ahead(self, run: object, keys: Sequence[bytes], start: int,
                       new: Container[bytes]) -> None:
        super().keep_run_ahead(run, list(keys)[1:], start, new)


@dataclass
class Request:
    """A running request: its access order, head first, and what it stored."""

    token: object
    keys: list[bytes] = field(default_factory=list)
    seen: int = 0
    offers: int = 0


def drive(order: KeyOrder, ref: Reference, seed: int, steps: int = 1500) -> None:
    """Random operations on both; the whole order compared after each."""
    rng = random.Random(seed)
    next_key = iter(range(10**9))
    heads = [[b"h%d-%d" % (h, i) for i in range(rng.randint(1, 6))] for h in range(3)]
    running: list[Request] = []
    for step in range(steps):
        op = rng.random()
        if op < 0.12 or not running:  # a request starts, maybe on a shared head
            req = Request(token=object())
            if rng.random() < 0.6:
                req.keys = list(rng.choice(heads))
            running.append(req)
        elif op < 0.55:  # a running request offers a chunk (its head, then new keys)
            req = rng.choice(running)
            chunk = [b"k%d" % next(next_key) for _ in range(rng.randint(1, 5))]
            if req.offers == 0 and req.keys:
                chunk = req.keys + chunk
                req.keys = []
            new = [k for k in chunk if k not in ref.d]
            both_add(order, ref, new)
            req.keys += chunk
            if req.offers:
                restart = rng.random() < 0.08
                if restart:  # the order changed (a context cleared, or resorted)
                    req.keys = [k for k in req.keys if rng.random() < 0.7] or req.keys
                start = 0 if restart else req.seen
                keys = list(req.keys) if restart else req.keys
                order.keep_run_ahead(req.token, keys, start, set(new))
                ref.keep_run_ahead(req.token, keys, start, set(new))
            req.seen = len(req.keys)
            req.offers += 1
        elif op < 0.65:  # a request finishes: its access moves every key
            req = running.pop(rng.randrange(len(running)))
            order.end_run(req.token)
            ref.end_run(req.token)
            keys = list(reversed(req.keys))
            if rng.random() < 0.5:  # or only some (a policy's window keeps the rest)
                keys = [k for k in keys if rng.random() < 0.5]
            order.move_present(keys)
            ref.move_present(keys)
        elif op < 0.8:  # evictions, some keys blocked
            present = list(ref.d)
            blocked = set(rng.sample(present, min(len(present), rng.randint(0, 4))))
            n = rng.randint(1, 4)
            assert order.take_oldest(n, blocked) == ref.take_oldest(n, blocked)
        elif op < 0.88:  # a key leaves by itself (promoted, removed)
            if ref.d:
                key = rng.choice(list(ref.d))
                assert order.discard(key) == ref.discard(key)
        elif op < 0.94:  # a key evicted earlier comes back (another request stores it)
            gone = [k for r in running for k in r.keys if k not in ref.d]
            if gone:
                both_add(order, ref, [rng.choice(gone)])
        else:  # a few keys move by themselves (another request's access)
            if ref.d:
                keys = rng.sample(list(ref.d), min(len(ref.d), 3))
                order.move_present(keys)
                ref.move_present(keys)
        assert list(order) == list(ref), f"seed {seed}, step {step}"
        assert len(order) == len(ref)
    for req in running:
        order.end_run(req.token)
    assert order._runs is None or len(order._runs.in_order) == len(
        {id(r) for r in order._runs.lifted.values()})


def both_add(order: KeyOrder, ref: Reference, keys: list[bytes]) -> None:
    order.add_many(keys)
    ref.add_many(keys)


@pytest.mark.parametrize("run_min", [0, 6])  # 6: short requests move their keys
@pytest.mark.parametrize("seed", range(12))
def test_keep_run_ahead_gives_the_order_moving_every_key_gives(
        seed: int, run_min: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(KeyOrder, "RUN_MIN", run_min)
    drive(KeyOrder(), Reference(), seed)


def test_the_comparison_fails_for_a_keep_ahead_that_skips_a_shared_head(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # negative control: the same driver catches an order that differs
    monkeypatch.setattr(KeyOrder, "RUN_MIN", 0)
    with pytest.raises(AssertionError):
        for seed in range(12):
            drive(KeyOrder(), SkipsSharedHead(), seed)


KEYS = [b"a", b"b", b"c"]


def order_with_a_run(monkeypatch: pytest.MonkeyPatch) -> KeyOrder:
    """``KEYS`` kept ahead as the run of request "r", then ``x``."""
    monkeypatch.setattr(KeyOrder, "RUN_MIN", 0)
    order = KeyOrder()
    order.add_many(KEYS)
    order.keep_run_ahead("r", KEYS, 0, set())
    order.add_many([b"x"])
    return order


def test_a_run_is_one_entry_and_ends_with_its_last_member(
        monkeypatch: pytest.MonkeyPatch) -> None:
    order = order_with_a_run(monkeypatch)
    assert list(order) == [b"c", b"b", b"a", b"x"] and len(order) == 4
    order.add_many([b"d"])
    order.keep_run_ahead("r", [*KEYS, b"d"], 3, {b"d"})
    assert list(order) == [b"x", b"d", b"c", b"b", b"a"]
    order.end_run("r")
    assert order._runs is not None  # finished: its members keep their rank
    assert order.take_oldest(3) == [b"x", b"d", b"c"]
    order.move_present([b"a", b"b"])
    assert order._runs is None and list(order) == [b"a", b"b"]


def test_a_short_request_moves_its_keys() -> None:
    order = KeyOrder()
    order.add_many([b"a", b"b", b"x"])
    order.keep_run_ahead("r", [b"a", b"b"], 0, set())
    assert order._runs is None and list(order) == [b"x", b"b", b"a"]


def test_a_finished_run_at_the_oldest_end_unfolds_into_its_members(
        monkeypatch: pytest.MonkeyPatch) -> None:
    order = order_with_a_run(monkeypatch)
    order.add_many([b"y"])
    order.end_run("r")
    assert order.take_oldest(1) == [b"c"]  # the run's members first, tail first
    assert order._runs is not None  # (the entry was among the newest keys' part)
    assert order.take_oldest(1) == [b"b"]  # the oldest entry now: unfolded first
    assert order._runs is None  # every scan at C speed again
    assert list(order) == [b"a", b"x", b"y"] and len(order) == 3


@pytest.mark.parametrize("start", [-1, 4, 1.5, True])
def test_a_start_outside_the_keys_is_refused(start: object) -> None:
    order = KeyOrder()
    order.add_many(KEYS)
    with pytest.raises(ValueError, match=r"start must be an int in 0\.\.len\(keys\) \(3\)"):
        order.keep_run_ahead("r", KEYS, start, set())  # type: ignore[arg-type]
    assert list(order) == KEYS  # nothing changed
