"""The served models, and how their engines are built from the configuration.

:class:`ModelServer` is one model as both wings see it (the OpenAI routes and
the semantic graph): its engine, tokenizer, tool-call parser and format, and
the predictors its policies share.  It lives at the gateway root, not in the
HTTP module: it is what the routes serve, not a part of them.

The engine factory goes by the replica's ``kind`` (native in a thread or a
worker process, vLLM, an OpenAI-compatible server): :func:`load_engine` builds
one engine per replica and puts several behind a ``ReplicaSet``;
:func:`zoo_engine_specs` groups the zoo variants of one base into one engine
that serves them all.  The optional engines are imported only when a model
uses them, so a missing dependency fails that model alone, naming it.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

from ..engine_ext.native.options import LOAD_KEYS
from ..engine_ext.native.setup import ZOO_PREFIX
from ..engine_ext.policies import OutputLengths, SegmentPredictor, ToolDurations
from .config import ConfigError, GatewayConfig, ModelSpec, engine_dict
from .retention import RetentionStore

if TYPE_CHECKING:  # the seams' types (imports for annotations only)
    from ..engine_ext.constraints.grammar import GrammarCompiler
    from ..engine_ext.policies import PolicySpec
    from ..engine_ext.protocol import Engine
    from ..engine_ext.tokenizer import Tokenizer
    from ..parsers.base import StreamingParser
    from ..parsers.formats import ToolFormat

log = logging.getLogger(__name__)


@dataclass
class ModelServer:
    """One served model: its engine, tokenizer, parser and prompt format."""

    name: str
    spec: ModelSpec
    engine: Engine
    parser_factory: Callable[[], StreamingParser]
    created: int = field(default_factory=lambda: int(time.time()))
    _grammar: Any = None
    #: tool call durations, shared with the engine's interception policy (the engine observes them)
    durations: ToolDurations = field(default_factory=ToolDurations)
    #: tokens a segment (to the next tool call or the end) produces, per application (LAMPS' predictor)
    lengths: OutputLengths = field(default_factory=OutputLengths)
    #: finished chat contexts kept across client-side tool calls (None: retention is off)
    retention: Optional[RetentionStore] = None
    #: the per-segment predictions the gateway hints the ranking with (LAMPS), learned per application
    #: over ``lengths`` and ``durations`` (built from them unless given)
    predictor: Optional[SegmentPredictor] = None
    #: the reasoning parser (``reasoning_parser:``), which wraps the tool-call parser; None: none
    reasoning_factory: Optional[Callable[..., StreamingParser]] = None

    def __post_init__(self) -> None:
        if self.predictor is None:
            self.predictor = SegmentPredictor(self.lengths, self.durations)

    @property
    def engine_times_calls(self) -> bool:
        """The engine itself learns each call's time (pause to resume) into
        ``durations``: an in-process engine whose interception policy owns
        that object.  Then the gateway must not observe the per-tool times
        again (:meth:`SegmentPredictor.observe_call` with
        ``tool_durations=False``); an engine in another process (a worker, a
        remote server) or with a policy replaced since learns into its own
        copy, and the gateway observes them here.  Read each time: a
        ``set_policies`` may replace the policy."""
        return self.durations is getattr(getattr(self.engine, "interception", None), "durations", None)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def tool_format(self) -> ToolFormat:
        """The tool-call format its parser owns (``format``, checked when the parser was registered)."""
        return self.parser_factory.format

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def reasons(self) -> bool:
        """The model's output is parsed for reasoning even when no tool call is: a reasoning parser is
        configured, or the tool format carries reasoning itself (harmony's analysis channel)."""
        return self.reasoning_factory is not None or getattr(self.tool_format, "reasoning_keep", None) is not None

    @property
    def reasoning_format(self) -> Any:
        """How earlier turns' reasoning is written back into a prompt: the reasoning parser's
        format, else the tool format's own (harmony), else None (reasoning is not rendered)."""
        if self.reasoning_factory is not None:
            return self.reasoning_factory.reasoning  # type: ignore[attr-defined]
        return self.tool_format if getattr(self.tool_format, "reasoning_keep", None) is not None else None

    @property
    def special_tokens(self) -> tuple:
        """Markers the parsers must see in the decoded text: the tool format's and the reasoning's."""
        extra = self.reasoning_factory.reasoning.special_tokens if self.reasoning_factory is not None else ()  # type: ignore[attr-defined]
        return tuple(self.tool_format.special_tokens) + tuple(extra)

    def new_parser(self, tools: Optional[Dict[str, Any]] = None, *, calls: bool = True,
                   prompt_tail: str = "") -> StreamingParser:
        """A parser for one output stream.  ``tools``: the request's functions (``{name: parameters}``),
        which formats with untyped arguments type values by; ``calls``: parse tool calls (False: only
        the reasoning is told apart, the rest is text -- for a model that :attr:`reasons`);
        ``prompt_tail``: the prompt's last characters, which tell a reasoning parser whether the
        generation prompt opened the reasoning."""
        carries = getattr(self.tool_format, "reasoning_keep", None) is not None  # harmony: its own reasoning
        inner = _make(self.parser_factory, tools) if calls or carries else None
        if self.reasoning_factory is None:
            if inner is None:
                raise ValueError(f"model {self.name!r} has no reasoning to parse apart from tool calls")
            return inner
        fmt = self.reasoning_factory.reasoning  # type: ignore[attr-defined]
        return self.reasoning_factory(inner=inner, starts_inside=fmt.starts_inside(prompt_tail),
                                      call_markers=self._call_markers() if calls else ())

    def _call_markers(self) -> tuple:
        """The tool format's call openings that end a reasoning: those that begin with one of its special
        tokens (``<tool_call>``, ``[TOOL_CALLS]``, harmony's ``<|channel|>commentary to=``), which a model
        writes only to call.  A markdown fence is prose a model also thinks in: it does not."""
        fmt = self.tool_format
        specials = tuple(getattr(fmt, "special_tokens", ()))
        return tuple(m for m in getattr(fmt, "call_start", ()) if specials and m.startswith(specials))

    def grammar(self) -> GrammarCompiler:
        if self._grammar is None:
            from ..engine_ext.constraints.grammar import GrammarCompiler

            self._grammar = GrammarCompiler(self.tokenizer, vocab_size=self.engine.vocab_size)
        return self._grammar


def _make(factory: Callable[..., StreamingParser], tools: Optional[Dict[str, Any]]) -> StreamingParser:
    """``factory(tools=tools)`` where the factory takes them (the built-ins do; a plugin's parser
    written before parsers were told the request's tools may not: it gets none)."""
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    if "tools" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return factory(tools=tools)
    return factory()


def zoo_engine_specs(cfg: GatewayConfig) -> Dict[str, ModelSpec]:
    """For each zoo model (``path: zoo/NAME``), the spec of the engine it
    shares: the zoo models of one base with the same engine settings and
    policy are served by one engine (or one set of replicas) holding all of
    them, each replica the ``variants`` it lists (default: all).  Unknown
    variants, and variants no replica holds, are a :class:`ConfigError`."""
    zoo_models = [s for s in cfg.models.values() if s.path.startswith(ZOO_PREFIX)]
    if not zoo_models:
        return {}
    from ..engine_ext.zoo import Zoo, ZooError

    try:
        z = Zoo(cfg.zoo)
        bases = {s.name: z.info(s.path[len(ZOO_PREFIX):]).base for s in zoo_models}
    except ZooError as e:
        raise ConfigError(f"{cfg.source}: models: {e}") from e
    groups: Dict[str, List[ModelSpec]] = {}
    for s in zoo_models:
        key = json.dumps([bases[s.name], s.engine, s.engine_args, s.replicas, dataclasses.asdict(s.policy)],
                         sort_keys=True, default=str)
        groups.setdefault(key, []).append(s)
    out: Dict[str, ModelSpec] = {}
    for specs in groups.values():
        first = specs[0]
        names = sorted({s.path[len(ZOO_PREFIX):] for s in specs})
        held: set = set()
        replicas = []
        for i, r in enumerate(first.replicas):
            mine = list(r.get("variants") or names)
            try:
                for n in mine:
                    if z.info(n).base != bases[first.name]:
                        raise ConfigError(f"{cfg.source}: models.{first.name}.replicas[{i}].variants: {n!r} is not "
                                          f"a variant of {bases[first.name]!r}")
            except ZooError as e:
                raise ConfigError(f"{cfg.source}: models.{first.name}.replicas[{i}].variants: {e}") from e
            held.update(mine)
            replicas.append({**r, "variants": mine, **({"zoo": cfg.zoo} if cfg.zoo else {})})
        missing = sorted(set(names) - held)
        if missing:
            raise ConfigError(f"{cfg.source}: models.{first.name}.replicas: no replica holds the variant(s) "
                              f"{', '.join(missing)}")
        group = dataclasses.replace(first, name=f"zoo/{bases[first.name]}", path=ZOO_PREFIX + bases[first.name],
                                    engine_args={**first.engine_args, "variants": names,
                                                 **({"zoo": cfg.zoo} if cfg.zoo else {})},
                                    replicas=replicas)
        for s in specs:
            out[s.name] = group
        log.info("zoo/%s: one engine for the variants %s", bases[first.name], ", ".join(names))
    return out


def load_engine(spec: ModelSpec) -> Engine:
    """The model's engine: one engine per replica (``spec.replicas``), each
    built by its kind with the model's policies; several are put behind one
    :class:`~interlace.engine_ext.replicas.ReplicaSet`.  If one fails to
    start, those already started are closed and the error raised."""
    replicas = spec.replicas or [engine_dict(spec.engine, spec.path, spec.engine_args)]
    engines: List[Any] = []
    try:
        for i, r in enumerate(replicas):
            where = f"models.{spec.name}." + (f"replicas[{i}]" if len(replicas) > 1 else "engine")
            engines.append(load_replica(spec, r, where, f"{spec.name}-{i}"))
    except BaseException:
        for e in reversed(engines):
            try:
                e.close()
            except Exception:  # noqa: BLE001  (the start-up error is the one to report)
                log.exception("closing a replica of %s after a failed start failed", spec.name)
        raise
    if len(engines) == 1:
        return engines[0]
    from ..engine_ext.replicas import ReplicaSet

    log.info("%s: %d replicas (%s)", spec.name, len(engines), ", ".join(r["kind"] for r in replicas))
    return ReplicaSet(engines)


def load_replica(spec: ModelSpec, r: Dict[str, Any], where: str = "", label: str = "worker") -> Engine:
    """One replica's engine, by its kind (``r``: a normalized engine dict of
    ``spec.replicas``).  The optional engines are imported here, so a missing
    dependency fails only the model that uses it, with a message naming it."""
    kind = r["kind"]
    if kind == "native":
        kwargs = {k: r[k] for k in (*LOAD_KEYS, "variants", "zoo") if k in r}
        if r.get("worker", "thread") == "thread":
            return load_native(spec.path, kwargs, spec.policy)
        process_engine = _optional(where, kind, "..engine_ext.worker", "ProcessEngine")
        kwargs["threads"] = r.get("threads") or _process_threads(spec)
        return process_engine.start({"path": spec.path, **kwargs}, spec.policy, name=label)
    from ..engine_ext.embedded import embedded_model_dir

    path = str(embedded_model_dir()) if spec.path == "embedded" else spec.path
    if kind == "vllm":
        load_vllm_engine = _optional(where, kind, "..engine_ext.vllm", "load_vllm_engine")
        model = r.get("model", spec.path)
        model = str(embedded_model_dir()) if model == "embedded" else model
        return load_vllm_engine({**r, "model": model}, model, spec.policy, name=label)
    if kind == "openai":
        load_openai_engine = _optional(where, kind, "..engine_ext.openai_http", "load_openai_engine")
        return load_openai_engine(dict(r), path, spec.policy, name=label)
    raise ConfigError(f"{where}.kind: unknown engine kind {kind!r}")


def _process_threads(spec: ModelSpec) -> int:
    """A process replica's torch threads when its config does not say: the
    gateway's (engine.threads, else the usable cores) shared out among the
    model's process replicas, so together they do not oversubscribe the cores."""
    import torch

    workers = sum(1 for r in spec.replicas if r["kind"] == "native" and r.get("worker") == "process")
    return max(1, torch.get_num_threads() // max(1, workers))


def _optional(where: str, kind: str, module: str, name: str) -> Any:
    import importlib

    try:
        return getattr(importlib.import_module(module, __package__), name)
    except ImportError as e:
        raise ConfigError(f"{where}: the {kind} engine cannot be loaded ({e}); is its optional dependency "
                          f"installed?") from e


def load_native(path: str, engine_args: Dict[str, Any], policy: PolicySpec) -> Engine:
    """A native engine in this process with its configured policies
    (:func:`~interlace.engine_ext.native.setup.build_native_engine`, which
    worker processes use too)."""
    from ..engine_ext.native.setup import build_native_engine

    return build_native_engine(path, engine_args, policy)
