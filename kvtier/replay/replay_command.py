"""``kvtier replay``: a Mooncake-format trace through the manager, every
policy x capacity x store threshold, under one key seed or several
(``kvtier.replay.seeds``); alone, behind a model of vLLM's prefix cache
(``--gpu-blocks``), with the engine driver's order (``--driver engine``) or
through CPU slots and a real disk tier (``--disk-blocks``). The flags are
checked before the trace is loaded; rows print as the replays finish
(``kvtier.replay.replay_output``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.admission import DEFAULT_MAX_TRACKER_SIZE
from kvtier.argtypes import int_list, known_name_list, name_list, positive_int, seed_list
from kvtier.errors import PROG, CommandError, ProtocolError
from kvtier.policies import policy_class
from kvtier.progress import Progress, make_progress
from kvtier.replay.driver import BOUNDS, ReplayResult, bound_results, replay, trace_keys
from kvtier.replay.engine import EngineConfig, replay_engine
from kvtier.replay.rekey import rekeyed
from kvtier.replay.replay_output import GpuTable, JsonLines, Table
from kvtier.replay.seeds import SeedSummary, median_results, seeds_label, summarize
from kvtier.replay.size_checks import check_sizes_fit
from kvtier.replay.trace import BUNDLED_TRACE, TraceRequest, load_requests

if TYPE_CHECKING:
    from kvtier.replay.engine_schedule import ServedRequest


def add_replay_parser(commands: Any) -> None:
    """Register ``kvtier replay``."""
    p = commands.add_parser(
        "replay",
        help="replay a Mooncake-format trace through the manager",
        description="Replay a Mooncake-format trace through OffloadManager for every "
        "policy x capacity x store threshold and report prefix-hit ratios.",
    )
    p.add_argument("trace", nargs="?", type=Path, metavar="TRACE",
                   help=f"Mooncake jsonl trace (default: the bundled {BUNDLED_TRACE.name})")
    p.add_argument("--capacity", type=int_list, required=True, metavar="N[,N...]",
                   help="cache sizes in blocks")
    p.add_argument("--policy", type=name_list, required=True, metavar="NAME[,NAME...]",
                   help="eviction policies (built-in name, 'default', module.path:ClassName; "
                   "'opt' and 'infinite' add the bounds)")
    p.add_argument("--store-threshold", type=int_list, default=[1], metavar="K[,K...]",
                   help="offers a new block needs before it is stored (default 1)")
    p.add_argument("--max-tracker-size", type=positive_int, default=None, metavar="N",
                   help="keys whose offer counts --store-threshold / --disk-store-threshold "
                   f"above 1 keep (default {DEFAULT_MAX_TRACKER_SIZE})")
    p.add_argument("--block-bytes", type=positive_int, default=None, metavar="B",
                   help="bytes per block for bytes_written (default: count blocks)")
    p.add_argument("--bounds", action="store_true",
                   help="add Belady OPT (per capacity) and infinite-cache rows")
    p.add_argument("--plot", default=None, metavar="OUT.png",
                   help="plot hit ratio against capacity, one line per policy, OPT dashed "
                   "(any file type matplotlib writes; .png added without a suffix)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--limit-requests", type=positive_int, default=None, metavar="M",
                   help="replay only the first M requests of the trace")
    p.add_argument("--key-seed", type=seed_list, default=[0], metavar="S[,S...]",
                   help="replay the trace under other block hashes (default 0: its own): "
                   "the default policy's shadow caches sample blocks by their hash, so "
                   "each S >= 1 is another draw of that sample, as another deployment's "
                   "block hashes are (kvtier.replay.rekey); several seeds or a range "
                   "(0-7) add a key-seed column and the median over them, each policy "
                   "against the first one under the same seed")
    _add_replay_driver_options(p)
    _add_replay_disk_options(p)
    _add_replay_gpu_options(p)
    p.set_defaults(func=cmd_replay)


def _add_replay_driver_options(p: Any) -> None:
    """``kvtier replay``'s request order: one at a time, or the engine driver's."""
    p.add_argument("--driver", choices=("sequential", "engine"), default="sequential",
                   help="sequential: the README's one-at-a-time order (default); engine: "
                   "requests in flight together, late out-of-order completions, "
                   "allocation-failure retries, preemption re-offers")
    p.add_argument("--concurrency", type=positive_int, default=None, metavar="N",
                   help="engine driver: requests in flight (default 4)")
    p.add_argument("--max-delay", type=int, default=None, metavar="STEPS",
                   help="engine driver: steps a load or store may take (default 2)")
    p.add_argument("--preempt", type=float, default=None, metavar="P",
                   help="engine driver: probability a request is preempted (default 0)")
    p.add_argument("--seed", type=int, default=None,
                   help="engine driver: random seed (default 0)")


def _add_replay_disk_options(p: Any) -> None:
    """``kvtier replay`` through the tier cascade with a real disk tier."""
    p.add_argument("--disk-blocks", type=positive_int, default=None, metavar="N",
                   help="replay through the tier cascade, CPU slots then a real disk tier "
                   "of N blocks (write-through unless --disk-write-policy evict), and "
                   "report hit_ratio, cpu_hit_ratio and disk_hit_ratio (sequential order; "
                   "no --bounds/--plot)")
    p.add_argument("--disk-store-threshold", type=int_list, default=None, metavar="K[,K...]",
                   help="with --disk-blocks: requests that must use a block (hit it or "
                   "offer it) before it is written to disk (default 1)")
    p.add_argument("--disk-write-policy", type=write_policy_list, default=None,
                   metavar="store|evict[,...]",
                   help="with --disk-blocks: 'store' writes admitted blocks through on "
                   "store (default), 'evict' writes them when the CPU tier evicts them")


def _add_replay_gpu_options(p: Any) -> None:
    """``kvtier replay`` behind a model of vLLM's own prefix cache."""
    p.add_argument("--gpu-blocks", type=positive_int, default=None, metavar="N",
                   help="put a model of vLLM's own prefix cache of N engine blocks (its "
                   "--num-gpu-blocks-override, one is vLLM's null block) in front of kvtier, "
                   "the trace served as 'kvtier bench serve' serves it (32-token blocks, "
                   "full blocks only, outputs capped), and report kvtier's CPU-tier hit "
                   "ratio in tokens (vLLM's external_prefix_cache_hits / _queries), the "
                   "engine cache's and the combined one; one request at a time, or "
                   "--concurrency N in flight with --driver engine (N: the server's mean "
                   "vllm:num_requests_running), or --gpu-batch-tokens; --bounds: OPT over "
                   "the blocks kvtier is asked about")
    p.add_argument("--gpu-batch-tokens", type=positive_int, default=None, metavar="N",
                   help="with --gpu-blocks: run vLLM's scheduler over a queue that never runs "
                   "dry (a saturated server: vllm:num_requests_waiting > 0) with N batched "
                   "tokens per step (vLLM's max_num_batched_tokens, 2048 on the CPU "
                   "platform's server) instead of a fixed number in flight")


def write_policy_list(text: str) -> list[str]:
    """Parse ``store|evict[,...]``, the tier cascade's write policies (argparse type)."""
    from kvtier.tiers.lower_tier import WRITE_POLICIES  # numpy and the tiers: only when used

    return known_name_list(text, WRITE_POLICIES, "write policy")


def check_policies(names: Sequence[str]) -> None:
    """Raise ``CommandError`` with kvtier's message for the first unknown policy."""
    for name in names:
        if name in BOUNDS:
            continue
        try:
            policy_class(name)
        except ValueError as exc:
            raise CommandError(str(exc)) from None


def _formatter(args: argparse.Namespace, path: Path,
               offered: int) -> Table | GpuTable | JsonLines:
    """JSON lines with ``--json``, else an aligned table (``offered``: the
    trace's blocks, the widest count)."""
    if args.json:
        return JsonLines(path)
    names = [*args.policy, *(BOUNDS if args.bounds else ())]
    capacities = [*args.capacity, *([offered] if "infinite" in names else [])]
    table = GpuTable if args.gpu_blocks is not None else Table
    return table(names, capacities, args.store_threshold, offered, args.key_seed)


def cmd_replay(args: argparse.Namespace) -> int:
    """Run every policy x capacity x threshold over the trace, under each key
    seed, and print the results (and their medians over several seeds)."""
    check_policies(args.policy)
    check_sizes_fit(max(args.capacity), args.gpu_blocks)
    _check_engine_options(args)
    _check_bounds_only(args)
    _check_tracker_size(args)
    _check_gpu_options(args)
    _check_disk_options(args)
    _check_plot(args)
    path: Path = args.trace if args.trace is not None else BUNDLED_TRACE
    loaded = load_requests(path, args.limit_requests, not args.no_progress)
    policies = [p for p in args.policy if p not in BOUNDS]
    if args.disk_blocks is not None:
        keys = trace_keys(_rekeyed(loaded, args.key_seed[0]))
        return _cmd_replay_tiered(args, path, keys, policies)
    results, summaries = _replay_seeds(args, path, loaded, policies)
    if args.plot is not None:
        _plot(results, summaries, args.plot, path)
    return 0


def _rekeyed(trace: Sequence[TraceRequest], seed: int) -> list[TraceRequest]:
    """``trace`` under key seed ``seed``; ``CommandError`` when two of its hash
    ids land on one (only this seed's fault)."""
    try:
        return rekeyed(trace, seed)
    except ValueError as exc:
        raise CommandError(f"--key-seed: {exc}") from None


def _replay_seeds(args: argparse.Namespace, path: Path, loaded: Sequence[TraceRequest],
                  policies: list[str],
                  ) -> tuple[list[tuple[int | None, ReplayResult]], list[SeedSummary]]:
    """Replay the grid under each key seed, printing rows as they finish, then
    the bounds (once: no seed changes them) and, for several seeds, the
    medians; return ``(seed, result)`` pairs (seed None for a bound) and the
    medians (none for one seed). A policy whose choices read no key bytes
    (``EvictionPolicy.reads_key_bytes``) runs under the first seed only: its
    row, printed once with no seed, stands for every seed."""
    bounds = [b for b in BOUNDS if b in args.policy or args.bounds]
    grid = list(itertools.product(policies, args.capacity, args.store_threshold))
    seeds: list[int] = args.key_seed
    once: dict[tuple[str, int, int], ReplayResult] = {}  # no seed changes these
    progress = make_progress((len(seeds) * len(grid) + bool(bounds)) * len(loaded),
                             not args.no_progress)
    results: list[tuple[int | None, ReplayResult]] = []
    summaries: list[SeedSummary] = []
    bound_rows: list[ReplayResult] = []
    out = _formatter(args, path, sum(len(r.hash_ids) for r in loaded))
    try:
        for seed in seeds:
            trace = _rekeyed(loaded, seed)
            keys = trace_keys(trace)
            served = _check_gpu_blocks(args, trace, path) if args.gpu_blocks is not None else None
            if seed == seeds[0] and (header := out.header()) is not None:
                progress.write(header)  # after the checks: an error prints no table
            label = f"seed {seed}: " if len(seeds) > 1 else ""
            for cell in grid:
                if cell in once:
                    results.append((seed, once[cell]))
                    progress.update(len(keys))
                    continue
                policy, capacity, threshold = cell
                progress.describe(f"{label}{policy} {capacity} k={threshold}")
                r = _run_one(args, keys, policy, capacity, threshold, progress, served)
                results.append((seed, r))
                if len(seeds) > 1 and not policy_class(policy).reads_key_bytes:
                    once[cell] = r
                    progress.write(out.row(r, None))  # one row for every seed
                else:
                    progress.write(out.row(r, seed))
            if bounds and seed == seeds[0]:
                progress.describe("bounds")
                bound_rows = _bound_rows(args, keys, bounds, served)
                progress.update(len(keys))
        for row in bound_rows:
            results.append((None, row))
            progress.write(out.row(row))
        if len(seeds) > 1 and policies:
            summaries = summarize([(s, r) for s, r in results if s is not None], policies[0])
            for line in out.summary(summaries):
                progress.write(line)
    finally:
        progress.close()
    return results, summaries


TIERED_COLUMNS = ("policy", "capacity", "disk", "threshold", "disk k", "write", "hit ratio",
                  "cpu hit", "disk hit", "disk writes", "seconds")


def _cmd_replay_tiered(args: argparse.Namespace, path: Path, keys: list[list[bytes]],
                       policies: list[str]) -> int:
    """``kvtier replay --disk-blocks N``: each policy x capacity x threshold x disk
    threshold x disk write policy through CPU slots + a disk tier
    (``kvtier.replay.tiered``)."""
    from kvtier.server_process import sigterm_as_exit

    with sigterm_as_exit():  # SIGTERM, as SIGINT does, removes the disk tier's directory
        return _replay_tiered_grid(args, path, keys, policies)


def _replay_tiered_grid(args: argparse.Namespace, path: Path, keys: list[list[bytes]],
                        policies: list[str]) -> int:
    """Print one row per combination of ``_cmd_replay_tiered``'s grid."""
    from kvtier.replay.tiered import replay_tiered

    disk_thresholds = args.disk_store_threshold or [1]
    write_policies = args.disk_write_policy or ["store"]
    grid = list(itertools.product(policies, args.capacity, args.store_threshold,
                                  disk_thresholds, write_policies))
    progress = make_progress(len(grid) * len(keys), not args.no_progress)
    widths = [max(len(TIERED_COLUMNS[0]), *map(len, policies)), *map(len, TIERED_COLUMNS[1:])]
    widths[1] = max(widths[1], len(str(max(args.capacity))))
    widths[2] = max(widths[2], len(str(args.disk_blocks)))
    try:
        if not args.json:
            progress.write("  ".join([TIERED_COLUMNS[0].ljust(widths[0])] + [
                h.rjust(w) for h, w in zip(TIERED_COLUMNS[1:], widths[1:], strict=True)]))
        for policy, capacity, threshold, disk_threshold, write in grid:
            progress.describe(f"{policy} {capacity}+{args.disk_blocks} k={threshold} "
                              f"disk k={disk_threshold} {write}")
            try:
                r = replay_tiered(keys, capacity, args.disk_blocks, policy,
                                  store_threshold=threshold,
                                  disk_store_threshold=disk_threshold,
                                  disk_write_policy=write,
                                  max_tracker_size=args.max_tracker_size,
                                  progress=progress.update)
            except ProtocolError:
                raise
            except ValueError as exc:
                raise CommandError(str(exc)) from None
            except MemoryError as exc:  # the CPU slots' region: capacity x 4 KiB of temp space
                raise CommandError(f"--capacity {capacity}: {exc or 'out of memory'}") from None
            if args.json:
                progress.write(json.dumps({**r.to_dict(), "trace": str(path)}))
            else:
                cells = (str(r.capacity), str(r.disk_blocks), str(r.store_threshold),
                         str(r.disk_store_threshold), r.disk_write_policy,
                         f"{r.hit_ratio:.4f}", f"{r.cpu_hit_ratio:.4f}",
                         f"{r.disk_hit_ratio:.4f}", str(r.disk_writes), f"{r.seconds:.1f}")
                progress.write("  ".join([r.policy.ljust(widths[0])] + [
                    c.rjust(w) for c, w in zip(cells, widths[1:], strict=True)]))
    finally:
        progress.close()
    return 0


def _bound_rows(args: argparse.Namespace, keys: list[list[bytes]], bounds: list[str],
                served: Sequence[ServedRequest] | None) -> list[ReplayResult]:
    """The bound rows: over the trace, or with ``--gpu-blocks`` over the blocks
    kvtier is asked about behind the engine cache."""
    opt, infinite = "opt" in bounds, "infinite" in bounds
    if served is None:
        return bound_results(keys, args.capacity, opt=opt, infinite=infinite,
                             block_bytes=args.block_bytes)
    from kvtier.replay.behind_engine import behind_engine_bounds

    return list(behind_engine_bounds(served, args.capacity, gpu_blocks=args.gpu_blocks,
                                     concurrency=_gpu_concurrency(args),
                                     batch_tokens=args.gpu_batch_tokens, opt=opt,
                                     infinite=infinite, block_bytes=args.block_bytes))


def _gpu_concurrency(args: argparse.Namespace) -> int:
    """Requests in flight behind the engine cache: ``--concurrency`` with ``--driver engine``."""
    return _engine_config(args).concurrency if args.driver == "engine" else 1


def _check_gpu_options(args: argparse.Namespace) -> None:
    """``CommandError`` for options ``--gpu-blocks`` cannot run with, or
    ``--gpu-batch-tokens`` without it: before the trace is loaded."""
    if args.gpu_blocks is None:
        if args.gpu_batch_tokens is not None:
            raise CommandError("--gpu-batch-tokens needs --gpu-blocks")
        return
    if args.disk_blocks is not None:
        raise CommandError("--gpu-blocks cannot be combined with --disk-blocks")
    if args.preempt is not None:
        raise CommandError("--gpu-blocks does not take --preempt (the scheduler model of "
                           "--gpu-batch-tokens preempts as vLLM does)")
    for option in ("--max-delay", "--seed"):
        if getattr(args, option[2:].replace("-", "_")) is not None:
            raise CommandError(f"--gpu-blocks does not take {option} (the engine cache "
                               "model has no delays and no randomness)")
    if args.gpu_batch_tokens is not None and args.driver == "engine":
        raise CommandError("--gpu-batch-tokens sets the requests in flight itself "
                           "(no --driver engine / --concurrency)")


def _check_gpu_blocks(args: argparse.Namespace, trace: Sequence[TraceRequest],
                      path: Path) -> list[ServedRequest]:
    """The trace (read from ``path``) as the engine gets it; ``CommandError`` for
    a request without an input length, or one longer than the engine cache."""
    from kvtier.replay.behind_engine import check_fits, served_requests
    from kvtier.replay.serving_trace import UnservableRequestError, missing_length_message

    try:
        served = served_requests(trace)
        check_fits(served, args.gpu_blocks)
    except UnservableRequestError as exc:
        raise CommandError(missing_length_message("--gpu-blocks", path, exc)) from None
    except ValueError as exc:
        raise CommandError(f"--gpu-blocks {args.gpu_blocks}: {exc}") from None
    return served


ENGINE_OPTIONS = ("--concurrency", "--max-delay", "--preempt", "--seed")
"""The engine driver's options: None unless given, and given only with ``--driver engine``."""


def _check_engine_options(args: argparse.Namespace) -> None:
    """``CommandError`` for an engine option given without ``--driver engine``
    (it would change nothing), or out of range."""
    if args.driver != "engine":
        for option in ENGINE_OPTIONS:
            if getattr(args, option[2:].replace("-", "_")) is not None:
                raise CommandError(f"{option} is an engine driver option: it needs "
                                   "--driver engine")
    if args.max_delay is not None and args.max_delay < 0:
        raise CommandError(f"--max-delay must be >= 0, got {args.max_delay}")
    if args.preempt is not None and not 0.0 <= args.preempt < 1.0:
        raise CommandError(f"--preempt must be in [0, 1), got {args.preempt}")


def _check_disk_options(args: argparse.Namespace) -> None:
    """``CommandError`` for disk options without ``--disk-blocks``, or for
    options ``--disk-blocks`` does not take: before the trace is loaded, which
    may take a while."""
    if args.disk_blocks is None:
        for option in ("--disk-store-threshold", "--disk-write-policy"):
            if getattr(args, option[2:].replace("-", "_")) is not None:
                raise CommandError(f"{option} needs --disk-blocks")
        return
    if (args.driver != "sequential" or args.bounds or args.plot is not None
            or any(name in BOUNDS for name in args.policy)):
        raise CommandError("--disk-blocks runs the sequential driver over real policies "
                           "only (no --driver engine, --bounds, --plot, opt or infinite)")
    if len(args.key_seed) > 1:
        raise CommandError("--disk-blocks replays under one --key-seed at a time")
    if args.block_bytes is not None:  # its rows have no bytes_written to scale
        raise CommandError("--block-bytes does not apply to --disk-blocks (its rows count "
                           "disk_writes in blocks)")


def _check_tracker_size(args: argparse.Namespace) -> None:
    """``CommandError`` for ``--max-tracker-size`` where no threshold above 1
    keeps counts (its rows would come out as without it); else the default
    fills it in."""
    if args.max_tracker_size is None:
        args.max_tracker_size = DEFAULT_MAX_TRACKER_SIZE
    elif max(args.store_threshold + (args.disk_store_threshold or [])) < 2:
        raise CommandError("--max-tracker-size bounds the offer counts of a --store-threshold "
                           "or --disk-store-threshold above 1; with threshold 1 none are "
                           "kept (raise a threshold, or drop --max-tracker-size)")


def _check_bounds_only(args: argparse.Namespace) -> None:
    """``CommandError`` for options that only change policies' replays when
    ``--policy`` names bounds only: their rows would come out as without them."""
    if any(name not in BOUNDS for name in args.policy):
        return
    if args.driver == "engine" and args.gpu_blocks is None:
        raise CommandError("--driver engine changes how policies are replayed; "
                           f"--policy {','.join(args.policy)} names bounds only, whose "
                           "rows do not depend on it (add a policy, or drop --driver)")
    if args.store_threshold != [1]:
        raise CommandError("--store-threshold applies to policies; the opt and infinite "
                           "rows keep every block (threshold 1): add a policy to --policy")
    if args.key_seed != [0]:
        raise CommandError("--key-seed changes policies' replays; the opt and infinite "
                           "rows are the same under every key seed: add a policy to --policy")


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine driver's settings: the options given, ``EngineConfig``'s defaults
    for the others."""
    given = {option[2:].replace("-", "_"): getattr(args, option[2:].replace("-", "_"))
             for option in ENGINE_OPTIONS}
    return EngineConfig(**{name: value for name, value in given.items() if value is not None})


def _check_plot(args: argparse.Namespace) -> None:
    """Check ``--plot`` before the run: ``args.plot`` becomes the file the plot
    will be written to (``.png`` added without a suffix); ``CommandError`` when
    it cannot be written (``kvtier.replay.plot.plot_path``)."""
    if args.plot is None:
        return
    from kvtier.replay.plot import PlotError, plot_path

    try:
        args.plot = plot_path(args.plot)
    except PlotError as exc:
        raise CommandError(str(exc)) from None


def _plot(results: Sequence[tuple[int | None, ReplayResult]],
          summaries: Sequence[SeedSummary], out: Path, trace: Path) -> None:
    """Plot ``results`` to ``out`` (checked by ``_check_plot``) and say so: with
    ``summaries`` (several key seeds), each policy's median and its range."""
    from kvtier.replay.plot import PlotError, plot_results

    rows = [r for _, r in results]
    spread: dict[tuple[str, int, int], tuple[float, float]] = {}
    if summaries:
        per_seed = [(seed, r) for seed, r in results if seed is not None]
        rows = [*median_results(per_seed, summaries), *(r for s, r in results if s is None)]
        spread = {(s.policy, s.capacity, s.store_threshold): (s.hit_ratio_min, s.hit_ratio_max)
                  for s in summaries}
    gpu = getattr(rows[0], "gpu_blocks", 0) if rows else 0
    title = (f"CPU-tier hit ratio behind a {gpu:,}-block engine cache\n{trace.name}" if gpu
             else f"prefix-hit ratio, {trace.name}")  # two lines: one is wider than the plot
    if spread:
        title += (f"\nmedian over key seeds {seeds_label(summaries[0].key_seeds)}, "
                  "shaded: their range")
    try:
        plot_results(rows, out, title=title, spread=spread)
    except PlotError as exc:
        raise CommandError(str(exc)) from None
    print(f"{PROG}: wrote plot {out}", file=sys.stderr)


def _run_one(args: argparse.Namespace, keys: list[list[bytes]], policy: str,
             capacity: int, threshold: int, progress: Progress,
             served: Sequence[ServedRequest] | None = None) -> ReplayResult:
    """One replay (``served``: the trace as the engine gets it, with ``--gpu-blocks``);
    bad manager parameters become ``CommandError`` (protocol bugs do not)."""
    try:
        if served is not None:
            from kvtier.replay.behind_engine import replay_behind_engine

            return replay_behind_engine(served, capacity, policy, gpu_blocks=args.gpu_blocks,
                                        concurrency=_gpu_concurrency(args),
                                        batch_tokens=args.gpu_batch_tokens,
                                        store_threshold=threshold,
                                        max_tracker_size=args.max_tracker_size,
                                        block_bytes=args.block_bytes,
                                        progress=progress.update)
        if args.driver == "engine":
            return replay_engine(keys, capacity, policy, _engine_config(args),
                                 store_threshold=threshold,
                                 max_tracker_size=args.max_tracker_size,
                                 block_bytes=args.block_bytes, progress=progress.update)
        return replay(keys, capacity, policy, store_threshold=threshold,
                      max_tracker_size=args.max_tracker_size,
                      block_bytes=args.block_bytes, progress=progress.update)
    except ProtocolError:
        raise
    except ValueError as exc:
        raise CommandError(str(exc)) from None
