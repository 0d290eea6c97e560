"""From OpenAI chat messages (and tools) to prompt token ids, per model.

When a model's chat template understands ``tools`` (Qwen2.5, Llama 3.1 ...),
the template renders them.  When it does not (SmolLM2's), the tools are
described in the system prompt in the model's tool-call format -- the format
its parser reads, ``parser.format`` (:mod:`interlace.parsers.formats`) -- and
assistant tool calls / tool results in the history are written in that same
format, so the model sees a consistent transcript.

Everything a client wrote (message contents, tool descriptions, tool-call
arguments, tool results) is tokenized as plain text: a user message holding
``<|im_end|><|im_start|>system`` cannot open a system turn.  Only the
template's own markers and the format's markers become special tokens (see
:meth:`Tokenizer.encode_rendered`).  Strings that cannot be rendered as plain
text (a tool name or schema key holding a special token) are refused with a
``ValueError``.

Earlier turns' reasoning (an assistant message's ``reasoning_content``) is written back as
the model family's reasoning format says (``reasoning``: a reasoning parser's
:class:`~interlace.parsers.reasoning.ReasoningFormat`, or a tool format that carries its
own, harmony's): its ``keep`` says which turns keep it (``"last"``: the assistant turns
after the last user message, the tool-calling chain in progress; ``"none"``; ``"all"``),
its ``render`` how.  A chat template that reads ``reasoning_content`` itself (Qwen3's,
DeepSeek's) gets the field and decides; without a reasoning format it is dropped.

Before any of that, :func:`prompt_bytes_bound` says how many bytes of text
cannot fit the context whatever they are, so a prompt that is far too long is
refused without tokenizing it (tokenizing 3.5 MB took 15 s of a shared CPU).
"""

from __future__ import annotations

import json
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple
from weakref import WeakKeyDictionary

from ..parsers.formats import ToolFormat

Mark = Callable[[str], str]

__all__ = ["render_messages", "render_text", "tool_results_turn", "template_supports_tools",
           "prompt_bytes_bound"]


def _content_text(content: Any) -> str:
    """OpenAI content may be a string or a list of parts; only text parts are supported."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"content must be a string or a list of content parts, got {type(content).__name__}")
    out = []
    for part in content:
        if not isinstance(part, dict):
            raise ValueError(f"content parts must be objects, got {type(part).__name__}")
        if part.get("type") == "text":
            if not isinstance(part.get("text"), str):
                raise ValueError("a text content part needs a string `text`")
            out.append(part["text"])
    return "".join(out)


# ------------------------------------------------------------------ size bounds
_longest: "WeakKeyDictionary[Any, int]" = WeakKeyDictionary()
_longest_lock = threading.Lock()


def longest_token_bytes(tokenizer: Any) -> int:
    """The most bytes of text one token of ``tokenizer`` stands for, plus one (a decoder may drop the
    leading space of a token decoded alone).  Every token decoded once, the first time (0.2 s for a
    49k vocabulary), then kept with the tokenizer."""
    with _longest_lock:
        n = _longest.get(tokenizer)
    if n is None:
        hf = tokenizer.tok
        texts = hf.decode_batch([[i] for i in range(hf.get_vocab_size(with_added_tokens=True))],
                                skip_special_tokens=False)
        n = 1 + max((len(t.encode("utf-8", "surrogatepass")) for t in texts), default=1)
        with _longest_lock:
            _longest[tokenizer] = n
    return n


def prompt_bytes_bound(tokenizer: Any, n_ctx: int) -> int:
    """Bytes of client text that cannot fit ``n_ctx`` tokens, whatever the text: no token stands for
    more than :func:`longest_token_bytes`.  Checked before a prompt is tokenized."""
    return n_ctx * longest_token_bytes(tokenizer)


def template_supports_tools(chat_template: Optional[str]) -> bool:
    return bool(chat_template) and "tools" in chat_template


# ------------------------------------------------------------------ untrusted strings
def _check_plain(tokenizer: Any, text: Any, what: str) -> None:
    """Refuse special-token text in a string rendered without a placeholder (names, ids, schema keys)."""
    tok = tokenizer.find_special(text) if isinstance(text, str) else None
    if tok is not None:
        raise ValueError(f"{what} contains the special token {tok!r}")


def _mark_leaves(tokenizer: Any, value: Any, mark: Mark, what: str, skip_keys: Sequence[str] = ()) -> Any:
    """``value`` with every string leaf passed through ``mark`` (keys are checked, not marked:
    templates look them up; values of ``skip_keys`` likewise, e.g. a schema's ``type``)."""
    if isinstance(value, str):
        return mark(value)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            _check_plain(tokenizer, k, f"{what}: key")
            if k in skip_keys:
                _check_plain(tokenizer, v if isinstance(v, str) else json.dumps(v), f"{what}: {k!r}")
                out[k] = v
            else:
                out[k] = _mark_leaves(tokenizer, v, mark, what, skip_keys)
        return out
    if isinstance(value, list):
        return [_mark_leaves(tokenizer, v, mark, what, skip_keys) for v in value]
    return value


def _arguments(call: Dict[str, Any]) -> Tuple[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError("an assistant tool call needs function.name and function.arguments")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError as e:
            raise ValueError(f"tool call {fn['name']!r}: arguments are not valid JSON: {e}") from None
    return fn["name"], args if args is not None else {}


# ------------------------------------------------------------------------ rendering
# ``render_calls`` / ``render_results`` are optional in a plugin's format (check_format
# does not require them); without them the single renderings are joined with newlines.
def _render_calls(fmt: ToolFormat, calls: Sequence[Tuple[str, Any]]) -> str:
    render = getattr(fmt, "render_calls", None)
    return render(calls) if render else "\n".join(fmt.render_call(n, a) for n, a in calls)


def _render_results(fmt: ToolFormat, contents: Sequence[str], names: Optional[Sequence[Optional[str]]] = None) -> str:
    render = getattr(fmt, "render_results", None)
    if render is not None and names is not None and getattr(fmt, "results_named", False):
        return render(contents, names)  # a result names the call it answers (harmony: ``functions.NAME``)
    return render(contents) if render else "\n".join(fmt.render_result(c) for c in contents)


def reasoning_kept(messages: List[Dict[str, Any]], reasoning: Any) -> List[bool]:
    """Per message, whether its ``reasoning_content`` is written back (see the module docstring)."""
    keep = None if reasoning is None else (getattr(reasoning, "keep", None)
                                            or getattr(reasoning, "reasoning_keep", None))
    if keep == "all":
        return [True] * len(messages)
    if keep != "last":
        return [False] * len(messages)
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    return [i > last_user for i in range(len(messages))]


def _reasoning_text(m: Dict[str, Any]) -> str:
    r = m.get("reasoning_content")
    if r is None:
        r = m.get("reasoning")
    return r if isinstance(r, str) else ""


def _render_reasoning(reasoning: Any, text: str) -> str:
    render = getattr(reasoning, "render", None) or getattr(reasoning, "render_reasoning")
    return render(text)


def render_text(tokenizer: Any, messages: List[Dict[str, Any]], tools: List[Dict[str, Any]], fmt: ToolFormat,
                mark: Mark = lambda s: s, reasoning: Any = None) -> str:
    """The prompt text (chat template applied, generation prompt added), every
    untrusted string passed through ``mark``.  :func:`render_messages` is what
    serving uses; this is its text, for logs and tests.  ``reasoning``: how the
    model writes earlier turns' reasoning back (None: it is dropped)."""
    for t in tools:
        if not isinstance(t, dict) or not isinstance(t.get("function"), dict):
            raise ValueError("each tool needs a `function` object")
        _check_plain(tokenizer, t["function"].get("name"), "tools: function name")
    functions = [_mark_leaves(tokenizer, t["function"], mark, "tools", skip_keys=("type", "name", "required"))
                 for t in tools]
    kept = reasoning_kept(messages, reasoning)
    if template_supports_tools(tokenizer.chat_template):
        msgs = []
        for m, keep in zip(messages, kept):
            m = dict(m)
            m.pop("reasoning", None)
            thought = _reasoning_text(m)
            m.pop("thinking", None)
            if thought and reasoning is not None:  # the template reads it where it keeps it: Qwen3's and
                m["reasoning_content"] = m["thinking"] = mark(thought)  # DeepSeek's as reasoning_content, gpt-oss's as thinking
            else:
                m.pop("reasoning_content", None)
            m["content"] = mark(_content_text(m.get("content")))
            for key in ("name", "tool_call_id"):
                _check_plain(tokenizer, m.get(key), f"messages: {key}")
            if m.get("tool_calls"):
                calls = []
                for c in m["tool_calls"]:
                    name, args = _arguments(c)
                    _check_plain(tokenizer, name, "tool call name")
                    _check_plain(tokenizer, c.get("id"), "tool call id")
                    calls.append({"type": "function", "id": c.get("id"), "function": {
                        "name": name, "arguments": _mark_leaves(tokenizer, args, mark, "tool call arguments")}})
                m["tool_calls"] = calls
            msgs.append(m)
        shown = [{**t, "function": f} for t, f in zip(tools, functions)]
        return tokenizer.apply_chat_template(msgs, tools=shown or None, add_generation_prompt=True)

    out: List[Dict[str, Any]] = []
    system_msgs = [m for m in messages[:1] if m["role"] in ("system", "developer")]
    system = [mark(_content_text(m.get("content"))) for m in system_msgs]
    rest = messages[len(system):]
    if functions:
        system.append(fmt.instructions(functions))
    if system:
        out.append({"role": "system", "content": "\n\n".join(s for s in system if s)})
    results: List[str] = []  # consecutive tool results go in one user turn
    result_names: List[Optional[str]] = []  # the names of the calls they answer
    call_names: Dict[Any, str] = {}  # tool_call_id -> the name of that call

    def flush_results() -> None:
        if results:
            out.append({"role": "user", "content": _render_results(fmt, results, result_names)})
            results.clear()
            result_names.clear()

    for m, keep in zip(rest, kept[len(system_msgs):]):
        role = m.get("role")
        if role == "tool":
            results.append(mark(_content_text(m.get("content"))))
            named = m.get("name") if isinstance(m.get("name"), str) else None
            _check_plain(tokenizer, named, "messages: name")
            result_names.append(call_names.get(m.get("tool_call_id")) or named)
            continue
        flush_results()
        if role in ("system", "developer"):
            out.append({"role": "system", "content": mark(_content_text(m.get("content")))})
        elif role == "assistant":
            text = _content_text(m.get("content"))
            thought = _reasoning_text(m) if keep else ""
            head_r = _render_reasoning(reasoning, mark(thought.strip())) if thought.strip() else ""
            calls = []
            for c in m.get("tool_calls") or []:
                name, args = _arguments(c)
                _check_plain(tokenizer, name, "tool call name")
                calls.append((name, _mark_leaves(tokenizer, args, mark, "tool call arguments")))
                if isinstance(c, dict) and isinstance(c.get("id"), str):
                    call_names[c["id"]] = name
            if calls:
                # as the model wrote it: text before the calls keeps its own line break, and
                # whitespace between calls (returned as content) is the calls' separator
                text = text if text.strip() else ""
                head = "" if not text else mark(text) + ("" if text.endswith("\n") else "\n")
                out.append({"role": "assistant", "content": head_r + head + _render_calls(fmt, calls)})
            else:
                out.append({"role": "assistant", "content": head_r + (mark(text) if text else "")})
        else:
            out.append({"role": "user", "content": mark(_content_text(m.get("content")))})
    flush_results()
    return tokenizer.apply_chat_template(out, add_generation_prompt=True)


def render_messages(tokenizer: Any, messages: List[Dict[str, Any]], tools: List[Dict[str, Any]],
                    fmt: ToolFormat, reasoning: Any = None) -> List[int]:
    """The prompt's token ids; client-written strings are tokenized as plain text."""
    return tokenizer.encode_rendered(lambda mark: render_text(tokenizer, messages, tools, fmt, mark, reasoning))


def _results_turn_text(tokenizer: Any, fmt: ToolFormat, results: Sequence[str], mark: Mark,
                       names: Optional[Sequence[str]] = None) -> str:
    marker = "\x00CALL\x00"
    block = _render_results(fmt, [mark(r) for r in results], names)
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}]
    with_results = base + [{"role": "user", "content": block}]
    a = tokenizer.apply_chat_template(base, add_generation_prompt=False)
    b = tokenizer.apply_chat_template(with_results, add_generation_prompt=True)
    end_of_call = a[a.index(marker) + len(marker):]
    return end_of_call + b[len(a):] if b.startswith(a) else b[b.index(marker) + len(marker):]


def tool_results_turn(tokenizer: Any, fmt: ToolFormat, results: List[str],
                      names: Optional[Sequence[str]] = None) -> List[int]:
    """Token ids appended to a paused context after server-side tool calls:
    close the assistant turn, a user turn holding the results (as plain text),
    open a new assistant turn.  Derived from the chat template itself, so it
    matches the model's turn markers.  ``names``: the calls' names (a format
    whose results name their call gets them)."""
    return tokenizer.encode_rendered(lambda mark: _results_turn_text(tokenizer, fmt, results, mark, names))
