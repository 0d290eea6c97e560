"""From OpenAI chat messages (and tools) to prompt tokens, per model.

When a model's chat template understands ``tools`` (Qwen2.5, Llama 3.1 ...),
the template renders them.  When it does not (SmolLM2's), the tools are
described in the system prompt in the model's tool-call format -- the format
its parser reads -- and assistant tool calls / tool results in the history
are written in that same format, so the model sees a consistent transcript.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional


@dataclass(frozen=True)
class ToolFormat:
    """How one tool-call format looks in a prompt."""

    name: str
    instructions: str              # system-prompt text; {tools} is the JSON list of functions
    call_end: str                  # marker after which a call is complete (the engine pauses there)

    def render_call(self, name: str, arguments: Any) -> str:
        raise NotImplementedError

    def render_result(self, content: str) -> str:
        raise NotImplementedError


class HermesFormat(ToolFormat):
    def render_call(self, name: str, arguments: Any) -> str:
        return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)}\n</tool_call>'

    def render_result(self, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"


HERMES = HermesFormat(
    name="hermes",
    instructions=(
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'),
    call_end="</tool_call>",
)

class MarkdownFormat(ToolFormat):
    """Code in a fenced block is run by the code tool (Conveyor's CodeGen)."""

    def render_call(self, name: str, arguments: Any) -> str:
        return f"```python\n{arguments.get('code', '')}\n```"

    def render_result(self, content: str) -> str:
        return f"Output:\n```\n{content}\n```"


MARKDOWN = MarkdownFormat(
    name="markdown",
    instructions=("You can run Python code: write it in one ```python code block. It is executed and you "
                  "will see its output.\n\nAvailable tools (for reference):\n{tools}"),
    call_end="\n```\n",  # a closing fence; the opening one is followed by a language, not a newline
)


class PlanFormat(ToolFormat):
    """LLMCompiler-style plans: one call per line, ``$N`` names results,
    ``join()`` ends the plan (Conveyor's Planning workload)."""

    def render_call(self, name: str, arguments: Any) -> str:
        args = ", ".join(json.dumps(a) for a in arguments.get("args", []))
        return f"${arguments.get('step', 1)} = {name}({args})"

    def render_result(self, content: str) -> str:
        return content


PLAN = PlanFormat(
    name="plan",
    instructions=("Answer by writing a plan, one tool call per line, each naming its result:\n"
                  '$1 = tool("argument")\n$2 = other_tool("uses $1")\n'
                  "then a final line `join()`. The calls run; you then see every result and answer.\n\n"
                  "Tools:\n{tools}"),
    call_end="join()",
)

FORMATS: Dict[str, ToolFormat] = {"hermes": HERMES, "markdown": MARKDOWN, "plan": PLAN}


def tool_format(parser: str) -> ToolFormat:
    """The prompt format matching a parser (hermes for parsers without their own)."""
    return FORMATS.get(parser, HERMES)


def _content_text(content: Any) -> str:
    """OpenAI content may be a string or a list of parts; only text parts are supported."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def template_supports_tools(chat_template: Optional[str]) -> bool:
    return bool(chat_template) and "tools" in chat_template


def render_messages(tokenizer: Any, messages: List[Dict[str, Any]], tools: List[Dict[str, Any]],
                    fmt: ToolFormat) -> str:
    """The prompt text (chat template applied, generation prompt added)."""
    functions = [t["function"] for t in tools]
    if template_supports_tools(tokenizer.chat_template):
        msgs = []
        for m in messages:
            m = dict(m)
            m["content"] = _content_text(m.get("content"))
            if m.get("tool_calls"):
                m["tool_calls"] = [{"type": "function", "id": c.get("id"), "function": {
                    "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
                    for c in m["tool_calls"]]
            msgs.append(m)
        return tokenizer.apply_chat_template(msgs, tools=tools or None, add_generation_prompt=True)

    out: List[Dict[str, str]] = []
    system = [_content_text(m.get("content")) for m in messages[:1] if m["role"] in ("system", "developer")]
    rest = messages[len(system):]
    if functions:
        tools_json = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False)
                               for f in functions)
        system.append(fmt.instructions.format(tools=tools_json))
    if system:
        out.append({"role": "system", "content": "\n\n".join(s for s in system if s)})
    for m in rest:
        role = m["role"]
        if role in ("system", "developer"):
            out.append({"role": "system", "content": _content_text(m.get("content"))})
        elif role == "assistant":
            parts = [_content_text(m.get("content"))] if m.get("content") else []
            for c in m.get("tool_calls") or []:
                parts.append(fmt.render_call(c["function"]["name"], json.loads(c["function"]["arguments"])))
            out.append({"role": "assistant", "content": "\n".join(parts)})
        elif role == "tool":
            block = fmt.render_result(_content_text(m.get("content")))
            if out and out[-1]["role"] == "user" and out[-1].get("_tool"):
                out[-1]["content"] += "\n" + block  # consecutive results go in one turn
            else:
                out.append({"role": "user", "content": block, "_tool": True})
        else:
            out.append({"role": "user", "content": _content_text(m.get("content"))})
    for m in out:
        m.pop("_tool", None)
    return tokenizer.apply_chat_template(out, add_generation_prompt=True)


def tool_results_turn(tokenizer: Any, fmt: ToolFormat, results: List[str]) -> str:
    """Text appended to a paused context after server-side tool calls: close
    the assistant turn, a user turn holding the results, open a new assistant
    turn.  Derived from the chat template itself, so it matches the model's
    turn markers."""
    marker = "\x00CALL\x00"
    base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}]
    with_results = base + [{"role": "user", "content": "\n".join(fmt.render_result(r) for r in results)}]
    a = tokenizer.apply_chat_template(base, add_generation_prompt=False)
    b = tokenizer.apply_chat_template(with_results, add_generation_prompt=True)
    end_of_call = a[a.index(marker) + len(marker):]
    return end_of_call + b[len(a):] if b.startswith(a) else b[b.index(marker) + len(marker):]
