"""The built-in tools: python, calculator, sqlite, search, format.

Pure logic (calculator, format) is tested in-process; everything else runs
through one shared runtime, as the gateway would run it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from interlace.gateway.plugin_host import PluginLoadError, configure_tool
from interlace.gateway.tools.call import ToolResult
from interlace.gateway.tools.runtime import ToolRuntime
from interlace.gateway.tools.base import InvalidToolArguments, ToolConfigError
from interlace.plugins.calculator import CalculatorError, CalculatorTool, evaluate
from interlace.plugins.format_tool import FormatError, FormatTool, safe_format
from interlace.plugins.python_tool import PythonTool
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


#: Set in the gateway process before the workers start; no tool may see it.
SECRET_VAR, SECRET = "INTERLACE_TEST_SECRET_API_KEY", "sk-must-not-leak-7f3a"


@pytest.fixture(scope="module")
def rt(database: Path, corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Harness]:
    python = PythonTool()
    configure_tool(python, {"cpu_time_s": 1, "memory_mb": 1024, "timeout_s": 10, "env": {"INTERLACE_VISIBLE": "yes"}})
    sqlite = SqliteTool()
    sqlite.configure({"database": str(database), "max_rows": 10})
    search = SearchTool()
    search.configure({"corpus": str(corpus), "delay_s": 0.3})
    os.environ[SECRET_VAR] = SECRET
    try:
        harness = Harness([python, CalculatorTool(), sqlite, search, FormatTool()])
        yield harness
        harness.close()
    finally:
        del os.environ[SECRET_VAR]
    assert search.index_path is None  # the temporary index was removed


def spare_info(rt: Harness, count: int = 1) -> dict[str, Any]:
    """What a warm python spare reported (spares are replaced after each call: wait for ``count``)."""
    deadline = time.monotonic() + 30
    while len(rt.runtime.worker_info("python")) < count:
        assert time.monotonic() < deadline, "no warm python spare"
        rt(asyncio.sleep(0.05))
    return rt.runtime.worker_info("python")[0]


def has_capability(bit: int) -> bool:
    """Whether this process holds a capability (the worker inherits the gateway's set)."""
    with open("/proc/self/status") as fh:
        caps = next(line.split()[1] for line in fh if line.startswith("CapEff:"))
    return bool(int(caps, 16) >> bit & 1)


def gone(pid: int) -> bool:
    """The process no longer runs (a zombie waiting for init to reap it counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# --------------------------------------------------------------------------- python


def scratch_marker(name: str) -> Any:
    """A file a call writes into its scratch directory (the only place it may write), seen from the gateway."""
    import glob
    import tempfile

    class Marker:
        def exists(self) -> bool:
            return bool(glob.glob(os.path.join(tempfile.gettempdir(), f"interlace-{os.getpid()}-python-*", name)))

    return Marker()


def test_python_runs_statement_before_next_is_delivered(rt: Harness) -> None:
    """Partial execution: statement 1's side effect is visible before statement 2 is sent."""
    marker = scratch_marker("marker-early")
    code = ["open('marker-early', 'w').write('1')", "import time", "t_second = time.time()", "t_second"]

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


def test_python_partial_off_runs_only_at_finish(rt: Harness) -> None:
    marker = scratch_marker("marker-late")
    code = "open('marker-late', 'w').write('4')\nopen('marker-late').read() + '2'"

    async def main() -> tuple[bool, ToolResult]:
        call = await rt.runtime.begin("python", partial=False)
        for line in code.splitlines():
            await call.line(line)
        await asyncio.sleep(0.2)
        existed = marker.exists()
        return existed, await call.finish({"code": code})

    existed, result = rt(main())
    assert not existed  # nothing ran before finish (the file, in the scratch dir, is read back at finish)
    assert result.ok and result.content["result"] == "'42'" and result.content["statements_run_early"] == 2


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
    result = rt.run("python", {"code": "print('before')\nwhile True:\n    pass"})
    assert result.ok and "CPUTimeExceeded" in result.content["error"] and result.content["stdout"] == "before\n"
    assert rt.run("python", {"code": "1 + 1"}).content["result"] == "2"


def test_python_cpu_limit_is_hard_inside_c_code(rt: Harness) -> None:
    """A C loop never runs the Python signal handler: the hard RLIMIT_CPU (cpu_s + 1) kills it."""
    code = "import hashlib\nhashlib.pbkdf2_hmac('sha256', b'k', b'salt', 10 ** 9)"  # minutes of pure C

    async def main() -> ToolResult:
        call = await rt.runtime.begin("python", partial=False, timeout_s=120)  # the CPU limit must act first
        return await call.finish({"code": code})

    result = rt(main())
    assert not result.ok and result.error_type == "ToolTimeout" and "CPU limit" in result.error, result
    assert gone(result.worker_pid)


def test_python_memory_limit(rt: Harness) -> None:
    result = rt.run("python", {"code": "x = bytearray(4 * 1024 ** 3)"})
    assert result.ok and "MemoryError" in result.content["error"]


def test_python_rlimits_are_hard(rt: Harness) -> None:
    """soft == hard for every limit set, so the code cannot raise its own soft limits."""
    code = ("import resource\n"
            "{n: resource.getrlimit(getattr(resource, n)) for n in "
            "('RLIMIT_AS', 'RLIMIT_CPU', 'RLIMIT_FSIZE', 'RLIMIT_NOFILE')}")
    limits = eval(rt.run("python", {"code": code}).content["result"])  # noqa: S307 - a dict repr we made
    assert limits["RLIMIT_AS"] == (1024 << 20, 1024 << 20)
    assert limits["RLIMIT_FSIZE"] == (64 << 20, 64 << 20) and limits["RLIMIT_NOFILE"] == (256, 256)
    soft, hard = limits["RLIMIT_CPU"]
    assert soft == hard and soft != resource.RLIM_INFINITY
    raise_it = "import resource\nresource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))"
    error = rt.run("python", {"code": raise_it}).content["error"] or ""
    if has_capability(24):  # CAP_SYS_RESOURCE may raise a hard limit: docs/security.md says so
        assert error == ""
    else:
        assert "ValueError: not allowed to raise maximum limit" in error


def test_python_nproc_reported_as_in_force(rt: Harness) -> None:
    """Sandboxed, the cgroup's pids limit bounds a call (RLIMIT_NPROC would count every call of the uid)."""
    info = spare_info(rt)
    rlimit_nproc = rt.runtime.tools["python"].info()["rlimits"]["RLIMIT_NPROC"]
    assert info["isolation"]["processes"] == "cgroup pids.max" and "pids limit" in rlimit_nproc
    assert "not enforced" in PythonTool().info()["rlimits"]["RLIMIT_NPROC"] or os.geteuid() != 0


def test_python_isolation_reported_and_network_blocked(rt: Harness) -> None:
    info = spare_info(rt)
    iso = info["isolation"]
    assert info["rlimits"]["RLIMIT_AS"] == [1024 << 20, 1024 << 20] and iso["cpu_time_s_per_call"] == 1
    assert "numpy" in info["warm_imports"]
    assert iso["sandbox"] == "bubblewrap" and iso["uid"] == 65534 and iso["network_interfaces"] == ["lo"]
    code = "import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('93.184.216.34', 80))"
    error = rt.run("python", {"code": code}).content["error"] or ""
    assert "OSError" in error or "unreachable" in error


def test_python_info_reports_isolation_in_force(rt: Harness) -> None:
    """Tool.info() (-> /v1/plugins, `interlace plugins`, the start-up log) tells the truth."""
    info = rt.runtime.tools["python"].info()
    json.dumps(info)
    worker = spare_info(rt)["isolation"]
    assert info["sandbox"]["sandbox"] == worker["sandbox"] == "bubblewrap"
    assert info["sandbox"]["uid"] == worker["uid"] == 65534
    assert "setns" in info["sandbox"]["seccomp"]["denied"] and "network" in info["sandbox"]["namespaces"]
    assert info["network_isolation"] != "none"
    assert info["process_per_call"] and info["rlimits"]["RLIMIT_AS"] == 1024 << 20


def test_python_fresh_process_per_call(rt: Harness) -> None:
    """No interpreter state survives a call, not even through builtins or sys.modules."""
    first = rt.run("python", {"code": "import builtins, os\nbuiltins.leak = 1\nos.getpid()"},
                   request={"key": "alice"})
    second = rt.run("python", {"code": "import os\nprint(os.getpid())\nleak"}, request={"key": "bob"})
    assert first.ok and second.ok and "NameError" in second.content["error"]
    assert first.worker_pid != second.worker_pid  # host pids (inside, each is pid 2 of its own namespace)
    assert gone(first.worker_pid)


def test_python_scratch_dir_private_and_removed(rt: Harness) -> None:
    code = ("import os, tempfile\nopen('out.txt', 'w').write('x')\n"
            "[os.getcwd(), os.environ['HOME'], tempfile.gettempdir(), oct(os.stat('.').st_mode & 0o777)]")
    result = rt.run("python", {"code": code})
    cwd, home, tmp, mode = eval(result.content["result"])  # noqa: S307 - a list repr we made
    assert cwd == home == tmp and mode == "0o700"
    assert os.path.basename(cwd).startswith(f"interlace-{os.getpid()}-python-")  # found again after a crash
    assert not os.path.exists(cwd)
    again = rt.run("python", {"code": "import os\nos.getcwd()"})
    assert eval(again.content["result"]) != cwd  # noqa: S307


def test_python_environment_is_clean(rt: Harness) -> None:
    """The gateway's secrets (API keys read through os.environ/NAME) never reach tool code."""
    code = "import os\n[dict(os.environ), open('/proc/self/environ', 'rb').read().decode()]"
    env, raw = eval(rt.run("python", {"code": code}).content["result"])  # noqa: S307
    assert os.environ[SECRET_VAR] == SECRET  # it is there, in the gateway
    assert SECRET_VAR not in env and SECRET not in raw
    assert env["INTERLACE_VISIBLE"] == "yes"  # what the tool's `env` setting names
    allowed = {"PATH", "LANG", "HOME", "TMPDIR", "INTERLACE_VISIBLE", "MPLCONFIGDIR", "MPLBACKEND",
               "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"}
    assert set(env) <= allowed, set(env) - allowed


def test_python_no_child_outlives_the_call(rt: Harness) -> None:
    """A subprocess, a forked child and a child in its own session: all gone after the call.

    Their pids inside the sandbox are its namespace's: the host sees them as
    processes of the sandbox's uid, and none may be left."""
    code = ("import os, subprocess, time\n"
            "a = subprocess.Popen(['sleep', '1000'])\n"
            "b = subprocess.Popen(['sleep', '1000'], start_new_session=True)\n"
            "c = os.fork()\n"
            "if c == 0:\n    time.sleep(1000)\n"
            "[a.pid, b.pid, c]")
    result = rt.run("python", {"code": code})
    assert result.ok and result.content["error"] is None, result
    pids = eval(result.content["result"])  # noqa: S307 - a list repr we made
    assert len(pids) == 3 and all(pids)
    deadline = time.monotonic() + 5
    while left := [p.pid for p in psutil.process_iter(["uids", "cmdline"])
                   if p.info["uids"] and p.info["uids"].real == 65534 and "1000" in (p.info["cmdline"] or [])]:
        assert time.monotonic() < deadline, left
        time.sleep(0.05)


def test_python_fork_without_exit_then_next_call_is_prompt(rt: Harness) -> None:
    result = rt.run("python", {"code": "import os\nchild = os.fork()\nprint('after fork')\n6 * 7"})
    assert result.ok and result.content["result"] == "42", result
    assert result.content["stdout"] == "after fork\n"  # the child's copy of the output never came back
    spare_info(rt, count=2)  # a warm spare is waiting, as between requests
    t0 = time.monotonic()
    after = rt.run("python", {"code": "1 + 1"})
    assert after.ok and after.content["result"] == "2" and time.monotonic() - t0 < 3


def test_python_fast_call_not_blocked_behind_slow_one(rt: Harness) -> None:
    spare_info(rt, count=2)  # both warm, as between requests

    async def main() -> tuple[float, ToolResult, ToolResult]:
        slow = asyncio.create_task(rt.runtime.run("python", {"code": "import time\ntime.sleep(6)\n'slow'"},
                                                  request={"key": "alice"}))
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        fast = await rt.runtime.run("python", {"code": "1 + 1"}, request={"key": "alice"})
        return time.monotonic() - t0, fast, await slow

    waited, fast, slow = rt(main())
    assert fast.ok and fast.content["result"] == "2" and waited < 4
    assert slow.ok and fast.finished_at < slow.finished_at - 2 and slow.content["result"] == "'slow'"


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
                                        "factorial(100000)", "1 / 0", "1" * 1001, "exp(1000)", "(-8) ** 0.5",
                                        "round(1, -10**8)", "round(10 ** 1000, -10 ** 6)", "round(2.5, 1.5)"])
def test_calculator_bounds_and_errors(expression: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(CalculatorError):
        evaluate(expression)
    assert time.monotonic() - t0 < 0.5


def test_calculator_round_still_works() -> None:
    assert (evaluate("round(1234.5678, 2)"), evaluate("round(1234, -2)"), evaluate("round(2.5)")) == (1234.57, 1200, 2)


def test_calculator_round_bomb_is_a_fast_error_in_the_worker(rt: Harness) -> None:
    t0 = time.monotonic()
    result = rt.run("calculator", {"expression": "round(1, -10**8)"})
    assert not result.ok and result.field == "expression" and "ndigits" in result.error
    assert time.monotonic() - t0 < 3


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


@pytest.mark.parametrize(
    ("query", "action"),
    [("INSERT INTO items (name) VALUES ('x')", "INSERT on items"), ("DELETE FROM items", "DELETE on items"),
     ("UPDATE items SET price = 0", "UPDATE on items"), ("ATTACH DATABASE '/tmp/x.db' AS x", "ATTACH"),
     ("ALTER TABLE items ADD COLUMN b", "ALTER_TABLE"), ("DETACH DATABASE main", "DETACH"),
     ("PRAGMA journal_mode = DELETE", "PRAGMA journal_mode"), ("PRAGMA user_version = 3", "PRAGMA user_version"),
     # schema changes are authorized as writes to the schema table first
     ("DROP TABLE items", "DELETE on sqlite_master"), ("CREATE TABLE t (a)", "INSERT on sqlite_master"),
     ("WITH d AS (SELECT 1) DELETE FROM items", "DELETE on items")],
)
def test_sqlite_denial_names_the_action(rt: Harness, query: str, action: str) -> None:
    """The authorizer's action code is named, not a result code that shares its number."""
    result = rt.run("sqlite", {"query": query})
    assert not result.ok and result.error_type == "ReadOnlyQueryError"
    assert result.error == f"only read-only queries are allowed ({action} denied)", result.error


@pytest.mark.parametrize(
    ("query", "first_row"),
    [("PRAGMA table_info(items)", [0, "id", "INTEGER", 0, None, 1]),
     ("PRAGMA table_xinfo(items)", [0, "id", "INTEGER", 0, None, 1, 0]),
     ("PRAGMA main.table_info('items')", [0, "id", "INTEGER", 0, None, 1]),
     ("PRAGMA index_list(items)", None), ("PRAGMA foreign_key_list(items)", None),
     ("PRAGMA user_version", [0])],
)
def test_sqlite_read_pragmas_allowed(rt: Harness, query: str, first_row: list[Any] | None) -> None:
    result = rt.run("sqlite", {"query": query})
    assert result.ok, result.error
    if first_row is not None:
        assert result.content["rows"][0] == first_row


def test_sqlite_huge_blob_is_a_fast_error(rt: Harness) -> None:
    """zeroblob(700000000) took 680 MB; SQLITE_LIMIT_LENGTH makes it an error before allocating."""
    t0 = time.monotonic()
    result = rt.run("sqlite", {"query": "SELECT zeroblob(700000000)"})
    assert not result.ok and result.error_type == "SqlError" and "too big" in result.error, result
    assert time.monotonic() - t0 < 5
    ok = rt.run("sqlite", {"query": "SELECT length(zeroblob(1000000))"})
    assert ok.ok and ok.content["rows"] == [[1000000]]


def test_sqlite_result_size_is_bounded(tmp_path: Path) -> None:
    path = tmp_path / "big.sqlite3"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (v TEXT)")
    conn.executemany("INSERT INTO t VALUES (?)", [("x" * 1000,) for _ in range(50)])
    conn.commit()
    conn.close()
    tool = SqliteTool()
    tool.configure({"database": str(path), "max_result_bytes": 10_000})
    tool.on_start()
    try:
        result = tool.on_finish({"query": "SELECT v FROM t"})
    finally:
        tool.on_close()
    assert result["truncated"] and len(result["rows"]) == 10


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


# --------------------------------------------------------------------------- settings and info


BUILTIN_TOOL_CLASSES = (PythonTool, CalculatorTool, SqliteTool, SearchTool, FormatTool)


@pytest.mark.parametrize("cls", BUILTIN_TOOL_CLASSES, ids=lambda c: c.name)
def test_settings_schema_is_a_closed_json_schema(cls: type) -> None:
    """Contract 2: each built-in declares the settings its configure() reads (the host rejects others)."""
    from jsonschema import validators

    schema = cls.settings_schema
    validators.validator_for(schema).check_schema(schema)
    assert schema["type"] == "object" and schema.get("additionalProperties") is False


@pytest.mark.parametrize(
    ("cls", "settings"),
    [(PythonTool, {"cpu_cores": 1.5, "allow_unisolated": True, "file_size_mb": 8, "max_open_files": 64,
                   "max_processes": 8, "max_concurrent": 2, "warm_imports": [], "max_output_chars": 100,
                   "cpu_time_s": 2}),
     (SqliteTool, {"database": "/x.db", "max_rows": 5, "max_value_bytes": 4096, "max_result_bytes": 4096}),
     (SearchTool, {"corpus": "/c", "index_path": "/i", "delay_s": 0.1, "default_k": 2, "max_k": 4}),
     (CalculatorTool, {}), (FormatTool, {})],
    ids=lambda v: getattr(v, "name", ""),
)
def test_settings_schema_accepts_every_documented_setting(cls: type, settings: dict[str, Any]) -> None:
    from jsonschema import validators

    schema = cls.settings_schema
    validators.validator_for(schema)(schema).validate(settings)
    with pytest.raises(Exception, match="Additional properties"):
        validators.validator_for(schema)(schema).validate({**settings, "no_such_setting": 1})


def test_python_allow_unisolated_must_be_a_boolean() -> None:
    with pytest.raises(PluginLoadError, match="allow_unisolated"):
        configure_tool(PythonTool(), {"allow_unisolated": "yes"})


@pytest.mark.parametrize("cls", BUILTIN_TOOL_CLASSES, ids=lambda c: c.name)
def test_info_is_plain_data_saying_what_the_tool_reaches(cls: type) -> None:
    info = cls().info()
    json.dumps(info)
    assert info.get("reaches") or info.get("network_isolation")


def test_builtin_pools_are_larger_than_one() -> None:
    """One worker per tool let one slow call block every other request's call of that tool."""
    assert all(cls.workers >= 2 for cls in BUILTIN_TOOL_CLASSES)


def test_python_programs_it_runs_do_not_inherit_the_worker_pipe(rt: Harness) -> None:
    """os.system / exec'd programs get no descriptor beyond stdin/stdout/stderr (the pipe is close-on-exec)."""
    code = "import os\nos.system('ls /proc/self/fd > fds.txt')\nsorted(open('fds.txt').read().split())"
    result = rt.run("python", {"code": code})
    assert result.ok and eval(result.content["result"]) == ["0", "1", "2", "3"], result  # 3: ls's own listing


def test_python_isolation_is_logged_at_start_up(caplog: pytest.LogCaptureFixture) -> None:
    """The README promises the isolation in force is reported at start-up: it is, in the log."""
    tool = PythonTool()
    configure_tool(tool, {"warm_imports": [], "workers": 1})

    async def main() -> None:
        async with ToolRuntime([tool]):
            pass

    with caplog.at_level(logging.INFO, logger="interlace.gateway.tools.runtime"):
        asyncio.run(main())
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("tool 'python'")]
    assert f'"network_isolation": "{tool.info()["network_isolation"]}"' in line
    assert "a fresh process per call" in line and '"RLIMIT_AS": [1073741824, 1073741824]' in line


def test_result_text_is_what_a_later_plan_step_reads() -> None:
    """A plan step's ``$N`` reads the tool's own ``result_text``: the value, not the record."""
    from interlace.gateway.tools.base import Tool

    assert CalculatorTool().result_text({"expression": "6*7", "result": 42}) == "42"
    assert PythonTool().result_text({"stdout": "", "result": " 'ok' ", "error": None}) == "'ok'"
    hits = {"query": "q", "results": [{"id": 1, "snippet": "best hit"}, {"id": 2, "snippet": "other"}]}
    assert SearchTool().result_text(hits) == "best hit"
    assert SearchTool().result_text({"query": "q", "results": []}) == '{"query": "q", "results": []}'
    # any other tool: its text, or its result as JSON, whatever its keys
    plain = Tool()
    assert plain.result_text("  text \n") == "text"
    assert plain.result_text({"result": 1}) == '{"result": 1}'
