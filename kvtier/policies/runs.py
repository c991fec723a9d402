"""A running request's blocks kept ahead of its newer ones, at O(new blocks) per offer.

vLLM offers a long prompt chunk by chunk. After each chunk is stored, the
request's earlier blocks should still rank above the new ones, so that tails
leave before heads while it runs (``EvictionPolicy.keep_ahead``). Moving every
earlier block to the newest end at each offer costs O(blocks so far): O(B^2 / C)
for a prompt of B blocks in chunks of C, and O(B) for each block it offers
while it decodes.

Here the blocks a running request keeps ahead, its *members*, are one entry of
the recency order, a :class:`Run`, standing where the request's latest
keep-ahead put them; moving that entry moves them all. A member keeps its own
entry in the order too, stale while it is a member: a scan from the oldest end
skips it there and meets it at its run's entry instead. A member leaves its
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
from collections.abc import Callable, Container, Iterator, Sequence


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


class Runs:
    """The runs of one :class:`~kvtier.policies.order.KeyOrder` and where their keys are.

    Owns ``lifted`` (each member and its run: a key is a member of one run at
    most), ``waiting`` (keys of running requests not in the order now, and
    the runs that want them back when they are added again), ``active``
    (running requests' runs, by the caller's token) and ``in_order`` (the runs
    with an entry in the order: the active ones and the finished ones with
    members). Bounded by the keys of the running requests plus the members of
    finished runs (at most the order's keys).

    The order calls :meth:`left`, :meth:`moved` and :meth:`added` as keys
    leave, move and arrive; it puts each run's entry in place through the
    ``place`` and ``drop`` callables given to :meth:`keep_ahead` and the others.
    """

    __slots__ = ("lifted", "waiting", "active", "in_order")

    DEAD_SLACK = 64
    """Dead entries a run may hold beyond its live ones before it is compacted."""

    def __init__(self) -> None:
        self.lifted: dict[bytes, Run] = {}
        self.waiting: dict[bytes, list[Run]] = {}
        self.active: dict[object, Run] = {}
        self.in_order: set[Run] = set()

    # -- a running request's keep-ahead ---------------------------------------

    def keep_ahead(self, token: object, keys: Sequence[bytes], start: int,
                   new: Container[bytes], present: Callable[[list[bytes]], set[bytes]],
                   place: Callable[[Run], None], drop: Callable[[Run], None]) -> None:
        """Rank the present keys of ``keys`` (the request's access order, head
        first), but those in ``new``, newest, head newest: as a move to the
        end of all of them would. ``keys[:start]`` are the keys of the previous
        call for ``token``, unchanged; ``start`` 0 takes ``keys`` whole.
        ``present(keys)``: those in the order; ``place(run)`` adds or moves the
        run's entry to the newest end; ``drop(run)`` removes a finished run's
        entry when it loses its last member.
        O(len(keys) - start + keys that left the run since the previous call)."""
        run = self.active.get(token)
        if run is None or start == 0:  # ``keys`` whole, whatever ``start`` says
            old, run = run, Run()
            self.active[token] = run
            self.in_order.add(run)
            start = 0
            if old is not None:  # its keys' order changed: a run anew; the old
                self._finish(old, drop)  # one's members keep their rank until taken
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
        here = present(wanted)
        if len(here) < len(wanted):
            waiting = self.waiting
            for key in wanted:
                if key not in here:
                    waiting.setdefault(key, []).append(run)
            wanted = [k for k in wanted if k in here]
        self._lift(run, wanted, not back, drop)
        place(run)

    def _lift(self, run: Run, keys: list[bytes], in_order: bool,
              drop: Callable[[Run], None]) -> None:
        """Make ``keys`` (present, with an index in ``run``; ``in_order``: by
        it) members of ``run``, taking them from their runs, and give each an
        entry in access order."""
        lifted, placed = self.lifted, run.placed
        if not lifted or lifted.keys().isdisjoint(keys):
            joining = keys  # the common case: members of no run yet
        else:
            losers = {lifted[k] for k in keys if k in lifted}
            losers.discard(run)
            for key in keys if losers else ():
                other = lifted.get(key)
                if other is not None and other is not run:
                    self._lose(other, key)
            joining = [k for k in keys if lifted.get(k) is not run]
            lifted.update(dict.fromkeys(joining, run))
            for other in losers:
                self._tidy(other, drop)
        if joining is keys:
            lifted.update(dict.fromkeys(joining, run))
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

    def moved(self, keys: Sequence[bytes], drop: Callable[[Run], None]) -> None:
        """``keys`` move by themselves (each is newest now): their runs lose them."""
        lifted = self.lifted
        gone = [k for k in keys if k in lifted]
        if not gone:
            return
        losers = list(map(lifted.pop, gone))
        run = losers[0]
        if losers.count(run) == len(losers):  # one run's keys (its request's access)
            run.live -= len(gone)
            if run.active:
                run.out.update(gone)
            self._tidy(run, drop)
            return
        for key, run in zip(gone, losers, strict=True):
            self._lose(run, key)
        for run in set(losers):
            self._tidy(run, drop)

    def left(self, keys: Sequence[bytes], drop: Callable[[Run], None]) -> None:
        """``keys`` left the order: their runs lose them; running ones wait for them."""
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
            self._tidy(run, drop)

    def added(self, keys: Sequence[bytes]) -> None:
        """``keys`` entered the order: running requests that had them take them
        back at their next keep-ahead."""
        waiting = self.waiting
        for key in keys:
            runs = waiting.pop(key, None)
            if runs is not None:
                for run in runs:
                    run.out.add(key)

    def _tidy(self, run: Run, drop: Callable[[Run], None]) -> None:
        """Drop dead entries from ``run``'s tail, compact it when they
        outnumber the live ones, end it when finished and empty."""
        if not run.active and run.live == 0:
            self.in_order.discard(run)
            drop(run)
            return
        members, lifted, placed = run.members, self.lifted, run.placed
        while members and lifted.get(members[-1]) is not run:
            placed.discard(members.pop())
        if len(members) > 2 * run.live + self.DEAD_SLACK:
            run.members = [k for k in members if lifted.get(k) is run]
            run.placed = set(run.members)

    # -- the end of a request ---------------------------------------------------

    def end(self, token: object, drop: Callable[[Run], None]) -> None:
        """The request of ``token`` finished: its run keeps its members where
        they rank and takes nothing back any more. O(keys of the request)."""
        run = self.active.pop(token, None)
        if run is not None:
            self._finish(run, drop)

    def _finish(self, run: Run, drop: Callable[[Run], None]) -> None:
        run.active = False
        if self.waiting:
            self._unwait(run)
        run.index, run.out = {}, set()
        if run.live == 0:
            self.in_order.discard(run)
            drop(run)

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
            elif entry not in lifted:
                yield entry  # type: ignore[misc]
