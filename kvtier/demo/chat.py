"""``kvtier demo``: a multi-turn chat workload on a real vLLM engine, with and without kvtier.

Several conversations share a system prompt; each turn appends the model's
reply and a new user message, so every prompt extends the previous one of its
conversation. The engine's own (GPU) prefix cache is emptied before every turn,
so whatever prefix is not recomputed was served by kvtier. The workload runs on
an engine with kvtier and on one without (same settings); per turn the demo
prints the prompt length, the tokens served from kvtier and the time to first
token (TTFT) of both, then a summary and whether the greedy outputs matched.

Each turn's reply is compared twice: with the engine's reply without any
cache, and with its reply after its own prefix cache was given the prefix
kvtier served (the reference pass: the kvtier run's computation, with the
engine's KV bytes in place of kvtier's). A turn is verified when either
matches; the exit status is 1 when one is not, or when kvtier served no token
(then no byte of kvtier's was checked). The first alone can fail with
every byte right: on some models attention over a cached prefix sums in another
order than a full prefill and bf16 rounding turns a greedy token, and vLLM's
own cache then does the same. The second alone can fail too: on a
sliding-window model vLLM's own cache serves fewer tokens than kvtier did
from the same prefix, and that turn is not compared.

Nothing to configure: the tiny model is built once into ``~/.cache/kvtier``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.argtypes import byte_size, positive_int
from kvtier.demo import engine as E
from kvtier.demo.tiny_model import (
    DEFAULT_MODEL_DIR_TEXT,
    build_tiny_llama,
    default_model_dir,
    is_built,
    token_prompt,
)
from kvtier.demo.workload import DemoError, Workload

if TYPE_CHECKING:
    from vllm import LLM

SETTLE_S = 0.05
"""Pause before each measured request: back-to-back requests on a busy CPU give
noisier TTFTs (vLLM's CPU backend runs OpenMP threads bound to cores)."""
DEFAULT_CPU_BYTES = 64 << 20
"""kvtier's CPU tier in the demo: 2048 slots of the tiny model's 32 KiB blocks."""


@dataclass(frozen=True)
class Turn:
    """One turn of one conversation in one run."""

    conversation: int
    turn: int
    prompt: tuple[int, ...]
    cached_tokens: int
    ttft_s: float
    output: tuple[int, ...]
    """The reply (chat pass) or its first token (replays)."""


@dataclass
class RunResult:
    """The workload on one engine: the chat pass, then its replays."""

    kvtier: bool
    repeats: list[list[Turn]] = field(default_factory=list)
    stats: dict[str, int] | None = None
    reference: list[Turn] = field(default_factory=list)
    """Without kvtier only: the reference pass (:func:`reference_pass`)."""


# -- running ---------------------------------------------------------------------


def _reset_gpu_cache(llm: LLM) -> None:
    """Empty the engine's own prefix cache, so any hit must come from kvtier."""
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache")


def run_turn(llm: LLM, conversation: int, turn: int, prompt: list[int], max_tokens: int,
             cached_prefix: int = 0) -> Turn:
    """One request on an empty GPU prefix cache (or one holding only the first
    ``cached_prefix`` tokens of ``prompt``, whole blocks); its blocks reach
    kvtier before it returns."""
    _reset_gpu_cache(llm)
    if cached_prefix:
        E.generate(llm, [prompt[:cached_prefix]], max_tokens=1)
    time.sleep(SETTLE_S)
    out = E.generate(llm, [prompt], max_tokens=max_tokens)[0]
    E.drain(llm)  # stores are submitted on the engine's next step
    if out.ttft_s is None:
        raise RuntimeError("vLLM reported no time to first token")
    return Turn(conversation, turn, tuple(prompt), out.num_cached_tokens, out.ttft_s,
                out.token_ids)


def chat_pass(llm: LLM, w: Workload, kvtier: bool) -> list[Turn]:
    """The workload, turn by turn across conversations; replies become history."""
    llm.reset_prefix_cache(reset_connector=kvtier)  # start from empty caches
    system = w.system_prompt()
    history = [system + w.user_message(c, 0) for c in range(w.conversations)]
    turns: list[Turn] = []
    for t in range(w.turns):
        for c in range(w.conversations):
            done = run_turn(llm, c + 1, t + 1, history[c], w.reply_tokens)
            turns.append(done)
            history[c] = history[c] + list(done.output) + w.user_message(c, t + 1)
    return turns


def replay_pass(llm: LLM, turns: Sequence[Turn], kvtier: bool) -> list[Turn]:
    """The prompts of a chat pass again, in order, from empty caches: TTFT only.

    Only prompt blocks are offloaded, so kvtier goes through the same states
    as in the chat pass and serves the same prefixes.
    """
    llm.reset_prefix_cache(reset_connector=kvtier)
    return [run_turn(llm, t.conversation, t.turn, list(t.prompt), 1) for t in turns]


def reference_pass(llm: LLM, kvtier_chat: Sequence[Turn]) -> list[Turn]:
    """The kvtier run's chat-pass prompts on an engine without kvtier, each after
    its own prefix cache was given the prefix kvtier served that prompt: the
    same computation as the kvtier run's, with the engine's bytes (module doc)."""
    llm.reset_prefix_cache()
    return [run_turn(llm, t.conversation, t.turn, list(t.prompt), len(t.output), t.cached_tokens)
            for t in kvtier_chat]


def run_engine(model: Path, w: Workload, cpu_bytes: int | None,
               kvtier_chat: Sequence[Turn] = ()) -> RunResult:
    """Start an engine (kvtier when ``cpu_bytes`` is set): one chat pass, then
    replays, then the reference pass of ``kvtier_chat`` if given (without kvtier)."""
    extra = None if cpu_bytes is None else E.kvtier_config(cpu_bytes)
    result = RunResult(kvtier=extra is not None)
    if result.kvtier and kvtier_chat:
        raise ValueError("the reference pass runs on the engine without kvtier")
    with E.running_engine(model, extra, engine_settings(w)) as llm:
        _warm_up(llm)
        chat = chat_pass(llm, w, result.kvtier)
        result.repeats.append(chat)
        for _ in range(w.repeats - 1):
            result.repeats.append(replay_pass(llm, chat, result.kvtier))
        if kvtier_chat:
            result.reference = reference_pass(llm, kvtier_chat)
        if result.kvtier and E.single_process():
            result.stats = E.kvtier_manager(llm).stats()
    return result


GPU_CACHE_SEQUENCES = 4
"""The engine's cache holds this many of the longest sequences: twice one for
each of up to two KV-cache groups (a hybrid model such as Gemma 2, with
sliding-window and full-attention layers, splits the blocks between them)."""


def engine_settings(w: Workload) -> E.EngineSettings:
    """The spike's settings, with room for the workload's longest sequence."""
    need = w.max_prompt_tokens() + w.reply_tokens
    model_len = max(1024, -(-need // 1024) * 1024)
    block = E.EngineSettings.block_size
    return E.EngineSettings(max_model_len=model_len,
                            num_gpu_blocks=GPU_CACHE_SEQUENCES * model_len // block,
                            log_stats=True)


def _warm_up(llm: LLM) -> None:
    """One throw-away request, so the first measured turn pays no first-call costs."""
    E.generate(llm, [token_prompt(100, start=400)], max_tokens=2)


# -- report ------------------------------------------------------------------------


@dataclass(frozen=True)
class TurnRow:
    """A turn's line of the report: TTFT best and median over the repeats.

    The table shows the best: background load on the CPU only ever adds time.
    """

    conversation: int
    turn: int
    prompt_tokens: int
    kvtier_tokens: int
    ttft_kvtier_ms: float
    ttft_baseline_ms: float
    ttft_kvtier_median_ms: float
    ttft_baseline_median_ms: float
    identical: bool
    """Same outputs with kvtier and without any cache (module doc: can differ by
    rounding); false when the engine without kvtier had cache hits."""
    baseline_cached_tokens: int
    """Should be 0: the GPU prefix cache is reset before every turn."""
    vllm_cache_tokens: int
    """Tokens the reference pass served from the engine's own prefix cache
    (should equal the chat pass's tokens from kvtier)."""
    vllm_cache_compared: bool
    """The reference pass served as many tokens from the engine's cache as
    kvtier served the chat pass, so their replies were compared."""
    same_as_vllm_cache: bool
    """kvtier's reply is the reference pass's, from the same cached prefix."""

    @property
    def verified(self) -> bool:
        """kvtier's reply is the uncached one, or vLLM's own cache's (module doc)."""
        return self.identical or self.same_as_vllm_cache


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def turn_rows(with_kv: RunResult, without: RunResult) -> list[TurnRow]:
    """Per-turn rows. A turn is identical when both chat passes had the same prompt
    and reply, every replay's first token is the reply's and the engine without
    kvtier had no cache hit; it is the same as vLLM's cache when the reference
    pass served as many tokens from the engine's cache as kvtier did in the chat
    pass and replied the same."""
    if len(without.reference) != len(with_kv.repeats[0]):
        raise ValueError(f"the run without kvtier has {len(without.reference)} reference "
                         f"turns for {len(with_kv.repeats[0])} kvtier turns")
    rows = []
    for i, first in enumerate(with_kv.repeats[0]):
        kv = [rep[i] for rep in with_kv.repeats]
        base = [rep[i] for rep in without.repeats]
        ref = without.reference[i]
        reply = base[0].output
        baseline_cached = max(turn.cached_tokens for turn in base)
        compared = ref.cached_tokens == first.cached_tokens
        rows.append(TurnRow(
            conversation=first.conversation,
            turn=first.turn,
            prompt_tokens=len(first.prompt),
            kvtier_tokens=min(turn.cached_tokens for turn in kv),
            ttft_kvtier_ms=_ms(min(turn.ttft_s for turn in kv)),
            ttft_baseline_ms=_ms(min(turn.ttft_s for turn in base)),
            ttft_kvtier_median_ms=_ms(statistics.median(turn.ttft_s for turn in kv)),
            ttft_baseline_median_ms=_ms(statistics.median(turn.ttft_s for turn in base)),
            identical=first.prompt == base[0].prompt and first.output == reply
            and all(turn.output == reply[:1] for turn in kv[1:] + base[1:])
            and baseline_cached == 0,
            baseline_cached_tokens=baseline_cached,
            vllm_cache_tokens=ref.cached_tokens,
            vllm_cache_compared=compared,
            same_as_vllm_cache=compared and ref.output == first.output,
        ))
    return rows


def summarize(rows: Sequence[TurnRow]) -> dict[str, Any]:
    """Totals: prefill saved, TTFT with and without kvtier, output check.

    kvtier's bytes are verified when kvtier served some tokens and every turn
    is verified; ``verified_turns`` counts the verified turns among those
    kvtier served (``kvtier_turns``): the others used none of its bytes."""
    prompt = sum(r.prompt_tokens for r in rows)
    served = sum(r.kvtier_tokens for r in rows)
    kv_ms = sum(r.ttft_kvtier_ms for r in rows)
    base_ms = sum(r.ttft_baseline_ms for r in rows)
    kv_median = sum(r.ttft_kvtier_median_ms for r in rows)
    base_median = sum(r.ttft_baseline_median_ms for r in rows)
    return {
        "turns": len(rows),
        "prompt_tokens": prompt,
        "kvtier_tokens": served,
        "prefill_saved": round(served / prompt, 4) if prompt else 0.0,
        "mean_ttft_kvtier_ms": round(kv_ms / len(rows), 3),
        "mean_ttft_baseline_ms": round(base_ms / len(rows), 3),
        "ttft_ratio": round(kv_ms / base_ms, 4),
        "ttft_ratio_of_medians": round(kv_median / base_median, 4),
        "identical_turns": sum(r.identical for r in rows),
        "outputs_identical": all(r.identical for r in rows),
        "baseline_cached_tokens": sum(r.baseline_cached_tokens for r in rows),
        "vllm_cache_identical_turns": sum(r.same_as_vllm_cache for r in rows),
        "vllm_cache_short_turns": sum(not r.vllm_cache_compared for r in rows),
        "kvtier_turns": sum(r.kvtier_tokens > 0 for r in rows),
        "verified_turns": sum(r.verified for r in rows if r.kvtier_tokens > 0),
        "unserved_unverified_turns": sum(not r.verified for r in rows if not r.kvtier_tokens),
        "outputs_verified": served > 0 and all(r.verified for r in rows),
    }


HEADER = ("conv", "turn", "prompt", "from kvtier", "TTFT kvtier", "TTFT without",
          "= no cache", "= vLLM cache")


def format_table(rows: Sequence[TurnRow]) -> list[str]:
    """Aligned text lines: a header, then one line per turn."""
    widths = [4, 4, 6, 11, 11, 12, 10, 12]
    lines = ["  ".join(h.rjust(w) for h, w in zip(HEADER, widths, strict=True))]
    for r in rows:
        cells = (str(r.conversation), str(r.turn), str(r.prompt_tokens), str(r.kvtier_tokens),
                 f"{r.ttft_kvtier_ms:.2f} ms", f"{r.ttft_baseline_ms:.2f} ms",
                 "yes" if r.identical else "NO", _reference_cell(r))
        lines.append("  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)))
    return lines


def _reference_cell(row: TurnRow) -> str:
    """``= vLLM cache``: "n/a" where vLLM's cache held another number of tokens."""
    if row.same_as_vllm_cache:
        return "yes"
    return "NO" if row.vllm_cache_compared else "n/a"


def format_summary(s: dict[str, Any], stats: dict[str, int] | None) -> list[str]:
    """The summary lines under the table."""
    lines = [
        f"prefill saved: {s['kvtier_tokens']} of {s['prompt_tokens']} prompt tokens "
        f"served from kvtier ({s['prefill_saved']:.1%})",
        f"TTFT, mean per turn of the best runs: {s['mean_ttft_kvtier_ms']:.2f} ms with "
        f"kvtier vs {s['mean_ttft_baseline_ms']:.2f} ms without, ratio {s['ttft_ratio']:.2f} "
        f"(of the medians, which a busy CPU inflates: {s['ttft_ratio_of_medians']:.2f})",
        f"greedy outputs identical with and without kvtier: "
        f"{'yes' if s['outputs_identical'] else 'NO'} "
        f"({s['identical_turns']}/{s['turns']} turns); without kvtier "
        f"{s['baseline_cached_tokens']} prompt tokens were cached",
        f"greedy outputs identical to vLLM's own prefix cache holding the prefixes "
        f"kvtier served: {s['vllm_cache_identical_turns']}/{s['turns']} turns"
        + (f" (on {s['vllm_cache_short_turns']} it held a different number of tokens: "
           "not compared)" if s["vllm_cache_short_turns"] else ""),
        _bytes_verified(s),
    ]
    if stats is not None:
        lines.append(
            f"kvtier CPU tier: {stats['hits']} block hits, {stats['stores']} stores, "
            f"{stats['evictions']} evictions, {stats['resident']} blocks resident"
        )
    return lines


def _bytes_verified(s: dict[str, Any]) -> str:
    """The summary's last line: whether kvtier's bytes were verified (:func:`summarize`)."""
    if not s["kvtier_turns"]:
        return "kvtier's bytes verified: NO (kvtier served no prompt tokens: nothing verified)"
    unserved = s["unserved_unverified_turns"]
    return (f"kvtier's bytes verified: {'yes' if s['outputs_verified'] else 'NO'} "
            f"({s['verified_turns']}/{s['kvtier_turns']} turns served from kvtier replied "
            "as without a cache or as from vLLM's own cache"
            + (f"; {unserved} turns kvtier served nothing replied otherwise too"
               if unserved else "") + ")")


# -- entry point -------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (all optional)."""
    w = Workload()
    for name, help_text in (
        ("conversations", "conversations"),
        ("turns", "turns per conversation"),
        ("system_tokens", "tokens of the shared system prompt"),
        ("user_tokens", "tokens of each user message"),
        ("reply_tokens", "tokens the model replies per turn"),
        ("repeats", "runs of the workload; TTFT is their best"),
    ):
        default = getattr(w, name)
        parser.add_argument(f"--{name.replace('_', '-')}", type=positive_int, default=default,
                            metavar="N", help=f"{help_text} (default {default})")
    parser.add_argument("--cpu-bytes", type=byte_size, default=DEFAULT_CPU_BYTES, metavar="B",
                        help=f"kvtier's CPU tier in bytes, K/M/G and Ki/Mi/Gi suffixes as "
                        f"for kvtier serve (default {DEFAULT_CPU_BYTES})")
    parser.add_argument("--model-dir", type=Path, default=None, metavar="DIR",
                        help=f"where the tiny model is built (default {DEFAULT_MODEL_DIR_TEXT}); "
                        "a directory that already holds a model (its config.json) is "
                        "used as it is")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    parser.add_argument("--disk", type=Path, default=None, metavar="DIR",
                        help="the tiered demo instead: two servers one after the other with "
                        "a disk tier in DIR (new or empty); the second gets its first "
                        "prefixes from disk, and its answers, those included, are "
                        "checked token for token against the first's")


def workload(args: argparse.Namespace) -> Workload:
    """The workload the parsed options describe."""
    return Workload(**{f.name: getattr(args, f.name) for f in fields(Workload)})


def _quiet_defaults() -> None:
    """One process and quiet vLLM logs, unless the caller's environment says otherwise."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def run(args: argparse.Namespace) -> int:
    """Run the demo for parsed ``args``; exit status 0, or 1 when a turn is not
    verified or kvtier served nothing (module doc)."""
    w = workload(args)
    w.check()
    _check_cpu_bytes(args.cpu_bytes)
    if args.disk is not None:
        from kvtier.demo import tiered

        tiered.check_args(args.disk, w)
    _quiet_defaults()
    say = _progress(args.json)
    model = _model(args.model_dir, say)
    if args.disk is not None:
        from kvtier.demo import tiered
        from kvtier.server_process import sigterm_as_exit

        with sigterm_as_exit():  # SIGTERM, as SIGINT does, stops the demo's servers
            return tiered.run_from_args(args, model, w, say)
    started = time.perf_counter()
    say("running the chat workload with kvtier ...")
    with_kv = run_engine(model, w, args.cpu_bytes)
    say("running it without kvtier, then its prompts on vLLM's own prefix cache ...")
    without = run_engine(model, w, None, kvtier_chat=with_kv.repeats[0])
    rows = turn_rows(with_kv, without)
    summary = summarize(rows)
    _print_report(args, w, rows, summary, with_kv.stats, time.perf_counter() - started)
    return 0 if summary["outputs_verified"] else 1


def _check_cpu_bytes(cpu_bytes: int) -> None:
    """``DemoError`` when ``--cpu-bytes`` cannot fit in the shared-memory file
    system the CPU tier's slot region lives in: found before the model is built
    and vLLM started (the engine would fail only then, with a traceback), as
    ``kvtier serve`` finds it."""
    from kvtier.serve import ServeError, check_cpu_tier_room

    try:
        check_cpu_tier_room(cpu_bytes)
    except ServeError as exc:
        raise DemoError(str(exc)) from None


def _model(model_dir: Path | None, say: Any) -> Path:
    """The model to serve: ``model_dir`` as it is when it holds a model (its
    ``config.json``), else the tiny model, built there (or in the default
    directory) when missing. ``DemoError`` for a directory that is neither
    a model nor empty: the tiny model is never built into someone's files."""
    target = model_dir or default_model_dir()
    if model_dir is not None and (model_dir / "config.json").is_file():
        return model_dir
    if model_dir is not None and model_dir.exists():
        if not model_dir.is_dir():
            raise DemoError(f"--model-dir {model_dir} is not a directory")
        if not is_built(model_dir) and any(model_dir.iterdir()):
            raise DemoError(f"--model-dir {model_dir} holds no model (no config.json) and "
                            "is not empty: give a model's directory, or a new or empty one "
                            "for the tiny model")
    if not is_built(target):
        say(f"building the tiny model in {target} ...")
    return build_tiny_llama(target)


def _progress(quiet: bool) -> Any:
    def say(text: str) -> None:
        if not quiet:
            print(text, file=sys.stderr, flush=True)

    return say


def _model_label(model_dir: Path | None) -> str:
    """"tiny Llama", or the model type and directory given with ``--model-dir``."""
    if model_dir is None:
        return "tiny Llama"
    try:
        model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None
    return f"{model_type or 'model'} in {model_dir}"


def _print_report(args: argparse.Namespace, w: Workload, rows: Sequence[TurnRow],
                  summary: dict[str, Any], stats: dict[str, int] | None, seconds: float) -> None:
    if args.json:
        print(json.dumps({"workload": asdict(w), "cpu_bytes": args.cpu_bytes,
                          "turns": [{**asdict(r), "verified": r.verified} for r in rows],
                          "summary": summary,
                          "kvtier_stats": stats, "seconds": round(seconds, 1)}))
        return
    print(f"kvtier demo: {w.conversations} conversations x {w.turns} turns, shared "
          f"{w.system_tokens}-token system prompt, +{w.user_tokens} user and "
          f"{w.reply_tokens} reply tokens per turn; {_model_label(args.model_dir)} on vLLM (CPU), "
          f"GPU prefix cache reset before every turn; TTFT = best of {w.repeats} runs")
    for line in [*format_table(rows), "", *format_summary(summary, stats)]:
        print(line)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvtier.demo.chat``: the same as ``kvtier demo``."""
    parser = argparse.ArgumentParser(prog="kvtier demo", description=__doc__)
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except DemoError as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
