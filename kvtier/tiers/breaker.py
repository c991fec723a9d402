"""A thread-safe circuit breaker for a remote tier.

States:

``closed``
    Calls go through. ``failure_threshold`` consecutive failures open it.
``open``
    Calls are refused (``allow()`` is False) until ``open_s`` has passed since
    it opened; ``open_s`` starts at ``reset_timeout_s`` and doubles each time a
    probe fails, up to ``max_reset_timeout_s``.
``half_open``
    One caller is let through as the probe; the others are refused. The
    probe's success closes the breaker (and resets ``open_s``), its failure
    opens it again. A probe that never reports is given up after ``open_s``.

``allow()`` gives each call let through a :class:`Permit`, which names the
stretch of state (the epoch) it began in; the call must end with
``record_success(permit)``, ``record_failure(permit)``, or
``record_no_verdict(permit)`` when it ended without telling whether the
server works (a client-side limit, a caller's mistake): a probe without a
verdict lets the next caller probe at once. A verdict from an earlier epoch
is stale and changes nothing: a slow call let through before the breaker
opened must not close it again when it finally succeeds (only the probe,
which began after the opening, may), nor fail the probe of a later epoch.
Memory and work are O(1).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Literal

from kvtier.tiers.base import TierConfigError, seconds_setting

BreakerState = Literal["closed", "open", "half_open"]


@dataclass(frozen=True, slots=True)
class Permit:
    """A call let through by :meth:`CircuitBreaker.allow`; ``epoch``: the
    breaker's epoch when it was let through (its verdict counts only while
    the breaker is still in that epoch). Always true."""

    epoch: int


DEFAULT_FAILURE_THRESHOLD: Final = 3
DEFAULT_RESET_TIMEOUT_S: Final = 1.0
DEFAULT_MAX_RESET_TIMEOUT_S: Final = 30.0
"""The breaker's defaults: failures in a row that open it, and its first and
longest wait before a probe."""


class CircuitBreaker:
    """See the module docstring. ``on_change(state)`` is called, outside the
    breaker's lock, when it opens after closed (``"open"``) and when it closes
    again (``"closed"``); failed probes do not call it. Calls come in the
    order of the changes, one at a time, even when two threads change the
    state at once, so the last call names the state the breaker is in."""

    def __init__(
        self,
        failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
        reset_timeout_s: float = DEFAULT_RESET_TIMEOUT_S,
        max_reset_timeout_s: float = DEFAULT_MAX_RESET_TIMEOUT_S,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[BreakerState], None] | None = None,
    ) -> None:
        if isinstance(failure_threshold, bool) or not isinstance(failure_threshold, int) or (
            failure_threshold < 1
        ):
            raise TierConfigError(
                f"failure_threshold must be an int >= 1, got {failure_threshold!r}"
            )
        for name, value in (
            ("reset_timeout_s", reset_timeout_s),
            ("max_reset_timeout_s", max_reset_timeout_s),
        ):
            seconds_setting("circuit breaker", name, value)
        if max_reset_timeout_s < reset_timeout_s:
            raise TierConfigError("max_reset_timeout_s must be >= reset_timeout_s")
        self.failure_threshold = failure_threshold
        self.reset_timeout_s = float(reset_timeout_s)
        self.max_reset_timeout_s = float(max_reset_timeout_s)
        self._clock = clock
        self._on_change = on_change
        self._lock = threading.Lock()
        # Changes not announced yet, queued under ``_lock`` in the order they
        # happened and announced under ``_announcing`` (reentrant: an
        # ``on_change`` may call the breaker); at most one per thread in a
        # ``record_*`` call. Announcing each change from its own thread after
        # the lock, a thread paused there announced "open" after another's
        # later "closed": the last word said open while the breaker was closed.
        self._changes: deque[BreakerState] = deque()
        self._announcing = threading.RLock()
        self._state: BreakerState = "closed"
        self._failures = 0
        self._open_s = self.reset_timeout_s
        self._since = 0.0  # when the current open / half-open state began
        # Bumped at every change of state and at every probe let through: a
        # verdict counts only from a call let through in the current epoch.
        self._epoch = 0
        self.opens = 0
        self.rejected = 0

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state

    def ready(self) -> bool:
        """Whether ``allow()`` would let a call through now (no state change)."""
        with self._lock:
            return self._state == "closed" or self._clock() - self._since >= self._open_s

    def allow(self) -> Permit | None:
        """A permit when a call may go now (as the probe when the breaker is
        open), else None."""
        with self._lock:
            if self._state == "closed":
                return Permit(self._epoch)
            now = self._clock()
            if now - self._since < self._open_s:
                self.rejected += 1
                return None
            # Open long enough, or a probe that never reported: probe again
            # (a new epoch, so the lost probe's late verdict is stale).
            self._state = "half_open"
            self._since = now
            self._epoch += 1
            return Permit(self._epoch)

    def _current(self, permit: Permit) -> bool:
        """Whether ``permit``'s call began in the current epoch (under ``_lock``)."""
        if not isinstance(permit, Permit):
            raise TypeError(f"expected the Permit that allow() returned, got {permit!r}")
        return permit.epoch == self._epoch

    def record_success(self, permit: Permit) -> None:
        """The call ``permit`` let through found the server working."""
        with self._lock:
            if not self._current(permit):
                return  # began before the last change: proves nothing about now
            self._failures = 0
            if self._state != "closed":
                self._state = "closed"
                self._epoch += 1
                self._open_s = self.reset_timeout_s
                self._changes.append("closed")
        self._announce()

    def record_failure(self, permit: Permit) -> None:
        """The call ``permit`` let through found the server failing."""
        with self._lock:
            if not self._current(permit):
                return
            self._failures += 1
            if self._state == "half_open":
                self._open_s = min(self._open_s * 2, self.max_reset_timeout_s)
                self._state = "open"
                self._epoch += 1
                self._since = self._clock()  # a failed probe: still open, longer
            elif self._state == "closed" and self._failures >= self.failure_threshold:
                self._state = "open"
                self._epoch += 1
                self._since = self._clock()
                self.opens += 1
                self._changes.append("open")
        self._announce()

    def record_no_verdict(self, permit: Permit) -> None:
        """The call ``permit`` let through ended without saying whether the
        server works; if it was the probe, the next ``allow()`` probes again
        (not only after ``open_s``: recovery is not delayed by a probe that
        proved nothing)."""
        with self._lock:
            if self._current(permit) and self._state == "half_open":
                self._state = "open"
                self._epoch += 1
                self._since = self._clock() - self._open_s

    def _announce(self) -> None:
        """Pass the queued changes to ``on_change``, oldest first."""
        if not self._changes:
            return
        with self._announcing:
            while self._changes:
                state = self._changes.popleft()
                if self._on_change is not None:
                    self._on_change(state)

    def __repr__(self) -> str:
        return f"CircuitBreaker(state={self.state!r}, opens={self.opens})"
