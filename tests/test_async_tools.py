"""AsyncTool: tools run as coroutines in the gateway's event loop (MCP tools are
these), through the same runtime as worker-process tools."""

from __future__ import annotations

import asyncio
import time

import pytest

from interlace import AsyncTool, PluginHost, ToolError, ToolUnavailable, hookimpl
from interlace.gateway.tools.runtime import ToolRuntime


class Lookup(AsyncTool):
    name = "lookup"
    description = "Look a word up."
    parameters = {"type": "object", "properties": {"word": {"type": "string", "minLength": 1},
                                                   "delay": {"type": "number"}},
                  "required": ["word"], "additionalProperties": False}
    timeout_s = 0.5
    max_concurrent = 2

    def __init__(self) -> None:
        self.running = 0
        self.most = 0
        self.down: str | None = None
        self.seen: list[dict] = []

    async def call(self, arguments, request):
        self.seen.append(arguments)
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            await asyncio.sleep(arguments.get("delay", 0))
            word = arguments["word"]
            if word == "error":
                raise ToolError("no such word")
            if word == "bug":
                raise KeyError("oops")
            if word == "object":
                return object()
            return {"word": word, "key": (request or {}).get("key")}
        finally:
            self.running -= 1

    def unavailable(self):
        return self.down


async def runtime_with(tool, **kw) -> ToolRuntime:
    runtime = ToolRuntime([tool], **kw)
    await runtime.start()
    return runtime


async def test_results_errors_bugs_and_non_json_values():
    tool = Lookup()
    runtime = await runtime_with(tool)
    try:
        assert not runtime.worker_pids()  # no process for it
        ok = await runtime.run("lookup", {"word": "cat"}, request={"key": "alice"})
        assert ok.ok and ok.content == {"word": "cat", "key": "alice"} and ok.worker_pid is None
        err = await runtime.run("lookup", {"word": "error"})
        assert not err.ok and err.error == "no such word" and err.error_type == "ToolError"
        bug = await runtime.run("lookup", {"word": "bug"})
        assert not bug.ok and bug.error_type == "KeyError" and "oops" in bug.error
        odd = await runtime.run("lookup", {"word": "object"})
        assert not odd.ok and odd.error_type == "TypeError"  # not JSON: an error, not a crash later
        assert (await runtime.run("lookup", {"word": "dog"})).ok  # still serving
    finally:
        await runtime.close()


async def test_schema_checked_early_and_nothing_runs_on_bad_arguments():
    tool = Lookup()
    runtime = await runtime_with(tool)
    try:
        call = await runtime.begin("lookup", "c1")
        with pytest.raises(ToolError, match="word"):
            await call.field("word", "")
        result = await call.finish()
        assert not result.ok and result.field == "word" and tool.seen == []
        missing = await runtime.run("lookup", {"delay": 0})
        assert not missing.ok and missing.field == "word" and tool.seen == []
    finally:
        await runtime.close()


async def test_wall_time_concurrency_cap_unavailable_and_cancel():
    tool = Lookup()
    runtime = await runtime_with(tool)
    try:
        t0 = time.monotonic()
        slow = await runtime.run("lookup", {"word": "x", "delay": 5})
        assert not slow.ok and slow.error_type == "ToolTimeout" and time.monotonic() - t0 < 2
        assert tool.running == 0  # the coroutine was cancelled, not left running

        results = await asyncio.gather(*(runtime.run("lookup", {"word": f"w{i}", "delay": 0.1}) for i in range(6)))
        assert all(r.ok for r in results) and tool.most == 2  # max_concurrent

        tool.down = "the service is restarting"
        down = await runtime.run("lookup", {"word": "x"})
        assert not down.ok and down.error_type == "ToolUnavailable" and "restarting" in down.error
        tool.down = None

        call = await runtime.begin("lookup", "c2")
        task = asyncio.ensure_future(call.finish({"word": "x", "delay": 0.3}))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert tool.running == 0
    finally:
        await runtime.close()


async def test_tools_added_and_removed_while_running():
    class Other(Lookup):
        name = "other"

    runtime = await runtime_with(Lookup())
    try:
        runtime.update_tools(add=[Other()])
        assert (await runtime.run("other", {"word": "a"})).ok
        runtime.update_tools(remove=["other"])
        gone = await runtime.run("other", {"word": "a"})
        assert not gone.ok and gone.error_type == "UnknownTool"
        with pytest.raises(ValueError, match="duplicate"):
            runtime.update_tools(add=[Lookup()])
    finally:
        await runtime.close()


def test_registered_through_the_plugin_hook_with_settings_and_policy():
    class Plugin:
        @hookimpl
        def register_tools(self, register):
            register(Lookup())

        @hookimpl
        def before_tool_execution(self, tool_name, arguments, request):
            from interlace import Veto

            return Veto("not cats") if arguments.get("word") == "cat" else None

    host = PluginHost({"lookup": {"timeout_s": 2.0}}, builtins=(), entrypoints=False, plugins=[Plugin()])
    tool = host.tools()["lookup"]
    assert tool.timeout_s == 2.0  # the common settings apply

    async def main():
        runtime = host.create_runtime()
        await runtime.start()
        try:
            vetoed = await runtime.run("lookup", {"word": "cat"})
            assert not vetoed.ok and vetoed.error_type == "ToolVetoed" and tool.seen == []
            assert (await runtime.run("lookup", {"word": "dog", "delay": 1})).ok  # 1 s < its 2 s setting
        finally:
            await runtime.close()

    asyncio.run(main())


def test_declarations_are_checked():
    from interlace import Granularity, ToolConfigError

    class Early(Lookup):
        granularity = Granularity.ON_FIELD

    class NoRoom(Lookup):
        max_concurrent = 0

    for cls, message in ((Early, "ON_FINISH"), (NoRoom, "max_concurrent")):
        with pytest.raises(ToolConfigError, match=message):
            cls().check()


def test_public_names():
    import interlace

    assert issubclass(interlace.AsyncTool, interlace.Tool)
    assert issubclass(ToolUnavailable, ToolError)
