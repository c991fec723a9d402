"""An ordered set of keys in plain dicts and a list: the policies' recency lists.

An ``OrderedDict`` costs about 91 bytes per key at a million keys (its dict,
a linked node per key and an index of the nodes); a plain dict about 42. A
plain dict alone cannot serve as a recency list, though: deleting its oldest
keys leaves holes at the front of its entry table, which every later scan
from the oldest end walks over; and each move to the end takes a new entry,
so a dict whose keys keep moving is resized to three times its keys.
:class:`KeyOrder` avoids both: the oldest keys are kept in a list in reverse
order, where they are taken from the end, and a key stored and then moved by
its own request's access is placed once, not twice.
"""

from __future__ import annotations

import itertools
from collections.abc import Container, Iterable, Iterator, Sequence

from kvtier.policies.runs import Run, Runs


class KeyOrder:
    """Keys in the order they were added or last moved to the end, oldest first.

    Owns, for three disjoint parts of the order, oldest first:

    * the *old* part: ``_old`` (a dict, for membership only) and
      ``_old_order`` (a list, newest first, so the oldest key is at its end),
      preceded by ``_parked`` (a short list, oldest first: keys found at the
      end of ``_old_order`` that a scan had to skip, set aside so that the
      holes behind them can be given back); the lists may hold keys no longer
      in ``_old`` (removed or moved since), which every read skips;
    * ``_mid``: keys moved to the end since the old part was built;
    * ``_tail`` (a dict) and then ``_pending`` (a list, not indexed yet): keys
      added since the last move (in a policy: the blocks stored since a
      request's access was last applied). Keys wait in ``_pending`` until a
      lookup needs them indexed; a move of exactly those keys, in reverse
      (their request's access, tail first), places each of them once.

    Cost: O(1) amortized per key and operation. The old part is rebuilt from
    all parts when a scan or a pop from the oldest end runs past it (each key
    once per rebuild, at C speed); a scan from the oldest end skips stale
    entries at C speed, and :meth:`evicted` truncates them at the end of the
    list. Memory: one dict entry per key (about 42 B at a million keys) and
    one list slot (8 B) per key of the old part, plus stale list slots and
    dict holes up to the number of keys at the last rebuild.

    ``keep_run_ahead`` keeps a long running request's keys ahead of its new
    ones as one entry, a run (``kvtier.policies.runs``), whose members have
    no entries of their own: a scan that meets a run's entry takes them key
    by key (``Runs.scan``), and a finished run whose entry is the oldest
    unfolds into entries of their own (``_unfold_oldest_run``).
    """

    __slots__ = ("_old", "_old_order", "_parked", "_mid", "_tail", "_pending", "_dead",
                 "_holes", "_runs")

    TRIM_EVERY = 64
    """Keys that may leave the old part before its list's end is trimmed."""
    SCAN_PENDING = 64
    """Pending keys a membership test scans (more are indexed first)."""
    RUN_MIN = 512
    """Keys of a running request past which ``keep_run_ahead`` keeps them as one
    entry (a :class:`~kvtier.policies.runs.Run`) rather than moving them all."""

    def __init__(self) -> None:
        self._old: dict[bytes, None] = {}
        self._old_order: list[bytes] = []
        self._parked: list[bytes] = []
        self._mid: dict[bytes, None] = {}
        self._tail: dict[bytes, None] = {}
        self._pending: list[bytes] = []
        self._dead = 0  # stale slots in _old_order and _parked
        self._holes = 0  # victims that left stale slots since the last trim
        self._runs: Runs | None = None  # running requests' kept-ahead keys (keep_run_ahead)

    def _settle(self) -> None:
        """Index the pending keys (into ``_tail``)."""
        tail = self._tail
        for key in self._pending:
            tail[key] = None
        self._pending.clear()

    def __len__(self) -> int:
        n = len(self._old) + len(self._mid) + len(self._tail) + len(self._pending)
        runs = self._runs
        return n if runs is None else n - len(runs.in_order) + len(runs.lifted)

    def __bool__(self) -> bool:
        if self._runs is not None:  # a run's entry is not a key
            return len(self) > 0
        return bool(self._old or self._mid or self._tail or self._pending)

    def __contains__(self, key: object) -> bool:
        if key in self._mid or key in self._tail or key in self._old:
            return True
        if self._runs is not None and key in self._runs.lifted:
            return True
        pending = self._pending
        if not pending:
            return False
        if len(pending) > self.SCAN_PENDING:
            self._settle()
            return key in self._tail
        return key in pending

    def __iter__(self) -> Iterator[bytes]:
        """Oldest first; the order must not change while an iterator is in use."""
        if self._runs is not None:
            self._unfold_oldest_run()
        if self._runs is not None:
            return self._runs.scan(self._entries())
        return self._entries()

    def _unfold_oldest_run(self) -> bool:
        """If the oldest entry is a finished run's, put its members in its place
        as entries of their own (the same order; O(members), once): scans from
        the oldest end then go at C speed again. Whether it did."""
        runs, order, old = self._runs, self._old_order, self._old
        if runs is None or self._parked:
            return False
        dead = 0
        while order and order[-1] not in old:
            order.pop()
            dead += 1
        self._dead -= dead
        run = order[-1] if order else None
        if not isinstance(run, Run) or run.active:
            return False
        members = [k for k in run.members if runs.lifted.get(k) is run]  # head first
        order.pop()
        del old[run]
        order.extend(members)  # newest first: the tail, the oldest member, at the end
        old.update(dict.fromkeys(members))
        runs.unfold(run)
        if not runs.in_order:
            self._runs = None
        return True

    def _entries(self) -> Iterator[bytes]:
        """Every entry, oldest first: a run's entry (``Run``) among the keys."""
        if self._pending:
            self._settle()
        if not self._dead:
            return itertools.chain(self._parked, reversed(self._old_order), self._mid,
                                   self._tail)
        live = self._old.__contains__
        return itertools.chain(filter(live, self._parked),
                               filter(live, reversed(self._old_order)), self._mid, self._tail)

    def __repr__(self) -> str:
        return f"KeyOrder({list(self)!r})"

    def present(self, keys: Iterable[bytes]) -> set[bytes]:
        """The keys of ``keys`` in the order (a set, built at C speed)."""
        if self._pending:
            self._settle()
        old, mid, tail, runs = self._old, self._mid, self._tail, self._runs
        if not (mid or tail or runs):
            return old.keys() & keys
        keys = keys if isinstance(keys, (list, tuple, set, frozenset)) else list(keys)
        found = old.keys() & keys if old else set()
        if mid:
            found |= mid.keys() & keys
        if tail:
            found |= tail.keys() & keys
        if runs is not None and runs.lifted:
            found |= runs.lifted.keys() & keys
        return found

    # -- changes -----------------------------------------------------------------

    def add(self, key: bytes) -> None:
        """Append ``key`` as the newest, unless present (then its place is kept)."""
        if self._pending:
            self._settle()
        if key not in self._old and key not in self._mid and not (
                self._runs is not None and key in self._runs.lifted):
            self._tail[key] = None
            if self._runs is not None and self._runs.waiting:
                self._runs.added([key])

    def add_many(self, keys: Iterable[bytes]) -> None:
        """Append ``keys``, distinct and absent, in order (for keys that may be
        present, use ``add``)."""
        if self._runs is not None and self._runs.waiting:
            keys = keys if isinstance(keys, list) else list(keys)
            self._runs.added(keys)
        self._pending.extend(keys)

    def discard(self, key: bytes) -> bool:
        """Remove ``key`` if present; whether it was."""
        if self._runs is not None and key in self._runs.lifted:
            self._runs.left([key])  # a member has no entry of its own
            return True
        return self._discard(key)

    def _discard(self, key: object) -> bool:
        if self._pending:
            self._settle()
        if key in self._mid:
            del self._mid[key]
        elif key in self._tail:
            del self._tail[key]
        elif key in self._old:
            del self._old[key]
            self._dead += 1
        else:
            return False
        return True

    def __delitem__(self, key: bytes) -> None:
        if not self.discard(key):
            raise KeyError(key)

    def discard_many(self, keys: Iterable[bytes]) -> list[bytes]:
        """Remove each of ``keys`` that is present; return those, in order."""
        keys = keys if isinstance(keys, list) else list(keys)
        if self._pending and not set(keys).isdisjoint(self._pending):
            self._settle()
        old, mid, tail = self._old, self._mid, self._tail
        lifted = self._runs.lifted if self._runs is not None else {}
        out: list[bytes] = []
        members: list[bytes] = []
        stale = 0
        for key in keys:
            if key in mid:
                del mid[key]
            elif key in tail:
                del tail[key]
            elif key in old:
                del old[key]
                stale += 1
            elif key in lifted:
                members.append(key)
            else:
                continue
            out.append(key)
        self._dead += stale
        if members and self._runs is not None:
            self._runs.left(members)
        return out

    def move_to_end(self, key: bytes) -> None:
        """Make ``key`` the newest; ``KeyError`` when absent."""
        if key not in self:
            raise KeyError(key)
        self.to_end([key])

    def to_end(self, keys: Iterable[bytes]) -> None:
        """Move each of ``keys`` to the end in turn, adding absent ones (as
        ``del d[k]`` if present, then ``d[k] = None``, on an ``OrderedDict``).

        The keys end up newest, in the order of their last occurrence in
        ``keys``; the keys added since the previous move and not in ``keys``
        keep their place before them.
        """
        keys = keys if isinstance(keys, list) else list(keys)
        runs = self._runs
        if runs is not None:
            runs.moved(keys)
            if runs.waiting:
                runs.added([k for k in keys if k not in self])
        self._to_end(keys, True)

    def move_present(self, keys: Iterable[bytes]) -> None:
        """``to_end`` of the keys of ``keys`` that are present (others ignored)."""
        if self._runs is not None:
            keys = keys if isinstance(keys, list) else list(keys)
            self._runs.moved(keys)
        self._to_end(keys, False)

    # -- running requests ----------------------------------------------------------

    def keep_run_ahead(self, run: object, keys: Sequence[bytes], start: int,
                       new: Container[bytes]) -> None:
        """``move_present(reversed([k for k in keys if k not in new]))`` for a
        running request: so, for up to ``RUN_MIN`` keys; past it, as a run, in
        O(``len(keys) - start``) and the keys of the request that left its run
        since its previous call (``kvtier.policies.runs``).

        ``run``: the request's token (hashable; the same at each call, until
        :meth:`end_run`); ``keys``: its access order, head first, whose first
        ``start`` keys are those of its previous call, unchanged (0: take it
        whole); ``new``: its keys stored just now, which rank below the others.
        """
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start <= len(keys):
            raise ValueError(f"start must be an int in 0..len(keys) ({len(keys)}), "
                             f"got {start!r}")
        runs = self._runs
        if (runs is None or run not in runs.active) and len(keys) <= self.RUN_MIN:
            ahead = list(itertools.filterfalse(new.__contains__, keys)) if new else list(keys)
            ahead.reverse()
            if runs is not None:
                runs.moved(ahead)
            self._to_end(ahead, False, distinct=True)
            return
        if runs is None:
            runs = self._runs = Runs(self)
        runs.keep_ahead(run, keys, start, new)

    def end_run(self, run: object) -> None:
        """The request of token ``run`` finished: its keys keep their rank and
        are no longer kept ahead (a no-op for a token never kept ahead)."""
        if self._runs is not None:
            self._runs.end(run)

    # (kvtier.policies.runs.RunHost: what the runs change in the order)

    def place_run(self, run: Run) -> None:
        """Add ``run``'s entry, or move it, to the newest end."""
        self._to_end([run], True)  # type: ignore[list-item]

    def drop_run(self, run: Run) -> None:
        """Remove ``run``'s entry; with the last run, the runs' state."""
        self._discard(run)
        if self._runs is not None and not self._runs.in_order:
            self._runs = None  # no run left: every operation takes its plain path again

    def unlink(self, keys: list[bytes]) -> None:
        """Remove the entries of ``keys``, which become members of a run."""
        self.discard_many(keys)

    def relink(self, keys: list[bytes]) -> None:
        """Give ``keys`` (members leaving their runs) entries, about to be moved."""
        if self._pending:
            self._settle()
        self._tail.update(dict.fromkeys(keys))

    def _to_end(self, keys: Iterable[bytes], add: bool, distinct: bool = False) -> None:
        """``to_end`` (``add``) or ``move_present``; ``distinct``: no key twice."""
        keys = keys if isinstance(keys, list) else list(keys)
        old, mid, tail, pending = self._old, self._mid, self._tail, self._pending
        if pending:
            n = len(pending)
            if keys == pending[::-1] if len(keys) == n else keys[:n] == pending[::-1]:
                # The common case: the keys added since the last move (a request's
                # new blocks) are moved first, in reverse (its access, tail first).
                if tail:  # added before them, not moved: stay before
                    mid.update(tail)
                    tail.clear()
                for key in reversed(pending):
                    mid[key] = None
                pending.clear()
                if len(keys) == n:
                    return
                keys = keys[n:]
            else:
                self._settle()
        moved: list[bytes] = []
        append = moved.append
        stale = missing = 0
        for key in keys:
            if key in tail:
                del tail[key]
            elif key in mid:
                del mid[key]
            elif key in old:
                del old[key]
                stale += 1
            else:
                missing += 1  # absent, or a repeat
                if not add:
                    continue
            append(key)
        self._dead += stale
        if tail:  # added before, not moved: they stay before the moved keys
            mid.update(tail)
            tail.clear()
        if missing and not distinct and len(set(keys)) != len(keys):  # a key twice: its last one
            found = set(moved)
            moved = [k for k in reversed(dict.fromkeys(reversed(keys))) if k in found]
        for key in moved:
            mid[key] = None

    # -- the oldest end ----------------------------------------------------------

    def pop_oldest(self) -> bytes:
        """Remove and return the oldest key; ``KeyError`` when empty."""
        if self._runs is not None:
            out = self.take_oldest(1)
            if not out:
                raise KeyError("pop_oldest from an empty KeyOrder")
            return out[0]
        if self._pending:
            self._settle()
        if not self._old:
            if not (self._mid or self._tail):
                raise KeyError("pop_oldest from an empty KeyOrder")
            self._rebuild()
        old, parked = self._old, self._parked
        while parked:
            key = parked.pop(0)
            if key in old:
                del old[key]
                return key
            self._dead -= 1
        order = self._old_order
        while True:
            key = order.pop()
            if key in old:
                del old[key]
                return key
            self._dead -= 1

    def pop_oldest_many(self, n: int) -> list[bytes]:
        """Remove and return the ``n`` oldest keys, oldest first (fewer if shorter)."""
        out: list[bytes] = []
        if n <= 0:
            return out
        if self._runs is not None:
            out = take(iter(self), n)
            self.evicted(out)
            return out
        if self._pending:
            self._settle()
        while len(out) < n:
            if not self._old:
                if not (self._mid or self._tail):
                    break
                self._rebuild()
            if self._parked:
                out.append(self.pop_oldest())
                continue
            old, order = self._old, self._old_order
            append = out.append
            dead = 0
            while old and len(out) < n:
                key = order.pop()
                if key in old:
                    del old[key]
                    append(key)
                else:
                    dead += 1
            self._dead -= dead
        return out

    def take_oldest(self, n: int, *skip: Container[bytes]) -> list[bytes] | None:
        """Remove and return the ``n`` oldest keys in none of ``skip``, oldest
        first; None (nothing changed) when there are fewer."""
        if n <= 0:
            return []
        if self._pending:
            self._settle()
        if self._runs is not None:
            self._unfold_oldest_run()
        old, order, runs = self._old, self._old_order, self._runs
        if not self._parked and len(order) >= n:
            last = order[-n:]
            checks: tuple[Container[object], ...] = (old, *skip) if self._dead else skip
            if runs is not None:  # a run's entry among them: the scan below
                checks = (runs.in_order, *checks)
            for container in checks:
                if container is old:
                    if not all(map(old.__contains__, last)):
                        break
                    continue
                if not container:
                    continue
                disjoint = getattr(container, "isdisjoint", None)
                if disjoint is None or not disjoint(last):
                    break
            else:  # the common case: the n oldest keys, at C speed
                del order[-n:]
                last.reverse()
                for key in last:
                    del old[key]
                if not old:
                    self._rebuild()
                return last
        victims = take(iter(self), n, *skip)
        if len(victims) < n:
            return None
        self.evicted(victims, *skip)
        return victims

    def evicted(self, victims: Iterable[bytes], *skipped: Container[bytes]) -> None:
        """Remove ``victims``, found by a scan from the oldest end, and give
        back the list slots they leave.

        The keys in ``skipped`` are those that scan passed over without taking
        them (blocked, protected). Victims that were members of a run (met at
        its entry) leave it; they had no entries of their own. When the scan
        went past the old part it is rebuilt; otherwise, once ``TRIM_EVERY``
        keys left the old part, the stale slots at the end of its list are cut
        off, setting aside the skipped keys that hide them.
        """
        victims = victims if isinstance(victims, list) else list(victims)
        if self._pending:
            self._settle()
        old, order = self._old, self._old_order
        n = len(victims)
        last = victims[-1] if n else None
        runs = self._runs
        if runs is not None:
            members = [k for k in victims if k in runs.lifted]
            if members:  # a scan met them at their run's entry: no entry of their own
                runs.left(members)
                gone = set(members)
                victims = [k for k in victims if k not in gone]
                n, last = len(victims), None
        if (n and last is not None and not self._parked and len(order) >= n
                and order[-n] is last and last in old):
            # The common case: the victims are the last n slots of the list (a
            # scan that took its last victim, live in the old part, n slots from
            # the end took every slot it passed).
            del order[-n:]
            for key in victims:
                del old[key]
            if not old:
                self._rebuild()
            return
        mid, tail = self._mid, self._tail
        past_old = False
        holes = 0
        for key in victims:
            try:
                del old[key]
                holes += 1
            except KeyError:
                past_old = True
                if key in mid:
                    del mid[key]
                else:
                    del tail[key]
        self._dead += holes
        self._holes += holes
        if past_old or not old:
            self._rebuild()
        elif self._holes >= self.TRIM_EVERY:
            self._trim(skipped)

    def _trim(self, skipped: tuple[Container[bytes], ...]) -> None:
        """Cut the stale slots off the end of ``_old_order``, parking the keys
        ``skipped`` that sit at its end."""
        old, order, parked = self._old, self._old_order, self._parked
        live = old.__contains__
        if parked:
            before = len(parked)
            parked[:] = filter(live, parked)
            self._dead -= before - len(parked)
        while order:
            # the first live slot from the end, found at C speed
            n = next(itertools.compress(itertools.count(), map(live, reversed(order))),
                     len(order))
            if n:
                del order[len(order) - n:]
                self._dead -= n
            if not order or not any(order[-1] in c for c in skipped):
                break
            parked.append(order.pop())
        self._holes = 0

    def _rebuild(self) -> None:
        """One old part holding every key, in order (stale slots dropped)."""
        if self._pending:
            self._settle()
        old = self._old
        live = old.__contains__
        keep = list(filter(live, self._old_order)) if old else []
        parked = list(filter(live, self._parked)) if old else []
        if self._mid:
            merged = self._mid
            merged.update(self._tail)
        else:  # a queue (keys leave from the oldest end only): reuse the tail's dict
            merged = self._tail
        order = list(reversed(merged))
        merged.update(old)
        order += keep
        self._old, self._old_order, self._parked = merged, order, parked
        self._mid, self._tail = {}, {}
        self._dead = self._holes = 0

    def clear(self) -> None:
        """Forget every key (and every run)."""
        self._runs = None
        self._old, self._old_order, self._parked = {}, [], []
        self._mid, self._tail = {}, {}
        self._pending = []
        self._dead = self._holes = 0


def take(keys: Iterator[bytes], k: int, *skip: Container[bytes]) -> list[bytes]:
    """The next ``k`` keys of ``keys`` that are in none of ``skip`` (fewer when
    ``keys`` runs out), at C speed; ``keys`` is left just after the last one."""
    if k <= 0:
        return []
    for container in skip:
        if container:
            keys = itertools.filterfalse(container.__contains__, keys)
    return list(itertools.islice(keys, k))
