"""The server's metrics in Prometheus' text format (through `prometheus_client`), named as vLLM
names them where it can.

Counters of tokens and speculation come straight from the scheduler's cumulative counters, read
when /metrics is scraped (a collector over them, in a registry of this server's own: nothing is
registered process-wide); the latency histograms are filled by `ServerMetrics.observe`, which the
scheduler calls (from its thread) for every finished request.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

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

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, count of observations <= le), +Inf last: the buckets as Prometheus exposes them."""
        out, total = [], 0
        for bound, count in zip(list(self.buckets) + [float("inf")], self.counts):
            total += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), total))
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
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Snapshot(self, scheduler, model_name))
        return generate_latest(registry).decode()

    def families(self, scheduler: BatchScheduler | None, model_name: str):
        """Every metric family as it stands now, each sample labelled with `model_name` first."""

        def family(kind, name: str, help_text: str, samples: list[tuple[dict, float]]):
            extra = list(samples[0][0]) if samples else []
            f = kind(f"specdec:{name}", help_text, labels=["model_name", *extra])
            for labels, value in samples:
                f.add_metric([model_name, *labels.values()], value)
            return f

        counter, gauge = CounterMetricFamily, GaugeMetricFamily
        if scheduler is not None:
            c = scheduler.counters
            spec = c.spec
            yield family(gauge, "num_requests_running", "Requests in the batch (each holds one cache row).",
                         [({}, scheduler.num_running)])
            yield family(gauge, "num_requests_waiting", "Requests queued for a batch row.",
                         [({}, scheduler.num_waiting)])
            yield family(counter, "prompt_tokens_total", "Prefilled prompt tokens.", [({}, c.prompt_tokens)])
            yield family(counter, "prefix_cache_hit_tokens_total",
                         "Prompt tokens whose KV entries came from the prefix cache instead of a prefill.",
                         [({}, c.prompt_tokens_cached)])
            yield family(counter, "generation_tokens_total", "Generated tokens.", [({}, c.generation_tokens)])
            yield family(counter, "request_success_total", "Finished requests by finish reason.",
                         [({"finished_reason": r}, v) for r, v in sorted(c.finished.items())])
            yield family(counter, "spec_decode_num_drafts_total", "Verify steps of a sequence that had drafts.",
                         [({}, spec.drafts)])
            yield family(counter, "spec_decode_num_draft_tokens_total", "Draft tokens proposed.",
                         [({}, spec.draft_tokens)])
            yield family(counter, "spec_decode_num_accepted_tokens_total", "Draft tokens accepted.",
                         [({}, spec.accepted_tokens)])
            yield family(counter, "spec_decode_num_accepted_tokens_per_pos_total",
                         "Accepted draft tokens by draft position.",
                         [({"position": str(i)}, v) for i, v in enumerate(spec.accepted_per_position)])
            yield family(counter, "spec_decode_num_draft_tokens_per_pos_total", "Draft tokens by draft position.",
                         [({"position": str(i)}, v) for i, v in enumerate(spec.drafted_per_position)])
            yield family(counter, "batch_steps_total", "Batched decode steps (one target forward each).",
                         [({}, c.steps)])
            yield family(counter, "batch_rows_total", "Sum over decode steps of the sequences in the batch.",
                         [({}, c.step_rows)])
            yield family(counter, "batch_scored_tokens_total",
                         "Sum over decode steps of rows x block width (tokens the target scored, padding included).",
                         [({}, c.step_tokens)])
            yield family(gauge, "spec_decode_max_draft_tokens",
                         "Draft tokens a sequence may propose at the current batch size (the load rule).",
                         [({}, scheduler.k_cap(max(1, scheduler.num_running)))])
        with self._lock:
            for name, hist, help_text in (
                ("time_to_first_token_seconds", self.ttft, "Arrival to first token."),
                ("time_per_output_token_seconds", self.tpot, "Mean time per output token after the first."),
                ("e2e_request_latency_seconds", self.e2e, "Arrival to last token."),
                ("request_queue_time_seconds", self.queue, "Arrival to admission into the batch."),
            ):
                f = HistogramMetricFamily(f"specdec:{name}", help_text, labels=["model_name"])
                f.add_metric([model_name], hist.cumulative(), sum_value=hist.total)
                yield f


class _Snapshot:
    """A `prometheus_client` collector over one server's metrics for one scrape."""

    def __init__(self, metrics: ServerMetrics, scheduler: BatchScheduler | None, model_name: str):
        self.metrics, self.scheduler, self.model_name = metrics, scheduler, model_name

    def collect(self):
        return self.metrics.families(self.scheduler, self.model_name)
