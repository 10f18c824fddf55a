"""Drafters propose the next tokens; the target verifies them.

A drafter sees only committed tokens. Its own cache (if any) is private to the request until the
request ends, when only committed tokens go into its trie.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from kvblocks.adapters import hf
from kvblocks.generator import ModelRunner, context_length
from kvblocks.sampling import SamplingParams, distribution
from kvblocks.trie import Hit, KVCacheTrie, Salt


@dataclass(slots=True)
class Proposal:
    tokens: list[int]
    q: torch.Tensor | None  # [len(tokens), V] drafter probabilities; None for a point-mass drafter


class Drafter:
    """Interface: `begin` a request, `propose` each round, `rollback` to the committed length, `end`.

    Each request gets a shallow copy of the drafter, so per-request state must be (re)bound in
    `begin`, never mutated in place on shared objects.
    """

    def begin(self, prompt_ids: list[int], salt: Salt) -> None:
        return None

    def propose(
        self, committed: list[int], gamma: int, params: SamplingParams, rng: torch.Generator | None
    ) -> Proposal:
        raise NotImplementedError

    def rollback(self, length: int) -> None:
        """The first `length` committed tokens are final; forget anything drafted past them."""
        return None

    def end(self, committed: list[int]) -> None:
        return None


class ModelDrafter(Drafter):
    """A smaller model with the same tokenizer, with its own prefix cache (`draft_cache`)."""

    def __init__(self, draft_model, draft_cache: KVCacheTrie | None = None) -> None:
        self.model = draft_model
        self.cache = draft_cache
        self.runner = ModelRunner(draft_model)
        self.max_context = context_length(draft_model.config)
        self._hit: Hit | None = None
        self._past = None
        self._length = 0
        self._salt: Salt = None

    def begin(self, prompt_ids: list[int], salt: Salt) -> None:
        self._salt = salt
        if self.cache is not None:
            self._hit = self.cache.match(prompt_ids, salt=salt)
            self._past = self._hit.to_hf_cache()
            self._length = self._hit.length
        else:
            self._past = hf.empty_cache(self.model.config)
            self._length = 0

    def propose(
        self, committed: list[int], gamma: int, params: SamplingParams, rng: torch.Generator | None
    ) -> Proposal:
        if self.max_context is not None:
            gamma = min(gamma, self.max_context - len(committed) - 1)
        if gamma <= 0:
            return Proposal([], None)
        logits = self.runner.forward(committed[self._length :], self._past)[-1]
        self._length = len(committed)
        tokens, rows = [], []
        for i in range(gamma):
            q = distribution(logits, params)
            token = int(q.argmax()) if params.greedy else int(torch.multinomial(q, 1, generator=rng))
            tokens.append(token)
            rows.append(q)
            if i + 1 < gamma:
                logits = self.runner.forward([token], self._past)[-1]
                self._length += 1
        return Proposal(tokens, torch.stack(rows) if rows else None)

    def rollback(self, length: int) -> None:
        if self._length > length:
            hf.crop(self._past, length)
            self._length = length

    def end(self, committed: list[int]) -> None:
        try:
            if self.cache is not None and self._past is not None:
                self.cache.insert(committed[: self._length], self._past, salt=self._salt)
        finally:
            if self._hit is not None:
                self._hit.release()
            self._hit, self._past, self._length = None, None, 0


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

    def propose(
        self, committed: list[int], gamma: int, params: SamplingParams, rng: torch.Generator | None
    ) -> Proposal:
        n_total = len(committed)
        for n in range(min(self.max_ngram, n_total - 1), self.min_ngram - 1, -1):
            tail = committed[n_total - n :]
            for start in range(n_total - n - 1, -1, -1):
                if committed[start : start + n] == tail:
                    follow = committed[start + n : start + n + gamma]
                    return Proposal(list(follow), None)
        return Proposal([], None)


class TrieDrafter(Drafter):
    """Propose what the trie already holds after the current sequence (repeated or retried requests)."""

    def __init__(self, cache: KVCacheTrie) -> None:
        self.cache = cache
        self._salt: Salt = None

    def begin(self, prompt_ids: list[int], salt: Salt) -> None:
        self._salt = salt

    def propose(
        self, committed: list[int], gamma: int, params: SamplingParams, rng: torch.Generator | None
    ) -> Proposal:
        return Proposal(self.cache.continuation(committed, gamma, salt=self._salt), None)
