"""Strict tools under ``tool_choice: "auto"`` (issue 34): a function tool with ``strict: true`` (or
every tool of a model configured with ``strict_tools: true``) has its calls' arguments constrained
to its schema from the format's call marker on, while free text stays free
(engine_ext/constraints/strict.py; gateway/openai/plan.py wires it in).

The processor, on the embedded model's tokenizer: free text untouched before a marker (only tokens
that are not valid UTF-8 text are masked), a marker ending inside a token, only schema-valid
continuations inside a call, free again after it, several calls, special tokens in prose, each
round restarted after server-side tool results, the first round forced by tool_choice then strict,
pickling for worker processes, the grammar vLLM gets, and its per-token cost.  With the model: the
135M model, asked to repeat a call whose ``unit`` is ``"kelvin"`` (not in the enum), repeats it
when free and writes a valid unit under strict -- per tool, by the model's config, after prose, and
in the second round of an agent loop.  Over HTTP: strict under auto, ``strict_tools`` in the
config, replays checked against the constraint (every round with server-side tools), and formats
that cannot constrain lazily accepting strict tools unconstrained.
"""

from __future__ import annotations

import json
import pickle
import statistics
import time

import httpx
import jsonschema
import pytest
import torch

from helpers import run
from helpers.gateway_server import LiveGateway
from interlace.engine_ext.constraints import grammar as grammar_module
from interlace.engine_ext.constraints.grammar import GrammarCompiler, GrammarError
from interlace.engine_ext.constraints.strict import (CannotTrigger, StrictToolsProcessor, strict_functions,
                                                     strict_tools_grammar, triggered_lark)
from interlace.engine_ext.protocol import SamplingParams
from interlace.parsers.formats import HERMES, LLAMA3_JSON, MARKDOWN, MISTRAL, PLAN, PYTHONIC, CannotForce

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                            "parameters": WEATHER_PARAMS}}
STRICT_WEATHER = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CALC = {"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def call(name, args):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


KELVIN = call("get_weather", {"city": "Paris", "unit": "kelvin"})     # fails the schema (enum)
CELSIUS = call("get_weather", {"city": "Paris", "unit": "celsius"})
SIX_BY_SEVEN = call("calculator", {"expression": "6*7"})
#: the prompt under which the 135M model, free, repeats the kelvin call (it never calls of its own accord)
REPEAT = [{"role": "user", "content": "Repeat exactly:\n" + KELVIN}]


@pytest.fixture(scope="module")
def gc(smol_engine):
    return GrammarCompiler(smol_engine.tokenizer, vocab_size=smol_engine.vocab_size)


@pytest.fixture(scope="module")
def weather_grammar(gc):
    return strict_tools_grammar(gc, HERMES, [WEATHER, ADD], ["get_weather"])


def masks(gc, proc, text, logits=None):
    """Feed ``text``'s tokens to ``proc`` one by one: ``[(text so far, masked logits)]`` at each step."""
    tok = gc.tokenizer
    ids = tok.encode(text)
    logits = torch.zeros(gc.vocab_size) if logits is None else logits
    out = []
    for i in range(len(ids) + 1):
        out.append((tok.decode(ids[:i]), proc(ids[:i], logits)))
    return ids, out


def allowed(gc, masked):
    ids = torch.isfinite(masked).nonzero().flatten().tolist()
    return {gc.tokenizer.decode([t], skip_special_tokens=False) for t in ids}


def eos_allowed(gc, masked):
    return bool(torch.isfinite(masked[min(gc.eos_token_ids)]))


def not_utf8(gc):
    """Tokens whose bytes are not whole UTF-8 characters (a lone continuation byte, ...)."""
    tok = gc.ll_tokenizer
    out = set()
    for i in range(tok.vocab_size):
        try:
            tok.decode_bytes([i]).decode("utf-8")
        except UnicodeDecodeError:
            out.add(i)
    return out


# ===================================================================== the processor
def test_free_text_is_untouched_before_the_marker(gc, weather_grammar):
    """Prose (markup, '<' that is not a marker, non-ASCII) passes as it is: the logits of every token
    that is whole UTF-8 text are the input's, bit for bit, at every step, and EOS may end it."""
    proc = StrictToolsProcessor.build(gc, weather_grammar)
    logits = torch.randn(gc.vocab_size, generator=torch.Generator().manual_seed(0))
    broken = not_utf8(gc)
    text = "Hello! 3 < 4, <b>bold</b> and <tool is fine; </tool_call> too; café ok."
    _, steps = masks(gc, proc, text, logits)
    for done, out in steps:
        masked = set(torch.isinf(out).nonzero().flatten().tolist())
        assert masked <= broken, (done, sorted(masked - broken)[:5])
        keep = torch.isfinite(out)
        assert torch.equal(out[keep], logits[keep])
        assert eos_allowed(gc, out), done


def test_special_tokens_stay_allowed_in_prose(gc, weather_grammar):
    proc = StrictToolsProcessor.build(gc, weather_grammar)
    tok = gc.tokenizer
    ids = tok.encode("Sure.") + [tok.tok.token_to_id("<|im_start|>")] + tok.encode(" ok ") + tok.encode(CELSIUS)
    for i in range(len(ids)):
        out = proc(ids[:i], torch.zeros(gc.vocab_size))
        assert torch.isfinite(out[ids[i]]), tok.decode(ids[:i], skip_special_tokens=False)


def test_inside_a_call_only_schema_valid_continuations(gc, weather_grammar):
    proc = StrictToolsProcessor.build(gc, weather_grammar)
    head = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "'
    _, steps = masks(gc, proc, head)
    done, out = steps[-1]
    ok = allowed(gc, out)
    assert ok and all("celsius".startswith(t) or "fahrenheit".startswith(t) for t in ok), sorted(ok)[:20]
    assert "kel" not in ok and not eos_allowed(gc, out)  # no unit outside the enum; no end inside a call
    # the name must be an offered tool, and the call is refused the model's layout
    _, steps = masks(gc, StrictToolsProcessor.build(gc, weather_grammar), 'x <tool_call>\n{"name": "')
    assert all("get_weather".startswith(t) or "add".startswith(t) for t in allowed(gc, steps[-1][1]))
    _, steps = masks(gc, StrictToolsProcessor.build(gc, weather_grammar), "x <tool_call>")
    assert "\n" in allowed(gc, steps[-1][1]) and all(t.startswith("\n") for t in allowed(gc, steps[-1][1]))


def test_the_marker_may_end_inside_a_token(gc, weather_grammar):
    """A token holding the marker's last character and more is allowed only if the rest starts a
    valid call: after '<tool_call' the vocabulary's '>",' '>.' '>>' ... are masked ('\\n' must
    follow), while for markdown's '```python\\n' the token '\\n\\n' (the marker's end and an empty code
    line) is allowed."""
    _, steps = masks(gc, StrictToolsProcessor.build(gc, weather_grammar), "Sure <tool_call")
    ok = allowed(gc, steps[-1][1])
    gts = {gc.tokenizer.decode([t]) for t in range(gc.vocab_size) if gc.tokenizer.decode([t]).startswith(">")}
    assert len(gts) > 5 and ok & gts == {">"}
    py = {"type": "function", "function": {"name": "python", "parameters": {
        "type": "object", "properties": {"code": {"type": "string"}}}}}
    g = strict_tools_grammar(gc, MARKDOWN, [py], ["python"])
    _, steps = masks(gc, StrictToolsProcessor.build(gc, g), "Here:\n```python")
    assert len(gc.tokenizer.encode("\n\n")) == 1 and "\n\n" in allowed(gc, steps[-1][1])


def test_free_again_after_a_call_and_a_second_call(gc, weather_grammar):
    proc = StrictToolsProcessor.build(gc, weather_grammar)
    text = "Checking. " + CELSIUS + "\nAnd the sum: " + call("add", {"a": 1, "b": "not checked", "z": [1]}) + " Done."
    ids, steps = masks(gc, proc, text)
    for i, (done, out) in enumerate(steps[:-1]):
        assert torch.isfinite(out[ids[i]]), done
    in_call = [done for done, out in steps if not eos_allowed(gc, out)]
    assert in_call and all(d.count("<tool_call>") > d.count("</tool_call>") for d in in_call)
    assert eos_allowed(gc, steps[-1][1])
    # the strict tool's schema still holds in the second call of the output
    _, steps = masks(gc, StrictToolsProcessor.build(gc, weather_grammar),
                     CELSIUS + " then " + KELVIN[:KELVIN.index("kelvin")])
    assert "kel" not in allowed(gc, steps[-1][1])


def test_non_strict_tools_take_any_object_and_are_not_compiled(gc):
    """Only strict tools' schemas are enforced or compiled: a non-strict tool whose schema llguidance
    refuses does not fail the request, and its calls need only be a JSON object; a strict tool with
    such a schema is a GrammarError naming its field."""
    bad = {"type": "function", "function": {"name": "odd", "parameters": {"type": "object", "properties": {
        "s": {"type": "string", "pattern": "^(a{500}){500}$"}}}}}
    g = strict_tools_grammar(gc, HERMES, [WEATHER, bad], ["get_weather"])
    proc = StrictToolsProcessor.build(gc, g)
    ids, steps = masks(gc, proc, call("odd", {"s": "b", "n": [1, {"x": None}]}))
    assert all(torch.isfinite(out[ids[i]]) for i, (_, out) in enumerate(steps[:-1]))
    with pytest.raises(GrammarError) as e:
        strict_tools_grammar(gc, HERMES, [WEATHER, bad], ["get_weather", "odd"])
    assert e.value.param.startswith("tools[1].function.parameters")


def test_strict_functions_reads_the_flag_or_the_models_default():
    tools = [STRICT_WEATHER, ADD, {"type": "function", "function": {**CALC["function"], "strict": False}}]
    assert strict_functions(tools) == ["get_weather"]
    assert strict_functions(tools, all_strict=True) == ["get_weather", "add", "calculator"]


def test_each_round_restarts_in_free_text(gc, weather_grammar):
    """After on_resume() (server-side results appended) the grammar restarts after what earlier rounds
    generated, even from inside a call (an early abort pauses mid-call), and still constrains calls."""
    proc = StrictToolsProcessor.build(gc, weather_grammar)
    tok = gc.tokenizer
    first = tok.encode('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    for i in range(len(first) + 1):
        out = proc(first[:i], torch.zeros(gc.vocab_size))
    assert not eos_allowed(gc, out)
    proc.on_resume()
    second = tok.encode("Sorry, that failed. " + KELVIN[:KELVIN.index("kelvin")])
    for i in range(len(second)):
        out = proc(first + second[:i], torch.zeros(gc.vocab_size))
        assert torch.isfinite(out[second[i]]), tok.decode(second[:i])
    out = proc(first + second, torch.zeros(gc.vocab_size))
    assert "kel" not in allowed(gc, out) and proc.resumes == 1


def test_a_forced_first_round_then_strict_rounds(gc, weather_grammar):
    """tool_choice forcing the first round (``first``) and strict tools after it: prose is masked in
    round one, free in round two, where the strict schema still holds; vLLM gets each round's grammar."""
    forced = gc.processor(gc.tool_calls(HERMES, [WEATHER, ADD], parallel=False))
    proc = StrictToolsProcessor.build(gc, weather_grammar, first=forced)
    prose = gc.tokenizer.encode("Sure")
    assert torch.isinf(proc([], torch.zeros(gc.vocab_size))[prose[0]])
    assert "grammar" in proc.segment_grammar(0) and "strict_lazy" not in proc.segment_grammar(0)["grammar"]
    proc.on_resume()
    assert torch.isfinite(proc([1, 2], torch.zeros(gc.vocab_size))[prose[0]])
    assert "strict_lazy_0_0[lazy]" in proc.segment_grammar(7)["grammar"]


def test_vllm_gets_the_whole_lazy_grammar_every_round(gc, weather_grammar):
    proc = StrictToolsProcessor.build(gc, weather_grammar)
    g0 = proc.segment_grammar(0)["grammar"]
    assert g0.startswith("%llguidance {}") and 'strict_lazy_0_0[lazy]: STRICT_ANY "<tool_call>"' in g0
    proc.on_resume()
    assert proc.segment_grammar(42) == {"grammar": g0}
    gc.lark(g0)  # it compiles as it is


def test_pickles_as_a_recipe_for_worker_processes(gc, weather_grammar, monkeypatch):
    forced = gc.processor(gc.tool_calls(HERMES, [WEATHER], parallel=False))
    monkeypatch.setattr(grammar_module, "_worker", ("smol", gc.tokenizer))
    copy = pickle.loads(pickle.dumps(StrictToolsProcessor.build(gc, weather_grammar, first=forced)))
    assert isinstance(copy, StrictToolsProcessor) and copy.spec == weather_grammar.spec
    assert copy.first is not None and copy.resumes == 0 and copy.every_round
    used = StrictToolsProcessor.build(gc, weather_grammar)
    used.on_resume()
    with pytest.raises(TypeError, match="started"):
        pickle.dumps(used)


def test_which_formats_can_constrain_lazily(gc):
    """hermes, mistral and markdown have a call marker; llama3_json and pythonic open calls with
    characters prose uses ('{', '['); plan cannot be forced at all."""
    assert (HERMES.call_start, MISTRAL.call_start, MARKDOWN.call_start) == (
        ("<tool_call>",), ("[TOOL_CALLS]",), ("```python\n",))
    for fmt in (LLAMA3_JSON, PYTHONIC):
        assert fmt.call_start == ()
        with pytest.raises(CannotTrigger):
            triggered_lark(gc, fmt, [WEATHER])
    with pytest.raises((CannotTrigger, CannotForce)):
        triggered_lark(gc, PLAN, [WEATHER])
    with pytest.raises(CannotForce):  # markdown calls only its python tool
        triggered_lark(gc, MARKDOWN, [WEATHER])


def test_mistral_list_is_constrained_from_its_marker(gc):
    g = strict_tools_grammar(gc, MISTRAL, [WEATHER, ADD], ["get_weather"])
    # (the strict call last: llguidance masks the token '"}' right after an enum value followed by '},' --
    # tool_choice "required"'s grammar does the same -- where the model then writes '"' and '},')
    good = ('I will look. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, '
            '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}] Done.')
    ids, steps = masks(gc, StrictToolsProcessor.build(gc, g), good)
    assert all(torch.isfinite(out[ids[i]]) for i, (_, out) in enumerate(steps[:-1]))
    assert eos_allowed(gc, steps[-1][1])
    _, steps = masks(gc, StrictToolsProcessor.build(gc, g),
                     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome", "unit": "')
    assert "kel" not in allowed(gc, steps[-1][1])


# ----------------------------------------------- every format with a marker, text or special tokens
class _SpecialVocab:
    """The embedded tokenizer with every format's markers added as special tokens (as the models
    of those formats have them: Mistral's [TOOL_CALLS], gpt-oss's <|channel|>, DeepSeek's and
    Kimi's markers), seen as the GrammarCompiler sees a tokenizer."""

    def __init__(self, base):
        from tokenizers import Tokenizer as HF

        self.tok = HF.from_str(base.tok.to_str())
        self.tok.add_special_tokens(sorted({m for f in _FORMATS for m in f.special_tokens} | {
            m for f in _FORMATS for m in f.call_start if m[:1] == "<" and m[-1:] == ">" and " " not in m}))
        self.eos_token_ids = base.eos_token_ids
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=False)


def _formats():
    from interlace.parsers.builtin import BUILTIN_PARSERS

    return [f.format for f in BUILTIN_PARSERS.values() if f.format.call_start and f.format is not MARKDOWN]


_FORMATS = _formats()


@pytest.fixture(scope="module")
def special_gc(smol_engine):
    return GrammarCompiler(_SpecialVocab(smol_engine.tokenizer))


def _first_rejected(gc, tok, fmt, text):
    """The text before the first token the strict grammar masks (None: all pass), and whether EOS may follow."""
    proc = StrictToolsProcessor.build(gc, strict_tools_grammar(gc, fmt, [WEATHER, ADD], ["get_weather"]))
    ids = tok.encode(text)
    for i in range(len(ids) + 1):
        out = proc(ids[:i], torch.zeros(gc.vocab_size))
        if i < len(ids) and torch.isinf(out[ids[i]]):
            return tok.decode(ids[:i]), False
    return None, eos_allowed(gc, out)


@pytest.mark.parametrize("fmt", _FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("vocab", ["text", "special"])
def test_every_format_with_a_marker(fmt, vocab, gc, special_gc):
    """Each registered format with call_start (the new ones included), on a vocabulary where its
    markers are text and on one where they are special tokens: prose, a call as the format renders
    it, prose again pass; the same call with "kelvin" is cut at the unit."""
    g, tok = (gc, gc.tokenizer) if vocab == "text" else (special_gc, special_gc.tokenizer)
    if vocab == "special" and fmt.name == "harmony":  # its marker's token is free in prose, the marker not
        prose = "Let me check.<|channel|>analysis<|message|>Think.<|end|><|start|>assistant"
    else:
        prose = "Let me check. "
    ok = prose + fmt.render_call("get_weather", {"city": "Paris", "unit": "celsius"}) + " Done."
    assert _first_rejected(g, tok, fmt, ok) == (None, True)
    cut, _ = _first_rejected(g, tok, fmt, prose + fmt.render_call("get_weather", {"city": "Paris", "unit": "kelvin"}))
    assert cut is not None and cut.endswith(("unit\": \"", "unit>\n", "<arg_value>")), cut


def test_a_special_token_marker_is_never_free(special_gc):
    """Where [TOOL_CALLS] is a special token, writing it starts a call: free text after it is masked;
    other special tokens stay free in prose."""
    tok = special_gc.tokenizer
    g = strict_tools_grammar(special_gc, MISTRAL, [WEATHER], ["get_weather"])
    proc = StrictToolsProcessor.build(special_gc, g)
    ids = tok.encode("Hi <|im_start|>[TOOL_CALLS]")
    for i in range(len(ids)):
        assert torch.isfinite(proc(ids[:i], torch.zeros(special_gc.vocab_size))[ids[i]])
    out = proc(ids, torch.zeros(special_gc.vocab_size))
    assert torch.isinf(out[tok.encode(" Hello")[0]]) and torch.isfinite(out[tok.encode("[")[0]])


def test_harmony_channel_token_stays_free_unless_a_call_follows(special_gc):
    from interlace.parsers.harmony import HARMONY

    tok = special_gc.tokenizer
    g = strict_tools_grammar(special_gc, HARMONY, [WEATHER], ["get_weather"])
    for prose in ("<|channel|>analysis<|message|>x<|end|>", "<|channel|>commentary<|message|>Checking.<|end|>",
                  "<|channel|>final<|message|>It is sunny."):
        proc = StrictToolsProcessor.build(special_gc, g)
        ids = tok.encode(prose)
        for i in range(len(ids)):
            assert torch.isfinite(proc(ids[:i], torch.zeros(special_gc.vocab_size))[ids[i]]), prose
    proc = StrictToolsProcessor.build(special_gc, g)
    ids = tok.encode("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                     '{"city": "P", "unit": "')
    for i in range(len(ids)):
        assert torch.isfinite(proc(ids[:i], torch.zeros(special_gc.vocab_size))[ids[i]])
    out = proc(ids, torch.zeros(special_gc.vocab_size))
    assert torch.isinf(out[tok.encode("kel")[0]]) and not eos_allowed(special_gc, out)


def test_per_token_cost(gc, weather_grammar):
    """What the constraint costs per token, on the embedded model's 49,152-token vocabulary: in prose
    (llguidance's mask is near all-ones) and across calls; it does not grow with the length of the
    prose.  Printed for the record (run with -s); the bounds only catch a blow-up."""
    tok = gc.tokenizer
    prose = ("The quick brown fox jumps over the lazy dog; Paris has museums, cafés and bridges. " * 12)
    ids = tok.encode(prose)

    def per_step(make, ids):
        proc = make()
        logits = torch.zeros(gc.vocab_size)
        times = []
        for i in range(len(ids)):
            t0 = time.perf_counter()
            proc(ids[:i], logits)
            times.append(time.perf_counter() - t0)
        return times

    free = per_step(lambda: StrictToolsProcessor.build(gc, weather_grammar), ids)
    with_calls = per_step(lambda: StrictToolsProcessor.build(gc, weather_grammar),
                          tok.encode(prose[:200] + CELSIUS + prose[:200] + CELSIUS))
    forced = per_step(lambda: gc.processor(gc.tool_calls(HERMES, [WEATHER], parallel=False)), tok.encode(CELSIUS))
    matcher = weather_grammar._matcher.deep_copy()
    raw = []
    for t in ids:
        t0 = time.perf_counter()
        matcher.compute_bitmask()
        raw.append(time.perf_counter() - t0)
        matcher.consume_token(t)
    us = {k: round(1e6 * statistics.median(v), 1) for k, v in
          (("prose", free), ("prose+calls", with_calls), ("forced call (tool_choice required)", forced),
           ("llguidance mask alone, prose", raw))}
    print(f"\nstrict tools, median per token (us), vocabulary {gc.vocab_size}: {us}")
    assert statistics.median(free) < 0.02
    n = len(free) // 4
    assert statistics.median(free[-n:]) < 3 * statistics.median(free[:n]) + 0.002


# ============================================================== with the model, in process
async def _rounds(engine, prompt_ids, proc, appended, rounds=2):
    """Decode ``rounds`` rounds, pausing after each call; each pause resumes with ``appended`` (the
    processor told, as the agent loop tells it)."""
    await engine.fill("strict-rounds", prompt_ids)
    texts = [""]
    try:
        sp = SamplingParams(max_tokens=70, pause_on=["</tool_call>"], logits_processors=[proc] if proc else [])
        async for ev in engine.generate("strict-rounds", sp):
            texts[-1] += ev.text
            if ev.paused:
                if len(texts) == rounds:
                    break
                texts.append("")
                if proc is not None:
                    proc.on_resume()
                await engine.resume("strict-rounds", engine.tokenizer.encode(appended))
    finally:
        await engine.free_context("strict-rounds")
    return texts


def test_a_later_rounds_call_is_strict_too(smol_engine, gc):
    """Real decoding across a server-side round: asked to repeat a calculator call and then the kelvin
    call, the model writes both; free, its second round repeats "kelvin", under strict it writes a unit
    of the enum -- the constraint is not first-round-only."""
    from interlace.gateway.prompt import render_messages

    tools = [CALC, WEATHER]
    prompt = render_messages(smol_engine.tokenizer, [{"role": "user", "content": "Repeat exactly:\n" + SIX_BY_SEVEN
                                                      + "\n" + KELVIN}], tools, HERMES)
    free = run(_rounds(smol_engine, prompt, None, "\n"))
    g = strict_tools_grammar(gc, HERMES, tools, ["calculator", "get_weather"])
    strict = run(_rounds(smol_engine, prompt, StrictToolsProcessor.build(gc, g), "\n"))
    assert free == [SIX_BY_SEVEN, KELVIN], free
    assert strict[0] == SIX_BY_SEVEN, strict
    args = json.loads(strict[1].split("\n")[1])["arguments"]
    jsonschema.validate(args, WEATHER_PARAMS)


# ====================================================================== over HTTP
@pytest.fixture(scope="module")
def live():
    m = {"path": "embedded", "kv_cache_tokens": 8192, "dtype": "float32", "max_model_len": 2048, "parser": "hermes"}
    cfg = {"server": {"replay": True, "server_tools": ["calculator"]},
           "models": {"smollm2": m, "smollm2-strict": {**m, "strict_tools": True},
                      "smollm2-llama": {**m, "parser": "llama3_json"}}}
    with LiveGateway(cfg) as gw:
        yield gw


def post(live, body):
    return httpx.post(live.url + "/v1/chat/completions", json={"model": "smollm2", "temperature": 0, **body},
                      timeout=600)


def calls_of(r):
    assert r.status_code == 200, r.text
    msg = r.json()["choices"][0]["message"]
    return msg, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg.get("tool_calls") or []]


def test_strict_true_under_auto_gives_valid_arguments(live):
    """The model, free, repeats the call with "kelvin" (the schema fails); the same request with
    strict: true on the tool yields a call whose arguments validate."""
    _, free = calls_of(post(live, {"messages": REPEAT, "tools": [WEATHER], "max_tokens": 60}))
    assert free == [("get_weather", {"city": "Paris", "unit": "kelvin"})]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(free[0][1], WEATHER_PARAMS)
    _, strict = calls_of(post(live, {"messages": REPEAT, "tools": [STRICT_WEATHER], "max_tokens": 60}))
    assert [n for n, _ in strict] == ["get_weather"]
    jsonschema.validate(strict[0][1], WEATHER_PARAMS)


def test_strict_tools_in_the_model_config(live):
    """The same request, byte for byte (so the same prompt), on a model with strict_tools: true."""
    _, calls = calls_of(post(live, {"model": "smollm2-strict", "messages": REPEAT, "tools": [WEATHER],
                                    "max_tokens": 60}))
    assert [n for n, _ in calls] == ["get_weather"]
    jsonschema.validate(calls[0][1], WEATHER_PARAMS)
    # tool_choice "none": calls are not parsed, so nothing is constrained (the text is the model's own)
    msg, calls = calls_of(post(live, {"model": "smollm2-strict", "messages": REPEAT, "tools": [WEATHER],
                                      "tool_choice": "none", "max_tokens": 36}))
    assert not calls and "kelvin" in msg["content"]


def test_prose_before_the_call_stays_free(live):
    ask = [{"role": "user", "content": "Repeat exactly:\nLet me look that up for you.\n\n" + KELVIN}]
    msg, calls = calls_of(post(live, {"model": "smollm2-strict", "messages": ask, "tools": [WEATHER],
                                      "max_tokens": 70}))
    assert msg["content"].strip() == "Let me look that up for you."
    assert [n for n, _ in calls] == ["get_weather"]
    jsonschema.validate(calls[0][1], WEATHER_PARAMS)


def test_a_replay_must_satisfy_strict_tools(live):
    """interlace.replay: prose then a valid call passes the strict check; a call outside the schema is
    a 400 under strict, and fine without it."""
    ok = post(live, {"messages": REPEAT, "tools": [STRICT_WEATHER],
                     "interlace": {"replay": "Sure, I will check.\n" + CELSIUS}})
    msg, calls = calls_of(ok)
    assert msg["content"].strip() == "Sure, I will check."
    assert calls == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    bad = post(live, {"messages": REPEAT, "tools": [STRICT_WEATHER], "interlace": {"replay": "Sure.\n" + KELVIN}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "interlace.replay", bad.text
    assert "strict tools" in bad.json()["error"]["message"]
    assert post(live, {"messages": REPEAT, "tools": [WEATHER], "interlace": {"replay": "Sure.\n" + KELVIN}}
                ).status_code == 200


def test_a_replay_is_checked_in_every_round_with_server_tools(live):
    """Server-side tools: the calculator call runs here, and the second round's call of a strict tool
    is checked as the first round's would be (tool_choice forcing covers the first round only; strict
    tools every round)."""
    ext = {"server_tools": ["calculator"]}
    bad = post(live, {"messages": REPEAT, "tools": [STRICT_WEATHER],
                      "interlace": {**ext, "replay": [SIX_BY_SEVEN, "Now the weather.\n" + KELVIN]}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "interlace.replay", bad.text
    ok = post(live, {"messages": REPEAT, "tools": [STRICT_WEATHER],
                     "interlace": {**ext, "replay": [SIX_BY_SEVEN, "Now the weather.\n" + CELSIUS]}})
    _, calls = calls_of(ok)
    assert calls == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    (res,) = ok.json()["interlace"]["tool_calls"]
    assert res["name"] == "calculator" and res["content"]["result"] == 42
    # forced first round (a named server tool), strict rounds after it
    named = {"type": "function", "function": {"name": "calculator"}}
    bad = post(live, {"messages": REPEAT, "tools": [STRICT_WEATHER], "tool_choice": named, "interlace": {
        **ext, "replay": [SIX_BY_SEVEN, KELVIN]}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "interlace.replay", bad.text


def test_formats_without_a_call_marker_accept_strict_tools_unconstrained(live):
    """llama3_json has no marker that opens a call: strict: true (which the OpenAI Agents SDK sends on
    every function tool) is accepted and not enforced, rather than refused."""
    bad_call = json.dumps({"name": "get_weather", "parameters": {"city": "Paris", "unit": "kelvin"}})
    r = post(live, {"model": "smollm2-llama", "messages": REPEAT, "tools": [STRICT_WEATHER],
                    "interlace": {"replay": bad_call}})
    _, calls = calls_of(r)
    assert calls == [("get_weather", {"city": "Paris", "unit": "kelvin"})]


def test_strict_client_schema_that_cannot_be_enforced_is_a_400(live):
    bad = {"type": "function", "function": {"name": "odd", "strict": True, "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "^(a{500}){500}$"}}}}}
    r = post(live, {"messages": REPEAT, "tools": [WEATHER, bad], "max_tokens": 5})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("tools[1].function.parameters"), r.text
    # strict by the model's default only: that tool is loosened, the request is served
    r = post(live, {"model": "smollm2-strict", "messages": REPEAT, "tools": [WEATHER, {
        "type": "function", "function": {k: v for k, v in bad["function"].items() if k != "strict"}}],
        "max_tokens": 5})
    assert r.status_code == 200, r.text


def test_response_format_wins_over_strict_tools(live):
    """With response_format the answer's schema is the constraint (one processor per request)."""
    r = post(live, {"model": "smollm2-strict", "messages": REPEAT, "tools": [WEATHER], "max_tokens": 8,
                    "response_format": {"type": "json_object"}})
    msg, calls = calls_of(r)
    assert not calls and msg["content"].startswith("{")
