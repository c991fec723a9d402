"""A model of vLLM's own GPU prefix cache (its block pool), for the replay lab.

What vLLM 0.32 does, and this model mirrors (one block = one engine block):

* ``vllm/v1/core/block_pool.py``, ``BlockPool``: a fixed pool of blocks; one,
  the null block, is reserved, so ``num_gpu_blocks - 1`` are usable, which is
  what ``num_blocks`` here counts. A full block is cached under its block hash
  (``cache_full_blocks``) when the scheduler allocates the step that fills it
  (``KVCacheManager.allocate_slots`` caches up to the tokens of that step),
  prompt blocks and blocks that decoding fills alike; a partial block is never
  cached. Identical blocks are not de-duplicated (``BlockHashToBlockMap`` may
  map one hash to several blocks; a hit takes the first). A block held by a
  request (``ref_cnt > 0``) cannot be evicted; a free block keeps its hash until
  it is reallocated (``get_new_blocks`` pops the free queue's front and drops
  the popped block's hash then: that is the eviction).
* ``vllm/v1/core/kv_cache_utils.py``, ``FreeKVCacheBlockQueue``: the free queue
  in eviction order, front first; it starts in block-id order.
  ``BlockPool.free_blocks`` puts a block that became free at the back when it
  has a hash (``append_n``: LRU) and at the front when it has none
  (``prepend_n``: an empty partial block is reused before any cached one), and
  ``SingleTypeKVCacheManager.free`` frees a request's blocks in reverse, so a
  finished request's tail is evicted before its head, after requests that
  finished earlier. A hit on a free block takes it out of the queue
  (``BlockPool.touch``: ``ref_cnt += 1``).
* ``vllm/v1/core/single_type_kv_cache_manager.py``: a hit is the longest run of
  cached blocks from the prompt's start (``FullAttentionManager.find_longest_cache_hit``,
  capped by the caller, see ``match``); ``get_num_blocks_to_allocate`` counts a
  free hit block as taken (it leaves the free queue) besides the new blocks;
  ``add_local_computed_blocks`` touches the hits before ``allocate_new_blocks``
  pops new ones, so a request never evicts its own hit.

Requests here name their full blocks by keys (the driver gives blocks that only
one request can ever fill, such as blocks completed by decoding, keys of their
own). Memory: O(``num_blocks``) in all (see ``GpuPrefixCache``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


class EngineCacheFullError(ValueError):
    """A request needs more free engine blocks than the cache has right now."""


@dataclass(slots=True)
class _Held:
    """One running request's blocks, in token order, the first ``cached`` hashed."""

    blocks: list[int] = field(default_factory=list)
    cached: int = 0


class GpuPrefixCache:
    """vLLM's block pool and prefix cache over ``num_blocks`` usable engine blocks.

    Owns, per block: its key (None while it has no hash), its reference count
    (requests holding it); the free queue (blocks with no reference, in eviction
    order, front first); the key → cached blocks map; and each request's held
    blocks in token order with how many of them are cached.

    A request's life: ``start`` (take its hits), ``grow`` (take new blocks as
    its steps need them), ``commit`` (cache the blocks that became full),
    ``free``. Invariants: a block is in the free queue iff its reference count
    is 0; every key in the map names blocks whose key it is, first-cached
    first; only free blocks are evicted, and only when a request grows.

    Memory: O(``num_blocks``): two per-block lists, a free queue and a key map
    of at most ``num_blocks`` entries each, plus the running requests' block
    lists (at most ``num_blocks`` distinct blocks; a shared hit block is listed
    once per request holding it).
    """

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._key: list[bytes | None] = [None] * num_blocks
        self._refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, list[int]] = {}
        self._held: dict[str, _Held] = {}
        self.evictions = 0

    # -- queries -------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        """Blocks no request holds (cached or empty): what allocation may take."""
        return len(self._free)

    @property
    def running(self) -> int:
        """Requests holding blocks."""
        return len(self._held)

    def held(self, req_id: str) -> int:
        """Blocks ``req_id`` holds (0 when it holds none)."""
        held = self._held.get(req_id)
        return len(held.blocks) if held is not None else 0

    def contains(self, key: bytes) -> bool:
        """Whether some block is cached under ``key`` (held or free)."""
        return key in self._cached

    def free_order(self) -> list[bytes | None]:
        """Keys of the free blocks in eviction order, next to go first; None for a
        block without hash (tests, debugging)."""
        return [self._key[b] for b in self._free]

    def match(self, keys: Sequence[bytes], limit: int) -> int:
        """The leading run of cached ``keys``, at most ``limit`` blocks.

        vLLM caps the hit at ``num_tokens - 1`` tokens (the last token is
        recomputed for its logits): ``limit`` is ``(num_tokens - 1) // block_size``.
        Changes nothing (``start`` takes the hit).
        """
        hits = 0
        cached = self._cached
        for key in keys[: max(0, limit)]:
            if key not in cached:
                break
            hits += 1
        return hits

    def admission_cost(self, keys: Sequence[bytes], hits: int, blocks: int) -> int:
        """Free blocks a request needs to hold ``blocks`` blocks, the first ``hits``
        of them hits on ``keys``: the new ones and the free hit ones
        (``get_num_blocks_to_allocate``)."""
        refs, cached = self._refs, self._cached
        free_hits = sum(1 for key in keys[:hits] if refs[cached[key][0]] == 0)
        return max(0, blocks - hits) + free_hits

    # -- a request's life --------------------------------------------------------------

    def start(self, req_id: str, keys: Sequence[bytes], hits: int) -> None:
        """Start ``req_id`` on its ``hits`` leading cached ``keys`` (a ``match``):
        take their blocks (out of the free queue when free).

        ``ValueError`` (changing nothing) for a running ``req_id`` or when
        ``keys[:hits]`` are not all cached.
        """
        if req_id in self._held:
            raise ValueError(f"request {req_id!r} is already running")
        if hits < 0 or hits > len(keys) or self.match(keys, hits) != hits:
            raise ValueError(f"hits={hits} is not a prefix hit of request {req_id!r}")
        self._held[req_id] = _Held([self._touch(self._cached[k][0]) for k in keys[:hits]], hits)

    def grow(self, req_id: str, blocks: int) -> None:
        """Let ``req_id`` hold ``blocks`` blocks: new ones come from the free
        queue's front (evicting their keys). ``EngineCacheFullError`` (changing
        nothing) when the queue is too short; ``KeyError`` when not started."""
        held = self._held[req_id]
        need = blocks - len(held.blocks)
        if need <= 0:
            return
        if need > len(self._free):
            raise EngineCacheFullError(
                f"request {req_id!r} needs {need} free engine blocks, "
                f"{len(self._free)} of {self.num_blocks} are free")
        held.blocks.extend(self._new_block() for _ in range(need))

    def commit(self, req_id: str, keys: Sequence[bytes]) -> None:
        """Cache ``req_id``'s blocks that are full: its held blocks
        ``[cached, len(keys))`` under ``keys[cached:]`` (``cache_full_blocks``).

        ``keys`` are the keys of the request's full blocks, in order; blocks
        already cached are left alone. ``ValueError`` when it holds fewer than
        ``len(keys)`` blocks; ``KeyError`` when not started.
        """
        held = self._held[req_id]
        if len(keys) > len(held.blocks):
            raise ValueError(f"request {req_id!r} holds {len(held.blocks)} blocks, "
                             f"cannot cache {len(keys)}")
        for i in range(held.cached, len(keys)):
            block = held.blocks[i]
            self._key[block] = keys[i]
            self._cached.setdefault(keys[i], []).append(block)
        held.cached = max(held.cached, len(keys))

    def free(self, req_id: str) -> None:
        """Finish ``req_id``: drop its references tail first; blocks that became
        free join the queue's back when cached (tail first, after blocks freed
        earlier) and its front when not. ``KeyError`` when not started."""
        refs, free, key = self._refs, self._free, self._key
        empty = []
        for block in reversed(self._held.pop(req_id).blocks):
            refs[block] -= 1
            if refs[block] == 0:
                if key[block] is None:
                    empty.append(block)
                else:
                    free[block] = None
        for block in reversed(empty):  # prepend_n keeps the freed order at the front
            free[block] = None
            free.move_to_end(block, last=False)

    # -- internals -------------------------------------------------------------------

    def _touch(self, block: int) -> int:
        if self._refs[block] == 0:
            del self._free[block]
        self._refs[block] += 1
        return block

    def _new_block(self) -> int:
        block, _ = self._free.popitem(last=False)
        old = self._key[block]
        if old is not None:
            self._uncache(old, block)
            self._key[block] = None
            self.evictions += 1
        self._refs[block] = 1
        return block

    def _uncache(self, key: bytes, block: int) -> None:
        blocks = self._cached[key]
        blocks.remove(block)
        if not blocks:
            del self._cached[key]
