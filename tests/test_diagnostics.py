"""Eviction history and the explanation of a failed load, DESIGN.md §6."""

from __future__ import annotations

import re
import time

import pytest
from conftest import fill, key, keys, request

import kvtier
from kvtier import MissingBlocksError, OffloadManager
from kvtier.history import EvictionHistory

DETAIL = re.compile(r"\((\d+|None), (None|\d+(?:\.\d+)?)\)")


def details(message: str) -> list[tuple[int | None, float | None]]:
    """The ``(end_token, seconds since eviction or None)`` pairs of an error message."""
    out: list[tuple[int | None, float | None]] = []
    for pos, ago in DETAIL.findall(message):
        out.append((None if pos == "None" else int(pos), None if ago == "None" else float(ago)))
    return out


def evict_all(mgr: OffloadManager, n: int, base: int = 900_000) -> None:
    """Push every block out by storing ``n`` new keys."""
    fill(mgr, keys(range(base, base + n)))


def failed_load(mgr: OffloadManager, ks: list[bytes], ctx: kvtier.RequestContext) -> str:
    with pytest.raises(MissingBlocksError) as err:
        mgr.prepare_load(ks, ctx)
    return str(err.value)


def test_missing_blocks_error_explains_the_miss() -> None:
    mgr = OffloadManager(3)
    ks = [key(i, 1) for i in range(5)]
    fill(mgr, ks[:3])  # ks[0..2] resident
    r = request("req-42", ks)  # positions 16, 32, 48, 64, 80
    fill(mgr, [ks[3]])  # evicts the tail of the first request: ks[2]
    assert not mgr.contains(ks[2]) and mgr.contains(ks[3])
    time.sleep(0.05)
    message = failed_load(mgr, ks, r)
    assert "'req-42'" in message
    assert "KV group 1" in message
    assert "2 of 5 keys missing" in message
    got = details(message)
    assert [pos for pos, _ in got] == [48, 80]
    ago_evicted, ago_never = got[0][1], got[1][1]
    assert ago_evicted is not None and 0.04 <= ago_evicted < 30
    assert ago_never is None
    assert "16..80" in message  # the load's end-token range
    assert re.search(r"history spans \d+(\.\d+)? s", message)


def test_missing_blocks_error_is_a_key_error_with_readable_text() -> None:
    mgr = OffloadManager(2)
    k = key(1)
    with pytest.raises(KeyError) as err:
        mgr.prepare_load([k], request("r", [k]))
    assert isinstance(err.value, kvtier.KVTierError)
    assert str(err.value).startswith("request 'r'")  # not repr()'d like a plain KeyError


def test_error_details_at_most_sixteen_keys() -> None:
    mgr = OffloadManager(4)
    ks = keys(range(20))
    message = failed_load(mgr, ks, request("r", ks))
    assert "20 of 20 keys missing" in message
    got = details(message)
    assert len(got) == 16
    assert [pos for pos, _ in got] == [16 * (i + 1) for i in range(16)]
    assert all(ago is None for _, ago in got)


def test_error_names_every_group_of_missing_keys() -> None:
    mgr = OffloadManager(4)
    ks = [key(1, 0), key(1, 3)]
    message = failed_load(mgr, ks, request("r", ks))
    assert "KV group 0, 3" in message


def test_error_without_positions_says_so() -> None:
    mgr = OffloadManager(4)
    ks = keys(range(2))
    message = failed_load(mgr, ks, kvtier.RequestContext("r"))
    assert "2 of 2 keys missing" in message
    assert details(message) == [(None, None), (None, None)]
    assert "unknown" in message


def test_write_pending_key_is_missing_for_loads() -> None:
    mgr = OffloadManager(4)
    k = key(1)
    writer = request("w", [k])
    mgr.prepare_store([k], writer)
    message = failed_load(mgr, [k], request("r", [k]))
    assert "1 of 1 keys missing" in message


def test_failed_load_changes_nothing() -> None:
    mgr = OffloadManager(4, max_leased_blocks=4)
    a, b, c = keys(range(3))
    fill(mgr, [a, b])
    r = request("r", [a, b, c])
    assert mgr.lookup([a, b, c], r) == 2
    before = mgr.stats()
    failed_load(mgr, [a, b, c], r)
    assert mgr.stats() == before
    assert (before["pinned"], before["leased"]) == (0, 2)
    spec = mgr.prepare_load([a, b], r)  # the leases are still there to become pins
    assert len(spec.block_ids) == 2
    with pytest.raises(kvtier.ProtocolError):
        mgr.complete_load([c], r)  # the failed load pinned nothing


def test_message_built_only_on_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = OffloadManager(4, max_leased_blocks=4)
    ks = keys(range(3))
    fill(mgr, ks)
    evict_all(mgr, 4)
    fill(mgr, ks)
    built = []
    lookups = []

    class SpyError(MissingBlocksError):
        def __init__(self, message: str) -> None:
            built.append(message)
            super().__init__(message)

    real = EvictionHistory.evicted_at
    monkeypatch.setattr("kvtier.manager.MissingBlocksError", SpyError)
    monkeypatch.setattr(
        EvictionHistory, "evicted_at", lambda self, k: lookups.append(k) or real(self, k)
    )
    r = request("r", ks)
    for _ in range(50):
        assert mgr.lookup(ks, r) == 3
        mgr.prepare_load(ks, r)
        mgr.complete_load(ks, r)
    assert built == [] and lookups == []
    with pytest.raises(MissingBlocksError):
        mgr.prepare_load(keys([77]), r)
    assert len(built) == 1 and lookups == keys([77])


# -- the history -----------------------------------------------------------------------


def test_history_is_bounded() -> None:
    mgr = OffloadManager(2, eviction_history_size=5)
    for i in range(20):
        fill(mgr, keys([i]))
        assert mgr.debug_state()["history_size"] <= 5
    assert mgr.stats()["evictions"] == 18
    assert 1 <= mgr.debug_state()["history_size"] <= 5
    # the oldest evictions are forgotten: key 0 is no longer explained
    message = failed_load(mgr, keys([0, 16]), request("r", keys([0, 16])))
    got = details(message)
    assert got[0] == (16, None)
    assert got[1][1] is not None


def test_history_cut_keeps_the_newest_three_quarters_in_eviction_order() -> None:
    history = EvictionHistory(8)
    ks = keys(range(12))
    history.record(ks[:9])  # 9 > 8: cut back to the newest 6
    assert [k for k in ks if history.evicted_at(k) is not None] == ks[3:9]
    history.record([ks[3]])  # evicted again: now the newest
    history.record(ks[9:12])  # 9 > 8 again: ks[4:7] are the oldest three
    remembered = {k for k in ks if history.evicted_at(k) is not None}
    assert remembered == {ks[3], *ks[7:12]} and len(history) == 6


def test_history_disabled_with_size_zero() -> None:
    mgr = OffloadManager(1, eviction_history_size=0)
    fill(mgr, keys([1]))
    fill(mgr, keys([2]))
    assert mgr.stats()["evictions"] == 1
    assert mgr.debug_state()["history_size"] == 0
    message = failed_load(mgr, keys([1]), request("r", keys([1])))
    assert details(message) == [(16, None)]


def test_history_forgotten_on_reset() -> None:
    mgr = OffloadManager(1)
    fill(mgr, keys([1]))
    fill(mgr, keys([2]))
    assert mgr.debug_state()["history_size"] == 1
    mgr.reset()
    assert mgr.debug_state()["history_size"] == 0


def test_reevicted_key_reports_its_last_eviction() -> None:
    mgr = OffloadManager(1)
    a, b = keys(range(2))
    fill(mgr, [a])
    fill(mgr, [b])  # a evicted
    time.sleep(0.3)
    fill(mgr, [a])  # b evicted
    fill(mgr, [b])  # a evicted again, just now
    message = failed_load(mgr, [a], request("r", [a]))
    ago = details(message)[0][1]
    assert ago is not None and ago < 0.25
    assert mgr.debug_state()["history_size"] == 2
