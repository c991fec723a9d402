"""Model identity: a fingerprint of everything that changes a KV block's bytes.

Block keys hash token ids, so two engines that give the same tokens the same
key must also compute the same KV for them, or a shared tier (disk, Redis)
serves one engine the other's KV: wrong output, silently. The shared tiers'
namespace (DESIGN.md §2) therefore fingerprints the model, not its name:

* **the weights**, by content: per weights file its relative path and size,
  then an XXH3-128 of every byte, so new weights at an old path, a
  fine-tune of a few rows of one tensor or a re-quantization all change the
  digest. A Hugging Face cache file is read too, although it links to
  ``blobs/<sha256>``: weights saved over the snapshot's path write through
  the link and keep the blob's name. A full read costs seconds per
  10 GB (``benchmarks/bench_identity.py``), once: the digests are remembered
  by each file's device, inode, size and times (``kvtier.file_digests``), so
  a restart on the same files reads nothing;
* **the effective config**: whatever the engine runs with, after overrides
  (see ``kvtier.vllm.identity`` for vLLM's fields), as canonical JSON.

What does not enter: the model's name or path (a copy elsewhere shares its
blocks), modification times (they only key the remembered digests), and the
tokenizer, which only decides which token ids a text becomes; the ids
themselves are what the keys hash.

Memory: one read buffer (``kvtier.file_digests.READ_BYTES``) and the
remembered digests (at most ``kvtier.file_digests.MAX_ENTRIES``).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import KVTierError
from kvtier.file_digests import FileDigests, default_cache_dir

WEIGHT_SUFFIXES = (
    ".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5",
    ".npz", ".pdparams", ".tensors",
)
"""File name endings of weights files (the formats vLLM and transformers load)."""

_HEX_DIGEST = 64


class IdentityError(KVTierError, ValueError):
    """The model's identity cannot be established; the message says what to do."""


@dataclass(frozen=True)
class WeightsDigest:
    """The content fingerprint of a checkpoint directory.

    ``digest`` is a hex BLAKE2b of every weights file's path, size and
    content digest; ``files``/``bytes`` describe what was fingerprinted,
    ``read`` how many files were read in full this time (the others' digests
    were the checkpoint's own or remembered), ``seconds`` what it cost.
    """

    digest: str
    files: int
    bytes: int
    seconds: float
    read: int = 0


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


def weights_digest(model_dir: str | Path, digests: FileDigests | None = None) -> WeightsDigest:
    """Fingerprint the weights files under ``model_dir`` (see the module doc).

    ``digests``: where file digests are remembered (default: the cache in
    ``kvtier.file_digests.default_cache_dir()``). Raises ``IdentityError``
    when ``model_dir`` is not a directory or holds no weights file, and
    ``OSError`` when a file cannot be read or changes while it is read.
    """
    start = time.perf_counter()
    root = Path(model_dir)
    if not root.is_dir():
        raise IdentityError(f"{str(root)!r} is not a local model directory")
    files = weights_files(root)
    if not files:
        raise IdentityError(
            f"no weights file ({', '.join(WEIGHT_SUFFIXES)}) under {str(root)!r}")
    if digests is None:
        digests = FileDigests(default_cache_dir())
    before = digests.computed
    h = hashlib.blake2b(digest_size=_HEX_DIGEST // 2, person=b"kvtier-weights")
    total = 0
    for path in files:
        size = path.stat().st_size
        total += size
        h.update(canonical_json([path.relative_to(root).as_posix(), size]))
        h.update(digests.digest(path))
    digests.save()
    return WeightsDigest(h.hexdigest(), len(files), total, time.perf_counter() - start,
                         digests.computed - before)
