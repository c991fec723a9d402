"""Replay a trace through a ``TierCascade``: CPU slots, then a real disk tier.

The order is the sequential driver's (``kvtier.replay.driver``): requests in
file order, one at a time, each in the cascade's step contract (vLLM's, see
``kvtier.tiers.cascade``). A request scans its blocks through the cascade
(CPU first, then disk) the way vLLM's scheduler does: HIT and HIT_PENDING (a
disk hit being promoted into a reserved CPU slot) extend the prefix, RETRY
(a remote tier's existence check in flight; not with a disk tier) continues
the scan, MISS ends it. A scan that met HIT_PENDING or RETRY is deferred: the
replay ends the scheduling step (``cascade.on_schedule_end()``, which submits
the step's promotions as one batch), keeps ending steps until no job is in
flight, and scans again, until a scan is final (no key pending) or a deadline
passes (an error). The request's prefix hits are the final scan's leading run
of HIT; a hit that answered HIT_PENDING during this request counts as a disk
hit, any other as a CPU hit.

The hit blocks are loaded, every block is offered for storing through
``cascade.prepare_store`` and each stored slot is filled with bytes derived
from its key; ``cascade.complete_store`` writes the admitted ones through to
disk, and ``cascade.on_request_finished`` submits writes the request made due.
Lookups and offers count as uses of a block, once per request, so the disk
tier's admission sees every request: with ``disk_store_threshold = t`` a block
reaches the disk only once ``t`` requests used it. ``disk_write_policy``
``"store"`` writes admitted blocks through; ``"evict"`` writes them as the CPU
tier evicts them (blocks still in the CPU tier are never written). The replay
ends steps until every write has finished before the next request, so no
write is dropped and the run is deterministic. Every loaded slot's bytes are
checked against its key (``verify_failures``).

The slot region is real but tiny (``slot_bytes``, 64 by default), so a disk
block costs one file-system allocation unit (4 KiB): the disk tier holds
``disk_blocks`` blocks.
"""

from __future__ import annotations

import contextlib
import hashlib
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.admission import DEFAULT_MAX_TRACKER_SIZE
from kvtier.manager import OffloadManager
from kvtier.replay.driver import ProgressCallback, request_contexts
from kvtier.replay.trace import MOONCAKE_BLOCK_TOKENS
from kvtier.request import RequestContext
from kvtier.results import LookupResult
from kvtier.slots.region import SlotRegion
from kvtier.tiers.base import Tier
from kvtier.tiers.cascade import TierCascade
from kvtier.tiers.disk import DiskTier
from kvtier.tiers.disk_dir import ALLOC_UNIT
from kvtier.tiers.lower_tier import WRITE_POLICIES, WritePolicy
from kvtier.tiers.namespace import KVLayout

DEFAULT_SLOT_BYTES = 64
NAMESPACE = KVLayout("kvtier-replay", "uint8", MOONCAKE_BLOCK_TOKENS, 1, 1, 1).namespace()
PROMOTION_TIMEOUT_S = 30.0
WAIT_S = 0.0001
"""Pause between two step ends while cascade jobs are in flight."""

_PENDING = (LookupResult.HIT_PENDING, LookupResult.RETRY)


@dataclass(frozen=True, slots=True)
class TieredReplayResult:
    """Figures of one tiered replay.

    ``hit_ratio`` is prefix-hit blocks / offered blocks, split into
    ``cpu_hit_ratio`` (blocks resident in the CPU tier at lookup) and
    ``disk_hit_ratio`` (blocks promoted from disk for this request).
    ``store_threshold`` is the CPU tier's admission; ``disk_store_threshold``
    and ``disk_write_policy`` the disk tier's (``kvtier.tiers.cascade``).
    ``disk_writes`` counts blocks written to disk; ``writes_not_admitted``
    the cascade's refusals (a block may be refused several times before it
    is admitted).
    """

    policy: str
    capacity: int
    disk_blocks: int
    store_threshold: int
    disk_store_threshold: int
    disk_write_policy: str
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
    duplicate_writes_skipped: int
    writes_not_admitted: int
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


class Replayer:
    """Runs requests through a cascade in vLLM's step contract (module docstring).

    Owns the hit and verification counters. ``wait_writes``: end steps after
    each request until its writes finished (deterministic; the replay lab);
    otherwise they run on while later requests are served (the soak), and only
    what the bounded I/O queues refuse is dropped.
    """

    def __init__(self, cascade: TierCascade, region: SlotRegion,
                 wait_writes: bool = True) -> None:
        self.cascade = cascade
        self.mgr = cascade.manager
        self.region = region
        self.size = region.slot_bytes
        self.wait_writes = wait_writes
        self.cpu_hits = self.disk_hits = self.verify_failures = 0

    def _end_steps(self, deadline: float, what: str) -> None:
        """End scheduling steps until no cascade job is batched, queued or running."""
        cascade = self.cascade
        cascade.on_schedule_end()
        while cascade.busy():
            if time.monotonic() > deadline:
                raise RuntimeError(f"kvtier tiered replay: {what} never finished")
            time.sleep(WAIT_S)
            cascade.on_schedule_end()

    def _scan(self, keys: list[bytes], ctx: RequestContext,
              pending: set[bytes]) -> int | None:
        """One prefix scan (vLLM's): the leading run of HIT, or None when a key
        answered HIT_PENDING or RETRY (added to ``pending``)."""
        lookup = self.cascade.lookup_one
        hits = 0
        deferred = False
        for key in keys:
            result = lookup(key, ctx)
            if result is LookupResult.MISS:
                break
            if result in _PENDING:
                deferred = True
                pending.add(key)
            else:
                hits += 1
        return None if deferred else hits

    def _prefix(self, keys: list[bytes], ctx: RequestContext) -> tuple[int, int]:
        """Scan until final, ending steps in between: (prefix hits, of them promoted).

        With ``wait_writes`` each deferred scan waits until no job is in flight;
        otherwise it ends one step and scans again (writes run on meanwhile)."""
        pending: set[bytes] = set()
        deadline = time.monotonic() + PROMOTION_TIMEOUT_S + 5.0
        while True:
            hits = self._scan(keys, ctx, pending)
            if hits is not None:
                self.cascade.on_schedule_end()
                return hits, sum(1 for k in keys[:hits] if k in pending)
            if self.wait_writes:
                self._end_steps(deadline, "a promotion")
                continue
            if time.monotonic() > deadline:
                raise RuntimeError("kvtier tiered replay: a promotion never finished")
            self.cascade.on_schedule_end()
            time.sleep(WAIT_S)

    def request(self, keys: list[bytes], ctx: RequestContext) -> None:
        mgr, cascade, size = self.mgr, self.cascade, self.size
        hits, promoted = self._prefix(keys, ctx)
        if hits:
            loaded = keys[:hits]
            spec = mgr.prepare_load(loaded, ctx)
            for key, slot in zip(loaded, spec.block_ids, strict=True):
                if not np.array_equal(self.region.slot_array(slot), key_bytes(key, size)):
                    self.verify_failures += 1
            mgr.complete_load(loaded, ctx)
        self.cpu_hits += hits - promoted
        self.disk_hits += promoted
        out = cascade.prepare_store(keys, ctx)
        if out is not None and out.keys_to_store:
            for key, slot in zip(out.keys_to_store, out.block_ids, strict=True):
                self.region.slot_array(slot)[:] = key_bytes(key, size)
            cascade.complete_store(out.keys_to_store, ctx)
        cascade.on_request_finished(ctx)
        if self.wait_writes:
            self._end_steps(time.monotonic() + PROMOTION_TIMEOUT_S, "a disk write")
        else:
            cascade.on_schedule_end()


def check_disk_options(disk_store_threshold: object, disk_write_policy: object) -> None:
    """``ValueError`` naming the option for a bad disk threshold or write policy."""
    if (isinstance(disk_store_threshold, bool) or not isinstance(disk_store_threshold, int)
            or disk_store_threshold < 1):
        raise ValueError(f"disk_store_threshold must be an int >= 1, "
                         f"got {disk_store_threshold!r}")
    if disk_write_policy not in WRITE_POLICIES:
        raise ValueError(f"disk_write_policy must be one of {', '.join(WRITE_POLICIES)}, "
                         f"got {disk_write_policy!r}")


def replay_tiered(
    requests: Sequence[list[bytes]],
    capacity: int,
    disk_blocks: int,
    policy: str = "lru",
    *,
    store_threshold: int = 1,
    disk_store_threshold: int = 1,
    disk_write_policy: WritePolicy = "store",
    max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE,
    slot_bytes: int = DEFAULT_SLOT_BYTES,
    workdir: str | Path | None = None,
    progress: ProgressCallback | None = None,
) -> TieredReplayResult:
    """Replay ``requests`` (block keys, see ``trace_keys``) through CPU + disk.

    ``capacity`` CPU slots of ``slot_bytes`` each and a fresh ``DiskTier`` of
    ``disk_blocks`` blocks (0: no disk tier, the CPU tier alone) in a temporary
    directory under ``workdir``; both are removed afterwards. Lease bounds are
    raised to the whole cache as in ``driver.replay``. ``store_threshold`` is
    the CPU tier's admission; the disk tier gets a block once
    ``disk_store_threshold`` requests used it, written through
    (``disk_write_policy="store"``) or on CPU eviction (``"evict"``).
    ``max_tracker_size`` bounds both use counters (CPU and disk admission).
    """
    if disk_blocks < 0:
        raise ValueError(f"disk_blocks must be >= 0, got {disk_blocks}")
    check_disk_options(disk_store_threshold, disk_write_policy)
    start = time.perf_counter()
    mgr = OffloadManager(
        capacity, policy=policy, store_threshold=store_threshold,
        max_tracker_size=max_tracker_size,
        max_leases_per_request=capacity, max_leased_blocks=capacity,
    )
    with tiered_cascade(mgr, disk_blocks, disk_write_policy,
                        disk_store_threshold, max_tracker_size=max_tracker_size,
                        slot_bytes=slot_bytes, workdir=workdir) as (cascade, region):
        r = Replayer(cascade, region)
        for keys, ctx in request_contexts(requests, progress):
            r.request(keys, ctx)
        if not cascade.drain(PROMOTION_TIMEOUT_S):
            raise RuntimeError("kvtier tiered replay: cascade jobs never finished")
        cstats = cascade.stats()
    settings = {"policy": policy, "capacity": capacity, "disk_blocks": disk_blocks,
                "store_threshold": store_threshold,
                "disk_store_threshold": disk_store_threshold,
                "disk_write_policy": disk_write_policy}
    return _result(settings, requests, r, mgr.stats(), cstats, time.perf_counter() - start)


@contextlib.contextmanager
def tiered_cascade(
    mgr: OffloadManager,
    disk_blocks: int,
    write_policy: WritePolicy | Sequence[WritePolicy] = "store",
    store_threshold: int | Sequence[int] = 1,
    *,
    max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE,
    slot_bytes: int = DEFAULT_SLOT_BYTES,
    workdir: str | Path | None = None,
    extra_tiers: Sequence[Tier] = (),
    io_threads: int = 1,
    **cascade_options: Any,
) -> Iterator[tuple[TierCascade, SlotRegion]]:
    """A ``TierCascade`` over ``mgr`` for the lab: a real slot region of
    ``mgr.num_blocks`` slots of ``slot_bytes`` and a fresh ``DiskTier`` of
    ``disk_blocks`` blocks (0: none) in a temporary directory under
    ``workdir``, then ``extra_tiers`` (e.g. a ``RedisTier``, owned by the
    cascade from then on). ``write_policy`` and ``store_threshold``: one for
    every tier, or one per tier; ``cascade_options`` go to ``TierCascade``
    (``max_probes``, ``max_failed``, ``max_queue``...). Everything is removed
    afterwards.
    """
    with tempfile.TemporaryDirectory(prefix="kvtier-tiered-", dir=workdir) as tmp:
        tmp_path = Path(tmp)
        tiers: list[Tier] = []
        if disk_blocks:
            tiers.append(DiskTier(
                tmp_path / "disk", NAMESPACE, disk_blocks * ALLOC_UNIT,
                free_reserve_bytes=0, rescan_interval_s=None,
            ))
        tiers.extend(extra_tiers)
        with SlotRegion.create("tiered-replay", mgr.num_blocks, slot_bytes,
                               shm_dir=tmp_path, populate=False) as region:
            cascade = TierCascade(mgr, region, tiers, write_policy, io_threads=io_threads,
                                  store_threshold=store_threshold,
                                  max_tracker_size=max_tracker_size,
                                  promotion_timeout_s=PROMOTION_TIMEOUT_S,
                                  **cascade_options)
            try:
                yield cascade, region
            finally:
                cascade.shutdown()


def _result(
    settings: dict[str, Any], requests: Sequence[list[bytes]], r: Replayer,
    stats: dict[str, int], cstats: dict[str, int], seconds: float,
) -> TieredReplayResult:
    """The figures of a finished replay (``stats``: the manager's, ``cstats``: the cascade's)."""
    offered = sum(map(len, requests))
    hits = r.cpu_hits + r.disk_hits

    def ratio(n: int) -> float:
        return n / offered if offered else 0.0

    return TieredReplayResult(
        **settings, requests=len(requests), offered_blocks=offered,
        hit_blocks=hits, cpu_hit_blocks=r.cpu_hits, disk_hit_blocks=r.disk_hits,
        hit_ratio=ratio(hits), cpu_hit_ratio=ratio(r.cpu_hits),
        disk_hit_ratio=ratio(r.disk_hits),
        stores=stats["stores"], evictions=stats["evictions"],
        promotions=cstats["promotions"], promotion_failures=cstats["promotion_failures"],
        disk_writes=cstats["cascade_writes"],
        duplicate_writes_skipped=cstats["duplicate_writes_skipped"],
        writes_not_admitted=cstats["writes_not_admitted"],
        dropped_writes=cstats["dropped_writes"],
        verify_failures=r.verify_failures, seconds=seconds,
    )
