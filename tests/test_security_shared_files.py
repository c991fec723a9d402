"""What another user of the host can do to kvtier through the
files and directories it shares with them (``/dev/shm``, ``/tmp``, a cache
directory made under umask 0). Real files, FIFOs, symlinks and, where the
test runs as root, files of another uid.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier import file_digests
from kvtier.bench.outfiles import write_atomic
from kvtier.file_digests import CACHE_NAME, FileDigests, content_digest
from kvtier.slots import SlotRegion
from kvtier.slots.region import cleanup_stale_regions

OTHER_UID = 4242
"""A uid that is not this process's (files are given to it with ``chown``: root only)."""

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


@pytest.fixture
def umask_0() -> Iterator[None]:
    old = os.umask(0)
    yield
    os.umask(old)


def run_python(code: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter; a hang fails the test instead of stopping it."""
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], text=True,
                              capture_output=True, timeout=timeout_s,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    except subprocess.TimeoutExpired:
        pytest.fail(f"hung for {timeout_s} s: {code}")


# ------------------------------------------------------------ /dev/shm


def test_a_fifo_in_shm_does_not_hang_an_engine_start(tmp_path: Path) -> None:
    # /dev/shm is writable by every user: `mkfifo /dev/shm/kvtier-x` made the
    # stale-region cleanup of every engine's start block for ever in open()
    for name in ("kvtier-x", "kvtier-eng-123.slots", "kvtier-eng-rank0.slots"):
        os.mkfifo(tmp_path / name)
    done = run_python(f"""
        from kvtier.slots import SlotRegion
        from kvtier.slots.region import region_creator
        r = SlotRegion.create("eng", 2, 4096, shm_dir={str(tmp_path)!r}, populate=False)
        r.close()
        print(region_creator("kvtier-eng-rank0.slots", {str(tmp_path)!r}))
        try:
            SlotRegion.attach("kvtier-eng-rank0.slots", shm_dir={str(tmp_path)!r})
        except ValueError as exc:
            print("refused:", exc)
        """, timeout_s=20)
    assert done.returncode == 0, done.stderr
    creator, refusal = done.stdout.splitlines()
    assert creator == "None" and refusal.startswith("refused:") and "not a regular file" in refusal
    assert all(stat.S_ISFIFO((tmp_path / n).lstat().st_mode)
               for n in ("kvtier-x", "kvtier-eng-123.slots"))  # not ours: left alone


def test_attach_refuses_a_symlink_at_the_region_name(tmp_path: Path) -> None:
    # the name another user could take first: a symlink there led the
    # scheduler to map whatever file it named (another engine's region)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    region = SlotRegion.create("real", 2, 4096, shm_dir=elsewhere, populate=False)
    try:
        (tmp_path / "kvtier-e-rank0.slots").symlink_to(region.path)
        with pytest.raises(OSError):
            SlotRegion.attach("kvtier-e-rank0.slots", shm_dir=tmp_path)
    finally:
        region.close()


@needs_root
def test_attach_refuses_another_users_region_file(tmp_path: Path) -> None:
    # a file of another user with a valid header, put at the name the
    # scheduler attaches: its bytes would be loaded into the engine's KV cache
    region = SlotRegion.create("e", 2, 4096, shm_dir=tmp_path, name="kvtier-e-rank0.slots",
                               populate=False, clean_stale=False)
    try:
        os.chown(region.path, OTHER_UID, OTHER_UID)
        with pytest.raises(ValueError, match="owned by uid 4242"):
            SlotRegion.attach(region.name, shm_dir=tmp_path)
    finally:
        region.close()


@needs_root
def test_stale_cleanup_leaves_other_users_files_alone(tmp_path: Path) -> None:
    # a root engine removed any kvtier-* file whose header named a dead pid
    fake = tmp_path / "kvtier-other-999999999.slots"
    fake.write_bytes(b"not a region")
    os.chown(fake, OTHER_UID, OTHER_UID)
    assert cleanup_stale_regions(tmp_path) == [] and fake.exists()


# ------------------------------------------------------------ the digest cache


def weights(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"w" * 1000)
    return path


@pytest.fixture
def no_racy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(file_digests, "RACY_S", 0.0)


def test_digest_cache_directories_are_private_under_umask_0(
        tmp_path: Path, umask_0: None, no_racy: None) -> None:
    # under umask 0 the cache directory (and its parents) were 0777: any user
    # could put a forged file-digests.json in it
    cache = tmp_path / "home" / ".cache" / "kvtier"
    digests = FileDigests(cache)
    digests.digest(weights(tmp_path))
    digests.save()
    assert (cache / CACHE_NAME).is_file()
    for directory in (cache, cache.parent, cache.parent.parent):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    assert stat.S_IMODE((cache / CACHE_NAME).stat().st_mode) == 0o600


def forge_cache(cache: Path, path: Path, size: int = 0) -> str:
    """A cache file saying ``path``'s content digest is a made-up one; returns it."""
    st = os.stat(path)
    key = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    forged = "ab" * 16
    text = json.dumps({key: forged})
    cache.mkdir(parents=True, exist_ok=True)
    (cache / CACHE_NAME).write_text(text + " " * max(0, size - len(text)))
    return forged


@pytest.mark.parametrize("how", ["group_writable", "world_writable", "oversized"])
def test_a_digest_cache_others_could_write_is_ignored(tmp_path: Path, how: str) -> None:
    # a forged entry gives new weights the digest of old ones: the engine
    # would serve the old weights' blocks
    path = weights(tmp_path)
    cache = tmp_path / "cache"
    forged = forge_cache(cache, path, size=2 << 20 if how == "oversized" else 0)
    mode = {"group_writable": 0o620, "world_writable": 0o602, "oversized": 0o600}[how]
    os.chmod(cache / CACHE_NAME, mode)
    assert FileDigests(cache).digest(path).hex() != forged
    assert FileDigests(cache).digest(path) == content_digest(path)


@needs_root
def test_a_digest_cache_of_another_user_is_ignored(tmp_path: Path) -> None:
    path = weights(tmp_path)
    cache = tmp_path / "cache"
    forged = forge_cache(cache, path)
    os.chmod(cache / CACHE_NAME, 0o600)
    os.chown(cache / CACHE_NAME, OTHER_UID, OTHER_UID)
    assert FileDigests(cache).digest(path).hex() != forged


def test_own_private_digest_cache_is_still_used(tmp_path: Path) -> None:
    # negative control: the same forged file, this user's and 0600, is believed
    path = weights(tmp_path)
    cache = tmp_path / "cache"
    forged = forge_cache(cache, path)
    os.chmod(cache / CACHE_NAME, 0o600)
    assert FileDigests(cache).digest(path).hex() == forged


def test_a_fifo_as_digest_cache_does_not_hang(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    os.mkfifo(cache / CACHE_NAME)
    done = run_python(f"""
        from pathlib import Path
        from kvtier.file_digests import FileDigests
        print(FileDigests(Path({str(cache)!r})).entries)
        """, timeout_s=20)
    assert done.returncode == 0 and done.stdout.strip() == "{}", done.stderr


# ------------------------------------------------------------ outputs in shared directories


def test_an_output_is_not_written_through_a_symlink_at_its_temp_name(tmp_path: Path) -> None:
    # outputs (traces, plots, bench results) were staged at .NAME.PID.tmp: a
    # user who put a symlink there first had the write go to any file of ours
    victim = tmp_path / "victim"
    victim.write_text("precious")
    out = tmp_path / "results.json"
    (tmp_path / f".{out.name}.{os.getpid()}.tmp").symlink_to(victim)
    write_atomic(out, "results")
    assert victim.read_text() == "precious"
    assert out.read_text() == "results" and not out.is_symlink()
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert leftovers == sorted([f".results.json.{os.getpid()}.tmp", "results.json", "victim"])


def test_an_output_keeps_the_umask_mode(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        write_atomic(tmp_path / "out.txt", "x")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out.txt").stat().st_mode) == 0o640


# ------------------------------------------------------------ the demo's model


@needs_root
def test_the_demo_does_not_use_another_users_model_in_tmp(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # with no writable home cache the model went to /tmp/kvtier-tiny-llama,
    # where any user could have put a model of their own first
    from kvtier.demo import tiny_model

    _no_home_cache(tmp_path, monkeypatch)
    squatted = tmp_path / "kvtier-tiny-llama"
    squatted.mkdir()
    (tmp_path / f"kvtier-{os.geteuid()}").mkdir(mode=0o777)
    os.chown(tmp_path / f"kvtier-{os.geteuid()}", OTHER_UID, OTHER_UID)
    with pytest.raises(PermissionError, match="not a private directory"):
        tiny_model.default_model_dir()


def test_the_demo_model_falls_back_to_a_private_temp_dir(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.demo import tiny_model

    _no_home_cache(tmp_path, monkeypatch)
    got = tiny_model.default_model_dir()
    assert got == tmp_path / f"kvtier-{os.geteuid()}" / "tiny-llama"
    assert stat.S_IMODE(got.parent.stat().st_mode) == 0o700


def _no_home_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A home cache directory that cannot be made; the temp dir is ``tmp_path``."""
    from kvtier.demo import tiny_model

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(home / "nope"))
    monkeypatch.setattr(tiny_model.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(os, "mkdir", _refusing_mkdir_under(home, os.mkdir))


def _refusing_mkdir_under(home: Path, real: object) -> object:
    """``os.mkdir`` failing under ``home`` (an unwritable home, even for root)."""
    def mkdir(path: object, *args: object, **kwargs: object) -> None:
        if str(path).startswith(str(home)):
            raise PermissionError(13, "Permission denied", str(path))
        real(path, *args, **kwargs)  # type: ignore[operator]
    return mkdir
