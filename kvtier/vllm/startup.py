"""What an operator reads in vLLM's log when kvtier starts.

``tiers_line`` is the one INFO line the scheduler logs per engine: the tiers
kvtier set up (CPU slots and bytes, the disk tier's path and cap, the Redis
endpoint without credentials, the shared tiers' namespace), the policy and the
store thresholds. No secret is in it: the Redis URL loses its user, password
and query (``kvtier.secrets.url_endpoint``), the tenant salt shows only as
"salted".

``share_vllm_log_handlers`` makes kvtier's records reach vLLM's log at all:
vLLM 0.32 gives a handler to its ``vllm`` logger only, so the records of the
``kvtier`` loggers went to Python's last-resort handler, which drops INFO
(the tiers line, the weights fingerprint) and prints warnings without a time.
"""

from __future__ import annotations

import logging

from kvtier.secrets import url_endpoint
from kvtier.tools.formatting import human_bytes
from kvtier.vllm.settings import KVTierSettings

KVTIER_LOGGER = "kvtier"
VLLM_LOGGER = "vllm"


def share_vllm_log_handlers() -> None:
    """Send the ``kvtier`` loggers' records to vLLM's handlers, at vLLM's level,
    when nothing else would show them: only if neither kvtier's logger nor the
    root logger has a handler (an application, or a test's log capture, that
    set up logging keeps its own) and vLLM's logger has one. Idempotent."""
    ours = logging.getLogger(KVTIER_LOGGER)
    if ours.handlers or logging.getLogger().handlers:
        return
    vllm = logging.getLogger(VLLM_LOGGER)
    if not vllm.handlers:
        return
    for handler in vllm.handlers:
        ours.addHandler(handler)
    ours.setLevel(vllm.getEffectiveLevel())
    # the root logger has no handler: propagating would only reach the last resort
    ours.propagate = False


def tiers_line(settings: KVTierSettings, *, num_slots: int, slot_stride: int, ranks: int,
               namespace: str | None) -> str:
    """The start-up line: ``num_slots`` CPU slots of ``slot_stride`` bytes on each
    of ``ranks`` ranks; ``namespace`` is the shared tiers' (rank 0's; None
    without disk and Redis tiers)."""
    s = settings
    per_rank = "" if ranks == 1 else f" on each of {ranks} ranks"
    parts = [f"CPU {num_slots} blocks of {human_bytes(slot_stride)}{per_rank} "
             f"({human_bytes(num_slots * slot_stride * ranks)})"]
    if s.disk_path is not None:
        parts.append(f"disk {s.disk_path} (cap {human_bytes(s.disk_bytes or 0)}, "
                     f"write on {s.disk_write_policy}, threshold {s.disk_store_threshold})")
    if s.redis_url is not None:
        ttl = "none" if s.redis_ttl_s is None else f"{s.redis_ttl_s:g} s"
        parts.append(f"redis {url_endpoint(s.redis_url)} (write on {s.redis_write_policy}, "
                     f"threshold {s.redis_store_threshold}, ttl {ttl})")
    if namespace is not None:
        rank = " (rank 0's)" if ranks > 1 else ""
        salted = ", tenant salted" if s.tenant_salt is not None else ""
        parts.append(f"namespace {namespace}{rank}{salted}")
    parts.append(f"policy {s.eviction_policy}, store_threshold {s.store_threshold}")
    return "kvtier: tiers: " + "; ".join(parts)
