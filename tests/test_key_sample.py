"""The CRC-32 key sample (kvtier.policies.key_sample) the default policy's
shadows and admission evidence draw."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import kvtier
from kvtier.policies.key_sample import KeySample


def ks(ids: range) -> list[bytes]:
    return [kvtier.block_key(i) for i in ids]


def test_a_key_sample_is_the_same_in_every_draw() -> None:
    keys = ks(range(20_000))
    sample = KeySample(1 / 8)
    drawn = sample.keys(keys)
    assert drawn == KeySample(1 / 8).keys(keys)  # CRC-32, not Python's salted hash
    assert 2300 < len(drawn) < 2700
    assert set(KeySample(1 / 32).keys(keys)) <= set(drawn)  # nested rates
    assert KeySample(1).keys(iter(keys[:3])) == keys[:3]
    for bad in (0, -0.5, 1.5, True, "1"):
        with pytest.raises(ValueError, match="sampling rate must be a number in"):
            KeySample(bad)  # type: ignore[arg-type]


def test_a_key_sample_is_the_same_in_every_process() -> None:
    code = ("import kvtier; from kvtier.policies.key_sample import KeySample; "
            "keys = [kvtier.block_key(i) for i in range(5000)]; "
            "print([i for i, k in enumerate(keys) if KeySample(1 / 16).keys([k])])")
    drawn = {subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                            text=True, env={**os.environ, "PYTHONHASHSEED": seed}).stdout
             for seed in ("1", "2")}
    assert len(drawn) == 1 and drawn.pop().startswith("[")  # Python's hash() would differ
