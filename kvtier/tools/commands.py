"""The ``kvtier disk`` and ``kvtier redis`` subcommands: arguments and output.

    kvtier disk inspect PATH [--namespace NS] [--json]
    kvtier disk verify PATH [--namespace NS] [--repair] [--json] [--no-progress]
    kvtier disk purge PATH [--namespace NS] [--yes]
    kvtier redis inspect URL [--scan-count N] [--json] [--no-progress]

The work is done by :mod:`kvtier.tools.disk_admin` and
:mod:`kvtier.tools.redis_admin`, imported when a command runs (building the
parser stays cheap, and redis-py is only needed by ``kvtier redis``). Their
:class:`~kvtier.tools.AdminError` becomes the CLI's ``CommandError``:
``kvtier: error: ...``, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

from kvtier.argtypes import positive_int
from kvtier.errors import PROG, CommandError
from kvtier.progress import make_progress
from kvtier.tools import AdminError
from kvtier.tools.formatting import human_age, human_bytes, plural, printable, table

if TYPE_CHECKING:
    from kvtier.tools.disk_admin import (
        BadBlock,
        DiskReport,
        NamespaceReport,
        Namespaces,
        PurgeSummary,
        VerifySummary,
    )
    from kvtier.tools.redis_admin import RedisReport

T = TypeVar("T")
_JSON_HELP = "print the report as one JSON object instead of text"


# ---------------------------------------------------------------- registration
def add_disk_parser(commands: Any) -> None:
    """Register ``kvtier disk inspect|verify|purge`` on the CLI's subparsers."""
    disk = commands.add_parser(
        "disk",
        help="inspect, verify or purge a disk tier directory",
        description="Operator tools for a disk tier directory (the disk_path of the "
        "configuration: PATH/kvtier-v1/<namespace>/...). Only kvtier's own files are "
        "read or removed.",
    )
    actions = disk.add_subparsers(dest="disk_action", metavar="ACTION", required=True)

    p = actions.add_parser("inspect", help="blocks, bytes and ages per namespace",
                           description="Report per namespace the blocks, bytes, oldest "
                           "and newest block, an age histogram (age: since the block's "
                           "last write or read) and temp files, plus totals.")
    _path_arguments(p)
    p.add_argument("--json", action="store_true", help=_JSON_HELP)
    p.set_defaults(func=cmd_disk_inspect)

    p = actions.add_parser("verify", help="check every block's header and checksum",
                           description="Read every block file and check its header and "
                           "xxh3-128 checksum. Exit status 0 when all hold, 1 when any "
                           "block is bad. With --repair, which removes the bad blocks: 0 "
                           "when every bad block found was removed, 1 when any is left "
                           "(one that could not be read, or could not be removed).")
    _path_arguments(p)
    p.add_argument("--repair", action="store_true",
                   help="remove the bad blocks and the temp files of dead writers")
    p.add_argument("--json", action="store_true",
                   help='JSON lines instead of text: one object per bad block ("type": '
                   '"bad"), then the summary ("type": "summary")')
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_disk_verify)

    p = actions.add_parser("purge", help="remove kvtier's blocks (or one namespace's)",
                           description="Remove kvtier's block files, temp files (not "
                           "those of running writers) and manifests, and its directories "
                           "once empty. Anything else in PATH is left alone. Asks first "
                           "unless --yes.")
    _path_arguments(p)
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.set_defaults(func=cmd_disk_purge)


def _path_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", type=Path, metavar="PATH", help="the disk tier's disk_path")
    p.add_argument("--namespace", default=None, metavar="NS",
                   help="only this namespace (a directory name under PATH/kvtier-v1)")


def add_redis_parser(commands: Any) -> None:
    """Register ``kvtier redis inspect`` on the CLI's subparsers."""
    red = commands.add_parser(
        "redis",
        help="inspect a Redis/Valkey tier",
        description="Operator tools for a Redis/Valkey tier. The password comes from the "
        "URL or $KVTIER_REDIS_PASSWORD and is never printed.",
    )
    actions = red.add_subparsers(dest="redis_action", metavar="ACTION", required=True)
    p = actions.add_parser("inspect", help="kvtier's namespaces, keys and value bytes",
                           description="Count kvtier's keys (kvtier:<namespace>:...) and "
                           "their value bytes (STRLEN) per namespace, with SCAN (never "
                           "KEYS, so the server keeps serving).")
    p.add_argument("url", metavar="URL",
                   help="redis://[user[:password]@]host:port/db, rediss:// (TLS) or unix://; "
                   "not Redis Cluster (redis+cluster://): inspect each shard by its own URL")
    p.add_argument("--scan-count", type=positive_int, default=1000, metavar="N",
                   help="COUNT hint of each SCAN call (default 1000)")
    p.add_argument("--json", action="store_true", help=_JSON_HELP)
    p.add_argument("--no-progress", action="store_true",
                   help="no progress counter (shown on a terminal: SCAN calls, keys found)")
    p.set_defaults(func=cmd_redis_inspect)


# ---------------------------------------------------------------- helpers
def _call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(...)``, its :class:`AdminError` raised as the CLI's ``CommandError``."""
    try:
        return fn(*args, **kwargs)
    except AdminError as exc:
        raise CommandError(str(exc)) from None


def _redis_admin() -> ModuleType:
    """:mod:`kvtier.tools.redis_admin`; ``CommandError`` without redis-py."""
    try:
        from kvtier.tools import redis_admin
    except ImportError as exc:
        if exc.name != "redis" and not (exc.name or "").startswith("redis."):
            raise
        raise CommandError("kvtier redis needs redis-py: pip install 'kvtier[redis]'") from None
    return redis_admin


# ---------------------------------------------------------------- disk inspect
def cmd_disk_inspect(args: argparse.Namespace) -> int:
    """``kvtier disk inspect``: print the report; exit 0."""
    from kvtier.tools import disk_admin  # numpy and the tiers: only when used

    report = _call(disk_admin.inspect_disk, args.path, args.namespace)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print("\n".join(format_disk_report(report)))
    return 0


def format_disk_report(report: DiskReport) -> list[str]:
    """A ``DiskReport`` as text lines: a table per namespace, totals, notes."""
    from kvtier.tools.disk_admin import AGE_BUCKETS, TMP_MAX_AGE_S

    n = len(report.namespaces)
    lines = [f"disk tier {report.path}: {plural(n, 'namespace')}"]
    if not n:
        return lines
    headers = ["namespace", "model", "blocks", "bytes", "oldest", "newest",
               *(name for name, _ in AGE_BUCKETS), "temp", "stale"]
    rows = [_inspect_row(ns, report.now) for ns in report.namespaces]
    rows.append(_inspect_row(report.total, report.now, model=""))
    lines += table(headers, rows, left=2)
    lines.append("ages: since a block file's last write or read (its mtime)")
    lines.append("temp: writes in progress; stale: temp files of dead writers or older "
                 f"than {human_age(TMP_MAX_AGE_S)}")
    if report.total.other_files:
        lines.append(f"{plural(report.total.other_files, 'other entry', 'other entries')} "
                     "in the namespace directories (not kvtier's, left alone)")
    return lines


def _inspect_row(ns: NamespaceReport, now: float, model: str | None = None) -> list[str]:
    oldest, newest = ns.age_s(now)
    return [
        ns.namespace, (ns.model or "-") if model is None else model, str(ns.blocks),
        human_bytes(ns.bytes), human_age(oldest), human_age(newest), *map(str, ns.ages),
        str(ns.temp_files), str(ns.stale_temp_files),
    ]


# ---------------------------------------------------------------- disk verify
def cmd_disk_verify(args: argparse.Namespace) -> int:
    """``kvtier disk verify``: print each bad block and a summary; exit 1 when a
    bad block is left on disk (any bad one; with ``--repair``, one it did not remove)."""
    from kvtier.tools import disk_admin

    _, selected = _call(disk_admin.select, args.path, args.namespace)
    show_bar = not args.no_progress and sys.stderr.isatty()
    progress = make_progress(_call(disk_admin.count_blocks, selected) if show_bar else 0,
                             show_bar, unit="block")
    progress.describe("verify")

    def on_bad(bad: BadBlock) -> None:
        if args.json:
            progress.write(json.dumps({"type": "bad", **bad.to_dict()}))
        else:
            progress.write(f"bad  {printable(bad.path, 4096)}: {bad.reason}"
                           + ("  (removed)" if bad.removed else ""))

    try:
        summary = _call(disk_admin.verify_disk, selected, repair=args.repair, on_bad=on_bad,
                        progress=progress.update)
    finally:
        progress.close()
    if args.json:
        print(json.dumps({"type": "summary", "path": str(args.path), **summary.to_dict()}))
    else:
        print("\n".join(format_verify_summary(summary)))
    # --repair succeeded when nothing bad is left: a cron job's repair is no failure
    return 1 if summary.bad - summary.removed else 0


def format_verify_summary(s: VerifySummary) -> list[str]:
    """A ``VerifySummary`` as text lines (the first names the number of bad blocks)."""
    where = f"{plural(s.blocks, 'block')} in {plural(s.namespaces, 'namespace')}"
    lines = [f"checked {where}: " + (f"{plural(s.bad, 'bad block')}" if s.bad else "all good")]
    if s.repair:
        lines.append(f"removed {plural(s.removed, 'bad block')} and "
                     f"{plural(s.temp_removed, 'stale temp file')}")
        failed = s.bad - s.removed - s.unreadable
        if failed:
            lines.append(f"{plural(failed, 'bad block')} could not be removed (replaced by "
                         "an engine meanwhile, or no permission)")
    else:
        wrong = s.bad - s.unreadable
        if wrong:
            lines.append(f"kvtier disk verify --repair removes {'it' if wrong == 1 else 'them'}")
        if s.stale_temp_files:
            lines.append(f"{plural(s.stale_temp_files, 'stale temp file')} (--repair removes "
                         f"{'it' if s.stale_temp_files == 1 else 'them'})")
    if s.unreadable:
        lines.append(f"{plural(s.unreadable, 'block')} could not be read and "
                     f"{'is' if s.unreadable == 1 else 'are'} kept, as engines keep "
                     f"{'it' if s.unreadable == 1 else 'them'} (the error may pass)")
    if s.vanished:
        lines.append(f"{plural(s.vanished, 'block')} removed by an engine during the check")
    return lines


# ---------------------------------------------------------------- disk purge
def cmd_disk_purge(args: argparse.Namespace) -> int:
    """``kvtier disk purge``: confirm, remove kvtier's files, print what was removed."""
    from kvtier.tools import disk_admin

    root, selected = _call(disk_admin.select, args.path, args.namespace)
    if not selected:
        print(f"nothing to purge: {root} holds no namespaces")
        return 0
    if not args.yes and not _call(_confirm_purge, root, selected):
        print(f"{PROG}: purge cancelled, nothing removed", file=sys.stderr)
        return 1
    s = disk_admin.PurgeSummary()
    try:
        _call(disk_admin.purge_disk, selected, s)
    except KeyboardInterrupt:  # blocks are gone for good: say which before exiting
        print(f"{PROG}: purge interrupted", file=sys.stderr)
        print(_purged(s, "before it was interrupted, "))
        raise
    print(_purged(s, "before it stopped, " if s.stopped else ""))
    if s.temp_in_use:
        print(f"left alone: {plural(s.temp_in_use, 'temp file')} of "
              f"{'a running writer' if s.temp_in_use == 1 else 'running writers'}")
    if s.other_files:
        print(f"left alone: {plural(s.other_files, 'entry', 'entries')} that "
              f"{'is' if s.other_files == 1 else 'are'} not kvtier's")
    if s.failed:
        print(f"{PROG}: could not remove {plural(s.failed, 'file')}: {s.first_error}",
              file=sys.stderr)
    if s.stopped is not None:  # what was removed is printed above; then the error
        raise CommandError(f"purge stopped part way: {s.stopped}")
    return 1 if s.failed else 0


def _purged(s: PurgeSummary, prefix: str) -> str:
    """The line saying what a purge removed."""
    return (f"{prefix}removed {plural(s.blocks, 'block')} ({human_bytes(s.bytes)}), "
            f"{plural(s.temp_files, 'temp file')} and {plural(s.manifests, 'manifest')} "
            f"from {plural(s.namespaces, 'namespace')}; "
            f"{plural(s.namespace_dirs_removed, 'namespace directory', 'namespace directories')}"
            " removed")


def _confirm_purge(root: Path, selected: Namespaces) -> bool:
    """Ask on the terminal; ``CommandError`` when stdin is not one."""
    from kvtier.tools.disk_admin import inspect_namespace

    if not sys.stdin.isatty():
        raise CommandError("purge removes blocks for good: pass --yes to confirm (stdin "
                           "is not a terminal, so kvtier cannot ask)")
    now = time.time()
    blocks = size = 0
    for name, ns_dir in selected:
        ns = inspect_namespace(name, ns_dir, now)
        blocks, size = blocks + ns.blocks, size + ns.bytes
    what = "all namespaces" if len(selected) > 1 else f"namespace {selected[0][0]}"
    print(f"remove {plural(blocks, 'block')} ({human_bytes(size)}) of {what} under {root}? "
          "[y/N] ", end="", file=sys.stderr, flush=True)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


# ---------------------------------------------------------------- redis inspect
def cmd_redis_inspect(args: argparse.Namespace) -> int:
    """``kvtier redis inspect``: print the report; exit 0. On a terminal a counter
    on stderr shows the SCAN going (a large database takes many calls)."""
    redis_admin = _redis_admin()
    # the number of kvtier keys is what SCAN finds out: a counter, not a bar
    progress = make_progress(None, not args.no_progress and sys.stderr.isatty(), unit="key")

    def on_page(keys: int, report: RedisReport) -> None:
        progress.describe(f"SCAN call {report.scan_calls}")
        progress.update(keys)

    try:
        report = _call(redis_admin.inspect_redis, args.url, scan_count=args.scan_count,
                       on_page=on_page)
    finally:
        progress.close()
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print("\n".join(format_redis_report(report)))
    return 0


def format_redis_report(report: RedisReport) -> list[str]:
    """A ``RedisReport`` as text lines."""
    from kvtier.tools.redis_admin import BYTES_METHOD, KEY_PREFIX, MAX_NAMESPACES

    server = report.server
    about = ", ".join(part for part in (
        f"redis {server['redis_version']}" if server.get("redis_version") else "",
        f"maxmemory {human_bytes(server['maxmemory']) if server['maxmemory'] else 'unlimited'}"
        if "maxmemory" in server else "",
        f"policy {server['maxmemory_policy']}" if server.get("maxmemory_policy") else "",
    ) if part)
    n = len(report.namespaces)
    lines = [f"redis tier {report.url}" + (f" ({about})" if about else "")
             + f": {plural(n, 'namespace')}"]
    if n:
        rows = [[ns.namespace, str(ns.keys), human_bytes(ns.value_bytes)]
                for ns in [*report.sorted_namespaces(), report.total()]]
        lines += table(["namespace", "keys", f"value bytes ({BYTES_METHOD})"], rows)
    blocks = report.total().keys + report.overflow.keys
    lines.append(f"value bytes: {BYTES_METHOD} of every value (header and payload, without "
                 "the server's per-key overhead)")
    if report.overflow.keys:
        lines.append(f"{plural(report.overflow.keys, 'more key')} "
                     f"({human_bytes(report.overflow.value_bytes)}) in namespaces found after "
                     f"the first {MAX_NAMESPACES:,}, not in the table")
    lines.append(f"SCAN MATCH {(KEY_PREFIX + b'*').decode()} COUNT {report.scan_count}: "
                 f"{plural(report.scan_calls, 'call')}; {blocks} of {report.db_keys} keys in "
                 "the database are kvtier blocks")
    if report.other_keys:
        lines.append(f"{plural(report.other_keys, 'other key')} under kvtier: "
                     "(not kvtier:<namespace>:<key> strings)")
    return lines
