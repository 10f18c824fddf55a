"""`kvblocks stats / inspect / explain`: a client of a running `kvblocks serve` (HTTP only)."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import httpx

from kvblocks.errors import UserError


def add_inspect_parsers(sub) -> None:
    st = sub.add_parser("stats", help="hit rates per tier, tokens saved, occupancy of a running server")
    _client_args(st)
    st.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, metavar="SECONDS",
                    help="refresh every SECONDS (default 2) with rates over the last interval")  # fmt: skip
    st.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="sample for --duration s and plot hit rate and occupancy",
    )
    st.add_argument("--duration", type=float, default=30.0, help="seconds to sample for --plot (default 30)")
    st.add_argument(
        "--interval", type=float, default=1.0, help="seconds between samples for --plot (default 1)"
    )
    st.add_argument("--since", type=parse_duration, default=None, metavar="DURATION",
                    help="show the past from the server's history (e.g. 90s, 30m, 1h): a table, a "
                    "terminal sparkline of the hit rate, and with --plot the chart of that span")  # fmt: skip
    st.add_argument("--json", action="store_true", help="print the raw stats JSON")
    st.set_defaults(func=cmd_stats)

    ins = sub.add_parser("inspect", help="top cached prefixes and the shape of the trie")
    _client_args(ins)
    ins.add_argument("--top", type=int, default=10, help="how many prefixes (default 10)")
    ins.add_argument("--tree", action="store_true", help="also draw the trie")
    ins.add_argument("--max-nodes", type=int, default=60, help="nodes drawn with --tree (default 60)")
    ins.set_defaults(func=cmd_inspect)

    ex = sub.add_parser("explain", help="why a prompt missed the cache: longest match, divergence, reason")
    _client_args(ex)
    ex.add_argument("prompt", help="the prompt text (a user message unless --raw)")
    ex.add_argument("--system", default=None, help="system message (chat prompts)")
    ex.add_argument("--raw", action="store_true", help="explain the plain text, without the chat template")
    ex.add_argument("--salt", default=None, help="the request's cache_salt")
    ex.add_argument(
        "--decoder-prompt",
        default=None,
        help="an encoder-decoder model's decoder prefix (the prompt is then its source; implies --raw)",
    )
    ex.add_argument(
        "--block",
        action="append",
        default=[],
        metavar="TEXT",
        help="a KV block (a document, a tool output) placed before the prompt, in order; repeatable",
    )
    ex.add_argument(
        "--kv-mode", choices=("exact", "blend", "concat"), default=None, help="how blocks are reused"
    )
    ex.add_argument("--blend-recompute", type=float, default=None, help="blend's recomputed share (0-1)")
    ex.add_argument("--json", action="store_true", help="print the raw explanation JSON")
    ex.set_defaults(func=cmd_explain)


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("KVBLOCKS_URL", "http://127.0.0.1:8000"),
                   help="server address (default $KVBLOCKS_URL or http://127.0.0.1:8000)")  # fmt: skip
    p.add_argument("--api-key", default=None, help="API key (default $KVBLOCKS_API_KEY)")


class Client:
    def __init__(self, args: argparse.Namespace) -> None:
        key = args.api_key or os.environ.get("KVBLOCKS_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.url = args.url.rstrip("/")
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=30.0)

    def call(self, method: str, path: str, **kwargs) -> dict:
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise UserError(
                f"cannot reach a kvblocks server at {self.url} ({exc.__class__.__name__}); is `kvblocks serve` running?"
            ) from exc
        if response.status_code == 401:
            raise UserError(
                f"the server at {self.url} rejected the API key (set --api-key or KVBLOCKS_API_KEY)"
            )
        try:
            body = response.json()
        except ValueError as exc:
            raise UserError(
                f"{self.url}{path} did not answer with JSON (HTTP {response.status_code})"
            ) from exc
        if response.status_code >= 400:
            message = (
                body.get("error", {}).get("message", response.text)
                if isinstance(body, dict)
                else response.text
            )
            raise UserError(f"server answered {response.status_code}: {message}")
        return body


# ---- stats -----------------------------------------------------------------------------------


def _rates(now: dict, before: dict | None) -> dict:
    """Hit rates per tier from counter deltas (since start when `before` is None)."""
    c0 = (before or {}).get("cache") or {}
    c1 = now.get("cache") or {}
    d = {k: c1.get(k, 0) - c0.get(k, 0) for k in c1 if isinstance(c1.get(k), int | float)}
    queried = d.get("queried_tokens", 0)
    spill = d.get("spill_hit_tokens", 0)
    device = d.get("hit_tokens", 0) - spill
    tiers = [t["name"] for t in now.get("spill_tiers") or ()]  # admin only, fastest first

    def rate(tokens: int) -> float:
        return tokens / queried if queried else 0.0

    return {
        "queries": d.get("queries", 0),
        "queried_tokens": queried,
        "device_hit_rate": rate(device),
        # every spill tier together (host, disk, Redis), and each one's share where the stats name them
        "spill": bool(tiers) or bool(c1.get("spill_hit_tokens")),
        "spill_hit_rate": rate(spill),
        "tier_hit_rates": {name: rate(d.get(f"{name}_hit_tokens", 0)) for name in tiers},
        "hit_rate": rate(device + spill),
        "tokens_saved": device + spill,
        "occupancy": c1.get("resident_tokens", 0) / c1["capacity_tokens"]
        if c1.get("capacity_tokens")
        else 0.0,
        "resident_tokens": c1.get("resident_tokens", 0),
        "capacity_tokens": c1.get("capacity_tokens", 0),
        "evicted_tokens": d.get("evicted_tokens", 0),
        "redis_errors": d.get("redis_errors"),
        "redis_verify_failures": d.get("redis_verify_failures"),
        # recurrent and hybrid models only
        "snapshots": c1.get("snapshots"),
        "snapshot_bytes": c1.get("snapshot_bytes", 0),
        "snapshot_misses": d.get("snapshot_misses", 0),
    }


def _stats_table(now: dict, r: dict, title: str):
    from rich.table import Table

    t = Table(title=title, show_header=True, header_style="bold")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("model", str(now.get("model")))
    t.add_row("requests (lookups)", f"{r['queries']:,}")
    t.add_row("prompt tokens looked up", f"{r['queried_tokens']:,}")
    t.add_row("hit rate, device", f"{r['device_hit_rate']:.1%}")
    if r["spill"]:
        t.add_row("hit rate, spill tiers", f"{r['spill_hit_rate']:.1%}")
        for name, rate in r["tier_hit_rates"].items():
            t.add_row(f"  restored from {name}", f"{rate:.1%}")
    t.add_row("hit rate, total", f"[bold]{r['hit_rate']:.1%}[/bold]")
    t.add_row("prefill tokens saved", f"{r['tokens_saved']:,}")
    t.add_row(
        "occupancy", f"{r['resident_tokens']:,} / {r['capacity_tokens']:,} tokens ({r['occupancy']:.1%})"
    )
    t.add_row("evicted tokens", f"{r['evicted_tokens']:,}")
    cache = now.get("cache") or {}
    if "source_resident_tokens" in cache:  # an encoder-decoder model: its source records
        held = f"{cache['source_resident_tokens']:,} / {cache['source_capacity_tokens']:,} tokens"
        t.add_row("source records (encoder output, cross K/V)", held)
    if "encoder_runs" in cache:
        t.add_row("source records held", f"{cache['source_records']:,}")
        t.add_row("encoder runs / sources reused", f"{cache['encoder_runs']:,} / {cache['encoder_reused']:,}")
        computed, reused = cache["encoder_tokens"], cache["encoder_reused_tokens"]
        t.add_row("source tokens encoded / reused", f"{computed:,} / {reused:,}")
        t.add_row("decoder prefix tokens hit", f"{cache['hit_tokens']:,} of {cache['queried_tokens']:,}")
    if r["snapshots"] is not None:
        t.add_row("state snapshots", f"{r['snapshots']:,} ({r['snapshot_bytes'] / 2**20:,.1f} MiB)")
        t.add_row("lookups short of a snapshot", f"{r['snapshot_misses']:,}")
    if r["redis_errors"] is not None:
        t.add_row("redis errors / verify failures", f"{r['redis_errors']:,} / {r['redis_verify_failures']:,}")
    for tier in now.get("spill_tiers") or ():  # admin only: each spill tier, fastest first
        t.add_row(f"spill tier {tier['name']}", _tier_line(tier, cache))
    if "tenant" in now:  # a tenant's key: its own counters, no server-wide engine figures
        t.add_row("tenant", now["tenant"] or "(default)")
    else:
        engine = now.get("engine", {})
        t.add_row("engine active / queued", f"{engine.get('active', 0)} / {engine.get('queued', 0)}")
        graphs = engine.get("cuda_graphs")
        if graphs is not None:  # a CUDA device's packed forwards
            state = f"off: {graphs['disabled']}" if graphs["disabled"] else f"{graphs['graphs']} held"
            t.add_row(
                "CUDA graphs replays / eager forwards",
                f"{graphs['replays']:,} / {graphs['eager']:,} ({graphs['captures']} captured, {state})",
            )
        direct = engine.get("attention_kernel")
        if direct is not None:  # the packed engine: is the CPU kernel reading keys in place?
            t.add_row("CPU attention kernel", "in use" if direct["in_use"] else f"off: {direct['reason']}")
    return t


def _tier_line(tier: dict, cache: dict) -> str:
    """A spill tier's health, size and counters in one line."""
    name = tier["name"]
    used, capacity, records = tier["used_bytes"], tier["capacity_bytes"], tier["records"]
    size = (
        ""
        if used is None
        else f"{used / 2**20:,.1f} MiB" + ("" if capacity is None else f" / {capacity / 2**20:,.1f} MiB")
    )
    held = "" if records is None else f", {records:,} records"
    hits = cache.get(f"{name}_hit_chunks", 0)
    restored = cache.get(f"{name}_hit_tokens", 0)
    return f"{tier['health']}: {size}{held}; {hits:,} chunks hit ({restored:,} tokens restored)"


def cmd_stats(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    client = Client(args)
    console = Console()
    if args.since is not None:
        return _history(client, args, console)
    first = client.call("GET", "/v1/cache/stats")
    if args.json:
        print(json.dumps(first, indent=2))
        return 0
    if args.plot:
        return _plot(client, args, first)
    if args.watch is None:
        console.print(_stats_table(first, _rates(first, None), "kvblocks cache (since server start)"))
        return 0
    before = first
    with Live(
        _stats_table(first, _rates(first, None), "since start"), console=console, refresh_per_second=4
    ) as live:
        try:
            while True:
                time.sleep(args.watch)
                now = client.call("GET", "/v1/cache/stats")
                live.update(_stats_table(now, _rates(now, before), f"last {args.watch:g} s (Ctrl-C to stop)"))
                before = now
        except KeyboardInterrupt:
            return 0


def _plot(client: Client, args: argparse.Namespace, first: dict) -> int:
    from tqdm import tqdm

    plt = _pyplot()

    times, hit, occ = [], [], []
    before, t0 = first, time.monotonic()
    bar = tqdm(total=round(args.duration), desc="sampling", unit="s", file=sys.stderr, leave=False)
    try:
        while time.monotonic() - t0 < args.duration:
            time.sleep(args.interval)
            now = client.call("GET", "/v1/cache/stats")
            r = _rates(now, before)
            times.append(time.monotonic() - t0)
            hit.append(r["hit_rate"] * 100 if r["queried_tokens"] else float("nan"))
            occ.append(r["occupancy"] * 100)
            before = now
            bar.update(min(round(times[-1]), bar.total) - bar.n)
    except KeyboardInterrupt:
        pass
    finally:
        bar.close()
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(times, hit, label="hit rate (per interval)", marker=".")
    ax.plot(times, occ, label="device pool occupancy", linestyle="--")
    ax.set_xlabel("seconds")
    ax.set_ylabel("%")
    ax.set_ylim(0, 105)
    ax.legend()
    ax.set_title(f"kvblocks cache — {first.get('model')}")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"wrote {args.plot}", file=sys.stderr)
    return 0


UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
SPARKS = " ▁▂▃▄▅▆▇█"


def parse_duration(text: str) -> float:
    """'90s', '30m', '1h', '2d' or plain seconds, as seconds."""
    number, unit = (text[:-1], text[-1]) if text and text[-1] in UNITS else (text, "s")
    try:
        seconds = float(number) * UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 90s, 30m, 1h)") from None
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"a duration must be positive, got {text!r}")
    return seconds


def _history(client: Client, args: argparse.Namespace, console) -> int:
    """The server's samples of the last --since seconds: per-interval rates, as a table and a sparkline."""
    from rich.table import Table

    body = client.call("GET", "/v1/cache/history", params={"since": args.since})
    samples = [s for s in body["samples"] if s.get("cache")]
    if args.json:
        print(json.dumps(body, indent=2))
        return 0
    if len(samples) < 2:
        raise UserError("the server has fewer than two samples in that span yet; try a longer --since")
    rows = [(b["t"], _rates(b, a)) for a, b in itertools.pairwise(samples)]
    t = Table(title=f"kvblocks cache, last {args.since:g} s ({len(samples)} samples)", header_style="bold")
    for column in ("time", "lookups", "hit rate", "spill-tier hits", "evicted", "resident"):
        t.add_column(column, justify="right")
    step = max(1, len(rows) // 20)
    for at, r in rows[::step]:
        t.add_row(time.strftime("%H:%M:%S", time.localtime(at)), f"{r['queries']:,}", f"{r['hit_rate']:.1%}",
                  f"{r['spill_hit_rate']:.1%}", f"{r['evicted_tokens']:,}", f"{r['resident_tokens']:,}")  # fmt: skip
    console.print(t)
    console.print("hit rate " + "".join(_spark(r) for _, r in rows))
    if args.plot:
        _plot_history(rows, args.plot, body["model"])
    return 0


def _spark(r: dict) -> str:
    return "·" if not r["queried_tokens"] else SPARKS[round(r["hit_rate"] * (len(SPARKS) - 1))]


def _plot_history(rows: list[tuple[float, dict]], path: str, model: str) -> None:
    plt = _pyplot()
    start = rows[0][0]
    minutes = [(at - start) / 60 for at, _ in rows]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(minutes, [r["hit_rate"] * 100 if r["queried_tokens"] else float("nan") for _, r in rows],
            label="hit rate", marker=".")  # fmt: skip
    ax.plot(minutes, [r["occupancy"] * 100 for _, r in rows], label="device pool occupancy", linestyle="--")
    ax.set_xlabel("minutes since " + time.strftime("%H:%M:%S", time.localtime(start)))
    ax.set_ylabel("%")
    ax.set_ylim(0, 105)
    ax.legend()
    ax.set_title(f"kvblocks cache history — {model}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", file=sys.stderr)


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise UserError("--plot needs matplotlib: pip install 'kvblocks[bench]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ---- inspect ---------------------------------------------------------------------------------


def cmd_inspect(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table
    from rich.tree import Tree

    client = Client(args)
    body = client.call(
        "GET",
        "/v1/cache/prefixes",
        params={"limit": args.top, "tree": args.tree, "max_nodes": args.max_nodes},
    )
    console = Console()
    t = Table(title="top cached prefixes", header_style="bold")
    for col, justify in (
        ("hits", "right"),
        ("tokens", "right"),
        ("pinned", "center"),
        ("namespace", "left"),
        ("preview", "left"),
    ):
        t.add_column(col, justify=justify)
    for p in body["prefixes"]:
        t.add_row(
            str(p["hits"]),
            str(p["length"]),
            "yes" if p["pinned"] else "",
            p["namespace"][:8],
            repr(p["preview"])[1:-1][:100],
        )
    console.print(t)
    if args.tree:
        root = Tree("[bold]trie[/bold]")
        branches = {}
        for node in body["tree"]:
            label = (f"[cyan]{node['run']}[/cyan] tok (to {node['prefix_length']}) hits={node['hits']}"
                     f"{' [red]locked[/red]' if node['locked'] else ''}{' [yellow]pinned[/yellow]' if node['pinned'] else ''}"
                     f"{' [green]snapshot[/green]' if node.get('snapshot') else ''}"
                     f"  {repr(node['preview'])[1:-1][:60]}")  # fmt: skip
            parent = branches.get(node["parent"], root)
            branches[node["id"]] = parent.add(label)
        console.print(root)
    return 0


# ---- explain ---------------------------------------------------------------------------------


def cmd_explain(args: argparse.Namespace) -> int:
    from rich.console import Console

    client = Client(args)
    payload = _explain_payload(args)
    e = client.call("POST", "/v1/cache/explain", json=payload)
    if args.json:
        print(json.dumps(e, indent=2))
        return 0
    console = Console(highlight=False)
    if "source" in e:  # an encoder-decoder model: the source's record, then the decoder prefix
        held = "held: the encoder does not run" if e["source"]["cached"] else "not held: the encoder runs"
        console.print(f"source of {e['source']['tokens']} tokens {held}")
    console.print(f"[bold]{e['reason']}[/bold]: {e['detail']}")
    console.print(f"cached {e['cached_tokens']} of {e['prompt_tokens']} prompt tokens")
    if len(e.get("tiers") or ()) > 1 or any(t["tier"] != "device" for t in e.get("tiers") or ()):
        console.print("from " + ", then ".join(f"{t['tier']} ({t['tokens']} tokens)" for t in e["tiers"]))
    if e["divergence"] is not None:
        console.print(f"diverges at token {e['divergence']}:")
        show = lambda pieces: " ".join(f"{p['id']}:{p['text']!r}" for p in pieces) or "(nothing)"  # noqa: E731
        console.print(f"  before     {show(e['before'])}")
        console.print(f"  prompt  -> [red]{show(e['prompt_side'])}[/red]")
        console.print(f"  cached  -> [green]{show(e['cached_side'])}[/green]")
    if "blocks" in e:
        console.print(f"kv_mode {e['kv_mode']} (blend_recompute {e['blend_recompute']:g}):")
        for i, b in enumerate(e["blocks"]):
            held = "held" if b["held"] else "not held"
            where = "".join(f", {t['tokens']} in {t['tier']}" for t in b.get("tiers", []))
            console.print(
                f"  block {i}: {b['length']} tokens at offset {b['offset']}, {held} "
                f"({b['device_tokens']} on the device{where}), "
                f"{b['reused_tokens']} would be reused: {b['note']}"
            )
    return 0


def _explain_payload(args: argparse.Namespace) -> dict:
    """The request: a plain prompt or a chat, with the `--block`s as KV blocks before the prompt."""
    if args.raw or args.decoder_prompt is not None:
        if args.block:
            blocks = [{"text": b, "block": True} for b in args.block]
            payload: dict = {"prompt_blocks": [*blocks, {"text": args.prompt}]}
        else:
            payload = {"prompt": args.prompt}
        if args.decoder_prompt is not None:
            payload["decoder_prompt"] = args.decoder_prompt
    else:
        system = [{"role": "system", "content": args.system}] if args.system else []
        content: str | list[dict] = args.prompt
        if args.block:
            blocks = [{"type": "text", "text": b, "kvblocks_block": True} for b in args.block]
            content = [*blocks, {"type": "text", "text": args.prompt}]
        payload = {"messages": [*system, {"role": "user", "content": content}]}
    payload["cache_salt"] = args.salt
    if args.kv_mode is not None:
        payload["kv_mode"] = args.kv_mode
    if args.blend_recompute is not None:
        payload["blend_recompute"] = args.blend_recompute
    return payload
