"""Speculative decoding with the prompt-lookup drafter and the trie drafter.

Shows: `SpeculativeGenerator` with two drafters that need no second model.
- `PromptLookupDrafter` copies what followed the last earlier occurrence of the current n-gram,
  which pays off when the reply repeats the prompt (quoting, editing, extracting).
- `TrieDrafter` proposes what the prefix cache already holds after the current text, which pays
  off when a request is repeated or retried: here the same request runs a second time.
Every round prints the drafts the target accepted (+), the ones it rejected (-) and the token the
target chose itself (=). Greedy output equals plain greedy decoding token for token; the program
checks it against a `CachedGenerator` without any cache.

Run (default model SmolLM2-135M-Instruct; --model PATH for a local folder):

    python examples/speculative_decoding.py
    python examples/speculative_decoding.py --max-tokens 8 --gamma 3     # quick

Output (abbreviated):

    plain greedy: 48 tokens in 2.7 s: 'The quick brown fox jumps over lazy dog. Pack my box with five dozen l'
    -- lookup drafter (gamma 4)
    round  1: - '<|im_start|>assistant\\n'  = 'The'
    round  2: + ' quick brown fox jumps'  = ' over'
    round  3: - ' the lazy dog.'  = ' lazy'
    round  4: + ' dog. Pack my'  = ' box'
    ...
    round  8: + ' jump'  - '! Sphinx of'  = '.'
    ...
    lookup: 27 rounds, 72 drafted, 21 accepted, 51 rejected (alpha 0.60, 1.78 tokens per target call) in 2.4 s
    lookup: same tokens as plain greedy: yes
    -- trie drafter (gamma 4), the same request again
    round  1: + 'The quick brown fox'  = ' jumps'
    round  2: + ' over lazy dog.'  = ' Pack'
    ...
    trie: 10 rounds, 38 drafted, 38 accepted, 0 rejected (alpha 1.00, 4.80 tokens per target call) in 1.0 s
    trie: same tokens as plain greedy: yes
"""

from __future__ import annotations

import argparse

import torch

import kvblocks
from kvblocks import models
from kvblocks.specdec import PromptLookupDrafter, Round, SpeculativeGenerator, TrieDrafter

TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow."
)
MESSAGES = [
    {"role": "system", "content": "You copy text exactly as it is given, with no comment."},
    {"role": "user", "content": f"Copy this text:\n{TEXT}"},
]


class RoundPrinter:
    """`on_round` callback: one line per draft/verify round."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.count = 0

    def __call__(self, rnd: Round) -> None:
        self.count += 1
        n = rnd.accepted
        parts = []
        if n:
            parts.append(f"+ {self.tokenizer.decode(rnd.drafts[:n])!r}")
        if n < len(rnd.drafts):
            parts.append(f"- {self.tokenizer.decode(rnd.drafts[n:])!r}")
        parts.append(f"= {self.tokenizer.decode([rnd.token])!r}")
        print(f"round {self.count:2d}: " + "  ".join(parts), flush=True)


def speculate(
    name: str, sg: SpeculativeGenerator, printer: RoundPrinter, reference: list[int], max_tokens: int
):
    printer.count = 0
    r = sg.generate(MESSAGES, max_new_tokens=max_tokens, temperature=0.0)
    s = r.spec
    print(
        f"{name}: {s.rounds} rounds, {s.drafted} drafted, {s.accepted} accepted, "
        f"{s.drafted - s.accepted} rejected (alpha {s.alpha:.2f}, {s.tokens_per_call:.2f} tokens per "
        f"target call) in {r.total_s:.1f} s"
    )
    print(f"{name}: same tokens as plain greedy: {'yes' if r.token_ids == reference else 'NO'}")
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local model folder (default SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens to generate")
    parser.add_argument("--gamma", type=int, default=4, help="drafts per round")
    args = parser.parse_args()
    torch.set_num_threads(1)

    model, tokenizer = models.load(args.model)
    plain = kvblocks.CachedGenerator(model, tokenizer, None)  # no cache, no drafts: the reference
    ref = plain.generate(MESSAGES, max_new_tokens=args.max_tokens, temperature=0.0)
    print(f"plain greedy: {len(ref.token_ids)} tokens in {ref.total_s:.1f} s: {ref.text.strip()[:70]!r}")

    cache = kvblocks.KVCacheTrie.for_model(model, capacity_tokens=4096)
    printer = RoundPrinter(tokenizer)

    print(f"-- lookup drafter (gamma {args.gamma})")
    lookup = SpeculativeGenerator(
        model, tokenizer, cache, drafter=PromptLookupDrafter(max_ngram=3), gamma=args.gamma, on_round=printer
    )
    speculate("lookup", lookup, printer, ref.token_ids, args.max_tokens)

    # The first run left prompt and reply in the cache, so the trie drafter proposes the reply.
    print(f"-- trie drafter (gamma {args.gamma}), the same request again")
    trie = SpeculativeGenerator(
        model, tokenizer, cache, drafter=TrieDrafter(cache), gamma=args.gamma, on_round=printer
    )
    speculate("trie", trie, printer, ref.token_ids, args.max_tokens)


if __name__ == "__main__":
    main()
