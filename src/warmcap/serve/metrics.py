"""One server's Prometheus registry: vLLM's request series plus warmcap's start-up facts.

Counters and histograms are fed by the engine loop as requests progress; the spec-decode counters
are read from the engine at scrape time (:class:`warmcap.metrics.SpecDecodeCollector`). Every server
has its own :class:`CollectorRegistry`, so two servers in one process never share a series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from warmcap.metrics import SpecDecodeCollector, SpecDecodeMetrics
from warmcap.serve.startup_facts import StartupFacts

if TYPE_CHECKING:
    from warmcap.audit.serving import ServingAuditCounts

# vLLM's latency buckets, trimmed to what a CPU or one GPU sees.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0)


class ServingMetrics:
    """The series one server exposes at ``/metrics``, all labelled with ``model_name``."""

    def __init__(
        self,
        model_name: str,
        spec_source: Callable[[], SpecDecodeMetrics],
        num_spec_positions: int,
        audit_source: Callable[[], ServingAuditCounts | None] = lambda: None,
    ) -> None:
        self.registry = CollectorRegistry()
        reg, label = self.registry, ["model_name"]
        self._model = model_name
        self.running = Gauge(
            "vllm:num_requests_running", "Requests in the running batch.", label, registry=reg
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled.", label, registry=reg
        )
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = all).", label, registry=reg
        )
        self.max_batched = Gauge(
            "warmcap:max_num_requests_per_step",
            "Most requests that gained tokens in one engine step since start-up (continuous batching).",
            label,
            registry=reg,
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefilled prompt tokens.", label, registry=reg)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", label, registry=reg)
        self.request_success = Counter(
            "vllm:request_success",
            "Requests that ended, by finish reason (stop, length, abort).",
            [*label, "finished_reason"],
            registry=reg,
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Seconds from arrival to the first generated token.",
            label,
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Seconds from arrival to the last token.",
            label,
            buckets=_E2E_BUCKETS,
            registry=reg,
        )
        self.phase_seconds = Gauge(
            "warmcap:startup_phase_seconds",
            "Seconds spent in each start-up phase.",
            [*label, "phase"],
            registry=reg,
        )
        self.graphs_captured = Gauge(
            "warmcap:graphs_captured", "Graphs captured at start-up.", label, registry=reg
        )
        self.graphs_verified = Gauge(
            "warmcap:graphs_verified", "Captured graphs whose replay matched eager.", label, registry=reg
        )
        self.audit_slots = Gauge(
            "warmcap:warmup_audit_slots_checked", "KV slots the warmup audit checked.", label, registry=reg
        )
        self.audit_violations = Gauge(
            "warmcap:warmup_audit_violations", "Stray KV writes the warmup audit found.", label, registry=reg
        )
        self.ready = Gauge(
            "warmcap:ready", "1 once start-up finished clean and requests are served.", label, registry=reg
        )
        reg.register(SpecDecodeCollector(spec_source, {"model_name": model_name}, num_spec_positions))
        reg.register(_ServingAuditCollector(audit_source, model_name))
        self._most_batched = 0
        for gauge in (self.running, self.waiting, self.kv_usage, self.max_batched, self.ready):
            gauge.labels(model_name).set(0)

    def observe_step(self, *, num_running: int, num_waiting: int, kv_usage: float, num_batched: int) -> None:
        """After each engine step: queue lengths, KV usage and how many requests the step advanced."""
        self.running.labels(self._model).set(num_running)
        self.waiting.labels(self._model).set(num_waiting)
        self.kv_usage.labels(self._model).set(kv_usage)
        if num_batched > self._most_batched:
            self._most_batched = num_batched
            self.max_batched.labels(self._model).set(num_batched)

    def observe_tokens(self, *, prompt: int = 0, generated: int = 0) -> None:
        if prompt:
            self.prompt_tokens.labels(self._model).inc(prompt)
        if generated:
            self.generation_tokens.labels(self._model).inc(generated)

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.labels(self._model).observe(seconds)

    def observe_end(self, reason: str, e2e_seconds: float | None) -> None:
        """A request ended (``reason``: stop, length or abort); latency only for a finished one."""
        self.request_success.labels(self._model, reason).inc()
        if e2e_seconds is not None:
            self.e2e.labels(self._model).observe(e2e_seconds)

    def set_startup(self, facts: StartupFacts) -> None:
        for phase, seconds in facts.phase_seconds.items():
            self.phase_seconds.labels(self._model, phase).set(seconds)
        self.graphs_captured.labels(self._model).set(facts.graphs_captured)
        self.graphs_verified.labels(self._model).set(facts.graphs_verified)
        self.audit_slots.labels(self._model).set(facts.audit_slots_checked)
        self.audit_violations.labels(self._model).set(facts.audit_violations)

    def set_ready(self) -> None:
        self.ready.labels(self._model).set(1)

    def render(self) -> bytes:
        """The Prometheus text exposition of every series."""
        return generate_latest(self.registry)


class _ServingAuditCollector(Collector):
    """``--audit-serving``'s counts, read from the engine loop at every scrape (all 0, and
    ``warmcap:serving_audit_enabled`` 0, when the audit is off)."""

    def __init__(self, source: Callable[[], ServingAuditCounts | None], model_name: str) -> None:
        self._source = source
        self._model = model_name

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        counts = self._source()
        enabled = GaugeMetricFamily(
            "warmcap:serving_audit_enabled",
            "1 when every serving step's KV writes are audited.",
            labels=["model_name"],
        )
        enabled.add_metric([self._model], 0 if counts is None else 1)
        yield enabled
        values = (0, 0, 0) if counts is None else (counts.steps, counts.slots_checked, counts.violations)
        helps = (
            ("steps", "Serving steps whose KV writes were audited."),
            ("slots_checked", "KV slots the serving audit checked."),
            ("violations", "Serving steps the audit failed for a stray KV write (each ended its requests)."),
        )
        for (name, help_text), value in zip(helps, values, strict=True):
            family = CounterMetricFamily(f"warmcap:serving_audit_{name}", help_text, labels=["model_name"])
            family.add_metric([self._model], value)
            yield family
