"""What a user walking the README meets with ``kvtier serve`` and the kvtier
settings: a chunked ``block_size`` refused before the engine loads its
weights, ``~`` in ``disk_path``, size suffixes in the byte settings, and the
warning for a Redis server that would keep kvtier's blocks without bound.

No engine starts here: every ``kvtier serve`` call prints its command."""

from __future__ import annotations

import json
import logging
import shlex
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from kvtier import block_key
from kvtier.cli import main
from kvtier.tiers.namespace import KVLayout
from kvtier.vllm.settings import ConfigError, KVTierSettings

ENGINE = ["--block-size", "32", "--max-model-len", "1024"]
ONE_BLOCK = "stores one engine block per slot"


def serve(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, Any], str]:
    """``kvtier serve /models/m ARGS... --print-command``: (status, the
    kv_connector_extra_config printed (empty when refused), stderr)."""
    try:
        status = main(["serve", "/models/m", *args, "--print-command"])
    except SystemExit as exc:  # argparse's own errors
        status = int(exc.code or 0)
    out = capsys.readouterr()
    extra: dict[str, Any] = {}
    if status == 0:
        argv = shlex.split(out.out)
        transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        extra = transfer["kv_connector_extra_config"]
    return status, extra, out.err


# ------------------------------------------------- (1) chunked blocks, up front
@pytest.mark.parametrize("args", [
    ["--kvtier", "block_size=64", *ENGINE],
    ["--kvtier", "block_size=32"],  # the engine's block size is not known here
    ["--kvtier", "blocks_per_chunk=2", *ENGINE],
    ["--kvtier", "blocks_per_chunk=1", "--kvtier", "block_size=32", *ENGINE],
])
def test_serve_refuses_a_chunked_block_size_before_the_engine_starts(
        capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    status, _, err = serve(capsys, *args)
    assert status == 2
    assert ONE_BLOCK in err and "leave both 'block_size' and 'blocks_per_chunk' unset" in err


@pytest.mark.parametrize("args", [
    ["--kvtier", "block_size=32", *ENGINE],  # one engine block per chunk
    ["--kvtier", "blocks_per_chunk=1", *ENGINE],
])
def test_serve_keeps_a_block_size_of_one_block_per_chunk(
        capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    status, extra, err = serve(capsys, *args)
    assert status == 0, err
    assert "block_size" in extra or "blocks_per_chunk" in extra


# ------------------------------------------------- (2) ~ in disk_path
@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home directory of its own, and a working directory apart from it."""
    home = tmp_path / "home"
    home.mkdir()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    return home


@pytest.mark.parametrize("form", ["flag", "kvtier"])
def test_serve_expands_the_home_directory_in_disk_path(
        capsys: pytest.CaptureFixture[str], home: Path, form: str) -> None:
    # the shell leaves "--disk-path=~/kv" as written
    path = ["--disk-path=~/kv"] if form == "flag" else ["--kvtier", "disk_path=~/kv"]
    status, extra, err = serve(capsys, *path, "--disk-bytes", "1G")
    assert status == 0, err
    assert extra["disk_path"] == str(home / "kv")
    assert not (Path.cwd() / "~").exists()


def test_settings_expand_the_home_directory_in_disk_path(home: Path) -> None:
    settings = KVTierSettings.from_extra_config(
        {"cpu_bytes_to_use": 1 << 20, "disk_path": "~/kv", "disk_bytes": 1 << 30})
    assert settings.disk_path == str(home / "kv")


def test_a_home_directory_that_cannot_be_expanded_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"disk_path '~no-such-user-kvtier/kv': cannot "):
        KVTierSettings.from_extra_config({"cpu_bytes_to_use": 1 << 20,
                                          "disk_path": "~no-such-user-kvtier/kv",
                                          "disk_bytes": 1 << 30})


# ------------------------------------------------- (3) sizes in byte settings
@pytest.mark.parametrize(("value", "expected"), [
    ("10GiB", 10 << 30), ("8e9", 8 * 10**9), ("2G", 2 * 10**9), ("1048576", 1 << 20),
])
def test_serve_reads_byte_settings_as_the_flags_do(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, value: str, expected: int) -> None:
    status, extra, err = serve(capsys, "--disk-path", str(tmp_path / "kv"),
                               "--kvtier", f"disk_bytes={value}",
                               "--kvtier", "cpu_bytes_to_use=64MiB")
    assert status == 0, err
    assert extra["disk_bytes"] == expected  # vLLM gets the int
    assert extra["cpu_bytes_to_use"] == 64 << 20


def test_transfer_config_byte_settings_take_sizes_and_ints(tmp_path: Path) -> None:
    disk = str(tmp_path / "kv")
    settings = KVTierSettings.from_extra_config(
        {"cpu_bytes_to_use": "8GiB", "disk_path": disk, "disk_bytes": "200G"})
    assert (settings.cpu_bytes_to_use, settings.disk_bytes) == (8 << 30, 200 * 10**9)
    settings = KVTierSettings.from_extra_config(
        {"cpu_bytes_to_use": 8 << 30, "disk_path": disk, "disk_bytes": 10**9})
    assert (settings.cpu_bytes_to_use, settings.disk_bytes) == (8 << 30, 10**9)


@pytest.mark.parametrize(("key", "value"), [
    ("disk_bytes", "10XB"), ("disk_bytes", "0"), ("cpu_bytes_to_use", "lots"),
    ("cpu_bytes_to_use", 1.5),
])
def test_a_bad_byte_setting_is_refused_by_name(tmp_path: Path, key: str, value: object) -> None:
    extra = {"cpu_bytes_to_use": 1 << 20, "disk_path": str(tmp_path), "disk_bytes": 1 << 20}
    extra[key] = value
    with pytest.raises(ConfigError, match=rf"^{key}"):
        KVTierSettings.from_extra_config(extra)


def test_every_byte_setting_takes_sizes() -> None:
    from kvtier.vllm.settings import BYTE_KEYS

    assert {f.name for f in fields(KVTierSettings) if "bytes" in f.name} == set(BYTE_KEYS)


# ------------------------------------------------- (4) an unbounded Redis server
SIZE = 4096
NS = KVLayout("ux-model", "bfloat16", 16, 2, 2, 64).namespace()
REDIS_LOGGER = "kvtier.tiers.redis_tier"


@pytest.fixture
def server_with() -> Iterator[Any]:
    """Start a local redis-server with the given config (closed after the test)."""
    pytest.importorskip("redis", reason="the redis extra (redis-py) is not installed")
    from kvtier.tiers.redis_server import RedisServer, find_server_binary

    if find_server_binary() is None:
        pytest.skip("no redis-server or valkey-server binary")
    started: list[RedisServer] = []

    def start(config: dict[str, str]) -> RedisServer:
        started.append(RedisServer(config=config).start())
        return started[-1]

    yield start
    for server in started:
        server.close()


def use_tier(url: str) -> None:
    """Store, read and check through a fresh tier, as an engine's would."""
    import numpy as np

    from kvtier.tiers.redis_tier import RedisTier

    tier = RedisTier(url, NS, password_env=None)
    try:
        for i in range(3):
            value = np.full(SIZE, i, dtype=np.uint8)
            assert tier.put([(block_key(i), value)]) == [True]
            got = tier.get([block_key(i)])[0]
            assert got is not None and bytes(got) == value.tobytes()
        tier.check()
        tier.check()
    finally:
        tier.close()


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == REDIS_LOGGER and r.levelno >= logging.WARNING]


@pytest.mark.parametrize(("config", "named"), [
    ({}, "no maxmemory"),  # redis-server's (and Debian's) default: unlimited
    ({"maxmemory": "64mb", "maxmemory-policy": "noeviction"}, "noeviction"),
])
def test_an_unbounded_redis_server_is_warned_of_once(
        server_with: Any, caplog: pytest.LogCaptureFixture, config: dict[str, str],
        named: str) -> None:
    caplog.set_level(logging.WARNING, logger=REDIS_LOGGER)
    server = server_with(config)
    use_tier(server.url)
    said = warnings_of(caplog)
    assert len(said) == 1, said
    assert named in said[0] and "maxmemory" in said[0] and "allkeys-lru" in said[0]
    assert server.url in said[0]


def test_the_warning_comes_at_the_first_call_without_check(
        server_with: Any, caplog: pytest.LogCaptureFixture) -> None:
    """An engine never calls ``check()``: its first store must warn."""
    import numpy as np

    from kvtier.tiers.redis_tier import RedisTier

    caplog.set_level(logging.WARNING, logger=REDIS_LOGGER)
    tier = RedisTier(server_with({}).url, NS, password_env=None)
    try:
        assert tier.put([(block_key(1), np.zeros(SIZE, dtype=np.uint8))]) == [True]
        assert len(warnings_of(caplog)) == 1
    finally:
        tier.close()


@pytest.mark.parametrize("config", [
    {"maxmemory": "64mb", "maxmemory-policy": "allkeys-lru"},
    # a user that may not run INFO: no warning, and the tier still serves
    {"user": "default on nopass ~* &* +@all -info"},
])
def test_a_bounded_or_silent_redis_server_gets_no_warning(
        server_with: Any, caplog: pytest.LogCaptureFixture, config: dict[str, str]) -> None:
    import redis

    caplog.set_level(logging.WARNING, logger=REDIS_LOGGER)
    server = server_with(config)
    if "user" in config:
        client = redis.Redis(port=server.port)
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.info("memory")
        client.close()
    use_tier(server.url)
    assert warnings_of(caplog) == []


def test_the_size_parser_names_a_value_that_is_not_text() -> None:
    from kvtier.argtypes import parse_byte_size

    with pytest.raises(TypeError, match="is text, got int"):
        parse_byte_size(8)  # type: ignore[arg-type]
