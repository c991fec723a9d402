"""The disk tier after a failed put: no reservation left behind (bounded memory
and capacity)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.tiers.disk import DiskTier

NAMESPACE = "0123456789abcdef"


def test_disk_put_of_an_empty_key_reserves_nothing(tmp_path: Path) -> None:
    """A put that raises for a bad key changes nothing. It used to reserve the
    key's bytes first and raise from the block header: the reservation was never
    given back (capacity lost for the tier's life) and every later put of that
    key answered True, "being written", for a block never stored."""
    tier = DiskTier(tmp_path, NAMESPACE, 1 << 20, free_reserve_bytes=0)
    for _ in range(3):
        with pytest.raises(ValueError, match=r"got 0"):
            tier.put([(b"", b"x" * 100)])
    assert tier.debug_state()["pending"] == 0
    assert tier.stats()["pending_bytes"] == 0
    assert tier.put([(b"k" * 32, b"x" * 100)]) == [True]
    assert tier.stats()["blocks"] == 1
    tier.close()


def test_disk_put_that_raises_mid_write_gives_its_reservation_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception other than OSError out of the write (MemoryError here: a
    real disk cannot raise one on demand) used to keep the key's reservation
    for the tier's life, and the key was "being written" ever after."""
    import kvtier.tiers.disk as disk

    tier = DiskTier(tmp_path, NAMESPACE, 1 << 20, free_reserve_bytes=0)
    real = disk.write_full

    def fail_once(*args: object) -> None:
        monkeypatch.setattr(disk, "write_full", real)
        raise MemoryError

    monkeypatch.setattr(disk, "write_full", fail_once)
    key = b"k" * 32
    with pytest.raises(MemoryError):
        tier.put([(key, b"x" * 100)])
    assert tier.debug_state()["pending"] == 0
    assert tier.stats()["pending_bytes"] == 0
    assert tier.put([(key, b"x" * 100)]) == [True]
    assert tier.get([key])[0] == b"x" * 100
    tier.close()
