"""The soak: generated traffic through the manager and a disk + Redis cascade,
sampling the memory of the process and the size of every bounded structure.

``run_soak`` drives ``requests`` requests of a :class:`~kvtier.replay.mix.TrafficMix`
(a mix of ``kvtier generate`` kinds, in bounded memory) through a real
``OffloadManager`` and ``TierCascade`` (``kvtier.replay.tiered``): a real CPU
slot region, a real ``DiskTier`` of ``disk_blocks`` blocks in a temporary
directory and a real ``RedisTier`` on a local ``redis-server`` started for the
run with ``maxmemory`` (``kvtier.tiers.redis_server``). Requests follow vLLM's
step contract one at a time (``tiered.Replayer``), but writes are not waited
for: they run on I/O threads while later requests are served, so the I/O
queues fill and drain as in an engine.

Every ``sample_every`` requests (and at the end) it takes a :class:`Sample`:
the resident set size (``/proc/self/statm``), and the entries of each
structure, flattened to dotted names: ``manager.*`` (``OffloadManager.
debug_state()``: block table, free slots, pins, leases, lease holders,
tracker, eviction history, events, and ``manager.policy.*``), ``cascade.*``
(``TierCascade.debug_state()``: use counts, failure sets, promotion and write
state, I/O queues, probes, each tier's index), ``request.*`` (the largest
request so far, and what its context kept after it finished) and ``mix.*``.
:func:`bounds` gives each structure's stated bound for a configuration, and
:func:`violations` names every sample entry above it.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, overload

import numpy as np

from kvtier.admission import DEFAULT_MAX_TRACKER_SIZE
from kvtier.events import DEFAULT_MAX_EVENTS
from kvtier.history import DEFAULT_EVICTION_HISTORY_SIZE
from kvtier.leases import DEFAULT_MAX_LEASE_HOLDERS, DEFAULT_MAX_LEASES_PER_REQUEST
from kvtier.manager import OffloadManager
from kvtier.policies import policy_class
from kvtier.policies.plfu import PLFUPolicy
from kvtier.replay.mix import DEFAULT_CHUNK, DEFAULT_KINDS, TrafficMix
from kvtier.replay.tiered import NAMESPACE, Replayer, tiered_cascade
from kvtier.replay.trace import MOONCAKE_BLOCK_TOKENS
from kvtier.request import RequestContext
from kvtier.tiers.base import Tier
from kvtier.tiers.cascade import DEFAULT_MAX_FAILED
from kvtier.tiers.probes import DEFAULT_MAX_PROBES

MAX_QUEUE = 256
"""The cascade's ``max_queue`` (its default)."""
IO_THREADS = 2
MAX_SAMPLES = 10_000
"""Samples a run may keep (``requests / sample_every``)."""
WARM_FRACTION = 0.25
"""RSS growth is measured from the sample at this share of the run to the end."""


DEFAULT_REDIS_MAXMEMORY = 64 << 20
"""The local redis-server's ``maxmemory`` in a soak (bytes)."""


@dataclass(frozen=True, slots=True)
class SoakConfig:
    """One soak run. ``write_policy`` and ``tier_store_threshold`` apply to
    both lower tiers (disk first, then Redis); ``redis_maxmemory`` bounds the
    server; ``redis=False`` leaves Redis out."""

    requests: int = 1_000_000
    cpu_blocks: int = 4_000
    disk_blocks: int = 16_000
    redis: bool = True
    redis_maxmemory: int = DEFAULT_REDIS_MAXMEMORY
    policy: str = "default"
    kinds: tuple[str, ...] = DEFAULT_KINDS
    chunk: int = DEFAULT_CHUNK
    seed: int = 0
    sample_every: int = 10_000
    store_threshold: int = 1
    tier_store_threshold: int = 2
    write_policy: str = "evict"
    max_tracker_size: int = DEFAULT_MAX_TRACKER_SIZE
    eviction_history_size: int = DEFAULT_EVICTION_HISTORY_SIZE
    max_events: int = DEFAULT_MAX_EVENTS
    max_probes: int = DEFAULT_MAX_PROBES
    max_failed: int = DEFAULT_MAX_FAILED
    slot_bytes: int = 64
    workdir: str | None = None

    def check(self) -> None:
        """``ValueError`` naming the first bad setting."""
        for name in ("requests", "cpu_blocks", "sample_every", "chunk", "store_threshold",
                     "tier_store_threshold", "max_tracker_size", "max_events", "max_probes",
                     "max_failed", "slot_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.disk_blocks < 0 or self.eviction_history_size < 0:
            raise ValueError("disk_blocks and eviction_history_size must be >= 0")
        if self.requests / self.sample_every > MAX_SAMPLES:
            raise ValueError(f"at most {MAX_SAMPLES} samples: raise sample_every to at least "
                             f"{-(-self.requests // MAX_SAMPLES)}")
        if self.write_policy not in ("store", "evict"):
            raise ValueError(f"write_policy must be store or evict, got {self.write_policy!r}")
        policy_class(self.policy)
        TrafficMix(self.kinds, self.seed, self.chunk)


@dataclass(slots=True)
class Sample:
    """The state after ``requests`` requests, ``seconds`` into the run."""

    requests: int
    seconds: float
    rss_bytes: int
    sizes: dict[str, int]
    counters: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class SampleLog(Sequence[Sample]):
    """The samples of a run, kept in columns allocated (and written, so that
    their pages are resident) before the first RSS reading: keeping a sample
    does not grow the resident set the soak measures, whose growth after
    warm-up would otherwise include its own history (a dict of every name per
    sample, about 10 KB each: 100 MB at ``MAX_SAMPLES``).

    The columns are the names of the first sample (``reserve``); a name first
    seen later is kept beside its row. Memory: ``rows`` x (names + 2) x 8
    bytes, plus the late names.
    """

    _ABSENT = np.iinfo(np.int64).min
    """A name the sample did not have (``Sample.sizes`` keeps only those it had)."""

    def __init__(self, rows: int) -> None:
        self._rows = rows
        self._len = 0
        self._size_names: tuple[str, ...] = ()
        self._counter_names: tuple[str, ...] = ()
        self._ints = np.empty((0, 0), dtype=np.int64)
        self._seconds = np.empty(0)
        self._late: dict[int, tuple[dict[str, int], dict[str, int]]] = {}

    def reserve(self, sizes: Mapping[str, int], counters: Mapping[str, int]) -> None:
        """Allocate the columns for the names of ``sizes`` and ``counters``
        (the first sample's), once."""
        if self._ints.size:
            return
        self._size_names, self._counter_names = tuple(sizes), tuple(counters)
        columns = 2 + len(self._size_names) + len(self._counter_names)
        self._ints = np.full((self._rows, columns), self._ABSENT, dtype=np.int64)
        self._seconds = np.full(self._rows, 0.0)

    def append(self, sample: Sample) -> None:
        """Keep ``sample``; ``IndexError`` past the ``rows`` reserved."""
        if self._len >= self._rows:
            raise IndexError(f"the soak's sample log holds {self._rows} samples")
        self.reserve(sample.sizes, sample.counters)
        row = self._ints[self._len]
        row[0], row[1] = sample.requests, sample.rss_bytes
        self._seconds[self._len] = sample.seconds
        late: tuple[dict[str, int], dict[str, int]] = ({}, {})
        for values, names, start, extra in (
                (sample.sizes, self._size_names, 2, late[0]),
                (sample.counters, self._counter_names, 2 + len(self._size_names), late[1])):
            for i, name in enumerate(names):
                row[start + i] = values.get(name, self._ABSENT)
            extra.update((n, v) for n, v in values.items() if n not in names)
        if late[0] or late[1]:
            self._late[self._len] = late
        self._len += 1

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> Sample: ...

    @overload
    def __getitem__(self, index: slice) -> list[Sample]: ...

    def __getitem__(self, index: int | slice) -> Sample | list[Sample]:
        if isinstance(index, slice):
            return [self._sample(i) for i in range(*index.indices(self._len))]
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError("sample index out of range")
        return self._sample(index)

    def __iter__(self) -> Iterator[Sample]:
        return (self._sample(i) for i in range(self._len))

    def _sample(self, i: int) -> Sample:
        row = self._ints[i].tolist()
        start = 2 + len(self._size_names)
        sizes = {n: v for n, v in zip(self._size_names, row[2:start], strict=True)
                 if v != self._ABSENT}
        counters = {n: v for n, v in zip(self._counter_names, row[start:], strict=True)
                    if v != self._ABSENT}
        late_sizes, late_counters = self._late.get(i, ({}, {}))
        return Sample(row[0], float(self._seconds[i]), row[1], {**sizes, **late_sizes},
                      {**counters, **late_counters})


@dataclass(slots=True)
class SoakResult:
    """The samples of a run and its bounds; :meth:`summary` sums it up."""

    config: SoakConfig
    samples: SampleLog = field(default_factory=lambda: SampleLog(0))
    bounds: dict[str, int] = field(default_factory=dict)

    def rss_growth_after_warmup(self) -> int:
        """RSS at the end minus RSS at the first sample past ``WARM_FRACTION``."""
        if not self.samples:
            return 0
        warm = next(s for s in self.samples
                    if s.requests >= self.config.requests * WARM_FRACTION)
        return self.samples[-1].rss_bytes - warm.rss_bytes

    def summary(self) -> dict[str, Any]:
        last = self.samples[-1]
        peak = peaks(self.samples, self.bounds)
        return {
            "requests": last.requests, "seconds": round(last.seconds, 1),
            "requests_per_s": round(last.requests / last.seconds, 1) if last.seconds else 0.0,
            "rss_mib_start": round(self.samples[0].rss_bytes / 2**20, 1),
            "rss_mib_end": round(last.rss_bytes / 2**20, 1),
            "rss_mib_peak": round(max(s.rss_bytes for s in self.samples) / 2**20, 1),
            "rss_growth_after_warmup_mib": round(self.rss_growth_after_warmup() / 2**20, 2),
            "violations": violations(self.samples, self.bounds),
            "peak_fill": {n: round(peak[n] / b, 3) for n, b in self.bounds.items() if b},
            "counters": last.counters,
        }


def sample_rows(config: SoakConfig) -> int:
    """Samples a run of ``config`` takes: at 0 requests, every ``sample_every``
    and at the end."""
    return config.requests // config.sample_every + 2


def rss_bytes() -> int:
    """This process's resident set size."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, int]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; int leaves only."""
    out: dict[str, int] = {}
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping):
            out.update(flatten(value, key + "."))
        elif isinstance(value, int) and not isinstance(value, bool):
            out[key] = value
    return out


def bounds(config: SoakConfig, longest_request: int) -> dict[str, int]:
    """Each sampled structure's stated bound (docstrings of the owners) for
    ``config``, where a request has at most ``longest_request`` blocks."""
    cpu, disk = config.cpu_blocks, config.disk_blocks
    jobs = 2 * MAX_QUEUE + IO_THREADS
    out = {f"manager.{n}": cpu for n in (
        "table", "free", "writing", "pinned", "leased", "reserved", "internal_pins",
        "unevictable", "policy_size", "held_back")}
    out.update({
        "manager.tracker_size": config.max_tracker_size,
        "manager.history_size": config.eviction_history_size,
        "manager.lease_holders": DEFAULT_MAX_LEASE_HOLDERS + 1,
        "manager.leases_held": (DEFAULT_MAX_LEASE_HOLDERS + 1) * DEFAULT_MAX_LEASES_PER_REQUEST,
        "manager.events": config.max_events,
        "cascade.uses": config.max_tracker_size,
        "cascade.due": cpu, "cascade.batched_promotions": cpu,
        "cascade.in_flight_promotions": cpu,
        "cascade.failed": config.max_failed, "cascade.sources": config.max_failed,
        "cascade.evicted_jobs": MAX_QUEUE,
        "cascade.queued_reads": MAX_QUEUE, "cascade.queued_writes": MAX_QUEUE,
        "cascade.done": 2 * jobs, "cascade.writes_in_flight": 3 * jobs,
        "cascade.probe_jobs": 3 * jobs, "cascade.running_promotions": 3 * jobs,
        "request.leftover": 0,
        "mix.chunks": len(config.kinds),
    })
    if disk:
        out.update({"cascade.tiers.disk.index": disk, "cascade.tiers.disk.pending": IO_THREADS,
                    "cascade.tiers.disk.scan_added": 0, "cascade.tiers.disk.scan_removed": 0,
                    "cascade.tiers.disk.events": 0})
    if config.redis:
        out.update({"cascade.probes.redis.known": config.max_probes,
                    "cascade.probes.redis.batch": config.max_probes,
                    "cascade.tiers.redis.events": 0})
    out.update(_policy_bounds(config.policy, cpu, longest_request))
    return out


def _policy_bounds(name: str, cpu: int, longest: int) -> dict[str, int]:
    """The policy's ``sizes()`` bounds (see each policy's docstring)."""
    cls = policy_class(name)
    if issubclass(cls, PLFUPolicy):
        bounds = cls(cpu).size_bounds(longest)
        return {f"manager.policy.{k}": v for k, v in bounds.items()}
    if cls.name == "arc":
        return {f"manager.policy.{n}": cpu for n in ("t1", "t2", "b1", "b2")}
    return {"manager.policy.resident": cpu}


def peaks(samples: Sequence[Sample], names: Iterable[str]) -> dict[str, int]:
    """The largest value of each of ``names`` over ``samples`` (0 when never sampled),
    in one pass over the samples."""
    out = dict.fromkeys(names, 0)
    for sample in samples:
        for name, peak in out.items():
            value = sample.sizes.get(name, 0)
            if value > peak:
                out[name] = value
    return out


def violations(samples: Sequence[Sample], limits: Mapping[str, int]) -> list[str]:
    """``"name=value > bound at N requests"`` for each entry above its bound
    (the first time only)."""
    out: list[str] = []
    seen: set[str] = set()
    for sample in samples:
        for name, bound in limits.items():
            value = sample.sizes.get(name, 0)
            if value > bound and name not in seen:
                seen.add(name)
                out.append(f"{name}={value} > {bound} at {sample.requests} requests")
    return out


class _Run:
    """The soak's moving parts for one run (see the module docstring)."""

    def __init__(self, config: SoakConfig, replayer: Replayer, mix: TrafficMix,
                 log: SampleLog) -> None:
        self.config = config
        self.log = log
        self.replayer = replayer
        self.mix = mix
        self.longest = 0
        self.leftover = 0
        self.start = time.monotonic()

    def request(self, serial: int) -> None:
        _, keys = self.mix.next_keys()
        ctx = RequestContext(f"soak-{serial}")
        ctx.set_positions(keys, MOONCAKE_BLOCK_TOKENS, MOONCAKE_BLOCK_TOKENS)
        self.replayer.request(keys, ctx)
        self.longest = max(self.longest, len(keys))
        # what a finished request's context still holds (cleared at finish)
        self.leftover = (len(ctx.access_log) + len(ctx.inserted) + len(ctx.reused)
                         + len(ctx.counted) + len(ctx.tier_counted) + len(ctx.skipped)
                         + len(ctx.ghost_checked) + len(ctx.missed_at) + len(ctx.leased)
                         + len(ctx.positions))

    def sample(self, served: int) -> Sample:
        cascade = self.replayer.cascade
        sizes = flatten({"manager": cascade.manager.debug_state(),
                         "cascade": cascade.debug_state(),
                         "request": {"longest": self.longest, "leftover": self.leftover},
                         "mix": {"chunks": self.mix.sizes()["chunks"]}})
        counters = {**cascade.manager.stats(), **cascade.stats()}
        for name, tier_stats in cascade.tier_stats().items():
            for key in ("stores", "hits", "evictions", "dropped_stores"):
                value = tier_stats.get(key)
                if isinstance(value, int):
                    counters[f"{name}.{key}"] = value
        counters["verify_failures"] = self.replayer.verify_failures
        counters["cpu_hit_blocks"] = self.replayer.cpu_hits
        counters["tier_hit_blocks"] = self.replayer.disk_hits
        self.log.reserve(sizes, counters)  # before the first RSS reading: see SampleLog
        sample = Sample(served, time.monotonic() - self.start, rss_bytes(), sizes, counters)
        self.log.append(sample)
        return sample


def run_soak(config: SoakConfig, on_sample: Callable[[Sample], None] | None = None,
             progress: Callable[[int], None] | None = None) -> SoakResult:
    """Run the soak; ``on_sample`` gets each sample as it is taken,
    ``progress`` the number of requests since its previous call."""
    config.check()
    mgr = OffloadManager(
        config.cpu_blocks, policy=config.policy, store_threshold=config.store_threshold,
        max_tracker_size=config.max_tracker_size, enable_events=True,
        eviction_history_size=config.eviction_history_size, max_events=config.max_events)
    mix = TrafficMix(config.kinds, config.seed, config.chunk)
    result = SoakResult(config, SampleLog(sample_rows(config)))
    with tempfile.TemporaryDirectory(prefix="kvtier-soak-", dir=config.workdir) as tmp:
        server, extra = _redis(config, Path(tmp))
        try:
            thresholds = [config.tier_store_threshold] * (bool(config.disk_blocks) + len(extra))
            with tiered_cascade(mgr, config.disk_blocks, config.write_policy,  # type: ignore[arg-type]
                                thresholds or 1, max_tracker_size=config.max_tracker_size,
                                slot_bytes=config.slot_bytes, workdir=tmp, extra_tiers=extra,
                                io_threads=IO_THREADS, max_queue=MAX_QUEUE,
                                max_probes=config.max_probes, max_failed=config.max_failed,
                                ) as (cascade, region):
                run = _Run(config, Replayer(cascade, region, wait_writes=False), mix,
                           result.samples)
                run.sample(0)
                last = 0
                for served in range(1, config.requests + 1):
                    run.request(served)
                    if served % config.sample_every == 0 or served == config.requests:
                        sample = run.sample(served)
                        if on_sample is not None:
                            on_sample(sample)
                        if progress is not None:
                            progress(served - last)
                        last = served
                result.bounds = bounds(config, run.longest)
        finally:
            if server is not None:
                server.close()
    return result


def _redis(config: SoakConfig, tmp: Path) -> tuple[Any, list[Tier]]:
    """A local redis-server bounded by ``redis_maxmemory`` and its tier (none
    without ``config.redis``)."""
    if not config.redis:
        return None, []
    from kvtier.tiers.redis_server import RedisServer
    from kvtier.tiers.redis_tier import RedisTier

    server = RedisServer(config={"maxmemory": str(config.redis_maxmemory),
                                 "maxmemory-policy": "allkeys-lru"})
    try:
        server.start()
        tier = RedisTier(server.url, NAMESPACE, password_env=None)
    except BaseException:
        server.close()
        raise
    return server, [tier]
