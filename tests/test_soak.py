"""A short soak in CI: tenants' agent traffic on a tiny model while Redis, clients and a flooding
tenant misbehave and a hostile one attacks (`kvblocks bench soak`). What must hold whatever the machine's speed: no reply
differs from a no-cache server's, the engine never dies, no request gets a 5xx (the attacks
included), and every kind of fault and attack was sent. TTFT and RSS ratios are the full benchmark's business (BENCHMARKS.md)."""

from __future__ import annotations

import json

from server_proc import tiny_model_dir

from kvblocks.cli.commands import main


def test_a_soak_under_faults_gives_no_wrong_output_no_engine_death_and_no_5xx(tmp_path, capsys):
    args = [
        "bench", "soak", "--model", str(tiny_model_dir()), "--duration", "40", "--agents", "2",
        "--system-tokens", "60", "--oversized-mb", "8", "--capacity", "400", "--fault-every", "4",
        "--out", str(tmp_path), "--warmup", "0", "--no-progress", "--no-plots", "--no-fail",
    ]  # fmt: skip
    assert main(args) == 0
    report = json.loads((tmp_path / "soak.json").read_text())
    checks = {c["name"]: c["value"] for c in report["checks"]}
    notes = "\n".join(report["notes"])
    assert checks["wrong outputs"] == 0, notes
    assert checks["engine deaths (health not 200)"] == 0, notes
    assert checks["5xx on well-formed requests"] == 0, notes
    assert checks["5xx on malformed requests"] == 0, notes
    assert checks["5xx on the attacks"] == 0, notes
    for attack in (
        "ref chain",
        "250 blocks",
        "115k messages",
        "110k input items",
        "huge metadata",
        "pin the cache",
    ):
        assert attack in notes, notes
    for fault in ("pause", "kill_restart", "flushall", "bitflip", "oversize", "wrong_type"):
        assert fault in notes, notes
    assert "checked against each request alone on a server whose cache is flushed" in notes
    assert not notes.startswith("0 replies")
    capsys.readouterr()
