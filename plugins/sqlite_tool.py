"""The ``sqlite`` tool: read-only SQL over a configured database file.

``ON_START`` granularity: the connection is opened as soon as the model has
named the tool (the Conveyor Database case), the query runs once it is
complete.  Three layers keep it read-only, so a write fails with a typed
:class:`ReadOnlyQueryError` instead of touching the file:

1. the file is opened through a ``file:...?mode=ro`` URI;
2. ``PRAGMA query_only`` is set;
3. an authorizer denies every action but reading (no ATTACH of a writable
   file, no PRAGMA that changes state).
"""

from __future__ import annotations

import base64
import os
import sqlite3
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from interlace.gateway.tools import Granularity, Tool, ToolConfigError, ToolError

__all__ = ["SqliteTool", "ReadOnlyQueryError", "SqlError"]


class ReadOnlyQueryError(ToolError):
    """The query tried to modify the database."""


class SqlError(ToolError):
    """The query is not valid SQL for this database."""


_ALLOWED_ACTIONS = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION}
_ALLOWED_ACTIONS.add(getattr(sqlite3, "SQLITE_RECURSIVE", 33))
#: Introspection pragmas a model may reasonably use; all others are denied.
_READ_PRAGMAS = {"table_info", "table_xinfo", "table_list", "index_list", "index_info", "foreign_key_list"}
_ACTION_NAMES = {getattr(sqlite3, n): n[7:] for n in dir(sqlite3) if n.startswith("SQLITE_") and n.isupper()
                 and isinstance(getattr(sqlite3, n), int) and n not in ("SQLITE_OK", "SQLITE_DENY", "SQLITE_IGNORE")}


def _jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode("ascii")}
    return value


class SqliteTool(Tool):
    """Settings: ``database`` (path; without it the tool is disabled), ``max_rows`` (default 200)."""

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
    granularity = Granularity.ON_START
    timeout_s = 10.0

    def __init__(self) -> None:
        self.database: str | None = None
        self.max_rows = 200
        self.enabled = False

    def configure(self, settings: Mapping[str, Any]) -> None:
        database = settings.get("database")
        self.max_rows = int(settings.get("max_rows", self.max_rows))
        self.timeout_s = float(settings.get("timeout_s", self.timeout_s))
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
        self._conn.set_authorizer(self._authorize)

    def _authorize(self, action: int, arg1: str | None, arg2: str | None, db: str | None, trigger: str | None) -> int:
        if action in _ALLOWED_ACTIONS:
            return sqlite3.SQLITE_OK
        if action == sqlite3.SQLITE_PRAGMA and arg1 and arg1.lower() in _READ_PRAGMAS and arg2 is None:
            return sqlite3.SQLITE_OK
        self._denied = _ACTION_NAMES.get(action, str(action))
        return sqlite3.SQLITE_DENY

    def on_finish(self, arguments: dict[str, Any]) -> dict[str, Any]:
        query, params = arguments["query"], arguments.get("params") or []
        try:
            assert self._conn is not None
            cursor = self._conn.execute(query, params)
            rows = cursor.fetchmany(self.max_rows + 1)
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
            "rows": [[_jsonable(v) for v in row] for row in rows[: self.max_rows]],
            "truncated": len(rows) > self.max_rows,
        }

    def on_close(self) -> None:
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()
            self._conn = None
