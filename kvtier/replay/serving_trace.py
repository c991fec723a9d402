"""The traces the serving benchmark replays with vLLM's ``timed_trace`` client.

A Mooncake trace counts prompts in 512-token blocks (``hash_ids``). A real
server here runs a tiny model with 32-token engine blocks, so the benchmark
maps one Mooncake block to one engine block: input lengths are divided by
``512 / tokens_per_block`` (16), hash ids are kept, and the client expands each
hash id into ``tokens_per_block`` tokens (``--timed-trace-chunk-hash-size``).
Output lengths are capped (``output_cap``): decoding is not what kvtier saves,
and a tiny model on two cores would spend the run in it. Timestamps are kept;
the client scales them (``--timed-trace-sec-multiplier``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

from kvtier.replay.generate import generate, write_trace
from kvtier.replay.trace import (
    BUNDLED_TRACE,
    MOONCAKE_BLOCK_TOKENS,
    TraceRequest,
    iter_trace,
    request_line,
)

ENGINE_BLOCK_TOKENS = 32
"""Tokens per engine block of the engines kvtier's demos, benchmarks and
behind-the-engine replays run: vLLM's CPU attention takes multiples of 32,
and the smallest gives a prompt the most blocks."""

DEFAULT_OUTPUT_CAP = 8


class UnservableRequestError(ValueError):
    """A request that cannot be served as the engine serves it. ``index`` is
    the request's position in the trace (from 0); ``where`` names it in the
    message (default ``request INDEX``); ``needs`` says what it lacks."""

    problem = "cannot be served"
    needs = "prompt tokens"

    def __init__(self, index: int, where: str = "") -> None:
        super().__init__(f"{where or f'request {index}'} {self.problem}")
        self.index = index


class MissingLengthError(UnservableRequestError):
    """A request has ``hash_ids`` but no ``input_length`` (absent or 0): how many
    tokens its blocks hold is unknown, so it cannot be served as the engine
    serves it."""

    problem = "has hash_ids but no input_length (absent or 0)"
    needs = "input_length (its prompt tokens)"


class NoPromptError(UnservableRequestError):
    """A request without ``hash_ids``: vLLM's client expands them into the
    prompt, so its prompt would be empty."""

    problem = "has no prompt tokens (no hash_ids)"
    needs = "hash_ids (its prompt's blocks)"


def located(exc: UnservableRequestError, path: Path) -> UnservableRequestError:
    """``exc`` naming the line of the trace at ``path`` its request is on."""
    try:
        lineno = request_line(path, exc.index)
    except OSError:
        lineno = 0
    # 0: a pipe, already read to its end, cannot be read again to count lines
    where = f"{path} line {lineno}" if lineno else f"request {exc.index + 1} of {path}"
    return type(exc)(exc.index, where)


def missing_length_message(option: str, path: Path, exc: UnservableRequestError) -> str:
    """The usage error for ``exc``: ``option`` needs what the request lacks
    (token lengths, hash ids), and where in the trace at ``path`` it is."""
    return f"{option} needs each request's {exc.needs}; {located(exc, path)}"


def scaled(requests: Iterable[TraceRequest], tokens_per_block: int = ENGINE_BLOCK_TOKENS,
           output_cap: int = DEFAULT_OUTPUT_CAP,
           limit: int | None = None) -> Iterator[TraceRequest]:
    """``requests`` with one Mooncake block mapped to one engine block of
    ``tokens_per_block`` tokens (module doc); the first ``limit`` only.

    ``MissingLengthError`` for a request with hash ids but no input length
    (its prompt would otherwise become one token)."""
    if tokens_per_block < 1 or MOONCAKE_BLOCK_TOKENS % tokens_per_block:
        raise ValueError(f"tokens_per_block must divide {MOONCAKE_BLOCK_TOKENS}, "
                         f"got {tokens_per_block}")
    if output_cap < 1:
        raise ValueError(f"output_cap must be >= 1, got {output_cap}")
    factor = MOONCAKE_BLOCK_TOKENS // tokens_per_block
    for i, request in enumerate(requests):
        if limit is not None and i >= limit:
            return
        if request.hash_ids and request.input_length < 1:
            raise MissingLengthError(i)
        yield replace(request, input_length=max(1, request.input_length // factor),
                      output_length=max(1, min(output_cap, request.output_length)))


def write_scaled(source: Path | None, out: Path, *, requests: int | None,
                 tokens_per_block: int = ENGINE_BLOCK_TOKENS,
                 output_cap: int = DEFAULT_OUTPUT_CAP) -> int:
    """Write the scaled ``source`` trace (default: the bundled one) to ``out``;
    ``MissingLengthError`` / ``NoPromptError`` naming the line of a request
    without an input length / without hash ids (vLLM's client would send it
    as an empty prompt, which the server refuses)."""
    path = source or BUNDLED_TRACE
    try:
        return write_trace(_with_prompts(scaled(iter_trace(path), tokens_per_block,
                                                output_cap, requests)), out)
    except UnservableRequestError as exc:
        raise located(exc, path) from None


def _with_prompts(requests: Iterable[TraceRequest]) -> Iterator[TraceRequest]:
    """``requests``; ``NoPromptError`` at the first one without hash ids."""
    for i, request in enumerate(requests):
        if not request.hash_ids:
            raise NoPromptError(i)
        yield request


def write_generated(kind: str, seed: int, out: Path, *, requests: int,
                    tokens_per_block: int = ENGINE_BLOCK_TOKENS,
                    output_cap: int = DEFAULT_OUTPUT_CAP) -> int:
    """Write ``kvtier generate KIND`` traffic, scaled the same way, to ``out``."""
    return write_trace(scaled(generate(kind, seed, requests), tokens_per_block, output_cap),
                       out)


def longest_request(path: Path) -> int:
    """Prompt plus output tokens of the longest request of a (scaled) trace."""
    return max((r.input_length + r.output_length for r in iter_trace(path)), default=1)

