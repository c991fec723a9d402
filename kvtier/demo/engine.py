"""Start vLLM on the tiny local model, with or without kvtier, and generate.

Settings come from the integration spike (docs/vllm-integration-notes.md):
block size 32 (CPU attention needs a multiple of 32), a small fixed number of
engine KV blocks, eager mode, bfloat16, token-id prompts and greedy sampling.
vLLM is imported on first use. A script that starts an engine needs an
``if __name__ == "__main__":`` guard: vLLM's worker processes re-import it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kvtier.replay.serving_trace import ENGINE_BLOCK_TOKENS

if TYPE_CHECKING:
    from vllm import LLM, RequestOutput

    from kvtier.manager import OffloadManager
    from kvtier.tiers.cascade import TierCascade
    from kvtier.vllm.adapter import KVTierOffloadingManager

SPEC_CONFIG = {"spec_name": "KVTierSpec", "spec_module_path": "kvtier.vllm"}
"""The ``kv_connector_extra_config`` keys that select kvtier."""


@dataclass(frozen=True)
class EngineSettings:
    """vLLM settings shared by the runs with and without kvtier.

    ``num_gpu_blocks * block_size`` must be at least ``max_model_len``.
    """

    block_size: int = ENGINE_BLOCK_TOKENS
    max_model_len: int = 1024
    num_gpu_blocks: int = 64
    max_num_seqs: int = 4
    kv_cache_memory_bytes: int = 64 << 20
    log_stats: bool = False
    """Keep vLLM's request metrics (``RequestOutput.metrics``: time to first token)."""
    tensor_parallel_size: int = 1
    """Worker processes sharing each layer (CPU: see :func:`cpu_thread_binding`)."""
    hf_overrides: Mapping[str, Any] | None = None
    """vLLM's ``hf_overrides``: changes to the model's config (e.g. RoPE)."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Model and KV dtype. Splitting a prompt differently between cached and
    computed tokens changes the order of sums; in bf16 that can turn a greedy
    token (README, the demo's output checks), in float32 far more rarely."""
    prefix_caching_hash_algo: str = "sha256"
    """vLLM's block hashing (``kvtier.vllm.block_hashing``: the fast ones need
    ``PYTHONHASHSEED`` for another process to share the keys)."""
    engine_args: Mapping[str, Any] | None = None
    """Further ``vllm.LLM`` keyword arguments (e.g. ``max_num_batched_tokens``,
    ``enable_lora``); they override the settings above."""


def cpu_thread_binding(ranks: int) -> str:
    """A ``VLLM_CPU_OMP_THREADS_BIND`` value giving each of ``ranks`` CPU workers
    its own share of this process's CPUs (vLLM's automatic binding wants one
    NUMA node per worker)."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
        raise ValueError(f"ranks must be an int >= 1, got {ranks!r}")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < ranks:
        raise ValueError(f"{ranks} CPU workers need {ranks} CPUs, this process may use {cpus}")
    share = len(cpus) // ranks
    groups = [cpus[r * share:(r + 1) * share] for r in range(ranks)]
    return "|".join(",".join(map(str, g)) for g in groups)


@dataclass(frozen=True)
class Generation:
    """One request's outcome."""

    prompt_tokens: int
    token_ids: tuple[int, ...]
    num_cached_tokens: int
    """Prompt tokens not computed: GPU prefix cache plus kvtier hits."""
    ttft_s: float | None
    """Time to first token from vLLM's metrics (None unless ``log_stats``)."""


def kvtier_config(cpu_bytes_to_use: int, **extra: Any) -> dict[str, Any]:
    """``kv_connector_extra_config`` enabling kvtier with ``extra`` settings."""
    return {**SPEC_CONFIG, "cpu_bytes_to_use": cpu_bytes_to_use, **extra}


def start_engine(
    model: str | Path,
    extra_config: Mapping[str, Any] | None = None,
    settings: EngineSettings | None = None,
) -> LLM:
    """A ``vllm.LLM`` on ``model``; with kvtier when ``extra_config`` is given.

    ``extra_config`` is passed verbatim as the OffloadingConnector's
    ``kv_connector_extra_config`` (see :func:`kvtier_config`).
    """
    from vllm import LLM
    from vllm.config import KVTransferConfig

    s = settings or EngineSettings()
    if s.tensor_parallel_size > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_thread_binding(
            s.tensor_parallel_size))
    transfer = None
    if extra_config is not None:
        transfer = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config=dict(extra_config),
        )
    try:
        args: dict[str, Any] = dict(
            block_size=s.block_size,
            max_model_len=s.max_model_len,
            num_gpu_blocks_override=s.num_gpu_blocks,
            kv_cache_memory_bytes=s.kv_cache_memory_bytes,
            max_num_seqs=s.max_num_seqs,
            enforce_eager=True,
            dtype=s.dtype,
            seed=0,
            disable_log_stats=not s.log_stats,
            kv_transfer_config=transfer,
            tensor_parallel_size=s.tensor_parallel_size,
            hf_overrides=dict(s.hf_overrides or {}),
            prefix_caching_hash_algo=s.prefix_caching_hash_algo,
        )
        return LLM(model=str(model), **{**args, **(s.engine_args or {})})
    except BaseException:
        _cleanup()  # a failed start leaves vLLM's process-wide state set up
        raise


def _cleanup() -> None:
    """Reset vLLM's process-wide state (distributed groups, env cache)."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()


def stop_engine(llm: LLM) -> None:
    """Shut the engine down now (workers, connector, slot region)."""
    llm.llm_engine.engine_core.shutdown()
    _cleanup()


@contextlib.contextmanager
def running_engine(
    model: str | Path,
    extra_config: Mapping[str, Any] | None = None,
    settings: EngineSettings | None = None,
) -> Iterator[LLM]:
    """:func:`start_engine` as a context manager that stops the engine on exit."""
    llm = start_engine(model, extra_config, settings)
    try:
        yield llm
    finally:
        stop_engine(llm)


def generate(
    llm: LLM, prompts: Sequence[Sequence[int]], max_tokens: int = 16
) -> list[Generation]:
    """Greedy generations of token-id ``prompts``, in order."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    outputs = llm.generate(requests, params, use_tqdm=False)
    return [_generation(out) for out in outputs]


def _generation(out: RequestOutput) -> Generation:
    metrics = out.metrics
    ttft = getattr(metrics, "first_token_latency", None) if metrics is not None else None
    return Generation(
        prompt_tokens=len(out.prompt_token_ids or ()),
        token_ids=tuple(out.outputs[0].token_ids),
        num_cached_tokens=out.num_cached_tokens or 0,
        ttft_s=float(ttft) if ttft else None,
    )


def drain(llm: LLM, steps: int = 2) -> None:
    """Let deferred stores finish: run ``steps`` one-token requests.

    vLLM submits a request's stores at the start of the engine's next step and
    completes them a step later, so an idle single-process engine leaves them
    pending. The probe prompt is shorter than a block, so it stores nothing.
    """
    probe = [[1] * (llm.llm_engine.vllm_config.cache_config.block_size // 4)]
    for _ in range(steps):
        generate(llm, probe, max_tokens=1)


def engine_id(llm: LLM) -> str:
    """The engine id that names kvtier's slot region."""
    transfer = llm.llm_engine.vllm_config.kv_transfer_config
    if transfer is None or transfer.engine_id is None:
        raise RuntimeError("the engine has no KV transfer config (started without kvtier)")
    return str(transfer.engine_id)


def region_path(llm: LLM, rank: int = 0) -> Path:
    """Path of kvtier's slot region of ``rank`` in ``/dev/shm``."""
    from kvtier.slots.region import default_shm_dir
    from kvtier.vllm.spec import shared_region_name

    return default_shm_dir() / shared_region_name(engine_id(llm), rank)


def kvtier_adapter(llm: LLM) -> KVTierOffloadingManager:
    """The engine's kvtier offloading manager (vLLM's side of the contract);
    needs a single-process engine, errors as :func:`kvtier_manager`."""
    from kvtier.vllm.adapter import KVTierOffloadingManager

    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        raise RuntimeError(
            "the scheduler runs in another process; set VLLM_ENABLE_V1_MULTIPROCESSING=0"
        )
    connector = core.scheduler.connector
    scheduler = getattr(connector, "connector_scheduler", None)
    manager = getattr(scheduler, "manager", None)
    if not isinstance(manager, KVTierOffloadingManager):
        raise RuntimeError(f"the engine's offloading manager is {manager!r}, not kvtier's")
    return manager


def kvtier_manager(llm: LLM) -> OffloadManager:
    """The engine's kvtier manager; needs a single-process engine.

    Raises ``RuntimeError`` when the scheduler runs in another process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=1``) or the engine has no kvtier.
    """
    return kvtier_adapter(llm).manager


def kvtier_cascade(llm: LLM) -> TierCascade:
    """The engine's kvtier tier cascade (disk/Redis); errors as :func:`kvtier_manager`,
    and ``RuntimeError`` when no lower tier is configured."""
    cascade = kvtier_adapter(llm).cascade
    if cascade is None:
        raise RuntimeError("the engine's kvtier has no disk or Redis tier")
    return cascade


def single_process() -> bool:
    """Whether vLLM will run the engine core in this process."""
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
