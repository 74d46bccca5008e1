"""Prometheus metrics under SGLang's names (`sglang:*`, label `model_name`), so dashboards built
for an SGLang server read ours unchanged.

Request-level metrics (token counters, TTFT / ITL / end-to-end histograms) are recorded by the
server as streams progress; engine gauges are read at scrape time from the engine's latest
counters, so the hot path pays nothing for them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600)
ITL_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 60, 120, 300, 600, 1200, 2400, 3600)


class EngineGauges(Collector):
    def __init__(self, model_name: str, client):
        self.model_name = model_name
        self.client = client

    def collect(self):
        # counters and capacity added up over the engine replicas (--dp-size)
        stats, info, capacity = self.client.stats, self.client.info, self.client.capacity()
        pages_used = stats.get("pages_used", 0)
        num_pages = capacity["num_pages"] or 1
        values = {
            "num_running_reqs": ("Running requests.", stats.get("num_running_reqs", 0)),
            "num_queue_reqs": ("Requests waiting to be scheduled.", stats.get("num_queue_reqs", 0)),
            "num_used_tokens": ("KV cache tokens in use.", pages_used * info.get("page_size", 1)),
            "token_usage": ("Share of the KV cache in use.", pages_used / num_pages),
            "gen_throughput": ("Generated tokens per second (recent).", self.client.gen_throughput()),
            "cache_hit_rate": ("Share of prompt tokens taken from the prefix cache.",
                               stats.get("engine_cached_prompt_tokens", 0) / max(stats.get("engine_prompt_tokens", 0), 1)),
            "max_total_num_tokens": ("KV cache capacity in tokens.", capacity["max_total_num_tokens"]),
            "num_used_state_slots": ("Lightning state slots in use.", stats.get("slots_used", 0)),
        }
        if "avg_spec_accept_length" in stats:
            values["spec_accept_length"] = ("Average speculative accept length.", stats["avg_spec_accept_length"])
        for name, (doc, value) in values.items():
            g = GaugeMetricFamily(f"sglang:{name}", doc, labels=["model_name"])
            g.add_metric([self.model_name], float(value))
            yield g


class ServerMetrics:
    def __init__(self, model_name: str, client):
        self.registry = r = CollectorRegistry()
        label = ["model_name"]

        def counter(name, doc):
            return Counter(f"sglang:{name}", doc, label, registry=r).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(f"sglang:{name}", doc, label, buckets=buckets, registry=r).labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.requests = counter("num_requests", "Requests finished (any reason).")
        self.aborted = counter("num_aborted_requests", "Requests aborted (client gone, abort_request, error).")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency, arrival to last token.", E2E_BUCKETS)
        r.register(EngineGauges(model_name, client))

    def on_tokens(self, n: int, gap: float, first: bool) -> None:
        """`n` new tokens arrived `gap` seconds after the previous ones (or the arrival)."""
        if first:
            self.ttft.observe(gap)
            return
        for _ in range(n):
            self.itl.observe(gap / n)

    def on_finish(self, prompt_tokens: int, completion_tokens: int, e2e: float, aborted: bool) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.requests.inc()
        self.e2e.observe(e2e)
        if aborted:
            self.aborted.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
