"""`kvblocks generate`: prompts run in order against one shared cache, with an optional drafter."""

from __future__ import annotations

import argparse
import json
import sys

from kvblocks.cli.args import add_draft_args, add_model_args
from kvblocks.cli.build import build_generator, load_stack, plain_generator, quantized_dtype
from kvblocks.errors import UserError


def generation_request(args: argparse.Namespace, prompt: str, encoder_decoder: bool):
    """What `generate` sends: an encoder-decoder model reads the prompt as its source (with
    --decoder-prompt as the reply's prefix); a decoder-only one reads it raw or as a chat turn."""
    if not encoder_decoder:
        if args.decoder_prompt is not None:
            raise UserError("--decoder-prompt is for encoder-decoder models; this one is decoder-only")
        return prompt if args.raw else _messages(args.system, prompt)
    if args.system is not None:
        raise UserError("--system: an encoder-decoder model has no chat template; the prompt is its source")
    from kvblocks.seq2seq import Seq2SeqPrompt

    return Seq2SeqPrompt(prompt, args.decoder_prompt or "")


def cmd_generate(args: argparse.Namespace) -> int:
    from kvblocks import PromptError

    quantized_dtype(args)
    if args.dtype == "auto":  # one request per forward: a half dtype rounds by the shapes a hit leaves
        args.dtype = "float32"
    model, tokenizer, cache = load_stack(args)
    encoder_decoder = getattr(model.config, "is_encoder_decoder", False)
    show = DraftPainter(tokenizer) if args.show_drafts and args.draft else None
    gen = build_generator(args, model, tokenizer, cache, on_round=show)
    prompts = list(args.prompt)
    if not prompts:
        if sys.stdin.isatty():
            raise UserError("give a prompt as an argument or on stdin")
        prompts = [sys.stdin.read()]
    for prompt in prompts:
        request = generation_request(args, prompt, encoder_decoder)
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
                if show is None:
                    sys.stdout.write(piece.text)
                    sys.stdout.flush()
                result = piece.result
        except (PromptError, ValueError) as exc:
            raise UserError(str(exc)) from exc
        sys.stdout.write("\n")
        if result.spec is not None:
            baseline = plain_generator(model, tokenizer, cache).generate(
                request, max_new_tokens=len(result.token_ids), temperature=args.temperature, seed=args.seed
            )
            print(_spec_line(result, baseline), file=sys.stderr)
        summary = {
            "prompt_tokens": result.prompt_tokens,
            "cached_tokens": result.cached_tokens,
            "completion_tokens": len(result.token_ids),
            "ttft_ms": round(result.ttft_s * 1e3, 1),
            "total_ms": round(result.total_s * 1e3, 1),
            "finish_reason": result.finish_reason,
        }
        if encoder_decoder:
            summary |= {"source_tokens": result.encoder_tokens, "source_cached": result.encoder_cached_tokens}
        print(json.dumps(summary) if args.json else _summary_line(summary), file=sys.stderr)
    return 0


def _decode_rate(r) -> float:
    """Tokens/s after the first token (prefill excluded, so cached and uncached runs compare)."""
    span = r.total_s - r.ttft_s
    return (len(r.token_ids) - 1) / span if span > 0 and len(r.token_ids) > 1 else 0.0


def _spec_line(r, baseline) -> str:
    s = r.spec
    fast, slow = _decode_rate(r), _decode_rate(baseline)
    ratio = f"{fast / slow:.2f}x" if slow else "n/a"
    return (
        f"[speculative: {s.rounds} rounds, {s.drafted} drafted, {s.accepted} accepted, alpha {s.alpha:.3f}, "
        f"{s.tokens_per_call:.2f} tokens/target call, draft efficiency {s.draft_efficiency:.3f}; "
        f"decode {fast:.1f} tok/s vs target-only {slow:.1f} tok/s ({ratio})]"
    )


class DraftPainter:
    """--show-drafts: accepted drafts green, rejected drafts red and struck through, the target's
    own token (correction or bonus) yellow."""

    GREEN, RED, YELLOW, RESET = "\x1b[32m", "\x1b[9;31m", "\x1b[1;33m", "\x1b[0m"

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, rnd) -> None:
        piece = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
        n = rnd.accepted
        out = self.GREEN + piece(rnd.drafts[:n]) + self.RESET
        if n < len(rnd.drafts):
            out += self.RED + piece(rnd.drafts[n:]) + self.RESET
        out += self.YELLOW + piece([rnd.token]) + self.RESET
        sys.stdout.write(out)
        sys.stdout.flush()


def _messages(system: str | None, prompt: str) -> list[dict]:
    msgs = [{"role": "system", "content": system}] if system else []
    return [*msgs, {"role": "user", "content": prompt}]


def _source_part(s: dict) -> str:
    if "source_tokens" not in s:
        return ""
    held = "held" if s["source_cached"] else "encoded"
    return f"source of {s['source_tokens']} tokens {held}; decoder: "


def _summary_line(s: dict) -> str:
    return (
        f"[{_source_part(s)}{s['prompt_tokens']} prompt tokens, {s['cached_tokens']} cached, "
        f"{s['completion_tokens']} generated; "
        f"ttft {s['ttft_ms']} ms, total {s['total_ms']} ms, {s['finish_reason']}]"
    )


def add_generate_parser(sub) -> None:
    g = sub.add_parser(
        "generate", help="generate text with prefix reuse", description="Generate text with prefix reuse."
    )
    g.add_argument("prompt", nargs="*", help="one or more prompts, run in order against one shared cache")
    add_model_args(g)
    g.add_argument("--system", default=None, help="system message (chat prompts)")
    g.add_argument(
        "--decoder-prompt",
        default=None,
        help="an encoder-decoder model's decoder prefix (the prompt is then its source)",
    )
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
    add_draft_args(g)
    g.add_argument(
        "--show-drafts",
        action="store_true",
        help="colour accepted drafts (green), rejected drafts (red) and the target's own tokens (yellow)",
    )
    g.set_defaults(func=cmd_generate)
