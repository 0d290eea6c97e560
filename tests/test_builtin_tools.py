"""The built-in tools: python, calculator, sqlite, search, format.

Pure logic (calculator, format) is tested in-process; everything else runs
through one shared runtime, as the gateway would run it.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from interlace.gateway.tool_runtime import ToolResult, ToolRuntime
from interlace.gateway.tools import InvalidToolArguments, ToolConfigError
from interlace.plugins.calculator import CalculatorError, CalculatorTool, evaluate
from interlace.plugins.format_tool import FormatError, FormatTool, safe_format
from interlace.plugins.python_tool import PythonTool, probe_isolation
from interlace.plugins.search import SearchTool, fts_query
from interlace.plugins.sqlite_tool import SqliteTool

# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("db") / "shop.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE items (id INTEGER PRIMARY KEY, name TEXT, price REAL, blob BLOB)")
    conn.executemany("INSERT INTO items (name, price, blob) VALUES (?, ?, ?)",
                     [(f"item{i}", i * 1.5, b"\x00\x01" if i == 1 else None) for i in range(1, 31)])
    conn.commit()
    conn.close()
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    docs = {
        "python.md": "# Hello world in Python\nUse print('Hello, world!') to write hello world in Python.",
        "cpp.md": "# Hello world in C++\nInclude iostream and write std::cout << \"Hello, world!\".",
        "java.txt": "Hello world in Java\nA public class with a static main method calls System.out.println.",
        "caps.txt": "Market capitalization\nMicrosoft and Apple are the largest companies by market cap.",
    }
    for name, text in docs.items():
        (root / name).write_text(text)
    return root


class Harness:
    """One event loop and one runtime for the whole module (workers start once)."""

    def __init__(self, tools: list[Any]) -> None:
        self.loop = asyncio.new_event_loop()
        self.runtime = ToolRuntime(tools)
        self.loop.run_until_complete(self.runtime.start())

    def __call__(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    def run(self, name: str, arguments: dict[str, Any], **kw: Any) -> ToolResult:
        return self(self.runtime.run(name, arguments, **kw))

    def close(self) -> None:
        self.loop.run_until_complete(self.runtime.close())
        self.loop.close()


@pytest.fixture(scope="module")
def rt(database: Path, corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    python = PythonTool()
    python.configure({"cpu_time_s": 1, "memory_mb": 1024, "timeout_s": 10})
    sqlite = SqliteTool()
    sqlite.configure({"database": str(database), "max_rows": 10})
    search = SearchTool()
    search.configure({"corpus": str(corpus), "delay_s": 0.3})
    harness = Harness([python, CalculatorTool(), sqlite, search, FormatTool()])
    yield harness
    harness.close()
    assert search.index_path is None  # the temporary index was removed


# --------------------------------------------------------------------------- python


def test_python_runs_statement_before_next_is_delivered(rt: Harness, tmp_path: Path) -> None:
    """Partial execution: statement 1's side effect is visible before statement 2 is sent."""
    marker = tmp_path / "marker"
    code = [f"open({str(marker)!r}, 'w').write('1')", "import time", "t_second = time.time()", "t_second"]

    async def main() -> tuple[float, float, ToolResult]:
        call = await rt.runtime.begin("python", "py1")
        await call.line(code[0])
        t0 = time.monotonic()
        while not marker.exists():  # the model is "still decoding": nothing else sent yet
            assert time.monotonic() - t0 < 5, "statement 1 did not run before statement 2 was delivered"
            await asyncio.sleep(0.005)
        seen_at = time.time()
        for line in code[1:]:
            await call.line(line)
        return seen_at, time.time(), await call.finish({"code": "\n".join(code)})

    seen_at, _, result = rt(main())
    assert result.ok, result.error
    assert result.content["error"] is None and result.content["statements_run_early"] == 4
    assert float(result.content["result"]) >= seen_at


def test_python_partial_off_runs_only_at_finish(rt: Harness, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    code = f"open({str(marker)!r}, 'w').write('1')\n6 * 7"

    async def main() -> tuple[bool, ToolResult]:
        call = await rt.runtime.begin("python", partial=False)
        for line in code.splitlines():
            await call.line(line)
        await asyncio.sleep(0.2)
        existed = marker.exists()
        return existed, await call.finish({"code": code})

    existed, result = rt(main())
    assert not existed and marker.exists()
    assert result.ok and result.content["result"] == "42" and result.content["statements_run_early"] == 2


def test_python_captures_output_and_finishes_unstreamed_code(rt: Harness) -> None:
    code = "import sys\nx = [i * i for i in range(5)]\nprint('sum', sum(x))\nprint('oops', file=sys.stderr)\nx[-1]"

    async def main() -> ToolResult:
        call = await rt.runtime.begin("python")
        for line in code.splitlines()[:2]:  # the parser delivered only two statements
            await call.line(line)
        return await call.finish({"code": code})

    result = rt(main())
    assert result.ok
    c = result.content
    assert (c["stdout"], c["stderr"], c["result"], c["error"]) == ("sum 30\n", "oops\n", "16", None)
    assert (c["statements"], c["statements_run_early"]) == (5, 2)


def test_python_exception_stops_later_statements(rt: Harness) -> None:
    code = "print('before')\n1 / 0\nprint('after')"
    result = rt.run("python", {"code": code})
    c = result.content
    assert result.ok and c["stdout"] == "before\n" and "ZeroDivisionError" in c["error"]
    assert "tool_runtime" not in c["error"] and "python_tool" not in c["error"]  # user frames only


def test_python_multiline_blocks_and_state(rt: Harness) -> None:
    code = "def f(n):\n    return n + 1\n\nclass A:\n    v = 2\n\nf(A.v)"

    async def main() -> ToolResult:
        call = await rt.runtime.begin("python")
        for stmt in ("def f(n):\n    return n + 1", "class A:\n    v = 2", "f(A.v)"):
            await call.line(stmt)
        return await call.finish({"code": code})

    assert rt(main()).content["result"] == "3"


def test_python_calls_do_not_share_variables(rt: Harness) -> None:
    rt.run("python", {"code": "leak = 1"})
    assert "NameError" in rt.run("python", {"code": "leak"}).content["error"]


def test_python_cpu_limit(rt: Harness) -> None:
    result = rt.run("python", {"code": "while True:\n    pass"})
    assert result.ok and "CPUTimeExceeded" in result.content["error"]
    assert rt.run("python", {"code": "1 + 1"}).content["result"] == "2"  # worker survived, limit reset


def test_python_memory_limit(rt: Harness) -> None:
    result = rt.run("python", {"code": "x = bytearray(4 * 1024 ** 3)"})
    assert result.ok and "MemoryError" in result.content["error"]


def test_python_isolation_reported_and_network_blocked(rt: Harness) -> None:
    (info,) = rt.runtime.worker_info("python")
    iso = info["isolation"]
    assert iso["memory_bytes"] == 1024 << 20 and iso["cpu_time_s_per_call"] == 1
    assert "numpy" in info["warm_imports"]
    code = "import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('93.184.216.34', 80))"
    result = rt.run("python", {"code": code})
    if iso["network_namespace"] is None:
        # This kernel refuses a private network namespace: then the worker must
        # not claim isolation -- it reports the host's own interfaces.
        assert iso["network_interfaces"] == [name for _, name in socket.if_nameindex()]
        return
    assert iso["network_interfaces"] == ["lo"]
    error = result.content["error"] or ""
    assert "OSError" in error or "unreachable" in error


def test_probe_isolation_matches_worker(rt: Harness) -> None:
    probed = probe_isolation()
    assert probed["network_namespace"] == rt.runtime.worker_info("python")[0]["isolation"]["network_namespace"]


def test_python_schema_rejects_extra_field(rt: Harness) -> None:
    result = rt.run("python", {"code": "1", "timeout": 5})
    assert not result.ok and result.error_type == "InvalidToolArguments" and result.field == "timeout"


# --------------------------------------------------------------------------- calculator


@pytest.mark.parametrize(
    ("expression", "value"),
    [("200*701", 140200), ("(1 + 2) * -3", -9), ("7 // 2 + 7 % 2", 4), ("2 ** 10", 1024), ("sqrt(16) + pi - pi", 4.0),
     ("max(1, 5, 3)", 5), ("2 ** -1", 0.5), ("factorial(10)", 3628800), ("1e3 / 4", 250.0)],
)
def test_calculator_evaluates(expression: str, value: float) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    "expression",
    ["__import__('os')", "__import__('os').system('true')", "(1).__class__", "open('x')", "lambda: 1",
     "[1, 2]", "'a' * 3", "x + 1", "1 if 1 else 2", "a.b()", "sqrt(x=4)", "True + 1"],
)
def test_calculator_rejects_non_arithmetic(expression: str) -> None:
    with pytest.raises(CalculatorError):
        evaluate(expression)


@pytest.mark.parametrize("expression", ["9 ** 9 ** 9", "10 ** 100000", "2 ** 5000", "(10 ** 1000) ** 5",
                                        "factorial(100000)", "1 / 0", "1" * 1001, "exp(1000)", "(-8) ** 0.5"])
def test_calculator_bounds_and_errors(expression: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(CalculatorError):
        evaluate(expression)
    assert time.monotonic() - t0 < 0.5


def test_calculator_aborts_early_in_worker(rt: Harness) -> None:
    async def main() -> tuple[BaseException, ToolResult]:
        call = await rt.runtime.begin("calculator")
        await call.field("expression", "__import__('os')")
        deadline = time.monotonic() + 5
        while call.failure is None and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        with pytest.raises(InvalidToolArguments) as info:
            await call.field("extra", 1)
        return info.value, await call.finish()

    exc, result = rt(main())
    assert exc.field == "expression" and "__import__" in str(exc)
    assert not result.ok and result.field == "expression"
    assert rt.run("calculator", {"expression": "200*701"}).content == {"expression": "200*701", "result": 140200}


# --------------------------------------------------------------------------- sqlite


def test_sqlite_reads_with_row_limit(rt: Harness) -> None:
    result = rt.run("sqlite", {"query": "SELECT id, name, price, blob FROM items ORDER BY id"})
    assert result.ok, result.error
    c = result.content
    assert c["columns"] == ["id", "name", "price", "blob"] and len(c["rows"]) == 10 and c["truncated"]
    assert c["rows"][0] == [1, "item1", 1.5, {"base64": "AAE="}]
    json.dumps(c)
    params = rt.run("sqlite", {"query": "SELECT count(*) FROM items WHERE price > ?", "params": [40]})
    assert params.content["rows"] == [[4]] and not params.content["truncated"]


@pytest.mark.parametrize(
    "query",
    ["INSERT INTO items (name) VALUES ('x')", "DELETE FROM items", "DROP TABLE items", "UPDATE items SET price = 0",
     "CREATE TABLE t (a)", "ATTACH DATABASE '/tmp/x.db' AS x", "PRAGMA journal_mode = DELETE",
     "WITH d AS (SELECT 1) DELETE FROM items"],
)
def test_sqlite_refuses_writes(rt: Harness, database: Path, query: str) -> None:
    before = database.read_bytes()
    result = rt.run("sqlite", {"query": query})
    assert not result.ok and result.error_type == "ReadOnlyQueryError", result
    assert database.read_bytes() == before


def test_sqlite_sql_errors_and_config() -> None:
    tool = SqliteTool()
    tool.configure({})
    assert not tool.enabled
    with pytest.raises(ToolConfigError):
        tool.configure({"database": "/no/such/file.db"})


def test_sqlite_bad_sql_is_typed(rt: Harness) -> None:
    for query in ("SELEC 1", "SELECT * FROM nope", "SELECT 1; SELECT 2"):
        result = rt.run("sqlite", {"query": query})
        assert not result.ok and result.error_type == "SqlError", (query, result)


# --------------------------------------------------------------------------- search


def test_search_returns_ranked_snippets(rt: Harness) -> None:
    result = rt.run("search", {"query": "hello world python", "k": 2})
    assert result.ok, result.error
    hits = result.content["results"]
    assert len(hits) == 2 and hits[0]["source"] == "python.md" and "print" in hits[0]["snippet"]
    assert hits[0]["score"] >= hits[1]["score"]
    assert rt.run("search", {"query": "zebra quantum"}).content["results"] == []
    assert rt.run("search", {"query": 'AND OR NEAR( "'}).ok  # operators are quoted, not injected


def test_search_starts_on_query_field_and_hides_delay(rt: Harness) -> None:
    """With delay_s=0.3, partial execution hides the 'remote' latency behind decoding."""

    async def one(partial: bool) -> ToolResult:
        call = await rt.runtime.begin("search", partial=partial)
        await call.field("query", "market cap microsoft apple")
        await asyncio.sleep(0.4)  # the model is still writing "k"
        await call.field("k", 1)
        return await call.finish({"query": "market cap microsoft apple", "k": 1})

    early, late = rt(one(True)), rt(one(False))
    assert early.content == late.content and early.content["results"][0]["source"] == "caps.txt"
    assert early.tail_latency_s < 0.2 <= 0.3 <= late.tail_latency_s


def test_search_jsonl_corpus_and_cleanup(tmp_path: Path) -> None:
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text('{"id": "a", "title": "Apples", "text": "apples are red"}\n\n{"text": "bananas are yellow"}\n')
    tool = SearchTool()
    tool.configure({"corpus": str(corpus)})
    tool.setup()
    index = tool.index_path
    assert index and os.path.exists(index) and tool.documents == 2
    tool.worker_init()
    tool.on_start()
    assert tool.on_finish({"query": "bananas"})["results"][0]["source"] == "docs.jsonl:3"
    tool._db.close()
    tool.teardown()
    assert not os.path.exists(index)
    assert fts_query("a \"b\" c*") == '"a" OR "b" OR "c"' and fts_query("!!") is None


def test_search_disabled_without_corpus() -> None:
    tool = SearchTool()
    tool.configure({})
    assert not tool.enabled


# --------------------------------------------------------------------------- format


def test_format_named_positional_and_specs(rt: Harness) -> None:
    assert safe_format("{name} has {n:,} items ({ratio:.1%})", {"name": "MSFT", "n": 12345, "ratio": 0.25}) == \
        "MSFT has 12,345 items (25.0%)"
    assert safe_format("{0} / {1} = {2:.2f}", [3, 2, 1.5]) == "3 / 2 = 1.50"
    assert safe_format("{x:>{w}}|", {"x": "a", "w": 3}) == "  a|"  # nested specs resolve before the width cap
    result = rt.run("format", {"template": "Ratio: {r:.3f}", "values": {"r": 1.23456}})
    assert result.ok and result.content == "Ratio: 1.235" and result.to_text() == "Ratio: 1.235"


@pytest.mark.parametrize(
    ("template", "values"),
    [("{x.__class__}", {"x": 1}), ("{x[0]}", {"x": [1]}), ("{x.__init__.__globals__}", {"x": 1}),
     ("{:>999999999}", ["a"]), ("{x:.99999f}", {"x": 1.0}), ("{missing}", {}), ("{0}", []), ("{", {}),
     ("{x:{w}}", {"x": "a", "w": 10**6})],
)
def test_format_rejects_unsafe_or_broken(template: str, values: Any) -> None:
    with pytest.raises(FormatError):
        safe_format(template, values)


def test_format_tool_error_result(rt: Harness) -> None:
    result = rt.run("format", {"template": "{x.__class__}", "values": {"x": 1}})
    assert not result.ok and result.error_type == "FormatError"
