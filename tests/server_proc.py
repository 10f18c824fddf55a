"""Run `kvblocks serve` as a real subprocess for HTTP tests, and build a tiny local model for it.

The server is a separate process on a free 127.0.0.1 port, so tests talk real HTTP to the same
code path users run (CLI parsing, uvicorn, the engine thread). Its stderr goes to a file, which a
test can read while the server runs (a pipe could fill up and block the server).
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvblocks.launch.ports import free_port
from kvblocks.launch.service import cli_env, kvblocks_command, terminate

SMOLLM2_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TINY_CONTEXT = 256


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    stderr_path: Path
    api_key: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, timeout: float = 120.0) -> httpx.Client:
        """An httpx client with the server's base URL and API key."""
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 20.0) -> str:
        """SIGTERM (uvicorn's graceful shutdown), SIGKILL if it hangs; returns everything on stderr."""
        terminate(self.proc, timeout)
        text = self.stderr()
        self.stderr_path.unlink(missing_ok=True)
        return text


def stop_cleanly(server: ServerProcess) -> None:
    """SIGTERM the server and check that no request crashed inside it and it shut down in order."""
    log = server.stop()
    assert "Traceback" not in log, log
    # uvicorn re-raises SIGTERM once its graceful shutdown (the app's lifespan included) is done
    assert server.proc.returncode in (0, -signal.SIGTERM), log


def start_server(
    *args: str,
    api_key: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 180.0,
    command: list[str] | None = None,
    stdout_to_log: bool = False,
) -> ServerProcess:
    """`kvblocks serve ARGS --port P`, returned once GET /health answers 200.

    `api_key` is only what the tests send; pass `--api-key` in `args` or KVBLOCKS_API_KEY in `env`
    to make the server require it. `command` is the `kvblocks` to run (this environment's by default).
    `stdout_to_log`: stdout goes to the log `stderr()` reads too (uvicorn's access log, with
    `--log-level info`). Without a `--dtype` in `args` the server runs float32, the dtype the tests'
    in-process references compute in (`--dtype auto` has tests of its own in tests/test_dtype.py).
    """
    if not any(a == "--dtype" or a.startswith("--dtype=") for a in args):
        args = (*args, "--dtype", "float32")
    port = free_port()
    fd, name = tempfile.mkstemp(prefix="kvblocks-serve-", suffix=".stderr")
    with os.fdopen(fd, "wb") as stderr:
        proc = subprocess.Popen(
            [*(command or kvblocks_command()), "serve", "--port", str(port), *args],
            stdout=stderr if stdout_to_log else subprocess.DEVNULL,
            stderr=stderr,
            env=cli_env(**(env or {})),
        )
    server = ServerProcess(proc, port, Path(name), api_key)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kvblocks serve exited with {proc.returncode}:\n{server.stop()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=2.0).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    log = server.stop()
    raise RuntimeError(f"kvblocks serve did not answer /health within {timeout:g} s:\n{log}")


def wait_idle(client: httpx.Client, timeout: float = 30.0) -> dict:
    """Poll /v1/cache/stats until no request runs or waits and no trie node is locked."""
    deadline = time.monotonic() + timeout
    while True:
        stats = client.get("/v1/cache/stats").json()
        engine, cache = stats["engine"], stats["cache"]
        if engine["active"] == 0 and engine["queued"] == 0 and cache["locked_tokens"] == 0:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"server still busy or holding locks after {timeout:g} s: {stats}")
        time.sleep(0.1)


def smollm2_dir() -> Path:
    from kvblocks import models

    return models.default_model_dir()


@functools.cache
def tiny_model_dir(context: int = TINY_CONTEXT, seed: int = 0) -> Path:
    """`make_tiny_model_dir` in a temporary folder, built once per test process."""
    path = Path(tempfile.mkdtemp(prefix="kvblocks-tiny-model-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return make_tiny_model_dir(path, context, seed)


def make_tiny_model_dir(path: Path, context: int = TINY_CONTEXT, seed: int = 0) -> Path:
    """A 2-layer random LlamaForCausalLM with SmolLM2's vocabulary and tokenizer, saved in `path`.

    Same tokenizer and chat template as the real model, so prompts, token boundaries and
    validation behave alike, while a forward pass costs about a millisecond. Its context is
    `context` tokens, so too-long prompts are cheap to build. Its config has no EOS id, so only
    the tokenizer's <|im_end|> (1 in 49152 per random token) ends a reply early.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=context,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    source = smollm2_dir()
    for name in SMOLLM2_TOKENIZER_FILES:
        shutil.copy(source / name, path / name)
    return path


def scrape(client: httpx.Client) -> dict[str, float]:
    """GET /metrics as {sample name with its labels: value}, e.g. 'x_total{tier="device"}'."""
    response = client.get("/metrics")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for line in response.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples
