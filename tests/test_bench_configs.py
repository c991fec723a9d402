"""`kvtier bench serve`: which server configurations it accepts, and the servers' context
length for a trace."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench.serving import (
    MAX_MODEL_LEN,
    BenchSettings,
    RunResult,
    Scenario,
    _result,
    check_config,
    fit_model_len,
    load_runs,
    recording_path,
    server_argv,
)
from kvtier.cli import build_parser


@pytest.mark.parametrize("config", ["none", "vllm-lru", "lru", "default", "adaptive",
                                    "default+disk", "adaptive+disk", "arc"])
def test_known_configurations_are_accepted(config: str) -> None:
    assert check_config(config) == config


@pytest.mark.parametrize("config,problem", [("nope", "'nope'"), ("lru+tape", "'tape'"),
                                            ("+disk", "''"), ("vllm-lru+disk", "'vllm-lru'")])
def test_unknown_configurations_name_the_problem(config: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        check_config(config)


def test_a_custom_policy_configuration_must_import(tmp_path: Path) -> None:
    custom = "kvtier.policies.lru:LRUPolicy"
    assert check_config(custom) == custom and check_config(custom + "+disk") == custom + "+disk"
    s = BenchSettings(model=tmp_path / "model", out=tmp_path / "out")
    argv = server_argv(s, custom, 1 << 20, 8000, tmp_path / "disk")
    assert argv[argv.index("--policy") + 1] == custom
    with pytest.raises(ValueError, match="no_such_module"):
        check_config("no_such_module:Policy")
    with pytest.raises(ValueError, match="EvictionPolicy"):
        check_config("kvtier.policies:POLICIES")


def test_a_policy_configuration_starts_kvtier_serve_with_that_policy(tmp_path: Path) -> None:
    s = BenchSettings(model=tmp_path / "model", out=tmp_path / "out")
    argv = server_argv(s, "adaptive+disk", 1 << 20, 8000, tmp_path / "disk")
    assert argv[argv.index("--policy") + 1] == "adaptive"
    assert argv[argv.index("--disk-path") + 1] == str(tmp_path / "disk")
    plain = server_argv(s, "adaptive", 1 << 20, 8000, tmp_path / "disk")
    assert "--disk-path" not in plain


def test_record_makes_each_kvtier_server_record_to_a_file_of_its_own(tmp_path: Path) -> None:
    plain = BenchSettings(model=tmp_path / "model", out=tmp_path / "out")
    s = BenchSettings(model=tmp_path / "model", out=tmp_path / "out", record=True)
    assert recording_path(plain, "default", "run") is None
    assert recording_path(s, "vllm-lru", "run") is None  # vLLM's manager: nothing to record
    assert recording_path(s, "none", "run") is None
    path = recording_path(s, "default", "default-bundled-paced-1000-r0")
    assert path == tmp_path / "out" / "served" / "default-bundled-paced-1000-r0.jsonl"
    argv = server_argv(s, "default", 1 << 20, 8000, tmp_path / "disk", path)
    assert argv[argv.index("--kvtier") + 1] == f"trace_path={path}"
    assert "--kvtier" not in server_argv(s, "default", 1 << 20, 8000, tmp_path / "disk")
    path.write_text('{"hash_ids": [1]}\n')  # a repeat of the run: the old trace is kept
    assert recording_path(s, "default", path.stem) == path and not path.exists()
    assert path.with_name(path.name + ".1").read_text() == '{"hash_ids": [1]}\n'
    path.write_text("")  # an empty one is not
    assert recording_path(s, "default", path.stem) == path and not path.exists()
    assert build_parser().parse_args(["bench", "serve", "--record"]).record


def test_the_command_line_rejects_an_unknown_configuration(
        capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(["bench", "serve", "--configs", "vllm-lru,adaptive"])
    assert args.configs == ("vllm-lru", "adaptive")
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "serve", "--configs", "vllm-lru,bogus"])
    assert "bogus" in capsys.readouterr().err


def test_a_run_records_the_policy_gauges_and_loads_back(tmp_path: Path) -> None:
    samples = {("vllm:external_prefix_cache_queries_total", ()): 100.0,
               ("vllm:external_prefix_cache_hits_total", ()): 25.0,
               ("vllm:kvtier_stores_skipped_total", ()): 7.0,
               ("vllm:kvtier_policy_admission", ()): 1.0,
               ("vllm:kvtier_policy_recency", ()): 1.0,
               ("vllm:kvtier_policy_switches_total", ()): 2.0,
               ("vllm:kvtier_dropped_writes_total", ()): 5.0,
               ("vllm:kvtier_promotions_deferred_total", ()): 3.0}
    run = _result("default", Scenario("generated", "paced", 1000), 0, {"completed": 3},
                  samples, 1.5)
    assert (run.hit_ratio, run.stores_skipped, run.policy_admission, run.policy_recency,
            run.policy_switches, run.dropped_writes,
            run.promotions_deferred) == (0.25, 7.0, 1.0, 1.0, 2.0, 5.0, 3.0)
    path = tmp_path / "runs.jsonl"
    old = '{"config": "vllm-lru", "traffic": "bundled", "regime": "paced", "cpu_blocks": 1000, ' \
          '"repeat": 0, "completed": 1, "failed": 0, "throughput": 1.0, "ttft_mean_ms": 1.0, ' \
          '"ttft_p50_ms": 1.0, "ttft_p99_ms": 1.0, "ttft_max_ms": 1.0, "hit_ratio": 0.0, ' \
          '"external_queries": 1.0, "external_hits": 0.0}'
    path.write_text(old + "\n")  # a row from before these fields
    (loaded,) = load_runs(path)
    assert isinstance(loaded, RunResult) and loaded.policy_switches == 0.0
    assert loaded.dropped_writes == 0.0


def _scaled_trace(path: Path, lengths: list[int]) -> Path:
    from kvtier.replay.generate import write_trace
    from kvtier.replay.trace import TraceRequest

    write_trace([TraceRequest(i, n, 8, (i,)) for i, n in enumerate(lengths)], path)
    return path


def test_the_context_length_fits_the_longest_request(tmp_path: Path) -> None:
    s = BenchSettings(model=tmp_path / "model", out=tmp_path / "out", gpu_blocks=500)
    short = {"bundled": _scaled_trace(tmp_path / "short.jsonl", [100, 7000])}
    assert fit_model_len(s, short) == MAX_MODEL_LEN
    long = {"bundled": _scaled_trace(tmp_path / "long.jsonl", [100, 11_960])}
    assert fit_model_len(s, long) == 11_968  # 11,968 tokens = 374 whole blocks of 32
    argv = server_argv(BenchSettings(model=s.model, out=s.out, max_model_len=11_968),
                       "default", 1 << 20, 8000, tmp_path / "disk")
    assert argv[argv.index("--max-model-len") + 1] == "11968"
    with pytest.raises(ValueError, match=r"too\.jsonl.*16008 tokens.*500 blocks"):
        fit_model_len(s, {"bundled": _scaled_trace(tmp_path / "too.jsonl", [16_000])})


@pytest.mark.parametrize("command", ["serve", "faults"])
@pytest.mark.parametrize("speedup", ["nan", "inf", "-inf", "0", "-2", "fast"])
def test_the_speedup_must_be_a_finite_number_above_zero(
        command: str, speedup: str, capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(["bench", command, "--speedup", "2.5"]).speedup == 2.5
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args(["bench", command, "--speedup", speedup])
    assert exit_.value.code == 2
    assert "--speedup: " in capsys.readouterr().err
