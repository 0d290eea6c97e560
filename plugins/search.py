"""The ``search`` tool: full-text search over a local corpus with SQLite FTS5.

The corpus (a directory of ``.txt``/``.md`` files, or a JSONL file of
``{"text": ..., "title"?: ..., "id"?/"url"?: ...}`` records) is indexed once
in the gateway process at start-up (:meth:`SearchTool.setup`), into a
configured file or a temporary one that :meth:`SearchTool.teardown` deletes.
Workers open the index read-only.

``ON_FIELD`` granularity: the search starts the moment ``query`` is
complete, while the model may still be writing ``k``; the Conveyor Search
case.  ``delay_s`` adds an artificial latency to each search, to emulate a
remote search API in benchmarks without a network.
"""

from __future__ import annotations

import json
import os
import re
import sqlite3
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from interlace import Granularity, Tool, ToolConfigError, ToolError

__all__ = ["SearchTool", "build_index", "iter_corpus"]

_TOKEN_RE = re.compile(r"\w+", re.UNICODE)
_TEXT_SUFFIXES = {".txt", ".md", ".rst", ".text"}


def iter_corpus(path: Path) -> Iterator[tuple[str, str, str]]:
    """Yield ``(source, title, body)`` for each document of a directory or JSONL corpus."""
    if path.is_dir():
        for file in sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _TEXT_SUFFIXES):
            text = file.read_text(encoding="utf-8", errors="replace")
            first = text.strip().splitlines()[0] if text.strip() else file.stem
            yield str(file.relative_to(path)), first.lstrip("# ").strip()[:200], text
    elif path.suffix.lower() in (".jsonl", ".ndjson"):
        with path.open(encoding="utf-8") as fh:
            for n, raw in enumerate(fh, 1):
                if not raw.strip():
                    continue
                try:
                    rec = json.loads(raw)
                    body = str(rec["text"])
                except (ValueError, KeyError, TypeError) as exc:
                    raise ToolConfigError(f"{path}:{n}: need a JSON object with 'text' ({exc})") from None
                source = str(rec.get("url") or rec.get("id") or f"{path.name}:{n}")
                yield source, str(rec.get("title") or body[:80]), body
    else:
        raise ToolConfigError(f"search corpus {str(path)!r} is neither a directory nor a .jsonl file")


def build_index(corpus: Path, index: Path) -> int:
    """(Re)build an FTS5 index of ``corpus`` at ``index``; return the document count."""
    if index.exists():
        index.unlink()
    conn = sqlite3.connect(index)
    try:
        conn.execute("CREATE VIRTUAL TABLE docs USING fts5(title, body, source UNINDEXED, tokenize='porter unicode61')")
        with conn:
            conn.executemany("INSERT INTO docs (source, title, body) VALUES (?, ?, ?)", iter_corpus(corpus))
        return conn.execute("SELECT count(*) FROM docs").fetchone()[0]
    finally:
        conn.close()


def fts_query(text: str) -> str | None:
    """A safe FTS5 MATCH expression: each word quoted (no operator injection), OR-ed, bm25-ranked."""
    words = _TOKEN_RE.findall(text)[:32]
    return " OR ".join('"' + w.replace('"', '""') + '"' for w in words) or None


class SearchTool(Tool):
    """Settings: ``corpus`` (directory or JSONL; without it the tool is disabled),
    ``index_path`` (default: a temporary file), ``delay_s`` (default 0),
    ``default_k`` (5), ``max_k`` (20)."""

    name = "search"
    description = "Search the document collection and return the best-matching snippets."
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {
            "query": {"type": "string", "minLength": 1, "description": "What to search for."},
            "k": {"type": "integer", "minimum": 1, "maximum": 20, "description": "How many results (default 5)."},
        },
        "required": ["query"],
        "additionalProperties": False,
    }
    settings_schema: dict[str, Any] = {
        "type": "object",
        "properties": {
            "corpus": {"type": "string", "description": "A directory of .txt/.md files or a JSONL file."},
            "index_path": {"type": "string", "description": "Where to build the index (default: a temporary file)."},
            "delay_s": {"type": "number", "minimum": 0, "description": "Added latency per search (benchmarks)."},
            "default_k": {"type": "integer", "minimum": 1},
            "max_k": {"type": "integer", "minimum": 1},
        },
        "additionalProperties": False,
    }
    granularity = Granularity.ON_FIELD
    timeout_s = 20.0
    workers = 2

    def info(self) -> dict[str, Any]:
        """What the tool can reach: its own index, read-only."""
        return {"reaches": "its full-text index of the configured corpus, read-only" if self.corpus
                else "nothing (no corpus)", "corpus": self.corpus, "documents": self.documents}

    def __init__(self) -> None:
        self.corpus: str | None = None
        self.index_path: str | None = None
        self.delay_s = 0.0
        self.default_k = 5
        self.max_k = 20
        self.enabled = False
        self.documents = 0
        self._owns_index = False

    def configure(self, settings: Mapping[str, Any]) -> None:
        corpus = settings.get("corpus")
        self.delay_s = float(settings.get("delay_s", self.delay_s))
        self.default_k = int(settings.get("default_k", self.default_k))
        self.max_k = int(settings.get("max_k", self.max_k))
        self.index_path = settings.get("index_path") or None
        self.parameters = {**self.parameters, "properties": {
            **self.parameters["properties"], "k": {"type": "integer", "minimum": 1, "maximum": self.max_k}}}
        self.__dict__.pop("_validator_cache", None)
        if not corpus:
            self.enabled = False
            return
        path = Path(os.path.expanduser(str(corpus))).resolve()
        if not path.exists():
            raise ToolConfigError(f"search corpus {str(path)!r} does not exist")
        self.corpus = str(path)
        self.enabled = True

    # -- gateway process ----------------------------------------------------------------

    def setup(self) -> None:
        if not self.enabled or not self.corpus:
            return
        if self.index_path is None:
            fd, tmp = tempfile.mkstemp(prefix="interlace-search-", suffix=".sqlite3")
            os.close(fd)
            self.index_path, self._owns_index = tmp, True
        self.documents = build_index(Path(self.corpus), Path(self.index_path))

    def teardown(self) -> None:
        if self._owns_index and self.index_path:
            for suffix in ("", "-wal", "-shm", "-journal"):
                try:
                    os.unlink(self.index_path + suffix)
                except FileNotFoundError:
                    pass
            self.index_path, self._owns_index = None, False

    # -- worker process -----------------------------------------------------------------

    def worker_init(self) -> dict[str, Any]:
        self._db: sqlite3.Connection | None = None
        if self.index_path:
            uri = Path(self.index_path).as_uri() + "?mode=ro"
            self._db = sqlite3.connect(uri, uri=True, check_same_thread=False)
        return {"documents": self.documents, "delay_s": self.delay_s}

    def search(self, query: str, k: int) -> list[dict[str, Any]]:
        if self._db is None:
            raise ToolError("search index not available")
        if self.delay_s:
            time.sleep(self.delay_s)  # emulated round trip of a remote search API
        match = fts_query(query)
        if match is None:
            return []
        rows = self._db.execute(
            "SELECT source, title, snippet(docs, 1, '', '', ' … ', 24), bm25(docs) "
            "FROM docs WHERE docs MATCH ? ORDER BY bm25(docs) LIMIT ?",
            (match, k),
        ).fetchall()
        return [{"source": s, "title": t, "snippet": snip, "score": round(-score, 4)} for s, t, snip, score in rows]

    def on_start(self) -> None:
        self._early: tuple[str, list[dict[str, Any]]] | None = None

    def on_field(self, key: str, value: Any) -> None:
        if key == "query" and isinstance(value, str):
            self._early = (value, self.search(value, self.max_k))

    def result_text(self, content: Any) -> str:
        """A later step that refers to a search wants its best hit's text."""
        if isinstance(content, dict) and isinstance(content.get("results"), list) and content["results"]:
            top = content["results"][0]
            content = (top.get("snippet") or top.get("text") or top) if isinstance(top, dict) else top
        return super().result_text(content)

    def on_finish(self, arguments: dict[str, Any]) -> dict[str, Any]:
        query = arguments["query"]
        k = min(int(arguments.get("k") or self.default_k), self.max_k)
        if self._early is not None and self._early[0] == query:
            results = self._early[1][:k]
        else:
            results = self.search(query, k)
        return {"query": query, "results": results}
