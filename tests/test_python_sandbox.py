"""The python tool's sandbox, attacked: every escape of the adversarial trial (issue 29) runs and must fail.

Each test runs the escape as tool code through the real runtime (bubblewrap,
setpriv, the seccomp filter, a cgroup per call), with this test process as
the "gateway": its pid, its environment secret, its listening sockets.
Where the OS cannot build the sandbox at all (not Linux, no bwrap), the
module is skipped with the reason; on Linux with bwrap installed
(``scripts/setup.sh --test`` installs it as root) every test runs.

The last test does the same from a gateway that is *not* root (uid 65534, no
capabilities): the sandbox then lives in a user namespace, without a cgroup,
with ``RLIMIT_NPROC`` per call; the same escapes must fail there too.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from interlace.gateway.plugin_host import configure_tool
from interlace.gateway.tools.base import Tool, ToolConfigError
from interlace.gateway.tools.call import ToolResult
from interlace.gateway.tools.cgroup import find_root
from interlace.gateway.tools.runtime import ToolRuntime
from interlace.gateway.tools.sandbox import SandboxUnavailable, probe
from interlace.plugins.python_tool import PythonTool

try:
    probe(65534)
    _UNAVAILABLE = None
except SandboxUnavailable as exc:
    _UNAVAILABLE = str(exc)

pytestmark = pytest.mark.skipif(
    _UNAVAILABLE is not None and (not sys.platform.startswith("linux") or os.geteuid() != 0),
    reason=f"the sandbox cannot exist here: {_UNAVAILABLE}",
)

SECRET_VAR, SECRET = "INTERLACE_SANDBOX_TEST_KEY", f"sk-sandbox-{uuid.uuid4().hex}"
MEMORY_MB, MAX_PROCESSES = 400, 24


class Harness:
    def __init__(self, tools: list[Tool]) -> None:
        self.loop = asyncio.new_event_loop()
        self.runtime = ToolRuntime(tools)
        self.loop.run_until_complete(self.runtime.start())

    def run(self, code: str) -> ToolResult:
        return self.loop.run_until_complete(self.runtime.run("python", {"code": code}))

    def close(self) -> None:
        self.loop.run_until_complete(self.runtime.close())
        self.loop.close()


@pytest.fixture(scope="module")
def rt() -> Iterator[Harness]:
    assert _UNAVAILABLE is None, _UNAVAILABLE  # Linux as root: the sandbox must work, not be skipped
    tool = PythonTool()
    configure_tool(tool, {"memory_mb": MEMORY_MB, "max_processes": MAX_PROCESSES, "warm_imports": [],
                          "timeout_s": 30, "cpu_time_s": 10})
    os.environ[SECRET_VAR] = SECRET
    try:
        harness = Harness([tool])
        yield harness
        harness.close()
    finally:
        del os.environ[SECRET_VAR]


def result_of(res: ToolResult) -> Any:
    assert res.ok and res.content["error"] is None, res
    return eval(res.content["result"])  # noqa: S307 - a repr the test's own code built


def sandbox_processes() -> list[int]:
    return [p.pid for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real == 65534]


# --------------------------------------------------------------------------- who it is


def test_unprivileged_uid_no_capabilities_no_new_privs_seccomp(rt: Harness) -> None:
    code = ("import os\nst = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
            "[os.getuid(), os.geteuid(), os.getgid(), os.getgroups(), "
            "{k: st[k].strip() for k in ('CapEff', 'CapPrm', 'CapBnd', 'CapAmb', 'NoNewPrivs', 'Seccomp')}]")
    uid, euid, gid, groups, status = result_of(rt.run(code))
    assert uid == euid == gid == 65534 and set(groups) <= {65534}
    assert status == {"CapEff": "0" * 16, "CapPrm": "0" * 16, "CapBnd": "0" * 16, "CapAmb": "0" * 16,
                      "NoNewPrivs": "1", "Seccomp": "2"}
    # The host's view of a live spare: bubblewrap runs as root, the python inside as the unprivileged uid.
    deadline = time.monotonic() + 30
    while True:  # a spare may be starting (still bwrap or setpriv): wait for a warm one
        rt.loop.run_until_complete(asyncio.sleep(0.05))
        uids = []
        for pid in rt.runtime.worker_pids():
            try:
                tree = psutil.Process(pid).children(recursive=True)
                uids += [(p.uids().real, p.uids().effective) for p in tree if p.name().startswith("python")]
            except psutil.NoSuchProcess:
                continue
        if uids or time.monotonic() > deadline:
            break
    assert uids and set(uids) == {(65534, 65534)}, uids


# --------------------------------------------------------------------------- /proc of the gateway


def test_gateway_proc_files_unreachable(rt: Harness) -> None:
    gateway = os.getpid()
    code = (
        "import os\nout = {}\n"
        f"for pid in ({gateway}, 1):\n"
        "    for name in ('environ', 'mem', 'ns/net', 'cmdline'):\n"
        "        try:\n"
        "            with open(f'/proc/{pid}/{name}', 'rb') as fh:\n"
        "                out[f'{pid}/{name}'] = fh.read(4096)\n"
        "        except OSError as exc:\n"
        "            out[f'{pid}/{name}'] = type(exc).__name__\n"
        "[out, sorted(int(p) for p in os.listdir('/proc') if p.isdigit()), os.getpid()]"
    )
    out, pids, own = result_of(rt.run(code))
    for name in ("environ", "mem", "ns/net", "cmdline"):
        assert out[f"{gateway}/{name}"] in ("FileNotFoundError", "ProcessLookupError"), out
    for name in ("environ", "mem", "ns/net"):  # pid 1 is bubblewrap's init, root in the namespace
        assert out[f"1/{name}"] == "PermissionError", out
    assert set(pids) <= {1, own}  # no other process visible


def test_gateway_secret_nowhere_the_code_can_read(rt: Harness) -> None:
    assert os.environ[SECRET_VAR] == SECRET
    code = (
        # each blob is searched as it is read, not kept: the call's memory is bounded (memory_mb)
        "import os\nleaked, count = False, 0\n"
        "def look(b):\n"
        "    global leaked, count\n"
        f"    leaked = leaked or {SECRET.encode()!r} in b or {SECRET_VAR.encode()!r} in b\n"
        "    count += 1\n"
        "look(repr(dict(os.environ)).encode())\n"
        "for pid in [p for p in os.listdir('/proc') if p.isdigit()] + ['self']:\n"
        "    for name in ('environ', 'cmdline'):\n"
        "        try:\n"
        "            look(open(f'/proc/{pid}/{name}', 'rb').read())\n"
        "        except OSError:\n"
        "            pass\n"
        "for top in ('/etc', '/tmp', os.getcwd()):\n"
        "    for root, dirs, files in os.walk(top):\n"
        "        for f in files:\n"
        "            try:\n"
        "                look(open(os.path.join(root, f), 'rb').read(1 << 20))\n"
        "            except OSError:\n"
        "                pass\n"
        "leaked, count"
    )
    leaked, count = result_of(rt.run(code))
    assert leaked is False and count > 3


# --------------------------------------------------------------------------- namespaces and seccomp


def test_setns_into_gateway_network_namespace_fails(rt: Harness) -> None:
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nout = []\n"
        f"for path in ('/proc/{os.getpid()}/ns/net', '/proc/1/ns/net', '/proc/self/ns/net'):\n"
        "    try:\n"
        "        fd = os.open(path, os.O_RDONLY)\n"
        "    except OSError as exc:\n"
        "        out.append(type(exc).__name__)\n"
        "        continue\n"
        "    out.append(libc.setns(fd, 0x40000000) == 0 or os.strerror(ctypes.get_errno()))\n"
        "out"
    )
    gateway, init, own = result_of(rt.run(code))
    assert gateway == "FileNotFoundError" and init == "PermissionError"
    assert own == os.strerror(1)  # EPERM from the seccomp filter, even on a namespace it may open


def test_unshare_clone_and_mount_are_denied(rt: Harness) -> None:
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "def err(rc):\n    return 0 if rc == 0 else ctypes.get_errno()\n"
        "[err(libc.unshare(0x10000000 | 0x40000000)), err(libc.unshare(0x20000000)), "
        "err(libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)), "  # clone(CLONE_NEWUSER | SIGCHLD)
        "err(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)), err(libc.ptrace(0, 0, 0, 0)), "
        "err(libc.syscall(321, 0, 0, 0))]"  # bpf
    )
    assert result_of(rt.run(code)) == [1, 1, 1, 1, 1, 1]  # EPERM each
    # and a plain fork/subprocess (clone without namespace flags) still works
    assert result_of(rt.run("import subprocess\nsubprocess.run(['true']).returncode")) == 0


def test_gateway_tcp_port_unreachable(rt: Harness) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = ("import socket\ns = socket.socket()\ns.settimeout(3)\n"
                f"try:\n    s.connect(('127.0.0.1', {port}))\n    r = 'connected'\n"
                "except OSError as exc:\n    r = type(exc).__name__\nr")
        assert result_of(rt.run(code)) != "connected"


def test_host_unix_sockets_unreachable(rt: Harness) -> None:
    paths = [os.path.join(tempfile.gettempdir(), f"interlace-test-{uuid.uuid4().hex[:8]}.sock"),
             f"/run/interlace-test-{uuid.uuid4().hex[:8]}.sock"]
    servers = []
    try:
        for path in paths:
            if not os.path.isdir(os.path.dirname(path)):
                continue
            server = socket.socket(socket.AF_UNIX)
            server.bind(path)
            os.chmod(path, 0o777)
            server.listen()
            servers.append(server)
        assert servers
        code = ("import socket\nout = []\n"
                f"for path in {paths!r}:\n"
                "    s = socket.socket(socket.AF_UNIX)\n"
                "    try:\n        s.connect(path)\n        out.append('connected')\n"
                "    except OSError as exc:\n        out.append(type(exc).__name__)\n"
                "out")
        assert "connected" not in result_of(rt.run(code))
    finally:
        for server in servers:
            server.close()
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)


def test_root_is_read_only_and_holds_only_what_python_needs(rt: Harness) -> None:
    code = ("import os\nw = []\n"
            "for d in ('/', '/usr', '/tmp', '/etc', os.path.dirname(os.getcwd())):\n"
            "    try:\n        open(os.path.join(d, 'x'), 'w')\n        w.append(d)\n    except OSError:\n        pass\n"
            "[sorted(os.listdir('/')), w, os.path.exists('/work/main/.git'), os.path.exists('/run'), "
            "os.path.exists('/sys/fs/cgroup'), os.access(os.getcwd(), os.W_OK)]")
    top, writable, git, run, sys_, scratch_ok = result_of(rt.run(code))
    assert writable == [] and scratch_ok
    assert not git and not run and not sys_
    assert "home" not in top and "var" not in top


# --------------------------------------------------------------------------- limits on the whole call


def test_children_together_cannot_exceed_memory_mb(rt: Harness) -> None:
    each = MEMORY_MB * 2 // 5  # 160 MiB each, below memory_mb; five of them are twice it
    code = (
        "import os, time\npids = []\n"
        "for _ in range(5):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        f"        data = b'x' * ({each} << 20)\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "    pids.append(pid)\n"
        "for pid in pids:\n    os.waitpid(pid, 0)\n'survived'"
    )
    result = rt.run(code)
    assert not result.ok and result.error_type == "ToolCrashed", result
    assert result.finished_at - result.started_at < 30  # killed at the OOM, not at the wall time
    assert result_of(rt.run("1 + 1")) == 2  # the gateway and the pool are fine


def test_fork_loop_stops_at_max_processes(rt: Harness) -> None:
    code = (
        "import os, time\nmade, error = 0, None\n"
        "for _ in range(300):\n"
        "    try:\n        pid = os.fork()\n"
        "    except OSError as exc:\n        error = exc.errno\n        break\n"
        "    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n"
        "    made += 1\n"
        "[made, error]"
    )
    made, error = result_of(rt.run(code))
    assert error == 11 and made <= MAX_PROCESSES  # EAGAIN from the cgroup's pids.max
    assert made >= MAX_PROCESSES - 4


def test_nothing_left_after_the_call(rt: Harness) -> None:
    code = ("import os, subprocess\nsubprocess.Popen(['sleep', '1000'], start_new_session=True)\n"
            "open('left.txt', 'w').write('x')\nos.getcwd()")
    scratch = result_of(rt.run(code))
    deadline = time.monotonic() + 5
    while True:
        busy = [p for p in sandbox_processes()
                if "1000" in (psutil.Process(p).cmdline() if psutil.pid_exists(p) else [])]
        if not busy:
            break
        assert time.monotonic() < deadline, busy
        time.sleep(0.05)
    assert not os.path.exists(scratch)


# --------------------------------------------------------------------------- start-up


def test_stale_scratch_and_cgroups_of_a_dead_gateway_removed_live_ones_kept() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert not psutil.pid_exists(dead.pid)
    stale = tempfile.mkdtemp(prefix=f"interlace-{dead.pid}-python-")
    live_owner = subprocess.Popen(["sleep", "60"])
    live = tempfile.mkdtemp(prefix=f"interlace-{live_owner.pid}-python-")
    groups = find_root().dirs.values()  # and their cgroups
    stale_groups = [os.path.join(d, os.path.basename(stale)) for d in groups]
    live_groups = [os.path.join(d, os.path.basename(live)) for d in groups]
    for path in stale_groups + live_groups:
        os.mkdir(path)
    try:
        tool = PythonTool()
        configure_tool(tool, {"warm_imports": [], "workers": 1})
        harness = Harness([tool])
        harness.close()
        assert not os.path.exists(stale) and not any(os.path.exists(p) for p in stale_groups)
        assert os.path.exists(live) and all(os.path.exists(p) for p in live_groups)
    finally:
        live_owner.kill()
        live_owner.wait()
        for path in (stale, live, *stale_groups, *live_groups):
            if os.path.exists(path):
                os.rmdir(path)


def test_refuses_to_start_without_the_sandbox_unless_allowed(monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Any) -> None:
    """A PATH without bwrap is a machine without bubblewrap: start-up fails, naming it and how to install it."""
    monkeypatch.setenv("PATH", str(tmp_path))
    strict = PythonTool()
    configure_tool(strict, {"warm_imports": [], "workers": 1})
    with pytest.raises(ToolConfigError, match="bubblewrap.*apt-get install bubblewrap"):
        Harness([strict])
    lenient = PythonTool()
    configure_tool(lenient, {"warm_imports": [], "workers": 1, "allow_unisolated": True})
    harness = Harness([lenient])
    try:
        info = lenient.info()
        assert info["sandbox"] == "none" and info["network_isolation"] == "none"
        assert "bubblewrap" in info["unsandboxed_because"]
        assert result_of(harness.run("import os\nos.getuid()")) == os.getuid()
    finally:
        harness.close()


class _OptIn(Tool):
    """A third-party tool asking for the sandbox."""

    name = "opt_in"
    sandbox = True

    def on_finish(self, arguments: dict[str, Any]) -> Any:
        return {"uid": os.getuid(), "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit())}


def test_a_third_party_tool_can_opt_in() -> None:
    harness = Harness([_OptIn()])
    try:
        result = harness.loop.run_until_complete(harness.runtime.run("opt_in", {}))
        assert result.ok and result.content["uid"] == 65534 and len(result.content["pids"]) <= 2, result
    finally:
        harness.close()


# --------------------------------------------------------------------------- a gateway that is not root

#: Run as an unprivileged "gateway": builds the runtime, runs each escape through it, prints what it saw.
_NON_ROOT_GATEWAY = r'''
import asyncio, json, os, socket, sys, tempfile, uuid
import psutil
from interlace.gateway.plugin_host import configure_tool
from interlace.gateway.tools.runtime import ToolRuntime
from interlace.plugins.python_tool import PythonTool

MAX_PROCESSES = int(sys.argv[1])
os.environ["INTERLACE_SANDBOX_TEST_KEY"] = SECRET = "sk-nonroot-" + uuid.uuid4().hex
ESCAPES = {
    "who": "import os, resource\nst = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
           "[os.getuid(), os.geteuid(), os.getgid(), resource.getrlimit(resource.RLIMIT_AS)[0], "
           "{k: st[k].strip() for k in ('CapEff', 'CapPrm', 'CapBnd', 'CapAmb', 'NoNewPrivs', 'Seccomp')}]",
    "proc": "import os\nout = {}\nfor name in ('environ', 'mem', 'ns/net', 'cmdline'):\n"
            "    try:\n        open(f'/proc/@GATEWAY@/{name}', 'rb').read(64)\n        out[name] = 'read'\n"
            "    except OSError as exc:\n        out[name] = type(exc).__name__\n"
            "blobs = []\nfor pid in [p for p in os.listdir('/proc') if p.isdigit()] + ['self']:\n"
            "    for name in ('environ', 'cmdline'):\n        try:\n"
            "            blobs.append(open(f'/proc/{pid}/{name}', 'rb').read())\n"
            "        except OSError:\n            pass\n"
            "[out, sorted(int(p) for p in os.listdir('/proc') if p.isdigit()), os.getpid(), "
            "any(@SECRET@.encode() in b for b in blobs + [repr(dict(os.environ)).encode()])]",
    "syscalls": "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                "def err(rc):\n    return 0 if rc == 0 else ctypes.get_errno()\n"
                "fd = os.open('/proc/self/ns/net', os.O_RDONLY)\n"
                "[err(libc.setns(fd, 0x40000000)), err(libc.unshare(0x10000000 | 0x40000000)), "
                "err(libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)), "
                "err(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)), err(libc.ptrace(0, 0, 0, 0)), "
                "err(libc.syscall(321, 0, 0, 0))]",
    "unix": "import socket\ns = socket.socket(socket.AF_UNIX)\n"
            "try:\n    s.connect(@UNIX@)\n    r = 'connected'\nexcept OSError as exc:\n    r = type(exc).__name__\nr",
    "tcp": "import socket\ns = socket.socket()\ns.settimeout(3)\n"
           "try:\n    s.connect(('127.0.0.1', @PORT@))\n    r = 'connected'\nexcept OSError as exc:\n"
           "    r = type(exc).__name__\nr",
    "files": "import os\nw = []\nfor d in ('/', '/usr', '/tmp', '/etc'):\n"
             "    try:\n        open(os.path.join(d, 'x'), 'w')\n        w.append(d)\n    except OSError:\n        pass\n"
             "[w, os.access(os.getcwd(), os.W_OK), os.path.exists('/work/main/.git')]",
    "forks": "import os, time\nmade, error = 0, None\nfor _ in range(300):\n"
             "    try:\n        pid = os.fork()\n    except OSError as exc:\n        error = exc.errno\n        break\n"
             "    if pid == 0:\n        time.sleep(60)\n        os._exit(0)\n    made += 1\n[made, error]",
}

async def main():
    tool = PythonTool()
    configure_tool(tool, {"memory_mb": 400, "max_processes": MAX_PROCESSES, "warm_imports": [], "workers": 1})
    unix_path = os.path.join(tempfile.gettempdir(), f"interlace-nonroot-{uuid.uuid4().hex[:8]}.sock")
    unix = socket.socket(socket.AF_UNIX)
    unix.bind(unix_path)
    os.chmod(unix_path, 0o777)
    unix.listen()
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    subst = {"@GATEWAY@": str(os.getpid()), "@SECRET@": repr(SECRET), "@UNIX@": repr(unix_path),
             "@PORT@": str(tcp.getsockname()[1])}
    out = {"gateway_uid": os.getuid(), "gateway_euid": os.geteuid()}
    async with ToolRuntime([tool]) as rt:
        out["info"] = tool.info()
        hosts = []
        for pid in rt.worker_pids():  # the host's view of the warm spare: the gateway's own uid, never root
            hosts += [p.uids().real for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]]
        out["host_uids"] = sorted(set(hosts))
        for name, code in ESCAPES.items():
            for key, value in subst.items():
                code = code.replace(key, value)
            res = await rt.run("python", {"code": code})
            out[name] = (eval(res.content["result"]) if res.ok and res.content["error"] is None
                         else {"failed": res.error or res.content})
    unix.close()
    os.unlink(unix_path)
    print("RESULT " + json.dumps(out))

asyncio.run(main())
'''


def _unprivileged(argv: list[str], uid: int) -> list[str]:
    """``argv`` run as ``uid`` with no capabilities.  Where the interpreter lies under a directory that
    uid cannot traverse (``/root``, mode 0700, here), a private mount namespace (made while still root)
    puts a traversable tmpfs over that directory with only the needed children bound back."""
    blocked: dict[str, set[str]] = {}
    for path in {os.path.realpath(p) for p in (sys.executable, sys.base_prefix, sys.prefix, *sys.path) if p}:
        parts = path.strip("/").split("/")
        for i in range(1, len(parts)):
            d = "/" + "/".join(parts[:i])
            if not os.stat(d).st_mode & 0o001:
                blocked.setdefault(d, set()).add(parts[i])
                break
    lines = ["set -e"]
    for i, (d, children) in enumerate(sorted(blocked.items())):
        held = {child: f"/tmp/.sb-{os.getpid()}-{i}-{j}" for j, child in enumerate(sorted(children))}
        lines += [f"mkdir -p {tmp} && mount --bind {d}/{child} {tmp}" for child, tmp in held.items()]
        lines.append(f"mount -t tmpfs -o mode=0755 tmpfs {d}")
        lines += [f"mkdir {d}/{child} && mount --bind {tmp} {d}/{child} && umount {tmp} && rmdir {tmp}"
                  for child, tmp in held.items()]
    lines.append(f'exec setpriv --reuid={uid} --regid={uid} --clear-groups --inh-caps=-all -- "$@"')
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", "\n".join(lines), "sh", *argv]


@pytest.mark.skipif(os.geteuid() != 0, reason="runs an unprivileged gateway from root; as non-root, the other "
                                               "tests of this module are that gateway")
def test_a_non_root_gateway_gets_the_sandbox_in_a_user_namespace() -> None:
    """The gateway is a real unprivileged process (uid 65534, no capabilities in any namespace): bubblewrap
    builds a user namespace, there is no writable cgroup, RLIMIT_NPROC bounds each call's tasks; every
    escape of the trial still fails, and info() says what is not enforced."""
    max_processes = 12
    argv = [sys.executable, "-c", _NON_ROOT_GATEWAY, str(max_processes)]
    env = {"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8", "HOME": "/tmp"}
    proc = subprocess.run(_unprivileged(argv, 65534), capture_output=True, text=True, timeout=300, env=env,
                          check=False, cwd="/")
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-4000:]
    out = json.loads(line[len("RESULT "):])
    assert out["gateway_uid"] == out["gateway_euid"] == 65534  # really not root
    info = out["info"]["sandbox"]
    assert info["sandbox"] == "bubblewrap" and info["mode"].startswith("user namespace")
    assert info["host_uid"] == 65534 and "user" in info["namespaces"]
    assert str(info["cgroup"]).startswith("unavailable: ")  # 65534 may not write the cgroup tree here
    assert any("memory_mb" in item for item in info["not_enforced"])
    assert "RLIMIT_NPROC" in info["max_processes"]["by"]
    assert out["host_uids"] and 0 not in out["host_uids"] and set(out["host_uids"]) == {65534}
    uid, euid, gid, rlimit_as, status = out["who"]
    assert uid == euid == gid == 65534 and rlimit_as == 400 << 20
    assert status == {"CapEff": "0" * 16, "CapPrm": "0" * 16, "CapBnd": "0" * 16, "CapAmb": "0" * 16,
                      "NoNewPrivs": "1", "Seccomp": "2"}
    gateway_files, pids, own, leaked = out["proc"]
    assert set(gateway_files.values()) <= {"FileNotFoundError", "ProcessLookupError"}, gateway_files
    assert set(pids) <= {1, own} and leaked is False
    assert out["syscalls"] == [1, 1, 1, 1, 1, 1]  # EPERM: setns, unshare, clone(NEWUSER), mount, ptrace, bpf
    assert out["unix"] in ("FileNotFoundError", "ConnectionRefusedError", "PermissionError"), out["unix"]
    assert out["tcp"] in ("ConnectionRefusedError", "OSError", "TimeoutError"), out["tcp"]  # a down loopback
    writable, scratch_ok, git = out["files"]
    assert writable == [] and scratch_ok and not git
    made, error = out["forks"]  # RLIMIT_NPROC, counted in the call's own user namespace
    assert error == 11 and max_processes - 2 <= made <= max_processes, out["forks"]
