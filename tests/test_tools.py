"""Operator tools for the shared tiers: ``kvtier disk inspect|verify|purge``,
``kvtier redis inspect``, on real block files and a real redis-server."""

from __future__ import annotations

import fcntl
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier import block_key
from kvtier.cli import main
from kvtier.tiers import DiskTier, KVLayout
from kvtier.tiers.blockfile import header_size
from kvtier.tiers.disk_dir import LAYOUT_DIR, fan_out_index
from kvtier.tiers.redis_server import RedisServer, find_server_binary, free_port
from kvtier.tools import disk_admin

NS_A = KVLayout("tools-model", "bfloat16", 16, 2, 2, 64).namespace()
NS_B = KVLayout("tools-model", "float16", 16, 2, 2, 64).namespace()
MODEL = "org/tools-model-7B"
PASSWORD = "t0ols-Pw-93ab"
REPO = str(Path(__file__).parent.parent)


def payload(i: int, size: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(size))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def put_blocks(path: Path, namespace: str, count: int, start: int = 0) -> int:
    """Store ``count`` blocks of various sizes; returns the bytes of their files."""
    tier = DiskTier(path, namespace, 64 << 20, free_reserve_bytes=0)
    items = [(block_key(i), payload(i, 1000 + 37 * i)) for i in range(start, start + count)]
    assert tier.put(items) == [True] * count
    tier.close()
    return sum(header_size(namespace.encode(), k) + len(v) for k, v in items)


def block_path(path: Path, namespace: str, i: int) -> Path:
    key = block_key(i)
    return path / LAYOUT_DIR / namespace / f"{fan_out_index(key):02x}" / f"{key.hex()}.kvb"


def files_under(path: Path) -> set[Path]:
    return {p for p in path.rglob("*") if p.is_file()}


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """A disk tier: 6 blocks in NS_A (with a manifest), 3 in NS_B."""
    path = tmp_path / "cache"
    put_blocks(path, NS_A, 6)
    put_blocks(path, NS_B, 3, start=100)
    manifest = {"model": MODEL, "dtype": "bfloat16", "created": time.time()}
    (path / LAYOUT_DIR / NS_A / "namespace.json").write_text(json.dumps(manifest))
    return path


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ---------------------------------------------------------------- disk inspect
def test_inspect_counts_what_was_put(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cache"
    bytes_a = put_blocks(path, NS_A, 6)
    bytes_b = put_blocks(path, NS_B, 3, start=100)
    (path / LAYOUT_DIR / NS_A / "namespace.json").write_text(json.dumps({"model": MODEL}))
    code, out, err = run(capsys, "disk", "inspect", str(path), "--json")
    assert (code, err) == (0, "")
    report = json.loads(out)
    by_ns = {ns["namespace"]: ns for ns in report["namespaces"]}
    assert set(by_ns) == {NS_A, NS_B}
    assert (by_ns[NS_A]["blocks"], by_ns[NS_A]["bytes"], by_ns[NS_A]["model"]) == (
        6, bytes_a, MODEL)  # the manifest is not a block
    assert (by_ns[NS_B]["blocks"], by_ns[NS_B]["bytes"], by_ns[NS_B]["model"]) == (
        3, bytes_b, None)
    total = report["total"]
    assert (total["namespaces"], total["blocks"], total["bytes"]) == (2, 9, bytes_a + bytes_b)
    assert total["age_histogram"]["<1m"] == 9 and total["temp_files"] == 0

    code, out, _ = run(capsys, "disk", "inspect", str(path))
    assert code == 0
    row_a = next(line for line in out.splitlines() if line.startswith(NS_A))
    assert MODEL in row_a and " 6 " in row_a
    total_row = next(line for line in out.splitlines() if line.startswith("total"))
    assert total_row.split()[1] == "9"


def test_inspect_ages_and_temp_files(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    now = time.time()
    ages = {0: 2 * 3600, 1: 2 * 86_400, 2: 30 * 86_400, 3: 30}  # block -> age in s
    for i, age in ages.items():
        os.utime(block_path(cache, NS_A, i), (now - age, now - age))
    fan_out = block_path(cache, NS_A, 0).parent
    (fan_out / f".{block_key(0).hex()}.{dead_pid()}.0.tmp").write_bytes(b"partial")
    (fan_out / f".{block_key(1).hex()}.{os.getpid()}.0.tmp").write_bytes(b"partial")
    code, out, _ = run(capsys, "disk", "inspect", str(cache), "--json")
    assert code == 0
    ns = next(n for n in json.loads(out)["namespaces"] if n["namespace"] == NS_A)
    assert ns["age_histogram"] == {"<1m": 3, "<1h": 0, "<1d": 1, "<1w": 1, "older": 1}
    assert 30 * 86_400 - 5 < ns["oldest_age_s"] < 30 * 86_400 + 60
    assert ns["newest_age_s"] < 60
    assert (ns["temp_files"], ns["stale_temp_files"], ns["blocks"]) == (2, 1, 6)


def test_inspect_one_namespace(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "disk", "inspect", str(cache), "--namespace", NS_B, "--json")
    assert code == 0
    assert [n["namespace"] for n in json.loads(out)["namespaces"]] == [NS_B]


def test_inspect_entry_point_runs_as_a_module(cache: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvtier", "disk", "inspect", str(cache)],
        capture_output=True, text=True, timeout=120, cwd=REPO, check=False,
    )
    assert out.returncode == 0, out.stderr
    assert NS_A in out.stdout and NS_B in out.stdout and MODEL in out.stdout


# ---------------------------------------------------------------- disk verify
def test_verify_clean_tier(cache: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "disk", "verify", str(cache))
    assert code == 0
    assert "checked 9 blocks in 2 namespaces: all good" in out


def test_verify_finds_and_repairs_exactly_the_bad_blocks(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flipped, truncated = block_path(cache, NS_A, 2), block_path(cache, NS_B, 101)
    data = bytearray(flipped.read_bytes())
    data[-10] ^= 0x01
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:50])
    fan_out = block_path(cache, NS_A, 0).parent
    stale = fan_out / f".{block_key(0).hex()}.{dead_pid()}.0.tmp"
    live = fan_out / f".{block_key(1).hex()}.{os.getpid()}.1.tmp"
    stale.write_bytes(b"partial")
    live.write_bytes(b"partial")
    before = files_under(cache)

    code, out, _ = run(capsys, "disk", "verify", str(cache))
    assert code == 1
    assert "checked 9 blocks in 2 namespaces: 2 bad blocks" in out
    assert f"bad  {flipped}: checksum mismatch" in out
    assert f"bad  {truncated}: truncated" in out
    assert "1 stale temp file" in out
    assert files_under(cache) == before  # without --repair nothing is touched

    code, out, _ = run(capsys, "disk", "verify", str(cache), "--repair")
    assert code == 0  # every bad block removed: nothing bad is left
    assert "2 bad blocks" in out and "removed 2 bad blocks and 1 stale temp file" in out
    assert files_under(cache) == before - {flipped, truncated, stale}

    code, out, _ = run(capsys, "disk", "verify", str(cache))
    assert code == 0
    assert "checked 7 blocks in 2 namespaces: all good" in out
    tier = DiskTier(cache, NS_A, 64 << 20, free_reserve_bytes=0)
    assert tier.get([block_key(0)]) == [memoryview(payload(0, 1000))]
    tier.close()


def test_verify_repair_keeps_a_block_it_cannot_read(
    cache: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # an engine's read error (EIO, EMFILE) is a miss and the file stays: the
    # error may pass. verify --repair used to delete such a block as bad.
    # (The error is injected: root reads any file.)
    unreadable = block_path(cache, NS_A, 3)
    real = disk_admin.read_block_file

    def failing(path: str) -> object:
        if path == str(unreadable):
            raise OSError(5, "Input/output error")
        return real(path)

    monkeypatch.setattr(disk_admin, "read_block_file", failing)
    code, out, _ = run(capsys, "disk", "verify", str(cache), "--repair")
    assert code == 1 and unreadable.exists()
    assert f"bad  {unreadable}: unreadable: Input/output error" in out
    assert "removed 0 bad blocks" in out
    assert "1 block could not be read and is kept" in out


def test_verify_reports_odd_names_and_sweeps_a_manifest_temp_file(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a name that is not UTF-8 (disk damage, a copied tree) or holds a newline
    # is reported without breaking the run or forging a line of the report
    fan_out = block_path(cache, NS_A, 0).parent
    odd = os.fsencode(str(fan_out)) + b"/\xff\xfe.kvb"
    with open(odd, "wb") as f:
        f.write(b"junk")
    (fan_out / "ab\nchecked 0 blocks: all good.kvb").write_bytes(b"junk")
    truncated = block_path(cache, NS_B, 101)
    truncated.write_bytes(truncated.read_bytes()[:50])
    ns_dir = cache / LAYOUT_DIR / NS_A
    left = ns_dir / f".namespace.json.{dead_pid()}.0.tmp"  # a manifest writer that died
    left.write_bytes(b"{")
    code, out, _ = run(capsys, "disk", "verify", str(cache), "--repair")
    assert code == 0
    assert "3 bad blocks" in out and "removed 3 bad blocks and 1 stale temp file" in out
    assert all(line.startswith(("bad  ", "checked ", "removed ")) or not line
               for line in out.splitlines())
    assert not os.path.lexists(odd) and not truncated.exists() and not left.exists()


def test_inspect_leaves_a_locked_temp_file_out_of_the_stale_ones(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a writer in another container: its pid is not visible here, its lock is
    fan_out = block_path(cache, NS_A, 0).parent
    foreign = fan_out / f".{block_key(0).hex()}.{dead_pid()}.0.tmp"
    foreign.write_bytes(b"partial")
    with open(foreign, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        _, out, _ = run(capsys, "disk", "inspect", str(cache), "--json")
        ns = next(n for n in json.loads(out)["namespaces"] if n["namespace"] == NS_A)
        assert (ns["temp_files"], ns["stale_temp_files"]) == (1, 0)
        run(capsys, "disk", "verify", str(cache), "--repair")
        assert foreign.exists()


def test_repair_leaves_a_file_written_again_at_the_same_path(tmp_path: Path) -> None:
    # the checked file was replaced (an engine removed the bad copy and stored
    # a good one, maybe on the same inode number): it must stay
    path = tmp_path / "block.kvb"
    path.write_bytes(b"bad copy")
    _, ident = disk_admin.read_block_file(str(path))
    path.unlink()
    time.sleep(0.01)
    path.write_bytes(b"good copy")
    assert not disk_admin.remove_if_same(str(path), ident)
    assert path.read_bytes() == b"good copy"
    _, ident = disk_admin.read_block_file(str(path))
    assert disk_admin.remove_if_same(str(path), ident) and not path.exists()


def test_verify_json_lines_and_one_namespace(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = block_path(cache, NS_B, 100)
    bad.write_bytes(b"KVTB" + bad.read_bytes()[4:-1])
    misplaced = block_path(cache, NS_A, 3)
    wrong_dir = misplaced.parent.parent / f"{(fan_out_index(block_key(3)) + 1) % 256:02x}"
    wrong_dir.mkdir(exist_ok=True)
    misplaced.rename(wrong_dir / misplaced.name)

    code, out, _ = run(capsys, "disk", "verify", str(cache), "--namespace", NS_B, "--json")
    assert code == 1
    lines = [json.loads(line) for line in out.splitlines()]
    assert [(r["type"], r.get("path")) for r in lines[:-1]] == [("bad", str(bad))]
    assert lines[0]["reason"].startswith("length mismatch")
    assert (lines[-1]["type"], lines[-1]["blocks"], lines[-1]["bad"]) == ("summary", 3, 1)

    code, out, _ = run(capsys, "disk", "verify", str(cache), "--namespace", NS_A)
    assert code == 1
    assert "belongs in" in out and "1 bad block" in out


# ---------------------------------------------------------------- disk purge
def test_purge_one_namespace_leaves_the_rest(
    cache: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    unrelated = cache / "notes.txt"
    unrelated.write_text("not kvtier's")
    stray = block_path(cache, NS_A, 0).parent / "keep-me.bin"
    stray.write_bytes(b"x")
    b_files = {p for p in files_under(cache) if NS_B in str(p)}

    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # not a terminal
    code, _, err = run(capsys, "disk", "purge", str(cache), "--namespace", NS_A)
    assert code == 2 and "kvtier: error:" in err and "--yes" in err
    assert block_path(cache, NS_A, 0).exists()

    code, out, _ = run(capsys, "disk", "purge", str(cache), "--namespace", NS_A, "--yes")
    assert code == 0
    assert "removed 6 blocks" in out and "1 manifest" in out and "left alone: 1 entry" in out
    assert files_under(cache) == b_files | {unrelated, stray}
    assert [p.name for p in (cache / LAYOUT_DIR / NS_A).iterdir()] == [stray.parent.name]

    code, out, _ = run(capsys, "disk", "inspect", str(cache), "--json")
    by_ns = {n["namespace"]: n for n in json.loads(out)["namespaces"]}
    assert (by_ns[NS_A]["blocks"], by_ns[NS_A]["other_files"], by_ns[NS_B]["blocks"]) == (
        0, 1, 3)


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_purge_asks_on_a_terminal(
    cache: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (cache / "notes.txt").write_text("not kvtier's")
    monkeypatch.setattr(sys, "stdin", _Terminal("n\n"))
    code, _, err = run(capsys, "disk", "purge", str(cache))
    assert code == 1 and "remove 9 blocks" in err and "nothing removed" in err
    assert block_path(cache, NS_B, 100).exists()

    monkeypatch.setattr(sys, "stdin", _Terminal("y\n"))
    code, out, _ = run(capsys, "disk", "purge", str(cache))
    assert code == 0 and "removed 9 blocks" in out and "2 namespace directories" in out
    assert files_under(cache) == {cache / "notes.txt"}
    assert list((cache / LAYOUT_DIR).iterdir()) == []
    assert put_blocks(cache, NS_A, 1) > 0  # a new engine starts from the empty tier


# ---------------------------------------------------------------- errors
def test_clear_errors_for_paths_that_are_not_tiers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "missing"
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "data.kvb").write_bytes(b"x")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    layout_file = tmp_path / "layout-file"
    layout_file.mkdir()
    (layout_file / LAYOUT_DIR).write_text("x")
    cases = [
        (missing, "no such directory"),
        (plain, "not a kvtier disk tier: it has no kvtier-v1 directory"),
        (a_file, "is not a directory"),
        (layout_file, "kvtier-v1 is not a directory"),
    ]
    for action in ("inspect", "verify", "purge"):
        for path, message in cases:
            extra = ["--yes"] if action == "purge" else []
            code, out, err = run(capsys, "disk", action, str(path), *extra)
            assert code == 2 and out == "", (action, path)
            assert err.startswith("kvtier: error: ") and message in err, (action, err)
    assert (plain / "data.kvb").exists() and a_file.exists()
    assert not (plain / LAYOUT_DIR).exists()


def test_unknown_namespace_is_a_clear_error(
    cache: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in (["inspect"], ["verify", "--repair"], ["purge", "--yes"]):
        code, _, err = run(capsys, "disk", *argv, str(cache), "--namespace", "0123abcd")
        assert code == 2 and err.startswith("kvtier: error: ")
        assert "unknown namespace '0123abcd'" in err and NS_A in err and NS_B in err


# ---------------------------------------------------------------- redis inspect
@pytest.fixture(scope="module")
def auth_server() -> Iterator[RedisServer]:
    pytest.importorskip("redis", reason="the redis extra (redis-py) is not installed")
    if find_server_binary() is None:
        pytest.skip("no redis-server or valkey-server binary (see tests/test_tier_redis.py)")
    srv = RedisServer(password=PASSWORD).start()
    yield srv
    srv.close()


def test_redis_inspect_counts_namespaces_over_many_scan_pages(
    auth_server: RedisServer, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import redis

    from kvtier.tiers.redis_tier import RedisTier

    url = auth_server.url.replace("://", f"://:{PASSWORD}@")
    raw = redis.Redis.from_url(url)
    raw.flushdb()
    expected: dict[str, tuple[int, int]] = {}
    for ns, count in ((NS_A, 1100), (NS_B, 250)):
        tier = RedisTier(url, ns)
        items = [(block_key(i), payload(i, 16 + i % 50)) for i in range(count)]
        assert all(tier.put(items))
        tier.close()
        expected[ns] = (count, sum(header_size(ns.encode(), k) + len(v) for k, v in items))
    raw.set(b"unrelated", b"x")
    raw.set(b"kvtier:not a namespace", b"x")
    raw.close()

    code, out, err = run(capsys, "redis", "inspect", url, "--scan-count", "50", "--json")
    assert code == 0, err
    report = json.loads(out)
    got = {n["namespace"]: (n["keys"], n["value_bytes"]) for n in report["namespaces"]}
    assert got == expected
    assert report["total"]["keys"] == 1350 and report["other_keys"] == 1
    assert report["db_keys"] == 1352 and report["bytes_method"] == "STRLEN"
    assert report["scan"]["match"] == "kvtier:*" and report["scan"]["count"] == 50
    assert report["scan"]["calls"] >= 10  # one page per SCAN call, cursor followed to 0
    assert PASSWORD not in out + err and "***" in report["url"]

    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", PASSWORD)
    code, out, err = run(capsys, "redis", "inspect", auth_server.url)
    assert code == 0, err
    assert "value bytes (STRLEN)" in out and "SCAN MATCH kvtier:* COUNT 1000" in out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines()[2:5]}
    assert rows == {NS_A: "1100", NS_B: "250", "total": "1350"}
    assert PASSWORD not in out + err


def test_redis_errors_never_show_the_password(
    auth_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    unreachable = f"redis://:{PASSWORD}@127.0.0.1:{free_port()}/0"
    code, out, err = run(capsys, "redis", "inspect", unreachable)
    assert code == 2 and out == ""
    assert err.startswith("kvtier: error: cannot reach Redis") and "redis://:***@127.0.0.1" in err
    assert PASSWORD not in err

    wrong = auth_server.url.replace("://", f"://:{PASSWORD}-wrong@")
    code, _, err = run(capsys, "redis", "inspect", wrong)
    assert code == 2 and "AuthenticationError" in err and PASSWORD not in err

    code, _, err = run(capsys, "redis", "inspect", f"redis+cluster://:{PASSWORD}@127.0.0.1:1")
    assert code == 2 and "Cluster is not supported" in err and PASSWORD not in err
