"""The XML tool-call formats, qwen3_coder and glm45, end to end through the HTTP API, and their forcing grammars.

One gateway serves the embedded model under both parser names (the models differ only in name and parser,
so they share one engine).  For each format, as test_formats_e2e.py does for the others: auto with replayed
calls (parallel), streaming deltas that reassemble, ``tool_choice`` required / named (the format's grammar,
real decoding: the arguments validate against the schemas), a server-side tool whose result is fed back.
Then the grammars themselves, on the model's tokenizer: they accept the formats' renderings, refuse string
values holding the tags that would end them, and raise ``CannotForce`` for names the formats cannot write.
"""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, Tuple

import httpx
import jsonschema
import openai
import pytest
import torch

from helpers.chat import assemble, calls_of, post
from helpers.gateway_server import LiveGateway
from interlace.parsers import ToolCallEnd
from interlace.parsers.builtin import BUILTIN_PARSERS
from interlace.parsers.formats import CannotForce

NAMES = ["qwen3_coder", "glm45"]
# bounded strings: the raw text a grammar lets the small model write ends within a short max_tokens
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 32}},
                   "required": ["timezone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
USER = [{"role": "user", "content": "What is the weather like in Paris for three days, and what time is it there?"}]
CALLS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"timezone": "Europe/Paris"})]

Call = Tuple[str, Dict[str, Any]]


def _text(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


# how each model writes calls, by hand (independently of the formats' own rendering): Qwen3-Coder's layout,
# and GLM-4.7's (no line breaks) for glm45, whose format renders GLM-4.5's
WRITE: Dict[str, Callable[[List[Call]], str]] = {
    "qwen3_coder": lambda cs: "\n".join(
        f"<tool_call>\n<function={n}>\n" + "".join(f"<parameter={k}>\n{_text(v)}\n</parameter>\n" for k, v in a.items())
        + "</function>\n</tool_call>" for n, a in cs),
    "glm45": lambda cs: "".join(
        f"<tool_call>{n}" + "".join(f"<arg_key>{k}</arg_key><arg_value>{_text(v)}</arg_value>" for k, v in a.items())
        + "</tool_call>" for n, a in cs),
}


@pytest.fixture(scope="module")
def live():
    m = {"path": "embedded", "kv_cache_tokens": 8192, "dtype": "float32", "max_model_len": 2048}
    cfg = {"server": {"server_tools": True, "replay": True}, "models": {name: {**m, "parser": name} for name in NAMES}}
    with LiveGateway(cfg) as gw:
        yield gw


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=600)





# ===================================================================== over HTTP
@pytest.mark.parametrize("name", NAMES)
def test_auto_parallel_calls_typed_by_the_schema(client, name):
    """Replayed calls come back as tool_calls, ``days`` typed as the integer the schema says, text before the
    calls as content."""
    r = client.chat.completions.create(model=name, messages=USER, tools=[WEATHER, TIME], max_tokens=150,
                                       extra_body={"interlace": {"replay": "Checking.\n" + WRITE[name](CALLS)}})
    ch = r.choices[0]
    assert calls_of(ch.message) == CALLS, ch.message
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Checking.\n"
    assert all(tc.id.startswith("call_") for tc in ch.message.tool_calls)


@pytest.mark.parametrize("name", NAMES)
def test_streaming_deltas_reassemble(client, name):
    chunks = list(client.chat.completions.create(model=name, messages=USER, tools=[WEATHER, TIME], max_tokens=150,
                                                 stream=True, extra_body={"interlace": {"replay": WRITE[name](CALLS)}}))
    got = assemble(chunks)
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == CALLS
    assert [c["arguments"] for c in got] == [json.dumps(a) for _, a in CALLS]  # the JSON rendering, exactly
    assert all(c["id"].startswith("call_") for c in got)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


@pytest.mark.parametrize("name", NAMES)
def test_required_and_named_are_forced_in_the_format(client, name):
    """Real decoding under the format's grammar: whatever the small model writes, the format's parser reads
    tool calls whose arguments fit the schemas."""
    r = client.chat.completions.create(model=name, messages=USER, tools=[WEATHER, TIME], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=120, temperature=0)
    ch = r.choices[0]
    ((fn, args),) = calls_of(ch.message)
    jsonschema.validate(args, SCHEMAS[fn])
    assert ch.finish_reason == "tool_calls" and not (ch.message.content or "").strip()
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model=name, messages=USER, tools=[WEATHER, TIME], max_tokens=120,
                                       temperature=0, tool_choice=named)
    ((fn, args),) = calls_of(r.choices[0].message)
    assert fn == "get_time"
    jsonschema.validate(args, SCHEMAS["get_time"])


@pytest.mark.parametrize("name", NAMES)
def test_a_replay_must_satisfy_the_forcing_grammar(live, name):
    """A replay under ``required`` is checked against the format's grammar: a string value holding the tag that
    would end it is refused (the grammar tests below check what it accepts)."""
    form = BUILTIN_PARSERS[name].format
    bad = form.render_calls([("get_weather", {"city": f"Pa{form.FORBIDDEN_IN_STRINGS[0]}ris"})])
    r = post(live, {"model": name, "messages": USER, "tools": [WEATHER, TIME], "tool_choice": "required",
                    "max_tokens": 150, "interlace": {"replay": bad}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "interlace.replay", r.text


@pytest.mark.parametrize("name", NAMES)
def test_server_side_tool_result_fed_back(client, name):
    body = dict(model=name, messages=[{"role": "user", "content": "What is 6 times 7?"}], max_tokens=150,
                extra_body={"interlace": {"server_tools": ["calculator"],
                                          "replay": [WRITE[name]([("calculator", {"expression": "6*7"})]),
                                                     "It is 42."]}})
    r = client.chat.completions.create(**body)
    ch = r.choices[0]
    assert ch.message.content.endswith("It is 42.") and ch.finish_reason == "stop", ch.message
    assert ch.message.tool_calls is None
    (res,) = r.model_extra["interlace"]["tool_calls"]
    assert res["name"] == "calculator" and res["ok"] and res["index"] == 0, res
    assert "42" in json.dumps(res["content"])


# ===================================================================== the grammars
@pytest.fixture(scope="module")
def compiler(live):
    return live.gateway.models["qwen3_coder"].grammar()


def _feed(compiler, grammar, text):
    """Drive a processor with ``text``'s tokens, checking each was allowed; the processor after them."""
    tok = compiler.tokenizer
    proc = compiler.processor(grammar)
    ids = tok.encode(text)
    for i, t in enumerate(ids):
        out = proc(ids[:i], torch.zeros(compiler.vocab_size))
        assert out[t] == 0.0, f"token {i} {tok.decode([t])!r} of {text!r} was masked"
    proc(ids, torch.zeros(compiler.vocab_size))  # consumes the last one
    return proc


KINDS = {"type": "function", "function": {"name": "kinds", "parameters": {
    "type": "object", "properties": {
        "text": {"type": "string"},
        "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]+$"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "note": {"anyOf": [{"type": "string", "maxLength": 8}, {"type": "null"}]},
        "n": {"type": "number"}, "flags": {"type": "array", "items": {"type": "boolean"}},
        "opts": {"type": "object", "properties": {"deep": {"type": "string"}}}},
    "required": ["text", "code"]}}}
KIND_ARGS = {"text": "multi\nline <b>tags</b> </param and </parameter", "code": "AB12", "unit": "celsius",
             "note": "short", "n": -1.5, "flags": [True, False], "opts": {"deep": "<b>x</b> {}"}}


@pytest.mark.parametrize("name", NAMES)
def test_grammar_accepts_the_rendering_and_the_parser_reads_it_back(compiler, name):
    """Every kind of value: raw strings (free, with a pattern, an enum, a nullable bounded one) and JSON values;
    optional parameters left out; parallel calls; one call, then only EOS."""
    form = BUILTIN_PARSERS[name].format
    tools = [KINDS, WEATHER]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    cases = [[("kinds", KIND_ARGS)], [("kinds", {"text": "", "code": "ZZ0"}), ("get_weather", {"city": "Oslo"})]]
    for calls in cases:
        text = form.render_calls(calls)
        proc = _feed(compiler, compiler.tool_calls(form, tools, force=None, parallel=len(calls) > 1), text)
        assert proc.matcher.is_accepting(), text
        events = BUILTIN_PARSERS[name](tools=schemas).parse(text)
        assert [(e.name, e.arguments) for e in events if isinstance(e, ToolCallEnd)] == calls
    proc = _feed(compiler, compiler.tool_calls(form, tools, force="get_weather", parallel=False),
                 form.render_call("get_weather", {"city": "Oslo", "days": 2}))
    assert proc.done


@pytest.mark.parametrize(("name", "args"), [
    ("qwen3_coder", {"text": "a\n</parameter>\nb", "code": "AB1"}),
    ("qwen3_coder", {"text": "x\n<parameter=n>\n1", "code": "AB1"}),
    ("qwen3_coder", {"text": "x</function>", "code": "AB1"}),
    ("qwen3_coder", {"text": "ok", "code": "ab1"}),            # the pattern
    ("qwen3_coder", {"text": "ok", "code": "AB1", "unit": "kelvin"}),
    ("qwen3_coder", {"text": "ok", "code": "AB1", "note": "far too long"}),
    ("glm45", {"text": "a</arg_value>b", "code": "AB1"}),
    ("glm45", {"text": "ok", "code": "AB1", "n": "one"}),       # not a number
])
def test_grammar_refuses_what_would_not_read_back(compiler, name, args):
    form = BUILTIN_PARSERS[name].format
    with pytest.raises(AssertionError, match="was masked"):
        _feed(compiler, compiler.tool_calls(form, [KINDS], force=None, parallel=False), form.render_call("kinds", args))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("tool", [
    lambda tag: {"name": "two words", "parameters": {"type": "object"}},
    lambda tag: {"name": "f", "parameters": {"type": "object", "properties": {"a<b": {}}}},
    lambda tag: {"name": "f", "parameters": {"type": "object", "properties": {"e": {"type": "string", "enum": [tag]}}}},
], ids=["function name", "parameter name", "enum"])
def test_what_a_format_cannot_write_cannot_be_forced(compiler, name, tool):
    """A name the format's parser would not read, or a string enum whose every value holds an end tag."""
    form = BUILTIN_PARSERS[name].format
    with pytest.raises(CannotForce):
        compiler.tool_calls(form, [{"type": "function", "function": tool(form.FORBIDDEN_IN_STRINGS[0])}],
                            force=None, parallel=False)


@pytest.fixture(scope="module")
def special_compiler():
    """A compiler for the embedded model's tokenizer with the formats' markers added as special tokens, as Qwen3's
    and GLM's tokenizers have them: the grammars must then write them as those tokens."""
    from tokenizers import AddedToken

    from interlace.engine_ext.constraints.grammar import GrammarCompiler
    from interlace.engine_ext.embedded import embedded_model_dir
    from interlace.engine_ext.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(embedded_model_dir())
    tok.tok.add_special_tokens([AddedToken(t, special=True) for t in BUILTIN_PARSERS["glm45"].format.special_tokens])
    return GrammarCompiler(tok)


@pytest.mark.parametrize("name", NAMES)
def test_grammar_with_the_markers_as_special_tokens(special_compiler, name):
    gc, form = special_compiler, BUILTIN_PARSERS[name].format
    assert gc.marker("<tool_call>").startswith("<[")  # the token, not its text

    def feed(text):
        proc = gc.processor(gc.tool_calls(form, [WEATHER, TIME], force=None, parallel=True))
        ids = gc.tokenizer.tok.encode(text, add_special_tokens=False).ids
        for i, t in enumerate(ids):
            out = proc(ids[:i], torch.zeros(gc.vocab_size))
            assert out[t] == 0.0, f"token {i} {gc.tokenizer.tok.id_to_token(t)!r} of {text!r} was masked"
        proc(ids, torch.zeros(gc.vocab_size))
        return proc

    assert feed(form.render_calls(CALLS)).matcher.is_accepting()
    with pytest.raises(AssertionError, match="was masked"):
        feed(form.render_call("get_weather", {"city": f"a{form.FORBIDDEN_IN_STRINGS[0]}b"}))
