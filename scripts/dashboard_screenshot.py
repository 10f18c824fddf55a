"""Render dashboards/kvblocks.json from real data: the picture in docs/OBSERVABILITY.md.

A real `kvblocks serve` (Redis tier, KV events, two tenants) takes agent traffic while a real
Prometheus (Debian's `prometheus` package) scrapes it with a router key; every panel's PromQL is
then evaluated by that Prometheus (`query_range`) and drawn with matplotlib in the dashboard's
layout. Grafana itself is not installed here: the queries and the data are the dashboard's, the
drawing is matplotlib's.

    scripts/dashboard-screenshot [--model PATH] [--seconds 120] [--out docs/dashboard.png]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

from kvblocks.launch.ports import free_port
from kvblocks.launch.redis_server import RedisServer
from kvblocks.launch.service import spawn_serve, terminate, wait_serve

DASHBOARD = Path(__file__).resolve().parent.parent / "dashboards" / "kvblocks.json"
KEYS = {"acme": "sk-shot-acme-0000", "globex": "sk-shot-globex-0000", "prometheus": "sk-shot-prom-0000"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--seconds", type=int, default=120)
    p.add_argument("--out", default="docs/dashboard.png")
    args = p.parse_args()
    if shutil.which("prometheus") is None:
        raise SystemExit("needs Prometheus on PATH: apt-get install prometheus")
    with (
        tempfile.TemporaryDirectory(prefix="kvblocks-shot-") as tmp,
        RedisServer(Path(tmp) / "redis") as redis,
    ):
        work = Path(tmp)
        redis.start()
        server = spawn_serve(serve_args(args, work, redis.url), work)
        try:
            wait_serve(server)
            prometheus, url = start_prometheus(work, server.url)
            try:
                start = time.time()
                drive(server.url, args.seconds)
                time.sleep(6)  # the last scrapes
                draw(query_panels(url, start, time.time()), Path(args.out))
            finally:
                terminate(prometheus)
        finally:
            server.stop(30)
    print(f"wrote {args.out}")


def serve_args(args, work: Path, redis_url: str) -> list[str]:
    keys = work / "keys.json"
    entries = [{"key": KEYS[t], "tenant": t} for t in ("acme", "globex")]
    entries.append({"key": KEYS["prometheus"], "tenant": "ops", "role": "router"})
    keys.write_text(json.dumps({"keys": entries}))
    keys.chmod(0o600)
    model = ["--model", args.model] if args.model else []
    return [*model, "--api-keys", str(keys), "--redis", redis_url, "--capacity", "2500",
            "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}"]  # fmt: skip


def start_prometheus(work: Path, target: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    config = work / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 2s}\n"
        "scrape_configs:\n"
        "  - job_name: kvblocks\n"
        f"    authorization: {{credentials: {KEYS['prometheus']}}}\n"
        f"    static_configs: [{{targets: ['{target.removeprefix('http://')}']}}]\n"
    )
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={work / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    terminate(proc)
    raise SystemExit("prometheus did not start")


def drive(url: str, seconds: int) -> None:
    """Two tenants' agents: multi-turn chats on each tenant's system prompt, and a few strangers."""
    stop = time.monotonic() + seconds

    def agent(tenant: str, i: int) -> None:
        rng = random.Random(f"{tenant}{i}")
        system = f"You are {tenant}'s assistant. " + " ".join(rng.choice("abcdefgh") * 4 for _ in range(200))
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {KEYS[tenant]}"}, timeout=300
        ) as c:
            while time.monotonic() < stop:
                messages = [{"role": "system", "content": system}]
                for turn in range(3):
                    messages.append({"role": "user", "content": f"question {rng.randrange(50)} turn {turn}"})
                    r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 8})
                    messages.append(
                        {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}
                    )

    threads = [threading.Thread(target=agent, args=(t, i)) for t in ("acme", "globex") for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def query_panels(url: str, start: float, end: float) -> list[tuple[dict, list[tuple[str, list, list]]]]:
    """Each panel with its series: (legend, times, values), evaluated by Prometheus."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    out = []
    for panel in panels:
        series = []
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", "20s")
            r = httpx.get(f"{url}/api/v1/query_range",
                          params={"query": expr, "start": start, "end": end, "step": 4}).json()  # fmt: skip
            for result in r["data"]["result"]:
                legend = target.get("legendFormat", "")
                for label, value in result["metric"].items():
                    legend = legend.replace("{{" + label + "}}", value)
                times = [float(t) - start for t, _ in result["values"]]
                series.append((legend or expr[:40], times, [float(v) for _, v in result["values"]]))
        out.append((panel, series))
    return out


def draw(panels: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 3
    rows = (len(panels) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(16, 3.2 * rows))
    for ax, (panel, series) in zip(axes.flat, panels):
        for legend, times, values in series:
            ax.plot(times, values, label=legend)
        ax.set_title(panel.get("title", ""), fontsize=10)
        ax.set_xlabel("seconds", fontsize=8)
        ax.tick_params(labelsize=8)
        if series:
            ax.legend(fontsize=7, loc="best")
        else:
            ax.text(0.5, 0.5, "no data (no recurrent model here)", ha="center", va="center", fontsize=8,
                    transform=ax.transAxes)  # fmt: skip
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle("dashboards/kvblocks.json, evaluated by Prometheus on a live kvblocks serve", fontsize=12)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)


if __name__ == "__main__":
    main()
