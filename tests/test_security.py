"""Security checks (issue 10, item 6), on real parts: redis-server processes
started here (loopback only), real files, real TLS certificates made with openssl.

1. Redis ACL users and TLS with certificate and host name verification.
2. No secret (Redis password, tenant salt) in any log record, ``repr``, error
   message or metric.
3. Private files (0600) and directories (0700), even under umask 0.
4. A tenant's salt keeps other tenants' engines from reading its blocks, on
   disk and in Redis, even when a value is copied under their names.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_tier_disk import block_files
from test_tier_redis import _make_tls_files, payload, start

from kvtier import OffloadManager, block_key
from kvtier.secrets import redact_url, split_url_password
from kvtier.slots import SlotRegion
from kvtier.slots.region import default_shm_dir
from kvtier.tiers import DiskTier, KVLayout, TierConfigError, TierUnavailableError
from kvtier.tiers.disk_dir import LAYOUT_DIR, MANIFEST_NAME
from kvtier.tiers.redis_server import RedisServer, TLSFiles, free_port
from kvtier.vllm.settings import ConfigError, KVTierSettings

redis = pytest.importorskip("redis", reason="the redis extra (redis-py) is not installed")
from kvtier.tiers.redis_tier import RedisTier  # noqa: E402

LAYOUT = KVLayout("test-model", "bfloat16", 16, 2, 2, 64)
NS = LAYOUT.namespace()
ADMIN_PW = "adm1n-Pw-5ecret-91c"
"""The server's ``requirepass`` (its ``default`` user)."""
ALICE_PW = "al1ce-Pw-5ecret-3e7"
WRONG_PW = "wr0ng-Pw-5ecret-b2a"
SALT = "t3nant-Salt-5ecret-d4f"
OTHER_SALT = "0ther-Salt-5ecret-a6b"
SECRETS = (ADMIN_PW, ALICE_PW, WRONG_PW, SALT, OTHER_SALT)
KVTIER_COMMANDS = ("get", "set", "exists", "del", "ping", "info")
"""What an engine's Redis tier sends (``kvtier/tiers/redis_tier.py``): the
minimal command set of a production ACL user (docs/guarantees.md, "Security")."""
SIZE = 4096


def assert_no_secret(*texts: object) -> None:
    """None of ``SECRETS`` appears in any of ``texts`` (each as ``str``)."""
    joined = "\n".join(str(t) for t in texts)
    for secret in SECRETS:
        assert secret not in joined, f"secret {secret[:6]}... shown in: {joined[:2000]}"


def logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every captured record, formatted with its arguments and any traceback."""
    handler = logging.StreamHandler()
    return [handler.format(r) for r in caplog.records] + [caplog.text]


@pytest.fixture(scope="module")
def acl_server() -> Iterator[RedisServer]:
    """A server whose ``default`` user needs ``ADMIN_PW``, with two ACL users:
    ``alice`` (the kvtier command set on ``kvtier:*`` keys, configured by the
    ``user`` line of docs/guarantees.md, "Security") and ``mallory`` (the same
    commands on ``other:*``)."""
    commands = ["-@all", *(f"+{c}" for c in KVTIER_COMMANDS)]
    srv = start(password=ADMIN_PW,
                config={"user": " ".join(["alice", "on", f">{ALICE_PW}", "~kvtier:*",
                                          *commands])})
    admin = redis.Redis(port=srv.port, password=ADMIN_PW)
    admin.acl_setuser("mallory", enabled=True, passwords=[f"+{ALICE_PW}"], keys=["other:*"],
                      commands=commands)
    admin.close()
    yield srv
    srv.close()


@pytest.fixture
def admin(acl_server: RedisServer) -> Iterator[object]:
    """A raw client of ``acl_server`` as its ``default`` user, on an empty db."""
    client = redis.Redis(port=acl_server.port, password=ADMIN_PW)
    client.flushdb()
    yield client
    client.close()


def url(srv: RedisServer, user: str = "", password: str = "", host: str = "127.0.0.1",
        query: str = "") -> str:
    """``srv``'s URL with ``user:password@`` and ``?query`` when given."""
    scheme = "rediss" if srv.tls else "redis"
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    return f"{scheme}://{auth}{host}:{srv.port}/0" + (f"?{query}" if query else "")


def make(address: str, namespace: str = NS, **kw: object) -> RedisTier:
    kw.setdefault("enable_events", True)
    kw.setdefault("password_env", None)
    return RedisTier(address, namespace, **kw)  # type: ignore[arg-type]


def round_trip(tier: RedisTier, i: int = 1) -> None:
    """Store block ``i`` and read it back through ``tier``."""
    key = block_key(i)
    assert tier.put([(key, payload(i, SIZE))]) == [True]
    assert tier.contains([key]) == [True]
    got = tier.get([key])[0]
    assert got is not None and bytes(got) == payload(i, SIZE).tobytes()


def fails_closed(tier: RedisTier, key: bytes) -> None:
    """Every call of ``tier`` is a miss or a dropped store, never a hit or a raise."""
    for _ in range(3):
        assert tier.get([key]) == [None]
        assert tier.contains([key]) == [False]
        assert tier.put([(key, payload(9, SIZE))]) == [False]
    assert tier.stats()["hits"] == 0


# ============================================================== 1. ACL users
def test_acl_user_limited_to_kvtier_keys_serves(acl_server: RedisServer, admin: object) -> None:
    tier = make(url(acl_server, "alice", ALICE_PW))
    round_trip(tier)
    assert tier.delete([block_key(1)]) == 1
    info = tier.check()  # PING and INFO are allowed
    assert info["redis_version"]
    # A damaged value is removed (DEL) and counted, under the same user.
    round_trip(tier, 2)
    admin.set(f"kvtier:{NS}:".encode() + block_key(2), b"KVTB" + b"\0" * 60)  # type: ignore[attr-defined]
    assert tier.get([block_key(2)]) == [None]
    assert tier.stats()["corrupt"] == 1
    assert admin.exists(f"kvtier:{NS}:".encode() + block_key(2)) == 0  # type: ignore[attr-defined]
    # The ACL really binds alice: other keys and other commands are refused.
    alice = redis.Redis(port=acl_server.port, username="alice", password=ALICE_PW)
    with pytest.raises(redis.exceptions.NoPermissionError):
        alice.set("other:x", b"1")
    with pytest.raises(redis.exceptions.NoPermissionError):
        alice.keys("*")
    alice.close()
    tier.close()


def test_acl_wrong_password_fails_closed_and_is_never_shown(
    acl_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    tier = make(url(acl_server, "alice", WRONG_PW), failure_threshold=2)
    fails_closed(tier, block_key(1))
    assert tier.stats()["breaker_state"] == "open" and int(tier.stats()["errors"]) >= 2
    with pytest.raises(TierUnavailableError, match="invalid username-password") as err:
        tier.check()
    opened = [r.getMessage() for r in caplog.records if "breaker open" in r.getMessage()]
    assert opened and "AuthenticationError" in opened[0]  # the warning names the cause
    assert_no_secret(*logged(caplog), repr(tier), str(tier), err.value, tier.stats(),
                     tier.take_events(), tier.safe_url)
    assert "alice:***@" in repr(tier)


def test_acl_user_without_the_kvtier_keys_gets_misses_not_errors_raised(
    acl_server: RedisServer, admin: object, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    make(url(acl_server, "alice", ALICE_PW)).put([(block_key(1), payload(1, SIZE))])
    tier = make(url(acl_server, "mallory", ALICE_PW))
    fails_closed(tier, block_key(1))
    stats = tier.stats()
    assert int(stats["errors"]) > 0 and stats["breaker_state"] == "closed"  # server answers
    assert admin.exists(f"kvtier:{NS}:".encode() + block_key(1)) == 1  # type: ignore[attr-defined]
    assert any("NoPermissionError" in m or "NOPERM" in m for m in logged(caplog))
    assert_no_secret(*logged(caplog), repr(tier))


# ============================================================== 1. TLS
@dataclass(frozen=True)
class TLSSetup:
    server: RedisServer
    files: TLSFiles
    """The server's certificate, key and the CA that signed them."""
    other: TLSFiles
    """Another CA (and a server certificate of its own, unused)."""


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSSetup]:
    files = _make_tls_files(tmp_path_factory.mktemp("ca-server"))
    other = _make_tls_files(tmp_path_factory.mktemp("ca-other"))
    try:
        srv = start(tls=files, password=ADMIN_PW)
    except RuntimeError as exc:
        pytest.skip(f"this redis-server has no TLS support: {exc}")
    yield TLSSetup(srv, files, other)
    srv.close()


def test_tls_with_the_ca_in_the_plugin_settings_reads_and_writes(tls: TLSSetup) -> None:
    """The URL query form, validated by the plug-in's settings and passed as is
    to ``RedisTier`` (as ``KVTierSpec._redis_tier`` does), reaches redis-py's
    TLS connection: the server's CA given, the tier reads and writes."""
    address = url(tls.server, password=ADMIN_PW,
                  query=f"ssl_cert_reqs=required&ssl_ca_certs={tls.files.ca}")
    settings = KVTierSettings.from_extra_config({"cpu_bytes_to_use": 1 << 20,
                                                 "redis_url": address})
    assert settings.redis_url is not None
    tier = make(settings.redis_url)
    round_trip(tier)
    pool = tier._client().connection_pool
    assert pool.connection_class is redis.connection.SSLConnection
    assert pool.connection_kwargs["ssl_ca_certs"] == str(tls.files.ca)
    tier.close()


@pytest.mark.parametrize("how", ["url", "client_options"])
def test_tls_server_signed_by_another_ca_is_refused(
    tls: TLSSetup, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    caplog.set_level(logging.DEBUG)
    make(url(tls.server, password=ADMIN_PW, query=f"ssl_ca_certs={tls.files.ca}")).put(
        [(block_key(1), payload(1, SIZE))])
    if how == "url":
        tier = make(url(tls.server, password=ADMIN_PW,
                        query=f"ssl_cert_reqs=required&ssl_ca_certs={tls.other.ca}"),
                    failure_threshold=1)
    else:
        tier = make(url(tls.server, password=ADMIN_PW), failure_threshold=1,
                    client_options={"ssl_ca_certs": str(tls.other.ca)})
    fails_closed(tier, block_key(1))
    assert tier.stats()["breaker_state"] == "open"
    with pytest.raises(TierUnavailableError, match="CERTIFICATE_VERIFY_FAILED") as err:
        tier.check()
    opened = [r.getMessage() for r in caplog.records if "breaker open" in r.getMessage()]
    assert opened and "certificate verify failed" in opened[0]
    assert_no_secret(*logged(caplog), err.value, repr(tier), tier.stats())


def test_tls_host_name_mismatch_is_refused(tls: TLSSetup) -> None:
    """The server's certificate is for 127.0.0.1 only; ``localhost`` reaches the
    same server but does not match it."""
    query = f"ssl_ca_certs={tls.files.ca}"
    make(url(tls.server, password=ADMIN_PW, query=query)).put([(block_key(1), b"x")])
    tier = make(url(tls.server, password=ADMIN_PW, host="localhost", query=query),
                failure_threshold=1)
    fails_closed(tier, block_key(1))
    with pytest.raises(TierUnavailableError, match="Hostname mismatch") as err:
        tier.check()
    assert_no_secret(err.value)
    # Control: the same URL without the host name check connects.
    unchecked = make(url(tls.server, password=ADMIN_PW, host="localhost",
                         query=f"{query}&ssl_check_hostname=false"))
    assert unchecked.contains([block_key(1)]) == [True]


def test_tls_client_certificate_in_the_url(tls: TLSSetup) -> None:
    """Mutual TLS: a server that asks for a client certificate (signed by its
    CA) refuses a client without one; the URL's ``ssl_certfile``/``ssl_keyfile``
    give it one (the server's own pair here: the same CA signed it)."""
    srv = start(tls=tls.files, password=ADMIN_PW, config={"tls-auth-clients": "yes"})
    try:
        query = f"ssl_ca_certs={tls.files.ca}"
        anonymous = make(url(srv, password=ADMIN_PW, query=query), failure_threshold=1)
        fails_closed(anonymous, block_key(1))
        with pytest.raises(TierUnavailableError):
            anonymous.check()
        client = make(url(srv, password=ADMIN_PW, query=f"{query}&ssl_certfile="
                          f"{tls.files.cert}&ssl_keyfile={tls.files.key}"))
        round_trip(client)
    finally:
        srv.close()


@pytest.mark.parametrize(("query", "named"), [
    ("ssl_ca_cert=/etc/ssl/ca.pem", "ssl_ca_cert"),  # misspelt: not redis-py's ssl_ca_certs
    ("ssl_cert_reqs=requird", "requird"),
])
def test_a_bad_tls_option_is_a_config_error_at_start(query: str, named: str) -> None:
    """Without the check at construction, a misspelt option raised TypeError from
    every call and a bad value logged a warning per call, forever."""
    address = f"rediss://:{ADMIN_PW}@127.0.0.1:{free_port()}/0?{query}"
    with pytest.raises(TierConfigError, match=named) as err:
        make(address)
    assert_no_secret(err.value)


# ============================================================== 2. no secret shown
def test_no_secret_in_logs_or_reprs_while_connecting_and_failing(
    acl_server: RedisServer, admin: object, tmp_path: Path,
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    caplog.set_level(logging.DEBUG)  # every logger: kvtier's and redis-py's
    salted = LAYOUT.namespace(SALT)
    shown: list[object] = []
    good = make(url(acl_server, password=ADMIN_PW), salted)
    round_trip(good)
    shown += [repr(good), str(good), good.check(), good.stats()]
    port = free_port()  # nothing listens there
    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", ADMIN_PW)
    for tier in (
        make(f"redis://:{ADMIN_PW}@127.0.0.1:{port}/0", salted, failure_threshold=1,
             connect_timeout_s=0.2),
        make(url(acl_server, password=WRONG_PW), salted, failure_threshold=1),
        make(f"redis://127.0.0.1:{port}/0", salted, failure_threshold=1,
             connect_timeout_s=0.2, password_env="KVTIER_REDIS_PASSWORD"),
    ):
        fails_closed(tier, block_key(1))
        with pytest.raises(TierUnavailableError) as err:
            tier.check()
        shown += [repr(tier), err.value, tier.stats(), tier.take_events()]
    disk = DiskTier(tmp_path / "disk", salted, 1 << 20, free_reserve_bytes=0,
                    manifest={"model": "test-model"})
    disk.put([(block_key(1), payload(1, SIZE))])
    shown += [repr(disk), disk.stats(), repr(LAYOUT), (disk.root / MANIFEST_NAME).read_text()]
    shown += [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")]
    shown += admin.keys("*")  # type: ignore[attr-defined]
    settings = KVTierSettings.from_extra_config({
        "cpu_bytes_to_use": 1 << 20, "redis_url": url(acl_server, "alice", ALICE_PW),
        "tenant_salt": SALT})
    assert settings.tenant_salt == SALT
    shown += [repr(settings), str(settings)]
    assert "alice:***@" in repr(settings)
    assert_no_secret(*logged(caplog), *shown)
    assert any("breaker open" in m for m in logged(caplog))  # failures were logged


@pytest.mark.parametrize(("address", "why"), [
    (f"redis://:pa/ss-{ADMIN_PW}@127.0.0.1:1/0", "outside its user:password"),  # unencoded /
    (f"redis://:pa?ss-{ADMIN_PW}@127.0.0.1:1/0", "outside its user:password"),
    (f"redis://:pa#ss-{ADMIN_PW}@127.0.0.1:1/0", "outside its user:password"),
    (f"redis://alice:12/{ADMIN_PW}@127.0.0.1:1/0", "outside its user:password"),
    (f"http://:{ADMIN_PW}@127.0.0.1:1/0", "scheme"),
    (f"redis://:{ADMIN_PW}@127.0.0.1:notaport/0", "Port"),
    (f"redis://:{ADMIN_PW}@127.0.0.1:1/0?ssl_bogus=1", "ssl_bogus"),
])
def test_a_malformed_url_is_refused_without_showing_its_password(address: str, why: str) -> None:
    """Before the check, a password with an unencoded '/' was logged whole
    (the URL parser saw no password to redact) and pieces of it reached
    redis-py's errors as a "host" or "port"."""
    assert_no_secret(redact_url(address))
    with pytest.raises(TierConfigError, match=why) as err:
        make(address)
    assert_no_secret(err.value)
    extra = {"cpu_bytes_to_use": 1, "redis_url": address}
    if "outside" in why:  # the plug-in refuses it at start-up too (and kvtier serve)
        with pytest.raises(ConfigError, match=why) as config_err:
            KVTierSettings.from_extra_config(extra)
        assert_no_secret(config_err.value)


def test_kvtier_serve_passes_an_encoded_password_decoded(
    acl_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``kvtier serve`` moves the URL's password to the environment
    (``split_url_password``); a percent-encoded one must arrive decoded, as
    redis-py would have sent it from the URL (``p%40ss`` is ``p@ss``)."""
    admin = redis.Redis(port=acl_server.port, password=ADMIN_PW)
    odd = "p@ss:w/rd-5ecret"
    admin.acl_setuser("odd", enabled=True, passwords=[f"+{odd}"], keys=["kvtier:*"],
                      commands=["-@all", *(f"+{c}" for c in KVTIER_COMMANDS)])
    admin.close()
    encoded = url(acl_server, "odd", "p%40ss%3Aw%2Frd-5ecret")
    make(encoded).put([(block_key(1), b"x")])  # redis-py decodes the URL's password
    bare, password = split_url_password(encoded)
    assert password == odd and "5ecret" not in bare
    monkeypatch.setenv("KVTIER_ODD_PW", password)
    assert make(bare, password_env="KVTIER_ODD_PW").contains([block_key(1)]) == [True]


@pytest.mark.parametrize("extra", [
    json.dumps({"cpu_bytes_to_use": 1, "redis_url": f"redis://:{ADMIN_PW}@h:1/0"}),  # no dict
    {"cpu_bytes_to_use": 1, "tenant_salt": 12345678901},
    {"cpu_bytes_to_use": 1, "tenant_salt": [SALT]},
    {"cpu_bytes_to_use": 1, "tenant_salt": SALT.encode()},
    {"cpu_bytes_to_use": 1, "redis_url": f"redis://:{ADMIN_PW}@h:1/0".encode()},
    {"cpu_bytes_to_use": 0, "redis_url": f"redis://:{ADMIN_PW}@h:1/0", "tenant_salt": SALT},
    {"cpu_bytes_to_use": 1, "redis_ttl_s": -1, "redis_url": f"redis://:{ADMIN_PW}@h:1/0"},
    {"cpu_bytes_to_use": 1, "redis_ttl_s": float("inf"), "redis_url": f"redis://:{ADMIN_PW}@h:1/0"},
    {"cpu_bytes_to_use": 1, "promotion_timeout_s": float("nan"), "tenant_salt": SALT},
    {"cpu_bytes_to_use": 1, "nonsense": SALT, "tenant_salt": SALT},
])
def test_config_errors_never_echo_a_secret(extra: object) -> None:
    with pytest.raises(ConfigError) as err:
        KVTierSettings.from_extra_config(extra)  # type: ignore[arg-type]
    assert_no_secret(err.value)
    assert "12345678901" not in str(err.value)


def test_metrics_hold_no_secret(acl_server: RedisServer, tmp_path: Path) -> None:
    """Metric names, help texts, label names and label values of a real engine
    adapter over a disk and a Redis tier configured with both secrets, one of
    them failing (wrong password)."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from kvtier.tiers.cascade import TierCascade
    from kvtier.vllm.adapter import KVTierOffloadingManager
    from kvtier.vllm.metrics import metric_definitions

    salted = LAYOUT.namespace(SALT)
    extra = {"cpu_bytes_to_use": 1 << 20, "redis_url": url(acl_server, password=ADMIN_PW),
             "tenant_salt": SALT, "disk_path": str(tmp_path / "disk"), "disk_bytes": 1 << 20}
    definitions = metric_definitions(extra)
    described = [(name, vars(meta)) for name, meta in definitions.items()]
    with SlotRegion.create("security-metrics", 4, SIZE, shm_dir=tmp_path) as region:
        tiers = [DiskTier(tmp_path / "disk", salted, 1 << 20, free_reserve_bytes=0),
                 make(url(acl_server, password=WRONG_PW), salted, failure_threshold=1)]
        for tier in tiers:
            tier.put([(block_key(1), payload(1, SIZE))])
        manager = OffloadManager(4)
        cascade = TierCascade(manager, region, tiers)
        try:
            stats = KVTierOffloadingManager(manager, cascade).get_stats()
        finally:
            cascade.shutdown()
    data = stats.data["data"]
    labels = {value for series in data.values() for values in series for value in values}
    assert labels == {"disk", "redis"}
    assert data["vllm:kvtier_tier_available"][("redis",)] == 0  # the failing one is seen
    assert_no_secret(described, data, stats.reduce())


# ============================================================== 3. file modes
@pytest.fixture
def umask_0() -> Iterator[None]:
    old = os.umask(0)
    yield
    os.umask(old)


def modes(root: Path) -> dict[str, int]:
    """Permission bits of ``root`` and everything under it, by relative path."""
    out = {".": stat.S_IMODE(root.stat().st_mode)}
    for path in root.rglob("*"):
        out[str(path.relative_to(root))] = stat.S_IMODE(path.lstat().st_mode)
    return out


def assert_private(root: Path) -> None:
    """Every directory under ``root`` 0700, every file 0600."""
    for name, mode in modes(root).items():
        want = 0o700 if (root / name).is_dir() else 0o600
        assert mode == want, f"{name}: {oct(mode)}"


def test_disk_temp_files_are_private_while_written(
    tmp_path: Path, umask_0: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Watch each real ``writev`` of the disk tier: the file being written (a
    temp file, block or manifest) is already 0600 in a 0700 directory."""
    seen: list[tuple[str, int, int]] = []
    real_writev: Callable[..., int] = os.writev

    def watching_writev(fd: int, buffers: object) -> int:
        path = os.readlink(f"/proc/self/fd/{fd}")
        seen.append((os.path.basename(path), stat.S_IMODE(os.fstat(fd).st_mode),
                     stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)))
        return real_writev(fd, buffers)

    monkeypatch.setattr(os, "writev", watching_writev)
    tier = DiskTier(tmp_path / "cache", NS, 1 << 20, free_reserve_bytes=0,
                    manifest={"model": "m"})
    tier.put([(block_key(1), payload(1, SIZE))])
    monkeypatch.undo()
    names = [name for name, _, _ in seen]
    assert any(n.startswith(f".{MANIFEST_NAME}.") and n.endswith(".tmp") for n in names)
    assert any(n.startswith(f".{block_key(1).hex()[:32]}.") and n.endswith(".tmp")
               for n in names)
    assert {(mode, dir_mode) for _, mode, dir_mode in seen} == {(0o600, 0o700)}
    assert_private(tmp_path / "cache")


def test_disk_directories_stay_private_under_umask_0(tmp_path: Path, umask_0: None) -> None:
    """Missing parents of ``disk_path``, the layout's own directories, loose
    modes found at start and directories re-created after deletion: all 0700."""
    cache = tmp_path / "a" / "b" / "cache"  # a and b do not exist yet
    tier = DiskTier(cache, NS, 1 << 20, free_reserve_bytes=0, manifest={"model": "m"})
    tier.put([(block_key(1), payload(1, SIZE))])
    assert_private(tmp_path / "a")
    loose = [cache / LAYOUT_DIR, tier.root, Path(block_files(cache)[0]).parent]
    for directory in loose:
        directory.chmod(0o777)
    DiskTier(cache, NS, 1 << 20, free_reserve_bytes=0)  # a new engine tightens them
    assert_private(tmp_path / "a")
    shutil.rmtree(cache / LAYOUT_DIR)
    assert tier.put([(block_key(2), payload(2, SIZE))]) == [True]  # made again, privately
    assert block_files(cache) and (cache / LAYOUT_DIR).is_dir()
    assert_private(tmp_path / "a")


def test_slot_region_is_private_under_umask_0(umask_0: None) -> None:
    """The CPU slot region in /dev/shm (the default directory): 0600."""
    with SlotRegion.create("security-test", 2, SIZE, clean_stale=False) as region:
        path = Path(region.path)
        assert path.parent == default_shm_dir()  # /dev/shm on Linux
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        leftovers = [p for p in path.parent.glob(f"{path.name.removesuffix('.slots')}*")
                     if p != path]
        assert leftovers == []  # the temp file it was published from is gone
    assert not path.exists()


# ============================================================== 4. tenants
def namespaces() -> tuple[str, str, str]:
    """Tenant A's, tenant B's and the unsalted namespace of one model and layout."""
    a, b, none = LAYOUT.namespace(SALT), LAYOUT.namespace(OTHER_SALT), LAYOUT.namespace()
    assert len({a, b, none}) == 3
    assert a == LAYOUT.namespace(SALT)  # the same tenant finds its blocks again
    return a, b, none


def test_disk_tenants_never_read_each_other(tmp_path: Path) -> None:
    ns_a, ns_b, ns_none = namespaces()
    tier_a, tier_b, plain = (DiskTier(tmp_path, ns, 1 << 20, free_reserve_bytes=0,
                                      enable_events=True) for ns in (ns_a, ns_b, ns_none))
    keys = [block_key(i) for i in range(4)]
    assert tier_a.put([(k, payload(i, SIZE)) for i, k in enumerate(keys)]) == [True] * 4
    for other in (tier_b, plain):
        assert other.contains(keys) == [False] * 4 and other.get(keys) == [None] * 4
    assert plain.put([(block_key(9), payload(9, SIZE))]) == [True]
    assert tier_a.contains([block_key(9)]) == [False] and tier_a.get([block_key(9)]) == [None]
    assert tier_a.get(keys[:1])[0] is not None  # A still reads its own
    # Adversarial: A's file copied to the very path B reads fails B's header check.
    src = Path(tier_a.dir.file(keys[0]))
    dst = Path(tier_b.dir.file(keys[0]))
    shutil.copy(src, dst)
    assert tier_b.get([keys[0]]) == [None]
    assert tier_b.stats()["corrupt"] == 1 and not dst.exists()
    assert [e.kind for e in tier_b.take_events()] == ["corrupt"]
    assert tier_b.contains([keys[0]]) == [False] and tier_b.stats()["hits"] == 0


def test_redis_tenants_never_read_each_other(acl_server: RedisServer, admin: object) -> None:
    ns_a, ns_b, ns_none = namespaces()
    address = url(acl_server, "alice", ALICE_PW)
    tier_a, tier_b, plain = (make(address, ns) for ns in (ns_a, ns_b, ns_none))
    keys = [block_key(i) for i in range(4)]
    assert tier_a.put([(k, payload(i, SIZE)) for i, k in enumerate(keys)]) == [True] * 4
    for other in (tier_b, plain):
        assert other.contains(keys) == [False] * 4 and other.get(keys) == [None] * 4
    assert plain.put([(block_key(9), payload(9, SIZE))]) == [True]
    assert tier_a.contains([block_key(9)]) == [False] and tier_a.get([block_key(9)]) == [None]
    # Adversarial: A's value renamed to B's key fails B's header check, is removed.
    key_b = f"kvtier:{ns_b}:".encode() + keys[0]
    admin.rename(f"kvtier:{ns_a}:".encode() + keys[0], key_b)  # type: ignore[attr-defined]
    assert tier_b.contains([keys[0]]) == [True]  # EXISTS only; the read decides
    assert tier_b.get([keys[0]]) == [None]
    assert tier_b.stats()["corrupt"] == 1 and tier_b.stats()["hits"] == 0
    assert admin.exists(key_b) == 0  # type: ignore[attr-defined]
    assert [e.kind for e in tier_b.take_events() if e.kind == "corrupt"] == ["corrupt"]


def test_plugin_namespace_depends_on_the_salt(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``KVTierSpec.namespace`` (what the engine's disk/Redis tiers use), without
    an engine: the model identity comes from a local checkpoint."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from test_identity import _engine_config, checkpoint
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    from kvtier.vllm.spec import KVTierSpec

    checkpoint(tmp_path / "model")
    monkeypatch.setenv("TEAM_A_SALT", SALT)

    def spec(salt: str | None) -> KVTierSpec:
        extra: dict[str, object] = {"cpu_bytes_to_use": 1 << 20, "disk_path": str(tmp_path),
                                    "disk_bytes": 1 << 20}
        if salt is not None:
            extra["tenant_salt"] = salt
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(16, ("layer.0",), 0),), worker_kv_bytes_per_block=SIZE,
            enable_kv_cache_events=False, extra_config=extra, engine_id="security-test",
            model=OffloadingModelConfig(str(tmp_path / "model"), "bfloat16"),
            cache=OffloadingCacheConfig(16, 1),
            parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False))
        made = KVTierSpec(config)
        made._vllm_config = _engine_config(str(tmp_path / "model"))  # what vLLM would pass
        return made

    a, again, from_env, b, unsalted = (spec(s) for s in (SALT, SALT, "env:TEAM_A_SALT",
                                                       OTHER_SALT, None))
    assert a.namespace() == again.namespace() == from_env.namespace()
    assert len({a.namespace(), b.namespace(), unsalted.namespace()}) == 3
    # two ranks splitting a block by heads or by tokens hold other bytes
    split = {}
    for tp, dcp in ((2, 1), (1, 2)):
        made = spec(None)
        made.config = dataclasses.replace(made.config, parallel=dataclasses.replace(
            made.config.parallel, world_size=2, tp_size=tp, dcp_size=dcp))
        split[tp, dcp] = made.namespace(rank=1)
    assert len(set(split.values())) == 2
    assert_no_secret(json.dumps(a._manifest(0)), repr(a.settings), a.namespace())


def test_engines_with_long_ids_get_regions_of_their_own() -> None:
    # vLLM names data-parallel engines <engine_id>_dp<rank>: ids that differ
    # only past the characters a name keeps must not share a slot region
    from kvtier.vllm.spec import REGION_ID_CHARS, shared_region_name

    long_id = "x" * REGION_ID_CHARS
    names = {shared_region_name(f"{long_id}_dp{dp}", 0) for dp in range(2)}
    names |= {shared_region_name("a/b", 0), shared_region_name("a_b", 0)}
    assert len(names) == 4
    assert shared_region_name("3f2c-uuid", 1) == "kvtier-3f2c-uuid-rank1.slots"


def test_a_second_engine_with_the_same_id_refuses_to_share_its_region() -> None:
    # Two launches given the same engine_id (a copied --kv-transfer-config)
    # must not join one slot region: each block table would hand out the same
    # slots and one engine would load the other's bytes.
    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
    )
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    from kvtier.vllm.settings import ConfigError
    from kvtier.vllm.spec import KVTierSpec

    page, engine_id = 4096, f"copied-{uuid.uuid4().hex[:8]}"

    def worker_of() -> object:
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(16, ("layer.0",), 0),), worker_kv_bytes_per_block=page,
            enable_kv_cache_events=False, extra_config={"cpu_bytes_to_use": 16 * page},
            engine_id=engine_id, model=OffloadingModelConfig("m", "bfloat16"),
            cache=OffloadingCacheConfig(16, 1),
            parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, False))
        kv = torch.zeros((8, page), dtype=torch.int8)
        caches = CanonicalKVCaches([CanonicalKVCacheTensor(kv, page)],
                                   [[CanonicalKVCacheRef(0, page)]])
        return KVTierSpec(config).get_worker(caches)

    first = worker_of()
    try:
        with pytest.raises(ConfigError, match=f"engine_id '{engine_id}'.*same"):
            worker_of()
    finally:
        first.shutdown()  # type: ignore[attr-defined]
    worker_of().shutdown()  # type: ignore[attr-defined]  # the name is free again


def test_the_region_reaper_carries_no_secret(monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    # the reaper outlives the engine, whose environment holds the Redis
    # password and the tenant salt that kvtier serve passes to it
    from kvtier.slots.region import SlotRegion

    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", ADMIN_PW)
    monkeypatch.setenv("KVTIER_TENANT_SALT", SALT)
    region = SlotRegion.create("reaper-env", 2, 4096, shm_dir=tmp_path, reaper=True,
                               populate=False)
    try:
        assert region._reaper is not None
        environ = Path(f"/proc/{region._reaper.pid}/environ").read_bytes()
    finally:
        region.close()
    assert ADMIN_PW.encode() not in environ and SALT.encode() not in environ
    assert b"PATH=" in environ
