"""What a verify forward costs by the rows it feeds, and the draft tree that buys the most tokens per second.

A target forward of n new rows takes about `a + b * n` seconds: `a` reads every weight once (on a
CPU, most of a decode step), `b` is the arithmetic one more row adds. `StepCost` fits the two by
least squares to the median time of each row count's newest forwards, timed by itself (`probe`:
1, 8, 16 and 32 rows at start) and reported by the generator (`add`, every verify forward), so a
loaded machine or a longer context moves the price and one stalled forward does not.

`best_cut` prices a round (EAGLE-2's dynamic tree, made cost-aware): the nodes of a scored tree are
added best first (their estimated acceptance probabilities, each at most its parent's), the expected
tokens of a round with the first k of them are `1 + sum(scores[:k])` (each node adds its chance of
being on the accepted path, the target's own token the 1), and the round's time is the forward of
`rows + 1 + k` rows when `rows` other rows share it. The cut maximises the batch's expected tokens
per second: `(others + tokens) / time`, so a node beside 16 other requests must be worth more than
one alone.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence


class StepCost:
    """`seconds(rows)` of one target forward, fitted as `a + b * rows` to timed forwards."""

    KEEP = 8  # the newest forwards kept per row count; each row count's median is fitted
    MAX_ROWS = 256  # forwards wider than this (prefills) say little about a verify step

    def __init__(self, a: float = 1.0, b: float = 0.05, *, learn: bool = True) -> None:
        """The prior (`a` seconds per forward, `b` per row; the default prices a row at 1/20 of a
        forward) holds until samples arrive; with `learn=False` it holds for good (tests)."""
        if a <= 0 or b < 0:
            raise ValueError(f"a step cost needs a > 0 and b >= 0, got a={a}, b={b}")
        self.a, self.b = a, b
        self._lock = threading.Lock()
        self._times: dict[int, deque[float]] = {}  # rows -> the newest forwards' seconds
        self.samples = 0
        self.learn = learn
        self.probed = not learn

    def seconds(self, rows: int) -> float:
        return self.a + self.b * rows

    def add(self, rows: int, seconds: float) -> None:
        """One timed forward of `rows` new rows."""
        if not self.learn or rows < 1 or rows > self.MAX_ROWS or seconds <= 0:
            return
        with self._lock:
            self._times.setdefault(rows, deque(maxlen=self.KEEP)).append(seconds)
            self.samples += 1
            points = [(n, statistics.median(t), len(t)) for n, t in self._times.items()]
            w = sum(k for _, _, k in points)
            x = sum(n * k for n, _, k in points) / w
            y = sum(t * k for _, t, k in points) / w
            var = sum(k * (n - x) ** 2 for n, _, k in points)
            if var > 0:  # two row counts at least: the slope is measured
                b = max(sum(k * (n - x) * (t - y) for n, t, k in points) / var, 0.0)
                a = y - b * x
            else:  # one row count: the prior's ratio of b to a, scaled to the measured time
                scale = y / self.seconds(x)
                a, b = self.a * scale, self.b * scale
            if a <= 0:  # a steep noisy fit: keep the level, not a negative fixed cost
                a, b = y / 2, y / 2 / max(x, 1.0)
            self.a, self.b = a, b

    def probe(self, forward: Callable[[int], None], rows: Sequence[int] = (1, 8, 16, 32)) -> None:
        """Time `forward(n)` (one forward of n new rows, rolled back by the caller) for each n,
        the best of two, after one untimed warm-up."""
        forward(rows[0])
        for n in rows:
            best = float("inf")
            for _ in range(2):
                t0 = time.perf_counter()
                forward(n)
                best = min(best, time.perf_counter() - t0)
            self.add(n, best)
        self.probed = True


def best_cut(scores: Sequence[float], cost: StepCost, others: int = 0, rows: int | None = None) -> int:
    """How many of the nodes (best first, `scores` non-increasing along every path) a round should
    verify: the k that maximises `(others + 1 + sum(scores[:k])) / cost.seconds(rows + 1 + k)`, the
    batch's expected tokens per second (`others` requests making a token each in `rows` rows of the
    same forward; `rows` defaults to `others`)."""
    rows = others if rows is None else rows
    best_k, best_rate, tokens = 0, (others + 1) / cost.seconds(rows + 1), float(others + 1)
    for k, s in enumerate(scores, 1):
        tokens += s
        rate = tokens / cost.seconds(rows + 1 + k)
        if rate > best_rate:
            best_k, best_rate = k, rate
    return best_k
