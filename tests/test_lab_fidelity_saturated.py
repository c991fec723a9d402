"""The lab's saturated scheduler (``kvtier replay --gpu-batch-tokens N``) against vLLM itself.

As ``test_lab_fidelity`` (same harness: vLLM 0.32's real ``Scheduler`` with
kvtier's adapter behind its offloading connector, and the lab side by side),
but every request arrives before the first step, so several are in flight:
a token budget per step shares the steps between prefills and decodes, a
request that cannot get a block preempts the last admitted one, and a
preempted request is looked up again when it resumes. kvtier's manager must
get the same calls in the same order: which blocks are offered, the lookups
(of a waiting request at every step it waits, of a resumed one over its
output too), loads, finishes.

vLLM keeps the requests that finished in a step in a set, so kvtier hears of
them in an arbitrary order; ``canonical`` sorts each run of finishes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from test_lab_fidelity import Call, Spec, lab_calls, output_id, vllm_calls

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvtier.demo.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("saturated") / "tiny-llama")


def canonical(calls: Sequence[Call]) -> list[Call]:
    """``calls`` with each run of consecutive finishes sorted by request."""
    out: list[Call] = []
    finishes: list[Call] = []
    for call in calls:
        if call[0] == "finish":
            finishes.append(call)
            continue
        out += sorted(finishes)
        finishes = []
        out.append(call)
    return out + sorted(finishes)


def assert_same_saturated(model: Path, requests: Sequence[Spec], gpu_blocks: int,
                          cpu_blocks: int, batch_tokens: int,
                          monkeypatch: pytest.MonkeyPatch) -> list[Call]:
    real = canonical(vllm_calls(model, requests, gpu_blocks, cpu_blocks, batch_tokens))
    lab = canonical(lab_calls(requests, gpu_blocks, cpu_blocks, monkeypatch, batch_tokens))
    assert lab == real
    return real


def test_a_resumed_request_asks_about_the_blocks_its_output_filled(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 8 usable blocks: r1 is preempted for r0's decode blocks once its output
    # filled its block 2; resumed on its engine hit (blocks 0 and 1), vLLM asks
    # kvtier about block 2 at each step it waits (a miss: outputs are never
    # offered), where the lab asked about nothing
    real = assert_same_saturated(tiny_model, [([5, 6, 7], 0, 66), ([4, 110], 1, 56)],
                                 9, 13, 128, monkeypatch)
    assert real[5:7] == [("lookup", 1, [output_id(1, 2)])] * 2


def test_a_request_whose_hits_another_is_loading_waits_and_the_next_is_asked(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # r1 (resumed) loads blocks 1 and 2; r2 and r3 hit them in kvtier in the
    # same step: vLLM defers both (_chunks_being_loaded) and asks each again
    # next step, when the load is cached in the engine; the lab loaded them for
    # r2 as well
    requests: list[Spec] = [([4, 100, 101], 31, 68), ([1, 2, 110], 0, 7), ([1, 2, 3], 1, 61),
                            ([1, 2, 3, 130], 31, 14)]
    real = assert_same_saturated(tiny_model, requests, 8, 15, 128, monkeypatch)
    at = real.index(("load", 1, [1, 2, 110]))
    assert real[at + 1:at + 9] == [
        ("lookup", 2, [1]), ("lookup", 2, [2]), ("lookup", 2, [3]),
        ("lookup", 3, [1]), ("lookup", 3, [2]), ("lookup", 3, [3]),
        ("finish", 0, []), ("loaded", 1, [1, 2, 110])]
    assert real[at + 9:at + 11] == [("lookup", 2, [3]), ("lookup", 3, [130])]


def test_an_asynchronous_load_needs_only_its_own_blocks_past_the_reservations(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # r3 is admitted with a load; r4 then fits its whole sequence in the free
    # blocks, and its load fits in what r3's prefill leaves: vLLM admits it in
    # the same step (the lab held r4's whole sequence against the reservations)
    requests: list[Spec] = [([1, 100], 0, 1), ([1, 2, 3, 110, 111], 1, 20),
                            ([5, 6, 7, 120, 121], 31, 4), ([5, 6, 7, 130], 0, 10),
                            ([1, 140], 1, 7), ([1, 2, 3, 150], 1, 12)]
    real = assert_same_saturated(tiny_model, requests, 8, 15, 128, monkeypatch)
    at = real.index(("load", 3, [130]))
    assert real[at + 1:at + 4] == [("lookup", 4, [1]), ("lookup", 4, [140]),
                                   ("load", 4, [1])]


WORKLOADS = [  # gpu blocks, cpu blocks, budget, requests, partial-block tokens, max output
    (24, 12, 256, 12, (1, 16, 31), 60),
    (16, 30, 128, 10, (0, 1, 16, 31), 80),
    (12, 6, 128, 8, (0, 5, 31), 70),
    (40, 20, 512, 16, (0, 1, 16), 100),
    (14, 40, 128, 12, (0, 1, 31), 120),
    (9, 30, 128, 14, (0, 16, 31), 200),
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("workload", range(len(WORKLOADS)))
def test_mixed_workloads_in_flight_make_the_same_calls_as_vllm(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch, workload: int, seed: int) -> None:
    # shared prefixes, chunked prefills, preemptions and resumes, loads,
    # deferred lookups, offers refused by a small CPU tier
    gpu, cpu, budget, n, tails, max_out = WORKLOADS[workload]
    rng = random.Random(seed * 100 + workload)
    bases = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [7, 8], [9, 10, 11, 12, 13, 14], [],
             list(range(455, 467))]
    requests: list[Spec] = []
    for i in range(n):
        ids = rng.choice(bases) + [1000 + i * 10 + j for j in range(rng.randint(0, 5))]
        ids, tail, out = ids or [999], rng.choice(tails), rng.randint(1, max_out)
        if -(-(32 * len(ids) + tail + out - 1) // 32) <= gpu - 1:  # vLLM can hold it
            requests.append((ids, tail, out))
    assert_same_saturated(tiny_model, requests, gpu, cpu, budget, monkeypatch)
