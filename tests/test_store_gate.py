"""The store gate: offer-count admission, then the policy's, each declined key counted once."""

from __future__ import annotations

import pytest

from kvtier import ProtocolError, block_key
from kvtier.policies.lru import LRUPolicy
from kvtier.request import RequestContext
from kvtier.store_gate import StoreGate


class _Admits(LRUPolicy):
    """LRU whose ``admit`` returns ``self.answer`` (an int, or anything, to test the check)."""

    wants_admission = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.answer: object = 0
        self.asked: list[list[bytes]] = []

    def admit(self, keys: list[bytes]) -> int:
        self.asked.append(list(keys))
        return self.answer  # type: ignore[return-value]


def keys(*ids: int) -> list[bytes]:
    return [block_key(i) for i in ids]


def test_the_policy_declines_a_suffix_counted_once_per_request() -> None:
    policy = _Admits(8)
    policy.answer = 1
    gate = StoreGate(policy, store_threshold=1, max_tracker_size=100)
    ctx = RequestContext("r")
    assert gate.admit(keys(1, 2, 3), ctx) == keys(1)
    assert gate.admit(keys(2, 3), ctx) == keys(2)  # 3 declined again: not counted again
    assert gate.skipped == 2
    assert gate.admit(keys(2, 3), RequestContext("s")) == keys(2)
    assert gate.skipped == 3  # another request: its decline of 3 counts again


def test_the_offer_count_comes_first_and_the_policy_sees_only_what_passed() -> None:
    policy = _Admits(8)
    policy.answer = 1
    gate = StoreGate(policy, store_threshold=2, max_tracker_size=100)
    assert gate.admit(keys(1, 2), RequestContext("a")) == []
    assert policy.asked == [] and gate.skipped == 2 and gate.offers(keys(1)[0]) == 1
    assert gate.admit(keys(1, 2), RequestContext("b")) == keys(1)
    assert policy.asked == [keys(1, 2)] and gate.skipped == 3 and len(gate) == 2


def test_with_policy_admission_off_the_policy_is_not_asked() -> None:
    policy = _Admits(8)
    gate = StoreGate(policy, store_threshold=1, max_tracker_size=100)
    gate.policy_admission = False
    assert gate.admit(keys(1, 2), RequestContext("r")) == keys(1, 2)
    assert policy.asked == [] and gate.skipped == 0 and gate.offers(keys(1)[0]) == 0


@pytest.mark.parametrize("answer", [-1, 4, True, 1.0, None])
def test_an_admit_outside_the_contract_is_a_protocol_error(answer: object) -> None:
    policy = _Admits(8)
    policy.answer = answer
    gate = StoreGate(policy, store_threshold=1, max_tracker_size=100)
    with pytest.raises(ProtocolError, match=r"_Admits\.admit returned .*0\.\.3"):
        gate.admit(keys(1, 2, 3), RequestContext("r"))
    assert gate.skipped == 0


@pytest.mark.parametrize("threshold", [0, True, 1.5])
def test_a_bad_threshold_is_refused(threshold: object) -> None:
    with pytest.raises(ValueError, match="store_threshold"):
        StoreGate(LRUPolicy(8), threshold, 100)  # type: ignore[arg-type]
