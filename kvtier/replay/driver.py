"""Replay a trace through an ``OffloadManager`` in the Mooncake README's order.

Requests run in file order, one at a time. For each request the driver:
sets block j's end-token position to ``(j + 1) * 512``; looks up the leading
run of resident blocks (the prefix hits) and loads them; offers all its blocks
for storing and completes the stores it was granted; finishes the request.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvtier.admission import DEFAULT_MAX_TRACKER_SIZE
from kvtier.keys import block_key
from kvtier.manager import OffloadManager
from kvtier.replay.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest
from kvtier.request import RequestContext

ProgressCallback = Callable[[int], None]
"""Called with the number of requests replayed since its previous call."""

PROGRESS_EVERY = 256
"""Requests between two calls of the progress callback."""


@dataclass(frozen=True, slots=True)
class ReplayResult:
    """Figures of one replay: one policy, capacity and store threshold.

    ``hit_ratio`` is prefix-hit blocks / offered blocks; ``bytes_written`` is
    stored blocks times the block size (stored blocks when no size was given);
    ``writes_per_hit`` is stored blocks per prefix-hit block (None without
    hits), the SSD-wear price of each hit; ``us_per_key`` is manager time per
    offered key, in microseconds (0.0 for the bounds, which run no manager).
    ``driver`` is ``"sequential"`` (this module), ``"engine"``
    (``kvtier.replay.engine``, with its ``concurrency``, ``preemptions`` and
    offers abandoned after allocation-failure retries) or ``"bound"``.
    """

    policy: str
    capacity: int
    store_threshold: int
    requests: int
    offered_blocks: int
    hit_blocks: int
    hit_ratio: float
    stores: int
    evictions: int
    stores_skipped: int
    allocation_failures: int
    bytes_written: int
    us_per_key: float
    writes_per_hit: float | None = None
    driver: str = "sequential"
    concurrency: int = 1
    preemptions: int = 0
    stores_abandoned: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The fields as a JSON-ready dict, in declaration order."""
        return asdict(self)

    @classmethod
    def from_manager(
        cls,
        mgr: OffloadManager,
        requests: Sequence[list[bytes]],
        hits: int,
        seconds: float,
        block_bytes: int | None,
        **extra: Any,
    ) -> ReplayResult:
        """The figures of a finished replay of ``requests`` through ``mgr``."""
        offered = sum(map(len, requests))
        stats = mgr.stats()
        return cls(
            policy=extra.pop("policy"),
            capacity=mgr.num_blocks,
            store_threshold=mgr.store_threshold,
            requests=len(requests),
            offered_blocks=offered,
            hit_blocks=hits,
            hit_ratio=hits / offered if offered else 0.0,
            stores=stats["stores"],
            evictions=stats["evictions"],
            stores_skipped=stats["stores_skipped"],
            allocation_failures=stats["allocation_failures"],
            bytes_written=stats["stores"] * (1 if block_bytes is None else block_bytes),
            us_per_key=seconds / offered * 1e6 if offered else 0.0,
            writes_per_hit=_per_hit(stats["stores"], hits),
            **extra,
        )


def replay_manager(
    capacity: int, policy: str, store_threshold: int, max_tracker_size: int
) -> OffloadManager:
    """A manager for a replay: lease bounds raised to the whole cache.

    The bounds guard against many abandoned concurrent requests (by default
    half the cache in total); in a replay they would only cut a request's
    prefix hit short.
    """
    return OffloadManager(
        capacity, policy=policy, store_threshold=store_threshold,
        max_tracker_size=max_tracker_size,
        max_leases_per_request=capacity, max_leased_blocks=capacity,
    )


def trace_keys(requests: Iterable[TraceRequest], group: int = 0) -> list[list[bytes]]:
    """Each request's block keys, in order; equal hash ids share one key object."""
    cache: dict[int, bytes] = {}
    out: list[list[bytes]] = []
    for request in requests:
        keys = []
        for hash_id in request.hash_ids:
            key = cache.get(hash_id)
            if key is None:
                key = cache[hash_id] = block_key(hash_id, group)
            keys.append(key)
        out.append(keys)
    return out


def replay_request(mgr: OffloadManager, keys: list[bytes], ctx: RequestContext) -> int:
    """Run one request's manager calls (this module's order); return its prefix-hit blocks."""
    hits = mgr.lookup(keys, ctx)
    if hits:
        loaded = keys[:hits]
        mgr.prepare_load(loaded, ctx)
        mgr.complete_load(loaded, ctx)
    out = mgr.prepare_store(keys, ctx)
    if out is not None and out.keys_to_store:
        mgr.complete_store(out.keys_to_store, ctx)
    mgr.on_request_finished(ctx)
    return hits


def _run(
    mgr: OffloadManager, requests: Sequence[list[bytes]], progress: ProgressCallback | None
) -> tuple[int, float]:
    """Replay ``requests``; return (prefix-hit blocks, seconds spent in manager calls).

    Only the manager calls are timed: building each request's context and
    positions, and the progress callback, fall outside the clock.
    """
    clock = time.perf_counter
    hits = 0
    elapsed = 0.0
    for keys, ctx in request_contexts(requests, progress):
        start = clock()
        hits += replay_request(mgr, keys, ctx)
        elapsed += clock() - start
    return hits, elapsed


def request_contexts(
    requests: Sequence[list[bytes]], progress: ProgressCallback | None
) -> Iterator[tuple[list[bytes], RequestContext]]:
    """Each request's keys with a fresh context (trace block positions set),
    reporting progress every ``PROGRESS_EVERY`` requests and at the end."""
    pending = 0
    for i, keys in enumerate(requests):
        yield keys, request_context(i, keys)
        pending += 1
        if progress is not None and pending == PROGRESS_EVERY:
            progress(pending)
            pending = 0
    if progress is not None and pending:
        progress(pending)


def request_context(index: int, keys: list[bytes]) -> RequestContext:
    """A fresh context for request ``index`` of a replay, its trace block positions set."""
    ctx = RequestContext(f"req-{index}")
    ctx.set_positions(keys, MOONCAKE_BLOCK_TOKENS, MOONCAKE_BLOCK_TOKENS)
    return ctx


def replay(
    requests: Sequence[list[bytes]],
    capacity: int,
    policy: str = "lru",
    *,
    store_threshold: int = 1,
    max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE,
    block_bytes: int | None = None,
    progress: ProgressCallback | None = None,
) -> ReplayResult:
    """Replay ``requests`` (block keys, see ``trace_keys``) through a fresh manager.

    Requests run one at a time (lease bounds: see ``replay_manager``). Raises
    ``ValueError`` for an unknown policy or bad manager parameters.
    """
    mgr = replay_manager(capacity, policy, store_threshold, max_tracker_size)
    hits, seconds = _run(mgr, requests, progress)
    return ReplayResult.from_manager(mgr, requests, hits, seconds, block_bytes, policy=policy)


def _per_hit(stores: int, hits: int) -> float | None:
    return stores / hits if hits else None


BOUNDS = ("opt", "infinite")
"""Names of the bound rows: Belady's OPT and the infinite cache."""


def bound_results(
    requests: Sequence[list[bytes]],
    capacities: Iterable[int],
    *,
    opt: bool = True,
    infinite: bool = True,
    block_bytes: int | None = None,
) -> list[ReplayResult]:
    """The bound rows for ``requests``: OPT at each capacity, then the infinite cache.

    Block hits on the flat access sequence (``kvtier.replay.bounds``); an
    infinite cache's ``capacity`` is the number of distinct blocks (any cache
    that large reaches it). ``stores`` are blocks the bound keeps.
    """
    from kvtier.replay import bounds

    seq = bounds.flatten(requests)
    out: list[ReplayResult] = []
    rows: list[tuple[str, int, bounds.BoundResult]] = []
    if opt:
        nxt = bounds.next_uses(seq)
        rows += [("opt", c, bounds.belady(seq, c, nxt)) for c in capacities]
    if infinite:
        inf = bounds.infinite(seq)
        rows.append(("infinite", inf.stores, inf))
    for name, capacity, b in rows:
        out.append(ReplayResult(
            policy=name, capacity=capacity, store_threshold=1, requests=len(requests),
            offered_blocks=b.accesses, hit_blocks=b.hits, hit_ratio=b.hit_ratio,
            stores=b.stores, evictions=b.evictions, stores_skipped=0,
            allocation_failures=0,
            bytes_written=b.stores * (1 if block_bytes is None else block_bytes),
            us_per_key=0.0, writes_per_hit=_per_hit(b.stores, b.hits), driver="bound",
        ))
    return out
