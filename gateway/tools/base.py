"""The tool declaration API for plugin authors.

A tool is a subclass of :class:`Tool` with a name, a description and a JSON
Schema for its arguments, plus handler methods.  The gateway keeps one
configured *prototype* instance per tool in the gateway process (where the
schema is checked as arguments stream in) and pickles it into pre-started
worker processes, where the handlers run.  Each call gets a shallow copy of
the prototype, so attributes a handler sets (``self.conn = ...``) live for one
call only, while whatever :meth:`Tool.worker_init` set up (warm imports, an open
index) is shared by every call served by that worker.

Partial execution (Conveyor, Xu et al.): while the model is still writing a
call, the runtime feeds the tool what is already complete.  ``granularity``
says which events a tool wants early:

* ``ON_START``  -- :meth:`Tool.on_start` as soon as the call's name is decoded
  (open a connection, warm a cache); everything else at the end.
* ``ON_FIELD``  -- also :meth:`Tool.on_field` for each top-level argument whose
  JSON value is complete (start a search once ``query`` is known).
* ``ON_LINE``   -- also :meth:`Tool.on_line` for each complete top-level
  statement of code (a code interpreter runs ``import`` lines while the model
  is still writing the plot).
* ``ON_FINISH`` -- nothing early: the worker is only involved once the
  arguments are complete.

Whatever the granularity, every call sees ``on_start`` first, then its
fields/lines in order, then ``on_finish(arguments)`` and ``on_close``.  With
partial execution switched off for a call the same sequence is replayed at
the end, so a tool's result never depends on the mode, only its latency.

Lifecycle of the prototype, for tools that need settings or resources::

    (validation)          gateway process, by the plugin host: the settings are
                          checked against ``settings_schema`` + COMMON_SETTINGS
    configure(settings)   gateway process, by the plugin host (settings dict)
    (common settings)     gateway process, by the host: workers, timeout_s, nice,
                          memory_mb, cpu_s, env set as attributes
    check()               gateway process, by the host: the declaration is sane
    setup()               gateway process, once, before workers start
    worker_init()         each worker process, once, before its first call
    on_start/.../on_close each call, in a worker
    teardown()            gateway process, when the runtime closes

Handlers may raise :class:`ToolError` (or a subclass) with a message meant for
the model; any other exception is reported as a tool failure too, but means a
bug in the tool.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Mapping
from typing import Any

__all__ = [
    "Granularity",
    "Tool",
    "AsyncTool",
    "ToolError",
    "ToolTimeout",
    "ToolCrashed",
    "ToolCancelled",
    "ToolVetoed",
    "ToolUnavailable",
    "InvalidToolArguments",
    "UnknownTool",
    "ToolConfigError",
    "COMMON_SETTINGS",
]

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")

#: Settings every tool takes, as JSON Schema property schemas.  The plugin
#: host validates them and sets the :class:`Tool` attribute of the same name;
#: a tool's own settings are described by :attr:`Tool.settings_schema`.
COMMON_SETTINGS: dict[str, dict[str, Any]] = {
    "workers": {"type": "integer", "minimum": 1, "description": "Worker processes kept warm for the tool."},
    "timeout_s": {"type": "number", "exclusiveMinimum": 0, "description": "Wall-clock seconds per call."},
    "nice": {"type": "integer", "minimum": 0, "maximum": 19, "description": "Added to the workers' nice value."},
    "memory_mb": {"type": "integer", "minimum": 16, "description": "Address-space limit of a worker, in MiB."},
    "cpu_s": {"type": "number", "exclusiveMinimum": 0, "description": "CPU seconds per call."},
    "env": {
        "type": "object",
        "additionalProperties": {"type": "string"},
        "description": "Extra environment variables for the workers (which otherwise get a minimal one).",
    },
    "sandbox": {"type": "boolean",
                "description": "Run the workers in the sandbox (gateway/tools/sandbox.py); refuse to start without it."},
    "sandbox_uid": {"type": "integer", "minimum": 1, "maximum": 4294967294,
                    "description": "Unprivileged uid (and gid) the sandboxed workers run as."},
}


class Granularity(enum.Enum):
    """When partial execution calls into a tool (see the module docstring)."""

    ON_START = "on_start"
    ON_FIELD = "on_field"
    ON_LINE = "on_line"
    ON_FINISH = "on_finish"


# --------------------------------------------------------------------------- errors


class ToolError(Exception):
    """A tool call failed; ``str(err)`` is what the model is shown.

    ``error_type`` names the failure for clients and logs.  It defaults to the
    class name and survives the trip from a worker process, where the original
    class may be one the gateway process never imported.
    """

    def __init__(self, message: str = "", *, error_type: str | None = None) -> None:
        super().__init__(message)
        self.error_type = error_type or type(self).__name__


class ToolTimeout(ToolError):
    """The call ran past its wall-clock or CPU budget; its worker was killed."""


class ToolCrashed(ToolError):
    """The worker process died during the call (segfault, ``os._exit``, OOM kill)."""


class ToolCancelled(ToolError):
    """The call was cancelled (model output abandoned, client disconnected)."""


class ToolUnavailable(ToolError):
    """The service behind an :class:`AsyncTool` is down (an MCP server restarting)."""


class ToolVetoed(ToolError):
    """A ``before_tool_execution`` hook refused the call; the message is its reason."""


class UnknownTool(ToolError, LookupError):
    """The model called a tool the gateway does not serve."""


class InvalidToolArguments(ToolError):
    """An argument does not match the tool's schema.

    ``field`` is the top-level argument at fault (``None`` when the arguments
    as a whole are wrong).  Raised the moment a bad field completes when the
    tool has ``validate_early`` set, so a doomed call is aborted before the
    model has finished writing it.
    """

    def __init__(self, field: str | None, message: str) -> None:
        self.field = field
        self.message = message
        text = f"invalid argument {field!r}: {message}" if field else f"invalid arguments: {message}"
        super().__init__(text)

    def __reduce__(self):  # the default would call cls(text) and lose ``field``
        return (type(self), (self.field, self.message))


class ToolConfigError(ValueError):
    """A tool's settings are wrong; raised at configuration time, not per call."""


# --------------------------------------------------------------------------- the base class


class Tool:
    """Base class for server-side tools.  Override the class attributes and handlers.

    Only :meth:`on_finish` is required.  Instances must be picklable: the
    runtime sends the configured prototype to each worker process.
    """

    #: Name the model calls the tool by (letters, digits, ``_ . -``).
    name: str = ""
    #: What the tool does, for the model.
    description: str = ""
    #: JSON Schema of the arguments object.
    parameters: dict[str, Any] = {"type": "object", "properties": {}}
    #: When partial execution calls into the tool.
    granularity: Granularity = Granularity.ON_FINISH
    #: Check each argument against its property schema as soon as it completes.
    validate_early: bool = True
    #: Wall-clock seconds ``finish()`` waits for the result before killing the worker.
    timeout_s: float = 30.0
    #: Seconds a call is expected to take, where the tool knows (a web API's usual latency):
    #: the prior the scheduler's ranking and the interception policy use until the gateway
    #: has timed calls of the tool (then the learned time wins).  None: learned only.
    expected_s: float | None = None
    #: For ``ON_LINE`` tools: the argument the streamed lines belong to (``"code"``).
    line_field: str | None = None
    #: Worker processes kept warm for this tool (calls beyond this queue).
    workers: int = 1
    #: Added to the worker processes' nice value (lower CPU priority).
    nice: int = 0
    #: Address-space limit of each worker process, in MiB.
    memory_mb: int = 1024
    #: CPU seconds one call may use.
    cpu_s: float = 30.0
    #: Extra environment variables for the workers; the host replaces it, never mutate it.
    env: Mapping[str, str] = {}
    #: Run the workers in the sandbox of :mod:`interlace.gateway.tools.sandbox` (bubblewrap
    #: namespaces, an unprivileged uid, seccomp, a cgroup per worker).  A tool that asks for it
    #: and cannot have it makes the runtime's start-up fail with a :class:`ToolConfigError`.
    sandbox: bool = False
    #: The unprivileged uid (and gid) of sandboxed workers (never 0).
    sandbox_uid: int = 65534
    #: Further host paths a sandboxed worker may read (bound read-only; interlace, the
    #: interpreter, the virtualenv and the tool's own package are always there).
    sandbox_ro_paths: tuple[str, ...] = ()
    #: With ``sandbox``: start without it where the OS cannot give it (reported, never silent).
    allow_unisolated: bool = False
    #: Set by the tool runtime when it starts the tool's pool: the sandbox's report
    #: (``{"sandbox": "bubblewrap", "uid": ..., ...}``) or ``{"sandbox": "none", ...}``;
    #: ``None`` before.  Workers see it too (it is set before the prototype is pickled).
    sandbox_in_force: Mapping[str, Any] | None = None
    #: ``False`` hides the tool (e.g. a database tool with no database configured).
    enabled: bool = True
    #: JSON Schema of the tool's own settings (the ``tools.<name>`` config section,
    #: minus :data:`COMMON_SETTINGS`).  A key that is neither declared here nor
    #: common is a configuration error; declare ``additionalProperties`` (a schema
    #: or ``true``) or ``patternProperties`` to accept free-form keys.
    settings_schema: dict[str, Any] = {"type": "object", "properties": {}}

    # -- gateway-process lifecycle -------------------------------------------------

    def configure(self, settings: Mapping[str, Any]) -> None:
        """Apply this tool's settings (called by the plugin host; default: ignore)."""

    def setup(self) -> None:
        """Prepare shared resources once before workers start (e.g. build an index)."""

    def teardown(self) -> None:
        """Release what :meth:`setup` created (runtime close)."""

    def info(self) -> dict[str, Any]:
        """Facts worth reporting in ``interlace plugins`` and ``GET /v1/plugins``
        (e.g. the isolation a sandbox has).  Must be JSON-able; default none."""
        return {}

    # -- worker-process handlers ---------------------------------------------------

    def worker_init(self) -> Mapping[str, Any] | None:
        """Run once in each new worker; return facts worth reporting (isolation in force)."""
        return None

    def on_start(self) -> None:
        """The call began: its name is decoded, arguments are still coming."""

    def on_field(self, key: str, value: Any) -> None:
        """A top-level argument is complete (``ON_FIELD`` tools)."""

    def on_line(self, line: str) -> None:
        """A complete top-level code statement (``ON_LINE`` tools)."""

    def on_finish(self, arguments: dict[str, Any]) -> Any:
        """All arguments are known: return the result (a ``str`` or JSON-able value)."""
        raise NotImplementedError(f"tool {self.name!r} does not implement on_finish")

    def on_close(self) -> None:
        """The call ended (finished, failed or cancelled): release per-call resources."""

    # -- results (gateway process) -----------------------------------------------------

    def result_text(self, content: Any) -> str:
        """How one of this tool's results reads where a later step refers to it
        (a plan format's ``$N``): the value a reader wants, not the whole record.
        The default is the text itself, or the result as JSON; a tool whose result
        is a record overrides it (the calculator answers with its ``result``)."""
        if isinstance(content, str):
            return content.strip()
        return json.dumps(content, ensure_ascii=False)

    # -- declarations and validation (gateway process) -------------------------------

    def spec(self) -> dict[str, Any]:
        """The OpenAI-style function declaration shown to the model."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    def check(self) -> None:
        """Fail fast on a bad declaration (called at registration)."""
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ToolConfigError(f"invalid tool name {self.name!r}")
        if not isinstance(self.granularity, Granularity):
            raise ToolConfigError(f"tool {self.name!r}: granularity must be a Granularity")
        if self.parameters.get("type", "object") != "object":
            raise ToolConfigError(f"tool {self.name!r}: parameters must describe an object")
        if self.timeout_s <= 0 or self.workers < 1 or self.memory_mb < 1 or self.cpu_s <= 0:
            raise ToolConfigError(f"tool {self.name!r}: timeout_s, workers, memory_mb and cpu_s must be positive")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in dict(self.env).items()):
            raise ToolConfigError(f"tool {self.name!r}: env must map strings to strings")
        e = self.expected_s
        if e is not None and (isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 <= e < float("inf")):
            raise ToolConfigError(f"tool {self.name!r}: expected_s must be a finite number of seconds >= 0 or None")
        if not isinstance(self.settings_schema, dict) or self.settings_schema.get("type", "object") != "object":
            raise ToolConfigError(f"tool {self.name!r}: settings_schema must describe an object")
        from jsonschema import validators

        validators.validator_for(self.settings_schema).check_schema(self.settings_schema)
        self._validators()  # raises jsonschema.SchemaError on a broken schema

    def validate_field(self, key: str, value: Any) -> None:
        """Check one completed top-level argument; raise :class:`InvalidToolArguments`.

        Known keys are checked against their property schema, unknown keys
        against ``patternProperties``/``additionalProperties``.  ``required``
        cannot be judged before the end and is left to :meth:`validate_arguments`.
        """
        field_validator, _ = self._validators()
        error = _best_error(field_validator, {key: value})
        if error is not None:
            raise InvalidToolArguments(key, error.message)

    def validate_arguments(self, arguments: Any) -> None:
        """Check the complete arguments object; raise :class:`InvalidToolArguments`."""
        if not isinstance(arguments, dict):
            raise InvalidToolArguments(None, f"arguments must be a JSON object, not {type(arguments).__name__}")
        _, full_validator = self._validators()
        error = _best_error(full_validator, arguments)
        if error is None:
            return
        field: str | None = None
        if error.path:
            field = str(error.path[0])
        elif error.validator == "required":
            missing = [r for r in error.validator_value if r not in arguments]
            field = missing[0] if missing else None
        elif error.validator in ("additionalProperties", "unevaluatedProperties", "propertyNames"):
            field_validator, _ = self._validators()  # name the first key that fails on its own
            field = next((k for k in arguments if _best_error(field_validator, {k: arguments[k]})), None)
        raise InvalidToolArguments(field, error.message)

    def _validators(self) -> tuple[Any, Any]:
        """Compiled validators, built lazily and cached on the instance (not pickled)."""
        cached = self.__dict__.get("_validator_cache")
        if cached is None:
            from jsonschema import validators  # imported here: workers never need it

            schema = self.parameters
            cls = validators.validator_for(schema)
            cls.check_schema(schema)
            keep = ("$schema", "$id", "$defs", "definitions", "properties", "patternProperties", "additionalProperties")
            # One schema for "does this single key/value fit?": the object keywords
            # minus the ones (required, minProperties, ...) only the whole object can satisfy.
            field_schema = {"type": "object", **{k: schema[k] for k in keep if k in schema}}
            cached = (cls(field_schema), cls(schema))
            self.__dict__["_validator_cache"] = cached
        return cached

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_validator_cache", None)
        return state

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.granularity.name}>"


def _best_error(validator: Any, instance: Any) -> Any:
    from jsonschema.exceptions import best_match

    return best_match(validator.iter_errors(instance))


class AsyncTool(Tool):
    """A tool whose work happens in another service (an MCP server, a web API).

    The runtime runs :meth:`call` as a coroutine in the gateway's event loop,
    with no worker process: the tool's own code only waits on I/O, and the
    containment that worker processes give (rlimits, a clean environment, a
    killable process group) belongs to the service doing the work.  Schema
    validation (early, per field), the ``before_tool_execution`` policy, the
    wall-time limit ``timeout_s`` and cancellation apply exactly as for other
    tools.  ``workers``, ``memory_mb``, ``cpu_s``, ``nice`` and ``env`` do not
    apply.  An async tool is not partially executed: :meth:`call` gets the
    complete arguments.
    """

    #: Calls of this tool that may run at once (more wait their turn).
    max_concurrent: int = 16

    async def call(self, arguments: dict[str, Any], request: Any) -> Any:
        """Run the call; return the result (a ``str`` or JSON-able value) or raise :class:`ToolError`."""
        raise NotImplementedError(f"tool {self.name!r} does not implement call")

    def unavailable(self) -> str | None:
        """Why the tool cannot run now (its service is down), or ``None`` when it can."""
        return None

    def check(self) -> None:
        super().check()
        if self.granularity is not Granularity.ON_FINISH:
            raise ToolConfigError(f"tool {self.name!r}: an AsyncTool gets its arguments whole (granularity ON_FINISH)")
        if not isinstance(self.max_concurrent, int) or self.max_concurrent < 1:
            raise ToolConfigError(f"tool {self.name!r}: max_concurrent must be a positive integer")
