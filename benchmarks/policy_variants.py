"""Members of the default policy's family, held fixed or started otherwise, for
replays that ask whether any of them would do better than the adaptive choice
(docs/policy.md, "Where it falls short" and "How it starts").

Each class of ``VARIANTS`` is ``AdaptivePolicy`` held in one configuration,
with its shadows off: a history length with or without admission, and
optionally the window share or the LFU share pinned, or admission that needs
two earlier uses. ``STARTS`` are ``AdaptivePolicy`` with its shadows on that
begin otherwise: with admission on, or taking the best shadow's
configuration without hysteresis once the cache is first full, or
deciding first from shadows sampled at a higher rate (docs/policy.md, "How
it starts"). ``GHOSTS`` are ``AdaptivePolicy`` whose window learns from
fewer of its ghosts: only those of the newer generation, or only those
within ARC's bound on a ghost list's depth (docs/policy.md, "Which ghosts
move the window"). ``ShadowPlain8`` / ``ShadowAdmit8`` are two of the
shadows' configurations at full scale, as a shadow runs them (PLFU's
window rules, no turns), for ``shadow_fidelity.py``.

    PYTHONPATH=benchmarks kvtier replay --capacity 4000 \\
        --policy lru,default,policy_variants:Admit8,policy_variants:Window1 TRACE
"""

from __future__ import annotations

from collections.abc import Container, Sequence
from typing import Any

from kvtier.policies.adaptive import AdaptivePolicy
from kvtier.policies.key_sample import KeySample
from kvtier.policies.plfu import PLFUPolicy
from kvtier.policies.shadows import PLFUShadow, Shadow
from kvtier.policies.turns import TurnTracker

_ABSENT = object()


class _Fixed(AdaptivePolicy):
    """``AdaptivePolicy`` in configuration ``CONFIG``, never switching.

    ``WINDOW``: the window's target share of the cache, pinned (None: learned);
    ``LFU_SHARE``: the main segment's share of victims by frequency, pinned
    (None: learned); ``ADMIT_USES``: earlier uses the history must know of a
    new block for admission to store it while the cache is full.
    """

    CONFIG: tuple[int, bool] = (8, True)
    WINDOW: float | None = None
    LFU_SHARE: float | None = None
    ADMIT_USES = 1

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.configure(*self.CONFIG)
        if self.WINDOW is not None:
            self.target = self.WINDOW * capacity
        if self.LFU_SHARE is not None:
            self.lfu_share = self.LFU_SHARE

    def sampled(self, keys: Sequence[bytes]) -> list[bytes]:
        return []  # no shadows: the configuration never changes

    def _from_ghost(self, key: bytes) -> None:
        target, share = self.target, self.lfu_share
        super()._from_ghost(key)
        if self.WINDOW is not None:
            self.target = target
        if self.LFU_SHARE is not None:
            self.lfu_share = share

    def admit(self, keys: list[bytes]) -> int:
        if self.ADMIT_USES == 1:
            return super().admit(keys)
        room = self.capacity - len(self)
        if len(keys) <= room:
            return len(keys)
        for i, key in enumerate(keys):
            if self._counts.get(key, 0) < self.ADMIT_USES:
                return i if i > room else room
        return len(keys)


class Plain8(_Fixed):
    """PLFU's configuration: a history of 8 x capacity, no admission."""

    name = "plain8"
    CONFIG = (8, False)


class Plain8Window50(Plain8):
    name = "plain8-window50"
    WINDOW = 0.5


class Admit8(_Fixed):
    """Admission over a history of 8 x capacity."""

    name = "admit8"


class Admit16(_Fixed):
    name = "admit16"
    CONFIG = (16, True)


class Admit32(_Fixed):
    name = "admit32"
    CONFIG = (32, True)


class Window1(Admit8):
    name = "admit8-window1"
    WINDOW = 0.01


class Window25(Admit8):
    name = "admit8-window25"
    WINDOW = 0.25


class Window50(Admit8):
    name = "admit8-window50"
    WINDOW = 0.5


class ByFrequency(Admit8):
    name = "admit8-lfu"
    LFU_SHARE = 0.98


class ByRecency(Admit8):
    name = "admit8-lru"
    LFU_SHARE = 0.02


class TwoUses(Admit8):
    name = "admit8-two-uses"
    ADMIT_USES = 2


class TwoUses32(TwoUses):
    name = "admit32-two-uses"
    CONFIG = (32, True)


class _NoTurns(TurnTracker):
    """A turn tracker that never sees a continuation (the shadows follow no turns)."""

    def continues(self, keys: Sequence[bytes], first_new: int, asked_from: int = 0) -> bool:
        return False


class ShadowPlain8(Plain8):
    """A shadow's configuration at full scale: PLFU's window rules (its start
    and step, not the default's) and no conversation turns, history 8 x
    capacity, no admission (``benchmarks/shadow_fidelity.py``)."""

    name = "shadow-plain8"
    START_WINDOW = PLFUPolicy.START_WINDOW
    STEP_SCALE = PLFUPolicy.STEP_SCALE

    def _init_adaptive(self) -> None:
        super()._init_adaptive()
        self.turns = _NoTurns(1)


class ShadowAdmit8(ShadowPlain8):
    """``ShadowPlain8`` with admission."""

    name = "shadow-admit8"
    CONFIG = (8, True)


VARIANTS = (Plain8, Plain8Window50, Admit8, Admit16, Admit32, Window1, Window25, Window50,
            ByFrequency, ByRecency, TwoUses, TwoUses32, ShadowPlain8, ShadowAdmit8)
"""Every variant, for ``--policy`` lists: ``policy_variants:NAME`` each."""


class StartAdmit(AdaptivePolicy):
    """The default policy starting with admission over 8 x capacity of history
    instead of PLFU's configuration."""

    name = "start-admit8"
    START = (8, True)


class FirstFree(AdaptivePolicy):
    """The default policy whose first decision after the cache is full takes the
    best shadow even without a lead beyond noise (``Z`` = 0 once)."""

    name = "first-free"

    def _init_adaptive(self) -> None:
        super()._init_adaptive()
        self._first_done = False

    def _decide(self) -> None:
        if self._first_done or len(self) < self.capacity:
            super()._decide()
            return
        self._first_done = True
        self.Z = 0.0  # this decision only: the instance attribute hides the class's
        try:
            super()._decide()
        finally:
            del self.Z


class WarmStart(AdaptivePolicy):
    """The default policy whose first ``WARM_EPOCHS`` decisions are made by a
    second set of shadows sampled at ``WARM_FACTOR`` times the rate (more
    evidence per epoch: a lead grows with the rate, its noise with its square
    root), then dropped; the regular shadows score from the start and decide
    after them. Memory: besides the default's, ``len(CANDIDATES)`` shadows of
    ``WARM_FACTOR`` times the size until the warm-up ends, none after."""

    name = "warm-start"
    WARM_FACTOR = 8
    WARM_EPOCHS = 16

    def _init_adaptive(self) -> None:
        super()._init_adaptive()
        rate = min(1.0, self.rate * self.WARM_FACTOR)
        self._warm_sample = KeySample(rate)
        self._warm_capacity = max(self.MIN_SHADOW, round(self.capacity * rate))
        self.warm: list[Shadow] = [PLFUShadow(self._warm_capacity, f, admission)
                                   for f, admission in self.CANDIDATES]
        self._warm_sampled = self._warm_epochs = 0

    def on_demand_access(self, keys: Sequence[bytes], reused: Container[bytes],
                         asked_from: int) -> None:
        super().on_demand_access(keys, reused, asked_from)
        if not self.warm:
            return
        served = self._warm_sample.keys(keys[:asked_from])
        sampled = served + self._warm_sample.keys(keys[asked_from:])
        if not sampled:
            return
        self._feed(self.warm, [(sampled, len(served))])
        self._warm_sampled += len(sampled)
        if self._warm_sampled >= self._warm_capacity:
            self._warm_sampled = 0
            self._feed_pending()  # before a switch resets their differences
            self._end_epoch(self.warm)
            self._follow_best(self.warm)
            self._warm_epochs += 1
            if self._warm_epochs >= self.WARM_EPOCHS:
                self.warm = []
                for s in self.shadows:
                    s.spread = 0.0

    def _decide(self) -> None:
        if not self.warm:
            super()._decide()
            return
        self._feed_pending()
        self._sampled = 0
        self._end_epoch(self.shadows)  # scores from the start, no decision yet

    def _switch(self, index: int) -> None:
        super()._switch(index)
        for s in self.warm:
            s.spread = 0.0


class WarmStart4(WarmStart):
    name = "warm-start4"
    WARM_FACTOR = 4


STARTS = (StartAdmit, FirstFree, WarmStart, WarmStart4)
"""The variants of how the default begins: ``policy_variants:NAME`` each."""


class RecentGhosts(AdaptivePolicy):
    """The default policy whose window moves only for a ghost of the newer
    generation (at most ``3/4 capacity`` victims back); a main-segment ghost
    of the older one still moves ``lfu_share``."""

    name = "recent-ghosts"

    def _from_ghost(self, key: bytes) -> None:
        old = key not in self._g1 and key not in self._g2
        target = self.target
        super()._from_ghost(key)
        if old:
            self.target = target


class GhostDepth(AdaptivePolicy):
    """The default policy with ARC's bound on a ghost list's depth: a ghost
    moves the window only if fewer victims of its own segment followed it
    than the cache has room beyond that segment (``capacity - |window|`` for
    a window ghost, ``capacity - |main|`` for a main one; in ARC ``|T1| +
    |B1| <= c`` says the same). Each ghost carries its victim number (in
    place of the ghost lists' values), so the memory is the default's."""

    name = "ghost-depth"

    def _init_state(self) -> None:
        super()._init_state()
        self._victims = [0, 0]  # victims of the window, of the main segment

    def evict(self, n: int, protected: Container[bytes]) -> list[bytes] | None:
        out = super().evict(n, protected)
        for key in out or ():
            self._number(key)
        return out

    def _ghost_lists(self) -> tuple[tuple[dict[bytes, Any], dict[bytes, Any], int], ...]:
        """(newer, older, resident blocks) of the window's ghosts, then the main's."""
        return ((self._g1, self._g1_old, len(self._window)),
                (self._g2, self._g2_old, len(self._recent)))

    def _number(self, key: bytes) -> None:
        """Stamp a new ghost with its segment's victim number."""
        for segment, (new, old, _) in enumerate(self._ghost_lists()):
            for ghosts in (new, old):
                value = ghosts.get(key, _ABSENT)
                if value is None or isinstance(value, bool):  # not numbered yet
                    ghosts[key] = (self._victims[segment], value)
                    self._victims[segment] += 1
                    return

    def _from_ghost(self, key: bytes) -> None:
        for segment, (new, old, held) in enumerate(self._ghost_lists()):
            ghosts = new if key in new else old if key in old else None
            if ghosts is None:
                continue
            entry = ghosts[key]
            number, value = entry if isinstance(entry, tuple) else (self._victims[segment], entry)
            ghosts[key] = value  # as the default keeps it, for its _from_ghost
            if self._victims[segment] - number <= self.capacity - held:
                super()._from_ghost(key)
                return
            del ghosts[key]
            if segment:  # too deep to move the window; still a vote on the order
                share, rate = self.lfu_share, self.LEARNING_RATE
                share = share - rate * share if value else share + rate * (1.0 - share)
                self.lfu_share = min(1.0 - self.MIN_SHARE, max(self.MIN_SHARE, share))
            return


GHOSTS = (RecentGhosts, GhostDepth)
"""The variants of which ghosts move the window: ``policy_variants:NAME`` each."""
