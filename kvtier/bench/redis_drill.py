"""The Redis crash drill (:func:`run_redis_drill`).

One engine with a Redis tier under continuous load (pool prompts, answers
checked, and distinct ones), a writer pipelining SETs; ``redis-server`` is
SIGKILLed mid-writes and restarted on its port, first without persistence,
then with AOF (``appendfsync always``). Every request must complete (HTTP 200
within its timeout) with the reference answer; the tier's counters show the
outage (errors, the breaker open); after the restart the engine takes Redis
hits again: without persistence the server is empty (the fixed prompts miss,
are stored anew, then hit), with AOF the server holds, for every writer key,
the last version acknowledged before the kill (or a later one) and the fixed
prompts hit at once.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.bench.drill_engine import (
    Load,
    LoadStats,
    RequestFailed,
    ask_all,
    cached_tokens,
    fixed_prompts,
    pool_prompts,
    serve_argv,
    settled_value,
    start_server,
    tier_metric,
    wait_metric,
)
from kvtier.bench.drill_writer import (
    WRITER_NAMESPACE,
    WriterConfig,
    WriterProcess,
    acked_between,
    drill_key,
    lost_writes,
    payload_version,
    read_acks,
)
from kvtier.bench.drills import (
    FIXED_MAX_TOKENS,
    POOL_MAX_TOKENS,
    POOL_SEED,
    READ_BATCH,
    Reference,
    Say,
    drill_reference,
    quiet,
    verdict,
)
from kvtier.server_process import ServerProcess
from kvtier.tiers.base import Tier
from kvtier.tools import AdminError

# ================================================================ redis drill
REDIS_SOURCE = "external_unspecified"
"""vLLM's ``prompt_tokens_cached_by_source`` label for kvtier's Redis promotions."""
PERSISTENCE = ("none", "aof")


@dataclass
class RedisKill:
    """One SIGKILL of redis-server and what followed."""

    kill: int
    persistence: str
    """``none`` (no persistence: restarts empty) or ``aof`` (``appendonly yes``)."""
    delay_s: float
    """Seconds of writes between the last fixed-prompt check and the kill."""
    outage_s: float
    hits_before: int = 0
    """Fixed-prompt tokens from Redis just before the kill (their blocks were there)."""
    writer_acked: int = 0
    """Writer keys with a SET acknowledged since the last restart and before the kill."""
    writer_found: int = 0
    """Writer keys on the server, with a right value, once it was back (the
    writer paused)."""
    writer_wrong: int = 0
    """Writer values that failed the checksum or had other bytes (no version
    of their key's): not counted as found."""
    acked_lost: int = 0
    """Writer keys whose last SET acknowledged before the kill is not on the
    server after the restart: the key is missing, or holds an older version
    (each SET writes a new version; a later one than acknowledged is fine)."""
    engine_keys_before: int = 0
    engine_keys_after: int = 0
    """The engine's keys on the server just before the kill / once it was back."""
    loading_s: float = 0.0
    """Seconds the restarted server took to answer (loading its AOF)."""
    breaker_opened: bool = False
    """``vllm:kvtier_tier_available{tier="redis"}`` went to 0 during the outage."""
    breaker_closed_s: float | None = None
    """Seconds from the restart until it was 1 again (None: not within the wait)."""
    tier_errors: int = 0
    dropped_stores: int = 0
    """Increase of the tier's ``errors`` and ``dropped_stores`` over the outage."""
    hits_first: int = 0
    """Fixed-prompt tokens from Redis, first ask after the restart."""
    hits_later: int = 0
    """... once they had been stored again (``none``), or again (``aof``)."""
    fixed_identical: bool | None = None

    def failures(self) -> list[str]:
        name = f"kill {self.kill} ({self.persistence})"
        out = []
        if self.hits_before <= 0:
            out.append(f"{name}: fixed prompts not served from Redis before the kill")
        if not self.breaker_opened or self.tier_errors <= 0:
            out.append(f"{name}: outage not in the counters (breaker opened: "
                       f"{self.breaker_opened}, errors {self.tier_errors})")
        if self.breaker_closed_s is None:
            out.append(f"{name}: the tier did not come back")
        if self.writer_acked <= 0:  # else `acked_lost` 0 and `writer_found` 0 say nothing
            out.append(f"{name}: no writer SET acknowledged before the kill")
        if self.writer_wrong:
            out.append(f"{name}: {self.writer_wrong} writer values wrong")
        if self.fixed_identical is not True:
            out.append(f"{name}: answers differ from the reference")
        if self.hits_later <= 0:
            out.append(f"{name}: no Redis hits after the restart")
        if self.persistence == "none" and (self.writer_found or self.hits_first):
            out.append(f"{name}: blocks after a restart without persistence "
                       f"({self.writer_found} writer blocks, {self.hits_first} tokens)")
        if self.persistence == "aof" and (self.acked_lost or self.hits_first <= 0):
            out.append(f"{name}: {self.acked_lost} acknowledged writer blocks lost, "
                       f"{self.hits_first} fixed-prompt tokens from Redis")
        return out


@dataclass
class RedisDrillReport:
    """What :func:`run_redis_drill` found."""

    seed: int
    appendfsync: str
    kills: list[RedisKill] = field(default_factory=list)
    baseline_hits: int = 0
    load: LoadStats = field(default_factory=LoadStats)
    fixed_asks: int = 0
    fixed_failed: int = 0
    writer_acked: int = 0
    engine_corrupt: int = 0
    """Redis values the engine found corrupt (a miss, deleted or, failing that,
    kept): must be 0."""
    evicted_keys: int = 0
    """Keys the server evicted (its ``noeviction`` policy keeps this 0, so the
    survival counts are exact)."""
    engine_status: int | None = None
    leftovers: list[int] = field(default_factory=list)
    seconds: float = 0.0

    def failures(self) -> list[str]:
        out = [f for k in self.kills for f in k.failures()]
        if self.baseline_hits <= 0:
            out.append("no Redis hits before the first kill")
        if self.load.failed or self.fixed_failed:
            out.append(f"{self.load.failed + self.fixed_failed} requests failed: "
                       f"{self.load.errors}")
        if self.load.wrong:
            out.append(f"{self.load.wrong} pool answers differ from the reference")
        if self.evicted_keys:
            out.append(f"the server evicted {self.evicted_keys} keys")
        if self.engine_corrupt:
            out.append(f"the engine read {self.engine_corrupt} corrupt values")
        if self.engine_status != 0 or self.leftovers:
            out.append(f"engine exit status {self.engine_status}, leftovers {self.leftovers}")
        return out

    @property
    def ok(self) -> bool:
        return not self.failures()

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["failures"] = self.failures()
        return out

    def table(self) -> str:
        """One line per kill, then the load and the verdict."""
        lines = ["kill  persistence  delay s  outage s  hits before  writer acked  found  "
                 "wrong  lost  engine keys  load s  breaker  back s  errors  dropped  hits first  "
                 "hits later  same"]
        for k in self.kills:
            back = "-" if k.breaker_closed_s is None else f"{k.breaker_closed_s:.1f}"
            lines.append(
                f"{k.kill:>4}  {k.persistence:>11}  {k.delay_s:>7.2f}  {k.outage_s:>8.2f}  "
                f"{k.hits_before:>11}  {k.writer_acked:>12}  {k.writer_found:>5}  "
                f"{k.writer_wrong:>5}  {k.acked_lost:>4}  "
                f"{f'{k.engine_keys_before}->{k.engine_keys_after}':>11}  "
                f"{k.loading_s:>6.2f}  {'opened' if k.breaker_opened else 'NO':>7}  {back:>6}  "
                f"{k.tier_errors:>6}  {k.dropped_stores:>7}  {k.hits_first:>10}  "
                f"{k.hits_later:>10}  {'yes' if k.fixed_identical else 'NO':>4}")
        ld = self.load
        lines.append(
            f"load: {ld.requests} requests, {ld.ok} answered, {ld.failed} failed, "
            f"{ld.wrong} wrong answers; fixed prompts asked {self.fixed_asks} times "
            f"({self.fixed_failed} failed); writer: {self.writer_acked} SETs acknowledged; "
            f"{self.seconds:.0f} s")
        lines.append(verdict(self.failures()))
        return "\n".join(lines)


@dataclass(frozen=True)
class RedisDrillSettings:
    """Sizes and timings of the Redis drill."""

    delay_s: tuple[float, float] = (1.0, 3.0)
    outage_s: tuple[float, float] = (2.0, 5.0)
    cpu_bytes: int = 4 << 20
    churn_requests: int = 24
    """Load requests that push the fixed prompts out of the GPU cache and CPU tier."""
    distinct_share: float = 0.25
    load_threads: int = 2
    writer_block_bytes: int = 64 << 10
    writer_keys: int = 256
    writer_batch: int = 8
    writer_pause_s: float = 0.001
    """Between the writer's pipelines: it keeps writing without taking both cores."""
    appendfsync: str = "always"
    maxmemory: str = "1gb"
    breaker_wait_s: float = 60.0


def writer_versions(tier: Tier, ids: Iterable[int],
                    block_bytes: int) -> tuple[dict[int, int], int]:
    """The version of each writer block of ``ids`` that ``tier`` holds (a miss:
    absent), and how many values it returned were no version of their key
    (other bytes, another key's, another size)."""
    held: dict[int, int] = {}
    wrong = 0
    wanted = list(ids)
    for start in range(0, len(wanted), READ_BATCH):
        chunk = wanted[start:start + READ_BATCH]
        for i, got in zip(chunk, tier.get([drill_key(i) for i in chunk]), strict=True):
            if got is None:
                continue
            version = payload_version(drill_key(i), got, block_bytes)
            if version is None:
                wrong += 1
            else:
                held[i] = version
    return held, wrong


class _RedisRun:
    """The running parts of a Redis drill and the steps it takes with them."""

    def __init__(self, model: Path, reference: Reference, s: RedisDrillSettings,
                 work: Path, report: RedisDrillReport, rng: random.Random) -> None:
        from kvtier.tiers.redis_server import RedisServer

        self.model, self.reference, self.s, self.report, self.rng = (
            model, reference, s, report, rng)
        self.fixed = fixed_prompts()
        self.ack_log = work / "redis-acks"
        self.redis = RedisServer(config={"maxmemory": s.maxmemory,
                                         "maxmemory-policy": "noeviction"})
        self.server: ServerProcess | None = None
        self.load: Load | None = None
        self.writer: WriterProcess | None = None
        self.work = work
        self.aof = False
        self.epoch_start = 0.0

    @property
    def url(self) -> str:
        return self.server.url if self.server is not None else ""

    def start(self) -> None:
        self.redis.start()
        self.server = start_server(
            lambda port: serve_argv(self.model, port, cpu_bytes=self.s.cpu_bytes,
                                    redis_url=self.redis.url), self.work / "engine.log")
        self.load = Load(self.url, self.model, seed=self.rng.randrange(1 << 30),
                         threads=self.s.load_threads,
                         pool=pool_prompts(len(self.reference.pool), POOL_SEED),
                         pool_answers=self.reference.pool,
                         distinct_share=self.s.distinct_share, distinct_tokens=(256, 400),
                         max_tokens=POOL_MAX_TOKENS).start()
        cfg = WriterConfig("redis", self.redis.url, str(self.ack_log),
                           block_bytes=self.s.writer_block_bytes, key_space=self.s.writer_keys,
                           batch=self.s.writer_batch, pause_s=self.s.writer_pause_s)
        self.writer = WriterProcess(cfg, self.work / "redis-writer.log").start()
        self.writer.wait_writing()

    def ask_fixed(self) -> tuple[bool, int]:
        """Ask the fixed prompts with the load paused: (answers identical, tokens
        from Redis)."""
        load = self.load
        if load is None:
            return False, 0
        load.pause()
        try:
            before = settled_value(lambda: cached_tokens(self.url, REDIS_SOURCE),
                                   timeout_s=3.0)
            self.report.fixed_asks += 1
            try:
                answers = ask_all(self.url, self.model, self.fixed, FIXED_MAX_TOKENS)
            except RequestFailed:
                self.report.fixed_failed += 1
                return False, 0
            after = settled_value(lambda: cached_tokens(self.url, REDIS_SOURCE), before,
                                  timeout_s=6.0)
        finally:
            load.resume()
        return answers == self.reference.fixed, int(after - before)

    def churn(self) -> None:
        if self.load is not None:
            self.load.wait_completed(self.s.churn_requests)

    def enable_aof(self) -> None:
        """Switch the running server to AOF (``CONFIG SET``), restarts included."""
        import redis

        client = redis.Redis.from_url(self.redis.url)
        try:
            client.config_set("appendonly", "yes")
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                info = client.info("persistence")
                if (info.get("aof_enabled") == 1 and not info.get("aof_rewrite_in_progress")
                        and not info.get("aof_rewrite_scheduled")):
                    break
                time.sleep(0.1)
            client.config_set("appendfsync", self.s.appendfsync)
        finally:
            client.close()
        self.redis.config.update({"appendonly": "yes", "appendfsync": self.s.appendfsync})
        self.aof = True

    def wait_loaded(self, timeout_s: float = 60.0) -> None:
        """Wait until the restarted server answers (it refuses while loading its AOF)."""
        import redis

        client = redis.Redis.from_url(self.redis.url)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                try:
                    client.ping()
                    return
                except redis.exceptions.RedisError:
                    time.sleep(0.05)
        finally:
            client.close()

    def engine_keys(self) -> int:
        from kvtier.tools.redis_admin import inspect_redis

        try:
            report = inspect_redis(self.redis.url)
        except AdminError:
            return -1
        return sum(ns.keys for name, ns in report.namespaces.items()
                   if name != WRITER_NAMESPACE)

    def writer_blocks(self) -> tuple[dict[int, int], int]:
        """The version of each writer key on the server, and values that are wrong."""
        from kvtier.tiers.redis_tier import RedisTier

        tier = RedisTier(self.redis.url, WRITER_NAMESPACE)
        try:
            held, wrong = writer_versions(tier, range(self.s.writer_keys),
                                          self.s.writer_block_bytes)
            stats = tier.stats()
            wrong += int(stats["corrupt"]) + int(stats["corrupt_kept"])
        finally:
            tier.close()
        return held, wrong

    def kill(self, kill: RedisKill) -> None:
        """Kill the server mid-writes, keep serving through the outage, restart it."""
        url, writer = self.url, self.writer
        if self.load is None or writer is None:
            return
        self.churn()  # out of the GPU cache and the CPU tier: the next ask reads Redis
        identical, kill.hits_before = self.ask_fixed()
        self.churn()
        errors0 = tier_metric(url, "errors", "redis")
        dropped0 = tier_metric(url, "dropped_stores", "redis")
        time.sleep(kill.delay_s)
        kill.engine_keys_before = self.engine_keys()
        kill_at = time.monotonic()
        self.redis.stop(kill=True)
        writer.pause()
        kill.breaker_opened = wait_metric(url, "available", "redis", 0, kill.outage_s)
        time.sleep(max(0.0, kill.outage_s - (time.monotonic() - kill_at)))
        self.redis.start()
        restarted = time.monotonic()
        self.wait_loaded()
        kill.loading_s = round(time.monotonic() - restarted, 2)
        acked = acked_between(self.ack_log, self.epoch_start, kill_at)
        held, kill.writer_wrong = self.writer_blocks()
        kill.writer_acked, kill.writer_found = len({w.id for w in acked}), len(held)
        kill.acked_lost = len(lost_writes(acked, held))
        kill.engine_keys_after = self.engine_keys()
        writer.resume()
        if wait_metric(url, "available", "redis", 1, self.s.breaker_wait_s):
            kill.breaker_closed_s = round(time.monotonic() - restarted, 2)
        kill.tier_errors = int(tier_metric(url, "errors", "redis") - errors0)
        kill.dropped_stores = int(tier_metric(url, "dropped_stores", "redis") - dropped0)
        self.churn()
        first_same, kill.hits_first = self.ask_fixed()
        self.churn()
        later_same, kill.hits_later = self.ask_fixed()
        kill.fixed_identical = identical and first_same and later_same
        self.epoch_start = restarted

    def finish(self) -> None:
        """Stop everything; the engine cleanly."""
        import redis

        if self.writer is not None:
            self.writer.kill()
        if self.load is not None:
            self.load.stop()
            self.report.load = self.load.stats()
        self.report.writer_acked = sum(len(ids) for _, ids in read_acks(self.ack_log))
        with contextlib.suppress(redis.exceptions.RedisError):
            client = redis.Redis.from_url(self.redis.url)
            self.report.evicted_keys = int(client.info("stats").get("evicted_keys", 0))
            client.close()
        if self.server is not None:
            with contextlib.suppress(OSError):
                self.report.engine_corrupt = int(tier_metric(self.url, "corrupt", "redis")
                                                 + tier_metric(self.url, "corrupt_kept", "redis"))
            self.report.engine_status = self.server.stop()
            self.report.leftovers = list(self.server.leftovers)
        self.redis.close()


def run_redis_drill(model: Path, persistence: Sequence[str] = PERSISTENCE, *, seed: int = 0,
                    reference: Reference | None = None, work: Path | None = None,
                    settings: RedisDrillSettings | None = None,
                    say: Say = quiet) -> RedisDrillReport:
    """The Redis drill: one engine, one kill of redis-server per entry of
    ``persistence`` (``none`` entries first, then ``aof``)."""
    order = [p for p in persistence if p not in PERSISTENCE]
    if order or list(persistence) != sorted(persistence, key=PERSISTENCE.index):
        raise ValueError(f"persistence must be {PERSISTENCE[0]!r} kills, then "
                         f"{PERSISTENCE[1]!r} ones, got {list(persistence)!r}")
    s = settings or RedisDrillSettings()
    rng = random.Random(seed)
    report = RedisDrillReport(seed, s.appendfsync)
    started = time.monotonic()
    own_work = work is None
    work = Path(tempfile.mkdtemp(prefix="kvtier-drill-")) if work is None else work
    run: _RedisRun | None = None
    try:
        if reference is None:
            say("reference answers (a server without kvtier) ...")
            reference = drill_reference(model, work)
        run = _RedisRun(model, reference, s, work, report, rng)
        say("engine with a Redis tier, load and writer ...")
        run.start()
        same, _ = run.ask_fixed()
        run.churn()
        again, report.baseline_hits = run.ask_fixed()
        for i, p in enumerate(persistence, 1):
            if p == "aof" and not run.aof:
                say("switching redis-server to AOF ...")
                run.enable_aof()
            kill = RedisKill(i, p, round(rng.uniform(*s.delay_s), 3),
                             round(rng.uniform(*s.outage_s), 3))
            run.kill(kill)
            kill.fixed_identical = bool(kill.fixed_identical and same and again)
            report.kills.append(kill)
            say(f"kill {i} ({p}): {kill.writer_found} of {kill.writer_acked} acked writer "
                f"blocks back, {kill.hits_first}/{kill.hits_later} tokens from Redis after it")
    finally:
        if run is not None:
            run.finish()
        report.seconds = round(time.monotonic() - started, 1)
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
    return report
