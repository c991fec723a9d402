"""Manager time per offered key for long prompts offered chunk by chunk, by prompt length.

vLLM's chunked prefill computes a long prompt over many scheduler steps and
offers its blocks to the offloading manager one chunk per step (at most
``max_num_batched_tokens`` tokens, 2,048 by default: 128 blocks of 16
tokens). This drives a real ``OffloadManager`` that way, once per policy and
prompt length: the first step looks the prompt's first key up (a miss), each
step offers the next ``--chunk`` keys (positions set as vLLM's scheduler sets
them) and completes the stores granted at the step before (the worker's
copies finish a step later), and the last step finishes the request.
``--others N`` adds N short requests (``--other-blocks`` keys, one offer,
finished at once) at every step, as other traffic in the same steps, and at
each of ``--after`` steps after the prompt finished (default 0); their
manager time per request is reported apart ("others us/req": what a long
request's blocks, kept ahead as a run, cost the traffic around them).

The cache holds ``--capacity-factor`` times the prompt (default 2: no
eviction of the prompt itself). Reported per policy and prompt length, the
best of ``--repeats`` runs: microseconds of manager time per offered key of
the long prompt (offers, completions and the finish; the other requests'
calls are not timed), the share of it spent ranking the request's earlier
blocks ahead of its new ones, in two parts: the manager listing them
(``OffloadManager._keep_ahead`` but the policy's call: "order %") and the
policy ranking them (``keep_ahead``: "keep %"); and the keys handed to
``keep_ahead`` as new since the request's previous offer, per offered key
(a count: 1 when the manager hands each key once, as it does since
``RequestContext.running_order``; the policy's own work per offer shows in
the time columns, which grow with the prompt where it moves every block).

``--decode N`` then decodes: N more blocks, each offered alone at its own
step (what vLLM does with ``"offload_prompt_only": false`` in the
connector's config; its default offers prompt blocks only), before the
finish; reported apart, as microseconds of manager time per decode offer
(not in the columns above).

    python benchmarks/bench_long_prompts.py [--blocks 1024,2048,4096,8192,16384]
        [--chunk 128] [--policies default,lru,plfu] [--others 0] [--decode 0]
        [--repeats 3]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Container, Sequence
from dataclasses import dataclass

from kvtier import OffloadManager, RequestContext, block_key

BLOCK_TOKENS = 16


@dataclass
class Run:
    """One long prompt through one manager: seconds and counts."""

    total_s: float = 0.0
    decode_s: float = 0.0
    order_s: float = 0.0
    keep_s: float = 0.0
    ahead_keys: int = 0
    others_s: float = 0.0
    others_n: int = 0


def _instrument(mgr: OffloadManager, run: Run) -> None:
    """Time ``_keep_ahead`` and the policy's ``keep_ahead`` within it (and count
    the keys handed to it as new since the request's previous offer)."""
    manager_keep_ahead = mgr._keep_ahead
    keep_ahead = mgr.policy.keep_ahead

    def timed_manager_keep_ahead(new: list[bytes], ctx: RequestContext) -> None:
        t0 = time.perf_counter()
        try:
            manager_keep_ahead(new, ctx)
        finally:
            run.order_s += time.perf_counter() - t0

    def timed_keep_ahead(token: object, keys: Sequence[bytes], start: int,
                         new: Container[bytes]) -> None:
        t0 = time.perf_counter()
        try:
            keep_ahead(token, keys, start, new)
        finally:
            spent = time.perf_counter() - t0
            run.keep_s += spent
            run.order_s -= spent  # counted once, as the policy's
            run.ahead_keys += len(keys) - start

    mgr._keep_ahead = timed_manager_keep_ahead  # type: ignore[method-assign]
    mgr.policy.keep_ahead = timed_keep_ahead  # type: ignore[method-assign,assignment]


def _other_traffic(mgr: OffloadManager, step: object, others: int, blocks: int,
                   run: Run) -> None:
    """``others`` short requests at this step: one offer each, finished at
    once; their manager time into ``run.others_s``."""
    clock = time.perf_counter
    for i in range(others):
        keys = [block_key(hash((step, i, j)) & (2**63 - 1), 1) for j in range(blocks)]
        ctx = RequestContext(f"other-{step}-{i}")
        t0 = clock()
        ctx.set_positions(keys, BLOCK_TOKENS, BLOCK_TOKENS)
        out = mgr.prepare_store(keys, ctx)
        if out is not None:
            mgr.complete_store(out.keys_to_store, ctx)
        mgr.on_request_finished(ctx)
        run.others_s += clock() - t0
        run.others_n += 1


def long_prompt(policy: str, blocks: int, chunk: int, capacity_factor: float,
                others: int, other_blocks: int, instrument: bool, decode: int = 0,
                after: int = 0) -> Run:
    """Offer one prompt of ``blocks`` keys in chunks, as vLLM does, then ``decode``
    blocks one at a time; time the manager (decode offers apart)."""
    mgr = OffloadManager(max(1, int(capacity_factor * blocks)), policy=policy)
    run = Run()
    if instrument:
        _instrument(mgr, run)
    keys = [block_key(i) for i in range(blocks)]
    ctx = RequestContext("long")
    clock = time.perf_counter
    t0 = clock()
    mgr.lookup_one(keys[0], ctx)
    run.total_s += clock() - t0
    granted: list[bytes] = []
    for step, start in enumerate(range(0, blocks, chunk)):
        _other_traffic(mgr, step, others, other_blocks, run)
        offer = keys[start:start + chunk]
        t0 = clock()
        ctx.set_positions(offer, (start + 1) * BLOCK_TOKENS, BLOCK_TOKENS)
        if granted:
            mgr.complete_store(granted, ctx)
        out = mgr.prepare_store(offer, ctx)
        granted = out.keys_to_store if out is not None else []
        run.total_s += clock() - t0
    granted = _decode(mgr, ctx, run, granted, blocks, decode, others, other_blocks)
    t0 = clock()
    if granted:
        mgr.complete_store(granted, ctx)
    mgr.on_request_finished(ctx)
    run.total_s += clock() - t0
    for step in range(after):
        _other_traffic(mgr, ("after", step), others, other_blocks, run)
    return run


def _decode(mgr: OffloadManager, ctx: RequestContext, run: Run, granted: list[bytes],
            blocks: int, decode: int, others: int, other_blocks: int) -> list[bytes]:
    """Offer ``decode`` blocks after the prompt's ``blocks``, one per step (the
    previous step's store completing first); time them into ``run.decode_s``;
    return the keys granted last."""
    clock = time.perf_counter
    for i in range(decode):
        _other_traffic(mgr, -1 - i, others, other_blocks, run)
        offer = [block_key(blocks + i)]
        t0 = clock()
        ctx.set_positions(offer, (blocks + i + 1) * BLOCK_TOKENS, BLOCK_TOKENS)
        if granted:
            mgr.complete_store(granted, ctx)
        out = mgr.prepare_store(offer, ctx)
        granted = out.keys_to_store if out is not None else []
        run.decode_s += clock() - t0
    return granted


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected ints >= 1, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--blocks", type=_ints, default=[1024, 2048, 4096, 8192, 16384],
                    help="prompt lengths in blocks, comma-separated")
    ap.add_argument("--chunk", type=int, default=128, help="blocks offered per step")
    ap.add_argument("--policies", default="default,lru,plfu",
                    help="eviction policies, comma-separated (default: %(default)s)")
    ap.add_argument("--capacity-factor", type=float, default=2.0,
                    help="cache size as a multiple of the prompt")
    ap.add_argument("--others", type=int, default=0,
                    help="short requests offered and finished at every step")
    ap.add_argument("--other-blocks", type=int, default=16,
                    help="blocks of each short request of --others (default: %(default)s)")
    ap.add_argument("--decode", type=int, default=0,
                    help="blocks decoded after the prompt, one offer each")
    ap.add_argument("--after", type=int, default=0,
                    help="steps of --others traffic after the prompt finished")
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each policy and prompt length, the best reported "
                    "(default: %(default)s)")
    args = ap.parse_args(argv)
    if (args.chunk < 1 or args.repeats < 1 or args.others < 0 or args.other_blocks < 1
            or args.decode < 0 or args.after < 0):
        ap.error("--chunk, --repeats and --other-blocks must be >= 1, --others, "
                 "--decode and --after >= 0")
    if args.capacity_factor <= 0:
        ap.error("--capacity-factor must be > 0")
    print(f"chunk {args.chunk} blocks, cache {args.capacity_factor:g} x prompt, "
          f"{args.others} other request(s) per step; best of {args.repeats}")
    decode_head = f" {'decode us/offer':>16s}" if args.decode else ""
    others_head = f" {'others us/req':>14s}" if args.others else ""
    print(f"{'policy':8s} {'blocks':>7s} {'us/key':>7s} {'order %':>8s} {'keep %':>7s} "
          f"{'ahead keys/key':>15s}{decode_head}{others_head}")
    for policy in args.policies.split(","):
        for blocks in args.blocks:
            run = functools.partial(long_prompt, policy, blocks, args.chunk,
                                    args.capacity_factor, args.others, args.other_blocks)
            repeats = range(args.repeats)
            runs = [run(instrument=False, after=args.after) for _ in repeats]
            best = min(runs, key=lambda r: r.total_s)
            others = ""
            if args.others:
                others = f" {min(r.others_s / r.others_n for r in runs) * 1e6:14.1f}"
            shares = run(instrument=True)
            total = shares.total_s or 1.0
            decode = ""
            if args.decode:  # runs of their own: the prompt's columns stay as without
                decode_s = min(run(instrument=False, decode=args.decode).decode_s
                               for _ in repeats)
                decode = f" {decode_s / args.decode * 1e6:16.1f}"
            print(f"{policy:8s} {blocks:7d} {best.total_s / blocks * 1e6:7.2f} "
                  f"{100 * shares.order_s / total:7.1f}% {100 * shares.keep_s / total:6.1f}% "
                  f"{shares.ahead_keys / blocks:15.2f}{decode}{others}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
