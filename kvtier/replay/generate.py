"""Seeded synthetic workloads in the Mooncake trace format.

Every kind models a prompt as a sequence of content blocks of 512 tokens and
turns it into ``hash_ids`` the way an engine's prefix hashes work: block j's id
depends on the content of blocks 0..j (a trie of contents), so the same
document after a different prefix gets new ids, and two requests share an id
exactly when they share the whole prefix up to that block.

Kinds (``KINDS``):

* ``chat`` -- multi-turn conversations: each turn resends the conversation so
  far (a short global system prompt, earlier questions and answers) plus a new
  question; many conversations are in flight at once and interleave.
* ``shared`` -- many users, a few system prompts of Zipf popularity; each user
  asks one to three short questions after the prompt.
* ``rag`` -- retrieval-augmented questions: a system prompt, one to three
  documents drawn with Zipf popularity from a large corpus, a one-off question.
* ``agent`` -- agent loops: a long tool/instruction prompt (a few agent types),
  a task, then many steps that each append a small tool call and result.
* ``scan`` -- ``chat`` traffic mixed with long one-off prompts (no reuse at
  all), the pattern that flushes a recency-only cache.
* ``loop`` -- a corpus of documents larger than the caches read again and
  again in the same order (a nightly batch over a knowledge base): LRU keeps
  nothing, OPT keeps a fraction.
* ``phase`` -- the traffic changes kind every quarter of the trace (chat,
  rag, loop, agent), each phase with fresh content: the best policy changes
  mid-trace.
* ``tenants`` -- a multi-tenant mixture: chat, rag, agent and shared tenants
  of different rates interleaved by arrival time, no content shared across
  tenants.
* ``drift`` -- popularity drift: one document of Zipf popularity and a
  one-off question per request, where the ranking moves one place every few
  requests, so each document climbs from cold to the top and then drops to
  the bottom at once (yesterday's news): counts lag what is popular now.

``generate(kind, seed, requests)`` is deterministic in its arguments.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable
from pathlib import Path

from kvtier.replay.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

MEAN_GAP_MS = 250.0
"""Mean time between two arrivals (Poisson arrivals, 4 requests per second)."""


class _Prefixes:
    """Interns content-block paths into prefix-hash ids (a trie of contents)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, int], int] = {}
        self._content = 0

    def fresh(self, n: int) -> list[int]:
        """``n`` content blocks never seen before."""
        start = self._content
        self._content += n
        return list(range(start, start + n))

    def ids(self, contents: Iterable[int]) -> list[int]:
        """The hash ids of a prompt made of ``contents``, in order."""
        table = self._ids
        parent = -1
        out = []
        for content in contents:
            node = (parent, content)
            hid = table.get(node)
            if hid is None:
                hid = table[node] = len(table)
            out.append(hid)
            parent = hid
        return out


class _Zipf:
    """Draws ranks 0..n-1 with probability proportional to 1 / (rank + 1) ** s."""

    def __init__(self, rng: random.Random, n: int, s: float) -> None:
        self._rng = rng
        weights = [1.0 / (i + 1) ** s for i in range(n)]
        total = 0.0
        self._cum = []
        for w in weights:
            total += w
            self._cum.append(total)

    def draw(self) -> int:
        return min(
            self._rng.choices(range(len(self._cum)), cum_weights=self._cum)[0],
            len(self._cum) - 1,
        )


class _Builder:
    """Collects requests with Poisson timestamps and consistent token lengths."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.prefixes = _Prefixes()
        self.requests: list[TraceRequest] = []
        self._clock = 0.0

    def add(self, contents: list[int], output_tokens: int) -> None:
        rng = self.rng
        hash_ids = self.prefixes.ids(contents)
        partial = rng.randrange(MOONCAKE_BLOCK_TOKENS)  # the last block is partly filled
        input_length = max(1, len(hash_ids) * MOONCAKE_BLOCK_TOKENS - partial)
        self.requests.append(
            TraceRequest(int(self._clock), input_length, output_tokens, tuple(hash_ids))
        )
        self._clock += rng.expovariate(1.0 / MEAN_GAP_MS)


def _output_tokens(rng: random.Random) -> int:
    return int(rng.lognormvariate(math.log(300), 0.8)) + 1


# -- kinds ------------------------------------------------------------------------


def _chat(b: _Builder, n: int, *, scan_share: float = 0.0) -> None:
    """Interleaved multi-turn conversations (and one-off long prompts when scanning)."""
    rng, prefixes = b.rng, b.prefixes
    system = prefixes.fresh(2)
    active: list[tuple[list[int], int]] = []  # (history contents, turns left)
    width = 192  # conversations in flight
    while len(b.requests) < n:
        if scan_share and rng.random() < scan_share:
            b.add(system[:1] + prefixes.fresh(rng.randint(48, 192)), _output_tokens(rng))
            continue
        while len(active) < width:
            turns = 1 + int(rng.expovariate(1 / 4.0))
            active.append((list(system), turns))
        i = rng.randrange(len(active))
        history, left = active[i]
        question = prefixes.fresh(rng.randint(1, 4))
        prompt = history + question
        out = _output_tokens(rng)
        b.add(prompt, out)
        answer = prefixes.fresh(max(1, round(out / MOONCAKE_BLOCK_TOKENS)))
        if left <= 1 or len(prompt) > 400:
            active[i] = active[-1]
            active.pop()
        else:
            active[i] = (prompt + answer, left - 1)


def _shared(b: _Builder, n: int) -> None:
    """A few system prompts of Zipf popularity; short sessions of one-off questions."""
    rng, prefixes = b.rng, b.prefixes
    prompts = [prefixes.fresh(rng.randint(8, 64)) for _ in range(200)]
    pick = _Zipf(rng, len(prompts), 1.1)
    sessions: list[tuple[list[int], int]] = []
    while len(b.requests) < n:
        if not sessions or rng.random() < 0.35:
            sessions.append((list(prompts[pick.draw()]), rng.randint(1, 3)))
        i = rng.randrange(len(sessions))
        history, left = sessions[i]
        prompt = history + prefixes.fresh(rng.randint(1, 3))
        out = _output_tokens(rng)
        b.add(prompt, out)
        if left <= 1:
            sessions[i] = sessions[-1]
            sessions.pop()
        else:
            sessions[i] = (prompt + prefixes.fresh(1), left - 1)
        if len(sessions) > 256:
            sessions.pop(0)


def _rag(b: _Builder, n: int) -> None:
    """System prompt + 1-3 Zipf-popular documents + a one-off question."""
    rng, prefixes = b.rng, b.prefixes
    system = prefixes.fresh(2)
    docs = [prefixes.fresh(rng.randint(2, 12)) for _ in range(max(200, n // 3))]
    pick = _Zipf(rng, len(docs), 0.9)
    while len(b.requests) < n:
        contents = list(system)
        chosen = dict.fromkeys(pick.draw() for _ in range(rng.randint(1, 3)))
        for d in chosen:
            contents += docs[d]
        contents += prefixes.fresh(rng.randint(1, 2))
        b.add(contents, _output_tokens(rng))


def _agent(b: _Builder, n: int) -> None:
    """Agent sessions: a long shared tool prompt, a task, many small appended steps."""
    rng, prefixes = b.rng, b.prefixes
    tools = [prefixes.fresh(rng.randint(24, 64)) for _ in range(8)]
    pick = _Zipf(rng, len(tools), 1.0)
    running: list[tuple[list[int], int]] = []
    width = 64
    while len(b.requests) < n:
        while len(running) < width:
            task = tools[pick.draw()] + prefixes.fresh(rng.randint(2, 8))
            running.append((task, rng.randint(5, 60)))
        i = rng.randrange(len(running))
        prompt, left = running[i]
        b.add(prompt, rng.randint(20, 200))
        grown = prompt + prefixes.fresh(rng.randint(1, 2))  # tool call + its result
        if left <= 1 or len(grown) > 600:
            running[i] = running[-1]
            running.pop()
        else:
            running[i] = (grown, left - 1)


def _scan(b: _Builder, n: int) -> None:
    _chat(b, n, scan_share=0.25)


LOOP_DOCUMENTS = 400
LOOP_DOC_BLOCKS = (12, 28)
"""The loop corpus: 400 documents of 12-28 blocks, about 8,000 blocks in all."""


def _loop(b: _Builder, n: int) -> None:
    """A system prompt, then the corpus's documents in a fixed cyclic order, each
    with a one-off question."""
    rng, prefixes = b.rng, b.prefixes
    system = prefixes.fresh(1)
    docs = [prefixes.fresh(rng.randint(*LOOP_DOC_BLOCKS)) for _ in range(LOOP_DOCUMENTS)]
    i = 0
    while len(b.requests) < n:
        b.add(system + docs[i % len(docs)] + prefixes.fresh(1), rng.randint(20, 200))
        i += 1


PHASES = ("chat", "rag", "loop", "agent")


def _phase(b: _Builder, n: int) -> None:
    """Each quarter of the trace another kind of traffic (``PHASES``)."""
    for k, kind in enumerate(PHASES, 1):
        KINDS[kind](b, n * k // len(PHASES))


TENANTS = (("chat", 0.4), ("rag", 0.3), ("agent", 0.2), ("shared", 0.1))
"""Tenants of the ``tenants`` mixture: their traffic and share of the requests."""
TENANT_ID_STRIDE = 1 << 40
"""Hash ids of tenant t start at t * TENANT_ID_STRIDE: no block is shared."""


def _tenants(b: _Builder, n: int) -> None:
    """Each tenant's own trace at its share of the arrival rate, merged by time."""
    merged: list[TraceRequest] = []
    counts = [max(1, round(n * share)) for _, share in TENANTS]
    for t in range(n - sum(counts)):  # rounding down left requests out: add them,
        counts[t % len(counts)] += 1  # so the trace has n requests
    for t, (kind, share) in enumerate(TENANTS):
        sub = _Builder(random.Random(f"{b.rng.random()}-{kind}"))
        KINDS[kind](sub, counts[t])
        for r in sub.requests:
            merged.append(TraceRequest(int(r.timestamp / share), r.input_length,
                                       r.output_length,
                                       tuple(h + t * TENANT_ID_STRIDE for h in r.hash_ids)))
    merged.sort(key=lambda r: r.timestamp)
    b.requests.extend(merged[: n - len(b.requests)])


DRIFT_DOCUMENTS = 2000
DRIFT_DOC_BLOCKS = (4, 30)
DRIFT_REQUESTS_PER_PLACE = 3
"""The drift corpus: 2,000 documents of 4-30 blocks; the popularity ranking
moves one place every 3 requests (a full turn every 6,000 requests)."""


def _drift(b: _Builder, n: int) -> None:
    """A document drawn from a Zipf ranking that rotates over time, plus a one-off question."""
    rng, prefixes = b.rng, b.prefixes
    docs = [prefixes.fresh(rng.randint(*DRIFT_DOC_BLOCKS)) for _ in range(DRIFT_DOCUMENTS)]
    pick = _Zipf(rng, len(docs), 0.9)
    i = 0
    while len(b.requests) < n:
        doc = (pick.draw() + i // DRIFT_REQUESTS_PER_PLACE) % len(docs)
        b.add(docs[doc] + prefixes.fresh(rng.randint(1, 4)), _output_tokens(rng))
        i += 1


KINDS: dict[str, Callable[[_Builder, int], None]] = {
    "chat": _chat,
    "shared": _shared,
    "rag": _rag,
    "agent": _agent,
    "scan": _scan,
    "loop": _loop,
    "phase": _phase,
    "tenants": _tenants,
    "drift": _drift,
}
"""Workload generators by name."""


def generate(kind: str, seed: int = 0, requests: int = 10_000) -> list[TraceRequest]:
    """``requests`` requests of workload ``kind``; the same arguments give the same trace."""
    if kind not in KINDS:
        raise ValueError(f"unknown workload {kind!r}; known workloads: {', '.join(KINDS)}")
    if isinstance(requests, bool) or not isinstance(requests, int) or requests < 1:
        raise ValueError(f"requests must be an int >= 1, got {requests!r}")
    b = _Builder(random.Random(f"kvtier-{kind}-{seed}"))
    KINDS[kind](b, requests)
    return b.requests[:requests]


def trace_line(request: TraceRequest) -> str:
    """One request as a Mooncake jsonl line (no newline)."""
    return json.dumps({
        "timestamp": request.timestamp,
        "input_length": request.input_length,
        "output_length": request.output_length,
        "hash_ids": list(request.hash_ids),
    })


def write_trace(requests: Iterable[TraceRequest], path: str | Path) -> int:
    """Write ``requests`` as Mooncake jsonl to ``path``; return how many were written."""
    count = 0
    with Path(path).open("w", encoding="utf-8") as fh:
        for request in requests:
            fh.write(trace_line(request) + "\n")
            count += 1
    return count
