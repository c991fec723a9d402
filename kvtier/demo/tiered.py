"""``kvtier demo --disk DIR``: a disk tier outlives the server that filled it.

Two real servers run one after the other (``kvtier serve``, vLLM's HTTP
server, the tiny local model), both with a disk tier on ``DIR``:

1. the first serves turns 1 to ``turns - 1`` of every conversation of the chat
   workload, then every conversation's last turn (kvtier writes their blocks
   through to disk), and stops;
2. the second, a new process with an empty GPU cache and an empty CPU tier,
   serves every conversation's last turn, then turns 1 to ``turns - 1`` again.

The second server's first prompts find their prefixes on disk; what they
promote is in the CPU tier for later ones. For every request the demo prints
where its prompt's tokens came from: the engine's own prefix cache
(``device``), kvtier's CPU tier (``host``), the disk tier (``disk``), or
computed. The figures are the server's own
(``vllm:prompt_tokens_cached_by_source`` before and after each request);
requests go one at a time. Both servers answer the same prompts (the second's
use the first's replies), and every greedy answer of the second server is
checked token for token against the first's, the last turn's (the prompts it
loads from disk) included. The demo fails (exit status 1) when an answer
differs, when an answer of the second server has none of the first's to be
compared with, when the second server got nothing from disk, or when the first
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
from kvtier.replay.serving_trace import ENGINE_BLOCK_TOKENS
from kvtier.server_process import ServerProcess

SOURCES = ("device", "host", "disk")
BLOCK_TOKENS = ENGINE_BLOCK_TOKENS  # the engines' --block-size
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
    """``DemoError`` unless there is a turn before the last (``w.turns`` >= 2):
    the second server starts with a last turn whose earlier turns the first
    served; and unless the first server starts from an empty disk tier: a
    ``disk`` directory holding an earlier run's blocks would serve both
    servers the same bytes from disk, and their answers' comparison would
    check nothing."""
    if w.turns < 2:
        raise DemoError("--disk needs --turns 2 or more: the second server starts with "
                        "a last turn whose earlier turns the first served")
    if disk.exists() and not disk.is_dir():
        raise DemoError(f"--disk {disk} is not a directory")
    if disk.is_dir() and any(disk.iterdir()):
        raise DemoError(f"--disk {disk} is not empty: the first server must start with "
                        "an empty disk tier (give a new or empty directory)")


def plans(w: Workload) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The (conversation, turn) requests of the first and of the second server.

    The first serves turns 1 to ``turns - 1``, then the last turn, so that the
    second server's answers to the last turn, whose prefixes it loads from
    disk, have answers of the first to be compared with. (The first answers it
    after its other turns, from its own GPU cache, not from disk; its blocks
    are written through to disk with theirs.) The second serves the last turn
    first (its prefixes on disk only), then the others."""
    conversations = range(1, w.conversations + 1)
    earlier = [(c, t) for t in range(1, w.turns) for c in conversations]
    last = [(c, w.turns) for c in conversations]
    return earlier + last, last + earlier


def run(model: Path, disk: Path, w: Workload, cpu_bytes: int,
        say: Callable[[str], None], row: Callable[[Served], None]) -> list[Served]:
    """Both servers, one after the other, on ``disk``."""
    from kvtier.tiers.redis_server import free_port

    replies: dict[tuple[int, int], list[int]] = {}
    first, second = plans(w)
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
    """Totals per server; the second server's answers compared with the
    first's to the same prompt, token for token: how many (``answers_compared``,
    ``disk_answers_compared`` of them on prompts that got tokens from disk),
    which differ (``answers_differing``) and which had no answer of the first
    (``answers_not_compared``), as ``[conversation, turn]``;
    ``answers_identical`` when at least one was compared, all of those are the
    same and none went uncompared; and whether the run showed what it is for
    (``verified``): identical answers, one of them on a prompt from disk, the
    second server served from disk, the first not."""
    out: dict[str, Any] = {}
    for server in (1, 2):
        mine = [r for r in results if r.server == server]
        out[f"server{server}"] = {
            "requests": len(mine), "prompt_tokens": sum(r.prompt_tokens for r in mine),
            **{s: sum(getattr(r, s) for r in mine) for s in (*SOURCES, "computed")}}
    answers = {(r.conversation, r.turn): (r.token_ids, r.answer) for r in results
               if r.server == 1}
    second = [r for r in results if r.server == 2]
    compared = [r for r in second if (r.conversation, r.turn) in answers]
    differing = [r for r in compared
                 if (r.token_ids, r.answer) != answers[(r.conversation, r.turn)]]
    out["answers_compared"] = len(compared)
    out["disk_answers_compared"] = sum(1 for r in compared if r.disk > 0)
    out["answers_differing"] = [[r.conversation, r.turn] for r in differing]
    out["answers_not_compared"] = [[r.conversation, r.turn] for r in second
                                   if (r.conversation, r.turn) not in answers]
    out["answers_identical"] = (bool(compared) and not differing
                                and not out["answers_not_compared"])
    out["verified"] = (out["answers_identical"] and out["disk_answers_compared"] > 0
                       and out["server1"]["disk"] == 0 and out["server2"]["disk"] > 0)
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
          f"{'yes' if s['answers_identical'] else 'NO'} ({s['answers_compared']} compared, "
          f"{s['disk_answers_compared']} of them on prompts with tokens from disk)")
    if s["answers_differing"]:
        print("answers of server 2 that differ from server 1's (conversation, turn): "
              + ", ".join(f"{c} {t}" for c, t in s["answers_differing"]))
    if s["answers_not_compared"]:
        print("answers of server 2 to prompts server 1 did not answer, not compared "
              "(conversation, turn): " + ", ".join(f"{c} {t}" for c, t in
                                                   s["answers_not_compared"]))
    if s["answers_compared"] and not s["disk_answers_compared"]:
        print("NO answer on a prompt with tokens from disk was compared")
    if not s["server2"]["disk"]:
        print("NO prompt tokens of server 2 came from disk: the disk tier served nothing")
    if s["server1"]["disk"]:
        print("server 1 got prompt tokens from disk: the disk tier was not empty")


def run_from_args(args: argparse.Namespace, model: Path, w: Workload,
               say: Callable[[str], None]) -> int:
    """``kvtier demo --disk DIR`` (``kvtier.demo.tiered``); 1 unless the summary
    says ``verified`` (every answer of server 2 compared with server 1's and
    identical, one on a prompt from disk; server 2 served from disk, server 1 not)."""
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
