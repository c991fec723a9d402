"""Crash drills: engines and tier writers killed with SIGKILL mid-write, and
``redis-server`` killed mid-pipeline, then the guarantees checked.

**Disk drill** (:func:`run_disk_drill`): N rounds on one directory. Each round
starts a tier writer (:mod:`kvtier.bench.drill_writer`: 1 MiB blocks whose
bytes derive from their keys, as fast as it can, in its own namespace) and,
with a model, a real engine (``kvtier serve`` with a disk tier on the same
directory) that first answers the fixed prompts, then is fed distinct prompts
so it writes through continuously. After a seeded random delay both get
SIGKILL (the engine: every process of its session). Then, with nothing
running, :func:`check_directory`: ``kvtier disk verify``'s check finds no bad
block; a new :class:`~kvtier.tiers.DiskTier` per namespace indexes exactly the
valid block files and removes every temp file (all writers are dead); every
block of the writer reads back as its derived bytes, and so do the last
blocks the writer's log says were acknowledged; every engine block reads
back (checksum). The next engine's start must remove the dead engine's slot
region from /dev/shm; its answers to the fixed prompts, which from round 2
come from disk blocks earlier engines wrote, must equal a server's without
kvtier. A final engine, stopped cleanly, checks the same once more.

**Redis drill** (:func:`run_redis_drill`): one engine with a Redis tier under
continuous load (pool prompts, answers checked, and distinct ones), a writer
pipelining SETs; ``redis-server`` is SIGKILLed mid-writes and restarted on its
port, first without persistence, then with AOF (``appendfsync always``). Every
request must complete (HTTP 200 within its timeout) with the reference answer;
the tier's counters show the outage (errors, the breaker open); after the
restart the engine takes Redis hits again: without persistence the server is
empty (the fixed prompts miss, are stored anew, then hit), with AOF every
store acknowledged before the kill is there and the fixed prompts hit at once.

Both return a report (a dataclass: ``to_dict()`` for JSON, ``table()`` for
people, ``failures()`` the broken guarantees, empty when all held).
"""

from __future__ import annotations

import contextlib
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
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
    kill_session,
    plain_argv,
    pool_prompts,
    remove_orphan_shm,
    serve_argv,
    session_regions,
    session_shm_files,
    settled_value,
    start_server,
    tier_metric,
    wait_metric,
)
from kvtier.bench.drill_writer import (
    WRITER_NAMESPACE,
    WriterConfig,
    WriterMode,
    WriterProcess,
    acked_between,
    drill_key,
    payload_matches,
    read_acks,
)
from kvtier.server_process import ServerProcess, session_pids
from kvtier.tiers.disk import DiskTier
from kvtier.tools import AdminError
from kvtier.tools.disk_admin import select, verify_disk
from kvtier.tools.disk_layout import walk_namespace

Say = Callable[[str], None]
FIXED_MAX_TOKENS = 8
POOL_MAX_TOKENS = 4
ID_STRIDE = 10_000_000
"""Writer block ids of round r start at ``r * ID_STRIDE`` (fresh keys per round)."""
ACKED_CHECKED = 8
"""The writer's last acknowledged blocks each round checks are on disk."""
CHECK_CAPACITY = 1 << 50
"""Capacity of the checking DiskTier: it must index everything, evict nothing."""
READ_BATCH = 32


def _quiet(_: str) -> None:
    return None


def verdict(failures: list[str]) -> str:
    """A report's last line: every guarantee held, or the ones that broke."""
    return "all guarantees held" if not failures else "FAILED: " + "; ".join(failures)


# ================================================================ directory check
@dataclass
class DirectoryCheck:
    """The state of a disk tier directory with no process writing to it."""

    files: int = 0
    """Block files found."""
    bad: int = 0
    """Block files ``kvtier disk verify`` rejects (header, key, length, checksum)."""
    temp_files: int = 0
    temp_of_live: int = 0
    """Temp files not stale (their writer's pid seems alive): must be 0."""
    other_files: int = 0
    indexed: int = 0
    """Blocks the new DiskTiers indexed (all namespaces)."""
    index_consistent: bool = True
    """In every namespace the index holds exactly the valid block files."""
    temp_removed: int = 0
    temp_left: int = 0
    writer_blocks_read: int = 0
    wrong_reads: int = 0
    """Writer blocks that did not read back as their derived bytes."""
    acked_checked: int = 0
    acked_missing: int = 0
    """Acknowledged writer blocks that are not on disk with their bytes."""
    engine_blocks_read: int = 0
    engine_unreadable: int = 0

    def failures(self) -> list[str]:
        """The guarantees this state breaks."""
        out = []
        if self.bad:
            out.append(f"{self.bad} bad block files")
        if not self.index_consistent:
            out.append(f"index of {self.indexed} blocks, {self.files - self.bad} valid files")
        if self.temp_of_live:
            out.append(f"{self.temp_of_live} temp files of writers that seem alive")
        if self.temp_left or self.temp_removed != self.temp_files:
            out.append(f"{self.temp_files} temp files, {self.temp_removed} removed, "
                       f"{self.temp_left} left")
        if self.other_files:
            out.append(f"{self.other_files} files that are not kvtier's")
        if self.wrong_reads:
            out.append(f"{self.wrong_reads} writer blocks read back wrong")
        if self.acked_missing:
            out.append(f"{self.acked_missing} of {self.acked_checked} acknowledged blocks lost")
        if self.engine_unreadable:
            out.append(f"{self.engine_unreadable} engine blocks unreadable")
        return out


def check_directory(path: Path, *, block_bytes: int, acked: Sequence[int] = (),
                    writer_namespace: str = WRITER_NAMESPACE) -> DirectoryCheck:
    """Verify ``path`` (nothing may run on it), rebuild each namespace's index,
    read every block back; ``acked``: writer ids that must be there."""
    out = DirectoryCheck()
    try:
        _, selected = select(path)
    except AdminError:
        selected = []
    writer_seen = False
    for name, ns_dir in selected:
        summary = verify_disk([(name, ns_dir)])
        valid = summary.blocks - summary.bad
        out.files += summary.blocks
        out.bad += summary.bad
        out.temp_files += summary.temp_files
        out.temp_of_live += summary.temp_files - summary.stale_temp_files
        out.other_files += summary.other_files
        tier = DiskTier(path, name, CHECK_CAPACITY, rescan_interval_s=None, touch_on_hit=False)
        try:
            stats = tier.stats()
            indexed = int(stats["blocks"])
            out.indexed += indexed
            out.index_consistent &= indexed == valid
            out.temp_removed += int(stats["tmp_removed"])
            if name == writer_namespace:
                writer_seen = True
                _read_writer_blocks(tier, block_bytes, acked, out)
            else:
                _read_engine_blocks(tier, out)
        finally:
            tier.close()
        out.temp_left += sum(e.kind == "temp" for e in walk_namespace(ns_dir))
    if not writer_seen:
        out.acked_checked = len(acked)
        out.acked_missing = len(acked)
    return out


def _read_writer_blocks(tier: DiskTier, block_bytes: int, acked: Sequence[int],
                        out: DirectoryCheck) -> None:
    keys = tier.indexed_keys()
    for start in range(0, len(keys), READ_BATCH):
        chunk = keys[start:start + READ_BATCH]
        for key, got in zip(chunk, tier.get(chunk), strict=True):
            out.writer_blocks_read += 1
            out.wrong_reads += got is None or not payload_matches(key, got, block_bytes)
    wanted = [drill_key(i) for i in acked]
    out.acked_checked += len(wanted)
    for key, got in zip(wanted, tier.get(wanted), strict=True):
        out.acked_missing += got is None or not payload_matches(key, got, block_bytes)


def _read_engine_blocks(tier: DiskTier, out: DirectoryCheck) -> None:
    keys = tier.indexed_keys()
    for start in range(0, len(keys), READ_BATCH):
        chunk = keys[start:start + READ_BATCH]
        got = tier.get(chunk)
        out.engine_blocks_read += len(chunk)
        out.engine_unreadable += sum(g is None for g in got)


# ================================================================ disk drill
@dataclass
class DiskRound:
    """One round of the disk drill."""

    round: int
    delay_s: float
    writer_acked: int = 0
    """Blocks the writer's log says were stored this round."""
    engine_requests: int = 0
    """Load requests the engine answered before the kill."""
    request_errors: int = 0
    """Load requests that failed before the kill."""
    engine_disk_stores: int = 0
    """Blocks the engine wrote to disk (its last /metrics before the kill)."""
    engine_corrupt: int = 0
    """Disk blocks the engine found corrupt (a miss, removed): must be 0."""
    fixed_identical: bool | None = None
    disk_tokens: int = 0
    """Prompt tokens of the fixed prompts the engine took from disk."""
    regions_after_kill: int = 0
    """The killed engine's slot regions still in /dev/shm (the reaper died too)."""
    stale_regions: int | None = None
    """Of those, left once the next engine started (kvtier removes stale ones)."""
    vllm_shm_left: int = 0
    vllm_shm_bytes: int = 0
    """Files vLLM's killed processes left in /dev/shm (``psm_*``: not kvtier's;
    the drill removes them)."""
    check: DirectoryCheck = field(default_factory=DirectoryCheck)

    def failures(self, with_engine: bool) -> list[str]:
        out = [f"round {self.round}: {f}" for f in self.check.failures()]
        if not with_engine:
            return out
        if self.fixed_identical is not True:
            out.append(f"round {self.round}: answers differ from the reference")
        if self.round > 1 and self.disk_tokens <= 0:
            out.append(f"round {self.round}: no fixed-prompt tokens from disk")
        if self.request_errors:
            out.append(f"round {self.round}: {self.request_errors} requests failed")
        if self.engine_corrupt:
            out.append(f"round {self.round}: the engine read {self.engine_corrupt} corrupt blocks")
        if self.stale_regions is None or self.stale_regions:
            out.append(f"round {self.round}: stale slot regions: {self.stale_regions}")
        return out


@dataclass
class FinalCheck:
    """A fresh engine on the drilled directory, stopped cleanly."""

    disk_tokens: int = 0
    fixed_identical: bool | None = None
    stale_regions: int = 0
    status: int | None = None
    leftovers: list[int] = field(default_factory=list)

    def failures(self) -> list[str]:
        out = []
        if self.fixed_identical is not True:
            out.append("final engine: answers differ from the reference")
        if self.disk_tokens <= 0:
            out.append("final engine: no fixed-prompt tokens from disk")
        if self.stale_regions:
            out.append(f"final engine: {self.stale_regions} stale slot regions")
        if self.status != 0 or self.leftovers:
            out.append(f"final engine: exit status {self.status}, leftovers {self.leftovers}")
        return out


@dataclass
class DiskDrillReport:
    """What :func:`run_disk_drill` found."""

    seed: int
    with_engine: bool
    writer_mode: str
    rounds: list[DiskRound] = field(default_factory=list)
    final: FinalCheck | None = None
    seconds: float = 0.0

    def failures(self) -> list[str]:
        out = [f for r in self.rounds for f in r.failures(self.with_engine)]
        if self.final is not None:
            out += self.final.failures()
        return out

    @property
    def ok(self) -> bool:
        return not self.failures()

    def totals(self) -> dict[str, Any]:
        """Sums over the rounds."""
        checks = [r.check for r in self.rounds]
        return {
            "rounds": len(self.rounds),
            "writer_blocks_acked": sum(r.writer_acked for r in self.rounds),
            "engine_disk_stores": sum(r.engine_disk_stores for r in self.rounds),
            "engine_corrupt": sum(r.engine_corrupt for r in self.rounds),
            "block_files_found": sum(c.files for c in checks),
            "bad_files": sum(c.bad for c in checks),
            "temp_files": sum(c.temp_files for c in checks),
            "temp_files_cleaned": sum(c.temp_removed for c in checks),
            "index_consistent": all(c.index_consistent for c in checks),
            "wrong_reads": sum(c.wrong_reads for c in checks),
            "acked_lost": sum(c.acked_missing for c in checks),
            "disk_tokens": sum(r.disk_tokens for r in self.rounds),
            "answers_identical": all(r.fixed_identical is not False for r in self.rounds),
            "request_errors": sum(r.request_errors for r in self.rounds),
            "regions_left_by_kills": sum(r.regions_after_kill for r in self.rounds),
            "stale_regions": sum(r.stale_regions or 0 for r in self.rounds),
            "vllm_shm_files_left": sum(r.vllm_shm_left for r in self.rounds),
            "vllm_shm_bytes_left": sum(r.vllm_shm_bytes for r in self.rounds),
        }

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["totals"] = self.totals()
        out["failures"] = self.failures()
        return out

    def table(self) -> str:
        """One line per round, then the totals and the verdict."""
        head = ("round  delay s  writer acked  engine stores  files  bad  temp  cleaned  "
                "indexed  consistent  wrong  lost  disk tok  same  regions  stale")
        lines = [head]
        for r in self.rounds:
            c = r.check
            same = "-" if r.fixed_identical is None else ("yes" if r.fixed_identical else "NO")
            stale = "-" if r.stale_regions is None else str(r.stale_regions)
            lines.append(
                f"{r.round:>5}  {r.delay_s:>7.2f}  {r.writer_acked:>12}  "
                f"{r.engine_disk_stores:>13}  {c.files:>5}  {c.bad:>3}  {c.temp_files:>4}  "
                f"{c.temp_removed:>7}  {c.indexed:>7}  "
                f"{'yes' if c.index_consistent else 'NO':>10}  {c.wrong_reads:>5}  "
                f"{c.acked_missing:>4}  {r.disk_tokens:>8}  {same:>4}  "
                f"{r.regions_after_kill:>7}  {stale:>5}")
        t = self.totals()
        lines.append(
            f"total  {t['rounds']} rounds in {self.seconds:.0f} s: {t['writer_blocks_acked']} "
            f"writer blocks acked, {t['engine_disk_stores']} engine blocks stored, "
            f"{t['block_files_found']} files checked, {t['bad_files']} bad, "
            f"{t['temp_files_cleaned']}/{t['temp_files']} temp files cleaned, "
            f"{t['wrong_reads']} wrong reads, {t['acked_lost']} acked blocks lost, "
            f"{t['engine_corrupt']} corrupt blocks read by engines")
        if t["vllm_shm_files_left"]:
            lines.append(f"killed vLLM processes left {t['vllm_shm_files_left']} files "
                         f"({t['vllm_shm_bytes_left'] / 2**20:.0f} MiB) in /dev/shm that are "
                         "not kvtier's (removed by the drill)")
        if self.final is not None:
            f = self.final
            lines.append(f"final engine: {f.disk_tokens} fixed-prompt tokens from disk, "
                         f"answers {'identical' if f.fixed_identical else 'DIFFERENT'}, "
                         f"{f.stale_regions} stale regions, exit status {f.status}")
        lines.append(verdict(self.failures()))
        return "\n".join(lines)


@dataclass(frozen=True)
class DiskDrillSettings:
    """Sizes and timings of the disk drill."""

    delay_s: tuple[float, float] = (2.0, 6.0)
    """Seconds from the start of the writes to the kill (uniform, seeded)."""
    writer_block_bytes: int = 1 << 20
    writer_capacity_bytes: int = 256 << 20
    cpu_bytes: int = 4 << 20
    disk_bytes: int = 512 << 20
    load_threads: int = 2


def _engine_round(server: ServerProcess, model: Path, fixed: Sequence[Sequence[int]],
                  reference: Sequence[str], round_: DiskRound) -> None:
    """Ask the fixed prompts first: answers and tokens from disk."""
    try:
        answers = ask_all(server.url, model, fixed, FIXED_MAX_TOKENS)
    except RequestFailed:
        round_.fixed_identical = False
        return
    round_.fixed_identical = answers == list(reference)
    above = 0.0 if round_.round > 1 else None  # from round 2 the blocks are on disk
    round_.disk_tokens = int(settled_value(lambda: cached_tokens(server.url, "disk"), above))


def run_disk_drill(directory: Path, rounds: int, *, seed: int = 0, model: Path | None = None,
                   reference: Sequence[str] | None = None, work: Path | None = None,
                   settings: DiskDrillSettings | None = None, writer_mode: WriterMode = "disk",
                   say: Say = _quiet) -> DiskDrillReport:
    """The disk drill on ``directory``; with ``model`` an engine crashes each round
    beside the writer (``reference``: the answers to :func:`fixed_prompts`,
    computed here when None). ``writer_mode="torn"`` is the negative control."""
    s = settings or DiskDrillSettings()
    rng = random.Random(seed)
    report = DiskDrillReport(seed, model is not None, writer_mode)
    started = time.monotonic()
    own_work = work is None
    work = Path(tempfile.mkdtemp(prefix="kvtier-drill-")) if work is None else work
    fixed = fixed_prompts()
    try:
        if model is not None and reference is None:
            say("reference answers (a server without kvtier) ...")
            reference = drill_reference(model, work, pool_size=0).fixed
        regions: list[Path] = []
        for r in range(1, rounds + 1):
            round_ = DiskRound(r, round(rng.uniform(*s.delay_s), 3))
            last = report.rounds[-1] if report.rounds else None
            regions = _disk_round(directory, round_, last, regions, rng, s, model, fixed,
                                  reference or [], work, writer_mode)
            report.rounds.append(round_)
            say(f"round {r}: {round_.writer_acked} writer blocks, {round_.check.files} files, "
                f"{round_.check.bad} bad, {round_.check.temp_removed} temp files cleaned"
                + (f", {round_.disk_tokens} tokens from disk" if model is not None else ""))
        if model is not None:
            say("final engine on the directory ...")
            report.final = _final_check(directory, report.rounds[-1] if report.rounds else None,
                                        regions, model, fixed, reference or [], s, work)
    finally:
        report.seconds = round(time.monotonic() - started, 1)
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
    return report


def _start_disk_engine(directory: Path, model: Path, s: DiskDrillSettings, log: Path,
                       previous: DiskRound | None, regions: Sequence[Path]
                       ) -> tuple[ServerProcess, list[Path]]:
    """Start an engine on ``directory``; record on ``previous`` how many of the dead
    engine's ``regions`` outlived this start; returns the new engine's regions."""
    server = start_server(
        lambda port: serve_argv(model, port, cpu_bytes=s.cpu_bytes, disk=directory,
                                disk_bytes=s.disk_bytes), log)
    if previous is not None:
        previous.stale_regions = sum(p.exists() for p in regions)
    return server, session_regions(_pids(server))


def _pids(server: ServerProcess) -> list[int]:
    return session_pids(server.proc.pid) if server.proc is not None else []


def _kill_all(writer: WriterProcess, server: ServerProcess | None, writer_first: bool) -> None:
    """SIGKILL the writer and the engine's session, in the order given."""
    if writer_first:
        writer.kill()
    if server is not None:
        kill_session(server)
    writer.kill()


def _disk_round(directory: Path, round_: DiskRound, previous: DiskRound | None,
                regions: Sequence[Path], rng: random.Random, s: DiskDrillSettings,
                model: Path | None, fixed: Sequence[Sequence[int]], reference: Sequence[str],
                work: Path, writer_mode: WriterMode) -> list[Path]:
    """One round; fills ``round_`` and returns the killed engine's slot regions."""
    r = round_.round
    ack_log = work / f"acks-{r}"
    cfg = WriterConfig(writer_mode, str(directory), str(ack_log),
                       block_bytes=s.writer_block_bytes, first_id=r * ID_STRIDE,
                       capacity_bytes=s.writer_capacity_bytes)
    writer = WriterProcess(cfg, work / f"writer-{r}.log")
    server: ServerProcess | None = None
    load: Load | None = None
    mine: list[Path] = []
    shm: list[Path] = []
    try:
        if model is not None:
            server, mine = _start_disk_engine(directory, model, s, work / f"engine-{r}.log",
                                              previous, regions)
            _engine_round(server, model, fixed, reference, round_)
            load = Load(server.url, model, seed=rng.randrange(1 << 30),
                        threads=s.load_threads).start()
        elif previous is not None:
            previous.stale_regions = 0
        writer.start().wait_writing()
        time.sleep(round_.delay_s)
        if server is not None:
            with contextlib.suppress(OSError):
                round_.engine_disk_stores = int(tier_metric(server.url, "stores", "disk"))
                round_.engine_corrupt = int(tier_metric(server.url, "corrupt", "disk"))
            shm = session_shm_files(_pids(server))  # what the engine maps at the kill
        kill_at = time.monotonic()
        _kill_all(writer, server, writer_first=rng.random() < 0.5)
        if load is not None:
            load.stop()
            before = load.stats(until=kill_at)
            round_.engine_requests, round_.request_errors = before.ok, before.failed
    finally:
        _kill_all(writer, server, writer_first=True)
        if load is not None:
            load.stop()
    round_.regions_after_kill = sum(p.exists() for p in mine)
    round_.vllm_shm_left, round_.vllm_shm_bytes = remove_orphan_shm(shm)
    acks = [i for _, ids in read_acks(ack_log) for i in ids]
    round_.writer_acked = len(acks)
    round_.check = check_directory(directory, block_bytes=s.writer_block_bytes,
                                   acked=acks[-ACKED_CHECKED:])
    return mine


def _final_check(directory: Path, previous: DiskRound | None, regions: Sequence[Path],
                 model: Path, fixed: Sequence[Sequence[int]], reference: Sequence[str],
                 s: DiskDrillSettings, work: Path) -> FinalCheck:
    """A fresh engine serves the fixed prompts from the drilled directory."""
    out = FinalCheck()
    server, _ = _start_disk_engine(directory, model, s, work / "engine-final.log", previous,
                                   regions)
    try:
        out.stale_regions = sum(p.exists() for p in regions)
        try:
            out.fixed_identical = ask_all(server.url, model, fixed,
                                          FIXED_MAX_TOKENS) == list(reference)
        except RequestFailed:
            out.fixed_identical = False
        out.disk_tokens = int(settled_value(lambda: cached_tokens(server.url, "disk"), 0.0))
    finally:
        out.status = server.stop()
        out.leftovers = list(server.leftovers)
    return out


# ================================================================ references
POOL_SIZE = 48
POOL_SEED = 0


@dataclass(frozen=True)
class Reference:
    """Greedy answers of a server without kvtier to the fixed and the pool prompts."""

    fixed: list[str]
    pool: list[str]


def drill_reference(model: Path, log_dir: Path, pool_size: int = POOL_SIZE) -> Reference:
    """One server without kvtier answers :func:`fixed_prompts` and the pool."""
    fixed = fixed_prompts()
    pool = pool_prompts(pool_size, POOL_SEED)
    server = start_server(lambda port: plain_argv(model, port), log_dir / "reference.log")
    try:
        return Reference(ask_all(server.url, model, fixed, FIXED_MAX_TOKENS),
                         ask_all(server.url, model, pool, POOL_MAX_TOKENS))
    finally:
        server.stop()


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
    """Writer blocks acknowledged since the last restart and before the kill."""
    writer_found: int = 0
    """Writer blocks on the server once it was back (the writer paused)."""
    writer_wrong: int = 0
    """Of those, values that failed the checksum or had other bytes."""
    acked_lost: int = 0
    """Acknowledged before the kill, missing after the restart."""
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
    """Redis values the engine found corrupt (a miss, deleted): must be 0."""
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

    def writer_blocks(self) -> tuple[set[int], int]:
        """Writer ids on the server with their bytes, and values that are wrong."""
        from kvtier.tiers.redis_tier import RedisTier

        tier = RedisTier(self.redis.url, WRITER_NAMESPACE)
        found: set[int] = set()
        wrong = 0
        try:
            ids = list(range(self.s.writer_keys))
            for start in range(0, len(ids), READ_BATCH):
                chunk = ids[start:start + READ_BATCH]
                for i, got in zip(chunk, tier.get([drill_key(i) for i in chunk]), strict=True):
                    if got is None:
                        continue
                    found.add(i)
                    wrong += not payload_matches(drill_key(i), got, self.s.writer_block_bytes)
            wrong += int(tier.stats()["corrupt"])
        finally:
            tier.close()
        return found, wrong

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
        acked = set(acked_between(self.ack_log, self.epoch_start, kill_at))
        found, kill.writer_wrong = self.writer_blocks()
        kill.writer_acked, kill.writer_found = len(acked), len(found)
        kill.acked_lost = len(acked - found)
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
                self.report.engine_corrupt = int(tier_metric(self.url, "corrupt", "redis"))
            self.report.engine_status = self.server.stop()
            self.report.leftovers = list(self.server.leftovers)
        self.redis.close()


def run_redis_drill(model: Path, persistence: Sequence[str] = PERSISTENCE, *, seed: int = 0,
                    reference: Reference | None = None, work: Path | None = None,
                    settings: RedisDrillSettings | None = None,
                    say: Say = _quiet) -> RedisDrillReport:
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
