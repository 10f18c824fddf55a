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

import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from kvblocks.adapters import hf
from kvblocks.adapters.hf_trie import KVCacheTrie
from kvblocks.generate.decoding import Decoding, context_room
from kvblocks.generate.generator import CachedGenerator, DecodeState
from kvblocks.generate.params import GenerationParams, ParamError
from kvblocks.generate.sampling import SamplingParams, distribution

from .cost import StepCost, best_cut
from .drafters import Drafter, DraftSession, PointMassSession, Proposal
from .rejection import verify
from .tree import DraftTree, Shape, Sure, TreeShape, accept

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
    tree_rounds: int = 0  # rounds that verified a tree of width > 1

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

    @property
    def accepted_path(self) -> float:
        """Mean accepted drafts per round (the accepted path's length, for a tree)."""
        return self.accepted / self.rounds if self.rounds else 0.0

    def record_tree(self, tree: DraftTree, path: list[int]) -> None:
        """One tree round: `drafted` counts its nodes, `accepted` its accepted path; a rejection is
        a path that stopped where the tree went on (the target's token matched none of the
        children); by position, depth d counts as drafted when the tree reaches it."""
        self.rounds += 1
        self.tree_rounds += not tree.is_chain
        self.drafted += len(tree)
        self.accepted += len(path)
        self.emitted += len(path) + 1
        self.rejected_rounds += bool(tree.children(path[-1] if path else -1))
        depth = tree.depth
        grow = depth - len(self.drafted_at)
        if grow > 0:
            self.drafted_at.extend([0] * grow)
            self.accepted_at.extend([0] * grow)
        for d in range(depth):
            self.drafted_at[d] += 1
            self.accepted_at[d] += d < len(path)

    def as_dict(self) -> dict:
        return {
            "gamma": self.gamma,
            "tree_rounds": self.tree_rounds,
            "accepted_path": self.accepted_path,
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

    `tree` drafts token trees instead of chains (`kvblocks.specdec.tree`): each round the drafter
    proposes up to `tree.budget` nodes, `tree.depth` deep (gamma is the depth), verified in one
    forward under a tree mask, the accepted path's KV kept and the rest dropped. Needs a target of
    full-attention layers on this path (the packed engine also takes windowed layers).

    `packed` (default "all") runs the target's linear layers on packed weights (`ModelRunner`): on a
    CPU a verify forward of 2 to 16 rows then costs little more than a decode step of one row, where
    `F.linear` took 1.7-2.6x one row's time at 2-8 rows (the 0.5B model; BENCHMARKS.md, trees).
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
        tree: TreeShape | None = None,
        cost: StepCost | None = None,
        packed: str = "all",
    ) -> None:
        super().__init__(model, tokenizer, cache, packed=packed)
        if gamma < 1:
            raise ValueError(f"gamma must be >= 1, got {gamma}")
        if tree is not None:
            gamma = tree.depth
            _check_tree_target(model, cache)
        self.tree = tree
        self.drafter = drafter
        self.gamma = gamma
        self.adaptive = adaptive
        self.max_gamma = max(max_gamma, gamma, tree.budget if tree is not None else 0)
        self.on_round = on_round
        self.target_vocab = self.vocab_size
        self._target_state = False  # probed on first use when there is no cache to say it
        # what a verify forward costs by rows (scored trees are cut to the most tokens per second)
        self.cost = cost if cost is not None else StepCost()
        self.sure = Sure()  # how sure the drafter's scored trees were, over every request
        self._probe_lock = threading.Lock()

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
        out: Decoding | None = None,
    ) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
        """One round's drafts (at most `gamma`, fewer near the context's end or `out`'s budget, none
        after an end of sequence of `out`), their drafter probabilities aligned to the target's
        vocabulary (None from a point-mass drafter) and `tail_q`, the drafter's distribution where a
        draft the target's vocabulary lacks cut the round short (for `verify`). The batched engine
        drafts through here too."""
        room = min(gamma, context_room(self.max_context, len(committed) + 1), _left(out))
        proposal = session.propose(committed, room, params, rng) if room > 0 else _NO_DRAFT
        drafts = proposal.tokens[: max(room, 0)]
        ends = out.ends if out is not None else frozenset()
        drafts = drafts[: next((i + 1 for i, t in enumerate(drafts) if t in ends), len(drafts))]
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
        n, token = verify(_judged(logits, params), drafts, q, params.greedy, rng, tail_q=tail_q)
        stats.record(len(drafts), n)
        return n, token, self.next_gamma(gamma, len(drafts), n)

    def next_gamma(self, gamma: int, drafted: int, accepted: int) -> int:
        """Adaptive gamma: one more after a fully accepted round, one fewer after a rejection."""
        if not self.adaptive or not drafted:
            return gamma
        return min(gamma + 1, self.max_gamma) if accepted == drafted else max(gamma - 1, 1)

    def propose_tree(
        self,
        session: DraftSession,
        committed: list[int],
        shape: Shape,
        params: SamplingParams,
        rng: torch.Generator | None,
        others: int = 0,
        room: int | None = None,
        out: Decoding | None = None,
    ) -> DraftTree:
        """One round's draft tree within `shape` (made smaller beside `others` requests, at most
        `room` nodes), no deeper than the context or `out`'s budget allows and nothing below an end
        of sequence of `out`, its q aligned to the target's vocabulary. A node the target's
        vocabulary lacks is dropped with its subtree, or, in a tree of i.i.d. siblings, kept as a
        leaf the verification rejects outright (fed as token 0)."""
        tree = None
        ends = out.ends if out is not None else frozenset()
        deepest = min(shape.limit.depth, context_room(self.max_context, len(committed) + 1), _left(out))
        if shape.limit.adaptive and isinstance(session, PointMassSession) and session.scored is not None:
            budget = shape.limit.budget if room is None else min(shape.limit.budget, room)
            depth = min(deepest, budget)
            if depth <= 0:
                return DraftTree([], [])
            grown = session.grow_tree(committed, budget, depth, shape.limit.width, shape.sure, ends)
            tree = grown.truncated(budget, depth)
            scores = [tree.scores[i] for i in tree.ranked()]
            tree = tree.best(best_cut(scores, self.step_cost(), others))
        else:
            budget, width = shape.for_batch(others)
            budget = budget if room is None else min(budget, room)
            depth = min(deepest, budget)
            if depth <= 0:
                return DraftTree([], [])
            tree = session.propose_tree(committed, budget, depth, width, params, rng)
            tree = tree.truncated(budget, depth).ended(ends)
        outside = [t >= self.target_vocab for t in tree.tokens]
        if any(outside):
            # keep only nodes with no outside ancestor; an outside node itself stays in a sampled tree
            inside = tree.prune([not o for o in outside]) if not tree.sampled else None
            if inside is None:
                parent_ok = [True] * len(tree)
                for i, p in enumerate(tree.parents):
                    parent_ok[i] = p < 0 or (parent_ok[p] and not outside[p])
                inside = tree.prune(parent_ok)
            tree = inside
        if tree.q is not None:
            tree.q = _match_vocab(tree.q, self.target_vocab)
        return tree

    def step_cost(self) -> StepCost:
        """The target's forward time by rows (`specdec.cost`), probed on its first use: a forward
        of 1, 8, 16 and 32 rows after 32 tokens of context, on a cache of its own."""
        if not self.cost.probed:
            with self._probe_lock:
                if not self.cost.probed:
                    past = hf.empty_cache(self.model.config)
                    context = 32
                    self.runner.forward([0] * context, past)

                    def forward(rows: int) -> None:
                        self.runner.forward([0] * rows, past, keep=rows)
                        self.runner.crop(past, context)

                    self.cost.probe(forward)
        return self.cost

    def fed_tokens(self, tree: DraftTree) -> list[int]:
        """The tree's tokens as the target reads them (an id outside its vocabulary as 0: never accepted)."""
        return [t if t < self.target_vocab else 0 for t in tree.tokens]

    def settle_tree(
        self,
        logits: torch.Tensor,
        tree: DraftTree,
        params: SamplingParams,
        rng: torch.Generator | None,
        stats: SpecStats,
        shape: Shape,
    ) -> tuple[list[int], int]:
        """Judge a tree round: (the accepted path's nodes, the target's own token); `logits` are
        the root's row then each node's. The one-request path and the batched engine both settle here."""
        path, token = accept(_judged(logits, params), tree, params.greedy, rng)
        stats.record_tree(tree, path)
        shape.after(tree, path)
        return path, token

    def _decode(self, ids: list[int], run: DecodeState, out: Decoding) -> Iterator[int]:
        if self.tree is not None:
            yield from self._decode_tree(ids, run, out)
            return
        yield from self._decode_chain(ids, run, out)

    def _decode_tree(self, ids: list[int], run: DecodeState, out: Decoding) -> Iterator[int]:
        """Tree rounds: the uncomputed committed tokens and the tree's nodes in one forward (a 4-D
        mask: the committed tokens causal, each node the prefix and its ancestors; a node's position
        is the root's plus its depth), then the accepted path's KV kept in order, the rest cropped."""
        params, rng = out.params.sampling, out.rng
        stats = run.spec = SpecStats(self.gamma)
        shape = Shape(self.tree, shared=self.sure)
        committed = list(ids)
        drafter = self.drafter.start(ids, run.salt)
        try:
            while True:
                tree = self.propose_tree(drafter, committed, shape, params, rng, out=out)
                head = committed[run.computed :]
                t0 = time.perf_counter()
                logits = self._tree_forward(head, tree, run.past, run.computed)
                self.cost.add(len(head) + len(tree), time.perf_counter() - t0)
                path, token = self.settle_tree(logits, tree, params, rng, stats, shape)
                new = [*tree.path_tokens(path), token]
                committed.extend(new)
                hf.keep_rows(run.past, len(committed) - len(new), path)
                run.computed = len(committed) - 1
                self._snapshot(run)
                drafter.rollback(len(committed) - 1)
                if self.on_round is not None:
                    # drafts as a chain would show them: the accepted path, then the children it stopped at
                    stopped = tree.path_tokens(tree.children(path[-1] if path else -1))
                    drafts = tree.path_tokens(path) + stopped
                    self.on_round(Round(list(committed), drafts, len(path), token, run.past))
                rows = [0, *(i + 1 for i in path)]
                for emitted, row in zip(new, logits[rows]):
                    if run.logits is not None:
                        run.logits.append(row.detach().clone())
                    yield emitted
        finally:
            drafter.end(run.sequence)

    def _tree_forward(self, head: list[int], tree: DraftTree, past, cached: int) -> torch.Tensor:
        """Logits `[1 + len(tree), V]`: the last committed token's row, then each node's."""
        if tree.is_chain:  # a chain is causal: the ordinary forward
            return self.runner.forward(head + self.fed_tokens(tree), past, keep=len(tree) + 1)
        h, n = len(head), len(tree)
        positions = list(range(cached, cached + h)) + [cached + h - 1 + d for d in tree.depths()]
        allowed = torch.ones(h + n, cached + h + n, dtype=torch.bool)
        allowed[:, cached:] = False
        allowed[:h, cached : cached + h] = torch.ones(h, h, dtype=torch.bool).tril()
        allowed[h:, cached : cached + h] = True
        allowed[h:, cached + h :] = torch.from_numpy(tree.ancestors())
        return self.runner.forward(
            head + self.fed_tokens(tree), past, keep=n + 1, positions=positions, allowed=allowed
        )

    def _decode_chain(self, ids: list[int], run: DecodeState, out: Decoding) -> Iterator[int]:
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
                proposal = self.propose(drafter, committed, gamma, params, rng, out)
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


def _check_tree_target(model, cache: KVCacheTrie | None) -> None:
    """Draft trees need a target whose cache rows can be kept out of order: full attention only."""
    config = model.config.get_text_config()
    state = cache.state if cache is not None else hf.describe(model)[1]
    windowed = "sliding_attention" in (getattr(config, "layer_types", None) or ()) or (
        getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    )
    if state is not None or windowed:
        raise ValueError(
            f"draft trees need a target of full-attention layers; a '{config.model_type}' model keeps "
            f"{'recurrent state' if state is not None else 'sliding-window layers'}: draft chains instead"
        )


def _left(out: Decoding | None) -> float:
    """The most drafts a round of `out` can use: its tokens left less the target's own."""
    return math.inf if out is None else out.left - 1


def _judged(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What a round is judged on: the target's distributions, or for greedy the logits themselves
    (greedy reads only each row's argmax, the same index as its one-hot's: building one-hot rows
    of a 150k vocabulary cost more than the argmax, tens of ms a round)."""
    return logits if params.greedy else distribution(logits, params)


def _match_vocab(q: torch.Tensor, size: int) -> torch.Tensor:
    """Drafter and target may pad their vocabularies differently; align q to the target's.

    Not renormalised: the drafter's mass on ids the target lacks is mass the target rejects.
    """
    if q.shape[-1] >= size:
        return q[..., :size]
    return torch.nn.functional.pad(q, (0, size - q.shape[-1]))
