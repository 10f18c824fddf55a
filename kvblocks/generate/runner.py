"""One model as the generator sees it: its forward passes (`ModelRunner`), context window,
vocabulary and end-of-sequence ids."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvblocks.adapters import hf
from kvblocks.engine.head import scope

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


def context_length(config: PretrainedConfig) -> int | None:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def vocab_size(config: PretrainedConfig) -> int:
    """Token ids the model embeds (and logits it returns): `config.vocab_size` of the text model."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return int(text.vocab_size)


def eos_token_ids(model: PreTrainedModel, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(int(v) for v in value)
    return frozenset(ids)


class ModelRunner:
    """Forward passes for one model: one at a time, logits only for the positions asked for.

    `packed` runs the linear layers on their packed weights as the batched engine's `--packed-weights`
    does (`kvblocks.engine.head`: kvblocks' kernel or oneDNN's reordered layout, where a shape's probe
    holds; on a CPU only): `"all"` every layer, `"head"` the output head, `"none"` (default) neither.
    With `"all"` a forward of 2 to 16 rows costs little more than one of a single row (what a
    speculative round verifies), and a row's products come out the same whatever rows are beside it.
    The bound: a copy of the packed weights (their size once more), made once per model and shared
    with the batched engine's."""

    def __init__(self, model: PreTrainedModel, *, packed: str = "none") -> None:
        from kvblocks.engine.attention.forward import packed_layers

        self.model = model
        # a model with no output embeddings to find (not a transformers model) keeps its own layers
        self.linears = packed_layers(model, packed) if hasattr(model, "get_output_embeddings") else None
        self.device = next(model.parameters()).device
        self.lock = threading.Lock()
        self._keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cache_arg = hf.cache_argument(model)
        self._position_args = hf.position_arguments(model)
        self.stepwise = getattr(model.config, "model_type", None) in hf.STEPWISE_MODEL_TYPES

    @torch.inference_mode()
    def forward(
        self,
        token_ids: Sequence[int],
        past: Any,
        keep: int = 1,
        *,
        positions: Sequence[int] | None = None,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits `[keep, vocab]` of the last `keep` positions; `past` grows by `len(token_ids)`.

        `positions` and `allowed` (`[new, cached + new]` booleans: which keys each new token sees)
        replace the causal numbering and mask, for a draft tree (`kvblocks.specdec.tree`).
        A model that cannot continue a recurrent state over several tokens in one forward
        (`hf.STEPWISE_MODEL_TYPES`) gets them one per forward once `past` holds a state."""
        if self.stepwise and len(token_ids) > 1 and hf.has_state(past):
            assert allowed is None, "a stepwise model reads no tree"
            rows = [self.forward([t], past) for t in token_ids]
            return torch.cat(rows[len(rows) - keep :])
        input_ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        kwargs: dict[str, Any] = {"logits_to_keep": keep} if self._keep_arg else {}
        kwargs.update(hf.positions(self._position_args, past, len(token_ids), self.device))
        if positions is not None and "position_ids" in kwargs:
            kwargs["position_ids"] = torch.tensor([list(positions)], dtype=torch.long, device=self.device)
        if allowed is not None:
            dtype = next(self.model.parameters()).dtype
            bias = torch.zeros(allowed.shape, dtype=dtype, device=self.device)
            kwargs["attention_mask"] = bias.masked_fill_(~allowed.to(self.device), torch.finfo(dtype).min)[
                None, None
            ]
        with self.lock, scope(self.linears):
            out = self.model(input_ids=input_ids, use_cache=True, **{self._cache_arg: past}, **kwargs)
        logits: torch.Tensor = out.logits[0, -keep:]
        return logits

    def crop(self, past: Any, length: int) -> None:
        """Roll `past` back to its first `length` positions (rejected drafts)."""
        hf.crop(past, length)
