"""The same trace under other block hashes (kvtier.replay.rekey, ``kvtier replay --key-seed``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvtier.replay.rekey as rekey
from kvtier.cli import main
from kvtier.policies.adaptive import AdaptivePolicy
from kvtier.replay.driver import replay, trace_keys
from kvtier.replay.generate import generate, write_trace
from kvtier.replay.rekey import rekeyed
from kvtier.replay.trace import TraceRequest


@pytest.fixture(scope="module")
def requests() -> list[TraceRequest]:
    return list(generate("tenants", 3, 600))


def _structure(reqs: list[TraceRequest]) -> list[list[int]]:
    """Each request's ids renumbered by first appearance: what a replay can tell apart."""
    seen: dict[int, int] = {}
    return [[seen.setdefault(i, len(seen)) for i in r.hash_ids] for r in reqs]


def test_seed_zero_is_the_trace_itself(requests: list[TraceRequest]) -> None:
    assert rekeyed(requests, 0) == requests


@pytest.mark.parametrize("seed", [1, 2, 2**64 - 1])
def test_a_seed_keeps_every_request_and_its_prefix_structure(
        requests: list[TraceRequest], seed: int) -> None:
    out = rekeyed(requests, seed)
    assert _structure(out) == _structure(requests)
    assert [(r.timestamp, r.input_length, r.output_length) for r in out] == [
        (r.timestamp, r.input_length, r.output_length) for r in requests]
    assert all(0 <= i < 2**64 for r in out for i in r.hash_ids)
    assert rekeyed(requests, seed) == out  # deterministic
    ids = {i for r in requests for i in r.hash_ids}
    assert not ids & {i for r in out for i in r.hash_ids}


def test_seeds_differ(requests: list[TraceRequest]) -> None:
    assert rekeyed(requests, 1) != rekeyed(requests, 2)


@pytest.mark.parametrize("seed", [-1, 2**64, True, 1.0, "1"])
def test_bad_seed_is_refused(requests: list[TraceRequest], seed: object) -> None:
    with pytest.raises(ValueError, match="key seed must be an int"):
        rekeyed(requests, seed)  # type: ignore[arg-type]


def test_requests_must_be_trace_requests() -> None:
    with pytest.raises(TypeError, match=r"rekeyed takes TraceRequests.*got dict"):
        rekeyed([{"hash_ids": [1, 2]}], 3)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="got dict"):
        rekeyed([{"hash_ids": [1, 2]}], 0)  # type: ignore[list-item]


def test_two_ids_on_one_new_id_raise_rather_than_merge_blocks(
        monkeypatch: pytest.MonkeyPatch, requests: list[TraceRequest]) -> None:
    # a 64-bit collision cannot be produced on demand: stand one in
    monkeypatch.setattr(rekey, "_rekey", lambda hash_id, key: 7)
    with pytest.raises(ValueError, match="maps two hash ids to 7"):
        rekeyed(requests, 5)


def test_policies_that_never_read_key_bytes_give_the_same_figures(
        requests: list[TraceRequest]) -> None:
    for policy in ("lru", "arc"):
        figures = {
            (r.hit_blocks, r.stores, r.evictions)
            for seed in (0, 1, 2)
            for r in [replay(trace_keys(rekeyed(requests, seed)), 150, policy)]
        }
        assert len(figures) == 1, policy


def test_the_default_shadows_sample_other_blocks_under_another_seed(
        requests: list[TraceRequest]) -> None:
    pol = AdaptivePolicy(1000)

    def sampled_positions(seed: int) -> set[tuple[int, int]]:
        keys = trace_keys(rekeyed(requests, seed))
        return {(r, j) for r, row in enumerate(keys) for j, k in enumerate(row)
                if pol.sampled([k])}

    base = sampled_positions(0)
    assert base and sampled_positions(1) and sampled_positions(1) != base


def test_cli_key_seed(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                      requests: list[TraceRequest]) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(requests, path)

    def rows(*extra: str) -> list[dict[str, object]]:
        assert main(["replay", str(path), "--capacity", "150", "--policy", "lru",
                     "--json", "--no-progress", *extra]) == 0
        out = capsys.readouterr().out
        return [{k: v for k, v in json.loads(line).items() if k != "us_per_key"}
                for line in out.splitlines()]

    own = rows()
    assert [r.pop("key_seed") for r in own] == [0]
    assert rows("--key-seed", "0") == [{**own[0], "key_seed": 0}]
    # LRU: the same figures under any seed
    assert rows("--key-seed", "4") == [{**own[0], "key_seed": 4}]
    with pytest.raises(SystemExit):
        main(["replay", str(path), "--capacity", "150", "--policy", "lru",
              "--key-seed", "-1"])
    assert "--key-seed: seeds are >= 0, got '-1'" in capsys.readouterr().err
