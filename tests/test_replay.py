"""The replay driver and the trace loader (kvtier.replay)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtier.replay.driver import ReplayResult, replay, trace_keys
from kvtier.replay.trace import BUNDLED_TRACE, TraceFormatError, TraceRequest, load_trace

README_LRU = {1_000: 0.0445, 4_000: 0.0865, 16_000: 0.2627}
"""LRU prefix-hit ratios of data/mooncake/README.md."""


@pytest.fixture(scope="module")
def bundled_keys() -> list[list[bytes]]:
    """The bundled Mooncake trace as block keys (loaded once for the module)."""
    return trace_keys(load_trace(BUNDLED_TRACE))


def _requests(*chains: list[int]) -> list[TraceRequest]:
    return [TraceRequest(i, 512 * len(c), 1, tuple(c)) for i, c in enumerate(chains)]


def _write(tmp_path: Path, lines: list[str], name: str = "t.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


# -- the bundled trace and the README's figures ----------------------------------


def test_bundled_trace_matches_readme_counts(bundled_keys: list[list[bytes]]) -> None:
    assert len(bundled_keys) == 12_031
    assert sum(map(len, bundled_keys)) == 288_500
    assert len({k for keys in bundled_keys for k in keys}) == 182_790


@pytest.mark.parametrize("capacity", sorted(README_LRU))
def test_lru_reproduces_readme(bundled_keys: list[list[bytes]], capacity: int) -> None:
    result = replay(bundled_keys, capacity, "lru")
    assert abs(result.hit_ratio - README_LRU[capacity]) < 0.0005, result
    assert result.offered_blocks == 288_500
    assert result.requests == 12_031
    assert result.allocation_failures == 0
    assert result.stores - result.evictions <= capacity
    assert result.us_per_key > 0


# -- driver semantics on small traces ----------------------------------------------


def test_prefix_hits_count_leading_run_only() -> None:
    keys = trace_keys(_requests([1, 2], [1, 2, 3], [9, 1, 2]))
    r = replay(keys, 10, "lru")
    # request 2 hits 1, 2; request 3 starts with a miss, so 1, 2 are no prefix hit
    assert (r.hit_blocks, r.offered_blocks, r.stores, r.evictions) == (2, 8, 4, 0)
    assert r.hit_ratio == pytest.approx(2 / 8)
    assert r.bytes_written == 4


def test_bytes_written_uses_block_bytes() -> None:
    r = replay(trace_keys(_requests([1, 2, 3])), 10, block_bytes=1024)
    assert r.bytes_written == 3 * 1024


def test_offer_larger_than_cache_is_an_allocation_failure() -> None:
    r = replay(trace_keys(_requests([1, 2, 3], [1])), 2, "lru")
    # the 3-block offer cannot fit a 2-block cache; the next request stores normally
    assert r.allocation_failures == 1
    assert (r.stores, r.hit_blocks) == (1, 0)


def test_store_threshold_skips_first_offers() -> None:
    keys = trace_keys(_requests([1, 2], [1, 2], [1, 2]))
    r = replay(keys, 10, "lru", store_threshold=2)
    assert (r.stores_skipped, r.stores, r.hit_blocks) == (2, 2, 2)
    assert r.store_threshold == 2


def test_tail_evicted_before_head() -> None:
    # [1, 2, 3] fills the cache; a new block evicts the tail 3, so 1, 2 still hit
    # (a prefix longer than half the cache: the replay's lease bound is the cache).
    keys = trace_keys(_requests([1, 2, 3], [4], [1, 2, 3]))
    r = replay(keys, 3, "lru")
    assert r.hit_blocks == 2


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_progress_reports_every_request(policy: str) -> None:
    keys = trace_keys(_requests(*([i, i + 1] for i in range(1000))))
    seen: list[int] = []
    r = replay(keys, 50, policy, progress=seen.append)
    assert sum(seen) == r.requests == 1000
    assert len(seen) > 1


def test_empty_trace_has_zero_ratio() -> None:
    r = replay([], 10)
    assert (r.requests, r.offered_blocks, r.hit_ratio, r.us_per_key) == (0, 0, 0.0, 0.0)


def test_unknown_policy_lists_known_ones() -> None:
    with pytest.raises(ValueError, match="known policies: adaptive, arc, lru"):
        replay([], 10, "nope")


def test_result_dict_has_every_field() -> None:
    d = replay(trace_keys(_requests([1])), 4).to_dict()
    assert list(d) == list(ReplayResult.__dataclass_fields__)


def test_trace_keys_share_key_objects() -> None:
    keys = trace_keys(_requests([7, 8], [7]))
    assert keys[0][0] is keys[1][0]
    assert keys[0][0] == (7).to_bytes(8, "big") + bytes(4)


# -- trace loader ------------------------------------------------------------------


def test_bundled_trace_constant_points_at_data() -> None:
    assert BUNDLED_TRACE.is_file()
    assert BUNDLED_TRACE.parts[-3:] == ("data", "mooncake", "conversation_trace.jsonl")


def test_malformed_line_names_file_and_line(tmp_path: Path) -> None:
    good = '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [1]}'
    path = _write(tmp_path, [good, good, '{"hash_ids": [1,', good])
    with pytest.raises(TraceFormatError, match=rf"{path.name}:3: not valid JSON"):
        load_trace(path)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("[1, 2]", "expected a JSON object"),
        ('{"hash_ids": "1"}', "'hash_ids' must be a list"),
        ('{"hash_ids": [-1]}', "'hash_ids' must be a list"),
        ('{"hash_ids": [1], "timestamp": -1}', "'timestamp' must be a non-negative number"),
        ('{"hash_ids": [1], "timestamp": "5"}', "'timestamp' must be a non-negative number"),
        ('{"hash_ids": [1], "timestamp": NaN}', "'timestamp' must be a non-negative number"),
        ('{"hash_ids": [1], "input_length": 1.5}', "'input_length' must be a non-negative int"),
        ('{"hash_ids": [1], "output_length": true}', "'output_length' must be a non-negative int"),
    ],
)
def test_invalid_request_lines(tmp_path: Path, line: str, message: str) -> None:
    path = _write(tmp_path, ['{"hash_ids": [1]}', line])
    with pytest.raises(TraceFormatError, match=rf":2: {message}"):
        load_trace(path)


def test_float_timestamps_and_integral_float_lengths_are_read(tmp_path: Path) -> None:
    # vLLM's timed_trace client reads timestamps as floats; table exports write 512.0
    path = _write(tmp_path, ['{"timestamp": 1.5, "input_length": 512.0, "output_length": 7,'
                             ' "hash_ids": [1]}'])
    (request,) = load_trace(path)
    assert (request.timestamp, request.input_length, request.output_length) == (1.5, 512, 7)
    assert isinstance(request.input_length, int)


def test_non_utf8_line_is_a_format_error(tmp_path: Path) -> None:
    path = tmp_path / "bin.jsonl"
    path.write_bytes(b'{"hash_ids": [1]}\n\xff\xfe\n')
    with pytest.raises(TraceFormatError, match=r"bin.jsonl:2: not UTF-8"):
        load_trace(path)


def test_blank_lines_skipped_but_counted(tmp_path: Path) -> None:
    path = _write(tmp_path, ['{"hash_ids": [1]}', "", '{"hash_ids": [2, 3]}', "oops"])
    with pytest.raises(TraceFormatError, match=r":4:"):
        load_trace(path)
    assert len(load_trace(_write(tmp_path, ['{"hash_ids": [1]}', "  "], "b.jsonl"))) == 1


def test_missing_and_directory_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="trace file not found"):
        load_trace(tmp_path / "absent.jsonl")
    with pytest.raises(IsADirectoryError, match="directory"):
        load_trace(tmp_path)


# -- token lengths, for the views that need them --------------------------------------


def test_served_trace_needs_input_lengths_and_names_the_line(tmp_path: Path) -> None:
    from kvtier.replay.behind_engine import served_requests
    from kvtier.replay.serving_trace import (
        MissingLengthError,
        missing_length_message,
        scaled,
    )

    lines = ['{"input_length": 1024, "hash_ids": [1, 2]}', "",
             '{"hash_ids": [1, 2, 3]}', '{"input_length": 0, "hash_ids": [4]}']
    path = _write(tmp_path, lines)
    trace = load_trace(path)
    # the replays that count blocks only read absent lengths as 0
    assert [r.input_length for r in trace] == [1024, 0, 0]
    with pytest.raises(MissingLengthError) as exc:
        served_requests(trace)
    # not one token per request (the old max(1, 0)): the second request, line 3
    assert exc.value.index == 1
    assert missing_length_message("--gpu-blocks", path, exc.value) == (
        f"--gpu-blocks needs each request's input_length (its prompt tokens); {path} "
        "line 3 has hash_ids but no input_length (absent or 0)")
    with pytest.raises(MissingLengthError):
        list(scaled([TraceRequest(0, 0, 5, (9,))]))
    # no hash ids and no length: the request is empty, not unsized
    assert [r.input_length for r in scaled([TraceRequest(0, 0, 5, ())])] == [1]


def test_scaled_trace_file_names_the_line_without_a_length(tmp_path: Path) -> None:
    # the serving benchmark's trace: a prompt of one token per request before
    from kvtier.replay.serving_trace import MissingLengthError, write_scaled

    path = _write(tmp_path, ['{"input_length": 600, "hash_ids": [1, 2]}', "",
                             '{"output_length": 3, "hash_ids": [1, 2, 3]}'])
    with pytest.raises(MissingLengthError, match=rf"^{re.escape(str(path))} line 3 has "
                       r"hash_ids but no input_length \(absent or 0\)$"):
        write_scaled(path, tmp_path / "scaled.jsonl", requests=None)
    assert write_scaled(path, tmp_path / "one.jsonl", requests=1) == 1


def test_scaled_trace_file_names_the_line_without_hash_ids(tmp_path: Path) -> None:
    # the serving benchmark's client sent it as an empty prompt, refused by the server
    from kvtier.replay.serving_trace import NoPromptError, write_scaled

    path = _write(tmp_path, ['{"input_length": 600, "hash_ids": [1, 2]}',
                             '{"input_length": 600, "hash_ids": []}'])
    with pytest.raises(NoPromptError, match=rf"^{re.escape(str(path))} line 2 has "
                       r"no prompt tokens \(no hash_ids\)$"):
        write_scaled(path, tmp_path / "scaled.jsonl", requests=None)
    assert write_scaled(path, tmp_path / "one.jsonl", requests=1) == 1


def test_request_line_counts_blank_lines(tmp_path: Path) -> None:
    from kvtier.replay.trace import request_line

    path = _write(tmp_path, ['{"hash_ids": [1]}', "", "  ", '{"hash_ids": [2]}'])
    assert [request_line(path, i) for i in range(3)] == [1, 4, 0]
