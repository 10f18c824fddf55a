"""Namespaces: a fingerprint of everything that changes KV values for the same token ids.

A namespace is (model fingerprint, dtype, tenant, salt). The fingerprint covers the config and
every parameter and buffer, so a fine-tune that changed one weight, or an attached adapter, never
shares KV with its base model. The tenant comes from the server's credentials; the salt is a
client's `cache_salt`, which refines the namespace inside its tenant and cannot leave it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import xxhash

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Bytes hashed per update when weights live off the CPU: bounds the host copy, not the result.
_HOST_CHUNK_BYTES = 64 << 20


@dataclass(slots=True, frozen=True)
class Scope:
    """Who a request belongs to: its tenant (from credentials) and its optional `cache_salt`."""

    tenant: str = ""
    salt: str = ""


@dataclass(slots=True, frozen=True)
class Namespace:
    """Model identity + dtype + tenant + salt. Two requests share KV only if all four are equal."""

    model: str
    dtype: str
    salt: str = ""
    tenant: str = ""

    @property
    def key(self) -> str:
        # JSON framing: no choice of tenant and salt strings can collide with another pair.
        fields = json.dumps([self.model, self.dtype, self.tenant, self.salt], ensure_ascii=False)
        return hashlib.sha256(fields.encode()).hexdigest()[:32]

    @property
    def scope(self) -> Scope:
        return Scope(self.tenant, self.salt)

    def with_salt(self, salt: str | Scope | None) -> Namespace:
        """This model's namespace for a request: a plain salt stays in the default tenant ("")."""
        scope = salt if isinstance(salt, Scope) else Scope("", salt or "")
        return Namespace(self.model, self.dtype, scope.salt, scope.tenant)


def model_fingerprint(model: PreTrainedModel) -> str:
    """Model type + a hash of the config, the attention implementation and every parameter and buffer.

    Each tensor contributes its name, dtype, shape and all of its bytes (xxh3-128, streamed), so
    any single changed weight changes the fingerprint; adapters (PEFT/LoRA) are parameters too.
    The load path is left out on purpose: processes on different machines load the same model
    from different folders and must land in the same namespace to share a Redis tier.
    """
    config = model.config
    cfg = config.to_dict()
    for volatile in ("_name_or_path", "transformers_version"):
        cfg.pop(volatile, None)
    cfg["_attn_implementation"] = getattr(config, "_attn_implementation", None)
    h = xxhash.xxh3_128(json.dumps(cfg, sort_keys=True, default=str).encode())
    named: list[tuple[str, torch.Tensor]] = [("p:" + n, t) for n, t in model.named_parameters()]
    named += [("b:" + n, t) for n, t in model.named_buffers()]
    for name, tensor in named:
        h.update(f"\0{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        _hash_tensor(h, tensor.detach())
    return f"{config.model_type}@{h.hexdigest()[:32]}"


def _hash_tensor(h: xxhash.xxh3_128, tensor: torch.Tensor) -> None:
    if tensor.device.type == "meta":
        raise ValueError("cannot fingerprint a model whose weights are not loaded (meta tensors)")
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return
    if tensor.device.type == "cpu":
        h.update(_byte_view(flat.contiguous()))
        return
    step = max(1, _HOST_CHUNK_BYTES // flat.element_size())
    for start in range(0, flat.numel(), step):
        h.update(_byte_view(flat[start : start + step].to("cpu")))


def _byte_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes without a copy (numpy has no bfloat16: view as bytes first)."""
    return (t.view(torch.uint8).numpy() if t.dtype != torch.bool else t.numpy().view(np.uint8)).data


def namespace_for(model: PreTrainedModel, salt: str | Scope | None = None) -> Namespace:
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return Namespace(model_fingerprint(model), dtype).with_salt(salt)
