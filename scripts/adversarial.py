#!/usr/bin/env python3
"""The adversarial run of issue 29: each attack of the trial against a real ``interlace serve``.

Why a script and not tests: the issue's "done when" asks for an adversarial run of the
same cases against the server as a user starts it (``interlace serve --config ...`` in
its own process, its own event loop, its own file-descriptor limit), with ``/health``
watched from outside while each attack runs.  The unit tests of each fix prove the
mechanism; this run proves the deployed whole, and gives the before/after table of
docs/adversarial.md.

What it does: starts the gateway as a subprocess (its own session and process group,
killed with every descendant at exit, Ctrl-C included), waits for ``/health``, then runs
each case while a probe thread GETs ``/health`` every 100 ms on a fresh connection
(30 s timeout) and records the slowest answer.  Each case has a deadline, so the run
never hangs; the server is restarted before cases that need a fresh one and after cases
that may degrade or kill it.  Output: a table (stdout) and ``--json FILE``.

Run from the repository root with the project's venv (stdlib + httpx only):

    .venv/bin/python scripts/adversarial.py --quick --json /tmp/adv.json
    .venv/bin/python scripts/adversarial.py --cases regex_transform,pattern_400
    .venv/bin/python scripts/adversarial.py --list

Criterion of every "freeze" case (the issue's): the attack is answered as the fix
promises AND ``/health`` stays under 1 s while it runs.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import random
import re
import resource
import secrets
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import httpx

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "configs" / "default.yaml"
KEYED_CONFIG = ROOT / "configs" / "adversarial.yaml"
HEALTH_LIMIT_MS = 1000.0
MODEL = "smollm2"


# ------------------------------------------------------------------------------------------- processes
def _proc_table() -> Dict[int, Tuple[int, str]]:
    """pid -> (ppid, start time) of every process now (from /proc/<pid>/stat)."""
    out: Dict[int, Tuple[int, str]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode("latin-1")
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) "
        out[int(name)] = (int(rest[1]), rest[19])  # ppid, starttime
    return out


def _alive(pid: int, start: str) -> bool:
    t = _proc_table().get(pid)
    return t is not None and t[1] == start


def _rss_mb(pid: int) -> Optional[float]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def snapshot_python(rev: str, workdir: Path) -> Tuple[str, Path, Path]:
    """A Python that imports ``interlace`` from commit ``rev`` instead of the working tree (the
    "before" column while fixes are in progress in the tree): ``git archive`` of the commit, its
    package-dir mapping (pyproject) rebuilt as a tree of symlinks, and a venv whose .pth files put
    that tree first and then the project venv's site-packages (every .pth of it but the editable
    install of interlace itself).  Tool workers start with this venv's interpreter, so they run
    the same commit.  Reads the repository only (git archive); returns (python, source root, the
    symlink tree: the server's working directory, since ``python -m`` puts it first on sys.path)."""
    import tomllib
    import venv
    src = workdir / f"src-{rev[:12]}"
    if not src.exists():
        src.mkdir(parents=True)
        arch = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=arch, check=True)
    mapping = tomllib.loads((src / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    farm = workdir / f"farm-{rev[:12]}"
    pkg = farm / "interlace"
    if not pkg.exists():
        pkg.mkdir(parents=True)
        for entry in (src / mapping.get("interlace", "interlace")).iterdir():
            (pkg / entry.name).symlink_to(entry)
        for name, folder in mapping.items():
            if name.startswith("interlace.") and name.count(".") == 1:
                link = pkg / name.split(".", 1)[1]
                if not link.exists():
                    link.symlink_to(src / folder)
    env_dir = workdir / f"venv-{rev[:12]}"
    base_site = next((ROOT / ".venv" / "lib").glob("python3*/site-packages"))
    if not env_dir.exists():
        venv.EnvBuilder(with_pip=False, symlinks=True).create(env_dir)
        site = next((env_dir / "lib").glob("python3*/site-packages"))
        (site / "00-adversarial.pth").write_text(f"{farm}\n{base_site}\n")
        for pth in sorted(base_site.glob("*.pth")):
            if not pth.name.startswith("__editable__.interlace-"):
                (site / f"01-{pth.name}").write_text(pth.read_text())
    return str(env_dir / "bin" / "python"), src, farm


class Server:
    """``interlace serve`` in its own session; every descendant seen is remembered, so that
    tool workers that left the process group (their own sessions) are killed at the end too."""

    def __init__(self, config: Path, workdir: Path, env: Dict[str, str], label: str,
                 nofile_soft: Optional[int] = None, python: Optional[str] = None, cwd: Path = ROOT):
        self.config, self.workdir, self.env, self.label = config, workdir, env, label
        self.python, self.cwd = python, cwd
        self.nofile_soft = nofile_soft
        self.port = 0
        self.proc: Optional[subprocess.Popen] = None
        self.start_time = ""
        self.seen: Dict[int, str] = {}  # descendant pid -> start time
        self._watch_stop = threading.Event()
        self._watch: Optional[threading.Thread] = None
        self.log_path = workdir / f"server-{label}-{int(time.time() * 1000)}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def _preexec(self) -> None:
        if self.nofile_soft is not None:
            _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(self.nofile_soft, hard), hard))

    def start(self, timeout: float = 300.0) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        exe = ROOT / ".venv" / "bin" / "interlace"
        if self.python:
            cmd = [self.python, "-m", "interlace.cli"]
        else:
            cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "interlace.cli"]
        cmd += ["serve", "--config", str(self.config), "--port", str(self.port)]
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=self.cwd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **self.env}, start_new_session=True,
                                     preexec_fn=self._preexec)
        _REGISTRY.add(self)
        self.start_time = _proc_table().get(self.proc.pid, (0, ""))[1]
        self._watch = threading.Thread(target=self._watch_loop, daemon=True)
        self._watch.start()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"interlace serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"interlace serve did not answer /health:\n{self.log_tail()}")
            time.sleep(0.3)

    def _watch_loop(self) -> None:
        while not self._watch_stop.is_set():
            self.snapshot()
            self._watch_stop.wait(1.0)

    def snapshot(self) -> None:
        if self.proc is None:
            return
        table = _proc_table()
        kids: Dict[int, List[int]] = {}
        for pid, (ppid, _st) in table.items():
            kids.setdefault(ppid, []).append(pid)
        todo = [self.proc.pid]
        while todo:
            p = todo.pop()
            for c in kids.get(p, []):
                if c not in self.seen:
                    self.seen[c] = table[c][1]
                todo.append(c)

    def descendants_alive(self) -> List[int]:
        table = _proc_table()
        return [p for p, st in self.seen.items() if p in table and table[p][1] == st]

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def log_lines(self) -> int:
        try:
            with open(self.log_path, "rb") as f:
                return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
        except OSError:
            return 0

    def log_count(self, needle: bytes) -> int:
        try:
            with open(self.log_path, "rb") as f:
                return sum(chunk.count(needle) for chunk in iter(lambda: f.read(1 << 20), b""))
        except OSError:
            return 0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        if not self.alive():
            return False
        try:
            return httpx.get(self.url + "/health", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, grace: float = 30.0) -> Optional[int]:
        """SIGTERM to the process group, SIGKILL after ``grace``; then every remembered
        descendant still alive is SIGKILLed.  Returns the server's exit code."""
        if self.proc is None:
            return None
        self.snapshot()
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                pass
        self.kill_all()
        return self.proc.returncode

    def kill_all(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in self.descendants_alive():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self._watch_stop.set()
        try:
            self.log.close()
        except Exception:  # noqa: BLE001 - closing a log file at exit
            pass
        _REGISTRY.discard(self)


_REGISTRY: set = set()


def _kill_everything() -> None:
    for s in list(_REGISTRY):
        s.kill_all()


# ---------------------------------------------------------------------------------------------- probe
class Probe(threading.Thread):
    """GET /health every 100 ms on a fresh connection (30 s timeout); also samples the server's RSS."""

    def __init__(self, server: Server):
        super().__init__(daemon=True)
        self.server = server
        self.stop_evt = threading.Event()
        self.lock = threading.Lock()
        self.completed = 0
        self.inflight_since: Optional[float] = None
        self.reset()

    def reset(self) -> None:
        with getattr(self, "lock", threading.Lock()):
            self.samples: List[float] = []
            self.failures: List[str] = []
            self.rss_max = 0.0
            self.rss_start = _rss_mb(self.server.pid) or 0.0

    def run(self) -> None:
        while not self.stop_evt.is_set():
            t0 = time.monotonic()
            self.inflight_since = t0
            err = None
            try:
                r = httpx.get(self.server.url + "/health", timeout=30, headers={"Connection": "close"})
                if r.status_code != 200:
                    err = f"HTTP {r.status_code}"
            except httpx.HTTPError as e:
                err = type(e).__name__
            dt = (time.monotonic() - t0) * 1000
            rss = _rss_mb(self.server.pid) or 0.0
            with self.lock:
                self.samples.append(dt)
                if err:
                    self.failures.append(err)
                self.rss_max = max(self.rss_max, rss)
                self.completed += 1
                self.inflight_since = None
            self.stop_evt.wait(max(0.0, 0.1 - dt / 1000))

    def settle(self, timeout: float = 31.0) -> None:
        """Wait until a probe started before now has completed: the one in flight when a case
        ends (possibly stuck behind the attack) must be counted, and a short case gets a sample."""
        with self.lock:
            n0 = self.completed
            inflight = self.inflight_since is not None
        target = n0 + (1 if inflight else 2)  # the one in flight, or a whole next one
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.is_alive():
            with self.lock:
                if self.completed >= target:
                    return
            time.sleep(0.02)

    def stats(self) -> dict:
        with self.lock:
            s = list(self.samples)
            return {"probes": len(s), "max_ms": round(max(s), 1) if s else None,
                    "p50_ms": round(sorted(s)[len(s) // 2], 1) if s else None,
                    "failures": len(self.failures), "failure_kinds": sorted(set(self.failures)),
                    "rss_start_mb": round(self.rss_start), "rss_max_mb": round(self.rss_max)}


# ---------------------------------------------------------------------------------------------- cases
@dataclass
class Result:
    case: str
    sent: str
    got: str = ""
    expected: str = ""
    verdict_ok: Optional[bool] = None  # the answer as the fix promises (None: not judged)
    freeze_case: bool = False  # /health < 1 s is part of the criterion
    health: dict = field(default_factory=dict)
    baseline_health_max_ms: Optional[float] = None
    sizes: str = ""
    duration_s: float = 0.0
    details: dict = field(default_factory=dict)
    status: str = ""  # PASS / FAIL / ERROR / DEADLINE / NOT CONFIGURABLE YET

    def judge(self) -> None:
        if self.status:
            return
        health_ok = (self.health.get("max_ms") is not None and self.health["max_ms"] < HEALTH_LIMIT_MS
                     and self.health.get("failures", 0) == 0)
        ok = bool(self.verdict_ok) and (health_ok or not self.freeze_case)
        self.status = "PASS" if ok else "FAIL"


class Ctx:
    """What a case gets: the server, the probe, the keys, the sizes, and helpers."""

    def __init__(self, server: Server, probe: Probe, keys: Dict[str, str], quick: bool, marker: str,
                 workdir: Path):
        self.server, self.probe, self.keys, self.quick = server, probe, keys, quick
        self.marker, self.workdir = marker, workdir
        self.began = False

    @property
    def url(self) -> str:
        return self.server.url

    def begin(self) -> None:
        """The attack starts now: /health is measured from here (preparing payloads is not)."""
        self.probe.reset()
        self.began = True

    def headers(self, key: Optional[str] = None, token: Optional[str] = None) -> Dict[str, str]:
        h = {"Content-Type": "application/json"}
        if token:
            h["Authorization"] = f"Bearer {token}"
        elif key:
            h["Authorization"] = f"Bearer {self.keys[key]}"
        return h

    def post(self, path: str, body: Any = None, *, raw: Optional[bytes] = None, key: Optional[str] = None,
             token: Optional[str] = None, timeout: float = 120.0) -> Tuple[httpx.Response, float]:
        data = raw if raw is not None else json.dumps(body).encode()
        t0 = time.monotonic()
        r = httpx.post(self.url + path, content=data, headers=self.headers(key, token), timeout=timeout)
        return r, time.monotonic() - t0

    def get(self, path: str, *, key: Optional[str] = None, token: Optional[str] = None,
            timeout: float = 120.0) -> Tuple[httpx.Response, float]:
        t0 = time.monotonic()
        r = httpx.get(self.url + path, headers=self.headers(key, token), timeout=timeout)
        return r, time.monotonic() - t0

    def delete_session(self, sid: str, token: str) -> None:
        try:
            httpx.delete(f"{self.url}/v1/sessions/{sid}", headers=self.headers(token=token), timeout=30)
        except httpx.HTTPError:
            pass


def _err(r: httpx.Response) -> str:
    """'STATUS code (type) param' of an answer, or its start when it is not the JSON error shape."""
    try:
        body = r.json()
    except ValueError:
        return f"{r.status_code} non-JSON {r.headers.get('content-type', '')!s}: {r.text[:80]!r}"
    e = body.get("error") if isinstance(body, dict) else None
    if isinstance(e, dict):
        extra = f" producer_code={e['producer_code']}" if e.get("producer_code") else ""
        return f"{r.status_code} {e.get('code')} param={e.get('param')}{extra}: {str(e.get('message'))[:100]}"
    return f"{r.status_code} {json.dumps(body)[:120]}"


def _code(r: httpx.Response) -> Optional[str]:
    try:
        e = r.json().get("error")
        return e.get("code") if isinstance(e, dict) else None
    except (ValueError, AttributeError):
        return None


def _new_session(ctx: Ctx, key: Optional[str] = None, body: Any = None) -> Tuple[httpx.Response, dict]:
    r, _ = ctx.post("/v1/sessions", body or {}, key=key)
    return r, (r.json() if r.status_code == 201 else {})


def _get_var(ctx: Ctx, sid: str, token: str, vid: str, timeout_s: int = 90) -> Tuple[httpx.Response, float]:
    return ctx.get(f"/v1/sessions/{sid}/variables/{vid}?timeout_s={timeout_s}", token=token, timeout=timeout_s + 30)


# -- 1 ------------------------------------------------------------------------------------------------
REGEX = "(.?){20}.{20}\u0000"


def case_regex_transform(ctx: Ctx, res: Result) -> None:
    res.freeze_case = True
    res.sent = f"POST /v1/sessions with a call whose output has transform regex {REGEX!r} (64 tokens generated)"
    res.expected = "400 at submit or 424 transform_failed, /health < 1 s"
    call = {"model": MODEL, "chat": True, "template": "Tell me a long story about a dragon. {{output:o}}",
            "outputs": {"o": {"sampling": {"max_tokens": 64, "temperature": 0}, "transform": {"regex": REGEX}}}}
    ctx.begin()
    r, s = _new_session(ctx, body={"calls": [call]})
    if r.status_code != 201:
        res.got = f"submit: {_err(r)}"
        res.verdict_ok = r.status_code == 400
        return
    vid = s["calls"][0]["outputs"]["o"]
    g, dt = _get_var(ctx, s["id"], s["token"], vid, timeout_s=200)
    res.got = f"submit 201; get after {dt:.1f}s: {_err(g)}"
    res.verdict_ok = g.status_code in (400, 424)
    ctx.delete_session(s["id"], s["token"])


# -- 2 ------------------------------------------------------------------------------------------------
def case_placeholder_amplification(ctx: Ctx, res: Result) -> None:
    res.freeze_case = True
    value = ("lorem ipsum dolor sit amet " * 4000)[:100_000]
    template = "{{input:x}}" * 100 + "{{output:o}}"
    res.sent = "template {{input:x}} x100 + {{output:o}} over a 100,000-char variable (10 MB prompt)"
    res.expected = "4xx at submit (prompt too large, counting repeats), /health < 1 s"
    r, s = _new_session(ctx)
    if r.status_code != 201:
        res.got = f"session: {_err(r)}"
        return
    sid, tok = s["id"], s["token"]
    v, _ = ctx.post(f"/v1/sessions/{sid}/variables", {"value": value}, token=tok)
    if v.status_code != 201:
        res.got = f"variable: {_err(v)}"
        ctx.delete_session(sid, tok)
        return
    ctx.begin()
    c, dt = ctx.post(f"/v1/sessions/{sid}/calls", {"model": MODEL, "template": template,
                                                   "inputs": {"x": v.json()["id"]},
                                                   "outputs": {"o": {"sampling": {"max_tokens": 1}}}}, token=tok)
    if c.status_code != 201:
        res.got = f"submit after {dt:.1f}s: {_err(c)}"
        res.verdict_ok = 400 <= c.status_code < 500
    else:
        g, gdt = _get_var(ctx, sid, tok, c.json()["outputs"]["o"])
        res.got = f"submit 201 ({dt:.1f}s); get after {gdt:.1f}s: {_err(g)}"
        res.verdict_ok = False
    res.details["rss_growth_mb"] = round(ctx.probe.stats()["rss_max_mb"] - ctx.probe.stats()["rss_start_mb"])
    res.got += f"; server RSS +{res.details['rss_growth_mb']} MB"
    ctx.delete_session(sid, tok)


# -- 3 ------------------------------------------------------------------------------------------------
def case_large_prompt(ctx: Ctx, res: Result) -> None:
    res.freeze_case = True
    content = ("hello world " * 300_000)[:3_500_000]
    raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}],
                      "max_tokens": 1}).encode()
    res.sent = f"chat completion with a {len(content) / 1e6:.1f} MB user message ({len(raw)} bytes body)"
    res.expected = "400 context_length_exceeded, /health < 1 s"
    ctx.begin()
    r, dt = ctx.post("/v1/chat/completions", raw=raw)
    res.got = f"{_err(r)} after {dt:.1f}s"
    res.verdict_ok = r.status_code in (400, 413)


def case_big_batch(ctx: Ctx, res: Result) -> None:
    res.freeze_case = True
    calls = [{"model": MODEL, "template": "{{output:o}}"}] * 50_000
    raw = json.dumps({"calls": calls}).encode()
    res.sent = f"POST /v1/sessions with a batch of 50,000 calls ({len(raw)} bytes)"
    res.expected = "429 session_limit (counted before parsing the calls), /health < 1 s"
    ctx.begin()
    r, dt = ctx.post("/v1/sessions", raw=raw)
    res.got = f"{_err(r)} after {dt:.1f}s"
    res.verdict_ok = r.status_code in (400, 413, 429)
    if r.status_code == 201:
        ctx.delete_session(r.json()["id"], r.json()["token"])


def case_big_metadata(ctx: Ctx, res: Result) -> None:
    res.freeze_case = True
    raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                      "metadata": {f"k{i}": "v" for i in range(200_000)}}).encode()
    res.sent = f"chat completion with a 200,000-key metadata ({len(raw)} bytes)"
    res.expected = "400 naming metadata, /health < 1 s"
    ctx.begin()
    r, dt = ctx.post("/v1/chat/completions", raw=raw)
    res.got = f"{_err(r)} after {dt:.1f}s"
    res.verdict_ok = r.status_code == 400


def case_big_schema(ctx: Ctx, res: Result) -> None:
    res.freeze_case = True
    props = {f"p{i}": {"type": "string"} for i in range(5000)}
    schema = {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}
    raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                      "response_format": {"type": "json_schema",
                                          "json_schema": {"name": "big", "schema": schema}}}).encode()
    res.sent = f"response_format json_schema with 5,000 required properties ({len(raw)} bytes)"
    res.expected = "400 (too complex) or 200, /health < 1 s"
    ctx.begin()
    r, dt = ctx.post("/v1/chat/completions", raw=raw, timeout=180)
    res.got = f"{_err(r) if r.status_code != 200 else '200'} after {dt:.1f}s"
    res.verdict_ok = r.status_code in (200, 400)


# -- 4 ------------------------------------------------------------------------------------------------
def case_pattern_400(ctx: Ctx, res: Result) -> None:
    pattern = "^(a{1000}){1000}$"
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}, "required": ["a"]}
    res.sent = f"response_format json_schema with pattern {pattern!r}"
    res.expected = "400 naming the pattern (not 500)"
    ctx.begin()
    r, dt = ctx.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                              "max_tokens": 4, "response_format": {
                                                  "type": "json_schema",
                                                  "json_schema": {"name": "p", "schema": schema}}}, timeout=180)
    res.got = f"{_err(r)} after {dt:.1f}s"
    res.verdict_ok = r.status_code == 400


# -- 5 ------------------------------------------------------------------------------------------------
def case_json_field_deep(ctx: Ctx, res: Result) -> None:
    res.freeze_case = True
    res.sent = ("semantic tool call (format tool, key 'attacker') whose output is 100,000 nested '[', "
                "transform json_field '0'")
    res.expected = "424 producer_code transform_failed (no RecursionError), /health < 1 s"
    r, s = _new_session(ctx, key="attacker")
    if r.status_code != 201:
        res.got = f"session: {_err(r)}"
        return
    ctx.begin()
    c, _ = ctx.post(f"/v1/sessions/{s['id']}/calls", {
        "tool": "format", "arguments": {"template": "[" * 100_000},
        "outputs": {"r": {"transform": {"json_field": "0"}}}}, token=s["token"])
    if c.status_code != 201:
        res.got = f"submit: {_err(c)}"
        res.verdict_ok = c.status_code == 400
    else:
        g, dt = _get_var(ctx, s["id"], s["token"], c.json()["outputs"]["r"])
        res.got = f"submit 201; get after {dt:.1f}s: {_err(g)}"
        body = g.json().get("error", {}) if g.headers.get("content-type", "").startswith("application/json") else {}
        res.verdict_ok = (g.status_code == 424 and body.get("producer_code") == "transform_failed"
                          and "Recursion" not in g.text)
    ctx.delete_session(s["id"], s["token"])


# -- 6 ------------------------------------------------------------------------------------------------
def case_metrics_growth(ctx: Ctx, res: Result) -> None:
    res.freeze_case = True
    n = 2_000 if ctx.quick else 11_000
    res.sizes = f"{n} requests"
    res.sent = f"{n} unauthenticated GET /v1/sessions/<random> (401/404), a real session's GETs, then /metrics"
    res.expected = "/metrics bounded (grows < 256 KB), no ids in it, scrape < 1 s, /health < 1 s"
    m0 = httpx.get(ctx.url + "/metrics", timeout=60)
    size0 = len(m0.content)
    r, s = _new_session(ctx)  # a "victim" session whose ids should not leak
    sid, tok = s.get("id", ""), s.get("token", "")
    if sid:
        v, _ = ctx.post(f"/v1/sessions/{sid}/variables", {"value": "x"}, token=tok)
        vid = v.json().get("id", "") if v.status_code == 201 else ""
        ctx.get(f"/v1/sessions/{sid}", token=tok)
        if vid:
            ctx.get(f"/v1/sessions/{sid}/variables/{vid}?timeout_s=0", token=tok)
    else:
        vid = ""
    ids = [f"ses_{secrets.token_hex(12)}" for _ in range(n)]
    ctx.begin()
    statuses: Dict[int, int] = {}
    lock = threading.Lock()

    def worker(part: List[str]) -> None:
        with httpx.Client(timeout=30) as c:
            for i in part:
                try:
                    st = c.get(f"{ctx.url}/v1/sessions/{i}").status_code
                except httpx.HTTPError:
                    st = -1
                with lock:
                    statuses[st] = statuses.get(st, 0) + 1

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(ids[k::4],), daemon=True) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sent_s = time.monotonic() - t0
    scrapes = []
    body = b""
    for _ in range(3):
        t1 = time.monotonic()
        m = httpx.get(ctx.url + "/metrics", timeout=60)
        scrapes.append(time.monotonic() - t1)
        body = m.content
    leaked_random = sum(1 for i in random.sample(ids, min(200, n)) if i.encode() in body)
    leaked_real = [x for x in (sid, vid) if x and x.encode() in body]
    res.got = (f"statuses {statuses} in {sent_s:.0f}s; /metrics {size0 / 1e3:.0f} KB -> {len(body) / 1e3:.0f} KB, "
               f"scrape max {max(scrapes):.2f}s; random ids in it: {leaked_random}/200 sampled; "
               f"real session/variable ids in it: {len(leaked_real)}/{len([x for x in (sid, vid) if x])}")
    res.details.update(metrics_bytes_before=size0, metrics_bytes_after=len(body), scrape_s=scrapes,
                       random_ids_leaked_of_200=leaked_random, real_ids_leaked=len(leaked_real))
    res.verdict_ok = (len(body) - size0 < 256_000 and max(scrapes) < 1.0 and leaked_random == 0
                      and not leaked_real)
    if sid:
        ctx.delete_session(sid, tok)


# -- 7 ------------------------------------------------------------------------------------------------
SLOW_NOFILE = 1024  # the server's soft RLIMIT_NOFILE in this case: a stock shell's / systemd's default


def case_slowloris(ctx: Ctx, res: Result) -> None:
    res.freeze_case = True
    n = 2_000 if ctx.quick else 20_000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError):
        pass
    mine = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    n_eff = min(n, mine - 200)
    res.sizes = f"{n_eff} connections (harness RLIMIT_NOFILE {mine}; server soft RLIMIT_NOFILE {SLOW_NOFILE})"
    res.sent = (f"{n_eff} connections each sending a partial header, one more header line every 10 s for 30 s; "
                "meanwhile a 4-token chat")
    res.expected = "chat answered, /health < 1 s, server log bounded (< 1,000 lines added)"
    lines0 = ctx.server.log_lines()
    emfile0 = ctx.server.log_count(b"Too many open files")
    ctx.begin()
    socks: List[socket.socket] = []
    failed = 0
    t0 = time.monotonic()
    for i in range(n_eff):
        if time.monotonic() - t0 > 30:
            break
        s = socket.socket()
        s.setblocking(False)
        try:
            s.connect(("127.0.0.1", ctx.server.port))
        except BlockingIOError:
            pass
        except OSError:
            failed += 1
            s.close()
            continue
        socks.append(s)
    # wait (briefly) for the handshakes, then send each its partial header
    time.sleep(1.0)
    established = 0
    for s in socks:
        try:
            s.send(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            established += 1
        except OSError:
            pass
    open_s = time.monotonic() - t0
    chat: Dict[str, Any] = {}

    def do_chat() -> None:
        t1 = time.monotonic()
        try:
            r = httpx.post(ctx.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4},
                timeout=30)
            chat["status"] = r.status_code
        except httpx.HTTPError as e:
            chat["status"] = type(e).__name__
        chat["s"] = time.monotonic() - t1

    ct = threading.Thread(target=do_chat, daemon=True)
    ct.start()
    hold_end = time.monotonic() + 30
    while time.monotonic() < hold_end:
        time.sleep(min(10.0, max(0.0, hold_end - time.monotonic())))
        for s in socks:
            try:
                s.send(b"X-Slow: 1\r\n")
            except OSError:
                pass
    ct.join(timeout=35)
    for s in socks:
        s.close()
    time.sleep(3)
    lines = ctx.server.log_lines() - lines0
    emfile = ctx.server.log_count(b"Too many open files") - emfile0
    alive_after = ctx.server.healthy()
    res.got = (f"{established}/{len(socks)} connections sent headers ({failed} connect errors, {open_s:.0f}s); "
               f"chat: {chat.get('status')} after {chat.get('s', 0):.1f}s; server log +{lines} lines "
               f"({emfile} 'Too many open files'); healthy after: {alive_after}")
    res.details.update(connections=len(socks), established=established, chat=chat, log_lines_added=lines,
                       emfile_lines=emfile)
    res.verdict_ok = chat.get("status") == 200 and lines < 1000 and alive_after
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    except (ValueError, OSError):
        pass


# -- 8 ------------------------------------------------------------------------------------------------
def _raw_exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            r, _, _ = select.select([s], [], [], max(0.0, end - time.monotonic()))
            if not r:
                break
            try:
                chunk = s.recv(65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
            head, sep, body = out.partition(b"\r\n\r\n")
            m = re.search(rb"(?i)content-length:\s*(\d+)", head)
            if sep and m and len(body) >= int(m.group(1)):
                break
        return out


def _protocol_case(ctx: Ctx, res: Result, what: str, data: bytes) -> None:
    res.sent = what
    res.expected = "4xx with a JSON error body {\"error\": {...}}"
    ctx.begin()
    out = _raw_exchange(ctx.server.port, data)
    head, _, body = out.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].decode("latin-1")
    ctype = next((ln.split(b":", 1)[1].strip().decode("latin-1") for ln in head.split(b"\r\n")[1:]
                  if ln.lower().startswith(b"content-type:")), "")
    try:
        is_json = isinstance(json.loads(body.decode()).get("error"), dict)
    except (ValueError, UnicodeDecodeError, AttributeError):
        is_json = False
    res.got = (f"{status_line or '(connection closed, no answer)'}; {ctype or 'no content-type'}; "
               f"body {body[:60]!r}; JSON error shape: {is_json}")
    m = re.match(r"HTTP/1\.[01] (\d+)", status_line)
    res.verdict_ok = bool(m) and 400 <= int(m.group(1)) < 500 and is_json


def case_bad_content_length(ctx: Ctx, res: Result) -> None:
    _protocol_case(ctx, res, "POST /v1/chat/completions with 'Content-Length: abc'",
                   b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Content-Length: abc\r\n\r\n{}")


def case_bad_chunked(ctx: Ctx, res: Result) -> None:
    _protocol_case(ctx, res, "POST /v1/chat/completions, Transfer-Encoding: chunked, chunk size 'zz'",
                   b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n")


def case_nul_header(ctx: Ctx, res: Result) -> None:
    _protocol_case(ctx, res, "GET /v1/models with a NUL byte in a header value",
                   b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Test: a\x00b\r\n\r\n")


# -- 9 ------------------------------------------------------------------------------------------------
def case_sigterm_drain(ctx: Ctx, res: Result) -> None:
    res.sent = ("SIGTERM to the gateway 3 s into a streamed and a non-streamed chat "
                "(max_tokens 1500 each)")
    res.expected = ("non-streamed: 200 or JSON 503; stream: finished or error event, then [DONE]; "
                    "server exits, no process left behind")
    body = {"model": MODEL, "messages": [{"role": "user", "content":
                                          "Write a very long, detailed essay about the history of Rome."}],
            "max_tokens": 1500, "temperature": 0}
    plain: Dict[str, Any] = {}
    stream: Dict[str, Any] = {"events": []}
    first_chunk = threading.Event()

    def do_plain() -> None:
        try:
            r = httpx.post(ctx.url + "/v1/chat/completions", json=body, timeout=120)
            plain.update(status=r.status_code, ctype=r.headers.get("content-type", ""), text=r.text[:160])
        except httpx.HTTPError as e:
            plain.update(status=type(e).__name__)

    def do_stream() -> None:
        try:
            with httpx.stream("POST", ctx.url + "/v1/chat/completions", json={**body, "stream": True},
                              timeout=120) as r:
                stream["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        stream["events"].append(line[5:].strip())
                        first_chunk.set()
        except httpx.HTTPError as e:
            stream["transport_error"] = type(e).__name__
        first_chunk.set()

    ctx.begin()
    tp = threading.Thread(target=do_plain, daemon=True)
    ts = threading.Thread(target=do_stream, daemon=True)
    tp.start()
    ts.start()
    first_chunk.wait(60)
    time.sleep(3)
    ctx.server.snapshot()
    n_desc = len(ctx.server.descendants_alive())
    t_term = time.monotonic()
    os.kill(ctx.server.pid, signal.SIGTERM)
    try:
        rc = ctx.server.proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        rc = "still running after 90 s"
    exit_s = time.monotonic() - t_term
    tp.join(timeout=30)
    ts.join(timeout=30)
    time.sleep(5)
    left = ctx.server.descendants_alive()
    ev = stream["events"]
    err_event = any('"error"' in e for e in ev)
    done = bool(ev) and ev[-1] == "[DONE]"
    finished = any('"finish_reason": "' in e.replace('":"', '": "') and '"finish_reason": null' not in e
                   for e in ev[-3:])
    plain_json = str(plain.get("ctype", "")).startswith("application/json")
    res.got = (f"non-streamed: {plain.get('status')} {plain.get('ctype', '')} {plain.get('text', '')[:70]!r}; "
               f"stream: {len(ev)} events, error event {err_event}, ends with [DONE] {done}"
               f"{', transport error ' + stream['transport_error'] if 'transport_error' in stream else ''}; "
               f"exit {rc} after {exit_s:.1f}s; {len(left)}/{n_desc} descendants left behind")
    res.details.update(plain=plain, stream_tail=ev[-3:], exit_code=rc, exit_s=exit_s, leftover=len(left))
    res.verdict_ok = ((plain.get("status") == 200 or (plain.get("status") == 503 and plain_json))
                      and done and (finished or err_event) and not left and isinstance(rc, int))


# -- 10 -----------------------------------------------------------------------------------------------
def case_sessions_per_key(ctx: Ctx, res: Result) -> None:
    res.sent = "key 'attacker' creates sessions until refused (global max_sessions 256); then key 'victim' one"
    res.expected = "attacker refused before taking every slot; victim gets 201"
    ctx.begin()
    mine: List[dict] = []
    refusal = ""
    for _ in range(300):
        r, s = _new_session(ctx, key="attacker")
        if r.status_code != 201:
            refusal = _err(r)
            break
        mine.append(s)
    v, vs = _new_session(ctx, key="victim")
    res.got = (f"attacker got {len(mine)} sessions, then {refusal or 'never refused'}; "
               f"victim: {v.status_code if v.status_code == 201 else _err(v)}")
    res.verdict_ok = v.status_code == 201 and len(mine) < 256
    for s in mine + ([vs] if vs else []):
        ctx.delete_session(s["id"], s["token"])


def case_fairness(ctx: Ctx, res: Result) -> None:
    n, tokens = 256, 32
    res.sizes = f"{n} calls x {tokens} tokens"
    res.sent = (f"key 'attacker' submits a {n}-call batch ({tokens} tokens each); 1 s later key 'victim' "
                "asks a 4-token chat")
    res.expected = "victim's chat answered within 10 s (fair share across keys)"
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
    r0, alone = ctx.post("/v1/chat/completions", chat, key="victim")
    calls = [{"model": MODEL, "template": f"Story number {i}: once upon a time {{{{output:o}}}}",
              "outputs": {"o": {"sampling": {"max_tokens": tokens, "temperature": 0}}}} for i in range(n)]
    ctx.begin()
    r, s = _new_session(ctx, key="attacker", body={"calls": calls})
    if r.status_code != 201:
        res.got = f"batch refused: {_err(r)}"
        res.verdict_ok = False
        return
    time.sleep(1)
    v, dt = ctx.post("/v1/chat/completions", chat, key="victim", timeout=600)
    res.got = (f"victim's 4-token chat: alone {alone:.1f}s ({r0.status_code}); behind the batch "
               f"{v.status_code} after {dt:.1f}s")
    res.details.update(alone_s=alone, loaded_s=dt)
    res.verdict_ok = v.status_code == 200 and dt < 10
    ctx.delete_session(s["id"], s["token"])


# -- 11 -----------------------------------------------------------------------------------------------
def _python_call(ctx: Ctx, code: str, timeout: float = 420) -> Tuple[str, dict, float]:
    """Force a python tool call with ``code`` (key 'attacker': server_tools [python], replay);
    returns (summary, the tool result's content, seconds)."""
    call = "```python\n" + code + "```\n"  # configs/adversarial.yaml: the markdown parser
    r, dt = ctx.post("/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "run it"}], "max_tokens": 3000,
        "interlace": {"server_tools": ["python"], "replay": [call, "done."]}}, key="attacker", timeout=timeout)
    if r.status_code != 200:
        return f"chat: {_err(r)}", {}, dt
    calls = (r.json().get("interlace") or {}).get("tool_calls") or []
    if not calls:
        return "no tool call ran", {}, dt
    c = calls[0]
    content = c.get("content") if isinstance(c.get("content"), dict) else {"raw": c.get("content")}
    if not c.get("ok"):
        content = {**content, "tool_error": c.get("error")}
    return "ok", content, dt


def _tool_text(content: dict) -> str:
    return json.dumps(content)


def _tool_summary(content: dict) -> str:
    out = (content.get("stdout") or "").strip().replace("\n", " | ")
    err = content.get("error") or content.get("tool_error") or ""
    err = (err.strip().splitlines() or [""])[-1] if isinstance(err, str) else str(err)
    return f"stdout {out[:110]!r}" + (f"; error {err[:110]!r}" if err else "")


def case_py_setns(ctx: Ctx, res: Result) -> None:
    res.sent = "python tool: setns(open('/proc/<gateway>/ns/net')) then connect to the gateway on 127.0.0.1"
    res.expected = "fails (gateway pid not visible / setns denied / no connection)"
    code = (f"import ctypes, os, socket\n"
            f"libc = ctypes.CDLL(None, use_errno=True)\n"
            f"fd = os.open('/proc/{ctx.server.pid}/ns/net', os.O_RDONLY)\n"
            f"print('setns', libc.setns(fd, 0x40000000), ctypes.get_errno())\n"
            f"s = socket.create_connection(('127.0.0.1', {ctx.server.port}), timeout=5)\n"
            f"s.sendall(b'GET /health HTTP/1.0\\r\\n\\r\\n')\n"
            f"print('GOT', s.recv(60))\n")
    ctx.begin()
    how, content, dt = _python_call(ctx, code)
    escaped = "GOT b'HTTP/1.1 200" in (content.get("stdout") or "")
    res.got = (f"{how} ({dt:.0f}s): {_tool_summary(content)}; reached the gateway: {escaped}")
    res.verdict_ok = how == "ok" and not escaped


def case_py_unix_socket(ctx: Ctx, res: Result) -> None:
    path = f"/tmp/adv-{secrets.token_hex(6)}.sock"
    hello = f"UNIX-HELLO-{secrets.token_hex(8)}".encode()
    accepted = threading.Event()
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    os.chmod(path, 0o777)
    srv.listen(4)
    srv.settimeout(1.0)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            accepted.set()
            try:
                c.sendall(hello)
            finally:
                c.close()

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    res.sent = f"python tool: connect to a filesystem AF_UNIX socket the harness listens on ({path})"
    res.expected = "fails (no host AF_UNIX sockets)"
    code = (f"import socket\n"
            f"s = socket.socket(socket.AF_UNIX)\n"
            f"s.connect('{path}')\n"
            f"print('GOT', s.recv(100))\n")
    try:
        ctx.begin()
        how, content, dt = _python_call(ctx, code)
    finally:
        stop.set()
        srv.close()
        th.join(timeout=5)
        try:
            os.unlink(path)
        except OSError:
            pass
    escaped = accepted.is_set() or hello.decode() in _tool_text(content)
    res.got = f"{how} ({dt:.0f}s): {_tool_summary(content)}; harness socket reached: {escaped}"
    res.verdict_ok = how == "ok" and not escaped


def case_py_environ(ctx: Ctx, res: Result) -> None:
    res.sent = "python tool: print(open('/proc/<gateway>/environ').read()) (the gateway holds a marker secret)"
    res.expected = "fails; the marker and the API keys never appear"
    code = f"print(open('/proc/{ctx.server.pid}/environ', 'rb').read().decode('latin-1'))\n"
    ctx.begin()
    how, content, dt = _python_call(ctx, code)
    text = _tool_text(content)
    leaked = [n for n, v in [("marker", ctx.marker), ("attacker key", ctx.keys["attacker"]),
                             ("victim key", ctx.keys["victim"])] if v in text]
    err = content.get("error") or content.get("tool_error") or ""
    err = (err.strip().splitlines() or [""])[-1] if isinstance(err, str) else str(err)
    # the environment itself is not copied into the report: only what of ours leaked
    res.got = (f"{how} ({dt:.0f}s): stdout {len(content.get('stdout') or '')} chars"
               f"{'; error ' + repr(err[:110]) if err else ''}; leaked: {leaked or 'nothing'}")
    res.verdict_ok = how == "ok" and not leaked


def case_py_mem(ctx: Ctx, res: Result) -> None:
    secret = f"ADVVICTIM-{secrets.token_hex(16)}"
    res.sent = ("key 'victim' stores a session variable; python tool (key 'attacker') scans "
                "/proc/<gateway>/mem (anonymous regions <= 64 MB) for it")
    res.expected = "fails; the victim's value never appears"
    r, s = _new_session(ctx, key="victim")
    if r.status_code != 201:
        res.got = f"victim session: {_err(r)}"
        return
    v, _ = ctx.post(f"/v1/sessions/{s['id']}/variables", {"value": secret}, token=s["token"])
    code = (f"import re\n"
            f"pid = {ctx.server.pid}\n"
            f"found = set()\n"
            f"scanned = 0\n"
            f"mem = open('/proc/%d/mem' % pid, 'rb', 0)\n"
            f"for line in open('/proc/%d/maps' % pid).read().splitlines():\n"
            f"    f = line.split()\n"
            f"    lo, hi = (int(x, 16) for x in f[0].split('-'))\n"
            f"    if 'r' not in f[1] or (len(f) > 5 and f[5] != '[heap]') or hi - lo > 64 << 20:\n"
            f"        continue\n"
            f"    try:\n"
            f"        mem.seek(lo)\n"
            f"        b = mem.read(hi - lo)\n"
            f"    except OSError:\n"
            f"        continue\n"
            f"    scanned += len(b)\n"
            f"    found.update(re.findall(rb'ADVVICTIM-[0-9a-f]{{32}}', b))\n"
            f"print('scanned MB', scanned >> 20, 'found', sorted(found))\n")
    ctx.begin()
    how, content, dt = _python_call(ctx, code)
    leaked = secret in _tool_text(content)
    res.got = f"{how} ({dt:.0f}s): {_tool_summary(content)[:150]}; victim's value found: {leaked}"
    res.verdict_ok = how == "ok" and not leaked
    ctx.delete_session(s["id"], s["token"])


def case_py_fork_memory(ctx: Ctx, res: Result) -> None:
    n, mb = 8, 240
    res.sent = f"python tool (memory_mb 1024): fork {n} children holding {mb} MB each ({n * mb} MB in all)"
    res.expected = "the call's processes together hold < 1024 MB"
    code = (f"import os, time\n"
            f"r, w = os.pipe()\n"
            f"pids = []\n"
            f"for i in range({n}):\n"
            f"    pid = os.fork()\n"
            f"    if pid == 0:\n"
            f"        try:\n"
            f"            b = b'x' * ({mb} << 20)\n"
            f"            os.write(w, b'1')\n"
            f"            time.sleep(4)\n"
            f"        finally:\n"
            f"            os._exit(0)\n"
            f"    pids.append(pid)\n"
            f"time.sleep(3)\n"
            f"os.set_blocking(r, False)\n"
            f"try:\n"
            f"    held = len(os.read(r, 100))\n"
            f"except BlockingIOError:\n"
            f"    held = 0\n"
            f"print('children holding {mb} MB:', held, 'total MB:', held * {mb})\n"
            f"for p in pids:\n"
            f"    os.waitpid(p, 0)\n")
    ctx.begin()
    how, content, dt = _python_call(ctx, code)
    m = re.search(r"total MB: (\d+)", content.get("stdout") or "")
    total = int(m.group(1)) if m else None
    res.got = f"{how} ({dt:.0f}s): {_tool_summary(content)}"
    res.verdict_ok = how == "ok" and (total is None or total < 1024)


def case_py_fork_many(ctx: Ctx, res: Result) -> None:
    res.sent = "python tool (max_processes 64): fork 300 children that sleep 3 s"
    res.expected = "refused at or below the process limit (<= 64 forked)"
    code = ("import os, time\n"
            "pids = []\n"
            "err = None\n"
            "for i in range(300):\n"
            "    try:\n"
            "        pid = os.fork()\n"
            "    except OSError as e:\n"
            "        err = repr(e)\n"
            "        break\n"
            "    if pid == 0:\n"
            "        time.sleep(3)\n"
            "        os._exit(0)\n"
            "    pids.append(pid)\n"
            "print('forked', len(pids), 'error', err)\n"
            "for p in pids:\n"
            "    os.waitpid(p, 0)\n")
    ctx.begin()
    how, content, dt = _python_call(ctx, code)
    m = re.search(r"forked (\d+)", content.get("stdout") or "")
    forked = int(m.group(1)) if m else None
    res.got = f"{how} ({dt:.0f}s): {_tool_summary(content)}"
    res.verdict_ok = how == "ok" and (forked is None or forked <= 64)


# -- 12 -----------------------------------------------------------------------------------------------
def case_unknown_tool(ctx: Ctx, res: Result) -> None:
    res.sent = "chat with interlace.server_tools ['nope'] (no key, default config); semantic tool node 'nope'"
    res.expected = "chat: 400 unknown_tool (docs/security.md); semantic: 400/404, not 403"
    ctx.begin()
    r, _ = ctx.post("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 1, "interlace": {"server_tools": ["nope"]}})
    s_r, s = _new_session(ctx)
    sem = None
    if s_r.status_code == 201:
        sem, _ = ctx.post(f"/v1/sessions/{s['id']}/calls", {"tool": "nope", "arguments": {},
                                                            "outputs": {"r": {}}}, token=s["token"])
        ctx.delete_session(s["id"], s["token"])
    res.got = f"chat: {_err(r)}; semantic: {_err(sem) if sem is not None else 'no session: ' + _err(s_r)}"
    res.verdict_ok = r.status_code == 400 and sem is not None and sem.status_code in (400, 404)


def case_options_allow(ctx: Ctx, res: Result) -> None:
    res.sent = "OPTIONS /v1/sessions/x; compared with /openapi.json's methods for /v1/sessions/{sid}"
    res.expected = "Allow lists every method the OpenAPI document has for the path (DELETE included)"
    ctx.begin()
    r = httpx.request("OPTIONS", ctx.url + "/v1/sessions/x", timeout=30)
    allow = {m.strip().upper() for m in r.headers.get("allow", "").split(",") if m.strip()}
    doc = httpx.get(ctx.url + "/openapi.json", timeout=30).json()
    path = next((p for p in doc.get("paths", {}) if re.fullmatch(r"/v1/sessions/\{[^}/]+\}", p)), None)
    want = {m.upper() for m in doc["paths"][path]} if path else set()
    want &= {"GET", "POST", "PUT", "DELETE", "PATCH", "HEAD"}
    res.got = f"{r.status_code}, Allow: {', '.join(sorted(allow)) or '(none)'}; OpenAPI {path}: {sorted(want)}"
    res.verdict_ok = "DELETE" in allow and want <= allow


# -- issue 33: the Responses and Messages APIs --------------------------------------------------------
RESP, MSGS = "/v1/responses", "/v1/messages"


def _resp_body(**kw: Any) -> dict:
    return {"model": MODEL, "input": "hi", "max_output_tokens": 1, **kw}


def _msg_body(**kw: Any) -> dict:
    return {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}], **kw}


def _shape_ok(r: httpx.Response, dialect: str) -> bool:
    """The body is the API's own error shape: OpenAI's {"error": {message, type, param, code}}, or
    Anthropic's {"type": "error", "error": {"type", "message"}}."""
    try:
        b = r.json()
    except ValueError:
        return False
    if not isinstance(b, dict) or not isinstance(b.get("error"), dict):
        return False
    e = b["error"]
    if dialect == "anthropic":
        return b.get("type") == "error" and isinstance(e.get("type"), str) and isinstance(e.get("message"), str)
    return isinstance(e.get("message"), str) and {"type", "param", "code"} <= set(e)


def _dialect(path: str) -> str:
    return "anthropic" if path.startswith(MSGS) else "openai"


def _brief(r: httpx.Response) -> str:
    """'STATUS type/code: message' of either API's error, or the status."""
    try:
        b = r.json()
    except ValueError:
        return f"{r.status_code} non-JSON {r.text[:60]!r}"
    e = b.get("error") if isinstance(b, dict) else None
    if isinstance(e, dict):
        return f"{r.status_code} {e.get('code') or e.get('type')}: {str(e.get('message'))[:90]}"
    return str(r.status_code)


def _send_all(ctx: Ctx, attempts: List[Tuple[str, str, Any]], key: str = "attacker",
              timeout: float = 120.0) -> Tuple[List[str], List[str]]:
    """POST each (label, path, body): the labels whose answer was a 5xx, not a 4xx/2xx, or a 4xx not in
    the API's error shape; and a line per attempt."""
    bad: List[str] = []
    lines: List[str] = []
    for label, path, body in attempts:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        r, _ = ctx.post(path, raw=raw, key=key, timeout=timeout)
        ok = (r.status_code == 200) or (400 <= r.status_code < 500 and _shape_ok(r, _dialect(path)))
        if not ok:
            bad.append(f"{label}: {_brief(r)}")
        lines.append(f"{label}: {_brief(r)}")
    return bad, lines


def _metrics(ctx: Ctx) -> Dict[str, float]:
    """The gauges that say what the engine holds: contexts on the replicas, retained contexts, KV blocks
    in use, and the keys' requests in flight (each summed over its labels)."""
    text = httpx.get(ctx.url + "/metrics", timeout=60).text
    names = ("interlace_replica_contexts", "interlace_retention_contexts", "interlace_replica_kv_blocks_in_use",
             "interlace_key_requests_in_flight")
    out = {n: 0.0 for n in names}
    for line in text.splitlines():
        for n in names:
            if line.startswith(n + "{") or line.startswith(n + " "):
                out[n] += float(line.rsplit(" ", 1)[1])
    return out


def _store_path(ctx: Ctx) -> Path:
    return ctx.workdir / "state" / "responses.sqlite3"  # INTERLACE_STATE_DIR of the run (main)


def _near_limit(make: Callable[[int], Any], limit: int) -> Tuple[bytes, int]:
    """The largest body ``make(n)`` (n items of about 1 KB) under ``limit`` bytes, and its n."""
    one = len(json.dumps(make(2)).encode()) - len(json.dumps(make(1)).encode())
    n = max(1, (limit - len(json.dumps(make(0)).encode())) // one)
    while len(raw := json.dumps(make(n)).encode()) > limit:
        n -= 1
    return raw, n


MAX_BODY = 4 * 1024 * 1024  # server.max_request_bytes (default; configs/adversarial.yaml keeps it)


def case_api_big_body(ctx: Ctx, res: Result) -> None:
    res.freeze_case = True
    chunk = "lorem ipsum " * 83  # ~1 KB
    resp = lambda n: _resp_body(input=[{"role": "user", "content": chunk}] * n)  # noqa: E731

    def msgs(n: int) -> dict:
        return _msg_body(messages=[{"role": "user", "content": [{"type": "text", "text": chunk}] * n}])

    r_raw, rn = _near_limit(resp, MAX_BODY)
    m_raw, mn = _near_limit(msgs, MAX_BODY)
    over_r = json.dumps(resp(rn + 2)).encode()
    over_m = json.dumps(msgs(mn + 2)).encode()
    res.sizes = f"{rn} input items ({len(r_raw)} B), {mn} content blocks ({len(m_raw)} B); limit {MAX_BODY} B"
    res.sent = ("POST /v1/responses and /v1/messages with a body just under max_request_bytes of ~1 KB input "
                "items / text blocks, then each just over it")
    res.expected = "under: 400 context_length_exceeded (or 200); over: 413; the API's error shape; /health < 1 s"
    ctx.begin()
    got, ok = [], True
    for label, path, raw, want in (("responses", RESP, r_raw, (200, 400)), ("messages", MSGS, m_raw, (200, 400)),
                                   ("responses over", RESP, over_r, (413,)), ("messages over", MSGS, over_m, (413,))):
        r, dt = ctx.post(path, raw=raw, key="attacker", timeout=180)
        ok &= r.status_code in want and (r.status_code == 200 or _shape_ok(r, _dialect(path)))
        got.append(f"{label}: {_brief(r)} ({dt:.1f}s)")
    res.got = "; ".join(got)
    res.verdict_ok = ok


def case_api_many_items(ctx: Ctx, res: Result) -> None:
    res.freeze_case = True
    n = 20_000
    items = [{"role": "user" if i % 2 == 0 else "assistant", "content": "a"} for i in range(n)] + \
        [{"role": "user", "content": "a"}]
    resp = _resp_body(input=items)
    msgs = _msg_body(messages=items)
    count = {"model": MODEL, "messages": items}
    fc = [x for i in range(n // 2) for x in (
        {"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": f"c{i}", "output": "r"})]
    resp_fc = _resp_body(input=fc, tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}}])
    res.sizes = f"{n + 1} messages; {n} function_call/function_call_output items"
    res.sent = (f"{n + 1} one-character alternating user/assistant turns to /v1/responses, /v1/messages and "
                f"count_tokens; {n} tiny function_call/_output items to /v1/responses")
    res.expected = "400 context_length_exceeded or 200 (count_tokens: 200), the API's shape, /health < 1 s"
    ctx.begin()
    got, ok = [], True
    for label, path, body in (("responses", RESP, resp), ("messages", MSGS, msgs),
                              ("count_tokens", MSGS + "/count_tokens", count), ("responses fc", RESP, resp_fc)):
        r, dt = ctx.post(path, body, key="attacker", timeout=180)
        ok &= r.status_code in (200, 400) and (r.status_code == 200 or _shape_ok(r, _dialect(path)))
        extra = f" input_tokens={r.json().get('input_tokens')}" if label == "count_tokens" and r.status_code == 200 \
            else ""
        got.append(f"{label}: {_brief(r)}{extra} ({dt:.1f}s)")
    res.got = "; ".join(got)
    res.verdict_ok = ok


def _nest(depth: int) -> Any:
    v: Any = "x"
    for _ in range(depth):
        v = {"a": v}
    return v


def case_api_deep_nesting(ctx: Ctx, res: Result) -> None:
    res.freeze_case = True
    deep = _nest(70)
    schema60 = {"type": "object"}
    for _ in range(28):  # 2 levels per wrap: properties -> name -> ... about 60 deep in all
        schema60 = {"type": "object", "properties": {"a": schema60}}
    fn = lambda params: [{"type": "function", "name": "f", "parameters": params}]  # noqa: E731
    tool = lambda schema: [{"name": "f", "input_schema": schema}]  # noqa: E731
    brackets = b'{"model": "' + MODEL.encode() + b'", "input": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    attempts = [
        ("responses metadata 70 deep", RESP, _resp_body(metadata={"k": deep})),
        ("responses tool parameters 70 deep", RESP, _resp_body(tools=fn({"type": "object", "properties": deep}))),
        ("responses text.format schema 70 deep", RESP, _resp_body(text={"format": {
            "type": "json_schema", "name": "x", "schema": {"type": "object", "properties": deep}}})),
        ("responses 100,000 '['", RESP, brackets),
        ("responses tool schema ~60 deep (under the limit)", RESP, _resp_body(tools=fn(schema60))),
        ("messages input_schema 70 deep", MSGS, _msg_body(tools=tool({"type": "object", "properties": deep}))),
        ("messages tool_use input 70 deep", MSGS, _msg_body(messages=[
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": deep}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]}],
            tools=tool({"type": "object"}))),
        ("messages 100,000 '['", MSGS, brackets.replace(b'"input"', b'"messages"')),
        ("count_tokens 100,000 '['", MSGS + "/count_tokens", brackets.replace(b'"input"', b'"messages"')),
        ("messages input_schema ~60 deep (under the limit)", MSGS, _msg_body(tools=tool(schema60))),
    ]
    res.sent = "JSON nested 70 levels (metadata, tool schemas, tool_use input), 100,000 '[', and a 60-deep tool schema"
    res.expected = "400 in the API's shape (or 200 under the depth limit), never 5xx, /health < 1 s"
    ctx.begin()
    bad, lines = _send_all(ctx, attempts)
    deep_ok = all(not ln.split(": ", 1)[1].startswith("200") for ln in lines if "70 deep" in ln or "'['" in ln)
    res.got = f"{len(lines) - len(bad)}/{len(lines)} answered as promised" + (f"; wrong: {bad}" if bad else "") + \
        "; " + "; ".join(lines)
    res.verdict_ok = not bad and deep_ok


UNHASHABLE = {"a": [1]}


def case_api_unhashable(ctx: Ctx, res: Result) -> None:
    u, ul = UNHASHABLE, [UNHASHABLE]
    fn_tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    call = lambda **kw: {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", **kw}  # noqa: E731
    out = lambda **kw: {"type": "function_call_output", "call_id": "c1", "output": "r", **kw}  # noqa: E731
    m_tools = [{"name": "f", "input_schema": {"type": "object"}}]

    def use(**kw: Any) -> dict:
        return {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}, **kw}]}

    def result(**kw: Any) -> dict:
        return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r", **kw}]}

    attempts: List[Tuple[str, str, Any]] = [
        ("r model", RESP, _resp_body(model=u)),
        ("r input", RESP, _resp_body(input=u)),
        ("r input[0].role", RESP, _resp_body(input=[{"role": u, "content": "hi"}])),
        ("r input[0].type dict", RESP, _resp_body(input=[{"type": u, "role": "user", "content": "hi"}])),
        ("r input[0].type list", RESP, _resp_body(input=[{"type": ul, "role": "user", "content": "hi"}])),
        ("r content[0].type", RESP, _resp_body(input=[{"role": "user", "content": [{"type": u, "text": "x"}]}])),
        ("r function_call.call_id", RESP, _resp_body(input=[call(call_id=u), out()], tools=fn_tools)),
        ("r function_call.name", RESP, _resp_body(input=[call(name=ul), out()], tools=fn_tools)),
        ("r function_call_output.call_id", RESP, _resp_body(input=[call(), out(call_id=u)], tools=fn_tools)),
        ("r tools[0].type", RESP, _resp_body(tools=[{"type": u, "name": "f"}])),
        ("r tools[0].name", RESP, _resp_body(tools=[{"type": "function", "name": u}])),
        ("r tool_choice list", RESP, _resp_body(tools=fn_tools, tool_choice=ul)),
        ("r tool_choice.type", RESP, _resp_body(tools=fn_tools, tool_choice={"type": u, "name": "f"})),
        ("r tool_choice.name", RESP, _resp_body(tools=fn_tools, tool_choice={"type": "function", "name": u})),
        ("r tool_choice mcp server_label", RESP, _resp_body(tool_choice={"type": "mcp", "server_label": ul,
                                                                          "name": "x"})),
        ("r mcp server_label", RESP, _resp_body(tools=[{"type": "mcp", "server_label": u}])),
        ("r mcp allowed_tools", RESP, _resp_body(tools=[{"type": "mcp", "server_label": "interlace",
                                                         "allowed_tools": [u]}])),
        ("r text.format.type", RESP, _resp_body(text={"format": {"type": u}})),
        ("r include", RESP, _resp_body(include=[u])),
        ("r previous_response_id", RESP, _resp_body(previous_response_id=u)),
        ("r metadata value", RESP, _resp_body(metadata={"k": u})),
        ("r interlace.server_tools", RESP, _resp_body(interlace={"server_tools": [u]})),
        ("r reasoning", RESP, _resp_body(reasoning={"effort": u})),
        ("m model", MSGS, _msg_body(model=ul)),
        ("m messages[0].role", MSGS, _msg_body(messages=[{"role": u, "content": "hi"}])),
        ("m messages[0].role list", MSGS, _msg_body(messages=[{"role": ul, "content": [
            {"type": "text", "text": "x"}]}])),
        ("m block type", MSGS, _msg_body(messages=[{"role": "user", "content": [{"type": ul, "text": "x"}]}])),
        ("m tool_use.id", MSGS, _msg_body(messages=[{"role": "user", "content": "go"}, use(id=u), result()],
                                          tools=m_tools)),
        ("m tool_use.name", MSGS, _msg_body(messages=[{"role": "user", "content": "go"}, use(name=ul), result()],
                                            tools=m_tools)),
        ("m tool_result.tool_use_id", MSGS, _msg_body(messages=[{"role": "user", "content": "go"}, use(),
                                                                result(tool_use_id=u)], tools=m_tools)),
        ("m tools[0].name", MSGS, _msg_body(tools=[{"name": u, "input_schema": {"type": "object"}}])),
        ("m tools[0].type", MSGS, _msg_body(tools=[{"type": u, "name": "f", "input_schema": {"type": "object"}}])),
        ("m tool_choice list", MSGS, _msg_body(tools=m_tools, tool_choice=ul)),
        ("m tool_choice.type", MSGS, _msg_body(tools=m_tools, tool_choice={"type": u})),
        ("m tool_choice.name", MSGS, _msg_body(tools=m_tools, tool_choice={"type": "tool", "name": u})),
        ("m stop_sequences", MSGS, _msg_body(stop_sequences=[u])),
        ("m system", MSGS, _msg_body(system=u)),
        ("m thinking.type", MSGS, _msg_body(thinking={"type": u})),
        ("m metadata.user_id", MSGS, _msg_body(metadata={"user_id": u})),
        ("m interlace.replay", MSGS, _msg_body(interlace={"replay": u})),
        ("m output_config.format.type", MSGS, _msg_body(output_config={"format": {"type": u, "schema": {}}})),
        ("count_tokens role", MSGS + "/count_tokens", {"model": MODEL, "messages": [{"role": u, "content": "x"}]}),
        ("count_tokens model", MSGS + "/count_tokens", {"model": u, "messages": [{"role": "user", "content": "x"}]}),
    ]
    res.sent = (f"{len(attempts)} requests with a dict/list where a name is looked up (role, type, tool names, "
                "tool_choice, call_id, tool_use_id, server_label, model ...)")
    res.expected = "each a 400 (404 for an unknown model) in the API's error shape, never 5xx"
    ctx.begin()
    bad, lines = _send_all(ctx, attempts)
    not_4xx = [ln for ln in lines if not ln.split(": ", 1)[1][:1] == "4"]
    res.got = f"{len(lines) - len(bad) - len(not_4xx)}/{len(lines)} 4xx in shape" + \
        (f"; wrong: {bad + not_4xx}" if bad or not_4xx else "")
    res.details["answers"] = lines
    res.verdict_ok = not bad and not not_4xx


def case_api_bad_strings(ctx: Ctx, res: Result) -> None:
    fn_tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    m_tools = lambda s="f", d="d": [{"name": s, "description": d, "input_schema": {"type": "object"}}]  # noqa: E731
    fields: List[Tuple[str, str, Callable[[str], Any]]] = [
        ("r model", RESP, lambda s: _resp_body(model=s)),
        ("r input", RESP, lambda s: _resp_body(input=s)),
        ("r instructions", RESP, lambda s: _resp_body(instructions=s)),
        ("r message text part", RESP, lambda s: _resp_body(input=[{"role": "user", "content": [
            {"type": "input_text", "text": s}]}])),
        ("r assistant output_text", RESP, lambda s: _resp_body(input=[
            {"role": "assistant", "content": [{"type": "output_text", "text": s}]}, {"role": "user", "content": "x"}])),
        ("r function_call.call_id", RESP, lambda s: _resp_body(tools=fn_tools, input=[
            {"type": "function_call", "call_id": s, "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": s, "output": "r"}])),
        ("r function_call.name", RESP, lambda s: _resp_body(tools=fn_tools, input=[
            {"type": "function_call", "call_id": "c", "name": s, "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "r"}])),
        ("r function_call.arguments", RESP, lambda s: _resp_body(tools=fn_tools, input=[
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": json.dumps({"a": s})},
            {"type": "function_call_output", "call_id": "c", "output": "r"}])),
        ("r function_call_output.output", RESP, lambda s: _resp_body(tools=fn_tools, input=[
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": s}])),
        ("r tools[0].name", RESP, lambda s: _resp_body(tools=[{"type": "function", "name": s}])),
        ("r tools[0].description", RESP, lambda s: _resp_body(tools=[{"type": "function", "name": "f",
                                                                        "description": s}])),
        ("r tool_choice.name", RESP, lambda s: _resp_body(tools=fn_tools, tool_choice={"type": "function",
                                                                                        "name": s})),
        ("r mcp server_label", RESP, lambda s: _resp_body(tools=[{"type": "mcp", "server_label": s}])),
        ("r text.format.name", RESP, lambda s: _resp_body(text={"format": {"type": "json_schema", "name": s,
                                                                             "schema": {"type": "object"}}})),
        ("r metadata value", RESP, lambda s: _resp_body(metadata={"k": s})),
        ("r metadata key", RESP, lambda s: _resp_body(metadata={s: "v"})),
        ("r user", RESP, lambda s: _resp_body(user=s)),
        ("r prompt_cache_key", RESP, lambda s: _resp_body(prompt_cache_key=s)),
        ("r safety_identifier", RESP, lambda s: _resp_body(safety_identifier=s)),
        ("r include[0]", RESP, lambda s: _resp_body(include=[s])),
        ("r previous_response_id", RESP, lambda s: _resp_body(previous_response_id=s)),
        ("m model", MSGS, lambda s: _msg_body(model=s)),
        ("m system", MSGS, lambda s: _msg_body(system=s)),
        ("m system block", MSGS, lambda s: _msg_body(system=[{"type": "text", "text": s}])),
        ("m content string", MSGS, lambda s: _msg_body(messages=[{"role": "user", "content": s}])),
        ("m text block", MSGS, lambda s: _msg_body(messages=[{"role": "user", "content": [
            {"type": "text", "text": s}]}])),
        ("m tool name", MSGS, lambda s: _msg_body(tools=m_tools(s=s))),
        ("m tool description", MSGS, lambda s: _msg_body(tools=m_tools(d=s))),
        ("m tool_use.id + tool_result.tool_use_id", MSGS, lambda s: _msg_body(tools=m_tools(), messages=[
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": s, "name": "f", "input": {"a": s}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": s, "content": s}]}])),
        ("m tool_choice.name", MSGS, lambda s: _msg_body(tools=m_tools(), tool_choice={"type": "tool", "name": s})),
        ("m stop_sequences", MSGS, lambda s: _msg_body(stop_sequences=[s])),
        ("m metadata.user_id", MSGS, lambda s: _msg_body(metadata={"user_id": s})),
        ("count_tokens system", MSGS + "/count_tokens", lambda s: {"model": MODEL, "system": s,
                                                                   "messages": [{"role": "user", "content": s}]}),
    ]
    attempts = []
    for label, path, make in fields:
        attempts.append((f"{label} NUL", path, json.dumps(make("a\x00b")).encode()))
        attempts.append((f"{label} surrogate", path, json.dumps(make("a\ud800b")).encode()))  # escaped: "\ud800"
    res.sent = (f"{len(fields)} string fields of both APIs, each once with a NUL and once with a lone surrogate "
                f"(\\ud800) ({len(attempts)} requests)")
    res.expected = "surrogate: 400 in the API's shape; NUL: 200 or 4xx; never 5xx"
    ctx.begin()
    bad, lines = _send_all(ctx, attempts)
    sur_ok = [ln for ln in lines if " surrogate: " in ln and not ln.split(": ", 1)[1].startswith("400")]
    statuses: Dict[str, int] = {}
    for ln in lines:
        k = ln.split(": ", 1)[1][:3]
        statuses[k] = statuses.get(k, 0) + 1
    res.got = f"statuses {statuses}" + (f"; wrong: {bad}" if bad else "") + \
        (f"; surrogate not 400: {sur_ok}" if sur_ok else "")
    res.details["answers"] = lines
    res.verdict_ok = not bad and not sur_ok


def case_api_huge_tool_schema(ctx: Ctx, res: Result) -> None:
    res.freeze_case = True
    props = {f"p{i}": {"type": "string", "description": "d" * 20} for i in range(5000)}
    big = {"type": "object", "properties": props, "required": list(props)}
    many = [{"type": "function", "name": f"f{i}", "parameters": {"type": "object", "properties": {
        f"p{j}": {"type": "integer"} for j in range(50)}}} for i in range(400)]
    attempts = [
        ("responses 5,000 properties", RESP, _resp_body(tools=[{"type": "function", "name": "f",
                                                                 "parameters": big}])),
        ("responses 400 tools x 50 properties", RESP, _resp_body(tools=many)),
        ("responses text.format 5,000 properties", RESP, _resp_body(text={"format": {
            "type": "json_schema", "name": "x", "schema": big}})),
        ("messages 5,000 properties", MSGS, _msg_body(tools=[{"name": "f", "input_schema": big}])),
        ("messages 400 tools x 50", MSGS, _msg_body(tools=[{"name": t["name"], "input_schema": t["parameters"]}
                                                           for t in many])),
        ("count_tokens 5,000 properties", MSGS + "/count_tokens", {
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"name": "f", "input_schema": big}]}),
    ]
    res.sizes = f"{len(json.dumps(big)) // 1000} KB schema; {len(json.dumps(many)) // 1000} KB of tools"
    res.sent = "function tools / input_schema / text.format with 5,000 properties; 400 tools of 50 properties each"
    res.expected = "400 (schema too large / context) or 200, the API's shape, /health < 1 s"
    ctx.begin()
    bad, lines = _send_all(ctx, attempts, timeout=180)
    res.got = "; ".join(lines) + (f"; wrong: {bad}" if bad else "")
    res.verdict_ok = not bad


def case_resp_chain30(ctx: Ctx, res: Result) -> None:
    res.freeze_case = True
    n = 30
    res.sizes = f"{n} follow-ups"
    res.sent = (f"a stored response and {n} follow-ups, each with previous_response_id of the one before "
                "(a 300-char user turn, a forced 12-word reply)")
    res.expected = ("every follow-up 200 with cached_tokens > 0; the last follow-ups no slower than 3x the first "
                    "+ 2 s; store file < 20 MB; /health < 1 s")
    reply = "Noted, I will remember that detail for the rest of our chat."
    prev, times, cached, statuses = None, [], [], []
    ctx.begin()
    for i in range(n + 1):
        body = _resp_body(input=f"Turn {i}: " + ("remember the number %d. " % i) * 12, max_output_tokens=64,
                          interlace={"replay": reply})
        if prev:
            body["previous_response_id"] = prev
        r, dt = ctx.post(RESP, body, key="attacker", timeout=180)
        statuses.append(r.status_code)
        if r.status_code != 200:
            res.got = f"turn {i}: {_brief(r)}"
            break
        j = r.json()
        prev = j["id"]
        times.append(dt)
        cached.append(((j.get("usage") or {}).get("input_tokens_details") or {}).get("cached_tokens", 0))
    path = _store_path(ctx)
    size = sum(p.stat().st_size for p in path.parent.glob(path.name + "*")) if path.parent.exists() else -1
    last = ctx.get(f"{RESP}/{prev}", key="attacker")[0] if prev else None
    if len(times) == n + 1:
        first5, last5 = sorted(times[1:6])[2], sorted(times[-5:])[2]
        hits = sum(1 for c in cached[1:] if c > 0)
        res.got = (f"{n + 1}/{n + 1} answered; median of follow-ups 1-5 {first5:.2f}s, of the last 5 {last5:.2f}s; "
                   f"cached_tokens > 0 on {hits}/{n} follow-ups (last: {cached[-1]} of the prompt); store file "
                   f"{size / 1e3:.0f} KB; GET of the last: {last.status_code if last is not None else '-'}")
        res.verdict_ok = (hits == n and last5 <= 3 * first5 + 2 and 0 < size < 20e6
                          and last is not None and last.status_code == 200)
    res.details.update(times_s=[round(t, 2) for t in times], cached_tokens=cached, store_bytes=size)


def case_resp_cross_key(ctx: Ctx, res: Result) -> None:
    secret = f"ADVSECRET-{secrets.token_hex(8)}"
    res.sent = ("key 'victim' stores a response and starts a background one (its input holds a secret); key "
                "'attacker' uses their ids: previous_response_id, GET, DELETE, cancel, input_items")
    res.expected = "404 response_not_found each (as an unknown id), the secret in no answer; victim's still there"
    r1, _ = ctx.post(RESP, _resp_body(input=f"My password is {secret}."), key="victim")
    r2, _ = ctx.post(RESP, _resp_body(input=f"Again {secret}, write a long story.", max_output_tokens=200,
                                      background=True), key="victim")
    if r1.status_code != 200 or r2.status_code != 200:
        res.got = f"victim: {_brief(r1)}, background {_brief(r2)}"
        return
    ids = [r1.json()["id"], r2.json()["id"]]
    ctx.begin()
    answers: List[str] = []
    leaked, wrong = False, []
    unknown = f"resp_{secrets.token_hex(16)}"
    for rid in ids + [unknown]:
        tries = [("previous_response_id", lambda: ctx.post(RESP, _resp_body(previous_response_id=rid),
                                                           key="attacker")[0]),
                 ("GET", lambda: ctx.get(f"{RESP}/{rid}", key="attacker")[0]),
                 ("input_items", lambda: ctx.get(f"{RESP}/{rid}/input_items", key="attacker")[0]),
                 ("cancel", lambda: ctx.post(f"{RESP}/{rid}/cancel", {}, key="attacker")[0]),
                 ("DELETE", lambda: httpx.delete(f"{ctx.url}{RESP}/{rid}", headers=ctx.headers("attacker"),
                                                 timeout=60))]
        for what, do in tries:
            r = do()
            leaked |= secret in r.text
            if r.status_code != 404 or not _shape_ok(r, "openai"):
                wrong.append(f"{'unknown' if rid == unknown else rid[:12]} {what}: {_brief(r)}")
            if rid != unknown:
                answers.append(f"{what} {r.status_code}")
    g1, _ = ctx.get(f"{RESP}/{ids[0]}", key="victim")
    c2, _ = ctx.post(f"{RESP}/{ids[1]}/cancel", {}, key="victim")
    d2 = httpx.delete(f"{ctx.url}{RESP}/{ids[1]}", headers=ctx.headers("victim"), timeout=60)
    still = g1.status_code == 200 and secret in json.dumps(ctx.get(f"{RESP}/{ids[0]}/input_items",
                                                                   key="victim")[0].json())
    res.got = (f"attacker on the victim's 2 ids: {sorted(set(answers))}; secret in an answer: {leaked}; "
               f"victim's GET after: {g1.status_code} (input_items intact: {still}); victim's cancel "
               f"{c2.status_code} {c2.json().get('status') if c2.status_code == 200 else ''}, delete "
               f"{d2.status_code}" + (f"; wrong: {wrong}" if wrong else ""))
    res.verdict_ok = not wrong and not leaked and still and c2.status_code == 200 and d2.status_code == 200


BG_LIMIT = 4  # configs/adversarial.yaml: key 'victim' max_concurrent_requests


def _background(ctx: Ctx, key: str, tokens: int = 400) -> httpx.Response:
    return ctx.post(RESP, _resp_body(input="Write a very long story about a dragon and a knight.",
                                     max_output_tokens=tokens, temperature=0, background=True), key=key)[0]


def case_resp_background_limit(ctx: Ctx, res: Result) -> None:
    n = 3 * BG_LIMIT
    res.sent = (f"key 'victim' (max_concurrent_requests {BG_LIMIT}) starts {n} background responses "
                "(400 tokens each); cancels half of those accepted and deletes the others while they run")
    res.expected = (f"{BG_LIMIT} queued, the rest 429 rate_limit_exceeded; after cancel/delete: none in flight "
                    "(a new one accepted), deleted ones 404, no engine context left but retained ones")
    m0 = _metrics(ctx)
    ctx.begin()
    got: List[httpx.Response] = [_background(ctx, "victim") for _ in range(n)]
    ok_ids = [r.json()["id"] for r in got if r.status_code == 200]
    refused = [r for r in got if r.status_code != 200]
    refused_ok = all(r.status_code == 429 and _shape_ok(r, "openai") for r in refused)
    time.sleep(2)
    inflight = _metrics(ctx)["interlace_key_requests_in_flight"]
    half = len(ok_ids) // 2
    cancels = [ctx.post(f"{RESP}/{rid}/cancel", {}, key="victim")[0] for rid in ok_ids[:half]]
    deletes = [httpx.delete(f"{ctx.url}{RESP}/{rid}", headers=ctx.headers("victim"), timeout=60)
               for rid in ok_ids[half:]]
    cancel_status = [c.json().get("status") if c.status_code == 200 else c.status_code for c in cancels]
    gone = [ctx.get(f"{RESP}/{rid}", key="victim")[0].status_code for rid in ok_ids[half:]]
    time.sleep(3)
    m1 = _metrics(ctx)
    again = _background(ctx, "victim", tokens=4)
    again_ok = again.status_code == 200
    if again_ok:
        rid = again.json()["id"]
        for _ in range(120):
            st = ctx.get(f"{RESP}/{rid}", key="victim")[0].json().get("status")
            if st not in ("queued", "in_progress"):
                break
            time.sleep(1)
        httpx.delete(f"{ctx.url}{RESP}/{rid}", headers=ctx.headers("victim"), timeout=60)
    leaked = (m1["interlace_replica_contexts"] - m1["interlace_retention_contexts"]) - \
        (m0["interlace_replica_contexts"] - m0["interlace_retention_contexts"])
    res.got = (f"accepted {len(ok_ids)}, refused {[_brief(r)[:60] for r in refused[:1]]} x{len(refused)} "
               f"(in flight then: {inflight:.0f}); cancel -> {cancel_status}; delete -> "
               f"{[d.status_code for d in deletes]}, GET after -> {gone}; after: in flight "
               f"{m1['interlace_key_requests_in_flight']:.0f}, contexts {m1['interlace_replica_contexts']:.0f} "
               f"(retained {m1['interlace_retention_contexts']:.0f}; before {m0['interlace_replica_contexts']:.0f}/"
               f"{m0['interlace_retention_contexts']:.0f}); a new one: {again.status_code}")
    res.verdict_ok = (len(ok_ids) == BG_LIMIT and refused_ok and len(refused) == n - BG_LIMIT
                      and all(s == "cancelled" for s in cancel_status)
                      and all(d.status_code == 200 for d in deletes) and all(g == 404 for g in gone)
                      and m1["interlace_key_requests_in_flight"] == 0 and leaked <= 0 and again_ok)


def case_resp_delete_running(ctx: Ctx, res: Result) -> None:
    res.sent = "key 'victim' starts a background response (400 tokens), DELETEs it while in_progress, then GETs it"
    res.expected = "DELETE 200 at once-ish (< 30 s), then GET 404; the run stopped (nothing in flight, no context)"
    m0 = _metrics(ctx)
    ctx.begin()
    r = _background(ctx, "victim")
    if r.status_code != 200:
        res.got = f"start: {_brief(r)}"
        return
    rid = r.json()["id"]
    st = None
    for _ in range(120):
        st = ctx.get(f"{RESP}/{rid}", key="victim")[0].json().get("status")
        if st == "in_progress":
            break
        time.sleep(0.25)
    time.sleep(1)
    t0 = time.monotonic()
    d = httpx.delete(f"{ctx.url}{RESP}/{rid}", headers=ctx.headers("victim"), timeout=60)
    ddt = time.monotonic() - t0
    g, _ = ctx.get(f"{RESP}/{rid}", key="victim")
    time.sleep(3)
    g2, _ = ctx.get(f"{RESP}/{rid}", key="victim")  # the cancelled run must not store itself back
    m1 = _metrics(ctx)
    leaked = (m1["interlace_replica_contexts"] - m1["interlace_retention_contexts"]) - \
        (m0["interlace_replica_contexts"] - m0["interlace_retention_contexts"])
    res.got = (f"status before: {st}; DELETE {d.status_code} after {ddt:.1f}s; GET {g.status_code}, 3 s later "
               f"{g2.status_code}; in flight after {m1['interlace_key_requests_in_flight']:.0f}; contexts not "
               f"retained, vs before: {leaked:+.0f}")
    res.verdict_ok = (d.status_code == 200 and ddt < 30 and g.status_code == 404 and g2.status_code == 404
                      and m1["interlace_key_requests_in_flight"] == 0 and leaked <= 0)


def case_api_disconnect_stream(ctx: Ctx, res: Result) -> None:
    n = 50
    res.sizes = f"{n} streams"
    res.sent = (f"{n} streams (alternately /v1/responses with store and /v1/messages, max 300 tokens), each "
                "closed by the client after its first text delta")
    res.expected = ("every stream started (200); afterwards no engine context but retained ones, KV blocks back "
                    "to the level before, nothing in flight")
    m0 = _metrics(ctx)
    ctx.begin()
    started, deltas = 0, 0
    for i in range(n):
        path = RESP if i % 2 == 0 else MSGS
        body = (_resp_body(input="Write a long story about a dragon.", max_output_tokens=300, stream=True)
                if path == RESP else _msg_body(max_tokens=300, stream=True, messages=[
                    {"role": "user", "content": "Write a long story about a dragon."}]))
        with httpx.stream("POST", ctx.url + path, json=body, headers=ctx.headers("attacker"), timeout=120) as r:
            if r.status_code == 200:
                started += 1
                for line in r.iter_lines():
                    if "output_text.delta" in line or "text_delta" in line:
                        deltas += 1
                        break
        # leaving the with-block closes the connection mid-stream
    time.sleep(5)
    m1 = _metrics(ctx)
    leaked = (m1["interlace_replica_contexts"] - m1["interlace_retention_contexts"]) - \
        (m0["interlace_replica_contexts"] - m0["interlace_retention_contexts"])
    res.got = (f"{started}/{n} started, {deltas} cut after a text delta; before: contexts "
               f"{m0['interlace_replica_contexts']:.0f} (retained {m0['interlace_retention_contexts']:.0f}), KV blocks "
               f"{m0['interlace_replica_kv_blocks_in_use']:.0f}; after: contexts "
               f"{m1['interlace_replica_contexts']:.0f} (retained {m1['interlace_retention_contexts']:.0f}), KV blocks "
               f"{m1['interlace_replica_kv_blocks_in_use']:.0f}, "
               f"in flight {m1['interlace_key_requests_in_flight']:.0f}")
    res.details.update(before=m0, after=m1)
    res.verdict_ok = started == n and leaked <= 0 and m1["interlace_key_requests_in_flight"] == 0


_LOCKER = """
import sqlite3, sys
c = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
c.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.readline()
c.execute("ROLLBACK")
c.close()
print("released", flush=True)
"""


def case_resp_store_locked(ctx: Ctx, res: Result) -> None:
    res.freeze_case = True
    res.sent = ("another process holds BEGIN EXCLUSIVE on the response store's SQLite file; meanwhile POST "
                "/v1/responses (stored, and background), GET of a stored one, POST /v1/messages; then it releases")
    res.expected = ("stored POSTs 503 in OpenAI's shape (no id handed out), GET and Messages unaffected or 503, "
                    "/health < 1 s; the same POST 200 after the release")
    pre, _ = ctx.post(RESP, _resp_body(), key="attacker")  # creates the file, and one to GET
    path = _store_path(ctx)
    if pre.status_code != 200 or not path.exists():
        res.got = f"setup: {_brief(pre)}; store file {path} exists: {path.exists()}"
        return
    pid = pre.json()["id"]
    locker = subprocess.Popen([sys.executable, "-c", _LOCKER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        line = locker.stdout.readline().strip()
        if line != "locked":
            res.got = f"the locker did not lock: {line!r}"
            return
        ctx.begin()
        body = _resp_body(input="hello while locked")
        p, pdt = ctx.post(RESP, body, key="attacker")
        b, _ = ctx.post(RESP, _resp_body(background=True), key="attacker")
        g, _ = ctx.get(f"{RESP}/{pid}", key="attacker")
        m, _ = ctx.post(MSGS, _msg_body(), key="attacker")
        ns, _ = ctx.post(RESP, _resp_body(store=False), key="attacker")
    finally:
        locker.stdin.write("\n")
        locker.stdin.flush()
        locker.wait(timeout=30)
    p2, _ = ctx.post(RESP, body, key="attacker")
    stored2 = p2.status_code == 200 and ctx.get(f"{RESP}/{p2.json()['id']}", key="attacker")[0].status_code == 200
    res.got = (f"locked: POST {_brief(p)} after {pdt:.1f}s; background {_brief(b)}; GET {g.status_code}; "
               f"messages {m.status_code}; store:false {ns.status_code}; released: POST {p2.status_code}, "
               f"GET of it {'200' if stored2 else 'not found'}")
    res.verdict_ok = (p.status_code == 503 and _shape_ok(p, "openai") and b.status_code == 503
                      and _shape_ok(b, "openai") and g.status_code in (200, 503) and m.status_code == 200
                      and ns.status_code == 200 and stored2)


def case_msg_count_tokens_big(ctx: Ctx, res: Result) -> None:
    res.freeze_case = True
    chunk = "hello world, " * 80
    make = lambda n: {"model": MODEL, "messages": [  # noqa: E731
        {"role": "user", "content": [{"type": "text", "text": chunk}] * n}]}
    raw, n = _near_limit(make, MAX_BODY)
    one = {"model": MODEL, "messages": [{"role": "user", "content": ("hello world, " * 400_000)[:MAX_BODY - 200]}]}
    raw1 = json.dumps(one).encode()
    res.sizes = f"{n} blocks ({len(raw)} B); one {len(raw1)} B string"
    res.sent = "POST /v1/messages/count_tokens with a body of max_request_bytes (1 KB text blocks; one 4 MB string)"
    res.expected = "200 with input_tokens (or 4xx in Anthropic's shape), /health < 1 s"
    ctx.begin()
    got, ok = [], True
    for label, body in (("blocks", raw), ("one string", raw1)):
        r, dt = ctx.post(MSGS + "/count_tokens", raw=body, key="attacker", timeout=300)
        ok &= r.status_code == 200 or (400 <= r.status_code < 500 and _shape_ok(r, "anthropic"))
        got.append(f"{label}: {r.status_code} "
                   f"{r.json().get('input_tokens') if r.status_code == 200 else _brief(r)} ({dt:.1f}s)")
    res.got = "; ".join(got)
    res.verdict_ok = ok


def case_msg_tool_turns(ctx: Ctx, res: Result) -> None:
    res.freeze_case = True
    n = 2000
    msgs: List[dict] = [{"role": "user", "content": "start"}]
    for i in range(n):
        msgs.append({"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i}", "name": "f",
                                                       "input": {"i": i}}]})
        msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                                  "content": "ok"}]})
    tools = [{"name": "f", "input_schema": {"type": "object", "properties": {"i": {"type": "integer"}}}}]
    body = _msg_body(messages=msgs, tools=tools)
    res.sizes = f"{n} tool_use/tool_result pairs ({len(json.dumps(body)) // 1000} KB)"
    res.sent = f"POST /v1/messages (and count_tokens) with {n} alternating tool_use / tool_result turns"
    res.expected = "messages: 400 context_length_exceeded (Anthropic's shape) or 200; count_tokens 200; /health < 1 s"
    ctx.begin()
    r, dt = ctx.post(MSGS, body, key="attacker", timeout=300)
    c, cdt = ctx.post(MSGS + "/count_tokens", {"model": MODEL, "messages": msgs, "tools": tools}, key="attacker",
                      timeout=300)
    res.got = (f"messages: {_brief(r)} ({dt:.1f}s); count_tokens: {c.status_code} "
               f"{c.json().get('input_tokens') if c.status_code == 200 else _brief(c)} ({cdt:.1f}s)")
    res.verdict_ok = (r.status_code == 200 or (r.status_code == 400 and _shape_ok(r, "anthropic"))) and \
        c.status_code == 200


def case_msg_error_shape(ctx: Ctx, res: Result) -> None:
    key = ctx.keys["attacker"]
    h = {"x-api-key": key, "content-type": "application/json", "anthropic-version": "2023-06-01"}
    good = json.dumps(_msg_body()).encode()
    long_prompt = json.dumps(_msg_body(messages=[{"role": "user", "content": "word " * 20_000}])).encode()
    tries: List[Tuple[str, str, str, Dict[str, str], bytes]] = [
        ("no key", "POST", MSGS, {"content-type": "application/json"}, good),
        ("wrong x-api-key", "POST", MSGS, {**h, "x-api-key": "nope"}, good),
        ("wrong bearer", "POST", MSGS, {"content-type": "application/json", "authorization": "Bearer nope"}, good),
        ("count_tokens no key", "POST", MSGS + "/count_tokens", {"content-type": "application/json"}, good),
        ("GET /v1/messages", "GET", MSGS, h, b""),
        ("unknown path", "POST", MSGS + "/nope", h, good),
        ("text/plain", "POST", MSGS, {**h, "content-type": "text/plain"}, good),
        ("invalid JSON", "POST", MSGS, h, b"{\"model\": "),
        ("not an object", "POST", MSGS, h, b"[]"),
        ("unknown field", "POST", MSGS, h, json.dumps(_msg_body(foo=1)).encode()),
        ("missing max_tokens", "POST", MSGS, h, json.dumps({"model": MODEL, "messages": [
            {"role": "user", "content": "hi"}]}).encode()),
        ("max_tokens 0", "POST", MSGS, h, json.dumps(_msg_body(max_tokens=0)).encode()),
        ("unknown model", "POST", MSGS, h, json.dumps(_msg_body(model="nope")).encode()),
        ("image block", "POST", MSGS, h, json.dumps(_msg_body(messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}])).encode()),
        ("final assistant turn", "POST", MSGS, h, json.dumps(_msg_body(messages=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "pre"}])).encode()),
        ("orphan tool_result", "POST", MSGS, h, json.dumps(_msg_body(messages=[{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "x", "content": "r"}]}])).encode()),
        ("context too long", "POST", MSGS, h, long_prompt),
        ("body too large", "POST", MSGS, h, b" " * (MAX_BODY + 10)),
        ("server tool asked", "POST", MSGS, h, json.dumps(_msg_body(interlace={"server_tools": ["python"]})).encode()),
        ("count_tokens max_tokens", "POST", MSGS + "/count_tokens", h, good),
        ("stream + error", "POST", MSGS, h, json.dumps(_msg_body(stream=True, temperature=2)).encode()),
    ]
    res.sent = f"{len(tries)} refusals on /v1/messages paths (auth, method, path, body, fields, limits)"
    res.expected = "each 4xx {\"type\": \"error\", \"error\": {\"type\", \"message\"}}, never OpenAI's shape or text"
    ctx.begin()
    wrong, lines = [], []
    for label, method, path, hdrs, data in tries:
        r = httpx.request(method, ctx.url + path, headers=hdrs, content=data or None, timeout=120)
        fine = 400 <= r.status_code < 500 and _shape_ok(r, "anthropic") and "param" not in r.json().get("error", {})
        et = r.json().get("error", {}).get("type") if fine else None
        lines.append(f"{label}: {r.status_code} {et}")
        if not fine:
            wrong.append(f"{label}: {r.status_code} {r.headers.get('content-type')} {r.text[:100]!r}")
    res.got = f"{len(tries) - len(wrong)}/{len(tries)} in Anthropic's shape: " + ", ".join(lines) + \
        (f"; wrong: {wrong}" if wrong else "")
    res.verdict_ok = not wrong


def case_msg_auth(ctx: Ctx, res: Result) -> None:
    key = ctx.keys["attacker"]
    good = _msg_body()
    cases = [("x-api-key right", {"x-api-key": key}, 200),
             ("x-api-key wrong", {"x-api-key": key + "x"}, 401),
             ("x-api-key upper-cased", {"x-api-key": key.upper()}, 401),
             ("bearer right", {"authorization": f"Bearer {key}"}, 200),
             ("bearer wrong", {"authorization": "Bearer " + key + "x"}, 401),
             ("bearer wrong + x-api-key right", {"authorization": "Bearer nope", "x-api-key": key}, 401),
             ("x-api-key on /v1/responses", {"x-api-key": key}, 200)]
    res.sent = "x-api-key and Authorization: Bearer, right and wrong, alone and together (Messages; Responses)"
    res.expected = ("right -> 200, wrong -> 401 in the API's shape; a wrong bearer is not rescued by a right "
                    "x-api-key")
    ctx.begin()
    wrong, lines = [], []
    for label, hdrs, want in cases:
        path = RESP if "responses" in label else MSGS
        body = _resp_body() if path == RESP else good
        r = httpx.post(ctx.url + path, json=body, headers={"content-type": "application/json", **hdrs}, timeout=120)
        lines.append(f"{label}: {r.status_code}")
        if r.status_code != want or (want != 200 and not _shape_ok(r, _dialect(path))):
            wrong.append(f"{label}: {_brief(r)} (want {want})")
    # the "bearer right + x-api-key wrong" pair is reported, not judged: bearer is the primary credential
    r = httpx.post(ctx.url + MSGS, json=good, headers={"authorization": f"Bearer {key}", "x-api-key": "nope"},
                   timeout=120)
    lines.append(f"bearer right + x-api-key wrong (reported only): {r.status_code}")
    res.got = ", ".join(lines) + (f"; wrong: {wrong}" if wrong else "")
    res.verdict_ok = not wrong


# ------------------------------------------------------------------------------------------- the plan
@dataclass
class Case:
    name: str
    issue_no: str
    fn: Callable[[Ctx, Result], None]
    config: str  # "default" | "keyed"
    fresh_before: bool = False  # restart before it
    restart_after: bool = False  # it may degrade or kill the server
    deadline_s: float = 120.0
    nofile_soft: Optional[int] = None


CASES: List[Case] = [
    Case("unknown_tool", "12", case_unknown_tool, "default"),
    Case("options_allow", "12", case_options_allow, "default"),
    Case("pattern_400", "4", case_pattern_400, "default", deadline_s=200),
    Case("bad_content_length", "8", case_bad_content_length, "default"),
    Case("bad_chunked", "8", case_bad_chunked, "default"),
    Case("nul_header", "8", case_nul_header, "default"),
    Case("big_metadata", "3", case_big_metadata, "default"),
    Case("big_schema", "3", case_big_schema, "default", deadline_s=200),
    Case("large_prompt", "3", case_large_prompt, "default"),
    Case("big_batch", "3", case_big_batch, "default"),
    Case("regex_transform", "1", case_regex_transform, "default", deadline_s=300),
    Case("placeholder_amplification", "2", case_placeholder_amplification, "default", restart_after=True,
         deadline_s=180),
    Case("metrics_growth", "6", case_metrics_growth, "default", restart_after=True, deadline_s=600),
    Case("slowloris", "7", case_slowloris, "default", fresh_before=True, restart_after=True, deadline_s=180,
         nofile_soft=SLOW_NOFILE),
    Case("sigterm_drain", "9", case_sigterm_drain, "default", fresh_before=True, restart_after=True,
         deadline_s=240),
    Case("json_field_deep", "5", case_json_field_deep, "keyed"),
    Case("py_setns", "11", case_py_setns, "keyed", deadline_s=480),
    Case("py_unix_socket", "11", case_py_unix_socket, "keyed", deadline_s=480),
    Case("py_environ", "11", case_py_environ, "keyed", deadline_s=480),
    Case("py_mem", "11", case_py_mem, "keyed", deadline_s=480),
    Case("py_fork_memory", "11", case_py_fork_memory, "keyed", deadline_s=480),
    Case("py_fork_many", "11", case_py_fork_many, "keyed", deadline_s=480, restart_after=True),
    Case("sessions_per_key", "10", case_sessions_per_key, "keyed", deadline_s=300),
    Case("fairness", "10", case_fairness, "keyed", deadline_s=700, restart_after=True),
    # issue 33: the Responses and Messages APIs (all with the keyed config)
    Case("api_big_body", "33", case_api_big_body, "keyed", deadline_s=300),
    Case("api_many_items", "33", case_api_many_items, "keyed", deadline_s=300),
    Case("api_deep_nesting", "33", case_api_deep_nesting, "keyed", deadline_s=300),
    Case("api_unhashable", "33", case_api_unhashable, "keyed", deadline_s=300),
    Case("api_bad_strings", "33", case_api_bad_strings, "keyed", deadline_s=400),
    Case("api_huge_tool_schema", "33", case_api_huge_tool_schema, "keyed", deadline_s=300),
    Case("resp_chain30", "33", case_resp_chain30, "keyed", deadline_s=600),
    Case("resp_cross_key", "33", case_resp_cross_key, "keyed", deadline_s=300),
    Case("resp_background_limit", "33", case_resp_background_limit, "keyed", deadline_s=400),
    Case("resp_delete_running", "33", case_resp_delete_running, "keyed", deadline_s=300),
    Case("api_disconnect_stream", "33", case_api_disconnect_stream, "keyed", deadline_s=600),
    Case("resp_store_locked", "33", case_resp_store_locked, "keyed", deadline_s=300),
    Case("msg_count_tokens_big", "33", case_msg_count_tokens_big, "keyed", deadline_s=400),
    Case("msg_tool_turns", "33", case_msg_tool_turns, "keyed", deadline_s=400),
    Case("msg_error_shape", "33", case_msg_error_shape, "keyed", deadline_s=300),
    Case("msg_auth", "33", case_msg_auth, "keyed", deadline_s=300),
]


def machine() -> dict:
    info: Dict[str, Any] = {"cores": os.cpu_count()}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            k, _, v = line.partition(":")
            if k.strip() == "Model name":
                info["model"] = v.strip()
            if k.strip() == "Flags":
                flags = set(v.split())
                info["flags"] = " ".join(f for f in ("avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile")
                                         if f in flags)
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        info["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                        timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        info["dirty_files"] = len(dirty.splitlines())
    except (OSError, subprocess.SubprocessError):
        pass
    info["date"] = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    return info


def _short(s: str, n: int) -> str:
    s = " ".join(s.split())
    return s if len(s) <= n else s[: n - 1] + "…"


def table(results: List[Result]) -> str:
    rows = ["| case | issue | sent | got | expected after the fix | /health max ms | result |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        h = r.health.get("max_ms")
        hs = "-" if h is None else f"{h:.0f}" + (f" ({r.health['failures']} failed)" if r.health.get("failures")
                                                   else "")
        rows.append(f"| {r.case} | {r.details.get('issue', '')} | {_short(r.sent, 110)} | "
                    f"{_short(r.got, 240).replace('|', '/')} | {_short(r.expected, 90)} | {hs} | {r.status} |")
    return "\n".join(rows)


def compare(paths: List[str]) -> str:
    """A markdown table of runs side by side (e.g. before.json after.json): per case what was sent,
    what each run got, its /health max and its verdict."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    labels = ["before", "after"][:len(runs)] if len(runs) <= 2 else [f"run {i + 1}" for i in range(len(runs))]
    order: List[str] = []
    by: List[Dict[str, dict]] = []
    for run in runs:
        by.append({r["case"]: r for r in run["results"]})
        order += [r["case"] for r in run["results"] if r["case"] not in order]
    head = "| case | issue | sent | expected after the fix | " + " | ".join(
        f"{lab}: got | {lab}: /health max ms | {lab}" for lab in labels) + " |"
    rows = [head, "|" + " --- |" * (4 + 3 * len(runs))]
    for name in order:
        first = next(b[name] for b in by if name in b)
        cells = [name, first["details"].get("issue", ""), _short(first["sent"], 110), _short(first["expected"], 90)]
        for b in by:
            r = b.get(name)
            if r is None:
                cells += ["(not run)", "", ""]
                continue
            h = r["health"].get("max_ms")
            hs = "-" if h is None else f"{h:.0f}" + (f" ({r['health']['failures']} failed)"
                                                       if r["health"].get("failures") else "")
            got = r["got"] + (f" [sizes: {r['sizes']}]" if r.get("sizes") else "")
            cells += [_short(got, 260).replace("|", "/"), hs, r["status"]]
        rows.append("| " + " | ".join(cells) + " |")
    meta = [f"- {lab}: {run['run'].get('date')}, {run['run'].get('gateway_source')}, "
            f"{run['run'].get('model')} [{run['run'].get('flags')}], {run['run'].get('cores')} cores, "
            f"quick={run['run'].get('quick')}" for lab, run in zip(labels, runs)]
    return "\n".join(meta) + "\n\n" + "\n".join(rows)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", help="comma-separated case names (default: all)")
    ap.add_argument("--quick", action="store_true", help="smaller sizes where the issue's take minutes")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--compare", nargs="+", metavar="JSON",
                    help="print a markdown table of earlier runs side by side (before.json after.json) and exit")
    ap.add_argument("--at", metavar="REV", help="run the gateway of this commit (git archive into the workdir) "
                    "instead of the working tree: the 'before' column while fixes are in progress")
    ap.add_argument("--workdir", help="where the configs and server logs go (default: a new temp dir)")
    args = ap.parse_args(argv)
    if args.compare:
        print(compare(args.compare))
        return 0
    if args.list:
        for c in CASES:
            print(f"{c.name:28s} issue case {c.issue_no:3s} config {c.config}")
        return 0
    chosen = CASES
    if args.cases:
        names = [n.strip() for n in args.cases.split(",") if n.strip()]
        unknown = [n for n in names if n not in {c.name for c in CASES}]
        if unknown:
            ap.error(f"unknown case(s) {unknown}; --list shows them")
        chosen = [c for c in CASES if c.name in names]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="interlace-adv-"))
    workdir.mkdir(parents=True, exist_ok=True)
    keys = {"attacker": "adv-" + secrets.token_hex(16), "victim": "adv-" + secrets.token_hex(16)}
    marker = "ADVMARKER-" + secrets.token_hex(16)
    env = {"ADV_KEY_ATTACKER": keys["attacker"], "ADV_KEY_VICTIM": keys["victim"], "ADV_MARKER_SECRET": marker,
           "INTERLACE_STATE_DIR": str(workdir / "state")}  # the response store's file, per run (_store_path)
    configs = {"default": DEFAULT_CONFIG, "keyed": KEYED_CONFIG}
    info = machine()
    python, cwd = None, ROOT
    if args.at:
        rev = subprocess.run(["git", "rev-parse", args.at], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.strip()
        python, src, cwd = snapshot_python(rev, workdir)
        if (src / "configs" / "default.yaml").exists():
            configs["default"] = src / "configs" / "default.yaml"
        info["gateway_source"] = f"commit {rev} (git archive; the working tree's configs/adversarial.yaml)"
    else:
        info["gateway_source"] = f"working tree at {info.get('commit')} ({info.get('dirty_files')} modified files)"
    info.update(quick=args.quick, workdir=str(workdir))
    print(f"# adversarial run {info['date']} commit {info.get('commit')} ({info.get('dirty_files')} modified "
          f"tracked files), {info.get('model')} [{info.get('flags')}], {info['cores']} cores, "
          f"quick={args.quick}; gateway: {info['gateway_source']}; logs in {workdir}", flush=True)

    def on_term(signum, frame):  # noqa: ARG001 - signal handler signature
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in the background
    results: List[Result] = []
    server: Optional[Server] = None
    probe: Optional[Probe] = None

    def stop_server() -> None:
        nonlocal server, probe
        if probe is not None:
            probe.stop_evt.set()
            probe.join(timeout=35)
            probe = None
        if server is not None:
            server.stop()
            server = None

    try:
        for case in chosen:
            res = Result(case=case.name, sent="")
            res.details["issue"] = case.issue_no
            res.details["config"] = str(configs[case.config])
            need_fresh = (server is None or case.fresh_before or server.config != configs[case.config]
                          or server.nofile_soft != case.nofile_soft or not server.healthy())
            if need_fresh:
                stop_server()
                print(f"-- starting interlace serve ({case.config})", flush=True)
                try:
                    server = Server(configs[case.config], workdir, env, case.config, case.nofile_soft, python, cwd)
                    server.start()
                except Exception as e:  # noqa: BLE001 - reported as the case's outcome
                    res.status = "ERROR"
                    res.got = f"server did not start: {_short(str(e), 400)}"
                    if server is not None:
                        server.stop()
                    server = None
                    results.append(res)
                    print(f"[{case.name}] {res.status}: {res.got}", flush=True)
                    continue
                probe = Probe(server)
                probe.start()
            assert server is not None and probe is not None
            ctx = Ctx(server, probe, keys, args.quick, marker, workdir)
            # two quiet seconds first: the machine's own noise on /health
            probe.reset()
            time.sleep(2)
            res.baseline_health_max_ms = probe.stats()["max_ms"]
            probe.reset()
            print(f"[{case.name}] running (deadline {case.deadline_s:.0f}s)", flush=True)
            box: Dict[str, Any] = {}

            def body() -> None:
                try:
                    case.fn(ctx, res)
                except Exception:  # noqa: BLE001 - a case that breaks is reported, the run goes on
                    box["error"] = traceback.format_exc()

            t0 = time.monotonic()
            th = threading.Thread(target=body, daemon=True)
            th.start()
            th.join(timeout=case.deadline_s)
            res.duration_s = round(time.monotonic() - t0, 1)
            probe.settle()
            res.health = probe.stats()
            if th.is_alive():
                res.status = "DEADLINE"
                res.got = (res.got + "; " if res.got else "") + f"no outcome within {case.deadline_s:.0f}s"
            elif "error" in box:
                res.status = "ERROR"
                res.got = (res.got + "; " if res.got else "") + box["error"].strip().splitlines()[-1]
                res.details["traceback"] = box["error"]
            res.judge()
            results.append(res)
            print(f"[{case.name}] {res.status} in {res.duration_s}s: {res.got} | /health max "
                  f"{res.health.get('max_ms')} ms ({res.health.get('failures')} failed; quiet before: "
                  f"{res.baseline_health_max_ms} ms)", flush=True)
            if case.restart_after or th.is_alive() or not server.alive():
                stop_server()
    except KeyboardInterrupt:
        print("interrupted: stopping the server", flush=True)
    finally:
        stop_server()
        _kill_everything()
    print()
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"run": info, "results": [asdict(r) for r in results]}, indent=1))
    return 0 if all(r.status == "PASS" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
