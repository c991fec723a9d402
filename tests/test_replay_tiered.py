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
    assert row.split()[:5] == ["lru", "6", "256", "1", "0.0000"]  # first turns only: no hits


def test_cli_disk_blocks_rejects_bounds(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    trace = _write_trace(tmp_path / "t.jsonl")
    assert main(["replay", str(trace), "--capacity", "6", "--policy", "lru",
                 "--disk-blocks", "8", "--bounds"]) == 2
    assert "--disk-blocks" in capsys.readouterr().err
