"""Endless generated traffic: a seeded mix of workload kinds, in bounded memory.

``kvtier.replay.generate`` builds a whole trace at once and interns every
prefix it makes (its memory grows with the trace). :class:`TrafficMix` draws
each request's kind from a weighted mix and takes it from that kind's current
*chunk*: ``generate(kind, seed, chunk)`` with a new seed for each chunk, so it
holds at most one chunk per kind, however many requests it serves. Chunks do
not share content (a chunk's ids are namespaced by kind and chunk number), so
reuse lives within a chunk: a conversation, a corpus, an agent run.

Keys look like vLLM's: a 32-byte hash (kind, chunk and the chunk's hash id)
and a 4-byte KV group (``kvtier.block_key``), 36 bytes in all.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from kvtier.keys import block_key
from kvtier.replay.generate import KINDS, generate
from kvtier.replay.trace import TraceRequest

DEFAULT_KINDS = ("chat", "shared", "rag", "agent", "scan")
"""The soak's mix: conversations, shared prompts, documents, agents, scans."""
DEFAULT_CHUNK = 2_000
"""Requests generated at a time per kind."""
HASH_BYTES = 32


class TrafficMix:
    """Requests of ``kinds`` (each with weight ``weights[i]``, default equal),
    drawn in a fixed order from ``seed``.

    Owns one chunk of generated requests per kind (at most ``chunk`` each,
    a cursor into it) and the mix's own random generator; nothing else grows
    with the requests served (``served`` counts them). Invariant: the same
    arguments give the same requests.
    """

    __slots__ = ("kinds", "weights", "chunk", "seed", "served", "_rng", "_chunks",
                 "_chunk_no")

    def __init__(self, kinds: Sequence[str] = DEFAULT_KINDS, seed: int = 0,
                 chunk: int = DEFAULT_CHUNK, weights: Sequence[float] | None = None) -> None:
        unknown = [k for k in kinds if k not in KINDS]
        if not kinds or unknown:
            raise ValueError(f"unknown workload kinds {unknown or '(none given)'}; "
                             f"known: {', '.join(KINDS)}")
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk must be an int >= 1, got {chunk!r}")
        self.kinds = tuple(kinds)
        self.weights = tuple(weights) if weights is not None else (1.0,) * len(self.kinds)
        if len(self.weights) != len(self.kinds) or any(w < 0 for w in self.weights) \
                or not any(self.weights):
            raise ValueError(f"need one non-negative weight per kind, got {self.weights}")
        self.chunk = chunk
        self.seed = seed
        self.served = 0
        self._rng = random.Random(f"kvtier-mix-{seed}")
        self._chunks: list[Iterator[TraceRequest]] = [iter(()) for _ in self.kinds]
        self._chunk_no = [-1] * len(self.kinds)

    def _next_of(self, i: int) -> tuple[int, TraceRequest]:
        """The next request of kind ``i`` and its chunk number."""
        request = next(self._chunks[i], None)
        if request is None:  # a new chunk, with its own seed (the kind seeds it too)
            self._chunk_no[i] += 1
            seed = self.seed << 32 | self._chunk_no[i]
            self._chunks[i] = iter(generate(self.kinds[i], seed, self.chunk))
            request = next(self._chunks[i])
        return self._chunk_no[i], request

    def next_keys(self) -> tuple[str, list[bytes]]:
        """The next request: its kind and its block keys, head first."""
        i = self._rng.choices(range(len(self.kinds)), weights=self.weights)[0]
        chunk_no, request = self._next_of(i)
        prefix = (i << 40 | chunk_no) << 64
        self.served += 1
        return self.kinds[i], [block_key((prefix | h).to_bytes(HASH_BYTES, "big"))
                               for h in request.hash_ids]

    def sizes(self) -> dict[str, int]:
        """What the mix holds: chunks in memory (one per kind at most)."""
        return {"chunks": sum(1 for n in self._chunk_no if n >= 0), "served": self.served}
