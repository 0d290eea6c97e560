"""The ``python`` tool: a code interpreter that runs statements as they are decoded.

This is the Conveyor CodeGen case: with ``ON_LINE`` granularity the parser
hands over each complete top-level statement, and the worker executes it
while the model is still writing the next one, so ``import matplotlib`` and
friends cost nothing by the time the code is complete.  ``on_finish`` then
runs only what the stream did not deliver (or everything, with partial
execution off), so both modes give the same result.

Containment (docs/security.md, "Tool execution").  The tool asks the
runtime for its sandbox (``sandbox = True``; gateway/tools/sandbox.py): each
worker runs under bubblewrap in new PID, mount, network, IPC, UTS and cgroup
namespaces, as an unprivileged uid (``sandbox_uid``, 65534) with no
capabilities and ``no_new_privs``, under a seccomp filter denying namespace,
mount, ptrace, bpf, keyring and similar syscalls, on a read-only root of only
what Python needs plus its private scratch directory, in a cgroup holding
``memory_mb`` and ``max_processes`` for all its processes together.  Where
the OS cannot build that, start-up fails unless ``allow_unisolated: true``;
then the tool runs with the common containment only and reports
``"sandbox": "none"`` -- or, when no caller may use the tool at all, the
gateway leaves it out and reports it ``"available": false`` with the reason.
A gateway that is not root gets the same sandbox in a user namespace (the
uid maps to the gateway's own); without a writable cgroup there, the
sandbox sets ``RLIMIT_NPROC`` per call instead of the pids limit, and the
memory of the call's processes together is not bounded (``info()`` says so).

The tool runtime also gives every call a fresh process (a warm spare, killed
with everything it started when the call ends), a clean environment, the
CPU budget and the wall-time limit.  This module adds hard ``RLIMIT_FSIZE``
and ``RLIMIT_NOFILE`` (and, unsandboxed and not root, ``RLIMIT_NPROC``;
sandboxed, the sandbox does that per call: its cgroup's pids limit, or
``RLIMIT_NPROC`` counted in the call's own user namespace).
"""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import io
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

from interlace import CPUTimeExceeded, Granularity, Tool, set_hard_limit

__all__ = ["PythonTool"]

_FILENAME = "<tool:python>"


def _network_interfaces() -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def _tasks_of_real_uid() -> int:
    """Processes and threads of this real uid: what RLIMIT_NPROC is compared with."""
    import psutil

    uid, count = os.getuid(), 0
    for proc in psutil.process_iter(["uids", "num_threads"]):
        uids = proc.info.get("uids")
        if uids is not None and uids.real == uid:
            count += proc.info.get("num_threads") or 1
    return count


def _nproc_fallback(in_force: Mapping[str, Any]) -> str | None:
    """The RLIMIT_NPROC the sandbox sets in the call's user namespace where it has no cgroup (else ``None``)."""
    by = str((in_force.get("max_processes") or {}).get("by", ""))
    return by if by.startswith(("RLIMIT_NPROC", "not enforced")) else None


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
    ``sandbox`` and ``sandbox_uid`` (common settings: on, 65534),
    ``allow_unisolated`` (default false: refuse to start where the sandbox
    cannot be built), ``cpu_cores`` (a cgroup CPU quota, default none),
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
            "allow_unisolated": {"type": "boolean",
                                 "description": "Start without the sandbox where the OS cannot build it."},
            "cpu_cores": {"type": "number", "exclusiveMinimum": 0,
                          "description": "CPU quota of a call's cgroup, in cores (default: none)."},
            "file_size_mb": {"type": "integer", "minimum": 0, "description": "Largest file a call may write."},
            "max_open_files": {"type": "integer", "minimum": 16, "description": "RLIMIT_NOFILE of a call."},
            "max_processes": {"type": "integer", "minimum": 1,
                              "description": "Processes and threads a call may add (its cgroup's pids limit)."},
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
    sandbox = True
    workers = 2
    max_concurrent = 8
    cpu_s = 10.0
    memory_mb = 1024

    def __init__(self) -> None:
        self.file_size_mb = 64
        self.max_open_files = 256
        self.max_processes = 64
        self.allow_unisolated = False
        self.cpu_cores: float | None = None
        self.warm_imports: tuple[str, ...] = ("numpy", "matplotlib", "matplotlib.pyplot")
        self.max_output_chars = 20_000
        self.env: dict[str, str] = {}
        self._mpl_dir: str | None = None

    def configure(self, settings: Mapping[str, Any]) -> None:
        # Validated against settings_schema by the host, which also applies the
        # common settings (cpu_s, memory_mb, timeout_s, workers, env, nice) after this.
        if "cpu_time_s" in settings:  # old name of cpu_s; cpu_s itself, when given, wins
            self.cpu_s = float(settings["cpu_time_s"])
        for key in ("file_size_mb", "max_open_files", "max_processes", "max_concurrent", "max_output_chars",
                    "allow_unisolated", "cpu_cores"):
            if key in settings:
                setattr(self, key, settings[key])
        self.warm_imports = tuple(settings.get("warm_imports", self.warm_imports))

    # -- gateway process ----------------------------------------------------------------

    def setup(self) -> None:
        """Prepare the shared matplotlib cache (the sandbox itself is the runtime's: see ``sandbox``)."""
        # One matplotlib cache for all calls: each call's HOME is a fresh scratch directory,
        # and rebuilding the font cache would cost every call seconds.  Built here, by
        # matplotlib itself before any call runs; sandboxed workers read it (bound
        # read-only) and copy it into their scratch, so no call can alter another's.
        self._mpl_dir = tempfile.mkdtemp(prefix=f"interlace-{os.getpid()}-python-mpl-")
        if "matplotlib" in self.warm_imports and importlib.util.find_spec("matplotlib") is not None:
            subprocess.run([sys.executable, "-c", "import matplotlib.font_manager"], check=False, timeout=120,
                           capture_output=True, env={"PATH": os.environ.get("PATH", os.defpath),
                                                     "MPLCONFIGDIR": self._mpl_dir, "MPLBACKEND": "Agg"})
        os.chmod(self._mpl_dir, 0o755)
        self.sandbox_ro_paths = (*self.sandbox_ro_paths, self._mpl_dir)
        self.env = {"MPLCONFIGDIR": self._mpl_dir, **self.env}

    def teardown(self) -> None:
        if self._mpl_dir:
            shutil.rmtree(self._mpl_dir, ignore_errors=True)
            self.env = {k: v for k, v in self.env.items() if v != self._mpl_dir}
            self.sandbox_ro_paths = tuple(p for p in self.sandbox_ro_paths if p != self._mpl_dir)
            self._mpl_dir = None

    def info(self) -> dict[str, Any]:
        """The containment in force, for the start-up log, ``/v1/plugins`` and ``interlace plugins``."""
        in_force = dict(self.sandbox_in_force or {})
        if in_force.get("sandbox") == "unavailable":  # left out: no caller may use it and no sandbox here
            return {"available": False, "sandbox": "unavailable", "unavailable_because": in_force.get("reason"),
                    "allow_unisolated": self.allow_unisolated, "process_per_call": True}
        sandboxed = in_force.get("sandbox") == "bubblewrap"
        if not in_force:
            sandbox: Any = "not started" if self.sandbox else "none"
        else:
            sandbox = in_force if sandboxed else "none"
        root = os.geteuid() == 0
        return {
            "sandbox": sandbox,
            **({"unsandboxed_because": in_force.get("reason")} if in_force and not sandboxed else {}),
            "network_isolation": "private network namespace (bubblewrap)" if sandboxed
            else ("none" if in_force or not self.sandbox else "not started"),
            "allow_unisolated": self.allow_unisolated,
            "process_per_call": True,
            "scratch_dir": "private per call (cwd, HOME, TMPDIR), removed after the call",
            "environment": "clean: PATH, LANG, HOME, TMPDIR" + (f" + {', '.join(sorted(self.env))}" if self.env else ""),
            "rlimits": {
                "RLIMIT_AS": self.memory_mb << 20,
                "RLIMIT_CPU": f"{self.cpu_s:g}s per call (CPUTimeExceeded), SIGKILL 1s later",
                "RLIMIT_FSIZE": self.file_size_mb << 20,
                "RLIMIT_NOFILE": self.max_open_files,
                "RLIMIT_NPROC": (_nproc_fallback(in_force) or "not used: the cgroup's pids limit bounds the call")
                if sandboxed
                else ("not enforced (the gateway runs as root)" if root
                      else f"{self.max_processes} more than the uid's processes at spawn"),
            },
            "wall_time_s": self.timeout_s,
        }

    # -- worker process -----------------------------------------------------------------

    def worker_init(self) -> dict[str, Any]:
        """Warm the imports and set the per-process limits; returns the containment in force."""
        sandboxed = (self.sandbox_in_force or {}).get("sandbox") == "bubblewrap"
        # One BLAS thread: workers are many, cores are few.
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[var] = "1"
        os.environ["MPLBACKEND"] = "Agg"
        shared = os.environ.get("MPLCONFIGDIR")
        if sandboxed and shared and os.path.isdir(shared) and not os.access(shared, os.W_OK):
            private = os.path.join(os.getcwd(), ".matplotlib")  # the shared cache is read-only here
            shutil.copytree(shared, private)
            os.environ["MPLCONFIGDIR"] = private
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
        if sandboxed:
            limits["processes"] = _nproc_fallback(self.sandbox_in_force or {}) or "cgroup pids.max"
        elif os.geteuid() == 0:
            limits["processes"] = "not enforced (root)"
        else:
            limits["processes"] = set_hard_limit("RLIMIT_NPROC", _tasks_of_real_uid() + self.max_processes)
        return {
            "isolation": {
                "sandbox": "bubblewrap" if sandboxed else "none",
                "uid": os.getuid(),
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
