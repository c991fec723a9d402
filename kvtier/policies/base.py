"""The contract between the manager and an eviction policy."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Container, Sequence
from typing import ClassVar


class EvictionPolicy(ABC):
    """Decides which resident blocks to evict; knows nothing of slots or bytes.

    The manager tells the policy about every resident block:

    * ``insert(keys)``: new blocks, in offer order (being written, so not
      evictable yet);
    * ``remove(key)``: a block left without eviction (its store failed);
    * ``blocked``: the set of resident keys that are not evictable (being
      written, pinned or leased). The manager keeps it current and the policy
      reads it in ``evict``; a block keeps its logical rank while blocked;
    * ``on_access(keys, reused)``: one finished request's access, head first
      (``keys[0]`` is the most valuable block): every key it loaded or offered,
      each once, held or not (a block may have been evicted while its request ran, or
      declined by ``admit``); ``reused`` are the keys the request found ready
      in the cache (not inserted by itself);
    * ``on_demand_access(keys, reused, asked_from)`` instead (only when
      ``wants_demand``): the same access, and the index of the first key the
      request asked the cache for (``keys[:asked_from]`` were served by a
      cache in front of it, such as the engine's prefix cache, and reached
      this one only as offers; ``len(keys)`` when the request asked this
      cache for nothing, as one the engine's cache served whole);
    * ``keep_ahead(run, keys, start, new)`` (only when ``wants_running_order``):
      a running request offered more blocks and ``new`` were inserted; its
      other blocks the policy holds should keep ranking above them (tails
      leave before heads while a request runs too: vLLM offers a long prompt
      chunk by chunk as it computes it). ``keys``: every key the request used
      so far, head first, held or not; ``keys[:start]`` are unchanged since
      the previous call for ``run`` (a token, the same until ``end_run``), so
      that a policy can do O(new keys) work per offer
      (``KeyOrder.keep_run_ahead``). Not a use of the blocks;
    * ``end_run(run)`` (only when ``wants_running_order``): the request of
      ``run`` finished (before its ``on_access``);
    * ``on_store_misses(keys)``: new store candidates, each once per request,
      before their ``insert`` (ghost-list policies learn from them); returns
      the keys it learned from, so the manager remembers only those;
    * ``on_asked(keys)`` (only when ``wants_asks``): keys a request asks this
      cache for, as it asks: at a lookup, the keys up to and including the
      first one not ready; at an offer, those past where the request began
      asking (``keys[asked_from:]``, blocks it computed again or found after
      a miss). A key comes again each time it is asked again (vLLM asks at
      every step while a request waits; an offer repeats the lookup's
      first miss, or more of its keys where the offer holds them): a
      policy that counts asks keeps its own record of what it has
      counted. The manager's state is as of the ask: a resident key is one
      the request could have had;
    * ``admit(keys)`` (only when ``wants_admission``): new store candidates of
      one offer, in offer order, after the manager's own admission
      (``store_threshold``) and before any eviction; returns how many leading
      keys to store. The rest are declined: not stored, not inserted, reported
      in ``stores_skipped``, and still part of the request's access. Declining
      a suffix keeps every stored block's prefix stored with it.

    ``evict(n, protected)`` is atomic: it removes and returns exactly ``n``
    evictable keys not in ``protected``, or returns None and changes nothing.

    Base-class state: ``capacity`` and ``blocked`` (bounded by the number of
    resident blocks).
    """

    name: ClassVar[str] = "custom"
    wants_reuse: ClassVar[bool] = True
    """False when ``on_access`` ignores ``reused``; lets the manager skip computing it."""
    wants_store_misses: ClassVar[bool] = False
    """True when ``on_store_misses`` does something; lets the manager skip the calls."""
    wants_admission: ClassVar[bool] = False
    """True when ``admit`` may decline keys; lets the manager skip the calls."""
    wants_demand: ClassVar[bool] = False
    """True when the policy takes ``on_demand_access`` in place of ``on_access``."""
    wants_asks: ClassVar[bool] = False
    """True when ``on_asked`` does something; lets the manager skip the calls."""
    wants_running_order: ClassVar[bool] = False
    """True when ``keep_ahead`` does something; lets the manager skip computing its keys."""
    reads_key_bytes: ClassVar[bool] = True
    """False when no choice depends on a key's bytes, only on which keys are
    equal (the same figures under any renaming of the keys); lets ``kvtier
    replay --key-seed`` replay the policy once for every seed."""

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"policy capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self.blocked: set[bytes] = set()

    def on_store_misses(self, keys: list[bytes]) -> list[bytes]:
        """Learn from keys about to be inserted; return those it learned from."""
        return []

    def keep_ahead(self, run: object, keys: Sequence[bytes], start: int,
                   new: Container[bytes]) -> None:
        """Rank the held keys of ``keys`` (a running request's blocks, head
        first), but those in ``new``, above ``new`` (its blocks just inserted);
        nothing here."""
        return None

    def end_run(self, run: object) -> None:
        """Forget the running request of token ``run`` (it finished); nothing here."""
        return None

    def on_asked(self, keys: Collection[bytes]) -> None:
        """Keys a request asks for, each time it asks (``wants_asks``);
        nothing here."""
        return None

    def admit(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` (new candidates of one offer) to store: all."""
        return len(keys)

    @abstractmethod
    def insert(self, keys: list[bytes]) -> None:
        """Track new resident blocks (the manager has put them in ``blocked``)."""

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Forget a resident block that leaves without eviction."""

    @abstractmethod
    def on_access(self, keys: Sequence[bytes], reused: Container[bytes]) -> None:
        """Apply one request's access; ``keys`` head first, absent keys ignored."""

    def on_demand_access(self, keys: Sequence[bytes], reused: Container[bytes],
                         asked_from: int) -> None:
        """``on_access``, knowing that the request asked for ``keys[asked_from:]``."""
        self.on_access(keys, reused)

    @abstractmethod
    def evict(self, n: int, protected: Container[bytes]) -> list[bytes] | None:
        """Remove and return exactly ``n`` victims, or return None and change nothing."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every block (and any history)."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident blocks tracked."""

    def gauges(self) -> dict[str, int]:
        """The policy's own state worth graphing, by name (none here); the
        manager's ``stats()`` reports each as ``policy_<name>``. ``switches``
        is exported as a counter: keep it across ``clear()`` (one that drops
        is read as restarted from 0, and the increase since its last report
        is lost)."""
        return {}

    def sizes(self) -> dict[str, int]:
        """Entries of each structure the policy keeps (cheap; for diagnostics and
        the soak). The base reports the resident blocks; policies add their own."""
        return {"resident": len(self)}
