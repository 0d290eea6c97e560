"""From a validated chat-completions request to a :class:`CompletionPlan`:
the prompt tokens, sampling parameters, the constraints that enforce
``tool_choice`` / ``response_format``, and the server-side tools a request may
use.  The route (``routes.py``) has already authenticated the caller and
checked its permissions; ``caller`` names it for the tool policy hooks.  What
the plan needs of the gateway is passed in (the served tools, the default and
maximum limits), so planning does not reach back into the composition root.
A request it cannot plan is refused with ``InvalidInput`` (a 400: gateway/errors.py).

Decisions worth knowing:

* ``tool_choice: "none"`` keeps the tools in the prompt (as OpenAI does: the
  model knows them, it just may not call them) and parses no calls, so call
  text the model writes anyway is plain content.
* Forced calls (``tool_choice: "required"`` or a named function) use the
  grammar of the model's own tool-call format (``model.tool_format.grammar``),
  so the forced text is what its parser reads.  ``"required"`` allows several
  calls unless ``parallel_tool_calls`` is false (OpenAI's default is true); a
  named function means exactly one call.  The grammar covers the client's
  tools and the server tools the request asked for (``interlace.server_tools``
  adds them to ``tools``): ``"required"`` may call any of them, a named
  function may be a server tool (wire.py checks the name against both).
* Forcing applies to the first round only.  OpenAI defines ``"required"`` for
  one model response ("the model must call one or more tools"); vLLM likewise
  constrains the one response it returns, and agent loops that send it again
  after a tool result (the OpenAI Agents SDK's ``reset_tool_choice``, on by
  default) reset it to ``"auto"``, since a model forced to call on every turn
  never answers.  Here the agent loop is inside one request, so the same
  holds within it: the forced call runs server-side, its result is appended
  and decoding goes on unconstrained (:class:`~.completions.FirstRoundOnly`),
  so the model answers (or calls again, of its own accord; calls of strict
  tools, if any, are then constrained as under "auto").
* Strict tools (``strict: true`` on a function tool, or the model's
  ``strict_tools``) under ``tool_choice: "auto"``: free text stays free and
  each call, from the format's call marker on, follows its tool's schema
  (:mod:`~interlace.engine_ext.constraints.strict`), in every round, server-side
  tool rounds included.  A format with no call marker (llama3_json, pythonic,
  plan) serves them unconstrained rather than refusing: the OpenAI Agents SDK
  marks every function tool strict.  With ``response_format`` the answer's
  schema is the constraint and strict tools are not constrained on top.
* ``interlace.replay`` keeps the request's constraints: the replayed text
  must satisfy ``tool_choice`` / ``response_format`` / strict tools (each piece
  a round when server-side tools run: forcing covers the first, strict tools
  every one), else the request is refused with 400.
* A prompt whose text cannot fit the context whatever its tokens (more bytes
  than ``max_model_len`` times the longest token's) is refused before it is
  tokenized (:func:`gateway.prompt.prompt_bytes_bound`): rendering the text
  takes milliseconds, tokenizing it seconds.
* Without ``max_tokens`` a completion may take ``server.default_max_tokens``
  tokens (or the context left, if less), not the whole context.
* When tools are parsed and the format needs special tokens in the text
  (Mistral ``[TOOL_CALLS]``, Llama ``<|python_tag|>``), they are decoded
  (``skip_special_tokens=False``) so the parser sees them.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence

from ...engine_ext.errors import InvalidSampling
from ...engine_ext.constraints.forced import ForcedOutput
from ...engine_ext.protocol import SamplingParams
from ..errors import InvalidInput
from ..prompt import prompt_bytes_bound, render_messages, render_text
from .completions import CompletionPlan, FirstRoundOnly

if TYPE_CHECKING:  # the seams' types (imports for annotations only)
    from ..models import ModelServer


def build_plan(model: ModelServer, body: Dict[str, Any], *, available_tools: Mapping[str, Any], default_max_tokens: int,
               max_tool_rounds: int, caller: Optional[str] = None) -> CompletionPlan:
    """The plan of ``body`` on ``model``.  ``available_tools``: the gateway's server-side
    tools by name; ``default_max_tokens`` and ``max_tool_rounds``: what a request that
    does not say gets (``server.default_max_tokens``, ``server.max_tool_rounds``)."""
    ext = body.get("interlace") or {}
    tools: List[Dict[str, Any]] = list(body.get("tools") or [])
    server = server_tools(available_tools, ext.get("server_tools"), tools)
    choice = body.get("tool_choice") or ("auto" if tools else "none")
    fmt = model.tool_format
    try:  # the tools stay visible with tool_choice "none" (OpenAI's behaviour)
        size = len(render_text(model.tokenizer, body["messages"], tools, fmt,
                               reasoning=model.reasoning_format).encode("utf-8", "surrogatepass"))
        bound = prompt_bytes_bound(model.tokenizer, model.max_model_len)
        if size > bound:  # cannot fit whatever its tokens: refused before it is tokenized
            raise InvalidInput(f"this model's maximum context length is {model.max_model_len} tokens; the prompt "
                               f"is {size} bytes of text, more than any {model.max_model_len} tokens stand for "
                               f"({bound} bytes)", param="messages", code="context_length_exceeded")
        prompt = render_messages(model.tokenizer, body["messages"], tools, fmt, model.reasoning_format)
    except ValueError as e:
        raise InvalidInput(f"messages could not be rendered for this model: {e}", param="messages",
                           code="invalid_value")
    room = model.max_model_len - len(prompt)
    if room < 1:
        raise InvalidInput(f"this model's maximum context length is {model.max_model_len} tokens; the "
                           f"messages take {len(prompt)} tokens", param="messages",
                           code="context_length_exceeded")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if max_tokens is not None and max_tokens > room:
        raise InvalidInput(f"this model's maximum context length is {model.max_model_len} tokens; the "
                           f"messages take {len(prompt)} and max_tokens asks for {max_tokens} more",
                           param="max_tokens", code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(room, default_max_tokens)
    parse_tools = choice != "none" and bool(tools)
    processors = constraint(model, body, tools, choice)
    if server and processors:  # tool_choice / format constrain the first round, strict tools every round
        processors = tuple(p if getattr(p, "every_round", False) else FirstRoundOnly(p) for p in processors)
    if ext.get("replay") is not None:
        pieces = [ext["replay"]] if isinstance(ext["replay"], str) else list(ext["replay"])
        piece_ids = [model.tokenizer.encode(p) for p in pieces]
        if processors:
            # each piece is a round when tools run here, else the pieces are one output
            check_replay(model, processors, piece_ids if server else [[t for p in piece_ids for t in p]])
        eos = min(model.tokenizer.eos_token_ids) if model.tokenizer.eos_token_ids else None
        processors = (ForcedOutput(piece_ids, eos),)  # the checked processors are spent: the replay replaces them
    stop = body.get("stop")
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.get("temperature") is None else float(body["temperature"]),
            top_p=1.0 if body.get("top_p") is None else float(body["top_p"]),
            top_k=body.get("top_k") or 0, seed=body.get("seed"),
            stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
            logprobs=bool(body.get("logprobs")), logits_processors=processors,
            # the parser must see the format's special tokens ([TOOL_CALLS], <|python_tag|>) in the text,
            # and the reasoning's (<think> where it is a special token) whenever the output is parsed
            skip_special_tokens=not ((parse_tools or model.reasons) and model.special_tokens))
    except InvalidSampling as e:
        raise InvalidInput(str(e), code="invalid_value")
    offered = {f["name"]: f.get("parameters") for f in (t.get("function", t) for t in tools
                                                         if t.get("type", "function") == "function")}
    forced = choice == "required" or isinstance(choice, dict)
    return CompletionPlan(prompt_ids=prompt, sampling=sampling, parse_tools=parse_tools, forced_calls=forced,
                          server_tools=server, partial_execution=ext.get("partial_execution", True),
                          max_tool_rounds=ext.get("max_tool_rounds", max_tool_rounds),
                          parallel_tool_calls=body.get("parallel_tool_calls") is not False,
                          request_info={"model": model.name, "user": body.get("user"), "key": caller},
                          offered_tools=offered, cache_key=body.get("prompt_cache_key") or None)


def server_tools(available: Mapping[str, Any], wanted: Any, tools: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The server-side tools a request asks for (``interlace.server_tools``:
    true for every enabled one of ``available``, or a list of names); each is
    added to ``tools`` (in place) unless the request describes it already."""
    server: Dict[str, Any] = {}
    if not wanted:
        return server
    names = [n for n, t in available.items() if t.enabled] if wanted is True else wanted
    for n in names:
        tool = available.get(n)
        if tool is None or not tool.enabled:
            raise InvalidInput(f"unknown server tool {n!r} (enabled: "
                               f"{', '.join(k for k, t in available.items() if t.enabled)})",
                               param="interlace.server_tools", code="unknown_tool")
        server[n] = tool
        if not any(t["function"]["name"] == n for t in tools):
            tools.append({"type": "function", "function": {"name": n, "description": tool.description,
                                                           "parameters": tool.parameters}})
    return server


def constraint(model: ModelServer, body: Dict[str, Any], tools: List[Dict[str, Any]], choice: Any) -> tuple:
    """Logits processors enforcing tool_choice / response_format / strict tools (constrained decoding).

    Strict tools (a function tool's ``strict: true``, or every tool with the model's ``strict_tools``)
    constrain calls under ``tool_choice`` "auto" from the format's call marker on, every round
    (:mod:`~interlace.engine_ext.constraints.strict`); under "required" / a named function the forcing
    grammar decides the first round and the strict one the rounds after server-side tool results.  A
    format that cannot constrain calls lazily (no call marker) serves strict tools unconstrained: the
    OpenAI Agents SDK marks every function tool strict, so refusing them would refuse it.  With
    ``response_format`` (and no forcing) the answer's schema is the one constraint."""
    rf = body.get("response_format") or {}
    forced = choice["function"]["name"] if isinstance(choice, dict) else None
    forcing = forced is not None or choice == "required"
    json_answer = rf.get("type") in ("json_object", "json_schema")
    strict = _strict_names(model, tools, choice) if not json_answer or forcing else []
    if not forcing and not json_answer and not strict:
        return ()
    from ...engine_ext.constraints.grammar import GrammarError
    from ...parsers.formats import CannotForce

    offered = [t["function"]["name"] for t in tools if t.get("type", "function") == "function"]
    if forced is not None and forced not in offered:  # `server_tools: true` left this check to the plan
        raise InvalidInput(f"tool_choice names function {forced!r}, which is not in tools or interlace.server_tools "
                           f"(offered: {', '.join(offered) or 'none'})", param="tool_choice", code="unknown_tool")
    g = model.grammar()
    first = None
    if forcing or json_answer:
        try:
            if forcing:
                # a named function means one call to it; "required" allows several unless parallel_tool_calls is false
                grammar = model.tool_format.grammar(
                    g, tools, forced, parallel=forced is None and body.get("parallel_tool_calls") is not False)
            elif rf["type"] == "json_schema":
                grammar = g.json_schema(rf["json_schema"]["schema"])
            else:
                grammar = g.json_object()
        except GrammarError as e:  # the client's schema or tools: the field at fault, else the constraint asked for
            raise InvalidInput(str(e), param=e.param or ("tool_choice" if forcing else "response_format"),
                               code="invalid_value")
        except CannotForce as e:
            raise InvalidInput(str(e), param="tools" if str(e).startswith("tools") else "tool_choice",
                               code="invalid_value")
        first = g.processor(grammar)
    proc = _strict_processor(model, g, body, tools, strict, first) if strict else None
    if proc is None:
        proc = first
    return () if proc is None else (proc,)


def _strict_names(model: ModelServer, tools: List[Dict[str, Any]], choice: Any) -> List[str]:
    """The function tools whose arguments are constrained (none where calls are not parsed)."""
    if choice == "none" or not tools:
        return []
    from ...engine_ext.constraints.strict import strict_functions

    return strict_functions(tools, all_strict=bool(getattr(model.spec, "strict_tools", False)))


def _strict_processor(model: ModelServer, g: Any, body: Dict[str, Any], tools: List[Dict[str, Any]],
                      strict: List[str], first: Any) -> Any:
    """The strict-tools processor (``first``: the first round's, when tool_choice forces it), or None
    where the model's format cannot constrain calls lazily.  A schema llguidance cannot enforce is a
    400 for a tool the client marked strict; a tool strict only by the model's ``strict_tools`` is
    then served unconstrained (its object shape still is)."""
    from ...engine_ext.constraints.grammar import GrammarError
    from ...engine_ext.constraints.strict import CannotTrigger, StrictToolsProcessor, strict_tools_grammar
    from ...parsers.formats import CannotForce

    asked = {t["function"]["name"] for t in tools if t.get("type", "function") == "function"
             and t["function"].get("strict") is True}
    parallel = body.get("parallel_tool_calls") is not False
    while True:
        try:
            grammar = strict_tools_grammar(g, model.tool_format, tools, strict, parallel=parallel)
            return StrictToolsProcessor.build(g, grammar, first=first)
        except (CannotTrigger, CannotForce):
            return None
        except GrammarError as e:
            at = re.match(r"tools\[(\d+)\]\.function\.parameters(?:$|[.\[])", e.param or "")
            guilty = tools[int(at.group(1))]["function"]["name"] if at and int(at.group(1)) < len(tools) else None
            if guilty is None or guilty in asked or guilty not in strict:
                raise InvalidInput(str(e), param=e.param or "tools", code="invalid_value") from None
            strict = [n for n in strict if n != guilty]  # strict by the model's default only: loosen it
            if not strict:
                return None


def check_replay(model: ModelServer, processors: Sequence[Any], pieces: Sequence[List[int]]) -> None:
    """Refuse (400) a replay the request's constraints would not allow: every
    token must pass every processor, and each piece (a round: the output up to
    a pause for server-side tools, after which the processors get
    ``on_resume()`` as in the agent loop) must be complete (an EOS allowed
    after it).  Uses the processors as the engine would, on zero logits."""
    import torch

    logits = torch.zeros(model.engine.vocab_size)
    eos = [e for e in model.tokenizer.eos_token_ids if e < logits.shape[0]]
    generated: List[int] = []
    for k, piece in enumerate(pieces):
        if k:
            for proc in processors:
                if hasattr(proc, "on_resume"):
                    proc.on_resume()
        for i in range(len(piece) + 1):
            ids = generated + list(piece[:i])
            masked = logits
            for proc in processors:
                masked = proc(ids, masked)
            if i < len(piece) and masked[piece[i]] == float("-inf"):
                done = model.tokenizer.decode(ids)
                raise InvalidInput(f"interlace.replay does not satisfy the request's tool_choice / "
                                   f"response_format / strict tools: the constraint rejects it after {done[-60:]!r}",
                                   param="interlace.replay", code="invalid_value")
            if i == len(piece) and not any(masked[e] != float("-inf") for e in eos):
                raise InvalidInput("interlace.replay does not satisfy the request's tool_choice / "
                                   "response_format / strict tools: the text ends before the constrained output "
                                   "is complete", param="interlace.replay", code="invalid_value")
        generated += list(piece)
