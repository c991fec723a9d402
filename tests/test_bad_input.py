"""Bad input gets a clear exception, never silent corruption (the issue's point 7)."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import fill, key, keys, request

import kvtier
from kvtier import OffloadManager, ProtocolError, RequestContext

A, B = keys(range(2))

# -- keys ----------------------------------------------------------------------------------

BAD_KEY_LISTS = [
    pytest.param(["abc"], id="str-key"),
    pytest.param([1, 2], id="int-keys"),
    pytest.param([bytearray(b"x" * 12)], id="bytearray-key"),
    pytest.param([A, None], id="none-among-bytes"),
    pytest.param(A, id="one-bytes-not-a-list"),
    pytest.param("abc", id="str-not-a-list"),
    pytest.param(7, id="int-not-a-list"),
]

LIST_CALLS = ["lookup", "prepare_load", "complete_load", "prepare_store", "complete_store", "touch"]


@pytest.mark.parametrize("bad", BAD_KEY_LISTS)
@pytest.mark.parametrize("call", LIST_CALLS)
def test_wrong_key_type_is_type_error_and_changes_nothing(call: str, bad: Any) -> None:
    mgr = OffloadManager(4)
    fill(mgr, [A])
    before = mgr.stats()
    with pytest.raises(TypeError):
        getattr(mgr, call)(bad, request("r"))
    assert mgr.stats() == before
    assert mgr.debug_state()["policy_size"] == 1


@pytest.mark.parametrize("bad", ["abc", 1, bytearray(b"x"), None, [A]])
@pytest.mark.parametrize("call", ["lookup_one", "contains", "admission_count"])
def test_wrong_single_key_type_is_type_error(call: str, bad: Any) -> None:
    mgr = OffloadManager(4, store_threshold=2)
    args = (bad, request("r")) if call == "lookup_one" else (bad,)
    with pytest.raises(TypeError):
        getattr(mgr, call)(*args)


def test_set_position_rejects_bad_key_and_position() -> None:
    ctx = RequestContext("r")
    with pytest.raises(TypeError):
        ctx.set_position("k", 16)  # type: ignore[arg-type]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError):
            ctx.set_position(A, bad)  # type: ignore[arg-type]


def test_set_positions_rejects_bad_input_and_records_nothing() -> None:
    ctx = RequestContext("r")
    with pytest.raises(TypeError, match="str"):
        ctx.set_positions([A, "k"], 16, 16)  # type: ignore[list-item]
    assert ctx.positions == {}  # not even the good key before the bad one
    for first_end, step in ((-1, 16), (16, 0), (True, 16), (16, 1.5)):
        with pytest.raises(ValueError):
            ctx.set_positions([A], first_end, step)  # type: ignore[arg-type]
    ctx.set_positions([A, b"b" * 12], 16, 32)
    assert ctx.positions == {A: 16, b"b" * 12: 48}


def test_block_key_rejects_bad_input() -> None:
    with pytest.raises(TypeError):
        kvtier.block_key("abc")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        kvtier.block_key(-1)
    with pytest.raises(ValueError):
        kvtier.block_key(b"")
    with pytest.raises(ValueError):
        kvtier.block_key(1, group=-1)


@pytest.mark.parametrize("bad", [None, "req-1", object()])
def test_wrong_context_type_is_type_error(bad: Any) -> None:
    mgr = OffloadManager(4)
    with pytest.raises(TypeError):
        mgr.lookup([A], bad)


def test_context_of_another_manager_is_protocol_error() -> None:
    m1, m2 = OffloadManager(4), OffloadManager(4)
    ctx = request("r", [A])
    m1.lookup([A], ctx)
    with pytest.raises(ProtocolError):
        m2.prepare_store([A], ctx)
    assert not m2.contains(A)


# -- protocol --------------------------------------------------------------------------------


def test_complete_load_without_prepare_load() -> None:
    mgr = OffloadManager(4)
    fill(mgr, [A])
    with pytest.raises(ProtocolError, match="complete_load"):
        mgr.complete_load([A], request("r"))
    assert mgr.stats()["pinned"] == 0


def test_complete_load_more_often_than_prepared() -> None:
    mgr = OffloadManager(4)
    fill(mgr, [A, B])
    r = request("r")
    mgr.prepare_load([A, B], r)
    with pytest.raises(ProtocolError):
        mgr.complete_load([A, A], r)
    assert mgr.stats()["pinned"] == 2  # nothing changed
    mgr.complete_load([A, B], r)
    with pytest.raises(ProtocolError):
        mgr.complete_load([A], r)
    assert mgr.stats()["pinned"] == 0


def test_complete_load_by_another_request() -> None:
    mgr = OffloadManager(4)
    fill(mgr, [A])
    mgr.prepare_load([A], request("r1"))
    with pytest.raises(ProtocolError):
        mgr.complete_load([A], request("r2"))
    assert mgr.stats()["pinned"] == 1


def test_complete_store_for_unknown_key() -> None:
    mgr = OffloadManager(4)
    r = request("r", [A, B])
    out = mgr.prepare_store([A], r)
    assert out is not None
    with pytest.raises(ProtocolError, match="complete_store"):
        mgr.complete_store([A, B], r)
    assert mgr.stats()["write_pending"] == 1  # nothing changed, A included
    mgr.complete_store([A], r)
    assert mgr.stats()["ready"] == 1


def test_complete_store_twice_or_by_another_request() -> None:
    mgr = OffloadManager(4)
    r = request("r", [A])
    mgr.prepare_store([A], r)
    with pytest.raises(ProtocolError):
        mgr.complete_store([A], request("other"))
    mgr.complete_store([A], r)
    with pytest.raises(ProtocolError):
        mgr.complete_store([A], r)
    with pytest.raises(ProtocolError):
        mgr.complete_store([A], r, success=False)
    assert mgr.contains(A) and mgr.stats()["stores"] == 1


def test_complete_store_of_a_key_that_was_only_reused() -> None:
    mgr = OffloadManager(4)
    fill(mgr, [A])
    r = request("r", [A])
    assert mgr.prepare_store([A], r) == ([], [], [])
    with pytest.raises(ProtocolError):
        mgr.complete_store([A], r, success=False)  # would free a block it never wrote
    assert mgr.contains(A)


# -- sizes and thresholds --------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, 2.0, "8", True, None])
def test_num_blocks_must_be_positive_int(bad: Any) -> None:
    with pytest.raises((ValueError, TypeError)):
        OffloadManager(bad)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"store_threshold": 0},
        {"store_threshold": -2},
        {"store_threshold": 1.5},
        {"max_tracker_size": 0},
        {"max_tracker_size": -1},
        {"eviction_history_size": -1},
        {"max_events": 0},
        {"max_events": -5},
        {"max_leases_per_request": -1},
        {"max_leased_blocks": -1},
        {"lease_timeout_s": 0},
        {"lease_timeout_s": -1.0},
        {"lease_timeout_s": float("nan")},
        {"lease_timeout_s": float("inf")},  # a lease that never lapses
        {"lease_timeout_s": True},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
def test_bad_sizes_and_thresholds_are_value_errors(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        OffloadManager(8, **kwargs)


@pytest.mark.parametrize("kwargs", [{"max_leases_per_request": 0}, {"max_leased_blocks": 0}])
def test_zero_lease_bounds_are_rejected(kwargs: dict[str, Any]) -> None:
    # With no lease budget a lookup can never report a hit: the cache would
    # silently never serve anything.
    with pytest.raises(ValueError):
        OffloadManager(8, **kwargs)


def test_request_id_must_be_nonempty_str() -> None:
    for bad in ("", None, 3):
        with pytest.raises(ValueError):
            RequestContext(bad)  # type: ignore[arg-type]


def test_threshold_one_with_valid_tracker_size() -> None:
    mgr = OffloadManager(4, store_threshold=1, max_tracker_size=1)
    out = mgr.prepare_store([key(1)], request("r"))
    assert out is not None and out.keys_to_store == [key(1)]
