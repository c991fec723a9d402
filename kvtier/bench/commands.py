"""``kvtier bench serve``: the serving benchmark's command line (``kvtier.bench.serving``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvtier.argtypes import positive_int
from kvtier.bench import serving
from kvtier.demo.tiny_model import DEFAULT_MODEL_DIR_TEXT
from kvtier.errors import CommandError
from kvtier.progress import make_progress
from kvtier.server_process import sigterm_as_exit


def _split(text: str) -> tuple[str, ...]:
    """The comma-separated items of ``text``, stripped, each once, in order."""
    return tuple(dict.fromkeys(n.strip() for n in text.split(",")))


def _names(allowed: tuple[str, ...]) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        names = _split(text)
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {bad[0] if bad else 'empty'!r} (choose from {', '.join(allowed)})")
        return names
    return parse


def _configs(text: str) -> tuple[str, ...]:
    names = _split(text)
    if not all(names):
        raise argparse.ArgumentTypeError("empty configuration name")
    try:
        return tuple(serving.check_config(n) for n in names)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(dict.fromkeys(positive_int(n) for n in _split(text)))


def _plain(doc: str | None, paragraph: int) -> str | None:
    """Paragraph ``paragraph`` of a module docstring, its ``literals`` as plain text."""
    return doc.split("\n\n")[paragraph].replace("``", "") if doc else None


def add_bench_parser(commands: Any) -> None:
    """Register ``kvtier bench serve``."""
    bench = commands.add_parser("bench", help="benchmarks (serve: real servers, vLLM's client)")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    p = sub.add_parser(
        "serve", help="real vLLM servers x configurations driven by 'vllm bench serve'",
        description=_plain(serving.__doc__, 1))
    p.add_argument("--out", type=Path, default=Path("bench-serve"), metavar="DIR",
                   help="runs, logs, summary and plot go here (default ./bench-serve)")
    p.add_argument("--model-dir", type=Path, default=None, metavar="DIR",
                   help="the tiny model (built there if missing; default "
                   f"{DEFAULT_MODEL_DIR_TEXT})")
    p.add_argument("--configs", type=_configs, default=serving.CONFIGS,
                   metavar="C[,C...]",
                   help=f"none, vllm-lru, or POLICY[+disk] (default {','.join(serving.CONFIGS)})")
    p.add_argument("--traffic", type=_names(serving.TRAFFIC), default=serving.TRAFFIC,
                   metavar="T[,T...]", help="bundled (the Mooncake trace) and/or generated "
                   f"(kvtier generate {serving.GENERATED_KIND}; default "
                   f"{','.join(serving.TRAFFIC)})")
    p.add_argument("--regimes", type=_names(serving.REGIMES), default=serving.REGIMES,
                   metavar="R[,R...]", help="paced (trace timestamps) and/or saturating "
                   f"(default {','.join(serving.REGIMES)})")
    p.add_argument("--cpu-blocks", type=_sizes, default=(1000, 4000), metavar="N[,N...]",
                   help="CPU-tier sizes in engine blocks (default 1000,4000: 2x and 8x the "
                   "engine cache)")
    p.add_argument("--gpu-blocks", type=positive_int, default=500, metavar="N",
                   help="engine KV cache blocks (default 500)")
    p.add_argument("--requests", type=positive_int, default=1500, metavar="N",
                   help="requests per run: the trace's first N, or N generated "
                   "(default %(default)s)")
    p.add_argument("--repeats", type=positive_int, default=3, metavar="N",
                   help="runs of each configuration in each scenario; the summary takes "
                   "their medians (default %(default)s)")
    p.add_argument("--speedup", type=float, default=25.0, metavar="X",
                   help="paced regime: arrivals X times faster than the trace (default 25)")
    p.add_argument("--concurrency", type=positive_int, default=16, metavar="N",
                   help="saturating regime: requests in flight (default 16)")
    p.add_argument("--trace", type=Path, default=None, metavar="TRACE",
                   help="Mooncake trace for 'bundled' traffic (default the bundled one)")
    p.add_argument("--resume", action="store_true", help="keep the runs of OUT/runs.jsonl")
    p.add_argument("--summarize", action="store_true",
                   help="only summarize OUT/runs.jsonl (no new runs)")
    p.set_defaults(func=cmd_bench_serve)
    _add_faults(sub)


def _add_faults(sub: Any) -> None:
    """Register ``kvtier bench faults``."""
    from kvtier.bench import faults

    p = sub.add_parser("faults", help="tier faults injected into a real server under load",
                       description=_plain(faults.__doc__, 0))
    p.add_argument("--out", type=Path, default=Path("bench-faults"), metavar="DIR",
                   help="trace, logs, faults.jsonl and faults.txt go here "
                   "(default ./bench-faults)")
    p.add_argument("--model-dir", type=Path, default=None, metavar="DIR",
                   help="the tiny model (built there if missing; default "
                   f"{DEFAULT_MODEL_DIR_TEXT})")
    p.add_argument("--faults", type=_names(faults.FAULTS), default=faults.FAULTS,
                   metavar="F[,F...]", help=f"default {','.join(faults.FAULTS)}")
    p.add_argument("--requests", type=positive_int, default=800, metavar="N",
                   help="requests per run: the bundled trace's first N (default %(default)s)")
    p.add_argument("--speedup", type=float, default=10.0, metavar="X",
                   help="arrivals X times faster than the trace (default 10)")
    p.set_defaults(func=cmd_bench_faults)


def cmd_bench_faults(args: argparse.Namespace) -> int:
    """The reference run, then every fault; faults.txt and faults.jsonl in OUT."""
    from kvtier.bench import faults
    from kvtier.demo.tiny_model import build_tiny_llama, default_model_dir

    if args.speedup <= 0:
        raise CommandError(f"--speedup must be > 0, got {args.speedup}")
    s = faults.FaultSettings(model=build_tiny_llama(args.model_dir or default_model_dir()),
                             out=args.out, faults=args.faults, requests=args.requests,
                             speedup=args.speedup)
    s.out.mkdir(parents=True, exist_ok=True)
    (s.out / "faults.jsonl").unlink(missing_ok=True)
    with sigterm_as_exit():
        results = faults.run_all(s, say=lambda m: print(m, file=sys.stderr, flush=True))
    lines = faults.table(results)
    (s.out / "faults.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def settings_from(args: argparse.Namespace) -> serving.BenchSettings:
    from kvtier.demo.tiny_model import build_tiny_llama, default_model_dir

    if args.speedup <= 0:
        raise ValueError(f"--speedup must be > 0, got {args.speedup}")
    model = build_tiny_llama(args.model_dir or default_model_dir())
    return serving.BenchSettings(
        model=model, out=args.out, configs=args.configs, traffic=args.traffic,
        regimes=args.regimes, cpu_blocks=args.cpu_blocks, gpu_blocks=args.gpu_blocks,
        requests=args.requests, repeats=args.repeats, speedup=args.speedup,
        concurrency=args.concurrency, trace=args.trace)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Run (or resume) the plan, then write summary.json, summary.txt and plot.png."""
    from dataclasses import asdict


    try:
        s = settings_from(args)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    steps = len(serving.plan(s))
    if args.summarize:
        results = serving.load_runs(s.out / "runs.jsonl")
    else:
        progress = make_progress(steps, True, unit="run")

        def report(line: str) -> None:
            progress.write(line)
            progress.update(1)

        try:
            with sigterm_as_exit():
                results = serving.run_all(s, resume=args.resume, progress=report)
        finally:
            progress.close()
    rows = serving.summarize(results, s)
    lines = list(serving.table(rows))
    (s.out / "summary.txt").write_text("\n".join(lines) + "\n")
    (s.out / "summary.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    serving.plot(rows, s.out / "plot.png")
    print("\n".join(lines))
    print(f"\nkvtier bench serve: {len(results)} runs; {s.out}/summary.txt, summary.json, "
          "plot.png", file=sys.stderr)
    return 0
