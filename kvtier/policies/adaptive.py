"""Adaptive PLFU, kvtier's default policy: PLFU whose history length and
admission are chosen online by miniature simulation (SHARDS-style shadow caches).

docs/policy.md ("Adaptive") has the measurements behind it.
"""

from __future__ import annotations

from collections.abc import Collection, Container, Iterable, Sequence

from kvtier.policies.admission_evidence import AdmissionEvidence
from kvtier.policies.key_sample import KeySample
from kvtier.policies.plfu import PLFUPolicy
from kvtier.policies.shadows import LRUShadow, PLFUShadow, Shadow
from kvtier.policies.turns import TurnTracker


class AdaptivePolicy(PLFUPolicy):
    """PLFU (``kvtier.policies.plfu``) whose trace-dependent choices are made
    online: how long the frequency history reaches back (``history_factor``
    times the capacity), whether a new block that the history has never
    seen may push out a resident one (admission), and whether to run the
    cache as LRU instead (``recency``) where frequency does not pay.

    Owns, besides PLFU's state (see :class:`PLFUPolicy`):

    * ``shadows`` (``kvtier.policies.shadows``): one miniature PLFU per
      candidate configuration (``CANDIDATES``) and, last, a miniature LRU,
      each of ``rate * capacity`` blocks, fed
      the keys whose CRC-32 falls in the sampled ``rate`` of the hash space
      (spatial sampling, as SHARDS does: a sampled key is sampled in every
      request). Each scores its hits, decayed by ``DECAY`` per epoch of
      ``shadow capacity`` sampled accesses. The shadows are read only at an
      epoch's end, so a request's sampled keys wait in ``_pending`` (less
      than an epoch's, plus one request's) and the shadows take an epoch's
      requests one shadow at a time: each finds its own state in the CPU
      caches, which a shadow fed at every request did not (docs/policy.md,
      "Cost side by side"). A hit counts only among the keys
      the request asked the cache for (``on_demand_access``): behind the
      engine's prefix cache a request offers blocks the engine served it, and
      a shadow holding those has gained nothing;
    * the active configuration: after each epoch the real cache takes the best
      shadow's configuration if it is ahead by more than noise (``Z``), and
      goes back to ``START``'s once that shadow scores as well as the active
      one. Switching between PLFU configurations changes two numbers
      (``history_limit``, ``admission``); no state is rebuilt. The LRU
      shadow may be followed only after ``RECENCY_AFTER`` epochs; following
      it puts the cache in PLFU's recency mode (``PLFUPolicy.recency``: the
      main segment drains into the window, which runs as LRU) until a PLFU
      configuration is taken again (the return to ``START``, or one that
      leads).

    * ``evidence`` (``kvtier.policies.admission_evidence``): while admission
      is off, what it would have changed on the cache itself, from the keys
      requests ask for (``on_asked``: every key, in the order the cache sees
      them, where the shadows see a sample, each request whole at its end).
      A shadow's lead for admission is not followed while the evidence is
      against admission beyond noise; where the shadows do not decide, the
      best admission configuration is taken when the evidence is for it
      beyond noise and its shadow scores above ``START``'s (docs/policy.md,
      "Admission measured on the cache"). Both need an admission shadow
      within noise of ``START``'s, so the evidence is fed only in epochs
      that follow one (``measuring_admission``; docs/policy.md, "The
      evidence rests while the shadows rule admission out").

    Admission (``wants_admission``): while active, ``admit`` stores the
    leading candidates the history knows and declines the rest of the offer
    (a suffix, so a stored block's prefix is stored with it), unless all of
    them fit without eviction. Declined keys still count as used by the
    request, so their next offer is admitted.

    Conversation turns (``turns``, a :class:`~kvtier.policies.turns.TurnTracker`
    of ``TURN_ENDS * capacity`` request ends): when a request's first block
    never seen follows the last block of a recent request, its new blocks enter
    the main segment (``PLFUPolicy.enter_main``) instead of the window: they
    are the prefix of the conversation's next turn. The shadows are plain PLFU.

    Invariants: PLFU's (``evict`` atomic, never a blocked or protected key,
    ``len`` = resident blocks); shadows never see blocked keys, and neither
    they nor the evidence affect the real cache except through the
    configuration.

    Memory: PLFU's bound with the largest history (``max(FACTORS) *
    capacity`` history keys, about ``3 * capacity`` ghosts), plus the shadows:
    ``len(CANDIDATES)`` miniatures of ``rate * capacity`` blocks with the same
    bounds each, where ``rate`` is at most ``MAX_RATE``, and the LRU
    miniature's ``rate * capacity`` keys; in all at most about
    ``(max(FACTORS) + 4) * capacity * (1 + (len(CANDIDATES) + 1) * rate)`` keys,
    ``TURN_ENDS * capacity`` request ends, the sampled keys waiting for
    the epoch's end (fewer than a shadow's capacity plus one request's), and
    the evidence's marks (``2 * min(capacity, EVIDENCE_BLOCKS)`` keys).
    """

    name = "adaptive"
    wants_admission = True
    wants_demand = True
    wants_asks = True

    FACTORS = (4, 8, 16, 32)
    """Candidate history lengths with admission, in multiples of the capacity
    (with admission on, the history is also the doorkeeper's memory)."""
    CANDIDATES = ((8, False), *((f, True) for f in FACTORS))
    """(history factor, admission) of each shadow: PLFU as it is, and PLFU with
    admission over each history length (without admission, the history length
    changed little in measurement)."""
    START = (8, False)
    """Configuration before the first decision (PLFU's), and the prior: leaving
    it takes a lead beyond noise (``Z``), staying away a lead at all. As soon
    as the active configuration's shadow no longer scores above START's, the
    cache returns to START. Without the return, a lead that passed ``Z`` by
    chance held for the rest of the replay wherever the two configurations
    then scored about alike: on generated chat at 500 blocks (shadows of 16
    blocks) admission came on under one key sample of eight and kept the
    default at 0.946 x LRU (docs/policy.md, "Small caches")."""
    STEP_SCALE = 2048
    """PLFU's window target moves ``capacity / STEP_SCALE`` blocks per ghost hit
    (PLFU: 8192). Four times PLFU's step lets a large cache follow a change of
    traffic within one pass of the new working set (on the phase traces at
    16,000 blocks it recovers LRU's hits; docs/policy.md, "Adaptive PLFU")."""
    START_WINDOW = PLFUPolicy.MAX_WINDOW
    """The window's room starts at its upper bound (PLFU's starts at its lower,
    ``MIN_WINDOW``); ghosts move it from there. ARC's rule moves ``target``
    a step per ghost that comes back, and each ghost list holds only its own
    segment's victims: from the lower bound the window earns its room one
    window ghost at a time, while a main segment that never pays a victim
    sends no ghost back to argue against it. Behind a busy engine (generated
    chat, 2,048 batch tokens, 500 engine blocks, 1,000 CPU blocks) a
    conversation's new blocks come back at its next turn: from the lower
    bound 185 window ghosts came back in 1,000 requests, the window reached
    166 blocks and the default kept 0.83-0.85 x LRU's hits on seeds 1-3
    (0.89 x vLLM's LRU in the server); from the upper bound a main segment
    too small pays victims and its ghosts pull the window down, so both
    sides learn from the first evictions (docs/policy.md, "Where the window
    starts")."""
    SHADOW_BLOCKS = 64
    """Shadow size aimed at: the sampling rate is ``SHADOW_BLOCKS / capacity``..."""
    MAX_RATE = 1 / 32
    """...at most this (small caches: the shadows cost at most this share each)..."""
    MIN_RATE = 1 / 256
    """...and at least this (caches past 16,384 blocks get larger shadows;
    1/128 cost a third of a microsecond per key at 16,000 blocks and chose
    the same configurations there, docs/policy.md "Cost")."""
    MIN_SHADOW = 8
    """Smallest shadow capacity, in blocks."""
    EVIDENCE_BLOCKS = 1024
    """The admission evidence marks every key up to this capacity and, past
    it, a key sample (``KeySample``) of rate ``EVIDENCE_BLOCKS / capacity``,
    so its marks never exceed ``2 * EVIDENCE_BLOCKS`` keys. On whole keys it
    cost 0.38 x LRU's manager time at 16,000 blocks, its two mark sets of
    24,000 keys meeting the CPU caches cold at every ask; sampled, 0.2 x,
    and of 852 lab cells at 4,000 and 16,000 blocks 814 kept their hits
    exactly, 38 moved by -1.5 to +3.6 % (docs/policy.md, "The evidence
    sampled on large caches")."""
    DECAY = 1 - 1 / max(FACTORS)
    """Weight of the previous score at each epoch: scores remember about as many
    accesses as the longest candidate history reaches back."""
    Z = 1.5
    """A configuration replaces the active one only when its score is ahead by more
    than ``Z`` standard deviations of the difference (estimated from the
    per-request differences of the two shadows, which see the same keys): a
    hysteresis, so a tie does not flip-flop and a clear lead is followed
    within a few epochs. At one sigma a shadow of about a hundred blocks
    switched admission on for a lead of two hits, and a phase change caught
    it there (docs/policy.md, "Adaptive PLFU"). The lead is counted less one
    hit (McNemar's continuity correction: hits are counts, and over the first
    epochs, when the spread comes from a handful of requests, a lead of a few
    hits passes the normal test by chance; on the issue's production trace at
    16,000 blocks, where the shadows get seven epochs in all, a lead of 4 hits
    in the second switched admission on under 2 of 8 key samples and kept
    0.5406 / 0.5460 against ARC's 0.5553: docs/policy.md, "One replay is one
    draw")."""

    RECENCY_AFTER = round(1 / (1 - DECAY))
    """Epochs before the LRU candidate may be followed: one memory of the
    scores (``DECAY``). Following LRU changes how the cache is run (the main
    segment drains, ``PLFUPolicy.recency``), not two numbers, so it waits for
    scores that hold a full memory of the traffic. Followed from the first
    epoch, on generated drift at 16,000 blocks (eleven epochs in 10,000
    requests) LRU's 64-block shadow led and the cache followed it, where the
    default keeps 2-3 % more hits than LRU (docs/policy.md, "The LRU
    candidate")."""

    TURN_ENDS = 1
    """Request ends remembered, in multiples of the capacity: a conversation
    that comes back after more requests than the cache has blocks starts over
    in the window (by then the cache holds little of it). On generated chat
    at 1,000 blocks, 1/8 to 2 x the capacity all kept the default above
    0.98 x LRU; 1 x kept every surrogate's gain at 16,000 blocks, which 1/8
    and 1/4 x lost part of, at half the memory of 2 x."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity, history_factor=self.START[0])
        rate = min(self.MAX_RATE, max(self.MIN_RATE, self.SHADOW_BLOCKS / capacity))
        self.rate = rate
        self._sample = KeySample(rate)
        self._shadow_capacity = max(self.MIN_SHADOW, round(capacity * rate))
        self.switches = 0
        """Configuration switches the shadows chose (and ``configure`` calls);
        a counter (``vllm:kvtier_policy_switches``): ``clear()`` keeps it, so
        the switches since its last report are not lost at a cache reset."""
        self._init_adaptive()

    def _init_adaptive(self) -> None:
        self.shadows: list[Shadow] = [PLFUShadow(self._shadow_capacity, f, adm)
                                      for f, adm in self.CANDIDATES]
        self.shadows.append(LRUShadow(self._shadow_capacity, self.START[0]))
        self._epochs = 0  # ended, up to RECENCY_AFTER (no further)
        self._start = self.CANDIDATES.index(self.START)
        self._active = self._start
        self.history_factor, self.admission = self.START
        self.history_limit = self.history_factor * self.capacity
        self._sampled = 0
        self._pending: list[tuple[list[bytes], int]] = []  # this epoch's sampled requests
        self.turns = TurnTracker(self.TURN_ENDS * self.capacity)
        self.evidence = AdmissionEvidence(self.capacity,
                                          min(1.0, self.EVIDENCE_BLOCKS / self.capacity))
        self._measuring = True  # the evidence is fed (_update_measuring)

    # -- introspection -------------------------------------------------------

    def sizes(self) -> dict[str, int]:
        sizes = super().sizes()
        sizes.update(_shadow_totals(s.sizes() for s in self.shadows))
        sizes["shadow_pending"] = sum(len(keys) for keys, _ in self._pending)
        sizes["turn_ends"] = len(self.turns)
        sizes.update(self.evidence.sizes())
        return sizes

    def size_bounds(self, batch: int) -> dict[str, int]:
        bounds = super().size_bounds(batch)
        bounds["history"] = bounds["history_aging"] = max(self.FACTORS) * self.capacity + batch
        bounds.update(_shadow_totals(s.size_bounds(batch, max(self.FACTORS))
                                     for s in self.shadows))
        bounds["shadow_pending"] = self._shadow_capacity + batch
        bounds["turn_ends"] = self.turns.limit
        bounds["evidence_stored"] = bounds["evidence_displaced"] = self.evidence.limit
        return bounds

    def gauges(self) -> dict[str, int]:
        """The active configuration and how often it changed: ``history_factor``,
        ``admission`` (1 while on), ``recency`` (1 while the cache runs as
        LRU), ``admission_evidence`` (the evidence's decayed lead, in hits:
        above 0 for admission) and ``switches`` (never decreases, also across
        ``clear()``, which returns to ``START`` without counting)."""
        return {"history_factor": self.history_factor, "admission": int(self.admission),
                "recency": int(self.recency),
                "admission_evidence": round(self.evidence.lead),
                "switches": self.switches}

    @property
    def measuring_admission(self) -> bool:
        """Whether the evidence is fed now (``_update_measuring``)."""
        return self._measuring

    def configuration(self) -> tuple[int, bool]:
        """The active (history factor, admission)."""
        return self.history_factor, self.admission

    def configure(self, history_factor: int, admission: bool, recency: bool = False) -> None:
        """Make a candidate configuration the active one (tests, experiments);
        ``recency``: the LRU candidate (``START``'s history factor, no admission)."""
        self._feed_pending()  # their differences count against the configuration before
        for i, s in enumerate(self.shadows):
            if (s.history_factor, s.admission, s.recency) == (history_factor, admission,
                                                              recency):
                self._switch(i)
                return
        raise ValueError("not a candidate configuration: "
                         f"{(history_factor, admission, recency)!r}")

    # -- the contract --------------------------------------------------------

    def admit(self, keys: list[bytes]) -> int:
        room = self.capacity - len(self)
        if len(keys) <= room:
            if self._measuring:
                self.evidence.fits()
            return len(keys)
        if self.admission:
            return self._admissible(keys, room)
        if self._measuring:
            n = self._admissible(keys, room)
            self.evidence.offered(keys[n:], n - room)
        return len(keys)

    def _admissible(self, keys: list[bytes], room: int) -> int:
        """How many leading ``keys`` admission stores, ``room`` (less than
        ``len(keys)``) being free: the leading keys the history knows, or
        ``room`` if more."""
        if self._aging:
            self._age_keys(keys)
        counts = self._counts
        for i, key in enumerate(keys):
            if key not in counts:
                return i if i > room else room
        return len(keys)

    def evict(self, n: int, protected: Container[bytes]) -> list[bytes] | None:
        victims = super().evict(n, protected)
        if victims and self._measuring:
            self.evidence.evicted(victims)
        return victims

    def remove(self, key: bytes) -> None:
        super().remove(key)
        self.evidence.removed(key)

    def on_asked(self, keys: Collection[bytes]) -> None:
        if self._measuring:
            self.evidence.asked(keys, self.is_resident)

    def on_access(self, keys: Sequence[bytes], reused: Container[bytes]) -> None:
        self.on_demand_access(keys, reused, 0)

    def on_demand_access(self, keys: Sequence[bytes], reused: Container[bytes],
                         asked_from: int) -> None:
        first_new = self._access_starts(keys)
        turn = not self.recency and self.turns.continues(keys, first_new, asked_from)
        self.turns.ended(keys)
        self._apply(keys, first_new)
        if turn:  # recency mode promotes nothing
            self.enter_main(keys[first_new:])
        sampled, asked_from = self.sampled_access(keys, asked_from)
        if sampled:
            self._pending.append((sampled, asked_from))
            self._sampled += len(sampled)
            if self._sampled >= self._shadow_capacity:
                self._decide()

    def _feed(self, shadows: list[Shadow], requests: list[tuple[list[bytes], int]]) -> None:
        """``requests`` (sampled keys, ``asked_from``), in order, to each of
        ``shadows``; each adds its squared per-request differences of hits to
        the active configuration's shadow."""
        hits = [s.access_all(requests) for s in shadows]
        mine = hits[self._active]
        for s, row in zip(shadows, hits, strict=True):
            spread = s.spread
            for n, m in zip(row, mine, strict=True):
                d = n - m
                if d:
                    spread += d * d
            s.spread = spread

    def _feed_pending(self) -> None:
        """Feed the shadows the requests sampled since the last feed."""
        if self._pending:
            requests, self._pending = self._pending, []
            self._feed(self.shadows, requests)

    def sampled_access(self, keys: Sequence[bytes], asked_from: int) -> tuple[list[bytes], int]:
        """What the shadows are fed of an access: its sampled keys, those a
        cache in front served (``keys[:asked_from]``) first, and how many of
        them were served."""
        if not asked_from:
            return self.sampled(keys), 0
        served = self.sampled(keys[:asked_from])
        return served + self.sampled(keys[asked_from:]), len(served)

    def sampled(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys of ``keys`` the shadows see (``rate``'s key sample)."""
        return self._sample.keys(keys)

    def _decide(self) -> None:
        """End of an epoch: feed the shadows its requests, update the scores,
        follow the best shadow."""
        self._feed_pending()
        self._sampled = 0
        self._end_epoch(self.shadows)
        if not self.admission:  # frozen while admission is on: nothing to measure
            self.evidence.end_epoch(self.DECAY)
        if self._epochs < self.RECENCY_AFTER:
            self._epochs += 1
        ready = self.recency or self._epochs >= self.RECENCY_AFTER
        self._follow_best(self.shadows if ready else self.shadows[:-1])  # LRU's is last
        self._update_measuring()

    def _update_measuring(self) -> None:
        """Feed the evidence until the next epoch's end only while admission
        is off and some admission shadow is not behind START's beyond noise
        (``Z``, against its ``spread``). Behind it, no admission shadow
        could be taken now whatever the verdict, and one epoch seldom
        brings one to a lead; measuring would cost every offer, eviction
        and ask for a verdict nobody reads. The marks go when it stops
        (stale by the time it starts again); its lead decays meanwhile."""
        self._set_measuring(not self.admission and self._admission_open())

    def _set_measuring(self, measuring: bool) -> None:
        """Feed the evidence from now on or not; its marks go when it stops."""
        if self._measuring and not measuring:
            self.evidence.forget_marks()
        self._measuring = measuring

    def _admission_open(self) -> bool:
        """Whether some admission shadow scores at least START's, less one hit
        and ``Z`` standard deviations of its difference to the active one."""
        start, bound = self.shadows[self._start].score, self.Z * self.Z
        for s in self.shadows:
            if s.admission:
                behind = start - s.score - 1.0
                if behind <= 0.0 or behind * behind <= bound * s.spread:
                    return True
        return False

    def _end_epoch(self, shadows: list[Shadow]) -> None:
        """Fold each shadow's hits of the epoch into its decayed score."""
        decay = self.DECAY
        for s in shadows:
            s.score = s.score * decay + s.hits
            s.spread *= decay
            s.hits = 0

    def _follow_best(self, shadows: list[Shadow]) -> None:
        """Switch to the best of ``shadows`` if it leads the active one beyond
        noise, unless the evidence is against the admission it would bring;
        failing that, take admission where the evidence is for it and an
        admission shadow leads START's, if not beyond noise. Return to
        ``START`` once the active one no longer leads START's."""
        if self._back_to_start(shadows):
            return
        verdict = 0 if self.admission else self.evidence.verdict(self.Z)
        best = max(range(len(shadows)), key=lambda i: shadows[i].score)
        if best != self._active:
            s = shadows[best]
            lead = s.score - shadows[self._active].score - 1.0  # less one hit: Z's docstring
            if (lead > 0 and lead * lead > self.Z * self.Z * s.spread
                    and not (s.admission and verdict < 0)):
                self._switch(best)
                return
        if verdict > 0:
            admitting = max((i for i, s in enumerate(shadows) if s.admission),
                            key=lambda i: shadows[i].score)
            if shadows[admitting].score > shadows[self._start].score:  # else undone next epoch
                self._switch(admitting)

    def _back_to_start(self, shadows: list[Shadow]) -> bool:
        """Take ``START``'s configuration if the active one's shadow no longer
        scores above START's; whether it did (``START``'s docstring)."""
        if self._active == self._start or (
                shadows[self._active].score > shadows[self._start].score):
            return False
        self._switch(self._start)
        return True

    def _switch(self, index: int) -> None:
        """Take shadow ``index``'s configuration; differences restart from it."""
        self._active = index
        s = self.shadows[index]
        self._set_measuring(not s.admission)  # admission on: the two caches are one
        self.history_factor, self.admission = s.history_factor, s.admission
        self.recency = s.recency
        self.history_limit = self.history_factor * self.capacity
        self.switches += 1
        for other in self.shadows:
            other.spread = 0.0

    def clear(self) -> None:
        super().clear()
        self._init_adaptive()


def _shadow_totals(parts: Iterable[dict[str, int]]) -> dict[str, int]:
    """Each part (``resident``, ``history``, ``ghosts``) summed over the
    shadows' ``sizes()`` or ``size_bounds()``, named ``shadow_PART``."""
    total = {"shadow_resident": 0, "shadow_history": 0, "shadow_ghosts": 0}
    for shadow in parts:
        for part, n in shadow.items():
            total["shadow_" + part] += n
    return total
