"""Benchmarks: ``interlace bench engine``, ``interlace bench tools`` and
``python -m interlace.bench.parsers``.  Results go to docs/benchmarks.md."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (what a results table records as the machine)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
