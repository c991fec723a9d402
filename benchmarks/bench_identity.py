"""What fingerprinting a model's weights costs (``kvtier.identity.weights_digest``).

Writes a checkpoint of ``--gb`` GB of random bytes as ``--shards`` safetensors
files of ``--tensors`` tensors in all (a 7-8B model has about 300), then times
the fingerprint: with nothing remembered, warm (pages cached, as on a host
whose workers just loaded the weights; median of ``--repeats``) and cold
(each file's cached pages dropped first with ``posix_fadvise(DONTNEED)``);
and at a restart, the digests remembered (``kvtier.file_digests``), next to
reading every byte once, cold, without hashing.

    python benchmarks/bench_identity.py [--gb 4] [--shards 4] [--tensors 300] [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import tempfile
import time
from pathlib import Path

import numpy as np

from kvtier.file_digests import FileDigests
from kvtier.identity import weights_digest, weights_files

CHUNK = 64 << 20


def write_checkpoint(root: Path, total_bytes: int, shards: int, tensors: int) -> None:
    """``shards`` safetensors files holding ``tensors`` random uint8 tensors in all."""
    rng = np.random.default_rng(0)
    per_tensor = total_bytes // tensors
    per_shard = -(-tensors // shards)
    for shard in range(shards):
        names = [f"layer.{i}.weight" for i in range(shard * per_shard,
                                                     min(tensors, (shard + 1) * per_shard))]
        header = {n: {"dtype": "U8", "shape": [per_tensor],
                      "data_offsets": [i * per_tensor, (i + 1) * per_tensor]}
                  for i, n in enumerate(names)}
        raw = json.dumps(header).encode()
        with open(root / f"model-{shard:05d}.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            left = per_tensor * len(names)
            while left:
                n = min(CHUNK, left)
                f.write(rng.integers(0, 255, n, dtype=np.uint8).tobytes())
                left -= n


def drop_cache(root: Path) -> None:
    """Drop the checkpoint's pages from the page cache (no root needed)."""
    for path in weights_files(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_all(root: Path) -> int:
    total = 0
    for path in weights_files(root):
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(CHUNK):
                total += len(chunk)
    return total


def timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb", type=float, default=4.0,
                    help="size of the checkpoint written, GB of 10**9 bytes "
                    "(default: %(default)s)")
    ap.add_argument("--shards", type=int, default=4,
                    help="safetensors files of the checkpoint (default: %(default)s)")
    ap.add_argument("--tensors", type=int, default=300,
                    help="tensors in all, over the shards (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=5,
                    help="timings of the warm, cold and restart fingerprints, the median "
                    "reported (default: %(default)s)")
    ap.add_argument("--dir", type=Path, default=None, help="where to write (default: a temp dir)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="kvtier-identity-", dir=args.dir))
    try:
        write_checkpoint(root, int(args.gb * 1e9), args.shards, args.tensors)
        fresh = lambda: weights_digest(root, FileDigests(None))  # noqa: E731
        fresh()
        warm = statistics.median(timed(fresh) for _ in range(args.repeats))
        cold = []
        for _ in range(args.repeats):
            drop_cache(root)
            cold.append(timed(fresh))
        drop_cache(root)
        full = timed(lambda: read_all(root))
        remembered = root / "digest-cache"
        digest = weights_digest(root, FileDigests(remembered))
        restart = statistics.median(
            timed(lambda: weights_digest(root, FileDigests(remembered)))
            for _ in range(args.repeats))
        print(f"checkpoint: {digest.bytes / 1e9:.2f} GB in {digest.files} safetensors files, "
              f"{args.tensors} tensors")
        print(f"first start, warm   {warm * 1e3:9.1f} ms  (median of {args.repeats})")
        print(f"first start, cold   {statistics.median(cold) * 1e3:9.1f} ms  "
              f"(median of {args.repeats}, max {max(cold) * 1e3:.1f} ms)")
        print(f"restart             {restart * 1e3:9.1f} ms  (digests remembered, median "
              f"of {args.repeats})")
        print(f"read every byte     {full * 1e3:9.1f} ms  (cold, once, no hashing)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
