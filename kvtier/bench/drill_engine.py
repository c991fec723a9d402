"""The engine side of the crash drills: ``kvtier serve`` servers, the HTTP load
that keeps them writing, their answers, and killing them as a crash would.

A server runs in its own session (:class:`~kvtier.server_process.ServerProcess`);
:func:`kill_session` SIGKILLs every process of that session at once (API
server, engine core, workers, kvtier's slot-region reapers) and waits until
each pid is gone, so the dead engine's temp files and slot regions are stale
for whoever looks next. Servers use ``--dtype float32``: greedy answers then do
not depend on which prompt tokens came from a cache (see
:mod:`kvtier.demo.tiered`), so an answer that differs from a server without
kvtier means a wrong KV block was served.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtier import prom
from kvtier.demo.tiny_model import NUM_SPECIAL, VOCAB_SIZE, token_prompt
from kvtier.replay.serving_trace import ENGINE_BLOCK_TOKENS
from kvtier.server_process import ServerProcess, session_pids
from kvtier.slots.region import PREFIX, SUFFIX, RegionHeader, default_shm_dir
from kvtier.tiers.redis_server import free_port

BLOCK_TOKENS = ENGINE_BLOCK_TOKENS  # the engines' --block-size
GPU_BLOCKS = 96
ENGINE_FLAGS = ["--block-size", str(BLOCK_TOKENS), "--max-model-len", "1024",
                "--num-gpu-blocks-override", str(GPU_BLOCKS),
                "--kv-cache-memory-bytes", str(64 << 20), "--gpu-memory-utilization", "0.5",
                "--enforce-eager", "--dtype", "float32", "--max-num-seqs", "4"]
"""vLLM's CPU build needs these (block size a multiple of 32, an explicit KV size);
a small GPU cache (96 blocks) so that a few requests push a prompt out of it."""
REQUEST_TIMEOUT_S = 60.0
CACHED = "vllm:prompt_tokens_cached_by_source_total"
KILL_WAIT_S = 30.0


class RequestFailed(RuntimeError):
    """A completion request that did not return 200 within its timeout."""


def serve_argv(model: Path, port: int, *, cpu_bytes: int, disk: Path | None = None,
               disk_bytes: int | None = None, redis_url: str | None = None) -> list[str]:
    """``kvtier serve`` on ``model`` with the given tiers and :data:`ENGINE_FLAGS`."""
    argv = [sys.executable, "-m", "kvtier", "serve", str(model), "--cpu-bytes",
            str(cpu_bytes), "--port", str(port)]
    if disk is not None:
        argv += ["--disk-path", str(disk), "--disk-bytes", str(disk_bytes or 256 << 20)]
    if redis_url is not None:
        argv += ["--redis-url", redis_url]
    return [*argv, *ENGINE_FLAGS]


def plain_argv(model: Path, port: int) -> list[str]:
    """vLLM's server without kvtier, same engine flags (reference answers)."""
    return [sys.executable, "-m", "kvtier.launch", "serve", str(model), "--port", str(port),
            *ENGINE_FLAGS]


def start_server(argv_of: Callable[[int], list[str]], log: Path,
                 env: Mapping[str, str] | None = None) -> ServerProcess:
    """Start ``argv_of(port)`` on a free port; waits until it serves."""
    port = free_port()
    server_env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING", **(env or {})}
    return ServerProcess(argv_of(port), port, log, env=server_env).start()


def complete(url: str, model: Path, prompt: Sequence[int], max_tokens: int,
             timeout_s: float = REQUEST_TIMEOUT_S, client: Any = None) -> str:
    """Greedy completion of ``prompt``; :class:`RequestFailed` on any failure."""
    import openai

    client = client or openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                                     timeout=timeout_s)
    try:
        out = client.completions.create(model=str(model), prompt=list(prompt),
                                        max_tokens=max_tokens, temperature=0.0)
    except openai.APIStatusError as exc:
        raise RequestFailed(f"HTTP {exc.status_code}") from None
    except openai.APITimeoutError:
        raise RequestFailed(f"no answer within {timeout_s:.0f} s") from None
    except openai.APIConnectionError as exc:
        raise RequestFailed(f"connection: {exc}") from None
    return str(out.choices[0].text)


def ask_all(url: str, model: Path, prompts: Sequence[Sequence[int]], max_tokens: int
            ) -> list[str]:
    """Answers to ``prompts``, one request at a time."""
    return [complete(url, model, p, max_tokens) for p in prompts]


def cached_tokens(url: str, source: str) -> float:
    """``vllm:prompt_tokens_cached_by_source`` of ``source`` (``disk``, ``host``,
    ``external_unspecified``: Redis) so far."""
    return prom.value(prom.scrape(url), CACHED, source=source)


def settled_value(read: Callable[[], float], above: float | None = None,
                  timeout_s: float = 10.0, poll_s: float = 0.5) -> float:
    """``read()`` once it exceeded ``above`` (when given) and stopped changing:
    vLLM's stats come a step or two late. After ``timeout_s``, the last value."""
    deadline = time.monotonic() + timeout_s
    last = read()
    while above is not None and last <= above and time.monotonic() < deadline:
        time.sleep(poll_s)
        last = read()
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        now = read()
        if now == last:
            break
        last = now
    return float(last)


def tier_metric(url: str, name: str, tier: str) -> float:
    """kvtier's per-tier sample ``vllm:kvtier_tier_<name>`` for ``tier``."""
    suffix = "" if name == "available" else "_total"
    return prom.value(prom.scrape(url), f"vllm:kvtier_tier_{name}{suffix}", tier=tier)


def wait_metric(url: str, name: str, tier: str, want: float, timeout_s: float) -> bool:
    """Whether ``tier_metric`` reached ``want`` within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError):
            if tier_metric(url, name, tier) == want:
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)


# ---------------------------------------------------------------- crashing
def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def kill_session(server: ServerProcess) -> list[int]:
    """SIGKILL every process of ``server``'s session, as a crash of the host's
    engine would; returns their pids once every one is gone (reaped, not a
    zombie). ``server.stop()`` does nothing afterwards."""
    proc = server.proc
    if proc is None:
        return []
    session = proc.pid
    killed: set[int] = set()
    deadline = time.monotonic() + KILL_WAIT_S
    while (alive := session_pids(session)) and time.monotonic() < deadline:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(session, signal.SIGKILL)
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed.update(alive)
        time.sleep(0.05)
    proc.wait()
    server.returncode = proc.returncode
    server.proc = None
    while not all(_gone(p) for p in killed) and time.monotonic() < deadline:
        time.sleep(0.05)  # killed children are reaped by init
    return sorted(killed)


def session_regions(pids: Sequence[int]) -> list[Path]:
    """kvtier slot regions in /dev/shm created by one of ``pids``."""
    wanted = set(pids)
    out = []
    for path in default_shm_dir().glob(f"{PREFIX}*{SUFFIX}"):
        with contextlib.suppress(OSError, ValueError):
            if RegionHeader.read(path).creator_pid in wanted:
                out.append(path)
    return sorted(out)


def session_shm_files(pids: Sequence[int]) -> list[Path]:
    """Files in /dev/shm that one of ``pids`` maps (vLLM's message-queue ring
    buffers ``psm_*``, semaphores, kvtier's slot regions)."""
    shm = str(default_shm_dir()) + "/"
    found: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)  # address perms offset dev inode [path]
                path = fields[5].strip() if len(fields) == 6 else ""
                if path.startswith(shm) and not path.endswith(" (deleted)"):
                    found.add(path)
    return sorted(Path(p) for p in found)


def _mapped_anywhere(path: Path) -> bool:
    needle = str(path)
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if needle in Path(entry.path, "maps").read_text():
                    return True
    return False


def remove_orphan_shm(paths: Sequence[Path]) -> tuple[int, int]:
    """Remove the files of ``paths`` that are not kvtier's, still exist and no
    process maps: what a SIGKILLed vLLM engine leaves in /dev/shm (its
    ``psm_*`` ring buffers, which nobody else removes). ``(files, bytes)``."""
    files = size = 0
    for path in paths:
        if path.name.startswith(PREFIX) or not path.exists() or _mapped_anywhere(path):
            continue
        with contextlib.suppress(OSError):
            n = path.stat().st_size
            path.unlink()
            files, size = files + 1, size + n
    return files, size


# ---------------------------------------------------------------- load
def distinct_prompt(rng: random.Random, low: int, high: int) -> list[int]:
    """A random prompt of ``low..high`` tokens (no two share a first block)."""
    return [rng.randrange(NUM_SPECIAL, VOCAB_SIZE) for _ in range(rng.randint(low, high))]


def fixed_prompts(n: int = 4, tokens: int = 300) -> list[list[int]]:
    """The drills' fixed prompts: asked again and again, answers compared."""
    return [token_prompt(tokens, start=11 + 97 * i) for i in range(n)]


def pool_prompts(n: int, seed: int, low: int = 256, high: int = 400) -> list[list[int]]:
    """``n`` prompts the Redis drill's load draws from (answers compared too)."""
    rng = random.Random(f"pool-{seed}")
    return [distinct_prompt(rng, low, high) for _ in range(n)]


MAX_LOAD_ERRORS = 5
"""Failures a :class:`LoadStats` describes (the first ones); the rest are counted."""


@dataclass
class LoadStats:
    """What a :class:`Load` saw; ``wrong``: answers that differ from the reference."""

    requests: int = 0
    ok: int = 0
    failed: int = 0
    wrong: int = 0
    errors: list[str] = field(default_factory=list)
    """The first :data:`MAX_LOAD_ERRORS` failures, described."""

    def add(self, failure: str | None, wrong: bool) -> None:
        """Count one request's outcome."""
        self.requests += 1
        self.ok += failure is None
        self.failed += failure is not None
        self.wrong += wrong
        if failure is not None and len(self.errors) < MAX_LOAD_ERRORS:
            self.errors.append(failure)

    def copy(self) -> LoadStats:
        """A snapshot (the ``errors`` list copied too)."""
        return replace(self, errors=list(self.errors))


class Load:
    """Threads asking a server continuously: distinct random prompts (each one
    new blocks: writes), or with ``pool`` a prompt of it whose answer is checked
    against ``pool_answers`` (a share ``distinct_share`` stays distinct).

    Memory: the outcomes are counted as they come (:class:`LoadStats`), and at
    most :data:`MAX_LOAD_ERRORS` failures are described, however long the load
    runs; ``stats()`` at a moment (a kill) gives the counts up to it."""

    def __init__(self, url: str, model: Path, *, seed: int, threads: int = 2,
                 pool: Sequence[Sequence[int]] = (), pool_answers: Sequence[str] = (),
                 distinct_share: float = 1.0, distinct_tokens: tuple[int, int] = (256, 768),
                 max_tokens: int = 2, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.url, self.model, self.seed = url, model, seed
        self.pool, self.pool_answers = list(pool), list(pool_answers)
        self.distinct_share = distinct_share if self.pool else 1.0
        self.distinct_tokens = distinct_tokens
        self.max_tokens, self.timeout_s = max_tokens, timeout_s
        self._stop = threading.Event()
        self._running = threading.Event()
        self._running.set()
        self._inflight = 0
        self._lock = threading.Lock()
        self._counts = LoadStats()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True,
                                          name=f"drill-load-{i}") for i in range(threads)]

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def _run(self, index: int) -> None:
        import openai

        rng = random.Random(f"{self.seed}-{index}")
        client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                               timeout=self.timeout_s)
        while not self._stop.is_set():
            if not self._running.wait(0.1):
                continue
            with self._lock:  # checked under the lock: pause() then waits for this one
                if not self._running.is_set():
                    continue
                self._inflight += 1
            try:
                self._one(rng, client)
            finally:
                with self._lock:
                    self._inflight -= 1

    def _one(self, rng: random.Random, client: Any) -> None:
        """One request and its outcome."""
        expected = None
        prompt: Sequence[int]
        if rng.random() < self.distinct_share:
            prompt = distinct_prompt(rng, *self.distinct_tokens)
        else:
            i = rng.randrange(len(self.pool))
            prompt, expected = self.pool[i], self.pool_answers[i]
        failure, wrong = None, False
        try:
            answer = complete(self.url, self.model, prompt, self.max_tokens,
                              self.timeout_s, client)
            wrong = expected is not None and answer != expected
        except RequestFailed as exc:
            failure = str(exc)
        with self._lock:
            self._counts.add(failure, wrong)

    def pause(self, timeout_s: float | None = None) -> None:
        """Stop sending; returns once no request is in flight."""
        with self._lock:
            self._running.clear()
        deadline = time.monotonic() + (timeout_s or self.timeout_s + 5)
        while time.monotonic() < deadline:
            with self._lock:
                if self._inflight == 0:
                    return
            time.sleep(0.05)

    def resume(self) -> None:
        self._running.set()

    @property
    def completed(self) -> int:
        """Requests answered so far."""
        with self._lock:
            return self._counts.ok

    def wait_completed(self, more: int, timeout_s: float = 120.0) -> bool:
        """Wait until ``more`` further requests were answered."""
        target = self.completed + more
        deadline = time.monotonic() + timeout_s
        while self.completed < target:
            if time.monotonic() > deadline or not any(t.is_alive() for t in self._threads):
                return False
            time.sleep(0.1)
        return True

    def stop(self) -> None:
        """Let each thread finish its request and end."""
        self._stop.set()
        self._running.set()
        for t in self._threads:
            t.join(self.timeout_s + 5)

    def stats(self) -> LoadStats:
        """The counts of the requests that ended so far."""
        with self._lock:
            return self._counts.copy()
