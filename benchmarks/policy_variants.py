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
it starts").

    PYTHONPATH=benchmarks kvtier replay --capacity 4000 \\
        --policy lru,default,policy_variants:Admit8,policy_variants:Window1 TRACE
"""

from __future__ import annotations

import zlib
from collections.abc import Container, Sequence

from kvtier.policies.adaptive import AdaptivePolicy, _Shadow


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


VARIANTS = (Plain8, Plain8Window50, Admit8, Admit16, Admit32, Window1, Window25, Window50,
            ByFrequency, ByRecency, TwoUses, TwoUses32)
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
        self._warm_threshold = int(rate * (1 << 32))
        self._warm_capacity = max(self.MIN_SHADOW, round(self.capacity * rate))
        self.warm = [_Shadow(self._warm_capacity, f, admission)
                     for f, admission in self.CANDIDATES]
        self._warm_sampled = self._warm_epochs = 0

    def on_demand_access(self, keys: Sequence[bytes], reused: Container[bytes],
                         asked_from: int) -> None:
        super().on_demand_access(keys, reused, asked_from)
        if not self.warm:
            return
        crc, threshold = zlib.crc32, self._warm_threshold
        served = [k for k in keys[:asked_from] if crc(k) < threshold]
        sampled = served + [k for k in keys[asked_from:] if crc(k) < threshold]
        if not sampled:
            return
        self._feed(self.warm, sampled, len(served))
        self._warm_sampled += len(sampled)
        if self._warm_sampled >= self._warm_capacity:
            self._warm_sampled = 0
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
