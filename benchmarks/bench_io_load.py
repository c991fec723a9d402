"""A real engine's pace while the cascade's I/O threads write to disk, at each
switch interval of their quick GIL hand-offs and without them (``plain``).

One engine with a disk tier answers ``--rounds`` batches of ``--batch`` fresh
prompts of ``--tokens`` tokens (``--max-tokens`` output tokens each); every
prompt's blocks are written through to disk while the engine computes, so the
I/O threads and the engine's loop share the GIL the whole time. The modes
take turns batch by batch. Printed per mode: the median seconds per batch
(what a lower interval would cost the engine's own work) and, at the end,
the blocks written.

    python benchmarks/bench_io_load.py [--rounds 6] [--batch 16] [--tokens 960]
        [--max-tokens 32] [--intervals 100,10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_disk_promotion import (
    CPU_BYTES,
    DISK_BYTES,
    Handoffs,
    handoff_modes,
    prompt,
    settle,
)
from bench_gil_handoff import intervals_us, rotated


def batch_seconds(model: Path, disk: Path, args: argparse.Namespace,
                  modes: dict[str, Handoffs]) -> tuple[dict[str, list[float]], int]:
    """Seconds per batch of each mode, and the blocks the cascade wrote."""
    from kvtier.demo import engine as E
    from kvtier.tiers import io_pool

    names = list(modes)
    out: dict[str, list[float]] = {m: [] for m in names}
    config = E.kvtier_config(CPU_BYTES, disk_path=str(disk), disk_bytes=DISK_BYTES * 8)
    per_request = (args.tokens + args.max_tokens) // 32 + 2
    settings = E.EngineSettings(max_model_len=args.tokens + args.max_tokens + 32,
                                num_gpu_blocks=per_request * args.batch)
    original = io_pool.quick_handoffs
    with E.running_engine(model, config, settings) as llm:
        E.generate(llm, [prompt(10**6, args.tokens)], max_tokens=2)  # warm up
        for r in range(args.rounds):
            mode = rotated(names, r // len(names))[r % len(names)]
            io_pool.quick_handoffs = modes[mode]  # type: ignore[assignment]
            batch = [prompt(r * args.batch + i, args.tokens) for i in range(args.batch)]
            start = time.perf_counter()
            E.generate(llm, batch, max_tokens=args.max_tokens)
            out[mode].append(time.perf_counter() - start)
            settle(llm)  # the batch's writes end before the next batch
        io_pool.quick_handoffs = original
        written = int(E.kvtier_cascade(llm).stats()["cascade_writes"])
    return out, written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="batches in all")
    ap.add_argument("--batch", type=int, default=16, help="prompts per batch")
    ap.add_argument("--tokens", type=int, default=960, help="tokens per prompt")
    ap.add_argument("--max-tokens", type=int, default=32, help="output tokens per prompt")
    ap.add_argument("--intervals", type=intervals_us, default=[100.0, 10.0],
                    metavar="US[,US...]",
                    help="switch intervals of the quick modes, microseconds")
    ap.add_argument("--plain", action="store_true", help="add a mode without quick hand-offs")
    args = ap.parse_args(argv)
    from kvtier.demo.tiny_model import build_tiny_llama

    modes = handoff_modes(args.intervals, args.plain)
    with tempfile.TemporaryDirectory() as root:
        model = build_tiny_llama(Path(root) / "tiny-llama")
        seconds, written = batch_seconds(model, Path(root) / "disk", args, modes)
    print(f"{args.rounds} batches of {args.batch} prompts of {args.tokens} tokens "
          f"(+{args.max_tokens} out), written through to disk (tiny Llama, CPU)")
    print(f"{'hand-offs':14s} {'batches':>7s} {'median s':>9s}")
    for mode, times in seconds.items():
        print(f"{mode:14s} {len(times):7d} {statistics.median(times):9.3f}")
    print(f"blocks written to disk: {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
