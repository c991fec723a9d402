"""A real engine's prompt served from the disk tier: how long the request
takes, with the I/O threads' quick GIL hand-offs (``quick_handoffs``, at each
``--intervals`` switch interval; by default the I/O threads') and without
them (``plain``), side by side in one engine.

A first engine writes ``--prompts`` prompts of ``--tokens`` tokens to a disk
tier and stops. A second engine on the same directory (its GPU cache and
CPU tier empty) then answers each prompt once (one output token), the
modes taking turns; each prompt is asked once, so each one's blocks come up
from disk. Printed per mode: the median seconds per request, how many of
its prompt tokens came from kvtier (blocks not promoted within
``promotion_timeout_s`` are computed instead) and the promotion timeouts.
vLLM steps in a Python loop while a request waits for its blocks, as its
engine core does, so the I/O threads share the GIL with a busy thread.

    python benchmarks/bench_disk_promotion.py [--prompts 8] [--tokens 960]
        [--intervals 100,30,10]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

from bench_gil_handoff import intervals_us, quick_label, rotated

from kvtier.tiers.gil_handoff import IO_SWITCH_INTERVAL_S

if TYPE_CHECKING:
    from vllm import LLM

    from kvtier.demo.engine import EngineSettings

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

CPU_BYTES = 64 << 20
DISK_BYTES = 256 << 20


@contextlib.contextmanager
def plain_handoffs() -> Iterator[None]:
    """What the I/O threads ran their jobs in before ``quick_handoffs``."""
    yield


def prompt(i: int, tokens: int) -> list[int]:
    """Prompt ``i``: distinct from every other from its first block on."""
    return [(i * 7919 + j * 31) % 500 + 3 for j in range(tokens)]


def settle(llm: LLM) -> None:
    """Let the engine's stores and the cascade's writes finish."""
    from kvtier.demo import engine as E

    E.drain(llm)
    cascade = E.kvtier_cascade(llm)
    deadline = time.monotonic() + 60
    while not cascade.drain(1) and time.monotonic() < deadline:
        E.drain(llm, 1)


def fill_disk(model: Path, disk: Path, prompts: list[list[int]]) -> None:
    """Write every prompt's blocks to the disk tier at ``disk`` (first engine)."""
    from kvtier.demo import engine as E

    config = E.kvtier_config(CPU_BYTES, disk_path=str(disk), disk_bytes=DISK_BYTES)
    with E.running_engine(model, config, settings(prompts)) as llm:
        E.generate(llm, prompts, max_tokens=1)
        settle(llm)


def settings(prompts: list[list[int]]) -> EngineSettings:
    """An engine whose GPU cache holds the longest prompt."""
    from kvtier.demo import engine as E

    longest = max(map(len, prompts)) + 32
    return E.EngineSettings(max_model_len=longest, num_gpu_blocks=longest // 32 + 8)


Handoffs = Callable[[], AbstractContextManager[None]]
"""What the I/O threads run each job in (``kvtier.tiers.io_pool.quick_handoffs``)."""


def handoff_modes(intervals: list[float], plain: bool) -> dict[str, Handoffs]:
    """The modes to compare, by name: quick hand-offs at each interval
    (microseconds), and with ``plain`` none."""
    from kvtier.tiers.gil_handoff import quick_handoffs

    modes: dict[str, Handoffs] = {
        quick_label(us): functools.partial(quick_handoffs, us * 1e-6) for us in intervals}
    if plain:
        modes["plain"] = plain_handoffs
    return modes


def serve_from_disk(model: Path, disk: Path, prompts: list[list[int]],
                    wrappers: dict[str, Handoffs]) -> dict[str, list[tuple[float, int, int]]]:
    """Per mode: (seconds, tokens from kvtier, promotion timeouts) per request."""
    from kvtier.demo import engine as E
    from kvtier.tiers import io_pool

    original = io_pool.quick_handoffs
    modes = list(wrappers)
    out: dict[str, list[tuple[float, int, int]]] = {m: [] for m in modes}
    config = E.kvtier_config(CPU_BYTES, disk_path=str(disk), disk_bytes=DISK_BYTES)
    with E.running_engine(model, config, settings(prompts)) as llm:
        cascade = E.kvtier_cascade(llm)
        for i, p in enumerate(prompts):
            mode = rotated(modes, i // len(modes))[i % len(modes)]
            io_pool.quick_handoffs = wrappers[mode]  # type: ignore[assignment]
            before = cascade.stats()["promotion_timeouts"]
            start = time.perf_counter()
            gen = E.generate(llm, [p], max_tokens=1)[0]
            took = time.perf_counter() - start
            settle(llm)  # late promotions land before the next request
            out[mode].append((took, gen.num_cached_tokens,
                              cascade.stats()["promotion_timeouts"] - before))
        io_pool.quick_handoffs = original
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8,
                    help="prompts in all (a multiple of the modes: as many per mode)")
    ap.add_argument("--tokens", type=int, default=960, help="tokens per prompt")
    ap.add_argument("--intervals", type=intervals_us, default=[IO_SWITCH_INTERVAL_S * 1e6],
                    metavar="US[,US...]",
                    help="switch intervals of the quick modes, microseconds (default: "
                    "the I/O threads')")
    args = ap.parse_args(argv)
    from kvtier.demo.tiny_model import build_tiny_llama

    prompts = [prompt(i, args.tokens) for i in range(args.prompts)]
    with tempfile.TemporaryDirectory() as root:
        model = build_tiny_llama(Path(root) / "tiny-llama")
        disk = Path(root) / "disk"
        fill_disk(model, disk, prompts)
        results = serve_from_disk(model, disk, prompts, handoff_modes(args.intervals, True))
    print(f"{args.prompts} prompts of {args.tokens} tokens, each served once from the disk "
          "tier by a second engine (tiny Llama, CPU)")
    print(f"{'hand-offs':14s} {'requests':>8s} {'median s':>9s} {'from kvtier':>12s} "
          f"{'timeouts':>9s}")
    for mode, rows in results.items():
        seconds = statistics.median(r[0] for r in rows)
        cached = sum(r[1] for r in rows)
        print(f"{mode:14s} {len(rows):8d} {seconds:9.3f} {cached:7d}/{len(rows) * args.tokens:<5d}"
              f"{sum(r[2] for r in rows):8d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
