"""Run ``tests/helpers/tier_engine.py`` (one vLLM engine with kvtier) in a
subprocess and return its JSON result; shared by the end-to-end tier tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HELPER = str(Path(__file__).parent / "tier_engine.py")
REPO = str(Path(__file__).parent.parent.parent)


def run_engine(
    model: Path, disk: Path | None, redis_url: str | None = None,
    extra: dict[str, Any] | None = None, rounds: int = 1, tp: int = 1, metrics: bool = False,
    hf_overrides: dict[str, Any] | None = None, hash_algo: str = "sha256",
    hash_seed: str | None = None,
) -> dict[str, Any]:
    """One engine run on ``model`` with a disk tier at ``disk`` and/or Redis at
    ``redis_url`` plus the kvtier keys of ``extra`` (see tier_engine.py);
    ``hash_algo``: vLLM's ``prefix_caching_hash_algo``, ``hash_seed``: the
    engine's ``PYTHONHASHSEED`` (None: unset). The result's ``log``: the
    last 20,000 characters of the engine's stdout (vLLM's log, which kvtier's
    records join) and of its stderr."""
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", "KVTIER_TEST_TP": str(tp),
           "KVTIER_TEST_METRICS": "1" if metrics else "0",
           "KVTIER_TEST_HF_OVERRIDES": json.dumps(hf_overrides or {}),
           "KVTIER_TEST_HASH_ALGO": hash_algo,
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("PYTHONHASHSEED", None)
    if hash_seed is not None:
        env["PYTHONHASHSEED"] = hash_seed
    args = [sys.executable, HELPER, str(model), "-" if disk is None else str(disk),
            redis_url or "-", json.dumps(extra or {}), str(rounds)]
    out = subprocess.run(args, capture_output=True,
                         text=True, timeout=300, cwd=REPO, env=env, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    result["log"] = out.stdout[-20_000:] + out.stderr[-20_000:]
    return result
