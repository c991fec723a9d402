"""``kvtier serve`` without starting an engine: the command it builds, its
errors, its secrets (kept out of argv and of the printed command)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from kvtier.argtypes import byte_size
from kvtier.cli import main

ENGINE = ["--block-size", "32", "--max-model-len", "1024"]


def printed(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[list[str], dict, str]:
    """Run ``kvtier serve ... --print-command``: (argv, extra config, stderr)."""
    assert main(["serve", "/models/m", *args, "--print-command"]) == 0
    out = capsys.readouterr()
    argv = shlex.split(out.out)
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return argv, transfer["kv_connector_extra_config"], out.err


def test_flags_become_the_transfer_config_and_vllm_options_pass_unchanged(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    disk = str(tmp_path / "kv")
    argv, extra, _ = printed(capsys, "--cpu-bytes", "2GiB", "--policy", "lru",
                             "--store-threshold", "2", "--disk-path", disk,
                             "--disk-bytes", "10G", "--kvtier", "disk_store_threshold=2",
                             "--kvtier", "lease_timeout_s=30.5", *ENGINE, "--port", "8001")
    assert argv[:3] == ["vllm", "serve", "/models/m"]
    assert argv[3:9] == [*ENGINE, "--port", "8001"]
    assert extra == {"spec_name": "KVTierSpec", "spec_module_path": "kvtier.vllm",
                     "cpu_bytes_to_use": 2 << 30, "eviction_policy": "lru",
                     "store_threshold": 2, "disk_path": disk, "disk_bytes": 10**10,
                     "disk_store_threshold": 2, "lease_timeout_s": 30.5}


def test_default_cpu_bytes_is_bounded(capsys: pytest.CaptureFixture[str]) -> None:
    _, extra, _ = printed(capsys)
    assert 0 < extra["cpu_bytes_to_use"] <= 16 << 30


def test_default_cpu_bytes_follow_the_containers_limits(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    # a pod limited to 4 GiB on a large node, then one with a small /dev/shm
    # (limits this machine does not have: the readings are replaced)
    from kvtier import host_memory

    (tmp_path / "memory.max").write_text("4294967296\n")
    assert host_memory.cgroup_limit_bytes(tmp_path) == 4 << 30
    (tmp_path / "memory.max").write_text("max\n")
    assert host_memory.cgroup_limit_bytes(tmp_path) is None
    monkeypatch.setattr(host_memory, "physical_bytes", lambda: 512 << 30)
    monkeypatch.setattr(host_memory, "cgroup_limit_bytes", lambda: 4 << 30)
    monkeypatch.setattr(host_memory, "free_bytes", lambda _: 64 << 30)
    assert printed(capsys)[1]["cpu_bytes_to_use"] == 1 << 30
    monkeypatch.setattr(host_memory, "free_bytes", lambda _: 64 << 20)
    _, extra, err = printed(capsys)
    assert extra["cpu_bytes_to_use"] == 32 << 20 and "--shm-size" in err


def test_secrets_never_reach_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    argv, extra, err = printed(capsys, "--redis-url", "redis://alice:s3cr3t-pw@cache:6379/0",
                               "--tenant-salt", "t3nant-salt")
    text = " ".join(argv) + err
    assert "s3cr3t-pw" not in text and "t3nant-salt" not in text
    assert extra["redis_url"] == "redis://alice@cache:6379/0"
    assert extra["tenant_salt"] == "env:KVTIER_TENANT_SALT"
    assert "KVTIER_REDIS_PASSWORD" in err and "KVTIER_TENANT_SALT" in err


@pytest.mark.parametrize(("args", "named"), [
    (["--policy", "nope"], "eviction_policy"),
    (["--disk-path", "/x"], "disk_bytes"),
    (["--disk-bytes", "1G"], "disk_path"),
    (["--kvtier", "no_such_key=1"], "no_such_key"),
    (["--kvtier", "store_threshold"], "KEY=VALUE"),
    (["--kvtier", "store_threshold=0"], "store_threshold"),
    (["--cpu-bytes", "lots"], "not a byte count"),
    (["--kv-transfer-config", "{}"], "builds --kv-transfer-config itself"),
    (["--kv_transfer_config={}"], "builds --kv-transfer-config itself"),
    (["--kv-transfer-config.kv_role", "kv_both"], "builds --kv-transfer-config itself"),
    (["--kv_transfer-config.kv_connector=X"], "builds --kv-transfer-config itself"),
    (["--kv-offloading_size", "8"], "--cpu-bytes instead"),
    (["--redis-url", "rediss://h:1/0?ssl%5Fpassword=k3y"], "ssl_password would be on vLLM's"),
    (["--kv-offloading-size", "8"], "--cpu-bytes instead"),
    (["--redis-url", "rediss://h:1/0?ssl_password=k3y"], "ssl_password would be on vLLM's"),
    (["--policy", "lru", "--kvtier", "eviction_policy=plfu"], "given twice"),
    (["--kv_offloading_backend=native"], "vLLM's own CPU offloading"),
    (["--disk-path", "/dev/null/kv", "--disk-bytes", "1G"], "is not a directory"),
    (["--redis-url", "redis://h:1/0?ssl_ca_cert=/x"], "ssl_ca_cert"),
    (["--redis-url", "redis://h:99999/0"], "Port out of range"),
    (["--redis-url", "redis://h:1/O"], "must be a number"),
    (["--cpu-byte", "1GiB"], "did you mean --cpu-bytes?"),
    (["--disk_pth=/x"], "unknown option --disk_pth: did you mean --disk-path?"),
    (["--kvtier-policy", "lru"], "did you mean --kvtier?"),
])
def test_bad_values_are_refused_before_the_engine_starts(
        capsys: pytest.CaptureFixture[str], args: list[str], named: str) -> None:
    try:
        status = main(["serve", "/models/m", *args])
    except SystemExit as exc:  # argparse's own errors
        status = int(exc.code or 0)
    assert status == 2
    assert named in capsys.readouterr().err


def test_other_commands_still_refuse_unknown_arguments(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "chat", "-o", "/tmp/x.jsonl", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "value"), [
    ("8000000000", 8 * 10**9), ("8e9", 8 * 10**9), ("8G", 8 * 10**9), ("8GB", 8 * 10**9),
    ("8Gi", 8 << 30), ("8GiB", 8 << 30), ("64mi", 64 << 20), ("1.5K", 1500),
])
def test_byte_sizes(text: str, value: int) -> None:
    assert byte_size(text) == value


@pytest.mark.parametrize("text", ["0", "-1", "1.5", "8X", "GiB", "nan", "inf"])
def test_bad_byte_sizes(text: str) -> None:
    import argparse

    with pytest.raises(argparse.ArgumentTypeError):
        byte_size(text)


def test_readme_serve_examples_build_valid_commands(capsys: pytest.CaptureFixture[str]) -> None:
    """Every ``kvtier serve`` line of the README gives a command vLLM accepts
    (running them for real: tests/test_serve_e2e.py)."""
    from test_serve_e2e import readme_serve_examples

    examples = readme_serve_examples()
    assert len(examples) >= 2
    for args in examples:
        assert main([*args[1:], "--print-command"]) == 0, args
        out = capsys.readouterr().out
        assert re.match(r"vllm serve \S+", out)


def test_no_vllm_option_is_taken_for_a_misspelt_kvtier_one() -> None:
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from kvtier.serve import _flag_name, _misspelt_own_flag, own_flags

    parser = make_arg_parser(FlexibleArgumentParser())
    vllm_flags = {o for a in parser._actions for o in a.option_strings if o.startswith("--")}
    assert len(vllm_flags) > 100
    own = own_flags()
    assert [f for f in vllm_flags if _misspelt_own_flag(_flag_name(f), own)] == []


def test_text_settings_stay_text_through_kvtier(capsys: pytest.CaptureFixture[str]) -> None:
    _, extra, err = printed(capsys, "--kvtier", "model_identity=20240601",
                            "--kvtier", 'eviction_policy="lru"', "--kvtier", "store_threshold=2")
    assert extra["model_identity"] == "20240601" and extra["eviction_policy"] == "lru"
    assert extra["store_threshold"] == 2
    _, extra, err = printed(capsys, "--kvtier", "tenant_salt=2024")
    assert extra["tenant_salt"] == "env:KVTIER_TENANT_SALT" and "KVTIER_TENANT_SALT" in err


@pytest.mark.parametrize(("args", "noted"), [
    ([], False), (["--api-server-count", "1"], False), (["--api-server-count=2"], True),
    (["-asc", "4"], True), (["--data-parallel-size", "2"], True),
    (["--data-parallel-size", "2", "--api-server-count", "1"], False),
    # vLLM's other defaults: one server per engine behind an external balancer,
    # the local engines' count behind a hybrid one, none headless
    (["-dp", "4", "--data-parallel-rank", "1"], False),
    (["-dp", "4", "--data-parallel-external-lb"], False),
    (["-dp", "4", "--data_parallel_external_lb", "--no-data-parallel-external-lb"], True),
    (["-dp", "4", "-dpm"], False),
    (["-dp", "4", "--data-parallel-hybrid-lb", "-dpl", "1"], False),
    (["-dp", "4", "--data-parallel-start-rank", "2", "-dpl", "2"], True),
    (["-dp", "4", "--data-parallel-hybrid-lb"], False),
    (["-dp", "4", "-dpl", "1"], True),
    (["-dp", "4", "--headless"], False),
])
def test_several_api_servers_are_told_what_they_do_to_the_gauges(
        capsys: pytest.CaptureFixture[str], args: list[str], noted: bool) -> None:
    # vLLM hands each step's stats to one API server: the others' gauges go stale
    _, _, err = printed(capsys, *args)
    assert ("kvtier's gauges" in err) == noted


@pytest.mark.parametrize(("args", "servers"), [
    ([], 1), (["-dp", "4"], 4), (["-dp", "4", "-asc", "2"], 2), (["-dp", "4", "--headless"], 0),
    (["-dp", "4", "--data-parallel-hybrid-lb", "-dpl", "3"], 3),
    (["-dp", "4", "--data-parallel-hybrid-lb"], 1), (["-dp", "4", "-dpn", "0"], 1),
    (["-dp", "x"], 1),
])
def test_api_servers_follow_vllms_defaults(args: list[str], servers: int) -> None:
    from kvtier.serve import api_servers

    assert api_servers(args) == servers
