"""``kvtier bench serve``: real servers x configurations, driven by vLLM's own client.

For every scenario (traffic x regime x CPU-tier size) and repeat, each
configuration gets a fresh server on the tiny local model (``--configs``, by
default: no offloading; vLLM's own CPU manager behind kvtier's worker; kvtier
with LRU, with its default policy, and default plus a disk tier) and one run of
``vllm bench serve --dataset-name timed_trace`` over the scaled trace
(``kvtier.replay.serving_trace``). Regimes: ``paced`` (the trace's arrival times,
sped up ``--speedup`` times) and ``saturating`` (``--concurrency`` requests
always in flight). Configurations are interleaved and their order rotates
each repeat, so slow phases of a shared machine hit all of them alike.

Per run: the client's completed/failed counts, request throughput, TTFT mean,
p50, p99 and max; from the server's ``/metrics``: prompt tokens by source
(``vllm:prompt_tokens_cached_by_source``) and the hit ratio of the offloading
tiers, ``vllm:external_prefix_cache_hits / _queries`` (the CPU tier's; with
``+disk``, the CPU and disk tiers' together). Runs are appended to
``OUT/runs.jsonl`` as they finish, the settings that shape every run
(``--requests``, ``--trace``, ``--speedup``...) in ``OUT/settings.json``.
``--resume`` skips the runs there, and refuses to mix them with runs of other
settings; without it, earlier runs are moved aside (``runs.jsonl.1``...), never
emptied. The traces are checked (readable, not empty, every request fitting
the engine's cache) before any result file is touched. The summary holds
medians over repeats (the completed and failed requests: totals over them)
and ratios against no offloading and against vLLM's manager, as a table,
JSON and one plot.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtier import prom
from kvtier.bench.outfiles import atomic_output, move_aside, write_atomic
from kvtier.launch import vllm_command
from kvtier.policies import POLICIES, policy_class
from kvtier.replay.serving_trace import ENGINE_BLOCK_TOKENS
from kvtier.replay.trace import BUNDLED_TRACE, TraceFormatError
from kvtier.server_process import ServerError, ServerProcess

BLOCK_TOKENS = ENGINE_BLOCK_TOKENS  # the engines' --block-size
CONFIGS = ("none", "vllm-lru", "lru", "default", "default+disk")
"""Server configurations, in the order of the table (the default set; any
``POLICY`` or ``POLICY+disk`` is accepted too, a built-in policy or a custom
``module.path:ClassName`` one, see ``check_config``)."""
TIERS = ("disk",)
"""Tiers a configuration may add below the CPU tier (``POLICY+TIER``)."""
PEER = "vllm-lru"
BASELINE = "none"
TRAFFIC = ("bundled", "generated")
REGIMES = ("paced", "saturating")
GENERATED_KIND = "chat"
MAX_MODEL_LEN = 8192
"""The servers' context length, unless a trace needs more (``fit_model_len``):
the longest scaled prompt of the bundled trace is 7,699 tokens (+ output)."""
RUNS_FILE = "runs.jsonl"
TRACES_DIR = "served"
"""Under ``--out``: the traces kvtier's servers recorded (``--record``)."""
SETTINGS_FILE = "settings.json"
"""Beside ``RUNS_FILE``: the settings its runs were made with (``run_settings``)."""
RUN_SETTINGS = {
    "model": "--model-dir", "trace": "--trace", "requests": "--requests",
    "speedup": "--speedup", "gpu_blocks": "--gpu-blocks", "concurrency": "--concurrency",
    "seed": "seed", "disk_blocks": "disk_blocks", "output_cap": "output_cap",
    "max_model_len": "context length (fitted to the traces)",
}
"""The settings that change a run's figures but not its key (``RunResult.key``),
each with how a message names it; ``run_settings`` adds the traces' digests."""
SUMMARY_FILES = ("summary.txt", "summary.json", "plot.png")
"""Beside ``RUNS_FILE``: what ``kvtier bench serve`` makes of its runs; moved
aside with them (a summary of runs no longer in ``RUNS_FILE`` misleads)."""


@dataclass(frozen=True)
class BenchSettings:
    """What ``kvtier bench serve`` runs (its flags)."""

    model: Path
    out: Path
    configs: tuple[str, ...] = CONFIGS
    traffic: tuple[str, ...] = TRAFFIC
    regimes: tuple[str, ...] = REGIMES
    cpu_blocks: tuple[int, ...] = (1000, 4000)
    gpu_blocks: int = 500
    requests: int = 1500
    repeats: int = 3
    speedup: float = 25.0
    concurrency: int = 16
    disk_blocks: int = 16000
    output_cap: int = 8
    seed: int = 0
    trace: Path | None = None
    ready_timeout_s: float = 300.0
    max_model_len: int = MAX_MODEL_LEN
    """Servers' context length; ``run_all`` raises it to fit the traces."""
    record: bool = False
    """Each kvtier server records what it served (``trace_path``) in
    ``out/TRACES_DIR/RUN.jsonl``, for ``kvtier replay`` of the same stream."""


@dataclass(frozen=True)
class Scenario:
    """One traffic, regime and CPU-tier size (``cpu_blocks`` 0 for no offloading)."""

    traffic: str
    regime: str
    cpu_blocks: int

    @property
    def label(self) -> str:
        return f"{self.traffic}/{self.regime}/{self.cpu_blocks}"


@dataclass
class RunResult:
    """One server run: the client's figures and the server's counters."""

    config: str
    traffic: str
    regime: str
    cpu_blocks: int
    repeat: int
    completed: int
    failed: int
    throughput: float
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_max_ms: float
    hit_ratio: float
    external_queries: float
    external_hits: float
    cached_by_source: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    stores_skipped: float = 0.0
    """kvtier's store candidates declined (its admission; 0 for vLLM's manager)."""
    policy_admission: float = 0.0
    """The adaptive policy's admission gauge at the end of the run (1: on)."""
    policy_recency: float = 0.0
    """The adaptive policy's recency gauge at the end of the run (1: running as LRU)."""
    policy_switches: float = 0.0
    """Configuration changes of the adaptive policy during the run."""
    dropped_writes: float = 0.0
    """Blocks whose write to a tier below the CPU tier was dropped (write queue
    full, tier down): a later request cannot find them there."""
    promotions_deferred: float = 0.0
    """Lower-tier hits not promoted because the read queue was full (misses)."""

    @property
    def key(self) -> tuple[str, str, str, int, int]:
        return (self.config, self.traffic, self.regime, self.cpu_blocks, self.repeat)


# -- one run ---------------------------------------------------------------------


def engine_flags(gpu_blocks: int, port: int, seed: int = 0, dtype: str = "bfloat16",
                 max_model_len: int = MAX_MODEL_LEN) -> list[str]:
    """vLLM options every server of the benchmarks shares (the tiny model)."""
    return ["--port", str(port), "--block-size", str(BLOCK_TOKENS),
            "--num-gpu-blocks-override", str(gpu_blocks),
            "--max-model-len", str(max_model_len),
            "--hf-overrides", json.dumps({"max_position_embeddings": max_model_len}),
            "--kv-cache-memory-bytes", str(256 << 20), "--gpu-memory-utilization", "0.5",
            "--enforce-eager", "--dtype", dtype, "--seed", str(seed)]


def kvtier_serve_argv(model: Path, cpu_bytes: int, kvtier_flags: Sequence[str],
                      vllm_flags: Sequence[str]) -> list[str]:
    """``kvtier serve MODEL --cpu-bytes N [kvtier flags] [vLLM flags]`` as a command."""
    return [sys.executable, "-m", "kvtier", "serve", str(model), "--cpu-bytes", str(cpu_bytes),
            *kvtier_flags, *vllm_flags]


def check_config(config: str) -> str:
    """Return ``config`` if it names a configuration; else raise ``ValueError``.

    ``none``, ``vllm-lru``, or a kvtier policy optionally followed by
    ``+disk``: a built-in one (``default``, ``lru``, ``adaptive``...) or a
    custom ``module.path:ClassName``, which must import here (the servers
    inherit this process's environment, ``PYTHONPATH`` included).
    """
    if config in (BASELINE, PEER):
        return config
    policy, plus, tier = config.partition("+")
    if ":" in policy:
        try:
            policy_class(policy)
        except ValueError as exc:
            raise ValueError(f"unknown configuration {config!r}: {exc}") from exc
    elif policy != "default" and policy not in POLICIES:
        known = ", ".join([BASELINE, PEER, "default", *POLICIES])
        raise ValueError(f"unknown configuration {config!r}: {policy!r} is none of {known}, "
                         "nor a custom policy 'module.path:ClassName'")
    if plus and tier not in TIERS:
        raise ValueError(f"unknown tier {tier!r} in configuration {config!r} "
                         f"(tiers: {', '.join(TIERS)})")
    return config


def server_argv(s: BenchSettings, config: str, cpu_bytes: int, port: int,
                disk_dir: Path, record_to: Path | None = None) -> list[str]:
    """The command starting ``config``'s server; a kvtier server records the
    requests it serves in ``record_to`` when given (vLLM's manager cannot)."""
    model = str(s.model)
    engine = engine_flags(s.gpu_blocks, port, s.seed, max_model_len=s.max_model_len)
    if config == BASELINE:
        return vllm_command(["serve", model, *engine])
    if config == PEER:
        extra = {"spec_name": "VllmManagerSpec", "spec_module_path": "kvtier.bench.peer_spec",
                 "cpu_bytes_to_use": cpu_bytes, "eviction_policy": "lru"}
        transfer = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": extra}
        return vllm_command(["serve", model, *engine,
                             "--kv-transfer-config", json.dumps(transfer)])
    policy, _, tier = check_config(config).partition("+")
    flags = ["--policy", policy]
    if tier == "disk":
        flags += ["--disk-path", str(disk_dir),
                  "--disk-bytes", str(s.disk_blocks * block_bytes())]
    if record_to is not None:
        flags += ["--kvtier", f"trace_path={record_to}"]
    return kvtier_serve_argv(s.model, cpu_bytes, flags, engine)


def block_bytes(dtype_bytes: int = 2) -> int:
    """Bytes of one engine block of the tiny model (bf16; float32: ``dtype_bytes=4``)."""
    from kvtier.demo.tiny_model import DTYPE_BYTES, kv_bytes_per_block

    return kv_bytes_per_block(BLOCK_TOKENS) * dtype_bytes // DTYPE_BYTES


SERVER_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
"""The environment of every server the benchmarks start: the same CPU
reservation for every configuration. On the CPU platform vLLM reserves one
more core whenever a KV connector is configured (for NIXL), which on a 2-core
machine leaves none for the scheduler, so the worker's threads would compete
with it in offloading configurations only. (Each server keeps idle
connections open past its client's reuse: ``ServerProcess``,
``kvtier.server_process.KEEP_ALIVE_S``.)"""


def server_env() -> dict[str, str]:
    return {**os.environ, **SERVER_ENV}


def client_argv(s: BenchSettings, scenario: Scenario, trace: Path, url: str,
                result_dir: Path, name: str) -> list[str]:
    """``vllm bench serve`` over ``trace`` in the scenario's regime."""
    argv = ["bench", "serve", "--backend", "vllm", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", str(s.model),
            "--tokenizer", str(s.model), "--dataset-name", "timed_trace",
            "--dataset-path", str(trace), "--num-prompts", str(s.requests),
            "--timed-trace-chunk-hash-size", str(BLOCK_TOKENS),
            "--timed-trace-sec-multiplier", f"{0.001 / s.speedup:.10f}",
            "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--save-detailed", "--result-dir", str(result_dir),
            "--result-filename", name, "--disable-tqdm", "--seed", str(s.seed)]
    if scenario.regime == "saturating":
        argv += ["--no-self-timed", "--request-rate", "inf",
                 "--max-concurrency", str(s.concurrency)]
    elif scenario.regime != "paced":
        raise ValueError(f"unknown regime {scenario.regime!r} (choose from {REGIMES})")
    return vllm_command(argv)


def recording_path(s: BenchSettings, config: str, name: str) -> Path | None:
    """Where run ``name`` records what it serves (``--record``; kvtier servers
    only), a file of a previous run of the same name moved aside to ``.N``."""
    if not s.record or config in (BASELINE, PEER):
        return None
    path = s.out / TRACES_DIR / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    if move_aside(path) is None:
        path.unlink(missing_ok=True)  # empty: a run that recorded nothing
    return path


def run_one(s: BenchSettings, config: str, scenario: Scenario, repeat: int,
            trace: Path, work: Path) -> RunResult:
    """Start ``config``'s server, replay ``trace`` against it, stop it; the figures."""
    import subprocess

    from kvtier.tiers.redis_server import free_port

    name = f"{config}-{scenario.traffic}-{scenario.regime}-{scenario.cpu_blocks}-r{repeat}"
    port = free_port()
    cpu_bytes = scenario.cpu_blocks * block_bytes()
    record_to = recording_path(s, config, name)
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-disk-") as disk_dir:
        server = ServerProcess(server_argv(s, config, cpu_bytes, port, Path(disk_dir),
                                           record_to), port,
                               work / "logs" / f"{name}.server.log", env=server_env(),
                               ready_timeout_s=s.ready_timeout_s)
        start = time.monotonic()
        try:
            server.start()
        except ServerError as exc:
            reason = str(exc).splitlines()[0].rstrip(":") if str(exc) else "no reason given"
            raise ServerError(f"the {config} server of {scenario.label} r{repeat} did not "
                              f"start: {reason}; see {server.log_path}") from exc
        try:
            env = {**os.environ, "PYTHONHASHSEED": "0"}  # the client seeds prompts by hash()
            client_log = work / "logs" / f"{name}.client.log"
            try:
                with open(client_log, "wb") as log:
                    subprocess.run(client_argv(s, scenario, trace, server.url,
                                               work / "results", name + ".json"),
                                   stdout=log, stderr=subprocess.STDOUT, env=env, check=True)
            except subprocess.CalledProcessError as exc:
                raise ServerError(f"the client (vllm bench serve) of {config} on "
                                  f"{scenario.label} r{repeat} exited with status "
                                  f"{exc.returncode}; see {client_log}") from exc
            samples = prom.scrape(server.url)
        finally:
            server.stop()
    client = json.loads((work / "results" / f"{name}.json").read_text())
    return _result(config, scenario, repeat, client, samples, time.monotonic() - start)


def _result(config: str, scenario: Scenario, repeat: int, client: dict[str, Any],
            samples: prom.Samples, seconds: float) -> RunResult:
    queries = prom.value(samples, "vllm:external_prefix_cache_queries_total")
    hits = prom.value(samples, "vllm:external_prefix_cache_hits_total")
    ttfts = [t for t in client.get("ttfts", []) if t]
    return RunResult(
        config=config, traffic=scenario.traffic, regime=scenario.regime,
        cpu_blocks=scenario.cpu_blocks, repeat=repeat,
        completed=int(client.get("completed", 0)), failed=int(client.get("failed", 0)),
        throughput=float(client.get("request_throughput", 0.0)),
        ttft_mean_ms=float(client.get("mean_ttft_ms", 0.0)),
        ttft_p50_ms=float(client.get("median_ttft_ms", 0.0)),
        ttft_p99_ms=float(client.get("p99_ttft_ms", 0.0)),
        ttft_max_ms=1000.0 * max(ttfts) if ttfts else 0.0,
        hit_ratio=hits / queries if queries else 0.0,
        external_queries=queries, external_hits=hits,
        cached_by_source=dict(prom.by_label(
            samples, "vllm:prompt_tokens_cached_by_source_total", "source")),
        seconds=seconds,
        stores_skipped=prom.value(samples, "vllm:kvtier_stores_skipped_total"),
        policy_admission=prom.value(samples, "vllm:kvtier_policy_admission"),
        policy_recency=prom.value(samples, "vllm:kvtier_policy_recency"),
        policy_switches=prom.value(samples, "vllm:kvtier_policy_switches_total"),
        dropped_writes=prom.value(samples, "vllm:kvtier_dropped_writes_total"),
        promotions_deferred=prom.value(samples, "vllm:kvtier_promotions_deferred_total"))


# -- the plan --------------------------------------------------------------------


def scenarios(s: BenchSettings) -> list[Scenario]:
    return [Scenario(t, r, c) for t in s.traffic for r in s.regimes for c in s.cpu_blocks]


def plan(s: BenchSettings) -> list[tuple[int, Scenario, str]]:
    """(repeat, scenario, config) in run order: repeats outermost, scenarios,
    then the configurations rotated by one each repeat. No offloading does not
    depend on the CPU-tier size: it runs once per traffic, regime and repeat
    (as the scenario of the first size)."""
    out = []
    for repeat in range(s.repeats):
        shift = repeat % len(s.configs)
        order = [*s.configs[shift:], *s.configs[:shift]]
        for scenario in scenarios(s):
            for config in order:
                if config == BASELINE and scenario.cpu_blocks != s.cpu_blocks[0]:
                    continue
                out.append((repeat, scenario, config))
    return out


def traffic_source(s: BenchSettings, kind: str) -> str:
    """Where ``kind`` traffic comes from, as messages name it."""
    if kind == "bundled":
        return f"the trace {s.trace or BUNDLED_TRACE}"
    return f"generated {GENERATED_KIND} traffic (seed {s.seed})"


def prepare_traces(s: BenchSettings, work: Path) -> dict[str, Path]:
    """The scaled traces, written once into ``work``.

    ``OSError`` when a trace cannot be read, ``TraceFormatError`` naming the
    line of a malformed one, ``ValueError`` naming the trace when it has no
    requests or one that cannot be scaled.
    """
    from kvtier.replay import serving_trace

    paths = {}
    for kind in s.traffic:
        path = work / f"trace-{kind}.jsonl"
        try:
            if kind == "bundled":
                count = serving_trace.write_scaled(
                    s.trace, path, requests=s.requests, tokens_per_block=BLOCK_TOKENS,
                    output_cap=s.output_cap)
            elif kind == "generated":
                count = serving_trace.write_generated(
                    GENERATED_KIND, s.seed, path, requests=s.requests,
                    tokens_per_block=BLOCK_TOKENS, output_cap=s.output_cap)
            else:
                raise ValueError(f"unknown traffic {kind!r} (choose from {TRAFFIC})")
        except TraceFormatError:
            raise  # its message names the file and line
        except ValueError as exc:
            if kind == "bundled" and str(s.trace or BUNDLED_TRACE) in str(exc):
                raise  # it names the trace
            raise ValueError(f"{traffic_source(s, kind)}: {exc}") from exc
        if count == 0:
            raise ValueError(f"{traffic_source(s, kind)}: the trace has no requests")
        paths[kind] = path
    return paths


def fit_model_len(s: BenchSettings, traces: dict[str, Path]) -> int:
    """The servers' context length for ``traces``: ``MAX_MODEL_LEN``, or the
    longest request (prompt and output) rounded up to whole blocks when longer.

    Raises ``ValueError`` naming the trace when that request does not fit the
    engine's cache of ``gpu_blocks`` blocks (vLLM would refuse to start).
    """
    from kvtier.replay import serving_trace

    fit = MAX_MODEL_LEN
    for kind, path in traces.items():
        longest = serving_trace.longest_request(path)
        whole = -(-longest // BLOCK_TOKENS) * BLOCK_TOKENS
        if whole > s.gpu_blocks * BLOCK_TOKENS:
            raise ValueError(
                f"{traffic_source(s, kind)} (scaled: {path.name}): a request of {longest} "
                f"tokens does not fit the engine's cache of {s.gpu_blocks} blocks of "
                f"{BLOCK_TOKENS} tokens; raise --gpu-blocks or use fewer --requests")
        fit = max(fit, whole)
    return fit


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _torn_tail(data: bytes) -> int | None:
    """Where the torn last line of runs file ``data`` starts: a line with no
    newline at its end that is not JSON (a write cut short: a kill, a full
    disk); None when there is none."""
    start = data.rfind(b"\n") + 1
    tail = data[start:]
    if not tail.strip():
        return None
    try:
        json.loads(tail)
    except ValueError:
        return start
    return None


def load_runs(path: Path, say: Callable[[str], None] | None = _stderr) -> list[RunResult]:
    """The runs of ``path`` ([] when there is no such file); ``ValueError``
    naming the line that is not a run. A torn last line (``_torn_tail``) is
    left out, ``say`` told: its run was never recorded whole, so it counts as
    not made (``--resume`` makes it again, ``end_runs_file``)."""
    if not path.is_file():
        return []
    data = path.read_bytes()
    torn = _torn_tail(data)
    lines = data[:torn].decode().splitlines()
    if torn is not None and say is not None:
        say(f"kvtier bench serve: warning: {path}:{len(lines) + 1} is a run cut short "
            f"(no newline, not JSON: {data[torn:torn + 40]!r}...); left out, its run "
            "counts as not made")
    runs = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            runs.append(RunResult(**json.loads(line)))
        except (ValueError, TypeError) as exc:
            raise ValueError(
                f"{path}:{lineno}: not a run of kvtier bench serve ({exc})") from None
    return runs


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_settings(s: BenchSettings, traces: dict[str, Path]) -> dict[str, Any]:
    """What ``SETTINGS_FILE`` holds: ``RUN_SETTINGS`` of ``s`` (paths absolute)
    and the SHA-256 of each scaled trace (``traces``), as JSON values."""
    values = {name: getattr(s, name) for name in RUN_SETTINGS}
    values["model"] = str(s.model.resolve())
    values["trace"] = str(s.trace.resolve()) if s.trace else "bundled"
    values["traces"] = {kind: _digest(path) for kind, path in sorted(traces.items())}
    loaded: dict[str, Any] = json.loads(json.dumps(values))
    return loaded


def settings_difference(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """The first setting in which ``new`` differs from ``old`` (both
    ``run_settings``), as a message; None when they agree (traces of a traffic
    only one of them has are not compared: traffic is part of a run's key)."""
    for name, label in RUN_SETTINGS.items():
        if old.get(name) != new.get(name):
            return f"made with {label} {old.get(name)}, this command has {new.get(name)}"
    old_traces, new_traces = old.get("traces") or {}, new.get("traces") or {}
    for kind in sorted(old_traces.keys() & new_traces.keys()):
        if old_traces[kind] != new_traces[kind]:
            return (f"made on another {kind} trace (its scaled requests differ from this "
                    "command's)")
    return None


def resumed_runs(work: Path, settings: dict[str, Any],
                 say: Callable[[str], None] | None = _stderr) -> dict[tuple[Any, ...], RunResult]:
    """The runs of ``work/runs.jsonl`` by key, when made with ``settings``;
    ``ValueError`` when they were not, or when which settings is unknown
    (``load_runs``: a torn last line left out, ``say`` told)."""
    runs_file, settings_file = work / RUNS_FILE, work / SETTINGS_FILE
    runs = load_runs(runs_file, say)
    if not runs:
        return {}
    afresh = "leave out --resume to start afresh (the earlier runs are then moved aside)"
    if not settings_file.is_file():
        raise ValueError(f"--resume: {runs_file} has no {SETTINGS_FILE} beside it (made by "
                         f"an older kvtier), so its runs' settings are unknown; {afresh}")
    try:
        stored = json.loads(settings_file.read_text())
    except ValueError as exc:
        raise ValueError(f"--resume: {settings_file} is not JSON ({exc}); {afresh}") from None
    difference = settings_difference(stored if isinstance(stored, dict) else {}, settings)
    if difference:
        raise ValueError(f"--resume: the runs in {runs_file} were {difference}; give the "
                         f"same settings, or {afresh}")
    return {r.key: r for r in runs}


def end_runs_file(path: Path) -> None:
    """Make ``path`` end where its last whole line does, so that the next run
    appended starts a line of its own: a torn last line (``_torn_tail``) is
    cut off, a whole one missing its newline gets it."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    torn = _torn_tail(data)
    if torn is not None:
        os.truncate(path, torn)
    else:
        with path.open("ab") as f:
            f.write(b"\n")


def start_afresh(work: Path, settings: dict[str, Any],
                 say: Callable[[str], None] | None = None) -> None:
    """Move earlier runs (their settings and summary) aside, ``say`` where, and write
    ``settings`` as the new runs' ``SETTINGS_FILE``."""
    moved = move_aside(work / RUNS_FILE, work / SETTINGS_FILE,
                       *(work / name for name in SUMMARY_FILES))
    if moved is not None and say is not None:
        aside = work / f"{SETTINGS_FILE}{moved.suffix}"
        kept = f", their settings in {aside}" if aside.is_file() else ""
        say(f"kvtier bench serve: the earlier runs of {work / RUNS_FILE} are now in "
            f"{moved}{kept}")
    write_atomic(work / SETTINGS_FILE, json.dumps(settings, indent=1) + "\n")


@dataclass(frozen=True)
class Prepared:
    """A checked plan, ready to run (``prepare``)."""

    settings: BenchSettings
    """The command's settings, ``max_model_len`` fitted to the traces."""
    traces: dict[str, Path]
    done: dict[tuple[Any, ...], RunResult]
    """The runs resumed, by key."""


def prepare(s: BenchSettings, resume: bool = False,
            say: Callable[[str], None] | None = None) -> Prepared:
    """Check the inputs, then set up ``s.out`` for the runs.

    The traces are scaled in a temporary directory and checked (``prepare_traces``,
    ``fit_model_len``), and with ``resume`` the runs there must have been made
    with these settings (``resumed_runs``): until all of that passed, nothing
    in ``s.out`` changes (its errors: ``OSError``, ``ValueError``). Then the
    traces move into ``s.out`` and, unless runs are resumed, earlier ones are
    moved aside (``start_afresh``).
    """
    work = s.out
    work.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".traces-", dir=work) as staging:
        staged = prepare_traces(s, Path(staging))
        s = replace(s, max_model_len=fit_model_len(s, staged))
        settings = run_settings(s, staged)
        done = resumed_runs(work, settings, say or _stderr) if resume else {}
        traces = {}
        for kind, path in staged.items():
            traces[kind] = work / path.name
            os.replace(path, traces[kind])
    if done:
        end_runs_file(work / RUNS_FILE)
    else:
        start_afresh(work, settings, say)
    for sub in ("logs", "results"):
        (work / sub).mkdir(exist_ok=True)
    return Prepared(s, traces, done)


def run_plan(p: Prepared, progress: Callable[[str], None] | None = None) -> list[RunResult]:
    """Every run of the plan of ``p`` not done yet, each appended to ``runs.jsonl``
    as it ends; all of the plan's runs, in plan order."""
    s, work = p.settings, p.settings.out
    results = []
    steps = plan(s)
    for i, (repeat, scenario, config) in enumerate(steps, 1):
        key = (config, scenario.traffic, scenario.regime, scenario.cpu_blocks, repeat)
        if key in p.done:
            results.append(p.done[key])
            continue
        result = run_one(s, config, scenario, repeat, p.traces[scenario.traffic], work)
        with (work / RUNS_FILE).open("a") as f:
            f.write(json.dumps(asdict(result)) + "\n")
        results.append(result)
        if progress is not None:
            progress(f"[{i}/{len(steps)}] {config:<13} {scenario.label:<28} r{repeat}  "
                     f"{result.completed} ok {result.failed} failed  "
                     f"{result.throughput:6.2f} req/s  TTFT {result.ttft_mean_ms:8.1f} ms  "
                     f"hit {result.hit_ratio:.4f}  ({result.seconds:.0f} s)")
    return results


def run_all(s: BenchSettings, resume: bool = False,
            progress: Callable[[str], None] | None = None,
            say: Callable[[str], None] | None = None) -> list[RunResult]:
    """Every run of the plan (those of ``runs.jsonl`` kept with ``resume``):
    ``prepare``, then ``run_plan``."""
    return run_plan(prepare(s, resume, say), progress)


# -- the summary -----------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """Medians over repeats of one configuration in one scenario, with ratios;
    the request counts are totals over the repeats (a failure in one run is
    never hidden by a median)."""

    config: str
    traffic: str
    regime: str
    cpu_blocks: int
    repeats: int
    completed: int
    """Requests completed, summed over the repeats."""
    failed: int
    """Requests failed, summed over the repeats."""
    throughput: float
    ttft_mean_ms: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    hit_ratio: float
    cached_by_source: dict[str, float]
    dropped_writes: float
    """Median over repeats of ``RunResult.dropped_writes``."""
    switched: int
    """Repeats whose policy changed configuration (``RunResult.policy_switches``
    above 0): whether the adaptive policy's shadows switched, which moves its
    hit ratio between runs."""
    throughput_vs_none: float | None
    ttft_mean_vs_none: float | None
    throughput_vs_peer: float | None
    ttft_mean_vs_peer: float | None
    ttft_p99_vs_peer: float | None
    hit_vs_peer: float | None


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _vs(medians: dict[str, Any], reference: dict[str, Any] | None, name: str) -> float | None:
    """``name``'s median over the reference's; None without a reference, at 0,
    or when either was not measured (NaN: no run completed a request)."""
    if not reference or not reference[name]:
        return None
    ratio = float(medians[name]) / float(reference[name])
    return None if math.isnan(ratio) else ratio


def summarize(results: Sequence[RunResult], s: BenchSettings) -> list[Row]:
    """One row per scenario and configuration (no offloading repeated in each
    size's scenario so that ratios compare runs of the same traffic).

    No offloading has no CPU tier: its runs count in every size's scenario,
    whichever size they were recorded under (``plan`` runs it as the first
    size's; ``--summarize --cpu-blocks`` may choose another size only)."""
    def runs(config: str, sc: Scenario) -> list[RunResult]:
        return [r for r in results if (r.config, r.traffic, r.regime) == (
            config, sc.traffic, sc.regime) and (config == BASELINE
                                                or r.cpu_blocks == sc.cpu_blocks)]

    rows = []
    for sc in scenarios(s):
        medians = {c: _medians(runs(c, sc)) for c in s.configs}
        base, peer = medians.get(BASELINE), medians.get(PEER)  # {} when not run
        for config in s.configs:
            m = medians[config]
            if not m:
                continue
            rows.append(Row(
                config=config, traffic=sc.traffic, regime=sc.regime, cpu_blocks=sc.cpu_blocks,
                repeats=int(m["repeats"]), completed=int(m["completed"]),
                failed=int(m["failed"]), throughput=m["throughput"],
                ttft_mean_ms=m["ttft_mean_ms"], ttft_p50_ms=m["ttft_p50_ms"],
                ttft_p99_ms=m["ttft_p99_ms"], hit_ratio=m["hit_ratio"],
                cached_by_source=m["cached_by_source"], dropped_writes=m["dropped_writes"],
                switched=int(m["switched"]),
                throughput_vs_none=_vs(m, base, "throughput"),
                ttft_mean_vs_none=_vs(m, base, "ttft_mean_ms"),
                throughput_vs_peer=_vs(m, peer, "throughput"),
                ttft_mean_vs_peer=_vs(m, peer, "ttft_mean_ms"),
                ttft_p99_vs_peer=_vs(m, peer, "ttft_p99_ms"),
                hit_vs_peer=_vs(m, peer, "hit_ratio"),
            ))
    return rows


def _medians(runs: Sequence[RunResult]) -> dict[str, Any]:
    """Median of each figure over ``runs`` (counts summed); {} without runs.

    TTFTs are medians over the runs that completed a request: ``vllm bench
    serve`` reports 0 ms for a run in which every request failed, which is no
    measurement (NaN when no run completed one)."""
    if not runs:
        return {}
    sources = sorted({k for r in runs for k in r.cached_by_source})
    out: dict[str, Any] = {name: _median([getattr(r, name) for r in runs]) for name in (
        "throughput", "hit_ratio", "dropped_writes")}
    answered = [r for r in runs if r.completed > 0]
    out.update({name: _median([getattr(r, name) for r in answered]) if answered
                else math.nan for name in ("ttft_mean_ms", "ttft_p50_ms", "ttft_p99_ms")})
    out.update(repeats=len(runs), completed=sum(r.completed for r in runs),
               failed=sum(r.failed for r in runs),
               switched=sum(1 for r in runs if r.policy_switches > 0),
               cached_by_source={k: _median([r.cached_by_source.get(k, 0.0) for r in runs])
                                 for k in sources})
    return out


HIT_NOTE = ("hit: vllm:external_prefix_cache_hits / _queries, prompt tokens found in the "
            "offloading tiers over those looked up there: the CPU tier's, and for +disk "
            "configurations the CPU and disk tiers' together")
"""The table's last line: what its ``hit`` column counts."""


def hit_title(configs: Sequence[str]) -> str:
    """The hit-ratio panel's title for ``configs``: the CPU tier's, unless one
    of them has a tier below it (``+disk``), whose hits count too."""
    below = sorted({config.partition("+")[2] for config in configs} - {""})
    if not below:
        return "CPU-tier hit ratio"
    return f"hit ratio: CPU tier ({', '.join(f'+{t}: CPU + {t}' for t in below)})"


TABLE = ("config", "cpu", "done", "fail", "req/s", "TTFT mean", "p50", "p99", "hit",
         "thr/none", "thr/vllm", "TTFT/vllm", "p99/vllm", "hit/vllm", "host tok", "disk tok",
         "dropped", "switched")


def table(rows: Sequence[Row]) -> Iterator[str]:
    """Text lines: one block per traffic and regime."""
    def ratio(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    last = None
    for r in rows:
        if (r.traffic, r.regime) != last:
            last = (r.traffic, r.regime)
            yield ""
            group = [g for g in rows if (g.traffic, g.regime) == last]
            yield f"{r.traffic} trace, {r.regime} ({_repeats(group)})"
            yield ("{:<13} {:>5} {:>5} {:>4} {:>6} {:>10} {:>8} {:>8} {:>7} {:>8} {:>8} "
                   "{:>9} {:>8} {:>8} {:>9} {:>9} {:>7} {:>8}").format(*TABLE)
        src = r.cached_by_source
        yield (f"{r.config:<13} {r.cpu_blocks:>5} {r.completed:>5} {r.failed:>4} "
               f"{r.throughput:>6.2f} {r.ttft_mean_ms:>8.0f}ms {r.ttft_p50_ms:>6.0f}ms "
               f"{r.ttft_p99_ms:>6.0f}ms {r.hit_ratio:>7.4f} {ratio(r.throughput_vs_none):>8} "
               f"{ratio(r.throughput_vs_peer):>8} {ratio(r.ttft_mean_vs_peer):>9} "
               f"{ratio(r.ttft_p99_vs_peer):>8} {ratio(r.hit_vs_peer):>8} "
               f"{src.get('host', 0):>9.0f} {src.get('disk', 0):>9.0f} "
               f"{r.dropped_writes:>7.0f} {_switched(r):>8}")
    if rows:
        yield ""
        yield HIT_NOTE


def _switched(row: Row) -> str:
    """``switched`` of ``row`` out of its repeats; ``-`` for vLLM's manager and
    no offloading, which have no kvtier policy."""
    return "-" if row.config in (BASELINE, PEER) else f"{row.switched}/{row.repeats}"


SUMMED = "done, fail and switched: totals of the runs"
"""What a block's heading says of the columns that are not medians."""


def _repeats(rows: Sequence[Row]) -> str:
    """How many runs the medians of ``rows`` (one traffic and regime) take;
    the rows with fewer named, when they differ (``--summarize`` of an
    interrupted benchmark); then which columns are totals, not medians."""
    most = max(r.repeats for r in rows)
    fewer = [f"{r.config} {r.cpu_blocks}: {r.repeats}" for r in rows if r.repeats < most]
    if not fewer:
        return f"medians of {most} runs; {SUMMED}"
    least = min(r.repeats for r in rows)
    return (f"medians of {least}-{most} runs; fewer than {most}: {', '.join(fewer)}; "
            f"{SUMMED}")


def plot(rows: Sequence[Row], out: Path) -> None:
    """Three panels per traffic and regime: hit ratio (``hit_title``), throughput
    and mean TTFT of each configuration, grouped by CPU-tier size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r.traffic, r.regime) for r in rows})
    fig, axes = plt.subplots(len(groups), 3, figsize=(15, 3.6 * len(groups)), squeeze=False)
    for (traffic, regime), ax_row in zip(groups, axes, strict=True):
        mine = [r for r in rows if (r.traffic, r.regime) == (traffic, regime)]
        sizes = sorted({r.cpu_blocks for r in mine})
        configs = list(dict.fromkeys(r.config for r in mine))
        width = 0.8 / max(1, len(configs))
        for ax, attr, title in zip(ax_row, ("hit_ratio", "throughput", "ttft_mean_ms"),
                                   (hit_title(configs), "requests / s", "mean TTFT (ms)"),
                                   strict=True):
            for j, config in enumerate(configs):
                vals = [next((getattr(r, attr) for r in mine if r.config == config
                              and r.cpu_blocks == size), 0.0) for size in sizes]
                ax.bar([i + j * width for i in range(len(sizes))], vals, width, label=config)
            ax.set_xticks([i + width * (len(configs) - 1) / 2 for i in range(len(sizes))])
            ax.set_xticklabels([f"{size} CPU blocks" for size in sizes])
            ax.set_title(f"{title}: {traffic}, {regime}", fontsize=10)
        ax_row[0].legend(fontsize=8)
    fig.tight_layout()
    try:
        with atomic_output(out) as f:
            fig.savefig(f, format="png", dpi=110)
    finally:
        plt.close(fig)
