"""Asynchronous existence checks of a remote tier, as the scheduler sees them.

A remote tier's ``contains`` is a network round trip (Redis). Asking it on the
scheduler thread, one key at a time, would stall every request of the engine
behind the slowest server answer. Instead the tier cascade asks
:class:`ExistenceProbes` (a dict lookup), which answers from what it knows and
collects the unknown keys; once per scheduling step they go to an I/O thread as
one batch (one pipelined round trip) and the answers come back through
:meth:`ExistenceProbes.answer`. Meanwhile the lookup reports RETRY, which vLLM's
scheduler treats as "not a hit yet, ask again next step".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.argtypes import is_positive_seconds

DEFAULT_PROBE_TTL_S = 2.0
DEFAULT_PROBE_TIMEOUT_S = 1.0
"""A healthy server answers in milliseconds; past this a request stops waiting
(a stuck server costs a new request at most this long, not its socket timeout)."""
DEFAULT_MAX_PROBES = 65_536


@dataclass(slots=True)
class _Answer:
    found: bool | None  # None: not answered yet
    since: float  # when asked (pending) or answered
    submitted: bool = False


class ExistenceProbes:
    """What the scheduler knows of which keys one remote tier holds.

    Owns ``_known`` (key -> answer, least recently asked first, at most
    ``max_keys`` entries: the oldest are forgotten first) and ``_batch`` (keys
    of ``_known`` asked for and not yet handed out by :meth:`take_batch`).
    Scheduler thread only.

    Invariants: an answer is trusted for ``ttl_s`` after it arrived, then the
    key is asked again; a question unanswered for ``timeout_s`` counts as "not
    found" (so a stuck server turns into misses, never into endless RETRY); a
    key is in at most one batch in flight.
    """

    __slots__ = ("ttl_s", "timeout_s", "max_keys", "_known", "_batch")

    def __init__(
        self,
        ttl_s: float = DEFAULT_PROBE_TTL_S,
        timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
        max_keys: int = DEFAULT_MAX_PROBES,
    ) -> None:
        for name, value in (("ttl_s", ttl_s), ("timeout_s", timeout_s)):
            if not is_positive_seconds(value):
                raise ValueError(f"probe {name} must be a finite number of seconds > 0, "
                                 f"got {value!r}")
        if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys < 1:
            raise ValueError(f"max_probes must be an int >= 1, got {max_keys!r}")
        self.ttl_s = float(ttl_s)
        self.timeout_s = float(timeout_s)
        self.max_keys = max_keys
        self._known: OrderedDict[bytes, _Answer] = OrderedDict()
        self._batch: dict[bytes, None] = {}

    def __len__(self) -> int:
        return len(self._known)

    def sizes(self) -> dict[str, int]:
        """Keys known (at most ``max_keys``) and asked for the next batch (a
        subset of them)."""
        return {"known": len(self._known), "batch": len(self._batch)}

    def ask(self, key: bytes, now: float) -> bool | None:
        """True / False when known, None while the answer is awaited (a new or
        expired key joins the next batch)."""
        entry = self._known.get(key)
        if entry is not None:
            if entry.found is None:
                return False if now - entry.since > self.timeout_s else None
            if now - entry.since <= self.ttl_s:
                return entry.found
        known = self._known
        known[key] = _Answer(None, now)
        known.move_to_end(key)
        if len(known) > self.max_keys:
            oldest, _ = known.popitem(last=False)
            self._batch.pop(oldest, None)
        self._batch[key] = None
        return None

    def take_batch(self) -> list[bytes]:
        """The keys to ask the tier about now (each at most once in flight)."""
        batch, self._batch = self._batch, {}
        out: list[bytes] = []
        for key in batch:
            entry = self._known.get(key)
            if entry is not None and entry.found is None and not entry.submitted:
                entry.submitted = True
                out.append(key)
        return out

    def answer(self, keys: Sequence[bytes], found: Sequence[bool], now: float) -> None:
        """Record the tier's answers for a batch from :meth:`take_batch`."""
        for key, hit in zip(keys, found, strict=True):
            entry = self._known.get(key)
            if entry is not None and entry.found is None:
                entry.found = bool(hit)
                entry.since = now

    def forget(self, key: bytes) -> None:
        """Drop what is known of ``key`` (promoted, or found corrupt)."""
        self._known.pop(key, None)

    def clear(self) -> None:
        self._known.clear()
        self._batch.clear()
