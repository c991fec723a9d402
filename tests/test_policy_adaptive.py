"""The adaptive policy (kvtier.policies.adaptive): contract, admission, shadows, bounds."""

from __future__ import annotations

import copy
import random
from collections.abc import Container, Sequence

import pytest
from helpers.policy_contract import drive_manager, exercise
from hypothesis import given, settings
from hypothesis import strategies as st
from test_plfu import OPS, plfu_invariants

import kvtier
from kvtier import OffloadManager, RequestContext
from kvtier.policies import (
    DEFAULT_POLICY,
    POLICIES,
    AdaptivePolicy,
    EvictionPolicy,
    LRUPolicy,
    PLFUPolicy,
    make_policy,
    policy_class,
)
from kvtier.policies.shadows import PLFUShadow, Shadow
from kvtier.policies.turns import TurnTracker
from kvtier.replay.behind_engine import replay_behind_engine, served_requests
from kvtier.replay.driver import replay, trace_keys
from kvtier.replay.generate import KINDS, generate


def k(i: int) -> bytes:
    return kvtier.block_key(i)


def ks(ids: range | list[int]) -> list[bytes]:
    return [k(i) for i in ids]


def _state(pol: EvictionPolicy) -> object:
    assert isinstance(pol, AdaptivePolicy)
    """Everything a failed evict must leave unchanged (PLFU's state and the mode)."""
    return copy.deepcopy({
        "window": list(pol._window), "recent": list(pol._recent.items()),
        "classes": [list(c) for c in pol._classes], "g1": (dict(pol._g1), dict(pol._g1_old)),
        "g2": (dict(pol._g2), dict(pol._g2_old)), "history": dict(pol.history),
        "numbers": (pol.target, pol.lfu_share, pol._carry, pol._base),
        "mode": pol.configuration(),
    })


def _request(pol: AdaptivePolicy, keys: list[bytes]) -> list[bytes]:
    """One request as the manager runs it: admission, room, store, access."""
    new = [key for key in keys if pol.segment(key) is None]
    new = new[:pol.admit(new)]
    victims: list[bytes] = []
    free = pol.capacity - len(pol)
    if len(new) > free:
        out = pol.evict(len(new) - free, set(keys))
        assert out is not None
        victims = out
    pol.blocked.update(new)
    pol.insert(new)
    pol.blocked.difference_update(new)
    pol.on_access(keys, set())
    return victims


def test_registered_and_the_default() -> None:
    assert POLICIES["adaptive"] is AdaptivePolicy
    assert DEFAULT_POLICY == "adaptive"
    assert policy_class("default") is AdaptivePolicy
    assert isinstance(OffloadManager(8, policy="default").policy, AdaptivePolicy)
    pol = make_policy("adaptive", 100)
    assert isinstance(pol, AdaptivePolicy)
    assert pol.configuration() == AdaptivePolicy.START
    assert AdaptivePolicy.MIN_RATE <= pol.rate <= AdaptivePolicy.MAX_RATE


def test_admission_declines_unknown_suffix_only_when_full() -> None:
    pol = AdaptivePolicy(4)
    pol.configure(8, True)
    assert pol.admit(ks(range(4))) == 4  # room for all: nothing declined
    _request(pol, ks(range(4)))
    assert len(pol) == 4
    assert pol.admit(ks(range(10, 13))) == 0  # full and never seen
    pol.on_access(ks(range(10, 13)), set())  # the request still used them
    assert pol.admit(ks([10, 11, 20, 12])) == 2  # known head, unknown from 20 on
    pol.configure(8, False)
    assert pol.admit(ks(range(30, 35))) == 5


def test_evict_skips_blocked_and_protected_or_fails_atomically() -> None:
    pol = AdaptivePolicy(6)
    _request(pol, ks(range(3)))
    _request(pol, ks(range(3)))
    _request(pol, ks(range(10, 13)))
    pol.blocked.update([k(10), k(0)])
    before = _state(pol)
    assert pol.evict(5, {k(11)}) is None
    assert _state(pol) == before
    victims = pol.evict(3, {k(11)})
    assert victims is not None and len(set(victims)) == 3
    assert not {k(10), k(0), k(11)} & set(victims)
    assert pol.evict(0, set()) == []


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), OPS, st.integers(0, 2**32), st.booleans())
def test_random_operations_keep_the_contract(capacity: int, ops: list, seed: int,
                                             admission: bool) -> None:
    pol = AdaptivePolicy(capacity)
    pol.configure(8, admission)
    exercise(pol, ops, random.Random(seed), invariants=plfu_invariants, snapshot=_state)


def _bound(pol: AdaptivePolicy) -> int:
    """The docstring's memory bound, in keys."""
    factor = max(AdaptivePolicy.FACTORS) + 4
    shadows = 2 * len(pol.shadows) * pol._shadow_capacity
    return factor * (pol.capacity + shadows) + AdaptivePolicy.TURN_ENDS * pol.capacity


def test_state_stays_bounded_under_long_random_use() -> None:
    rng = random.Random(3)
    pol = AdaptivePolicy(64)
    docs = [list(range(1000 * d, 1000 * d + rng.randint(2, 10))) for d in range(300)]
    fresh = 10**7
    for i in range(6000):
        ids = list(docs[int(rng.paretovariate(1.0)) % len(docs)])
        ids += list(range(fresh, fresh + rng.randint(1, 6)))
        fresh += 10
        _request(pol, ks(ids))
        if i % 500 == 0:
            sizes = pol.sizes()
            assert sizes["window"] + sizes["main"] == len(pol) <= 64
            assert sum(sizes.values()) <= _bound(pol)
            for s in pol.shadows:
                assert len(s.resident) <= s.capacity
                if isinstance(s, PLFUShadow):
                    assert len(s.policy) == len(s.resident)
                    assert len(s.policy.history) <= s.policy.history_limit
    pol.clear()
    assert len(pol) == 0 and pol.configuration() == AdaptivePolicy.START
    assert pol.sizes()["shadow_resident"] == 0


def test_shadows_stay_bounded_when_requests_are_larger_than_the_cache() -> None:
    # the manager stores nothing of an offer larger than the cache; a shadow,
    # offered more sampled keys than it holds, keeps their head
    from kvtier import OffloadManager, RequestContext

    mgr = OffloadManager(100, policy="adaptive")
    assert isinstance(mgr.policy, AdaptivePolicy)
    for r in range(60):
        ctx = RequestContext(f"r{r}")
        keys = ks(range(r * 1000, r * 1000 + 400))
        ctx.set_positions(keys, 16, 16)
        mgr.lookup(keys, ctx)
        assert mgr.prepare_store(keys, ctx) is None
        mgr.on_request_finished(ctx)
    for shadow in mgr.policy.shadows:
        assert len(shadow.resident) <= shadow.capacity
        if isinstance(shadow, PLFUShadow):
            assert len(shadow.resident) == len(shadow.policy)


def test_follows_the_best_shadow() -> None:
    # Hot documents reused far apart, between floods of one-off blocks: the
    # admission shadows score more, and the real cache takes their mode.
    pol = AdaptivePolicy(400)
    rng = random.Random(5)
    hot = [list(range(100_000 * d, 100_000 * d + 4)) for d in range(150)]
    fresh = 10**8
    for _ in range(8000):
        ids = list(hot[rng.randrange(len(hot))]) if rng.random() < 0.4 else []
        ids += list(range(fresh, fresh + 8))
        fresh += 8
        _request(pol, ks(ids))
    assert pol.switches >= 1
    assert pol.admission


class _FedEachRequest(AdaptivePolicy):
    """The shadows fed at every request, as before session 40 (the reference)."""

    def on_demand_access(self, keys: Sequence[bytes], reused: Container[bytes],
                         asked_from: int) -> None:
        super().on_demand_access(keys, reused, asked_from)
        self._feed_pending()


class _FedNewestFirst(AdaptivePolicy):
    """An epoch's requests fed newest first (the negative control)."""

    def _feed_pending(self) -> None:
        self._pending.reverse()
        super()._feed_pending()


def _decisions(cls: type[AdaptivePolicy], seed: int) -> list[object]:
    """What ``cls`` (400 blocks) admits and evicts at each request of hot
    documents between floods of new blocks, some served in part by an engine
    cache in front (``asked_from``); then its shadows' scores."""
    rng = random.Random(seed)
    pol = cls(400)
    hot = [list(range(100_000 * d, 100_000 * d + 4)) for d in range(150)]
    out: list[object] = []
    for fresh in range(10**8, 10**8 + 8 * 6000, 8):
        ids = list(hot[rng.randrange(len(hot))]) if rng.random() < 0.4 else []
        keys = ks(ids + list(range(fresh, fresh + 8)))
        new = [key for key in keys if pol.segment(key) is None]
        admitted = pol.admit(new)
        new = new[:admitted]
        over = len(pol) + len(new) - pol.capacity
        victims = pol.evict(over, set(keys)) if over > 0 else []
        assert victims is not None
        pol.insert(new)
        pol.on_demand_access(keys, set(), rng.randrange(len(ids) + 1))
        out.append((admitted, victims, pol.configuration()))
    pol._feed_pending()  # what an epoch's end would feed them
    out.append([(s.score, s.spread, s.hits, len(s.resident)) for s in pol.shadows])
    return out


@pytest.mark.parametrize("seed", [5, 6])
def test_shadows_fed_an_epoch_at_a_time_decide_as_if_fed_each_request(seed: int) -> None:
    # the shadows are read only at an epoch's end: feeding them its requests
    # then, one shadow at a time, leaves every score, spread and decision as
    # it was; feeding them in another order does not
    reference = _decisions(_FedEachRequest, seed)
    assert {mode for _, _, mode in reference[:-1]} != {AdaptivePolicy.START}  # they switch
    assert _decisions(AdaptivePolicy, seed) == reference
    assert _decisions(_FedNewestFirst, seed) != reference


class _NoCorrection(AdaptivePolicy):
    """The switch without the continuity correction (the negative control)."""

    def _decide(self) -> None:
        shadows, active = self.shadows, self.shadows[self._active]
        for s in shadows:
            s.score, s.spread, s.hits = s.score * self.DECAY + s.hits, s.spread * self.DECAY, 0
        best = max(range(len(shadows)), key=lambda i: shadows[i].score)
        gap = shadows[best].score - active.score
        if best != self._active and gap > 0 and gap * gap > self.Z**2 * shadows[best].spread:
            self._switch(best)


@pytest.mark.parametrize("hits, switches", [(4, 0), (6, 1)])
def test_a_lead_counts_one_hit_less(hits: int, switches: int) -> None:
    # A challenger ahead by `hits` over requests that differed by one hit
    # each, about 6 of them (spread 5.8; in the second epoch on the production
    # trace at 16,000 blocks, a lead of 4 switched admission on by chance): 4
    # passes 1.5 sigma only without the correction, 6 passes with it.
    def decide(cls: type[AdaptivePolicy]) -> int:
        pol = cls(16_000)
        leader = pol.shadows[1]
        leader.hits, leader.spread = hits, 5.8 / pol.DECAY
        pol._decide()
        return pol.switches

    assert decide(AdaptivePolicy) == switches
    assert decide(_NoCorrection) == 1


def generated_hit_ratios(kind: str, seed: int, requests: int, capacity: int,
                         *policies: str) -> list[float]:
    """Hit ratio of each of ``policies`` on ``kvtier generate KIND`` traffic
    (``seed``, ``requests``) at ``capacity`` blocks."""
    keys = trace_keys(generate(kind, seed, requests))
    return [replay(keys, capacity, policy).hit_ratio for policy in policies]


def chat_hit_ratios(seed: int, requests: int, capacity: int,
                    control: str) -> tuple[float, float, float]:
    """Hit ratios of LRU, the default and this module's ``control`` policy on
    generated chat (``seed``, ``requests``) at ``capacity`` blocks."""
    lru, default, ctl = generated_hit_ratios(
        "chat", seed, requests, capacity, "lru", "default", f"test_policy_adaptive:{control}")
    return lru, default, ctl


class _NoReturn(AdaptivePolicy):
    """The switch without the return to START (the negative control)."""

    def _back_to_start(self, shadows: list[Shadow]) -> bool:
        return False


@pytest.mark.parametrize("start_hits, back", [(9, False), (10, True)])
def test_returns_to_start_once_its_shadow_scores_as_well(start_hits: int, back: bool) -> None:
    # A lead beyond noise switches admission on; an epoch later the start's
    # shadow scores as well as the leader (10 against 10 * DECAY), though not
    # better by more than noise: the default returns, the control stays; at 9
    # the start's shadow is still behind and both stay.
    def run(cls: type[AdaptivePolicy]) -> tuple[tuple[int, bool], int]:
        pol = cls(16_000)
        leader = pol.shadows[1]
        start = pol.shadows[pol.CANDIDATES.index(pol.START)]
        leader.hits, leader.spread = 10, 5.8 / pol.DECAY
        pol._decide()
        assert pol.configuration() == (leader.history_factor, True)
        start.hits, start.spread = start_hits, 50.0
        pol._decide()
        return pol.configuration(), pol.switches

    assert run(AdaptivePolicy) == ((AdaptivePolicy.START, 2) if back else ((4, True), 1))
    assert run(_NoReturn) == ((4, True), 1)


def test_a_chance_lead_does_not_hold_chat_below_lru_in_a_small_cache() -> None:
    # Generated chat (seed 41) at 500 blocks, where the shadows hold 16 blocks:
    # admission came on by chance and, without the return, stayed (0.946 x LRU)
    lru, default, control = chat_hit_ratios(41, 10_000, 500, "_NoReturn")
    assert default >= 0.98 * lru
    assert control < 0.96 * lru


def test_manager_with_adaptive_pins_leases_failures_and_declines() -> None:
    mgr = OffloadManager(16, policy="adaptive", max_leases_per_request=16,
                         max_leased_blocks=16)
    assert isinstance(mgr.policy, AdaptivePolicy)
    mgr.policy.configure(8, True)
    drive_manager(mgr, random.Random(7), 600, prefixes=6)
    assert mgr.stats()["stores_skipped"] > 0  # admission declined some


def test_declined_block_is_stored_on_its_next_offer() -> None:
    mgr = OffloadManager(2, policy="adaptive")
    pol = mgr.policy
    assert isinstance(pol, AdaptivePolicy)
    pol.configure(8, True)

    def run(ids: list[int], name: str) -> list[bytes]:
        keys = ks(ids)
        ctx = RequestContext(name)
        ctx.set_positions(keys, 16, 16)
        mgr.lookup(keys, ctx)
        out = mgr.prepare_store(keys, ctx)
        stored = list(out.keys_to_store) if out is not None else []
        if stored:
            mgr.complete_store(stored, ctx)
        mgr.on_request_finished(ctx)
        return stored

    assert run([1, 2], "a") == ks([1, 2])  # room: stored
    assert run([3], "b") == []  # full, never seen: declined
    assert mgr.stats()["stores_skipped"] == 1
    assert run([3], "c") == ks([3])  # seen once: admitted
    assert mgr.contains(k(3))


def test_configure_takes_only_candidates() -> None:
    pol = AdaptivePolicy(10)
    pol.configure(32, True)
    assert pol.configuration() == (32, True) and pol.history_limit == 320
    with pytest.raises(ValueError):
        pol.configure(5, True)


# -- what the request asked for (behind a cache in front) --------------------------

DEMANDS: list[tuple[list[bytes], int]] = []
"""What ``_DemandRecorder`` was told, access by access."""


class _DemandRecorder(LRUPolicy):
    wants_demand = True

    def on_demand_access(self, keys, reused, asked_from):  # type: ignore[no-untyped-def]
        DEMANDS.append((list(keys), asked_from))
        super().on_demand_access(keys, reused, asked_from)


class _PlainRecorder(_DemandRecorder):
    wants_demand = False  # negative control: the manager must call on_access only


class _NoDemand(AdaptivePolicy):
    wants_demand = False  # negative control: shadows score every key they hold


def _serve(mgr: OffloadManager, ids: list[int], asked: int | None, name: str) -> None:
    """A request as vLLM runs it without kvtier hits: lookups from block
    ``asked`` (None: no lookup), then an offer of every block."""
    keys = ks(ids)
    ctx = RequestContext(name)
    ctx.set_positions(keys, 32, 32)
    if asked is not None:
        assert mgr.lookup(keys[asked:], ctx) == 0
    out = mgr.prepare_store(keys, ctx)
    assert out is not None
    mgr.complete_store(list(out.keys_to_store), ctx)
    mgr.on_request_finished(ctx)


def test_manager_says_where_the_asked_keys_start() -> None:
    DEMANDS.clear()
    mgr = OffloadManager(64, policy="test_policy_adaptive:_DemandRecorder")
    _serve(mgr, list(range(6)), 2, "a")  # blocks 0-1 came from the engine
    _serve(mgr, list(range(10, 14)), 0, "b")
    # never looked up (the engine's cache served it whole): nothing was asked
    _serve(mgr, list(range(20, 23)), None, "c")
    assert [(ks(range(6)), 2), (ks(range(10, 14)), 0), (ks(range(20, 23)), 3)] == DEMANDS
    ctx = RequestContext("d")
    mgr.lookup_one(k(30), ctx)  # vLLM's lookups come one key at a time
    mgr.lookup_one(k(31), ctx)
    assert ctx.first_asked == k(30)
    mgr.on_request_finished(ctx)
    assert ctx.first_asked is None  # cleared with the request's state

    DEMANDS.clear()
    plain = OffloadManager(64, policy="test_policy_adaptive:_PlainRecorder")
    _serve(plain, list(range(6)), 2, "a")
    assert DEMANDS == []


def test_asked_from_places_an_absent_first_key_by_position() -> None:
    ctx = RequestContext("r")
    keys = ks([1, 2, 3, 4])
    ctx.set_positions(keys, 32, 32)
    assert ctx.asked_from(keys) == len(keys)  # never looked up: nothing asked
    ctx.first_asked = k(3)
    assert ctx.asked_from(keys) == 2
    ctx.set_position(k(9), 80)  # between blocks 2 and 3, and not held
    ctx.first_asked = k(9)
    assert ctx.asked_from([k(1), k(2), k(4)]) == 2
    ctx.first_asked = k(99)  # no position either: counts every key as asked
    assert ctx.asked_from(keys) == 0


def test_shadow_scores_only_the_keys_the_request_asked_for() -> None:
    s = PLFUShadow(8, 8, False)
    s.access(ks(range(4)))
    s.access(ks(range(4)))
    assert s.last == 4
    s.access(ks(range(4)), asked_from=3)  # blocks 0-2 were served in front
    assert s.last == 1 and s.hits == 5


def test_behind_the_engine_the_shadows_find_admission() -> None:
    # Generated chat behind a 500-block engine cache: a turn offers the blocks
    # the engine served it; admission pays in a 1,000-block tier, and only
    # shadows that leave those blocks out of their score can see it.
    requests = served_requests(generate("chat", 1, 3000))
    lru = replay_behind_engine(requests, 1000, "lru", gpu_blocks=500)
    default = replay_behind_engine(requests, 1000, "default", gpu_blocks=500)
    control = replay_behind_engine(requests, 1000, "test_policy_adaptive:_NoDemand",
                                   gpu_blocks=500)
    assert default.stores_skipped > 0 and control.stores_skipped == 0
    assert default.hit_ratio > 1.1 * lru.hit_ratio
    assert control.hit_ratio < default.hit_ratio


def test_a_request_the_engine_served_whole_scores_no_shadow_hit() -> None:
    """vLLM never asks kvtier about a request whose every block the engine's
    cache held; its offer of those blocks is no demand on the tier, so no
    shadow scores it (with the old reading, "never looked up: all asked",
    every shadow holding them scored a hit)."""
    mgr = OffloadManager(64, policy="adaptive")
    pol = mgr.policy
    assert isinstance(pol, AdaptivePolicy)
    # two sampled blocks a request: three requests stay within one epoch
    keys = [key for key in ks(range(2000)) if pol.sampled([key])][:2]
    assert 3 * len(keys) < pol._shadow_capacity
    ids = [int.from_bytes(key[:8], "big") for key in keys]
    _serve(mgr, ids, 0, "asked")  # asked and missed: stored in every shadow
    pol._feed_pending()
    assert [s.hits for s in pol.shadows] == [0] * len(pol.shadows)
    _serve(mgr, ids, None, "engine")  # the same blocks, never asked for
    pol._feed_pending()
    assert [s.hits for s in pol.shadows] == [0] * len(pol.shadows)
    ctx = RequestContext("asked again")  # control: asked, held, scored
    assert mgr.lookup(keys, ctx) == len(ids)
    assert mgr.prepare_store(keys, ctx) is not None
    mgr.on_request_finished(ctx)
    pol._feed_pending()
    assert all(s.hits == len(ids) for s in pol.shadows)


def test_stats_report_the_active_configuration() -> None:
    mgr = OffloadManager(16, policy="adaptive")
    stats = mgr.stats()
    assert (stats["policy_history_factor"], stats["policy_admission"],
            stats["policy_switches"]) == (8, 0, 0)
    assert isinstance(mgr.policy, AdaptivePolicy)
    mgr.policy.configure(32, True)
    stats = mgr.stats()
    assert (stats["policy_history_factor"], stats["policy_admission"],
            stats["policy_switches"]) == (32, 1, 1)
    assert not any(name.startswith("policy_") for name in OffloadManager(16).stats())


def _request_behind(pol: AdaptivePolicy, keys: list[bytes], asked_from: int) -> None:
    """``_request`` for a request whose first ``asked_from`` keys a cache in
    front served (they are offered, not asked for)."""
    new = [key for key in keys if pol.segment(key) is None]
    free = pol.capacity - len(pol)
    if len(new) > free:
        assert pol.evict(len(new) - free, set(keys)) is not None
    pol.insert(new)
    pol.on_demand_access(keys, set(), asked_from)


def test_a_conversation_turn_puts_its_new_blocks_in_main() -> None:
    pol = AdaptivePolicy(64)
    turn1 = ks(range(5))
    _request(pol, turn1)
    assert {pol.segment(key) for key in turn1} == {"window"}
    turn2 = turn1 + ks(range(5, 9))  # goes on where turn 1 ended
    _request(pol, turn2)
    assert {pol.segment(key) for key in turn2} == {"main"}
    assert all(pol.history[key] == 1 for key in ks(range(5, 9)))
    branch = ks(range(3)) + ks(range(100, 104))  # block 2 ended no request
    _request(pol, branch)
    assert {pol.segment(key) for key in ks(range(100, 104))} == {"window"}
    assert pol.sizes()["turn_ends"] == 3


def test_a_turn_served_by_the_cache_in_front_stays_in_the_window() -> None:
    pol = AdaptivePolicy(64)
    turn1 = ks(range(5))
    _request(pol, turn1)
    turn2 = turn1 + ks(range(5, 9))
    _request_behind(pol, turn2, asked_from=len(turn1))  # turn 1 came from the engine
    assert {pol.segment(key) for key in ks(range(5, 9))} == {"window"}
    turn3 = turn2 + ks(range(9, 12))
    _request_behind(pol, turn3, asked_from=len(turn2) - 1)  # block 8 asked from here
    assert {pol.segment(key) for key in ks(range(9, 12))} == {"main"}


def test_turn_tracker_keeps_the_latest_ends_within_its_limit() -> None:
    turns = TurnTracker(3)
    for i in range(5):
        turns.ended(ks([i]))
    assert len(turns) == 3
    assert turns.continues(ks([4, 50]), 1)
    assert not turns.continues(ks([0, 50]), 1)  # the oldest end was dropped
    assert not turns.continues(ks([4, 50]), 1, asked_from=1)  # served in front
    assert not turns.continues(ks([4]), 1)  # nothing new after it
    turns.ended(ks([2]))  # an end seen again becomes the newest
    turns.ended(ks([7]))
    assert turns.continues(ks([2, 50]), 1) and not turns.continues(ks([3, 50]), 1)
    turns.ended([])
    assert len(turns) == 3
    with pytest.raises(ValueError, match="TurnTracker limit"):
        TurnTracker(0)


class _NeverATurn(TurnTracker):
    def continues(self, keys: object, first_new: int, asked_from: int = 0) -> bool:
        return False


class _NoTurns(AdaptivePolicy):
    """Negative control: conversation turns never recognised."""

    def _init_adaptive(self) -> None:
        super()._init_adaptive()
        self.turns = _NeverATurn(1)


def test_turns_keep_a_chat_at_lru_where_the_window_lost_it() -> None:
    # Generated chat (seed 21, the seed that showed the loss): without turns
    # the last turn's new blocks wait in the window and are gone when the
    # conversation comes back; the default then fell below 0.98 x LRU.
    lru, default, control = chat_hit_ratios(21, 3000, 1000, "_NoTurns")
    assert default >= 0.98 * lru
    assert control < default - 0.005


class _LowStart(AdaptivePolicy):
    """Negative control: the window's room starts at its lower bound, as PLFU's
    (and, as when the start was chosen, without the admission evidence: with
    it, the low start kept 0.84-1.02 x LRU on the test below, the evidence
    taking admission where the window lost a turn's blocks)."""

    START_WINDOW = AdaptivePolicy.MIN_WINDOW
    wants_asks = False


def test_the_window_starts_at_its_upper_bound_and_returns_there() -> None:
    pol = AdaptivePolicy(1000)
    assert pol.target == 1000 * AdaptivePolicy.MAX_WINDOW
    assert PLFUPolicy(1000).target == 1000 * PLFUPolicy.MIN_WINDOW
    assert all(s.policy.target == s.capacity * PLFUPolicy.MIN_WINDOW
               for s in pol.shadows if isinstance(s, PLFUShadow))
    pol.target = 100.0
    pol.clear()
    assert pol.target == 500.0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_busy_engines_chat_keeps_lru_hits_from_the_first_requests(seed: int) -> None:
    # Generated chat behind a 500-block engine cache that always has 2,048
    # tokens of work (many conversations in flight), first 1,000 requests,
    # 1,000 CPU blocks: each conversation's new blocks come back at its next
    # turn. From the lower bound the window grew to 166 blocks at most (seed
    # 1) and the default kept 0.83-0.85 x LRU's hits (0.89 x vLLM's LRU in the
    # server); a subclass starting there is the negative control.
    requests = served_requests(generate("chat", seed, 1000))

    def hits(policy: str) -> float:
        return replay_behind_engine(requests, 1000, policy, gpu_blocks=500,
                                    batch_tokens=2048).hit_ratio

    lru, default, control = hits("lru"), hits("default"), hits("test_policy_adaptive:_LowStart")
    assert default >= 0.9 * lru
    assert control < 0.86 * lru


@pytest.mark.parametrize("kind", KINDS)
def test_behind_the_engine_the_default_keeps_lru_hits_on_every_generated_kind(
        kind: str) -> None:
    # The engine view of issue 11's generated row: each kind served through a
    # 500-block engine cache (one request at a time), 10,000 requests, the CPU
    # tier at 2x / 8x it. The default's worst over seeds 1-3 and 21-24 is
    # 0.985 x LRU (docs/policy.md, "The engine view over every generated
    # kind"); PLFU, its negative control, keeps 0.974 x on drift at 2x.
    requests = served_requests(generate(kind, 1, 10_000))

    def hits(policy: str, capacity: int) -> float:
        return replay_behind_engine(requests, capacity, policy, gpu_blocks=500).hit_ratio

    for capacity in (1000, 4000):
        assert hits("default", capacity) >= 0.98 * hits("lru", capacity)
    if kind == "drift":
        assert hits("plfu", 1000) < 0.98 * hits("lru", 1000)


class _NoLRU(AdaptivePolicy):
    """Negative control: the default that never follows its LRU candidate."""

    RECENCY_AFTER = 1 << 62


@pytest.mark.parametrize("seed", [42, 44, 72])
def test_drift_keeps_lru_hits_at_4000_blocks_on_fresh_seeds(seed: int) -> None:
    # Popularity drift (kvtier generate drift), 10,000 requests, 4,000 blocks:
    # the row of issue 11 asks every generated workload for >= 0.98 x LRU.
    # ARC's rule swings PLFU's window between a fifth and half of the cache
    # there, and without its LRU candidate the default keeps 0.975 / 0.979 /
    # 0.976 x LRU on these seeds (docs/policy.md, "Popularity drift on seeds
    # never looked at"); the LRU shadow leads once the scores hold a full
    # memory, and the cache runs as LRU from then on (docs/policy.md, "The
    # LRU candidate").
    lru, default, control = generated_hit_ratios("drift", seed, 10_000, 4000, "lru", "default",
                                                 "test_policy_adaptive:_NoLRU")
    assert default >= 0.98 * lru
    assert control < 0.98 * lru
