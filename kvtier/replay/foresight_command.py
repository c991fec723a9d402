"""``kvtier foresight``: the command line of ``kvtier.replay.foresight``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kvtier.argtypes import int_list, positive_int
from kvtier.errors import CommandError
from kvtier.replay.size_checks import check_sizes_fit
from kvtier.replay.trace import BUNDLED_TRACE, load_requests


def add_foresight_parser(commands: Any) -> None:
    """Register ``kvtier foresight``."""
    p = commands.add_parser(
        "foresight", help="does a block's past predict its reuse on a trace?",
        description="Rank blocks by their uses in the last W requests (past), by a map from "
        "(uses so far, age) fitted on the trace itself (fitted), and by their uses in the "
        "next W requests (future, an oracle), against LRU at each capacity. If past and "
        "fitted stay near LRU while future is far above it, no policy that reads a block's "
        "own history (the default included) gains much on this traffic.")
    p.add_argument("trace", nargs="?", type=Path, metavar="TRACE",
                   help=f"Mooncake jsonl trace (default: the bundled {BUNDLED_TRACE.name})")
    p.add_argument("--capacity", type=int_list, default=[1000, 4000], metavar="N[,N...]",
                   help="cache sizes in blocks (default 1000,4000)")
    p.add_argument("--windows", type=int_list, default=[100, 1000, 4000], metavar="W[,W...]",
                   help="window lengths in requests (default 100,1000,4000)")
    p.add_argument("--gpu-blocks", type=positive_int, default=None, metavar="N",
                   help="rank what kvtier is asked behind an engine prefix cache of N blocks")
    p.add_argument("--limit-requests", type=positive_int, default=None, metavar="M",
                   help="only the first M requests of the trace (the run takes time in "
                   "proportion to requests x capacity: about a minute at 4,000 blocks "
                   "over 4,000 requests)")
    p.add_argument("--json", action="store_true", help="one JSON list of rows")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_foresight)


def cmd_foresight(args: argparse.Namespace) -> int:
    """Run the three rankings and LRU; print the table (or JSON)."""
    from kvtier.replay.foresight import asked_streams, readings, rows, run, table
    from kvtier.replay.serving_trace import UnservableRequestError, missing_length_message

    check_sizes_fit(gpu_blocks=args.gpu_blocks)
    path = args.trace or BUNDLED_TRACE
    loaded = load_requests(path, args.limit_requests, not args.no_progress)
    try:
        requests = asked_streams(loaded, args.gpu_blocks or 0)
    except UnservableRequestError as exc:  # no prompt, or its tokens are unknown
        raise CommandError(missing_length_message("--gpu-blocks", path, exc)) from None
    except ValueError as exc:  # the engine cannot hold the longest request
        raise CommandError(f"--gpu-blocks {args.gpu_blocks}: {exc}") from None
    results = run(requests, args.capacity, args.windows, not args.no_progress)
    if args.json:
        print(json.dumps(rows(results), indent=1))
        return 0
    print(table(results))
    print("\n".join(readings(results)))
    return 0

