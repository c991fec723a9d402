"""The store gate: which new blocks of an offer the CPU tier stores.

Two admissions, applied in order to the new keys of one offer: the offer
count (``store_threshold``, an :class:`~kvtier.admission.AdmissionTracker`),
then the policy's own (``EvictionPolicy.admit``, for a policy that
``wants_admission``). Eviction is not the gate's business: what passes it
still needs slots (``OffloadManager._make_room``).
"""

from __future__ import annotations

from kvtier.admission import AdmissionTracker
from kvtier.errors import ProtocolError
from kvtier.keys import GROUP_BYTES
from kvtier.policies import EvictionPolicy
from kvtier.request import RequestContext


class StoreGate:
    """Filters an offer's new keys; counts each key it declines once per request.

    Owns the admission tracker (None while ``store_threshold < 2``: every
    offer passes it), the switch ``policy_admission`` and the counters
    ``skipped`` (every decline) and ``below_threshold`` (its part the offer
    count declined). Invariants: what passes is a subsequence of the candidates
    in their order, and what the policy declines is a suffix in token order
    (so a stored block's prefix is stored with it; a hybrid model's offer
    lists its KV groups one after the other, and a suffix of that list would
    drop whole groups, whose blocks every hit needs); a key declined again by
    the same request is not counted again (the request's ``skipped`` set, bounded by
    its offers). Memory: the tracker's, at most ``max_tracker_size`` keys.
    """

    __slots__ = ("_policy", "_tracker", "below_threshold", "policy_admission", "skipped")

    def __init__(self, policy: EvictionPolicy, store_threshold: int,
                 max_tracker_size: int) -> None:
        tracker = AdmissionTracker(store_threshold, max_tracker_size)  # checks both
        self._policy = policy
        self._tracker = tracker if store_threshold >= 2 else None
        self.policy_admission = True
        """Whether the policy's ``admit`` may decline new blocks (when it
        ``wants_admission``); a ``TierCascade`` turns it off, since the tiers
        below store what the CPU tier stores."""
        self.skipped = 0
        """Keys declined, each once per request (``stats()["stores_skipped"]``)."""
        self.below_threshold = 0
        """The part of ``skipped`` the offer count declined
        (``stats()["stores_below_threshold"]``): vLLM's
        ``vllm:kv_offload_stores_skipped`` counts only these ("reuse threshold
        not reached"), not the policy's declines."""

    def __len__(self) -> int:
        """Keys the tracker counts offers of."""
        return 0 if self._tracker is None else len(self._tracker)

    def offers(self, key: bytes) -> int:
        """How many requests offered ``key`` (0 when untracked or threshold < 2)."""
        return 0 if self._tracker is None else self._tracker.count(key)

    def admit(self, candidates: list[bytes], ctx: RequestContext) -> list[bytes]:
        """The candidates (distinct new keys of ``ctx``'s offer) to store."""
        if self._tracker is not None:
            candidates, declined = self._tracker.record(candidates, ctx.counted)
            if declined:
                self.below_threshold += self._count(declined, ctx)
        if candidates and self.policy_admission and self._policy.wants_admission:
            ranked = candidates
            n = self._admit(ranked)
            if n < len(ranked) and _several_groups(ranked):
                ranked = _token_order(ranked, ctx.positions)
                n = self._admit(ranked)
            if n < len(ranked):
                self._count(ranked[n:], ctx)
                if ranked is candidates:
                    candidates = candidates[:n]
                else:  # in the offer's order: vLLM pairs it with the granted slots
                    kept = set(ranked[:n])
                    candidates = [k for k in candidates if k in kept]
        return candidates

    def _admit(self, keys: list[bytes]) -> int:
        """The policy's ``admit(keys)``, checked."""
        n = self._policy.admit(keys)
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= len(keys):
            raise ProtocolError(
                f"{type(self._policy).__name__}.admit returned {n!r}, not an int in "
                f"0..{len(keys)}")
        return n

    def _count(self, declined: list[bytes], ctx: RequestContext) -> int:
        """Add the keys ``ctx`` has not had declined before to ``skipped``;
        return how many that was."""
        seen = ctx.skipped
        new = [k for k in declined if k not in seen] if seen else declined
        seen.update(new)
        self.skipped += len(new)
        return len(new)

    def clear(self) -> None:
        """Forget the offer counts (``skipped`` and ``below_threshold`` are
        counters and stay)."""
        if self._tracker is not None:
            self._tracker.clear()


def _several_groups(keys: list[bytes]) -> bool:
    """Whether ``keys`` belong to more than one KV group (a hybrid model's offer)."""
    first = keys[0][-GROUP_BYTES:]
    return any(k[-GROUP_BYTES:] != first for k in keys)


def _token_order(keys: list[bytes], positions: dict[bytes, int]) -> list[bytes]:
    """``keys`` by end-token position (vLLM offers a hybrid model's blocks
    group by group), keys without a position last; the sort is stable, so
    the groups of one position keep the offer's order."""
    return sorted(keys, key=lambda k: (k not in positions, positions.get(k, 0)))
