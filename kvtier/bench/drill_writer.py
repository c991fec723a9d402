"""The tier writer of the crash drills: a process storing blocks as fast as it
can until it is killed, logging every store the tier acknowledged.

``python -m kvtier.bench.drill_writer CONFIG_JSON`` (see :class:`WriterConfig`).
Every store is a new *version* of its block: the writer numbers its writes
0, 1, 2, ... and a block's bytes are its version (8 bytes) followed by bytes
derived from its key and that version (:func:`drill_payload`), so whoever
reads a block later can tell a right one from a wrong one without the writer,
and which write it is: a key written again and again (``key_space``) carries
different bytes each time, and a server that lost the last writes of a key
but kept an earlier one is caught (:func:`lost_writes`).
After each ``put`` the writer appends one line to its acknowledgement log
(``<CLOCK_MONOTONIC seconds> <id>:<version> <id>:<version> ...``: the blocks
that ``put`` reported stored), with one ``write`` to an ``O_APPEND`` file, so
the log survives a SIGKILL of the writer and says which stores were
acknowledged before a kill.

Modes:
  ``disk``   a :class:`~kvtier.tiers.DiskTier` (temp file, rename).
  ``redis``  a :class:`~kvtier.tiers.RedisTier` (pipelined SETs); while the
             server is down (every store dropped) it pauses 10 ms per batch.
  ``torn``   negative control: block files written in place, in pieces (with
             a pause after each, as on a slow device), without a temp file:
             the bug a crash drill must catch.

Keys are ``block_key(first_id + n)``; with ``key_space`` set, ``n`` cycles
through ``range(key_space)`` (bounded memory on a Redis server), else it grows.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, NamedTuple

import xxhash

from kvtier.keys import block_key
from kvtier.tiers import blockfile
from kvtier.tiers.base import Tier
from kvtier.tiers.disk_dir import BLOCK_SUFFIX, LAYOUT_DIR, fan_out_index

WriterMode = Literal["disk", "redis", "torn"]
WRITER_NAMESPACE = "drill-writer"
"""The writer's namespace: beside an engine's on a shared directory or server."""
MAX_SECONDS = 900.0
"""A writer nobody killed exits after this (it also dies with its parent)."""
_PAUSE_ON_FAILURE_S = 0.01
_TORN_PIECE = 16 << 10
_TORN_PIECE_S = 0.0005
"""The torn writer's pause per piece: a slow device, so a kill lands mid-file."""


def drill_key(i: int) -> bytes:
    """The key of writer block ``i``."""
    return block_key(i)


VERSION_BYTES = 8
"""A payload starts with its version, big-endian."""
MIN_BLOCK_BYTES = VERSION_BYTES + 16
"""The smallest block: the version and one digest."""


class Write(NamedTuple):
    """One acknowledged store: block ``id`` at ``version`` (the writer's write number)."""

    id: int
    version: int


def drill_payload(key: bytes, size: int, version: int = 0) -> bytes:
    """The bytes of ``version`` of block ``key``: the version (8 bytes, big-endian),
    then the xxh3-128 digest of the key and the version repeated to ``size`` bytes."""
    if size < MIN_BLOCK_BYTES:
        raise ValueError(f"a writer block has at least {MIN_BLOCK_BYTES} bytes, not {size}")
    head = version.to_bytes(VERSION_BYTES, "big")
    digest = xxhash.xxh3_128_digest(key + head)
    rest = size - VERSION_BYTES
    return head + (digest * -(-rest // len(digest)))[:rest]


def payload_version(key: bytes, data: blockfile.BytesLike, size: int) -> int | None:
    """The version of block ``key`` that ``data`` is exactly (its ``size`` derived
    bytes), None when it is none (other bytes, another key's, another size)."""
    value = bytes(data)
    if len(value) != size or size < MIN_BLOCK_BYTES:
        return None
    version = int.from_bytes(value[:VERSION_BYTES], "big")
    return version if value == drill_payload(key, size, version) else None


def payload_matches(key: bytes, data: blockfile.BytesLike, size: int) -> bool:
    """Whether ``data`` is exactly the ``size`` derived bytes of some version of ``key``."""
    return payload_version(key, data, size) is not None


def latest_versions(writes: Iterable[Write]) -> dict[int, int]:
    """The latest acknowledged version of each id."""
    out: dict[int, int] = {}
    for w in writes:
        if w.version > out.get(w.id, -1):
            out[w.id] = w.version
    return out


def lost_writes(acked: Iterable[Write], held: Mapping[int, int]) -> list[int]:
    """Ids whose latest acknowledged write is not held: ``held`` (id -> version
    found) lacks the id, or has an older version. A later version is fine (a
    store can land without its acknowledgement being logged)."""
    return sorted(i for i, v in latest_versions(acked).items() if held.get(i, -1) < v)


@dataclass(frozen=True)
class WriterConfig:
    """What one writer process writes, where, and where it logs."""

    mode: WriterMode
    target: str
    """``disk``/``torn``: the tier directory (``disk_path``); ``redis``: the URL."""
    ack_log: str
    block_bytes: int = 1 << 20
    first_id: int = 0
    key_space: int | None = None
    batch: int = 1
    capacity_bytes: int = 256 << 20
    """``disk``: the writer's DiskTier capacity (it evicts its oldest blocks)."""
    namespace: str = WRITER_NAMESPACE
    max_seconds: float = MAX_SECONDS
    pause_s: float = 0.0
    """Sleep after each batch (0: none, as fast as it can)."""

    def __post_init__(self) -> None:
        if self.block_bytes < MIN_BLOCK_BYTES:
            raise ValueError(f"block_bytes must be at least {MIN_BLOCK_BYTES}, "
                             f"not {self.block_bytes}")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WriterConfig:
        return cls(**json.loads(text))


def _writes(cfg: WriterConfig) -> Iterator[list[Write]]:
    """Batches of writes, forever: write ``n`` is version ``n`` of its block."""
    n = 0
    while True:
        batch = []
        for _ in range(cfg.batch):
            offset = n % cfg.key_space if cfg.key_space else n
            batch.append(Write(cfg.first_id + offset, n))
            n += 1
        yield batch


def _open_tier(cfg: WriterConfig) -> Tier:
    from kvtier.tiers import DiskTier, RedisTier

    if cfg.mode == "disk":
        return DiskTier(cfg.target, cfg.namespace, cfg.capacity_bytes)
    return RedisTier(cfg.target, cfg.namespace)


def torn_path(directory: str | os.PathLike[str], namespace: str, key: bytes) -> Path:
    """Where a DiskTier under ``directory`` keeps block ``key`` of ``namespace``."""
    return (Path(directory) / LAYOUT_DIR / namespace / f"{fan_out_index(key):02x}"
            / f"{key.hex()}{BLOCK_SUFFIX}")


def _write_torn(cfg: WriterConfig, key: bytes, payload: bytes) -> bool:
    """Write a block file in place, piece by piece (no temp file, no rename)."""
    path = torn_path(cfg.target, cfg.namespace, key)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    value = blockfile.encode(cfg.namespace.encode(), key, payload)
    with open(path, "wb") as f:
        for start in range(0, len(value), _TORN_PIECE):
            f.write(value[start:start + _TORN_PIECE])
            f.flush()
            time.sleep(_TORN_PIECE_S)
    return True


def run(cfg: WriterConfig) -> None:
    """Write until killed (or ``max_seconds``), logging acknowledged writes."""
    log = os.open(cfg.ack_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    tier = None if cfg.mode == "torn" else _open_tier(cfg)
    deadline = time.monotonic() + cfg.max_seconds
    for writes in _writes(cfg):
        if time.monotonic() > deadline:
            break
        items = [(drill_key(w.id), drill_payload(drill_key(w.id), cfg.block_bytes, w.version))
                 for w in writes]
        if tier is None:
            ok = [_write_torn(cfg, key, data) for key, data in items]
        else:
            ok = tier.put(items)
        done = [f"{w.id}:{w.version}" for w, stored in zip(writes, ok, strict=True) if stored]
        if done:
            os.write(log, f"{time.monotonic():.6f} {' '.join(done)}\n".encode())
        pause = cfg.pause_s if done else max(cfg.pause_s, _PAUSE_ON_FAILURE_S)
        if pause:
            time.sleep(pause)


def read_acks(path: str | os.PathLike[str]) -> list[tuple[float, list[Write]]]:
    """The acknowledgement log: ``(time, writes)`` per line; a torn last line is skipped."""
    out: list[tuple[float, list[Write]]] = []
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines(keepends=True):
        if not line.endswith("\n"):
            break
        fields = line.split()
        with contextlib.suppress(ValueError, IndexError):
            out.append((float(fields[0]), [_parse_write(x) for x in fields[1:]]))
    return out


def _parse_write(field: str) -> Write:
    block, version = field.split(":")
    return Write(int(block), int(version))


def acked_between(path: str | os.PathLike[str], start: float, end: float) -> list[Write]:
    """Writes whose store was acknowledged in ``[start, end)`` (CLOCK_MONOTONIC
    seconds, as logged: after the writer saw the acknowledgement), in order."""
    return [w for t, writes in read_acks(path) if start <= t < end for w in writes]


def _die_with_parent() -> None:
    """In the child: get SIGKILL when the parent dies (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class WriterProcess:
    """One writer subprocess: ``start``, ``kill`` (SIGKILL, reaped), ``pause``/``resume``."""

    def __init__(self, cfg: WriterConfig, log_path: str | os.PathLike[str]) -> None:
        self.cfg = cfg
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WriterProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvtier.bench.drill_writer", self.cfg.to_json()],
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        return self

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> int | None:
        """SIGKILL the writer and reap it (its pid is then dead for stale-temp
        checks); its exit status (``-9`` when it was still running)."""
        proc = self.proc
        if proc is None:
            return None
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        return proc.wait()

    def wait_writing(self, timeout_s: float = 60.0) -> bool:
        """Wait until the writer's first store was acknowledged (it has started
        writing); False when it exited or ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.running():
            with contextlib.suppress(OSError):
                if os.path.getsize(self.cfg.ack_log) > 0:
                    return True
            time.sleep(0.01)
        return False

    def pause(self) -> None:
        if self.running() and self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.running() and self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)

    def log_tail(self, chars: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit("usage: python -m kvtier.bench.drill_writer CONFIG_JSON")
    run(WriterConfig.from_json(args[0]))


if __name__ == "__main__":
    main()
