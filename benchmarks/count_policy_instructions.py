"""Instructions (and L2 misses) per offered key of each policy's replay,
against LRU (needs valgrind).

Wall-clock cost on a shared machine moves by several percent between runs
(``bench_policy_cost.py``); an instruction count does not: each replay runs
once under ``valgrind --tool=cachegrind`` with a fixed hash seed, and the
count of a run that only loads the trace is subtracted. Instructions leave
out what memory costs (a policy that touches more memory pays more per
instruction); ``--l2-kib N`` also simulates the data caches (a 48 KiB,
12-way L1 and an N KiB, 16-way L2 as the last level, 64-byte lines;
several times slower) and counts the data reads and writes that miss the
L2, each of which waits on the next level. Together they tell whether a
code change did less work and touched less memory; ``bench_policy_cost.py``
tells what that costs in time. The count stops where the replay ends (the
child leaves with ``os._exit``): freeing a policy's tables and the last
collection at exit are not counted. ``--keep DIR`` keeps each run's cachegrind
file there (``POLICY-CAPACITY.cg``), for ``cg_annotate`` to break the
counts down by C function.

    python benchmarks/count_policy_instructions.py [--policies lru,plfu,default]
        [--capacity 1000,4000,16000] [--l2-kib 2048] [--keep DIR] [--jobs 2] [TRACE]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from kvtier.argtypes import int_list, non_negative_int, policy_list, positive_int
from kvtier.replay.trace import BUNDLED_TRACE

BASELINE = "lru"
LOAD_ONLY = "-"
_RUN = ("import os, sys; from kvtier.admission import DEFAULT_MAX_TRACKER_SIZE as T; "
        "from kvtier.replay.driver import replay_manager, replay_request, request_contexts, "
        "trace_keys; from kvtier.replay.trace import load_trace; "
        "requests = trace_keys(load_trace(sys.argv[1])); "
        "print(sum(map(len, requests)), flush=True); "
        "mgr = None if sys.argv[2] == '-' else "
        "replay_manager(int(sys.argv[3]), sys.argv[2], 1, T); "
        "mgr is None or sum(replay_request(mgr, k, ctx) "
        "for k, ctx in request_contexts(requests, None)); "
        "os._exit(0)")
"""The child's program: one line, since cachegrind's file records the command
line and ``cg_annotate`` reads only a one-line one. It ends with
``os._exit`` while the manager is still referenced: a server's manager lives
as long as the server, so freeing the policy's tables and the interpreter's
last collection at exit (which grow with the policy's memory) are no part
of its cost per key."""
_REFS = re.compile(r"I\s+refs:\s+([\d,]+)")
_L2_MISSES = re.compile(r"LLd\s+misses:\s+([\d,]+)")
L1D = "49152,12,64"
"""Simulated L1 data cache (bytes, ways, line bytes) under ``--l2-kib``."""


class Counts(NamedTuple):
    """What one valgrind run counted."""

    instructions: int
    l2_misses: int  # data reads and writes that missed the simulated L2; 0 without it
    keys: int  # offered keys of the trace


def parse_refs(stderr: str) -> int:
    """The instruction count in cachegrind's summary."""
    return _parse(_REFS, "I refs", stderr)


def parse_l2_misses(stderr: str) -> int:
    """The last-level data misses in cachegrind's summary (here: the L2's)."""
    return _parse(_L2_MISSES, "LLd misses", stderr)


def _parse(pattern: re.Pattern[str], name: str, stderr: str) -> int:
    match = pattern.search(stderr)
    if match is None:
        raise RuntimeError(f"no '{name}' line in valgrind's output:\n{stderr[-2000:]}")
    return int(match.group(1).replace(",", ""))


def l2_geometry(kib: int) -> str:
    """Cachegrind's ``--LL`` value for a 16-way L2 of ``kib`` KiB (a power of two)."""
    if kib < 64 or kib & (kib - 1):
        raise ValueError(f"--l2-kib must be a power of two >= 64, got {kib}")
    return f"{kib * 1024},16,64"


def count(trace: Path, policy: str, capacity: int, l2_kib: int = 0,
          keep: Path | None = None) -> Counts:
    """What one run of ``policy`` (``-``: load only) costs; caches simulated
    when ``l2_kib`` is set, cachegrind's file kept in ``keep`` when given."""
    sim = ["--cache-sim=no"] if not l2_kib else [
        "--cache-sim=yes", "--I1=32768,8,64", f"--D1={L1D}", f"--LL={l2_geometry(l2_kib)}"]
    name = "load-only" if policy == LOAD_ONLY else f"{policy.replace(':', '.')}-{capacity}"
    out = keep / f"{name}.cg" if keep is not None else "/dev/null"
    cmd = ["valgrind", "--tool=cachegrind", *sim, f"--cachegrind-out-file={out}",
           sys.executable, "-c", _RUN, str(trace), policy, str(capacity)]
    env = dict(os.environ, PYTHONHASHSEED="0")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    misses = parse_l2_misses(done.stderr) if l2_kib else 0
    return Counts(parse_refs(done.stderr), misses, int(done.stdout.split()[0]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", type=Path, default=BUNDLED_TRACE,
                    help="Mooncake trace (default: the bundled conversation trace)")
    ap.add_argument("--policies", type=policy_list, default="lru,plfu,default",
                    help="eviction policies, comma-separated; lru is always counted "
                    "(default %(default)s)")
    ap.add_argument("--capacity", type=int_list, default="1000,4000,16000",
                    help="cache sizes in blocks, comma-separated (default %(default)s)")
    ap.add_argument("--l2-kib", type=non_negative_int, default=0,
                    help="also simulate an L2 of this many KiB and count its misses")
    ap.add_argument("--keep", type=Path, metavar="DIR",
                    help="keep each run's cachegrind file in DIR (for cg_annotate)")
    ap.add_argument("--jobs", type=positive_int, default=2,
                    help="valgrind runs at once (default 2)")
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        ap.error("valgrind is not installed")
    if args.l2_kib:
        try:
            l2_geometry(args.l2_kib)
        except ValueError as exc:
            ap.error(str(exc))
    if args.keep is not None:
        if args.keep.exists() and not args.keep.is_dir():
            ap.error(f"--keep: {args.keep} exists and is not a directory")
        args.keep.mkdir(parents=True, exist_ok=True)
    policies = list(dict.fromkeys([BASELINE, *args.policies]))
    capacities: list[int] = args.capacity
    cells = [(LOAD_ONLY, 0)] + [(p, c) for c in capacities for p in policies]
    with ThreadPoolExecutor(args.jobs) as pool:
        runs = pool.map(
            lambda cell: count(args.trace, cell[0], cell[1], args.l2_kib, args.keep), cells)
        counts = dict(zip(cells, runs, strict=True))
    print_table(counts, policies, capacities, bool(args.l2_kib))
    return 0


def print_table(counts: dict[tuple[str, int], Counts], policies: list[str],
                capacities: list[int], l2: bool) -> None:
    """Per key and against LRU at the same capacity, the load-only run subtracted."""
    base = counts[LOAD_ONLY, 0]
    keys = base.keys
    head = f"{'policy':10s} {'capacity':>8s} {'instr/key':>10s} {'x LRU':>6s}"
    print(head + (f" {'L2 miss/key':>11s} {'x LRU':>6s}" if l2 else ""))
    for c in capacities:
        lru = counts[BASELINE, c]
        for p in policies:
            run = counts[p, c]
            work = run.instructions - base.instructions
            line = (f"{p:10s} {c:8d} {work / keys:10.0f} "
                    f"{work / (lru.instructions - base.instructions):6.3f}")
            if l2:
                misses = run.l2_misses - base.l2_misses
                line += (f" {misses / keys:11.2f} "
                         f"{misses / max(1, lru.l2_misses - base.l2_misses):6.3f}")
            print(line)


if __name__ == "__main__":
    sys.exit(main())
