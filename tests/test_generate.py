"""Synthetic workloads (kvtier.replay.generate) and ``kvtier generate``."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.replay.driver import replay, trace_keys
from kvtier.replay.generate import KINDS, generate, trace_line, write_trace
from kvtier.replay.trace import MOONCAKE_BLOCK_TOKENS, load_trace


@pytest.mark.parametrize("kind", list(KINDS))
def test_seeded_and_deterministic(kind: str) -> None:
    a = generate(kind, seed=3, requests=300)
    assert a == generate(kind, seed=3, requests=300)
    assert a != generate(kind, seed=4, requests=300)
    assert len(a) == 300


@pytest.mark.parametrize("kind", list(KINDS))
def test_requests_are_valid_prefix_chains(kind: str) -> None:
    requests = generate(kind, seed=1, requests=400)
    parent: dict[int, int] = {}
    depth: dict[int, int] = {}
    last_time = 0
    for r in requests:
        assert r.hash_ids, "every request has a prompt"
        assert (len(r.hash_ids) - 1) * MOONCAKE_BLOCK_TOKENS < r.input_length
        assert r.input_length <= len(r.hash_ids) * MOONCAKE_BLOCK_TOKENS
        assert r.output_length >= 1 and r.timestamp >= last_time
        last_time = r.timestamp
        assert len(set(r.hash_ids)) == len(r.hash_ids)
        for j, hid in enumerate(r.hash_ids):  # an id always has the same prefix
            assert depth.setdefault(hid, j) == j
            if j:
                assert parent.setdefault(hid, r.hash_ids[j - 1]) == r.hash_ids[j - 1]


def test_kinds_have_their_shape() -> None:
    def reuse(kind: str) -> float:
        reqs = generate(kind, seed=2, requests=2000)
        blocks = [h for r in reqs for h in r.hash_ids]
        return 1 - len(set(blocks)) / len(blocks)

    ratios = {kind: reuse(kind) for kind in KINDS}
    assert ratios["agent"] > 0.9  # long prefixes growing by small steps
    assert ratios["shared"] > 0.6  # a few system prompts
    assert ratios["chat"] > 0.5  # turns extend the conversation
    assert ratios["scan"] < ratios["chat"]  # one-off long prompts dilute reuse
    assert 0.1 < ratios["rag"] < ratios["shared"]
    agent = generate("agent", seed=2, requests=2000)
    assert sum(len(r.hash_ids) for r in agent) / len(agent) > 40


def test_unknown_kind_and_bad_count() -> None:
    with pytest.raises(ValueError, match="known workloads: chat"):
        generate("mixed")
    with pytest.raises(ValueError, match="requests"):
        generate("chat", requests=0)


def test_written_trace_loads_and_replays(tmp_path: Path) -> None:
    requests = generate("rag", seed=5, requests=200)
    path = tmp_path / "rag.jsonl"
    assert write_trace(requests, path) == 200
    assert load_trace(path) == requests
    first = json.loads(path.read_text().splitlines()[0])
    assert list(first) == ["timestamp", "input_length", "output_length", "hash_ids"]
    assert trace_line(requests[0]) == path.read_text().splitlines()[0]
    assert replay(trace_keys(requests), 64, "plfu").hit_ratio > 0


def test_generate_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "agent.jsonl"
    assert main(["generate", "agent", "--seed", "7", "--requests", "50", "-o", str(out)]) == 0
    assert "wrote 50 agent requests" in capsys.readouterr().err
    assert load_trace(out) == generate("agent", 7, 50)


def test_generate_command_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["generate", "nope", "-o", str(tmp_path / "x.jsonl")])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
    code = main(["generate", "chat", "--requests", "5", "-o", str(tmp_path / "no" / "x.jsonl")])
    assert code == 2
    assert capsys.readouterr().err.startswith("kvtier: error: cannot write")


def test_loop_defeats_lru_but_not_opt() -> None:
    """Documents re-read in a cycle longer than the cache: LRU keeps only the
    system prompt, OPT a good share."""
    from kvtier.replay.driver import bound_results

    keys = trace_keys(generate("loop", seed=0, requests=1200))
    lru = replay(keys, 4000, "lru")
    assert lru.hit_blocks <= len(keys)  # the system block at most
    (opt,) = bound_results(keys, [4000], infinite=False)
    assert opt.hit_ratio > 0.2
    assert lru.hit_ratio < 0.1


def test_phases_change_the_traffic() -> None:
    from kvtier.replay.generate import PHASES

    reqs = generate("phase", seed=0, requests=2000)
    quarters = [reqs[i * 500:(i + 1) * 500] for i in range(len(PHASES))]
    ids = [set(h for r in q for h in r.hash_ids) for q in quarters]
    for a in range(len(ids)):
        for b in range(a + 1, len(ids)):
            assert not ids[a] & ids[b], "each phase has fresh content"
    loop = quarters[PHASES.index("loop")]
    assert len({r.hash_ids[1] for r in loop}) > 100  # many documents, read in turn


def test_tenants_share_nothing_and_interleave() -> None:
    from kvtier.replay.generate import TENANT_ID_STRIDE, TENANTS

    reqs = generate("tenants", seed=0, requests=3000)
    owner = [r.hash_ids[0] // TENANT_ID_STRIDE for r in reqs]
    counts = {t: owner.count(t) for t in range(len(TENANTS))}
    assert all(counts[t] > 0 for t in counts)
    assert counts[0] > counts[3]  # chat's share is four times shared's
    assert all(len({h // TENANT_ID_STRIDE for h in r.hash_ids}) == 1 for r in reqs)
    switches = sum(a != b for a, b in itertools.pairwise(owner))
    assert switches > 500  # interleaved by arrival time, not one tenant after another


def test_drift_moves_the_popular_documents() -> None:
    """The ranking turns: the documents most used early on are cold later, and
    the ones most used late were cold early."""
    from collections import Counter

    reqs = generate("drift", seed=0, requests=3000)
    first = Counter(r.hash_ids[0] for r in reqs[:600])
    last = Counter(r.hash_ids[0] for r in reqs[-600:])
    early_top = [doc for doc, _ in first.most_common(5)]
    late_top = [doc for doc, _ in last.most_common(5)]
    assert not set(early_top) & set(late_top)
    assert sum(last[doc] for doc in early_top) < sum(first[doc] for doc in early_top) / 4
    assert sum(first[doc] for doc in late_top) < sum(last[doc] for doc in late_top) / 4
    uses = Counter(h for r in reqs for h in r.hash_ids)
    assert all(uses[r.hash_ids[-1]] == 1 for r in reqs)  # each question is one-off
