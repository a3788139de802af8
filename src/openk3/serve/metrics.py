"""/metrics: the server's Prometheus series (prometheus_client, text format), one registry per app.

Read from the engine at each scrape (counters and gauges): openk3_requests_received_total and
openk3_requests_finished_total{reason} (engine requests: one per choice), openk3_prompt_tokens_total,
openk3_generation_tokens_total, openk3_engine_steps_total, openk3_engine_step_seconds_total (wall time inside the
engine's steps), openk3_engine_slowest_step_seconds, openk3_engine_prefill_forwards_total (batched prefill
forwards), openk3_engine_preemptions_total (sequences preempted for want of latent pages), openk3_queue_requests,
openk3_running_requests, openk3_memory_bytes{part} (weights, latent_pages, kda_states, cuda_graphs),
openk3_prefix_cache_queried_tokens_total, openk3_prefix_cache_hit_tokens_total,
openk3_prefix_cache_evicted_pages_total, openk3_prefix_cache_dropped_checkpoints_total, openk3_prefix_cache_utilisation,
and with --speculative (0 otherwise) openk3_spec_decode_drafts_total (verifications, one per sequence and round),
openk3_spec_decode_draft_tokens_total and openk3_spec_decode_accepted_tokens_total (vLLM's acceptance length is
1 + accepted / drafts), openk3_spec_decode_steps_total{k} (decode steps by the drafts per round chosen for them,
k="0": plain steps) and, with --speculative auto, openk3_spec_decode_accepted_average (the policy's moving average of
accepted drafts per verification; 0 until measured).
Observed per request from the engine's event times (histograms): openk3_time_to_first_token_seconds (from the
request's arrival at the API to its first token, of any choice), openk3_inter_token_latency_seconds (between
consecutive tokens of one choice) and openk3_e2e_request_latency_seconds (arrival to the last choice's end, for
requests whose every choice ended with "stop" or "length").
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from openk3.serve.scheduler import RequestEvent

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class EngineCollector(Collector):
    """The engine's counters and gauges, read when /metrics is scraped (from its snapshot: `Engine.snapshot`, through
    openk3.serve.core)."""

    def __init__(self, core):
        self.core = core

    def collect(self):
        snap = self.core.snapshot()
        m, stats = snap["metrics"], snap["cache_stats"]
        finished = CounterMetricFamily("openk3_requests_finished", "Engine requests finished, by reason.",
                                       labels=["reason"])
        for reason, count in sorted(m.requests_finished.items()):
            finished.add_metric([reason], count)
        yield finished
        steps = CounterMetricFamily("openk3_spec_decode_steps", "Decode steps by the drafts per round chosen for them "
                                    "(0: plain decoding).", labels=["k"])
        for k, count in sorted(m.spec_steps.items()):
            steps.add_metric([str(k)], count)
        yield steps
        counters = [
            ("requests_received", "Engine requests accepted (one per choice).", m.requests_received),
            ("prompt_tokens", "Prompt tokens of admitted requests.", m.prompt_tokens),
            ("generation_tokens", "Generated tokens.", m.generation_tokens),
            ("engine_steps", "Engine steps.", m.steps),
            ("engine_step_seconds", "Wall time of the engine's steps.", m.step_seconds),
            ("engine_prefill_forwards", "Batched prefill forwards.", m.prefill_forwards),
            ("engine_preemptions", "Running sequences sent back to the queue for want of latent pages.",
             m.preemptions),
            ("prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache.",
             stats.queried_tokens if stats else 0),
            ("prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.",
             stats.hit_tokens if stats else 0),
            ("prefix_cache_evicted_pages", "Prefix-cache pages dropped from the cache (from its lowest tier).",
             stats.evicted_pages if stats else 0),
            ("prefix_cache_dropped_checkpoints", "Mid-turn KDA checkpoints dropped to make room in the prefix cache.",
             stats.dropped_checkpoints if stats else 0),
            ("spec_decode_drafts", "Speculative verifications (per sequence and round).", m.spec_drafts),
            ("spec_decode_draft_tokens", "Tokens proposed by the draft model.", m.spec_draft_tokens),
            ("spec_decode_accepted_tokens", "Drafted tokens the target accepted.", m.spec_accepted_tokens),
        ]
        gauges = [
            ("engine_slowest_step_seconds", "The longest engine step so far.", m.slowest_step_seconds),
            ("queue_requests", "Requests waiting for admission.", snap["waiting"]),
            ("running_requests", "Requests being prefilled or decoded.", snap["running"]),
            ("prefix_cache_utilisation", "Used fraction of the prefix cache's device tier.", snap["cache_utilisation"]),
            ("spec_decode_accepted_average", "The speculation policy's moving average of accepted drafts per "
             "verification.", m.spec_accepted_average or 0.0),
        ]
        for name, text, value in counters:
            yield CounterMetricFamily(f"openk3_{name}", text, value=value)
        memory = GaugeMetricFamily("openk3_memory_bytes", "Device memory held by the engine, by part.",
                                   labels=["part"])
        for part, nbytes in snap["memory"].items():
            memory.add_metric([part], nbytes)
        yield memory
        for name, text, value in gauges:
            yield GaugeMetricFamily(f"openk3_{name}", text, value=value)


class LoopHistogram(Collector):
    """A Prometheus histogram observed on the event loop alone, so without a lock: prometheus_client's Histogram
    takes one per observation and walks its buckets, ~4 us paid for every streamed token by the inter-token
    latency (bench/api_host.py). A scrape reads the counts as they stand; the count is the +Inf bucket's."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]):
        self.name, self.documentation = name, documentation
        self.bounds = (*buckets, float("inf"))
        self.counts = [0] * len(self.bounds)  # per bucket, not cumulative
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1  # the first bound >= amount: Prometheus's "le"
        self.sum += amount

    def collect(self):
        buckets = [(floatToGoString(b), n) for b, n in zip(self.bounds, accumulate(self.counts))]
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=self.sum)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, core):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(core))
        self.ttft = LoopHistogram("openk3_time_to_first_token_seconds",
                                  "From a request's arrival to its first token.", TTFT_BUCKETS)
        self.itl = LoopHistogram("openk3_inter_token_latency_seconds", "Between consecutive tokens of one choice.",
                                 ITL_BUCKETS)
        self.e2e = LoopHistogram("openk3_e2e_request_latency_seconds", "From a request's arrival to its end.",
                                 E2E_BUCKETS)
        for histogram in (self.ttft, self.itl, self.e2e):
            self.registry.register(histogram)

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self, arrival: float, choices: int) -> RequestTimer:
        return RequestTimer(self, arrival, choices)


class RequestTimer:
    """Feeds the histograms from one request's engine events (their `at` and token counts)."""

    def __init__(self, metrics: ServerMetrics, arrival: float, choices: int):
        self.metrics, self.arrival = metrics, arrival
        self.first_token = False
        self.tokens = [0] * choices
        self.last_token_at: list[float | None] = [None] * choices

    def observe(self, index: int, event: RequestEvent) -> None:
        new = event.completion_tokens - self.tokens[index]
        if new > 0:
            if not self.first_token:
                self.metrics.ttft.observe(event.at - self.arrival)
                self.first_token = True
            if self.last_token_at[index] is not None:
                for _ in range(new):
                    self.metrics.itl.observe((event.at - self.last_token_at[index]) / new)
            self.tokens[index], self.last_token_at[index] = event.completion_tokens, event.at

    def finish(self, at: float, reasons: list[str | None]) -> None:
        if all(reason in ("stop", "length") for reason in reasons):
            self.metrics.e2e.observe(at - self.arrival)
