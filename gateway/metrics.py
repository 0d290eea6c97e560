"""Prometheus metrics of one gateway (its own registry, so several gateways
in one process -- tests -- do not collide)."""

from __future__ import annotations

from typing import Callable, Dict

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the route)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("interlace_requests", "HTTP API requests", ["endpoint", "model", "status"],
                                registry=r)
        self.tokens = Counter("interlace_tokens", "Tokens processed", ["model", "kind"], registry=r)
        self.ttft = Histogram("interlace_time_to_first_token_seconds", "Time to first token", ["model"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tool_calls = Counter("interlace_tool_calls", "Server-side tool calls", ["tool", "outcome"],
                                  registry=r)
        self.tool_latency = Histogram("interlace_tool_latency_seconds", "Tool call latency (start to result)",
                                      ["tool"], buckets=LATENCY_BUCKETS, registry=r)
        self.kv_blocks = Gauge("interlace_kv_blocks_in_use", "KV cache blocks in use", ["model"], registry=r)
        self.kv_blocks_total = Gauge("interlace_kv_blocks_total", "KV cache blocks", ["model"], registry=r)

    def watch_engine(self, model: str, used: Callable[[], int], total: int) -> None:
        self.kv_blocks.labels(model).set_function(used)
        self.kv_blocks_total.labels(model).set(total)

    def request(self, endpoint: str, model: str, status: int) -> None:
        self.requests.labels(endpoint, model, str(status)).inc()

    def usage(self, model: str, usage: Dict[str, int]) -> None:
        self.tokens.labels(model, "prompt").inc(usage.get("prompt_tokens", 0))
        self.tokens.labels(model, "completion").inc(usage.get("completion_tokens", 0))

    def tool_call(self, tool: str, ok: bool, seconds: float) -> None:
        self.tool_calls.labels(tool, "ok" if ok else "error").inc()
        self.tool_latency.labels(tool).observe(max(0.0, seconds))

    def render(self) -> bytes:
        return generate_latest(self.registry)
