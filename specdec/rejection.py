"""One verification step of speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

For drafts x_1..x_g with drafter distributions q_i and target distributions p_i (p_{g+1} for the
bonus), draft x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); the first rejected
position emits a sample from norm(max(0, p_i - q_i)); if all g pass, a bonus token is drawn from
p_{g+1}. The emitted token is then distributed exactly as p_i. Greedy is the same rule on one-hot
distributions, i.e. token matching. A point-mass drafter (lookup, trie) has q_i = one-hot(x_i):
accept iff the target's own sample equals the draft, else emit that sample.
"""

from __future__ import annotations

import torch


def acceptance_probability(p: torch.Tensor, q: torch.Tensor, token: int) -> float:
    """min(1, p(x) / q(x)) for a draft x drawn from q (so q(x) > 0)."""
    qx = float(q[token])
    return 1.0 if qx <= 0.0 else min(1.0, float(p[token]) / qx)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): where to sample after a rejection."""
    r = (p - q).clamp_min(0.0)
    total = r.sum()
    # total == 0 only when p == q, where rejection has probability 0; fall back to p.
    return p if float(total) <= 0.0 else r / total


def _sample(probs: torch.Tensor, rng: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=rng))


def _uniform(rng: torch.Generator | None, like: torch.Tensor) -> float:
    return float(torch.rand((), generator=rng, device=like.device, dtype=torch.float64))


def verify(
    p: torch.Tensor,
    drafts: list[int],
    q: torch.Tensor | None,
    greedy: bool,
    rng: torch.Generator | None,
    tail_q: torch.Tensor | None = None,
) -> tuple[int, int]:
    """(number of drafts accepted, the token emitted after them).

    `p` is `[len(drafts) + 1, V]` target probabilities; `q` is `[len(drafts), V]` drafter
    probabilities, or None for a point-mass drafter. `tail_q` is the drafter's distribution at
    position len(drafts) when its draft there was rejected outright (an id outside the target's
    vocabulary): the last token then comes from the residual instead of p.
    """
    assert p.shape[0] == len(drafts) + 1
    for i, x in enumerate(drafts):
        if greedy:
            target = int(p[i].argmax())
            if target != x:
                return i, target
        elif q is None:
            target = _sample(p[i], rng)
            if target != x:
                return i, target
        elif _uniform(rng, p) >= acceptance_probability(p[i], q[i], x):
            return i, _sample(residual(p[i], q[i]), rng)
    last = p[len(drafts)]
    if greedy:
        return len(drafts), int(last.argmax())
    return len(drafts), _sample(last if tail_q is None else residual(last, tail_q), rng)
