"""One vLLM engine process for tests/test_vllm_tiers.py.

``python tests/helpers/tier_engine.py MODEL DISK_PATH [REDIS_URL [EXTRA_JSON [ROUNDS]]]``
starts a single-process engine with kvtier and a disk tier under DISK_PATH
(``-``: no disk tier) and, with REDIS_URL (``-``: none), a Redis tier, plus the
kvtier config keys of EXTRA_JSON; it generates the test prompt ROUNDS times
(greedy, default 1; the engine's own prefix cache is reset between rounds),
waits for the cascade's writes, stops, and prints one JSON object: token ids,
num_cached_tokens (of the last round), the cascade's and its first tier's
stats, and the cascade's stats after each round. ``KVTIER_TEST_TP``: the
engine's tensor parallel size (default 1). ``KVTIER_TEST_METRICS=1``: keep
vLLM's stats and add ``metrics``, kvtier's Prometheus samples
(``name{label=value,...}`` -> value). ``KVTIER_TEST_HF_OVERRIDES``: vLLM's
``hf_overrides`` as JSON. ``KVTIER_TEST_HASH_ALGO``: vLLM's
``prefix_caching_hash_algo`` (default sha256).
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


def kvtier_samples() -> dict[str, float]:
    """kvtier's samples and vLLM's cached tokens by source, from this process's
    Prometheus registry (engine labels dropped)."""
    from prometheus_client import REGISTRY

    out = {}
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            wanted = sample.name.startswith(("vllm:kvtier_", "vllm:prompt_tokens_cached_by"))
            if wanted and not sample.name.endswith("_created"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                                  if k not in ("model_name", "engine"))
                out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def main() -> None:
    model, disk_path = sys.argv[1], sys.argv[2]
    tiers: dict[str, object] = {}
    if disk_path != "-":
        tiers.update(disk_path=disk_path, disk_bytes=64 << 20)
    if len(sys.argv) > 3 and sys.argv[3] != "-":
        tiers["redis_url"] = sys.argv[3]
    if len(sys.argv) > 4:
        tiers.update(json.loads(sys.argv[4]))
    rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    extra = E.kvtier_config(64 << 20, **tiers)
    tp = int(os.environ.get("KVTIER_TEST_TP", "1"))
    metrics = os.environ.get("KVTIER_TEST_METRICS") == "1"
    overrides = json.loads(os.environ.get("KVTIER_TEST_HF_OVERRIDES", "{}"))
    llm = E.start_engine(model, extra, E.EngineSettings(
        tensor_parallel_size=tp, log_stats=metrics, hf_overrides=overrides,
        prefix_caching_hash_algo=os.environ.get("KVTIER_TEST_HASH_ALGO", "sha256")))
    try:
        cascade = E.kvtier_cascade(llm)
        per_round = []
        for i in range(rounds):
            if i:
                llm.reset_prefix_cache()
            out = E.generate(llm, [PROMPT])[0]
            E.drain(llm)
            deadline = time.monotonic() + 30
            while not cascade.drain(1) and time.monotonic() < deadline:
                E.drain(llm, 1)
            per_round.append(cascade.stats())
        result = {
            "rounds": per_round,
            "tokens": list(out.token_ids),
            "cached": out.num_cached_tokens,
            "cascade": cascade.stats(),
            "disk": {k: v for k, v in cascade.tiers[0].stats().items()
                     if isinstance(v, int)},
        }
        if metrics:
            result["metrics"] = kvtier_samples()
    finally:
        E.stop_engine(llm)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
