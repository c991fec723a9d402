"""Model identity: a fingerprint of everything that changes a KV block's bytes.

Block keys hash token ids, so two engines that give the same tokens the same
key must also compute the same KV for them, or a shared tier (disk, Redis)
serves one engine the other's KV: wrong output, silently. The shared tiers'
namespace (DESIGN.md §2) therefore fingerprints the model, not its name:

* **the weights**, by content: per weights file its relative path and size,
  then the checkpoint's own hash where it has one (a Hugging Face cache file
  is a link to ``blobs/<sha256>``), else samples of its bytes. Safetensors
  files are sampled in *every* tensor (its header, then ``SAMPLE_BYTES`` at
  the start, middle and end of each tensor's data), so new weights at an old
  path, a fine-tune of a few layers or a re-quantization all change the
  digest. Other formats are sampled at ``FILE_WINDOWS`` evenly spaced places
  plus head and tail. Reads are positioned (``pread``), about 12 KiB per
  tensor: a multi-GB checkpoint costs milliseconds warm and well under a
  second cold (``benchmarks/bench_identity.py``);
* **the effective config**: whatever the engine runs with, after overrides
  (see ``kvtier.vllm.identity`` for vLLM's fields), as canonical JSON.

What does not enter: the model's name or path (a copy elsewhere shares its
blocks), modification times, and the tokenizer, which only decides which
token ids a text becomes; the ids themselves are what the keys hash.

Memory: one file's safetensors header at a time (capped at ``MAX_HEADER_BYTES``).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from kvtier.errors import KVTierError

WEIGHT_SUFFIXES = (
    ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5",
    ".npz", ".pdparams", ".tensors",
)
"""File name endings of weights files (the formats vLLM and transformers load)."""

SAMPLE_BYTES = 4096
"""Bytes read at each sampled place."""

FILE_WINDOWS = 256
"""Evenly spaced samples of a weights file that is not safetensors."""

HEAD_TAIL_BYTES = 64 << 10
"""Bytes read at the start and at the end of a weights file that is not safetensors."""

MAX_HEADER_BYTES = 100 << 20
"""Largest safetensors header read (the format's own limit is 100 MB)."""

_HEX_DIGEST = 64


class IdentityError(KVTierError, ValueError):
    """The model's identity cannot be established; the message says what to do."""


@dataclass(frozen=True)
class WeightsDigest:
    """The content fingerprint of a checkpoint directory.

    ``digest`` is a hex BLAKE2b of every weights file's path, size and samples;
    ``files``/``bytes`` describe what was fingerprinted, ``seconds`` what it cost.
    """

    digest: str
    files: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class ModelIdentity:
    """What makes a model's KV for given tokens: the weights and the effective config.

    ``weights`` is a content digest (``weights_digest``) or an identity the
    operator vouches for (``model_identity`` in the config); ``config`` is the
    digest of the effective config (``config_digest``). Equal identities, and
    only those, may share blocks.
    """

    weights: str
    config: str

    def as_dict(self) -> dict[str, str]:
        """The identity as it enters a namespace fingerprint."""
        return {"weights": self.weights, "config": self.config}


def canonical_json(value: Any) -> bytes:
    """Deterministic JSON of ``value``: sorted keys, no spaces; sets sorted;
    anything else JSON cannot hold (dtypes, enums) as its ``str``."""

    def fallback(obj: Any) -> Any:
        if isinstance(obj, (set, frozenset)):
            return sorted(map(str, obj))
        return str(obj)

    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=fallback).encode()


def config_digest(config: Mapping[str, Any]) -> str:
    """Hex digest of an effective config (canonical JSON, see ``canonical_json``)."""
    return hashlib.blake2b(canonical_json(dict(config)), digest_size=_HEX_DIGEST // 2).hexdigest()


def weights_files(model_dir: Path) -> list[Path]:
    """The weights files under ``model_dir``, sorted; hidden entries skipped."""
    found: list[Path] = []
    for root, dirs, files in os.walk(model_dir, followlinks=False):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.extend(Path(root, f) for f in files
                     if not f.startswith(".") and f.endswith(WEIGHT_SUFFIXES))
    return sorted(found)


def weights_digest(model_dir: str | Path) -> WeightsDigest:
    """Fingerprint the weights files under ``model_dir`` (see the module doc).

    Raises ``IdentityError`` when ``model_dir`` is not a directory or holds no
    weights file, and ``OSError`` when a file cannot be read.
    """
    start = time.perf_counter()
    root = Path(model_dir)
    if not root.is_dir():
        raise IdentityError(f"{str(root)!r} is not a local model directory")
    files = weights_files(root)
    if not files:
        raise IdentityError(
            f"no weights file ({', '.join(WEIGHT_SUFFIXES)}) under {str(root)!r}")
    h = hashlib.blake2b(digest_size=_HEX_DIGEST // 2, person=b"kvtier-weights")
    total = 0
    for path in files:
        size = path.stat().st_size
        total += size
        h.update(canonical_json([path.relative_to(root).as_posix(), size]))
        h.update(_file_fingerprint(path, size))
    return WeightsDigest(h.hexdigest(), len(files), total, time.perf_counter() - start)


def _file_fingerprint(path: Path, size: int) -> bytes:
    """The checkpoint's own content hash of ``path`` where it has one, else samples."""
    blob = _hub_blob_name(path)
    if blob is not None:
        return b"blob:" + blob.encode()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        h = xxhash.xxh3_128()
        ranges = _safetensors_ranges(fd, size) if path.suffix == ".safetensors" else None
        for offset, length in ranges if ranges is not None else _file_ranges(size):
            h.update(os.pread(fd, length, offset))
        return h.digest()
    finally:
        os.close(fd)


def _hub_blob_name(path: Path) -> str | None:
    """The content hash naming a Hugging Face cache blob ``path`` links to, if any."""
    if not path.is_symlink():
        return None
    target = path.resolve()
    if target.parent.name == "blobs" and len(target.name) in (40, 64):
        return target.name
    return None


def _file_ranges(size: int) -> Iterator[tuple[int, int]]:
    """Head, tail and ``FILE_WINDOWS`` evenly spaced windows of a ``size``-byte file."""
    if size <= 2 * HEAD_TAIL_BYTES + FILE_WINDOWS * SAMPLE_BYTES:
        yield 0, size
        return
    yield 0, HEAD_TAIL_BYTES
    step = (size - SAMPLE_BYTES) // FILE_WINDOWS
    for i in range(FILE_WINDOWS):
        yield i * step, SAMPLE_BYTES
    yield size - HEAD_TAIL_BYTES, HEAD_TAIL_BYTES


def _safetensors_ranges(fd: int, size: int) -> list[tuple[int, int]] | None:
    """The header, then start, middle and end of every tensor; None when the
    file is not valid safetensors (then it is sampled like any other file)."""
    raw = os.pread(fd, 8, 0)
    if len(raw) < 8:
        return None
    (header_len,) = struct.unpack("<Q", raw)
    if header_len > min(MAX_HEADER_BYTES, size - 8):
        return None
    try:
        header = json.loads(os.pread(fd, header_len, 8))
    except ValueError:
        return None
    if not isinstance(header, dict):
        return None
    base = 8 + header_len
    out = [(0, base)]
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2
                and all(type(x) is int for x in offsets)
                and 0 <= offsets[0] <= offsets[1] <= size - base):
            return None
        spans.append((offsets[0], offsets[1]))
    for begin, end in sorted(spans):
        out.extend(_tensor_windows(base + begin, base + end))
    return out


def _tensor_windows(begin: int, end: int) -> list[tuple[int, int]]:
    """Up to three ``SAMPLE_BYTES`` windows of the byte range ``[begin, end)``."""
    length = end - begin
    if length <= 3 * SAMPLE_BYTES:
        return [(begin, length)] if length > 0 else []
    middle = begin + (length - SAMPLE_BYTES) // 2
    return [(begin, SAMPLE_BYTES), (middle, SAMPLE_BYTES), (end - SAMPLE_BYTES, SAMPLE_BYTES)]
