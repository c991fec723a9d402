"""The disk crash drill (:func:`run_disk_drill`).

N rounds on one directory. Each round starts a tier writer
(:mod:`kvtier.bench.drill_writer`: 1 MiB blocks whose bytes derive from their
keys and write numbers, as fast as it can, in its own namespace) and, with a
model, a real engine (``kvtier serve`` with a disk tier on the same directory)
that first answers the fixed prompts, then is fed distinct prompts so it
writes through continuously. After a seeded random delay both get SIGKILL (the
engine: every process of its session). Then, with nothing running,
:func:`check_directory`: ``kvtier disk verify``'s check finds no bad block; a
new :class:`~kvtier.tiers.DiskTier` per namespace indexes exactly the valid
block files and removes every temp file (all writers are dead); every block of
the writer reads back as its derived bytes, and so do the last blocks the
writer's log says were acknowledged, each at its acknowledged version (or a
later one); every engine block reads back (checksum). The next engine's start
must remove the dead engine's slot region from /dev/shm; its answers to the
fixed prompts, which from round 2 come from disk blocks earlier engines wrote,
must equal a server's without kvtier. A final engine, stopped cleanly, checks
the same once more.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.bench.drill_engine import (
    Load,
    RequestFailed,
    ask_all,
    cached_tokens,
    fixed_prompts,
    kill_session,
    remove_orphan_shm,
    serve_argv,
    session_regions,
    session_shm_files,
    settled_value,
    start_server,
    tier_metric,
)
from kvtier.bench.drill_writer import (
    WRITER_NAMESPACE,
    Write,
    WriterConfig,
    WriterMode,
    WriterProcess,
    drill_key,
    lost_writes,
    payload_matches,
    payload_version,
    read_acks,
)
from kvtier.bench.drills import (
    FIXED_MAX_TOKENS,
    READ_BATCH,
    Say,
    drill_reference,
    quiet,
    verdict,
)
from kvtier.server_process import ServerProcess, session_pids
from kvtier.tiers.disk import DiskTier
from kvtier.tools import AdminError
from kvtier.tools.disk_admin import select, verify_disk
from kvtier.tools.disk_layout import walk_namespace

ID_STRIDE = 10_000_000
"""Writer block ids of round r start at ``r * ID_STRIDE`` (fresh keys per round)."""
ACKED_CHECKED = 8
"""The writer's last acknowledged blocks each round checks are on disk."""
CHECK_CAPACITY = 1 << 50
"""Capacity of the checking DiskTier: it must index everything, evict nothing."""


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
    """Acknowledged writer blocks that are not on disk with the bytes of their
    acknowledged version (or a later one)."""
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


def check_directory(path: Path, *, block_bytes: int, acked: Sequence[Write] = (),
                    writer_namespace: str = WRITER_NAMESPACE) -> DirectoryCheck:
    """Verify ``path`` (nothing may run on it), rebuild each namespace's index,
    read every block back; ``acked``: writer stores that must be there (each
    block at its latest acknowledged version, or a later one)."""
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
        out.acked_checked = out.acked_missing = len({w.id for w in acked})
    return out


def _read_writer_blocks(tier: DiskTier, block_bytes: int, acked: Sequence[Write],
                        out: DirectoryCheck) -> None:
    keys = tier.indexed_keys()
    for start in range(0, len(keys), READ_BATCH):
        chunk = keys[start:start + READ_BATCH]
        for key, got in zip(chunk, tier.get(chunk), strict=True):
            out.writer_blocks_read += 1
            out.wrong_reads += got is None or not payload_matches(key, got, block_bytes)
    ids = sorted({w.id for w in acked})
    held: dict[int, int] = {}
    for i, got in zip(ids, tier.get([drill_key(i) for i in ids]), strict=True):
        version = None if got is None else payload_version(drill_key(i), got, block_bytes)
        if version is not None:
            held[i] = version
    out.acked_checked += len(ids)
    out.acked_missing += len(lost_writes(acked, held))


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
        if self.writer_acked <= 0:  # else every check of the writer's blocks is vacuous
            out.append(f"round {self.round}: the writer stored nothing before the kill")
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
        """Sums over the rounds (``answers_identical``: of the ``answers_checked``
        rounds; ``answers_unchecked``: rounds without an engine to ask)."""
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
            # rounds whose fixed prompts were asked (engine drills), apart from the
            # others: a round nobody asked proves nothing either way
            "answers_checked": sum(r.fixed_identical is not None for r in self.rounds),
            "answers_identical": sum(r.fixed_identical is True for r in self.rounds),
            "answers_unchecked": sum(r.fixed_identical is None for r in self.rounds),
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
                   say: Say = quiet) -> DiskDrillReport:
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
        # the requests that ended before the kill: those cut short by it are no failure
        before = load.stats() if load is not None else None
        _kill_all(writer, server, writer_first=rng.random() < 0.5)
        if load is not None:
            load.stop()
        if before is not None:
            round_.engine_requests, round_.request_errors = before.ok, before.failed
    finally:
        _kill_all(writer, server, writer_first=True)
        if load is not None:
            load.stop()
    round_.regions_after_kill = sum(p.exists() for p in mine)
    round_.vllm_shm_left, round_.vllm_shm_bytes = remove_orphan_shm(shm)
    acks = [w for _, writes in read_acks(ack_log) for w in writes]
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
