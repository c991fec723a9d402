"""``kvtier demo``: options and report without an engine, then one small real run."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from helpers.corrupt import corrupt_region
from helpers.model_variants import SLIDING_WINDOW, build_variant

from kvtier.cli import build_parser, cmd_demo, main
from kvtier.demo import chat
from kvtier.demo import engine as E
from kvtier.demo.chat import RunResult, Turn, Workload
from kvtier.demo.tiny_model import build_tiny_llama


def turn(conv: int, t: int, prompt: int, cached: int, ttft_ms: float, out: tuple[int, ...]) -> Turn:
    return Turn(conv, t, tuple(range(prompt)), cached, ttft_ms / 1000, out)


def runs(kv_reply: tuple[int, ...] = (7, 8), cached_reply: tuple[int, ...] = (7, 8),
         cached_tokens: int = 96) -> tuple[RunResult, RunResult]:
    """A kvtier run and a baseline run of one conversation, two turns, two repeats;
    ``cached_*``: the reference pass's second turn (vLLM's own cache)."""
    kv = RunResult(kvtier=True, repeats=[
        [turn(1, 1, 96, 0, 5.0, (5, 6)), turn(1, 2, 132, 96, 4.0, kv_reply)],
        [turn(1, 1, 96, 0, 6.0, (5,)), turn(1, 2, 132, 96, 3.0, kv_reply[:1])],
    ])
    base = RunResult(kvtier=False, repeats=[
        [turn(1, 1, 96, 0, 5.5, (5, 6)), turn(1, 2, 132, 0, 8.0, (7, 8))],
        [turn(1, 1, 96, 0, 9.0, (5,)), turn(1, 2, 132, 0, 6.0, (7,))],
    ], reference=[turn(1, 1, 96, 0, 5.0, (5, 6)),
                  turn(1, 2, 132, cached_tokens, 4.0, cached_reply)])
    return kv, base


def test_rows_take_best_ttft_and_check_outputs() -> None:
    rows = chat.turn_rows(*runs())
    assert [(r.kvtier_tokens, r.ttft_kvtier_ms, r.ttft_baseline_ms) for r in rows] == [
        (0, 5.0, 5.5), (96, 3.0, 6.0)
    ]
    assert [r.ttft_baseline_median_ms for r in rows] == [7.25, 7.0]
    assert all(r.identical for r in rows)
    assert all(r.same_as_vllm_cache for r in rows)
    summary = chat.summarize(rows)
    assert summary["prefill_saved"] == round(96 / 228, 4)
    assert summary["outputs_identical"] and summary["baseline_cached_tokens"] == 0
    assert summary["vllm_cache_identical_turns"] == 2 and summary["outputs_verified"]
    assert summary["ttft_ratio"] == round(8.0 / 11.5, 4)


def test_a_differing_reply_is_reported() -> None:
    rows = chat.turn_rows(*runs(kv_reply=(7, 9)))
    assert [r.identical for r in rows] == [True, False]
    assert [r.same_as_vllm_cache for r in rows] == [True, False]
    summary = chat.summarize(rows)
    assert not summary["outputs_identical"] and not summary["outputs_verified"]
    table = chat.format_table(rows)
    assert table[0].split() == [
        "conv", "turn", "prompt", "from", "kvtier", "TTFT", "kvtier", "TTFT", "without",
        "=", "no", "cache", "=", "vLLM", "cache",
    ]
    assert table[2].split()[-2:] == ["NO", "NO"]
    assert chat.format_summary(summary, None)[-1].startswith("kvtier's bytes verified: NO (0/1")


def test_a_reply_vllms_own_cache_changes_too_is_rounding_not_kvtier() -> None:
    """A cached prefix can turn a greedy token on some models (seen on a GQA
    model): kvtier's reply then differs from the uncached one, as vLLM's does."""
    rows = chat.turn_rows(*runs(kv_reply=(7, 9), cached_reply=(7, 9)))
    summary = chat.summarize(rows)
    assert not summary["outputs_identical"] and summary["outputs_verified"]
    assert chat.format_table(rows)[2].split()[-2:] == ["NO", "yes"]
    assert chat.format_summary(summary, None)[-1].startswith("kvtier's bytes verified: yes")


def test_the_reference_must_serve_as_many_tokens_from_the_cache() -> None:
    """On a sliding-window model vLLM's own cache served fewer tokens than kvtier:
    not compared, so only the uncached reply can verify the turn."""
    rows = chat.turn_rows(*runs(cached_tokens=64))
    assert [r.same_as_vllm_cache for r in rows] == [True, False]
    assert rows[1].vllm_cache_tokens == 64 and rows[1].verified
    summary = chat.summarize(rows)
    assert summary["vllm_cache_short_turns"] == 1 and summary["outputs_verified"]
    assert "not compared" in chat.format_summary(summary, None)[-2]
    assert chat.format_table(rows)[2].split()[-2:] == ["yes", "n/a"]
    wrong = chat.turn_rows(*runs(kv_reply=(7, 9), cached_tokens=64, cached_reply=(7, 9)))
    assert not wrong[1].verified


def test_rows_need_a_reference_turn_for_every_kvtier_turn() -> None:
    kv, base = runs()
    base.reference.pop()
    with pytest.raises(ValueError, match="1 reference turns for 2 kvtier turns"):
        chat.turn_rows(kv, base)


def test_demo_options_default_to_the_workload() -> None:
    args = build_parser().parse_args(["demo"])
    assert args.func is cmd_demo
    assert chat.workload(args) == Workload()
    assert args.model_dir is None and not args.json
    assert build_parser().parse_args(["demo", "--cpu-bytes", "1GiB"]).cpu_bytes == 1 << 30


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
    assert summary["outputs_verified"] and summary["vllm_cache_identical_turns"] == 4
    # the reference pass got the same prefixes from the engine's own cache
    assert [r["vllm_cache_tokens"] for r in rows] == [r["kvtier_tokens"] for r in rows]
    assert report["kvtier_stats"]["hits"] > 0


@pytest.mark.vllm
@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm(-cpu)")
@pytest.mark.parametrize("variant", ["llama-gqa", "gemma2-hybrid-short"])
def test_demo_verifies_kvtier_on_other_attention_layouts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    variant: str,
) -> None:
    """Grouped-query attention, and a hybrid of sliding-window and full-attention
    layers (two KV-cache groups): kvtier serves prefixes and every turn is
    verified, whichever of the two comparisons holds for the model."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "ERROR")
    model = build_variant(tmp_path / variant, variant)
    argv = ["demo", "--json", "--conversations", "2", "--turns", "2", "--repeats", "1",
            "--system-tokens", str(2 * SLIDING_WINDOW), "--user-tokens", str(SLIDING_WINDOW),
            "--reply-tokens", "8", "--model-dir", str(model)]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["summary"]["outputs_verified"]
    # each conversation's second turn starts with its whole first prompt
    assert all(r["kvtier_tokens"] >= 2 * SLIDING_WINDOW for r in report["turns"][2:])


@pytest.mark.vllm
@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm(-cpu)")
def test_the_reference_pass_catches_wrong_bytes_from_kvtier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control of the demo's exit status: kvtier serves zeroed slots
    for the second conversation's system prompt, and vLLM's own cache, given the
    same prefix, replies otherwise."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    model = build_tiny_llama(tmp_path / "tiny")
    w = Workload(conversations=2, turns=1, repeats=1, system_tokens=64, user_tokens=32,
                 reply_tokens=8)
    settings = chat.engine_settings(w)
    prompts = [w.system_prompt() + w.user_message(c, 0) for c in range(2)]
    with E.running_engine(model, E.kvtier_config(chat.DEFAULT_CPU_BYTES), settings) as llm:
        first = chat.run_turn(llm, 1, 1, prompts[0], w.reply_tokens)
        corrupt_region(llm)
        second = chat.run_turn(llm, 2, 1, prompts[1], w.reply_tokens)
    assert (first.cached_tokens, second.cached_tokens) == (0, 64)
    with E.running_engine(model, None, settings) as llm:
        reference = chat.reference_pass(llm, [first, second])
        uncached = chat.run_turn(llm, 2, 1, prompts[1], w.reply_tokens)
    assert [t.cached_tokens for t in reference] == [0, 64]
    assert reference[0].output == first.output
    assert reference[1].output != second.output, "wrong KV went unnoticed"
    assert uncached.cached_tokens == 0
    assert uncached.output != second.output, "wrong KV went unnoticed"


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
    summary = report["summary"]
    # Every answer of the second server compared, the last turn's (from disk) included.
    assert summary["answers_identical"] and summary["answers_compared"] == 4
    assert summary["disk_answers_compared"] == 2 and summary["answers_not_compared"] == []
    assert summary["verified"]
    assert sum(r["disk"] + r["host"] + r["device"] for r in rest) > 0


def test_a_model_directory_is_used_as_it_is_and_nothing_is_built_into_others(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.demo.chat import _model

    sharded = tmp_path / "sharded"  # a real model's layout the tiny one does not have
    sharded.mkdir()
    (sharded / "config.json").write_text("{}")
    (sharded / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert _model(sharded, print) == sharded
    assert sorted(p.name for p in sharded.iterdir()) == [
        "config.json", "model-00001-of-00002.safetensors"]
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("mine")
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    for path, why in ((other, "holds no model"), (not_a_dir, "is not a directory")):
        assert main(["demo", "--model-dir", str(path)]) == 2
        assert why in capsys.readouterr().err
    assert [p.name for p in other.iterdir()] == ["todo.txt"]
