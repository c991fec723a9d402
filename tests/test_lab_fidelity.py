"""The lab's view behind the engine (``kvtier replay --gpu-blocks``) against vLLM itself.

Each test serves the same requests twice, one at a time (a new request arrives
once the previous one left the engine, as ``FixedFront`` with concurrency 1
models it), and compares the calls kvtier's manager gets:

* through vLLM 0.32's real ``Scheduler``, its ``KVCacheManager`` / block pool
  and the ``OffloadingConnector``'s scheduler side, with kvtier's vLLM adapter
  behind it (no workers: every load and store completes within its step, as
  the lab assumes), a request's block j made of tokens only its trace hash id
  decides;
* through the lab (``replay_behind_engine``) with the same engine and CPU sizes.

The logs name blocks by trace hash id; a lookup is logged key by key, up to
its first miss (vLLM asks one key at a time; the lab asks for the run).
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvtier import OffloadManager, RequestContext
from kvtier.replay import behind_engine
from kvtier.replay.behind_engine import ENGINE_BLOCK_TOKENS, replay_behind_engine
from kvtier.replay.driver import trace_keys
from kvtier.replay.engine_schedule import (
    CPU_MAX_NUM_BATCHED_TOKENS,
    CPU_MAX_NUM_SEQS,
    ServedRequest,
)
from kvtier.replay.trace import TraceRequest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import OffloadingSpec

from kvtier.vllm.adapter import KVTierOffloadingManager

BT = ENGINE_BLOCK_TOKENS
Call = tuple[str, int, list[int]]
Spec = tuple[list[int], int, int]
"""A request: its full blocks' hash ids, the tokens of its partial block, its output tokens."""


class Logged(OffloadManager):
    """A manager logging each call as (what, request, hash ids)."""

    names: ClassVar[dict[bytes, int]] = {}
    """vLLM block hash -> trace hash id (filled before vLLM's run)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[Call] = []

    def _id(self, key: bytes) -> int:
        if len(key) == 12:  # kvtier.keys.block_key: the lab's keys
            return int.from_bytes(key[:8], "big")
        if len(key) == 19:  # engine_schedule.private_key: a block its output filled
            return output_id(int.from_bytes(key[4:12], "big"), int.from_bytes(key[12:], "big"))
        return self.names[bytes(key[:-4])]  # vLLM's OffloadKey: block hash + group

    def _log(self, what: str, keys: Iterable[bytes], ctx: RequestContext) -> None:
        self.calls.append((what, int(ctx.req_id.split("-")[1]), [self._id(k) for k in keys]))

    def lookup(self, keys: Iterable[bytes], ctx: RequestContext) -> int:
        keys = list(keys)
        hits = super().lookup(keys, ctx)
        for key in keys[: hits + 1]:
            self._log("lookup", [key], ctx)
        return hits

    def lookup_one(self, key: bytes, ctx: RequestContext) -> Any:
        result = super().lookup_one(key, ctx)
        self._log("lookup", [key], ctx)
        return result

    def prepare_load(self, keys: Any, ctx: RequestContext) -> Any:
        self._log("load", keys, ctx)
        return super().prepare_load(keys, ctx)

    def complete_load(self, keys: Any, ctx: RequestContext) -> None:
        self._log("loaded", sorted(keys, key=self._id), ctx)  # vLLM passes a set
        super().complete_load(keys, ctx)

    def prepare_store(self, keys: Any, ctx: RequestContext) -> Any:
        self._log("offer", keys, ctx)
        return super().prepare_store(keys, ctx)

    def on_request_finished(self, ctx: RequestContext) -> None:
        self._log("finish", [], ctx)
        super().on_request_finished(ctx)


def block_tokens(hash_id: int) -> list[int]:
    """The tokens of the block a trace hash id names: its first two spell the
    id (in base 500), so distinct ids below 250,000 make distinct blocks."""
    return [3 + hash_id % 500, 3 + hash_id // 500 % 500,
            *(3 + (hash_id * 37 + t * 11) % 500 for t in range(2, BT))]


def output_id(index: int, block: int) -> int:
    """The logged id of block ``block`` of request ``index`` when its output
    filled it (its tokens are that request's only: see ``vllm_calls``)."""
    return -(index * 10_000 + block)


class LoggedSpec(OffloadingSpec):
    """kvtier's adapter over a ``Logged`` manager of ``cpu_blocks`` blocks,
    lease bounds raised to the whole cache as the lab's
    (``driver.replay_manager``); vLLM loads it by this module's path and name."""

    def get_manager(self) -> Any:
        blocks = int(self.extra_config["cpu_blocks"])  # lease bounds as the lab's
        return KVTierOffloadingManager(Logged(blocks, max_leases_per_request=blocks,
                                              max_leased_blocks=blocks))

    def get_worker(self, kv_caches: Any) -> Any:
        raise NotImplementedError("scheduler side only")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvtier.demo.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("fidelity") / "tiny-llama")


def _scheduler(model: Path, gpu_blocks: int, cpu_blocks: int,
               batch_tokens: int = CPU_MAX_NUM_BATCHED_TOKENS) -> Any:
    """vLLM's scheduler over ``gpu_blocks`` blocks (one its null block),
    ``batch_tokens`` tokens per step (the CPU server's default: 2048), at most
    128 requests running (the CPU server's default), kvtier behind it."""
    import torch
    from vllm.config import (
        CacheConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
    )
    from vllm.v1.structured_output import StructuredOutputManager

    config = VllmConfig(
        model_config=ModelConfig(model=str(model), tokenizer=str(model), dtype="bfloat16",
                                 max_model_len=4096, seed=0),
        cache_config=CacheConfig(block_size=BT, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=batch_tokens,
                                         max_num_seqs=CPU_MAX_NUM_SEQS,
                                         max_model_len=4096, is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="OffloadingConnector", kv_role="kv_both",
            kv_connector_extra_config={"spec_name": "LoggedSpec", "spec_module_path": __name__,
                                       "cpu_blocks": cpu_blocks}))
    config.cache_config.num_gpu_blocks = gpu_blocks
    spec = FullAttentionSpec(block_size=BT, num_kv_heads=4, head_size=32, dtype=torch.bfloat16)
    layer = "model.layers.0.self_attn.attn"
    page = spec.page_size_bytes
    kv_config = KVCacheConfig(
        num_blocks=gpu_blocks,
        kv_cache_tensors=[KVCacheTensor(size=gpu_blocks * page, layers=[layer],
                                        layer_stride=gpu_blocks * page, block_stride=page)],
        kv_cache_groups=[KVCacheGroupSpec([layer], spec)])
    return Scheduler(config, kv_config, StructuredOutputManager(config), block_size=BT,
                     log_stats=True)


def vllm_calls(model: Path, requests: Sequence[Spec], gpu_blocks: int, cpu_blocks: int,
               batch_tokens: int | None = None) -> list[Call]:
    """The manager's calls when vLLM serves ``requests``: one at a time, or,
    with ``batch_tokens``, all arriving together before the first step and
    scheduled with that budget per step.

    Request i samples token ``3 + i`` (a real model's outputs differ between
    requests), so a block its output filled is its own, as the lab keys it
    (``engine_schedule.private_key``); the log names it ``output_id(i, block)``.
    """
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
    from vllm.v1.request import Request

    sched = _scheduler(model, gpu_blocks, cpu_blocks, batch_tokens or CPU_MAX_NUM_BATCHED_TOKENS)
    mgr = sched.connector.connector_scheduler.manager.manager
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BT, sha256)
    made: list[Request] = []

    def name_blocks() -> None:
        for i, req in enumerate(made):
            ids = requests[i][0]
            Logged.names.update(zip(map(bytes, req.block_hashes), ids, strict=False))
            for j in range(len(ids), len(req.block_hashes)):
                Logged.names[bytes(req.block_hashes[j])] = output_id(i, j)

    def step() -> None:
        so = sched.schedule()
        meta = so.kv_connector_metadata
        jobs = {**meta.load_jobs, **meta.store_jobs}
        ran = list(so.num_scheduled_tokens)
        # schedule() already counted the scheduled tokens as computed: a
        # request samples when they reach its end (not after a partial chunk)
        sampled = [[3 + int(r.split("-")[1])]
                   if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
                   else [] for r in ran]
        output = KVConnectorOutput(
            finished_recving={job.req_id for job in meta.load_jobs.values()} or None,
            kv_connector_worker_meta=OffloadingWorkerMetadata(
                completed_jobs=dict.fromkeys(jobs, 1)))
        sched.update_from_output(so, ModelRunnerOutput(
            req_ids=ran, req_id_to_index={r: j for j, r in enumerate(ran)},
            sampled_token_ids=sampled, kv_connector_output=output))
        name_blocks()

    for i, (ids, tail, out) in enumerate(requests):
        tokens = [tok for h in ids for tok in block_tokens(h)]
        tokens += [3 + (i * 13 + t) % 500 for t in range(tail)]
        made.append(Request(f"req-{i}", tokens, SamplingParams(max_tokens=out, ignore_eos=True),
                            None, block_hasher=hasher))
        name_blocks()
        sched.add_request(made[-1])
        while batch_tokens is None and sched.has_requests():
            step()  # it runs, finishes, and the engine steps once more
    while sched.has_requests():
        step()
    assert isinstance(mgr, Logged)
    return mgr.calls


def lab_calls(requests: Sequence[Spec], gpu_blocks: int, cpu_blocks: int,
              monkeypatch: pytest.MonkeyPatch, batch_tokens: int | None = None) -> list[Call]:
    """The manager's calls when the lab serves ``requests`` (``--gpu-blocks``;
    ``--gpu-batch-tokens`` with ``batch_tokens``)."""
    made: list[Logged] = []

    def make(capacity: int, policy: str, store_threshold: int,
             max_tracker_size: int) -> OffloadManager:
        made.append(Logged(capacity, policy=policy, max_leases_per_request=capacity,
                           max_leased_blocks=capacity))
        return made[-1]

    monkeypatch.setattr(behind_engine, "replay_manager", make)
    served = [ServedRequest(trace_keys([TraceRequest(0, 1, 1, tuple(ids))])[0],
                            BT * len(ids) + tail, out) for ids, tail, out in requests]
    replay_behind_engine(served, cpu_blocks, gpu_blocks=gpu_blocks, batch_tokens=batch_tokens)
    return made[0].calls


def assert_same(model: Path, requests: Sequence[Spec], gpu_blocks: int, cpu_blocks: int,
                monkeypatch: pytest.MonkeyPatch) -> list[Call]:
    real = vllm_calls(model, requests, gpu_blocks, cpu_blocks)
    assert lab_calls(requests, gpu_blocks, cpu_blocks, monkeypatch) == real
    return real


def test_kvtier_hears_of_a_finish_before_the_next_request_and_offers_after_its_load(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM steps again right after a request finishes, so kvtier hears of it
    # before the next one's lookup; a load takes a step of its own, completed
    # before the request's first offer
    worked = [[1, 2, 3], [1, 2, 4], [5, 6, 7], [1, 2, 3, 8], [1, 2, 3, 8]]
    real = assert_same(tiny_model, [(w, 16, 1) for w in worked], 6, 10, monkeypatch)
    assert real[:6] == [("lookup", 0, [1]), ("offer", 0, [1, 2, 3]), ("finish", 0, []),
                        ("lookup", 1, [4]), ("offer", 1, [1, 2, 4]), ("finish", 1, [])]
    assert real[9:15] == [("lookup", 3, [2]), ("lookup", 3, [3]), ("lookup", 3, [8]),
                          ("load", 3, [2, 3]), ("loaded", 3, [2, 3]), ("offer", 3, [8])]


def test_a_long_prompt_is_offered_chunk_by_chunk(tiny_model: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # 70 full blocks: 64 of them (2048 tokens) in the first step, the rest in
    # the next; its repeat loads 69 from the CPU tier and recomputes the 70th
    # (an engine hit stops a block short of a partial block's end)
    long = list(range(100, 170))
    real = assert_same(tiny_model, [(long, 5, 2), (list(range(200, 210)), 0, 1), (long, 5, 2)],
                       90, 200, monkeypatch)
    offers = [c for c in real if c[0] == "offer" and c[1] == 0]
    assert offers == [("offer", 0, long[:64]), ("offer", 0, long[64:])]


def test_a_refused_offer_is_retried_at_every_step_of_the_request(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a 9-block offer never fits 6 CPU blocks: vLLM asks again at each of the
    # request's steps (its prefill, its 3 decode steps) and once it finished
    real = assert_same(tiny_model, [([1, 2, 3, 5, 6, 7, 8, 9, 10], 1, 4), ([1, 2], 3, 1)],
                       30, 6, monkeypatch)
    assert [c[0] for c in real if c[1] == 0] == ["lookup"] + ["offer"] * 5 + ["finish"]


def test_a_mixed_workload_makes_the_same_calls_as_vllm(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # shared prefixes, aligned and partial prompts, decode filling blocks, an
    # engine cache small enough to evict and a CPU tier that evicts
    rng = random.Random(3)
    bases = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [7, 8], [9, 10, 11, 12, 13, 14], []]
    requests: list[Spec] = []
    for i in range(40):
        ids = rng.choice(bases) + [1000 + i * 10 + j for j in range(rng.randint(0, 5))]
        requests.append((ids or [999], rng.choice([0, 1, 16, 31]), rng.randint(1, 40)))
    assert_same(tiny_model, requests, 16, 12, monkeypatch)
