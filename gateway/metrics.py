"""Prometheus metrics of one gateway (its own registry, so several gateways
in one process -- tests -- do not collide).

Every label value comes from a bounded set the server defines, never from
what a client sends: requests are counted by route *template*
(``/v1/sessions/{sid}/variables/{vid}``), a path that matches no route as
one ``<unmatched>`` label.  Labelled by raw path, 11,000 unauthenticated 404s
on ``/v1/sessions/<random>`` grew the page to 354 MB (each scrape stalled the
server 2.4-3.8 s) and showed other clients' session and variable ids to
whoever read ``/metrics``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Optional, Pattern, Tuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the route)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.routing import BaseRoute, Mount, Route, compile_path

from ..engine_ext.replicas import ROUTE_REASONS, engine_stats

if TYPE_CHECKING:  # the seams' types (imports for annotations only)
    from ..engine_ext.protocol import Engine

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
#: How a prompt token's KV can already exist (``interlace_prefill_tokens_saved``'s label):
#: the engine's prefix cache, a retained context adopted by a client-side tool call's follow-up
#: (gateway/retention.py), a fork's parent (Semantic Variables' shared prefixes).
SAVED_BY = ("prefix_cache", "retention", "fork")
#: The endpoint label of a path no route matches.
UNMATCHED = "<unmatched>"


def route_templates(routes: Iterable[BaseRoute], prefix: str = "") -> Iterator[str]:
    """The full path template of every route, mounted groups included (``/v1/sessions/{sid}``)."""
    for r in routes:
        if isinstance(r, Mount):
            yield from route_templates(r.routes, prefix + r.path)
        elif isinstance(r, Route):
            yield prefix + r.path


class RouteLabels:
    """A request path to the template of the route that serves it, else :data:`UNMATCHED`:
    the label set is the route table, whatever paths clients send."""

    def __init__(self, routes: Iterable[BaseRoute]):
        self.patterns: List[Tuple[Pattern[str], str]] = []
        for template in dict.fromkeys(route_templates(routes)):
            self.patterns.append((compile_path(template)[0], template))

    def label(self, path: str) -> str:
        return next((template for regex, template in self.patterns if regex.match(path)), UNMATCHED)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        #: the gateway's route table (:meth:`bind_routes`); until bound, endpoints are counted as given
        self.routes: Optional[RouteLabels] = None
        r = self.registry
        self.requests = Counter("interlace_requests", "HTTP API requests", ["endpoint", "model", "status"],
                                registry=r)
        self.tokens = Counter("interlace_tokens", "Tokens processed", ["model", "kind"], registry=r)
        self.ttft = Histogram("interlace_time_to_first_token_seconds",
                              "Time from a request's arrival to its first token (content or tool call)", ["model"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_saved_tokens = Counter(
            "interlace_prefill_tokens_saved", "Prompt tokens served from KV that already existed instead of "
            "prefilled (usage.prompt_tokens_details.cached_tokens), by mechanism", ["model", "mechanism"],
            registry=r)
        self.tool_calls = Counter("interlace_tool_calls", "Server-side tool calls", ["tool", "outcome"],
                                  registry=r)
        self.tool_latency = Histogram("interlace_tool_latency_seconds", "Tool call latency (start to result)",
                                      ["tool"], buckets=LATENCY_BUCKETS, registry=r)
        self.kv_blocks = Gauge("interlace_kv_blocks_in_use", "KV cache blocks in use", ["model"], registry=r)
        self.kv_blocks_total = Gauge("interlace_kv_blocks_total", "KV cache blocks", ["model"], registry=r)
        self.engine_threads = Gauge("interlace_engine_threads", "CPU threads the model's native engine steps run "
                                    "on now (adapted to the free cores; summed over replicas)", ["model"], registry=r)
        # per engine replica (engine_ext/replicas.py; an engine alone is replica "0"), read at scrape time
        self.replicas = ReplicaCollector()
        r.register(self.replicas)
        self.pins = PinCollector()
        r.register(self.pins)
        self.capacity = CapacityCollector()
        r.register(self.capacity)
        # client-side tool calls: contexts retained for the follow-up request (gateway/retention.py)
        self.retention_hits = Counter("interlace_retention_hits", "Requests that adopted a retained context",
                                      ["model"], registry=r)
        self.retention_misses = Counter("interlace_retention_misses", "Requests with no retained context to adopt",
                                        ["model"], registry=r)
        self.retention_evictions = Counter("interlace_retention_evictions", "Retained contexts freed unused",
                                           ["model", "reason"], registry=r)
        self.retention_contexts = Gauge("interlace_retention_contexts", "Contexts retained now", ["model"],
                                        registry=r)
        self.retention_tokens = Gauge("interlace_retention_tokens", "Tokens of the contexts retained now",
                                      ["model"], registry=r)

        # Semantic Variables (gateway/semantic/graph.py)
        self.sessions = Gauge("interlace_sessions", "Semantic Variables sessions open now", registry=r)
        self.semantic_calls = Counter("interlace_semantic_calls", "Semantic calls finished", ["kind", "outcome"],
                                      registry=r)
        self.semantic_tokens = Counter(
            "interlace_semantic_prompt_tokens", "Prompt tokens of semantic calls: filled, or forked from a shared "
            "prefix context instead", ["model", "kind"], registry=r)

    def watch_engine(self, model: str, engine: Engine) -> None:
        """KV blocks of ``model``'s engine (all its live replicas) and its per-replica metrics,
        read from the engine's load stats when scraped."""
        self.kv_blocks.labels(model).set_function(lambda: _stat(engine, "kv_blocks_used"))
        self.kv_blocks_total.labels(model).set_function(lambda: _stat(engine, "kv_blocks_total"))
        self.engine_threads.labels(model).set_function(lambda: _stat(engine, "threads"))
        self.replicas.engines.append((model, engine))
        self.pins.engines.append((model, engine))
        self.capacity.engines.append((model, engine))

    def bind_routes(self, routes: Iterable[BaseRoute]) -> None:
        """Count requests by the templates of ``routes`` (the application's route table)."""
        self.routes = RouteLabels(routes)

    def request(self, endpoint: str, model: str, status: int) -> None:
        """Count one answered request; ``endpoint`` may be the raw path: it is counted
        as its route's template (or :data:`UNMATCHED`) once :meth:`bind_routes` was called."""
        if self.routes is not None:
            endpoint = self.routes.label(endpoint)
        self.requests.labels(endpoint, model, str(int(status))).inc()

    def usage(self, model: str, usage: Dict[str, Any]) -> None:
        self.tokens.labels(model, "prompt").inc(usage.get("prompt_tokens", 0))
        self.tokens.labels(model, "completion").inc(usage.get("completion_tokens", 0))
        self.tokens.labels(model, "cached").inc((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))

    def tool_call(self, tool: str, ok: bool, seconds: float) -> None:
        self.tool_calls.labels(tool, "ok" if ok else "error").inc()
        self.tool_latency.labels(tool).observe(max(0.0, seconds))

    def retention_lookup(self, model: str, hit: bool) -> None:
        (self.retention_hits if hit else self.retention_misses).labels(model).inc()

    def prefill_saved(self, model: str, saved: Dict[str, int]) -> None:
        """Count prompt tokens not prefilled, by mechanism (:data:`SAVED_BY`; an engine's
        other keys are not labels: the label set stays the server's)."""
        for mechanism, tokens in saved.items():
            if mechanism in SAVED_BY and tokens > 0:
                self.prefill_saved_tokens.labels(model, mechanism).inc(tokens)

    def retention_evicted(self, model: str, reason: str) -> None:
        self.retention_evictions.labels(model, reason).inc()

    def retention_held(self, model: str, contexts: int, tokens: int) -> None:
        self.retention_contexts.labels(model).set(contexts)
        self.retention_tokens.labels(model).set(tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _stat(engine: Any, key: str) -> int:
    """One number of :func:`engine_stats`; engines without stats: their block manager, else 0."""
    st = engine_stats(engine)
    if st is not None:
        return int(st.get(key, 0) or 0)
    blocks = getattr(engine, "blocks", None)
    if blocks is None:
        return 0
    return int(blocks.num_used if key == "kv_blocks_used" else blocks.num_blocks if key == "kv_blocks_total" else 0)


def replica_states(engine: Any) -> List[Dict[str, Any]]:
    """``engine.replica_states()`` of a replica set; an engine alone is one replica named "0"."""
    fn = getattr(engine, "replica_states", None)
    if callable(fn):
        return fn()
    alive = bool(getattr(engine, "alive", True))
    stats = engine_stats(engine) if alive else None
    if stats is None and alive and getattr(engine, "blocks", None) is not None:
        stats = {"kv_blocks_used": _stat(engine, "kv_blocks_used"), "kv_blocks_total": _stat(engine, "kv_blocks_total")}
    return [{"name": "0", "alive": alive, "contexts": (stats or {}).get("contexts", 0), "stats": stats, "routed": {}}]


class ReplicaCollector:
    """``interlace_replica_*``: whether each replica is up, its KV blocks, queued tokens,
    capacity in force, active tokens, requests held by the cap and contexts, and the new
    contexts routed to it by reason (:data:`~..engine_ext.replicas.ROUTE_REASONS`)."""

    GAUGES: Tuple[Tuple[str, str, str], ...] = (
        ("interlace_replica_kv_blocks_in_use", "KV cache blocks in use on the replica", "kv_blocks_used"),
        ("interlace_replica_kv_blocks_total", "KV cache blocks of the replica", "kv_blocks_total"),
        ("interlace_replica_queued_tokens", "Tokens the replica has queued to compute", "queued_tokens"),
        ("interlace_replica_capacity_tokens", "Token capacity in force on the replica now (Parrot's capacity "
         "regulation; 0: none but memory)", "capacity_tokens"),
        ("interlace_replica_active_tokens", "Context tokens of the replica's requests with work (running or "
         "waiting to run)", "active_tokens"),
        ("interlace_replica_capacity_held", "Requests the replica's capacity cap held back at its last step",
         "capacity_held"),
    )

    def __init__(self) -> None:
        self.engines: List[Tuple[str, Any]] = []  # (model name, engine)

    def describe(self) -> Iterator[Any]:
        return iter(())  # names are known only when collected (no clash check at registration)

    def collect(self) -> Iterator[Any]:
        labels = ["model", "replica"]
        up = GaugeMetricFamily("interlace_replica_up", "Whether the engine replica serves (1) or is gone (0)",
                               labels=labels)
        gauges = [(GaugeMetricFamily(name, doc, labels=labels), key) for name, doc, key in self.GAUGES]
        contexts = GaugeMetricFamily("interlace_replica_contexts", "Contexts held on the replica", labels=labels)
        routed = CounterMetricFamily("interlace_replica_routed", "New contexts placed on the replica, by reason",
                                     labels=["model", "replica", "reason"])
        for model, engine in self.engines:
            for st in replica_states(engine):
                name, stats = st["name"], st.get("stats") or {}
                up.add_metric([model, name], 1.0 if st["alive"] else 0.0)
                for family, key in gauges:
                    family.add_metric([model, name], float(stats.get(key, 0) or 0))
                contexts.add_metric([model, name], float(st.get("contexts", 0) or 0))
                for reason in ROUTE_REASONS:
                    routed.add_metric([model, name, reason], float((st.get("routed") or {}).get(reason, 0)))
        yield up
        for family, _ in gauges:
            yield family
        yield contexts
        yield routed


class PinCollector:
    """Pins of engines that keep paused or retained contexts' KV in a cache
    that is not Interlace's own (vLLM: engine_ext/vllm/pins.py), read from
    the engine's load stats when scraped (the ``pinned_blocks``, ``pinned``,
    ``pin_<outcome>`` and ``recomputed_after_resume`` keys; an engine
    without them has no such metrics) -- the counts of the engine core's
    last answer, each read asking for the next, so a scrape never waits on
    the engine."""

    OUTCOMES = (("hits", "hit"), ("expired", "expired"), ("dropped", "dropped"), ("discarded", "discarded"),
                ("misses", "miss"))

    def __init__(self) -> None:
        self.engines: List[Tuple[str, Any]] = []

    def describe(self) -> Iterator[Any]:
        return iter(())

    def collect(self) -> Iterator[Any]:
        blocks = GaugeMetricFamily("interlace_pinned_kv_blocks", "KV blocks held by paused or retained contexts "
                                   "waiting for their resume or follow-up", labels=["model"])
        held = GaugeMetricFamily("interlace_pinned_contexts", "Paused or retained contexts holding KV now",
                                 labels=["model"])
        outcomes = CounterMetricFamily(
            "interlace_pins", "Pins by outcome: hit (resumed on its KV), expired (its TTL passed), dropped (over "
            "the pin budget, or running requests needed the blocks), discarded (the interception policy released "
            "it at the call), miss (resumed after a release)", labels=["model", "outcome"])
        recomputed = CounterMetricFamily("interlace_resume_recomputed_tokens", "Tokens of paused contexts "
                                         "computed again at their resume", labels=["model"])
        for model, engine in self.engines:
            st = engine_stats(engine) or {}
            if "pinned_blocks" not in st:
                continue
            blocks.add_metric([model], float(st.get("pinned_blocks", 0)))
            held.add_metric([model], float(st.get("pinned", 0)))
            for key, label in self.OUTCOMES:
                outcomes.add_metric([model, label], float(st.get(f"pin_{key}", 0)))
            recomputed.add_metric([model], float(st.get("recomputed_after_resume", 0)))
        yield blocks
        yield held
        yield outcomes
        yield recomputed


class CapacityCollector:
    """Parrot's capacity regulation per model (engine_ext/policies/capacity.py), read
    from its replicas' load stats when scraped, summed over the live ones (one engine:
    its own numbers): ``interlace_capacity_tokens`` (the cap in force now: the latency
    cap while latency-critical work runs, else the throughput cap; 0: none but memory,
    on some replica -- as ``ReplicaSet.load_stats`` sums it),
    ``interlace_capacity_active_tokens``, ``interlace_capacity_latency_requests``,
    ``interlace_capacity_held_requests`` (held back by the cap at the last step) and
    ``interlace_capacity_configured_tokens`` by objective (the configured caps; 0: none).
    An engine whose stats lack ``capacity_tokens`` (a remote server) has none of them."""

    #: (metric, help, load-stats key), summed over replicas
    GAUGES: Tuple[Tuple[str, str, str], ...] = (
        ("interlace_capacity_tokens", "Token capacity in force now (Parrot's capacity regulation: the latency cap "
         "while latency-critical work runs, else the throughput cap; 0: none but memory), summed over replicas "
         "(0 if one has none)",
         "capacity_tokens"),
        ("interlace_capacity_active_tokens", "Context tokens of the requests with work (running or waiting to run)",
         "active_tokens"),
        ("interlace_capacity_latency_requests", "Latency-critical requests with work", "latency_running"),
        ("interlace_capacity_held_requests", "Requests held back by the capacity cap at the last step (their KV "
         "kept)", "capacity_held"),
    )
    CONFIGURED = (("latency", "capacity_latency_tokens"), ("throughput", "capacity_throughput_tokens"))

    def __init__(self) -> None:
        self.engines: List[Tuple[str, Any]] = []

    def describe(self) -> Iterator[Any]:
        return iter(())

    def collect(self) -> Iterator[Any]:
        gauges = [(GaugeMetricFamily(name, doc, labels=["model"]), key) for name, doc, key in self.GAUGES]
        configured = GaugeMetricFamily("interlace_capacity_configured_tokens", "The configured capacity caps by "
                                       "objective (0: none)", labels=["model", "objective"])
        for model, engine in self.engines:
            stats = [st["stats"] for st in replica_states(engine)
                     if st["alive"] and "capacity_tokens" in (st.get("stats") or {})]
            if not stats:
                continue
            for family, key in gauges:
                values = [int(st.get(key, 0) or 0) for st in stats]
                if key == "capacity_tokens" and not all(values):  # a replica with no cap: none for the model
                    values = [0]
                family.add_metric([model], float(sum(values)))
            for objective, key in self.CONFIGURED:
                configured.add_metric([model, objective], float(max(int(st.get(key, 0) or 0) for st in stats)))
        for family, _ in gauges:
            yield family
        yield configured
