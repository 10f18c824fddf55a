"""SpeculativeGenerator: draft/verify decoding over the prefix cache, exact by construction.

Each round: the drafter proposes up to gamma tokens from the committed sequence; the target runs
once over [uncomputed committed tokens] + drafts and `verify` accepts a prefix of the drafts plus
one token of its own. Both caches are then cropped to len(committed) - 1 (roll back by target
length, never by deltas), so rejected drafts vanish. Only committed tokens reach either trie, when
the request ends.

A target with recurrent state (a hybrid or SSM model) cannot be cropped: its state is snapshotted
before each verify, and after a rejection it is restored and the accepted tokens are fed again
(one more forward of the accepted length), so the cache holds exactly the committed tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from kvblocks.adapters import hf
from kvblocks.adapters.hf_trie import KVCacheTrie
from kvblocks.generate.decoding import Decoding, context_room
from kvblocks.generate.generator import CachedGenerator, DecodeState
from kvblocks.generate.params import GenerationParams, ParamError
from kvblocks.generate.sampling import SamplingParams, distribution

from .drafters import Drafter, DraftSession, Proposal
from .rejection import verify

_NO_DRAFT = Proposal([], None)


@dataclass(slots=True)
class SpecStats:
    """Acceptance figures of one request (alpha, tokens per call and draft
    efficiency, not one ambiguous "acceptance rate": docs/ARCHITECTURE.md)."""

    gamma: int
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    rejected_rounds: int = 0
    emitted: int = 0
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)

    @property
    def alpha(self) -> float:
        """MLE of the per-token acceptance probability: sum(n) / (sum(n) + rounds with a rejection)."""
        denom = self.accepted + self.rejected_rounds
        return self.accepted / denom if denom else 0.0

    @property
    def tokens_per_call(self) -> float:
        """Mean tokens committed per target call (accepted drafts + the target's own token)."""
        return self.emitted / self.rounds if self.rounds else 0.0

    @property
    def draft_efficiency(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    def record(self, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += accepted + 1
        self.rejected_rounds += accepted < drafted
        grow = drafted - len(self.drafted_at)
        if grow > 0:
            self.drafted_at.extend([0] * grow)
            self.accepted_at.extend([0] * grow)
        for i in range(drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted

    def as_dict(self) -> dict:
        return {
            "gamma": self.gamma,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "rejected_rounds": self.rejected_rounds,
            "alpha": self.alpha,
            "tokens_per_call": self.tokens_per_call,
            "draft_efficiency": self.draft_efficiency,
            "acceptance_by_position": self.acceptance_by_position,
        }


@dataclass(slots=True, frozen=True)
class Round:
    """What one round did, for observers (tests check cache invariants after every round)."""

    committed: list[int]
    drafts: list[int]
    accepted: int
    token: int
    target_past: object


class SpeculativeGenerator(CachedGenerator):
    """`CachedGenerator` whose decode step is draft + verify. Same call shape and result, plus `r.spec`.

    `adaptive=True` grows gamma by one after a fully accepted round and shrinks it by one after a
    rejection, within [1, max_gamma].
    """

    def __init__(
        self,
        model,
        tokenizer,
        cache: KVCacheTrie | None,
        drafter: Drafter,
        gamma: int = 4,
        *,
        adaptive: bool = False,
        max_gamma: int = 16,
        on_round: Callable[[Round], None] | None = None,
    ) -> None:
        super().__init__(model, tokenizer, cache)
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        self.drafter = drafter
        self.gamma = gamma
        self.adaptive = adaptive
        self.max_gamma = max(max_gamma, gamma)
        self.on_round = on_round
        self.target_vocab = self.vocab_size
        self._target_state = False  # probed on first use when there is no cache to say it

    def check_params(self, params: GenerationParams) -> None:
        """Logits processing is refused: a round verifies up to gamma positions at once against
        distributions that the processors would rewrite token by token."""
        super().check_params(params)
        if params.kv_mode != "exact":
            raise ParamError(
                "kv_mode",
                f"speculative decoding serves kv_mode 'exact' only, not {params.kv_mode!r}; use a plain "
                "CachedGenerator (a server without --draft) for KV blocks",
            )
        if params.logit_processors:
            raise ParamError(
                params.logit_processors[0],
                f"speculative decoding does not support {', '.join(params.logit_processors)}; "
                "use a plain CachedGenerator for this request",
            )

    def propose(
        self,
        session: DraftSession,
        committed: list[int],
        gamma: int,
        params: SamplingParams,
        rng: torch.Generator | None,
    ) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
        """One round's drafts (at most `gamma`, fewer near the context's end), their drafter
        probabilities aligned to the target's vocabulary (None from a point-mass drafter) and
        `tail_q`, the drafter's distribution where a draft the target's vocabulary lacks cut the
        round short (for `verify`). The batched engine drafts through here too."""
        room = min(gamma, context_room(self.max_context, len(committed) + 1))
        proposal = session.propose(committed, room, params, rng) if room > 0 else _NO_DRAFT
        drafts = proposal.tokens[: max(room, 0)]
        # A draft id the target's vocabulary lacks has p = 0: it is rejected outright, so it is never
        # fed to the target and the round ends there with a residual sample.
        cut = next((i for i, t in enumerate(drafts) if t >= self.target_vocab), len(drafts))
        tail_q = None
        if cut < len(drafts) and proposal.q is not None:
            tail_q = _match_vocab(proposal.q[cut], self.target_vocab)
        drafts = drafts[:cut]
        q = None if proposal.q is None else _match_vocab(proposal.q[: len(drafts)], self.target_vocab)
        return drafts, q, tail_q

    def settle(
        self,
        logits: torch.Tensor,
        proposal: tuple[list[int], torch.Tensor | None, torch.Tensor | None],
        params: SamplingParams,
        rng: torch.Generator | None,
        stats: SpecStats,
        gamma: int,
    ) -> tuple[int, int, int]:
        """Judge one round's `proposal` (from `propose`) against the target's `logits` of the fed
        token and the drafts: (drafts accepted, the target's own token, the next round's gamma).
        The one-request path and the batched engine both settle rounds here."""
        drafts, q, tail_q = proposal
        n, token = verify(distribution(logits, params), drafts, q, params.greedy, rng, tail_q=tail_q)
        stats.record(len(drafts), n)
        return n, token, self.next_gamma(gamma, len(drafts), n)

    def next_gamma(self, gamma: int, drafted: int, accepted: int) -> int:
        """Adaptive gamma: one more after a fully accepted round, one fewer after a rejection."""
        if not self.adaptive or not drafted:
            return gamma
        return min(gamma + 1, self.max_gamma) if accepted == drafted else max(gamma - 1, 1)

    def _decode(self, ids: list[int], run: DecodeState, out: Decoding) -> Iterator[int]:
        """Draft/verify rounds; every committed token goes to the per-token rule (`out`) through the
        stream, which owns the finish checks, so a round's tail past a finish is never emitted."""
        params, rng = out.params.sampling, out.rng
        stats = run.spec = SpecStats(self.gamma)
        committed = list(ids)
        gamma = self.gamma
        # the engine interleaves requests: each one drafts in its own session (cache, trie lock, salt)
        drafter = self.drafter.start(ids, run.salt)
        state = self._state_layout(run)
        try:
            if state is not None and run.computed < len(ids) - 1:  # snapshots along the prompt
                self._prefill(ids, run, len(ids) - 1)
            while True:
                proposal = self.propose(drafter, committed, gamma, params, rng)
                drafts = proposal[0]
                feed = committed[run.computed :] + drafts
                saved = hf.capture_state(run.past, state) if state is not None and drafts else None
                logits = self.runner.forward(feed, run.past, keep=len(drafts) + 1)
                n, token, next_gamma = self.settle(logits, proposal, params, rng, stats, gamma)
                new = [*drafts[:n], token]
                committed.extend(new)
                if saved is not None and n < len(drafts):
                    self._rewind(run, saved, feed[: len(feed) - len(drafts) + n])
                else:
                    self.runner.crop(run.past, len(committed) - 1)
                run.computed = len(committed) - 1
                self._snapshot(run)
                drafter.rollback(len(committed) - 1)
                if self.on_round is not None:
                    self.on_round(Round(list(committed), drafts, n, token, run.past))
                gamma = next_gamma
                for emitted, row in zip(new, logits[: n + 1]):
                    if run.logits is not None:  # row by row: the consumer may stop mid-round
                        run.logits.append(row.detach().clone())
                    yield emitted
        finally:
            drafter.end(run.sequence)

    def _state_layout(self, run: DecodeState):
        """The target's recurrent-state layout (None for an attention-only target)."""
        if self.cache is not None:
            return self.cache.state
        if self._target_state is False:
            self._target_state = hf.describe(self.model)[1]
        return self._target_state

    def _rewind(self, run: DecodeState, saved: torch.Tensor, accepted: list[int]) -> None:
        """Undo a verify on a recurrent target: the state from before it, the attention layers
        cropped to the same position, then the accepted tokens fed again."""
        state = self._state_layout(run)
        hf.apply_state(run.past, state, saved)
        hf.crop(run.past, run.computed, state_restored=True)
        self.runner.forward(accepted, run.past)


def _match_vocab(q: torch.Tensor, size: int) -> torch.Tensor:
    """Drafter and target may pad their vocabularies differently; align q to the target's.

    Not renormalised: the drafter's mass on ids the target lacks is mass the target rejects.
    """
    if q.shape[-1] >= size:
        return q[..., :size]
    return torch.nn.functional.pad(q, (0, size - q.shape[-1]))
