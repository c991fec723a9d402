"""The README read as a user who copies from it: its configuration examples are
accepted as written, and its config table, metric names, commands, flags, file
names and Python example agree with the code. The pages its measurement
sections moved to (``PAGES``) are read with it: their commands, flags and
files are checked the same way."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

from kvtier.vllm.settings import KVTierSettings

REPO = Path(__file__).parent.parent
README = REPO / "README.md"
PAGES = (README, REPO / "docs" / "costs.md", REPO / "docs" / "serving-benchmark.md",
         REPO / "docs" / "guarantees.md")
"""The README and the pages of figures it points to, read as one text."""
TEXT = "\n".join(page.read_text() for page in PAGES)

FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
COMMANDS = ("replay", "generate", "foresight", "soak", "serve", "bench", "disk", "redis",
            "demo")
OTHER_FLAGS = frozenset({
    # vLLM's (kvtier serve passes them on) and its client's
    "--api-server-count", "--block-size", "--data-parallel-size", "--data-parallel-size-local",
    "--dataset-name", "--dtype",
    "--enforce-eager",
    "--gpu-memory-utilization", "--kv-cache-memory-bytes", "--kv-transfer-config",
    "--max-model-len", "--mm-processor-kwargs", "--num-gpu-blocks-override", "--port",
    "--timed-trace-chunk-hash-size", "--timed-trace-sec-multiplier",
    "--trust-remote-code",
    "--shm-size",  # docker's
    "--cpu-byte",  # the misspelling kvtier serve catches
})
"""Flags the README names that belong to other programs."""


def code_blocks() -> list[str]:
    return FENCE.findall(TEXT)


def inline_spans() -> list[str]:
    """Inline code outside the fenced blocks, a span broken over lines joined."""
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", FENCE.sub("", TEXT))]


def section(start: str, end: str) -> str:
    """The README's text from ``start`` to the next ``end`` (both must be there;
    a space in either matches a line break too)."""
    def where(words: str, pos: int = 0) -> re.Match[str]:
        found = re.compile(r"\s+".join(map(re.escape, words.split(" ")))).search(TEXT, pos)
        assert found, f"the README has no {words!r}"
        return found

    begin = where(start).start()
    return TEXT[begin:where(end, begin + 1).start()]


# -- configuration -----------------------------------------------------------------


def test_every_kv_transfer_config_example_is_valid() -> None:
    examples = re.findall(r"--kv-transfer-config '(\{.*?\})'", TEXT, re.S)
    assert len(examples) >= 2
    for raw in examples:
        config = json.loads(raw)
        assert config["kv_connector"] == "OffloadingConnector"
        extra = config["kv_connector_extra_config"]
        assert (extra["spec_name"], extra["spec_module_path"]) == ("KVTierSpec", "kvtier.vllm")
        KVTierSettings.from_extra_config(extra)


def test_every_config_key_is_in_the_readme_table() -> None:
    for key in KVTierSettings.accepted_keys():
        assert f"| `{key}` |" in TEXT, key


def config_table() -> dict[str, tuple[str, str]]:
    """key -> (default cell, meaning cell) of the README's config table."""
    table = section("| key | default | meaning |", "\n\n")
    rows = re.findall(r"^\| `(\w+)` \| (.*?) \| (.*) \|$", table, re.M)
    return {key: (default, meaning) for key, default, meaning in rows}


UNSET_DEFAULTS = {"unset", "required with `disk_path`", "half the tier"}
"""Default cells that describe a field whose default is None."""


def test_every_default_in_the_config_table_is_the_settings_default() -> None:
    table = config_table()
    assert list(table) == KVTierSettings.accepted_keys()
    for f in dataclasses.fields(KVTierSettings):
        cell = table[f.name][0]
        if cell == "required":
            assert f.default is dataclasses.MISSING, f.name
            continue
        if cell in UNSET_DEFAULTS:
            assert f.default is None, f.name
            continue
        literal = re.match(r"`([^`]+)`", cell)
        assert literal, f"{f.name}: default cell {cell!r}"
        try:
            shown: Any = json.loads(literal.group(1))
        except ValueError:
            shown = literal.group(1)  # a bare word: auto
        assert shown == f.default and isinstance(shown, bool) == isinstance(f.default, bool), (
            f"{f.name}: the README says {shown!r}, KVTierSettings has {f.default!r}")


def test_the_config_table_names_every_allowed_value() -> None:
    from kvtier.policies import POLICIES
    from kvtier.secrets import REDIS_URL_SCHEMES
    from kvtier.slots.jobs import CUDA_COPY_MODES
    from kvtier.tiers.cascade import WRITE_POLICIES
    from kvtier.tiers.disk_lookups import LOOKUP_MODES

    table = config_table()
    allowed = {"eviction_policy": [*POLICIES, "default"], "disk_write_policy": WRITE_POLICIES,
               "redis_write_policy": WRITE_POLICIES, "disk_lookups": LOOKUP_MODES,
               "cuda_copy": CUDA_COPY_MODES}
    for key, values in allowed.items():
        meaning = table[key][1]
        if key == "redis_write_policy":
            assert "As `disk_write_policy`" in meaning
            continue
        for value in values:
            assert f"`{value}`" in meaning, (key, value)
    for scheme in REDIS_URL_SCHEMES:
        shown = "`+cluster`" if scheme.endswith("+cluster") else f"`{scheme}://`"
        assert shown in table["redis_url"][1], scheme


# -- metrics -----------------------------------------------------------------------


def named_metrics(text: str, prefix: str) -> list[tuple[str, str]]:
    """(metric, the last 'counter'/'gauge'/'histogram' before it) for each metric
    ``text`` names in code spans: ``prefix + name``, or ``_name`` for short."""
    out = []
    kind = ""
    for match in re.finditer(r"\b(counters?|gauges?|histograms?)\b|`([\w:]+)[`{]", text):
        if match.group(1):
            kind = match.group(1).rstrip("s")
            continue
        name = match.group(2)
        if name.startswith(prefix):
            out.append((name, kind))
        elif name.startswith("_") and not name.endswith("_"):
            out.append((prefix + name[1:], kind))
    return out


def test_the_readme_lists_every_kvtier_metric_with_its_type() -> None:
    from kvtier.vllm import metrics as M

    counters = {*M.COUNTERS, *M.TIER_COUNTERS, *M.POLICY_COUNTERS, *M.TRACE_COUNTERS,
                *("tier_" + name for name in M.PER_TIER_COUNTERS)}
    gauges = {*M.GAUGES, *M.POLICY_GAUGES, "tier_available"}
    defined = {M.METRIC_PREFIX + n: "counter" for n in counters}
    defined |= {M.METRIC_PREFIX + n: "gauge" for n in gauges}
    listed = named_metrics(section("Metrics (Prometheus", "vLLM's own offloading metrics"),
                           M.METRIC_PREFIX)
    assert dict(listed) == defined
    assert len(listed) == len(defined), "a metric listed twice"
    per_tier = section("and per tier (label", "vLLM's own `vllm:prompt_tokens")
    assert {name for name, _ in named_metrics(per_tier, M.METRIC_PREFIX)} == {
        name for name in defined if name.startswith(M.METRIC_PREFIX + "tier_")}
    assert f"unanswered in {M.DEFAULT_LOOKUP_TIMEOUT_S} s" in TEXT
    # and every mention elsewhere (in queries, in the drills) is one of them
    for name in re.findall(r"vllm:kvtier_\w+", TEXT):
        assert name in defined, name


def test_every_vllm_offloading_metric_the_readme_names_is_vllms() -> None:
    pytest.importorskip("vllm")
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import metrics as vm

    from kvtier.vllm.metrics import metric_definitions

    known = {*metric_definitions({"store_threshold": 2}),
             *vm.get_connector_metric_definitions(),
             # the per-direction family vLLM keeps for its CPU offloading's dashboards
             *getattr(vm, "_DEPRECATED_CONNECTOR_METRIC_DEFINITIONS", {})}
    prefix = "vllm:kv_offload_"
    text = section("vLLM's own offloading metrics carry", "On vLLM 0.32")
    named = [name for name, _ in named_metrics(text, prefix)]
    assert len(named) >= 10
    for name in {*named, *re.findall(prefix + r"\w+", TEXT)}:
        assert name in known, name


# -- commands ----------------------------------------------------------------------


def subparsers() -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every ``kvtier`` (sub)command's parser, by its words."""
    from kvtier.cli import build_parser

    found: dict[tuple[str, ...], argparse.ArgumentParser] = {}

    def walk(parser: argparse.ArgumentParser, words: tuple[str, ...]) -> None:
        found[words] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, (*words, name))

    walk(build_parser(), ())
    return found


def readme_commands() -> list[str]:
    """Every ``kvtier ...`` command line the README shows: in code blocks (a
    ``$`` prompt, lines continued with a backslash) and in inline code."""
    starts = re.compile(r"(?:PYTHONPATH=\S+ )?kvtier (?:" + "|".join(COMMANDS) + r")(?= |$)")
    lines = []
    for block in code_blocks():
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if starts.match(line):
                lines.append(line)
    for span in inline_spans():
        lines += [span[m.start():] for m in starts.finditer(span)]
        if re.match(r"(disk|redis) (inspect|verify|purge)\b", span):  # Operator tools
            lines.append("kvtier " + span)
    return [re.sub(r"^PYTHONPATH=\S+ ", "", line) for line in lines]


def test_every_command_and_flag_the_readme_shows_exists() -> None:
    parsers = subparsers()
    commands = readme_commands()
    assert len(commands) > 50
    for command in commands:
        words: tuple[str, ...] = ()
        for word in command.split()[1:]:
            if (*words, word) not in parsers:
                break
            words = (*words, word)
        assert words, f"no such command: {command}"
        own = {o for action in parsers[words]._actions for o in action.option_strings}
        for flag in re.findall(r"(?<![\w-])--?[a-zA-Z][\w-]*", command):
            if words == ("serve",) and flag in OTHER_FLAGS:
                continue  # vLLM's: kvtier serve passes it on
            assert flag in own, f"kvtier {' '.join(words)} has no {flag}: {command}"


def test_every_flag_the_readme_names_belongs_to_a_command_or_benchmark() -> None:
    known = {o for parser in subparsers().values() for action in parser._actions
             for o in action.option_strings}
    for script in (REPO / "benchmarks").glob("*.py"):
        known.update(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", script.read_text()))
    for flag in set(re.findall(r"(?<![\w-])--[a-zA-Z][\w-]*", TEXT)):
        assert flag in known or flag in OTHER_FLAGS, flag


def test_every_file_and_test_the_readme_names_exists() -> None:
    paths = set(re.findall(
        r"(?<![\w/.~-])((?:benchmarks|tests|kvtier|docs|data)/[\w/-]*(?:\.\w+|/))", TEXT))
    assert len(paths) > 30
    for path in paths:
        assert (REPO / path).exists(), path
    test_source = "".join(p.read_text() for p in (REPO / "tests").rglob("*.py"))
    for name in set(re.findall(r"\btest_\w+(?=`|\))", TEXT)):
        assert f"def {name}(" in test_source, name


def test_every_page_of_figures_is_linked_from_the_readme() -> None:
    readme = README.read_text()
    for page in PAGES[1:]:
        link = f"]({page.relative_to(REPO)})"
        assert link in readme, f"the README links no {page.name}"


def output_shape(line: str) -> str:
    """A line of a command's output with its numbers left out."""
    return re.sub(r"\d[\d,.]*", "#", line)


def test_soak_summaries_have_the_shape_soak_prints(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.cli import main

    assert main(["soak", "--requests", "20", "--no-redis", "--disk-blocks", "0",
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out.splitlines()
    summary = [output_shape(line) for line in printed[-3:]]
    shown = [block.splitlines() for block in code_blocks() if " requests in " in block]
    assert len(shown) == 2
    for lines in shown:
        assert [output_shape(line) for line in lines] == summary


# -- the manager on its own --------------------------------------------------------


def test_the_manager_example_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    text = section("## The manager on its own", "What holds")
    (code,) = re.findall(r"```python\n(.*?)```", text, re.S)
    exec(compile(code, "README.md", "exec"), {})  # the README's own example, as a user runs it
    stats = ast.literal_eval(capsys.readouterr().out)  # the dict it printed
    assert stats["stores"] == stats["resident"] > 0


def test_the_stats_fields_the_readme_lists_are_the_managers() -> None:
    from kvtier import OffloadManager

    text = section("`stats()` fields:", "## Trace replay")
    listed = {name for name in re.findall(r"`(\w+)`", text)
              if not name.endswith("_") and name != "adaptive"}
    assert listed == set(OffloadManager(num_blocks=8, policy="default").stats())


def test_the_reset_route_the_readme_names_says_it_needs_dev_mode() -> None:
    """vLLM 0.32 serves ``POST /reset_prefix_cache`` only in its dev mode: a
    user who sent it as the README showed got 404 and no reset."""
    import inspect

    pytest.importorskip("vllm")
    from vllm.entrypoints.launchers.api_server import routers

    assert "VLLM_SERVER_DEV_MODE" in inspect.getsource(routers)
    for mention in re.finditer(r"POST /reset_prefix_cache", TEXT):
        assert "VLLM_SERVER_DEV_MODE=1" in TEXT[mention.start():mention.start() + 300]
