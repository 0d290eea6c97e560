"""The sandbox a tool's workers run in when the tool asks for it (``Tool.sandbox``): bubblewrap, setpriv, seccomp, a cgroup.

Why: the python tool runs code the model wrote.  Run as root with only a
network namespace, that code (adversarial trial, issue 29) entered the
gateway's network namespace with ``setns(/proc/<gateway>/ns/net)``, read
every API key from ``/proc/<gateway>/environ``, another tenant's session
variable from ``/proc/<gateway>/mem``, reached host ``AF_UNIX`` sockets and
held 1.9 GB with forked children against a 1 GB limit.

What a sandboxed worker gets, each piece from a well-kept tool rather than
hand-written syscalls:

* **bubblewrap** (``bwrap``) builds new PID, mount, network, IPC, UTS and
  cgroup namespaces with their own ``/proc``: no other process is visible, so
  no ``/proc/<pid>/environ``, ``mem`` or ``ns/*`` of the gateway can be
  named.  The root is an empty tmpfs, remounted read-only, holding only
  read-only binds of what Python needs (``/usr`` and the ``/lib*`` links,
  a few files of ``/etc``, the interpreter's prefix, the virtualenv, the
  package directories of ``interlace`` and of the tool) plus the worker's
  private scratch directory, writable.  No ``/tmp``, ``/run``, ``/home``,
  ``/sys`` or project tree: no host ``AF_UNIX`` socket has a path in there,
  and the network namespace holds only a down loopback.
* **setpriv** (util-linux) drops to an unprivileged uid/gid (``sandbox_uid``,
  default 65534) with no supplementary groups, empty capability sets
  (bounding set included) and ``no_new_privs``, before the interpreter
  starts.  bubblewrap runs with the gateway's rights (as root it needs no
  user namespace, and an unprivileged uid could not even traverse ``/root``
  to bind the interpreter); it keeps only ``CAP_SETUID``, ``CAP_SETGID`` and
  ``CAP_SETPCAP`` for setpriv, which gives them up.  The uid is a real host
  uid, not root mapped into a user namespace.
* **seccomp** (libseccomp, through ``pyseccomp``): a filter, compiled once in
  the gateway and loaded by bubblewrap (``--seccomp FD``) before setpriv
  runs, answers ``EPERM`` to :data:`DENIED_SYSCALLS` -- namespace changes
  (``setns``, ``unshare``, ``clone`` with any ``CLONE_NEW*`` flag), mounts,
  ``ptrace`` and cross-process memory access, ``bpf``, the kernel keyring,
  modules, ``perf_event_open``, ``userfaultfd``, ``io_uring``, file handles
  and the like -- and ``ENOSYS`` to ``clone3`` (its flags cannot be
  inspected, and libc then falls back to ``clone``).  Syscalls of another
  ABI (i386, x32) kill the process.
* **a cgroup per worker** (:mod:`.cgroup`): ``memory_mb`` for all its tasks
  together, ``max_processes`` tasks (plus the three of the sandbox itself:
  bubblewrap, its init and the worker), optionally ``cpu_cores``.

**A gateway that is not root** cannot switch uids nor (usually) write a
cgroup.  bubblewrap then builds a user namespace as well (``--unshare-user``,
``--uid``/``--gid`` ``sandbox_uid`` inside, ``--cap-drop ALL``: no capability
in any namespace), with the same root, binds, namespaces and seccomp filter,
and no setpriv.  The host uid of the code is then the gateway's own
unprivileged uid -- never root, but not a uid of its own.  Without a writable
cgroup the whole-call limits fall back to rlimits: ``prlimit`` (util-linux)
sets ``RLIMIT_NPROC`` inside the sandbox to ``max_processes`` plus bubblewrap's
init and the worker (since Linux 5.14 the kernel counts ``RLIMIT_NPROC`` per
user namespace and uid, and each call has its own user namespace: a per-call
bound, measured exact here -- the gateway's own tasks of the same uid do not
count), and every process keeps its own ``RLIMIT_AS``; the memory of all the call's processes together and
``cpu_cores`` are then not enforced, which :meth:`Sandbox.info` (``"cgroup":
"unavailable: ..."``, ``"not_enforced"``) and the start-up log say.  Where the
kernel refuses unprivileged user namespaces, the probe fails and says so.

Where any piece is missing, :func:`probe` raises :class:`SandboxUnavailable`
naming it and how to install it; the tool refuses to start then (the python
tool unless its settings say ``allow_unisolated: true``; the gateway leaves a
tool out instead when no caller may use it: :func:`unavailable_reason`).  The probe also
starts one sandboxed interpreter and checks, from inside, the uid, the
capability sets, ``no_new_privs``, the seccomp mode and that ``unshare``
fails, so a sandbox that only looks right is refused too.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from .base import Tool, ToolConfigError
from .cgroup import JOIN_WRAPPER, CallCgroup, CgroupRoot, CgroupUnavailable, find_root

__all__ = ["Sandbox", "SandboxUnavailable", "probe", "unavailable_reason", "DENIED_SYSCALLS", "NAMESPACES",
           "SANDBOX_OVERHEAD_TASKS", "USERNS_OVERHEAD_TASKS"]

#: Namespaces bubblewrap creates (``mount`` always).
NAMESPACES = ("pid", "mount", "network", "ipc", "uts", "cgroup")
#: Denied with EPERM (those the running libseccomp does not know are left out, and not reported).
DENIED_SYSCALLS = (
    "setns", "unshare", "mount", "umount", "umount2", "pivot_root", "chroot", "mount_setattr", "move_mount",
    "open_tree", "fsopen", "fsconfig", "fsmount", "fspick", "ptrace", "process_vm_readv", "process_vm_writev",
    "pidfd_getfd", "kcmp", "bpf", "keyctl", "add_key", "request_key", "init_module", "finit_module",
    "delete_module", "kexec_load", "kexec_file_load", "perf_event_open", "userfaultfd", "open_by_handle_at",
    "name_to_handle_at", "io_uring_setup", "io_uring_enter", "io_uring_register", "swapon", "swapoff", "reboot",
    "syslog", "acct", "quotactl", "lookup_dcookie", "iopl", "ioperm", "settimeofday", "clock_settime",
    "clock_adjtime", "adjtimex", "sethostname", "setdomainname", "vhangup", "uselib", "fanotify_init",
    "nfsservctl", "_sysctl",
)
_CLONE_NEW_FLAGS = {  # every namespace flag clone() takes
    "CLONE_NEWTIME": 0x00000080, "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000,
    "CLONE_NEWUTS": 0x04000000, "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000,
    "CLONE_NEWPID": 0x20000000, "CLONE_NEWNET": 0x40000000,
}
_TIOCSTI = 0x5412  # push input into a terminal: bubblewrap's --new-session covers it too
#: Tasks of the sandbox itself in the worker's cgroup: bubblewrap, its PID-namespace init, the worker.
SANDBOX_OVERHEAD_TASKS = 3
#: Tasks of the sandbox itself in its user namespace (no cgroup, not root): bubblewrap's init and the worker.
USERNS_OVERHEAD_TASKS = 2
#: Files of /etc that Python and its libraries read (the dynamic linker's cache, time zone, fonts, user names).
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "alternatives", "fonts", "passwd", "group",
        "nsswitch.conf")
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32")
_INSTALL_HINT = "apt-get install bubblewrap util-linux libseccomp2 (scripts/setup.sh does it when run as root)"


class SandboxUnavailable(ToolConfigError):
    """The OS cannot give a tool the sandbox it asked for; the message says what is missing and how to fix it."""


@functools.cache
def _seccomp_program() -> tuple[bytes, tuple[str, ...]]:
    """The filter as BPF (native architecture) and the syscalls it denies."""
    import errno as _errno

    import pyseccomp as seccomp

    filt = seccomp.SyscallFilter(seccomp.ALLOW)
    denied = []
    for name in DENIED_SYSCALLS:
        try:
            filt.add_rule(seccomp.ERRNO(_errno.EPERM), name)
            denied.append(name)
        except (OSError, ValueError, RuntimeError):
            pass  # unknown to this libseccomp / architecture
    for flag in _CLONE_NEW_FLAGS.values():
        filt.add_rule(seccomp.ERRNO(_errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    denied.append("clone(CLONE_NEW*)")
    filt.add_rule(seccomp.ERRNO(_errno.ENOSYS), "clone3")
    denied.append("clone3 (ENOSYS)")
    filt.add_rule(seccomp.ERRNO(_errno.EPERM), "ioctl", seccomp.Arg(1, seccomp.MASKED_EQ, 0xFFFFFFFF, _TIOCSTI))
    denied.append("ioctl(TIOCSTI)")
    with tempfile.TemporaryFile() as fh:
        filt.export_bpf(fh)
        fh.seek(0)
        return fh.read(), tuple(denied)


def _root_mode() -> bool:
    """Whether the gateway is root: setpriv switches uids; otherwise bubblewrap makes a user namespace."""
    return os.geteuid() == 0


def _userns_problem() -> str | None:
    """Why this kernel refuses unprivileged user namespaces, if it visibly does."""
    for path, bad, fix in (
        ("/proc/sys/user/max_user_namespaces", "0", "sysctl user.max_user_namespaces=15000"),
        ("/proc/sys/kernel/unprivileged_userns_clone", "0", "sysctl kernel.unprivileged_userns_clone=1"),
    ):
        try:
            with open(path) as fh:
                if fh.read().strip() == bad:
                    return (f"the gateway is not root and this kernel refuses unprivileged user namespaces "
                            f"({path} is {bad}): run the gateway as root, or allow them ({fix})")
        except OSError:
            continue
    return None


def _nproc_per_userns() -> bool:
    """Whether this kernel counts RLIMIT_NPROC per user namespace (Linux 5.14's ucounts); before, per uid."""
    match = re.match(r"(\d+)\.(\d+)", platform.release())
    return match is not None and (int(match.group(1)), int(match.group(2))) >= (5, 14)


def _missing(root_mode: bool) -> tuple[list[str], CgroupRoot | None, str | None]:
    """What the OS lacks for the sandbox (empty when nothing), the cgroup root if there is one, and why
    there is none.  As root, a missing cgroup is a problem; otherwise rlimits stand in for it."""
    problems = []
    if not sys.platform.startswith("linux"):
        return [f"the sandbox needs Linux (namespaces, seccomp, cgroups); this is {sys.platform}"], None, None
    if shutil.which("bwrap") is None:
        problems.append("bubblewrap (`bwrap`) is not installed")
    if root_mode and shutil.which("setpriv") is None:
        problems.append("`setpriv` (util-linux) is not installed")
    if not root_mode and (userns := _userns_problem()):
        problems.append(userns)
    if not root_mode and os.getuid() == 0:
        problems.append("the gateway's real uid is root but its effective uid is not: the sandbox's host uid "
                        "would be root; run it as root or as an ordinary user")
    try:
        _seccomp_program()
    except (ImportError, OSError, RuntimeError, ValueError) as exc:
        problems.append(f"seccomp filters need libseccomp and the pyseccomp package ({exc}; pip install pyseccomp)")
    root, no_cgroup = None, None
    try:
        root = find_root()
    except (CgroupUnavailable, OSError) as exc:
        no_cgroup = str(exc)
        if root_mode:
            problems.append(f"no cgroup for per-call limits: {exc}")
        elif shutil.which("prlimit") is None and _nproc_per_userns():
            problems.append(f"no cgroup for per-call limits ({exc}), and `prlimit` (util-linux), which sets the "
                            "per-call task limit instead, is not installed")
    return problems, root, no_cgroup


def _system_binds() -> list[str]:
    args: list[str] = []
    for path in _SYSTEM:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for name in _ETC:
        path = os.path.join("/etc", name)
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    return args


def _package_paths(tool: Tool) -> list[str]:
    """The interpreter, the virtualenv and the code the worker imports: read-only binds outside /usr."""
    paths = {sys.base_prefix, sys.base_exec_prefix, sys.prefix, sys.exec_prefix,
             os.path.dirname(os.path.realpath(sys.executable))}
    paths.update(p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p))
    tops = {"interlace", type(tool).__module__.split(".")[0]}
    for name, module in list(sys.modules.items()):
        parts = name.split(".")
        if parts[0] not in tops or len(parts) > 2 or module is None:
            continue
        search = getattr(module, "__path__", None)
        if search is not None:
            paths.update(p for p in search if os.path.isdir(p))
        elif len(parts) == 1 and getattr(module, "__file__", None):
            paths.add(module.__file__)  # a top-level module: that file, not its directory
    paths.update(p for p in getattr(tool, "sandbox_ro_paths", ()) if os.path.exists(p))
    real = sorted({os.path.realpath(p) for p in paths} | {os.path.abspath(p) for p in paths})
    kept: list[str] = []
    for path in real:  # drop what a shorter kept path or /usr already covers
        if path.startswith("/usr/") or any(path == k or path.startswith(k.rstrip("/") + "/") for k in kept):
            continue
        kept.append(path)
    return kept


def _parents(paths: list[str]) -> list[str]:
    """``--dir`` for every ancestor of the binds, mode 0755 (bubblewrap would make them 0700)."""
    seen: list[str] = []
    for path in paths:
        parts = path.strip("/").split("/")[:-1]
        for i in range(1, len(parts) + 1):
            d = "/" + "/".join(parts[:i])
            if d not in seen:
                seen.append(d)
    return [a for d in seen for a in ("--perms", "0755", "--dir", d)]


class Sandbox:
    """The sandbox of one tool's workers: how to start one, and its per-worker cgroup (if any)."""

    def __init__(self, tool: Tool, root: CgroupRoot | None, report: dict[str, Any], *, root_mode: bool,
                 no_cgroup: str | None = None) -> None:
        self.tool = tool
        self.uid = int(getattr(tool, "sandbox_uid", 65534))
        self.gid = self.uid
        self.root_mode = root_mode  # root: setpriv switches to the uid; else bubblewrap's user namespace maps it
        self.cgroups = root
        self.no_cgroup = no_cgroup  # why there is no cgroup (not root, nothing delegated)
        self.bpf, self.denied = _seccomp_program()
        self.bwrap = shutil.which("bwrap") or "bwrap"
        self.setpriv = shutil.which("setpriv") or "setpriv"
        self.prlimit = shutil.which("prlimit") or "prlimit"
        self.nproc_per_userns = _nproc_per_userns()
        self.ro_paths = _package_paths(tool)
        self.memory_bytes = int(tool.memory_mb) << 20
        self.max_processes = int(getattr(tool, "max_processes", 64))
        self.cpu_cores = getattr(tool, "cpu_cores", None)
        self.report = report

    @classmethod
    def for_tool(cls, tool: Tool) -> Sandbox:
        """The sandbox ``tool`` asked for; raise :class:`SandboxUnavailable` where the OS cannot give it."""
        uid = int(getattr(tool, "sandbox_uid", 65534))
        if uid <= 0:
            raise SandboxUnavailable(f"tool {tool.name!r}: sandbox_uid must be an unprivileged uid, not {uid}")
        report = probe(uid)
        root_mode = _root_mode()
        problems, root, no_cgroup = _missing(root_mode)
        assert not problems and (root is not None or not root_mode)  # probe() raised otherwise
        if root is not None:
            root.remove_stale()  # what a gateway killed before it could clean up left behind
        return cls(tool, root, report, root_mode=root_mode, no_cgroup=no_cgroup)

    def prepare_scratch(self, path: str) -> None:
        """Hand the scratch directory to the sandbox's uid (still mode 0700: nobody else may enter).

        In a user namespace the gateway's own uid is the sandbox's uid outside: nothing to change."""
        if self.root_mode:
            os.chown(path, self.uid, self.gid)

    def new_cgroup(self, name: str) -> CallCgroup | None:
        """The worker's cgroup, or ``None`` where there is no writable cgroup (rlimits stand in)."""
        if self.cgroups is None:
            return None
        return self.cgroups.create(name, memory_bytes=self.memory_bytes,
                                   pids=self.max_processes + SANDBOX_OVERHEAD_TASKS, cpu_cores=self.cpu_cores)

    def seccomp_fd(self) -> int:
        """A fresh file descriptor holding the compiled filter, for ``--seccomp`` (the caller closes it)."""
        fd = os.memfd_create("interlace-seccomp")  # close-on-exec: pass_fds hands it to bwrap only
        os.write(fd, self.bpf)
        os.lseek(fd, 0, os.SEEK_SET)
        return fd

    def command(self, argv: list[str], scratch: str, seccomp_fd: int, cgroup: CallCgroup | None) -> list[str]:
        """The whole command line: join ``cgroup``, build the sandbox, drop to the uid, run ``argv``."""
        binds = [a for p in self.ro_paths for a in ("--ro-bind", p, p)]
        if self.root_mode:  # bubblewrap keeps what setpriv needs; setpriv gives it up
            become = ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                      "--cap-add", "CAP_SETPCAP", "--seccomp", str(seccomp_fd),
                      "--", self.setpriv, f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups",
                      "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
        else:  # a user namespace mapping the uid to the gateway's own; no capability in it either
            become = ["--cap-drop", "ALL", "--seccomp", str(seccomp_fd), "--"]
            if cgroup is None and self.nproc_per_userns:  # counts this user namespace's tasks: per call
                become += [self.prlimit, f"--nproc={self.max_processes + USERNS_OVERHEAD_TASKS}", "--"]
        bwrap = [
            self.bwrap,
            *(() if self.root_mode else ("--unshare-user", "--uid", str(self.uid), "--gid", str(self.gid))),
            "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup",
            "--die-with-parent", "--new-session",
            *_parents([*self.ro_paths, scratch]),
            *_system_binds(), *binds,
            "--bind", scratch, scratch,
            "--proc", "/proc", "--dev", "/dev",
            "--remount-ro", "/",
            *become, *argv,
        ]
        if cgroup is None:
            return bwrap
        return ["/bin/sh", "-c", JOIN_WRAPPER, "sh", *cgroup.procs_files, "--", *bwrap]

    def not_enforced(self) -> list[str]:
        """The whole-call limits that do not hold here (no cgroup), for ``info()`` and the start-up log."""
        if self.cgroups is not None:
            return []
        out = [f"memory_mb ({self.memory_bytes >> 20} MiB) for all the call's processes together: each process "
               "has its own RLIMIT_AS of that size, so N processes may hold N times it",
               "an OOM kill of one process does not end the whole call"]
        if not self.nproc_per_userns:
            out.append(f"max_processes ({self.max_processes}): this kernel ({platform.release()}) counts "
                       "RLIMIT_NPROC per uid, not per user namespace (Linux 5.14 or later does)")
        if self.cpu_cores:
            out.append(f"cpu_cores ({self.cpu_cores:g}): no CPU quota")
        return out

    def info(self) -> dict[str, Any]:
        """What is in force, for ``Tool.info()``."""
        if self.cgroups is not None:
            cgroup: Any = {"version": self.cgroups.version, "memory_bytes": self.memory_bytes,
                           "max_processes": self.max_processes,
                           "pids_max": self.max_processes + SANDBOX_OVERHEAD_TASKS,
                           "cpu_cores": self.cpu_cores, "per": "worker process (one per call for per-call tools)"}
        else:
            cgroup = f"unavailable: {self.no_cgroup}"
        processes = (f"cgroup pids.max {self.max_processes + SANDBOX_OVERHEAD_TASKS}" if self.cgroups is not None
                     else f"RLIMIT_NPROC {self.max_processes + USERNS_OVERHEAD_TASKS} (prlimit), counted in the "
                          "call's own user namespace" if self.nproc_per_userns else "not enforced")
        return {
            "sandbox": "bubblewrap",
            "mode": "root: setpriv to the uid" if self.root_mode
            else "user namespace (the gateway is not root): the uid inside maps to the gateway's own",
            "uid": self.uid,
            "gid": self.gid,
            "host_uid": self.uid if self.root_mode else os.getuid(),
            "capabilities": "none (effective, permitted, bounding, ambient), no_new_privs",
            "namespaces": list(NAMESPACES) + ([] if self.root_mode else ["user"]),
            "filesystem": {"read_only": [*self.ro_paths, "/usr (+ /lib*, /bin links)", "/etc: " + ", ".join(_ETC)],
                           "writable": "the call's scratch directory only"},
            "seccomp": {"action": "EPERM", "denied": list(self.denied)},
            "cgroup": cgroup,
            "max_processes": {"limit": self.max_processes, "by": processes},
            **({"not_enforced": self.not_enforced()} if self.cgroups is None else {}),
        }


def unavailable_reason(tool: Tool) -> str | None:
    """Why ``tool``'s sandbox cannot be built here; ``None`` when it does not ask for one or gets it.

    Runs the same (cached) :func:`probe` the pool runs; for tools no caller may
    use (the gateway leaves them out) and listings (``interlace plugins``)."""
    if not getattr(tool, "sandbox", False):
        return None
    uid = int(getattr(tool, "sandbox_uid", 65534))
    if uid <= 0:
        return f"tool {tool.name!r}: sandbox_uid must be an unprivileged uid, not {uid}"
    try:
        probe(uid)
    except SandboxUnavailable as exc:
        return str(exc)
    return None


def probe(uid: int) -> dict[str, Any]:
    """Check once (per uid, mode and set of programs found) that the sandbox can be built here and holds, from inside; raise :class:`SandboxUnavailable`.

    Starts one sandboxed interpreter (no warm imports) that reports its uid,
    capability sets, ``no_new_privs``, seccomp mode and whether ``unshare``
    is refused; any of these wrong is a refusal, not a warning.
    """
    return _probe(uid, shutil.which("bwrap"), shutil.which("setpriv"), _root_mode())


@functools.cache
def _probe(uid: int, bwrap: str | None, setpriv: str | None, root_mode: bool) -> dict[str, Any]:
    problems, root, no_cgroup = _missing(root_mode)
    if problems or (root is None and root_mode):
        install = any("installed" in p or "pyseccomp" in p for p in problems)
        raise SandboxUnavailable("the tool sandbox cannot be built on this machine: " + "; ".join(problems)
                                 + (f". To install what it needs: {_INSTALL_HINT}" if install else ""))

    class _Probe(Tool):
        name = "sandbox-probe"

    tool = _Probe()
    tool.sandbox_uid = uid  # type: ignore[attr-defined]
    tool.memory_mb = 256
    box = Sandbox(tool, root, {}, root_mode=root_mode, no_cgroup=no_cgroup)
    scratch = tempfile.mkdtemp(prefix=f"interlace-{os.getpid()}-sandbox-probe-")
    cgroup = None
    fd = -1
    try:
        box.prepare_scratch(scratch)
        cgroup = box.new_cgroup(os.path.basename(scratch))
        fd = box.seccomp_fd()
        argv = [sys.executable, "-c", "from interlace.gateway.tools.sandbox import _probe_main; _probe_main()"]
        proc = subprocess.run(box.command(argv, scratch, fd, cgroup), pass_fds=(fd,), capture_output=True,
                              text=True, timeout=60, check=False, cwd="/",
                              env={"PATH": os.environ.get("PATH", os.defpath), "LANG": "C.UTF-8", "HOME": scratch})
    except (OSError, subprocess.SubprocessError) as exc:
        raise SandboxUnavailable(f"the tool sandbox failed to start: {exc}") from None
    finally:
        if fd >= 0:
            os.close(fd)
        if cgroup is not None:
            cgroup.remove()
        shutil.rmtree(scratch, ignore_errors=True)
    try:
        seen = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        hint = "" if root_mode else (" (the gateway is not root: bubblewrap needs unprivileged user namespaces, "
                                     "which this kernel or a security module may refuse; run it as root)")
        raise SandboxUnavailable(f"the tool sandbox failed to start (exit {proc.returncode}): "
                                 f"{proc.stderr.strip()[-2000:]}{hint}") from None
    wrong = [f"{k}={seen.get(k)!r} (want {v!r})" for k, v in
             {"uid": uid, "euid": uid, "CapEff": 0, "CapPrm": 0, "CapBnd": 0, "NoNewPrivs": 1, "Seccomp": 2,
              "unshare": errno.EPERM, "other_processes": []}.items() if seen.get(k) != v]
    if wrong:
        raise SandboxUnavailable("the tool sandbox started but does not hold: " + ", ".join(wrong))
    return seen


def _probe_main() -> None:
    """Inside the probe's sandbox: report what holds, as JSON on stdout."""
    status: dict[str, Any] = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("CapEff", "CapPrm", "CapBnd"):
                status[key] = int(value, 16)
            elif key in ("NoNewPrivs", "Seccomp"):
                status[key] = int(value)
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    status["unshare"] = 0 if libc.unshare(0x40000000) == 0 else ctypes.get_errno()  # CLONE_NEWNET
    status["uid"], status["euid"] = os.getuid(), os.geteuid()
    status["other_processes"] = sorted(int(p) for p in os.listdir("/proc")
                                       if p.isdigit() and p not in (str(os.getpid()), "1"))
    print(json.dumps(status))
