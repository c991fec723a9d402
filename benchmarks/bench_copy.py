"""Copy bandwidth of TransferWorker (engine KV tensors <-> CPU slots).

Each case moves a batch of blocks at scattered ids between engine tensors and a
shared-memory slot region, and compares it with a plain ``torch`` ``copy_`` of
one contiguous tensor of the same total size, measured in the same run with the
same thread count (``--threads``: torch intra-op threads for the baseline and
``copy_threads`` for the worker). Both sides rotate over a working set four
times the batch, so neither copies cache-hot data. Reported: median of repeats,
ratio = worker bandwidth / baseline bandwidth.

    python benchmarks/bench_copy.py [--blocks 64] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass

# Idle OpenMP threads of the baseline's torch copy_ would otherwise spin on the
# cores the worker's copy threads need (set before torch loads OpenMP).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch

from kvtier.slots import SlotRegion, TransferWorker

MIB = 1 << 20
KIB = 1 << 10
# (label, block bytes, number of canonical tensors the block is split over)
CASES = [
    ("2MiB block, 1 tensor", 2 * MIB, 1),
    ("2MiB block, 32 x 64KiB", 2 * MIB, 32),  # 8B-class model, 16 tokens, layer-major
    ("64KiB block, 1 tensor", 64 * KIB, 1),
    ("64KiB block, 32 x 2KiB", 64 * KIB, 32),
]
ROTATE = 4


@dataclass
class Row:
    case: str
    direction: str
    batch_mib: float
    worker_gbps: float
    memcpy_gbps: float
    ratio: float


def _median_seconds(fns: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Interleave the functions ``repeats`` times after a warm-up; medians."""
    for fn in fns.values():
        for _ in range(ROTATE):  # every rotated buffer touched once
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _baseline(total: int) -> Callable[[], None]:
    src = torch.randint(-128, 128, (ROTATE * total,), dtype=torch.int8)
    dst = torch.zeros_like(src).fill_(1)  # resident pages, like the worker's
    state = {"i": 0}

    def copy() -> None:
        i = state["i"] = (state["i"] + 1) % ROTATE
        dst[i * total : (i + 1) * total].copy_(src[i * total : (i + 1) * total])

    return copy


def _worker_jobs(worker: TransferWorker, blocks: int, seed: int) -> dict[str, Callable[[], None]]:
    rng = np.random.default_rng(seed)
    pool = ROTATE * blocks
    batches = [
        (rng.permutation(pool)[:blocks], rng.permutation(pool)[:blocks]) for _ in range(ROTATE)
    ]
    state = {"i": 0, "job": 0}

    def run(direction: str) -> None:
        i = state["i"] = (state["i"] + 1) % ROTATE
        state["job"] += 1
        engine_ids, slot_ids = batches[i]
        if direction == "store":
            worker.store(state["job"], engine_ids, slot_ids)
        else:
            worker.load(state["job"], slot_ids, engine_ids)
        for result in worker.get_finished():
            if not result.success:
                raise RuntimeError(f"copy failed: {result.error}")

    return {"store": lambda: run("store"), "load": lambda: run("load")}


def bench_case(
    label: str, block_bytes: int, num_tensors: int, blocks: int, threads: int, repeats: int
) -> list[Row]:
    page = block_bytes // num_tensors
    pool = ROTATE * blocks
    tensors = [torch.randint(-128, 128, (pool, page), dtype=torch.int8) for _ in range(num_tensors)]
    total = blocks * block_bytes
    with SlotRegion.create(f"bench-{uuid.uuid4().hex[:8]}", pool, block_bytes) as region:
        worker = TransferWorker(tensors, region, copy_threads=threads)
        fns = {"memcpy": _baseline(total), **_worker_jobs(worker, blocks, seed=0)}
        secs = _median_seconds(fns, repeats)
        worker.shutdown()
    base = total / secs["memcpy"] / 1e9
    return [
        Row(
            label,
            direction,
            total / MIB,
            round(total / secs[direction] / 1e9, 2),
            round(base, 2),
            round(secs["memcpy"] / secs[direction], 3),
        )
        for direction in ("store", "load")
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64, help="blocks per batch")
    parser.add_argument("--threads", type=int, default=1, help="torch and copy threads")
    parser.add_argument("--repeats", type=int, default=21,
                        help="timed runs of each copy, the median reported "
                        "(default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [
        row
        for label, block_bytes, tensors in CASES
        for row in bench_case(label, block_bytes, tensors, args.blocks, args.threads, args.repeats)
    ]
    if args.json:
        for row in rows:
            print(json.dumps({**asdict(row), "threads": args.threads, "blocks": args.blocks}))
        return
    print(f"batch of {args.blocks} blocks, {args.threads} thread(s), median of {args.repeats}")
    print(f"{'case':<24} {'dir':<6} {'MiB':>6} {'GB/s':>7} {'memcpy':>7} {'ratio':>6}")
    for r in rows:
        print(
            f"{r.case:<24} {r.direction:<6} {r.batch_mib:>6.0f} {r.worker_gbps:>7.2f} "
            f"{r.memcpy_gbps:>7.2f} {r.ratio:>6.2f}"
        )


if __name__ == "__main__":
    main()
