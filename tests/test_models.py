"""The default model's one-time conversion when several processes or threads need it at once."""

from __future__ import annotations

import threading
import time

from kvblocks import models


def test_callers_at_once_convert_the_default_model_once_and_see_only_the_finished_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBLOCKS_HOME", str(tmp_path))
    conversions = []

    def convert(target):  # what the real one does, slowly: write elsewhere, then one rename
        conversions.append(target)
        time.sleep(0.3)
        staging = target.parent / ".staging"
        staging.mkdir()
        (staging / "config.json").write_text("{}")
        (staging / "model.safetensors").write_bytes(b"weights")
        staging.rename(target)

    monkeypatch.setattr(models, "_convert", convert)
    found, errors = [], []

    def load() -> None:
        try:
            target = models.default_model_dir()
            found.append((target, sorted(p.name for p in target.iterdir())))
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert len(conversions) == 1
    assert found == [(tmp_path / models.DEFAULT_MODEL, ["config.json", "model.safetensors"])] * 4
    assert models.default_model_dir() == tmp_path / models.DEFAULT_MODEL and len(conversions) == 1
