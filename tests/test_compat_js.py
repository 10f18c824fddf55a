"""JavaScript clients against a real `kvblocks serve` (issue 42): the openai npm package and the Vercel AI
SDK (`@ai-sdk/openai` on the Responses and chat APIs, `@ai-sdk/openai-compatible`), at the versions pinned
in tests/js/package-lock.json, installed from the npm registry by `npm ci` here.

`tests/js/compat.mjs` runs every check once and prints one JSON line per check; each check is a test here.
The model is a tiny random one, so tool arguments and objects are bounded types (enums, booleans) whose
shape does not depend on what it says. Without node and npm the tests skip, except in CI
(KVBLOCKS_CI=1), where they fail.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from server_proc import start_server, stop_cleanly, tiny_model_dir

JS = Path(__file__).with_name("js")
API_KEY = "sk-compat-js"
MODEL = "tiny"
CONTEXT = 4096
CHECKS = [
    "openai.chat", "openai.chat.stream", "openai.chat.tools.required", "openai.chat.tools.stream",
    "openai.chat.parse.zod", "openai.responses.create", "openai.responses.stream",
    "openai.responses.parse.zod", "openai.responses.retrieve.input_items.delete",
    *(
        f"{provider}.{check}"
        for provider in ("aisdk.responses", "aisdk.chat", "aisdk.compatible")
        for check in ("generateText", "streamText", "generateObject", "streamObject", "tools.required",
                      "tools.cut", "tools.multistep", "tools.stream")
    ),
]  # fmt: skip


def npm() -> str:
    path, node = shutil.which("npm"), shutil.which("node")
    if path is None or node is None:
        if os.environ.get("KVBLOCKS_CI") == "1":
            pytest.fail("node and npm are needed in CI (KVBLOCKS_CI=1)", pytrace=False)
        pytest.skip("node and npm are not installed")
    return path


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    install = subprocess.run(
        [npm(), "ci", "--no-audit", "--no-fund"], cwd=JS, capture_output=True, text=True, timeout=600
    )
    assert install.returncode == 0, install.stderr[-4000:]
    server = start_server(
        "--model", str(tiny_model_dir(CONTEXT)), "--served-model-name", MODEL, "--capacity", "65536",
        "--api-key", API_KEY, api_key=API_KEY,
    )  # fmt: skip
    try:
        run = subprocess.run(
            ["node", "compat.mjs", server.url, API_KEY, MODEL],
            cwd=JS,
            capture_output=True,
            text=True,
            timeout=900,
        )
    finally:
        stop_cleanly(server)
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines, f"compat.mjs printed no result (exit {run.returncode}):\n{run.stderr[-4000:]}"
    return {line["check"]: line for line in lines}


@pytest.mark.parametrize("check", CHECKS)
def test_a_javascript_client_works_against_the_server(results, check):
    assert check in results, f"{check} did not run; ran: {sorted(results)}"
    outcome = results[check]
    assert outcome["ok"], json.dumps(outcome["detail"], indent=1)[:4000]
