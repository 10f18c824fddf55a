"""`kvblocks bench seq2seq` on a tiny shape: it runs both benchmarks and reports what it promises."""

from __future__ import annotations

from test_bench_suites import checks, run_suite


def test_seq2seq_suite_reports_no_encoder_work_on_reuse_and_exact_speculation(tmp_path, capsys):
    sizes = {"source": 64, "decoder": 6, "hidden": 32, "layers": 2, "vocab": 256, "tokens": 12, "repeats": 2}
    reports = run_suite(tmp_path, capsys, "seq2seq", *(f"--{k}={v}" for k, v in sizes.items()))
    reuse = checks(reports, "seq2seq-reuse")
    assert reuse["encoder runs on the repeated source"] == 0
    assert reuse["encoder tokens on the repeated source"] == 0
    assert reuse["source reuses"] == 2
    for kind in ("trie", "model"):
        spec = checks(reports, f"seq2seq-specdec-{kind}")
        assert spec["greedy output identical to target only"] == 1
        assert spec["predicted speed-up S"] > 0 and spec["measured speed-up"] > 0
    assert checks(reports, "seq2seq-specdec-trie")["alpha"] == 1.0  # the trie holds the warm-up's reply


def test_the_first_layer_drafter_leaves_the_target_whole():
    from kvblocks.bench.seq2seq import build_model, first_layer_drafter

    model = build_model(hidden=32, layers=3, vocab=64, source=16, seed=0)
    draft = first_layer_drafter(model)
    assert len(draft.model.decoder.layers) == 1 and draft.config.decoder_layers == 1
    assert len(model.model.decoder.layers) == 3 and model.config.decoder_layers == 3
    assert draft.model.decoder.layers[0] is model.model.decoder.layers[0]  # weights shared
