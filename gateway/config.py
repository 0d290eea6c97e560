"""The gateway's YAML configuration: loading, secrets, validation.

Validation uses a JSON Schema (jsonschema) so every mistake is reported with
the file, the key path and what was expected, e.g.::

    configs/prod.yaml: models.smollm2.dtype: 'fp64' is not one of ['auto', 'float32', 'bfloat16', 'float16']

A string of the form ``os.environ/NAME`` anywhere in the file is replaced by
that environment variable (so API keys stay out of the file); a missing
variable is a configuration error too.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import jsonschema
import yaml

ENV_PREFIX = "os.environ/"

MODEL_SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["path"],
    "properties": {
        "engine": {"enum": ["native"], "description": "which engine serves the model"},
        "path": {"type": "string", "minLength": 1,
                 "description": "'embedded', a Hugging Face model directory or a .gguf file"},
        "parser": {"type": "string", "minLength": 1, "description": "tool-call parser name (default hermes)"},
        "dtype": {"enum": ["auto", "float32", "bfloat16", "float16"]},
        "device": {"type": "string"},
        "block_size": {"type": "integer", "minimum": 1, "maximum": 256},
        "kv_cache_tokens": {"type": "integer", "minimum": 16},
        "max_batched_tokens": {"type": "integer", "minimum": 1},
        "max_seqs": {"type": "integer", "minimum": 1},
        "max_model_len": {"type": "integer", "minimum": 16},
    },
}

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
                "api_keys": {"type": "array", "items": {"type": "string", "minLength": 1}},
                "max_request_bytes": {"type": "integer", "minimum": 1024},
                "max_tool_rounds": {"type": "integer", "minimum": 1, "maximum": 64},
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
    },
}

DEFAULTS = {
    "server": {"host": "127.0.0.1", "port": 8000, "api_keys": [], "max_request_bytes": 4 * 1024 * 1024,
               "max_tool_rounds": 8},
    "plugins": {"entrypoints": True, "modules": []},
    "tools": {},
}
MODEL_DEFAULTS = {"engine": "native", "parser": "hermes", "dtype": "auto", "block_size": 16,
                  "kv_cache_tokens": 16384, "max_batched_tokens": 512, "max_seqs": 256}


class ConfigError(ValueError):
    """The configuration file is missing, unreadable or invalid."""


@dataclass
class ModelSpec:
    name: str
    engine: str
    path: str
    parser: str
    engine_args: Dict[str, Any]


@dataclass
class GatewayConfig:
    host: str
    port: int
    api_keys: List[str]
    max_request_bytes: int
    max_tool_rounds: int
    models: Dict[str, ModelSpec]
    plugin_entrypoints: bool
    plugin_modules: List[str]
    tools: Dict[str, Dict[str, Any]]
    source: str = "<dict>"
    raw: Dict[str, Any] = field(default_factory=dict)


def _substitute_env(node: Any, path: str, source: str) -> Any:
    if isinstance(node, dict):
        return {k: _substitute_env(v, f"{path}.{k}" if path else str(k), source) for k, v in node.items()}
    if isinstance(node, list):
        return [_substitute_env(v, f"{path}[{i}]", source) for i, v in enumerate(node)]
    if isinstance(node, str) and node.startswith(ENV_PREFIX):
        name = node[len(ENV_PREFIX):]
        if name not in os.environ:
            raise ConfigError(f"{source}: {path}: environment variable {name!r} is not set")
        return os.environ[name]
    return node


def _key_path(err: jsonschema.ValidationError) -> str:
    out = ""
    for p in err.absolute_path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def parse_config(data: Any, source: str = "<dict>") -> GatewayConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: (top level): expected a mapping, got {type(data).__name__}")
    errors = sorted(jsonschema.Draft202012Validator(SCHEMA).iter_errors(data), key=lambda e: list(e.absolute_path))
    if errors:
        lines = [f"{source}: {_key_path(e)}: {e.message}" for e in errors[:10]]
        raise ConfigError("invalid configuration\n  " + "\n  ".join(lines))
    data = _substitute_env(copy.deepcopy(data), "", source)
    server = {**DEFAULTS["server"], **data.get("server", {})}
    plugins = {**DEFAULTS["plugins"], **data.get("plugins", {})}
    models = {}
    for name, m in data["models"].items():
        m = {**MODEL_DEFAULTS, **m}
        engine_args = {k: v for k, v in m.items() if k not in ("engine", "path", "parser")}
        models[name] = ModelSpec(name, m["engine"], m["path"], m["parser"], engine_args)
    return GatewayConfig(host=server["host"], port=server["port"], api_keys=list(server["api_keys"]),
                         max_request_bytes=server["max_request_bytes"], max_tool_rounds=server["max_tool_rounds"],
                         models=models, plugin_entrypoints=plugins["entrypoints"],
                         plugin_modules=list(plugins["modules"]), tools=dict(data.get("tools") or {}),
                         source=source, raw=data)


def load_config(path: str | os.PathLike) -> GatewayConfig:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read configuration: {e.strerror or e}") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from e
    return parse_config(data, str(p))
