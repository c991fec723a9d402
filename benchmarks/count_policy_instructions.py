"""Instructions per offered key of each policy's replay, against LRU (needs valgrind).

Wall-clock cost on a shared machine moves by several percent between runs
(``bench_policy_cost.py``); an instruction count does not: each replay runs
once under ``valgrind --tool=cachegrind --cache-sim=no`` with a fixed hash
seed, and the count of a run that only loads the trace is subtracted. The
count leaves out what memory costs (a policy that touches more memory
pays more per instruction), so it tells whether a code change did less
work, and ``bench_policy_cost.py`` tells what the work costs in time.

    python benchmarks/count_policy_instructions.py [--policies lru,plfu,default]
        [--capacity 1000,4000,16000] [--jobs 2] [TRACE]
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

from kvtier.replay.trace import BUNDLED_TRACE

BASELINE = "lru"
LOAD_ONLY = "-"
_RUN = """
import sys
from kvtier.replay.driver import replay, trace_keys
from kvtier.replay.trace import load_trace
requests = trace_keys(load_trace(sys.argv[1]))
print(sum(map(len, requests)))
if sys.argv[2] != "-":
    replay(requests, int(sys.argv[3]), sys.argv[2])
"""
_REFS = re.compile(r"I\s+refs:\s+([\d,]+)")


def parse_refs(stderr: str) -> int:
    """The instruction count in cachegrind's summary."""
    match = _REFS.search(stderr)
    if match is None:
        raise RuntimeError(f"no 'I refs' line in valgrind's output:\n{stderr[-2000:]}")
    return int(match.group(1).replace(",", ""))


def count(trace: Path, policy: str, capacity: int) -> tuple[int, int]:
    """(instructions, offered keys) of one run of ``policy`` (``-``: load only)."""
    cmd = ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
           sys.executable, "-c", _RUN, str(trace), policy, str(capacity)]
    env = dict(os.environ, PYTHONHASHSEED="0")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return parse_refs(done.stderr), int(done.stdout.split()[0])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", type=Path, default=BUNDLED_TRACE)
    ap.add_argument("--policies", default="lru,plfu,default")
    ap.add_argument("--capacity", default="1000,4000,16000")
    ap.add_argument("--jobs", type=int, default=2, help="valgrind runs at once (default 2)")
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        ap.error("valgrind is not installed")
    policies = list(dict.fromkeys([BASELINE, *args.policies.split(",")]))
    capacities = [int(c) for c in args.capacity.split(",")]
    cells = [(LOAD_ONLY, 0)] + [(p, c) for c in capacities for p in policies]
    with ThreadPoolExecutor(max(1, args.jobs)) as pool:
        counts = dict(zip(cells, pool.map(lambda cell: count(args.trace, *cell), cells),
                          strict=True))
    base, keys = counts[LOAD_ONLY, 0]
    print(f"{'policy':10s} {'capacity':>8s} {'instr/key':>10s} {'x LRU':>6s}")
    for c in capacities:
        lru = counts[BASELINE, c][0] - base
        for p in policies:
            work = counts[p, c][0] - base
            print(f"{p:10s} {c:8d} {work / keys:10.0f} {work / lru:6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
