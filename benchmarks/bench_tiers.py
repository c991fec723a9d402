"""Throughput of the disk and Redis tiers against their raw rates, same run.

Disk: ``DiskTier.put`` / ``get_into`` of ``--blocks`` blocks of ``--block-mib``
MiB (checksummed header, temp file + rename per block, checksum checked on
read, payload read straight into slot-like buffers) against one Python process
writing the same bytes sequentially into one file and reading them back into
the same buffers (plain ``write`` / ``readinto``). Same directory, page cache
as the OS leaves it (``--cold`` drops each file's cached pages before reads).

Redis: ``RedisTier.put`` / ``get_into`` against raw pipelined redis-py
``SET`` / ``GET`` of values of the same payload size, same batches, same
server (a local redis-server started here on a free loopback port, or ``--url``).

Reported: median seconds of ``--repeats`` interleaved runs (alternately in
forward and reverse order, after one untimed pass), GB/s, ratio =
tier rate / raw rate (target >= 0.7). ``--rebuild-files N`` also times a warm
restart (a new DiskTier scanning N small block files).

    python benchmarks/bench_tiers.py [--blocks 48] [--block-mib 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

from kvtier import block_key
from kvtier.tiers import DiskTier, KVLayout

MIB = 1 << 20


@dataclass
class Row:
    tier: str
    op: str
    mib: float
    tier_gbps: float
    raw_gbps: float
    ratio: float


def _medians(fns: dict[str, Callable[[], None]], repeats: int,
             before: Callable[[str], None]) -> dict[str, float]:
    """Median seconds of each function after one untimed pass.

    Odd repeats run the functions in reverse order (reads first, on the data the
    previous pass wrote), so neither side always runs after the other: the
    allocator's and the page cache's state otherwise favours whichever goes second.
    """
    names = list(fns)
    for name in names:
        before(name)
        fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            before(name)
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _rows(tier: str, total: int, secs: dict[str, float]) -> list[Row]:
    rows = []
    for op in ("write", "read"):
        tier_s, raw_s = secs[f"tier_{op}"], secs[f"raw_{op}"]
        rows.append(Row(tier, op, total / MIB, round(total / tier_s / 1e9, 3),
                        round(total / raw_s / 1e9, 3), round(raw_s / tier_s, 3)))
    return rows


def _payloads(blocks: int, block_bytes: int) -> tuple[list[bytes], list[np.ndarray]]:
    rng = np.random.default_rng(0)
    keys = [block_key(rng.bytes(32), 0) for _ in range(blocks)]
    slots = [rng.integers(0, 256, block_bytes, dtype=np.uint8) for _ in range(blocks)]
    return keys, slots


def _drop_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def bench_disk(args: argparse.Namespace, namespace: str) -> list[Row]:
    block_bytes = int(args.block_mib * MIB)
    keys, slots = _payloads(args.blocks, block_bytes)
    dests = [np.zeros(block_bytes, np.uint8) for _ in range(args.blocks)]
    base = tempfile.mkdtemp(prefix="kvtier-bench-", dir=args.dir)
    raw_path = os.path.join(base, "raw.bin")
    total = args.blocks * block_bytes
    tier = DiskTier(os.path.join(base, "tier"), namespace, 4 * total + (64 * MIB),
                    free_reserve_bytes=0, rescan_interval_s=None)
    batch = args.batch

    def raw_write() -> None:
        with open(raw_path, "wb") as f:
            for s in slots:
                f.write(s.data)

    def raw_read() -> None:
        with open(raw_path, "rb", buffering=0) as f:
            for d in dests:
                f.readinto(d.data)

    def tier_write() -> None:
        for i in range(0, len(keys), batch):
            ok = tier.put(list(zip(keys[i : i + batch], slots[i : i + batch], strict=True)))
            assert all(ok), "disk tier dropped a store"

    def tier_read() -> None:
        for i in range(0, len(keys), batch):
            got = tier.get_into(keys[i : i + batch], dests[i : i + batch])
            assert None not in got, "disk tier missed"

    def before(name: str) -> None:
        if name == "tier_write":
            tier.delete(keys)
        elif name == "raw_write" and os.path.exists(raw_path):
            os.unlink(raw_path)
        os.sync()  # start each run without the last one's dirty pages
        if args.cold and name == "raw_read":
            _drop_cache(raw_path)
        elif args.cold and name == "tier_read":
            for k in keys:
                _drop_cache(tier.dir.file(k))

    try:
        fns = {"raw_write": raw_write, "tier_write": tier_write,
               "raw_read": raw_read, "tier_read": tier_read}
        secs = _medians(fns, args.repeats, before)
        assert all((d == s).all() for d, s in zip(dests, slots, strict=True))
    finally:
        tier.close()
        shutil.rmtree(base, ignore_errors=True)
    return _rows("disk", total, secs)


def bench_redis(args: argparse.Namespace, namespace: str) -> list[Row]:
    import redis

    from kvtier.tiers.redis_server import RedisServer
    from kvtier.tiers.redis_tier import RedisTier

    server = None
    url = args.url
    if url is None:
        server = RedisServer().start()
        url = server.url
    block_bytes = int(args.block_mib * MIB)
    keys, slots = _payloads(args.blocks, block_bytes)
    dests = [np.zeros(block_bytes, np.uint8) for _ in range(args.blocks)]
    raw_values = [s.tobytes() for s in slots]
    raw_keys = [b"raw:" + k for k in keys]
    batch = args.batch
    tier = RedisTier(url, namespace, max_batch_keys=batch, socket_timeout_s=30.0)
    client = redis.Redis.from_url(url, socket_timeout=30.0)

    def raw_write() -> None:
        for i in range(0, len(keys), batch):
            pipe = client.pipeline(transaction=False)
            for k, v in zip(raw_keys[i : i + batch], raw_values[i : i + batch], strict=True):
                pipe.set(k, v)
            pipe.execute()

    def raw_read() -> None:
        # Values of one batch at a time, like the tier: the consumer drops them.
        for i in range(0, len(keys), batch):
            pipe = client.pipeline(transaction=False)
            for k in raw_keys[i : i + batch]:
                pipe.get(k)
            got = pipe.execute()
            assert all(v is not None and len(v) == block_bytes for v in got)
            del got

    def tier_write() -> None:
        ok = tier.put(list(zip(keys, slots, strict=True)))
        assert all(ok), "redis tier dropped a store"

    def tier_read() -> None:
        got = tier.get_into(keys, dests)
        assert None not in got, "redis tier missed"

    def before(name: str) -> None:
        if name == "raw_write":
            client.delete(*raw_keys)
        elif name == "tier_write":
            tier.delete(keys)

    try:
        fns = {"raw_write": raw_write, "tier_write": tier_write,
               "raw_read": raw_read, "tier_read": tier_read}
        secs = _medians(fns, args.repeats, before)
        assert all((d == s).all() for d, s in zip(dests, slots, strict=True))
    finally:
        client.delete(*raw_keys)
        tier.delete(keys)
        tier.close()
        client.close()
        if server is not None:
            server.close()
    return _rows("redis", args.blocks * block_bytes, secs)


def bench_rebuild(args: argparse.Namespace, namespace: str) -> dict[str, float]:
    """Write N small blocks, then time a new DiskTier finding them."""
    base = tempfile.mkdtemp(prefix="kvtier-rebuild-", dir=args.dir)
    try:
        tier = DiskTier(base, namespace, 1 << 40, free_reserve_bytes=0, rescan_interval_s=None)
        payload = b"x" * 256
        n = args.rebuild_files
        for i in range(0, n, 1000):
            tier.put([(block_key(j), payload) for j in range(i, min(n, i + 1000))])
        tier.close()
        start = time.perf_counter()
        again = DiskTier(base, namespace, 1 << 40, free_reserve_bytes=0, rescan_interval_s=None)
        seconds = time.perf_counter() - start
        found = again.stats()["blocks"]
        hit = again.get([block_key(n - 1)])[0]
        assert found == n and hit is not None, (found, n)
        return {"files": n, "rebuild_s": round(seconds, 3)}
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=48, help="blocks per run")
    parser.add_argument("--block-mib", type=float, default=2.0,
                        help="size of a block, MiB (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=16, help="blocks per tier call / pipeline")
    parser.add_argument("--repeats", type=int, default=7,
                        help="timed runs of each operation, interleaved, the median "
                        "reported (default: %(default)s)")
    parser.add_argument("--dir", default=None, help="where the disk runs write (default: TMPDIR)")
    parser.add_argument("--cold", action="store_true", help="drop cached pages before reads")
    parser.add_argument("--url", default=None, help="Redis URL (default: start a local server)")
    parser.add_argument("--only", choices=("disk", "redis"), default=None,
                        help="time this tier only (default: both)")
    parser.add_argument("--rebuild-files", type=int, default=0,
                        help="also time a warm restart over this many files")
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    args = parser.parse_args()
    namespace = KVLayout("bench", "bfloat16", 16, 32, 8, 128).namespace()
    rows: list[Row] = []
    if args.only in (None, "disk"):
        rows += bench_disk(args, namespace)
    if args.only in (None, "redis"):
        rows += bench_redis(args, namespace)
    rebuild = bench_rebuild(args, namespace) if args.rebuild_files else None
    if args.json:
        for row in rows:
            print(json.dumps({**asdict(row), "blocks": args.blocks, "block_mib": args.block_mib,
                              "target": 0.7}))
        if rebuild:
            print(json.dumps({"tier": "disk", "op": "rebuild", **rebuild}))
        return
    print(f"{args.blocks} blocks of {args.block_mib:g} MiB, batches of {args.batch}, "
          f"median of {args.repeats}{', cold reads' if args.cold else ''}")
    print(f"{'tier':<6} {'op':<6} {'MiB':>6} {'tier GB/s':>10} {'raw GB/s':>9} {'ratio':>6}")
    for r in rows:
        flag = "" if r.ratio >= 0.7 else "  (< 0.7)"
        print(f"{r.tier:<6} {r.op:<6} {r.mib:>6.0f} {r.tier_gbps:>10.3f} {r.raw_gbps:>9.3f} "
              f"{r.ratio:>6.2f}{flag}")
    if rebuild:
        print(f"warm restart: {rebuild['files']} files indexed in {rebuild['rebuild_s']} s")


if __name__ == "__main__":
    main()
