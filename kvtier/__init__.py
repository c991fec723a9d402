"""kvtier: tiered KV-cache offloading for LLM inference engines.

The scheduler-side contract (DESIGN.md §3)::

    import kvtier
    key = kvtier.block_key(block_hash, group=0)
    ctx = kvtier.RequestContext("req-1")
    mgr = kvtier.OffloadManager(num_blocks, policy="lru")
    n = mgr.lookup(keys, ctx)
"""

from kvtier.errors import KVTierError, MissingBlocksError, ProtocolError
from kvtier.events import Event
from kvtier.keys import block_key, key_group, key_hash
from kvtier.manager import OffloadManager
from kvtier.policies import POLICIES, EvictionPolicy
from kvtier.request import RequestContext
from kvtier.results import LoadSpec, LookupResult, PrepareStoreOutput

__version__ = "0.1.0"

__all__ = [
    "POLICIES",
    "Event",
    "EvictionPolicy",
    "KVTierError",
    "LoadSpec",
    "LookupResult",
    "MissingBlocksError",
    "OffloadManager",
    "PrepareStoreOutput",
    "ProtocolError",
    "RequestContext",
    "__version__",
    "block_key",
    "key_group",
    "key_hash",
]
