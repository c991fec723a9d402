"""PromotionOutcomes: failures expire after their TTL, both maps stay bounded."""

from __future__ import annotations

from kvtier import block_key
from kvtier.tiers.outcomes import PromotionOutcomes


def test_a_failure_is_a_miss_until_its_ttl_then_forgotten() -> None:
    o = PromotionOutcomes(failure_ttl_s=10.0, max_keys=4)
    o.note_failures([block_key(1)], now=100.0)
    assert o.failed_recently(block_key(1), 109.9)
    assert not o.failed_recently(block_key(1), 110.0)
    assert block_key(1) not in o.failed  # dropped when found expired
    assert not o.failed_recently(block_key(2), 100.0)


def test_both_maps_keep_the_latest_max_keys() -> None:
    o = PromotionOutcomes(failure_ttl_s=1.0, max_keys=3)
    o.note_failures([block_key(i) for i in range(5)], now=0.0)
    o.note_failures([block_key(2)], now=0.5)  # refreshed: now the latest
    assert list(o.failed) == [block_key(3), block_key(4), block_key(2)]
    for i in range(5):
        o.note_source(block_key(i), "disk")
    o.note_source(block_key(2), "redis")
    assert list(o.sources) == [block_key(3), block_key(4), block_key(2)]
    assert o.sources[block_key(2)] == "redis"
    o.clear()
    assert not o.failed and not o.sources
