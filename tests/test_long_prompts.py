"""Long prompts offered chunk by chunk: the work per offer, and its correctness.

At every offer after the first, the request's earlier blocks must keep
ranking above its new ones (``keep_ahead``). Moving them all cost O(blocks so
far) per offer: O(B * C) for a prompt of B blocks offered in C chunks, and
O(B) for each block it offers while decoding (``offload_prompt_only``
false). A request past ``KeyOrder.RUN_MIN`` keys now keeps them as one entry
of the order (``kvtier.policies.runs``), so an offer costs O(its chunk); the
counts below are of the keys the policy's order actually moves or looks up.
The manager hands the policy the request's access order and how much of it
is unchanged since its previous offer (``RequestContext.running_order``), kept
up to date rather than rebuilt; the randomized tests check both against the
former computations, call by call, and the order against moving every key.
"""

from __future__ import annotations

import importlib.util
import itertools
import random
import sys
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest

from kvtier import MissingBlocksError, OffloadManager, RequestContext, block_key
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.order import KeyOrder

BLOCK_TOKENS = 16
RUN_MIN = KeyOrder.RUN_MIN
"""The order's threshold as shipped (the negative control changes the class's)."""
BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_long_prompts.py"


class CountingContext(RequestContext):
    """A context that counts the keys its access log yields when listed whole."""

    __slots__ = ("walked",)

    def __init__(self, req_id: str) -> None:
        super().__init__(req_id)
        self.walked = 0

    def accessed_keys(self) -> list[bytes]:
        keys = super().accessed_keys()
        self.walked += len(keys)
        return keys


class CountingOrder(KeyOrder):
    """A KeyOrder counting the keys it moves and looks up in bulk (its work
    for a keep-ahead: moving keys, or checking a run's new keys)."""

    __slots__ = ()

    def _to_end(self, keys: Iterable[bytes], add: bool, distinct: bool = False) -> None:
        keys = keys if isinstance(keys, list) else list(keys)
        CountingLRU.kept += len(keys)
        super()._to_end(keys, add, distinct)

    def present(self, keys: Iterable[bytes]) -> set[bytes]:
        keys = keys if isinstance(keys, list) else list(keys)
        CountingLRU.kept += len(keys)
        return super().present(keys)


class CountingLRU(LRUPolicy):
    """LRU whose order counts its work while it keeps a request's blocks ahead."""

    kept = 0

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order = CountingOrder()

    def keep_ahead(self, run: object, keys: Sequence[bytes], start: int,
                   new: Container[bytes]) -> None:
        before = CountingLRU.kept
        super().keep_ahead(run, keys, start, new)
        CountingLRU.counted += CountingLRU.kept - before

    counted = 0
    """Of ``kept``, the part within ``keep_ahead`` (the rest: inserts' moves)."""


class CountingNoRunningOrder(CountingLRU):
    """The same, never asked to keep a running request's head ahead."""

    wants_running_order = False


def counting_manager(policy: str = "CountingLRU") -> OffloadManager:
    """An 8,192-block manager under one of this module's counting policies,
    its count of keys kept ahead reset."""
    CountingLRU.kept = CountingLRU.counted = 0
    return OffloadManager(8192, policy=f"test_long_prompts:{policy}")


def offer_in_chunks(mgr: OffloadManager, ctx: CountingContext, blocks: int,
                    chunk: int, work: Callable[[], int] | None = None) -> list[int]:
    """Offer ``blocks`` keys in chunks as vLLM does (stores complete a step
    later); return the work counted at each offer: ``work()``'s rise, by
    default the keys walked (access log + keep_ahead). Every offer is stored."""
    if work is None:
        def work() -> int:
            return ctx.walked + CountingLRU.counted
    keys = [block_key(i) for i in range(blocks)]
    per_offer = []
    granted: list[bytes] = []
    for start in range(0, blocks, chunk):
        offer = keys[start:start + chunk]
        ctx.set_positions(offer, (start + 1) * BLOCK_TOKENS, BLOCK_TOKENS)
        if granted:
            mgr.complete_store(granted, ctx)
        before = work()
        out = mgr.prepare_store(offer, ctx)
        per_offer.append(work() - before)
        assert out is not None and out.keys_to_store == offer
        granted = out.keys_to_store
    return per_offer


def test_keep_ahead_work_per_offer_is_bounded_by_the_chunk() -> None:
    # before: each offer moved every held block of the request, 128 more each time
    mgr = counting_manager()
    per_offer = offer_in_chunks(mgr, CountingContext("long"), 4096, 128)
    past = RUN_MIN // 128 + 1  # offers up to RUN_MIN keys move them all
    assert max(per_offer[:past]) <= RUN_MIN + 16, per_offer
    assert max(per_offer[past:]) <= 2 * 128 + 16, per_offer
    assert sum(per_offer) <= 3 * 4096 + RUN_MIN ** 2 // 128, per_offer


def test_keep_ahead_work_per_decode_offer_is_bounded() -> None:
    mgr = counting_manager()
    ctx = CountingContext("long")
    offer_in_chunks(mgr, ctx, 2048, 128)
    per_offer = []
    for i in range(8):  # decode: one new block per offer, stored a step later
        key = [block_key(2048 + i)]
        ctx.set_positions(key, (2049 + i) * BLOCK_TOKENS, BLOCK_TOKENS)
        before = CountingLRU.counted
        out = mgr.prepare_store(key, ctx)
        assert out is not None and out.keys_to_store == key
        per_offer.append(CountingLRU.counted - before)
        mgr.complete_store(key, ctx)
    # the first joins the prompt's last chunk to the request's run
    assert per_offer[0] <= 128 + 16 and max(per_offer[1:]) <= 16, per_offer


def test_the_work_counts_fail_for_a_keep_ahead_that_moves_every_block(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # negative control: with runs off, the same counts see O(blocks so far)
    monkeypatch.setattr(KeyOrder, "RUN_MIN", 10**9)
    with pytest.raises(AssertionError):
        test_keep_ahead_work_per_offer_is_bounded_by_the_chunk()
    with pytest.raises(AssertionError):
        test_keep_ahead_work_per_decode_offer_is_bounded()


def test_offer_work_without_running_order_is_bounded_by_the_chunk() -> None:
    # everything but keep_ahead: no offer walks the request's earlier blocks
    mgr = counting_manager("CountingNoRunningOrder")
    ctx = CountingContext("long")
    per_offer = offer_in_chunks(mgr, ctx, 4096, 128)
    assert max(per_offer) == 0 and CountingLRU.counted == 0
    mgr.on_request_finished(ctx)  # the finish lists the whole request, once
    assert ctx.walked == 4096


def load_benchmark() -> ModuleType:
    """benchmarks/bench_long_prompts.py as a module."""
    spec = importlib.util.spec_from_file_location("bench_long_prompts", BENCH)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    sys.modules["bench_long_prompts"] = bench  # its dataclass looks its module up
    spec.loader.exec_module(bench)
    return bench


def test_the_long_prompt_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark()
    assert bench.main(["--blocks", "256,512", "--chunk", "64", "--policies", "lru,default",
                 "--others", "1", "--repeats", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0], r[1]) for r in rows] == [
        ("lru", "256"), ("lru", "512"), ("default", "256"), ("default", "512")]
    # keys handed to keep_ahead as new, per key: each once, whatever the length
    # (all of them, each time, before: (offers - 1) / 2 per key, 1.5 and 3.5 here)
    assert [float(r[-2]) for r in rows] == [1.0, 1.0, 1.0, 1.0]  # (then others us/req)


def test_the_long_prompt_benchmark_times_decode_offers(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark()
    assert bench.main(["--blocks", "256", "--chunk", "64", "--policies", "lru",
                       "--decode", "4", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[-2:] == ["decode", "us/offer"]
    row = lines[2].split()
    assert row[:2] == ["lru", "256"] and float(row[-2]) == 1.0 and float(row[-1]) > 0
    with pytest.raises(SystemExit):
        bench.main(["--decode", "-1"])


def test_the_long_prompt_benchmark_times_the_traffic_around_it(
        capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark()
    assert bench.main(["--blocks", "256", "--chunk", "64", "--policies", "default",
                       "--others", "2", "--after", "3", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[-2:] == ["others", "us/req"]
    assert float(lines[2].split()[-1]) > 0
    with pytest.raises(SystemExit):
        bench.main(["--after", "-1"])


# -- the listing: kept up to date, exactly what the rebuild gave ---------------


class CountingPositions(dict[bytes, int]):
    """A positions dict counting the keys looked up in it by Python code (the
    ordering's membership tests and sort keys; not the caller's writes)."""

    def __init__(self) -> None:
        super().__init__()
        self.looked_up = 0

    def __getitem__(self, key: bytes) -> int:
        self.looked_up += 1
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.looked_up += 1
        return super().__contains__(key)


def listing_work_per_offer(blocks: int, chunk: int) -> list[int]:
    """Keys the listing of a running request's blocks walks in its access log
    and looks up in its positions, per offer, for ``blocks`` keys offered in
    chunks (keep_ahead's own work, the known fault, is not counted)."""
    mgr = OffloadManager(2 * blocks, policy="lru")
    ctx = CountingContext("long")
    positions = CountingPositions()
    ctx.positions = positions
    return offer_in_chunks(mgr, ctx, blocks, chunk,
                           lambda: ctx.walked + positions.looked_up)


@pytest.mark.parametrize("blocks,chunk", [(4096, 128), (8192, 64)])  # 64: merged logs
def test_listing_work_per_offer_is_bounded_by_the_chunk(blocks: int, chunk: int) -> None:
    # before: every offer deduplicated the whole access log and sorted all of
    # the request's keys by position, O(blocks so far) each
    # the first listing (at the second offer) builds the order from the two
    # chunks logged so far; each later one adds its chunk: a key walked, looked
    # up and sorted (the tail compare adds 2)
    per_offer = listing_work_per_offer(blocks, chunk)
    assert max(per_offer[2:]) <= 3 * chunk, per_offer
    assert per_offer[1] == 3 * 2 * chunk, per_offer


def reference_order(ctx: RequestContext) -> list[bytes]:
    """``RequestContext.access_order`` as computed before it was kept up to
    date: the log's distinct keys in first-seen order, sorted by position
    (stable) when every one has a position."""
    keys = list(dict.fromkeys(itertools.chain.from_iterable(ctx.access_log)))
    positions = ctx.positions
    if positions and positions.keys() >= set(keys):
        keys.sort(key=positions.__getitem__)
    return keys


@dataclass
class Driven:
    """One request the random driver runs, with what it still owes."""

    ctx: RequestContext
    prompt: list[bytes] = field(default_factory=list)
    ends: dict[bytes, int] = field(default_factory=dict)
    mode: str = "chunk"
    step: int = BLOCK_TOKENS
    groups: int = 1
    next_block: int = 0
    stores: list[list[bytes]] = field(default_factory=list)
    loads: list[list[bytes]] = field(default_factory=list)


MODES = ("chunk", "upfront", "none", "partial", "late", "shared")


class CheckedLRU(LRUPolicy):
    """LRU checking its order, after every call, against an ``OrderedDict``
    that moves every key (the keep-ahead as it was before runs), and every
    victim against that order's."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.ref: OrderedDict[bytes, None] = OrderedDict()

    def _moved(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            if k in self.ref:
                self.ref.move_to_end(k)
        assert list(self._order) == list(self.ref)

    def insert(self, keys: list[bytes]) -> None:
        super().insert(keys)
        self.ref.update(dict.fromkeys(keys))

    def remove(self, key: bytes) -> None:
        super().remove(key)
        self.ref.pop(key, None)

    def on_access(self, keys: Sequence[bytes], reused: Container[bytes]) -> None:
        super().on_access(keys, reused)
        self._moved(reversed(keys))

    def keep_ahead(self, run: object, keys: Sequence[bytes], start: int,
                   new: Container[bytes]) -> None:
        super().keep_ahead(run, keys, start, new)
        self._moved(reversed([k for k in keys if k not in new]))

    def evict(self, n: int, protected: Container[bytes]) -> list[bytes] | None:
        expected = [k for k in self.ref if k not in self.blocked and k not in protected][:n]
        victims = super().evict(n, protected)
        assert victims == (expected if len(expected) == n else None)
        for k in victims or ():
            del self.ref[k]
        return victims

    def clear(self) -> None:
        super().clear()
        self.ref.clear()


class Driver:
    """Random interleavings of several requests over one small cache, checking
    what the manager hands ``keep_ahead`` (the request's order against
    ``reference_order``, its unchanged prefix against the previous call's) and
    direct ``access_order`` calls."""

    def __init__(self, policy: str, seed: int) -> None:
        self.rng = random.Random(seed)
        self.mgr = OffloadManager(self.rng.choice([12, 24, 48]), policy=policy)
        self.checked = 0
        self.seen: dict[object, list[bytes]] = {}
        keep_ahead, end_run = self.mgr.policy.keep_ahead, self.mgr.policy.end_run

        def checked_keep_ahead(run: object, keys: Sequence[bytes], start: int,
                               new: Container[bytes]) -> None:
            assert isinstance(run, RequestContext)
            assert list(keys) == reference_order(run)
            assert list(keys[:start]) == self.seen.get(run, [])[:start]
            self.seen[run] = list(keys)
            self.checked += 1
            keep_ahead(run, keys, start, new)

        def checked_end_run(run: object) -> None:
            self.seen.pop(run, None)
            end_run(run)

        self.mgr.policy.keep_ahead = checked_keep_ahead  # type: ignore[method-assign]
        self.mgr.policy.end_run = checked_end_run  # type: ignore[method-assign]
        self.reqs = [self.start(Driven(RequestContext(f"r{i}"))) for i in range(4)]

    def start(self, req: Driven) -> Driven:
        """A new prompt: shares a document's head with others; one or two KV
        groups (two keys per position: ties)."""
        rng = self.rng
        doc, length = rng.randrange(3), rng.randrange(4, 40)
        groups, req.step = rng.choice([1, 1, 2]), rng.choice([1, BLOCK_TOKENS])
        req.prompt = [block_key(doc * 1000 + i + (0 if i < 8 else rng.randrange(2) * 500), g)
                      for i in range(length) for g in range(groups)]
        req.ends = {k: (i // groups + 1) * req.step for i, k in enumerate(req.prompt)}
        req.groups = groups
        req.mode = rng.choice(MODES)
        req.next_block = 0
        if req.mode == "shared":  # written directly, as vLLM's scheduler does
            req.ctx.positions = {}
        if req.mode == "upfront":
            self.place(req, req.prompt)
        return req

    def place(self, req: Driven, keys: list[bytes]) -> None:
        if not keys:
            return
        if req.mode == "shared":  # set again with the same value, as vLLM does
            positions = req.ctx.positions
            positions.update((k, positions.get(k, req.ends[k])) for k in keys)
        elif req.mode == "partial":
            for k in keys:
                if self.rng.random() < 0.8:
                    req.ctx.set_position(k, req.ends[k])
        elif req.mode != "none" and req.groups == 1 and keys == req.prompt[
                req.prompt.index(keys[0]):][:len(keys)]:  # consecutive blocks
            req.ctx.set_positions(keys, req.ends[keys[0]], req.step)
        elif req.mode != "none":
            for k in keys:
                req.ctx.set_position(k, req.ends[k])

    def offer(self, req: Driven) -> None:
        rng, prompt = self.rng, req.prompt
        size = rng.randrange(1, 12)
        roll = rng.random()
        if roll < 0.15 and req.next_block:  # preemption-style: again from the head
            start = rng.randrange(0, req.next_block)
        elif roll < 0.3:  # out of order: a later part first (SWA backfill)
            start = rng.randrange(0, len(prompt))
        else:
            start = req.next_block
        keys = prompt[start:start + size]
        if not keys:
            return
        req.next_block = max(req.next_block, start + len(keys))
        if req.mode != "late":
            self.place(req, keys)
        out = self.mgr.prepare_store(keys, req.ctx)
        if out is not None and out.keys_to_store:
            req.stores.append(out.keys_to_store)

    def step(self) -> None:
        rng, mgr = self.rng, self.mgr
        req = rng.choice(self.reqs)
        ctx = req.ctx
        op = rng.random()
        if op < 0.35:
            self.offer(req)
        elif op < 0.5 and req.stores:
            mgr.complete_store(req.stores.pop(rng.randrange(len(req.stores))), ctx,
                               success=rng.random() < 0.9)
        elif op < 0.6:
            head = req.prompt[:rng.randrange(1, len(req.prompt) + 1)]
            hits = mgr.lookup(head, ctx)
            if hits and rng.random() < 0.7:
                try:
                    mgr.prepare_load(head[:hits], ctx)
                except MissingBlocksError:
                    return
                req.loads.append(head[:hits])
        elif op < 0.68 and req.loads:
            mgr.complete_load(req.loads.pop(), ctx)
        elif op < 0.78:  # many small lists: the log merges at MAX_ACCESS_LISTS
            mgr.touch(rng.sample(req.prompt, rng.randrange(1, 4)), ctx)
        elif op < 0.82:  # late or missing positions arrive
            self.place(req, req.prompt[:req.next_block])
        elif op < 0.83:  # a position moved (out of order)
            ctx.set_position(rng.choice(req.prompt), rng.randrange(0, 50 * req.step))
        elif op < 0.84:  # ...or several
            at = rng.randrange(len(req.prompt))
            ctx.set_positions(req.prompt[at:at + 4], rng.randrange(0, 50 * req.step),
                              rng.choice([1, req.step]))
        elif op < 0.86:  # positions rebound (same entries, or none)
            ctx.positions = dict(ctx.positions) if rng.random() < 0.7 else {}
        elif op < 0.92:
            self.finish(req)
        elif op < 0.935:
            ctx.clear_request_state()
        elif op < 0.94 and ctx.access_log:  # the log changed other than by log_access
            ctx.access_log[:] = [list(keys) for keys in reversed(ctx.access_log)]
        elif op < 0.95:
            mgr.reset()  # contexts start over; owed completions are absorbed
        else:
            self.check(req)
        if rng.random() < 0.5:
            self.check(rng.choice(self.reqs))

    def finish(self, req: Driven) -> None:
        for keys in req.stores:
            self.mgr.complete_store(keys, req.ctx)
        for keys in req.loads:
            self.mgr.complete_load(keys, req.ctx)
        req.stores, req.loads = [], []
        self.check(req)
        self.mgr.on_request_finished(req.ctx)
        self.check(req)
        self.start(req)

    def check(self, req: Driven) -> None:
        assert req.ctx.access_order() == reference_order(req.ctx)


@pytest.mark.parametrize("run_min", [0, 8])  # 0: every running request's keys are a run
@pytest.mark.parametrize("policy", ["default", "lru", "arc", "plfu",
                                    "test_long_prompts:CheckedLRU"])
def test_keep_ahead_gets_what_the_rebuild_gave_under_random_interleavings(
        policy: str, run_min: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(KeyOrder, "RUN_MIN", run_min)
    merged = checked = 0
    for seed in range(12):
        driver = Driver(policy, seed)
        for _ in range(600):
            driver.step()
            merged += any(len(r.ctx.access_log) == 1 and len(r.ctx.access_log[0]) > 8
                          for r in driver.reqs)
        checked += driver.checked
    assert checked > 12 * 30  # keep-aheads checked
    assert merged  # the MAX_ACCESS_LISTS merge happened along the way
