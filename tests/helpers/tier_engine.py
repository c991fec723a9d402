"""One vLLM engine process for tests/test_vllm_tiers.py.

``python tests/helpers/tier_engine.py MODEL DISK_PATH [REDIS_URL]`` starts a
single-process engine with kvtier and a disk tier under DISK_PATH (``-``: no
disk tier) and, with REDIS_URL, a Redis tier; it generates the test prompt
once (greedy), waits for the cascade's writes, stops, and prints one JSON
object: token ids, num_cached_tokens, the cascade's and its first tier's stats.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

from kvtier.demo import engine as E
from kvtier.demo.tiny_model import token_prompt

PROMPT = token_prompt(200)


def main() -> None:
    model, disk_path = sys.argv[1], sys.argv[2]
    tiers: dict[str, object] = {}
    if disk_path != "-":
        tiers.update(disk_path=disk_path, disk_bytes=64 << 20)
    if len(sys.argv) > 3:
        tiers["redis_url"] = sys.argv[3]
    extra = E.kvtier_config(64 << 20, **tiers)
    llm = E.start_engine(model, extra)
    try:
        core = llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined]
        adapter = core.scheduler.connector.connector_scheduler.manager
        cascade = adapter.cascade
        out = E.generate(llm, [PROMPT])[0]
        E.drain(llm)
        deadline = time.monotonic() + 30
        while not cascade.drain(1) and time.monotonic() < deadline:
            E.drain(llm, 1)
        result = {
            "tokens": list(out.token_ids),
            "cached": out.num_cached_tokens,
            "cascade": cascade.stats(),
            "disk": {k: v for k, v in cascade.tiers[0].stats().items()
                     if isinstance(v, int)},
        }
    finally:
        E.stop_engine(llm)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
