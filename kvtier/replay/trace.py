"""Mooncake-format traces: one JSON request per line."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import CommandError, KVTierError

MOONCAKE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` block in the Mooncake traces."""

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
        raise TraceFormatError(f"{where}: {name!r} must be a non-negative int, got {value!r}")
    return value


def _timestamp(obj: dict[str, Any], where: str) -> float:
    """The arrival in ms: any finite non-negative number (vLLM's ``timed_trace``
    client reads it as a float too); 0 when absent."""
    value = obj.get("timestamp", 0)
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value < 0):
        raise TraceFormatError(
            f"{where}: 'timestamp' must be a non-negative number of ms, got {value!r}")
    return value


def parse_line(line: str, where: str) -> TraceRequest:
    """Parse one trace line; ``where`` ("file:line") prefixes any error."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceFormatError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceFormatError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 1 << 64 for h in ids
    ):
        raise TraceFormatError(f"{where}: 'hash_ids' must be a list of ints in [0, 2**64)")
    return TraceRequest(
        _timestamp(obj, where),
        _length(obj, "input_length", where),
        _length(obj, "output_length", where),
        tuple(ids),
    )


def iter_trace(path: str | Path) -> Iterator[TraceRequest]:
    """Yield the requests of a Mooncake jsonl file in file order (blank lines skipped)."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"trace path is a directory, not a file: {path}")
    if not path.is_file():
        raise FileNotFoundError(f"trace file not found: {path}")
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if raw.strip():
                yield parse_line(_decode(raw, f"{path}:{lineno}"), f"{path}:{lineno}")


def request_line(path: str | Path, index: int) -> int:
    """The line number (from 1) of request ``index`` (from 0) of the trace at
    ``path``, counting the blank lines ``iter_trace`` skips; 0 when the file
    holds fewer requests."""
    seen = 0
    with Path(path).open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            if raw.strip():
                if seen == index:
                    return lineno
                seen += 1
    return 0


def _decode(raw: bytes, where: str) -> str:
    """Decode one raw line as UTF-8; ``where`` prefixes the error."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceFormatError(f"{where}: not UTF-8 text ({exc.reason})") from None


def load_trace(path: str | Path) -> list[TraceRequest]:
    """All requests of a Mooncake jsonl file."""
    return list(iter_trace(path))


def load_requests(path: Path) -> list[TraceRequest]:
    """The trace's requests; ``CommandError`` when unreadable or empty."""
    try:
        requests = load_trace(path)
    except (FileNotFoundError, IsADirectoryError) as exc:
        raise CommandError(str(exc)) from None
    except TraceFormatError as exc:
        raise CommandError(f"malformed trace: {exc}") from None
    except OSError as exc:
        raise CommandError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    if not requests:
        raise CommandError(f"{path}: the trace has no requests")
    return requests
