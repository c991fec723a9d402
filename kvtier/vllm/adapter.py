"""kvtier's manager behind vLLM's ``OffloadingManager`` interface."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

from vllm.v1.kv_offload.base import (
    Locality,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.base import (
    LookupResult as VllmLookupResult,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.manager import OffloadManager
from kvtier.replay.recorder import TraceRecorder
from kvtier.request import RequestContext
from kvtier.results import LookupResult
from kvtier.tiers.cascade import TierCascade
from kvtier.vllm.metrics import fill_stats

_LOCALITY = {"DISK": Locality.LOCAL, "REDIS": Locality.REMOTE}
"""Where a lower tier's blocks live, by event medium (the tier's name upper-cased)."""

_HIT_SOURCE = {"disk": CacheHitSource.DISK}
"""vLLM's hit source of a block promoted from a tier, by tier name (others:
``EXTERNAL_UNSPECIFIED``, vLLM has no member for a shared remote store; it is
also vLLM's answer for a source not known)."""


MAX_ALLOCATION_SAMPLES = 4096
"""Store offers whose sizes are kept between two stats reports (the rest are
not sampled: vLLM reports every step, so this only bounds a stalled logger)."""


class _Promoted:
    """Keys a request waited on a promotion for, each with the tier it came
    from once known (None until then): its per-request state in vLLM's
    ``ReqContext``, bounded by the request's blocks."""

    __slots__ = ("keys",)

    def __init__(self) -> None:
        self.keys: dict[bytes, str | None] = {}


class _Arrival:
    """When a request reached the scheduler (the trace recorder's clock, ms):
    its per-request state in vLLM's ``ReqContext`` while a trace is recorded."""

    __slots__ = ("ms",)

    def __init__(self, ms: float) -> None:
        self.ms = ms


_LOOKUP = {
    LookupResult.MISS: VllmLookupResult.MISS,
    LookupResult.HIT: VllmLookupResult.HIT,
    LookupResult.HIT_PENDING: VllmLookupResult.HIT_PENDING,
    LookupResult.RETRY: VllmLookupResult.RETRY,
}


class KVTierOffloadingManager(OffloadingManager):
    """Speaks vLLM's scheduler-side protocol over one ``kvtier.OffloadManager``.

    Owns nothing but the manager and the last stats snapshot: each vLLM
    ``ReqContext`` carries its kvtier ``RequestContext`` in its per-request
    state, sharing vLLM's end-token positions, so it lives and dies with the
    request. With a ``TierCascade`` (disk/Redis tiers configured), lookups,
    offers, completed stores, finishes, step ends, events, resets and shutdown
    go through it; its tiers' events are reported as ``Medium.STORAGE``.
    With a ``TraceRecorder`` (``trace_path`` in the config), each finished
    request's keys are written to its trace; ``shutdown`` closes it.
    """

    def __init__(self, manager: OffloadManager, cascade: TierCascade | None = None,
                 recorder: TraceRecorder | None = None) -> None:
        self.manager = manager
        self.cascade = cascade
        self.recorder = recorder
        self._reported: dict[str, int] = {}
        self._allocation_sizes: list[int] = []
        """Slots granted per store offer since the last ``get_stats`` (vLLM
        calls it every step; at most ``MAX_ALLOCATION_SAMPLES`` kept)."""

    @staticmethod
    def context(req_context: ReqContext) -> RequestContext:
        """The kvtier context of a vLLM request, created on first use."""
        ctx = req_context.get_state(RequestContext)
        if ctx is None:
            ctx = RequestContext(req_context.req_id)
            positions = getattr(req_context, "_offload_key_positions", None)
            if isinstance(positions, dict):
                ctx.positions = positions  # vLLM's scheduler records them there
            req_context.set_state(ctx)
        return ctx

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self.context(req_context)
        if self.recorder is not None:
            req_context.set_state(_Arrival(self.recorder.arrive()))
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> VllmLookupResult:
        ctx = self.context(req_context)
        cascade = self.cascade
        if cascade is None:
            return _LOOKUP[self.manager.lookup_one(key, ctx)]
        result = cascade.lookup_one(key, ctx)
        if result is LookupResult.HIT_PENDING and cascade.is_promoting(key):
            promoted = req_context.get_state(_Promoted)
            if promoted is None:
                promoted = _Promoted()
                req_context.set_state(promoted)
            promoted.keys[key] = None  # a new promotion: its tier is learned at the HIT
        elif result is LookupResult.HIT:
            promoted = req_context.get_state(_Promoted)
            if promoted is not None and key in promoted.keys and promoted.keys[key] is None:
                # now, while the cascade remembers it (the promotion was just
                # applied); vLLM asks for the source later in the step
                promoted.keys[key] = cascade.source_of(key)
        return _LOOKUP[result]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        """HOST for a block found in CPU; the lower tier's source for one this
        request waited on a promotion for. When that tier is not known (the
        cascade's bounded memory of sources dropped it before the request saw
        its hit): the only lower tier, if there is one, else vLLM's "not
        known" (``EXTERNAL_UNSPECIFIED``)."""
        promoted = req_context.get_state(_Promoted)
        cascade = self.cascade
        if cascade is None or promoted is None or key not in promoted.keys:
            return CacheHitSource.HOST
        tier = promoted.keys[key] or cascade.source_of(key)
        if tier is None and len(cascade.tiers) == 1:
            tier = cascade.tiers[0].name
        return _HIT_SOURCE.get(tier or "", CacheHitSource.EXTERNAL_UNSPECIFIED)

    def prepare_load(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> CPULoadStoreSpec:
        spec = self.manager.prepare_load(list(keys), self.context(req_context))
        return CPULoadStoreSpec(spec.block_ids)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.manager.touch(list(keys), self.context(req_context))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.manager.complete_load(list(keys), self.context(req_context))

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        ctx = self.context(req_context)
        if self.cascade is not None:
            out = self.cascade.prepare_store(list(keys), ctx)
        else:
            out = self.manager.prepare_store(list(keys), ctx)
        if out is None:
            return None
        if out.keys_to_store and len(self._allocation_sizes) < MAX_ALLOCATION_SAMPLES:
            self._allocation_sizes.append(len(out.keys_to_store))
        return PrepareStoreOutput(
            keys_to_store=[OffloadKey(k) for k in out.keys_to_store],
            store_spec=CPULoadStoreSpec(out.block_ids),
            evicted_keys=[OffloadKey(k) for k in out.evicted_keys],
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        ctx = self.context(req_context)
        if self.cascade is not None:
            self.cascade.complete_store(list(keys), ctx, success=success)
        else:
            self.manager.complete_store(list(keys), ctx, success=success)

    def on_request_finished(self, req_context: ReqContext) -> None:
        ctx = self.context(req_context)
        if self.recorder is not None:  # first: a finish may reset the context
            arrival = req_context.get_state(_Arrival)
            self.recorder.record(self.recorder.now_ms() if arrival is None else arrival.ms,
                                 ctx.positions.items())
        if self.cascade is not None:
            self.cascade.on_request_finished(ctx)
        else:
            self.manager.on_request_finished(ctx)

    def take_events(self) -> Iterable[OffloadingEvent]:
        events = self.manager.take_events()
        if self.cascade is not None:
            events.extend(self.cascade.take_events())
        for event in events:
            primary = event.medium == "CPU"
            yield OffloadingEvent(
                keys=[OffloadKey(k) for k in event.keys],
                medium=Medium.CPU if primary else Medium.STORAGE,
                removed=event.kind == "removed",
                locality=None if primary else _LOCALITY.get(event.medium, Locality.LOCAL),
                ownership=None if primary else event.medium.lower(),
            )

    def get_stats(self) -> Any:
        stats = self.manager.stats()
        tiers = None
        if self.cascade is not None:
            stats.update(self.cascade.stats())
            tiers = self.cascade.tier_stats()
        if self.recorder is not None:
            stats["trace_recorded"] = self.recorder.recorded
            stats["trace_dropped"] = self.recorder.dropped
        return fill_stats(stats, self.manager.num_blocks, self._reported, tiers,
                          self._allocation_sizes, self.manager.store_threshold)

    def on_schedule_end(self, context: Any) -> None:
        if self.cascade is not None:
            self.cascade.on_schedule_end()

    def has_pending_work(self) -> bool:
        """Whether the cascade has I/O to submit or to apply (a write, a
        write-on-evict copy, a promotion or a probe batched, queued or
        running). vLLM's engine keeps stepping while this holds, so the
        cascade's ``on_schedule_end`` runs after the last request too: without
        it, an idle server never submitted the last step's write-on-evict
        copies (a shutdown then dropped them) and kept finished writes' pins.
        A tier call that hangs keeps the engine stepping, idle, until it
        returns, as vLLM's own tiering manager does for its transfers."""
        return self.cascade is not None and self.cascade.busy()

    def reset_cache(self) -> None:
        # vLLM drops the completions of jobs from before the reset ("stale
        # jobs") and re-offers running requests' blocks from their start
        if self.cascade is not None:
            self.cascade.reset(owed_completions=False)
        else:
            self.manager.reset(owed_completions=False)

    def shutdown(self) -> None:
        if self.cascade is not None:
            self.cascade.shutdown()
        if self.recorder is not None:
            self.recorder.close()
