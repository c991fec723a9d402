"""A running request's blocks kept ahead of its newer ones, at O(new blocks) per offer.

vLLM offers a long prompt chunk by chunk. After each chunk is stored, the
request's earlier blocks should still rank above the new ones, so that tails
leave before heads while it runs (``EvictionPolicy.keep_ahead``). Moving every
earlier block to the newest end at each offer costs O(blocks so far): O(B^2 / C)
for a prompt of B blocks in chunks of C, and O(B) for each block it offers
while it decodes.

Here the blocks a running request keeps ahead, its *members*, are one entry of
the recency order, a :class:`Run`, standing where the request's latest
keep-ahead put them; moving that entry moves them all. A member has no entry
of its own in the order (a scan from the oldest end meets it at its run's
entry), and gets one back when it leaves its run by moving. A member leaves its
run when it moves by itself (another request's access), when another running
request's keep-ahead takes it (a shared prompt head: the latest keep-ahead
places it), or when it leaves the order; while its request runs, such a key is
remembered (``Run.out``, ``Runs.waiting``) so that the next keep-ahead takes it
back, as a move of all the request's blocks would. The result is the order that
moving them all gives, key for key.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Container, Iterable, Iterator, Sequence
from typing import Protocol


class Run:
    """One running (or finished) request's members, in the order they rank.

    Owns ``members``: the keys the run holds, head first (the head ranks
    newest), and dead entries for keys that left it (skipped, dropped from
    the tail as they come to it and all at once when they outnumber the live
    ones); ``placed``: the keys with an entry there; ``live``: how many are
    members now. While its request runs (``active``): ``index``, each key the
    request was seen with and its place in the request's access order, and
    ``out``, keys of the request in the order but not members now, taken back
    at its next keep-ahead. Memory: O(keys of the request) while active,
    O(members) once finished; a finished run ends when its last member leaves.
    """

    __slots__ = ("members", "placed", "live", "index", "out", "active")

    def __init__(self) -> None:
        self.members: list[bytes] = []
        self.placed: set[bytes] = set()
        self.live = 0
        self.index: dict[bytes, int] = {}
        self.out: set[bytes] = set()
        self.active = True

    def __repr__(self) -> str:
        return f"Run(live={self.live}, active={self.active})"


class RunHost(Protocol):
    """What :class:`Runs` needs of the order it serves (a ``KeyOrder``)."""

    def present(self, keys: Iterable[bytes]) -> set[bytes]:
        """The keys of ``keys`` in the order, members of runs included."""

    def place_run(self, run: Run) -> None:
        """Add ``run``'s entry, or move it, to the newest end."""

    def drop_run(self, run: Run) -> None:
        """Remove ``run``'s entry (a finished run left without members)."""

    def unlink(self, keys: list[bytes]) -> None:
        """Remove the order's own entries of ``keys`` (they became members)."""

    def relink(self, keys: list[bytes]) -> None:
        """Give ``keys`` (members no more, about to move) entries of their own."""


class Runs:
    """The runs of one :class:`~kvtier.policies.order.KeyOrder` and where their keys are.

    Owns ``lifted`` (each member and its run: a key is a member of one run at
    most), ``waiting`` (keys of running requests not in the order now, and
    the runs that want them back when they are added again), ``active``
    (running requests' runs, by the caller's token) and ``in_order`` (the runs
    with an entry in the order: the active ones and the finished ones with
    members). Bounded by the keys of the running requests plus the members of
    finished runs (at most the order's keys).

    The order (``host``) calls :meth:`left`, :meth:`moved` and :meth:`added`
    as keys leave, move and arrive; runs change its entries through it.
    """

    __slots__ = ("host", "lifted", "waiting", "active", "in_order")

    DEAD_SLACK = 64
    """Dead entries a run may hold beyond its live ones before it is compacted."""

    def __init__(self, host: RunHost) -> None:
        self.host = host
        self.lifted: dict[bytes, Run] = {}
        self.waiting: dict[bytes, list[Run]] = {}
        self.active: dict[object, Run] = {}
        self.in_order: set[Run] = set()

    # -- a running request's keep-ahead ---------------------------------------

    def keep_ahead(self, token: object, keys: Sequence[bytes], start: int,
                   new: Container[bytes]) -> None:
        """Rank the present keys of ``keys`` (the request's access order, head
        first), but those in ``new``, newest, head newest: as a move to the
        end of all of them would. ``keys[:start]`` are the keys of the previous
        call for ``token``, unchanged; ``start`` 0 takes ``keys`` whole.
        O(len(keys) - start + keys that left the run since the previous call)."""
        run = self.active.get(token)
        if run is None or start == 0:  # ``keys`` whole, whatever ``start`` says
            old, run = run, Run()
            self.active[token] = run
            self.in_order.add(run)
            start = 0
            if old is not None:  # its keys' order changed: a run anew; the old
                self._finish(old)  # one's members keep their rank until taken
        index = run.index
        delta = list(keys[start:])
        if index:
            delta = [k for k in delta if k not in index]
        index.update(zip(delta, itertools.count(len(index))))
        back = run.out
        run.out = set()
        if new:  # stored just now: they rank below this call's keys, ahead of the next's
            if back and any(map(new.__contains__, back)):
                run.out = {k for k in back if k in new}
                back = back - run.out
            run.out.update([k for k in delta if k in new])
            delta = [k for k in delta if k not in new]
        wanted = [*back, *delta] if back else delta
        here = self.host.present(wanted)
        if len(here) < len(wanted):
            waiting = self.waiting
            for key in wanted:
                if key not in here:
                    waiting.setdefault(key, []).append(run)
            wanted = [k for k in wanted if k in here]
        self._lift(run, wanted, not back)
        self.host.place_run(run)

    def _lift(self, run: Run, keys: list[bytes], in_order: bool) -> None:
        """Make ``keys`` (present, with an index in ``run``; ``in_order``: by
        it) members of ``run``, taking them from their runs, and give each an
        entry in access order."""
        lifted, placed = self.lifted, run.placed
        losers: set[Run] = set()
        if not lifted or lifted.keys().isdisjoint(keys):
            joining = keys  # the common case: members of no run yet
            self.host.unlink(keys)
        else:
            self.host.unlink([k for k in keys if k not in lifted])
            losers = {lifted[k] for k in keys if k in lifted}
            losers.discard(run)
            for key in keys if losers else ():
                other = lifted.get(key)
                if other is not None and other is not run:
                    self._lose(other, key)
            joining = [k for k in keys if lifted.get(k) is not run]
        lifted.update(dict.fromkeys(joining, run))
        for other in losers:  # after the update: the keys they lost are dead there
            self._tidy(other)
        run.live += len(joining)
        entries = joining if placed.isdisjoint(joining) else [
            k for k in joining if k not in placed]
        if not entries:
            return
        placed.update(entries)
        members, order = run.members, run.index.__getitem__
        if not in_order:
            entries = sorted(entries, key=order)  # keys taken back, then new ones: two runs
        if not members or order(entries[0]) > order(members[-1]):
            members.extend(entries)  # past every entry: the request's new keys
        elif len(entries) <= 8:
            for key in entries:
                bisect.insort(members, key, key=order)
        else:
            members.extend(entries)
            members.sort(key=order)

    def _lose(self, run: Run, key: bytes) -> None:
        """``key`` stops being a member of ``run`` (it is still in the order)."""
        run.live -= 1
        if run.active:
            run.out.add(key)

    # -- keys leaving, moving, arriving ---------------------------------------

    def moved(self, keys: Sequence[bytes]) -> None:
        """``keys`` are about to move by themselves (each to be newest): their
        runs lose them, and they get entries of their own back to move."""
        lifted = self.lifted
        gone = [k for k in keys if k in lifted]
        if not gone:
            return
        self.host.relink(gone)
        losers = list(map(lifted.pop, gone))
        run = losers[0]
        if losers.count(run) == len(losers):  # one run's keys (its request's access)
            run.live -= len(gone)
            if run.active:
                run.out.update(gone)
            self._tidy(run)
            return
        for key, run in zip(gone, losers, strict=True):
            self._lose(run, key)
        for run in set(losers):
            self._tidy(run)

    def left(self, keys: Sequence[bytes]) -> None:
        """``keys``, members, left the order: their runs lose them; running
        ones wait for them."""
        lifted, waiting = self.lifted, self.waiting
        gone = [k for k in keys if k in lifted]
        if not gone:
            return
        losers = list(map(lifted.pop, gone))
        for key, run in zip(gone, losers, strict=True):
            run.live -= 1
            if run.active:
                waiting.setdefault(key, []).append(run)
        for run in set(losers):
            self._tidy(run)

    def added(self, keys: Sequence[bytes]) -> None:
        """``keys`` entered the order: running requests that had them take them
        back at their next keep-ahead."""
        waiting = self.waiting
        for key in keys:
            runs = waiting.pop(key, None)
            if runs is not None:
                for run in runs:
                    run.out.add(key)

    def _tidy(self, run: Run) -> None:
        """Drop dead entries from ``run``'s tail, compact it when they
        outnumber the live ones, end it when finished and empty."""
        if not run.active and run.live == 0:
            self.in_order.discard(run)
            self.host.drop_run(run)
            return
        members, lifted, placed = run.members, self.lifted, run.placed
        while members and lifted.get(members[-1]) is not run:
            placed.discard(members.pop())
        if len(members) > 2 * run.live + self.DEAD_SLACK:
            run.members = [k for k in members if lifted.get(k) is run]
            run.placed = set(run.members)

    def unfold(self, run: Run) -> None:
        """A finished ``run`` ends: the order gave each member an entry of its own
        where the run's stood."""
        lifted = self.lifted
        for key in run.members:
            if lifted.get(key) is run:
                del lifted[key]
        run.members, run.placed, run.live = [], set(), 0
        self.in_order.discard(run)

    # -- the end of a request ---------------------------------------------------

    def end(self, token: object) -> None:
        """The request of ``token`` finished: its run keeps its members where
        they rank and takes nothing back any more. O(keys of the request)."""
        run = self.active.pop(token, None)
        if run is not None:
            self._finish(run)

    def _finish(self, run: Run) -> None:
        run.active = False
        if self.waiting:
            self._unwait(run)
        run.index, run.out = {}, set()
        if run.live == 0:
            self.in_order.discard(run)
            self.host.drop_run(run)

    def _unwait(self, run: Run) -> None:
        waiting = self.waiting
        for key in run.index:
            runs = waiting.get(key)
            if runs is not None and run in runs:
                runs.remove(run)
                if not runs:
                    del waiting[key]

    # -- reading ---------------------------------------------------------------

    def scan(self, entries: Iterator[object]) -> Iterator[bytes]:
        """The keys of ``entries`` (the order's entries, oldest first) as they
        rank: a run's members at its entry, oldest (tail) first."""
        lifted = self.lifted
        for entry in entries:
            if isinstance(entry, Run):
                for key in reversed(entry.members):
                    if lifted.get(key) is entry:
                        yield key
            else:
                yield entry  # type: ignore[misc]
