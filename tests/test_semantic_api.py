"""Semantic Variables over HTTP against a real gateway (embedded model, loopback).

Sessions and their isolation, the DAG (diamonds, failures travelling
downstream, cycles and unknown variables refused), transforms, tool nodes
and their permission, prefix sharing by fork, objectives reaching the
engine, limits, and everything freed on delete, expiry and shutdown.
"""

from __future__ import annotations

import bisect
import json
import re
import time

import httpx
import pytest
from starlette.routing import Mount

from helpers.gateway_server import LiveGateway, engine_state

KEY, TOOL_KEY = "sv-key", "sv-tool-key"
MODEL = {"path": "embedded", "kv_cache_tokens": 4096, "dtype": "float32"}
#: A long constant instruction: several whole KV blocks before the first variable.
SYSTEM = ("You are a careful assistant. Answer in one short sentence, in plain English, without lists, "
          "without code and without any preamble. ") * 4


@pytest.fixture(scope="module")
def live():
    cfg = {"server": {"api_keys": [KEY, {"key": TOOL_KEY, "name": "tools", "server_tools": ["calculator"]}],
                      "sessions": {"max_variables": 40, "max_pending_calls": 8, "max_bytes": 64 * 1024}},
           "models": {"smollm2": MODEL, "nocache": {**MODEL, "prefix_caching": False}}}
    with LiveGateway(cfg) as gw:
        yield gw
        # left open on purpose, with a call waiting and a prefix context: shutdown frees them
        store, services = gw.gateway.sessions, gw.gateway.services
        left = S(httpx.Client(base_url=gw.url, timeout=60))
        left.llm(SYSTEM + "{{input:a}} {{output:out}}", {"a": left.var(name="never")})
        running = left.llm(SYSTEM + "Write a long story. {{output:out}}", max_tokens=400)
        deadline = time.time() + 60  # shut down while it generates, forked from a prefix context
        while left.http.get(left.url(f"/calls/{running['id']}"), headers=left.h).json()["state"] != "running":
            assert time.time() < deadline
            time.sleep(0.02)
        assert store.sessions
    assert not store.sessions and left.id not in store.sessions
    assert all(not p.entries for p in services.prefixes.values())
    assert gw.gateway.sessions is None and not gw.gateway.models  # the engines are closed after them


@pytest.fixture
def http(live):
    with httpx.Client(base_url=live.url, timeout=120) as c:
        yield c


class S:
    """One session, seen through raw HTTP."""

    def __init__(self, http: httpx.Client, key: str = KEY, **body):
        r = http.post("/v1/sessions", json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 201, r.text
        self.http, self.info = http, r.json()
        self.id, self.token = self.info["id"], self.info["token"]
        self.h = {"Authorization": f"Bearer {self.token}"}

    def url(self, rest: str = "") -> str:
        return f"/v1/sessions/{self.id}{rest}"

    def var(self, value=None, **kw) -> str:
        body = {**kw, **({"value": value} if value is not None else {})}
        r = self.http.post(self.url("/variables"), json=body, headers=self.h)
        assert r.status_code == 201, r.text
        return r.json()["id"]

    def submit(self, expect: int = 201, **body) -> dict:
        r = self.http.post(self.url("/calls"), json=body, headers=self.h)
        assert r.status_code == expect, r.text
        return r.json()

    def llm(self, template: str, inputs=None, max_tokens: int = 6, expect: int = 201, model: str = "smollm2",
            **outputs) -> dict:
        outs = outputs or {"out": {}}
        for o in outs.values():
            o.setdefault("sampling", {"max_tokens": max_tokens})
        return self.submit(expect, model=model, template=template, inputs=inputs or {}, outputs=outs)

    def get(self, vid: str, **params) -> httpx.Response:
        return self.http.get(self.url(f"/variables/{vid}"), params=params, headers=self.h)

    def value(self, vid: str, **params) -> str:
        r = self.get(vid, **params)
        assert r.status_code == 200, r.text
        return r.json()["value"]

    def delete(self) -> None:
        assert self.http.delete(self.url(), headers=self.h).status_code == 200


def idle_engine(live, model="smollm2", timeout=10.0) -> dict:
    deadline = time.time() + timeout
    while True:
        st = engine_state(live, model)
        if (st["contexts"] == 0 and st["used_blocks"] == 0) or time.time() > deadline:
            return st
        time.sleep(0.05)


# ------------------------------------------------------------------ sessions
def test_sessions_need_the_api_key_and_each_its_own_token(live, http):
    assert http.post("/v1/sessions").status_code == 401
    assert http.post("/v1/sessions", headers={"Authorization": "Bearer nope"}).status_code == 401
    a, b = S(http), S(http)
    va = a.var("secret of a")
    # no token, another session's token, a made-up session
    r = http.get(a.url(f"/variables/{va}"))
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_session_token"
    r = http.get(a.url(f"/variables/{va}"), headers=b.h)
    assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
    r = http.get("/v1/sessions/ses_nothere", headers=a.h)
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    # a's variable does not exist inside b: neither to read nor as an input of b's call
    r = b.get(va)
    assert r.status_code == 404 and r.json()["error"]["code"] == "variable_not_found"
    r = http.post(b.url("/calls"), headers=b.h, json={"model": "smollm2", "template": "{{input:x}} {{output:y}}",
                                                       "inputs": {"x": va}})
    assert r.status_code == 404 and r.json()["error"]["param"] == "inputs.x"
    assert a.value(va) == "secret of a"
    a.delete(), b.delete()
    # a deleted session is gone for its own token too
    assert http.get(a.url(), headers=a.h).status_code == 404


def test_session_create_validation(http):
    r = http.post("/v1/sessions", json={"ttl_s": -1}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "ttl_s"
    r = http.post("/v1/sessions", json={"tll_s": 5}, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "tll_s" in r.json()["error"]["message"]


# ------------------------------------------------------------------- the DAG
def test_diamond_runs_server_side_and_set_releases_waiting_calls(live, http):
    s = S(http)
    topic = s.var(name="topic")  # declared: everything waits for it
    a = s.llm("Topic: {{input:t}}. One word about it: {{output:out}}", {"t": topic})["outputs"]["out"]
    b = s.llm("Topic: {{input:t}}. Another word: {{output:out}}", {"t": topic})["outputs"]["out"]
    d = s.llm("Words: {{input:a}} and {{input:b}}. Joined: {{output:out}}", {"a": a, "b": b})
    info = http.get(s.url(), headers=s.h).json()
    assert info["calls"]["pending"] == 3 and info["calls"]["running"] == 0
    r = s.get(d["outputs"]["out"], timeout_s=0.2)  # nothing can run yet
    assert r.status_code == 408 and r.json()["error"]["code"] == "timeout"
    assert s.get(d["outputs"]["out"], timeout_s=0).status_code == 408  # "is it there yet?", answered at once
    assert http.put(s.url(f"/variables/{topic}"), json={"value": "tea"}, headers=s.h).status_code == 200
    final = s.value(d["outputs"]["out"], criterion="latency")
    va, vb = s.value(a), s.value(b)
    assert final and va and vb
    # the join's prompt really held both branches' values: its context starts with them
    assert http.get(s.url(f"/calls/{d['id']}"), headers=s.h).json()["state"] == "done"
    # variables are set once
    r = http.put(s.url(f"/variables/{topic}"), json={"value": "coffee"}, headers=s.h)
    assert r.status_code == 409 and r.json()["error"]["code"] == "variable_already_set"
    r = http.put(s.url(f"/variables/{a}"), json={"value": "x"}, headers=s.h)
    assert r.status_code == 409 and r.json()["error"]["code"] == "variable_has_producer"
    s.delete()


def test_a_failed_producer_reaches_every_get_downstream(live, http):
    s = S(http)
    x = s.var("not json at all")
    bad = s.llm("Say something: {{input:x}} {{output:out}}", {"x": x},
                out={"transform": {"json_field": "answer"}})
    after = s.llm("Use {{input:v}}: {{output:out}}", {"v": bad["outputs"]["out"]})
    later = s.llm("And then {{input:v}}: {{output:out}}", {"v": after["outputs"]["out"]})
    for vid in (bad["outputs"]["out"], later["outputs"]["out"]):
        r = s.get(vid)
        assert r.status_code == 424, r.text
        err = r.json()["error"]
        assert err["code"] == "producer_failed" and err["call"] == bad["id"]
        assert "json_field 'answer'" in err["message"] and "not JSON" in err["message"]
    # a call submitted after the failure fails at once, with the same cause
    late = s.llm("Too late {{input:v}} {{output:out}}", {"v": bad["outputs"]["out"]})
    assert late["state"] == "failed"
    # the stream reports it as an event, then [DONE]
    with http.stream("GET", s.url(f"/variables/{later['outputs']['out']}"), params={"stream": "true"},
                     headers=s.h) as st:
        lines = [line for line in st.iter_lines() if line]
    assert json.loads(lines[-2][6:])["error"]["call"] == bad["id"] and lines[-1] == "data: [DONE]"
    s.delete()


def test_cycles_unknown_variables_and_bad_templates_are_refused_keeping_nothing(live, http):
    s = S(http)
    v1, v2 = s.var(name="v1"), s.var(name="v2")
    s.llm("{{input:a}} {{output:out}}", {"a": v1}, out={"variable": v2})
    before = http.get(s.url(), headers=s.h).json()
    # v2 -> v1 would close v1 -> v2 -> v1
    r = s.llm("{{input:a}} {{output:out}}", {"a": v2}, expect=400, out={"variable": v1})
    assert r["error"]["code"] == "cycle"
    # a call reading its own output
    r = s.llm("{{input:a}} {{output:out}}", {"a": v1}, expect=400, out={"variable": v1})
    assert r["error"]["code"] == "cycle"
    cases = [
        (dict(template="{{input:a}} {{output:o}}", inputs={"a": "sv_missing"}), 404, "variable_not_found"),
        (dict(template="{{input:a}} {{output:o}}", inputs={}), 400, None),
        (dict(template="{{input:a}} {{output:o}}", inputs={"a": {"value": "x"}, "b": {"value": "y"}}), 400, None),
        (dict(template="no outputs {{input:a}}", inputs={"a": {"value": "x"}}), 400, None),
        (dict(template="{{output:o}}", outputs={"o": {"transform": {"regex": "("}}}), 400, None),
        (dict(template="{{output:o}}", outputs={"o": {"sampling": {"temperature": -1}}}), 400, None),
        (dict(template="{{output:o}}", outputs={"o": {"variable": v2}}), 409, "variable_has_producer"),
        (dict(template="{{output:o}}", model="gpt-4"), 404, "model_not_found"),
    ]
    for body, status, code in cases:
        body = {"model": "smollm2", **body}
        r = http.post(s.url("/calls"), json=body, headers=s.h)
        assert r.status_code == status, (body, r.text)
        if code:
            assert r.json()["error"]["code"] == code
    r = http.post(s.url("/calls"), json={"template": "{{output:o}}"}, headers=s.h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    after = http.get(s.url(), headers=s.h).json()
    assert after["variables"] == before["variables"] and after["calls"] == before["calls"]
    s.delete()


def test_transforms_and_constants(live, http):
    s = S(http)
    r = s.llm("Repeat exactly: {\"city\": \"Paris\"}\n{{output:out}}", max_tokens=12,
              out={"transform": {"strip": True, "regex": "[A-Z][a-z]+", "group": 0}})
    raw_stream = []
    with http.stream("GET", s.url(f"/variables/{r['outputs']['out']}"), params={"stream": "true"},
                     headers=s.h) as st:
        events = [json.loads(line[6:]) for line in st.iter_lines() if line and line != "data: [DONE]"]
    raw_stream = "".join(e["delta"] for e in events if "delta" in e)
    value = events[-1]["value"]
    import re
    assert value == re.search("[A-Z][a-z]+", raw_stream.strip()).group(0)
    assert value != raw_stream
    s.delete()


# ------------------------------------------------------------ sampling limits
@pytest.mark.parametrize("setting, ok", [
    ({"temperature": 50}, False),                        # SamplingParams' own bound is 100; the API's is 2
    ({"stop": [f"<s{i}>" for i in range(9)]}, True),     # up to 16 stop strings, not 8
    ({"stop": [f"<s{i}>" for i in range(17)]}, False),
    ({"seed": 2 ** 63}, False),                          # a seed within int64
    ({"temperature": None}, True),                       # null is "not given"
])
def test_a_semantic_call_samples_within_the_chat_routes_limits(live, http, setting, ok):
    """One set of sampling limits (gateway/sampling.py): a semantic call's ``sampling`` gets the
    answer the chat route gives the same settings, down to the code and the field named."""
    s = S(http)
    r = s.llm("Say hi. {{output:out}}", expect=201 if ok else 400, out={"sampling": {"max_tokens": 1, **setting}})
    chat = http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={"model": "smollm2", "messages": [{"role": "user", "content": "Say hi."}],
                           "max_tokens": 1, **setting})
    assert chat.status_code == (200 if ok else 400), chat.text
    if not ok:
        err, chat_err = r["error"], chat.json()["error"]
        assert err["code"] == chat_err["code"] == "invalid_value"
        assert err["param"] == f"outputs.out.sampling.{chat_err['param']}"
        assert err["message"] == f"outputs.out.sampling.{chat_err['message']}"
    s.delete()


# ---------------------------------------------------------------- tool nodes
def test_tool_nodes_need_the_permission_and_feed_llm_calls(live, http):
    plain = S(http)
    r = plain.submit(403, tool="calculator", arguments={"expression": "1+1"}, outputs={"r": {}})
    assert r["error"]["code"] == "permission_denied"
    plain.delete()
    s = S(http, TOOL_KEY)
    expr = s.var("6*7")
    r = s.submit(tool="calculator", arguments={"expression": "{{input:e}}"}, inputs={"e": expr},
                 outputs={"r": {"transform": {"json_field": "result"}}})
    assert s.value(r["outputs"]["r"]) == "42"
    r2 = s.llm("The answer is {{input:n}}. {{output:out}}", {"n": r["outputs"]["r"]})
    assert s.value(r2["outputs"]["out"]) is not None
    bad = s.submit(tool="calculator", arguments={"expression": "1/0"}, outputs={"r": {}})
    g = s.get(bad["outputs"]["r"])
    assert g.status_code == 424 and "calculator" in g.json()["error"]["message"]
    assert s.submit(404, tool="nonexistent", arguments={}, outputs={"r": {}})["error"]["code"] == "unknown_tool"
    # an enabled tool this key was not granted
    assert s.submit(403, tool="python", arguments={}, outputs={"r": {}})["error"]["code"] == "permission_denied"
    s.delete()


# ------------------------------------------------------------------ batches
def test_a_batch_submits_a_whole_dag_in_one_request(live, http):
    s = S(http)
    r = s.submit(calls=[
        {"model": "smollm2", "template": "Name a {{input:k}}: {{output:a}}", "inputs": {"k": {"value": "fruit"}},
         "outputs": {"a": {"sampling": {"max_tokens": 3}}}},
        {"model": "smollm2", "template": "{{input:x}} is {{output:b}}", "inputs": {"x": {"call": 0, "output": "a"}},
         "outputs": {"b": {"sampling": {"max_tokens": 3}}}},
        {"model": "smollm2", "template": "{{input:x}} {{input:y}}! {{output:c}}",
         "inputs": {"x": {"call": 0, "output": "a"}, "y": {"call": 1, "output": "b"}},
         "outputs": {"c": {"sampling": {"max_tokens": 3}}}}])
    calls = r["calls"]
    assert [set(c["outputs"]) for c in calls] == [{"a"}, {"b"}, {"c"}]
    assert s.value(calls[2]["outputs"]["c"]) is not None
    info = http.get(s.url(f"/calls/{calls[1]['id']}"), headers=s.h).json()
    assert info["inputs"] == {"x": calls[0]["outputs"]["a"]} and info["state"] == "done"
    s.delete()


def test_a_session_may_come_with_its_first_batch(live, http):
    h = {"Authorization": f"Bearer {KEY}"}
    call = {"model": "smollm2", "template": "Hi {{output:a}}", "outputs": {"a": {"sampling": {"max_tokens": 2}}}}
    r = http.post("/v1/sessions", json={"calls": [call]}, headers=h)
    assert r.status_code == 201, r.text
    body = r.json()
    s_h = {"Authorization": f"Bearer {body['token']}"}
    vid = body["calls"][0]["outputs"]["a"]
    assert http.get(f"/v1/sessions/{body['id']}/variables/{vid}", headers=s_h).json()["value"] is not None
    assert http.delete(f"/v1/sessions/{body['id']}", headers=s_h).status_code == 200
    before = len(live.gateway.sessions.sessions)
    bad = http.post("/v1/sessions", json={"calls": [call, {"model": "nope", "template": "{{output:b}}"}]}, headers=h)
    assert bad.status_code == 404 and bad.json()["error"]["message"].startswith("calls.1: ")
    assert len(live.gateway.sessions.sessions) == before  # no session kept
    assert http.post("/v1/sessions", json={"calls": [call]}).status_code == 401


def test_a_bad_batch_keeps_nothing_and_names_the_call(live, http):
    s = S(http)
    ok = {"model": "smollm2", "template": "Hi {{output:a}}", "outputs": {"a": {}}}
    r = s.submit(400, calls=[ok, {"model": "smollm2", "template": "{{input:x}}{{output:b}}",
                                  "inputs": {"x": {"call": 1, "output": "b"}}, "outputs": {"b": {}}}])
    assert r["error"]["message"].startswith("calls.1: ") and r["error"]["param"] == "calls.1.inputs.x"
    r = s.submit(400, calls=[ok, {"model": "smollm2", "template": "{{input:x}}{{output:b}}",
                                  "inputs": {"x": {"call": 0, "output": "zz"}}, "outputs": {"b": {}}}])
    assert "has no output 'zz'" in r["error"]["message"]
    declared = s.var(name="x")
    twice = {"model": "smollm2", "template": "{{output:a}}", "outputs": {"a": {"variable": declared}}}
    assert s.submit(409, calls=[twice, twice])["error"]["code"] == "variable_has_producer"
    # a cycle through an earlier call of the batch: 0 reads x, 1 writes x from 0's output
    cyc = s.submit(400, calls=[
        {"model": "smollm2", "template": "{{input:x}}{{output:a}}", "inputs": {"x": declared}, "outputs": {"a": {}}},
        {"model": "smollm2", "template": "{{input:y}}{{output:b}}", "inputs": {"y": {"call": 0, "output": "a"}},
         "outputs": {"b": {"variable": declared}}}])
    assert cyc["error"]["code"] == "cycle" and cyc["error"]["message"].startswith("calls.1: ")
    assert s.submit(400, calls=[])["error"]["param"] == "calls"
    assert s.submit(400, calls=[ok], extra=1)["error"]["param"] == "calls"
    # outside a batch, a reference to another call is not a binding
    assert "variable id" in s.submit(400, model="smollm2", template="{{input:x}}{{output:b}}",
                                     inputs={"x": {"call": 0, "output": "a"}}, outputs={"b": {}})["error"]["message"]
    info = http.get(s.url(), headers=s.h).json()
    assert info["variables"] == 1 and sum(info["calls"].values()) == 0  # only the declared variable
    s.delete()


# ---------------------------------------------------- chat prompts as messages
CHAT = [("system", "You are terse. The topic is {{input:topic}}."),
        ("user", "Tell me one fact about {{input:topic}}, in a sentence.\n\n{{input:extra}}")]


def test_a_messages_call_reads_the_prompt_the_chat_endpoint_reads(live, http):
    """Greedy output of a messages call equals /v1/chat/completions on the same messages:
    the prompt is tokenized whole, not piece by piece ("about " + "cats" would be other ids)."""
    s = S(http)
    topic = s.var("cats")
    extra = s.var("Keep it short.")
    r = s.submit(model="smollm2", messages=[{"role": role, "content": c} for role, c in CHAT]
                 + [{"role": "assistant", "content": "{{output:answer}}"}],
                 inputs={"topic": topic, "extra": extra},
                 outputs={"answer": {"sampling": {"max_tokens": 12, "temperature": 0}}})
    got = s.value(r["outputs"]["answer"])
    rendered = [{"role": role, "content": c.replace("{{input:topic}}", "cats")
                 .replace("{{input:extra}}", "Keep it short.")} for role, c in CHAT]
    chat = http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                     json={"model": "smollm2", "messages": rendered, "max_tokens": 12, "temperature": 0})
    assert chat.status_code == 200, chat.text
    assert got == chat.json()["choices"][0]["message"]["content"] and got
    # the same through a chat template call (one user turn) and the plain chat endpoint
    r2 = s.submit(model="smollm2", template="What is a {{input:topic}}?{{output:out}}", chat=True,
                  inputs={"topic": topic}, outputs={"out": {"sampling": {"max_tokens": 8, "temperature": 0}}})
    chat2 = http.post("/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "smollm2", "messages": [{"role": "user", "content": "What is a cats?"}],
                            "max_tokens": 8, "temperature": 0})
    assert s.value(r2["outputs"]["out"]) == chat2.json()["choices"][0]["message"]["content"]
    s.delete()


@pytest.mark.parametrize("messages, problem", [
    ("hi", "list of {role, content}"),
    ([{"role": "assistant", "content": "{{output:a}}"}], "list of {role, content}"),
    ([{"role": "user", "content": "x"}, {"role": "user", "content": "{{output:a}}"}], "last message"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "so: {{output:a}}"}], "last message"),
    ([{"role": "user", "content": "{{output:b}}"}, {"role": "assistant", "content": "{{output:a}}"}],
     "only be the last"),
    ([{"role": "robot", "content": "x"}, {"role": "assistant", "content": "{{output:a}}"}], "role must be"),
    ([{"role": "user", "content": 3}, {"role": "assistant", "content": "{{output:a}}"}], "must be a string"),
    ([{"role": "user", "content": "x", "name": "n"}, {"role": "assistant", "content": "{{output:a}}"}],
     "exactly 'role' and 'content'"),
])
def test_bad_messages_are_refused_keeping_nothing(live, http, messages, problem):
    s = S(http)
    r = s.submit(400, model="smollm2", messages=messages, outputs={"a": {}})
    assert problem in r["error"]["message"], r
    both = s.submit(400, model="smollm2", template="{{output:a}}", outputs={"a": {}},
                    messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "{{output:a}}"}])
    assert "not both" in both["error"]["message"]
    assert http.get(s.url(), headers=s.h).json()["variables"] == 0
    s.delete()


# ------------------------------------------------------------ prefix sharing
def test_a_shared_prefix_is_filled_once_and_forked(live, http):
    """Three calls sharing a long instruction and a document, dispatched
    together when the document is set, on an engine without its block-hash
    prefix cache: the shared part is prefilled once."""
    eng = live.gateway.models["nocache"].engine
    s = S(http)
    doc = s.var(name="doc")
    tmpl = SYSTEM + "Document: {{input:d}}\nQuestion: {{input:q}}\nAnswer: {{output:out}}"
    qs = ["Who?", "Where is it?", "When did it happen?"]
    calls = [s.llm(tmpl, {"d": doc, "q": {"value": q}}, model="nocache", max_tokens=2) for q in qs]
    text = "The harbour of the old town was rebuilt in stone after the great storm. " * 6
    before = eng.stats["prefill_tokens"]
    http.put(s.url(f"/variables/{doc}"), json={"value": text}, headers=s.h)
    for c in calls:
        s.value(c["outputs"]["out"])
    prefilled = eng.stats["prefill_tokens"] - before
    usage = http.get(s.url(), headers=s.h).json()["usage"]
    tok = live.gateway.models["nocache"].tokenizer
    # the prompt is tokenized whole and cut at variable boundaries: shared are the tokens that
    # end before the question (a token straddling the boundary belongs to the question's piece)
    head = SYSTEM + "Document: " + text + "\nQuestion: "
    ids, ends = tok.encode_pieces_with_ends([(head + qs[0] + "\nAnswer: ", False)])
    shared = bisect.bisect_right(ends, len(head))
    assert 0 < len(head) - ends[shared - 1] < 3  # cut at the boundary
    assert usage["forked_tokens"] == 2 * shared
    assert usage["cached_tokens"] == 2 * shared  # no prefix cache here: what the forks took
    assert usage["filled_tokens"] == usage["prompt_tokens"] - 2 * shared
    # the engine computed the shared prefix once (plus each call's own question and the decodes' inputs)
    assert shared + 3 * 4 <= prefilled < 2 * shared, (prefilled, shared)
    metrics = http.get("/metrics").text
    forked = [ln for ln in metrics.splitlines()
              if ln.startswith("interlace_semantic_prompt_tokens_total") and 'kind="forked"' in ln
              and 'model="nocache"' in ln]
    assert forked and float(forked[0].split()[-1]) >= 2 * shared
    assert "interlace_sessions " in metrics
    s.delete()
    st = idle_engine(live, "nocache")
    assert st["contexts"] == 0 and st["used_blocks"] == 0


# -------------------------------------------------------------- objectives
def test_deduced_objectives_are_reported_and_reach_the_engine(live, http):
    s = S(http)
    src = s.var(name="src")
    maps = [s.llm("Part {{input:i}} of {{input:s}}: {{output:out}}", {"i": {"value": str(i)}, "s": src})
            for i in range(3)]
    red = s.llm("Combine {{input:a}} {{input:b}} {{input:c}}: {{output:out}}",
                dict(zip("abc", (m["outputs"]["out"] for m in maps))))
    assert s.get(red["outputs"]["out"], criterion="latency", timeout_s=0.1).status_code == 408
    infos = [http.get(s.url(f"/calls/{c['id']}"), headers=s.h).json() for c in maps + [red]]
    assert infos[-1]["objective"] == "latency" and infos[-1]["task_group"] is None
    groups = {i["task_group"] for i in infos[:-1]}
    assert len(groups) == 1 and None not in groups and all(i["objective"] == "throughput" for i in infos[:-1])
    # what the engine's ranking reads, for contexts the calls create
    seen = {}
    eng = live.gateway.models["smollm2"].engine
    orig = eng.fill

    async def spy(cid, tokens, parent_context_id=None, hint=None):
        seen[cid] = hint
        return await orig(cid, tokens, parent_context_id=parent_context_id, hint=hint)

    eng.fill = spy
    try:
        http.put(s.url(f"/variables/{src}"), json={"value": "a story"}, headers=s.h)
        s.value(red["outputs"]["out"])
    finally:
        del eng.fill
    by_call = {cid[2]: h for cid, h in seen.items() if cid[0] == "sv"}
    assert by_call[red["id"]].objective == "latency"
    assert {by_call[m["id"]].task_group for m in maps} == groups
    s.delete()


# ---------------------------------------------------------------- limits
def test_session_limits_are_clear_4xx(live, http):
    s = S(http)
    big = "x" * 40_000
    s.var(big)
    r = http.post(s.url("/variables"), json={"value": big}, headers=s.h)
    assert r.status_code == 413 and r.json()["error"]["code"] == "session_bytes"
    blocker = s.var(name="never")
    for _ in range(8):
        s.llm("{{input:a}} {{output:out}}", {"a": blocker})
    r = http.post(s.url("/calls"), headers=s.h, json={"model": "smollm2", "template": "{{input:a}} {{output:o}}",
                                                      "inputs": {"a": blocker}})
    assert r.status_code == 429 and r.json()["error"]["code"] == "session_limit"
    s.delete()


# --------------------------------------------------------- freeing
def test_delete_aborts_running_calls_and_frees_everything(live, http):
    s = S(http)
    long = s.llm(SYSTEM + "Write a long story about {{input:t}}: {{output:out}}", {"t": {"value": "the sea"}},
                 max_tokens=400)
    waiting = s.llm("{{input:a}} {{output:out}}", {"a": long["outputs"]["out"]})
    # running means holding KV: a context exists a moment before its first step allocates blocks
    # (a clean-clone CI run read contexts 1, used_blocks 0 in between)
    deadline = time.time() + 60
    while engine_state(live)["used_blocks"] == 0 and time.time() < deadline:
        time.sleep(0.02)
    assert engine_state(live)["used_blocks"] > 0
    s.delete()
    st = idle_engine(live)
    assert st["contexts"] == 0 and st["used_blocks"] == 0, st
    assert http.get(s.url(f"/variables/{waiting['outputs']['out']}"), headers=s.h).status_code == 404


def test_idle_sessions_expire_and_free_their_contexts(live, http):
    s = S(http, ttl_s=0.6)
    r = s.llm(SYSTEM + "Say hi to {{input:n}}: {{output:out}}", {"n": {"value": "Ann"}})
    assert s.value(r["outputs"]["out"]) is not None
    s.var(name="unused")
    time.sleep(1.5)
    assert http.get(s.url(), headers=s.h).status_code == 404
    assert s.id not in live.gateway.sessions.sessions
    st = idle_engine(live)
    assert st["contexts"] == 0 and st["used_blocks"] == 0, st


# ---------------------------------------------------------------- openapi
def test_openapi_lists_every_route_with_its_description(live, http):
    from interlace.gateway.openapi import OPERATIONS

    doc = http.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    listed = {(p, m) for p, ops in doc["paths"].items() for m in ops}

    def served_by(routes, prefix=""):  # mounted groups (the session routes) included
        for r in routes:
            if isinstance(r, Mount):
                yield from served_by(r.routes, prefix + r.path)
            elif r.include_in_schema:  # not: the trailing-slash redirect
                path = re.sub(r"\{(\w+):\w+\}", r"{\1}", prefix + r.path)  # /v1/models/{id:path}: {id}
                yield from ((path, m.lower()) for m in (r.methods or ()) if m != "HEAD")

    served = set(served_by(live.app.routes))
    assert served == listed
    assert served <= set(OPERATIONS), served - set(OPERATIONS)
    assert ("/v1/sessions/{sid}/variables/{vid}", "get") in listed
    # the session routes are one mounted group; their path parameters are still documented
    assert [r.path for r in live.app.routes if isinstance(r, Mount)] == ["/v1/sessions"]
    params = doc["paths"]["/v1/sessions/{sid}/variables/{vid}"]["get"]["parameters"]
    assert [p["name"] for p in params if p["in"] == "path"] == ["sid", "vid"]


def test_sampling_limits_are_written_once():
    """The chat schema, the semantic calls' check and the OpenAPI document read one set of limits."""
    from interlace.gateway import openapi, sampling
    from interlace.gateway.openai import wire

    for key, limits in sampling.PROPERTIES.items():
        assert wire.CHAT_REQUEST_SCHEMA["properties"][key] is limits
    assert wire.CHAT_REQUEST_SCHEMA["properties"]["max_completion_tokens"] is sampling.PROPERTIES["max_tokens"]
    assert openapi.SAMPLING["properties"] is sampling.PROPERTIES


def test_a_trailing_slash_redirects_to_the_sessions_route(http):
    """``/v1/sessions/`` is below the mounted group; it redirects to ``/v1/sessions`` (307, method and
    body kept) as Starlette redirects every other route's trailing slash."""
    r = http.post("/v1/sessions/", json={}, headers={"Authorization": f"Bearer {KEY}"}, follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"].endswith("/v1/sessions")
    assert http.get("/v1/chat/completions/", follow_redirects=False).status_code == 307  # the same as elsewhere
