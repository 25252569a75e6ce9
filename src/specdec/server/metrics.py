"""Prometheus text exposition of the server's metrics, named as vLLM names them where it can.

Counters of tokens and speculation come straight from the scheduler's cumulative counters; the
latency histograms are filled by `ServerMetrics.observe`, which the scheduler calls (from its
thread) for every finished request.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

from ..scheduler import BatchScheduler, Delta, Request

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                   40.0, 80.0, 160.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket (not cumulative); last = +Inf
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, cumulative = [], 0
        for bound, count in zip(list(self.buckets) + [float("inf")], self.counts):
            cumulative += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {cumulative}')
        out.append(f"{name}_sum{{{labels}}} {self.total}")
        out.append(f"{name}_count{{{labels}}} {self.n}")
        return out


class ServerMetrics:
    """Latency histograms per finished request (thread-safe: written by the scheduler thread)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.tpot = Histogram(LATENCY_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.queue = Histogram(LATENCY_BUCKETS)

    def observe(self, request: Request, delta: Delta) -> None:
        if delta.timing is None or delta.finish_reason not in ("stop", "length"):
            return
        t = delta.timing
        with self._lock:
            self.ttft.observe(t.ttft_s)
            self.e2e.observe(t.e2e_s)
            self.queue.observe(t.queue_s)
            if t.tpot_s is not None:
                self.tpot.observe(t.tpot_s)

    def render(self, scheduler: BatchScheduler | None, model_name: str) -> str:
        labels = f'model_name="{model_name}"'
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP specdec:{name} {help_text}")
            lines.append(f"# TYPE specdec:{name} {kind}")
            for extra, value in samples:
                lines.append(f"specdec:{name}{{{labels}{extra}}} {value}")

        if scheduler is not None:
            c = scheduler.counters
            spec = c.spec
            metric("num_requests_running", "gauge", "Requests in the batch (each holds one cache row).",
                   [("", scheduler.num_running)])
            metric("num_requests_waiting", "gauge", "Requests queued for a batch row.", [("", scheduler.num_waiting)])
            metric("prompt_tokens_total", "counter", "Prefilled prompt tokens.", [("", c.prompt_tokens)])
            metric("prefix_cache_hit_tokens_total", "counter",
                   "Prompt tokens whose KV entries came from the prefix cache instead of a prefill.",
                   [("", c.prompt_tokens_cached)])
            metric("generation_tokens_total", "counter", "Generated tokens.", [("", c.generation_tokens)])
            metric("request_success_total", "counter", "Finished requests by finish reason.",
                   [(f',finished_reason="{r}"', v) for r, v in sorted(c.finished.items())])
            metric("spec_decode_num_drafts_total", "counter", "Verify steps of a sequence that had drafts.",
                   [("", spec.drafts)])
            metric("spec_decode_num_draft_tokens_total", "counter", "Draft tokens proposed.", [("", spec.draft_tokens)])
            metric("spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted.",
                   [("", spec.accepted_tokens)])
            metric("spec_decode_num_accepted_tokens_per_pos_total", "counter",
                   "Accepted draft tokens by draft position.",
                   [(f',position="{i}"', v) for i, v in enumerate(spec.accepted_per_position)])
            metric("spec_decode_num_draft_tokens_per_pos_total", "counter", "Draft tokens by draft position.",
                   [(f',position="{i}"', v) for i, v in enumerate(spec.drafted_per_position)])
            metric("batch_steps_total", "counter", "Batched decode steps (one target forward each).",
                   [("", c.steps)])
            metric("batch_rows_total", "counter", "Sum over decode steps of the sequences in the batch.",
                   [("", c.step_rows)])
            metric("batch_scored_tokens_total", "counter",
                   "Sum over decode steps of rows x block width (tokens the target scored, padding included).",
                   [("", c.step_tokens)])
            metric("spec_decode_max_draft_tokens", "gauge",
                   "Draft tokens a sequence may propose at the current batch size (the load rule).",
                   [("", scheduler.k_cap(max(1, scheduler.num_running)))])
        with self._lock:
            for name, hist, help_text in (
                ("time_to_first_token_seconds", self.ttft, "Arrival to first token."),
                ("time_per_output_token_seconds", self.tpot, "Mean time per output token after the first."),
                ("e2e_request_latency_seconds", self.e2e, "Arrival to last token."),
                ("request_queue_time_seconds", self.queue, "Arrival to admission into the batch."),
            ):
                lines.append(f"# HELP specdec:{name} {help_text}")
                lines.append(f"# TYPE specdec:{name} histogram")
                lines.extend(hist.lines(f"specdec:{name}", labels))
        return "\n".join(lines) + "\n"
