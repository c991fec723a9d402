"""Whether an engine's block keys can match another engine process's.

kvtier's keys are vLLM's block hashes, chained from a first value vLLM
derives from a seed (``NONE_HASH``). With the cryptographic algorithms
(``sha256``, ``sha256_cbor``, vLLM's default) the seed is fixed, so every
process computes the same keys for the same tokens. With the fast ones
(``xxhash``, ``xxhash_cbor``) vLLM draws the seed at random in each process
unless ``PYTHONHASHSEED`` is set, because their collision resistance rests on
the seed staying unknown. A disk or Redis tier then still extends the CPU
tier within one process, but never serves a block another process (another
engine, or the same one after a restart) wrote: in
``tests/test_vllm_tiers.py`` the second of two engine runs on one disk tier
gets 0 prompt tokens from it under unseeded ``xxhash``, and all 192 it can
serve with ``PYTHONHASHSEED`` set.

Different seeds give different keys, never a wrong block: this is about hit
ratio, so :class:`~kvtier.vllm.spec.KVTierSpec` logs a warning at start-up
and starts anyway.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

SEEDED_PER_PROCESS = frozenset({"xxhash", "xxhash_cbor"})
"""``prefix_caching_hash_algo`` values vLLM seeds at random per process unless
``PYTHONHASHSEED`` is set (``vllm.v1.core.kv_cache_utils.resolve_none_hash_seed``)."""


def unshared_keys_reason(vllm_config: Any, environ: Mapping[str, str] | None = None) -> str | None:
    """Why this engine's block keys will differ from every other process's,
    with the fix; None when they are reproducible (or the config is unknown)."""
    cache = getattr(vllm_config, "cache_config", None)
    algo = getattr(cache, "prefix_caching_hash_algo", None)
    env = os.environ if environ is None else environ
    if algo not in SEEDED_PER_PROCESS or env.get("PYTHONHASHSEED") is not None:
        return None
    return (
        f"vLLM's prefix_caching_hash_algo={algo!r} seeds block hashes at random in each "
        "process unless PYTHONHASHSEED is set, so the disk/Redis tier will not serve "
        "blocks written by another engine process or by an earlier run of this one. "
        "Set PYTHONHASHSEED to the same value on every engine sharing the tier (keep it "
        f"secret: {algo} is not collision resistant), or use prefix_caching_hash_algo="
        "'sha256'"
    )
