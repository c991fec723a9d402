"""Replay a trace through a ``TierCascade``: CPU slots, then a real disk tier.

The order is the sequential driver's (``kvtier.replay.driver``): requests in
file order, one at a time. Each request looks up its blocks one by one through
the cascade (CPU first, then disk); a disk hit is promoted into a reserved CPU
slot and reports HIT_PENDING, which is resolved (polling the cascade) to HIT or
MISS before the next block is looked up. The request's prefix hits are its
leading run of HIT; a hit whose block was promoted during this request counts
as a disk hit, any other as a CPU hit. The hit blocks are loaded, every block
is offered for storing, and each stored slot is filled with bytes derived from
its key; ``complete_store`` writes them through to disk, and the replay waits
for those writes (``drain``) before the next request, so no write is dropped
and the run is deterministic. Every loaded slot's bytes are checked against
its key (``verify_failures``).

The slot region is real but tiny (``slot_bytes``, 64 by default), so a disk
block costs one file-system allocation unit (4 KiB): the disk tier holds
``disk_blocks`` blocks.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.manager import OffloadManager
from kvtier.replay.driver import ProgressCallback, request_contexts
from kvtier.replay.trace import MOONCAKE_BLOCK_TOKENS
from kvtier.request import RequestContext
from kvtier.results import LookupResult
from kvtier.slots.region import SlotRegion
from kvtier.tiers.cascade import TierCascade
from kvtier.tiers.disk import ALLOC_UNIT, DiskTier
from kvtier.tiers.namespace import KVLayout

DEFAULT_SLOT_BYTES = 64
NAMESPACE = KVLayout("kvtier-replay", "uint8", MOONCAKE_BLOCK_TOKENS, 1, 1, 1).namespace()
PROMOTION_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class TieredReplayResult:
    """Figures of one tiered replay.

    ``hit_ratio`` is prefix-hit blocks / offered blocks, split into
    ``cpu_hit_ratio`` (blocks resident in the CPU tier at lookup) and
    ``disk_hit_ratio`` (blocks promoted from disk for this request).
    """

    policy: str
    capacity: int
    disk_blocks: int
    store_threshold: int
    requests: int
    offered_blocks: int
    hit_blocks: int
    cpu_hit_blocks: int
    disk_hit_blocks: int
    hit_ratio: float
    cpu_hit_ratio: float
    disk_hit_ratio: float
    stores: int
    evictions: int
    promotions: int
    promotion_failures: int
    disk_writes: int
    dropped_writes: int
    verify_failures: int
    seconds: float
    driver: str = "tiered"

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict, in declaration order."""
        return asdict(self)


def key_bytes(key: bytes, size: int) -> np.ndarray:
    """``size`` bytes derived from ``key`` (what a stored slot holds)."""
    digest = np.frombuffer(hashlib.blake2b(key, digest_size=64).digest(), dtype=np.uint8)
    return np.resize(digest, size)


class _Replayer:
    def __init__(self, cascade: TierCascade, region: SlotRegion) -> None:
        self.cascade = cascade
        self.mgr = cascade.manager
        self.region = region
        self.size = region.slot_bytes
        self.cpu_hits = self.disk_hits = self.verify_failures = 0

    def _resolve(self, key: bytes, ctx: RequestContext) -> LookupResult:
        """Look ``key`` up; poll a pending promotion until it is HIT or MISS."""
        lookup = self.cascade.lookup_one
        result = lookup(key, ctx)
        deadline = time.monotonic() + PROMOTION_TIMEOUT_S + 5.0
        while result is LookupResult.HIT_PENDING:
            if time.monotonic() > deadline:
                raise RuntimeError("kvtier tiered replay: a promotion never finished")
            time.sleep(0)
            result = lookup(key, ctx)
        return result

    def request(self, keys: list[bytes], ctx: RequestContext) -> None:
        mgr, cascade, size = self.mgr, self.cascade, self.size
        hits = promoted = 0
        for key in keys:
            first = cascade.lookup_one(key, ctx)
            if first is LookupResult.HIT_PENDING:
                first = self._resolve(key, ctx)
                promoted += first is LookupResult.HIT
            if first is not LookupResult.HIT:
                break
            hits += 1
        if hits:
            loaded = keys[:hits]
            spec = mgr.prepare_load(loaded, ctx)
            for key, slot in zip(loaded, spec.block_ids, strict=True):
                if not np.array_equal(self.region.slot_array(slot), key_bytes(key, size)):
                    self.verify_failures += 1
            mgr.complete_load(loaded, ctx)
        self.cpu_hits += hits - promoted
        self.disk_hits += promoted
        out = mgr.prepare_store(keys, ctx)
        if out is not None and out.keys_to_store:
            for key, slot in zip(out.keys_to_store, out.block_ids, strict=True):
                self.region.slot_array(slot)[:] = key_bytes(key, size)
            cascade.complete_store(out.keys_to_store, ctx)
            if not cascade.drain(PROMOTION_TIMEOUT_S):
                raise RuntimeError("kvtier tiered replay: disk writes never finished")
        mgr.on_request_finished(ctx)


def replay_tiered(
    requests: Sequence[list[bytes]],
    capacity: int,
    disk_blocks: int,
    policy: str = "lru",
    *,
    store_threshold: int = 1,
    max_tracker_size: int = 64_000,
    slot_bytes: int = DEFAULT_SLOT_BYTES,
    workdir: str | Path | None = None,
    progress: ProgressCallback | None = None,
) -> TieredReplayResult:
    """Replay ``requests`` (block keys, see ``trace_keys``) through CPU + disk.

    ``capacity`` CPU slots of ``slot_bytes`` each and a fresh ``DiskTier`` of
    ``disk_blocks`` blocks (0: no disk tier, the CPU tier alone) in a temporary
    directory under ``workdir``; both are removed afterwards. Lease bounds are
    raised to the whole cache as in ``driver.replay``.
    """
    if disk_blocks < 0:
        raise ValueError(f"disk_blocks must be >= 0, got {disk_blocks}")
    start = time.perf_counter()
    mgr = OffloadManager(
        capacity, policy=policy, store_threshold=store_threshold,
        max_tracker_size=max_tracker_size,
        max_leases_per_request=capacity, max_leased_blocks=capacity,
    )
    with tempfile.TemporaryDirectory(prefix="kvtier-tiered-", dir=workdir) as tmp:
        tmp_path = Path(tmp)
        tiers = []
        if disk_blocks:
            tiers.append(DiskTier(
                tmp_path / "disk", NAMESPACE, disk_blocks * ALLOC_UNIT,
                free_reserve_bytes=0, rescan_interval_s=None,
            ))
        with SlotRegion.create("tiered-replay", capacity, slot_bytes,
                               shm_dir=tmp_path, populate=False) as region:
            cascade = TierCascade(mgr, region, tiers, "store", io_threads=1,
                                  promotion_timeout_s=PROMOTION_TIMEOUT_S)
            try:
                r = _Replayer(cascade, region)
                for keys, ctx in request_contexts(requests, progress):
                    r.request(keys, ctx)
                cascade.drain(PROMOTION_TIMEOUT_S)
                cstats = cascade.stats()
            finally:
                cascade.shutdown()
    stats = mgr.stats()
    offered = sum(map(len, requests))
    hits = r.cpu_hits + r.disk_hits

    def ratio(n: int) -> float:
        return n / offered if offered else 0.0

    return TieredReplayResult(
        policy=policy, capacity=capacity, disk_blocks=disk_blocks,
        store_threshold=store_threshold, requests=len(requests), offered_blocks=offered,
        hit_blocks=hits, cpu_hit_blocks=r.cpu_hits, disk_hit_blocks=r.disk_hits,
        hit_ratio=ratio(hits), cpu_hit_ratio=ratio(r.cpu_hits),
        disk_hit_ratio=ratio(r.disk_hits),
        stores=stats["stores"], evictions=stats["evictions"],
        promotions=cstats["promotions"], promotion_failures=cstats["promotion_failures"],
        disk_writes=cstats["cascade_writes"], dropped_writes=cstats["dropped_writes"],
        verify_failures=r.verify_failures, seconds=time.perf_counter() - start,
    )
