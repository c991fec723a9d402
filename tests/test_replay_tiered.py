"""The tiered replay (kvtier.replay.tiered): CPU slots + a real disk tier."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvtier.cli import main
from kvtier.replay.driver import replay, trace_keys
from kvtier.replay.tiered import key_bytes, replay_tiered
from kvtier.replay.trace import TraceRequest


def _trace() -> list[list[bytes]]:
    """12 conversations of 3 turns each (prefixes grow by 2 blocks a turn),
    interleaved so a 6-block CPU tier forgets a conversation before it comes back."""
    requests: list[TraceRequest] = []
    for turn in range(1, 4):
        for conv in range(12):
            ids = tuple(conv * 100 + j for j in range(2 * turn + 1))
            requests.append(TraceRequest(len(requests), 512 * len(ids), 1, ids))
    return trace_keys(requests)


def test_key_bytes_are_per_key() -> None:
    a, b = key_bytes(b"a" * 12, 64), key_bytes(b"b" * 12, 64)
    assert a.nbytes == 64 and not np.array_equal(a, b)
    assert np.array_equal(a, key_bytes(b"a" * 12, 64))


@pytest.mark.parametrize("policy", ["lru", "default"])
def test_cpu_alone_matches_sequential_driver(policy: str, tmp_path: Path) -> None:
    keys = _trace()
    alone = replay_tiered(keys, 6, 0, policy, workdir=tmp_path)
    ref = replay(keys, 6, policy)
    assert alone.hit_blocks == alone.cpu_hit_blocks == ref.hit_blocks
    assert alone.disk_hit_blocks == 0 and alone.verify_failures == 0


@pytest.mark.parametrize("policy", ["lru", "default"])
def test_disk_adds_hits_and_promoted_bytes_verify(policy: str, tmp_path: Path) -> None:
    keys = _trace()
    alone = replay_tiered(keys, 6, 0, policy, workdir=tmp_path)
    tiered = replay_tiered(keys, 6, 256, policy, workdir=tmp_path)
    assert tiered.hit_blocks >= alone.hit_blocks
    assert tiered.disk_hit_blocks > 0 and tiered.promotions >= tiered.disk_hit_blocks
    assert tiered.hit_blocks == tiered.cpu_hit_blocks + tiered.disk_hit_blocks
    assert tiered.hit_ratio == pytest.approx(tiered.cpu_hit_ratio + tiered.disk_hit_ratio)
    # Every later turn of every conversation hits its whole earlier prefix (disk holds all).
    assert tiered.hit_blocks == sum(12 * (2 * t + 1) for t in (1, 2))
    assert tiered.verify_failures == 0 and tiered.dropped_writes == 0
    assert tiered.promotion_failures == 0
    assert list(tmp_path.iterdir()) == []  # temporary region and disk removed


def test_small_disk_still_no_worse(tmp_path: Path) -> None:
    keys = _trace()
    alone = replay_tiered(keys, 6, 0, "lru", workdir=tmp_path)
    tiered = replay_tiered(keys, 6, 8, "lru", workdir=tmp_path)
    assert tiered.hit_blocks >= alone.hit_blocks and tiered.verify_failures == 0


def _trace_with_one_offs() -> list[list[bytes]]:
    """``_trace()`` with a one-off prompt (3 blocks no other request has) after
    every request: 192 distinct blocks, 60 of them used by two requests or more
    (each conversation's first 5 blocks)."""
    requests: list[TraceRequest] = []
    for turn in range(1, 4):
        for conv in range(12):
            for ids in (tuple(conv * 100 + j for j in range(2 * turn + 1)),
                        tuple(10_000 + 10 * len(requests) + j for j in range(3))):
                requests.append(TraceRequest(len(requests), 512 * len(ids), 1, ids))
    return trace_keys(requests)


def test_disk_threshold_two_keeps_one_off_blocks_off_disk(tmp_path: Path) -> None:
    keys = _trace_with_one_offs()
    once = replay_tiered(keys, 8, 256, "lru", workdir=tmp_path)
    twice = replay_tiered(keys, 8, 256, "lru", disk_store_threshold=2, workdir=tmp_path)
    assert (once.disk_store_threshold, twice.disk_store_threshold) == (1, 2)
    assert once.disk_writes == 192 and once.writes_not_admitted == 0
    # Only blocks a second request used reach the disk: no one-off prompt, no last turn.
    assert twice.disk_writes == 60 < once.disk_writes and twice.writes_not_admitted > 0
    # The price: a conversation's second turn misses (its blocks were used once
    # when evicted); the third hits the first turn's 3 blocks, which the second
    # turn's offer admitted. Threshold 1: second turns hit 3, third turns 5.
    assert once.hit_blocks == once.disk_hit_blocks == 12 * (3 + 5)
    assert twice.hit_blocks == twice.disk_hit_blocks == 12 * 3
    for r in (once, twice):
        assert r.verify_failures == 0 and r.dropped_writes == 0
        assert r.promotion_failures == 0


def test_disk_threshold_counts_cpu_hits_as_uses(tmp_path: Path) -> None:
    """With room for everything in the CPU tier a block's second use is a CPU
    hit (never an offer of a new block): it must still admit the block."""
    keys = _trace_with_one_offs()
    r = replay_tiered(keys, 1000, 256, "lru", disk_store_threshold=2, workdir=tmp_path)
    assert r.evictions == 0 and r.hit_blocks == r.cpu_hit_blocks == 12 * (3 + 5)
    assert r.disk_writes == 60 and r.verify_failures == 0


def test_evict_policy_writes_only_blocks_leaving_the_cpu(tmp_path: Path) -> None:
    keys = _trace_with_one_offs()
    store = replay_tiered(keys, 1000, 256, "lru", workdir=tmp_path)
    evict = replay_tiered(keys, 1000, 256, "lru", disk_write_policy="evict", workdir=tmp_path)
    assert evict.disk_write_policy == "evict" and store.disk_write_policy == "store"
    assert store.disk_writes == 192
    assert evict.evictions == 0 and evict.disk_writes == 0  # nothing left the CPU tier
    assert evict.hit_blocks == store.hit_blocks
    for threshold in (1, 2):
        small = replay_tiered(keys, 8, 256, "lru", disk_store_threshold=threshold,
                              disk_write_policy="evict", workdir=tmp_path)
        # Each evicted block is written, found on disk already, or not admitted.
        assert small.evictions > 0 and small.disk_writes > 0
        assert (small.disk_writes + small.duplicate_writes_skipped
                + small.writes_not_admitted) == small.evictions
        assert (small.writes_not_admitted > 0) == (threshold > 1)
        assert small.disk_hit_blocks > 0 and small.verify_failures == 0
        assert small.dropped_writes == 0 and small.promotion_failures == 0


def test_evict_policy_matches_store_hits_on_disk(tmp_path: Path) -> None:
    """An evicted block is on disk before its slot is reused, so evict finds
    every block store does (the disk holds all): same hits, fewer writes."""
    keys = _trace_with_one_offs()
    store = replay_tiered(keys, 8, 256, "lru", workdir=tmp_path)
    evict = replay_tiered(keys, 8, 256, "lru", disk_write_policy="evict", workdir=tmp_path)
    assert evict.hit_blocks == store.hit_blocks and evict.disk_hit_blocks > 0
    assert evict.disk_writes < store.disk_writes


@pytest.mark.parametrize(("options", "message"), [
    ({"disk_store_threshold": 0}, "disk_store_threshold must be an int >= 1"),
    ({"disk_store_threshold": True}, "disk_store_threshold must be an int >= 1"),
    ({"disk_write_policy": "lazy"}, "disk_write_policy must be one of store, evict"),
])
def test_bad_disk_options(options: dict[str, object], message: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=message):
        replay_tiered(_trace(), 6, 8, "lru", workdir=tmp_path, **options)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def _write_trace(path: Path) -> Path:
    lines: list[str] = []
    for turn in range(1, 4):
        for conv in range(12):
            ids = [conv * 100 + j for j in range(2 * turn + 1)]
            lines.append(json.dumps({"timestamp": len(lines), "input_length": 512 * len(ids),
                                     "output_length": 1, "hash_ids": ids}))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_cli_disk_blocks_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _write_trace(tmp_path / "t.jsonl")
    assert main(["replay", str(trace), "--capacity", "6", "--policy", "lru",
                 "--disk-blocks", "256", "--json", "--no-progress"]) == 0
    row = json.loads(capsys.readouterr().out.strip())
    assert row["disk_blocks"] == 256 and row["requests"] == 36
    assert row["hit_ratio"] == pytest.approx(row["cpu_hit_ratio"] + row["disk_hit_ratio"])
    assert row["disk_hit_ratio"] > 0 and row["verify_failures"] == 0


def test_cli_disk_blocks_table_and_limit(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    trace = _write_trace(tmp_path / "t.jsonl")
    assert main(["replay", str(trace), "--capacity", "6", "--policy", "lru",
                 "--disk-blocks", "256", "--limit-requests", "12", "--no-progress"]) == 0
    header, row = capsys.readouterr().out.strip().splitlines()
    assert header.split()[:3] == ["policy", "capacity", "disk"]
    # first turns only: no hits; every block (12 x 3) written through
    assert row.split()[:10] == ["lru", "6", "256", "1", "1", "store", "0.0000", "0.0000",
                                "0.0000", "36"]


def test_cli_disk_blocks_rejects_bounds(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    trace = _write_trace(tmp_path / "t.jsonl")
    assert main(["replay", str(trace), "--capacity", "6", "--policy", "lru",
                 "--disk-blocks", "8", "--bounds"]) == 2
    assert "--disk-blocks" in capsys.readouterr().err


def test_cli_disk_options_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _write_trace(tmp_path / "t.jsonl")
    assert main(["replay", str(trace), "--capacity", "6", "--policy", "lru",
                 "--disk-blocks", "256", "--disk-store-threshold", "1,2",
                 "--disk-write-policy", "store,evict", "--json", "--no-progress"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["disk_store_threshold"], r["disk_write_policy"]) for r in rows] == [
        (1, "store"), (1, "evict"), (2, "store"), (2, "evict")]
    writes = {(r["disk_store_threshold"], r["disk_write_policy"]): r["disk_writes"]
              for r in rows}
    assert writes[2, "store"] < writes[1, "store"]
    assert writes[2, "evict"] < writes[1, "evict"]
    assert all(r["verify_failures"] == 0 for r in rows)


@pytest.mark.parametrize(("argv", "message"), [
    (["--disk-store-threshold", "0"], "argument --disk-store-threshold: must be >= 1, got 0"),
    (["--disk-store-threshold", "1,two"], "argument --disk-store-threshold: not an integer"),
    (["--disk-write-policy", "lazy"],
     "argument --disk-write-policy: unknown write policy 'lazy' (choose from store, evict)"),
    (["--disk-write-policy", "store,"], "argument --disk-write-policy: empty name"),
])
def test_cli_bad_disk_options(argv: list[str], message: str, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    trace = _write_trace(tmp_path / "t.jsonl")
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(trace), "--capacity", "6", "--policy", "lru",
              "--disk-blocks", "8", *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--disk-store-threshold", "--disk-write-policy"])
def test_cli_disk_options_need_disk_blocks(option: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    trace = _write_trace(tmp_path / "t.jsonl")
    value = "2" if option == "--disk-store-threshold" else "evict"
    assert main(["replay", str(trace), "--capacity", "6", "--policy", "lru",
                 option, value]) == 2
    assert f"kvtier: error: {option} needs --disk-blocks" in capsys.readouterr().err
