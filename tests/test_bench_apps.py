"""Smoke test of ``interlace bench apps`` (bench/apps.py): tiny sizes, two
applications, every variant of each, through the real gateway (embedded
model) on loopback.  Checks the table's structure and that the
request-centric and the Semantic Variables variants both produced their
outputs, with nonzero prefill counts measured on the engine."""

from __future__ import annotations

import json

import pytest

from interlace.bench import apps


def test_documents_and_apps_are_well_formed():
    doc = apps.load_document()
    assert len(doc.split()) > 2000
    calls = apps.multiagent_app(files=2, rounds=2, out=4).calls
    # architect, 2 coders, then (2 reviewers + 2 revisions) per round
    assert len(calls) == 1 + 2 + 2 * 4
    produced = {c.out for c in calls}
    for c in calls:
        for kind, v in c.inputs.values():
            assert kind == "const" or v in produced
        assert set(apps._PLACEHOLDER.findall(c.text)) == set(c.inputs)
    assert apps.render("a {{input:x}} b", {"x": "{{input:x}}"}) == "a {{input:x}} b"  # one pass
    with pytest.raises(apps.BenchError):
        apps.parse_apps("chain,nope")
    with pytest.raises(apps.BenchError):
        apps.parse_delay("300,200")


def test_quick_run_measures_both_ways(tmp_path, capsys):
    out = tmp_path / "apps.json"
    png = tmp_path / "apps.png"
    rc = apps.main(["--quick", "--apps", "mapreduce,shared", "--chunks", "2", "--chunk-tokens", "48",
                    "--output-tokens", "6", "--users", "2", "--system-tokens", "96", "--delay-ms", "20,30",
                    "--capacity", "off", "--weights", "float32", "--json", str(out), "--out-png", str(png)])
    text = capsys.readouterr().out
    assert rc == 0, text
    res = json.loads(out.read_text())
    assert png.stat().st_size > 0

    # the printed tables: one per app, the same columns, a row per variant
    header = "| " + " | ".join(apps.COLUMNS) + " |"
    assert text.count(header) == 2
    assert "**mapreduce**" in text and "**shared**" in text
    for line in ("| a-seq |", "| a-par |", "| a-par-nocache |", "| b-nocache |"):
        assert line in text
    assert "target mapreduce: b >= 2x faster" in text
    assert "target shared: b >= 5x fewer prefilled tokens than a-par-nocache" in text

    expected = {"mapreduce": {"a-seq", "a-par", "b"}, "shared": {"a-par", "a-par-nocache", "b", "b-nocache"}}
    for app, variants in expected.items():
        summ = res["summaries"][app]["off"]  # one capacity setting (test_bench_apps_capacity.py: both)
        assert set(summ) == variants
        for v, s in summ.items():
            assert s["runs"] == 1 and not s["errors"], (app, v, s["errors"])
            assert s["e2e_s"] > 0
            assert s["prefill_tokens"] > 0, (app, v)
            assert s["peak_blocks"] > 0, (app, v)
            assert s["output_tokens"] > 0, (app, v)
            assert s["http_requests"] >= 1
        # greedy and max_tokens: both ways generate the same number of tokens
        assert len({s["output_tokens"] for s in summ.values()}) == 1, summ
    for r in res["runs"]:
        assert all(isinstance(t, str) and t for t in r["finals"].values()), (r["app"], r["variant"])
        assert r["leaked_blocks"] == 0, (r["app"], r["variant"])
    mr = res["summaries"]["mapreduce"]["off"]
    # the semantic run needs its session, its calls and the fetch: more requests than a-seq's 3 completions
    assert mr["a-seq"]["http_requests"] == 3
    assert mr["b"]["http_requests"] > 3
    sh = res["summaries"]["shared"]["off"]
    # the engine without its prefix cache prefills every user's whole prompt; forking the shared prompt does not
    assert sh["b"]["prefill_tokens"] < sh["a-par-nocache"]["prefill_tokens"]
    assert sh["a-par-nocache"]["prefill_tokens"] >= sh["a-par-nocache"]["prompt_tokens"] - 2
