"""`kvblocks` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


class UserError(Exception):
    """Bad input or environment: printed as one line, exit status 2, no traceback."""


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="local transformers model path or hub id (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16, float16 or float64")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0 (default: cpu)")
    p.add_argument(
        "--capacity",
        default="1GiB",
        help="device KV pool size: tokens (e.g. 200000) or bytes with a unit (e.g. 512MiB, 2GiB); default 1GiB",
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")


def parse_capacity(text: str) -> dict[str, int]:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    t = text.strip().lower()
    for unit, scale in units.items():
        if t.endswith(unit):
            number = t[: -len(unit)].strip()
            try:
                return {"capacity_bytes": int(float(number) * scale)}
            except ValueError:
                break
    if t.isdigit() and int(t) > 0:
        return {"capacity_tokens": int(t)}
    raise UserError(f"--capacity must be a token count or a size like 512MiB, got '{text}'")


def load_stack(args: argparse.Namespace):
    """(model, tokenizer, cache) from the common model arguments."""
    from kvblocks import KVCacheTrie, UnsupportedModelError, models

    torch.set_num_threads(max(1, args.threads))
    capacity = parse_capacity(args.capacity)
    try:
        model, tokenizer = models.load(args.model, args.dtype, args.device)
        cache = KVCacheTrie.for_model(model, **capacity)
    except (models.ModelLoadError, UnsupportedModelError) as exc:
        raise UserError(str(exc)) from exc
    return model, tokenizer, cache


def cmd_generate(args: argparse.Namespace) -> int:
    from kvblocks import CachedGenerator, PromptError

    model, tokenizer, cache = load_stack(args)
    gen = CachedGenerator(model, tokenizer, cache)
    prompts = list(args.prompt)
    if not prompts:
        if sys.stdin.isatty():
            raise UserError("give a prompt as an argument or on stdin")
        prompts = [sys.stdin.read()]
    for prompt in prompts:
        request = prompt if args.raw else _messages(args.system, prompt)
        try:
            stream = gen.stream(
                request,
                max_new_tokens=args.max_new_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                stop=args.stop,
                seed=args.seed,
            )
            result = None
            for piece in stream:
                sys.stdout.write(piece.text)
                sys.stdout.flush()
                result = piece.result
        except (PromptError, ValueError) as exc:
            raise UserError(str(exc)) from exc
        sys.stdout.write("\n")
        summary = {
            "prompt_tokens": result.prompt_tokens,
            "cached_tokens": result.cached_tokens,
            "completion_tokens": len(result.token_ids),
            "ttft_ms": round(result.ttft_s * 1e3, 1),
            "total_ms": round(result.total_s * 1e3, 1),
            "finish_reason": result.finish_reason,
        }
        print(json.dumps(summary) if args.json else _summary_line(summary), file=sys.stderr)
    return 0


def _messages(system: str | None, prompt: str) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    return [*msgs, {"role": "user", "content": prompt}]


def _summary_line(s: dict) -> str:
    return (
        f"[{s['prompt_tokens']} prompt tokens, {s['cached_tokens']} cached, {s['completion_tokens']} generated; "
        f"ttft {s['ttft_ms']} ms, total {s['total_ms']} ms, {s['finish_reason']}]"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvblocks", description="Exact prefix-sharing KV cache for transformers"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser(
        "generate", help="generate text with prefix reuse", description="Generate text with prefix reuse."
    )
    g.add_argument("prompt", nargs="*", help="one or more prompts, run in order against one shared cache")
    add_model_args(g)
    g.add_argument("--system", default=None, help="system message (chat prompts)")
    g.add_argument(
        "--raw", action="store_true", help="send the prompt as plain text, without the chat template"
    )
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print the per-request summary as JSON on stderr")
    g.set_defaults(func=cmd_generate)

    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except UserError as exc:
        print(f"kvblocks: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
