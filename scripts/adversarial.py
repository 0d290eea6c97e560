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
    env = {"ADV_KEY_ATTACKER": keys["attacker"], "ADV_KEY_VICTIM": keys["victim"], "ADV_MARKER_SECRET": marker}
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
