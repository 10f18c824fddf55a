from __future__ import annotations

import json
import time

import numpy as np
import pytest
import torch
from conftest import IdTokenizer, tiny_llama

from kvblocks.bench import micro
from kvblocks.bench.harness import BenchOptions, Check, Report, Stats, Variant, measure
from kvblocks.cache.layout import KVLayout
from kvblocks.cache.pool import KVPool
from kvblocks.cli.commands import main


def test_stats_give_median_p99_and_mean():
    st = Stats.of([float(x) for x in range(1, 101)])
    assert (st.n, st.median, st.mean, st.min, st.max) == (100, 50.5, 50.5, 1.0, 100.0)
    assert st.p99 == pytest.approx(99.01)


QUIET = BenchOptions(warmup=0, plots=False, progress=False)


def test_measure_interleaves_variants_and_rotates_the_order_after_warmup():
    calls: list[str] = []
    variants = [Variant(name, lambda name=name: calls.append(name)) for name in "ABC"]
    samples = measure(variants, 3, BenchOptions(warmup=1, progress=False))
    assert "".join(calls) == "ABC" + "ABC" + "BCA" + "CAB"
    assert {name: len(s) for name, s in samples.items()} == {"A": 3, "B": 3, "C": 3}


def test_setup_and_teardown_are_not_timed():
    def nap() -> None:
        time.sleep(0.02)

    variant = Variant("v", lambda: None, setup=nap, teardown=nap)
    assert max(measure([variant], 2, QUIET)["v"]) < 0.015


def test_cpu_clock_leaves_out_time_the_process_does_not_run():
    variant = Variant("sleep", lambda: time.sleep(0.05))
    assert min(measure([variant], 2, QUIET)["sleep"]) >= 0.05
    cpu = BenchOptions(warmup=0, plots=False, progress=False, clock="cpu")
    assert max(measure([variant], 2, cpu)["sleep"]) < 0.02


def test_ratios_come_from_medians_and_checks_know_their_direction():
    report = Report("t", "T", {"n": 3}, {"a": [1.0, 2.0, 100.0], "b": [4.0, 4.0, 4.0]}, baseline="b")
    assert report.ratio("a", "b") == 0.5
    assert report.paired_ratio("a", "b") == 0.5
    assert Check("bandwidth ratio", 0.8, target=0.7, higher_is_better=True).passed is True
    assert Check("latency", 1.2, "ms", 1.0).passed is False
    assert Check("info", 3.0).passed is None
    md = report.to_markdown()
    assert "| a | 3 | 2 s |" in md and "| 0.500 |" in md


def test_report_save_writes_json_markdown_and_png(tmp_path):
    report = Report("r", "R", {}, {"x": [0.001, 0.002]}, [Check("c", 1.0, "ms", 2.0)])
    paths = report.save(BenchOptions(out=tmp_path), {"cpu_count": 2})
    assert sorted(p.name for p in paths) == ["r.json", "r.md", "r.png"]
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["stats_s"]["x"]["median"] == pytest.approx(0.0015)
    assert data["checks"][0]["passed"] is True


def test_fragmented_pool_hands_out_scattered_but_distinct_slots():
    pool = KVPool(KVLayout.from_shapes(torch.float32, [(1, 2)]), 512, "cpu")
    micro.fragment(pool, np.random.default_rng(0), rounds=20)
    assert pool.num_free == 512
    slots = pool.alloc(256)
    assert len(set(slots.tolist())) == 256
    assert micro.slot_runs(slots) > 1


def test_micro_gather_and_trie_run_end_to_end_on_tiny_sizes(tmp_path, capsys):
    args = ["bench", "micro", "--only", "gather", "--only", "trie", "--out", str(tmp_path)]
    args += ["--warmup", "1", "--no-progress", "--no-plots", "--no-fail"]
    args += [
        "--gather-tokens",
        "64",
        "--gather-capacity",
        "256",
        "--gather-layers",
        "2",
        "--gather-repeats",
        "3",
    ]
    args += ["--trie-resident", "20000", "--trie-prompt", "512", "--trie-new", "32", "--trie-repeats", "3"]
    args += ["--trie-fill", "1.5"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "gather / clone bandwidth" in out and "match+release" in out and "bytes per resident token" in out
    data = json.loads((tmp_path / "micro-summary.json").read_text())
    assert [r["name"] for r in data["reports"]] == ["micro-gather", "micro-trie", "micro-memory"]
    trie = data["reports"][1]
    assert trie["params"]["resident_tokens"] >= 19_000
    assert all(st["median"] > 0 for st in trie["stats_s"].values())
    memory = data["reports"][2]["checks"][0]
    assert 8 <= memory["value"] < 1000


def test_ttft_benchmark_runs_on_a_tiny_model(tmp_path):
    opts = BenchOptions(warmup=1, out=tmp_path, plots=False, progress=False)
    report = micro.bench_ttft(
        opts, tiny_llama(), IdTokenizer(), cached=24, question=4, repeats=3, nocache_repeats=2
    )
    ideal, kvblocks, *_ = report.samples
    assert [len(s) for s in report.samples.values()] == [3, 3, 2, 2]
    assert report.checks[0].name == "kvblocks / ideal"
    assert report.checks[0].value == pytest.approx(report.ratio(kvblocks, ideal))


TINY_GATHER = ["bench", "micro", "--only", "gather", "--warmup", "0", "--no-progress", "--no-plots"]
TINY_GATHER += [
    "--gather-tokens",
    "32",
    "--gather-capacity",
    "128",
    "--gather-layers",
    "1",
    "--gather-repeats",
    "2",
]


def test_a_missed_target_makes_the_exit_status_1_and_no_fail_only_reports_it(tmp_path, capsys):
    impossible = ["--target", "gather / clone bandwidth (fragmented)=1e9", "--out", str(tmp_path)]
    assert main([*TINY_GATHER, *impossible]) == 1
    captured = capsys.readouterr()
    assert "| gather / clone bandwidth (fragmented) |" in captured.out and "**MISS**" in captured.out
    assert "1 target(s) missed, exit status 1: " in captured.err
    data = json.loads((tmp_path / "micro-summary.json").read_text())
    checks = {c["name"]: c for c in data["reports"][0]["checks"]}
    ratio = checks["gather / clone bandwidth (fragmented)"]
    assert ratio["target"] == 1e9 and ratio["passed"] is False

    assert main([*TINY_GATHER, *impossible, "--no-fail"]) == 0
    assert "missed, reported only (--no-fail)" in capsys.readouterr().err

    reachable = ["--target", "gather / clone bandwidth (fragmented)=1e-9", "--out", str(tmp_path)]
    assert main([*TINY_GATHER, *reachable]) == 0


def test_a_target_for_a_metric_the_run_does_not_have_is_a_one_line_error(tmp_path, capsys):
    assert main([*TINY_GATHER, "--target", "no such metric=1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "kvblocks: error: --target: no metric named no such metric" in err
    assert "gather / clone bandwidth (fragmented)" in err
    with pytest.raises(SystemExit) as exited:
        main([*TINY_GATHER, "--target", "forty-two"])
    assert exited.value.code == 2
    assert "expected METRIC=VALUE, got 'forty-two'" in capsys.readouterr().err


def test_impossible_sizes_are_a_one_line_error(capsys):
    assert (
        main(["bench", "micro", "--only", "gather", "--gather-tokens", "100", "--gather-capacity", "10"]) == 2
    )
    assert "kvblocks: error: --gather-tokens (100) must not exceed" in capsys.readouterr().err
