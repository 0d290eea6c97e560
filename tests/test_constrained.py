"""Constrained decoding (engine_ext/constraints/grammar.py) on the embedded SmolLM2:
greedy decoding under a grammar yields JSON valid against a schema, a JSON
object, and hermes tool calls for tool_choice "required" / a named function;
invalid constraints raise GrammarError (CannotForce where a format cannot force calls);
processors keep per-request state."""

import asyncio
import json
import re

import jsonschema
import pytest
import torch

from helpers import run
from interlace.engine_ext.protocol import SamplingParams
from interlace.engine_ext.constraints.grammar import ConstraintViolation, GrammarCompiler, GrammarError
from interlace.parsers import ToolCallEnd
from interlace.parsers.builtin import BUILTIN_PARSERS
from interlace.parsers.formats import HERMES, CannotForce

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 40},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CALL_RE = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.S)


@pytest.fixture(scope="module")
def compiler(smol_engine):
    return GrammarCompiler(smol_engine.tokenizer, vocab_size=smol_engine.vocab_size)


async def _generate(engine, cid, prompt, proc, max_tokens=80):
    await engine.fill(cid, engine.tokenizer.encode_chat([{"role": "user", "content": prompt}]))
    try:
        events = [ev async for ev in engine.generate(cid, SamplingParams(max_tokens=max_tokens,
                                                                         logits_processors=[proc]))]
    finally:
        await engine.free_context(cid)
    return "".join(e.text for e in events), events[-1].finish_reason


def _check_calls(text, allowed_names):
    calls = CALL_RE.findall(text)
    assert calls and CALL_RE.sub("", text).strip() == "", text  # nothing but tool calls
    for body in calls:
        call = json.loads(body)
        assert set(call) == {"name", "arguments"}
        assert call["name"] in allowed_names
        jsonschema.validate(call["arguments"], PARAMS[call["name"]])
    return [json.loads(b) for b in calls]


# ------------------------------------------------------------ with the model
def test_json_schema(smol_engine, compiler):
    proc = compiler.processor(compiler.json_schema(PERSON))
    text, finish = run(_generate(smol_engine, "cd-schema", "Describe a person as JSON.", proc))
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)
    assert proc.done and proc.steps > 0


def _unique_keys(pairs):
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), f"repeated key in {pairs}"
    return dict(pairs)


JSON_OBJECT_PROMPTS = ["Give me a JSON object describing Paris.", "List three fruits and their colours as JSON.",
                       "Return a JSON object with your name and age.", "Describe a cat in JSON."]


def test_json_object_terminates(smol_engine, compiler):
    """json_object used to loop on repeated keys until max_tokens ('{", ": 3, ": 3, ...' on the fruit
    prompt): with unique keys and a bounded object each prompt ends with EOS, a JSON object with unique
    keys.  The prompts decode concurrently (one batch), to keep the test short."""
    async def all_prompts():
        return await asyncio.gather(*(
            _generate(smol_engine, f"cd-object-{i}", p, compiler.processor(compiler.json_object()), max_tokens=256)
            for i, p in enumerate(JSON_OBJECT_PROMPTS)))

    for text, finish in run(all_prompts()):
        assert finish == "stop", text
        assert isinstance(json.loads(text, object_pairs_hook=_unique_keys), dict)


def test_repeated_key_is_masked(compiler):
    tok = compiler.tokenizer
    close_key = tok.encode('a": 2')[1]  # the token that closes a key and writes the colon
    assert tok.decode([close_key]).startswith('"')
    for prefix, repeats in [('{"a": 1, "a', True), ('{"a": 1, "b', False), ('{"b": {"a": 1}, "a', False),
                            ('{"b": {"a": 1, "a', True), ('{"a": [{"a": 1}], "c": {"a', False)]:
        _, out = _feed(compiler, compiler.json_object(), prefix)
        assert bool(torch.isinf(out[close_key])) == repeats, prefix


def test_json_object_is_bounded(compiler):
    """Past 16 members only '}' may follow (a model inventing new keys forever still has to stop)."""
    members = ", ".join(f'"k{i}": "v"' for i in range(16))
    _, out = _feed(compiler, compiler.json_object(), "{" + members)
    allowed = [compiler.tokenizer.decode([t]) for t in torch.isfinite(out).nonzero().flatten().tolist()]
    assert allowed and all(a.startswith("}") for a in allowed), allowed[:10]
    for bad in ('{", ', '{"a": 1e999', '{"a": NaN', '{"a": 1, "a": 2'):  # the degenerate keys it looped on
        with pytest.raises(AssertionError, match="was masked"):
            _feed(compiler, compiler.json_object(), bad)


def test_tool_choice_required(smol_engine, compiler):
    g = compiler.tool_calls(HERMES, TOOLS, force=None, parallel=False)
    text, finish = run(_generate(smol_engine, "cd-required", "What is the weather in Paris?",
                                 compiler.processor(g)))
    assert finish == "stop"
    assert len(_check_calls(text, {"get_weather", "add"})) == 1


def test_tool_choice_named(smol_engine, compiler):
    g = compiler.tool_calls(HERMES, TOOLS, force="add", parallel=False)
    text, finish = run(_generate(smol_engine, "cd-named", "What is the weather in Paris?",
                                 compiler.processor(g)))
    assert finish == "stop"
    assert [c["name"] for c in _check_calls(text, {"add"})] == ["add"]  # forced, though it fits badly


def test_processors_are_per_request_in_one_batch(smol_engine, compiler):
    """Two concurrent requests (decoded in the same batches), different grammars."""
    schema_g = compiler.json_schema(PERSON)
    tools_g = compiler.tool_calls(HERMES, TOOLS, force="get_weather", parallel=False)

    async def both():
        return await asyncio.gather(
            _generate(smol_engine, "cd-b1", "Describe a person as JSON.", compiler.processor(schema_g)),
            _generate(smol_engine, "cd-b2", "What is the weather in Rome?", compiler.processor(tools_g)))

    (t1, f1), (t2, f2) = run(both())
    assert f1 == f2 == "stop"
    jsonschema.validate(json.loads(t1), PERSON)
    assert [c["name"] for c in _check_calls(t2, {"get_weather"})] == ["get_weather"]


# ------------------------------------------------- grammar-level, no decoding
def _feed(compiler, grammar, text, width=None):
    """Drive a processor with ``text``'s tokens, checking each was allowed;
    returns the processor and the mask after the last token."""
    tok = compiler.tokenizer
    width = width or compiler.vocab_size
    proc = compiler.processor(grammar)
    ids = tok.encode(text)
    for i, t in enumerate(ids):
        out = proc(ids[:i], torch.zeros(width))
        assert out[t] == 0.0, f"token {i} {tok.decode([t])!r} of {text!r} was masked"
    return proc, proc(ids, torch.zeros(width))


def test_complete_grammar_allows_only_eos(compiler):
    proc, out = _feed(compiler, compiler.json_schema(PERSON), '{"name": "Ann", "age": 3, "colour": "red"}')
    assert proc.done
    allowed = torch.isfinite(out).nonzero().flatten().tolist()
    assert sorted(allowed) == sorted(compiler.eos_token_ids)


def test_wider_logits_mask_padding(compiler):
    """A model whose logits are wider than the tokenizer: padded ids stay masked."""
    width = compiler.vocab_size + 64
    _, out = _feed(compiler, compiler.json_object(), '{"a": ', width=width)
    assert out.shape[0] == width and torch.isinf(out[compiler.vocab_size:]).all()


def test_parallel_calls_then_eos(compiler):
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    g = compiler.tool_calls(HERMES, TOOLS, force=None, parallel=True)
    proc, out = _feed(compiler, g, call + "\n" + call.replace("add", "get_weather").replace(
        '{"a": 1, "b": 2}', '{"city": "Oslo", "unit": "celsius"}'))
    eos = sorted(compiler.eos_token_ids)[0]
    assert torch.isfinite(out[eos])  # may stop, or go on with another call
    single = compiler.tool_calls(HERMES, TOOLS, force=None, parallel=False)
    proc, out = _feed(compiler, single, call)
    assert proc.done  # one call only: EOS next


@pytest.mark.parametrize("fmt,text", [
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
                '{"name": "add", "arguments": {"a": 3, "b": 4}}]'),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                    '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}'),
    ("pythonic", '[add(a=1, b=2), get_weather(city="Oslo", unit="celsius")]'),
])
def test_other_tool_call_formats(compiler, fmt, text):
    proc, _ = _feed(compiler, compiler.tool_calls(BUILTIN_PARSERS[fmt].format, TOOLS, force=None, parallel=True), text)
    assert proc.matcher.is_accepting()


CALLS = [("add", {"a": 1, "b": -2}), ("get_weather", {"city": "Oslo \"N\"", "unit": "celsius"})]


@pytest.mark.parametrize("fmt", sorted(BUILTIN_PARSERS))
def test_format_grammar_accepts_its_own_rendering(compiler, fmt):
    """One definition per format: the grammar a format forces accepts exactly what the format renders
    (and the parser reads back), for a single call and for parallel calls; plan cannot be forced."""
    form = BUILTIN_PARSERS[fmt].format
    if fmt == "plan":
        with pytest.raises(CannotForce, match="plan"):
            compiler.tool_calls(form, TOOLS, force=None, parallel=True)
        return
    tools, cases = TOOLS, [CALLS[:1], CALLS]
    if fmt == "markdown":
        tools = [{"type": "function", "function": {"name": "python", "parameters": {
            "type": "object", "properties": {"code": {"type": "string"}}}}}]
        cases = [[("python", {"code": "x = 1\nprint(x)  # ``\n"})]]
    for calls in cases:
        text = form.render_calls(calls)
        g = compiler.tool_calls(form, tools, force=None, parallel=len(calls) > 1)
        proc, out = _feed(compiler, g, text)
        assert proc.matcher.is_accepting(), (fmt, text)
        parsed = BUILTIN_PARSERS[fmt]().parse(text)
        assert [(e.name, e.arguments) for e in parsed if isinstance(e, ToolCallEnd)] == calls
    if fmt != "markdown":
        one = compiler.tool_calls(form, TOOLS, force="add", parallel=False)
        proc, out = _feed(compiler, one, form.render_calls(CALLS[:1]))
        assert proc.done  # one call only: EOS next


def test_wrong_tool_name_is_masked(compiler):
    g = compiler.tool_calls(HERMES, TOOLS, force="add", parallel=False)
    tok = compiler.tokenizer
    prefix = tok.encode('<tool_call>\n{"name": "')
    proc = compiler.processor(g)
    for i in range(len(prefix) + 1):
        out = proc(prefix[:i], torch.zeros(compiler.vocab_size))
    assert torch.isinf(out[tok.encode("get")[0]]) and torch.isfinite(out[tok.encode("add")[0]])


@pytest.mark.parametrize("schema", [
    {"type": "foo"},                                  # not a JSON Schema
    {"properties": 3},
    "not a schema",
    {"type": "string", "format": "no-such-format"},   # valid, but llguidance cannot enforce it
    False,
])
def test_invalid_schema_raises(compiler, schema):
    with pytest.raises(GrammarError):
        compiler.json_schema(schema)


@pytest.mark.parametrize("kwargs,error", [
    ({"tools": TOOLS, "force": "nope"}, GrammarError),
    ({"tools": [ADD, ADD]}, GrammarError),
    ({"tools": []}, GrammarError),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}}}]}, GrammarError),
    ({"tools": TOOLS, "fmt": BUILTIN_PARSERS["markdown"].format}, CannotForce),  # markdown forces only its code tool
])
def test_invalid_tools_raise(compiler, kwargs, error):
    kwargs = {"fmt": HERMES, "force": None, "parallel": True, **kwargs}
    with pytest.raises(error):
        compiler.tool_calls(**kwargs)


def test_grammar_is_cached_and_processors_independent(compiler):
    assert compiler.json_schema(PERSON) is compiler.json_schema(PERSON)
    g = compiler.json_object()
    p1, p2 = compiler.processor(g), compiler.processor(g)
    _feed(compiler, g, '{"a": 1}')
    ids = compiler.tokenizer.encode('{"a": 1}')
    p1(ids, torch.zeros(compiler.vocab_size))
    assert p1.done and not p2.done
    with pytest.raises(ConstraintViolation):
        p1(ids[:1], torch.zeros(compiler.vocab_size))  # reused for another stream
