"""``kvtier demo``: options and report without an engine, then one small real run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvtier.cli import build_parser, cmd_demo, main
from kvtier.demo import chat
from kvtier.demo.chat import RunResult, Turn, Workload


def turn(conv: int, t: int, prompt: int, cached: int, ttft_ms: float, out: tuple[int, ...]) -> Turn:
    return Turn(conv, t, tuple(range(prompt)), cached, ttft_ms / 1000, out)


def runs(kv_reply: tuple[int, ...] = (7, 8)) -> tuple[RunResult, RunResult]:
    """A kvtier run and a baseline run of one conversation, two turns, two repeats."""
    kv = RunResult(kvtier=True, repeats=[
        [turn(1, 1, 96, 0, 5.0, (5, 6)), turn(1, 2, 132, 96, 4.0, kv_reply)],
        [turn(1, 1, 96, 0, 6.0, (5,)), turn(1, 2, 132, 96, 3.0, kv_reply[:1])],
    ])
    base = RunResult(kvtier=False, repeats=[
        [turn(1, 1, 96, 0, 5.5, (5, 6)), turn(1, 2, 132, 0, 8.0, (7, 8))],
        [turn(1, 1, 96, 0, 9.0, (5,)), turn(1, 2, 132, 0, 6.0, (7,))],
    ])
    return kv, base


def test_rows_take_best_ttft_and_check_outputs() -> None:
    rows = chat.turn_rows(*runs())
    assert [(r.kvtier_tokens, r.ttft_kvtier_ms, r.ttft_baseline_ms) for r in rows] == [
        (0, 5.0, 5.5), (96, 3.0, 6.0)
    ]
    assert [r.ttft_baseline_median_ms for r in rows] == [7.25, 7.0]
    assert all(r.identical for r in rows)
    summary = chat.summarize(rows)
    assert summary["prefill_saved"] == round(96 / 228, 4)
    assert summary["outputs_identical"] and summary["baseline_cached_tokens"] == 0
    assert summary["ttft_ratio"] == round(8.0 / 11.5, 4)


def test_a_differing_reply_is_reported() -> None:
    rows = chat.turn_rows(*runs(kv_reply=(7, 9)))
    assert [r.identical for r in rows] == [True, False]
    assert not chat.summarize(rows)["outputs_identical"]
    table = chat.format_table(rows)
    assert table[0].split() == [
        "conv", "turn", "prompt", "from", "kvtier", "TTFT", "kvtier", "TTFT", "without", "same"
    ]
    assert table[2].split()[-1] == "NO"


def test_demo_options_default_to_the_workload() -> None:
    args = build_parser().parse_args(["demo"])
    assert args.func is cmd_demo
    assert chat.workload(args) == Workload()
    assert args.model_dir is None and not args.json


def test_too_long_a_chat_is_rejected_before_starting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--turns", "40"]) == 2
    assert "tiny model takes at most 4096" in capsys.readouterr().err


@pytest.mark.vllm
@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm(-cpu)")
def test_demo_runs_the_engine_and_serves_prefixes_from_kvtier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
    argv = ["demo", "--json", "--conversations", "2", "--turns", "2", "--repeats", "2",
            "--system-tokens", "64", "--user-tokens", "32", "--reply-tokens", "4",
            "--model-dir", str(tmp_path / "tiny")]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["turns"]
    assert [(r["conversation"], r["turn"], r["prompt_tokens"]) for r in rows] == [
        (1, 1, 96), (2, 1, 96), (1, 2, 132), (2, 2, 132)
    ]
    # The shared 2-block system prompt, then each conversation's whole first prompt.
    assert [r["kvtier_tokens"] for r in rows] == [0, 64, 96, 96]
    summary = report["summary"]
    assert summary["outputs_identical"] and summary["baseline_cached_tokens"] == 0
    assert report["kvtier_stats"]["hits"] > 0


@pytest.mark.vllm
@pytest.mark.timeout(600)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm(-cpu)")
def test_tiered_demo_second_server_gets_its_first_prefixes_from_disk(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two real servers in a row on one disk directory (kvtier serve, HTTP)."""
    argv = ["demo", "--disk", str(tmp_path / "disk"), "--json", "--conversations", "2",
            "--turns", "2", "--system-tokens", "64", "--user-tokens", "64",
            "--reply-tokens", "8", "--model-dir", str(tmp_path / "tiny")]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    first, *rest = [r for r in report["requests"] if r["server"] == 2]
    # The second server's first prompt: system prompt, turn 1 and its reply, on disk.
    assert first["disk"] >= 64 + 64 and first["host"] == 0 and first["device"] == 0
    assert report["summary"]["server1"]["disk"] == 0
    assert report["summary"]["answers_identical"] and report["summary"]["answers_compared"] == 2
    assert sum(r["disk"] + r["host"] + r["device"] for r in rest) > 0
