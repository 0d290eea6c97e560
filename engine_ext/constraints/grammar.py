"""Constrained decoding for the OpenAI API: ``response_format`` and ``tool_choice``.

A request that asks for a JSON schema, any JSON object, or a forced tool call
gets a logits processor (the engine's per-request hook, see
:data:`interlace.engine_ext.protocol.LogitsProcessor`) that masks every token
the grammar does not allow next.  Grammars and token masks come from
`llguidance <https://github.com/guidance-ai/llguidance>`_: its Earley parser
over a token trie computes a mask in tens of microseconds, supports JSON
Schema natively and embeds JSON schemas inside Lark grammars (``%json{...}``),
which is what tool calls need: a fixed envelope around per-tool arguments.

Usage (the HTTP layer)::

    gc = GrammarCompiler(engine.tokenizer, vocab_size=engine.vocab_size)  # once per model
    try:
        grammar = gc.json_schema(schema)          # or gc.json_object(), gc.tool_calls(fmt, tools)
    except GrammarError as e:
        ...  # answer 400 with str(e)
    sampling = SamplingParams(..., logits_processors=[gc.processor(grammar)])  # fresh per request

Tool-call grammars are defined by the formats themselves (a parser's
``format.grammar(compiler, tools, force, parallel)``, see
:mod:`interlace.parsers.formats`); this module only provides the building
blocks they use (:meth:`GrammarCompiler.envelope`, :meth:`~GrammarCompiler.json_rule`,
:meth:`~GrammarCompiler.marker`: the parsers' ``GrammarBuilder`` protocol).
It knows no format and imports nothing from the parsers or the gateway: a
caller hands it the format object.

Processors in engine worker processes.  A :class:`GrammarProcessor` is
shipped to a worker process as a recipe and rebuilt there for the tokenizer
of the engine that process serves.  The worker says which tokenizer that is
(:func:`serve_in_worker`, called by ``engine_ext/worker.py`` once its engine
is built), so this module does not import the worker.

torch is imported inside :meth:`GrammarProcessor.__call__`, where the logits
come in as torch tensors, so torch is loaded already and the import is only a
lookup.  Importing this module, to compile and validate grammars, needs only
numpy and llguidance.

JSON is generated compactly with ``json.dumps``-style separators (``", "`` and
``": "``) and no other whitespace: small models given free whitespace tend to
loop on newlines and indentation until ``max_tokens``, and the output is the
same JSON either way.  The grammar cannot make a model *finish*: a model that
keeps extending a string runs into ``max_tokens`` (finish_reason ``"length"``)
with a truncated document, as with OpenAI.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

if TYPE_CHECKING:
    import torch

try:
    import llguidance as llg
except ImportError:  # pragma: no cover - llguidance is a dependency of constrained decoding only
    llg = None  # type: ignore[assignment]

__all__ = ["GrammarError", "ConstraintViolation", "Grammar", "GrammarCompiler", "GrammarProcessor",
           "serve_in_worker"]


class GrammarError(ValueError):
    """The requested constraint cannot be compiled: an invalid or unsupported
    JSON schema, a regex too complex for the lexer, an invalid tool list or an
    unknown tool.  The message is meant for the API client (the HTTP layer
    answers 400 with it); ``param`` names the request field at fault where one
    is known (``response_format.json_schema.schema``,
    ``tools[2].function.parameters``).  A format that cannot force calls
    raises the parsers' own ``CannotForce``."""

    def __init__(self, message: str, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.param = param


class _Functions(Dict[str, Dict[str, Any]]):
    """``{name: parameters schema}`` that also knows each schema's request field (``where``)."""

    where: Dict[str, str]


class ConstraintViolation(RuntimeError):
    """The grammar matcher rejected a token or reached an error state while
    decoding.  Masking makes this impossible unless something outside the
    processor changed the sampled token (or the processor was reused for a
    second stream): it signals a bug, not a client error."""


#: How JSON inside constrained output is laid out (llguidance JSON compile
#: options): ``json.dumps`` separators, no free whitespace -- see the module doc.
JSON_OPTIONS: Dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

#: Lexer fuel a client's regex may take in isolation (llguidance's ``initial_lexer_fuel``; decoding
#: has its default, 1,000,000, about 20 ms of work): see :meth:`GrammarCompiler._check_pattern`.
PATTERN_PROBE_FUEL = 250_000

#: grammars whose output is one JSON document: their processors refuse repeated keys (KeyGuard)
_JSON_KINDS = frozenset(("json_schema", "json_object"))

_NO_PARAMETERS: Dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class Grammar:
    """A compiled, validated constraint.

    ``spec`` is the llguidance grammar string (what :class:`llguidance.LLMatcher`
    takes); ``kind`` says what it constrains (``"json_schema"``, ``"json_object"``,
    ``"tool_calls"``, ``"lark"``), for logs and metrics.  ``_matcher`` is a
    pristine matcher, built once at validation and deep-copied per request,
    which is cheaper than compiling the grammar again.
    """

    spec: str
    kind: str
    _matcher: Any = field(default=None, repr=False, compare=False)
    #: the output is JSON whose objects must not repeat a key (a grammar cannot say so; see KeyGuard)
    unique_keys: bool = False


def _lit(text: str) -> str:
    """A Lark string literal for ``text`` (Lark strings take JSON escapes)."""
    return json.dumps(text, ensure_ascii=False)


# ==================================================================== compiler
class GrammarCompiler:
    """Builds grammars and per-request logits processors for one model.

    Build it once per model: wrapping the tokenizer for llguidance (a token
    trie over the whole vocabulary) takes a fraction of a second.  All
    methods may be called from any thread; each processor is used by the
    engine thread of one request only.

    ``vocab_size`` is the model's logits width (its config's ``vocab_size``),
    which may exceed the tokenizer's size (padded embeddings); the padding
    ids have no text and are never allowed.
    """

    def __init__(self, tokenizer: Any, *, vocab_size: Optional[int] = None,
                 eos_token_ids: Sequence[int] = (), cache_size: int = 128):
        if llg is None:
            raise RuntimeError("constrained decoding needs the llguidance package: pip install llguidance")
        self.tokenizer = tokenizer
        hf = tokenizer.tok  # tokenizers.Tokenizer
        self.vocab_size = max(int(vocab_size or 0), int(getattr(tokenizer, "vocab_size", 0) or 0),
                              hf.get_vocab_size(with_added_tokens=True))
        self.eos_token_ids: Tuple[int, ...] = tuple(sorted(set(tokenizer.eos_token_ids) | set(eos_token_ids)))
        if not self.eos_token_ids:
            raise GrammarError("constrained decoding needs a model with an EOS token")
        # to_str() is the tokenizer.json text; llguidance parses it with the same Rust library
        self.ll_tokenizer = llg.LLTokenizer(hf.to_str(), n_vocab=self.vocab_size,
                                            eos_token=list(self.eos_token_ids))
        self._cache: "OrderedDict[str, Grammar]" = OrderedDict()
        self._patterns: "OrderedDict[str, None]" = OrderedDict()  # regexes the lexer was seen to build
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._tokens: Optional[_TokenTable] = None
        self._specials: Optional[Tuple[int, ...]] = None

    # ----------------------------------------------------------------- grammars
    def json_schema(self, schema: Any) -> Grammar:
        """Output must be one JSON document valid against ``schema``
        (``response_format: {"type": "json_schema", "json_schema": {"schema": ...}}``).

        Raises :class:`GrammarError` for a schema that is not a JSON object, is
        not a valid JSON Schema, or uses keywords llguidance cannot enforce
        (rather than silently generating output that may not validate).
        """
        where = "response_format.json_schema.schema"
        schema = self._check_schema(schema, where)
        try:
            return self.compile(llg.LLMatcher.grammar_from_json_schema(self._with_options(schema)), "json_schema")
        except GrammarError as e:
            raise GrammarError(str(e), where) from None

    def json_object(self) -> Grammar:
        """Output must be one JSON object (``response_format: {"type": "json_object"}``), then EOS.

        ``{"type": "object"}`` alone does not make a small model finish: it
        repeats keys (``{", ": 3, ": 3, ...``) until ``max_tokens``.  So the
        object is bounded (:func:`json_object_lark`: nesting depth, members
        per object, items per array, string and key length, sane first key
        character) and its processor masks any token that would repeat a key
        of the same object (:class:`KeyGuard`).  Unique keys leave a model
        that loops nothing to loop on, and the bounds make every output
        finite: the object closes and only EOS may follow.
        """
        return self.compile(llg.LLMatcher.grammar_from_lark(json_object_lark()), "json_object")

    def tool_calls(self, fmt: Any, tools: Sequence[Mapping[str, Any]], *, force: Optional[str] = None,
                   parallel: bool = True) -> Grammar:
        """Output must be tool calls in the format ``fmt`` and nothing else, then EOS.

        For ``tool_choice="required"`` (``force=None``) each call may name any
        of ``tools``; for ``tool_choice={"type": "function", "function":
        {"name": N}}`` (``force=N``) only ``N``.  With ``parallel``
        (``parallel_tool_calls``) one or more calls, else exactly one.  Each
        call's arguments match its function's ``parameters`` schema.
        ``tools`` are OpenAI tool objects (bare function objects are accepted
        too).  ``fmt`` is the tool-call format, a parser's ``format``
        (:class:`interlace.parsers.formats.ToolFormat`): it builds its grammar
        with the helpers below (:meth:`envelope`, :meth:`functions`,
        :meth:`json_rule`), and raises its own error when it cannot force calls.
        """
        return fmt.grammar(self, list(tools) if isinstance(tools, (list, tuple)) else tools, force, parallel)

    # ------------------------------------------------- helpers for formats' grammars
    def functions(self, tools: Sequence[Mapping[str, Any]], force: Optional[str] = None) -> Dict[str, Dict[str, Any]]:
        """``{name: parameters schema}`` of the function tools (only ``force`` when given), validated."""
        functions = self._functions(tools)
        if force is not None:
            if force not in functions:
                raise GrammarError(f"tool_choice names function {force!r}, which is not in tools", "tool_choice")
            for name in [n for n in functions if n != force]:
                del functions[name]
        if not functions:
            raise GrammarError("tool_choice needs at least one function tool", "tool_choice")
        return functions

    def json_rule(self, schema: Mapping[str, Any]) -> str:
        """The Lark right-hand side matching JSON valid against ``schema``, laid out as :data:`JSON_OPTIONS`."""
        return f"%json {json.dumps(self._with_options(schema), ensure_ascii=False)}"

    @staticmethod
    def literal(text: str) -> str:
        """A Lark string literal for ``text``."""
        return _lit(text)

    def marker(self, text: str) -> str:
        """A Lark expression for a format marker: the special token itself
        when the vocabulary has it as one (models emit ``[TOOL_CALLS]`` as a
        single special token, which a text literal would never match), else
        the text."""
        tid = self.tokenizer.tok.token_to_id(text)
        if tid is not None and self.ll_tokenizer.is_special_token(tid):
            return f"<[{tid}]>"
        return _lit(text)

    def envelope(self, tools: Sequence[Mapping[str, Any]], *, force: Optional[str], parallel: bool,
                 call: Callable[[str, str], str], open: str = '""', sep: str = '""', close: str = '""') -> Grammar:
        """Calls laid out as ``open call (sep call)* close`` (``open call close`` without ``parallel``).

        ``call(name_lit, args_rule)`` returns the Lark expression of one call
        of a function, given its JSON-encoded name as a Lark literal and the
        rule matching its arguments; ``open``/``sep``/``close`` are Lark
        expressions (use :meth:`marker` for markers that may be special tokens).
        """
        functions = self.functions(tools, force)
        rules: List[str] = []
        alts: List[str] = []
        for i, (name, params) in enumerate(functions.items()):
            # the name is fixed text in the envelope: JSON-encode it, then quote that for Lark
            rules.append(f"args_{i}: {self.json_rule(params)}")
            alts.append(call(_lit(json.dumps(name, ensure_ascii=False)), f"args_{i}"))
        more = f" ({sep} call)*" if parallel else ""
        head = [f"start: {open} call{more} {close}", "call: " + "\n    | ".join(alts)]
        return self.tool_grammar("\n".join(head + rules) + "\n", functions)

    def tool_grammar(self, lark: str, functions: Mapping[str, Mapping[str, Any]]) -> Grammar:
        """Compile a tool-call Lark grammar; a failure names the guilty tool when one is."""
        try:
            return self.compile(llg.LLMatcher.grammar_from_lark(lark), "tool_calls")
        except GrammarError:
            # llguidance's message quotes the whole Lark grammar: find the guilty tool for a clean one
            for name, params in functions.items():
                try:
                    self.compile(llg.LLMatcher.grammar_from_json_schema(self._with_options(params)), "json_schema")
                except GrammarError as e:
                    raise GrammarError(f"tools: parameters of function {name!r}: {e}",
                                       getattr(functions, "where", {}).get(name, "tools")) from None
            raise

    def lark(self, grammar: str) -> Grammar:
        """A raw Lark grammar (llguidance dialect), for callers with their own formats."""
        return self.compile(llg.LLMatcher.grammar_from_lark(grammar), "lark")

    def compile(self, spec: str, kind: str = "llguidance") -> Grammar:
        """Validate an llguidance grammar string and keep a pristine matcher
        for it.  Results are cached by ``spec`` (requests repeat the same
        schema / tool list), so a repeated grammar costs one dict lookup."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        # compiling outside the lock: llguidance drops the GIL while it builds
        matcher = llg.LLMatcher(self.ll_tokenizer, spec, log_level=0)
        if matcher.is_error():
            what = {"json_schema": "JSON schema", "tool_calls": "tool parameters schema"}.get(kind, "grammar")
            raise GrammarError(f"unsupported or invalid {what}: {_clean(matcher.get_error())}")
        grammar = Grammar(spec=spec, kind=kind, _matcher=matcher, unique_keys=kind in _JSON_KINDS)
        with self._lock:
            self._cache[spec] = grammar
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return grammar

    # --------------------------------------------------------------- processors
    def processor(self, grammar: Grammar | str) -> "GrammarProcessor":
        """A fresh logits processor for one request (it holds the parse
        state, so never share one between requests)."""
        if isinstance(grammar, str):
            grammar = self.compile(grammar)
        with self._lock:  # deep_copy reads the pristine matcher; keep it single-threaded
            matcher = grammar._matcher.deep_copy()
        guard = KeyGuard(self._token_table()) if grammar.unique_keys else None
        return GrammarProcessor(matcher, self.eos_token_ids, self.vocab_size, kind=grammar.kind, key_guard=guard,
                                spec=grammar.spec)

    def special_token_ids(self) -> Tuple[int, ...]:
        """The vocabulary's special tokens (control tokens such as EOS or ``<|im_start|>``, no text),
        found once per model (a scan of the vocabulary)."""
        if self._specials is None:
            tok = self.ll_tokenizer
            self._specials = tuple(i for i in range(tok.vocab_size) if tok.is_special_token(i))
        return self._specials

    def _token_table(self) -> "_TokenTable":
        """Every token's bytes and quote count, built once per model (for :class:`KeyGuard`)."""
        if self._tokens is None:
            n = self.ll_tokenizer.vocab_size
            raw = [self.ll_tokenizer.decode_bytes([i]) for i in range(n)]
            quotes = np.zeros(self.vocab_size, dtype=np.int8)
            quotes[:n] = [min(b.count(b'"'), 2) for b in raw]
            self._tokens = _TokenTable(raw, quotes == 1, quotes == 2)
        return self._tokens

    # ------------------------------------------------------------------ helpers
    def _check_schema(self, schema: Any, what: str) -> Dict[str, Any]:
        if isinstance(schema, bool):  # JSON Schema's true / false
            if not schema:
                raise GrammarError(f"{what}: the schema `false` accepts no output", what)
            return {}
        if not isinstance(schema, dict):
            raise GrammarError(f"{what} must be a JSON object (a JSON Schema), got {type(schema).__name__}", what)
        import jsonschema

        try:
            jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
        except jsonschema.SchemaError as e:
            path = "".join(f"[{p!r}]" for p in e.absolute_path)
            raise GrammarError(f"{what} is not a valid JSON Schema: {e.message}"
                               + (f" (at {path})" if path else ""), what) from None
        for path, pattern in _patterns(schema):
            self._check_pattern(pattern, f"{what}{path}")
        return schema

    def _check_pattern(self, pattern: str, where: str) -> None:
        """Refuse a regex the lexer cannot build (``^(a{1000}){1000}$``: "too many expressions").

        llguidance builds a regex's lexer states lazily, at the first token
        inside the string, so such a grammar compiles and then fails while
        decoding -- a 500 for what is the client's schema.  The probe matches a
        string with the pattern up to the lexer's first mask inside it, once
        per pattern (cached like grammars), with a quarter of the lexer fuel
        decoding has (:data:`PATTERN_PROBE_FUEL`): how much a pattern costs
        depends on the grammar around it, so a pattern must fit with room to
        spare.  ``^(a{500}){500}$`` is refused too: it fits decoding's fuel, but
        each of its masks took seconds of the engine thread."""
        with self._lock:
            if pattern in self._patterns:
                self._patterns.move_to_end(pattern)
                return
        spec = llg.LLMatcher.grammar_from_json_schema(self._with_options({"type": "string", "pattern": pattern}))
        probe = llg.LLMatcher(self.ll_tokenizer, spec, log_level=0,
                              limits=llg.LLParserLimits(initial_lexer_fuel=PATTERN_PROBE_FUEL))
        probe.compute_bitmask()
        probe.consume_tokens(self.ll_tokenizer.tokenize_str('"'))
        probe.compute_bitmask()
        if probe.is_error():
            raise GrammarError(f"{where}: the pattern {pattern[:80]!r} is too complex for constrained decoding "
                               f"({_clean(probe.get_error()).splitlines()[0]})", where)
        with self._lock:
            self._patterns[pattern] = None
            while len(self._patterns) > self._cache_size:
                self._patterns.popitem(last=False)

    @staticmethod
    def _with_options(schema: Mapping[str, Any]) -> Dict[str, Any]:
        """``schema`` with our layout options; a client's own ``x-guidance``
        (llguidance's extension) is replaced, not merged, so clients cannot
        switch on e.g. lenient mode."""
        out = dict(schema)
        out["x-guidance"] = dict(JSON_OPTIONS)
        return out

    def _functions(self, tools: Sequence[Mapping[str, Any]]) -> _Functions:
        """``{name: parameters schema}`` of the function tools, in order (with each one's request field)."""
        if not isinstance(tools, (list, tuple)):
            raise GrammarError("tools must be a list", "tools")
        out = _Functions()
        out.where = {}
        for i, t in enumerate(tools):
            if not isinstance(t, Mapping):
                raise GrammarError(f"tools[{i}] must be an object", f"tools[{i}]")
            if t.get("type", "function") != "function":
                continue  # other tool types (built-in server tools) take no part in tool_choice
            fn = t.get("function", t)
            name = fn.get("name") if isinstance(fn, Mapping) else None
            if not isinstance(name, str) or not name:
                raise GrammarError(f"tools[{i}].function.name must be a non-empty string", f"tools[{i}].function.name")
            if name in out:
                raise GrammarError(f"tools: function name {name!r} appears twice", "tools")
            params = fn.get("parameters")
            out.where[name] = f"tools[{i}].function.parameters"
            out[name] = (copy.deepcopy(_NO_PARAMETERS) if params is None
                         else self._check_schema(params, out.where[name]))
        return out


#: keywords whose value is a schema, or an object / array of schemas (JSON Schema 2020-12 and draft 7)
_SUBSCHEMA = frozenset(("items", "additionalItems", "contains", "additionalProperties", "propertyNames", "not",
                        "if", "then", "else", "unevaluatedItems", "unevaluatedProperties", "prefixItems",
                        "allOf", "anyOf", "oneOf", "properties", "patternProperties", "$defs", "definitions",
                        "dependentSchemas"))
_SCHEMA_MAPS = frozenset(("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"))


def _patterns(schema: Any) -> List[Tuple[str, str]]:
    """``(path, regex)`` of every ``pattern`` and ``patternProperties`` key in ``schema``, found
    without recursion (the path as ``.properties.a.pattern``)."""
    out: List[Tuple[str, str]] = []
    todo: List[Tuple[str, Any]] = [("", schema)]
    while todo:
        path, node = todo.pop()
        if not isinstance(node, dict):
            continue
        if isinstance(node.get("pattern"), str):
            out.append((f"{path}.pattern", node["pattern"]))
        for key, value in node.items():
            if key not in _SUBSCHEMA:
                continue
            if key == "patternProperties" and isinstance(value, dict):
                out += [(f"{path}.patternProperties", k) for k in value]
            if key in _SCHEMA_MAPS and isinstance(value, dict):
                todo += [(f"{path}.{key}.{k}", v) for k, v in value.items()]
            elif isinstance(value, list):
                todo += [(f"{path}.{key}[{i}]", v) for i, v in enumerate(value)]
            else:
                todo.append((f"{path}.{key}", value))
    return out


def json_object_lark(depth: int = 4, width: int = 16, max_string: int = 512, max_key: int = 64) -> str:
    """The Lark grammar of ``response_format: json_object``: a JSON object, bounded.

    ``depth`` levels of nesting, ``width`` members/items per container,
    strings up to ``max_string`` characters, numbers with at most 16 integer
    digits, 15 decimals and a 2-digit exponent (never ``1e999``), keys of 1 to
    ``max_key`` characters starting with a letter, digit, ``_``, ``$``, ``@``
    or a non-ASCII character (a key like ``", "`` is how a small model starts
    looping).  Layout as :data:`JSON_OPTIONS`.  Every output is finite; with
    :class:`KeyGuard`'s unique keys a looping model runs out of room and
    closes the object, after which only EOS is allowed.
    """
    rules = [f"start: obj{depth}"]
    for d in range(depth, 0, -1):
        rules.append(f'obj{d}: "{{" "}}" | "{{" m{d} (", " m{d}){{0,{width - 1}}} "}}"')
        rules.append(f'm{d}: KEY ": " val{d - 1}')
        if d < depth:
            rules.append(f"val{d}: obj{d} | arr{d} | scalar")
            rules.append(f'arr{d}: "[" "]" | "[" val{d - 1} (", " val{d - 1}){{0,{width - 1}}} "]"')
    rules += ["val0: scalar", 'scalar: STRING | NUMBER | "true" | "false" | "null"',
              f'KEY: /"[A-Za-z0-9_$@\\u00C0-\\uFFFF][^"\\\\\\x00-\\x1f]{{0,{max_key - 1}}}"/',
              f'STRING: /"(\\\\(["\\\\\\/bfnrt]|u[0-9a-fA-F]{{4}})|[^"\\\\\\x00-\\x1f]){{0,{max_string}}}"/',
              'NUMBER: /-?(0|[1-9][0-9]{0,15})(\\.[0-9]{1,15})?([eE][+-]?[0-9]{1,2})?/']
    return "\n".join(rules) + "\n"


@dataclass(frozen=True)
class _TokenTable:
    raw: List[bytes]          # each token's bytes
    one_quote: np.ndarray     # tokens holding exactly one '"' (can close a key being written)
    quotes: np.ndarray        # tokens holding two or more (can open and close a key)


_QUOTE, _BSLASH = 0x22, 0x5C
_OBJ, _ARR = 0x7B, 0x5B


class KeyGuard:
    """Masks every token that would complete a key its object already has.

    JSON Schema (and so llguidance) cannot forbid duplicate keys, and a small
    model under ``{"type": "object"}`` loops on them.  The guard follows the
    JSON structure of the generated bytes (which the grammar keeps valid):
    for each open object, the keys written so far; inside a key string, the
    bytes of the key.  A token can complete a key only if it holds a ``"``
    (two when it must also open it), so only the grammar-allowed tokens with
    quotes are simulated: a few hundred at most, at a key, a few microseconds
    each.  Keys are compared as written (escapes not decoded).
    """

    def __init__(self, table: _TokenTable) -> None:
        self.table = table
        self.consumed = 0
        # frames: [is_object, keys]; the innermost last
        self.frames: List[Tuple[bool, set]] = []
        self.expect_key = False   # in the innermost object, at a key position
        self.in_str = False
        self.esc = False
        self.in_key = False
        self.key = bytearray()

    def feed(self, generated: Sequence[int]) -> None:
        raw = self.table.raw
        for tok in generated[self.consumed:]:
            tok = int(tok)
            if tok < len(raw):
                self._scan(raw[tok], commit=True)
        self.consumed = len(generated)

    def restrict(self, allowed: np.ndarray) -> np.ndarray:
        """``allowed`` without the tokens that would repeat a key (a copy when it changes)."""
        if not any(is_obj for is_obj, _ in self.frames):
            return allowed
        n = min(allowed.shape[0], self.table.quotes.shape[0])
        quoted = self.table.quotes[:n] | self.table.one_quote[:n] if self.in_key else self.table.quotes[:n]
        cand = allowed[:n] & quoted
        bad = [int(t) for t in np.flatnonzero(cand) if self._repeats(self.table.raw[int(t)])]
        if not bad:
            return allowed
        out = allowed.copy()
        out[bad] = False
        return out if out.any() else allowed  # never leave nothing: the grammar's word is final

    # -- the scanner: commit=True updates the state; False simulates and reports a repeated key
    def _repeats(self, data: bytes) -> bool:
        return self._scan(data, commit=False)

    def _scan(self, data: bytes, commit: bool) -> bool:  # noqa: C901
        frames = self.frames if commit else list(self.frames)
        added: Dict[int, set] = {}
        expect_key, in_str, esc, in_key = self.expect_key, self.in_str, self.esc, self.in_key
        key = self.key if commit else bytearray(self.key)
        for b in data:
            if in_str:
                if esc:
                    esc = False
                elif b == _BSLASH:
                    esc = True
                elif b == _QUOTE:
                    in_str = False
                    if in_key:
                        in_key = False
                        k = bytes(key)
                        keys = frames[-1][1]
                        if k in keys or k in added.get(len(frames), ()):
                            if not commit:
                                return True
                        if commit:
                            keys.add(k)
                        else:
                            added.setdefault(len(frames), set()).add(k)
                    continue
                if in_key:
                    key.append(b)
                continue
            if b == _QUOTE:
                in_str = True
                in_key = expect_key
                expect_key = False
                key.clear()
            elif b == _OBJ or b == _ARR:
                frames.append((b == _OBJ, set()))
                if not commit:
                    added.pop(len(frames), None)
                expect_key = b == _OBJ
            elif b == 0x7D or b == 0x5D:  # } ]
                if frames:
                    frames.pop()
                expect_key = False
            elif b == 0x2C:  # ,
                expect_key = bool(frames) and frames[-1][0]
        if commit:
            self.expect_key, self.in_str, self.esc, self.in_key = expect_key, in_str, esc, in_key
        return False


def _clean(err: str) -> str:
    """llguidance errors carry a grammar-position prefix that means nothing to a client."""
    return err.strip().removeprefix("Error: ").strip()


# =================================================================== processor
class GrammarProcessor:
    """Logits processor enforcing one grammar on one ``generate`` stream.

    Each call feeds the tokens sampled since the previous call to the
    matcher (the engine passes the whole list of generated tokens), then
    masks the logits: allowed tokens keep their value, the others become
    ``-inf``.  Once the grammar is complete only EOS remains allowed, so the
    engine ends the stream with finish_reason ``"stop"``.

    ``steps`` and ``overhead_s`` (total time spent in calls) are kept for
    metrics and benchmarks.

    The matcher does not pickle; the processor pickles as a recipe (its
    ``spec``, ``kind``, EOS ids, vocabulary size and whether it has a
    :class:`KeyGuard`) that rebuilds a fresh processor in an engine worker
    process (:class:`~interlace.engine_ext.worker.ProcessEngine`) through a
    per-process :class:`GrammarCompiler` for that engine's tokenizer
    (:func:`serve_in_worker`).  Only a processor that has not started can be
    shipped (the parse state stays behind).
    """

    def __init__(self, matcher: Any, eos_token_ids: Sequence[int], vocab_size: int, *, kind: str = "grammar",
                 key_guard: Optional["KeyGuard"] = None, spec: Optional[str] = None):
        self.matcher = matcher
        #: the llguidance grammar string: engines that run grammars themselves (vLLM) take it instead
        self.spec = spec
        self.key_guard = key_guard
        self.kind = kind
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.consumed = 0
        self.steps = 0
        self.overhead_s = 0.0
        self._eos_only: Optional[np.ndarray] = None

    def __reduce__(self) -> Tuple[Any, tuple]:
        if self.spec is None:
            raise TypeError(f"this {self.kind} GrammarProcessor has no grammar spec to rebuild it from")
        if self.consumed or self.steps:
            raise TypeError(f"this {self.kind} GrammarProcessor has started ({self.steps} steps): "
                            "its parse state cannot be shipped")
        return _rebuild_processor, (self.spec, self.kind, tuple(self.eos_token_ids), self.vocab_size,
                                    self.key_guard is not None)

    def segment_grammar(self, n_generated: int) -> Dict[str, Any]:
        """For engines that sample by themselves (vLLM's structured outputs):
        the grammar as ``{"json": schema}`` or ``{"grammar": lark}``.  Such
        an engine starts a grammar afresh with each request, so it can only
        be given at the start of the output."""
        if n_generated:
            raise ConstraintViolation(f"this {self.kind} grammar cannot go on across a pause on this engine")
        try:
            grammars = json.loads(self.spec or "{}").get("grammars") or []
        except ValueError:  # llguidance keeps a Lark grammar as its text (some versions)
            return {"grammar": self.spec}
        if len(grammars) == 1 and "json_schema" in grammars[0]:
            return {"json": grammars[0]["json_schema"]}
        if len(grammars) == 1 and "lark_grammar" in grammars[0]:
            return {"grammar": grammars[0]["lark_grammar"]}
        raise ConstraintViolation(f"this {self.kind} grammar is not one Lark grammar or JSON schema")

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but EOS may follow."""
        return self.matcher.is_stopped()

    def __call__(self, generated: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        import torch  # loaded already: logits are torch tensors (see the module docstring)

        t0 = time.perf_counter()
        n = len(generated)
        if n < self.consumed:
            raise ConstraintViolation(f"{self.kind} processor saw {n} generated tokens after {self.consumed}: "
                                      "a processor must not be shared between requests")
        m = self.matcher
        for tok in generated[self.consumed:n]:
            if m.is_stopped():
                break  # a token past the end (an EOS let through with ignore_eos): nothing left to match
            if not m.consume_token(int(tok)):
                raise ConstraintViolation(f"{self.kind} constraint rejected token {int(tok)} "
                                          f"after {self.consumed} tokens: {_clean(m.get_error())}")
        self.consumed = n
        allowed = self._allowed(logits.shape[-1])
        if self.key_guard is not None:
            self.key_guard.feed(generated)
            if not m.is_stopped():
                allowed = self.key_guard.restrict(allowed)
        if logits.device.type == "cpu" and logits.dtype == torch.float32:
            # numpy, not torch: torch's intra-op thread pool turns this 50k-element
            # select into milliseconds when the cores are busy (the engine thread
            # is running the model at the same time); numpy is single-threaded
            out = np.full(allowed.shape[0], -np.inf, dtype=np.float32)
            np.copyto(out, logits.detach().numpy(), where=allowed)
            result = torch.from_numpy(out)
        else:
            mask = torch.from_numpy(allowed).to(logits.device, non_blocking=True)
            result = logits.masked_fill(~mask, float("-inf"))
        self.steps += 1
        self.overhead_s += time.perf_counter() - t0
        return result

    def _allowed(self, width: int) -> np.ndarray:
        """Boolean mask over ``width`` logits."""
        m = self.matcher
        if m.is_stopped():
            if self._eos_only is None or self._eos_only.shape[0] != width:
                mask = np.zeros(width, dtype=np.bool_)
                mask[[e for e in self.eos_token_ids if e < width]] = True
                self._eos_only = mask
            return self._eos_only
        words = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
        if m.is_error():
            raise ConstraintViolation(f"{self.kind} constraint failed after {self.consumed} tokens: "
                                      f"{_clean(m.get_error())}")
        bits = np.unpackbits(words, bitorder="little").view(np.bool_)  # token i = bit i of the LE words
        if bits.shape[0] >= width:
            bits = bits[:width]
        else:  # logits wider than the tokenizer: the extra ids have no text
            bits = np.concatenate([bits, np.zeros(width - bits.shape[0], dtype=np.bool_)])
        if m.is_accepting():  # llguidance allows the primary EOS; allow every EOS id the engine stops on
            bits[[e for e in self.eos_token_ids if e < width]] = True
        if not bits.any():
            raise ConstraintViolation(f"{self.kind} constraint allows no token after {self.consumed} tokens")
        return bits


# ============================================================ processors in worker processes
_compilers: Dict[Tuple[int, int, Tuple[int, ...]], GrammarCompiler] = {}
_compilers_lock = threading.Lock()
#: (engine name, its tokenizer) of the engine this process serves as a worker; None in any other process
_worker: Optional[Tuple[str, Any]] = None


def serve_in_worker(engine_name: str, tokenizer: Any) -> None:
    """Declare this process an engine worker serving ``engine_name``.  A
    :class:`GrammarProcessor` unpickled here is then rebuilt for
    ``tokenizer`` (None for a model without one, which refuses them).
    ``engine_ext/worker.py`` calls it in its child once the engine is built."""
    global _worker
    _worker = (engine_name, tokenizer)


def _process_compiler(tokenizer: Any, vocab_size: int, eos_token_ids: Tuple[int, ...]) -> GrammarCompiler:
    """This process's compiler for ``tokenizer`` (built on first use, then cached)."""
    key = (id(tokenizer), vocab_size, eos_token_ids)  # the compiler holds the tokenizer: the id stays its own
    with _compilers_lock:
        gc = _compilers.get(key)
        if gc is None:
            gc = _compilers[key] = GrammarCompiler(tokenizer, vocab_size=vocab_size, eos_token_ids=eos_token_ids)
        return gc


def _rebuild_processor(spec: str, kind: str, eos_token_ids: Tuple[int, ...], vocab_size: int,
                       key_guard: bool) -> GrammarProcessor:
    """Unpickle a :class:`GrammarProcessor` (its ``__reduce__``): a fresh
    one for the same grammar, built for the tokenizer of the engine this
    worker process serves."""
    engine_name, tokenizer = _worker or (None, None)
    if tokenizer is None:
        raise RuntimeError("a GrammarProcessor is rebuilt only in an engine worker process whose model has a "
                           "tokenizer" + ("" if engine_name is None else f" (engine {engine_name!r} has none)"))
    gc = _process_compiler(tokenizer, vocab_size, tuple(eos_token_ids))
    if (gc.vocab_size, gc.eos_token_ids) != (vocab_size, tuple(eos_token_ids)):
        raise RuntimeError(f"this {kind} grammar was built for another tokenizer (vocabulary {vocab_size}, "
                           f"EOS {list(eos_token_ids)}; the engine's: {gc.vocab_size}, {list(gc.eos_token_ids)})")
    grammar = gc.compile(spec, kind)
    if (grammar.kind, grammar.unique_keys) != (kind, key_guard):  # the cache holds it under another kind
        grammar = dataclasses.replace(grammar, kind=kind, unique_keys=key_guard)
    return gc.processor(grammar)
