"""The tool runtime: partial execution, early validation, failures, cancellation, clean shutdown.

The tools below run in worker processes; they live at module level so the
``spawn`` workers can import them by reference.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import psutil
import pytest

from interlace.gateway.tool_runtime import ToolResult, ToolRuntime
from interlace.gateway.tools import (
    Granularity,
    InvalidToolArguments,
    Tool,
    ToolConfigError,
    ToolError,
    ToolVetoed,
    UnknownTool,
)


class EventsTool(Tool):
    """Reports the handler calls it saw, with worker-side timestamps."""

    name = "events"
    parameters = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    granularity = Granularity.ON_FIELD

    def on_start(self) -> None:
        self.seen: list[list[Any]] = [["start", None, time.time()]]

    def on_field(self, key: str, value: Any) -> None:
        self.seen.append(["field", key, time.time()])

    def on_line(self, line: str) -> None:  # not an ON_LINE tool: must never be called
        self.seen.append(["line", line, time.time()])

    def on_finish(self, arguments: dict[str, Any]) -> dict[str, Any]:
        return {"seen": self.seen, "arguments": arguments, "pid": os.getpid()}


class NewsTool(Tool):
    """The Conveyor "Validation" workload: a city and a two-letter state are required."""

    name = "local_news"
    parameters = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 1},
            "state": {"type": "string", "pattern": "^[A-Z]{2}$"},
            "limit": {"type": "integer", "minimum": 1},
        },
        "required": ["city", "state"],
        "additionalProperties": False,
    }
    granularity = Granularity.ON_FIELD

    def on_finish(self, arguments: dict[str, Any]) -> str:
        return f"news for {arguments['city']}, {arguments['state']}"


class LenientNewsTool(NewsTool):
    validate_early = False


class MisbehavingTool(Tool):
    """Hangs, crashes or raises on demand (argument ``do``)."""

    name = "misbehave"
    parameters = {"type": "object", "properties": {"do": {"type": "string"}}, "required": ["do"]}
    granularity = Granularity.ON_LINE
    timeout_s = 0.5

    def on_line(self, line: str) -> None:
        if line == "hang":
            time.sleep(60)
        if line == "crash":
            os._exit(7)

    def on_finish(self, arguments: dict[str, Any]) -> Any:
        action = arguments["do"]
        if action == "hang":
            time.sleep(60)
        if action == "crash":
            os._exit(3)
        if action == "raise":
            raise ValueError("boom")
        if action == "tool-error":
            raise ToolError("the thing is unavailable")
        if action == "exit":
            raise SystemExit(1)
        if action == "unjsonable":
            return {1, 2}
        return {"pid": os.getpid(), "did": action}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def children() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]


async def wait_for(predicate: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


# --------------------------------------------------------------------------- happy paths


def test_fields_reach_worker_in_order_and_result_carries_timing() -> None:
    async def main() -> ToolResult:
        async with ToolRuntime([EventsTool()]) as rt:
            call = await rt.begin("events", "c1")
            await call.field("a", 1)
            await call.line("ignored for ON_FIELD tools")
            await call.field("b", "x")
            return await call.finish({"a": 1, "b": "x"})

    result = run(main())
    assert result.ok and result.call_id == "c1" and result.name == "events"
    assert [s[:2] for s in result.content["seen"]] == [["start", None], ["field", "a"], ["field", "b"]]
    assert result.started_at <= result.finish_called_at <= result.finished_at
    assert result.worker_pid == result.content["pid"] and result.partial


def test_partial_off_delivers_everything_at_finish() -> None:
    async def main() -> tuple[float, ToolResult]:
        async with ToolRuntime([EventsTool()]) as rt:
            call = await rt.begin("events", partial=False)
            await call.field("a", 1)
            await asyncio.sleep(0.05)
            t_finish = time.time()
            return t_finish, await call.finish()

    t_finish, result = run(main())
    assert result.ok and not result.partial
    assert [s[:2] for s in result.content["seen"]] == [["start", None], ["field", "a"]]
    assert all(stamp >= t_finish for _, _, stamp in result.content["seen"])
    assert result.content["arguments"] == {"a": 1}  # defaults to the fields received


def test_partial_on_runs_fields_before_finish() -> None:
    async def main() -> tuple[float, ToolResult]:
        async with ToolRuntime([EventsTool()]) as rt:
            call = await rt.begin("events")
            await call.field("a", 1)
            await asyncio.sleep(0.1)  # "decoding" the rest
            t_finish = time.time()
            return t_finish, await call.finish({"a": 1})

    t_finish, result = run(main())
    field_stamp = result.content["seen"][1][2]
    assert field_stamp < t_finish


# --------------------------------------------------------------------------- validation


def test_early_validation_aborts_at_first_invalid_field() -> None:
    async def main() -> tuple[InvalidToolArguments, ToolResult]:
        async with ToolRuntime([NewsTool()]) as rt:
            call = await rt.begin("local_news", "c1")
            await call.field("city", "Durham")
            with pytest.raises(InvalidToolArguments) as info:
                await call.field("state", "North Carolina")
            with pytest.raises(InvalidToolArguments):  # the call stays failed
                await call.field("limit", 3)
            return info.value, await call.finish()

    exc, result = run(main())
    assert exc.field == "state" and "does not match" in exc.message
    assert not result.ok and result.error_type == "InvalidToolArguments" and result.field == "state"


def test_unknown_key_rejected_early_and_missing_required_at_finish() -> None:
    async def main() -> tuple[InvalidToolArguments, ToolResult]:
        # One worker and acquire_timeout_s=5: the failed call must hand its worker back at once.
        async with ToolRuntime([NewsTool()], acquire_timeout_s=5) as rt:
            call = await rt.begin("local_news")
            with pytest.raises(InvalidToolArguments) as info:
                await call.field("zip", "27701")
            late = await rt.begin("local_news")
            await late.field("city", "Durham")
            return info.value, await late.finish()

    exc, result = run(main())
    assert exc.field == "zip" and "zip" in exc.message
    assert not result.ok and result.field == "state" and "required" in result.error


def test_validate_early_off_defers_to_finish() -> None:
    async def main() -> ToolResult:
        async with ToolRuntime([LenientNewsTool()]) as rt:
            call = await rt.begin("local_news")
            await call.field("city", "Durham")
            await call.field("state", "North Carolina")  # accepted for now
            return await call.finish()

    result = run(main())
    assert not result.ok and result.error_type == "InvalidToolArguments" and result.field == "state"


def test_bad_declarations_fail_check() -> None:
    class BadName(Tool):
        name = "has space"

    class BadSchema(Tool):
        name = "bad_schema"
        parameters = {"type": "object", "properties": {"a": {"type": "no-such-type"}}}

    with pytest.raises(ToolConfigError):
        BadName().check()
    with pytest.raises(Exception, match="no-such-type"):
        BadSchema().check()


# --------------------------------------------------------------------------- failures


def test_raising_tool_gives_error_result_and_runtime_keeps_serving() -> None:
    async def main() -> list[ToolResult]:
        async with ToolRuntime([MisbehavingTool()]) as rt:
            return [await rt.run("misbehave", {"do": d}) for d in ("raise", "tool-error", "exit", "unjsonable", "ok")]

    raised, tool_error, exited, unjsonable, ok = run(main())
    assert not raised.ok and raised.error_type == "ValueError" and "boom" in raised.error
    assert not tool_error.ok and tool_error.error_type == "ToolError" and tool_error.error == "the thing is unavailable"
    assert not exited.ok and exited.error_type == "SystemExit"
    assert not unjsonable.ok and "JSON" in unjsonable.error
    assert ok.ok and ok.worker_pid == raised.worker_pid  # same worker survived all of it


def test_timeout_kills_and_replaces_worker() -> None:
    async def main() -> tuple[ToolResult, ToolResult, list[int]]:
        async with ToolRuntime([MisbehavingTool()]) as rt:
            hung = await rt.run("misbehave", {"do": "hang"})
            after = await rt.run("misbehave", {"do": "ok"})
            return hung, after, rt.worker_pids()

    hung, after, pids = run(main())
    assert not hung.ok and hung.error_type == "ToolTimeout"
    assert hung.tail_latency_s is not None and hung.tail_latency_s < 3
    assert not psutil.pid_exists(hung.worker_pid) or psutil.Process(hung.worker_pid).status() == psutil.STATUS_ZOMBIE
    assert after.ok and after.worker_pid != hung.worker_pid and pids == [after.worker_pid]


def test_crash_in_finish_and_in_partial_phase() -> None:
    async def main() -> tuple[ToolResult, ToolError, ToolResult, ToolResult]:
        async with ToolRuntime([MisbehavingTool()]) as rt:
            crashed = await rt.run("misbehave", {"do": "crash"})
            call = await rt.begin("misbehave")
            await call.line("crash")
            await wait_for(lambda: call.failure is not None)
            with pytest.raises(ToolError) as info:
                await call.line("more")
            crashed_early = await call.finish({"do": "ok"})
            after = await rt.run("misbehave", {"do": "ok"})
            return crashed, info.value, crashed_early, after

    crashed, early_exc, crashed_early, after = run(main())
    assert not crashed.ok and crashed.error_type == "ToolCrashed" and "exit code 3" in crashed.error
    assert early_exc.error_type == "ToolCrashed" and "exit code 7" in str(early_exc)
    assert not crashed_early.ok and crashed_early.error_type == "ToolCrashed"
    assert after.ok


def test_idle_worker_killed_from_outside_is_replaced() -> None:
    async def main() -> tuple[int, ToolResult]:
        async with ToolRuntime([EventsTool()]) as rt:
            (victim,) = rt.worker_pids()
            os.kill(victim, 9)  # e.g. the OOM killer
            await wait_for(lambda: rt.worker_pids() not in ([], [victim]))
            return victim, await rt.run("events", {"a": 1})

    victim, after = run(main())
    assert after.ok and after.worker_pid != victim


def test_cancel_busy_call_kills_worker_idle_call_keeps_it() -> None:
    async def main() -> tuple[int | None, int | None, ToolResult]:
        async with ToolRuntime([MisbehavingTool()], cancel_grace_s=0.2) as rt:
            idle = await rt.begin("misbehave")
            await idle.line("fine")
            pid_idle = idle._worker_pid
            await idle.cancel()
            await idle.cancel()  # idempotent
            busy = await rt.begin("misbehave")
            pid_busy = busy._worker_pid
            await busy.line("hang")
            t0 = time.monotonic()
            await busy.cancel("client went away")
            assert time.monotonic() - t0 < 2
            with pytest.raises(RuntimeError):
                await busy.finish({"do": "ok"})
            after = await rt.run("misbehave", {"do": "ok"})
            return pid_idle, pid_busy, after

    pid_idle, pid_busy, after = run(main())
    assert pid_idle == pid_busy  # a polite cancel gives the worker back
    assert after.ok and after.worker_pid != pid_busy  # a busy one is killed and replaced


def test_asyncio_cancellation_of_finish_kills_worker() -> None:
    async def main() -> tuple[int | None, ToolResult]:
        async with ToolRuntime([MisbehavingTool()]) as rt:
            call = await rt.begin("misbehave", timeout_s=30)
            task = asyncio.create_task(call.finish({"do": "hang"}))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return call._worker_pid, await rt.run("misbehave", {"do": "ok"})

    old_pid, after = run(main())
    assert after.ok and after.worker_pid != old_pid


def test_policy_veto_at_begin_and_on_fields() -> None:
    def policy(name: str, arguments: dict[str, Any], request: Any) -> str | None:
        if request == "blocked-user":
            return "not for you"
        if arguments.get("a") == 13:
            return "unlucky"
        return None

    async def main() -> tuple[ToolResult, ToolVetoed, ToolResult, ToolResult]:
        async with ToolRuntime([EventsTool()], policy=policy) as rt:
            at_begin = await (await rt.begin("events", request="blocked-user")).finish({})
            call = await rt.begin("events")
            with pytest.raises(ToolVetoed) as info:
                await call.field("a", 13)
            on_field = await call.finish()
            fine = await rt.run("events", {"a": 1})
            return at_begin, info.value, on_field, fine

    at_begin, exc, on_field, fine = run(main())
    assert not at_begin.ok and at_begin.error_type == "ToolVetoed" and at_begin.error == "not for you"
    assert str(exc) == "unlucky" and not on_field.ok and on_field.error == "unlucky"
    assert fine.ok


def test_unknown_tool_and_concurrent_calls_share_pool() -> None:
    async def main() -> tuple[ToolResult, list[ToolResult]]:
        async with ToolRuntime([EventsTool()], workers=2) as rt:
            with pytest.raises(UnknownTool):
                await rt.begin("nope")
            missing = await rt.run("nope", {})
            results = await asyncio.gather(*(rt.run("events", {"a": i}) for i in range(6)))
            return missing, list(results)

    missing, results = run(main())
    assert not missing.ok and missing.error_type == "UnknownTool"
    assert all(r.ok for r in results) and [r.content["arguments"]["a"] for r in results] == list(range(6))
    assert len({r.worker_pid for r in results}) == 2


# --------------------------------------------------------------------------- lifecycle


def test_close_leaves_no_processes() -> None:
    before = {p.pid for p in children()}

    async def main() -> list[int]:
        rt = ToolRuntime([EventsTool(), MisbehavingTool()], workers=2, stop_grace_s=0.3)
        await rt.start()
        pids = rt.worker_pids()
        assert len(pids) == 4 and all(psutil.pid_exists(p) for p in pids)
        busy = await rt.begin("misbehave")
        await busy.line("hang")  # a worker stuck mid-call must be killed too
        await rt.close()
        await rt.close()  # idempotent
        with pytest.raises(RuntimeError):
            await rt.begin("events")
        return pids

    pids = run(main())
    assert {p.pid for p in children()} - before == set()
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def test_worker_init_failure_fails_start_cleanly() -> None:
    before = {p.pid for p in children()}

    async def main() -> None:
        rt = ToolRuntime([BrokenInitTool()])
        with pytest.raises(RuntimeError, match="worker_init failed"):
            await rt.start()

    run(main())
    assert {p.pid for p in children()} - before == set()


class BrokenInitTool(Tool):
    name = "broken_init"

    def worker_init(self) -> None:
        raise OSError("cannot open resource")

    def on_finish(self, arguments: dict[str, Any]) -> str:
        return "unreachable"
