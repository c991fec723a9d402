"""A real tier whose reads wait for a signal: holds an I/O thread on demand."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvtier.tiers.base import Tier
from kvtier.tiers.blockfile import BytesLike
from kvtier.tiers.delegating import DelegatingTier


class Gate(DelegatingTier):
    """``inner`` whose ``get_into`` sets ``entered``, then waits for ``opened``
    (at most 10 s, so a test that forgets to open it still ends)."""

    def __init__(self, inner: Tier) -> None:
        super().__init__(inner)
        self.opened = threading.Event()
        self.entered = threading.Event()

    def get_into(self, keys: Sequence[bytes], buffers: Sequence[BytesLike]) -> list[int | None]:
        self.entered.set()
        self.opened.wait(10)
        return self.inner.get_into(keys, buffers)
