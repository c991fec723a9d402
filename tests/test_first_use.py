"""kvtier as a vLLM production engineer first meets it: the engine log's word
on what kvtier set up, the README's ``kvtier serve`` example, the exit status of
``kvtier disk verify --repair``, and where ``kvtier serve`` keeps the Redis
password. Real specs (vLLM's own config types, no engine), real files, a real
redis-server and real child processes."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).parent.parent
PASSWORD = "nu-Secr3t-pw"
SALT = "nu-tenant-salt-71"
SLOT = 32768

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vllm(-cpu)")


# ------------------------------------------------------ start-up log line
def _spec(extra: dict[str, Any], tmp_path: Path, *, world: int = 1) -> Any:
    """A scheduler-side ``KVTierSpec`` as vLLM builds it (no engine); the model
    identity comes from a local checkpoint, as in tests/test_security.py."""
    from test_identity import _engine_config, checkpoint
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    from kvtier.vllm.spec import KVTierSpec

    model = tmp_path / "model"
    if not model.exists():
        checkpoint(model)
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(32, ("layer.0",), 0),), worker_kv_bytes_per_block=SLOT,
        enable_kv_cache_events=False, extra_config=extra, engine_id="newuser",
        model=OffloadingModelConfig(str(model), "bfloat16"),
        cache=OffloadingCacheConfig(32, 1),
        parallel=OffloadingParallelConfig(0, world, world, 1, 1, 1, 0, 1, None, False))
    spec = KVTierSpec(config)
    spec._vllm_config = _engine_config(str(model))  # what vLLM would pass
    return spec


def _started_line(spec: Any, caplog: pytest.LogCaptureFixture) -> str:
    """The INFO lines of ``kvtier.vllm.spec`` the scheduler's start logs (one)."""
    with caplog.at_level("INFO", logger="kvtier.vllm.spec"):
        manager = spec.get_manager()
    try:
        lines = [r.getMessage() for r in caplog.records
                 if r.name == "kvtier.vllm.spec" and r.levelname == "INFO"]
        assert len(lines) == 1, lines
        return lines[0]
    finally:
        manager.shutdown()


@needs_vllm
def test_the_scheduler_logs_one_line_naming_the_cpu_tier(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Fault: nothing in the engine's log said what kvtier set up: an operator
    could not tell a CPU-only engine from one with disk and Redis tiers."""
    line = _started_line(_spec({"cpu_bytes_to_use": 64 * SLOT, "eviction_policy": "lru",
                                "store_threshold": 2}, tmp_path), caplog)
    assert line.startswith("kvtier: tiers: CPU 64 blocks of 32.0 KiB (2.0 MiB)")
    assert "policy lru, store_threshold 2" in line
    assert "disk" not in line and "redis" not in line and "namespace" not in line


@needs_vllm
def test_the_line_names_every_tier_and_no_secret(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, redis_server: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Disk path and cap, the Redis endpoint without user, password or query,
    the namespace (what ``kvtier disk/redis inspect`` list), thresholds; the
    password and the salt (from the environment, as kvtier serve passes it)
    are nowhere in the line."""
    host_port = redis_server.url.split("://", 1)[1].split("/", 1)[0]
    url = f"redis://admin:{PASSWORD}@{host_port}/3?password={PASSWORD}&socket_keepalive=1"
    monkeypatch.setenv("NU_SALT", SALT)
    spec = _spec({"cpu_bytes_to_use": 64 * SLOT, "disk_path": str(tmp_path / "disk"),
                  "disk_bytes": "1GiB", "disk_store_threshold": 2, "redis_url": url,
                  "redis_write_policy": "evict", "redis_ttl_s": 600,
                  "tenant_salt": "env:NU_SALT"}, tmp_path)
    line = _started_line(spec, caplog)
    assert f"disk {tmp_path / 'disk'} (cap 1.0 GiB, write on store, threshold 2)" in line
    assert f"redis redis://{host_port}/3 (write on evict, threshold 1, ttl 600 s)" in line
    assert f"namespace {spec.namespace(0)}, tenant salted" in line
    assert "policy default, store_threshold 1" in line
    for secret in (PASSWORD, "admin", SALT, "socket_keepalive"):
        assert secret not in line


@needs_vllm
def test_a_tensor_parallel_engine_says_the_bytes_of_all_ranks(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    line = _started_line(_spec({"cpu_bytes_to_use": 64 * SLOT}, tmp_path, world=2), caplog)
    assert "CPU 32 blocks of 32.0 KiB on each of 2 ranks (2.0 MiB)" in line


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://:pw-1@h:6379/0", "redis://h:6379/0"),
    ("rediss://user:pw-1@h:6380/2?ssl_ca_certs=/ca.pem&password=pw-1", "rediss://h:6380/2"),
    ("unix://:pw-1@/run/redis.sock?db=4&password=pw-1", "unix:///run/redis.sock?db=4"),
    ("redis+cluster://u:pw-1@h:7000", "redis+cluster://h:7000"),
    ("redis://:pw/1@x@h:6379/0", "redis://h:6379"),  # a misplaced '@': host only
])
def test_the_endpoint_of_a_redis_url_holds_no_credentials(url: str, shown: str) -> None:
    from kvtier.secrets import url_endpoint

    assert url_endpoint(url) == shown
    assert "pw" not in url_endpoint(url)


_LOG_THROUGH_VLLM = textwrap.dedent("""
    import sys
    sys.path.insert(0, sys.argv[1] + "/tests")
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging

    configure_logging(LoggingConfig())  # what vLLM's engine process does first
    from pathlib import Path
    from test_first_use import _spec

    _spec({"cpu_bytes_to_use": 64 * 32768}, Path(sys.argv[2])).get_manager().shutdown()
""")


@needs_vllm
def test_kvtiers_records_reach_vllms_log(tmp_path: Path) -> None:
    """Fault: vLLM gives a handler to its own logger only, so kvtier's INFO
    records (this line, the weights fingerprint) were dropped by Python's
    last-resort handler and its warnings printed without vLLM's prefix. A
    real process that configures logging as vLLM's engine does."""
    # vLLM's default level (INFO): an earlier test in this process may have set another
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_TARGET_DEVICE": "cpu",
           "VLLM_LOGGING_STREAM": "ext://sys.stdout", "VLLM_LOGGING_LEVEL": "INFO"}
    done = subprocess.run([sys.executable, "-c", _LOG_THROUGH_VLLM, str(REPO), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "kvtier: tiers:" in line]
    assert len(lines) == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert " INFO " in lines[0] and "[spec.py:" in lines[0]  # vLLM's format
    assert "CPU 64 blocks" in lines[0]


# ------------------------------------------------------ disk verify --repair
def _disk_with_two_bad_blocks(tmp_path: Path) -> tuple[Path, list[Path]]:
    """A real disk tier of 4 blocks, one flipped bit and one truncated file."""
    from helpers.disk_blocks import make_disk, payload

    from kvtier import block_key
    from kvtier.tiers import KVLayout
    from kvtier.tiers.disk_dir import LAYOUT_DIR, fan_out_index

    ns = KVLayout("newuser", "bfloat16", 16, 2, 2, 64).namespace()
    tier = make_disk(tmp_path / "cache", ns)
    assert tier.put([(block_key(i), payload(i)) for i in range(4)]) == [True] * 4
    tier.close()
    bad = []
    for i in (1, 2):
        key = block_key(i)
        path = tmp_path / "cache" / LAYOUT_DIR / ns / f"{fan_out_index(key):02x}" / \
            f"{key.hex()}.kvb"
        data = path.read_bytes()
        path.write_bytes(data[:-10] + bytes([data[-10] ^ 1]) + data[-9:] if i == 1
                         else data[:60])
        bad.append(path)
    return tmp_path / "cache", bad


def _verify(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    from kvtier.cli import main

    code = main(["disk", "verify", *argv])
    return code, capsys.readouterr().out


def test_a_repair_that_removed_every_bad_block_exits_0(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Fault: ``verify --repair`` exited 1 after it had removed every bad
    block, so a cron job or systemd timer running it reported each
    successful repair as a failure. Now 1 means a bad block is left."""
    cache, bad = _disk_with_two_bad_blocks(tmp_path)
    code, out = _verify(capsys, str(cache))
    assert code == 1 and "2 bad blocks" in out  # without --repair: found, kept
    code, out = _verify(capsys, str(cache), "--repair")
    assert code == 0, out
    assert "2 bad blocks" in out and "removed 2 bad blocks" in out  # still reported
    assert not any(p.exists() for p in bad)
    assert _verify(capsys, str(cache))[0] == 0


@pytest.mark.parametrize("left", ["unreadable", "not removed"])
def test_a_repair_that_left_a_bad_block_exits_1(
        left: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad block the repair leaves (a read error may pass, so it is kept; a
    file it cannot remove) keeps the exit status at 1. The faults are
    injected: root reads and removes any file."""
    from kvtier.tools import disk_admin

    cache, bad = _disk_with_two_bad_blocks(tmp_path)
    if left == "unreadable":
        real = disk_admin.read_block_file

        def failing(path: str) -> object:
            if path == str(bad[0]):
                raise OSError(5, "Input/output error")
            return real(path)

        monkeypatch.setattr(disk_admin, "read_block_file", failing)
    else:
        real_remove = disk_admin.remove_if_same
        monkeypatch.setattr(disk_admin, "remove_if_same",
                            lambda path, ident: path != str(bad[0]) and real_remove(path, ident))
    code, out = _verify(capsys, str(cache), "--repair")
    assert code == 1, out
    assert bad[0].exists() and not bad[1].exists()


def test_verify_help_says_what_the_exit_status_of_a_repair_means() -> None:
    done = subprocess.run([sys.executable, "-m", "kvtier", "disk", "verify", "--help"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    text = " ".join(done.stdout.split())
    assert "0 when every bad block found was removed, 1 when any is left" in text
    readme = " ".join((REPO / "README.md").read_text().split())
    assert "0 when every bad block found was removed (the report still lists them), 1 " \
           "when any bad block remains" in readme


# ------------------------------------------------------ the Redis password and argv
def _cmdlines_until_exec(argv: list[str], env: dict[str, str],
                         timeout_s: float = 120.0) -> tuple[list[bytes], bytes]:
    """Start ``argv``, read its /proc cmdline until it has become vLLM's server
    (``kvtier.launch``), then its environment; kill it. Returns (every distinct
    command line seen, the environment of the server)."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    seen: list[bytes] = []
    environ = b""
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
                    cmdline = f.read()
                if b"kvtier.launch" in cmdline:
                    with open(f"/proc/{proc.pid}/environ", "rb") as f:
                        environ = f.read()
            except (FileNotFoundError, ProcessLookupError):
                break
            if cmdline and (not seen or seen[-1] != cmdline):
                seen.append(cmdline)
            if environ:
                break
            time.sleep(0.002)
    finally:
        proc.kill()
        _, err = proc.communicate()
    assert environ, (seen, err.decode(errors="replace")[-2000:])
    return seen, environ


@needs_vllm
def test_a_password_file_keeps_the_password_off_every_command_line(tmp_path: Path) -> None:
    """Fault: the only way to give ``kvtier serve`` the Redis password on the
    command line was the URL, and ``kvtier serve``'s own argv holds it (ps,
    /proc/PID/cmdline) for the seconds its checks take before it execs vLLM
    (vLLM's argv never had it). ``--redis-password-file`` reads it from a
    file; a real ``kvtier serve`` is watched from start to exec: no command
    line ever holds the password, and vLLM's server has it in its environment,
    where the Redis tier reads it."""
    secret = tmp_path / "redis.pw"
    secret.write_text(PASSWORD + "\n")
    secret.chmod(0o600)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("KVTIER_REDIS_PASSWORD", None)
    seen, environ = _cmdlines_until_exec(
        [sys.executable, "-m", "kvtier", "serve", str(tmp_path / "model"), "--cpu-bytes", "1MiB",
         "--redis-url", "redis://127.0.0.1:1/0", "--redis-password-file", str(secret),
         "--port", "0"], env)
    assert seen and b"kvtier.launch" in seen[-1]
    assert not any(PASSWORD.encode() in cmdline for cmdline in seen)
    assert f"KVTIER_REDIS_PASSWORD={PASSWORD}".encode() in environ.split(b"\0")


def _serve(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    from kvtier.cli import main

    code = main(["serve", "/models/m", "--cpu-bytes", "1MiB", *args, "--print-command"])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_password_typed_in_the_url_is_said_to_be_visible(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The URL's password still works (vLLM's command line never holds it),
    but the user is told their own command line did, and what to use."""
    code, out, err = _serve(capsys, "--redis-url", f"redis://:{PASSWORD}@h:1/0")
    assert code == 0 and PASSWORD not in out + err
    assert "this command line holds the Redis password" in err
    assert "--redis-password-file" in err
    secret = tmp_path / "pw"
    secret.write_text(PASSWORD)
    code, out, err = _serve(capsys, "--redis-url", "redis://h:1/0",
                            "--redis-password-file", str(secret))
    assert code == 0 and PASSWORD not in out + err
    assert "this command line holds" not in err
    assert "set KVTIER_REDIS_PASSWORD" in err  # --print-command: where the secret goes


@pytest.mark.parametrize(("content", "url", "named"), [
    (None, "redis://h:1/0", "No such file"),
    ("\n", "redis://h:1/0", "first line is empty"),
    ("x" * 5000, "redis://h:1/0", "not a password file"),
    (PASSWORD, None, "needs a Redis tier"),
    (PASSWORD, "redis://:other@h:1/0", "give it once"),
])
def test_a_password_file_that_cannot_serve_is_named(
        content: str | None, url: str | None, named: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    secret = tmp_path / "pw"
    if content is not None:
        secret.write_text(content)
    args = ["--redis-password-file", str(secret)]
    if url is not None:
        args += ["--redis-url", url]
    code, _, err = _serve(capsys, *args)
    assert code == 2 and named in err and "--redis-password-file" in err
    assert PASSWORD not in err


# ------------------------------------------------------ the README's kvtier serve example
def test_the_readme_serve_examples_leave_kvtier_work_to_show() -> None:
    """Fault: the README's ``kvtier serve`` example gave the engine a 256 MiB
    KV cache, 8,192 blocks of the tiny model: a newcomer's requests all fit
    in it and kvtier served nothing. Each example now caps the engine's cache
    below what the README's prompts (three of 900 tokens) need, while it
    still holds one request of --max-model-len (vLLM refuses less), and the
    prompts fit --max-model-len."""
    import re
    import shlex

    from test_serve_e2e import readme_serve_examples

    from kvtier.demo.tiny_model import kv_bytes_per_block

    text = (REPO / "README.md").read_text()
    snippet = re.search(r"range\((\d+)\)\)\)\" \"\$1\"; \}\nfor s in ([\d ]+); do", text)
    assert snippet, "the README's prompts snippet"
    prompt_tokens = int(snippet.group(1)) + 1  # the tokenizer's BOS
    distinct = len(set(snippet.group(2).split()))
    max_tokens = int(re.search(r'max_tokens\\": (\d+)\}', text).group(1))  # type: ignore[union-attr]
    examples = readme_serve_examples()
    assert len(examples) >= 2
    for example in examples:
        args = dict(zip(example, [*example[1:], ""], strict=True))
        block, model_len = int(args["--block-size"]), int(args["--max-model-len"])
        blocks = (int(args["--num-gpu-blocks-override"]) if "--num-gpu-blocks-override" in args
                  else int(args["--kv-cache-memory-bytes"]) // kv_bytes_per_block(block))
        engine_tokens = blocks * block
        assert model_len <= engine_tokens < distinct * prompt_tokens, shlex.join(example)
        assert prompt_tokens + max_tokens <= model_len


# ------------------------------------------------------ kvtier serve without a model
@pytest.mark.parametrize("args", [["/models/m"], ["--port", "8000"], ["--model", "/models/m"],
                                  ["--model=/models/m"], ["--config", "serve.yaml"]])
def test_serve_goes_on_when_the_arguments_may_name_a_model(
        capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    from kvtier.cli import main

    code = main(["serve", *args, "--cpu-bytes", "1MiB", "--print-command"])
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize("args", [[], ["--enforce-eager"], ["--block-size=32"]])
def test_serve_without_a_model_is_refused_before_vllm_starts(
        capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    """vLLM would serve its default hub model: seconds of imports, then a
    traceback about reaching the hub. kvtier says what is missing, at once."""
    from kvtier.cli import main

    code = main(["serve", "--cpu-bytes", "1MiB", *args, "--print-command"])
    err = capsys.readouterr().err
    assert code == 2 and "name the model to serve: kvtier serve MODEL" in err
