"""Mooncake-format traces: one JSON request per line."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import CommandError, KVTierError
from kvtier.progress import Progress, make_progress

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` block in the Mooncake traces."""

UTF8_BOM = b"\xef\xbb\xbf"
"""What some editors and Windows tools write before a UTF-8 file's first line."""
GZIP_MAGIC = b"\x1f\x8b"
"""The first bytes of a gzip file."""

BUNDLED_TRACE = (
    Path(__file__).resolve().parents[2] / "data" / "mooncake" / "conversation_trace.jsonl"
)
"""The Mooncake "Conversation" trace shipped in the source tree (``data/mooncake``).

The single place that knows where it lives: a source checkout or an editable
install has it; a wheel does not ship ``data/`` (move it under the package and
read it with ``importlib.resources`` if it ever must be installed).
"""


class TraceFormatError(KVTierError, ValueError):
    """A trace line is not a valid request; the message names file and line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: arrival (ms, an int or a float as the file has
    it), lengths (tokens) and prefix blocks."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _length(obj: dict[str, Any], name: str, where: str) -> int:
    """A token count: a non-negative int (an integral float such as ``512.0``,
    as table exports write them, is taken as that int); 0 when absent."""
    value = obj.get(name, 0)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise TraceFormatError(
            f"{where}: {name!r} must be a non-negative int, got {_shown(value)}")
    return value


def _timestamp(obj: dict[str, Any], where: str) -> float:
    """The arrival in ms: any finite non-negative number (vLLM's ``timed_trace``
    client reads it as a float too); 0 when absent."""
    value = obj.get("timestamp", 0)
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not _finite(value) or value < 0):
        raise TraceFormatError(
            f"{where}: 'timestamp' must be a non-negative number of ms, got {_shown(value)}")
    return value


def _finite(value: float) -> bool:
    """Whether ``value`` is a finite float, or an int a float can hold (a
    timestamp goes to vLLM's client as a float; ``math.isfinite`` raises
    OverflowError for an int beyond the float range)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


SHOWN_CHARS = 40
"""Characters of a bad value an error message quotes: a line may hold a
number of thousands of digits or a list of thousands of items."""


def _shown(value: object) -> str:
    """``repr(value)``, cut to ``SHOWN_CHARS`` characters."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


def _hash_ids(obj: dict[str, Any], where: str) -> list[int]:
    """The line's ``hash_ids``; ``TraceFormatError`` saying what is there instead."""
    must = f"{where}: 'hash_ids' must be a list of ints in [0, 2**64)"
    if "hash_ids" not in obj:
        raise TraceFormatError(f"{must}; the line has none")
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise TraceFormatError(f"{must}, got {_shown(ids)}")
    for i, h in enumerate(ids):
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < 1 << 64:
            raise TraceFormatError(f"{must}, got {_shown(h)} at index {i}")
    return ids


def _chained(ids: list[int]) -> list[int]:
    """``ids`` with each repeat of an id within the request replaced by an id
    derived from its parent's and its own (a 64-bit BLAKE2b of the two), as
    an engine's chained block hashes make the same tokens at another place in
    a prompt another block; an id the request already has is derived again.
    Mooncake's ids are prefix hashes already, so a request's ids are distinct
    and come back unchanged (one C-level check); kept as one key, a repeat made
    prefix hits that no engine would have."""
    if len(set(ids)) == len(ids):
        return ids
    out: list[int] = []
    seen: set[int] = set()
    for h in ids:
        while h in seen:
            parent = out[-1] if out else 0
            digest = hashlib.blake2b(parent.to_bytes(8, "big") + h.to_bytes(8, "big"),
                                     digest_size=8, person=b"kvtier-repeat").digest()
            h = int.from_bytes(digest, "big")
        seen.add(h)
        out.append(h)
    return out


def parse_line(line: str, where: str) -> TraceRequest:
    """Parse one trace line; ``where`` ("file:line") prefixes any error."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not valid JSON ({exc.msg})") from None
    except ValueError:  # json reads no int of more digits than sys.get_int_max_str_digits()
        raise TraceFormatError(f"{where}: holds a number too long to read (more than "
                               f"{sys.get_int_max_str_digits()} digits)") from None
    except RecursionError:  # json recurses once per nested list or object
        raise TraceFormatError(f"{where}: lists or objects nested too deeply to read") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    ids = _chained(_hash_ids(obj, where))
    return TraceRequest(
        _timestamp(obj, where),
        _length(obj, "input_length", where),
        _length(obj, "output_length", where),
        tuple(ids),
    )


def iter_trace(path: str | Path) -> Iterator[TraceRequest]:
    """Yield the requests of a Mooncake jsonl file in file order (blank lines
    skipped, a UTF-8 byte order mark before the first line ignored). The file
    may be a pipe (``/dev/stdin``, a shell's ``<(zcat trace.jsonl.gz)``): it is
    read once, front to back."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"trace path is a directory, not a file: {path}")
    if not path.exists():
        raise FileNotFoundError(f"trace file not found: {path}")
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if lineno == 1:
                raw = _first_line(raw, path)
            if raw.strip():
                yield parse_line(_decode(raw, f"{path}:{lineno}"), f"{path}:{lineno}")


def request_line(path: str | Path, index: int) -> int:
    """The line number (from 1) of request ``index`` (from 0) of the trace at
    ``path``, counting the blank lines ``iter_trace`` skips; 0 when the file
    holds fewer requests."""
    seen = 0
    with Path(path).open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if (raw.removeprefix(UTF8_BOM) if lineno == 1 else raw).strip():
                if seen == index:
                    return lineno
                seen += 1
    return 0


def _first_line(raw: bytes, path: Path) -> bytes:
    """The first line without a UTF-8 byte order mark (editors and Windows
    tools write one; it is not part of the JSON). ``TraceFormatError`` when
    the file is gzip-compressed, which the trace is not read as."""
    if raw.startswith(GZIP_MAGIC):
        raise TraceFormatError(f"{path}: gzip-compressed; a trace is read as plain "
                               f"JSON lines: decompress it first (gunzip -k {path})")
    return raw.removeprefix(UTF8_BOM)


def _decode(raw: bytes, where: str) -> str:
    """Decode one raw line as UTF-8; ``where`` prefixes the error."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{where}: not UTF-8 text ({exc.reason})") from None


def load_trace(path: str | Path) -> list[TraceRequest]:
    """All requests of a Mooncake jsonl file."""
    return list(iter_trace(path))


LOAD_PROGRESS_EVERY = 4096
"""Requests read between two updates of the loading counter."""


def load_requests(path: Path, limit: int | None = None,
                  progress: bool = False) -> list[TraceRequest]:
    """The trace's requests, the first ``limit`` only when given (the rest of
    the file is not read); ``CommandError`` when unreadable or empty.
    ``progress``: a counter of the requests read on a terminal (a trace of
    millions of requests takes tens of seconds to read).

    Memory: the requests read, about 45 bytes per hash id (a request of the
    bundled trace, 24 ids, about 1 KB).
    """
    bar = make_progress(None, progress, unit="req")
    bar.describe(f"reading {path.name}")
    try:
        requests = _read_counted(itertools.islice(iter_trace(path), limit), bar)
    except (FileNotFoundError, IsADirectoryError) as exc:
        raise CommandError(str(exc)) from None
    except TraceFormatError as exc:
        raise CommandError(f"malformed trace: {exc}") from None
    except OSError as exc:
        raise CommandError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    finally:
        bar.close()
    if not requests:
        raise CommandError(f"{path}: the trace has no requests")
    return requests


def _read_counted(requests: Iterator[TraceRequest], bar: Progress) -> list[TraceRequest]:
    """``list(requests)``, advancing ``bar`` every ``LOAD_PROGRESS_EVERY``."""
    out: list[TraceRequest] = []
    for chunk in iter(lambda: list(itertools.islice(requests, LOAD_PROGRESS_EVERY)), []):
        out.extend(chunk)
        bar.update(len(chunk))
    return out
