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
from .seq2seq import Seq2SeqModelDrafter, Seq2SeqSpeculativeGenerator
from .tree import DraftTree, TreeShape

__all__ = [
    "DraftSession",
    "DraftTree",
    "Drafter",
    "ModelDrafter",
    "PointMassSession",
    "PromptLookupDrafter",
    "Proposal",
    "Round",
    "Seq2SeqModelDrafter",
    "Seq2SeqSpeculativeGenerator",
    "SpecStats",
    "SpeculativeGenerator",
    "TreeShape",
    "TrieDrafter",
    "acceptance_probability",
    "residual",
    "truncated_model",
    "verify",
]
