"""Why did a prompt miss? The longest cached match, where it diverges, and the reason.

Reasons, checked in this order:
- `prompt_logprobs`: the request asks for prompt log-probabilities, so its prompt is recomputed;
- `cached`: everything but the last token is cached (the last one is always recomputed);
- `no_state_snapshot`: a recurrent or hybrid model holds more of the prompt than it can serve: no
  state snapshot at the divergence point (or at the prompt's last-but-one token), so the hit stops
  at the last snapshot before it (serving the prompt snapshots that point for the next request);
- `evicted`: the cache held a longer prefix of this prompt once and evicted it;
- `namespace_mismatch`: another namespace of the caller's tenant (another cache salt) holds a longer
  prefix (an admin's explain counts every tenant);
- `tokenization_boundary`: the cache continues with different ids that spell the same text (a
  prefix tokenised alone, e.g. a system prompt ending in a space, then reused inside a longer text);
- `never_seen`: nothing cached continues this prompt.

`tiers` says where the prompt's cached prefix would come from: `device` for what the pool holds,
then each spill tier (`host`, `disk`, `redis`) holding the chunks that continue it, as far as their
record sizes show (nothing is read or verified: a record that fails verification is still a miss).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from kvblocks.cache.trie import PrefixCache, Salt

# one token of a prompt or of the cache's continuation: {"position", "id", "text"}
Piece = dict[str, Any]


class Decoder(Protocol):
    """The part of a tokenizer `explain` uses."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


LEDGER_GRANULARITY = 16


class EvictionLedger:
    """Bounded memory of evicted prefixes: 64-bit hashes of (namespace, ids[:p]) at every 16th
    position, in a ring buffer (8 bytes each, no Python object per entry).

    Only used to explain misses; it never serves KV.
    """

    def __init__(self, capacity: int = 1 << 17) -> None:
        self._ring = np.zeros(capacity, dtype=np.uint64)
        self._next = 0
        self._filled = 0

    def record(self, namespace_key: str, ids: np.ndarray, evicted_from: int) -> None:
        for digest in _checkpoint_hashes(namespace_key, ids, first=evicted_from + 1):
            self._ring[self._next] = digest
            self._next = (self._next + 1) % len(self._ring)
            self._filled = min(self._filled + 1, len(self._ring))

    def longest_evicted(self, namespace_key: str, ids: np.ndarray, after: int) -> int:
        """Longest checkpoint p > `after` whose prefix ids[:p] was evicted (0 if none)."""
        points = _checkpoints(len(ids), after + 1)
        if not points or not self._filled:
            return 0
        query = np.array(_checkpoint_hashes(namespace_key, ids, after + 1), dtype=np.uint64)
        seen = np.isin(query, self._ring[: self._filled])
        return points[int(np.flatnonzero(seen)[-1])] if seen.any() else 0


def _checkpoints(length: int, first: int) -> list[int]:
    g = LEDGER_GRANULARITY
    return list(range(max(g, -(-first // g) * g), length + 1, g))


def _checkpoint_hashes(namespace_key: str, ids: np.ndarray, first: int) -> list[int]:
    data = np.ascontiguousarray(ids, dtype="<i4")
    h = hashlib.blake2b(namespace_key.encode(), digest_size=8)
    out, done = [], 0
    for p in _checkpoints(len(data), first):
        h.update(data[done:p].tobytes())
        done = p
        out.append(int.from_bytes(h.copy().digest(), "little"))
    return out


@dataclass(slots=True)
class Explanation:
    reason: str
    prompt_tokens: int
    cached_tokens: int
    divergence: int | None
    detail: str
    prompt_side: list[Piece]
    cached_side: list[Piece]
    before: list[Piece]
    tiers: list[dict[str, Any]] = field(
        default_factory=list
    )  # [{"tier": "device" | spill tier, "tokens": n}]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pieces(tokenizer: Decoder, ids: list[int], start: int) -> list[Piece]:
    return [
        {"position": start + i, "id": int(t), "text": tokenizer.decode([int(t)], skip_special_tokens=False)}
        for i, t in enumerate(ids)
    ]


def explain(
    cache: PrefixCache,
    tokenizer: Decoder,
    ids: list[int],
    *,
    salt: Salt = None,
    all_tenants: bool = False,
    prompt_logprobs: bool = False,
    window: int = 8,
) -> Explanation:
    """Explain how much of `ids` the cache holds, which tier each part would come from, and why the
    rest missed.

    `salt` is the request's cache salt or `Scope`. Only namespaces of the request's own tenant
    count as "another namespace" unless `all_tenants` (an admin asks): for a tenant the answer
    is the same whether or not other tenants hold the prompt. With `prompt_logprobs` (the request
    asks for prompt log-probabilities, e.g. completions with echo and logprobs) nothing is reused.
    """
    arr = np.asarray(ids, dtype=np.int32)
    matched = cache.cached_length(arr, salt=salt)
    explained = _explain(cache, tokenizer, ids, arr, matched, salt, all_tenants, prompt_logprobs, window)
    explained.tiers = _tiers(cache, arr, salt, matched, prompt_logprobs)
    return explained


def _tiers(
    cache: PrefixCache, arr: np.ndarray, salt: Salt, matched: int, prompt_logprobs: bool
) -> list[dict[str, Any]]:
    """The device's share of the cached prefix, then each spill tier's, in the order a lookup asks."""
    n = len(arr)
    usable = min(matched, max(n - 1, 0))
    out: list[dict[str, Any]] = [{"tier": "device", "tokens": usable}] if usable else []
    spill = getattr(cache, "spill", None)
    if spill is None or prompt_logprobs or not hasattr(spill, "locate") or usable >= n - 1:
        return out
    _, ns = cache.key_of(arr, salt)
    return out + [{"tier": t, "tokens": k} for t, k in spill.locate(ns.key, arr, matched, n - 1)]


def _explain(
    cache: PrefixCache, tokenizer: Decoder, ids: list[int], arr: np.ndarray, matched: int, salt: Salt,
    all_tenants: bool, prompt_logprobs: bool, window: int,
) -> Explanation:  # fmt: skip
    n = len(arr)
    usable = min(matched, max(n - 1, 0))
    before = _pieces(tokenizer, ids[max(0, matched - window) : matched], max(0, matched - window))
    if prompt_logprobs:
        detail = (
            "the request asks for prompt logprobs, which need logits at every prompt position: its "
            f"prompt is computed in full ({matched} tokens were cached) and stored for later requests"
        )
        return Explanation("prompt_logprobs", n, 0, None, detail, [], [], before)
    servable = cache.cached_length(arr[: max(n - 1, 0)], salt=salt, servable=True)
    if servable < usable:
        point = "the prompt's last-but-one token" if usable == n - 1 else f"the divergence point ({usable})"
        detail = (
            f"no state snapshot at the divergence point: {usable} tokens are cached, but the recurrent "
            f"state is kept only up to {servable}; serving this prompt snapshots {point} for the next request"
        )
        return Explanation(
            "no_state_snapshot",
            n,
            servable,
            usable,
            detail,
            _pieces(tokenizer, ids[usable : usable + window], usable),
            [],
            before,
        )
    if matched >= n - 1:
        return Explanation(
            "cached", n, usable, None, "every prompt token but the last is cached", [], [], before
        )
    prompt_side = _pieces(tokenizer, ids[matched : matched + window], matched)
    cached_next = cache.continuation(arr[:matched], window, salt=salt)
    cached_side = _pieces(tokenizer, cached_next, matched)
    reason, detail = _why_diverged(cache, tokenizer, ids, matched, cached_next, salt, all_tenants)
    return Explanation(reason, n, usable, matched, detail, prompt_side, cached_side, before)


def _why_diverged(
    cache: PrefixCache,
    tokenizer: Decoder,
    ids: list[int],
    matched: int,
    cached_next: list[int],
    salt: Salt,
    all_tenants: bool,
) -> tuple[str, str]:
    """The reason (and its wording) why the cache's match of `ids` stops at `matched`."""
    arr, ns = cache.key_of(ids, salt)
    evicted = cache.reports.evicted_length(ns.key, arr, matched)
    best_other = max(cache.reports.other_namespace_lengths(ns, arr, all_tenants).values(), default=0)
    if evicted > matched:
        return "evicted", f"the first {evicted} tokens were cached before and evicted"
    if best_other > matched:
        return (
            "namespace_mismatch",
            f"another namespace (another cache_salt) holds {best_other} tokens of this prompt",
        )
    if cached_next and _same_text(tokenizer, ids[matched:], cached_next):
        return (
            "tokenization_boundary",
            "the cache continues with different token ids for the same text: the prefix was tokenised "
            "apart from what follows it; send token ids, or tokenise the whole prompt",
        )
    if matched == 0:
        return "never_seen", "nothing cached continues this prompt"
    return "never_seen", f"the cache holds the first {matched} tokens; the prompt goes on differently"


def _same_text(tokenizer: Decoder, prompt_tail: list[int], cached_tail: list[int]) -> bool:
    """Whether the cache spells the prompt's next text with other ids: its leading tokens spell a
    prefix of the prompt's text (what it holds after them, e.g. a cached reply, may differ), or
    the prompt's remaining text is a prefix of the cached text."""
    prompt_text = tokenizer.decode(prompt_tail[:8], skip_special_tokens=False)
    cached = [tokenizer.decode(cached_tail[:j], skip_special_tokens=False) for j in range(1, 9)]
    return bool(prompt_text) and (
        cached[-1].startswith(prompt_text) or any(t and prompt_text.startswith(t) for t in cached)
    )
