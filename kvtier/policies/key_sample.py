"""Spatial sampling of keys by hash, as SHARDS does.

A key is in the sample when the CRC-32 of its bytes falls in the sampled
``rate`` of the hash space, so a sampled key is sampled wherever it occurs
(every request, offer and eviction), and the same key set is drawn in every
process and every run (unlike ``hash()``, which Python salts per process).
The default policy's shadows (``kvtier.policies.adaptive``) and its
admission evidence (``kvtier.policies.admission_evidence``) each draw one.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

_HASH_SPACE = 1 << 32


class KeySample:
    """The keys whose CRC-32 is below ``rate`` of the hash space.

    Owns nothing but ``rate`` (in (0, 1]) and its threshold; at ``rate`` 1
    every key is sampled and ``keys`` returns its input as a list without
    hashing it.
    """

    __slots__ = ("rate", "_threshold")

    def __init__(self, rate: float) -> None:
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1:
            raise ValueError(f"sampling rate must be a number in (0, 1], got {rate!r}")
        self.rate = float(rate)
        self._threshold = int(rate * _HASH_SPACE)

    def keys(self, keys: Iterable[bytes]) -> list[bytes]:
        """The sampled keys of ``keys``, in order."""
        if self._threshold >= _HASH_SPACE:
            return list(keys)
        crc, threshold = zlib.crc32, self._threshold
        return [k for k in keys if crc(k) < threshold]
