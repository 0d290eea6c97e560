"""Tests for the example plugin: the tool itself, and real calls through Interlace.

They import only the public ``interlace`` package and need no torch: a plugin's
own test suite runs wherever ``interlace`` is installed.
"""

from __future__ import annotations

import asyncio
from typing import Any

import interlace_example_plugin
import pytest
from interlace import PluginHost, PluginLoadError
from interlace_example_plugin import WordCountTool

TEXT = "The cat saw the hat, a A"


def run_word_count(settings: dict[str, Any], arguments: dict[str, Any]) -> Any:
    """One call through a PluginHost and its ToolRuntime, configured as the gateway does it
    (``tools: {word_count: settings}``): the tool runs in a worker process."""
    host = PluginHost({"word_count": settings}, builtins=(), entrypoints=False, plugins=[interlace_example_plugin])

    async def main() -> Any:
        runtime = host.create_runtime()
        await runtime.start()
        try:
            call = await runtime.begin("word_count", "c1")
            await call.field("text", arguments["text"])  # ON_FIELD: the worker starts counting here
            return await call.finish(arguments)
        finally:
            await runtime.close()

    result = asyncio.run(main())
    assert result.ok, result.error
    return result.content


def test_counts_words_directly() -> None:
    tool = WordCountTool()
    tool.configure({})
    tool.on_start()
    tool.on_field("text", "The cat and the hat")
    assert tool.on_finish({"text": "The cat and the hat", "top": 1}) == {"words": 5, "distinct": 4, "top": [["the", 2]]}


def test_defaults_in_the_worker() -> None:
    content = run_word_count({}, {"text": TEXT, "top": 2})
    assert content == {"words": 7, "distinct": 5, "top": [["the", 2], ["a", 2]]}


def test_settings_reach_the_worker() -> None:
    """Case kept and one-letter words dropped: only the configured instance answers this."""
    content = run_word_count({"lowercase": False, "min_length": 2}, {"text": TEXT, "top": 1})
    assert content == {"words": 5, "distinct": 5, "top": [["The", 1]]}


def test_listed_with_its_info() -> None:
    host = PluginHost({"word_count": {"min_length": 3}}, builtins=(), entrypoints=False,
                      plugins=[interlace_example_plugin])
    (plugin,) = host.list_plugins()
    assert plugin["hooks"] == ["register_tools"]
    assert plugin["tools"][0]["info"] == {"lowercase": True, "min_length": 3}


@pytest.mark.parametrize(("settings", "message"), [
    ({"lowercse": False}, r"tool 'word_count': unknown setting 'lowercse'; did you mean 'lowercase'"),
    ({"min_length": "3"}, r"tool 'word_count': setting 'min_length': '3' is not of type 'integer'"),
    ({"env": {"LANG": 1}}, r"tool 'word_count': setting 'env\.LANG': 1 is not of type 'string'"),
])
def test_bad_settings_are_config_errors(settings: dict[str, Any], message: str) -> None:
    host = PluginHost({"word_count": settings}, builtins=(), entrypoints=False, plugins=[interlace_example_plugin])
    with pytest.raises(PluginLoadError, match=message):
        host.tools()
