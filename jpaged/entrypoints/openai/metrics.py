"""Prometheus metrics of the HTTP server, under vLLM's names.

Routers (llm-d's inference gateway, Ray Serve, KServe autoscalers) pick a
replica from vLLM's metric names: queue depth, running requests and KV cache
usage.  Exporting the same names with the same meaning lets them drive jpaged
unchanged.  Each app has its own CollectorRegistry, so several servers in one
process (tests) do not clash.

Histograms and token counters are updated by the engine thread as tokens come
out (prometheus_client is thread-safe); gauges and the engine's cumulative
counters come from the snapshot the engine thread takes after every step, read
at scrape time by a custom collector.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from jpaged.core.stats import EngineSnapshot
from jpaged.engine.async_engine import EngineMetrics, EngineRequest
from jpaged.core.lora_adapters import adapter_name_error

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's buckets (seconds), so that dashboards built for vLLM read these too.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics(EngineMetrics):
    """The server's metrics registry; the engine thread reports into it."""

    def __init__(self, model_name: str, block_size: int, enable_prefix_caching: bool = True,
                 num_replicas: int = 1):
        self.model_name = model_name
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_replicas = num_replicas  # data-parallel pools, each with its null block
        self.snapshot = EngineSnapshot()  # the engine's, once it runs (num_blocks 0 before)
        self.registry = CollectorRegistry()
        label = {"registry": self.registry, "labelnames": ["model_name"]}
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (arrival to "
                              "the step that produced it).", buckets=TTFT_BUCKETS, **label)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between consecutive tokens "
                             "of a sample.", buckets=ITL_BUCKETS, **label)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to the last token.",
                             buckets=E2E_BUCKETS, **label)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of admitted requests.", **label)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", **label)
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                       registry=self.registry, labelnames=["model_name", "finished_reason"])
        self.registry.register(_SnapshotCollector(self))

    # Called by the engine thread.
    def on_admitted(self, request: EngineRequest) -> None:
        self.prompt_tokens.labels(self.model_name).inc(len(request.prompt_token_ids))

    def on_tokens(self, request: EngineRequest, num_tokens: int, gap: float | None, first: bool) -> None:
        self.generation_tokens.labels(self.model_name).inc(num_tokens)
        first_token_time = request.first_token_time
        if first and first_token_time is not None:
            self.ttft.labels(self.model_name).observe(first_token_time - request.arrival_time)
        if gap is not None:
            self.itl.labels(self.model_name).observe(gap)

    def on_finished(self, request: EngineRequest, reasons: list[str | None], now: float) -> None:
        reason = "error" if "error" in reasons else "abort" if "abort" in reasons else reasons[0]
        self.request_success.labels(self.model_name, reason).inc()
        if reason in ("stop", "length"):
            self.e2e.labels(self.model_name).observe(now - request.arrival_time)

    def on_snapshot(self, snapshot: EngineSnapshot) -> None:
        self.snapshot = snapshot  # one reference swap: a scrape sees one whole snapshot

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SnapshotCollector(Collector):
    """Gauges and engine counters from the latest snapshot, at scrape time."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator:
        m, snap = self.metrics, self.metrics.snapshot
        name = [m.model_name]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric(name, value)
            return g

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric(name, value)
            return c

        yield gauge("vllm:num_requests_running", "Requests with a sample in the running batch.", snap.running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to start (or preempted by recompute).",
                    snap.waiting)
        yield gauge("vllm:num_requests_swapped", "Requests preempted to host memory.", snap.swapped)
        # Block 0 of each pool is the null block, never handed out.
        usable = snap.num_blocks - m.num_replicas if snap.num_blocks else 0
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).",
                    snap.used_blocks / usable if usable else 0.0)
        info = GaugeMetricFamily("vllm:cache_config_info", "KV cache configuration.",
                                 labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"])
        info.add_metric([str(m.block_size), str(snap.num_blocks), str(m.enable_prefix_caching)], 1)
        yield info
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      snap.totals.prompt_tokens)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      snap.totals.cached_prompt_tokens)
        yield counter("vllm:num_preemptions", "Preemptions (recompute and swap).", snap.totals.preemptions)
        # Speculative decoding: acceptance rate = accepted / draft tokens; mean
        # accepted length = 1 + accepted / drafts.
        yield counter("vllm:spec_decode_num_drafts", "Rows that verified draft tokens.",
                      snap.totals.spec_decode_num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.",
                      snap.totals.spec_decode_num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      snap.totals.spec_decode_num_accepted_tokens)
        if snap.totals.expert_load is not None:  # a mixture-of-experts model
            yield expert_load_counter(m.model_name, snap.totals.expert_load)


def expert_load_counter(model_name: str, load: Any) -> CounterMetricFamily:
    """`jpaged:moe_expert_tokens`, tokens routed to each expert since the engine
    started, labelled by MoE layer (i: the model's i-th layer with experts) and expert."""
    c = CounterMetricFamily("jpaged:moe_expert_tokens", "Tokens routed to each expert (padding not counted).",
                            labels=["model_name", "moe_layer", "expert"])
    for layer, row in enumerate(load):
        for expert, tokens in enumerate(row):
            c.add_metric([model_name, str(layer), str(expert)], int(tokens))
    return c


class LoraRequestsInfo(Collector):
    """vLLM's `vllm:lora_requests_info` (when adapters are on): its labels name the
    adapters of the requests running and waiting, comma-joined, and the slots
    (max_lora); its value is the time.  llm-d's gateway routes by it (LoRA
    affinity).  Read from the server's requests in flight (`runs()`) at scrape
    time, on the event loop that owns them."""

    def __init__(self, runs: Callable[[], Iterable[Any]], max_lora: int):
        self.runs, self.max_lora = runs, max_lora

    def collect(self) -> Iterator[GaugeMetricFamily]:
        running, waiting = set(), set()
        for run in list(self.runs()):
            lora = run.gen.params.lora
            for request in run.submission.requests if lora is not None else ():
                if not request.finished:
                    (waiting if request.queued else running).add(lora)
        info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        info.add_metric([str(self.max_lora), adapter_label(running), adapter_label(waiting)], time.time())
        yield info


def adapter_label(names: Iterable[str]) -> str:
    """Adapter names comma-joined, as vLLM's label holds them.  The adapter name rule
    (jpaged.loading.peft) has no ",": a name that broke it could forge other names in
    the label, so one is left out rather than joined."""
    names = sorted(names)
    assert all("," not in n for n in names if adapter_name_error(n) is None)  # (the rule's own promise)
    return ",".join(n for n in names if adapter_name_error(n) is None)
