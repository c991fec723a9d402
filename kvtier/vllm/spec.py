"""``KVTierSpec``: kvtier as a vLLM offloading spec (``spec_name`` "KVTierSpec")."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvtier.identity import IdentityError, ModelIdentity
from kvtier.manager import OffloadManager
from kvtier.replay.recorder import TraceRecorder, TraceRecorderError
from kvtier.slots.region import DEFAULT_ALIGNMENT, PREFIX, SUFFIX, SlotRegion, region_creator
from kvtier.tiers.base import Tier
from kvtier.tiers.cascade import TierCascade
from kvtier.tiers.io_pool import SlotSource
from kvtier.tiers.lower_tier import WritePolicy
from kvtier.tiers.namespace import namespace_of
from kvtier.tiers.ranks import RankedTier, RankRegions
from kvtier.vllm.adapter import KVTierOffloadingManager
from kvtier.vllm.block_hashing import unshared_keys_reason
from kvtier.vllm.identity import find_vllm_config, lora_reason, model_identity
from kvtier.vllm.metrics import metric_definitions
from kvtier.vllm.settings import ConfigError, KVTierSettings, one_block_per_slot_error
from kvtier.vllm.startup import share_vllm_log_handlers, tiers_line
from kvtier.vllm.worker import VllmSlotWorker

logger = logging.getLogger(__name__)

ATTACH_RETRY_S = 1.0
"""How often the scheduler retries attaching the workers' slot region."""


REGION_ID_CHARS = 64
"""Characters of the engine id a region name keeps as they are."""


def shared_region_name(engine_id: str, rank: int) -> str:
    """Name of an engine rank's slot region: computable by every process of the
    engine, and distinct for distinct engine ids (an id that is long or has
    other characters than ``[A-Za-z0-9_.-]`` gets a digest of all of it, so
    vLLM's data-parallel ``<id>_dp<rank>`` engines never share a region)."""
    safe = "".join(c if c.isalnum() or c in "_.-" else "_" for c in engine_id)
    if safe != engine_id or len(safe) > REGION_ID_CHARS:
        digest = hashlib.blake2b(engine_id.encode(), digest_size=6).hexdigest()
        safe = f"{safe[:REGION_ID_CHARS - 13]}-{digest}"
    return f"{PREFIX}{safe or 'engine'}-rank{rank}{SUFFIX}"


def create_worker_region(engine_id: str, rank: int, num_slots: int,
                         slot_bytes: int) -> SlotRegion:
    """Create an engine rank's slot region; ``ConfigError`` when a live process
    already has one under that name.

    Only the rank's worker creates its region (the scheduler attaches), so an
    existing live region belongs to another engine started with the same
    ``engine_id``: joining it would let two block tables hand out the same
    slots, and each engine would load the other's bytes.
    """
    name = shared_region_name(engine_id, rank)
    try:
        # vLLM kills its workers at shutdown: the reaper removes the file anyway
        return SlotRegion.create(engine_id, num_slots, slot_bytes, name=name, reaper=True)
    except FileExistsError:
        creator = region_creator(name)
        owner = f"process {creator[0]}" if creator else "another process"
        raise ConfigError(
            f"slot region {name!r} for engine_id {engine_id!r} rank {rank} is held by "
            f"{owner}: another engine on this host uses the same kv_transfer_config "
            "engine_id. Give each engine its own engine_id, or leave it unset (vLLM "
            "then picks a unique one)") from None


class KVTierSpec(OffloadingSpec):
    """Builds kvtier's scheduler-side manager and worker-side transfer worker.

    vLLM constructs the spec once per role (scheduler, each worker); both
    derive the same slot geometry from the config: one slot holds one engine
    block of this rank (``worker_kv_bytes_per_block`` bytes, 4 KiB aligned),
    and ``cpu_bytes_to_use`` is shared by all ranks. Bad configuration raises
    ``ConfigError`` here, at start-up.
    """

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        return metric_definitions(extra_config)

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        share_vllm_log_handlers()  # before the first record: vLLM's log shows kvtier's
        self.settings = KVTierSettings.from_extra_config(self.extra_config)
        if self.blocks_per_chunk != 1:
            raise one_block_per_slot_error(
                f"blocks_per_chunk={self.blocks_per_chunk} (from 'block_size'/'blocks_per_chunk')")
        if config.parallel.pp_size != 1:
            # Each process sizes its slots from its own stage's bytes per block,
            # and the scheduler from rank 0's: on uneven stages a worker's
            # region is smaller than the slot numbers the scheduler hands out.
            raise ConfigError(
                f"kvtier supports tensor-parallel engines, not pipeline-parallel ones "
                f"(pp_size={config.parallel.pp_size}): the stages' blocks differ in size, "
                "and one slot count serves every rank"
            )
        if self.extra_config.get("canonical_layout"):
            logger.warning("kvtier: canonical_layout is ignored: kvtier keeps each rank's "
                           "shard of a block as the engine lays it out, so blocks are "
                           "shared only by engines of the same topology")
        self.slot_bytes = config.worker_kv_bytes_per_block
        self.num_slots = self._count_slots(config)
        self._vllm_config = find_vllm_config()  # the engine's: model config and weights
        self._identity: ModelIdentity | None = None
        self._manager: KVTierOffloadingManager | None = None
        self._worker: VllmSlotWorker | None = None

    def _count_slots(self, config: OffloadingConfig) -> int:
        if self.slot_bytes <= 0:
            return 0
        stride = self._slot_stride()
        ranks = max(1, config.parallel.world_size)
        num_slots = self.settings.cpu_bytes_to_use // (stride * ranks)
        if num_slots < 1:
            raise ConfigError(
                f"cpu_bytes_to_use={self.settings.cpu_bytes_to_use} holds no KV block: "
                f"one block takes {stride} bytes on each of {ranks} rank(s)"
            )
        return num_slots

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            s = self.settings
            recorder = self._recorder()  # first: a bad trace_path stops nothing started
            manager = OffloadManager(
                self.num_slots,
                policy=s.eviction_policy,
                store_threshold=s.store_threshold,
                max_tracker_size=s.max_tracker_size,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                eviction_history_size=s.eviction_history_size,
                max_leases_per_request=s.max_leases_per_request,
                max_leased_blocks=s.max_leased_blocks,
                lease_timeout_s=s.lease_timeout_s,
            )
            self._manager = KVTierOffloadingManager(manager, self._cascade(manager), recorder)
            self._log_tiers()
        return self._manager

    def _recorder(self) -> TraceRecorder | None:
        """The trace recorder ``trace_path`` asks for (on the scheduler's side only)."""
        s = self.settings
        if s.trace_path is None:
            return None
        try:
            return TraceRecorder(s.trace_path, s.trace_max_requests)
        except TraceRecorderError as exc:
            raise ConfigError(str(exc)) from None

    def _log_tiers(self) -> None:
        """The scheduler's one start-up line: which tiers are active (``tiers_line``)."""
        s = self.settings
        shared = s.disk_path is not None or s.redis_url is not None
        logger.info("%s", tiers_line(
            s, num_slots=self.num_slots, slot_stride=self._slot_stride(),
            ranks=max(1, self.config.parallel.world_size),
            namespace=self.namespace(0) if shared else None))

    def _slot_stride(self) -> int:
        """Bytes one slot takes in a rank's region (a block, 4 KiB aligned)."""
        return -(-self.slot_bytes // DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT

    def model_identity(self) -> ModelIdentity:
        """The model's weights and effective config, fingerprinted once
        (``kvtier.vllm.identity``); ``ConfigError`` when they cannot be."""
        if self._identity is None:
            if self._vllm_config is None:
                raise ConfigError("kvtier found no VllmConfig to fingerprint the model for "
                                  "its disk/Redis tiers (the spec must be built by vLLM's "
                                  "OffloadingConnector)")
            try:
                self._identity = model_identity(self._vllm_config, self.settings.model_identity)
            except IdentityError as exc:
                raise ConfigError(str(exc)) from None
        return self._identity

    def namespace(self, rank: int | None = None) -> str:
        """The shared tiers' namespace of one rank (default: this process's):
        the model's identity (weights, effective config), KV dtype and
        geometry, rank and world size and how the world splits a block
        (tensor, prefill- and decode-context parallel sizes), tenant."""
        c = self.config
        fingerprint = {
            "identity": self.model_identity().as_dict(),
            "dtype": c.model.dtype,
            "tokens_per_block": [g.tokens_per_block for g in c.groups],
            "layers": [len(g.layer_names) for g in c.groups],
            "worker_kv_bytes_per_block": c.worker_kv_bytes_per_block,
            "kv_cache_layout": c.kv_cache_layout,
            "rank": c.parallel.rank if rank is None else rank,
            "world_size": c.parallel.world_size,
            # how the world splits a block: by heads (tensor) or by tokens (context)
            "split": [c.parallel.tp_size, c.parallel.pcp_size, c.parallel.dcp_size],
        }
        raw = json.dumps(fingerprint, sort_keys=True, separators=(",", ":")).encode()
        return namespace_of(raw, self.settings.tenant_salt)

    def _cascade(self, manager: OffloadManager) -> TierCascade | None:
        """Disk/Redis tiers behind the CPU tier, when configured. With several
        ranks (tensor parallel), each tier keeps one value per rank
        (``RankedTier``) and the cascade reads all ranks' slot regions."""
        s = self.settings
        if s.disk_path is None and s.redis_url is None:
            return None
        for reason in (unshared_keys_reason(self._vllm_config), lora_reason(self._vllm_config)):
            if reason is not None:
                logger.warning("kvtier: %s", reason)
        tiers: list[Tier] = []
        policies: list[WritePolicy] = []
        thresholds: list[int] = []
        if s.disk_path is not None:
            tiers.append(self._ranked(self._disk_tier))
            policies.append(s.disk_write_policy)  # type: ignore[arg-type]  # validated
            thresholds.append(s.disk_store_threshold)
        if s.redis_url is not None:
            tiers.append(self._ranked(self._redis_tier))
            policies.append(s.redis_write_policy)  # type: ignore[arg-type]  # validated
            thresholds.append(s.redis_store_threshold)
        return TierCascade(manager, self._region_attacher(), tiers, policies,
                           store_threshold=thresholds, max_tracker_size=s.max_tracker_size,
                           async_lookups=s.redis_async_lookups,
                           promotion_timeout_s=s.promotion_timeout_s)

    def _ranked(self, make: Callable[[int], Tier]) -> Tier:
        """One tier per rank (``make(rank)``), as one ``RankedTier`` when several."""
        world = max(1, self.config.parallel.world_size)
        if world == 1:
            return make(0)
        tiers: list[Tier] = []
        try:
            for rank in range(world):
                tiers.append(make(rank))
        except BaseException:
            for tier in tiers:
                tier.close()
            raise
        return RankedTier(tiers, enable_events=self.kv_events_config.enable_kv_cache_events)

    def _disk_tier(self, rank: int) -> Tier:
        from kvtier.tiers.disk import DiskTier

        s = self.settings
        if s.disk_path is None or s.disk_bytes is None:
            raise ConfigError("disk_bytes is required with disk_path")
        share = s.disk_bytes // max(1, self.config.parallel.world_size)
        return DiskTier(s.disk_path, self.namespace(rank), share, max_block_bytes=self.slot_bytes,
                        enable_events=self.kv_events_config.enable_kv_cache_events,
                        manifest=self._manifest(rank), lookups=s.disk_lookups)

    def _manifest(self, rank: int) -> dict[str, object]:
        """What a shared tier's namespace says about its engine, for operators
        (``kvtier disk inspect``): no salt, no secret."""
        c = self.config
        return {"model": c.model.name, "kv_dtype": c.model.dtype,
                "weights": self.model_identity().weights[:24],
                "tokens_per_block": [g.tokens_per_block for g in c.groups],
                "rank": rank, "world_size": c.parallel.world_size,
                "tenant_salted": self.settings.tenant_salt is not None,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    def _redis_tier(self, rank: int) -> Tier:
        from kvtier.tiers.redis_tier import RedisTier

        s = self.settings
        if s.redis_url is None:
            raise ConfigError("redis_url is not set")
        return RedisTier(s.redis_url, self.namespace(rank), ttl_s=s.redis_ttl_s,
                         max_block_bytes=self.slot_bytes,
                         enable_events=self.kv_events_config.enable_kv_cache_events)

    def _region_attacher(self) -> Callable[[], SlotSource | None]:
        """A callable attaching the workers' slot regions on first success (None
        until every rank's worker created its region; retried at most every
        ``ATTACH_RETRY_S``). Several ranks: a ``RankRegions`` in rank order."""
        world = max(1, self.config.parallel.world_size)
        names = [shared_region_name(self.config.engine_id, r) for r in range(world)]
        last_try = [-ATTACH_RETRY_S]

        def attach() -> SlotSource | None:
            now = time.monotonic()
            if now - last_try[0] < ATTACH_RETRY_S:
                return None
            last_try[0] = now
            regions: list[SlotRegion] = []
            try:
                for name in names:
                    regions.append(SlotRegion.attach(name, num_slots=self.num_slots,
                                                     slot_bytes=self.slot_bytes))
            except FileNotFoundError:
                for region in regions:
                    region.close()
                return None
            return regions[0] if world == 1 else RankRegions(regions)

        return attach

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            region = create_worker_region(self.config.engine_id, self.config.parallel.rank,
                                          self.num_slots, self.slot_bytes)
            try:
                self._worker = VllmSlotWorker(
                    kv_caches,
                    region,
                    cuda_copy=self.settings.cuda_copy,
                    own_region=True,
                )
            except BaseException:
                region.close()
                raise
        return self._worker


# kvtier offloads GPU blocks to CPU memory (its transfers are CPU_to_GPU and
# GPU_to_CPU): as a registered CPU offloading spec, vLLM fills its
# per-direction transfer metrics (vllm:kv_offload_total_bytes, _total_time,
# _size) for kvtier too. Registration adds nothing to the class itself.
CPUOffloadingSpec.register(KVTierSpec)
