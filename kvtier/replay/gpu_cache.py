"""A model of vLLM's own GPU prefix cache (its block pool), for the replay lab.

What vLLM 0.32 does, and this model mirrors (block = one trace block):

* ``vllm/v1/core/block_pool.py``, ``BlockPool``: a fixed pool of blocks (one,
  the null block, is reserved: ``num_gpu_blocks - 1`` are usable, which is what
  ``num_blocks`` here counts). A full block, once computed, is cached under its
  block hash (``cache_full_blocks``); identical blocks are not de-duplicated
  (``BlockHashToBlockMap`` may map one hash to several blocks and a hit takes
  the first). A block held by a running request (``ref_cnt > 0``) cannot be
  evicted; a block with ``ref_cnt == 0`` sits in the free queue and keeps its
  hash until it is reallocated (``get_new_blocks`` pops the queue's front and
  drops the popped block's hash then: that is the eviction).
* ``vllm/v1/core/kv_cache_utils.py``, ``FreeKVCacheBlockQueue``: the free queue
  in eviction order, front first; it starts in block-id order. ``free_blocks``
  appends blocks that became free to the back (cached ones; uncached ones go
  to the front), and ``single_type_kv_cache_manager.py``
  ``SingleTypeKVCacheManager.free`` frees a request's blocks in reverse, so a
  finished request's tail is evicted before its head, and requests that
  finished earlier before later ones (LRU). A hit on a free block takes it
  out of the queue again (``BlockPool.touch``: ``ref_cnt += 1``).
* ``vllm/v1/core/kv_cache_manager.py``, ``KVCacheManager.get_computed_blocks``:
  the hit is the longest run of cached blocks from the prompt's start
  (``FullAttentionManager.find_longest_cache_hit``), capped at
  ``num_tokens - 1`` tokens: the last token must be recomputed for its logits,
  and since hits are whole blocks, a block-aligned prompt whose every block is
  cached still recomputes its whole last block (into a new block: the copy is
  not de-duplicated). ``allocate_slots`` touches the hit blocks before it
  pops new ones, so a request never evicts its own hit; it fails (the request
  waits) when the free queue is shorter than the blocks it must take.

Requests here are block-aligned: every key is a full block (the lab's
convention for Mooncake ``hash_ids``), and only prompt blocks are modelled
(no decode blocks). A request's blocks are computed or loaded at once when
it is allocated, so they are cached from then on.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class EngineCacheFullError(ValueError):
    """A request needs more free engine blocks than the cache has right now."""


class GpuPrefixCache:
    """vLLM's block pool and prefix cache over ``num_blocks`` engine blocks.

    Owns, per block: its key (None until it is first computed), its reference
    count (running requests holding it); the free queue (blocks with no
    reference, in eviction order, front first); the key → cached blocks map;
    and each running request's blocks in prompt order.

    Invariants: a block is in the free queue iff its reference count is 0;
    every key in the map names blocks whose key it is, first-cached first;
    only free blocks are evicted, and only when a request allocates.

    Memory: O(``num_blocks``): two per-block lists, a free queue and a key map
    of at most ``num_blocks`` entries each, plus the running requests' block
    lists (their blocks: at most ``num_blocks`` distinct, a shared hit block
    listed once per request holding it).
    """

    def __init__(self, num_blocks: int) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._key: list[bytes | None] = [None] * num_blocks
        self._refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, list[int]] = {}
        self._running: dict[str, list[int]] = {}
        self.hits = 0
        self.queries = 0
        self.evictions = 0

    # -- queries -------------------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        """Blocks no running request holds (cached or empty): what allocation may take."""
        return len(self._free)

    @property
    def running(self) -> int:
        """Requests holding blocks."""
        return len(self._running)

    def contains(self, key: bytes) -> bool:
        """Whether some block is cached under ``key`` (held or free)."""
        return key in self._cached

    def free_order(self) -> list[bytes | None]:
        """Keys of the free blocks in eviction order, next to go first (tests, debugging)."""
        return [self._key[b] for b in self._free]

    def match(self, keys: Sequence[bytes]) -> int:
        """The engine's prefix hit of a prompt of ``keys``, in blocks.

        The leading run of cached keys, at most ``len(keys) - 1``: vLLM
        recomputes the last block of a fully cached block-aligned prompt.
        Changes nothing (the hit is taken by ``allocate``).
        """
        hits = 0
        cached = self._cached
        for key in keys[: len(keys) - 1]:
            if key not in cached:
                break
            hits += 1
        return hits

    def blocks_needed(self, keys: Sequence[bytes], hits: int) -> int:
        """Free blocks ``allocate(.., keys, hits)`` takes: new ones and free hit ones."""
        refs, cached = self._refs, self._cached
        free_hits = sum(1 for key in keys[:hits] if refs[cached[key][0]] == 0)
        return len(keys) - hits + free_hits

    # -- a request's life --------------------------------------------------------------

    def allocate(self, req_id: str, keys: Sequence[bytes], hits: int) -> None:
        """Start request ``req_id``: take its ``hits`` leading cached blocks
        (``match``), then new blocks for the rest, evicting from the free
        queue's front, and cache the new blocks under their keys.

        Counts the prompt's blocks as queries and ``hits`` as hits (vLLM's
        ``prefix_cache_queries`` / ``prefix_cache_hits``, in blocks). Raises
        ``EngineCacheFullError`` (changing nothing) when the free queue is too
        short, ``ValueError`` for a running ``req_id`` or a bad ``hits``.
        """
        if req_id in self._running:
            raise ValueError(f"request {req_id!r} is already running")
        if not 0 <= hits <= self.match(keys):
            raise ValueError(f"hits={hits} is not a prefix hit of request {req_id!r}")
        needed = self.blocks_needed(keys, hits)
        if needed > len(self._free):
            raise EngineCacheFullError(
                f"request {req_id!r} needs {needed} free engine blocks, "
                f"{len(self._free)} of {self.num_blocks} are free")
        blocks = [self._touch(self._cached[key][0]) for key in keys[:hits]]
        blocks.extend(self._new_block(key) for key in keys[hits:])
        self._running[req_id] = blocks
        self.queries += len(keys)
        self.hits += hits

    def free(self, req_id: str) -> None:
        """Finish ``req_id``: drop its references, tail first, so its blocks
        that became free join the queue's back tail first (evicted tail first,
        after blocks freed earlier). ``KeyError`` when it is not running."""
        refs, free = self._refs, self._free
        for block in reversed(self._running.pop(req_id)):
            refs[block] -= 1
            if refs[block] == 0:
                free[block] = None

    # -- internals -------------------------------------------------------------------

    def _touch(self, block: int) -> int:
        if self._refs[block] == 0:
            del self._free[block]
        self._refs[block] += 1
        return block

    def _new_block(self, key: bytes) -> int:
        block, _ = self._free.popitem(last=False)
        old = self._key[block]
        if old is not None:
            self._uncache(old, block)
            self.evictions += 1
        self._key[block] = key
        self._cached.setdefault(key, []).append(block)
        self._refs[block] = 1
        return block

    def _uncache(self, key: bytes, block: int) -> None:
        blocks = self._cached[key]
        blocks.remove(block)
        if not blocks:
            del self._cached[key]
