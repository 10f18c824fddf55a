"""Drafters propose the next tokens; the target verifies them.

A drafter sees only committed tokens. Its own cache (if any) is private to the request until the
request ends, when only committed tokens go into its trie.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvblocks.adapters import hf
from kvblocks.adapters.hf_trie import KVCacheTrie
from kvblocks.cache.trie import Hit, Salt
from kvblocks.generate.decoding import context_room
from kvblocks.generate.generator import ModelRunner, context_length
from kvblocks.generate.sampling import SamplingParams, distribution

from .tree import DraftTree, depth_first, grow, merge


@dataclass(slots=True)
class Proposal:
    tokens: list[int]
    q: torch.Tensor | None  # [len(tokens), V] drafter probabilities; None for a point-mass drafter


class DraftSession:
    """One request's drafting state, from `Drafter.start` to `end`: `propose` each round, `rollback` to
    the committed length after verification. Nothing in it is shared with another request."""

    def propose(
        self, committed: list[int], gamma: int, params: SamplingParams, rng: torch.Generator | None
    ) -> Proposal:
        raise NotImplementedError

    def propose_tree(
        self,
        committed: list[int],
        budget: int,
        depth: int,
        width: int,
        params: SamplingParams,
        rng: torch.Generator | None,
    ) -> DraftTree:
        """A tree of at most `budget` nodes, `depth` levels and `width` children per node; a drafter
        with one continuation proposes it as a chain (the default)."""
        proposal = self.propose(committed, min(depth, budget), params, rng)
        return DraftTree.chain(proposal.tokens, proposal.q)

    def rollback(self, length: int) -> None:
        """The first `length` committed tokens are final; forget anything drafted past them."""
        return None

    def end(self, committed: list[int]) -> None:
        return None


class Drafter:
    """Shared by every request (and thread) of a generator: what it holds is read-only configuration
    and shared caches; `start` makes the request's own `DraftSession`."""

    def start(self, prompt_ids: list[int], salt: Salt) -> DraftSession:
        raise NotImplementedError


@dataclass(slots=True)
class PointMassSession(DraftSession):
    """A drafter without a model or state of its own: `draft(committed, gamma)` returns the tokens."""

    draft: Callable[[list[int], int], list[int]]
    # (committed, budget, depth, width) -> a point-mass tree; None: the chain of `draft`
    branches: Callable[[list[int], int, int, int], DraftTree] | None = None
    # (committed, budget, depth, width, sure, ends) -> a scored tree grown best first (`tree.grow`),
    # `sure` the chance that the target continues as the source did; None: `branches`
    scored: Callable[[list[int], int, int, int, float, frozenset[int]], DraftTree] | None = None

    def propose(
        self, committed: list[int], gamma: int, params: SamplingParams, rng: torch.Generator | None
    ) -> Proposal:
        return Proposal(self.draft(committed, gamma), None)

    def propose_tree(self, committed, budget, depth, width, params, rng) -> DraftTree:
        if self.branches is None or width <= 1:
            return DraftTree.chain(self.draft(committed, min(depth, budget)))
        return self.branches(committed, budget, depth, width)

    def grow_tree(self, committed, budget, depth, width, sure, ends=frozenset()) -> DraftTree | None:
        """A scored tree (`tree.grow`, nothing below a token of `ends`), or None where this drafter
        scores none."""
        if self.scored is None:
            return None
        return self.scored(committed, budget, depth, width, sure, ends)


class ModelDrafter(Drafter):
    """A smaller model with the same tokenizer, with its own prefix cache (`draft_cache`)."""

    def __init__(self, draft_model, draft_cache: KVCacheTrie | None = None) -> None:
        if (draft_cache.state if draft_cache is not None else hf.describe(draft_model)[1]) is not None:
            raise hf.UnsupportedModelError(
                f"draft model type '{draft_model.config.model_type}' keeps recurrent state, which a "
                "drafter rolls back after every rejection; use an attention-only drafter (a hybrid "
                "target is fine)"
            )
        self.model = draft_model
        self.cache = draft_cache
        self.runner = ModelRunner(draft_model)
        self.max_context = context_length(draft_model.config)

    def start(self, prompt_ids: list[int], salt: Salt) -> ModelDraftSession:
        return ModelDraftSession(self, prompt_ids, salt)


class ModelDraftSession(DraftSession):
    """The draft model's cache for one request: re-attached from the draft trie, grown by proposals,
    cropped on rollback, and inserted (committed tokens only) at the end."""

    def __init__(self, drafter: ModelDrafter, prompt_ids: list[int], salt: Salt) -> None:
        self.drafter = drafter
        self.salt = salt
        self.hit: Hit | None = None
        if drafter.cache is not None:
            self.hit = drafter.cache.match_or_miss(prompt_ids, salt=salt)
            self.past = self.hit.to_hf_cache()
            self.length = self.hit.length
        else:
            self.past = hf.empty_cache(drafter.model.config)
            self.length = 0

    def propose(
        self, committed: list[int], gamma: int, params: SamplingParams, rng: torch.Generator | None
    ) -> Proposal:
        runner, max_context = self.drafter.runner, self.drafter.max_context
        gamma = min(gamma, context_room(max_context, len(committed) + 1))
        if gamma <= 0:
            return Proposal([], None)
        logits = runner.forward(committed[self.length :], self.past)[-1]
        self.length = len(committed)
        tokens, rows = [], []
        for i in range(gamma):
            q = distribution(logits, params)
            token = int(q.argmax()) if params.greedy else int(torch.multinomial(q, 1, generator=rng))
            tokens.append(token)
            rows.append(q)
            if i + 1 < gamma:
                logits = runner.forward([token], self.past)[-1]
                self.length += 1
        return Proposal(tokens, torch.stack(rows) if rows else None)

    def propose_tree(self, committed, budget, depth, width, params, rng) -> DraftTree:
        """The drafter's chain of `depth` tokens, and at each level up to `width - 1` more children
        of the chain's node above, drawn from the same distribution row (no more drafter forwards):
        greedy, the next most likely tokens; sampling, more i.i.d. draws, so that every node's
        siblings are i.i.d. samples of q at their parent as multi-draft rejection sampling needs.
        Shallow levels first until `budget`."""
        proposal = self.propose(committed, min(depth, budget), params, rng)
        chain, q = proposal.tokens, proposal.q
        if q is None or width <= 1 or len(chain) >= budget:
            return DraftTree.chain(chain, None if params.greedy else q)
        tokens, parents, rows = list(chain), list(range(-1, len(chain) - 1)), list(range(len(chain)))
        for level in range(len(chain)):
            if params.greedy:
                top = torch.topk(q[level], min(width, q.shape[-1])).indices.tolist()
                extra = [t for t in top if t != chain[level]][: width - 1]
            else:
                extra = torch.multinomial(q[level], width - 1, replacement=True, generator=rng).tolist()
            for t in extra[: budget - len(tokens)]:
                tokens.append(int(t))
                parents.append(level - 1)
                rows.append(level)
        return depth_first(tokens, parents, None if params.greedy else q[rows], not params.greedy)

    def rollback(self, length: int) -> None:
        if self.length > length:
            self.drafter.runner.crop(self.past, length)
            self.length = length

    def end(self, committed: list[int]) -> None:
        try:
            if self.drafter.cache is not None and self.past is not None:
                self.drafter.cache.insert(committed[: self.length], self.past, salt=self.salt)
        finally:
            if self.hit is not None:
                self.hit.release()
            self.hit, self.past, self.length = None, None, 0


def truncated_model(model, layers: int):
    """The target's first `layers` decoder layers + its final norm and head, sharing weights.

    A cheap self-drafter: no second checkpoint, no extra weight memory.
    """
    found = [
        (name, module)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and len(module) == model.config.num_hidden_layers
    ]
    if not found:
        raise ValueError(f"cannot find the decoder layers of a '{model.config.model_type}' model")
    path, stack = found[0]
    if not 0 < layers < len(stack):
        raise ValueError(f"self-drafter layers must be in 1..{len(stack) - 1}, got {layers}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:layers]
    # Copy only the modules on the path to the layer list; the layers themselves stay shared.
    draft = copy.copy(model)
    draft._modules = dict(model._modules)
    draft.config = config
    parent = draft
    names = path.split(".")
    for name in names[:-1]:
        child = copy.copy(getattr(parent, name))
        child._modules = dict(child._modules)
        if getattr(child, "config", None) is model.config:
            child.config = config
        parent._modules[name] = child
        parent = child
    parent._modules[names[-1]] = torch.nn.ModuleList(list(stack)[:layers])
    return draft


class PromptLookupDrafter(Drafter):
    """Copy what followed the last earlier occurrence of the current n-gram (no model).

    A point-mass drafter: in sampling mode a draft is accepted iff the target's own sample equals
    it, so the output distribution is exactly the target's.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, prompt_ids: list[int], salt: Salt) -> PointMassSession:
        source = getattr(getattr(salt, "source", None), "ids", ())  # a seq2seq request's source
        index = NgramIndex(self.min_ngram, self.max_ngram, source)
        return PointMassSession(
            lambda committed, gamma: self.lookup(committed, gamma, source),
            lambda committed, budget, depth, width: merge(
                self.lookups(committed, depth, width, source), budget
            ),
            lambda committed, budget, depth, width, sure, ends: grow(
                index.expander(committed, sure), budget, depth, width, ends
            ),
        )

    def lookups(
        self, committed: list[int], depth: int, width: int, source: Sequence[int] = ()
    ) -> list[list[int]]:
        """Up to `width` different continuations of the current n-gram's earlier occurrences,
        longest n-gram first, then latest occurrence first (the first is `lookup`'s)."""
        n_total, found = len(committed), []
        for n in range(min(self.max_ngram, n_total - 1), self.min_ngram - 1, -1):
            tail = committed[n_total - n :]
            for text, end in ((committed, n_total - n - 1), (source, len(source) - n - 1)):
                for start in range(end, -1, -1):
                    if list(text[start : start + n]) == tail:
                        follow = list(text[start + n : start + n + depth])
                        if follow and follow not in found:
                            found.append(follow)
                            if len(found) >= width:
                                return found
        return found

    def lookup(self, committed: list[int], gamma: int, source: Sequence[int] = ()) -> list[int]:
        """What followed the current n-gram's last earlier occurrence in `committed`, else in the
        seq2seq `source` (a summary or translation copies from it)."""
        n_total = len(committed)
        for n in range(min(self.max_ngram, n_total - 1), self.min_ngram - 1, -1):
            tail = committed[n_total - n :]
            for start in range(n_total - n - 1, -1, -1):
                if committed[start : start + n] == tail:
                    return list(committed[start + n : start + n + gamma])
            for start in range(len(source) - n - 1, -1, -1):
                if list(source[start : start + n]) == tail:
                    return list(source[start + n : start + n + gamma])
        return []


class TrieDrafter(Drafter):
    """Propose what the trie already holds after the current sequence (repeated or retried requests):
    one chain, the most recently used branch at each fork; as a tree, every branch it holds there,
    the most often taken first (`PrefixCache.continuations`)."""

    def __init__(self, cache: KVCacheTrie) -> None:
        self.cache = cache

    def start(self, prompt_ids: list[int], salt: Salt) -> PointMassSession:
        return PointMassSession(
            lambda committed, gamma: self.cache.continuation(committed, gamma, salt=salt),
            lambda committed, budget, depth, width: DraftTree(
                *self.cache.continuations(committed, budget, depth, width, salt=salt)
            ),
        )


class NgramIndex:
    """Where every n-gram (`min_n..max_n` tokens) of a request's committed tokens and of its
    seq2seq source ended, kept up to date as the committed tokens grow (rebuilt if they are ever
    not an extension of what it indexed): one lookup per tree node is a dict read, not a scan."""

    def __init__(self, min_n: int, max_n: int, source: Sequence[int] = ()) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.text: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}  # gram -> ends e (text[e] follows it)
        self.source = list(source)
        self.source_ends: dict[tuple[int, ...], list[int]] = {}
        self._add(self.source, self.source_ends, 0)

    def _add(self, text: list[int], ends: dict, first: int) -> None:
        """Index the grams followed by `text[e]` for every e from `first` on."""
        for e in range(max(first, 1), len(text)):
            for n in range(self.min_n, min(self.max_n, e) + 1):
                ends.setdefault(tuple(text[e - n : e]), []).append(e)

    def update(self, committed: list[int]) -> None:
        done = len(self.text)
        if len(committed) < done or committed[:done] != self.text:
            self.text, self.ends, done = [], {}, 0
        self.text.extend(committed[done:])
        self._add(self.text, self.ends, done)

    def following(self, tail: Sequence[int]) -> list[tuple[int, int]]:
        """(token, count) of what followed the longest n-gram at the end of `tail` that occurred
        before, the most frequent first, then the latest."""
        for n in range(min(self.max_n, len(tail)), self.min_n - 1, -1):
            gram = tuple(tail[len(tail) - n :])
            counts: dict[int, list[int]] = {}
            for text, ends in ((self.text, self.ends), (self.source, self.source_ends)):
                for rank, e in enumerate(reversed(ends.get(gram, ()))):
                    entry = counts.setdefault(text[e], [0, rank])
                    entry[0] += 1
            if counts:
                ranked = sorted(counts.items(), key=lambda kv: (-kv[1][0], kv[1][1]))
                return [(token, c) for token, (c, _) in ranked]
        return []

    def expander(self, committed: list[int], sure: float):
        """`tree.grow`'s `expand` after `committed`: a child's probability is `sure` (how often
        the target goes on as an earlier occurrence did) times its share of the occurrences."""
        self.update(committed)
        base = self.text[-self.max_n :]

        def expand(path: tuple[int, ...]) -> list[tuple[int, float]]:
            found = self.following((base + list(path))[-self.max_n :])
            total = sum(c for _, c in found)
            return [(t, sure * c / total) for t, c in found]

        return expand
