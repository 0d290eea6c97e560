"""The ``python`` tool: a code interpreter that runs statements as they are decoded.

This is the Conveyor CodeGen case: with ``ON_LINE`` granularity the parser
hands over each complete top-level statement, and the worker executes it
while the model is still writing the next one, so ``import matplotlib`` and
friends cost nothing by the time the code is complete.  ``on_finish`` then
runs only what the stream did not deliver (or everything, with partial
execution off), so both modes give the same result.

Containment (docs/security.md, "Tool execution", says what it does *not*
cover).  The tool runtime gives every call:

* a fresh process (``process_per_call``): pre-spawned as a warm spare that
  has done the warm imports, killed with its whole process group and every
  descendant when the call ends, so no state, thread or child process
  survives into another call or another API key's call;
* a private scratch directory as cwd, ``HOME`` and ``TMPDIR``, removed after
  the call;
* a clean environment (``PATH``, ``LANG``, ``HOME``, ``TMPDIR``, the
  ``env`` setting): never the gateway's API keys;
* ``RLIMIT_AS`` = ``memory_mb`` and a CPU budget of ``cpu_s`` (a
  ``CPUTimeExceeded`` error first, SIGKILL one second later from a hard
  ``RLIMIT_CPU``), and the wall-time limit ``timeout_s``.

This tool adds, in :meth:`PythonTool.worker_init`, before any import starts
a thread:

* a private network namespace (only a down loopback): ``unshare(CLONE_NEWNET)``
  as root, or inside a new user namespace otherwise.  Where the OS refuses,
  the tool refuses to start unless its settings say ``allow_unisolated: true``;
* ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE`` and ``RLIMIT_NPROC`` with soft == hard,
  so the code cannot raise them.  ``RLIMIT_NPROC`` counts every process of
  the real uid and is not enforced for root (reported as such by
  :meth:`PythonTool.info`).
"""

from __future__ import annotations

import ast
import builtins
import ctypes
import importlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Mapping
from contextlib import redirect_stderr, redirect_stdout
from typing import Any

from interlace import CPUTimeExceeded, Granularity, Tool, ToolConfigError, set_hard_limit

__all__ = ["PythonTool", "probe_isolation", "isolate_network", "NETWORK_ISOLATION_LABELS"]

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
_FILENAME = "<tool:python>"
#: ``isolate_network()``'s answer -> what ``info()`` reports as ``network_isolation``.
NETWORK_ISOLATION_LABELS = {
    "netns": "private network namespace",
    "userns+netns": "private network namespace (in a new user namespace)",
    None: "none",
}


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


def _probe_main() -> None:
    """Entry of the probe process: try to isolate, print what happened as JSON."""
    how = isolate_network()
    print(json.dumps({"network_namespace": how, "network_interfaces": _network_interfaces()}))


def probe_isolation() -> dict[str, Any]:
    """Start a throw-away process, isolate its network as a worker would, report the outcome.

    Returns ``{"network_namespace": "netns" | "userns+netns" | None,
    "network_interfaces": [...]}``.  Costs one interpreter start (no warm
    imports); the python tool runs it once, at set-up.
    """
    proc = subprocess.run(
        [sys.executable, "-c", "from interlace.plugins.python_tool import _probe_main; _probe_main()"],
        env={"PATH": os.environ.get("PATH", os.defpath), "LANG": os.environ.get("LANG", "C.UTF-8")},
        capture_output=True, text=True, timeout=60, check=False,
    )
    try:
        return dict(json.loads(proc.stdout.strip().splitlines()[-1]))
    except (ValueError, IndexError):
        raise RuntimeError(f"python tool: the isolation probe failed:\n{proc.stderr.strip()}") from None


def _tasks_of_real_uid() -> int:
    """Processes and threads of this real uid: what RLIMIT_NPROC is compared with."""
    import psutil

    uid, count = os.getuid(), 0
    for proc in psutil.process_iter(["uids", "num_threads"]):
        uids = proc.info.get("uids")
        if uids is not None and uids.real == uid:
            count += proc.info.get("num_threads") or 1
    return count


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
    """Executes Python code statement by statement in a fresh, contained process per call.

    Settings (``settings_schema``) besides the common ones (``workers`` = warm
    spares, ``timeout_s``, ``memory_mb``, ``cpu_s``, ``env``, ``nice``):
    ``isolate_network`` (default true), ``allow_unisolated`` (default false:
    refuse to start where the network cannot be isolated),
    ``file_size_mb``, ``max_open_files``, ``max_processes``,
    ``max_concurrent`` (calls running at once), ``warm_imports``,
    ``max_output_chars`` and ``cpu_time_s`` (old name of ``cpu_s``).
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
    settings_schema = {
        "type": "object",
        "properties": {
            "isolate_network": {"type": "boolean", "description": "Run each call in a private network namespace."},
            "allow_unisolated": {"type": "boolean",
                                 "description": "Start even where the OS cannot isolate the network."},
            "file_size_mb": {"type": "integer", "minimum": 0, "description": "Largest file a call may write."},
            "max_open_files": {"type": "integer", "minimum": 16, "description": "RLIMIT_NOFILE of a call."},
            "max_processes": {"type": "integer", "minimum": 1,
                              "description": "Processes a call may add (RLIMIT_NPROC; not enforced for root)."},
            "max_concurrent": {"type": "integer", "minimum": 1, "description": "Calls running at once."},
            "warm_imports": {"type": "array", "items": {"type": "string"},
                             "description": "Modules each spare imports before its call."},
            "max_output_chars": {"type": "integer", "minimum": 1},
            "cpu_time_s": {"type": "number", "exclusiveMinimum": 0, "description": "Old name of cpu_s."},
        },
        "additionalProperties": False,
    }
    granularity = Granularity.ON_LINE
    line_field = "code"
    timeout_s = 30.0
    #: Read by the tool runtime: one fresh process per call, ``workers`` warm spares.
    process_per_call = True
    workers = 2
    max_concurrent = 8
    cpu_s = 10.0
    memory_mb = 1024

    def __init__(self) -> None:
        self.file_size_mb = 64
        self.max_open_files = 256
        self.max_processes = 64
        self.isolate_network = True
        self.allow_unisolated = False
        self.warm_imports: tuple[str, ...] = ("numpy", "matplotlib", "matplotlib.pyplot")
        self.max_output_chars = 20_000
        self.env: dict[str, str] = {}
        self._probe: dict[str, Any] | None = None
        self._mpl_dir: str | None = None

    def configure(self, settings: Mapping[str, Any]) -> None:
        # Validated against settings_schema by the host, which also applies the
        # common settings (cpu_s, memory_mb, timeout_s, workers, env, nice) after this.
        if "cpu_time_s" in settings:  # old name of cpu_s; cpu_s itself, when given, wins
            self.cpu_s = float(settings["cpu_time_s"])
        for key in ("file_size_mb", "max_open_files", "max_processes", "max_concurrent", "max_output_chars",
                    "isolate_network", "allow_unisolated"):
            if key in settings:
                setattr(self, key, settings[key])
        self.warm_imports = tuple(settings.get("warm_imports", self.warm_imports))

    # -- gateway process ----------------------------------------------------------------

    def network_probe(self) -> dict[str, Any]:
        """Whether this OS lets a worker create a private network namespace (probed once)."""
        if self._probe is None:
            self._probe = probe_isolation() if self.isolate_network else {"network_namespace": None}
        return self._probe

    def setup(self) -> None:
        """Refuse to start without network isolation, unless the settings allow it."""
        how = self.network_probe()["network_namespace"]
        if how is None and self.isolate_network and not self.allow_unisolated:
            raise ToolConfigError(
                "python tool: this OS does not let the tool's workers create a private network namespace "
                "(unshare(CLONE_NEWNET) failed, also inside a user namespace), so code run by the model "
                "could reach the network. Run the gateway where namespaces are allowed (root, or "
                "unprivileged user namespaces enabled), or set `allow_unisolated: true` under "
                "tools.python in the config to run it without network isolation."
            )
        # One matplotlib cache for all calls: each call's HOME is a fresh scratch
        # directory, and rebuilding the font cache would cost every call seconds.
        self._mpl_dir = tempfile.mkdtemp(prefix="interlace-python-mpl-")
        self.env = {"MPLCONFIGDIR": self._mpl_dir, **self.env}

    def teardown(self) -> None:
        if self._mpl_dir:
            shutil.rmtree(self._mpl_dir, ignore_errors=True)
            self.env = {k: v for k, v in self.env.items() if v != self._mpl_dir}
            self._mpl_dir = None

    def info(self) -> dict[str, Any]:
        """The containment in force, for the start-up log, ``/v1/plugins`` and ``interlace plugins``."""
        probe = self.network_probe()
        root = os.geteuid() == 0
        return {
            "network_isolation": NETWORK_ISOLATION_LABELS.get(probe.get("network_namespace"), "none"),
            "allow_unisolated": self.allow_unisolated,
            "process_per_call": True,
            "scratch_dir": "private per call (cwd, HOME, TMPDIR), removed after the call",
            "environment": "clean: PATH, LANG, HOME, TMPDIR" + (f" + {', '.join(sorted(self.env))}" if self.env else ""),
            "rlimits": {
                "RLIMIT_AS": self.memory_mb << 20,
                "RLIMIT_CPU": f"{self.cpu_s:g}s per call (CPUTimeExceeded), SIGKILL 1s later",
                "RLIMIT_FSIZE": self.file_size_mb << 20,
                "RLIMIT_NOFILE": self.max_open_files,
                "RLIMIT_NPROC": "not enforced (the gateway runs as root)" if root
                else f"{self.max_processes} more than the uid's processes at spawn",
            },
            "wall_time_s": self.timeout_s,
            "not_contained": "same uid as the gateway, filesystem readable (and writable where the uid may), "
                             "no seccomp filter: not a sandbox for hostile code",
        }

    # -- worker process -----------------------------------------------------------------

    def worker_init(self) -> dict[str, Any]:
        """Contain the worker, then warm the imports; returns the isolation in force."""
        netns = isolate_network() if self.isolate_network else None  # before any thread exists
        if netns is None and self.isolate_network and not self.allow_unisolated:
            raise ToolConfigError("python tool: could not create a private network namespace")
        # One BLAS thread: workers are many, cores are few.
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
        limits: dict[str, Any] = {
            "file_size_bytes": set_hard_limit("RLIMIT_FSIZE", self.file_size_mb << 20),
            "open_files": set_hard_limit("RLIMIT_NOFILE", self.max_open_files),
        }
        if os.geteuid() == 0:
            limits["processes"] = "not enforced (root)"
        else:
            limits["processes"] = set_hard_limit("RLIMIT_NPROC", _tasks_of_real_uid() + self.max_processes)
        return {
            "isolation": {
                "network_namespace": netns,
                "network_interfaces": _network_interfaces(),
                "cpu_time_s_per_call": self.cpu_s,
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
        self._ns = {}

    def result_text(self, content: Any) -> str:
        """A later step that refers to a run wants its last expression's value."""
        return super().result_text(content["result"] if isinstance(content, dict) and "result" in content else content)

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
            except BaseException as exc:  # noqa: BLE001 - user code may raise anything, SystemExit included
                if isinstance(exc, CPUTimeExceeded):  # the runtime's per-call CPU budget
                    self._error = f"CPUTimeExceeded: more than {self.cpu_s:g}s of CPU time"
                    continue
                tb = exc.__traceback__
                while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
                    tb = tb.tb_next  # show the user's frames, not ours
                self._error = "".join(traceback.format_exception(type(exc), exc, tb))[-self.max_output_chars:]
