"""``kvtier bench faults``' table, from results (the runs are in test_faults_under_load)."""

from __future__ import annotations

from kvtier.bench.faults import HEADER, FaultResult, table


def _result(fault: str, **counters: float) -> FaultResult:
    return FaultResult(fault=fault, completed=10, failed=0, ttft_p99_ms=100.0,
                       ttft_max_ms=120.0, kvtier_tokens=500.0, tier_errors={},
                       counters=counters, disk_io_ms=0.0, probe_answer="a", probe_same=True)


def test_failed_and_late_promotions_are_shown_apart() -> None:
    # 3 promotions ran late, 2 of them failed: summed, those 2 counted twice
    lines = table([_result("none"), _result("disk-slow", promotion_failures=2,
                                            promotion_timeouts=3)])
    columns = dict(zip(HEADER, lines[2].split(), strict=False))
    assert (columns["write fail"], columns["promo fail"]) == ("0", "2")
    assert lines[2].split()[HEADER.index("promo late")] == "3"
