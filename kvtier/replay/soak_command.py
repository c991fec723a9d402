"""``kvtier soak``: the soak's command line (``kvtier.replay.soak``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvtier.argtypes import non_negative_int, positive_int
from kvtier.errors import PROG, CommandError
from kvtier.progress import make_progress
from kvtier.replay.mix import DEFAULT_KINDS
from kvtier.replay.size_checks import check_sizes_fit

SHOWN = ("manager.table", "manager.tracker_size", "manager.history_size", "manager.events",
         "cascade.uses", "cascade.tiers.disk.index", "cascade.probes.redis.known",
         "cascade.queued_writes")
"""Sizes printed per sample without ``--json`` (all are in the JSON)."""
SAMPLES = 100
"""Samples of a run without ``--sample-every`` (the last one at the end)."""


def add_soak_parser(commands: Any) -> None:
    """Register ``kvtier soak``."""
    p = commands.add_parser(
        "soak", help="generated traffic through the manager, disk and Redis, sampling memory",
        description="Drive generated traffic (a mix of kvtier generate kinds) through a real "
        "OffloadManager and TierCascade with a disk tier and a Redis tier on a local "
        "redis-server, and sample the RSS and the size of every bounded structure. Exit "
        "status 1 when a structure went past its stated bound.")
    p.add_argument("--requests", type=positive_int, default=1_000_000, metavar="N",
                   help="requests driven through the manager (default 1,000,000: "
                        "about an hour on a 2-core machine)")
    p.add_argument("--cpu-blocks", type=positive_int, default=4_000, metavar="N",
                   help="CPU slots (default 4000)")
    p.add_argument("--disk-blocks", type=non_negative_int, default=16_000, metavar="N",
                   help="disk tier blocks, 0 for none (default 16000)")
    p.add_argument("--redis-maxmemory", type=positive_int, default=None, metavar="BYTES",
                   help="the local redis-server's maxmemory (default 64 MiB)")
    p.add_argument("--no-redis", action="store_true", help="no Redis tier")
    p.add_argument("--policy", default="default", help="eviction policy (default: default)")
    p.add_argument("--kinds", default=",".join(DEFAULT_KINDS), metavar="K[,K...]",
                   help=f"workload kinds mixed (default {','.join(DEFAULT_KINDS)})")
    p.add_argument("--sample-every", type=positive_int, default=None, metavar="N",
                   help="requests between samples (default: at most 100 samples)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the generated traffic mix (default 0)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per sample, then the summary")
    p.add_argument("--plot", default=None, metavar="OUT.png",
                   help="RSS and structure fill against requests (any file type matplotlib "
                   "writes; .png added without a suffix)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_soak)


def cmd_soak(args: argparse.Namespace) -> int:
    """Run the soak; print samples and the summary; 1 on a bound violation."""
    from kvtier.replay.soak import DEFAULT_REDIS_MAXMEMORY, Sample, SoakConfig, run_soak
    from kvtier.server_process import sigterm_as_exit

    if args.no_redis and args.redis_maxmemory is not None:
        raise CommandError("--redis-maxmemory sizes the Redis tier that --no-redis leaves out")
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    _check_flags(args, kinds)
    # rounded up: 100 samples at most (a remainder adds the last one, at the end)
    every = args.sample_every or -(-args.requests // SAMPLES)
    config = SoakConfig(requests=args.requests, cpu_blocks=args.cpu_blocks,
                        disk_blocks=args.disk_blocks, redis=not args.no_redis,
                        redis_maxmemory=args.redis_maxmemory or DEFAULT_REDIS_MAXMEMORY,
                        policy=args.policy,
                        kinds=kinds, sample_every=every, seed=args.seed)
    try:
        config.check()
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    check_sizes_fit(args.cpu_blocks, capacity_flag="--cpu-blocks")
    plot = _plot_path(args.plot)
    progress = make_progress(args.requests, not args.no_progress, unit="req")
    if not args.json:
        progress.write("  ".join(["requests", "seconds", "RSS MiB", *SHOWN]))

    def show(sample: Sample) -> None:
        if args.json:
            progress.write(json.dumps(sample.to_dict()))
        else:
            cells = [str(sample.requests), f"{sample.seconds:.0f}",
                     f"{sample.rss_bytes / 2**20:.1f}",
                     *(str(sample.sizes.get(name, "-")) for name in SHOWN)]
            progress.write("  ".join(cells))

    try:
        with sigterm_as_exit():  # SIGTERM, as SIGINT does, removes the soak's directory
            result = run_soak(config, on_sample=show, progress=progress.update)
    except FileNotFoundError as exc:  # no redis-server
        raise CommandError(f"{exc} (or run with --no-redis)") from None
    except MemoryError as exc:  # the CPU slots' region: cpu_blocks x 4 KiB of temp space
        raise CommandError(f"--cpu-blocks {args.cpu_blocks}: {exc or 'out of memory'}") from None
    finally:
        progress.close()
    summary = result.summary()
    print(json.dumps({"summary": summary, "bounds": result.bounds}) if args.json
          else _summary_text(summary))
    if plot is not None:
        from kvtier.replay.plot import PlotError
        from kvtier.replay.soak_plot import plot_soak

        try:
            plot_soak(result.samples, result.bounds, plot,
                      title=f"kvtier soak: {args.requests:,} requests, {args.policy}, "
                      f"{args.cpu_blocks:,} CPU + {args.disk_blocks:,} disk blocks"
                      + ("" if args.no_redis else " + Redis"))
        except PlotError as exc:
            raise CommandError(str(exc)) from None
        print(f"{PROG}: wrote plot {plot}")
    return 1 if summary["violations"] else 0


def _check_flags(args: argparse.Namespace, kinds: tuple[str, ...]) -> None:
    """``CommandError`` naming the flag of a bad ``--policy``, ``--kinds`` or
    ``--sample-every`` (``SoakConfig.check`` names its fields, not the flags)."""
    from kvtier.policies import policy_class
    from kvtier.replay.mix import TrafficMix
    from kvtier.replay.soak import MAX_SAMPLES

    try:
        policy_class(args.policy)
    except ValueError as exc:
        raise CommandError(f"--policy: {exc}") from None
    try:
        TrafficMix(kinds, args.seed)
    except ValueError as exc:
        raise CommandError(f"--kinds: {exc}") from None
    every = args.sample_every
    if every is not None and args.requests / every > MAX_SAMPLES:
        raise CommandError(f"--sample-every {every}: {args.requests:,} requests would take "
                           f"more than {MAX_SAMPLES:,} samples; give --sample-every "
                           f"{-(-args.requests // MAX_SAMPLES)} or more")


def _plot_path(text: str | None) -> Path | None:
    """The file ``--plot TEXT`` will write, checked before the run
    (``kvtier.replay.plot.plot_path``); ``CommandError`` when it cannot be."""
    if text is None:
        return None
    from kvtier.replay.plot import PlotError, plot_path

    try:
        return plot_path(text)
    except PlotError as exc:
        raise CommandError(str(exc)) from None


def _summary_text(summary: dict[str, Any]) -> str:
    lines = [f"{summary['requests']:,} requests in {summary['seconds']:.0f} s "
             f"({summary['requests_per_s']} req/s)",
             f"RSS {summary['rss_mib_start']} MiB at start, {summary['rss_mib_end']} MiB at the "
             f"end (peak {summary['rss_mib_peak']}); growth after warm-up "
             f"{summary['rss_growth_after_warmup_mib']} MiB"]
    violations = summary["violations"]
    lines.append("every structure within its bound" if not violations
                 else "over their bounds: " + "; ".join(violations))
    return "\n".join(lines)
