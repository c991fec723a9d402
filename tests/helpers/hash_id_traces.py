"""Small hash-id request lists for the trace-level caches' tests
(tests/test_foresight.py, tests/test_policy_benchmarks.py)."""

from __future__ import annotations

from kvtier.replay.generate import generate


def chat_requests(seed: int = 3, n: int = 400) -> list[tuple[int, ...]]:
    """Generated chat traffic: multi-turn prefixes, so every cache has reuse to find."""
    return [r.hash_ids for r in generate("chat", seed=seed, requests=n)]


def shared_head_between_one_offs() -> list[tuple[int, ...]]:
    """A 3-block prefix used every third request; two 4-block one-offs in between.

    LRU of 4 blocks finds nothing; a cache that declines the one-offs finds the
    head 99 times: a hit ratio of 3 * 99 / (11 * 100).
    """
    out: list[tuple[int, ...]] = []
    for i in range(100):
        out += [(0, 1, 2), tuple(range(1000 + 8 * i, 1004 + 8 * i)),
                tuple(range(1004 + 8 * i, 1008 + 8 * i))]
    return out
