"""``interlace bench engine`` runs end to end (tiny settings): every variant
in its own subprocess, the table, the JSON and the plot.  A smoke test; the
numbers themselves are recorded in docs/benchmarks.md, not asserted."""

import json

from interlace.bench import engine as bench_engine


def test_bench_engine_smoke(tmp_path, capsys):
    out = tmp_path / "r.json"
    png = tmp_path / "p.png"
    assert bench_engine.main(["--dtypes", "float32", "--batches", "1", "2", "--prompt-len", "8", "--new", "4",
                              "--repeat", "1", "--json", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "| interlace float32 |" in text and "| transformers float32 |" in text
    res = json.loads(out.read_text())
    for variant in ("interlace float32", "transformers float32"):
        cells = res["best"][variant]
        assert set(cells) == {"1", "2"} and all(c["decode"] > 0 and c["prefill"] > 0 for c in cells.values())
    assert png.stat().st_size > 1000
