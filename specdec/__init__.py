"""Speculative decoding over the kvblocks prefix cache (imported as `kvblocks.specdec`)."""

from .drafters import (
    Drafter,
    DraftSession,
    ModelDrafter,
    PointMassSession,
    PromptLookupDrafter,
    Proposal,
    TrieDrafter,
    truncated_model,
)
from .generator import Round, SpecStats, SpeculativeGenerator
from .rejection import acceptance_probability, residual, verify

__all__ = [
    "DraftSession",
    "Drafter",
    "ModelDrafter",
    "PointMassSession",
    "PromptLookupDrafter",
    "Proposal",
    "Round",
    "SpecStats",
    "SpeculativeGenerator",
    "TrieDrafter",
    "acceptance_probability",
    "residual",
    "truncated_model",
    "verify",
]
