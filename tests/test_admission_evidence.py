"""Admission measured on the real cache (kvtier.policies.admission_evidence), the
manager's report of the keys a request asks for (``EvictionPolicy.on_asked``),
and what the default policy does with the evidence (kvtier.policies.adaptive)."""

from __future__ import annotations

from collections.abc import Collection

import pytest

import kvtier
from kvtier import OffloadManager, RequestContext
from kvtier.policies import AdaptivePolicy, LRUPolicy
from kvtier.policies.admission_evidence import AdmissionEvidence
from kvtier.policies.shadows import Shadow
from kvtier.replay.driver import replay, replay_request, trace_keys
from kvtier.replay.generate import generate


def k(i: int) -> bytes:
    return kvtier.block_key(i)


def ks(ids: range | list[int]) -> list[bytes]:
    return [k(i) for i in ids]


# -- the evidence ------------------------------------------------------------


def test_an_offer_admission_would_cut_marks_both_sides_of_the_difference() -> None:
    ev = AdmissionEvidence(100)
    ev.offered(ks(range(10, 14)), room_taken=2)  # 4 declined; the other cache evicts 2
    ev.evicted(ks(range(6)))  # this cache evicted 6: the other keeps the last 4
    assert list(ev.stored) == ks(range(10, 14))
    assert list(ev.displaced) == ks(range(2, 6))


def test_the_other_cache_evicts_its_displaced_blocks_first_oldest_first() -> None:
    ev = AdmissionEvidence(100)
    ev.offered([k(10)], room_taken=0)
    ev.evicted(ks([1, 2, 3]))  # all kept by the other cache
    ev.offered([], room_taken=2)  # an offer admission stores whole, that needs 2 blocks
    ev.evicted(ks([4, 5]))
    # the other cache made its room from its oldest displaced blocks, 1 and 2;
    # it still holds 3, and 4 and 5 that this one evicted
    assert list(ev.displaced) == ks([3, 4, 5])


def test_an_eviction_no_offer_made_takes_as_many_displaced_blocks() -> None:
    ev = AdmissionEvidence(100)
    ev.offered([k(10)], room_taken=0)
    ev.evicted(ks([1, 2, 3]))
    ev.fits()
    ev.evicted(ks([4, 5]))  # a promotion's room, say: the other cache needs it too
    assert list(ev.displaced) == ks([3, 4, 5])


def test_a_stored_block_evicted_is_in_neither_cache() -> None:
    ev = AdmissionEvidence(100)
    ev.offered(ks([7, 8]), room_taken=0)
    ev.evicted([k(7), k(1)])
    assert list(ev.stored) == [k(8)] and list(ev.displaced) == [k(1)]
    ev.removed(k(8))  # a failed store: gone without eviction
    assert not ev.stored


def test_asks_vote_once_per_mark() -> None:
    ev = AdmissionEvidence(100)
    ev.offered(ks([10, 11, 12]), room_taken=0)
    ev.evicted(ks([1, 2, 3]))
    resident = set(ks([10, 11, 3])).__contains__
    ev.asked(ks([10, 11, 12, 1, 2, 3, 99, 10, 1]), resident)  # 10 and 1 twice
    # 10 and 11 were hits admission would have lost; 1 and 2 misses it would
    # have kept; 12 (gone since) and 3 (back since) vote for nothing
    assert (ev.votes_for, ev.votes_against) == (2, 2)
    assert not ev.stored and not ev.displaced
    ev.asked(ks([10, 1]), resident)  # asked again (a request that waits)
    assert (ev.votes_for, ev.votes_against) == (2, 2)


def test_the_verdict_asks_for_a_lead_beyond_the_noise_of_the_asks() -> None:
    ev = AdmissionEvidence(10_000)
    for i in range(40):  # 40 asks, one vote for admission each
        ev.offered([], room_taken=0)
        ev.evicted([k(i)])
        ev.asked({k(i)}, lambda key: False)
    ev.end_epoch(0.9)
    assert ev.lead == 40 and ev.verdict(1.5) == 1
    assert ev.verdict(10.0) == 0
    # one ask of 40 votes against: the lead is gone, the noise is large
    ev.offered(ks(range(1000, 1040)), room_taken=0)
    ev.asked(ks(range(1000, 1040)), lambda key: True)
    ev.end_epoch(1.0)
    assert ev.lead == 0 and ev.verdict(1.5) == 0
    ev.clear()
    assert (ev.lead, ev.spread, ev.verdict(1.5)) == (0.0, 0.0, 0)


def test_marks_are_bounded_by_the_limit() -> None:
    ev = AdmissionEvidence(8)
    ev.offered(ks(range(100, 120)), room_taken=0)
    ev.evicted(ks(range(20)))
    assert ev.sizes() == {"evidence_stored": 8, "evidence_displaced": 8}
    assert list(ev.stored) == ks(range(112, 120))  # the newest kept
    assert list(ev.displaced) == ks(range(12, 20))
    with pytest.raises(ValueError, match="capacity must be an int >= 1"):
        AdmissionEvidence(0)


def test_a_sampled_evidence_marks_only_its_keys_within_its_limit() -> None:
    ev = AdmissionEvidence(4000, rate=0.25)
    assert ev.limit == 1000
    declined, victims = ks(range(10_000, 10_400)), ks(range(400))
    ev.offered(declined, room_taken=0)
    ev.evicted(victims)
    assert list(ev.stored) == ev.sample.keys(declined)
    assert list(ev.displaced) == ev.sample.keys(victims)
    assert 60 < len(ev.stored) < 140 and 60 < len(ev.displaced) < 140  # about a quarter


def test_a_sampled_evidence_drops_its_share_of_the_displaced_blocks() -> None:
    ev = AdmissionEvidence(100_000, rate=0.25)
    ev.offered([], room_taken=0)
    ev.evicted(ks(range(4000)))  # about 1,000 sampled displaced marks
    marked = list(ev.displaced)
    victims = ks(range(100_000, 100_100))
    for victim in victims:  # offers the other cache makes room for: 3 blocks each
        ev.offered([], room_taken=3)
        ev.evicted([victim])
    # 300 of the other cache's displaced blocks: 75 sampled marks, oldest
    # first (the fractions carried from eviction to eviction); it still
    # holds the victims, now displaced too
    assert list(ev.displaced) == marked[75:] + ev.sample.keys(victims)
    ev.offered([], room_taken=10_000)  # more than it has displaced: it also
    ev.evicted(ks(range(200_000, 200_040)))  # evicts the leading victims
    assert not ev.displaced


def test_the_default_samples_its_evidence_past_evidence_blocks() -> None:
    small, large = AdaptivePolicy(1000), AdaptivePolicy(16_000)
    assert small.evidence.sample.rate == 1 and small.evidence.limit == 1000
    assert large.evidence.sample.rate == AdaptivePolicy.EVIDENCE_BLOCKS / 16_000
    assert large.evidence.limit == AdaptivePolicy.EVIDENCE_BLOCKS
    assert large.size_bounds(1)["evidence_stored"] == AdaptivePolicy.EVIDENCE_BLOCKS


# -- the manager's report ----------------------------------------------------


class _Recorder(LRUPolicy):
    """LRU that records what it is told a request asks for."""

    wants_asks = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.asks: list[set[bytes]] = []

    def on_asked(self, keys: Collection[bytes]) -> None:
        self.asks.append(set(keys))


def _manager() -> tuple[OffloadManager, _Recorder]:
    mgr = OffloadManager(16, policy="test_admission_evidence:_Recorder")
    assert isinstance(mgr.policy, _Recorder)
    return mgr, mgr.policy


def _store(mgr: OffloadManager, keys: list[bytes], name: str) -> None:
    ctx = RequestContext(name)
    out = mgr.prepare_store(keys, ctx)
    assert out is not None
    mgr.complete_store(out.keys_to_store, ctx)
    mgr.on_request_finished(ctx)


def test_a_lookup_reports_its_hits_and_first_miss_each_time_it_asks() -> None:
    mgr, pol = _manager()
    _store(mgr, ks(range(3)), "writer")
    assert pol.asks == []  # a request that never looked up asked for nothing
    ctx = RequestContext("r")
    assert mgr.lookup(ks(range(6)), ctx) == 3
    assert pol.asks == [set(ks(range(4)))]  # what a lookup shows: up to the first miss
    mgr.lookup(ks(range(6)), ctx)  # asked again while it waits: reported again
    assert pol.asks == [set(ks(range(4)))] * 2
    mgr.prepare_store(ks(range(6)), ctx)  # all it asked for, before it is stored
    assert pol.asks[2:] == [set(ks(range(6)))]
    mgr.on_request_finished(ctx)
    other = RequestContext("r2")
    mgr.lookup(ks(range(2)), other)  # another request: its own report
    assert pol.asks[-1] == set(ks(range(2)))


def test_lookup_one_reports_each_ask() -> None:
    mgr, pol = _manager()
    _store(mgr, ks(range(2)), "writer")
    ctx = RequestContext("r")
    for _ in range(2):  # vLLM asks again at each step while the request waits
        for key in ks(range(3)):
            mgr.lookup_one(key, ctx)
    assert pol.asks == [{k(0)}, {k(1)}, {k(2)}] * 2


def test_an_offer_reports_only_past_where_the_request_began_asking() -> None:
    # Behind the engine's cache: the request looked up from block 4 on (0-3
    # were the engine's); its offer of 0-7 reports 4-7.
    mgr, pol = _manager()
    ctx = RequestContext("r")
    keys = ks(range(8))
    ctx.set_positions(keys, 16, 16)
    mgr.lookup(keys[4:], ctx)
    assert pol.asks == [{k(4)}]
    mgr.prepare_store(keys, ctx)
    assert pol.asks == [{k(4)}, set(ks([4, 5, 6, 7]))]


def test_a_policy_that_does_not_want_asks_is_not_told() -> None:
    mgr = OffloadManager(16, policy="lru")
    pol = mgr.policy
    assert isinstance(pol, LRUPolicy)
    pol.on_asked = None  # type: ignore[assignment,method-assign]  # a call would fail
    ctx = RequestContext("r")
    mgr.lookup(ks(range(4)), ctx)
    mgr.lookup_one(k(9), ctx)
    mgr.prepare_store(ks(range(4)), ctx)


# -- the default policy --------------------------------------------------------


class _Blind(AdaptivePolicy):
    """The default without the evidence: the shadows alone decide (its votes
    never come, since the manager reports no ask)."""

    wants_asks = False


def test_the_evidence_vetoes_a_chance_lead_for_admission() -> None:
    # Generated popularity drift, seed 174, at 1,000 blocks: at epoch 55 the
    # shadow of admission over 32 x the capacity led START's by chance, and
    # the shadows alone followed it for 20 epochs, to 0.965 x LRU's hits
    # (docs/policy.md, "Admission measured on the cache"); on the cache,
    # admission was losing hits all along.
    keys = trace_keys(generate("drift", 174, 10_000))
    lru = replay(keys, 1000, "lru").hit_ratio
    with_evidence = replay(keys, 1000, "adaptive").hit_ratio
    blind = replay(keys, 1000, "test_admission_evidence:_Blind").hit_ratio
    assert with_evidence >= 0.98 * lru
    assert blind < 0.97 * lru  # the control: the same policy, blind to the cache


class _Switches(AdaptivePolicy):
    """The default, recording the configuration after each decision."""

    def _follow_best(self, shadows: list[Shadow]) -> None:
        super()._follow_best(shadows)
        self.taken = getattr(self, "taken", [])
        self.taken.append(self.admission)


def _vote_for_admission(pol: AdaptivePolicy, epochs: int, admission_score: float) -> None:
    """``epochs`` epochs of one vote for admission each, the shadows' scores
    set: START's 10, the admission shadows' ``admission_score`` (within noise)."""
    for i in range(epochs):
        for s in pol.shadows:
            s.score = admission_score if s.admission else 10.0
            s.spread = 100.0
        pol.evidence.offered([], room_taken=0)
        pol.evidence.evicted([k(i)])
        pol.evidence.asked([k(i)], lambda key: False)
        pol._decide()


def test_evidence_for_admission_takes_it_where_the_shadows_lean_to_it() -> None:
    pol = _Switches(1000)
    _vote_for_admission(pol, 30, 10.5)
    first = pol.taken.index(True)
    assert first > 0 and all(pol.taken[first:])  # taken once, and kept
    best = max((s for s in pol.shadows if s.admission), key=lambda s: s.score)
    assert pol.configuration() == (best.history_factor, True)
    assert pol.switches == 1
    # the lead it acted on, frozen while admission is on (vllm:kvtier_policy_admission_evidence)
    assert pol.gauges()["admission_evidence"] == round(pol.evidence.lead) > 0


def test_evidence_for_admission_does_not_take_it_against_the_shadows() -> None:
    # The control: admission shadows below START's; taken, the return to
    # START would undo it at the next epoch.
    pol = _Switches(1000)
    _vote_for_admission(pol, 30, 9.5)
    assert not any(pol.taken) and pol.switches == 0
    assert OffloadManager(100, policy="adaptive").stats()["policy_admission_evidence"] == 0


def _ask(mgr: OffloadManager, keys: list[bytes], name: str) -> None:
    replay_request(mgr, keys, RequestContext(name))


def _epoch_with_scores(pol: AdaptivePolicy, admission_score: float, spread: float) -> None:
    """End an epoch with START's shadow (and LRU's) at 10 and the admission
    shadows at ``admission_score``, each ``spread`` from the active one."""
    for s in pol.shadows:
        s.score = admission_score if s.admission else 10.0
        s.spread = spread
    pol._decide()


def _new_offer_marks(mgr: OffloadManager, first: int) -> int:
    """Offer ten blocks never seen to the full cache; how many it marked."""
    pol = mgr.policy
    assert isinstance(pol, AdaptivePolicy)
    before = len(pol.evidence.stored)
    _ask(mgr, ks(range(first, first + 10)), f"new{first}")
    return len(pol.evidence.stored) - before


def test_the_evidence_rests_while_every_admission_shadow_trails_beyond_noise() -> None:
    mgr = OffloadManager(100, policy="adaptive")
    pol = mgr.policy
    assert isinstance(pol, AdaptivePolicy) and pol.measuring_admission
    for r in range(2):
        _ask(mgr, ks(range(100)), f"old{r}")
    assert _new_offer_marks(mgr, 1000) == 10
    # behind START's by 8 hits, its noise (Z = 1.5 standard deviations) 1.5:
    # no admission shadow could be taken now, whatever the verdict
    _epoch_with_scores(pol, 2.0, 1.0)
    assert not pol.measuring_admission and not pol.evidence.stored  # marks dropped
    assert _new_offer_marks(mgr, 2000) == 0
    votes = pol.evidence.votes_for + pol.evidence.votes_against
    _ask(mgr, ks(range(100)), "asks again")  # evicted blocks: no vote
    assert pol.evidence.votes_for + pol.evidence.votes_against == votes
    # the control: the same deficit within its noise (spread 100: about 15 hits)
    _epoch_with_scores(pol, 2.0, 100.0)
    assert pol.measuring_admission
    assert _new_offer_marks(mgr, 3000) == 10


def test_the_evidence_rests_while_admission_is_on() -> None:
    pol = AdaptivePolicy(1000)
    pol.configure(16, True)
    assert not pol.measuring_admission
    pol.configure(8, False)
    assert pol.measuring_admission


def test_the_default_marks_and_counts_through_a_manager() -> None:
    # A full cache of blocks two requests used; a new offer of blocks never
    # seen evicts ten of them: admission would have declined it.
    mgr = OffloadManager(100, policy="adaptive")
    pol = mgr.policy
    assert isinstance(pol, AdaptivePolicy) and not pol.admission
    old = ks(range(100))
    for r in range(2):
        _ask(mgr, old, f"old{r}")
    _ask(mgr, ks(range(1000, 1010)), "new")
    assert list(pol.evidence.stored) == ks(range(1000, 1010))
    assert sorted(pol.evidence.displaced) == sorted(ks(range(90, 100)))  # the tails
    ctx = RequestContext("again")
    hits = mgr.lookup(old, ctx)  # the lease budget (50 blocks) ends the run early
    assert hits < 90 and pol.evidence.votes_for == 0
    mgr.prepare_store(old, ctx)  # the rest is asked as it is offered
    assert pol.evidence.votes_for == 10 and not pol.evidence.displaced
    assert pol.sizes()["evidence_stored"] <= pol.size_bounds(10)["evidence_stored"]
