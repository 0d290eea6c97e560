"""A benchmark variant gives its memory back (issue 30): ``interlace bench apps``
runs every variant on a fresh gateway and engine in one process, and
``--quick`` grew about 1 GB of process-tree RSS per variant until the OOM
killer ended it.  The stopped engine, its model and KV cache were reachable
only through reference cycles, which CPython's automatic collector reaches
rarely once torch is loaded; the bench now collects them (and trims the C
heap) as each gateway's block ends (bench/apps.py, ``Gateway``).

Here one variant runs twice in process with the automatic collector off (the
case the bench hit: its full pass did not come), so only the bench's own
release can free the first engine: afterwards no engine object is left,
and the RSS after the second run is within 300 MB of that after the first (one
unreleased engine of the embedded model is about 1 GB: 540 MB of float32
weights, its KV cache and buffers).  ``interlace bench langchain --quick``
(one run per mode) releases each run's engine the same way.
"""

from __future__ import annotations

import gc

import psutil
import pytest

from interlace.bench import apps, langchain_apps
from interlace.engine_ext.embedded import embedded_model_dir
from interlace.engine_ext.native.engine import NativeEngine
from interlace.engine_ext.native.loader import load_config
from interlace.engine_ext.tokenizer import Tokenizer


def tree_rss_mb() -> float:
    me = psutil.Process()
    return sum(p.memory_info().rss for p in (me, *me.children(recursive=True))) / 2**20


def engines_alive() -> int:
    """Native engine objects anywhere in the heap, garbage not yet collected included."""
    return sum(1 for o in gc.get_objects() if type(o) is NativeEngine)


@pytest.fixture
def automatic_gc_off():
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    yield
    if was:
        gc.enable()


def test_one_variant_twice_returns_its_memory(automatic_gc_off):
    d = embedded_model_dir()
    sizes = apps.Sizes(chunks=1, chunk_tokens=48, output_tokens=2, users=1, system_tokens=32, files=1, rounds=1)
    (app,) = apps.build_apps(["chain"], sizes, Tokenizer(d, load_config(d)[0]))
    before = engines_alive()
    rss, left = [], []
    for _ in range(2):
        row = apps.measure(app, "a-seq", seed=0, repeat=0, delay=(0.0, 0.0), kv_cache_tokens=16384,
                           max_batched_tokens=512)
        assert row["output_tokens"] == 2 and row["prefill_tokens"] > 0 and row["leaked_blocks"] == 0, row
        rss.append(tree_rss_mb())
        left.append(engines_alive() - before)
    assert rss[1] - rss[0] < 300, f"process-tree RSS after run 1 and 2: {rss[0]:.0f} MB, {rss[1]:.0f} MB"
    assert left == [0, 0]  # each variant's engine is gone, not waiting for a collection


def test_langchain_quick_runs_each_mode_once_and_releases_its_engines(automatic_gc_off, capsys):
    before = engines_alive()
    assert langchain_apps.main(["--quick", "--apps", "chain", "--chunks", "1", "--chunk-tokens", "48",
                                "--output-tokens", "2", "--delay-ms", "0"]) == 0
    assert engines_alive() == before
    rows = [ln.split(" | ") for ln in capsys.readouterr().out.splitlines() if ln.startswith("| chain |")]
    # | app | mode | e2e s (median) | runs | HTTP requests | prefilled tokens | speed-up vs a | same result |
    assert [r[1] for r in rows] == ["a: ChatInterlace", "b: to_semantic"]
    for r in rows:
        assert "," not in r[3] and r[3] == r[2], r  # one run of each mode (--quick): its e2e is the median
        assert int(r[5]) > 0 and r[7] == "yes |", r  # prefilled on the engine; b's text equals a's
