"""Members of the default policy's family, held fixed or started otherwise, for
replays that ask whether any of them would do better than the adaptive choice
(docs/policy.md, "Where it falls short" and "How it starts").

Each class of ``VARIANTS`` is ``AdaptivePolicy`` held in one configuration,
with its shadows off: a history length with or without admission, and
optionally the window share or the LFU share pinned, or admission that needs
two earlier uses. ``STARTS`` are ``AdaptivePolicy`` with its shadows on that
begin otherwise: with admission on, or taking the best shadow's
configuration without hysteresis once the cache is first full
(docs/policy.md, "How it starts").

    PYTHONPATH=benchmarks kvtier replay --capacity 4000 \\
        --policy lru,default,policy_variants:Admit8,policy_variants:Window1 TRACE
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.policies.adaptive import AdaptivePolicy


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


STARTS = (StartAdmit, FirstFree)
"""The variants of how the default begins: ``policy_variants:NAME`` each."""
