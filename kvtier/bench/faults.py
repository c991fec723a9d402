"""``kvtier bench faults``: tier faults injected while a real server is under load.

Each run starts a fresh ``kvtier serve`` on the tiny model (float32, so that
greedy answers do not depend on which tokens were cached) with a disk tier and
a Redis tier (a local ``redis-server``), drives it with vLLM's own client over
the scaled bundled trace (``kvtier.replay.serving_trace``, paced ``speedup`` times
faster than the trace), injects one fault ``fault_at_s`` after the first
request of the load reached the server, lifts it ``fault_for_s`` later, and
lets the load finish:

* ``none``: no fault (the reference run);
* ``redis-kill``: ``redis-server`` SIGKILLed, restarted empty on the same port;
* ``redis-stop``: ``redis-server`` stopped (SIGSTOP) for ``fault_for_s``;
* ``disk-removed``: the disk tier's directory deleted;
* ``disk-full``: the disk tier's file system filled (a ballast file on a small
  tmpfs; needs root to mount it, else the fault is reported as skipped);
* ``disk-slow``: every disk read and write waits ``slow_s`` (``SlowDiskSpec``).

Reported per fault: requests completed and failed, p99 and max TTFT against the
reference run's p99, the bound a request may lose to a fault (the documented
timeouts: ``PROBE_TIMEOUT_S`` + ``promotion_timeout_s``), prompt tokens served
by kvtier (lost against the reference), the errors the tiers counted, and
whether a fixed probe prompt's greedy answer stayed the same.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier import prom
from kvtier.atomic_files import atomic_path
from kvtier.bench.outfiles import move_aside
from kvtier.bench.serving import (
    BLOCK_TOKENS,
    SERVER_ENV,
    block_bytes,
    engine_flags,
    kvtier_serve_argv,
)
from kvtier.launch import vllm_command
from kvtier.server_process import ServerError, ServerProcess
from kvtier.tiers.cascade import DEFAULT_PROMOTION_TIMEOUT_S
from kvtier.tiers.probes import DEFAULT_PROBE_TIMEOUT_S

CONTROL_ENV = "KVTIER_FAULT_CONTROL"
"""Names the file holding the slow disk's delay (``kvtier.bench.fault_spec``)."""
FAULTS = ("none", "redis-kill", "redis-stop", "disk-removed", "disk-full", "disk-slow")
TIMEOUT_BOUND_S = DEFAULT_PROBE_TIMEOUT_S + DEFAULT_PROMOTION_TIMEOUT_S
"""The most a tier fault may add to one request's TTFT: a Redis existence check
unanswered for ``probe_timeout_s`` turns into "not there", and a promotion
unfinished after ``promotion_timeout_s`` into a miss (the block is computed)."""
PROBE_PROMPT_TOKENS = 300
RESULTS_FILE = "faults.jsonl"
"""In ``out``: one line per run; an earlier one is moved aside (``faults.jsonl.N``)."""
TABLE_FILE = "faults.txt"
"""In ``out``: the table, once every run is done; an earlier one is moved aside
with the results it shows (``faults.txt.N``)."""
TMPFS_BYTES = 96 << 20
LOAD_WAIT_S = 300.0
"""The longest wait for the client's first request to reach the server."""


class FaultSkipped(RuntimeError):
    """The fault cannot be injected here (e.g. mounting a tmpfs needs root)."""


@dataclass(frozen=True)
class FaultSettings:
    """What ``kvtier bench faults`` runs (its flags)."""

    model: Path
    out: Path
    faults: tuple[str, ...] = FAULTS
    requests: int = 800
    speedup: float = 10.0
    cpu_blocks: int = 1000
    gpu_blocks: int = 500
    disk_blocks: int = 4000
    fault_at_s: float = 5.0
    fault_for_s: float = 5.0
    slow_s: float = 0.5
    seed: int = 0


@dataclass
class FaultResult:
    """One run under one fault."""

    fault: str
    completed: int = 0
    failed: int = 0
    ttft_p99_ms: float = 0.0
    ttft_max_ms: float = 0.0
    kvtier_tokens: float = 0.0
    tier_errors: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    disk_io_ms: float = 0.0
    """Milliseconds the I/O threads spent in disk reads and writes
    (``vllm:kvtier_tier_read_ms`` + ``_write_ms``)."""
    probe_answer: str = ""
    probe_same: bool = True
    skipped: str = ""


# -- the environment of one run ------------------------------------------------------


@dataclass
class Stage:
    """What a fault acts on: the Redis server, the disk directory, the control file."""

    redis: Any
    disk: Path
    control: Path
    mount: Path | None = None
    ballast: Path | None = None


@contextlib.contextmanager
def stage(s: FaultSettings, fault: str, work: Path) -> Iterator[Stage]:
    """A fresh Redis server and disk directory (on a small tmpfs for ``disk-full``)."""
    from kvtier.tiers.redis_server import RedisServer

    with RedisServer(config={"maxmemory": "1gb", "maxmemory-policy": "allkeys-lru"}) as redis, \
            tempfile.TemporaryDirectory(prefix="kvtier-fault-", dir=work) as tmp:
        root = Path(tmp)
        st = Stage(redis=redis, disk=root / "disk", control=root / "slow")
        if fault == "disk-full":
            st.mount = root / "tmpfs"
            st.mount.mkdir()
            _mount_tmpfs(st.mount)
            st.disk = st.mount / "disk"
        try:
            yield st
        finally:
            if st.mount is not None:
                subprocess.run(["umount", "-l", str(st.mount)], check=False,
                               capture_output=True)


def _mount_tmpfs(path: Path) -> None:
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=0700",
                           "tmpfs", str(path)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise FaultSkipped(f"cannot mount a tmpfs ({done.stderr.strip() or 'needs root'})")


def start_fault(fault: str, st: Stage, s: FaultSettings) -> None:
    """Inject ``fault``."""
    if fault == "redis-kill":
        st.redis.stop(kill=True)
    elif fault == "redis-stop":
        st.redis.pause()
    elif fault == "disk-removed":
        shutil.rmtree(st.disk, ignore_errors=True)
    elif fault == "disk-full":
        st.ballast = (st.mount or st.disk) / "ballast"
        _fill(st.ballast)
    elif fault == "disk-slow":
        st.control.write_text(str(s.slow_s))
    elif fault != "none":
        raise ValueError(f"unknown fault {fault!r} (choose from {', '.join(FAULTS)})")


def stop_fault(fault: str, st: Stage) -> None:
    """Lift ``fault`` (a removed directory stays removed: the tier re-creates it)."""
    if fault == "redis-kill":
        st.redis.start()
    elif fault == "redis-stop":
        st.redis.resume()
    elif fault == "disk-full" and st.ballast is not None:
        st.ballast.unlink(missing_ok=True)
    elif fault == "disk-slow":
        st.control.write_text("")


def _fill(path: Path) -> None:
    """Write zeros to ``path`` until its file system is full."""
    chunk = b"\0" * (1 << 20)
    with open(path, "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError:
            pass


# -- one run -------------------------------------------------------------------------


def server_argv(s: FaultSettings, st: Stage, port: int) -> list[str]:
    bb = block_bytes(dtype_bytes=4)
    flags = ["--policy", "default", "--disk-path", str(st.disk),
             "--disk-bytes", str(s.disk_blocks * bb), "--redis-url", st.redis.url,
             "--kvtier", "spec_name=SlowDiskSpec",
             "--kvtier", "spec_module_path=kvtier.bench.fault_spec"]
    return kvtier_serve_argv(s.model, s.cpu_blocks * bb, flags,
                             engine_flags(s.gpu_blocks, port, s.seed, dtype="float32"))


def client_argv(s: FaultSettings, trace: Path, url: str, result: Path) -> list[str]:
    return vllm_command([
        "bench", "serve", "--backend", "vllm", "--base-url", url,
        "--endpoint", "/v1/completions", "--model", str(s.model), "--tokenizer", str(s.model),
        "--dataset-name", "timed_trace", "--dataset-path", str(trace),
        "--num-prompts", str(s.requests), "--timed-trace-chunk-hash-size", str(BLOCK_TOKENS),
        "--timed-trace-sec-multiplier", f"{0.001 / s.speedup:.10f}",
        "--percentile-metrics", "ttft", "--metric-percentiles", "99",
        "--save-result", "--save-detailed", "--result-dir", str(result.parent),
        "--result-filename", result.name, "--disable-tqdm", "--seed", str(s.seed)])


def probe(url: str, model: Path) -> str:
    """The greedy answer to a fixed prompt no trace request shares."""
    import openai

    from kvtier.demo.tiny_model import token_prompt

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0,
                           timeout=60)
    out = client.completions.create(model=str(model), prompt=token_prompt(
        PROBE_PROMPT_TOKENS, start=401), max_tokens=16, temperature=0.0)
    return str(out.choices[0].text)


def run_fault(s: FaultSettings, fault: str, trace: Path, work: Path) -> FaultResult:
    """One server, one load, one fault; see the module doc."""
    from kvtier.tiers.redis_server import free_port

    try:
        with stage(s, fault, work) as st:
            port = free_port()
            env = {**os.environ, **SERVER_ENV, CONTROL_ENV: str(st.control)}
            server = ServerProcess(server_argv(s, st, port), port,
                                   work / "logs" / f"{fault}.server.log", env=env)
            with server:
                return _load_with_fault(s, fault, st, server, trace, work)
    except FaultSkipped as exc:
        return FaultResult(fault=fault, skipped=str(exc))


def _load_with_fault(s: FaultSettings, fault: str, st: Stage, server: ServerProcess,
                     trace: Path, work: Path) -> FaultResult:
    before = probe(server.url, s.model)
    result_file = work / "results" / f"{fault}.json"
    result_file.unlink(missing_ok=True)  # an earlier command's: never this run's figures
    client_log = work / "logs" / f"{fault}.client.log"
    with open(client_log, "wb") as log:
        client = subprocess.Popen(client_argv(s, trace, server.url, result_file),
                                  stdout=log, stderr=subprocess.STDOUT,
                                  env={**os.environ, "PYTHONHASHSEED": "0"})
        try:
            _wait_for_load(server.url, client, fault=fault, client_log=client_log)
            time.sleep(s.fault_at_s)
            start_fault(fault, st, s)
            time.sleep(s.fault_for_s)
            stop_fault(fault, st)
            client.wait(timeout=1800)
        finally:
            if client.poll() is None:
                client.send_signal(signal.SIGKILL)
                client.wait()
    if client.returncode != 0 or not result_file.is_file():
        raise ServerError(f"the {fault} run's client (vllm bench serve) exited with status "
                          f"{client.returncode} without its results; see {client_log}")
    samples = prom.scrape(server.url)  # before the probe: the figures are the load's
    after = probe(server.url, s.model)
    detail = json.loads(result_file.read_text())
    return _result(fault, detail, samples, after, before)


def _wait_for_load(url: str, client: subprocess.Popen[bytes], timeout_s: float = LOAD_WAIT_S,
                   *, fault: str = "", client_log: Path | None = None) -> None:
    """Return once the client's first trace request reached the server (the
    client takes a while to start: the fault must hit the load, not the lull),
    or the client exited (its exit status is checked after the run).
    ``ServerError`` when no request came within ``timeout_s``: a fault injected
    then would hit no load, and the run would measure nothing."""
    seen = prom.value(prom.scrape(url), "vllm:request_success_total")
    deadline = time.monotonic() + timeout_s
    while client.poll() is None:
        samples = prom.scrape(url)
        if (prom.value(samples, "vllm:num_requests_running") > 0
                or prom.value(samples, "vllm:request_success_total") > seen):
            return
        if time.monotonic() >= deadline:
            run = f"the {fault} run's" if fault else "the"
            where = f"; see {client_log}" if client_log is not None else ""
            raise ServerError(f"no request of {run} load (vllm bench serve) reached the "
                              f"server within {timeout_s:.0f} s: the fault was not "
                              f"injected{where}")
        time.sleep(0.2)


def _result(fault: str, client: dict[str, Any], samples: prom.Samples, answer: str,
            before: str) -> FaultResult:
    ttfts = [t for t in client.get("ttfts", []) if t]
    cached = prom.by_label(samples, "vllm:prompt_tokens_cached_by_source_total", "source")
    counters = {name: prom.value(samples, f"vllm:kvtier_{name}_total") for name in (
        "promotions", "promotion_failures", "promotion_timeouts", "dropped_writes",
        "write_failures", "cascade_writes")}
    return FaultResult(
        fault=fault, completed=int(client.get("completed", 0)),
        failed=int(client.get("failed", 0)),
        ttft_p99_ms=float(client.get("p99_ttft_ms", 0.0)),
        ttft_max_ms=1000.0 * max(ttfts) if ttfts else 0.0,
        kvtier_tokens=sum(v for k, v in cached.items() if k != "device"),
        tier_errors=dict(prom.by_label(samples, "vllm:kvtier_tier_errors_total", "tier")),
        counters=counters,
        disk_io_ms=sum(prom.value(samples, f"vllm:kvtier_tier_{n}_ms_total", tier="disk")
                       for n in ("read", "write")),
        probe_answer=answer, probe_same=answer == before)



# -- all runs ------------------------------------------------------------------------


def prepare(s: FaultSettings, say: Any = print) -> Path:
    """Write the scaled trace into ``s.out`` (whole or not at all), then move an
    earlier ``RESULTS_FILE`` aside with its ``TABLE_FILE`` (``say`` where); the
    trace's path."""
    from kvtier.replay import serving_trace

    work = s.out
    work.mkdir(parents=True, exist_ok=True)
    trace = work / "trace.jsonl"
    with atomic_path(trace) as staged:
        serving_trace.write_scaled(None, staged, requests=s.requests,
                                   tokens_per_block=BLOCK_TOKENS)
    moved = move_aside(work / RESULTS_FILE, work / TABLE_FILE)
    if moved is not None:
        table = moved.with_name(TABLE_FILE + moved.suffix)
        also = f" (their table in {table})" if table.exists() else ""
        say(f"kvtier bench faults: the earlier results of {work / RESULTS_FILE} are now "
            f"in {moved}{also}")
    for sub in ("logs", "results"):
        (work / sub).mkdir(exist_ok=True)
    return trace


def run_faults(s: FaultSettings, trace: Path, say: Any = print) -> list[FaultResult]:
    """The reference run first, then each fault, over ``trace`` (``prepare``),
    each result appended to ``RESULTS_FILE``; the probe compared across runs."""
    work = s.out
    faults = ["none", *(f for f in s.faults if f != "none")]
    results: list[FaultResult] = []
    for fault in faults:
        say(f"kvtier bench faults: {fault} ...")
        r = run_fault(s, fault, trace, work)
        if results and not r.skipped:
            r.probe_same = r.probe_same and r.probe_answer == results[0].probe_answer
        results.append(r)
        with (work / RESULTS_FILE).open("a") as f:
            f.write(json.dumps(asdict(r)) + "\n")
    return results


def run_all(s: FaultSettings, say: Any = print) -> list[FaultResult]:
    """``prepare``, then ``run_faults``."""
    return run_faults(s, prepare(s, say), say)


HEADER = ("fault", "done", "failed", "p99 TTFT", "/clean", "max-clean p99", "kvtier tok",
          "lost", "tier errors", "write fail", "promo fail", "promo late", "disk I/O s",
          "probe same")
_ROW = ("{:<13} {:>5} {:>6} {:>9} {:>6} {:>13} {:>10} {:>5} {:>16} {:>10} {:>10} {:>10}"
        " {:>12} {:>10}")


def table(results: list[FaultResult]) -> list[str]:
    """The report, the reference run first. A figure with nothing to compare
    against (the reference run measured no TTFT, or served no kvtier tokens)
    shows ``-``; ``lost`` is at least 0 %, and a note names the runs that
    served more kvtier tokens than the reference (runs vary)."""
    clean = results[0]
    lines = [_ROW.format(*HEADER)]
    served_more: list[str] = []
    for r in results:
        if r.skipped:
            lines.append(f"{r.fault:<13} skipped: {r.skipped}")
            continue
        ratio, over = _against_clean_ttft(r, clean)
        lost = _lost(r, clean)
        if clean.kvtier_tokens and r.kvtier_tokens > clean.kvtier_tokens:
            served_more.append(f"{r.fault} +{r.kvtier_tokens / clean.kvtier_tokens - 1:.0%}")
        errors = ",".join(f"{k}={v:.0f}" for k, v in sorted(r.tier_errors.items())) or "0"
        c = r.counters  # a late promotion that failed is in both promotion counters
        lines.append(_ROW.format(
            r.fault, r.completed, r.failed,
            f"{r.ttft_p99_ms:.0f}ms" if _measured(r) else "-", ratio, over,
            f"{r.kvtier_tokens:.0f}", lost, errors,
            f"{c.get('write_failures', 0) + c.get('dropped_writes', 0):.0f}",
            f"{c.get('promotion_failures', 0):.0f}", f"{c.get('promotion_timeouts', 0):.0f}",
            f"{r.disk_io_ms / 1000:.1f}", "yes" if r.probe_same else "NO"))
    lines.append(f"bound on max - clean p99 (probe_timeout_s + promotion_timeout_s): "
                 f"{TIMEOUT_BOUND_S:.1f} s")
    if served_more:
        lines.append("lost 0% where a run served more kvtier tokens than the reference run: "
                     + ", ".join(served_more))
    return lines


def _measured(r: FaultResult) -> bool:
    """Whether the run measured a TTFT: ``vllm bench serve`` reports a p99 of 0
    when no request completed."""
    return r.completed > 0 and r.ttft_p99_ms > 0


def _against_clean_ttft(r: FaultResult, clean: FaultResult) -> tuple[str, str]:
    """``/clean`` and ``max-clean p99`` cells; ``-`` when either run measured no TTFT
    (a ratio to 0, or a difference from it, would read as a figure)."""
    if not (_measured(r) and _measured(clean)):
        return "-", "-"
    return (f"{r.ttft_p99_ms / clean.ttft_p99_ms:.2f}",
            f"{(r.ttft_max_ms - clean.ttft_p99_ms) / 1000:+.2f}s")


def _lost(r: FaultResult, clean: FaultResult) -> str:
    """The ``lost`` cell: the share of the reference run's kvtier tokens this run
    did not serve; ``-`` when the reference served none; 0 % when this run
    served more (nothing was lost; how much more is in ``table``'s note)."""
    if not clean.kvtier_tokens:
        return "-"
    return f"{max(0.0, 1 - r.kvtier_tokens / clean.kvtier_tokens):.0%}"
