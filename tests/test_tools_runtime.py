"""The tool runtime: partial execution, early validation, failures, cancellation, clean shutdown.

The tools below run in worker processes; they live at module level so the
``spawn`` workers can import them by reference.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import psutil
import pytest

from interlace.gateway.tools.call import ToolCall, ToolResult
from interlace.gateway.tools.runtime import ToolRuntime
from interlace.gateway.tools.base import (
    Granularity,
    InvalidToolArguments,
    Tool,
    ToolConfigError,
    ToolError,
    ToolTimeout,
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


class OrderTool(Tool):
    """Returns its ``label`` after ``sleep`` seconds: shows the order calls got the worker in."""

    name = "order"
    parameters = {"type": "object", "properties": {"label": {"type": "string"}, "sleep": {"type": "number"}}}
    workers = 1

    def on_finish(self, arguments: dict[str, Any]) -> str:
        time.sleep(arguments.get("sleep", 0.0))
        return arguments["label"]


class HogTool(Tool):
    """Burns CPU, memory or forks on demand, in a reusable worker (not the python tool)."""

    name = "hog"
    parameters = {"type": "object", "properties": {"do": {"type": "string"}}, "required": ["do"]}
    memory_mb = 256
    cpu_s = 0.5
    timeout_s = 60.0

    def on_finish(self, arguments: dict[str, Any]) -> Any:
        action = arguments["do"]
        if action == "spin":
            while True:
                pass
        if action == "alloc":
            return len(bytearray(600 << 20))
        if action == "fork":  # a child that never exits: returns, like its parent, into the worker loop
            os.fork()
            return {"pid": os.getpid()}
        if action == "env":
            return {"env": dict(os.environ), "cwd": os.getcwd()}
        if action == "spawn-and-hang":
            import subprocess

            subprocess.Popen(["sleep", "1000"])
            time.sleep(1000)
        return {"pid": os.getpid()}


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


# --------------------------------------------------------------------------- limits on every worker


def test_wall_time_starts_at_begin_not_at_finish() -> None:
    """A statement that hangs while the model is still writing is killed at the deadline."""

    async def main() -> tuple[ToolCall, float, ToolResult, ToolResult]:
        async with ToolRuntime([MisbehavingTool()]) as rt:  # timeout_s = 0.5
            call = await rt.begin("misbehave")
            await call.line("hang")
            t0 = time.monotonic()
            await wait_for(lambda: call.failure is not None, timeout=10)  # finish() is never called
            waited = time.monotonic() - t0
            with pytest.raises(ToolTimeout):
                await call.line("more")
            result = await call.finish({"do": "ok"})
            after = await rt.run("misbehave", {"do": "ok"})
            return call, waited, result, after

    call, waited, result, after = run(main())
    assert isinstance(call.failure, ToolTimeout) and "wall-time limit of 0.5s" in str(call.failure)
    assert waited < 5 and not result.ok and result.error_type == "ToolTimeout"
    assert not psutil.pid_exists(result.worker_pid) or psutil.Process(result.worker_pid).status() == "zombie"
    assert after.ok and after.worker_pid != result.worker_pid


def test_slow_model_between_events_is_not_held_against_the_tool() -> None:
    """The wall clock runs while the worker works on the call, not while the model decodes."""
    tool = EventsTool()
    tool.timeout_s = 0.5

    async def main() -> ToolResult:
        async with ToolRuntime([tool]) as rt:
            call = await rt.begin("events")
            await call.field("a", 1)
            await asyncio.sleep(1.2)  # the model takes its time writing "b"
            await call.field("b", "x")
            await asyncio.sleep(0.6)
            return await call.finish({"a": 1, "b": "x"})

    result = run(main())
    assert result.ok, result.error


def test_timeout_kills_the_whole_process_group() -> None:
    async def main() -> tuple[ToolResult, list[int]]:
        async with ToolRuntime([HogTool()]) as rt:
            call = await rt.begin("hog", timeout_s=1.5)
            result_task = asyncio.create_task(call.finish({"do": "spawn-and-hang"}))
            await wait_for(lambda: call._worker_pid is not None, timeout=10)
            worker = psutil.Process(call._worker_pid)
            await wait_for(lambda: bool(worker.children()), timeout=10)
            sleepers = [c.pid for c in worker.children()]
            return await result_task, sleepers

    result, sleepers = run(main())
    assert not result.ok and result.error_type == "ToolTimeout" and sleepers
    for pid in sleepers:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_cpu_limit_applies_to_every_worker() -> None:
    async def main() -> tuple[float, ToolResult, ToolResult]:
        async with ToolRuntime([HogTool()]) as rt:  # cpu_s = 0.5, timeout_s = 60
            t0 = time.monotonic()
            spun = await rt.run("hog", {"do": "spin"})
            elapsed = time.monotonic() - t0
            return elapsed, spun, await rt.run("hog", {"do": "ok"})

    elapsed, spun, after = run(main())
    assert not spun.ok and spun.error_type == "ToolTimeout" and "CPU time limit of 0.5s" in spun.error
    assert elapsed < 30  # far below the 60 s wall-time limit, even on a loaded machine
    assert after.ok and after.worker_pid == spun.worker_pid  # the budget is per call: the worker goes on


def test_memory_limit_applies_to_every_worker() -> None:
    async def main() -> tuple[ToolResult, list[dict[str, Any]]]:
        async with ToolRuntime([HogTool()]) as rt:  # memory_mb = 256
            return await rt.run("hog", {"do": "alloc"}), rt.worker_info("hog")

    result, infos = run(main())
    assert not result.ok and result.error_type == "MemoryError"
    assert infos[0]["rlimits"]["RLIMIT_AS"] == [256 << 20, 256 << 20]


def test_workers_get_a_clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INTERLACE_TEST_GATEWAY_SECRET", "sk-secret")
    tool = HogTool()
    tool.env = {"TOOL_SETTING": "visible"}

    async def main() -> ToolResult:
        async with ToolRuntime([tool]) as rt:
            return await rt.run("hog", {"do": "env"})

    result = run(main())
    env, cwd = result.content["env"], result.content["cwd"]
    assert "INTERLACE_TEST_GATEWAY_SECRET" not in env and "sk-secret" not in json.dumps(env)
    assert set(env) == {"PATH", "LANG", "HOME", "TMPDIR", "TOOL_SETTING"} and env["TOOL_SETTING"] == "visible"
    assert env["HOME"] == env["TMPDIR"] == cwd and not os.path.exists(cwd)  # scratch removed with the worker


def test_fork_without_exit_does_not_corrupt_the_pipe() -> None:
    """The forked child returns into the worker loop too: it must exit before touching the pipe."""

    async def main() -> tuple[ToolResult, ToolResult, float]:
        async with ToolRuntime([HogTool()], workers=1) as rt:
            forked = await rt.run("hog", {"do": "fork"})
            t0 = time.monotonic()
            after = await rt.run("hog", {"do": "ok"})
            return forked, after, time.monotonic() - t0

    forked, after, waited = run(main())
    assert forked.ok and forked.content["pid"] == forked.worker_pid
    assert after.ok and after.worker_pid == forked.worker_pid and waited < 5


# --------------------------------------------------------------------------- pool sizing and fairness


def test_two_keys_alternate_on_one_worker() -> None:
    """Round-robin between keys: alice's backlog does not starve bob."""

    async def main() -> list[str]:
        async with ToolRuntime([OrderTool()]) as rt:
            blocker = asyncio.create_task(rt.run("order", {"label": "block", "sleep": 2}, request={"key": "x"}))
            await asyncio.sleep(0.1)
            tasks = []
            for label, key in [("a1", "alice"), ("a2", "alice"), ("a3", "alice"), ("a4", "alice"),
                               ("b1", "bob"), ("b2", "bob")]:
                tasks.append(asyncio.create_task(rt.run("order", {"label": label}, request={"key": key})))
                await asyncio.sleep(0.01)  # queued in this order
            await blocker
            results = await asyncio.gather(*tasks)
            return [r.content for r in sorted(results, key=lambda r: r.finished_at)]

    assert run(main()) == ["a1", "b1", "a2", "b2", "a3", "a4"]


def test_fast_call_not_blocked_behind_slow_one_with_two_workers() -> None:
    tool = OrderTool()
    tool.workers = 2  # what the built-in tools default to

    async def main() -> tuple[ToolResult, ToolResult]:
        async with ToolRuntime([tool]) as rt:
            slow = asyncio.create_task(rt.run("order", {"label": "slow", "sleep": 3}))
            await asyncio.sleep(0.2)
            fast = await rt.run("order", {"label": "fast"})
            return fast, await slow

    fast, slow = run(main())
    assert fast.ok and slow.ok and fast.finished_at < slow.finished_at - 1


def test_waiting_caller_that_gives_up_leaves_the_queue() -> None:
    async def main() -> tuple[ToolResult, ToolResult]:
        async with ToolRuntime([OrderTool()], acquire_timeout_s=0.3) as rt:
            slow = asyncio.create_task(rt.run("order", {"label": "slow", "sleep": 1}))
            await asyncio.sleep(0.1)
            starved = await rt.run("order", {"label": "late"})
            await slow
            return starved, await rt.run("order", {"label": "next"})

    starved, after = run(main())
    assert not starved.ok and "became free" in starved.error
    assert after.ok and after.content == "next"


def test_pools_and_calls_get_the_runtime_settings_not_the_runtime() -> None:
    """The runtime hands its settings down: no pool, worker or call holds the runtime itself."""

    async def main() -> None:
        async with ToolRuntime([EventsTool()], acquire_timeout_s=7.0) as rt:
            call = await rt.begin("events", "c1")
            await call.field("a", 1)
            held = [call, call.pool, call._worker]
            assert call.settings is rt.settings and call.settings.acquire_timeout_s == 7.0
            assert call.pool.settings is rt.settings
            assert not [obj for obj in held if any(value is rt for value in vars(obj).values())]
            assert (await call.finish()).ok

    run(main())


def test_the_tools_wing_imports_one_way() -> None:
    """Its modules import only those below them (no circle): the order its package docstring gives."""
    import ast
    from pathlib import Path

    import interlace.gateway.tools as wing

    order = ["base", "worker", "settings", "process", "cgroup", "sandbox", "pool", "call", "runtime"]  # bottom to top
    folder = Path(wing.__file__).parent
    assert {p.stem for p in folder.glob("*.py")} - {"__init__"} == set(order)
    for name in order:
        siblings = set()
        for node in ast.walk(ast.parse((folder / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                siblings.update([node.module] if node.module else [a.name for a in node.names])
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("interlace.gateway.tools."):
                siblings.add(node.module.split(".")[3])
        above = siblings - set(order[: order.index(name)])
        assert not above, f"gateway/tools/{name}.py imports {sorted(above)}, which sit above it"
