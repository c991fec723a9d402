"""The policy rows measured on public traces the repository does not bundle.

Issue 11's production trace (Mooncake's FAST'25 synthetic trace) and the
1,000-request arXiv slice stay out of the tree (docs/policy.md, "The issue's
production trace" and "Another unseen trace"). Put them in a directory as
``synthetic_trace.jsonl`` and ``arxiv_slice.jsonl`` and point
``KVTIER_PUBLIC_TRACES`` at it: these tests then replay each row's command
and check the figures the README and docs/policy.md quote (key seed 0, four
digits), so that a change of the policy cannot leave those rows stale.
Without the variable, or for a file that is not there, they are skipped;
a file with other bytes fails (its figures would not be the rows').
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import pytest

from kvtier.replay.behind_engine import replay_behind_engine, served_requests
from kvtier.replay.driver import replay, trace_keys
from kvtier.replay.trace import TraceRequest, load_trace

ENV = "KVTIER_PUBLIC_TRACES"
GPU_BLOCKS = 500

TRACES = {
    "synthetic_trace.jsonl":
        "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
    "arxiv_slice.jsonl":
        "42af0f9a813095782299f34fff4e6df907326e3e846f25c0e9c7132b70e44cc8",
}
"""File name in ``$KVTIER_PUBLIC_TRACES`` -> sha256 of the trace the rows used."""

ROWS = {
    # (trace, view, capacity, policy): hit ratio; view "alone" is `kvtier replay`,
    # "engine" `kvtier replay --gpu-blocks 500` (the CPU tier's ratio)
    ("synthetic_trace.jsonl", "alone", 1000, "lru"): 0.0841,
    ("synthetic_trace.jsonl", "alone", 1000, "default"): 0.0962,
    ("synthetic_trace.jsonl", "alone", 4000, "lru"): 0.2345,
    ("synthetic_trace.jsonl", "alone", 4000, "default"): 0.2476,
    ("synthetic_trace.jsonl", "alone", 16000, "arc"): 0.5553,
    ("synthetic_trace.jsonl", "alone", 16000, "default"): 0.5621,
    ("synthetic_trace.jsonl", "engine", 1000, "lru"): 0.0418,
    ("synthetic_trace.jsonl", "engine", 1000, "default"): 0.0683,
    ("synthetic_trace.jsonl", "engine", 4000, "lru"): 0.2146,
    ("synthetic_trace.jsonl", "engine", 4000, "default"): 0.2261,
    ("arxiv_slice.jsonl", "alone", 1000, "lru"): 0.3540,
    ("arxiv_slice.jsonl", "alone", 1000, "default"): 0.3620,
    ("arxiv_slice.jsonl", "alone", 4000, "lru"): 0.3806,
    ("arxiv_slice.jsonl", "alone", 4000, "default"): 0.3814,
    ("arxiv_slice.jsonl", "engine", 1000, "lru"): 0.0027,
    ("arxiv_slice.jsonl", "engine", 1000, "default"): 0.0289,
    ("arxiv_slice.jsonl", "engine", 4000, "lru"): 0.0500,
    ("arxiv_slice.jsonl", "engine", 4000, "default"): 0.0529,
}


def _trace(name: str) -> Path:
    """The trace file, checked against the rows' bytes; skip when not provided."""
    folder = os.environ.get(ENV)
    if not folder:
        pytest.skip(f"set {ENV} to a directory holding {name} (docs/policy.md)")
    path = Path(folder) / name
    if not path.is_file():
        pytest.skip(f"{path} not found")
    digest = _sha256(path)
    assert digest == TRACES[name], (
        f"{path}: sha256 {digest}, not {TRACES[name]}: another file than the rows used")
    return path


@functools.cache
def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@functools.cache
def _load(path: Path) -> list[TraceRequest]:
    return load_trace(path)  # read once for all the rows of a trace


def hit_ratio(path: Path, view: str, capacity: int, policy: str) -> float:
    """What ``kvtier replay`` (``view`` "alone") or ``kvtier replay
    --gpu-blocks 500`` ("engine") prints as the hit ratio of one row."""
    trace = _load(path)
    if view == "alone":
        return replay(trace_keys(trace), capacity, policy).hit_ratio
    return replay_behind_engine(served_requests(trace), capacity, policy,
                                gpu_blocks=GPU_BLOCKS).hit_ratio


@pytest.mark.parametrize(("name", "view", "capacity", "policy"), sorted(ROWS))
def test_the_quoted_figure_is_what_the_replay_gives(name: str, view: str, capacity: int,
                                                    policy: str) -> None:
    path = _trace(name)
    got = hit_ratio(path, view, capacity, policy)
    assert round(got, 4) == ROWS[name, view, capacity, policy], (name, view, capacity, policy)


def test_the_check_tells_policies_apart() -> None:
    """Negative control: PLFU, another policy, misses the default's figure."""
    path = _trace("synthetic_trace.jsonl")
    got = round(hit_ratio(path, "alone", 1000, "plfu"), 4)
    assert got != ROWS["synthetic_trace.jsonl", "alone", 1000, "default"]


def test_a_trace_with_other_bytes_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "arxiv_slice.jsonl").write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n')
    monkeypatch.setenv(ENV, str(tmp_path))
    with pytest.raises(AssertionError, match="another file than the rows used"):
        _trace("arxiv_slice.jsonl")


def test_without_the_folder_the_rows_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match=ENV):
        _trace("synthetic_trace.jsonl")
