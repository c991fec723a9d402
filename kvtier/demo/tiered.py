"""``kvtier demo --disk DIR``: a disk tier outlives the server that filled it.

Two real servers run one after the other (``kvtier serve``, vLLM's HTTP
server, the tiny local model), both with a disk tier on ``DIR``:

1. the first serves the first ``turns - 1`` turns of every conversation of the
   chat workload (kvtier writes their blocks through to disk) and stops;
2. the second, a new process with an empty GPU cache and an empty CPU tier,
   serves the same conversations' next turn, then all turns again.

Its first prompts find their prefixes on disk; what they promote is in the CPU
tier for later ones. For every request the demo prints where its prompt's
tokens came from: the engine's own prefix cache (``device``), kvtier's CPU
tier (``host``), the disk tier (``disk``), or computed. The figures are the
server's own (``vllm:prompt_tokens_cached_by_source`` before and after each
request); requests go one at a time. Greedy answers of the second server are
checked token for token against the first's where both answered the same
prompt. The demo fails (exit status 1) when an answer differs, when nothing
was compared, when the second server got nothing from disk, or when the first
did (it must start from an empty disk tier: ``DIR`` must be new or empty).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvtier import prom
from kvtier.demo.tiny_model import kv_bytes_per_block
from kvtier.demo.workload import DemoError, Workload
from kvtier.server_process import ServerProcess

SOURCES = ("device", "host", "disk")
BLOCK_TOKENS = 32
# float32: greedy answers then do not depend on how a prompt was split between
# cached and computed tokens (bf16 rounding differs between batch shapes, and a
# random tiny model has near-ties), so the answer check checks the bytes.
ENGINE_FLAGS = ["--block-size", str(BLOCK_TOKENS), "--max-model-len", "4096",
                "--num-gpu-blocks-override", "256", "--kv-cache-memory-bytes", str(64 << 20),
                "--gpu-memory-utilization", "0.5", "--enforce-eager", "--dtype", "float32"]


@dataclass(frozen=True)
class Served:
    """One request and where its prompt tokens came from."""

    server: int
    conversation: int
    turn: int
    prompt_tokens: int
    device: int
    host: int
    disk: int
    answer: str
    token_ids: tuple[int, ...]

    @property
    def computed(self) -> int:
        return self.prompt_tokens - self.device - self.host - self.disk


def prompt_of(w: Workload, conversation: int, turn: int, replies: dict[tuple[int, int], list[int]]
              ) -> list[int]:
    """Turn ``turn`` of ``conversation``: system prompt, then the earlier turns'
    user messages and replies, then this turn's user message."""
    out = list(w.system_prompt())
    for t in range(1, turn):
        out += w.user_message(conversation, t) + replies[(conversation, t)]
    return out + w.user_message(conversation, turn)


def _cached(url: str) -> dict[str, float]:
    return dict(prom.by_label(prom.scrape(url), "vllm:prompt_tokens_cached_by_source_total",
                              "source"))


def _ask(url: str, model: Path, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model=str(model), prompt=prompt, max_tokens=max_tokens,
                                    temperature=0.0, extra_body={"return_token_ids": True})
    choice = out.choices[0]
    ids = list(getattr(choice, "token_ids", None) or [])
    return ids, choice.text


def serve_turns(url: str, model: Path, server: int, w: Workload,
                turns: Sequence[tuple[int, int]], replies: dict[tuple[int, int], list[int]],
                say: Callable[[Served], None]) -> list[Served]:
    """Ask ``turns`` one at a time; record each reply and where its prompt came from."""
    out = []
    for conversation, turn in turns:
        prompt = prompt_of(w, conversation, turn, replies)
        before = _cached(url)
        ids, text = _ask(url, model, prompt, w.reply_tokens)
        after = prom_wait(url, before)
        replies.setdefault((conversation, turn), ids)
        got = {s: int(after.get(s, 0) - before.get(s, 0)) for s in SOURCES}
        served = Served(server, conversation, turn, len(prompt), **got, answer=text,
                        token_ids=tuple(ids))
        out.append(served)
        say(served)
    return out


def prom_wait(url: str, before: dict[str, float], tries: int = 20) -> dict[str, float]:
    """The counters once this request's figures arrived (they come a step late)."""
    import time

    after = _cached(url)
    for _ in range(tries):
        if after != before:
            break
        time.sleep(0.1)
        after = _cached(url)
    return after


def server_argv(model: Path, disk: Path, port: int, cpu_bytes: int) -> list[str]:
    disk_bytes = 16384 * 2 * kv_bytes_per_block(BLOCK_TOKENS)  # float32: twice bf16's
    return [sys.executable, "-m", "kvtier", "serve", str(model), "--cpu-bytes", str(cpu_bytes),
            "--disk-path", str(disk), "--disk-bytes", str(disk_bytes), "--port", str(port),
            *ENGINE_FLAGS]


def check_args(disk: Path, w: Workload) -> None:
    """``DemoError`` unless the first server can serve a turn (``w.turns`` >= 2)
    and start from an empty disk tier: a ``disk`` directory holding an earlier
    run's blocks would serve both servers the same bytes from disk, and their
    answers' comparison would check nothing."""
    if w.turns < 2:
        raise DemoError("--disk needs --turns 2 or more: the first server serves all "
                        "turns but the last")
    if disk.exists() and not disk.is_dir():
        raise DemoError(f"--disk {disk} is not a directory")
    if disk.is_dir() and any(disk.iterdir()):
        raise DemoError(f"--disk {disk} is not empty: the first server must start with "
                        "an empty disk tier (give a new or empty directory)")


def run(model: Path, disk: Path, w: Workload, cpu_bytes: int,
        say: Callable[[str], None], row: Callable[[Served], None]) -> list[Served]:
    """Both servers, one after the other, on ``disk``."""
    from kvtier.tiers.redis_server import free_port

    replies: dict[tuple[int, int], list[int]] = {}
    conversations = range(1, w.conversations + 1)
    first = [(c, t) for t in range(1, w.turns) for c in conversations]
    second = [(c, w.turns) for c in conversations] + first  # the new turn, then the old ones
    results = []
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-logs-") as logs:
        for server, turns in ((1, first), (2, second)):
            port = free_port()
            say(f"starting server {server} (kvtier serve, disk tier {disk}) ...")
            proc = ServerProcess(server_argv(model, disk, port, cpu_bytes), port,
                                 Path(logs) / f"server-{server}.log")
            with proc:
                results += serve_turns(proc.url, model, server, w, turns, replies, row)
    return results


def summary(results: Sequence[Served]) -> dict[str, Any]:
    """Totals per server; whether the second server's answers to prompts the
    first also answered are the same (token for token, and at least one); and
    whether the run showed what it is for (``verified``): identical answers,
    the second server served from disk, the first not."""
    out: dict[str, Any] = {}
    for server in (1, 2):
        mine = [r for r in results if r.server == server]
        out[f"server{server}"] = {
            "requests": len(mine), "prompt_tokens": sum(r.prompt_tokens for r in mine),
            **{s: sum(getattr(r, s) for r in mine) for s in (*SOURCES, "computed")}}
    answers = {(r.conversation, r.turn): (r.token_ids, r.answer) for r in results
               if r.server == 1}
    same = [(r.token_ids, r.answer) == answers[(r.conversation, r.turn)] for r in results
            if r.server == 2 and (r.conversation, r.turn) in answers]
    out["answers_compared"] = len(same)
    out["answers_identical"] = bool(same) and all(same)
    out["verified"] = (out["answers_identical"] and out["server1"]["disk"] == 0
                       and out["server2"]["disk"] > 0)
    return out


HEADER = "server  conv  turn  prompt  from GPU cache  from CPU tier  from disk  computed"


def format_row(r: Served) -> str:
    return (f"{r.server:>6}  {r.conversation:>4}  {r.turn:>4}  {r.prompt_tokens:>6}  "
            f"{r.device:>14}  {r.host:>13}  {r.disk:>9}  {r.computed:>8}")


def print_report(results: Sequence[Served], s: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps({"requests": [asdict(r) for r in results], "summary": s}))
        return
    for server in (1, 2):
        t = s[f"server{server}"]
        print(f"server {server}: {t['requests']} requests, {t['prompt_tokens']} prompt tokens: "
              f"{t['device']} from the GPU cache, {t['host']} from kvtier's CPU tier, "
              f"{t['disk']} from disk, {t['computed']} computed")
    print(f"greedy answers of server 2 identical to server 1's: "
          f"{'yes' if s['answers_identical'] else 'NO'} ({s['answers_compared']} compared)")
    if not s["server2"]["disk"]:
        print("NO prompt tokens of server 2 came from disk: the disk tier served nothing")
    if s["server1"]["disk"]:
        print("server 1 got prompt tokens from disk: the disk tier was not empty")


def run_from_args(args: argparse.Namespace, model: Path, w: Workload,
               say: Callable[[str], None]) -> int:
    """``kvtier demo --disk DIR`` (``kvtier.demo.tiered``); 1 unless the summary
    says ``verified`` (answers identical, server 2 served from disk, server 1 not)."""
    if not args.json:
        print(f"kvtier demo --disk {args.disk}: {w.conversations} conversations x {w.turns} "
              "turns on two servers in a row (kvtier serve, a disk tier shared by both)")
        print(HEADER)

    def row(r: Served) -> None:
        if not args.json:
            print(format_row(r), flush=True)

    results = run(model, args.disk, w, args.cpu_bytes, say, row)
    s = summary(results)
    print_report(results, s, args.json)
    return 0 if s["verified"] else 1
