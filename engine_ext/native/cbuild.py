"""Compiling the engine's small native kernels on first use.

The CPU kernels (:mod:`.cpu_attention`, :mod:`.cpu_matmul`) ship as source
and are compiled on the machine that runs them, with ``-march=native``: the
machines this runs on differ (AVX2 only, AVX-512 with VNNI and BF16, ARM),
and one wheel per ISA is not worth it for a few hundred lines.  A build is
cached under the model cache's ``kernels/`` directory, keyed by the source,
the compiler command and the CPU's flags, so a second process (or a machine
with another CPU sharing the directory) never loads a binary built for
something else.  A failed build raises :class:`BuildError`; callers fall back
to torch and log one line.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

log = logging.getLogger(__name__)


#: e^x for x <= 0, shared by the C and C++ kernels' sources (softmax weights below their maximum)
EXP_LE0 = r"""
/* e^x for x <= 0 (a score minus the running maximum): 2^(x log2 e) split into 2^n 2^f, |f| <= 1/2,
   2^f by its Taylor series to degree 7 (relative error < 1e-8, below float32's rounding).  Unlike
   expf it vectorizes: the softmax takes one vector pass per tile of keys, not a libm call per key. */
static inline float exp_le0(float x) {
    x = x < -87.f ? -87.f : x;
    const float t = x * 1.4426950408889634f, n = floorf(t + 0.5f), f = t - n;
    float p = 1.5252733804059840e-5f;
    p = p * f + 1.5403530393381606e-4f;
    p = p * f + 1.3333558146428443e-3f;
    p = p * f + 9.6181291076284772e-3f;
    p = p * f + 5.5504108664821580e-2f;
    p = p * f + 2.4022650695910071e-1f;
    p = p * f + 6.9314718055994531e-1f;
    p = p * f + 1.0f;
    const int32_t e = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &e, 4);
    return p * two_n;
}

"""


class BuildError(RuntimeError):
    """The kernel could not be compiled here (no compiler, or it failed)."""


def cpu_flags() -> str:
    """This CPU's feature flags (the ``flags`` line of /proc/cpuinfo), or the machine name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def compiler(cplusplus: bool = False) -> Optional[str]:
    """``$CC`` / ``$CXX``, else the first C (C++) compiler on PATH."""
    env = os.environ.get("CXX" if cplusplus else "CC")
    if env:
        return env
    names = ("c++", "g++", "clang++") if cplusplus else ("cc", "gcc", "clang")
    return next((p for p in map(shutil.which, names) if p), None)


def target(name: str, source: str, args: Sequence[str], cache_dir: Optional[Path] = None) -> Path:
    """Where the build of ``source`` with ``args`` for this CPU is cached."""
    from .loader import cache_root

    key = hashlib.sha256("\0".join((source, *args, cpu_flags())).encode()).hexdigest()[:16]
    return (cache_dir or cache_root() / "kernels") / f"{name}_{key}.so"


def build(source: str, suffix: str, command: Sequence[str], out: Path, libs: Sequence[str] = ()) -> None:
    """Compile ``source`` (written to a ``.suffix`` file) into the shared library ``out``:
    ``command`` is the compiler and its flags; the source, output and then ``libs`` (``-l``
    options come after the source, or the linker drops them) are appended."""
    if not command or command[0] is None:
        raise BuildError("no C/C++ compiler (cc, gcc, clang; c++, g++, clang++) on PATH")
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / f"kernel.{suffix}"
        src.write_text(source)
        lib = Path(tmp) / out.name
        try:
            done = subprocess.run([*command, str(src), "-o", str(lib), *libs], capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            raise BuildError(f"{command[0]}: {e}") from e
        if done.returncode != 0:
            raise BuildError(f"{command[0]} failed: {done.stderr.strip()[-500:]}")
        os.replace(lib, out)  # atomic: a concurrent loader sees the whole file or none


def torch_command() -> Tuple[List[str], List[str]]:
    """The C++ compiler command for a torch extension built for this CPU (this torch's headers,
    ``-march=native``, OpenMP: ``at::parallel_for`` runs on torch's own pool) and its libraries."""
    import torch
    from torch.utils import cpp_extension

    # -fno-trapping-math: nothing here reads floating-point exception flags, and without it GCC
    # vectorizes no loop that converts floats to integers (the softmax's exp: 13x slower)
    flags = ["-O3", "-march=native", "-fno-trapping-math", "-fopenmp", "-std=c++20", "-shared", "-fPIC", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    flags += [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()] + ["-lc10", "-ltorch_cpu"]
    return [compiler(cplusplus=True), *flags], libs


def load_torch_ops(name: str, source: str, command: Sequence[str], libs: Sequence[str],
                   cache_dir: Optional[Path], what: str) -> Path:
    """Build the torch extension ``source`` (once per source, command, CPU and torch version: it
    links against torch's C++ ABI) and load it, registering its ``TORCH_LIBRARY`` ops under
    ``torch.ops``; one INFO line when it had to be compiled.  Raises :class:`BuildError` (or
    OSError/RuntimeError from loading)."""
    import torch

    out = target(name, source, [*command[1:], *libs, torch.__version__], cache_dir)
    if not out.exists():
        t0 = time.perf_counter()
        build(source, "cpp", command, out, libs)
        log.info("built %s for this CPU in %.1f s: %s", what, time.perf_counter() - t0, out)
    torch.ops.load_library(str(out))
    return out
