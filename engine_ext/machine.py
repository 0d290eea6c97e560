"""The machine a measurement ran on: the CPU model *and* the instruction-set
flags that decide a CPU kernel's speed (AVX2 against AVX-512, BF16 and AMX
support), present and absent, because the model name alone ("AMD EPYC") says
nothing about them.

Every benchmark records :func:`machine` in its JSON and prints
:func:`describe_machine` above its table; the engines' profilers key their
saved profiles by :func:`cpu_description`.  It lives in ``engine_ext`` (not
``bench``) because the engine layer needs it and may not import upward.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Dict, List, Optional

# ISA extensions that change which CPU kernels PyTorch/oneDNN can use.
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
             "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


def _lscpu() -> Dict[str, str]:
    """``lscpu``'s fields (``{"Model name": ..., "Flags": ...}``); empty where lscpu is missing."""
    try:
        out = subprocess.run(["lscpu", "-J"], capture_output=True, text=True, timeout=10, check=True).stdout
        rows = json.loads(out)["lscpu"]
    except (OSError, subprocess.SubprocessError, ValueError, KeyError):
        return {}
    fields: Dict[str, str] = {}

    def walk(items: List[Dict[str, Any]]) -> None:  # newer lscpu nests fields under "children"
        for item in items:
            fields[str(item.get("field", "")).rstrip(":")] = str(item.get("data") or "")
            walk(item.get("children") or [])
    walk(rows)
    return fields


def _cpuinfo() -> Dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (the fallback without lscpu)."""
    fields: Dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                break
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_description(lscpu: Optional[Dict[str, str]] = None, cpuinfo: Optional[Dict[str, str]] = None
                    ) -> Dict[str, Any]:
    """The CPU as a dict: model name, family/model, logical CPUs, hypervisor,
    and the ISA flags of :data:`ISA_FLAGS` split into present and absent.

    ``lscpu``/``cpuinfo`` are the parsed sources (read from this machine when
    omitted; given explicitly by tests)."""
    ls = _lscpu() if lscpu is None else lscpu
    ci = (_cpuinfo() if not ls else {}) if cpuinfo is None else cpuinfo
    flags = set((ls.get("Flags") or ci.get("flags") or "").split())
    name = ls.get("Model name") or ci.get("model name") or platform.processor() or platform.machine()
    return {
        "model_name": name,
        "vendor": ls.get("Vendor ID") or ci.get("vendor_id") or "",
        "family": ls.get("CPU family") or ci.get("cpu family") or "",
        "model": ls.get("Model") or ci.get("model") or "",
        "cpus": int(ls.get("CPU(s)") or 0) or os.cpu_count() or 0,
        "threads_per_core": ls.get("Thread(s) per core") or "",
        "hypervisor": ls.get("Hypervisor vendor") or ("yes" if "hypervisor" in flags else ""),
        "isa": [f for f in ISA_FLAGS if f in flags],
        "isa_absent": [f for f in ISA_FLAGS if f not in flags] if flags else [],
        "source": "lscpu" if ls else ("/proc/cpuinfo" if ci else "platform"),
    }


def machine(**extra: Any) -> Dict[str, Any]:
    """What a results file records as the machine: the CPU (see
    :func:`cpu_description`), the usable CPUs of this process, Python, the
    date, plus the benchmark's own ``extra`` facts (torch version, threads)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 0
    return {"cpu": cpu_description(), "usable_cpus": usable, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), **extra}


def describe_cpu(cpu: Dict[str, Any]) -> str:
    """One line for a table's caption, e.g. ``AMD EPYC (family 23 model 49), 2 CPUs, KVM guest;
    ISA avx avx2 fma f16c; no avx512f avx512_bf16 amx_bf16``."""
    ident = f"family {cpu['family']} model {cpu['model']}" if cpu.get("family") else ""
    parts = [f"{cpu['model_name']}" + (f" ({ident})" if ident else ""), f"{cpu['cpus']} CPUs"]
    if cpu.get("hypervisor"):
        parts.append(f"{cpu['hypervisor']} guest" if cpu["hypervisor"] != "yes" else "virtual machine")
    text = ", ".join(parts)
    if cpu.get("isa") or cpu.get("isa_absent"):
        text += "; ISA " + (" ".join(cpu["isa"]) or "-")
        if cpu.get("isa_absent"):
            text += "; no " + " ".join(cpu["isa_absent"])
    else:
        text += "; ISA flags unknown"
    return text


def describe_machine(m: Dict[str, Any]) -> str:
    """One line for a benchmark's caption (the CPU, usable CPUs, Python, date, and the extras)."""
    extras = ", ".join(f"{k} {v}" for k, v in m.items() if k not in ("cpu", "usable_cpus", "python", "date"))
    return (f"{describe_cpu(m['cpu'])}; {m['usable_cpus']} usable by this process; Python {m['python']}"
            + (f"; {extras}" if extras else "") + f"; {m['date']}")
