from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
from conftest import IdTokenizer, tiny_llama

from kvblocks.bench import workloads as wl
from kvblocks.bench.harness import BenchOptions
from kvblocks.cli.commands import main

VOCAB = 128
QUIET = BenchOptions(warmup=1, plots=False, progress=False)


def sizes(**overrides) -> dict:
    base = dict(
        groups=2,
        prompts_per_group=3,
        system=24,
        question=4,
        output=3,
        conversations=3,
        turns=3,
        systems=1,
        user=4,
        capacity_fraction=0.5,
        order="arrival",
        seed=0,
        skip=[],
        cb_page_size=8,
        cb_max_batch_tokens=256,
        cb_blocks=None,
        zipf=0.0,
        eviction="gdsf",
        also_eviction=[],
    )
    return base | overrides


def test_shared_prompt_ideal_hit_rate_is_the_closed_form():
    w = wl.shared_prompt(4, 8, 1024, 32, 16, vocab=49152)
    hits, lengths = wl.unbounded_ideal(w), w.prompt_lengths()
    assert sum(hits) / sum(lengths) == pytest.approx(1024 * 7 / (8 * (1024 + 32)), abs=1e-12)
    assert sorted({h for h in hits}) == [0, 1024]


def test_shared_prompt_requests_share_exactly_their_system_prompt():
    w = wl.shared_prompt(3, 4, 16, 5, 2, vocab=VOCAB, seed=1)
    tr = wl.Transcript(w)
    prompts = [tr.prompt(t) for t in w.turns]
    for a, ta in zip(prompts, w.turns):
        for b, tb in zip(prompts, w.turns):
            if a is b:
                continue
            shared = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
            same_group = w.system_of[ta.conversation] == w.system_of[tb.conversation]
            assert shared == (16 if same_group else 0)


def test_sorted_order_puts_requests_with_one_system_prompt_back_to_back():
    w = wl.shared_prompt(3, 4, 8, 2, 1, vocab=VOCAB, order="sorted")
    groups = [w.system_of[t.conversation] for t in w.turns]
    assert sum(a != b for a, b in itertools.pairwise(groups)) == 2
    assert wl.unbounded_ideal(w) == [0 if k % 4 == 0 else 8 for k in range(12)]


def test_multi_turn_ideal_hits_the_history_up_to_the_last_reply_token():
    w = wl.multi_turn(2, 3, system=10, user=4, output=5, vocab=VOCAB)
    hits, lengths = wl.unbounded_ideal(w), w.prompt_lengths()
    turn_of: dict[int, int] = {}
    for t, h, n in zip(w.turns, hits, lengths):
        k = turn_of.get(t.conversation, 0)
        turn_of[t.conversation] = k + 1
        assert n == 10 + 4 * (k + 1) + 5 * k
        if k:
            assert h == n - 4 - 1  # everything but the last reply token and the new user turn
    first_turns = [h for t, h in zip(w.turns, hits) if h < 10 + 4]
    assert sorted(first_turns) == [0, 10]


def test_offline_optimum_keeps_the_prompts_needed_soonest():
    w = wl.shared_prompt(3, 2, 10, 2, 2, vocab=VOCAB)
    w.turns = sorted(w.turns, key=lambda t: (t.conversation % 2, t.conversation))  # groups a b c a b c
    assert [w.system_of[t.conversation] for t in w.turns] == [0, 1, 2, 0, 1, 2]
    # after a b: keep a (needed next) and 5 tokens of b; c is needed last, so it is bypassed
    assert wl.offline_optimal(w, capacity=15) == [0, 0, 0, 10, 5, 0]
    assert sum(wl.lru_whole_prefixes(w, 15)) == 0  # LRU of whole prompts thrashes on a cycle


def test_every_variant_runs_and_kvblocks_matches_the_ideal_on_a_tiny_model():
    model = tiny_llama(vocab_size=VOCAB)
    report = wl.bench_workload(model, IdTokenizer(), "shared-prompt", sizes(), QUIET)
    rows = {r.variant: r for r in report.rows}
    assert set(rows) == {"kvblocks", "ideal", "no reuse", "deepcopy recipe", "transformers CB", wl.CB_BATCH}
    assert rows["kvblocks"].hit_rate == pytest.approx(rows["ideal"].hit_rate)
    assert rows["ideal"].hit_rate == pytest.approx(24 * 2 / (3 * 28))
    assert rows["deepcopy recipe"].hit_rate == pytest.approx(rows["ideal"].hit_rate)
    assert rows["no reuse"].hit_rate == 0
    assert rows["transformers CB"].hit_rate == pytest.approx(rows["ideal"].hit_rate)  # 24 = 3 pages of 8
    for r in report.rows:
        assert r.same_tokens_as_ideal == r.requests == 6, r.variant
    names = [c.name for c in report.checks]
    assert names[0] == "kvblocks hit rate / ideal" and report.checks[0].passed
    assert "transformers CB, all at once / kvblocks, end-to-end" in names


def test_multi_turn_and_pressure_run_and_report_their_ideals():
    model = tiny_llama(vocab_size=VOCAB)
    skip = ["no-reuse", "cb-batch"]
    multi = wl.bench_workload(model, IdTokenizer(), "multi-turn", sizes(skip=skip), QUIET)
    rows = {r.variant: r for r in multi.rows}
    assert rows["kvblocks"].hit_rate == pytest.approx(rows["ideal"].hit_rate)
    assert rows["deepcopy recipe"].hit_rate < rows["ideal"].hit_rate  # it only reuses the system prompt
    assert rows["kvblocks"].same_tokens_as_ideal == 9
    pressure = wl.bench_workload(
        model, IdTokenizer(), "pressure", sizes(skip=skip, prompts_per_group=4, also_eviction=["lru"]), QUIET
    )
    assert list(pressure.ideal_lines) == ["offline optimal, same capacity", "unbounded ideal"]
    optimum, unbounded = pressure.ideal_lines.values()
    assert optimum < unbounded
    rows = {r.variant: r for r in pressure.rows}
    for lane in ("kvblocks", "kvblocks, lru"):  # one lane per eviction policy, both exact
        assert rows[lane].hit_rate <= optimum + 1e-12
        assert rows[lane].same_tokens_as_ideal == rows[lane].requests
    names = [c.name for c in pressure.checks]
    assert "kvblocks, lru hit rate / offline optimal, same capacity" in names
    assert not any(n.startswith("kvblocks, lru /") for n in names)  # not compared as a baseline


def test_zipf_popularity_skews_which_system_prompt_requests_pick():
    uniform = wl.shared_prompt(4, 50, 8, 2, 1, vocab=1024)
    skewed = wl.shared_prompt(4, 50, 8, 2, 1, vocab=1024, zipf=1.5)
    assert np.bincount(uniform.system_of).tolist() == [50] * 4
    counts = np.bincount(skewed.system_of, minlength=4)
    assert counts.sum() == 200 and counts[0] > counts[1] > counts[3]
    assert len(skewed.turns) == 200 and wl.offline_optimal(skewed, 16)  # Belady takes any popularity


def test_cli_writes_json_markdown_and_plots(tmp_path, capsys):
    args = ["bench", "shared-prompt", "--out", str(tmp_path), "--warmup", "0", "--no-progress", "--no-fail"]
    args += [
        "--groups",
        "2",
        "--prompts-per-group",
        "2",
        "--system",
        "16",
        "--question",
        "4",
        "--output",
        "2",
    ]
    args += ["--skip", "cb", "--skip", "cb-batch", "--skip", "no-reuse", "--cb-page-size", "8"]
    args += ["--model", "tiny"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            "kvblocks.bench.fixtures.load_model", lambda name: (tiny_llama(vocab_size=VOCAB), IdTokenizer())
        )
        assert main(args) == 0
    out = capsys.readouterr().out
    assert "| kvblocks | 0.4000 | 1.0000 |" in out and "same tokens as ideal" in out
    names = {p.name for p in tmp_path.iterdir()}
    report = {f"workload-shared-prompt{suffix}" for suffix in ("-overview.png", ".json", ".md", ".png")}
    assert names == report | {"shared-prompt-summary.json", "shared-prompt-summary.md"}
    data = json.loads((tmp_path / "workload-shared-prompt.json").read_text())
    assert [v["variant"] for v in data["variants"]] == ["kvblocks", "ideal", "deepcopy recipe"]


def test_bad_capacity_fraction_is_a_one_line_error(capsys):
    assert main(["bench", "pressure", "--capacity-fraction", "1.5"]) == 2
    assert "kvblocks: error: --capacity-fraction must be in (0, 1)" in capsys.readouterr().err
