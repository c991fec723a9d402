"""The servers the harness starts (``ServerProcess``: benchmarks, drills, the
tiered demo) keep an idle connection open past vLLM's own 5 s keep-alive:
``vllm bench serve`` reuses a connection idle for up to 60 s, and one that
the server closed meanwhile failed its request ("Server disconnected";
``kvtier.server_process.KEEP_ALIVE_S``). Real server, real socket."""

from __future__ import annotations

import http.client
import importlib.util
import time
from pathlib import Path

import pytest

from kvtier.bench import serving
from kvtier.demo.tiny_model import build_tiny_llama
from kvtier.launch import vllm_command
from kvtier.server_process import ServerProcess
from kvtier.tiers.redis_server import free_port

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm(-cpu)"),
]

VLLM_KEEP_ALIVE_S = 5
"""vLLM's default ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``."""


def test_a_connection_idle_past_vllms_keep_alive_still_serves(tmp_path: Path) -> None:
    model = build_tiny_llama(tmp_path / "model")
    port = free_port()
    argv = vllm_command(["serve", str(model), *serving.engine_flags(64, port, max_model_len=512)])
    with ServerProcess(argv, port, tmp_path / "server.log"):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        try:
            for _ in range(2):  # the second request reuses the idle connection
                conn.request("GET", "/health")
                response = conn.getresponse()
                response.read()
                assert response.status == 200
                time.sleep(VLLM_KEEP_ALIVE_S + 2)
        finally:
            conn.close()
