"""Prometheus metrics on a private registry: HTTP traffic, tokens, and engine gauges read at scrape time."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# engine.metrics() key -> (metric name without the specdec_ prefix, help)
ENGINE_COUNTERS = {
    "steps": ("engine_steps", "Engine steps run"),
    "step_seconds": ("engine_step_seconds", "Seconds of engine steps, each from its start to its commit"),
    "eager_steps": ("engine_eager_steps", "Engine steps with a forward outside the fixed-shape (CUDA graph) path"),
    "eager_step_seconds": ("engine_eager_step_seconds", "Seconds of those eager engine steps"),
    "overlapped_steps": ("engine_overlapped_steps", "Engine steps scheduled and launched while the step before "
                                                    "them still ran on the device"),
    "drafts": ("spec_drafts", "Verify steps of a request that carried at least one draft token"),
    "draft_tokens": ("spec_draft_tokens", "Draft tokens proposed and verified"),
    "accepted_tokens": ("spec_accepted_tokens", "Draft tokens accepted"),
    "verify_steps": ("spec_verify_steps", "Per-request steps that produced tokens (with or without drafts)"),
    "preemptions": ("preemptions", "Requests preempted for lack of KV cache blocks"),
    "prefix_cache_hit_tokens": ("prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache"),
    "prefix_cache_query_tokens": ("prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache"),
    "eager_forwards": ("eager_forwards", "Target forwards outside the fixed-shape (CUDA graph) path"),
    "draft_eager_forwards": ("draft_eager_forwards", "Drafter forwards outside the fixed-shape path"),
}
ENGINE_GAUGES = {
    "kv_cache_usage": ("kv_cache_usage", "Fraction of KV cache blocks in use"),
    "draft_k": ("spec_draft_k", "Drafts per request chosen for the last step (0 = speculation off)"),
    "running": ("num_requests_running", "Requests being generated"),
    "waiting": ("num_requests_waiting", "Requests queued for admission"),
    "admission_batch": ("admission_batch", "Free sequence slots waited for before admitting queued requests"),
}

# present only with the remote speculator
REMOTE_COUNTERS = {
    "remote_requests": ("remote_draft_requests", "Requests sent to the /draft server"),
    "remote_failures": ("remote_draft_failures", "/draft requests that failed (each one an empty draft)"),
    "remote_timeouts": ("remote_draft_timeouts", "/draft requests that timed out"),
    "remote_fallbacks": ("remote_draft_fallbacks", "Pauses of speculation after consecutive /draft failures"),
    "remote_recoveries": ("remote_draft_recoveries", "Times the /draft server answered again after failing"),
}

# present only with a drafter (draft_forwards) or an EAGLE-3 / MTP head (speculate/eagle3.py: what its work runs
# ahead of the host, and where)
HEAD_COUNTERS = {
    "draft_forwards": ("spec_draft_forwards", "Forwards of the drafter or head that drafted"),
    "head_eager_forwards": ("head_eager_forwards", "Head forwards outside its fixed-shape (CUDA graph) path"),
    "head_observed_ahead": ("head_observed_ahead", "Steps whose head observe was queued before the host read their "
                                                   "acceptance"),
    "head_chains_ahead": ("head_chains_ahead", "Draft chains queued before the host read the last step's acceptance"),
    "head_chains_ahead_dropped": ("head_chains_ahead_dropped", "Chains queued ahead that the next step did not use"),
    "head_observes_without_logits": ("head_observes_without_logits", "Head observes of a step without drafts that "
                                                                     "skipped the head's logits"),
    "head_positions_kept": ("head_positions_kept", "Positions of steps without drafts kept by a sleeping head "
                                                   "instead of observed"),
    "head_wakes": ("head_wakes", "Forwards that fed a sleeping head's kept positions before a chain"),
}


class ServerMetrics:
    def __init__(self, engine_loop):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("specdec_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("specdec_request_latency_seconds", "HTTP request latency to the last byte",
                                 ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("specdec_generation_tokens", "Tokens generated", registry=r)
        r.register(_EngineCollector(engine_loop))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Reads the latest snapshot of `Engine.metrics()` the engine loop sent; never touches the engine itself."""

    def __init__(self, engine_loop):
        self.engine_loop = engine_loop

    def describe(self):
        return []  # the set of families is only known at collect time

    def collect(self):
        snap = self.engine_loop.snapshot
        for key, (name, doc) in ENGINE_COUNTERS.items():
            yield CounterMetricFamily(f"specdec_{name}", doc, value=snap.get(key, 0))
        for key, (name, doc) in ENGINE_GAUGES.items():
            yield GaugeMetricFamily(f"specdec_{name}", doc, value=snap.get(key, 0))
        for key, (name, doc) in {**REMOTE_COUNTERS, **HEAD_COUNTERS}.items():
            if key in snap:
                yield CounterMetricFamily(f"specdec_{name}", doc, value=snap[key])
        if "remote_fallback" in snap:
            yield GaugeMetricFamily("specdec_remote_draft_fallback", "1 while /draft is being left alone",
                                    value=float(bool(snap["remote_fallback"])))
        if "remote_failures_by_reason" in snap:
            yield _labelled_counter("specdec_remote_draft_failures_by_reason", "/draft requests that failed, by why",
                                    "reason", snap["remote_failures_by_reason"])
        per_pos = CounterMetricFamily("specdec_spec_accepted_per_position",
                                      "Draft tokens accepted at each position of a draft (0 = first)",
                                      labels=["position"])
        for pos, count in enumerate(snap.get("accepted_per_position", [])):
            per_pos.add_metric([str(pos)], count)
        yield per_pos
        yield CounterMetricFamily("specdec_engine_step_errors", "Engine steps that raised (their requests failed)",
                                  value=self.engine_loop.step_errors)
        yield CounterMetricFamily("specdec_request_aborts", "Requests aborted because their client went away",
                                  value=self.engine_loop.aborted)
        yield GaugeMetricFamily("specdec_engine_alive", "1 while the engine runs",
                                value=1.0 if self.engine_loop.alive else 0.0)
        peak = GaugeMetricFamily("specdec_peak_memory_bytes", "Peak memory: device (GPU) allocations, host RSS",
                                 labels=["kind"])
        for kind, value in self.engine_loop.peak_memory().items():
            peak.add_metric([kind], value)
        yield peak


def _labelled_counter(name: str, doc: str, label: str, counts: dict) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for value, count in counts.items():
        family.add_metric([value], count)
    return family

