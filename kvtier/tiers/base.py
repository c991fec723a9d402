"""The interface of a secondary tier (disk, Redis), as the tier cascade sees it.

A tier stores opaque block payloads under block keys, inside one namespace
(``kvtier.tiers.namespace``), each value checksummed (``kvtier.tiers.blockfile``).
Every call is batch-oriented and thread-safe, so the cascade's I/O threads can
call one tier concurrently. The contract:

``contains(keys) -> list[bool]``
    Whether each key is (believed) stored. Cheap: no payload is read. A True may
    still turn into a miss at ``get`` time (another engine evicted the block, or
    it is found corrupt), so callers must handle that.
``get_into(keys, buffers) -> list[int | None]``
    Reads each key's payload into the matching writable buffer (for example a
    reserved CPU slot, ``SlotRegion.slot_array(slot)``), verifying the
    checksum. Returns the payload length, or None for a miss, in which case the
    buffer's contents are unspecified (it may hold part of a rejected value).
    A payload larger than its buffer is a corrupt block.
``get(keys) -> list[memoryview | None]``
    Same, into new buffers (tools, tests).
``put(items) -> list[bool]``
    Stores ``(key, payload)`` pairs; the payload may be any C-contiguous buffer
    (a CPU slot's array), read during the call only. True: the block is stored
    (the disk tier skips a block it already holds; Redis overwrites it, the same
    key always meaning the same bytes, so a cascade avoiding duplicate transfers
    asks ``contains`` first). False: the store was dropped (no room, ENOSPC,
    server full, server down, breaker open). Never raises for I/O trouble.
``delete(keys) -> int``
    Removes blocks; returns how many were present.
``stats() -> dict``
    Counters (all tiers): ``hits``, ``misses`` (keys asked of ``get``/``get_into``;
    ``contains`` counts nothing), ``stores`` (blocks written), ``dropped_stores``,
    ``corrupt`` (values that failed a check and were removed), ``evictions`` (by
    the tier itself; Redis evicts server-side), ``errors`` (I/O or server
    failures), plus tier-specific entries.
``take_events() -> list[TierEvent]``
    Pending events (bounded; when disabled, always empty).
``available``
    False while the tier is known to be failing (breaker open): the cascade may
    skip it without paying for the call.

Failures degrade: an I/O error is a miss or a dropped store, counted in
``errors`` and logged, never an exception. Exceptions are for the caller's
mistakes only: bad config (:class:`TierConfigError`), keys that are not bytes,
payloads beyond the tier's ``max_block_bytes``, a closed tier.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

from kvtier.argtypes import is_positive_seconds
from kvtier.errors import KVTierError
from kvtier.events import Event
from kvtier.keys import check_keys
from kvtier.tiers.blockfile import BytesLike, byte_view

TierEventKind = Literal["stored", "removed", "corrupt", "breaker_open", "breaker_closed"]

DEFAULT_MAX_TIER_EVENTS: Final = 10_000
"""Pending events a tier keeps by default (``max_events``); oldest dropped first."""

COUNTERS = ("hits", "misses", "stores", "dropped_stores", "corrupt", "evictions", "errors")
"""Counters every tier reports in ``stats()``."""


class TierConfigError(KVTierError, ValueError):
    """A tier's configuration cannot work; the message names the setting."""


class TierUnavailableError(KVTierError, ConnectionError):
    """Raised only by explicit health checks (``RedisTier.check``), never by I/O calls."""


@dataclass(frozen=True, slots=True)
class TierEvent:
    """Something that happened to blocks of a tier.

    ``stored``: blocks became readable. ``removed``: blocks left the tier
    (``detail``: ``evicted``, ``deleted``, ``gone``). ``corrupt``: a value
    failed its check and was removed (``detail``: the reason). ``breaker_open``
    / ``breaker_closed``: the tier stopped / resumed serving (no keys).
    """

    kind: TierEventKind
    keys: tuple[bytes, ...]
    tier: str
    detail: str = ""

    def as_event(self) -> Event | None:
        """The manager-level ``Event`` (medium = tier name upper-cased), if any."""
        if self.kind == "stored":
            return Event(self.keys, "stored", self.tier.upper())
        if self.kind in ("removed", "corrupt"):
            return Event(self.keys, "removed", self.tier.upper())
        return None


class TierEventLog:
    """At most ``max_events`` pending events; older ones dropped and counted."""

    def __init__(self, tier: str, enabled: bool, max_events: int = DEFAULT_MAX_TIER_EVENTS) -> None:
        if isinstance(max_events, bool) or not isinstance(max_events, int) or max_events < 1:
            raise TierConfigError(f"max_events must be an int >= 1, got {max_events!r}")
        self.tier = tier
        self.enabled = enabled
        self.dropped = 0
        self._events: deque[TierEvent] = deque(maxlen=max_events)
        self._lock = threading.Lock()

    def emit(self, kind: TierEventKind, keys: Sequence[bytes] = (), detail: str = "") -> None:
        """Record one event (when enabled); breaker events may have no keys."""
        if not self.enabled or (not keys and kind not in ("breaker_open", "breaker_closed")):
            return
        with self._lock:
            if len(self._events) == self._events.maxlen:
                self.dropped += 1
            self._events.append(TierEvent(kind, tuple(keys), self.tier, detail))

    def take(self) -> list[TierEvent]:
        with self._lock:
            out = list(self._events)
            self._events.clear()
        return out

    def __len__(self) -> int:
        """Events not taken yet (at most ``max_events``)."""
        return len(self._events)


def seconds_setting(tier: str, name: str, value: object) -> float:
    """``value`` as seconds; ``TierConfigError`` naming ``tier`` and ``name``
    unless it is a finite number > 0 (``kvtier.argtypes.is_positive_seconds``)."""
    if not is_positive_seconds(value):
        raise TierConfigError(f"{tier}: {name} must be a finite number of seconds > 0, "
                              f"got {value!r}")
    return float(value)  # type: ignore[arg-type]


class Counters:
    """Thread-safe integer counters, starting with :data:`COUNTERS` at 0."""

    def __init__(self, *extra: str) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys((*COUNTERS, *extra), 0)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] += n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


class WarningLimiter:
    """Logs each warning template at most once per ``interval_s``; the next one
    says how many were suppressed. Bounded by the number of templates in the code."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(msg, -self._interval_s) < self._interval_s:
                self._suppressed[msg] = self._suppressed.get(msg, 0) + 1
                return
            self._last[msg] = now
            suppressed = self._suppressed.pop(msg, 0)
        if suppressed:
            msg += f" ({suppressed} similar warnings suppressed)"
        self._logger.warning(msg, *args)


class Tier(ABC):
    """A secondary tier; see the module docstring for the contract."""

    name: str = "tier"
    """Short lower-case name; the events' medium is its upper-cased form."""

    remote: bool = False
    """``contains`` costs a network round trip: the tier cascade asks it in
    batches from an I/O thread (answering RETRY meanwhile), not per key on the
    scheduler thread."""

    namespace: str

    @abstractmethod
    def contains(self, keys: Sequence[bytes]) -> list[bool]: ...

    def contains_waiting(self, keys: Sequence[bytes]) -> list[bool]:
        """``contains`` for a thread that may wait on the storage as long as it
        takes (the I/O threads' check before a write), where ``contains`` may
        give up at a deadline kept for the scheduler's thread; here the same."""
        return self.contains(keys)

    @abstractmethod
    def get_into(self, keys: Sequence[bytes], buffers: Sequence[BytesLike]) -> list[int | None]: ...

    @abstractmethod
    def get(self, keys: Sequence[bytes]) -> list[memoryview | None]: ...

    @abstractmethod
    def put(self, items: Sequence[tuple[bytes, BytesLike]]) -> list[bool]: ...

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> int: ...

    @abstractmethod
    def stats(self) -> dict[str, int | float | str]: ...

    @abstractmethod
    def take_events(self) -> list[TierEvent]: ...

    @property
    def available(self) -> bool:
        """Whether a call may go now (a circuit breaker's probe included)."""
        return True

    @property
    def serving(self) -> bool:
        """Whether the tier's calls last found it working: the
        ``vllm:kvtier_tier_available`` gauge. Unlike ``available``, False from
        a breaker's opening until a probe succeeds, also while no call comes to
        probe (steps that only decode look nothing up). By default ``available``."""
        return self.available

    def debug_state(self) -> dict[str, int]:
        """Entries of the tier's in-process structures (cheap: the length of
        each; each tier's docstring states their bounds). None by default."""
        return {}

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Tier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_batch(keys: Sequence[bytes], what: str = "keys") -> list[bytes]:
    """``keys`` as a list of bytes keys (``TypeError`` otherwise)."""
    return check_keys(keys, what)


def check_items(items: Sequence[tuple[bytes, BytesLike]]) -> tuple[list[bytes], list[memoryview]]:
    """The keys and byte views of ``put``'s ``(key, payload)`` pairs (``TypeError`` otherwise)."""
    if isinstance(items, (bytes, str)):
        raise TypeError("items must be a sequence of (key, payload) pairs")
    pairs = list(items)
    keys = check_batch([k for k, _ in pairs])
    return keys, [byte_view(p) for _, p in pairs]


def check_buffers(keys: list[bytes], buffers: Sequence[BytesLike]) -> None:
    if len(buffers) != len(keys):
        raise ValueError(f"got {len(keys)} keys but {len(buffers)} buffers")
