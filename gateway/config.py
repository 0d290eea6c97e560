"""The gateway's YAML configuration: loading, secrets, validation.

Validation uses a JSON Schema (jsonschema) so every mistake is reported with
the file, the key path and what was expected, e.g.::

    configs/prod.yaml: models.smollm2.dtype: 'fp64' is not one of ['auto', 'float32', 'bfloat16', 'float16']

A string of the form ``os.environ/NAME`` anywhere in the file is replaced by
that environment variable (so API keys stay out of the file); a missing
variable is a configuration error too, except where the caller needs no
secret (``require_secrets=False``: ``interlace plugins`` lists the plugins
without the API keys' variables; such a string then stays as written).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import jsonschema
import yaml

from ..engine_ext.native import options as native_options
from ..engine_ext.policies import INTERCEPTION_NAMES, RANKING_NAMES, PolicySpec

ENV_PREFIX = "os.environ/"

#: Which server-side tools a caller may use: none (false), all enabled ones (true) or those named.
SERVER_TOOLS_SCHEMA = {"oneOf": [{"type": "boolean"},
                                 {"type": "array", "items": {"type": "string", "minLength": 1}}]}

#: Scheduling and KV-memory policy (issue #8): the top-level ``engine:`` section gives the
#: defaults of every model, and a model may override any of these keys itself.
POLICY_PROPERTIES = {
    "interception": {"enum": list(INTERCEPTION_NAMES),
                     "description": "what a context waiting for a tool keeps: infercept = least waste"},
    "ranking": {"enum": list(RANKING_NAMES), "description": "which waiting request runs first: lamps"},
    "starvation_threshold": {"type": "integer", "minimum": 1},
    "refresh_interval": {"type": "integer", "minimum": 1},
    "horizon": {"enum": ["segment", "job"],
                "description": "LAMPS scores up to the next call (segment) or adds the predicted later ones (job)"},
    "handling_at_call": {"type": "boolean",
                         "description": "LAMPS: a call gets the handling predicted for its segment (Algorithm 1)"},
    "profile": {"type": "string", "minLength": 1,
                "description": "'auto' (measured at start-up, cached), a profile JSON file or a built-in name"},
    "swap_space_tokens": {"type": "integer", "minimum": 0, "description": "host swap pool (default: the KV cache)"},
    "prefix_caching": {"type": "boolean"},
    "capacity": {
        "type": "object", "additionalProperties": False,
        "description": "Parrot's capacity regulation: the tokens an engine runs while latency-critical work runs, "
                       "and otherwise (docs/semantic-variables.md)",
        "properties": {"latency_tokens": {"type": ["integer", "null"], "minimum": 1,
                                          "description": "cap beside latency-critical work (null: regulation off)"},
                       "throughput_tokens": {"type": ["integer", "null"], "minimum": 1,
                                             "description": "cap otherwise (null: none but memory)"}}},
    "retention": {
        "type": "object", "additionalProperties": False,
        "description": "keep a chat's context across client-side tool calls for the follow-up request",
        "properties": {"enabled": {"type": "boolean"},
                       "max_contexts": {"type": "integer", "minimum": 0},
                       "max_tokens": {"type": "integer", "minimum": 0,
                                      "description": "tokens retained at most (default: half the KV cache)"},
                       "ttl_s": {"type": "number", "exclusiveMinimum": 0}}},
}

#: The native engine's own settings: at the model level, or in a native engine object (overriding them).
NATIVE_PROPERTIES = {
    "dtype": {"enum": list(native_options.DTYPES)},
    "weights": {"enum": list(native_options.WEIGHTS),
                "description": "how the weight matmuls are stored (default: dense in dtype): as-shipped = a "
                               ".gguf's quantized tensors, int8 = per-channel int8 (docs/quantization.md)"},
    "device": {"type": "string"},
    "block_size": {"type": "integer", "minimum": 1, "maximum": 256},
    "kv_cache_tokens": {"type": "integer", "minimum": 16},
    "max_batched_tokens": {"type": "integer", "minimum": 1},
    "max_seqs": {"type": "integer", "minimum": 1},
    "max_model_len": {"type": "integer", "minimum": 16},
    "attention": {"enum": list(native_options.ATTENTION),
                  "description": "attention: kernel = compiled CPU decode kernel, reads the paged cache in place; "
                                 "triton = the Triton kernels (a GPU; without CUDA only under Triton's interpreter, "
                                 "for tests); torch = gathers it (the reference numerics); auto = the CPU kernel "
                                 "where it builds, Triton on a GPU where it is installed"},
    "cuda_graphs": {"type": "boolean",
                    "description": "decode steps replayed as CUDA graphs (padded batch sizes 1, 2, 4, 8, 16, 24, ...); "
                                   "needs attention: triton (or auto on a GPU); default: on with CUDA and Triton"},
    "gpu_memory_utilization": {"type": "number", "exclusiveMinimum": 0, "maximum": 1,
                               "description": "CUDA only (ignored on a CPU): the share of the GPU's memory this "
                                              "engine may use; the KV cache gets what the weights and a measured "
                                              "activation peak leave (as vLLM).  Default 0.9 where kv_cache_tokens "
                                              "is not set; where it is set, kv_cache_tokens sizes the cache"},
    "adapt_threads": {"type": "boolean",
                      "description": "CPU only: run each step on as many torch threads as there are free cores "
                                     "(at most engine.threads), re-chosen from the scheduler's accounting while "
                                     "the engine runs, so a busy neighbour or a tool worker does not stall every "
                                     "parallel region (docs/cpu-engine.md); false: always engine.threads. "
                                     "Default true"},
}

#: ``gpu_memory_utilization`` of a native engine whose configuration sizes its cache neither way
GPU_MEMORY_UTILIZATION_DEFAULT = 0.9

ENGINE_KINDS = ("native", "vllm", "openai")

#: The keys of an engine object, per kind (issue #11).
ENGINE_KIND_PROPERTIES = {
    "native": {
        "worker": {"enum": ["thread", "process"],
                   "description": "thread: in the gateway's process (default); process: in a worker process"},
        "threads": {"type": "integer", "minimum": 1,
                    "description": "worker: process only: the worker's torch threads (default: engine.threads "
                                   "shared out among the model's process replicas)"},
        "variants": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1},
                     "description": "zoo models (path: zoo/NAME): the variants this replica holds "
                                    "(default: every zoo model of its base in this config)"},
        **NATIVE_PROPERTIES,
    },
    "vllm": {
        "model": {"type": "string", "minLength": 1, "description": "what vLLM loads (default: the model's path)"},
        "dtype": {"enum": ["auto", "float32", "bfloat16", "float16"]},
        "tensor_parallel_size": {"type": "integer", "minimum": 1},
        "pipeline_parallel_size": {"type": "integer", "minimum": 1},
        "distributed_executor_backend": {"enum": ["mp", "ray", "uni", "external_launcher"]},
        "gpu_memory_utilization": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "max_model_len": {"type": "integer", "minimum": 16},
        "kv_cache_space_gb": {"type": "number", "exclusiveMinimum": 0, "description": "CPU builds of vLLM only"},
        "pin_budget": {"type": "number", "minimum": 0, "maximum": 1,
                       "description": "fraction of vLLM's KV blocks that paused or kept contexts may hold (default "
                                      "0.5); the model's interception policy decides which pause keeps its KV"},
        "pin_ttl_s": {"type": "number", "exclusiveMinimum": 0,
                      "description": "seconds a kept context's KV may wait for its resume or follow-up (default "
                                     "120; a client-side call's pin lives as long as the retention TTL)"},
        "enforce_eager": {"type": "boolean"},
        "max_num_seqs": {"type": "integer", "minimum": 1},
        "max_num_batched_tokens": {"type": "integer", "minimum": 1},
        "args": {"type": "object", "description": "more vLLM engine arguments, passed through unchecked"},
    },
    "openai": {
        "url": {"type": "string", "pattern": r"^https?://[^\s/]+\S*$",
                "description": "a vLLM OpenAI-compatible server, e.g. http://10.0.0.5:8000/v1"},
        "model": {"type": "string", "minLength": 1,
                  "description": "the remote server's model name (default: the model path's last component)"},
        "api_key": {"type": "string"},
        "timeout_s": {"type": "number", "exclusiveMinimum": 0},
    },
}

#: ``engine: native`` (a kind alone) or ``engine: {kind: ..., ...}``.  Written with if/then rather
#: than oneOf so a mistake is reported at its own key, not as "not valid under any of the schemas".
ENGINE_SCHEMA = {
    "type": ["string", "object"],
    "description": "which engine serves the model: native, vllm, or an object {kind: native|vllm|openai, ...}",
    "if": {"type": "string"},
    "then": {"enum": ["native", "vllm"]},
    "else": {
        "required": ["kind"],
        "properties": {"kind": {"enum": list(ENGINE_KINDS)}},
        "allOf": [{"if": {"properties": {"kind": {"const": kind}}, "required": ["kind"]},
                   "then": {"additionalProperties": False, "properties": {"kind": {"const": kind}, **props},
                            **({"required": ["url"]} if kind == "openai" else {})}}
                  for kind, props in ENGINE_KIND_PROPERTIES.items()],
    },
}

MODEL_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["path"],
    "properties": {
        **POLICY_PROPERTIES,
        "engine": ENGINE_SCHEMA,
        "replicas": {
            "type": ["integer", "array"],
            "description": "copies of the engine behind this model (a number), or one engine per replica (a list)",
            "if": {"type": "integer"},
            "then": {"minimum": 1},
            "else": {"minItems": 1, "items": ENGINE_SCHEMA},
        },
        "path": {"type": "string", "minLength": 1,
                 "description": "'embedded', a Hugging Face model directory, a .gguf file, or zoo/NAME "
                                "(a variant in the block zoo: `interlace zoo add`)"},
        "parser": {"type": "string", "minLength": 1, "description": "tool-call parser name (default hermes)"},
        "reasoning_parser": {"type": ["string", "null"], "minLength": 1,
                             "description": "reasoning parser name (qwen3, deepseek_r1, ...): the model's "
                                            "reasoning is kept apart from its answer and its calls "
                                            "(default none: a format that carries reasoning, harmony, "
                                            "separates it itself)"},
        "strict_tools": {"type": "boolean",
                         "description": "constrain every tool's arguments to its schema under tool_choice "
                                        "auto, as a tool with strict: true is (default false)"},
        **NATIVE_PROPERTIES,
    },
}

#: ``server.per_key`` and an API key's own ``limits`` (gateway/key_limits.py); null: the default share
PER_KEY_SCHEMA = {
    "type": "object", "additionalProperties": False,
    "description": "limits per API key (without keys: of all callers together); a key's own limits override "
                   "server.per_key",
    "properties": {
        "max_sessions": {"type": ["integer", "null"], "minimum": 1,
                         "description": "Semantic Variables sessions the key holds at once"},
        "max_pending_calls": {"type": ["integer", "null"], "minimum": 1,
                              "description": "semantic calls pending or running, over all the key's sessions"},
        "max_concurrent_requests": {"type": ["integer", "null"], "minimum": 1,
                                    "description": "chat completions the key has in flight at once"}}}

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["models"],
    "properties": {
        "server": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "host": {"type": "string"},
                "port": {"type": "integer", "minimum": 0, "maximum": 65535},
                "api_keys": {"type": "array", "items": {"oneOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "object", "additionalProperties": False, "required": ["key"],
                     "properties": {"key": {"type": "string", "minLength": 1},
                                    "name": {"type": "string", "pattern": "^[A-Za-z0-9_.:@-]{1,64}$"},
                                    "server_tools": SERVER_TOOLS_SCHEMA,
                                    "replay": {"type": "boolean"},
                                    "limits": PER_KEY_SCHEMA}},
                ]}},
                "server_tools": SERVER_TOOLS_SCHEMA,
                "replay": {"type": "boolean",
                           "description": "may callers force the model's output (interlace.replay)? "
                                          "For benchmarks and tests"},
                "cors_origins": {"type": "array", "items": {"type": "string", "minLength": 1},
                                 "description": "browser origins allowed to call the API ('*' = any)"},
                "default_max_tokens": {"type": "integer", "minimum": 1,
                                       "description": "max_tokens of a request that does not say"},
                "max_request_bytes": {"type": "integer", "minimum": 1024},
                "max_tool_rounds": {"type": "integer", "minimum": 1, "maximum": 64},
                "metrics_key": {"type": "string", "minLength": 16,
                                "description": "a bearer token GET /metrics then needs (write it as "
                                               "os.environ/NAME); unset: /metrics is open to whoever reaches "
                                               "the port"},
                "connections": {
                    "type": "object", "additionalProperties": False,
                    "description": "connection limits and read timeouts (gateway/connections.py)",
                    "properties": {
                        "max_connections": {"type": "integer", "minimum": 1,
                                            "description": "open connections at most; at the cap a new one "
                                                           "replaces the oldest still waiting for a request"},
                        "header_timeout_s": {"type": "number", "exclusiveMinimum": 0,
                                             "description": "seconds to receive a whole request head"},
                        "body_timeout_s": {"type": "number", "exclusiveMinimum": 0,
                                           "description": "seconds to receive a whole body, from its head"},
                        "keep_alive_s": {"type": "number", "exclusiveMinimum": 0,
                                         "description": "idle seconds between requests on a connection"},
                        "backlog": {"type": "integer", "minimum": 1,
                                    "description": "connections the kernel queues before they are accepted"}}},
                "drain_s": {"type": "number", "minimum": 0,
                            "description": "SIGTERM: seconds in-flight requests get to finish before each is "
                                           "ended with a 503 (or an error event and [DONE])"},
                "per_key": PER_KEY_SCHEMA,
                "responses": {
                    "type": "object", "additionalProperties": False,
                    "description": "stored Responses-API responses (POST /v1/responses with store: true; "
                                   "docs/config.md)",
                    "properties": {"enabled": {"type": "boolean",
                                               "description": "false: nothing is stored, previous_response_id "
                                                              "is unknown"},
                                   "path": {"type": "string", "minLength": 1,
                                            "description": "the SQLite file (relative: to the config file); "
                                                           "':memory:' keeps them in memory only"},
                                   "ttl_s": {"type": "number", "exclusiveMinimum": 0,
                                             "description": "seconds a stored response is kept (default 30 days)"},
                                   "max_per_key": {"type": "integer", "minimum": 1,
                                                   "description": "stored responses one API key holds at once"}}},
                "sessions": {
                    "type": "object", "additionalProperties": False,
                    "description": "Semantic Variables sessions (docs/semantic-variables.md)",
                    "properties": {"enabled": {"type": "boolean"},
                                   "ttl_s": {"type": "number", "exclusiveMinimum": 0,
                                             "description": "idle seconds before a session is freed"},
                                   "max_ttl_s": {"type": "number", "exclusiveMinimum": 0},
                                   "max_sessions": {"type": "integer", "minimum": 1},
                                   "max_variables": {"type": "integer", "minimum": 1},
                                   "max_pending_calls": {"type": "integer", "minimum": 1},
                                   "max_bytes": {"type": "integer", "minimum": 1024}}},
            },
        },
        "models": {"type": "object", "minProperties": 1,
                   "propertyNames": {"pattern": "^[A-Za-z0-9_.:/-]{1,128}$"},
                   "additionalProperties": MODEL_SCHEMA},
        "plugins": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "entrypoints": {"type": "boolean", "description": "load installed third-party plugins"},
                "modules": {"type": "array", "items": {"type": "string"},
                            "description": "extra plugin modules to load by import path"},
            },
        },
        "tools": {"type": "object", "additionalProperties": {"type": "object"},
                  "description": "settings per tool name, passed to Tool.configure"},
        "engine": {"type": "object", "additionalProperties": False,
                   "properties": {**POLICY_PROPERTIES,
                                  "threads": {"type": "integer", "minimum": 1,
                                              "description": "torch (OpenMP) threads of the native engines in "
                                                             "the gateway's process (default: the cores this "
                                                             "process may use, from its affinity mask)"}},
                   "description": "scheduling policy defaults of every model"},
        "mcp_servers": {"type": "object", "additionalProperties": {
            "type": "object", "additionalProperties": False,
            "properties": {
                "command": {"type": "string", "minLength": 1, "description": "stdio: the program to start"},
                "args": {"type": "array", "items": {"type": "string"}},
                "env": {"type": "object", "additionalProperties": {"type": "string"},
                        "description": "stdio: environment variables beside a minimal one (values may be "
                                       "os.environ/NAME)"},
                "cwd": {"type": "string", "minLength": 1,
                        "description": "stdio: working directory (relative to the config file)"},
                "url": {"type": "string", "pattern": "^https?://",
                        "description": "streamable HTTP: the server's endpoint"},
                "headers": {"type": "object", "additionalProperties": {"type": "string"},
                            "description": "streamable HTTP: headers of every request (e.g. Authorization: "
                                           "os.environ/TOKEN)"},
                "timeout_s": {"type": "number", "exclusiveMinimum": 0, "description": "wall time of one call"},
                "startup_timeout_s": {"type": "number", "exclusiveMinimum": 0,
                                      "description": "seconds to connect and list the tools"},
            }},
            "description": "MCP servers whose tools are served as NAME.TOOL (docs/mcp.md)"},
        "zoo": {"type": "string", "minLength": 1,
                "description": "the block zoo directory of zoo/NAME models (default: $INTERLACE_ZOO, "
                               "else ~/.cache/interlace/zoo)"},
    },
}

DEFAULTS = {
    "server": {"host": "127.0.0.1", "port": 8000, "api_keys": [], "server_tools": False, "replay": False,
               "cors_origins": [], "default_max_tokens": 1024, "max_request_bytes": 4 * 1024 * 1024,
               "max_tool_rounds": 8},
    "plugins": {"entrypoints": True, "modules": []},
    "tools": {},
}
MODEL_DEFAULTS = {"engine": "native", "parser": "hermes", "dtype": "auto", "block_size": 16,
                  "kv_cache_tokens": 16384, "max_batched_tokens": 512, "max_seqs": 256, "attention": "auto"}
#: The papers' defaults (InferCept's min-waste handling, LAMPS' ranking with its threshold of 100).
POLICY_DEFAULTS = {"interception": "infercept", "ranking": "lamps", "starvation_threshold": 100,
                   "refresh_interval": 1, "horizon": "job", "handling_at_call": False, "profile": "auto",
                   "prefix_caching": True}
RETENTION_DEFAULTS = {"enabled": True, "max_contexts": 64, "ttl_s": 600.0}
#: Parrot's example (section 5.4): a latency-critical request's engine runs at most ~2,000 tokens
CAPACITY_DEFAULTS = {"latency_tokens": PolicySpec.latency_capacity_tokens,
                     "throughput_tokens": PolicySpec.throughput_capacity_tokens}


class ConfigError(ValueError):
    """The configuration file is missing, unreadable or invalid."""


@dataclass(frozen=True)
class RetentionSpec:
    """Client-side tool calls: how many finished chat contexts are kept for their follow-ups."""

    enabled: bool = True
    max_contexts: int = 64
    max_tokens: int = 8192
    ttl_s: float = 600.0


@dataclass
class ModelSpec:
    """``engine`` is the first replica's kind and ``engine_args`` the model-level native
    settings; ``replicas`` holds one engine dict per replica (``{"kind": ..., ...}``,
    native ones with the model-level settings merged in), one when no ``replicas:`` is given."""

    name: str
    engine: str
    path: str
    parser: str
    engine_args: Dict[str, Any]
    policy: PolicySpec = field(default_factory=PolicySpec)
    replicas: List[Dict[str, Any]] = field(default_factory=list)
    retention: RetentionSpec = field(default_factory=RetentionSpec)
    #: the reasoning parser's name (None: the model's reasoning, if any, is not told apart by a parser)
    reasoning_parser: Optional[str] = None
    #: every tool's arguments constrained under tool_choice auto, as for ``strict: true``
    strict_tools: bool = False

    def __repr__(self) -> str:  # never print a remote replica's secret
        shown = [{k: ("***" if k == "api_key" else v) for k, v in r.items()} for r in self.replicas]
        return (f"ModelSpec(name={self.name!r}, engine={self.engine!r}, path={self.path!r}, parser={self.parser!r}, "
                f"engine_args={self.engine_args!r}, policy={self.policy!r}, replicas={shown!r})")


#: A caller's server-tool permission: False (none), True (every enabled tool) or the tool names allowed.
ServerTools = Union[bool, List[str]]


@dataclass(frozen=True)
class PerKeyLimits:
    """What one API key may hold at once (gateway/key_limits.py): ``server.per_key``, or the key's ``limits``."""

    max_sessions: int = 256
    max_pending_calls: int = 1024
    max_concurrent_requests: int = 256


def per_key_defaults(sessions: "SessionsConfig", keys: int) -> PerKeyLimits:
    """The limits of a key that ``server.per_key`` leaves unset: a share of the server's (all of it
    without keys or with one key, half with two, a quarter from four keys on), so no key takes
    everything while another is configured."""
    share = min(4, max(1, keys))
    return PerKeyLimits(max_sessions=max(1, sessions.max_sessions // share),
                        max_pending_calls=max(1, 4 * sessions.max_pending_calls // share),
                        max_concurrent_requests=max(1, 256 // share))


@dataclass(frozen=True)
class ApiKey:
    """One client's key, the name it is known by (logs, tool policy hooks) and its permissions."""

    key: str
    name: str
    server_tools: ServerTools = False
    replay: bool = False
    limits: PerKeyLimits = PerKeyLimits()  # server.per_key, overridden by the key's own limits

    def __repr__(self) -> str:  # never print the secret
        return (f"ApiKey(name={self.name!r}, server_tools={self.server_tools!r}, replay={self.replay!r}, "
                f"limits={self.limits!r})")


def may_use_tool(permission: ServerTools, tool: str) -> bool:
    """Whether ``permission`` grants ``tool``: ``True`` grants every tool, a list its names,
    where ``SERVER.*`` grants every tool of an MCP server."""
    if permission is True:
        return True
    return isinstance(permission, list) and any(
        p == tool or (p.endswith(".*") and tool.startswith(p[:-1])) for p in permission)


@dataclass(frozen=True)
class McpServerSpec:
    """One ``mcp_servers`` entry: a stdio server (``command``) or a streamable HTTP one (``url``)."""

    name: str
    command: Optional[str] = None
    args: Tuple[str, ...] = ()
    env: Dict[str, str] = field(default_factory=dict)
    cwd: Optional[str] = None
    url: Optional[str] = None
    headers: Dict[str, str] = field(default_factory=dict)
    timeout_s: float = 60.0
    startup_timeout_s: float = 20.0

    @property
    def transport(self) -> str:
        return "stdio" if self.command else "http"

    def __repr__(self) -> str:  # env and headers may hold secrets: names only
        where = f"command={self.command!r}, args={list(self.args)!r}" if self.command else f"url={self.url!r}"
        return (f"McpServerSpec(name={self.name!r}, {where}, env={sorted(self.env)!r}, "
                f"headers={sorted(self.headers)!r})")


#: An MCP server's name: its tools are NAME.TOOL, so no dots.
MCP_SERVER_NAME = re.compile(r"^[A-Za-z0-9_-]{1,32}$")


#: The Responses API's ``{"type": "mcp", "server_label": "interlace"}``: the gateway's own plugin tools
#: (no configured MCP server may take the name).
RESERVED_MCP_LABEL = "interlace"


def _mcp_servers(raw: Dict[str, Any], source: str) -> Dict[str, McpServerSpec]:
    """``mcp_servers`` entries to specs, each either stdio or HTTP, with a message per mistake."""
    out: Dict[str, McpServerSpec] = {}
    for name, m in raw.items():
        where = f"{source}: mcp_servers.{name}"
        if not MCP_SERVER_NAME.match(name):
            raise ConfigError(f"{where}: a server name is 1-32 letters, digits, '_' or '-' (its tools are "
                              f"named SERVER.TOOL, so no dots)")
        if name == RESERVED_MCP_LABEL:
            raise ConfigError(f"{where}: the name {RESERVED_MCP_LABEL!r} is reserved: in the Responses API "
                              f"the MCP server_label {RESERVED_MCP_LABEL!r} names the gateway's own plugin tools")
        if ("command" in m) == ("url" in m):
            raise ConfigError(f"{where}: give either command (a stdio server) or url (a streamable HTTP server)"
                              + (", not both" if "command" in m else ""))
        wrong = [k for k in (("args", "env", "cwd") if "url" in m else ("headers",)) if k in m]
        if wrong:
            kind = "a streamable HTTP server (url)" if "url" in m else "a stdio server (command)"
            raise ConfigError(f"{where}.{wrong[0]}: not a setting of {kind}")
        cwd = m.get("cwd")
        if cwd is not None and not os.path.isabs(cwd) and not source.startswith("<"):
            cwd = str(Path(source).resolve().parent / cwd)
        if cwd is not None and not os.path.isdir(cwd):
            raise ConfigError(f"{where}.cwd: {cwd!r} is not a directory")
        out[name] = McpServerSpec(name=name, command=m.get("command"), args=tuple(m.get("args", ())),
                                  env=dict(m.get("env", {})), cwd=cwd, url=m.get("url"),
                                  headers=dict(m.get("headers", {})), timeout_s=float(m.get("timeout_s", 60.0)),
                                  startup_timeout_s=float(m.get("startup_timeout_s", 20.0)))
    return out


@dataclass(frozen=True)
class SessionsConfig:
    """``server.sessions``: Semantic Variables sessions (gateway/semantic/sessions.py)."""

    enabled: bool = True
    ttl_s: float = 600.0
    max_ttl_s: float = 86400.0
    max_sessions: int = 256
    max_variables: int = 1024
    max_pending_calls: int = 256
    max_bytes: int = 16 * 1024 * 1024


def default_state_dir() -> str:
    """Where the gateway keeps what outlives a process (the stored responses):
    ``$INTERLACE_STATE_DIR``, else ``${XDG_STATE_HOME:-~/.local/state}/interlace``."""
    if os.environ.get("INTERLACE_STATE_DIR"):
        return os.environ["INTERLACE_STATE_DIR"]
    return os.path.join(os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "interlace")


@dataclass(frozen=True)
class ResponsesConfig:
    """``server.responses``: the Responses API's stored responses (gateway/responses/store.py).
    OpenAI keeps a stored response 30 days; so does the default here."""

    enabled: bool = True
    path: str = ""          # "" until parse_config fills in default_state_dir()/responses.sqlite3
    ttl_s: float = 30 * 86400.0
    max_per_key: int = 10_000


@dataclass(frozen=True)
class ConnectionsConfig:
    """``server.connections``: how many connections, and how long a client may take to send a request."""

    max_connections: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_s: float = 5.0
    backlog: int = 1024


@dataclass
class GatewayConfig:
    host: str
    port: int
    api_keys: List[ApiKey]
    max_request_bytes: int
    max_tool_rounds: int
    models: Dict[str, ModelSpec]
    plugin_entrypoints: bool
    plugin_modules: List[str]
    tools: Dict[str, Dict[str, Any]]
    server_tools: ServerTools = False
    replay: bool = False
    cors_origins: List[str] = field(default_factory=list)
    default_max_tokens: int = 1024
    sessions: SessionsConfig = field(default_factory=SessionsConfig)
    responses: ResponsesConfig = field(default_factory=ResponsesConfig)
    per_key: PerKeyLimits = field(default_factory=PerKeyLimits)  # server.per_key, the defaults filled in
    connections: ConnectionsConfig = field(default_factory=ConnectionsConfig)
    drain_s: float = 30.0  # server.drain_s: SIGTERM's grace for in-flight requests
    source: str = "<dict>"
    zoo: Optional[str] = None  # the block zoo directory (None: the default)
    threads: Optional[int] = None  # engine.threads (None: the cores in the affinity mask)
    mcp_servers: Dict[str, McpServerSpec] = field(default_factory=dict)
    metrics_key: Optional[str] = field(default=None, repr=False)  # server.metrics_key (None: /metrics is open)
    raw: Dict[str, Any] = field(default_factory=dict, repr=False)  # secrets substituted: never printed
    def check_parsers(self, installed: Iterable[str], reasoning: Iterable[str] = ()) -> None:
        """:class:`ConfigError` naming the first model whose parser (tool-call or reasoning) is not
        installed (``installed``, ``reasoning``)."""
        names, thinking = sorted(installed), sorted(reasoning)
        for spec in self.models.values():
            if spec.parser not in names:
                raise ConfigError(f"{self.source}: models.{spec.name}.parser: unknown parser {spec.parser!r} "
                                  f"(installed: {', '.join(names)})")
            if spec.reasoning_parser is not None and spec.reasoning_parser not in thinking:
                raise ConfigError(f"{self.source}: models.{spec.name}.reasoning_parser: unknown reasoning parser "
                                  f"{spec.reasoning_parser!r} (installed: {', '.join(thinking) or 'none'})")


def _substitute_env(node: Any, path: str, source: str, required: bool = True) -> Any:
    if isinstance(node, dict):
        return {k: _substitute_env(v, f"{path}.{k}" if path else str(k), source, required) for k, v in node.items()}
    if isinstance(node, list):
        return [_substitute_env(v, f"{path}[{i}]", source, required) for i, v in enumerate(node)]
    if isinstance(node, str) and node.startswith(ENV_PREFIX):
        name = node[len(ENV_PREFIX):]
        if name not in os.environ:
            if not required:
                return node
            raise ConfigError(f"{source}: {path}: environment variable {name!r} is not set")
        return os.environ[name]
    return node


def _key_path(err: jsonschema.ValidationError) -> str:
    out = ""
    for p in err.absolute_path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def _per_key(server: Dict[str, Any], source: str) -> PerKeyLimits:
    """``server.per_key`` over its defaults (:func:`per_key_defaults`)."""
    sessions = _sessions(server.get("sessions") or {}, source)
    base = per_key_defaults(sessions, len(server["api_keys"]))
    return dataclasses.replace(base, **{k: v for k, v in (server.get("per_key") or {}).items() if v is not None})


def _api_keys(server: Dict[str, Any], source: str) -> List[ApiKey]:
    """Strings and objects to :class:`ApiKey`; a key's permissions default to the server's own,
    its limits to ``server.per_key``.
    A plain string key is named ``key<i>`` (its index), so logs never show the secret."""
    out: List[ApiKey] = []
    per_key = _per_key(server, source)
    for i, k in enumerate(server["api_keys"]):
        k = {"key": k} if isinstance(k, str) else k
        own = {n: v for n, v in (k.get("limits") or {}).items() if v is not None}
        out.append(ApiKey(key=k["key"], name=k.get("name", f"key{i}"),
                          server_tools=k.get("server_tools", server["server_tools"]),
                          replay=k.get("replay", server["replay"]), limits=dataclasses.replace(per_key, **own)))
    for what in ("key", "name"):
        seen = [getattr(k, what) for k in out]
        dup = next((i for i, v in enumerate(seen) if v in seen[:i]), None)
        if dup is not None:
            raise ConfigError(f"{source}: server.api_keys[{dup}]: duplicate {what}"
                              + (f" {seen[dup]!r}" if what == "name" else ""))
    return out


def parse_config(data: Any, source: str = "<dict>", *, require_secrets: bool = True) -> GatewayConfig:
    """``data`` (the YAML's object) validated, with defaults; ``require_secrets=False`` leaves an
    ``os.environ/NAME`` whose variable is unset as written instead of refusing the config."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: (top level): expected a mapping, got {type(data).__name__}")
    errors = sorted(jsonschema.Draft202012Validator(SCHEMA).iter_errors(data), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"{source}: {_key_path(e)}: {e.message}" for e in errors[:10]]
        raise ConfigError("invalid configuration\n  " + "\n  ".join(lines))
    data = _substitute_env(copy.deepcopy(data), "", source, require_secrets)
    server = {**DEFAULTS["server"], **data.get("server", {})}
    plugins = {**DEFAULTS["plugins"], **data.get("plugins", {})}
    models = {}
    defaults = {k: v for k, v in (data.get("engine") or {}).items() if k != "threads"}
    for name, m in data["models"].items():
        m = {**MODEL_DEFAULTS, **m}
        engine_args = {k: v for k, v in m.items()
                       if k not in ("engine", "replicas", "path", "parser", "reasoning_parser", "strict_tools",
                                    *POLICY_PROPERTIES)}
        own = {k: v for k, v in m.items() if k in POLICY_PROPERTIES}
        policy = _policy(defaults, own, m["kv_cache_tokens"], f"models.{name}", source)
        retention = _retention(defaults, own, m["kv_cache_tokens"])
        replicas = _replicas(data["models"][name], m["path"], engine_args, f"models.{name}", source,
                             sized=bool(_CACHE_SIZING & set(data["models"][name])))
        models[name] = ModelSpec(name, replicas[0]["kind"], m["path"], m["parser"], engine_args, policy, replicas,
                                 retention, reasoning_parser=m.get("reasoning_parser"),
                                 strict_tools=bool(m.get("strict_tools", False)))
    return GatewayConfig(host=server["host"], port=server["port"], api_keys=_api_keys(server, source),
                         server_tools=server["server_tools"], replay=server["replay"],
                         cors_origins=list(server["cors_origins"]),
                         default_max_tokens=server["default_max_tokens"],
                         max_request_bytes=server["max_request_bytes"], max_tool_rounds=server["max_tool_rounds"],
                         models=models, plugin_entrypoints=plugins["entrypoints"],
                         plugin_modules=list(plugins["modules"]), tools=dict(data.get("tools") or {}),
                         sessions=_sessions(server.get("sessions") or {}, source), per_key=_per_key(server, source),
                         responses=_responses(server.get("responses") or {}, source),
                         connections=ConnectionsConfig(**{k: (float(v) if k.endswith("_s") else v)
                                                          for k, v in (server.get("connections") or {}).items()}),
                         drain_s=float(server.get("drain_s", 30.0)), source=source, raw=data,
                         zoo=data.get("zoo"), threads=(data.get("engine") or {}).get("threads"),
                         mcp_servers=_mcp_servers(data.get("mcp_servers") or {}, source),
                         metrics_key=server.get("metrics_key"))


_CACHE_SIZING = frozenset({"kv_cache_tokens", "gpu_memory_utilization"})


def engine_dict(engine: Union[str, Dict[str, Any]], path: str, native_args: Dict[str, Any],
                sized: bool = True) -> Dict[str, Any]:
    """One replica's engine, normalized: ``{"kind": ..., ...}``; a native one gets the model-level
    native settings under its own and ``worker`` (default thread), an openai one its ``model``
    when set (default: the only model its server serves).  ``sized=False``: the model's settings
    size the KV cache neither way, so a native replica that does not either gets
    ``gpu_memory_utilization`` :data:`GPU_MEMORY_UTILIZATION_DEFAULT` (which a CPU ignores)."""
    e = {"kind": engine} if isinstance(engine, str) else dict(engine)
    if e["kind"] == "native":
        own = {k: v for k, v in e.items() if k not in ("kind", "worker")}
        e = {"kind": "native", "worker": e.get("worker", "thread"), **native_args, **own}
        if not sized and not _CACHE_SIZING & set(own):
            e["gpu_memory_utilization"] = GPU_MEMORY_UTILIZATION_DEFAULT
    return e


def _replicas(raw: Dict[str, Any], path: str, native_args: Dict[str, Any], where: str,
              source: str, sized: bool = True) -> List[Dict[str, Any]]:
    """The model's replicas: ``replicas: N`` copies of ``engine``, or the listed engines."""
    engine = raw.get("engine", MODEL_DEFAULTS["engine"])
    replicas = raw.get("replicas", 1)
    zoo = path.startswith("zoo/")
    for e in (replicas if isinstance(replicas, list) else [engine]):
        kind = e if isinstance(e, str) else e.get("kind")
        if zoo and kind != "native":
            raise ConfigError(f"{source}: {where}: a zoo model ({path}) is served by the native engine "
                              f"(block sharing), not {kind}")
        if not zoo and isinstance(e, dict) and "variants" in e:
            raise ConfigError(f"{source}: {where}: variants: only for zoo models (path: zoo/NAME)")
        if isinstance(e, dict) and "threads" in e and e.get("worker", "thread") != "process":
            raise ConfigError(f"{source}: {where}: threads: only for a replica with worker: process (engines in "
                              f"the gateway's process share engine.threads)")
    if isinstance(replicas, list):
        if "engine" in raw:
            raise ConfigError(f"{source}: {where}.replicas: a list of replicas names each one's engine; "
                              f"drop {where}.engine (or give replicas as a number)")
        return [engine_dict(e, path, native_args, sized) for e in replicas]
    return [engine_dict(engine, path, native_args, sized) for _ in range(replicas)]


def _responses(raw: Dict[str, Any], source: str) -> ResponsesConfig:
    """``server.responses`` with its defaults; a relative ``path`` is relative to the config file."""
    path = raw.get("path") or os.path.join(default_state_dir(), "responses.sqlite3")
    if path != ":memory:":
        path = os.path.expanduser(path)
        if not os.path.isabs(path) and os.path.isfile(source):
            path = os.path.join(os.path.dirname(os.path.abspath(source)), path)
        path = os.path.abspath(path)
    return ResponsesConfig(enabled=raw.get("enabled", True), path=path,
                           ttl_s=float(raw.get("ttl_s", ResponsesConfig.ttl_s)),
                           max_per_key=raw.get("max_per_key", ResponsesConfig.max_per_key))


def _sessions(raw: Dict[str, Any], source: str) -> SessionsConfig:
    cfg = SessionsConfig(**{k: (float(v) if k.endswith("_s") else v) for k, v in raw.items()})
    if cfg.ttl_s > cfg.max_ttl_s:
        raise ConfigError(f"{source}: server.sessions.ttl_s ({cfg.ttl_s}) exceeds max_ttl_s ({cfg.max_ttl_s})")
    return cfg


def _policy(defaults: Dict[str, Any], own: Dict[str, Any], kv_cache_tokens: int, where: str,
            source: str) -> PolicySpec:
    """A model's policy: its own keys over the ``engine:`` section's over the defaults.
    A profile file is read now, so a bad one stops start-up with its name."""
    p = {**POLICY_DEFAULTS, **defaults, **own}
    if p["profile"] != "auto":
        from ..engine_ext.policies import Profile, ProfileError

        try:
            Profile.load(p["profile"])
        except ProfileError as e:
            where = f"{where}.profile" if "profile" in own else "engine.profile"
            raise ConfigError(f"{source}: {where}: {e}") from None
    capacity = _capacity(defaults, own, where, source)
    return PolicySpec(interception=p["interception"], ranking=p["ranking"],
                      starvation_threshold=p["starvation_threshold"], refresh_interval=p["refresh_interval"],
                      horizon=p["horizon"], handling_at_call=p["handling_at_call"], profile=p["profile"],
                      swap_space_tokens=p.get("swap_space_tokens", kv_cache_tokens),
                      prefix_caching=p["prefix_caching"], latency_capacity_tokens=capacity["latency_tokens"],
                      throughput_capacity_tokens=capacity["throughput_tokens"])


def _capacity(defaults: Dict[str, Any], own: Dict[str, Any], where: str, source: str) -> Dict[str, Any]:
    """A model's capacity caps, key by key: its own over the ``engine:`` section's over
    :data:`CAPACITY_DEFAULTS`; a latency cap above the throughput cap is refused, naming
    the section each came from."""
    sections = (("engine.capacity", defaults.get("capacity") or {}), (f"{where}.capacity", own.get("capacity") or {}))
    c, at = dict(CAPACITY_DEFAULTS), {k: "engine.capacity" for k in CAPACITY_DEFAULTS}
    for path, section in sections:
        for k, v in section.items():
            c[k], at[k] = v, path
    lat, thr = c["latency_tokens"], c["throughput_tokens"]
    if lat is not None and thr is not None and lat > thr:
        raise ConfigError(f"{source}: {at['latency_tokens']}.latency_tokens: {lat} exceeds "
                          f"{at['throughput_tokens']}.throughput_tokens ({thr}); the cap beside latency-critical "
                          f"work must not be larger than the one without it")
    return c


def _retention(defaults: Dict[str, Any], own: Dict[str, Any], kv_cache_tokens: int) -> RetentionSpec:
    """A model's retention of client-side tool calls' contexts (a gateway setting, written
    beside the engine policy in YAML): its own keys over the ``engine:`` section's over the defaults."""
    r = {**RETENTION_DEFAULTS, "max_tokens": kv_cache_tokens // 2, **(defaults.get("retention") or {}),
         **(own.get("retention") or {})}
    return RetentionSpec(enabled=r["enabled"], max_contexts=r["max_contexts"], max_tokens=r["max_tokens"],
                         ttl_s=float(r["ttl_s"]))


def load_config(path: str | os.PathLike, *, require_secrets: bool = True) -> GatewayConfig:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read configuration: {e.strerror or e}") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from e
    return parse_config(data, str(p), require_secrets=require_secrets)
