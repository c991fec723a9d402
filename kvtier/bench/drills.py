"""Crash drills: engines and tier writers killed with SIGKILL mid-write, and
``redis-server`` killed mid-pipeline, then the guarantees checked.

The disk drill is :mod:`kvtier.bench.disk_drill`, the Redis drill
:mod:`kvtier.bench.redis_drill`; this module holds what both use: the
reference answers of a server without kvtier, and a report's verdict line.

Both return a report (a dataclass: ``to_dict()`` for JSON, ``table()`` for
people, ``failures()`` the broken guarantees, empty when all held).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvtier.bench.drill_engine import (
    ask_all,
    fixed_prompts,
    plain_argv,
    pool_prompts,
    start_server,
)

Say = Callable[[str], None]
FIXED_MAX_TOKENS = 8
POOL_MAX_TOKENS = 4
READ_BATCH = 32
"""Blocks each tier ``get`` of a drill's read-back asks for."""


def quiet(_: str) -> None:
    return None


def verdict(failures: list[str]) -> str:
    """A report's last line: every guarantee held, or the ones that broke."""
    return "all guarantees held" if not failures else "FAILED: " + "; ".join(failures)


# ================================================================ references
POOL_SIZE = 48
POOL_SEED = 0


@dataclass(frozen=True)
class Reference:
    """Greedy answers of a server without kvtier to the fixed and the pool prompts."""

    fixed: list[str]
    pool: list[str]


def drill_reference(model: Path, log_dir: Path, pool_size: int = POOL_SIZE) -> Reference:
    """One server without kvtier answers :func:`fixed_prompts` and the pool."""
    fixed = fixed_prompts()
    pool = pool_prompts(pool_size, POOL_SEED)
    server = start_server(lambda port: plain_argv(model, port), log_dir / "reference.log")
    try:
        return Reference(ask_all(server.url, model, fixed, FIXED_MAX_TOKENS),
                         ask_all(server.url, model, pool, POOL_MAX_TOKENS))
    finally:
        server.stop()
