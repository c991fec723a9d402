"""``kvtier demo``'s report: claims of its report that held without being true.

Unit-level (hand-made runs, no engine) except the last test, the tiered demo's
negative control, which runs two real servers.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.demo import chat, tiered
from kvtier.demo.chat import RunResult, Turn
from kvtier.demo.tiered import Served
from kvtier.demo.workload import Workload


def turn(conv: int, t: int, prompt: int, cached: int, out: tuple[int, ...]) -> Turn:
    return Turn(conv, t, tuple(range(prompt)), cached, 0.005, out)


def runs(kv_cached: tuple[int, int] = (0, 96), base_cached: int = 0,
         ref_cached: int = 96, replay_cached: int | None = None,
         kv_reply: tuple[int, ...] = (7, 8), ref_reply: tuple[int, ...] = (7, 8)
         ) -> tuple[RunResult, RunResult]:
    """One conversation, two turns, two repeats (a chat pass, a replay)."""
    c1, c2 = kv_cached
    r2 = c2 if replay_cached is None else replay_cached
    kv = RunResult(kvtier=True, repeats=[
        [turn(1, 1, 96, c1, (5, 6)), turn(1, 2, 132, c2, kv_reply)],
        [turn(1, 1, 96, c1, (5,)), turn(1, 2, 132, r2, kv_reply[:1])],
    ])
    base = RunResult(kvtier=False, repeats=[
        [turn(1, 1, 96, 0, (5, 6)), turn(1, 2, 132, base_cached, (7, 8))],
        [turn(1, 1, 96, 0, (5,)), turn(1, 2, 132, base_cached, (7,))],
    ], reference=[turn(1, 1, 96, c1, (5, 6)), turn(1, 2, 132, ref_cached, ref_reply)])
    return kv, base


# -- the chat demo -----------------------------------------------------------------


def test_a_run_where_kvtier_served_nothing_verifies_no_bytes() -> None:
    """Fault: with kvtier serving no token at all (kvtier broken, or not in the
    engine), every reply is trivially the uncached one, and the demo printed
    "kvtier's bytes verified: yes (2/2 turns ...)" and exited 0: bytes that
    were never used were called verified."""
    rows = chat.turn_rows(*runs(kv_cached=(0, 0), ref_cached=0))
    summary = chat.summarize(rows)
    assert summary["kvtier_tokens"] == 0
    assert not summary["outputs_verified"], "exit status 0 with nothing served by kvtier"
    line = chat.format_summary(summary, None)[-1]
    assert line.startswith("kvtier's bytes verified: NO"), line


def test_bytes_verified_counts_only_turns_kvtier_served() -> None:
    """Fault: the count of turns whose kvtier bytes were verified included turns
    kvtier served nothing to (the README's run: "16/16" where turn 1 of
    conversation 1 had 0 tokens from kvtier)."""
    summary = chat.summarize(chat.turn_rows(*runs()))
    assert summary["outputs_verified"]
    assert (summary["verified_turns"], summary["kvtier_turns"]) == (1, 1)
    line = chat.format_summary(summary, None)[-1]
    assert line.startswith("kvtier's bytes verified: yes (1/1 turns served from kvtier"), line


def test_a_baseline_that_hit_a_cache_is_not_the_uncached_reply() -> None:
    """Fault: ``= no cache`` compared kvtier's reply with the engine's without
    kvtier whatever that engine served from its own cache; the demo printed how
    many tokens it had cached but a cached baseline still verified the turn as
    "replied as without a cache"."""
    rows = chat.turn_rows(*runs(base_cached=64, ref_cached=64))
    assert rows[1].baseline_cached_tokens == 64
    assert not rows[1].identical, "a cached reply was called the uncached one"


def test_a_reference_that_was_compared_and_differs_reads_no_not_na() -> None:
    """Fault: the table's ``= vLLM cache`` cell and the "not compared" count
    compared vLLM's cached tokens with the fewest kvtier served over all
    repeats, while the comparison itself used the chat pass's. When a replay
    got fewer tokens from kvtier than the chat pass (evictions, a small
    ``--cpu-bytes``), a reply that was compared with vLLM's own cache and
    differed read "n/a" and was counted as not compared."""
    rows = chat.turn_rows(*runs(replay_cached=64, ref_reply=(7, 9)))
    assert not rows[1].same_as_vllm_cache
    assert chat.format_table(rows)[2].split()[-1] == "NO"
    assert chat.summarize(rows)["vllm_cache_short_turns"] == 0


# -- the tiered demo ---------------------------------------------------------------


def served(server: int, conv: int, t: int, disk: int = 0, answer: str = "w5 w7",
           token_ids: tuple[int, ...] = (5, 7)) -> Served:
    return Served(server, conv, t, 128, 0, 0, disk, answer, token_ids)


def _args(tmp_path: Path, **kw: object) -> argparse.Namespace:
    return argparse.Namespace(disk=tmp_path / "disk", json=True, cpu_bytes=1 << 20, **kw)


def _status(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, results: list[Served]) -> int:
    monkeypatch.setattr(tiered, "run", lambda *a, **k: results)
    return tiered.run_from_args(_args(tmp_path), tmp_path, Workload(turns=2), lambda s: None)


def test_tiered_demo_with_nothing_compared_does_not_pass(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Fault: with ``--turns 1`` the first server serves nothing, nothing is
    compared, and ``all([])`` printed "identical to server 1's: yes (0
    compared)" with exit status 0."""
    results = [served(2, 1, 1, disk=0)]
    assert not tiered.summary(results)["answers_identical"]
    assert _status(monkeypatch, tmp_path, results) == 1
    capsys.readouterr()


def test_tiered_demo_with_nothing_from_disk_fails(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Fault: a disk tier that served the second server nothing (broken, or
    blocks not found) still gave exit status 0: the demo's point, a disk tier
    outliving the server that filled it, was not shown but reported as fine."""
    results = [served(1, 1, 1), served(2, 1, 2, disk=0), served(2, 1, 1)]
    assert _status(monkeypatch, tmp_path, results) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["summary"]["verified"]


def test_tiered_demo_whose_first_server_read_from_disk_fails(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Fault: when the first server already got prefixes from disk (``DIR``
    held an earlier run's blocks), both servers' answers came from the same
    disk bytes and their comparison checks nothing; it passed."""
    results = [served(1, 1, 1, disk=96), served(2, 1, 2, disk=128), served(2, 1, 1)]
    assert _status(monkeypatch, tmp_path, results) == 1
    capsys.readouterr()


def test_tiered_answers_are_compared_token_for_token() -> None:
    """Fault (minor): answers were compared as text, from which the tokenizer
    drops special tokens (ids 0-2 of the tiny model): ids (5, 1, 7) and (5, 7)
    both read "w5 w7"."""
    results = [served(1, 1, 1), served(2, 1, 1, token_ids=(5, 1, 7))]
    assert not tiered.summary(results)["answers_identical"]


def test_tiered_demo_fails_when_the_turn_loaded_from_disk_is_not_compared(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Fault: the first server never answered the last turn, so the second
    server's answers to it, the prompts it loads from disk, were compared with
    nothing; only the replays of earlier turns (their prefixes in the GPU
    cache, a block or so from the CPU tier) were. A last-turn answer on wrong
    bytes from disk passed with exit status 0."""
    results = [served(1, 1, 1), served(1, 2, 1),
               served(2, 1, 2, disk=128, token_ids=(9, 9)),
               served(2, 2, 2, disk=96, token_ids=(9, 9)),
               served(2, 1, 1), served(2, 2, 1)]
    assert _status(monkeypatch, tmp_path, results) == 1, "turn 2 was compared with nothing"
    s = json.loads(capsys.readouterr().out)["summary"]
    assert not s["answers_identical"] and not s["verified"]
    assert s["answers_not_compared"] == [[1, 2], [2, 2]]
    assert s["disk_answers_compared"] == 0


def test_tiered_demo_fails_when_a_last_turn_answer_differs(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The last turn, answered by both servers (the first from its GPU cache,
    the second from disk): one answer of the second that differs by a token
    fails the demo, though every replay of turn 1 is the same; the report
    names it."""
    results = [served(1, 1, 1), served(1, 2, 1), served(1, 1, 2), served(1, 2, 2),
               served(2, 1, 2, disk=128), served(2, 2, 2, disk=96, token_ids=(5, 8)),
               served(2, 1, 1), served(2, 2, 1)]
    s = tiered.summary(results)
    assert (s["answers_compared"], s["disk_answers_compared"]) == (4, 2)
    assert s["answers_differing"] == [[2, 2]] and s["answers_not_compared"] == []
    assert not s["answers_identical"] and not s["verified"]
    assert _status(monkeypatch, tmp_path, results) == 1
    capsys.readouterr()
    tiered.print_report(results, s, as_json=False)
    out = capsys.readouterr().out
    assert "identical to server 1's: NO (4 compared, 2 of them on prompts with tokens from disk)" \
        in out
    assert "differ from server 1's (conversation, turn): 2 2" in out
    # The same run with that answer right passes.
    results[5] = served(2, 2, 2, disk=96)
    assert tiered.summary(results)["verified"]
    assert _status(monkeypatch, tmp_path, results) == 0
    capsys.readouterr()


def test_tiered_demo_first_server_answers_the_last_turn_after_the_others() -> None:
    """The first server answered turns 1 to N-1 only, so the second server's
    turn N (the one it loads from disk) had nothing to be compared with. Now
    the first answers every conversation's turn N too, after its earlier turns
    (whose blocks are on disk by then as before); the second starts with turn N
    (its prefixes on disk only), then replays turns 1 to N-1."""
    first, second = tiered.plans(Workload(conversations=2, turns=3))
    assert first == [(1, 1), (2, 1), (1, 2), (2, 2), (1, 3), (2, 3)]
    assert second == [(1, 3), (2, 3), (1, 1), (2, 1), (1, 2), (2, 2)]
    assert set(second) <= set(first), "an answer of the second server is compared with nothing"


def test_tiered_demo_runs_the_planned_turns_on_each_server(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``run`` gives each server its plan (no engine: servers and requests faked)."""
    import contextlib

    asked: list[tuple[int, list[tuple[int, int]]]] = []

    class FakeServer(contextlib.nullcontext):  # type: ignore[type-arg]
        def __init__(self, argv: list[str], port: int, log: Path) -> None:
            super().__init__()
            self.url = f"http://127.0.0.1:{port}"

    def fake_serve(url: str, model: Path, server: int, w: Workload,
                   turns: list[tuple[int, int]], *rest: object) -> list[Served]:
        asked.append((server, list(turns)))
        return [served(server, c, n) for c, n in turns]

    monkeypatch.setattr(tiered, "ServerProcess", FakeServer)
    monkeypatch.setattr(tiered, "serve_turns", fake_serve)
    w = Workload(conversations=2, turns=2)
    results = tiered.run(tmp_path, tmp_path / "disk", w, 1 << 20, lambda s: None, lambda r: None)
    assert asked == [(1, [(1, 1), (2, 1), (1, 2), (2, 2)]),
                     (2, [(1, 2), (2, 2), (1, 1), (2, 1)])]
    assert tiered.summary(results)["answers_not_compared"] == []


def _no_servers(*args: object, **kwargs: object) -> None:
    pytest.fail("the demo started its servers")


def _model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="kvtier demo needs vllm")
def test_tiered_demo_refuses_a_disk_directory_with_earlier_blocks(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Fault: ``--disk DIR`` reused whatever ``DIR`` held (the README's command,
    run twice): see the test above. Refused before any server starts."""
    disk = tmp_path / "disk"
    (disk / "kvtier-v1").mkdir(parents=True)
    monkeypatch.setattr(tiered, "run", _no_servers)
    argv = ["demo", "--disk", str(disk), "--model-dir", str(_model_dir(tmp_path))]
    assert main(argv) == 2
    assert "not empty" in capsys.readouterr().err


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="kvtier demo needs vllm")
def test_tiered_demo_refuses_one_turn(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With one turn the first server has nothing to serve (see above)."""
    monkeypatch.setattr(tiered, "run", _no_servers)
    argv = ["demo", "--disk", str(tmp_path / "disk"), "--turns", "1",
            "--model-dir", str(_model_dir(tmp_path))]
    assert main(argv) == 2
    assert "--turns 2" in capsys.readouterr().err


# -- the tiered demo's negative control (two real servers) --------------------------


def _zero_disk_payloads(disk: Path) -> int:
    """Rewrite every block file under ``disk`` with a zeroed payload and a valid
    checksum (what a wrong but well-formed block looks like)."""
    from kvtier.tiers import blockfile

    n = 0
    for path in disk.rglob("*.kvb"):
        value = path.read_bytes()
        header = blockfile.unpack_header(value)
        path.write_bytes(blockfile.encode(header.namespace, header.key,
                                          bytes(header.payload_len)))
        n += 1
    return n


@pytest.mark.vllm
@pytest.mark.timeout(600)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm(-cpu)")
def test_tiered_demo_catches_wrong_bytes_from_disk(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Negative control of the tiered demo (it had none): between the servers,
    every block on disk is zeroed, checksums kept valid. The second server
    loads them; its answers must differ from the first's (a last-turn answer,
    its prompt from disk, among them) and the demo exit 1."""
    disk = tmp_path / "disk"
    zeroed: list[int] = []
    serve = tiered.serve_turns

    def corrupting(url: str, model: Path, server: int, *rest: object) -> list[Served]:
        if server == 2:
            zeroed.append(_zero_disk_payloads(disk))
        return serve(url, model, server, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(tiered, "serve_turns", corrupting)
    argv = ["demo", "--disk", str(disk), "--json", "--conversations", "2",
            "--turns", "2", "--system-tokens", "64", "--user-tokens", "64",
            "--reply-tokens", "8", "--model-dir", str(tmp_path / "tiny")]
    assert main(argv) == 1
    report = json.loads(capsys.readouterr().out)
    assert zeroed and zeroed[0] > 0
    assert report["summary"]["server2"]["disk"] > 0, "the zeroed blocks were not loaded"
    assert report["summary"]["answers_compared"] == 4
    assert report["summary"]["answers_not_compared"] == []
    assert not report["summary"]["answers_identical"], "wrong KV from disk went unnoticed"
    # The last turn, whose prefixes the second server loaded from disk, is what
    # the comparison must catch (not only the replays' last block from the CPU tier).
    # (at least one: on a random tiny model one 8-token answer could come out
    # the same from zeroed KV by chance; every one differed in the runs made)
    last = [[c, 2] for c in (1, 2)]
    differing = report["summary"]["answers_differing"]
    assert any(d in differing for d in last), f"turn 2 matched on zeroed KV: {differing}"
