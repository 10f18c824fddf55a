"""Namespaces: a fingerprint of everything that changes KV values for the same token ids."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import torch


@dataclass(slots=True, frozen=True)
class Namespace:
    """Model identity + dtype + optional tenant salt. Two requests share KV only if these are equal."""

    model: str
    dtype: str
    salt: str = ""

    @property
    def key(self) -> str:
        digest = hashlib.sha256(f"{self.model}\0{self.dtype}\0{self.salt}".encode()).hexdigest()
        return digest[:32]

    def with_salt(self, salt: str | None) -> Namespace:
        return Namespace(self.model, self.dtype, salt or "")


def model_fingerprint(model: torch.nn.Module) -> str:
    """Model type + hash of the config and a sample of the weights.

    The load path is left out on purpose: processes on different machines load the same model
    from different folders and must land in the same namespace to share a Redis tier. The weight
    sample keeps two random-init or fine-tuned models with one config apart.
    """
    config = model.config
    cfg = config.to_dict()
    cfg.pop("_name_or_path", None)
    cfg.pop("transformers_version", None)
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode())
    params = list(model.parameters())
    for p in (params[0], params[len(params) // 2], params[-1]):
        sample = p.detach().reshape(-1)[:4096].to("cpu", torch.float64)
        h.update(sample.numpy().tobytes())
    return f"{config.model_type}@{h.hexdigest()[:16]}"


def namespace_for(model: torch.nn.Module, salt: str | None = None) -> Namespace:
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return Namespace(model_fingerprint(model), dtype, salt or "")
