"""CORS (issue 42): `--allowed-origins` lets a page of another origin call the server from a browser;
without it the server sends no CORS headers, and a browser refuses to hand the page the answer.

The browser is a real headless Chromium (Debian's `chromium`): a page served from its own origin on a
second loopback port calls the server with `fetch` (an API key and a JSON body, so every call is
preceded by a preflight), streams a chat completion, and reports what it got to its own origin
(`/result?...`), where the test reads it. Without Chromium the browser tests skip,
except in CI (KVBLOCKS_CI=1), where they fail.
"""

from __future__ import annotations

import functools
import os
import queue
import shutil
import subprocess
import tempfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from server_proc import start_server, stop_cleanly, tiny_model_dir

from kvblocks.launch.ports import free_port

API_KEY = "sk-cors-test"
MODEL = "tiny"
PAGE = """<!doctype html><html><body><pre id="out">pending</pre><script>
const out = document.getElementById("out");
const headers = {"Authorization": "Bearer %(key)s", "Content-Type": "application/json"};
const body = (stream) => JSON.stringify({model: "%(model)s", max_tokens: 4, temperature: 0, stream,
  messages: [{role: "user", content: "Hello"}]});
(async () => {
  try {
    const r = await fetch("%(server)s/v1/chat/completions", {method: "POST", headers, body: body(false)});
    const j = await r.json();
    const s = await fetch("%(server)s/v1/chat/completions", {method: "POST", headers, body: body(true)});
    const reader = s.body.getReader();
    let text = "";
    for (;;) { const {done, value} = await reader.read(); if (done) break; text += new TextDecoder().decode(value); }
    const denied = await fetch("%(server)s/v1/models", {headers: {"Authorization": "Bearer wrong"}});
    out.textContent = "OK " + j.object + " " + (text.includes("data: [DONE]") ? "STREAMED" : "NOSTREAM")
      + " " + denied.status;
  } catch (e) {
    out.textContent = "BLOCKED " + e.name;
  }
  await fetch("/result?" + new URLSearchParams({page: "%(name)s", text: out.textContent}));
})();
</script></body></html>"""


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        reason = "Debian's chromium is not installed (scripts/setup installs it)"
        if os.environ.get("KVBLOCKS_CI") == "1":
            pytest.fail(f"headless Chromium needed in CI (KVBLOCKS_CI=1): {reason}", pytrace=False)
        pytest.skip(reason)
    return path


class PageHandler(SimpleHTTPRequestHandler):
    """Serves the pages; `/result?page=..&text=..` is what a page reports, kept in `results`."""

    results: ClassVar[dict[str, queue.Queue]] = {}

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path != "/result":
            super().do_GET()
            return
        query = parse_qs(url.query)
        self.results.setdefault(query["page"][0], queue.Queue()).put(query["text"][0])
        self.send_response(204)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def page_origin():
    """A static page server on its own port: the origin the browser calls the kvblocks server from."""
    root = Path(tempfile.mkdtemp(prefix="kvblocks-cors-page-"))
    httpd = ThreadingHTTPServer(
        ("127.0.0.1", free_port()), functools.partial(PageHandler, directory=str(root))
    )
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def model():
    return str(tiny_model_dir())


@pytest.fixture(scope="module")
def server(page_origin, model):
    _, origin = page_origin
    server = start_server(
        "--model", model, "--served-model-name", MODEL, "--api-key", API_KEY,
        "--allowed-origins", origin, api_key=API_KEY,
    )  # fmt: skip
    yield server
    stop_cleanly(server)


def browse(page_origin, server_url: str, name: str) -> str:
    """What the page reported once headless Chromium loaded it and its fetches ended."""
    root, origin = page_origin
    (root / f"{name}.html").write_text(
        PAGE % {"key": API_KEY, "model": MODEL, "server": server_url, "name": name}
    )
    reported = PageHandler.results.setdefault(name, queue.Queue())
    profile = tempfile.mkdtemp(prefix="kvblocks-chromium-")
    browser = subprocess.Popen(
        [
            chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync",
            f"--user-data-dir={profile}", f"{origin}/{name}.html",
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        return reported.get(timeout=120)
    except queue.Empty:
        browser.kill()
        pytest.fail(
            f"the page reported nothing within 120 s; Chromium said:\n{browser.communicate()[1][-3000:]}"
        )
    finally:
        browser.kill()
        browser.wait()
        shutil.rmtree(profile, ignore_errors=True)


def test_a_page_of_an_allowed_origin_calls_and_streams_from_a_real_browser(server, page_origin):
    assert browse(page_origin, server.url, "allowed") == "OK chat.completion STREAMED 401"


def test_a_browser_page_gets_nothing_from_a_server_without_allowed_origins(page_origin, model):
    server = start_server(
        "--model", model, "--served-model-name", MODEL, "--api-key", API_KEY, api_key=API_KEY
    )
    try:
        assert browse(page_origin, server.url, "refused") == "BLOCKED TypeError"
    finally:
        stop_cleanly(server)


def test_a_preflight_from_an_allowed_origin_is_answered_without_an_api_key(server, page_origin):
    _, origin = page_origin
    preflight = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    r = httpx.options(f"{server.url}/v1/chat/completions", headers=preflight)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == origin
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()


def test_a_preflight_from_another_origin_is_refused_and_names_no_origin(server):
    preflight = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
    r = httpx.options(f"{server.url}/v1/chat/completions", headers=preflight)
    assert r.status_code == 400
    assert "access-control-allow-origin" not in r.headers


def test_errors_carry_the_cors_headers_so_a_page_can_read_them(server, page_origin):
    _, origin = page_origin
    r = httpx.get(f"{server.url}/v1/models", headers={"Origin": origin})
    assert r.status_code == 401
    assert r.headers["access-control-allow-origin"] == origin
    assert r.json()["error"]["code"] == "invalid_api_key"


def test_credentials_with_a_wildcard_origin_is_refused_at_start(model):
    from kvblocks.launch.service import kvblocks_command

    run = subprocess.run(
        [*kvblocks_command(), "serve", "--model", model, "--port", str(free_port()),
         "--allowed-origins", "*", "--allow-credentials"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0
    assert "--allow-credentials needs explicit --allowed-origins" in run.stderr
    assert "Traceback" not in run.stderr
