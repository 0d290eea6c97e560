"""Tests for the example plugin: the tool itself, and a real call through Interlace."""

import asyncio

from interlace.gateway.plugin_host import PluginHost
from interlace_example_plugin import WordCountTool


def test_counts_words_directly():
    tool = WordCountTool()
    tool.configure({})
    tool.on_start()
    tool.on_field("text", "The cat and the hat")
    assert tool.on_finish({"text": "The cat and the hat", "top": 1}) == {"words": 5, "distinct": 4, "top": [["the", 2]]}


def test_discovered_and_run_through_interlace():
    host = PluginHost({"word_count": {"lowercase": False}})
    assert "word_count" in host.tools()

    async def main():
        runtime = host.create_runtime()
        await runtime.start()
        try:
            call = await runtime.begin("word_count", "c1")
            await call.field("text", "a b a")
            return await call.finish({"text": "a b a", "top": 2})
        finally:
            await runtime.close()

    result = asyncio.run(main())
    assert result.ok, result.error
    assert result.content == {"words": 3, "distinct": 2, "top": [["a", 2], ["b", 1]]}
