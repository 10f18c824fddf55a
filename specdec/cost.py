"""What a verify forward costs by the rows it feeds, and the draft tree that buys the most tokens per second.

A target forward of n new rows takes about `a + b * max(0, n - knee)` seconds: `a` reads every
weight once (on a CPU, most of a decode step), `b` is the arithmetic one more row adds once the
rows' multiply-adds outlast the weights' reading, past `knee` rows (a roofline: a CPU kernel that
streams the weights once does 1 to about 4-8 rows in the time of one, the 0.5B model's layers 83 ms
at 1 row, 88 at 4, 107 at 8, 176 at 16; a product that repacks per call has no flat part, knee 0).
`StepCost` fits `a` and `b` by least squares to the median time of each row count's newest
forwards for each knee at a measured row count (and 0), and keeps the knee that fits best; the
forwards are timed by itself (`probe`: 1, 4, 8, 16 and 32 rows at start) and reported by the
generator (`add`, every verify forward), so a loaded machine or a longer context moves the price
and one stalled forward does not.

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
    """`seconds(rows)` of one target forward, fitted as `a + b * max(0, rows - knee)` to timed forwards."""

    KEEP = 8  # the newest forwards kept per row count; each row count's median is fitted
    MAX_ROWS = 256  # forwards wider than this (prefills) say little about a verify step

    def __init__(self, a: float = 1.0, b: float = 0.05, *, knee: int = 0, learn: bool = True) -> None:
        """The prior (`a` seconds per forward, `b` per row past `knee`; the default prices every row
        at 1/20 of a forward) holds until samples arrive; with `learn=False` it holds for good (tests)."""
        if a <= 0 or b < 0 or knee < 0:
            raise ValueError(f"a step cost needs a > 0, b >= 0 and knee >= 0, got a={a}, b={b}, knee={knee}")
        self.a, self.b, self.knee = a, b, knee
        self._lock = threading.Lock()
        self._times: dict[int, deque[float]] = {}  # rows -> the newest forwards' seconds
        self.samples = 0
        self.learn = learn
        self.probed = not learn

    def seconds(self, rows: int) -> float:
        return self.a + self.b * max(0, rows - self.knee)

    def add(self, rows: int, seconds: float) -> None:
        """One timed forward of `rows` new rows."""
        if not self.learn or rows < 1 or rows > self.MAX_ROWS or seconds <= 0:
            return
        with self._lock:
            self._times.setdefault(rows, deque(maxlen=self.KEEP)).append(seconds)
            self.samples += 1
            points = [(n, statistics.median(t), len(t)) for n, t in sorted(self._times.items())]
            if len(points) == 1:  # one row count: the prior's shape, scaled to the measured time
                n, t, _ = points[0]
                scale = t / self.seconds(n)
                self.a, self.b = self.a * scale, self.b * scale
                return
            # every knee at a measured row count but the widest (rows past it must be measured), and 0
            fits = [
                f for knee in (0, *(n for n, _, _ in points[:-1])) if (f := _fit(points, knee)) is not None
            ]
            if not fits:  # every slope came out negative (noise): the level, rows free
                w = sum(k for _, _, k in points)
                self.a, self.b, self.knee = sum(t * k for _, t, k in points) / w, 0.0, 0
                return
            least = min(f[0] for f in fits)  # the least squared error; of fits as good, the smallest knee
            _, self.a, self.b, self.knee = next(f for f in fits if f[0] <= least * (1 + 1e-6) + 1e-15)

    def probe(self, forward: Callable[[int], None], rows: Sequence[int] = (1, 4, 8, 16, 32)) -> None:
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


def _fit(points: list[tuple[int, float, int]], knee: int) -> tuple[float, float, float, int] | None:
    """(weighted squared error, a, b, knee) of `t = a + b * max(0, n - knee)` fitted by least squares
    to (rows, median seconds, weight) points, or None where the slope comes out negative or `a` not
    positive."""
    z = [(max(0, n - knee), t, k) for n, t, k in points]
    w = sum(k for _, _, k in z)
    x = sum(v * k for v, _, k in z) / w
    y = sum(t * k for _, t, k in z) / w
    var = sum(k * (v - x) ** 2 for v, _, k in z)
    if var <= 0:
        return None
    b = sum(k * (v - x) * (t - y) for v, t, k in z) / var
    a = y - b * x
    if b < 0 or a <= 0:
        return None
    return sum(k * (a + b * v - t) ** 2 for v, t, k in z), a, b, knee


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
