"""Prometheus metrics: counters and histograms, rendered in the text exposition format.

Counters only go up; rates (hit rate, tokens/s) are for the reader to compute from deltas.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

HELP = {
    "kvblocks_requests_total": "Finished generation requests.",
    "kvblocks_requests_failed_total": "Requests that failed inside the engine.",
    "kvblocks_requests_cancelled_total": "Requests abandoned by their client (disconnects).",
    "kvblocks_prompt_tokens_total": "Prompt tokens of finished requests.",
    "kvblocks_cached_prompt_tokens_total": "Prompt tokens served from the prefix cache.",
    "kvblocks_generation_tokens_total": "Generated tokens.",
    "kvblocks_spec_drafted_tokens_total": "Speculative draft tokens proposed.",
    "kvblocks_spec_accepted_tokens_total": "Speculative draft tokens accepted.",
    "kvblocks_spec_rounds_total": "Speculative draft/verify rounds (target calls).",
    "kvblocks_time_to_first_token_seconds": "Time from request arrival to its first token, queueing included.",
    "kvblocks_inter_token_seconds": "Time between consecutive tokens of a stream.",
}


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: dict[str, float] = {name: 0 for name in HELP if name.endswith("_total")}
        self.histograms: dict[str, Histogram] = {
            name: Histogram() for name in HELP if name.endswith("_seconds")
        }

    def inc(self, name: str, value: float = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + value

    def observe(self, name: str, value: float) -> None:
        with self._lock:
            self.histograms.setdefault(name, Histogram()).observe(value)

    def render(self, extra_counters: dict[str, tuple[str, dict[str, str], float]] | None = None) -> str:
        """Prometheus text. `extra_counters` maps a sample name to (help, labels, value)."""
        lines: list[str] = []
        with self._lock:
            for name, value in sorted(self.counters.items()):
                lines += [
                    f"# HELP {name} {HELP.get(name, name)}",
                    f"# TYPE {name} counter",
                    f"{name} {_sample(value)}",
                ]
            for name, h in sorted(self.histograms.items()):
                lines += [f"# HELP {name} {HELP.get(name, name)}", f"# TYPE {name} histogram"]
                cumulative = 0
                for bound, count in zip(h.buckets, h.counts):
                    cumulative += count
                    lines.append(f'{name}_bucket{{le="{bound:g}"}} {cumulative}')
                lines.append(f'{name}_bucket{{le="+Inf"}} {h.n}')
                lines += [f"{name}_sum {h.total:.6f}", f"{name}_count {h.n}"]
        grouped: dict[str, list[tuple[dict[str, str], float]]] = {}
        helps: dict[str, str] = {}
        for name, (help_text, labels, value) in (extra_counters or {}).items():
            base = name.split("{", 1)[0]
            grouped.setdefault(base, []).append((labels, value))
            helps[base] = help_text
        for base, samples in grouped.items():
            kind = "counter" if base.endswith("_total") else "gauge"
            lines += [f"# HELP {base} {helps[base]}", f"# TYPE {base} {kind}"]
            for labels, value in samples:
                label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
                sample = f"{base}{{{label_text}}}" if label_text else base
                lines.append(f"{sample} {_sample(value)}")
        return "\n".join(lines) + "\n"


def _sample(value: float) -> str:
    """A sample value in full: `:g` would print 1234567 as 1.23457e+06 and stall a counter's rate."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))
