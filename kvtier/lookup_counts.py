"""The manager's hit and miss counters, counted once per request.

vLLM asks again for a waiting request's blocks at every scheduler step, so
counting every lookup would grow the hits with the queue's length. A hit is
counted when its key is newly leased to the request (a key the request still
holds leased is not counted again). A lookup's misses are counted unless the
request had a counted lookup miss at the same key before
(``RequestContext.missed_at``): vLLM asks key by key (``lookup_one``), group
by group for a model with several KV groups, goes on past a RETRY (a block a
remote tier has not answered for yet) and scans a sliding-window group from
its end, so the keys a waiting request misses at recur in turn, not one after
the other. A block that misses and is found by a later lookup of the same
request counts once as a miss and once as a hit.
"""

from __future__ import annotations

from kvtier.request import RequestContext


class LookupCounts:
    """Owns two counters, ``hits`` and ``misses``; both only grow."""

    __slots__ = ("hits", "misses")

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0

    def count(self, ctx: RequestContext, fresh_hits: int, missed_at: bytes | None,
              misses: int) -> None:
        """Count one lookup of ``ctx``: ``fresh_hits`` keys newly leased to it,
        and ``misses`` keys from ``missed_at``, its first missing key (None:
        none missed). ``ctx.missed_at`` grows by at most one key per call, a
        key the request asked for: bounded by the request's keys."""
        self.hits += fresh_hits
        if missed_at is not None and missed_at not in ctx.missed_at:
            self.misses += misses
            ctx.missed_at.add(missed_at)
