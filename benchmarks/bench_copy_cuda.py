"""Copy bandwidth of TransferWorker's CUDA path (GPU KV tensors <-> CPU slots).

Each case moves a batch of blocks between GPU tensors (scattered block ids)
and a shared-memory slot region, the way an engine's offloading worker does,
with the batch's slot ids either ``scattered`` (one run per block, as after
churn) or ``consecutive`` (one run). It is compared with one contiguous
``copy_`` of the same bytes between a GPU tensor and pinned host memory (the
link's practical peak), interleaved in the same run. Worker variants:
``memcpy`` and ``mapped`` (``cuda_copy``, see ``kvtier.slots.cuda``) over a
pinned region, and ``pageable`` (memcpy with the region's registration
skipped, to show what pinning buys). Every side rotates over a working set four
times the batch. Reported per direction, medians of ``--repeats``:

* GB/s: bytes / (submit -> results seen by the host);
* ratio: the variant's bandwidth / the contiguous copy's;
* submit us: host time ``store``/``load`` take to queue the job, what the
  engine's thread pays (the copy itself runs on the worker's own stream).

``--interference`` also times bf16 matrix products queued on the engine's
stream while one batch of 2 MiB blocks is copied, per mode: the mapped mode
copies with kernels, which take SM time from the engine's work.

    python benchmarks/bench_copy_cuda.py [--blocks 64] [--repeats 21] [--interference] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from functools import partial
from typing import Any
from unittest import mock

import numpy as np
import torch
from bench_copy import CASES, MIB, ROTATE, _median_seconds

from kvtier.slots import SlotRegion, TransferWorker

SHM = "/dev/shm"
LAYOUTS = ("scattered", "consecutive")
VARIANTS = ("memcpy", "mapped", "pageable")
DIRECTIONS = ("store", "load")


@contextmanager
def _region(slots: int, slot_bytes: int) -> Iterator[SlotRegion]:
    """A slot region in /dev/shm, or in a temporary directory when /dev/shm
    has too little room (a container's default 64 MiB, say)."""
    name = f"bench-{uuid.uuid4().hex[:8]}"
    if shutil.disk_usage(SHM).free >= 2 * slots * slot_bytes:
        with SlotRegion.create(name, slots, slot_bytes) as r:
            yield r
        return
    with tempfile.TemporaryDirectory() as tmp, SlotRegion.create(
        name, slots, slot_bytes, shm_dir=tmp
    ) as r:
        yield r


def _worker(tensors: list[torch.Tensor], region: SlotRegion, variant: str) -> TransferWorker:
    if variant == "pageable":
        with mock.patch("kvtier.slots.cuda.host_register", return_value=None):
            return TransferWorker(tensors, region, cuda_copy="memcpy")
    return TransferWorker(tensors, region, cuda_copy=variant)  # type: ignore[arg-type]


class WorkerRun:
    """One worker's jobs over rotating batches, timed per call."""

    def __init__(self, worker: TransferWorker, blocks: int, layout: str, seed: int) -> None:
        rng = np.random.default_rng(seed)
        pool = ROTATE * blocks
        self.worker = worker
        self.batches = []
        for i in range(ROTATE):
            slots = rng.permutation(pool)[:blocks] if layout == "scattered" else (
                np.arange(i * blocks, (i + 1) * blocks))
            self.batches.append((rng.permutation(pool)[:blocks], slots))
        self.job = 0
        self.submit_s: dict[str, list[float]] = {d: [] for d in DIRECTIONS}

    def submit(self, direction: str) -> int:
        self.job += 1
        engine_ids, slot_ids = self.batches[self.job % ROTATE]
        start = time.perf_counter()
        if direction == "store":
            self.worker.store(self.job, engine_ids, slot_ids)
        else:
            self.worker.load(self.job, slot_ids, engine_ids)
        self.submit_s[direction].append(time.perf_counter() - start)
        return self.job

    def finish(self, job: int) -> float | None:
        """Wait for ``job``; the copy stream's own time for it, in seconds."""
        self.worker.wait({job})
        seconds = None
        for result in self.worker.get_finished():
            if not result.success:
                raise RuntimeError(f"copy failed: {result.error}")
            seconds = result.seconds
        return seconds

    def run(self, direction: str) -> None:
        self.finish(self.submit(direction))


def _baseline(total: int) -> dict[str, Callable[[], None]]:
    gpu = torch.randint(-128, 128, (ROTATE * total,), dtype=torch.int8, device="cuda")
    host = torch.ones(ROTATE * total, dtype=torch.int8).pin_memory()
    state = {"i": 0}

    def copy(direction: str) -> None:
        i = state["i"] = (state["i"] + 1) % ROTATE
        part = slice(i * total, (i + 1) * total)
        if direction == "store":
            host[part].copy_(gpu[part], non_blocking=True)
        else:
            gpu[part].copy_(host[part], non_blocking=True)
        torch.cuda.synchronize()

    return {f"peak-{d}": partial(copy, d) for d in DIRECTIONS}


@contextmanager
def _runs(block_bytes: int, num_tensors: int, blocks: int, layout: str
          ) -> Iterator[dict[str, WorkerRun]]:
    """One WorkerRun per variant, each over its own region: a registration
    pins the memory for every worker using it."""
    pool = ROTATE * blocks
    page = block_bytes // num_tensors
    tensors = [
        torch.randint(-128, 128, (pool, page), dtype=torch.int8, device="cuda")
        for _ in range(num_tensors)
    ]
    with ExitStack() as stack:
        runs = {}
        for i, variant in enumerate(VARIANTS):
            region = stack.enter_context(_region(pool, block_bytes))
            runs[variant] = WorkerRun(_worker(tensors, region, variant), blocks, layout, seed=i)
        try:
            yield runs
        finally:
            for run in runs.values():
                run.worker.shutdown()


def bench_case(label: str, block_bytes: int, num_tensors: int, blocks: int, layout: str,
               repeats: int) -> list[dict[str, Any]]:
    total = blocks * block_bytes
    with _runs(block_bytes, num_tensors, blocks, layout) as runs:
        fns: dict[str, Callable[[], None]] = dict(_baseline(total))
        for variant, run in runs.items():
            fns.update({f"{variant}-{d}": partial(run.run, d) for d in DIRECTIONS})
        secs = _median_seconds(fns, repeats)
    rows = []
    for d in DIRECTIONS:
        row: dict[str, Any] = {"case": label, "layout": layout, "direction": d,
                               "batch_mib": total / MIB,
                               "peak_gbps": round(total / secs[f"peak-{d}"] / 1e9, 2)}
        for variant, run in runs.items():
            row[f"{variant}_gbps"] = round(total / secs[f"{variant}-{d}"] / 1e9, 2)
            row[f"{variant}_ratio"] = round(secs[f"peak-{d}"] / secs[f"{variant}-{d}"], 3)
            row[f"{variant}_submit_us"] = round(statistics.median(run.submit_s[d]) * 1e6, 1)
        rows.append(row)
    return rows


def interference(blocks: int, repeats: int) -> list[dict[str, Any]]:
    """Time of 20 bf16 8192^3 matrix products on the engine's stream, alone and
    queued right after one copy job (2 MiB blocks, scattered) per mode."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def products() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            a @ a
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0

    products()
    rows = [{"copy": "none", "products_ms": round(
        statistics.median(products() for _ in range(repeats)) * 1e3, 2)}]
    with _runs(2 * MIB, 1, blocks, "scattered") as runs:
        for variant in ("memcpy", "mapped"):
            for d in DIRECTIONS:
                compute, copy = [], []
                for _ in range(repeats):
                    job = runs[variant].submit(d)
                    compute.append(products())
                    copy.append(runs[variant].finish(job) or float("nan"))
                rows.append({"copy": f"{variant}-{d}", "batch_mib": 2 * blocks,
                             "products_ms": round(statistics.median(compute) * 1e3, 2),
                             "copy_ms": round(statistics.median(copy) * 1e3, 2)})
    return rows


def _print_table(rows: list[dict[str, Any]], blocks: int, repeats: int) -> None:
    print(f"{torch.cuda.get_device_name()}: batch of {blocks} blocks, median of {repeats}; "
          "GB/s (ratio to the contiguous copy) and submit us")
    print(f"{'case':<24} {'slots':<11} {'dir':<5} {'MiB':>5} {'peak':>6} "
          + " ".join(f"{v:>22}" for v in VARIANTS))
    for r in rows:
        cells = " ".join(
            f"{r[f'{v}_gbps']:>6.2f} ({r[f'{v}_ratio']:.2f}) {r[f'{v}_submit_us']:>7.0f}"
            for v in VARIANTS
        )
        print(f"{r['case']:<24} {r['layout']:<11} {r['direction']:<5} {r['batch_mib']:>5.0f} "
              f"{r['peak_gbps']:>6.2f} {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=64, help="blocks per batch")
    parser.add_argument("--repeats", type=int, default=21,
                        help="timed runs of each copy (and of --interference's products), "
                        "the median reported (default: %(default)s)")
    parser.add_argument("--interference", action="store_true",
                        help="also time matrix products running beside a copy")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    rows = [
        row
        for layout in LAYOUTS
        for label, block_bytes, tensors in CASES
        for row in bench_case(label, block_bytes, tensors, args.blocks, layout, args.repeats)
    ]
    extra = interference(args.blocks, args.repeats) if args.interference else []
    if args.json:
        for row in rows + extra:
            print(json.dumps({**row, "blocks": args.blocks,
                              "device": torch.cuda.get_device_name()}))
        return
    _print_table(rows, args.blocks, args.repeats)
    for row in extra:
        print(row)


if __name__ == "__main__":
    main()
