"""``kvtier bench serve``: the serving benchmark's command line (``kvtier.bench.serving``)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from kvtier.argtypes import positive_int
from kvtier.bench import serving
from kvtier.bench.outfiles import write_atomic
from kvtier.demo.tiny_model import DEFAULT_MODEL_DIR_TEXT
from kvtier.errors import CommandError
from kvtier.progress import make_progress
from kvtier.replay.trace import TraceFormatError
from kvtier.server_process import ServerError, sigterm_as_exit


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


def _speedup(text: str) -> float:
    """Parse a finite number > 0 (an argparse ``type``): a NaN speedup would
    compare false with everything, an infinite one pace every request at 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not _is_speedup(value):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def _is_speedup(value: float) -> bool:
    return math.isfinite(value) and value > 0


def _failure(exc: BaseException) -> str:
    """One line for a user's mistake: ``exc``'s message (an ``OSError``'s file
    and reason), its first line only."""
    if isinstance(exc, OSError) and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    else:
        text = str(exc) or type(exc).__name__
    return text.splitlines()[0].rstrip(":")


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
    # --configs, --traffic, --regimes, --cpu-blocks: None when not given
    # (settings_from: the defaults; with --summarize, those of the runs)
    p.add_argument("--configs", type=_configs, default=None,
                   metavar="C[,C...]",
                   help=f"none, vllm-lru, or POLICY[+disk] (default {','.join(serving.CONFIGS)}; "
                   "with --summarize, those of the runs)")
    p.add_argument("--traffic", type=_names(serving.TRAFFIC), default=None,
                   metavar="T[,T...]", help="bundled (the Mooncake trace) and/or generated "
                   f"(kvtier generate {serving.GENERATED_KIND}; default "
                   f"{','.join(serving.TRAFFIC)})")
    p.add_argument("--regimes", type=_names(serving.REGIMES), default=None,
                   metavar="R[,R...]", help="paced (trace timestamps) and/or saturating "
                   f"(default {','.join(serving.REGIMES)})")
    p.add_argument("--cpu-blocks", type=_sizes, default=None, metavar="N[,N...]",
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
    p.add_argument("--speedup", type=_speedup, default=25.0, metavar="X",
                   help="paced regime: arrivals X times faster than the trace (default 25)")
    p.add_argument("--concurrency", type=positive_int, default=16, metavar="N",
                   help="saturating regime: requests in flight (default 16)")
    p.add_argument("--trace", type=Path, default=None, metavar="TRACE",
                   help="Mooncake trace for 'bundled' traffic (default the bundled one)")
    p.add_argument("--record", action="store_true",
                   help=f"kvtier's servers record the requests they serve in "
                   f"OUT/{serving.TRACES_DIR}/RUN.jsonl (trace_path), to replay the "
                   "same stream in the lab with kvtier replay")
    p.add_argument("--resume", action="store_true",
                   help="keep the runs of OUT/runs.jsonl (made with the same settings); "
                   "without it they are moved aside to runs.jsonl.N")
    p.add_argument("--summarize", action="store_true",
                   help="only summarize OUT/runs.jsonl (no new runs): every run "
                        "in it, whatever --repeats says")
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
    p.add_argument("--speedup", type=_speedup, default=10.0, metavar="X",
                   help="arrivals X times faster than the trace (default 10)")
    p.set_defaults(func=cmd_bench_faults)


def cmd_bench_faults(args: argparse.Namespace) -> int:
    """The reference run, then every fault; faults.txt and faults.jsonl in OUT
    (earlier ones moved aside to faults.jsonl.N and faults.txt.N)."""
    from kvtier.bench import faults
    from kvtier.demo.tiny_model import build_tiny_llama, default_model_dir

    if not _is_speedup(args.speedup):
        raise CommandError(f"--speedup must be a finite number > 0, got {args.speedup}")
    s = faults.FaultSettings(model=build_tiny_llama(args.model_dir or default_model_dir()),
                             out=args.out, faults=args.faults, requests=args.requests,
                             speedup=args.speedup)
    _check_out(s.out)
    try:
        trace = faults.prepare(s, say=_stderr)
    except (OSError, ValueError) as exc:
        raise CommandError(_failure(exc)) from None
    try:
        with sigterm_as_exit():
            results = faults.run_faults(s, trace, say=_stderr)
    except ServerError as exc:
        raise CommandError(f"{_failure(exc)} (server logs in {s.out / 'logs'}; the runs so "
                           f"far are in {s.out / faults.RESULTS_FILE})") from None
    lines = faults.table(results)
    write_atomic(s.out / faults.TABLE_FILE, "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _check_out(out: Path) -> None:
    """``CommandError`` when ``--out`` names something that is not a directory."""
    if out.exists() and not out.is_dir():
        raise CommandError(f"--out {out}: not a directory")


SELECTIONS = {"configs": "config", "traffic": "traffic", "regimes": "regime",
              "cpu_blocks": "cpu_blocks"}
"""Options choosing which runs (``BenchSettings`` field: ``RunResult`` field)."""


def settings_from(args: argparse.Namespace, build_model: bool = True,
                  runs: list[serving.RunResult] | None = None) -> serving.BenchSettings:
    """The benchmark's settings from the command line; the tiny model built
    unless ``build_model`` is false. ``ValueError`` for a bad ``--speedup``.
    ``SELECTIONS`` not given: those of ``runs`` (in their order) when given,
    else ``BenchSettings``' defaults."""
    from kvtier.demo.tiny_model import build_tiny_llama, default_model_dir

    if not _is_speedup(args.speedup):
        raise ValueError(f"--speedup must be a finite number > 0, got {args.speedup}")
    model = args.model_dir or default_model_dir()
    if build_model:
        model = build_tiny_llama(model)
    chosen: dict[str, Any] = {}
    for name, field in SELECTIONS.items():
        value = getattr(args, name, None)
        if value is None and runs:
            value = tuple(dict.fromkeys(getattr(r, field) for r in runs))
        if value is not None:
            chosen[name] = value
    return serving.BenchSettings(
        model=model, out=args.out, gpu_blocks=args.gpu_blocks,
        requests=args.requests, repeats=args.repeats, speedup=args.speedup,
        concurrency=args.concurrency, trace=args.trace,
        record=args.record, **chosen)


def cmd_bench_serve(args: argparse.Namespace) -> int:
    """Run (or resume) the plan, then write summary.json, summary.txt and plot.png."""
    try:
        s = settings_from(args, build_model=not args.summarize)
        if args.summarize:
            results = _stored_runs(s)
            s = settings_from(args, build_model=False, runs=results)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    if not args.summarize:
        results = _run(s, args.resume)
    rows = serving.summarize(results, s)
    if not rows:
        raise CommandError(
            f"none of the {len(results)} runs of {s.out / serving.RUNS_FILE} is of the "
            "configurations, traffic, regimes and CPU-tier sizes asked for (--configs, "
            "--traffic, --regimes, --cpu-blocks)")
    _write_summary(rows, s.out)
    print(f"\nkvtier bench serve: {len(results)} runs; {s.out}/summary.txt, summary.json, "
          "plot.png", file=sys.stderr)
    return 0


def _stored_runs(s: serving.BenchSettings) -> list[serving.RunResult]:
    """``--summarize``: the runs of OUT/runs.jsonl; ``CommandError`` when there are none."""
    runs_file = s.out / serving.RUNS_FILE
    if not s.out.is_dir():
        raise CommandError(f"no runs to summarize: no directory {s.out} (--out)")
    try:
        results = serving.load_runs(runs_file)
    except (OSError, ValueError) as exc:
        raise CommandError(_failure(exc)) from None
    if not results:
        raise CommandError(f"no runs to summarize in {runs_file}")
    return results


def _run(s: serving.BenchSettings, resume: bool) -> list[serving.RunResult]:
    """Check the inputs and OUT (``serving.prepare``), then run what is left."""
    _check_out(s.out)
    try:
        prepared = serving.prepare(s, resume=resume, say=_stderr)
    except TraceFormatError as exc:
        raise CommandError(f"malformed trace: {exc}") from None
    except (OSError, ValueError) as exc:
        raise CommandError(_failure(exc)) from None
    progress = make_progress(len(serving.plan(prepared.settings)), True, unit="run")

    def report(line: str) -> None:
        progress.write(line)
        progress.update(1)

    try:
        with sigterm_as_exit():
            return serving.run_plan(prepared, progress=report)
    except ServerError as exc:
        raise CommandError(f"{_failure(exc)} (the runs so far are in "
                           f"{s.out / serving.RUNS_FILE}: --resume continues)") from None
    finally:
        progress.close()


def _nan_as_null(value: Any) -> Any:
    """``value`` with every NaN (a figure no run measured) as None: strict JSON
    has no NaN."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_as_null(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_nan_as_null(v) for v in value]
    return value


def _write_summary(rows: list[serving.Row], out: Path) -> None:
    """summary.txt, summary.json and plot.png in ``out``, each written whole;
    the table on stdout."""
    from dataclasses import asdict

    lines = list(serving.table(rows))
    write_atomic(out / "summary.txt", "\n".join(lines) + "\n")
    records = [_nan_as_null(asdict(r)) for r in rows]
    write_atomic(out / "summary.json", json.dumps(records, indent=1, allow_nan=False))
    serving.plot(rows, out / "plot.png")
    print("\n".join(lines))
