"""The benchmark and drill harness (``kvtier.bench``): faults in what it reported.

Each test names what a reported figure or verdict got wrong. No server, engine
or redis-server starts here: the harness's pure parts are fed small
hand-computed inputs, and the one run below has its client and server faked.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.bench_runs import run_result

from kvtier import prom
from kvtier.bench import faults, serving
from kvtier.bench.disk_drill import DiskRound
from kvtier.bench.drill_writer import WriterConfig, drill_key
from kvtier.bench.redis_drill import RedisKill
from kvtier.cli import main
from kvtier.server_process import ServerError


def _settings(tmp_path: Path, *configs: str) -> serving.BenchSettings:
    return serving.BenchSettings(model=tmp_path / "model", out=tmp_path / "out",
                                 configs=configs, traffic=("bundled",), regimes=("paced",),
                                 cpu_blocks=(1000,), repeats=2)


# ------------------------------------------------------------ serving summary
def test_a_run_whose_requests_all_failed_does_not_count_as_a_ttft_of_zero(
        tmp_path: Path) -> None:
    """`vllm bench serve` reports a mean/p50/p99 TTFT of 0 ms for a run in which
    no request completed (numpy over an empty list, ``np.mean(ttfts or 0)``).
    `_medians` took those zeros as measurements: one broken repeat of two halved
    the configuration's median TTFT (100 -> 50 ms) and made it look twice as
    fast as vLLM's manager (TTFT/vllm 0.50), the failure itself visible only in
    the summed `fail` column."""
    results = [run_result("vllm-lru", 0), run_result("vllm-lru", 1),
               run_result("lru", 0),
               run_result("lru", 1, completed=0, failed=10, throughput=0.0, ttft_mean_ms=0.0,
                    ttft_p50_ms=0.0, ttft_p99_ms=0.0, ttft_max_ms=0.0)]
    rows = {r.config: r for r in serving.summarize(results, _settings(tmp_path, "vllm-lru",
                                                                          "lru"))}
    lru = rows["lru"]
    assert (lru.ttft_mean_ms, lru.ttft_p50_ms, lru.ttft_p99_ms) == (100.0, 90.0, 200.0)
    assert lru.ttft_mean_vs_peer == 1.0 and lru.ttft_p99_vs_peer == 1.0
    assert lru.failed == 10


def test_a_configuration_whose_runs_all_failed_has_no_ttft(tmp_path: Path) -> None:
    """The same when every repeat failed: no TTFT was measured, so none is shown
    (and no ratio), rather than 0 ms."""
    failed = dict(completed=0, failed=10, throughput=0.0, ttft_mean_ms=0.0, ttft_p50_ms=0.0,
                  ttft_p99_ms=0.0, ttft_max_ms=0.0)
    results = [run_result("vllm-lru", 0), run_result("lru", 0, **failed),
               run_result("lru", 1, **failed)]
    rows = {r.config: r for r in serving.summarize(results, _settings(tmp_path, "vllm-lru",
                                                                          "lru"))}
    assert math.isnan(rows["lru"].ttft_mean_ms) and rows["lru"].ttft_mean_vs_peer is None
    assert "lru" in "\n".join(serving.table(list(rows.values())))


def test_a_ttft_no_run_measured_is_null_in_summary_json(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # strict JSON has no NaN: summary.json must stay readable by any parser
    from kvtier.bench.commands import _write_summary

    monkeypatch.setattr(serving, "plot", lambda rows, out: out.write_bytes(b"png"))
    failed = dict(completed=0, failed=10, throughput=0.0, ttft_mean_ms=0.0, ttft_p50_ms=0.0,
                  ttft_p99_ms=0.0, ttft_max_ms=0.0)
    results = [run_result("vllm-lru", 0), run_result("lru", 0, **failed)]
    _write_summary(serving.summarize(results, _settings(tmp_path, "vllm-lru", "lru")), tmp_path)

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    records = json.loads((tmp_path / "summary.json").read_text(), parse_constant=refuse)
    lru = next(r for r in records if r["config"] == "lru")
    assert lru["ttft_mean_ms"] is None and lru["ttft_mean_vs_peer"] is None


def test_the_table_does_not_claim_more_repeats_than_a_row_has(tmp_path: Path) -> None:
    """`--summarize` of an interrupted run (`runs.jsonl` holds repeat 1 of
    vllm-lru but not of lru): the block's header said "medians of 2 runs",
    taken from its first row, while lru's row was one run, its ratios a single
    run against a median of two."""
    results = [run_result("vllm-lru", 0), run_result("vllm-lru", 1, ttft_mean_ms=300.0),
               run_result("lru", 0)]
    rows = serving.summarize(results, _settings(tmp_path, "vllm-lru", "lru"))
    assert [(r.config, r.repeats) for r in rows] == [("vllm-lru", 2), ("lru", 1)]
    header = next(line for line in serving.table(rows) if "medians of" in line)
    assert "medians of 2 runs" not in header, header
    assert "1-2 runs" in header and "lru 1000: 1" in header, header


def test_the_table_counts_the_runs_whose_policy_switched(tmp_path: Path) -> None:
    """Whether the adaptive policy's shadows switched moves its hit ratio
    between runs (docs/serving-benchmark.md): the table says in how many of a
    row's repeats they did, and nothing for vLLM's manager, which has none."""
    results = [run_result("vllm-lru", 0), run_result("vllm-lru", 1),
               run_result("default", 0, policy_switches=2.0),
               run_result("default", 1, policy_switches=0.0)]
    rows = serving.summarize(results, _settings(tmp_path, "vllm-lru", "default"))
    assert [(r.config, r.switched) for r in rows] == [("vllm-lru", 0), ("default", 1)]
    lines = list(serving.table(rows))
    header = next(line for line in lines if line.startswith("config"))
    assert header.split()[-1] == "switched"
    cells = {line.split()[0]: line.split()[-1] for line in lines
             if line.startswith(("vllm-lru", "default"))}
    assert cells == {"vllm-lru": "-", "default": "1/2"}


def test_summarize_keeps_the_runs_of_configurations_not_named_again(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`--summarize` "rewrites the summary from OUT/runs.jsonl", but without
    `--configs`/`--cpu-blocks` it filtered the runs by the defaults
    (none,vllm-lru,lru,default,default+disk; 1000,4000): runs of the README's
    own `--configs vllm-lru,plfu,default` lost their plfu rows, and runs at
    2,000 CPU blocks all of theirs, without a word."""
    monkeypatch.setattr(serving, "plot", lambda rows, out: out.write_bytes(b"png"))
    out = tmp_path / "out"
    out.mkdir()
    runs = [run_result(c, r, cpu_blocks=size) for size in (1000, 2000)
            for c in ("vllm-lru", "plfu", "default") for r in (0, 1)]
    (out / "runs.jsonl").write_text("".join(json.dumps(serving.asdict(r)) + "\n"
                                            for r in runs))
    assert main(["bench", "serve", "--out", str(out), "--summarize"]) == 0
    capsys.readouterr()
    rows = json.loads((out / "summary.json").read_text())
    assert sorted({(r["config"], r["cpu_blocks"]) for r in rows}) == sorted(
        {(c, size) for size in (1000, 2000) for c in ("vllm-lru", "plfu", "default")})
    # options given still choose
    assert main(["bench", "serve", "--out", str(out), "--summarize",
                 "--configs", "plfu", "--cpu-blocks", "2000"]) == 0
    rows = json.loads((out / "summary.json").read_text())
    assert [(r["config"], r["cpu_blocks"]) for r in rows] == [("plfu", 2000)]


def test_a_new_run_moves_the_earlier_summary_aside_with_its_runs(tmp_path: Path) -> None:
    """Without `--resume` the earlier runs and settings move to `.N`, but their
    summary.txt, summary.json and plot.png stayed: until the new runs all end
    (or for good, when one fails: "the runs so far are in runs.jsonl"), OUT held
    a summary of runs that are no longer in runs.jsonl."""
    out = tmp_path / "out"
    out.mkdir()
    for name, text in (("runs.jsonl", "old runs\n"), ("settings.json", "{}"),
                       ("summary.txt", "old summary\n"), ("summary.json", "[]"),
                       ("plot.png", "old plot")):
        (out / name).write_text(text)
    serving.start_afresh(out, {"model": "m"})
    assert sorted(p.name for p in out.iterdir()) == [
        "plot.png.1", "runs.jsonl.1", "settings.json", "settings.json.1", "summary.json.1",
        "summary.txt.1"]
    assert (out / "summary.txt.1").read_text() == "old summary\n"


def test_the_hit_ratio_of_a_disk_configuration_is_not_called_the_cpu_tiers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`hit_ratio` is `vllm:external_prefix_cache_hits / _queries`: what the
    offloading connector found, in any of kvtier's tiers (a `+disk`
    configuration's lookups find disk blocks too). The plot's panel, the
    `--help` text and the module called it the "CPU-tier hit ratio" for every
    configuration, `default+disk`'s included; the table's `hit` column said
    nothing of what it counts."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from kvtier.bench.commands import _plain

    assert "CPU-tier hit ratio" not in (_plain(serving.__doc__, 1) or "")
    results = [run_result(c, 0, traffic=t) for t in ("bundled", "generated")
               for c in (("vllm-lru", "default", "default+disk") if t == "bundled"
                         else ("vllm-lru", "default"))]
    settings = serving.BenchSettings(
        model=tmp_path / "model", out=tmp_path / "out",
        configs=("vllm-lru", "default", "default+disk"), traffic=("bundled", "generated"),
        regimes=("paced",), cpu_blocks=(1000,), repeats=1)
    rows = serving.summarize(results, settings)
    lines = list(serving.table(rows))
    note = [line for line in lines if line.startswith("hit:")]
    assert note and "disk" in note[0] and "external_prefix_cache_hits" in note[0], lines
    titles: list[str] = []

    def savefig(self: Figure, fname: Any, *args: Any, **kwargs: Any) -> None:
        titles.extend(ax.get_title() for ax in self.axes)

    monkeypatch.setattr(Figure, "savefig", savefig)
    serving.plot(rows, tmp_path / "plot.png")
    hits = sorted(t for t in titles if "hit ratio" in t)
    assert hits == ["CPU-tier hit ratio: generated, paced",
                    "hit ratio: CPU tier (+disk: CPU + disk): bundled, paced"], titles


# ------------------------------------------------------------ faults under load
class _Client:
    """`vllm bench serve` that exits with ``status`` without writing its result."""

    def __init__(self, status: int) -> None:
        self.returncode = status

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode


def test_a_fault_run_whose_client_failed_does_not_report_an_earlier_runs_figures(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`_load_with_fault` never looked at the client's exit status and read
    results/FAULT.json whatever it held: when `vllm bench serve` died before
    saving (a crash, an unknown option), an earlier `kvtier bench faults` in
    the same --out (prepare moves faults.jsonl aside, not results/) supplied
    the figures, reported as this run's: 800 done, 0 failed."""
    work = tmp_path / "out"
    (work / "results").mkdir(parents=True)
    (work / "logs").mkdir()
    (work / "results" / "none.json").write_text(json.dumps(
        {"completed": 800, "failed": 0, "p99_ttft_ms": 50.0, "ttfts": [0.05]}))
    monkeypatch.setattr(faults, "probe", lambda url, model: "answer")
    monkeypatch.setattr(prom, "scrape", lambda url, timeout_s=10.0: {})
    monkeypatch.setattr(faults.subprocess, "Popen", lambda *a, **k: _Client(1))

    class Server:
        url = "http://127.0.0.1:1"

    s = faults.FaultSettings(model=tmp_path / "model", out=work, fault_at_s=0.0,
                             fault_for_s=0.0)
    st = faults.Stage(redis=None, disk=tmp_path / "disk", control=tmp_path / "slow")
    with pytest.raises(ServerError, match="exited with status 1"):
        faults._load_with_fault(s, "none", st, Server(), work / "trace.jsonl", work)  # type: ignore[arg-type]


def test_a_fault_run_whose_load_never_reaches_the_server_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`_wait_for_load` waits (300 s) for the client's first request to reach
    the server before the fault goes in; when none came in time (a client
    stuck loading its tokenizer, a wrong URL) it returned all the same, and the
    fault was injected with no load on the server: a run that measured no
    fault reported as one. It must fail the run (`ServerError`: one line on
    the command line, as for a server that did not start)."""
    class Running:
        returncode = None

        def poll(self) -> None:
            return None

    monkeypatch.setattr(prom, "scrape", lambda url, timeout_s=10.0: {})  # no load, ever
    started = time.monotonic()
    with pytest.raises(ServerError, match="reached the server within 0 s"):
        faults._wait_for_load("http://127.0.0.1:1", Running(), 0.3)  # type: ignore[arg-type]
    assert time.monotonic() - started < 5
    with pytest.raises(ServerError, match=r"the redis-kill run's load .*; see client\.log"):
        faults._wait_for_load("http://127.0.0.1:1", Running(), 0.0,  # type: ignore[arg-type]
                              fault="redis-kill", client_log=Path("client.log"))


def test_a_fault_run_waits_for_its_load_and_leaves_a_dead_client_to_the_status_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # load seen: go; a client that exited: its exit status is reported after the run
    loads = iter([{}, {}, {("vllm:num_requests_running", ()): 2.0}])
    monkeypatch.setattr(prom, "scrape", lambda url, timeout_s=10.0: next(loads))
    monkeypatch.setattr(faults.time, "sleep", lambda s: None)

    class Running:
        def poll(self) -> None:
            return None

    faults._wait_for_load("http://127.0.0.1:1", Running(), 60.0)  # type: ignore[arg-type]
    monkeypatch.setattr(prom, "scrape", lambda url, timeout_s=10.0: {})
    faults._wait_for_load("http://127.0.0.1:1", _Client(1), 0.0)  # type: ignore[arg-type]


# ------------------------------------------------------------ crash drills
def test_a_disk_round_in_which_the_writer_stored_nothing_fails() -> None:
    """A disk round checks that what the writer acknowledged survived the kill;
    when the writer acknowledged nothing (it did not start, crashed, or its
    tier refused every put: `wait_writing`'s False is ignored) every check is
    vacuous and the round reported "all guarantees held"; so did
    `benchmarks/drill_crash.py`'s exit status."""
    idle = DiskRound(1, 1.0)  # writer_acked 0, an empty directory check
    assert idle.failures(with_engine=False) != []


def test_a_redis_kill_with_no_acknowledged_write_fails() -> None:
    """The same for a Redis kill with AOF: `acked_lost` 0 of 0 acknowledged
    writes passed as "every SET acknowledged before the kill is back"."""
    kill = RedisKill(1, "aof", 1.0, 2.0, hits_before=1152, breaker_opened=True,
                     breaker_closed_s=4.0, tier_errors=5, hits_first=1152, hits_later=1152,
                     fixed_identical=True)
    assert kill.writer_acked == 0 and kill.acked_lost == 0
    assert kill.failures() != []


def test_a_lost_acknowledged_rewrite_is_seen_by_the_redis_drill(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Redis drill's writer cycles over `writer_keys` (256) keys, and a
    block's bytes derived from its key alone, so every SET of a key carried
    the same bytes. With AOF the drill claims every SET acknowledged before
    the kill is back (`acked_lost` 0); it counted as lost an acknowledged id
    with no value of its derived bytes on the restarted server. A key is
    rewritten many times a second, so a server that lost its last second of
    acknowledged SETs (appendfsync everysec, a broken fsync) still held an
    earlier, identical value of every key, and the check could not fail.

    Now each write is a new version of its key (bytes from key and write
    number, both in the acknowledgement log), and a key must hold its latest
    acknowledged version or a later one. Here the real writer loop
    (`drill_writer.run`) writes to an in-memory tier; the "restarted server"
    keeps only the SETs made before the middle of the acknowledgement log, and
    the drill's own check (`writer_versions` on the server, `lost_writes`
    against `acked_between`, as `_RedisRun.kill` does) must see the loss."""
    from kvtier.bench import drill_writer
    from kvtier.bench.drill_writer import acked_between, lost_writes, read_acks
    from kvtier.bench.redis_drill import writer_versions

    puts: list[tuple[float, bytes, bytes]] = []

    class MemoryTier:
        def put(self, items: Any) -> list[bool]:
            puts.extend((time.monotonic(), k, bytes(v)) for k, v in items)
            return [True] * len(items)

    class Server:
        def __init__(self, values: dict[bytes, bytes]) -> None:
            self.values = values

        def get(self, keys: Any) -> list[bytes | None]:
            return [self.values.get(k) for k in keys]

    monkeypatch.setattr(drill_writer, "_open_tier", lambda cfg: MemoryTier())
    log = tmp_path / "acks"
    cfg = WriterConfig("redis", "redis://unused", str(log), block_bytes=64, key_space=4,
                       batch=1, max_seconds=0.2, pause_s=0.001)
    drill_writer.run(cfg)
    acks = read_acks(log)
    assert len(acks) > 16  # each of the 4 keys written several times
    acked = acked_between(log, 0.0, float("inf"))
    assert len({w.version for w in acked}) == len(acked)  # every write its own version

    def check(values: dict[bytes, bytes]) -> tuple[dict[int, int], int, list[int]]:
        held, wrong = writer_versions(Server(values), range(4), 64)  # type: ignore[arg-type]
        return held, wrong, lost_writes(acked, held)

    everything = {k: v for _, k, v in puts}  # the last SET of each key
    assert check(everything) == ({i: max(w.version for w in acked if w.id == i)
                                  for i in range(4)}, 0, [])
    cut = acks[len(acks) // 2][0]  # the server loses every SET acknowledged after this
    held, wrong, lost = check({k: v for t, k, v in puts if t < cut})
    assert len(held) == 4 and wrong == 0  # every key is there, with right bytes
    assert lost, "half the acknowledged SETs were lost and the drill sees none"
    # a SET that landed without its acknowledgement logged: a later version is fine
    unlogged = {k: drill_writer.drill_payload(k, 64, 1 << 40) for k in everything}
    assert check(unlogged)[2] == []
    # another key's bytes, a valid version of them, are wrong
    swapped = dict(everything)
    swapped[drill_key(0)] = everything[drill_key(1)]
    held, wrong, lost = check(swapped)
    assert 0 not in held and wrong == 1 and lost == [0]


def test_the_slow_disk_of_the_fault_runs_answers_the_io_threads_as_the_disk_does(
        tmp_path: Path) -> None:
    """`kvtier bench faults` serves every run (the fault-free one included)
    through `SlowDiskSpec`, whose disk tier is a `SlowTier` (a
    `DelegatingTier`). It forwarded `contains` but not `contains_waiting`, so
    the I/O threads' check before a write fell back to `Tier.contains_waiting`
    = `contains`: through the disk tier's lookup thread with its scheduler
    deadline (a block found late counts as absent), queued before the
    scheduler's own lookups, which `DiskTier.contains_waiting` exists to
    avoid. The runs measured a disk tier that behaves unlike the real one.
    Nor did it forward `debug_state` (the soak's bounds)."""
    from kvtier.bench.fault_spec import SlowTier
    from kvtier.tiers.disk import DiskTier

    calls: list[str] = []

    class Watched(DiskTier):
        def contains(self, keys: Any) -> list[bool]:
            calls.append("contains")
            return super().contains(keys)

        def contains_waiting(self, keys: Any) -> list[bool]:
            calls.append("contains_waiting")
            return super().contains_waiting(keys)

    inner = Watched(tmp_path, "ns", 1 << 20)
    with SlowTier(inner, None) as tier:
        assert tier.contains_waiting([drill_key(1)]) == [False]
        assert calls == ["contains_waiting"]
        assert tier.debug_state() == inner.debug_state() != {}


def test_a_client_that_fails_mid_benchmark_is_one_line_of_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`run_one` runs `vllm bench serve` with `check=True`; its failure (a
    crash, a refused option) escaped as `CalledProcessError`, which
    `kvtier bench serve` does not catch: a traceback, and not a word about
    the runs so far being kept in runs.jsonl for `--resume` (a server that
    fails to start gets that message)."""
    import subprocess

    from kvtier.demo.tiny_model import is_built
    from kvtier.replay.generate import write_trace
    from kvtier.replay.trace import TraceRequest

    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json",
                 "generation_config.json"):
        (model / name).write_text("{}")
    assert is_built(model)
    trace = tmp_path / "trace.jsonl"
    write_trace([TraceRequest(10 * i, 2048, 8, (i, i + 1, i + 2, i + 3)) for i in range(3)],
                trace)

    class Server:
        url = "http://127.0.0.1:1"

        def __init__(self, argv: Any, port: int, log_path: Path, **kwargs: Any) -> None:
            self.log_path = log_path

        def start(self) -> Server:
            return self

        def stop(self) -> int:
            return 0

    def client(argv: Any, **kwargs: Any) -> None:
        raise subprocess.CalledProcessError(1, argv)

    monkeypatch.setattr(serving, "ServerProcess", Server)
    monkeypatch.setattr(subprocess, "run", client)
    argv = ["bench", "serve", "--out", str(tmp_path / "out"), "--model-dir", str(model),
            "--trace", str(trace), "--traffic", "bundled", "--regimes", "paced",
            "--cpu-blocks", "1000", "--repeats", "1", "--configs", "none", "--requests", "3"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("kvtier: error: ") and "--resume continues" in err, err


def test_the_after_probe_is_not_counted_as_the_loads_kvtier_tokens(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The "kvtier tok" column is the load's prompt tokens kvtier served. The
    metrics were scraped after the probe that checks the answer did not
    change, so a probe served from kvtier (its blocks left the engine's cache
    during the load) was counted as the load's: up to PROBE_PROMPT_TOKENS more
    than the load got, also in the column of a run whose fault cut kvtier off."""
    work = tmp_path / "out"
    (work / "results").mkdir(parents=True)
    (work / "logs").mkdir()
    served = {"kvtier": 0.0, "probes": 0}

    def probe(url: str, model: Path) -> str:
        served["probes"] += 1
        if served["probes"] > 1:  # the after probe: served from kvtier
            served["kvtier"] += faults.PROBE_PROMPT_TOKENS
        return "answer"

    def scrape(url: str, timeout_s: float = 10.0) -> prom.Samples:
        return {("vllm:num_requests_running", ()): 1.0,
                ("vllm:prompt_tokens_cached_by_source_total",
                 (("source", "kvtier"),)): served["kvtier"]}

    def popen(*args: object, **kwargs: object) -> _Client:
        served["kvtier"] += 1000.0  # what the load got from kvtier
        (work / "results" / "none.json").write_text(json.dumps(
            {"completed": 10, "failed": 0, "p99_ttft_ms": 5.0, "ttfts": [0.005]}))
        return _Client(0)

    monkeypatch.setattr(faults, "probe", probe)
    monkeypatch.setattr(prom, "scrape", scrape)
    monkeypatch.setattr(faults.subprocess, "Popen", popen)

    class Server:
        url = "http://127.0.0.1:1"

    s = faults.FaultSettings(model=tmp_path / "model", out=work, fault_at_s=0.0,
                             fault_for_s=0.0)
    st = faults.Stage(redis=None, disk=tmp_path / "disk", control=tmp_path / "slow")
    r = faults._load_with_fault(s, "none", st, Server(), work / "trace.jsonl", work)  # type: ignore[arg-type]
    assert served["probes"] == 2 and r.probe_same
    assert r.kvtier_tokens == 1000.0
