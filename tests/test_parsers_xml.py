"""The XML tool-call parsers, qwen3_coder (parsers/qwen3_coder.py) and glm45 (parsers/glm45.py).

Split invariance (hypothesis), every model output vLLM's and SGLang's tests accept for these formats (each
case names its peer test; the ones we refuse say why), values typed by the tool's schema, streamed argument
deltas that reassemble the final arguments, render -> parse round trips, malformed and unterminated calls.
The forcing grammars and the HTTP path are tested in test_formats_e2e_xml.py.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_parsers import calls, check_invariants, normalise, registry, text_of

from interlace.parsers import (
    ArgumentsDelta,
    FieldComplete,
    Glm45Parser,
    ParserError,
    Qwen3CoderParser,
    StreamingParser,
    Text,
    ToolCallEnd,
    ToolCallStart,
    counting_ids,
)
from interlace.parsers.builtin import BUILTIN_PARSERS
from interlace.parsers.events import Event
from interlace.parsers.formats import check_format
from interlace.parsers.glm45 import GLM45
from interlace.parsers.qwen3_coder import QWEN3_CODER, typed_value

PARSERS: dict[str, type[StreamingParser]] = {"qwen3_coder": Qwen3CoderParser, "glm45": Glm45Parser}
FMTS = sorted(PARSERS)
Tools = Mapping[str, Any]


def run(fmt: str, text: str, cuts: Sequence[int] = (), tools: Tools | None = None) -> list[Event]:
    """Feed ``text`` split at ``cuts`` to a fresh parser; all events, ``finish()``'s included."""
    p = PARSERS[fmt](id_factory=counting_ids(), tools=tools)
    events: list[Event] = []
    prev = 0
    for c in sorted(set(cuts)) + [len(text)]:
        events += p.feed(text[prev:c])
        prev = c
    return events + p.finish()


def errors(events: Sequence[Event]) -> list[ParserError]:
    return [e for e in events if isinstance(e, ParserError)]


def props(**types: Any) -> dict[str, Any]:
    """A parameters schema: ``props(city="string", n={"type": "integer"})``."""
    return {"type": "object", "properties": {k: ({"type": v} if isinstance(v, str) else v) for k, v in types.items()}}


# ---------------------------------------------------------------- the peers' tools ----
# vLLM tests/tool_parsers/test_qwen3coder_tool_parser.py and test_qwen3_xml_coder_shared.py
V_WEATHER = {"get_current_weather": props(city="string", state="string", unit="string"),
             "calculate_area": props(shape="string", dimensions="object", precision="integer")}
V_TYPES = {"test_types": props(int_param="integer", float_param="float", bool_param="boolean", str_param="string",
                               obj_param="object")}
V_ANYOF = {"test_anyof": props(
    anyof_int={"anyOf": [{"type": "integer"}, {"type": "null"}], "default": 5},
    anyof_str={"anyOf": [{"type": "string"}, {"type": "null"}]},
    anyof_array={"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}]},
    anyof_obj={"anyOf": [{"type": "object"}, {"type": "null"}]},
    type_as_array={"type": ["integer", "null"]},
    multi_non_null={"anyOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]})}
V_WRITE = {"write_file": props(path="string", content="string")}
# SGLang test/registered/function_call/test_qwen3_coder_detector/test_fixtures.py
S_TOOLS = {"get_current_weather": props(location="string", unit={"type": "string", "enum": ["celsius", "fahrenheit"]},
                                        days="integer"),
           "sql_interpreter": props(query="string", dry_run="boolean"),
           "TodoWrite": props(todos={"type": "array", "items": {"type": "object"}})}
# vLLM tests/tool_parsers/test_glm4_moe_tool_parser.py / SGLang TestGlm4MoeDetector
G_WEATHER = {"get_weather": props(city="string", date="string")}
G_TODO = {"todo_write": props(todos="array")}

DALLAS = {"city": "Dallas", "state": "TX", "unit": "fahrenheit"}


def qwen_call(name: str, args: Mapping[str, str], *, nl: bool = True) -> str:
    """A call as Qwen3-Coder writes it (values given as the model's text)."""
    sep = "\n" if nl else ""
    body = "".join(f"<parameter={k}>{sep}{v}{sep}</parameter>\n" for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


_NESTED = ('doc = """\n<tool_call>\n<function=write_file>\n<parameter=path>\nliteral/value.txt\n</parameter>\n'
           '<parameter=content>\nhello\n</parameter>\n</function>\n</tool_call>\n"""\n')
_TAGS_IN_CODE = ('char_deltas = [\n    "<tool_call>\\n",\n    "<parameter=query>\\n",\n    "\\n</parameter>\\n",\n'
                 '    "</function>\\n",\n]\n')
_PARAM_LINES = ('TOOL_CALL_TEMPLATE = """\n</parameter>\n<parameter=new_string>\n#!/usr/bin/env python3\n'
                '</parameter>\n"""\n')
_SAME_NAME = 'doc = """\n<parameter=path>\nliteral/value\n</parameter>\n"""\n'
_OUT_OF_SCHEMA = ('template = """\n<tool_call>\n<function=foo>\n<parameter=bar>baz</parameter>\n</function>\n'
                  '</tool_call>\n"""\n')

# (format, tools, model output, expected content, expected calls, expected ParserErrors)
COMPAT: list[tuple[str, Tools | None, str, str, list[tuple[str, dict]], int]] = [
    # --- vLLM test_qwen3coder_tool_parser.py / test_qwen3_xml_coder_shared.py: test_extract_tool_calls(_streaming)
    ("qwen3_coder", V_WEATHER, qwen_call("get_current_weather", DALLAS), "", [("get_current_weather", DALLAS)], 0),
    ("qwen3_coder", V_WEATHER, "Sure! Let me check the weather for you." + qwen_call("get_current_weather", DALLAS),
     "Sure! Let me check the weather for you.", [("get_current_weather", DALLAS)], 0),
    ("qwen3_coder", V_WEATHER, qwen_call("calculate_area", {"shape": "rectangle",
                                                           "dimensions": '{"width": 10, \n "height": 20}',
                                                           "precision": "2"}),
     "", [("calculate_area", {"shape": "rectangle", "dimensions": {"width": 10, "height": 20}, "precision": 2})], 0),
    ("qwen3_coder", V_WEATHER, qwen_call("get_current_weather", DALLAS) + "\n" + qwen_call(
        "get_current_weather", {"city": "Orlando", "state": "FL", "unit": "celsius"}),
     "", [("get_current_weather", DALLAS),
          ("get_current_weather", {"city": "Orlando", "state": "FL", "unit": "celsius"})], 0),
    ("qwen3_coder", V_WEATHER, "Let me calculate that area for you." + qwen_call(
        "calculate_area", {"shape": "circle", "dimensions": '{"radius": 15.5}', "precision": "3"}),
     "Let me calculate that area for you.",
     [("calculate_area", {"shape": "circle", "dimensions": {"radius": 15.5}, "precision": 3})], 0),
    # test_extract_tool_calls_fallback_no_tags: a bare <function=...> block
    ("qwen3_coder", V_WEATHER, "<function=get_current_weather>\n<parameter=city>\nDallas\n</parameter>\n"
                               "<parameter=state>\nTX\n</parameter>\n</function>",
     "", [("get_current_weather", {"city": "Dallas", "state": "TX"})], 0),
    # test_extract_tool_calls_type_conversion ("float" is vLLM's alias of number)
    ("qwen3_coder", V_TYPES, qwen_call("test_types", {"int_param": "42", "float_param": "3.14", "bool_param": "true",
                                                     "str_param": "hello world", "obj_param": '{"key": "value"}'}),
     "", [("test_types", {"int_param": 42, "float_param": 3.14, "bool_param": True, "str_param": "hello world",
                          "obj_param": {"key": "value"}})], 0),
    # test_extract_tool_calls_complex_type_with_single_quote: an object as a Python repr
    ("qwen3_coder", V_TYPES, qwen_call("test_types", {"obj_param": "{'key': 'value'}"}),
     "", [("test_types", {"obj_param": {"key": "value"}})], 0),
    # test_extract_tool_calls_anyof_type_conversion
    ("qwen3_coder", V_ANYOF, qwen_call("test_anyof", {"anyof_int": "5", "anyof_str": "hello",
                                                     "anyof_array": '["a", "b", "c"]', "anyof_obj": '{"key": "value"}',
                                                     "type_as_array": "42", "multi_non_null": "some text"}),
     "", [("test_anyof", {"anyof_int": 5, "anyof_str": "hello", "anyof_array": ["a", "b", "c"],
                          "anyof_obj": {"key": "value"}, "type_as_array": 42, "multi_non_null": "some text"})], 0),
    # test_extract_tool_calls_missing_closing_parameter_tag (+ _streaming_missing_closing_tag)
    ("qwen3_coder", V_WEATHER, "Let me check the weather for you:\n<tool_call>\n<function=get_current_weather>\n"
                               "<parameter=city>\nDallas\n<parameter=state>\nTX\n</parameter>\n<parameter=unit>\n"
                               "fahrenheit\n</parameter>\n</function>\n</tool_call>",
     "Let me check the weather for you:\n", [("get_current_weather", DALLAS)], 0),
    # test_extract_tool_calls_streaming_missing_opening_tag: a bare block, then a stray </tool_call>
    ("qwen3_coder", V_WEATHER, "I'll check the weather for you.\n\n<function=get_current_weather>\n<parameter=city>\n"
                               "Dallas\n</parameter>\n<parameter=state>\nTX\n</parameter>\n<parameter=unit>\n"
                               "fahrenheit\n</parameter>\n</function>\n</tool_call>",
     "I'll check the weather for you.\n\n", [("get_current_weather", DALLAS)], 0),
    # test_none_tool_calls_filtered: a broken call (no '>' after its name) does not hide the good one after it
    ("qwen3_coder", V_WEATHER, "<tool_call>\n<function=bad_func_no_gt\n</function>\n</tool_call>\n<tool_call>\n"
                               "<function=get_current_weather>\n<parameter=city>Dallas</parameter>\n"
                               "<parameter=state>TX</parameter>\n</function>\n</tool_call>",
     "", [("get_current_weather", {"city": "Dallas", "state": "TX"})], 1),
    # test_anyof_parameter_not_double_encoded (+ _streaming), values on one line with their tags
    ("qwen3_coder", {"update_record": props(data={"anyOf": [{"type": "object"}, {"type": "null"}]})},
     '<tool_call>\n<function=update_record>\n<parameter=data>{"key": "value", "count": 42}</parameter>\n'
     "</function>\n</tool_call>", "", [("update_record", {"data": {"key": "value", "count": 42}})], 0),
    # test_no_double_serialization_string_args
    ("qwen3_coder", {"greet": props(message="string")},
     "<tool_call>\n<function=greet>\n<parameter=message>hello world</parameter>\n</function>\n</tool_call>",
     "", [("greet", {"message": "hello world"})], 0),
    # test_string_null_value_preserved / test_anyof_string_null_keeps_value_as_string / ..._integer_null_parses_as_int
    ("qwen3_coder", {"search": props(query="string")}, qwen_call("search", {"query": "null"}, nl=False),
     "", [("search", {"query": "null"})], 0),
    ("qwen3_coder", {"set_code": props(code={"anyOf": [{"type": "string"}, {"type": "null"}]})},
     qwen_call("set_code", {"code": "42"}, nl=False), "", [("set_code", {"code": "42"})], 0),
    ("qwen3_coder", {"set_count": props(count={"anyOf": [{"type": "integer"}, {"type": "null"}]})},
     qwen_call("set_count", {"count": "42"}, nl=False), "", [("set_count", {"count": 42})], 0),
    # test_python_none_value_for_nullable_int / test_anyof_string_null_with_null_literal_returns_none
    ("qwen3_coder", {"set_count": props(count={"anyOf": [{"type": "integer"}, {"type": "null"}]})},
     qwen_call("set_count", {"count": "None"}, nl=False), "", [("set_count", {"count": None})], 0),
    ("qwen3_coder", {"set_value": props(optional={"anyOf": [{"type": "string"}, {"type": "null"}]})},
     qwen_call("set_value", {"optional": "None"}, nl=False) + qwen_call("set_value", {"optional": "null"}, nl=False),
     "", [("set_value", {"optional": None})] * 2, 0),
    # test_double_encoded_object_param_(non)streaming: an object as a JSON string of its Python repr
    ("qwen3_coder", {"process": props(name="string", data="object")},
     qwen_call("process", {"name": "hello", "data": "\"{'key': 'value', 'n': 1}\""}) + "\n",
     "", [("process", {"name": "hello", "data": {"key": "value", "n": 1}})], 0),
    # test_content_with_xml_structural_tags / _param_like_lines / _real_param_name_literal / _full_nested_tool_call
    ("qwen3_coder", V_WRITE, "<tool_call>\n<function=write_file>\n<parameter=path>\ntest.py\n</parameter>\n"
                             f"<parameter=content>\n{_TAGS_IN_CODE}</parameter>\n</function>\n</tool_call>\n",
     "", [("write_file", {"path": "test.py", "content": _TAGS_IN_CODE.rstrip("\n")})], 0),
    ("qwen3_coder", V_WRITE, "<tool_call>\n<function=write_file>\n<parameter=path>\ntest_template.py\n</parameter>\n"
                             f"<parameter=content>\n{_PARAM_LINES}</parameter>\n</function>\n</tool_call>\n",
     "", [("write_file", {"path": "test_template.py", "content": _PARAM_LINES.rstrip("\n")})], 0),
    ("qwen3_coder", V_WRITE, "<tool_call>\n<function=write_file>\n<parameter=path>\nfixture.py\n</parameter>\n"
                             f"<parameter=content>\n{_SAME_NAME}</parameter>\n</function>\n</tool_call>",
     "", [("write_file", {"path": "fixture.py", "content": _SAME_NAME.rstrip("\n")})], 0),
    ("qwen3_coder", V_WRITE, "<tool_call>\n<function=write_file>\n<parameter=path>\nfixture.py\n</parameter>\n"
                             f"<parameter=content>\n{_NESTED}</parameter>\n</function>\n</tool_call>",
     "", [("write_file", {"path": "fixture.py", "content": _NESTED.rstrip("\n")})], 0),
    # test_two_tools_second_with_out_of_schema_nested_literal_(non)streaming
    ("qwen3_coder", V_WRITE, "<tool_call>\n<function=foo>\n<parameter=bar>baz</parameter>\n</function>\n</tool_call>"
                             "\n\n<tool_call>\n<function=write_file>\n<parameter=path>\nfixture.py\n</parameter>\n"
                             f"<parameter=content>\n{_OUT_OF_SCHEMA}</parameter>\n</function>\n</tool_call>",
     "", [("foo", {"bar": "baz"}), ("write_file", {"path": "fixture.py", "content": _OUT_OF_SCHEMA.rstrip("\n")})], 0),
    # test_array_with_json_bool
    ("qwen3_coder", {"pick": props(items="array")}, qwen_call("pick", {"items": '["a", "b", 1, true]'}),
     "", [("pick", {"items": ["a", "b", 1, True]})], 0),
    # test_two_tool_calls_in_one_streaming_chunk / ..._plus_trailing_text_one_delta / ..._final_close_in_same_delta
    ("qwen3_coder", {"get_weather": props(city="string")},
     qwen_call("get_weather", {"city": "Paris"}) + "\n" + qwen_call("get_weather", {"city": "London"}) + "\nAll done!",
     "\nAll done!", [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "London"})], 0),
    ("qwen3_coder", {"get_weather": props(city="string")},
     "<tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>\n</tool_call>\n"
     "I hope this helps!", "\nI hope this helps!", [("get_weather", {"city": "Paris"})], 0),
    # test_jinja_template_phantom_tool_call_is_rejected: "{{ tc.name }}" is no function name
    ("qwen3_coder", V_WRITE, "<tool_call>\n<function={{ tc.name }}>\n<parameter={{ k }}>\n{{ v }}\n</parameter>\n"
                             "</function>\n</tool_call>\n\n" + qwen_call("write_file", {"path": "out.txt",
                                                                                         "content": "hello"}),
     "", [("write_file", {"path": "out.txt", "content": "hello"})], 1),
    # test_inline_empty_tool_call_preserves_content_before_real_call
    ("qwen3_coder", {"log": props(msg="string")},
     "I'll show: <tool_call>example</tool_call>. Now real:\n" + qwen_call("log", {"msg": "hi"}),
     "I'll show: . Now real:\n", [("log", {"msg": "hi"})], 1),
    # SGLang test_function_call_parser.py TestQwen3CoderDetector: no parameters, special characters
    ("qwen3_coder", V_WEATHER, "<tool_call>\n<function=get_current_weather>\n</function>\n</tool_call>",
     "", [("get_current_weather", {})], 0),
    ("qwen3_coder", V_WEATHER, qwen_call("get_current_weather", {"city": "Dallas->TX"}),
     "", [("get_current_weather", {"city": "Dallas->TX"})], 0),
    # SGLang test_qwen3_coder_detector/test_cases.py: bare blocks, values inline, Python True, implicit closes
    ("qwen3_coder", S_TOOLS, "<function=get_current_weather>\n<parameter=location>Boston</parameter>\n"
                             "<parameter=unit>celsius</parameter>\n<parameter=days>3</parameter>\n</function>",
     "", [("get_current_weather", {"location": "Boston", "unit": "celsius", "days": 3})], 0),
    ("qwen3_coder", S_TOOLS, "Text prefix + double tool call test\n\n<function=get_current_weather>\n"
                             "<parameter=location>New York</parameter>\n</function>\n<function=sql_interpreter>\n"
                             "<parameter=query>SELECT * FROM users</parameter>\n<parameter=dry_run>True</parameter>\n"
                             "</function>\n",
     "Text prefix + double tool call test\n\n",
     [("get_current_weather", {"location": "New York"}),
      ("sql_interpreter", {"query": "SELECT * FROM users", "dry_run": True})], 0),
    ("qwen3_coder", S_TOOLS, "Text prefix + implicit parameter close test\n\n<function=get_current_weather>\n"
                             "<parameter=location>Paris\n<parameter=unit>celsius\n<parameter=days>3\n</function>",
     "Text prefix + implicit parameter close test\n\n",
     [("get_current_weather", {"location": "Paris", "unit": "celsius", "days": 3})], 0),
    ("qwen3_coder", S_TOOLS, "Text prefix + complex schema tool call test\n\n<function=TodoWrite>\n<parameter=todos>\n"
                             "[\n {\"content\": \"Buy a new car\", \"status\": 'pending'},\n"
                             " {\"content\": \"Buy a new house\", \"status\": \"completed\"}\n]\n</parameter>\n"
                             "</function>\n\n",
     "Text prefix + complex schema tool call test\n\n",
     [("TodoWrite", {"todos": [{"content": "Buy a new car", "status": "pending"},
                               {"content": "Buy a new house", "status": "completed"}]})], 0),
    # --- vLLM test_glm4_moe_tool_parser.py: test_extract_tool_calls (indented pairs), content before
    ("glm45", None, "<tool_call>get_current_weather\n    <arg_key>city</arg_key>\n    <arg_value>Dallas</arg_value>\n"
                    "    <arg_key>state</arg_key>\n    <arg_value>TX</arg_value>\n    <arg_key>unit</arg_key>\n"
                    "    <arg_value>fahrenheit</arg_value>\n    </tool_call>\n    <tool_call>get_current_weather\n"
                    "    <arg_key>city</arg_key>\n    <arg_value>Orlando</arg_value>\n    </tool_call>",
     "", [("get_current_weather", DALLAS), ("get_current_weather", {"city": "Orlando"})], 0),
    ("glm45", None, "I'll help you check the weather. <tool_call>get_current_weather\n    <arg_key>city</arg_key>\n"
                    "    <arg_value>Seattle</arg_value>\n    </tool_call>",
     "I'll help you check the weather. ", [("get_current_weather", {"city": "Seattle"})], 0),
    # test_extract_tool_calls_with_thinking_tags (no reasoning parser here: the think block is text)
    ("glm45", G_WEATHER, "<think>I want to get the weather.</think>\n\nI will help you get the weather.\n"
                         "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
                         "<arg_key>date</arg_key>\n<arg_value>2025-08-01</arg_value>\n</tool_call>",
     "<think>I want to get the weather.</think>\n\nI will help you get the weather.\n",
     [("get_weather", {"city": "Beijing", "date": "2025-08-01"})], 0),
    # test_extract_tool_calls_empty_arguments / test_zero_argument_tool_call
    ("glm45", None, "<tool_call>get_current_time\n</tool_call>", "", [("get_current_time", {})], 0),
    # test_extract_tool_calls_mixed_content (text between calls is text here)
    ("glm45", G_WEATHER, "I will help you get the weather info.\n\n<tool_call>get_weather\n<arg_key>city</arg_key>\n"
                         "<arg_value>Beijing</arg_value>\n</tool_call>\n\nmeaningwhile, I will also check the weather "
                         "in Shanghai.\n\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Shanghai"
                         "</arg_value>\n</tool_call>",
     "I will help you get the weather info.\n\n\n\nmeaningwhile, I will also check the weather in Shanghai.\n\n",
     [("get_weather", {"city": "Beijing"}), ("get_weather", {"city": "Shanghai"})], 0),
    # test_extract_tool_calls_numeric_deserialization (no schema for "calculate": decoded as JSON)
    ("glm45", G_WEATHER, "<tool_call>calculate\n<arg_key>operation</arg_key>\n<arg_value>add</arg_value>\n"
                         "<arg_key>a</arg_key>\n<arg_value>42</arg_value>\n<arg_key>b</arg_key>\n<arg_value>3.14"
                         "</arg_value>\n<arg_key>enabled</arg_key>\n<arg_value>true</arg_value>\n</tool_call>",
     "", [("calculate", {"operation": "add", "a": 42, "b": 3.14, "enabled": True})], 0),
    # test_whitespace_preserved_in_arg_values / test_unicode_characters_preserved / test_streaming_json_escape_in_string
    ("glm45", {"apply_diff": props(s="string")}, "<tool_call>apply_diff\n<arg_key>s</arg_key>\n<arg_value>    indented "
                                                 "code    </arg_value>\n</tool_call>",
     "", [("apply_diff", {"s": "    indented code    "})], 0),
    ("glm45", {"send_message": props(greeting="string", emoji="string", message="string")},
     "<tool_call>send_message\n<arg_key>greeting</arg_key>\n<arg_value>你好世界</arg_value>\n"
     "<arg_key>emoji</arg_key>\n<arg_value>🎉</arg_value>\n<arg_key>message</arg_key>"
     "<arg_value>Hello \"world\"\nNew line</arg_value></tool_call>",
     "", [("send_message", {"greeting": "你好世界", "emoji": "🎉", "message": "Hello \"world\"\nNew line"})], 0),
    # test_streaming_multi_token_with_multiple_args: no space between the pairs
    ("glm45", {"calculate": props(operation="string", a="number", b="number")},
     "<tool_call>calculate\n<arg_key>operation</arg_key><arg_value>add</arg_value><arg_key>a</arg_key>"
     "<arg_value>42</arg_value><arg_key>b</arg_key><arg_value>3.14</arg_value></tool_call>",
     "", [("calculate", {"operation": "add", "a": 42, "b": 3.14})], 0),
    # vLLM test_glm47_moe_tool_parser.py: zero-argument inline / with a newline, args on one line, content before,
    # several calls, whitespace before the first call is no content
    ("glm45", None, "<tool_call>get_current_date</tool_call>", "", [("get_current_date", {})], 0),
    ("glm45", None, "Checking.<tool_call>get_current_date\n</tool_call>", "Checking.", [("get_current_date", {})], 0),
    ("glm45", G_WEATHER, "  \n  <tool_call>get_weather<arg_key>city</arg_key><arg_value>Beijing</arg_value></tool_call>"
                         "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Shanghai</arg_value></tool_call>",
     "", [("get_weather", {"city": "Beijing"}), ("get_weather", {"city": "Shanghai"})], 0),
    # SGLang test_function_call_parser.py TestGlm4MoeDetector: calls back to back
    ("glm45", G_WEATHER, "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
                         "<arg_key>date</arg_key>\n<arg_value>2024-06-27</arg_value>\n</tool_call>"
                         "<tool_call>get_weather\n"
                         "<arg_key>city</arg_key>\n<arg_value>Shanghai</arg_value>\n<arg_key>date</arg_key>\n"
                         "<arg_value>2024-06-28</arg_value>\n</tool_call>",
     "", [("get_weather", {"city": "Beijing", "date": "2024-06-27"}),
          ("get_weather", {"city": "Shanghai", "date": "2024-06-28"})], 0),
    # test_array_argument_with_escaped_json (and SGLang test_glm47_moe_detector.py): JSON with its quotes escaped,
    # a literal backslash-n as the line break (the raw-string variants), Windows paths, a literal \n in a string
    ("glm45", G_TODO, r"""<tool_call>todo_write\n<arg_key>todos</arg_key>\n<arg_value>[{\"id\": \"1\", \"task\": """
                      r"""\"Check for hard-coded issues\", \"status\": \"in_progress\"}, {\"id\": \"2\", \"task\": """
                      r"""\"Report\", \"status\": \"pending\"}]</arg_value>""" "\n</tool_call>",
     "", [("todo_write", {"todos": [{"id": "1", "task": "Check for hard-coded issues", "status": "in_progress"},
                                   {"id": "2", "task": "Report", "status": "pending"}]})], 0),
    ("glm45", G_TODO, '<tool_call>todo_write\n<arg_key>todos</arg_key>\n<arg_value>[{"id": "1", "task": "Check file at '
                      'C:\\\\Users\\\\test.txt", "status": "pending"}]</arg_value></tool_call>',
     "", [("todo_write", {"todos": [{"id": "1", "task": r"Check file at C:\Users\test.txt",
                                    "status": "pending"}]})], 0),
    ("glm45", G_TODO, r"""<tool_call>todo_write<arg_key>todos</arg_key><arg_value>[{\"id\": \"1\", \"task\": """
                      r"""\"Print \\\\n to see newline\",\"status\": \"pending\"}]</arg_value></tool_call>""",
     "", [("todo_write", {"todos": [{"id": "1", "task": r"Print \n to see newline", "status": "pending"}]})], 0),
    # SGLang test_glm47_moe_detector.py: numbers and a JSON array, an empty string, special characters, nesting,
    # empty structures
    ("glm45", {"create_todos": props(priority="number", count="integer", items="array")},
     '<tool_call>create_todos<arg_key>priority</arg_key><arg_value>5.5</arg_value><arg_key>count</arg_key>'
     '<arg_value>10</arg_value><arg_key>items</arg_key><arg_value>[{"description": "TestTodo 1"}, '
     '{"description": "TestTodo 2"}]</arg_value></tool_call>',
     "", [("create_todos", {"priority": 5.5, "count": 10, "items": [{"description": "TestTodo 1"},
                                                                      {"description": "TestTodo 2"}]})], 0),
    ("glm45", {"create_note": props(title="string", content="string")},
     "<tool_call>create_note<arg_key>title</arg_key><arg_value>Test</arg_value><arg_key>content</arg_key>"
     "<arg_value></arg_value></tool_call>", "", [("create_note", {"title": "Test", "content": ""})], 0),
    ("glm45", {"execute_command": props(command="string")},
     "<tool_call>execute_command<arg_key>command</arg_key><arg_value>echo 'Hello World' & more</arg_value></tool_call>",
     "", [("execute_command", {"command": "echo 'Hello World' & more"})], 0),
    ("glm45", {"create_structure": props(data="object", empty_obj="object", empty_arr="array")},
     '<tool_call>create_structure<arg_key>data</arg_key><arg_value>{"level1": {"level2": {"value": "deep"}}}'
     "</arg_value><arg_key>empty_obj</arg_key><arg_value>{}</arg_value><arg_key>empty_arr</arg_key>"
     "<arg_value>[]</arg_value></tool_call>",
     "", [("create_structure", {"data": {"level1": {"level2": {"value": "deep"}}}, "empty_obj": {}, "empty_arr": []})],
     0),
    # GLM-4.5-Air as observed (ik_llama.cpp discussion 753): spaces around the tags
    ("glm45", {"ls": props(dirPath="string")},
     "Let me search: <tool_call>ls <arg_key>dirPath</arg_key> <arg_value>backend</arg_value> </tool_call>",
     "Let me search: ", [("ls", {"dirPath": "backend"})], 0),
]


@pytest.mark.parametrize(("fmt", "tools", "text", "content", "expected", "n_errors"), COMPAT)
def test_accepts_what_vllm_and_sglang_accept(fmt, tools, text, content, expected, n_errors) -> None:
    for cuts in ((), range(len(text))):
        events = run(fmt, text, cuts, tools)
        check_invariants(events)
        assert calls(events) == expected
        assert text_of(events) == content
        assert len(errors(events)) == n_errors, errors(events)


# What a peer accepts that we read otherwise, and why:
REFUSED = [
    # SGLang TestQwen3CoderDetector.test_parse_streaming_multiple_tools indents every line by 8 spaces and expects
    # "Dallas": a value is raw text (the reference strips one newline each side, nothing else), so its indentation
    # stays -- a file's content must not lose its leading spaces.
    ("qwen3_coder", V_WEATHER, "<tool_call>\n        <function=get_current_weather>\n        <parameter=city>\n"
                               "        Dallas\n        </parameter>\n        </function>\n        </tool_call>",
     [("get_current_weather", {"city": "        Dallas\n        "})], 0),
    # vLLM's regex reads a call whose </function> never came (max_tokens cut it): its last value may be cut off
    # too, so it is unterminated here (vLLM's GLM parser refuses the same, test_extract_tool_calls_incomplete_tool_call)
    ("qwen3_coder", V_WEATHER, "<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDal", [], 1),
    ("glm45", G_WEATHER, "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
                         "<arg_key>date</arg_key>\n<arg_value>2025-08-01</arg_value>", [], 1),
    # vLLM test_malformed_tool_call_no_regex_match: "<tool_call>   " is content there; the opener is GLM's call
    # token, so an output that ends inside it is an unterminated call here
    ("glm45", G_WEATHER, "<tool_call>   ", [], 1),
    # vLLM makes a boolean that is neither true nor false `false`; we keep the text (a schema check then catches it)
    ("qwen3_coder", V_TYPES, qwen_call("test_types", {"bool_param": "yes"}),
     [("test_types", {"bool_param": "yes"})], 0),
    # SGLang's detector drops calls to functions not in `tools` (TestGlm4MoeDetector.test_invalid_tool_call); here
    # they are calls, and the gateway refuses them for every format alike
    ("glm45", G_WEATHER, "<tool_call>invalid_func\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
                         "</tool_call>", [("invalid_func", {"city": "Beijing"})], 0),
]


@pytest.mark.parametrize(("fmt", "tools", "text", "expected", "n_errors"), REFUSED)
def test_what_we_read_otherwise(fmt, tools, text, expected, n_errors) -> None:
    for cuts in ((), range(len(text))):
        events = run(fmt, text, cuts, tools)
        check_invariants(events)
        assert calls(events) == expected and len(errors(events)) == n_errors


# ------------------------------------------------------------ split invariance ----
MALFORMED = [
    ("qwen3_coder", V_WEATHER, "<tool_call>\n<function=get_current_weather>\n<parameter=ci\nty>x</parameter>\n"
                               "</function>\n</tool_call>after"),
    ("qwen3_coder", V_WEATHER, "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>tail"),
    ("qwen3_coder", V_WEATHER, "<tool_call>\n<function=get_current_weather>\n<parameter=city>\nA\n</parameter>\n"
                               "<tool_call>\n<function=get_current_weather>\n</function>\n</tool_call>"),
    ("qwen3_coder", None, "Use <function=name> in prose, or <function=bad name> and <function=x>oops"),
    ("qwen3_coder", None, "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</func"),
    ("qwen3_coder", None, "<tool_call>\n<function=" + "n" * 300 + ">\n</function>\n</tool_call>ok"),
    ("glm45", G_WEATHER, "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Seattle</arg_value>\n"
                         "<arg_key>incomplete_arg\n<arg_value>value</arg_value>\n</tool_call>after"),
    ("glm45", G_WEATHER, "<tool_call></tool_call>x<tool_call>get weather\n</tool_call>y"),
    ("glm45", G_WEATHER, "<tool_call>get_weather\n<arg_key>city</arg_key>\nBeijing\n</tool_call>"),
    ("glm45", G_WEATHER, "<tool_call>a\n<arg_key>k</arg_key><arg_value>1</arg_value><tool_call>b</tool_call>"),
    ("glm45", None, "<tool_call>f\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>"),
]
SAMPLES = [(f, tools, text) for f, tools, text, *_ in COMPAT + REFUSED] + MALFORMED


@settings(max_examples=250, deadline=None)
@given(data=st.data())
def test_any_split_gives_same_events(data: st.DataObject) -> None:
    fmt, tools, text = data.draw(st.sampled_from(SAMPLES))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=30))
    whole = normalise(run(fmt, text, (), tools))
    assert normalise(run(fmt, text, cuts, tools)) == whole
    check_invariants(whole)


@pytest.mark.parametrize(("fmt", "tools", "text"), MALFORMED)
def test_char_by_char_gives_same_events_on_malformed_calls(fmt, tools, text) -> None:
    split = run(fmt, text, range(1, len(text)), tools)
    check_invariants(split)
    assert normalise(split) == normalise(run(fmt, text, (), tools))


GARBAGE = {
    "qwen3_coder": list("ab {}<>/=\"'\\\n ") + [
        "<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", "f>", "a>",
        "city>", "<tool_", "</param", "42", "null", "\n</parameter>\n"],
    "glm45": list("ab {}<>/\"'\\\n ") + [
        "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "f", "city",
        "\\n", "<arg_", "</tool", "42", "[1]"],
}


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_garbage_never_raises_and_is_split_invariant(data: st.DataObject) -> None:
    fmt = data.draw(st.sampled_from(FMTS))
    text = "".join(data.draw(st.lists(st.sampled_from(GARBAGE[fmt]), max_size=40)))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    tools = data.draw(st.sampled_from([None, {"f": props(city="string", a="integer")}]))
    whole = run(fmt, text, (), tools)
    check_invariants(whole)
    assert normalise(run(fmt, text, cuts, tools)) == normalise(whole)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_mutated_outputs_are_split_invariant(data: st.DataObject) -> None:
    """Near-valid outputs (a slice deleted, something inserted) take the error paths."""
    fmt, tools, text = data.draw(st.sampled_from(SAMPLES))
    a = data.draw(st.integers(0, len(text)))
    b = data.draw(st.integers(a, min(len(text), a + 12)))
    ins = data.draw(st.sampled_from(["", "<", ">", "\n", "/", "\\n", "</parameter>", "</arg_value>", "</tool_call>",
                                     "<parameter=city>", "<arg_key>"]))
    text = text[:a] + ins + text[b:]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=15))
    whole = run(fmt, text, (), tools)
    check_invariants(whole)
    assert normalise(run(fmt, text, cuts, tools)) == normalise(whole)


# ------------------------------------------------------------------ typing values ----
TYPED = [
    # (property schema, the model's text, the value)
    ({"type": "string"}, " 42 ", " 42 "),
    ({"type": "string"}, "null", "null"),
    ({"type": "string", "enum": ["a", "b"]}, "a", "a"),
    ({"type": "integer"}, "42", 42),
    ({"type": "integer"}, " 42\n", 42),
    ({"type": "integer"}, "forty", "forty"),          # not an integer: the text stays (the peers "degenerate" too)
    ({"type": "number"}, "3.5", 3.5),
    ({"type": "number"}, "1e999", "1e999"),           # not a finite number: no JSON for it, the text stays
    ({"type": "boolean"}, "True", True),
    ({"type": "boolean"}, "FALSE", False),
    ({"type": "null"}, "None", None),
    ({"type": "object"}, '{"a": [1, null]}', {"a": [1, None]}),
    ({"type": "object"}, "{'a': (1, 2)}", {"a": [1, 2]}),  # a Python literal; tuples become lists
    ({"type": "object"}, "{1, 2}", "{1, 2}"),         # a set is no JSON: the text stays
    ({"type": "array"}, '[\\"x\\"]', ["x"]),           # SGLang's escaped JSON
    ({"type": "array"}, "'[1]'", [1]),                 # vLLM's double-encoded container
    ({"type": ["integer", "null"]}, "null", None),
    ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "NULL", None),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, '"7"', "7"),  # JSON first: a JSON string is a string
    ({}, "[1, 2]", [1, 2]),                            # no type: any JSON, else the text
    ({}, "plain words", "plain words"),
    ({"enum": ["red", "green"]}, "red", "red"),
    (None, "42", 42),                                  # no schema at all
    (None, "Paris", "Paris"),
    (None, '"quoted"', "quoted"),
]


@pytest.mark.parametrize(("schema", "raw", "value"), TYPED)
def test_typed_value(schema, raw, value) -> None:
    got = typed_value(raw, schema)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize(("schema", "raw", "value"), TYPED)
def test_values_are_typed_by_the_tools_schema(fmt, schema, raw, value) -> None:
    """Through each parser: the value of a parameter with that schema (None: a tool the parser does not know)."""
    tools = None if schema is None else {"f": {"type": "object", "properties": {"p": schema}}}
    if fmt == "qwen3_coder":
        text = f"<tool_call>\n<function=f>\n<parameter=p>\n{raw}\n</parameter>\n</function>\n</tool_call>"
    else:
        text = f"<tool_call>f\n<arg_key>p</arg_key>\n<arg_value>{raw}</arg_value>\n</tool_call>"
    events = run(fmt, text, (), tools)
    check_invariants(events)
    assert calls(events) == [("f", {"p": value})]
    assert FieldComplete(0, "p", value) in events


@pytest.mark.parametrize("fmt", FMTS)
def test_a_key_the_schema_does_not_name_is_read_as_json(fmt) -> None:
    text = PARSERS[fmt].format.render_call("f", {"other": 42, "known": "42"})
    tools = {"f": props(known="string")}
    assert calls(run(fmt, text, (), tools)) == [("f", {"other": 42, "known": "42"})]


def test_qwen_a_parameter_the_schema_does_not_name_after_a_value_is_part_of_it() -> None:
    """As vLLM reads it (test_content_with_param_like_lines): ``</parameter>`` then a ``<parameter=NAME>`` that
    the schema does not name is text of the value, so file content holding such lines stays whole -- and a
    parameter the model invents after another one is read into that one (up to ``</function>``, as vLLM's
    fallback reads it)."""
    text = QWEN3_CODER.render_call("f", {"known": "42", "other": 42})
    assert calls(run("qwen3_coder", text, (), {"f": props(known="string")})) == [
        ("f", {"known": "42\n</parameter>\n<parameter=other>\n42\n</parameter>"})]
    assert calls(run("qwen3_coder", text, (), None)) == [("f", {"known": 42, "other": 42})]  # no schema: any NAME


# ------------------------------------------------------------ deltas and fields ----
@pytest.mark.parametrize("fmt", FMTS)
def test_argument_deltas_are_the_json_of_the_final_arguments(fmt) -> None:
    form = QWEN3_CODER if fmt == "qwen3_coder" else GLM45
    args = {"city": "Zürich \"Süd\"\n2", "days": 3, "tags": ["a", {"b": None}], "ok": False, "none": None}
    tools = {"f": props(city="string", days="integer", tags="array", ok="boolean", none="null")}
    text = form.render_calls([("f", args), ("g", {})])
    for cuts in ((), range(len(text))):
        events = run(fmt, text, cuts, tools)
        for index, (name, final) in enumerate(calls(events)):
            joined = "".join(e.fragment for e in events if isinstance(e, ArgumentsDelta) and e.index == index)
            assert joined == json.dumps(final, ensure_ascii=False)
        assert calls(events) == [("f", args), ("g", {})]
    deltas = [e.fragment for e in run(fmt, text, (), tools) if isinstance(e, ArgumentsDelta) and e.index == 0]
    assert deltas == ['{"city": "Zürich \\"Süd\\"\\n2"', ', "days": 3', ', "tags": ["a", {"b": null}]',
                      ', "ok": false', ', "none": null', "}"]


@pytest.mark.parametrize(("fmt", "text", "key"), [
    ("qwen3_coder", "<tool_call>\n<function=write>\n<parameter=path>\na.txt\n</parameter>\n<parameter=body>\n"
                    + "x" * 400 + "\n</parameter>\n</function>\n</tool_call>", "path"),
    ("glm45", "<tool_call>write<arg_key>path</arg_key><arg_value>a.txt</arg_value><arg_key>body</arg_key>"
              "<arg_value>" + "x" * 400 + "</arg_value></tool_call>", "path"),
])
def test_field_arrives_before_the_call_ends(fmt, text, key) -> None:
    p = PARSERS[fmt](id_factory=counting_ids())
    seen_at = None
    events: list[Event] = []
    for i in range(0, len(text), 4):
        new = p.feed(text[i:i + 4])
        events += new
        if seen_at is None and FieldComplete(0, key, "a.txt") in new:
            seen_at = i + 4
    events += p.finish()
    assert seen_at is not None and seen_at < 100, "the first field must arrive long before the call ends"
    kinds = [type(e) for e in events]
    assert kinds.index(FieldComplete) < kinds.index(ToolCallEnd)
    assert FieldComplete(0, "body", "x" * 400) in events


def test_qwen_field_waits_for_the_next_tag_only() -> None:
    """A ``</parameter>`` is structural only once what follows it is known: the field comes with the next tag."""
    p = Qwen3CoderParser(id_factory=counting_ids(), tools=V_WEATHER)
    assert [type(e) for e in p.feed("<tool_call>\n<function=get_current_weather>\n<parameter=city>\nA\n")] == [
        ToolCallStart]
    assert p.feed("</parameter>\n") == [] and p.in_call
    assert p.feed("<parameter=st")[1:] == []
    ev = p.feed("ate>\n")
    assert ev == [ArgumentsDelta(0, '{"city": "A"'), FieldComplete(0, "city", "A")]
    p.feed("TX\n</parameter>\n")
    ev = p.feed("</function>")
    assert [type(e) for e in ev] == [ArgumentsDelta, FieldComplete, ArgumentsDelta, ToolCallEnd] and not p.in_call


def test_streaming_incomplete_then_complete() -> None:
    """SGLang test_parse_streaming_incomplete: the deltas of a call cut short are a JSON prefix, then the rest
    completes it."""
    p = Qwen3CoderParser(id_factory=counting_ids(), tools=V_WEATHER)
    events: list[Event] = []
    for chunk in ["<tool_call>", "\n<function=get_current_weather>", "\n<parameter=city>", "\nDallas",
                  "\n</parameter>", "\n<parameter=state>", "\nTX"]:
        events += p.feed(chunk)
    so_far = "".join(e.fragment for e in events if isinstance(e, ArgumentsDelta))
    assert so_far.startswith('{"city": "Dallas"') and not so_far.endswith("}")
    events += p.feed("\n</parameter>\n</function>\n</tool_call>") + p.finish()
    assert calls(events) == [("get_current_weather", {"city": "Dallas", "state": "TX"})]


# ------------------------------------------------------------------- errors ----
@pytest.mark.parametrize(("fmt", "text", "index"), [
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n", 0),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>", 0),  # </parameter> at the end
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a", 0),
    ("qwen3_coder", "<tool_call>\n<function=f", None),
    ("qwen3_coder", "<tool_call>\n<func", None),
    ("glm45", "<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1", 0),
    ("glm45", "<tool_call>f\n<arg_key>a</arg_key>\n<arg_val", 0),
    ("glm45", "<tool_call>f\n<arg_key>a", 0),
    ("glm45", "<tool_call>f<arg_k", None),
])
def test_unterminated_call_is_a_parser_error(fmt, text, index) -> None:
    for cuts in ((), range(len(text))):
        events = run(fmt, text, cuts)
        check_invariants(events)
        assert not calls(events)
        (err,) = errors(events)
        assert err.index == index and "unterminated" in err.message and err.raw == text
        assert events[-1] == err


@pytest.mark.parametrize(("fmt", "text", "message", "raw", "content", "expected"), [
    ("qwen3_coder", "<tool_call>\n<function=f>\n<parameter=a\nb>1</parameter>\n</function>\n</tool_call>after",
     "malformed parameter name", "<tool_call>\n<function=f>\n<parameter=a", "after", []),
    ("qwen3_coder", "<tool_call>\n<function=f g>\n</function>\n</tool_call>after" + qwen_call("h", {}),
     "malformed function name", "<tool_call>\n<function=f g>\n", "after", [("h", {})]),
    ("qwen3_coder", '<tool_call>\n{"name": "f"}\n</tool_call>after', "expected <function=NAME> after <tool_call>",
     '<tool_call>\n{"name": "f"}\n', "after", []),
    ("qwen3_coder", "<tool_call>\n<function=f>\n<tool_call>\n<function=g>\n</function>\n</tool_call>",
     "expected </function> before the next call", "<tool_call>\n<function=f>\n", "", [("g", {})]),
    ("glm45", "<tool_call>get weather\n</tool_call>after", "malformed function name", "<tool_call>get weather\n",
     "after", []),
    ("glm45", "<tool_call>f\n<arg_key>a</arg_key>\nvalue</tool_call>after", "expected <arg_value> after </arg_key>",
     "<tool_call>f\n<arg_key>a</arg_key>\n", "after", []),
    ("glm45", "<tool_call>f\n<arg_key>a<arg_value>1</arg_value>\n</tool_call>after", "expected </arg_key>",
     "<tool_call>f\n<arg_key>a", "after", []),
    ("glm45", "<tool_call>f\n<tool_call>g</tool_call>", "expected </tool_call> before the next call",
     "<tool_call>f\n", "", [("g", {})]),
])
def test_malformed_calls(fmt, text, message, raw, content, expected) -> None:
    for cuts in ((), range(len(text))):
        events = run(fmt, text, cuts)
        check_invariants(events)
        (err,) = errors(events)
        assert (err.message, err.raw) == (message, raw)
        assert text_of(events) == content and calls(events) == expected


@pytest.mark.parametrize("text", ["See <function=name> and <function=x>, a bare mention.",
                                  "<function=f>\nnot a parameter\n</function>", "ends with <function=fo"])
def test_bare_function_in_prose_is_text(text) -> None:
    """A bare ``<function=NAME>`` is a call only if its body starts like one."""
    for cuts in ((), range(len(text))):
        assert normalise(run("qwen3_coder", text, cuts)) == [Text(text)]


@pytest.mark.parametrize("fmt", FMTS)
def test_text_only_output(fmt) -> None:
    s = "The capital is Paris.\n<b>bold</b> < > </ and a lone <tool_cal and <arg_ and \\n here."
    assert normalise(run(fmt, s)) == [Text(s)]


# ------------------------------------------------- the formats, written and read back ----
_NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,10}(\.[a-z_][a-z0-9_]{0,5})?", fullmatch=True)
_KEYS = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_\-]{0,8}", fullmatch=True)
#: pieces of strings, the formats' tags and their beginnings among them
_PIECES = st.sampled_from(list("ab \n\t<>/=\"'\\{}é") + [
    "<parameter=", "</parameter", "<parameter=a>", "</function", "<function=f>", "<tool_call>", "</tool_call",
    "</arg_value", "<arg_value>", "<arg_key>k</arg_key>", "null", "42", "[1]", "\n\n", "  ", "</parameter>",
    "</function>", "</tool_call>", "</arg_value>", "\n<parameter=a>\n"])


def _text(forbidden: Sequence[str]) -> st.SearchStrategy[str]:
    return st.lists(_PIECES, max_size=8).map("".join).filter(lambda s: not any(f in s for f in forbidden))


def _args(forbidden: Sequence[str]) -> st.SearchStrategy[dict]:
    """Arguments: a string value is written raw, so it holds none of the format's ``forbidden`` tags; strings
    inside JSON values may hold anything (the rendering escapes the end tags there)."""
    def scalar(text: st.SearchStrategy[str]) -> st.SearchStrategy[Any]:
        return st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12),
                         st.floats(allow_nan=False, allow_infinity=False), text)
    nested = st.recursive(scalar(_text(())), lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(_KEYS, inner, max_size=3)), max_leaves=6)
    top = st.one_of(scalar(_text(forbidden)), st.lists(nested, max_size=3), st.dictionaries(_KEYS, nested, max_size=3))
    return st.dictionaries(_KEYS, top, max_size=4)


def _schema(args: Mapping[str, Any]) -> dict:
    """The parameters schema the arguments fit: each value's JSON type."""
    def kind(v: Any) -> str:
        return {type(None): "null", bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
                dict: "object"}[type(v)]
    return props(**{k: kind(v) for k, v in args.items()})


@pytest.mark.parametrize("fmt", FMTS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_format_renders_what_its_parser_reads(fmt: str, data: st.DataObject) -> None:
    """render_call / render_calls parsed with the tools' schemas give back the same calls, however split; every
    ``call_end`` marker the rendering holds is a point where the parser is outside a call with all started calls
    ended (the engine pauses there), and the last one ends them all."""
    form = PARSERS[fmt].format
    forbidden = form.FORBIDDEN_IN_STRINGS
    cs = data.draw(st.lists(st.tuples(_NAMES, _args(forbidden)), min_size=1, max_size=3))
    tools: dict[str, Any] = {}
    for name, args in cs:
        tools[name] = _schema({**tools.get(name, {}).get("properties", {}), **args})
    # one schema per function: a key's type must agree between two calls of the same name
    cs = [(n, a) for n, a in cs if _schema(a)["properties"].items() <= tools[n]["properties"].items()]
    name, args = cs[0]
    assert calls(run(fmt, form.render_call(name, args), (), tools)) == [(name, args)]
    text = form.render_calls(cs)
    events = run(fmt, text, data.draw(st.lists(st.integers(0, len(text)), max_size=6)), tools)
    check_invariants(events)
    assert calls(events) == cs and not errors(events) and not text_of(events).strip()
    ends = [i + len(m) for m in form.call_end for i in range(len(text)) if text.startswith(m, i)]
    assert ends
    for end in sorted(set(ends)):
        p = PARSERS[fmt](id_factory=counting_ids(), tools=tools)
        ev = p.feed(text[:end])
        started = {e.index for e in ev if isinstance(e, ToolCallStart)}
        ended = {e.index for e in ev if isinstance(e, ToolCallEnd)}
        if not p.in_call:
            assert started == ended
        if end == max(ends):
            assert not p.in_call and len(ended) == len(cs)


@pytest.mark.parametrize("fmt", FMTS)
def test_a_call_end_marker_inside_a_value_is_not_the_end(fmt) -> None:
    """``</tool_call>`` inside a JSON value (as a forced call may write it; ``render_call`` would escape it): the
    engine pauses there, the parser says it is still in the call."""
    form = PARSERS[fmt].format
    text = form.render_call("f", {"code": {"s": "x</tool_call>y"}, "n": 1}).replace("<\\/", "</")
    cut = text.index("</tool_call>") + len("</tool_call>")
    p = PARSERS[fmt](id_factory=counting_ids(), tools={"f": props(code="object", n="integer")})
    p.feed(text[:cut])
    assert p.in_call
    assert calls(p.feed(text[cut:]) + p.finish()) == [("f", {"code": {"s": "x</tool_call>y"}, "n": 1})]


def test_renderings_are_the_models_templates() -> None:
    """Qwen3-Coder's template writes ``<tool_call>\\n<function=...>`` with each value between newlines; GLM-4.5's
    ``<tool_call>NAME`` with one tag pair per line; both write strings raw and the rest as JSON."""
    args = {"city": "Paris", "days": 3, "opts": {"a": [1]}}
    assert QWEN3_CODER.render_call("w", args) == (
        "<tool_call>\n<function=w>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
        '<parameter=opts>\n{"a": [1]}\n</parameter>\n</function>\n</tool_call>')
    assert GLM45.render_call("w", args) == (
        "<tool_call>w\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n"
        '<arg_value>3</arg_value>\n<arg_key>opts</arg_key>\n<arg_value>{"a": [1]}</arg_value>\n</tool_call>')
    assert QWEN3_CODER.render_results(["a", "b"]) == (
        "<tool_response>\na\n</tool_response>\n<tool_response>\nb\n</tool_response>")
    assert GLM45.render_result("r") == "<tool_response>\nr\n</tool_response>"


@pytest.mark.parametrize("fmt", FMTS)
def test_registered_with_a_complete_format(fmt) -> None:
    reg = registry()
    assert BUILTIN_PARSERS[fmt] is PARSERS[fmt] and fmt in reg.names()
    parser = reg.create(fmt)
    assert type(parser) is PARSERS[fmt] and parser.format.name == fmt
    form = check_format(parser.format, fmt)
    assert form.call_start == ("<tool_call>",) and form.call_end == ("</tool_call>",)
    assert {"<tool_call>", "</tool_call>"} <= set(form.special_tokens)
    fn = {"name": "get_weather", "description": "Weather", "parameters": props(city="string")}
    text = form.instructions([fn])
    assert '"name": "get_weather"' in text and "<tool_call>" in text
    assert (fmt == "glm45") == ("<arg_key>" in text)


def test_glm_special_tokens_are_the_tokenizers_added_tokens() -> None:
    assert GLM45.special_tokens == ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                                    "</arg_value>")
    assert QWEN3_CODER.special_tokens == ("<tool_call>", "</tool_call>")
