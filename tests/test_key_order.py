"""``KeyOrder`` (kvtier.policies.order) behaves as an ``OrderedDict`` of its keys."""

from __future__ import annotations

import sys
from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.policies.order import KeyOrder

KEYS = [bytes([i]) for i in range(12)]

_op = st.one_of(
    st.tuples(st.just("add"), st.lists(st.sampled_from(KEYS), max_size=5)),
    st.tuples(st.just("add_many"), st.lists(st.sampled_from(KEYS), max_size=5)),
    st.tuples(st.just("to_end"), st.lists(st.sampled_from(KEYS), max_size=5)),
    st.tuples(st.just("move_present"), st.lists(st.sampled_from(KEYS), max_size=5)),
    st.tuples(st.just("discard"), st.lists(st.sampled_from(KEYS), max_size=3)),
    st.tuples(st.just("evict"), st.tuples(st.integers(0, 4), st.sets(st.sampled_from(KEYS)))),
    st.tuples(st.just("pop"), st.just(None)),
    st.tuples(st.just("pop_many"), st.integers(0, 4)),
    st.tuples(st.just("take_oldest"), st.tuples(st.integers(0, 4), st.sets(st.sampled_from(KEYS)))),
)


def _apply(order: KeyOrder, model: OrderedDict[bytes, None], op: str, arg: object) -> None:
    if op == "add":  # any keys, one at a time
        for key in arg:  # type: ignore[attr-defined]
            order.add(key)
            model[key] = None
    elif op == "add_many":  # keys that are absent
        fresh = [k for k in dict.fromkeys(arg) if k not in model]  # type: ignore[call-overload]
        order.add_many(fresh)
        for key in fresh:
            model[key] = None
    elif op == "to_end":
        order.to_end(arg)  # type: ignore[arg-type]
        for key in arg:  # type: ignore[attr-defined]
            model.pop(key, None)
            model[key] = None
    elif op == "move_present":
        order.move_present(arg)  # type: ignore[arg-type]
        for key in arg:  # type: ignore[attr-defined]
            if key in model:
                model.move_to_end(key)
    elif op == "discard":
        for key in arg:  # type: ignore[attr-defined]
            assert order.discard(key) == (key in model)
            model.pop(key, None)
    elif op == "evict":
        n, skip = arg  # type: ignore[misc]
        victims = [k for k in order if k not in skip][:n]
        assert victims == [k for k in model if k not in skip][:n]
        order.evicted(victims, skip)
        for key in victims:
            del model[key]
    elif op == "take_oldest":
        n, skip = arg  # type: ignore[misc]
        want = [k for k in model if k not in skip][:n]
        got = order.take_oldest(n, skip)
        if len(want) < n:
            assert got is None
        else:
            assert got == want
            for key in want:
                del model[key]
    elif op == "pop_many":
        want = [model.popitem(last=False)[0] for _ in range(min(arg, len(model)))]  # type: ignore[call-overload]
        assert order.pop_oldest_many(arg) == want  # type: ignore[arg-type]
    elif model:
        assert order.pop_oldest() == model.popitem(last=False)[0]
    else:
        with pytest.raises(KeyError):
            order.pop_oldest()


@settings(max_examples=300, deadline=None)
@given(st.lists(_op, max_size=40))
def test_same_order_as_an_ordered_dict(ops: list[tuple[str, object]]) -> None:
    order, model = KeyOrder(), OrderedDict[bytes, None]()
    for op, arg in ops:
        _apply(order, model, op, arg)
        assert list(order) == list(model)
        assert len(order) == len(model) and bool(order) == bool(model)
        assert all((k in order) == (k in model) for k in KEYS)
        assert order.present(KEYS) == set(model)
        slots = order._parked + order._old_order
        assert order._dead == sum(1 for k in slots if k not in order._old)


def test_move_to_end_and_del_raise_for_absent_keys() -> None:
    order = KeyOrder()
    order.add_many([b"a", b"b"])
    order.move_to_end(b"a")
    assert list(order) == [b"b", b"a"]
    with pytest.raises(KeyError):
        order.move_to_end(b"c")
    del order[b"b"]
    with pytest.raises(KeyError):
        del order[b"b"]
    order.clear()
    assert not order and list(order) == []


def test_a_million_keys_stored_then_reordered_take_one_dict_entry_each() -> None:
    """Each key added, then moved by its own request's access: ~42 B per key
    (an OrderedDict takes ~91 B), not the 84 B of a dict entry per move."""
    order = KeyOrder()
    n, per = 200_000, 32
    keys = [i.to_bytes(36, "big") for i in range(n)]
    for start in range(0, n, per):
        batch = keys[start:start + per]
        order.add_many(batch)
        order.move_present(reversed(batch))
    parts = (order._old, order._mid, order._tail)  # no eviction: no list yet
    table = sum(sys.getsizeof(p) for p in parts)
    assert table / n < 60
    compact = sys.getsizeof(dict.fromkeys(keys))
    assert table <= compact * 1.05


def test_scans_from_the_oldest_end_do_not_walk_over_holes() -> None:
    """Evicting the oldest keys one at a time stays O(1): the holes they leave
    are given back, so the dict's entry table does not grow with evictions."""
    order = KeyOrder()
    order.add_many(i.to_bytes(8, "big") for i in range(10_000))
    order.pop_oldest()  # builds the compact old part
    size = sys.getsizeof(order._old)
    for i in range(10_000, 60_000):
        victim = next(iter(order))
        order.evicted([victim])
        order.add(i.to_bytes(8, "big"))
        if i % 5_000 == 0:
            order.move_present([])
    assert len(order) == 9_999
    assert sys.getsizeof(order._old) <= size
