"""The ``python`` tool: a code interpreter that runs statements as they are decoded.

This is the Conveyor CodeGen case: with ``ON_LINE`` granularity the parser
hands over each complete top-level statement, and the worker executes it
while the model is still writing the next one, so ``import matplotlib`` and
friends cost nothing by the time the code is complete.  ``on_finish`` then
runs only what the stream did not deliver (or everything, with partial
execution off), so both modes give the same result.

Containment, in each worker (see :func:`probe_isolation` for what is in force):

* a private network namespace (only a down loopback), when the kernel lets
  us create one: ``unshare(CLONE_NEWNET)`` as root, or inside a new user
  namespace otherwise.  Done before any import starts threads, because
  ``CLONE_NEWUSER`` requires a single-threaded process;
* ``RLIMIT_AS`` (memory) and ``RLIMIT_FSIZE`` for the worker's life, and a per-call
  ``RLIMIT_CPU`` budget (SIGXCPU is turned into an exception that ends the
  call, not the worker);
* a scratch working directory, removed when the runtime closes;
* wall-clock time is bounded by the runtime's ``timeout_s`` (worker killed).

This confines mistakes, not a determined attacker: the code runs as the
gateway's user and may, for example, raise its own soft limits.  Run the
gateway in a container if untrusted users reach this tool.
"""

from __future__ import annotations

import ast
import builtins
import ctypes
import importlib
import io
import os
import resource
import shutil
import signal
import socket
import sys
import tempfile
import traceback
from collections.abc import Mapping
from contextlib import redirect_stderr, redirect_stdout
from typing import Any

from interlace.gateway.tools import Granularity, Tool, ToolConfigError

__all__ = ["PythonTool", "probe_isolation", "isolate_network"]

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
_FILENAME = "<tool:python>"


class CPUTimeExceeded(BaseException):
    """Raised from the SIGXCPU handler.  A BaseException so ``except Exception`` in user code cannot swallow it."""


def isolate_network() -> str | None:
    """Move this process into a new, empty network namespace.

    Returns how (``"netns"`` or ``"userns+netns"``), or ``None`` when the
    kernel refuses (no privilege, user namespaces disabled, seccomp).  Must run
    while the process is still single-threaded.
    """
    if hasattr(os, "unshare"):  # Python 3.12+
        try:
            os.unshare(os.CLONE_NEWNET)  # type: ignore[attr-defined]
            return "netns"
        except OSError:
            pass
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    if not hasattr(libc, "unshare"):
        return None
    if libc.unshare(_CLONE_NEWNET) == 0:
        return "netns"
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        return None
    # Map our own ids so files keep their owners; "deny" setgroups is required first.
    for path, text in (("/proc/self/setgroups", "deny"), ("/proc/self/uid_map", f"{uid} {uid} 1"),
                       ("/proc/self/gid_map", f"{gid} {gid} 1")):
        try:
            with open(path, "w") as fh:
                fh.write(text)
        except OSError:
            pass
    return "userns+netns"


def _network_interfaces() -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _on_sigxcpu(signum: int, frame: Any) -> None:
    raise CPUTimeExceeded("CPU time limit exceeded")


class _CappedText(io.TextIOBase):
    """A text sink that keeps the first ``limit`` characters, so a print loop cannot fill memory."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.parts: list[str] = []
        self.size = 0
        self.dropped = 0

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        room = self.limit - self.size
        if room > 0:
            self.parts.append(s[:room])
            self.size += min(len(s), room)
        self.dropped += max(0, len(s) - max(room, 0))
        return len(s)

    def getvalue(self) -> str:
        text = "".join(self.parts)
        return text + (f"\n... [{self.dropped} characters truncated]" if self.dropped else "")


class PythonTool(Tool):
    """Executes Python code statement by statement in a warm, contained worker.

    Settings (``configure``): ``cpu_time_s`` (per call, default 10),
    ``memory_mb`` (address space per worker, default 2048), ``file_size_mb``
    (largest file written, default 64), ``isolate_network`` (default true),
    ``warm_imports`` (modules imported at worker start, missing ones skipped;
    default numpy and matplotlib with the Agg backend), ``max_output_chars``,
    ``timeout_s``, ``workers``.
    """

    name = "python"
    description = (
        "Run Python 3 code and return its stdout, stderr and the repr of the last expression. "
        "Top-level statements run as soon as they are written. numpy (and matplotlib, if installed) "
        "are available; there is no network access."
    )
    parameters = {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "Python source code to run."}},
        "required": ["code"],
        "additionalProperties": False,
    }
    granularity = Granularity.ON_LINE
    line_field = "code"
    timeout_s = 30.0

    def __init__(self) -> None:
        self.cpu_time_s = 10.0
        self.memory_mb = 2048
        self.file_size_mb = 64
        self.isolate_network = True
        self.warm_imports: tuple[str, ...] = ("numpy", "matplotlib", "matplotlib.pyplot")
        self.max_output_chars = 20_000
        self.scratch_root: str | None = None

    def configure(self, settings: Mapping[str, Any]) -> None:
        try:
            self.cpu_time_s = float(settings.get("cpu_time_s", self.cpu_time_s))
            self.memory_mb = int(settings.get("memory_mb", self.memory_mb))
            self.file_size_mb = int(settings.get("file_size_mb", self.file_size_mb))
            self.isolate_network = bool(settings.get("isolate_network", self.isolate_network))
            self.warm_imports = tuple(settings.get("warm_imports", self.warm_imports))
            self.max_output_chars = int(settings.get("max_output_chars", self.max_output_chars))
            self.timeout_s = float(settings.get("timeout_s", self.timeout_s))
            self.workers = int(settings.get("workers", self.workers))
        except (TypeError, ValueError) as exc:
            raise ToolConfigError(f"python tool settings: {exc}") from exc

    # -- gateway process ----------------------------------------------------------------

    def setup(self) -> None:
        self.scratch_root = tempfile.mkdtemp(prefix="interlace-python-")

    def teardown(self) -> None:
        if self.scratch_root:
            shutil.rmtree(self.scratch_root, ignore_errors=True)
            self.scratch_root = None

    # -- worker process -----------------------------------------------------------------

    def worker_init(self) -> dict[str, Any]:
        """Contain the worker, then warm the imports; returns the isolation in force."""
        netns = isolate_network() if self.isolate_network else None
        # One BLAS thread: workers are many, cores are few, and threads must not
        # exist before unshare() (done above).
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = "1"
        os.environ["MPLBACKEND"] = "Agg"
        warmed = []
        for module in self.warm_imports:
            try:
                importlib.import_module(module)
                warmed.append(module)
            except Exception:  # noqa: BLE001 - optional imports: missing or broken is fine
                pass
        if self.scratch_root:
            os.chdir(tempfile.mkdtemp(dir=self.scratch_root))
        limits: dict[str, int | None] = {}
        for name, key, value in (("RLIMIT_AS", "memory_bytes", self.memory_mb << 20),
                                 ("RLIMIT_FSIZE", "file_size_bytes", self.file_size_mb << 20)):
            try:
                _, hard = resource.getrlimit(getattr(resource, name))
                if hard != resource.RLIM_INFINITY:
                    value = min(value, hard)
                resource.setrlimit(getattr(resource, name), (value, hard))
                limits[key] = value
            except (ValueError, OSError):
                limits[key] = None
        signal.signal(signal.SIGXCPU, _on_sigxcpu)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # oversized writes fail with EFBIG instead
        return {
            "isolation": {
                "network_namespace": netns,
                "network_interfaces": _network_interfaces(),
                "cpu_time_s_per_call": self.cpu_time_s,
                **limits,
                "wall_time_s": self.timeout_s,
                "cwd": os.getcwd(),
            },
            "warm_imports": warmed,
        }

    def on_start(self) -> None:
        self._ns: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
        self._stdout = _CappedText(self.max_output_chars)
        self._stderr = _CappedText(self.max_output_chars)
        self._executed: list[str] = []  # ast.dump of each statement run, to reconcile at finish
        self._streamed = 0
        self._line_no = 0
        self._last: str | None = None
        self._error: str | None = None
        soft = int(_cpu_seconds() + self.cpu_time_s) + 1
        try:
            resource.setrlimit(resource.RLIMIT_CPU, (soft, resource.getrlimit(resource.RLIMIT_CPU)[1]))
        except (ValueError, OSError):
            pass

    def on_line(self, line: str) -> None:
        offset, self._line_no = self._line_no, self._line_no + line.count("\n") + 1
        if self._error is not None:
            return  # like a notebook cell: nothing runs after the first exception
        try:
            module = ast.parse(line, _FILENAME, "exec")
        except SyntaxError:
            self._error = "".join(traceback.format_exception_only(*sys.exc_info()[:2]))
            return
        ast.increment_lineno(module, offset)
        self._run(module.body)
        self._streamed = len(self._executed)

    def on_finish(self, arguments: dict[str, Any]) -> dict[str, Any]:
        code = arguments.get("code", "")
        if self._error is None:
            try:
                body = ast.parse(code, _FILENAME, "exec").body
            except SyntaxError:
                self._error = "".join(traceback.format_exception_only(*sys.exc_info()[:2]))
                body = None
            if body is not None:
                done = len(self._executed)
                if [ast.dump(s) for s in body[:done]] != self._executed:
                    self._error = "internal error: the streamed statements differ from the final code"
                else:
                    self._run(body[done:])
        return {
            "stdout": self._stdout.getvalue(),
            "stderr": self._stderr.getvalue(),
            "result": self._last,
            "error": self._error,
            "statements": len(self._executed),
            "statements_run_early": self._streamed,
        }

    def on_close(self) -> None:
        try:
            hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
            resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))
        except (ValueError, OSError):
            pass
        self._ns = {}

    def _run(self, statements: list[ast.stmt]) -> None:
        for stmt in statements:
            if self._error is not None:
                return
            self._executed.append(ast.dump(stmt))
            try:
                with redirect_stdout(self._stdout), redirect_stderr(self._stderr):
                    if isinstance(stmt, ast.Expr):
                        value = eval(compile(ast.Expression(stmt.value), _FILENAME, "eval"), self._ns)
                        self._last = None if value is None else repr(value)[: self.max_output_chars]
                    else:
                        exec(compile(ast.Module([stmt], []), _FILENAME, "exec"), self._ns)
                        self._last = None
            except CPUTimeExceeded:
                self._error = f"CPUTimeExceeded: more than {self.cpu_time_s:g}s of CPU time"
            except BaseException as exc:  # noqa: BLE001 - user code may raise anything, SystemExit included
                tb = exc.__traceback__
                while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
                    tb = tb.tb_next  # show the user's frames, not ours
                self._error = "".join(traceback.format_exception(type(exc), exc, tb))[-self.max_output_chars:]


def _probe(conn: Any, tool: PythonTool) -> None:
    conn.send(tool.worker_init())
    conn.close()


def probe_isolation(settings: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Start a throw-away worker with the python tool's containment and report what is in force.

    For ``interlace plugins`` / diagnostics; a running gateway can ask
    ``ToolRuntime.worker_info("python")`` instead, which costs nothing.
    """
    import multiprocessing

    tool = PythonTool()
    tool.configure({**(settings or {}), "warm_imports": ()})
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_probe, args=(child, tool), daemon=True)
    proc.start()
    child.close()
    try:
        info = parent.recv() if parent.poll(30) else {}
    except EOFError:
        info = {}
    finally:
        proc.join(5)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
    return dict(info.get("isolation", {}))
