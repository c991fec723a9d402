"""Values the manager returns to its callers."""

from __future__ import annotations

import enum
from typing import NamedTuple


class LookupResult(enum.Enum):
    """Answer of ``OffloadManager.lookup_one`` (and ``TierCascade.lookup_one``) for one key."""

    MISS = "miss"
    HIT = "hit"
    HIT_PENDING = "hit_pending"
    """Resident but not readable yet (store or promotion in flight): ask again later."""
    RETRY = "retry"
    """Not known yet (a remote tier's existence check is in flight): not a hit;
    ask again after the step ends. Only ``TierCascade`` answers it."""


class LoadSpec(NamedTuple):
    """Slots to read, in the order of the keys passed to ``prepare_load``."""

    block_ids: list[int]


class PrepareStoreOutput(NamedTuple):
    """What a ``prepare_store`` granted.

    ``keys_to_store[i]`` is to be written into slot ``block_ids[i]``;
    ``evicted_keys`` left the cache to make room.
    """

    keys_to_store: list[bytes]
    block_ids: list[int]
    evicted_keys: list[bytes]
