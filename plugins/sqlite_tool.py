"""The ``sqlite`` tool: read-only SQL over a configured database file.

``ON_START`` granularity: the connection is opened as soon as the model has
named the tool (the Conveyor Database case), the query runs once it is
complete.  Three layers keep it read-only, so a write fails with a typed
:class:`ReadOnlyQueryError` instead of touching the file:

1. the file is opened through a ``file:...?mode=ro`` URI;
2. ``PRAGMA query_only`` is set;
3. an authorizer denies every action but reading (no ATTACH of a writable
   file, no PRAGMA that changes state; introspection pragmas such as
   ``table_info(t)`` are allowed).

``SQLITE_LIMIT_LENGTH`` bounds any string or blob a query builds, the rows
returned are bounded in number and size, and the worker's address space is
bounded by the runtime's ``memory_mb``.
"""

from __future__ import annotations

import base64
import os
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from interlace import Granularity, Tool, ToolConfigError, ToolError

__all__ = ["SqliteTool", "ReadOnlyQueryError", "SqlError"]


class ReadOnlyQueryError(ToolError):
    """The query tried to modify the database."""


class SqlError(ToolError):
    """The query is not valid SQL for this database."""


#: The authorizer's action codes (sqlite3.h, "Authorizer Action Codes").  Spelled out because
#: the ``sqlite3`` module also exports result codes (``SQLITE_ERROR`` = 1, ``SQLITE_INTERRUPT``
#: = 9, ...) that share these numbers: a table built from ``dir(sqlite3)`` names a denied
#: DELETE "INTERRUPT".
_ACTION_NAMES: dict[int, str] = dict(enumerate((
    "CREATE_INDEX", "CREATE_TABLE", "CREATE_TEMP_INDEX", "CREATE_TEMP_TABLE", "CREATE_TEMP_TRIGGER",
    "CREATE_TEMP_VIEW", "CREATE_TRIGGER", "CREATE_VIEW", "DELETE", "DROP_INDEX", "DROP_TABLE",
    "DROP_TEMP_INDEX", "DROP_TEMP_TABLE", "DROP_TEMP_TRIGGER", "DROP_TEMP_VIEW", "DROP_TRIGGER", "DROP_VIEW",
    "INSERT", "PRAGMA", "READ", "SELECT", "TRANSACTION", "UPDATE", "ATTACH", "DETACH", "ALTER_TABLE",
    "REINDEX", "ANALYZE", "CREATE_VTABLE", "DROP_VTABLE", "FUNCTION", "SAVEPOINT", "RECURSIVE"), start=1))
_ACTION_CODES = {name: code for code, name in _ACTION_NAMES.items()}
_ALLOWED_ACTIONS = {_ACTION_CODES[n] for n in ("SELECT", "READ", "FUNCTION", "RECURSIVE")}
#: Read-only introspection pragmas, allowed with or without an argument (``table_info(t)``).
_READ_PRAGMAS = {"table_info", "table_xinfo", "table_list", "index_list", "index_info", "index_xinfo",
                 "foreign_key_list", "foreign_key_check", "collation_list", "database_list", "function_list",
                 "module_list", "pragma_list", "compile_options"}
#: Setting pragmas that may be read (no argument) but never set (``user_version = 3`` is denied).
_READABLE_SETTINGS = {"user_version", "schema_version", "application_id", "encoding", "page_size", "page_count",
                      "freelist_count", "journal_mode", "foreign_keys", "query_only"}
#: Largest string or blob a query may build (``SELECT zeroblob(700000000)`` is a fast error).
DEFAULT_MAX_VALUE_BYTES = 16 << 20
DEFAULT_MAX_RESULT_BYTES = 4 << 20


def authorize_read_only(action: int, arg1: str | None, arg2: str | None) -> bool:
    """Whether the authorizer lets ``action`` through: reading, and read-only pragmas."""
    if action in _ALLOWED_ACTIONS:
        return True
    if action == _ACTION_CODES["PRAGMA"] and arg1:
        name = arg1.lower()
        return name in _READ_PRAGMAS or (name in _READABLE_SETTINGS and arg2 is None)
    return False


def describe_action(action: int, arg1: str | None) -> str:
    """How a denial names what the query tried: ``INSERT on items``, ``PRAGMA journal_mode``.

    Schema changes are authorized as writes to ``sqlite_master`` before their
    own action (``DROP TABLE t`` is first a ``DELETE on sqlite_master``).
    """
    what = _ACTION_NAMES.get(action, f"action {action}")
    if what in ("INSERT", "UPDATE", "DELETE", "PRAGMA") and arg1:
        return f"{what} {arg1}" if what == "PRAGMA" else f"{what} on {arg1}"
    return what


def _value_size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes)) else 8


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode("ascii")}
    return value


class SqliteTool(Tool):
    """Settings: ``database`` (path; without it the tool is disabled), ``max_rows`` (default 200),
    ``max_value_bytes`` (largest string/blob a query may build, default 16 MiB) and
    ``max_result_bytes`` (rows beyond this size are cut, default 4 MiB)."""

    name = "sqlite"
    description = "Run one read-only SQL query (SQLite dialect) against the configured database."
    parameters = {
        "type": "object",
        "properties": {
            "query": {"type": "string", "minLength": 1,
                      "description": "A single SELECT (or WITH ... SELECT) statement."},
            "params": {"type": "array", "items": {"type": ["string", "number", "integer", "boolean", "null"]},
                       "description": "Values for ? placeholders."},
        },
        "required": ["query"],
        "additionalProperties": False,
    }
    settings_schema = {
        "type": "object",
        "properties": {
            "database": {"type": "string", "description": "Path of the SQLite file (opened read-only)."},
            "max_rows": {"type": "integer", "minimum": 1},
            "max_value_bytes": {"type": "integer", "minimum": 1024,
                                "description": "SQLITE_LIMIT_LENGTH: largest string or blob a query builds."},
            "max_result_bytes": {"type": "integer", "minimum": 1024},
        },
        "additionalProperties": False,
    }
    granularity = Granularity.ON_START
    timeout_s = 10.0
    workers = 2

    def __init__(self) -> None:
        self.database: str | None = None
        self.max_rows = 200
        self.max_value_bytes = DEFAULT_MAX_VALUE_BYTES
        self.max_result_bytes = DEFAULT_MAX_RESULT_BYTES
        self.enabled = False

    def info(self) -> dict[str, Any]:
        """What the tool can reach: one database file, read-only."""
        return {"reaches": "the configured database file, read-only" if self.database else "nothing (no database)",
                "database": self.database, "max_rows": self.max_rows, "max_value_bytes": self.max_value_bytes}

    def configure(self, settings: Mapping[str, Any]) -> None:
        database = settings.get("database")
        self.max_rows = int(settings.get("max_rows", self.max_rows))
        self.max_value_bytes = int(settings.get("max_value_bytes", self.max_value_bytes))
        self.max_result_bytes = int(settings.get("max_result_bytes", self.max_result_bytes))
        if not database:
            self.enabled = False
            return
        path = Path(os.path.expanduser(str(database))).resolve()
        if not path.is_file():
            raise ToolConfigError(f"sqlite tool: database {str(path)!r} does not exist")
        self.database = str(path)
        self.enabled = True

    def on_start(self) -> None:
        if not self.database:
            raise ToolError("no database configured")
        self._denied: str | None = None
        self._conn: sqlite3.Connection | None = sqlite3.connect(Path(self.database).as_uri() + "?mode=ro", uri=True, check_same_thread=False)
        self._conn.execute("PRAGMA query_only = ON")
        self._conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, self.max_value_bytes)
        self._conn.set_authorizer(self._authorize)

    def _authorize(self, action: int, arg1: str | None, arg2: str | None, db: str | None, trigger: str | None) -> int:
        if authorize_read_only(action, arg1, arg2):
            return sqlite3.SQLITE_OK
        if self._denied is None:  # name the first denied action: the one the query is about
            self._denied = describe_action(action, arg1)
        return sqlite3.SQLITE_DENY

    def on_finish(self, arguments: dict[str, Any]) -> dict[str, Any]:
        query, params = arguments["query"], arguments.get("params") or []
        try:
            assert self._conn is not None
            cursor = self._conn.execute(query, params)
            rows, size, truncated = [], 0, False
            for row in cursor:
                size += sum(_value_size(v) for v in row)
                if len(rows) == self.max_rows or size > self.max_result_bytes:
                    truncated = True
                    break
                rows.append(row)
        except sqlite3.Error as exc:
            if self._denied or "readonly" in str(exc) or "read-only" in str(exc):
                what = f" ({self._denied} denied)" if self._denied else ""
                raise ReadOnlyQueryError(f"only read-only queries are allowed{what}") from None
            raise SqlError(f"{type(exc).__name__}: {exc}") from None
        except (ValueError, sqlite3.Warning) as exc:  # e.g. several statements at once
            raise SqlError(str(exc)) from None
        columns = [d[0] for d in cursor.description or ()]
        return {
            "columns": columns,
            "rows": [[_jsonable(v) for v in row] for row in rows],
            "truncated": truncated,
        }

    def on_close(self) -> None:
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()
            self._conn = None
