"""Cache events for subscribers (vLLM's KV events, metrics)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Final, Literal

from kvtier.argtypes import require_positive_int

EventKind = Literal["stored", "removed"]

DEFAULT_MAX_EVENTS: Final = 100_000
"""Pending events a log keeps by default (``max_events``); oldest dropped first."""


@dataclass(frozen=True, slots=True)
class Event:
    """Blocks that became loadable (``stored``) or left (``removed``) a medium."""

    keys: tuple[bytes, ...]
    kind: EventKind
    medium: str = "CPU"


class EventLog:
    """Events not yet taken, at most ``max_events`` of them.

    When nobody drains the log, the oldest events are dropped and counted in
    ``dropped``, so an idle subscriber cannot grow memory without bound.
    """

    __slots__ = ("enabled", "dropped", "_events")

    def __init__(self, enabled: bool, max_events: int = DEFAULT_MAX_EVENTS) -> None:
        require_positive_int("max_events", max_events)
        self.enabled = enabled
        self.dropped = 0
        self._events: deque[Event] = deque(maxlen=max_events)

    def emit(self, keys: list[bytes], kind: EventKind, medium: str = "CPU") -> None:
        """Record one event when enabled and ``keys`` is not empty."""
        if not self.enabled or not keys:
            return
        if len(self._events) == self._events.maxlen:
            self.dropped += 1
        self._events.append(Event(tuple(keys), kind, medium))

    def __len__(self) -> int:
        """Events not taken yet."""
        return len(self._events)

    def take(self) -> list[Event]:
        """Return and forget every pending event, oldest first."""
        out = list(self._events)
        self._events.clear()
        return out
