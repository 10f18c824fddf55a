"""`kvblocks bench blocks --shares`: the blend shares compared, with the two the targets check."""

from __future__ import annotations

import pytest

from kvblocks.bench.blocks import blend_shares, variants
from kvblocks.cli.commands import main


def test_shares_always_include_the_target_share_and_one_sorted():
    assert blend_shares("0.7,0.5,0.5") == (0.15, 0.5, 0.7, 1.0)
    names = [name for name, _, _ in variants(blend_shares("0"))]
    assert names == ["full prefill", "prefix only", "blend 0", "blend 0.15", "blend 1", "concat"]


def test_shares_outside_zero_one_or_not_numbers_are_refused_in_one_line(capsys):
    for bad in ("1.5", "0.1,x", "-0.1"):
        with pytest.raises(SystemExit) as exited:
            main(["bench", "blocks", "--shares", bad])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert "expected comma-separated shares in [0, 1]" in err and "Traceback" not in err
