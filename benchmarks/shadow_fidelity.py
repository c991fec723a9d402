"""How well the default's shadows predict its candidate configurations behind
the engine's cache: the shadows' scores beside the real caches' hit ratios.

The default (``kvtier.policies.adaptive``) follows the shadow that scores
best, so a shadow whose score ranks two configurations otherwise than the
real caches do steers it wrong. This replays TRACE behind an engine cache of
``--gpu-blocks`` blocks with the default, records every access the default
is given (keys, ``asked_from``), and feeds them to each candidate's shadow
at several sampling rates (1: a shadow as large as the cache; the default
samples ``AdaptivePolicy.rate``); then it replays the candidates it can hold
fixed at full scale (PLFU with the shadows' window rules,
``policy_variants:Shadow*``, and LRU) for their real CPU-tier hit ratios.
A shadow's score is its hits over the sampled keys the tier was asked for;
a real ratio is hit tokens over queried tokens: compare the rankings, and
the levels only roughly. (It found that requests the engine served whole
counted as asked, docs/policy.md, "Requests the engine served whole".)

    PYTHONPATH=benchmarks python benchmarks/shadow_fidelity.py TRACE
        [--capacity 1000] [--gpu-blocks 500] [--gpu-batch-tokens T]
        [--rates 0.03125,0.125,0.5,1]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Container, Sequence
from pathlib import Path
from typing import ClassVar

from kvtier.argtypes import positive_int
from kvtier.policies.adaptive import AdaptivePolicy
from kvtier.policies.key_sample import KeySample
from kvtier.policies.shadows import LRUShadow, PLFUShadow, Shadow
from kvtier.replay.behind_engine import replay_behind_engine, served_requests
from kvtier.replay.trace import load_trace

Access = tuple[list[bytes], int]

FIXED = {(8, False): "policy_variants:ShadowPlain8", (8, True): "policy_variants:ShadowAdmit8",
         "lru": "lru"}
"""Candidates replayed held fixed at full scale, by (history factor, admission)."""


class Recorder(AdaptivePolicy):
    """The default policy, recording each access it is given in ``log``
    (class-level: the replay builds the policy by name; one replay at a time).
    Memory: every access of the replay, the trace's keys once more."""

    name = "recorder"
    log: ClassVar[list[Access]] = []

    def on_demand_access(self, keys: Sequence[bytes], reused: Container[bytes],
                         asked_from: int) -> None:
        Recorder.log.append((list(keys), asked_from))
        super().on_demand_access(keys, reused, asked_from)


class Sampler(AdaptivePolicy):
    """The default's sampling of the keys its shadows see, at any ``rate``
    (the policy's own is capped at ``MAX_RATE``)."""

    name = "sampler"

    def __init__(self, rate: float) -> None:
        super().__init__(AdaptivePolicy.MIN_SHADOW)
        self._sample = KeySample(rate)


def sampled(log: list[Access], rate: float) -> list[Access]:
    """What ``AdaptivePolicy.on_demand_access`` feeds its shadows of each
    access (``sampled_access``) at ``rate``; accesses with none are left out."""
    sampler = Sampler(rate)
    out = [sampler.sampled_access(keys, asked_from) for keys, asked_from in log]
    return [access for access in out if access[0]]


def shadow_scores(log: list[Access], capacity: int, rate: float) -> dict[object, float]:
    """Each candidate shadow's hits over the sampled asked keys, the shadows
    ``round(capacity * rate)`` blocks (at least ``MIN_SHADOW``)."""
    requests = sampled(log, rate)
    asked = sum(len(keys) - a for keys, a in requests) or 1
    size = max(AdaptivePolicy.MIN_SHADOW, round(capacity * rate))
    shadows: dict[object, Shadow] = {c: PLFUShadow(size, *c) for c in AdaptivePolicy.CANDIDATES}
    shadows["lru"] = LRUShadow(size, AdaptivePolicy.START[0])
    return {c: sum(s.access_all(requests)) / asked for c, s in shadows.items()}


def label(candidate: object) -> str:
    """A column's name: ``plainF`` / ``admitF`` for (F, admission), or ``LRU``."""
    if not isinstance(candidate, tuple):
        return "LRU"
    factor, admission = candidate
    return f"{'admit' if admission else 'plain'}{factor}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path, help="Mooncake trace to replay (JSON lines)")
    ap.add_argument("--capacity", type=positive_int, default=1000,
                    help="CPU tier size in blocks (default: %(default)s)")
    ap.add_argument("--gpu-blocks", type=positive_int, default=500,
                    help="blocks of the engine's prefix cache in front of kvtier "
                    "(default: %(default)s)")
    ap.add_argument("--gpu-batch-tokens", type=positive_int, default=None,
                    help="vLLM's scheduler with this many tokens a step over a queue "
                    "that never runs dry (default: one request at a time)")
    ap.add_argument("--rates", default="0.03125,0.125,0.5,1",
                    help="shadow sampling rates, comma-separated, each in (0, 1]; 1: a "
                    "shadow as large as the cache (default: %(default)s)")
    args = ap.parse_args(argv)
    try:
        rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        ap.error(f"--rates: comma-separated numbers, got {args.rates!r}")
    if not all(0 < r <= 1 for r in rates):
        ap.error(f"--rates: each in (0, 1], got {args.rates!r}")
    try:
        served = served_requests(load_trace(args.trace))
    except (OSError, ValueError) as exc:
        ap.error(f"{args.trace}: {exc}")

    def run(policy: str) -> float:
        return replay_behind_engine(served, args.capacity, policy, gpu_blocks=args.gpu_blocks,
                                    batch_tokens=args.gpu_batch_tokens).hit_ratio

    Recorder.log = []
    try:
        default = run(f"{__name__}:Recorder")
    except ValueError as exc:  # an engine too small for a request, a policy not found
        ap.error(str(exc))
    log, Recorder.log = Recorder.log, []
    candidates = [*AdaptivePolicy.CANDIDATES, "lru"]
    print(f"{'':22s}" + "".join(f"{label(c):>9s}" for c in candidates))
    for rate in rates:
        scores = shadow_scores(log, args.capacity, rate)
        print(f"shadows at rate {rate:<7.4g}" + "".join(f"{scores[c]:9.4f}" for c in candidates))
    real = {c: run(FIXED[c]) for c in candidates if c in FIXED}
    print(f"{'real, held fixed':22s}" + "".join(
        f"{real[c]:9.4f}" if c in real else f"{'-':>9s}" for c in candidates))
    print(f"(the default itself: {default:.4f}; a shadow's score is over sampled asked "
          "keys, a real ratio over queried tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
