"""The server's metrics in Prometheus' text format (through `prometheus_client`), named as vLLM
names them where it can.

Counters of tokens and speculation come straight from the scheduler's cumulative counters, read
when /metrics is scraped (a collector over them, in a registry of this server's own: nothing is
registered process-wide); the latency histograms are filled by `ServerMetrics.observe`, which the
scheduler calls (from its thread) for every finished request.

Who reads what. Server-wide counters move with every tenant's requests: prefix-cache hit tokens
would tell one tenant, scrape by scrape, how much of its guess matched a prompt in the cache if
the cache were shared, and the rest say when others are busy. So the families are in two views:
`render(..., tenant=None)` (the operator's: a server without keys or with one tenant, or the
metrics key) has them all, plus every tenant's own families labelled `tenant`; `render(...,
tenant=NAME)` (a tenant's key when there are several) has that tenant's own families alone:
its requests, tokens, prefix-cache hit tokens (its own partitions') and latencies.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from ..request import Delta, Request
from ..scheduler import BatchScheduler

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


@dataclass
class TenantFigures:
    """One tenant's own requests (what its key may read on /metrics)."""

    finished: dict[str, int] = field(default_factory=dict)  # finish_reason -> requests
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens from the prefix cache (its own partitions')
    generation_tokens: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))


class ServerMetrics:
    """Latency histograms per finished request, server-wide and per tenant (thread-safe: written
    by the scheduler thread)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.tpot = Histogram(LATENCY_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)
        self.queue = Histogram(LATENCY_BUCKETS)
        self.tenants: dict[str, TenantFigures] = {}

    def observe(self, request: Request, delta: Delta) -> None:
        with self._lock:
            mine = self.tenants.setdefault(request.tenant, TenantFigures())
            mine.finished[delta.finish_reason] = mine.finished.get(delta.finish_reason, 0) + 1
            if delta.usage is not None:
                mine.prompt_tokens += delta.usage.prompt_tokens
                mine.cached_tokens += delta.usage.cached_tokens
                mine.generation_tokens += delta.usage.completion_tokens
            if delta.timing is None or delta.finish_reason not in ("stop", "length"):
                return
            t = delta.timing
            mine.ttft.observe(t.ttft_s)
            mine.e2e.observe(t.e2e_s)
            self.ttft.observe(t.ttft_s)
            self.e2e.observe(t.e2e_s)
            self.queue.observe(t.queue_s)
            if t.tpot_s is not None:
                self.tpot.observe(t.tpot_s)

    def render(self, scheduler: BatchScheduler | None, model_name: str, tenant: str | None = None) -> str:
        """The text /metrics answers: every family (`tenant` None), or `tenant`'s own only."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Snapshot(self, scheduler, model_name, tenant))
        return generate_latest(registry).decode()

    def tenant_families(self, model_name: str, only: str | None):
        """Per-tenant families, labelled `tenant`: every tenant's, or `only`'s."""
        with self._lock:
            figures = {name: f for name, f in sorted(self.tenants.items()) if only is None or name == only}
            if only is not None and not figures:
                figures = {only: TenantFigures()}
            for name, help_text, value in (
                ("tenant_prompt_tokens_total", "Prompt tokens of the tenant's finished requests.",
                 lambda f: f.prompt_tokens),
                ("tenant_prefix_cache_hit_tokens_total",
                 "The tenant's prompt tokens that came from its own prefix-cache partitions.", lambda f: f.cached_tokens),
                ("tenant_generation_tokens_total", "Tokens generated for the tenant.", lambda f: f.generation_tokens),
            ):
                family = CounterMetricFamily(f"specdec:{name}", help_text, labels=["model_name", "tenant"])
                for tenant, f in figures.items():
                    family.add_metric([model_name, tenant], value(f))
                yield family
            family = CounterMetricFamily("specdec:tenant_request_success_total",
                                         "The tenant's finished requests by finish reason.",
                                         labels=["model_name", "tenant", "finished_reason"])
            for tenant, f in figures.items():
                for reason, n in sorted(f.finished.items()):
                    family.add_metric([model_name, tenant, reason], n)
            yield family
            for name, attr, help_text in (("tenant_time_to_first_token_seconds", "ttft", "Arrival to first token."),
                                          ("tenant_e2e_request_latency_seconds", "e2e", "Arrival to last token.")):
                family = HistogramMetricFamily(f"specdec:{name}", help_text, labels=["model_name", "tenant"])
                for tenant, f in figures.items():
                    hist = getattr(f, attr)
                    family.add_metric([model_name, tenant], hist.cumulative(), sum_value=hist.total)
                yield family

    def families(self, scheduler: BatchScheduler | None, model_name: str):
        """Every server-wide metric family as it stands now, each sample labelled with `model_name` first."""

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
            if scheduler.prefix_cache is not None:
                yield family(counter, "prefix_cache_cross_partition_hit_tokens_total",
                             "Prompt tokens copied from another tenant's or salt's prefix-cache entry (always 0).",
                             [({}, scheduler.prefix_cache.stats.cross_partition_hit_tokens)])
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

    def __init__(self, metrics: ServerMetrics, scheduler: BatchScheduler | None, model_name: str,
                 tenant: str | None):
        self.metrics, self.scheduler, self.model_name, self.tenant = metrics, scheduler, model_name, tenant

    def collect(self):
        if self.tenant is None:
            yield from self.metrics.families(self.scheduler, self.model_name)
        yield from self.metrics.tenant_families(self.model_name, self.tenant)
