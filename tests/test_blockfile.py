"""The checksummed block format shared by the disk and Redis tiers, and namespaces."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import block_key
from kvtier.tiers import KVLayout, check_namespace, namespace_of
from kvtier.tiers.blockfile import (
    FIXED_HEADER_BYTES,
    FORMAT_VERSION,
    MAGIC,
    MAX_KEY_BYTES,
    CorruptBlockError,
    byte_view,
    decode,
    encode,
    header_size,
    pack_header,
    unpack_header,
    verify,
)

NS = b"0123456789abcdef"
KEY = block_key(b"\x01" * 32, 3)


def _reason(value: bytes | bytearray, ns: bytes = NS, key: bytes = KEY) -> str:
    with pytest.raises(CorruptBlockError) as info:
        decode(value, ns, key)
    return info.value.reason


def test_round_trip_of_every_buffer_kind() -> None:
    data = np.arange(1000, dtype=np.uint8)
    for payload in (data, data.tobytes(), bytearray(data.tobytes()), memoryview(data)):
        value = encode(NS, KEY, payload)
        assert len(value) == header_size(NS, KEY) + 1000
        assert bytes(decode(value, NS, KEY)) == data.tobytes()


def test_documented_layout() -> None:
    value = encode(NS, KEY, b"payload")
    assert FIXED_HEADER_BYTES == 40
    magic, version, algo, flags, ns_len, key_len, reserved, length = struct.unpack_from(
        "<4sHBBHHIQ", value
    )
    assert (magic, version, algo, flags, reserved) == (MAGIC, FORMAT_VERSION, 1, 0, 0)
    assert (ns_len, key_len, length) == (len(NS), len(KEY), 7)
    assert value[40 : 40 + len(NS)] == NS
    assert value[40 + len(NS) : 40 + len(NS) + len(KEY)] == KEY
    assert value[header_size(NS, KEY) :] == b"payload"
    header = unpack_header(value)
    assert (header.namespace, header.key, header.payload_len) == (NS, KEY, 7)
    assert header.size == header_size(NS, KEY)
    assert len(header.checksum) == 16


def test_every_flipped_byte_is_detected() -> None:
    value = encode(NS, KEY, bytes(range(200)))
    for i in range(len(value)):
        bad = bytearray(value)
        bad[i] ^= 0x01
        _reason(bad)  # raises for a flip anywhere: header, namespace, key or payload


def test_truncated_and_extended_values_are_detected() -> None:
    value = encode(NS, KEY, bytes(100))
    for n in range(len(value)):
        assert _reason(value[:n]) in {"truncated", "length mismatch"}
    assert _reason(value + b"\0") == "length mismatch"


def test_wrong_identity_and_version() -> None:
    value = encode(NS, KEY, b"x" * 10)
    assert _reason(value, ns=b"fedcba9876543210") == "namespace mismatch"
    assert _reason(value, key=block_key(b"\x02" * 32, 3)) == "key mismatch"
    assert _reason(b"XXXX" + value[4:]) == "bad magic"
    future = bytearray(value)
    future[4:6] = (FORMAT_VERSION + 1).to_bytes(2, "little")
    assert _reason(future) == "unsupported version"
    algo = bytearray(value)
    algo[6] = 9
    assert _reason(algo) == "unknown checksum algorithm"
    assert _reason(b"") == "truncated"


def test_verify_needs_the_exact_payload() -> None:
    header = unpack_header(pack_header(NS, KEY, b"abc"))
    verify(header, b"abc")
    with pytest.raises(CorruptBlockError, match="checksum"):
        verify(header, b"abd")
    with pytest.raises(CorruptBlockError, match="length"):
        verify(header, b"abcd")


def test_bad_arguments_are_caller_errors() -> None:
    with pytest.raises(TypeError, match="key must be bytes"):
        pack_header(NS, "key", b"x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="key must be"):
        pack_header(NS, b"", b"x")
    with pytest.raises(ValueError, match="key must be"):
        pack_header(NS, b"k" * (MAX_KEY_BYTES + 1), b"x")
    with pytest.raises(ValueError, match="namespace"):
        pack_header(b"", KEY, b"x")
    with pytest.raises(TypeError, match="bytes-like"):
        pack_header(NS, KEY, 12)
    with pytest.raises(ValueError, match="contiguous"):
        byte_view(np.zeros((4, 4), np.uint8)[:, 1])
    with pytest.raises(ValueError, match="read-only"):
        byte_view(b"abc", writable=True)
    assert byte_view(np.zeros(3, np.int32)).nbytes == 12


@settings(max_examples=60, deadline=None)
@given(
    ns=st.text("0123456789abcdef", min_size=1, max_size=64).map(str.encode),
    key=st.binary(min_size=1, max_size=80),
    payload=st.binary(max_size=3000),
)
def test_round_trip_property(ns: bytes, key: bytes, payload: bytes) -> None:
    value = encode(ns, key, payload)
    assert bytes(decode(value, ns, key)) == payload


# ---------------------------------------------------------------- namespaces
LAYOUT = KVLayout("meta-llama/Llama-3-8B", "bfloat16", 16, 32, 8, 128, tp_rank=0, tp_size=2)


def test_namespace_is_short_hex_and_stable() -> None:
    ns = LAYOUT.namespace()
    assert len(ns) == 16 and int(ns, 16) >= 0
    again = KVLayout("meta-llama/Llama-3-8B", "bfloat16", 16, 32, 8, 128, tp_rank=0, tp_size=2)
    assert again.namespace() == ns
    assert check_namespace(ns) == ns


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other"}, {"dtype": "float16"}, {"block_size": 32}, {"num_layers": 33},
        {"num_kv_heads": 4}, {"head_dim": 64}, {"tp_rank": 1}, {"pp_size": 2},
        {"extra": {"kv_layout": "HND"}},
    ],
)
def test_every_layout_fact_changes_the_namespace(change: dict[str, object]) -> None:
    fields = {
        "model": "meta-llama/Llama-3-8B", "dtype": "bfloat16", "block_size": 16,
        "num_layers": 32, "num_kv_heads": 8, "head_dim": 128, "tp_rank": 0, "tp_size": 2,
    }
    fields.update(change)
    assert KVLayout(**fields).namespace() != LAYOUT.namespace()  # type: ignore[arg-type]


def test_tenant_salt_separates_and_hides() -> None:
    plain = LAYOUT.namespace()
    a, b = LAYOUT.namespace("tenant-a"), LAYOUT.namespace(b"tenant-b")
    assert len({plain, a, b}) == 3
    assert LAYOUT.namespace("tenant-a") == a
    assert "tenant" not in repr(LAYOUT)
    assert namespace_of(LAYOUT.fingerprint(), "tenant-a") == a


def test_bad_layouts_and_namespaces() -> None:
    with pytest.raises(ValueError, match="tp_rank must be < tp_size"):
        KVLayout("m", "bf16", 16, 2, 2, 64, tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="block_size"):
        KVLayout("m", "bf16", 0, 2, 2, 64)
    with pytest.raises(ValueError, match="model"):
        KVLayout("", "bf16", 16, 2, 2, 64)
    with pytest.raises(ValueError, match="tenant_salt"):
        LAYOUT.namespace("")
    for bad in ("", ".hidden", "a/b", "x" * 65, "sp ace"):
        with pytest.raises(ValueError, match="namespace"):
            check_namespace(bad)
    with pytest.raises(TypeError):
        check_namespace(b"abc")
