"""Drafters from a one-word spec, as the CLI and the server take them: PATH, self:K, lookup[:N], trie."""

from __future__ import annotations

from kvblocks import models
from kvblocks.adapters.hf_trie import KVCacheTrie

from .drafters import Drafter, ModelDrafter, PromptLookupDrafter, TrieDrafter, truncated_model

DRAFT_KINDS = "a model path, self:K, lookup[:N] or trie"


class DraftSpecError(ValueError):
    """The --draft value names no drafter kvblocks can build."""


def build_drafter(
    spec: str, model, cache: KVCacheTrie | None, capacity: dict, dtype: str, device: str
) -> Drafter:
    """`capacity` is KVCacheTrie.for_model's capacity keywords, for a model drafter's own cache."""
    kind, _, arg = spec.partition(":")
    if kind == "lookup":
        if arg and not arg.isdigit():
            raise DraftSpecError(f"lookup takes an n-gram size, as in lookup:3; got '{spec}'")
        return PromptLookupDrafter(max_ngram=int(arg or 3))
    if kind == "trie" and not arg:
        if cache is None:
            raise DraftSpecError("the trie drafter needs the prefix cache")
        return TrieDrafter(cache)
    if kind == "self":
        if not arg.isdigit():
            raise DraftSpecError(f"self takes a layer count, as in self:8; got '{spec}'")
        try:
            draft = truncated_model(model, int(arg))
        except ValueError as exc:
            raise DraftSpecError(str(exc)) from exc
    else:
        try:
            draft, _ = models.load(spec, dtype, device)
        except models.ModelLoadError as exc:
            raise DraftSpecError(f"{exc} (--draft takes {DRAFT_KINDS})") from exc
        if draft.config.get_text_config().vocab_size < model.config.get_text_config().vocab_size // 2:
            raise DraftSpecError("the draft model's vocabulary does not match the target's tokenizer")
    try:
        return ModelDrafter(draft, KVCacheTrie.for_model(draft, **capacity))
    except ValueError as exc:  # a drafter kvblocks cannot cache or roll back (UnsupportedModelError)
        raise DraftSpecError(str(exc)) from exc
