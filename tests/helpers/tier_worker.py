"""A second engine process for the tier tests: ``python tests/helpers/tier_worker.py ROLE JSON``.

Roles:
  disk-write   store keys ``ids`` in a DiskTier, then exit (warm restart).
  disk-share   loop storing and reading ``ids`` in a DiskTier shared with
               another process, checking every hit's bytes.
  redis-write  store keys ``ids`` in a RedisTier.
  redis-read   read keys ``ids`` from a RedisTier, checking bytes.

Prints one JSON object (counts and the tier's stats) on stdout.
"""

from __future__ import annotations

import json
import random
import sys
import time
from typing import Any

import numpy as np

from kvtier import block_key


def payload(i: int, size: int) -> np.ndarray:
    """The deterministic bytes of block ``i`` (every process agrees on them)."""
    return np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8)


def _disk(cfg: dict) -> Any:
    from kvtier.tiers import DiskTier

    return DiskTier(cfg["path"], cfg["namespace"], cfg["capacity"], free_reserve_bytes=0,
                    rescan_interval_s=cfg.get("rescan_interval_s"))


def _redis(cfg: dict) -> Any:
    from kvtier.tiers import RedisTier

    return RedisTier(cfg["url"], cfg["namespace"])


def main() -> None:
    role, cfg = sys.argv[1], json.loads(sys.argv[2])
    size = cfg["size"]
    ids = cfg["ids"]
    out: dict[str, object] = {}
    if role in ("disk-write", "redis-write"):
        tier = _disk(cfg) if role == "disk-write" else _redis(cfg)
        ok = tier.put([(block_key(i), payload(i, size)) for i in ids])
        out["stored"] = sum(ok)
    elif role == "redis-read":
        tier = _redis(cfg)
        got = tier.get([block_key(i) for i in ids])
        out["hits"] = sum(g is not None for g in got)
        out["bad"] = sum(
            g is not None and bytes(g) != payload(i, size).tobytes()
            for i, g in zip(ids, got, strict=True)
        )
    elif role == "disk-share":
        tier = _disk(cfg)
        rng = random.Random(cfg["seed"])
        buf = np.zeros(size, np.uint8)
        hits = bad = stores = 0
        deadline = time.monotonic() + cfg["seconds"]
        while time.monotonic() < deadline:
            i = rng.choice(ids)
            key = block_key(i)
            if rng.random() < 0.5:
                stores += sum(tier.put([(key, payload(i, size))]))
            elif tier.contains([key])[0]:
                n = tier.get_into([key], [buf])[0]
                if n is not None:
                    hits += 1
                    bad += int(n != size or not np.array_equal(buf, payload(i, size)))
        out.update(hits=hits, bad=bad, stores=stores)
    else:
        raise SystemExit(f"unknown role {role}")
    out["stats"] = tier.stats()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
