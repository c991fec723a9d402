"""The serving benchmark's peer: vLLM's own ``CPUOffloadingManager`` behind
kvtier's transfer worker.

vLLM's own CPU spec cannot run on vLLM's CPU platform (its worker needs a
GPU), so the peer keeps everything of ``KVTierSpec`` (slot geometry, worker,
metrics) and swaps only the scheduler-side manager: the comparison with kvtier
measures the manager's decisions, nothing else. Selected with
``"spec_name": "VllmManagerSpec", "spec_module_path": "kvtier.bench.peer_spec"``;
``eviction_policy`` is vLLM's (``lru`` or ``arc``), ``store_threshold`` and
``max_tracker_size`` as in vLLM. No disk or Redis tier.
"""

from __future__ import annotations

from vllm.v1.kv_offload.base import OffloadingManager

from kvtier.vllm.settings import ConfigError
from kvtier.vllm.spec import KVTierSpec

PEER_POLICIES = ("lru", "arc")


class VllmManagerSpec(KVTierSpec):
    """``KVTierSpec`` whose manager is vLLM's ``CPUOffloadingManager``."""

    _peer: OffloadingManager | None = None

    def get_manager(self) -> OffloadingManager:
        if self._peer is None:
            from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

            s = self.settings
            if s.eviction_policy not in PEER_POLICIES:
                raise ConfigError(f"VllmManagerSpec runs vLLM's {list(PEER_POLICIES)} "
                                  f"policies, not {s.eviction_policy!r}")
            if s.disk_path is not None or s.redis_url is not None:
                raise ConfigError("VllmManagerSpec has no disk or Redis tier")
            self._peer = CPUOffloadingManager(
                num_chunks=self.num_slots, cache_policy=s.eviction_policy,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=s.store_threshold, max_tracker_size=s.max_tracker_size)
        return self._peer
