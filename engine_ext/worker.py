"""The native engine in a worker process.

:class:`ProcessEngine` implements :class:`~interlace.engine_ext.protocol.Engine`
by running a :class:`~interlace.engine_ext.native.engine.NativeEngine` in a
child process (``multiprocessing``, "spawn": forking a process that runs torch
threads is unsafe), so one gateway can front several replicas on separate
cores or GPUs, and a replica that crashes does not take the gateway down.

Parent and child talk over one duplex pipe.  Every call carries a call id;
the child's asyncio loop owns the engine and runs each call as a task, so a
``generate`` stream never blocks other calls.  Results, the stream's
:class:`TokenEvent` s and errors come back with the call id: a typed engine
error (``engine_ext/errors.py``) is raised in the parent as the same class
with the same message; another error as its own class when that class is a
builtin or an ``interlace`` one, else as :class:`EngineError` naming it (the
child's traceback rides along as a note).  A reader thread in the parent
watches the pipe and the process: when the child dies every pending call and
running stream fails at once with :class:`EngineUnavailable`, and so does
every later call.  A caller cancelled while waiting has its call cancelled in
the child too, so cancellation means what it means in process (a cancelled
fill is undone, a cancelled or abandoned stream aborted).

Token events cross in batches (issue 36): the child sends what its streams
emitted in one loop turn (a decode step's tokens for every stream: the
native engine hands them over together) as one ``evs`` message -- their
kinds and call ids, their payloads pickled together; an error goes alone,
in its place, since what it carries may not unpickle here --, and the
reader thread hands a message's events to each caller's loop with one
wake-up (``channel.Outbox``).  Measured (a 2-core CPU host, 256 streams, one
token each per step): the child spent 1.7-4.0 ms per step sending one
message per token, 0.3-0.6 ms sending one; the tokens reached all 256
streams in the parent after 15-24 ms, now 2.4-8.9 ms.

Logits processors run in the child, on copies shipped when a stream starts;
``on_resume()`` calls on the caller's processors reach the copies at the
next ``resume`` (see :class:`ProcessEngine`).

"spawn" starts a fresh interpreter that imports the parent's main module
(as ``__mp_main__``): a script that starts workers must do so under
``if __name__ == "__main__":`` (console scripts such as ``interlace`` do).
The child inherits the parent's stdout and stderr, logs there at the
parent's level (lines prefixed by the worker's name), ignores SIGINT (the
parent closes it) and exits when the parent goes away (the pipe closes).
"""

from __future__ import annotations

import asyncio
import copy
import importlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Dict, Hashable, List, Optional, Sequence

from . import errors as E
from .channel import Outbox
from .protocol import PauseHint, RequestHint, SamplingParams, TokenEvent

log = logging.getLogger(__name__)

#: How long :meth:`ProcessEngine.close` lets the child shut its engine down
#: before it is terminated (then killed).
CLOSE_TIMEOUT_S = 5.0
#: How often a busy child sends its load (:meth:`ProcessEngine.stats`) when it changed (seconds).
STATS_INTERVAL_S = 0.1

#: Calls the child runs with ``await engine.<name>(*args)`` (``last_logits`` and ``stats`` are special).
_ASYNC_CALLS = frozenset({"free_context", "pause", "resume", "park", "truncate", "computed_tokens",
                          "check_invariants", "context_length", "context_tokens"})
#: Non-blocking engine calls nobody waits for (their errors are logged in the child).
_POSTS = frozenset({"free_context_nowait", "set_pause_hint", "set_request_hint"})

def _processor_name(proc: Any) -> str:
    return getattr(proc, "__qualname__", None) or type(proc).__qualname__


# ================================================================= errors across the pipe
def _pack_error(e: BaseException) -> tuple:
    """What rebuilds ``e`` in the other process: its class's module and name,
    its args and attributes (when they pickle, else its message), the traceback."""
    cls = type(e)
    args: tuple = e.args
    attrs: dict = dict(getattr(e, "__dict__", {}))
    try:
        pickle.dumps((args, attrs))
    except Exception:  # noqa: BLE001  (anything unpicklable travels as its text)
        args, attrs = (str(e),), {}
    tb = "".join(traceback.format_exception(cls, e, e.__traceback__))
    return cls.__module__, cls.__qualname__, args, attrs, str(e), tb


def _unpack_error(packed: tuple) -> BaseException:
    module, qualname, args, attrs, message, tb = packed
    cls: Any = None
    if module == "builtins" or module.startswith(("interlace.", "interlace_")):
        try:
            cls = importlib.import_module(module)
            for part in qualname.split("."):
                cls = getattr(cls, part)
        except Exception:  # noqa: BLE001
            cls = None
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        err: BaseException = E.EngineError(f"engine worker: {module}.{qualname}: {message}")
    else:
        err = cls.__new__(cls)  # not __init__: its signature may differ from its args (ContextNotFound)
        err.args = tuple(args)
        try:
            err.__dict__.update(attrs)
        except AttributeError:
            pass
    if not isinstance(err, E.EngineError) or type(err) is E.EngineError:
        err.add_note(f"raised in the engine worker process:\n{tb}")
    return err


def _frame(kind: str, call_id: Optional[int], payload: Any) -> bytes:
    """One message: its kind and call id, and the payload pickled on its own,
    so a payload the other side cannot unpickle fails that call alone."""
    return pickle.dumps((kind, call_id, pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL)),
                        protocol=pickle.HIGHEST_PROTOCOL)


# ===================================================================== parent side
class _Call:
    """A pending call in the parent: a future (calls) or a queue (streams) on
    the caller's event loop."""

    __slots__ = ("loop", "fut", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop, fut: Optional[asyncio.Future] = None,
                 queue: Optional[asyncio.Queue] = None):
        self.loop, self.fut, self.queue = loop, fut, queue

    def deliver(self, kind: str, value: Any, outbox: Optional[Outbox] = None) -> None:
        """From the reader thread: ``ok`` / ``err`` end a call; ``ev`` / ``end`` / ``err`` feed a stream
        (through ``outbox``, the reader's, when given)."""
        try:
            if self.queue is not None and outbox is not None:
                outbox.put(self, (kind, value))
            elif self.queue is not None:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, value))
            else:
                self.loop.call_soon_threadsafe(_settle, self.fut, kind, value)
        except RuntimeError:  # the caller's loop is closed: nobody is waiting
            pass


def _settle(fut: asyncio.Future, kind: str, value: Any) -> None:
    if fut.done():
        return
    if kind == "ok":
        fut.set_result(value)
    else:
        fut.set_exception(value)


class ProcessEngine:
    """A :class:`NativeEngine` in a worker process, as an
    :class:`~interlace.engine_ext.protocol.Engine`.  Build it with
    :meth:`start`.  ``tokenizer`` is loaded in this process from the model
    directory the child resolved; ``vocab_size``, ``max_model_len``,
    ``block_size``, ``eos_token_ids`` and the engine's ``name`` come from the
    child at start-up.

    Logits processors: ``generate`` pickles each one and the child runs its
    copy.  A processor holding what does not pickle gives a recipe instead
    (``__reduce__``): a ``GrammarProcessor`` rebuilds itself from its grammar
    spec for the engine's tokenizer, which the child declares once its engine
    is built (``constraints.grammar.serve_in_worker``).
    One that cannot be pickled, or rebuilt in the child, makes ``generate``
    raise :class:`InvalidSampling` naming it, before anything changes.  The
    caller's objects stay in this process and never see a token: their state
    (a grammar's parse, ``steps``, ``done``) stays as it was when the stream
    started.  Between rounds callers call ``on_resume()`` on their
    processors, then :meth:`resume`.  So that the child's copies see those
    calls, a processor with ``on_resume`` counts them in an int attribute
    ``resumes`` (``ForcedOutput`` and the gateway's ``FirstRoundOnly`` do;
    one without it is refused), and :meth:`resume` first makes on the
    child's copies (of the context's stream) the calls made on the caller's
    since the stream started or the previous resume.  A resume without
    ``on_resume`` (a spurious pause resumed with nothing) leaves them alone,
    as in process."""

    def __init__(self, process: Any, conn: Any, info: Dict[str, Any], tokenizer: Any, label: str):
        self.process = process
        self.pid: int = process.pid
        self.label = label
        self.info = info
        self.tokenizer = tokenizer
        self.name: str = info["name"]
        self.model_dir = Path(info["model_dir"])
        self.vocab_size: int = info["vocab_size"]
        self.max_model_len: int = info["max_model_len"]
        self.block_size: int = info["block_size"]
        self.eos_token_ids = frozenset(info["eos_token_ids"])
        self.variant_names = frozenset(info["variant_names"])  # the model variants it serves
        self._stats: Dict[str, int] = dict(info["stats"])  # the latest load the child sent
        self._conn = conn
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # _calls, _dead, _closed
        self._calls: Dict[int, _Call] = {}
        #: context id -> its streams' processors with on_resume: [[index, processor, resumes passed on], ...]
        self._streams: Dict[Hashable, List[List[List[Any]]]] = {}
        self._ids = itertools.count(1)
        self._closed = False
        self._dead: Optional[str] = None  # why the child is gone (None: alive as far as we know)
        self._reader = threading.Thread(target=self._read, name=f"interlace-{label}-reader", daemon=True)
        self._reader.start()

    # ------------------------------------------------------------------ start
    @classmethod
    def start(cls, native_kwargs: Dict[str, Any], policy: Any = None, *, name: str = "worker",
              start_timeout: Optional[float] = None) -> "ProcessEngine":
        """Start a worker process and load its engine; blocks until it serves
        (call it from a thread in async code).  ``native_kwargs``: ``path``
        (a model directory, a ``.gguf`` file or ``"embedded"``), an optional
        ``threads`` (the child's torch threads) and
        :meth:`NativeEngine.load` keyword arguments.  ``policy``: the
        gateway's ``PolicySpec``, applied as in process
        (:func:`~interlace.engine_ext.native.setup.build_native_engine`);
        None: the engine's default policies.  The child's start-up error is
        raised here (as its own class when it is a builtin or Interlace one);
        a child that dies while starting, or (``start_timeout``) takes too
        long, raises :class:`EngineUnavailable`."""
        kwargs = dict(native_kwargs)
        if "path" not in kwargs:
            raise ValueError("native_kwargs needs a 'path' (a model directory, a .gguf file or 'embedded')")
        ctx = multiprocessing.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        process = ctx.Process(target=_child_main, name=f"interlace-{name}", daemon=True,
                              args=(child_conn, kwargs, policy, name, logging.getLogger().getEffectiveLevel()))
        process.start()
        child_conn.close()  # ours: the pipe reports EOF once the child's end closes
        try:
            ready = multiprocessing.connection.wait([parent_conn, process.sentinel], timeout=start_timeout)
            if not parent_conn.poll():  # also when the child exited after saying why
                process.join(timeout=1.0)
                if not ready:
                    raise E.EngineUnavailable(f"engine {name}: the worker did not start within {start_timeout} s")
                raise E.EngineUnavailable(f"engine {name}: the worker process exited while starting "
                                          f"(exit code {_exitcode(process)})")
            try:
                kind, _, blob = pickle.loads(parent_conn.recv_bytes())
                payload = pickle.loads(blob)
            except (EOFError, OSError):
                process.join(timeout=1.0)
                raise E.EngineUnavailable(f"engine {name}: the worker process exited while starting "
                                          f"(exit code {_exitcode(process)})") from None
            if kind == "failed":
                raise _unpack_error(payload)
            assert kind == "ready", kind
            from .tokenizer import Tokenizer

            tokenizer = Tokenizer.from_model_dir(payload["model_dir"])  # as NativeEngine.load builds it
        except BaseException:
            _stop_process(process, graceful=1.0)  # a child that failed exits by itself
            parent_conn.close()
            raise
        return cls(process, parent_conn, payload, tokenizer, name)

    # ------------------------------------------------------------- protocol
    async def fill(self, context_id: Hashable, token_ids: Sequence[int],
                   parent_context_id: Optional[Hashable] = None, hint: Optional[RequestHint] = None,
                   variant: Optional[str] = None) -> int:
        """As :meth:`NativeEngine.fill`; a caller cancelled while waiting has
        the fill undone in the child (also when its result was already on its way)."""
        return await self._call("fill", context_id, list(token_ids), parent_context_id, hint, variant)

    async def generate(self, context_id: Hashable, sampling: Optional[SamplingParams] = None,
                       parent_context_id: Optional[Hashable] = None,
                       hint: Optional[RequestHint] = None) -> AsyncIterator[TokenEvent]:
        """As :meth:`NativeEngine.generate`; logits processors run on copies
        in the child (see the module doc)."""
        sampling = sampling or SamplingParams()
        procs, blobs, hooked = self._pack_processors(sampling)
        if procs:
            sampling = copy.copy(sampling)  # shipped apart: a processor the child cannot rebuild is named
            sampling.logits_processors = ()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        call_id = self._open(_Call(loop, queue=queue))
        finished = False
        stream = [[i, p, p.resumes] for i, p in hooked]
        if stream:
            with self._lock:
                self._streams.setdefault(context_id, []).append(stream)
        try:
            self._send(("gen", call_id, (context_id, sampling, parent_context_id, hint, blobs)))
            while True:
                kind, item = await queue.get()
                if kind == "ev":
                    finished = item.finish_reason is not None
                    yield item
                    if finished:
                        return
                elif kind == "end":  # the child's stream ended without a final event (it always has one)
                    finished = True
                    return
                else:
                    finished = True
                    raise item
        finally:
            self._forget(call_id)
            if stream:
                with self._lock:
                    streams = [s for s in self._streams.get(context_id, ()) if s is not stream]
                    if streams:
                        self._streams[context_id] = streams
                    else:
                        self._streams.pop(context_id, None)
            if not finished:  # consumer stopped early or was cancelled: abort it in the child
                self._post_quiet(("cancel", call_id, None))

    def _pack_processors(self, sampling: SamplingParams) -> tuple:
        """(processors, each pickled, those with ``on_resume`` as (index,
        processor)); InvalidSampling for one that cannot go to the child."""
        procs = list(sampling.logits_processors or ())
        blobs: List[bytes] = []
        hooked = []
        for i, proc in enumerate(procs):
            what = f"engine {self.name!r}: logits processor {i} ({_processor_name(proc)})"
            if callable(getattr(proc, "on_resume", None)):
                if not isinstance(getattr(proc, "resumes", None), int):
                    raise E.InvalidSampling(f"{what} has on_resume() but no int `resumes` counting its calls: "
                                            "this engine runs it in a worker process and could not pass them on")
                hooked.append((i, proc))
            try:
                blobs.append(pickle.dumps(proc, protocol=pickle.HIGHEST_PROTOCOL))
            except Exception as e:  # noqa: BLE001  (PicklingError, TypeError, AttributeError, a recipe's own)
                raise E.InvalidSampling(f"{what} cannot be sent to the worker process: {e}") from e
        return procs, blobs, hooked

    async def free_context(self, context_id: Hashable) -> None:
        await self._call("free_context", context_id)

    def free_context_nowait(self, context_id: Hashable) -> None:
        """Queue a free without waiting; ignored when the context (or the
        worker) is gone."""
        self._post_quiet(("post", None, ("free_context_nowait", (context_id,))))

    async def pause(self, context_id: Hashable, hint: Optional[PauseHint] = None) -> None:
        await self._call("pause", context_id, hint)

    async def resume(self, context_id: Hashable, token_ids: Sequence[int] = (),
                     hint: Optional[RequestHint] = None) -> None:
        """As :meth:`NativeEngine.resume` (``hint`` goes over the channel
        with the call, a plain picklable dataclass); first the child's
        copies of the stream's processors get the ``on_resume()`` calls
        made on the caller's since the stream started or the previous resume."""
        await self._call("resume", context_id, list(token_ids), self._resumes_to_pass(context_id), hint)

    def _resumes_to_pass(self, context_id: Hashable) -> List[tuple]:
        """[(processor index, on_resume calls)] not passed on yet, for the context's latest stream."""
        out = []
        with self._lock:
            streams = self._streams.get(context_id)
            for entry in streams[-1] if streams else ():
                i, proc, passed = entry
                n = int(proc.resumes) - passed
                if n > 0:
                    out.append((i, n))
                    entry[2] = passed + n
        return out

    def set_pause_hint(self, context_id: Hashable, hint: PauseHint) -> None:
        if not isinstance(hint, PauseHint):
            raise TypeError(f"hint must be a PauseHint, got {type(hint).__name__}")
        self._post_quiet(("post", None, ("set_pause_hint", (context_id, hint))))

    def set_request_hint(self, context_id: Hashable, hint: RequestHint) -> None:
        if not isinstance(hint, RequestHint):
            raise TypeError(f"hint must be a RequestHint, got {type(hint).__name__}")
        hint.validate()
        self._post_quiet(("post", None, ("set_request_hint", (context_id, hint))))

    async def park(self, context_id: Hashable, hint: Optional[PauseHint] = None) -> None:
        await self._call("park", context_id, hint)

    async def truncate(self, context_id: Hashable, num_tokens: int) -> int:
        return await self._call("truncate", context_id, num_tokens)

    async def computed_tokens(self, context_id: Hashable) -> int:
        return await self._call("computed_tokens", context_id)

    # ---------------------------------------------------------------- extras
    async def check_invariants(self) -> dict:
        return await self._call("check_invariants")

    async def context_length(self, context_id: Hashable) -> int:
        return await self._call("context_length", context_id)

    async def context_tokens(self, context_id: Hashable) -> List[int]:
        return await self._call("context_tokens", context_id)

    async def last_logits(self, context_id: Hashable) -> Any:
        """As :meth:`NativeEngine.last_logits` (a CPU float32 tensor here)."""
        arr = await self._call("last_logits", context_id)
        if arr is None:
            return None
        import torch

        return torch.from_numpy(arr)

    def load_stats(self) -> Dict[str, int]:
        """The worker's load, without waiting: ``kv_blocks_used``,
        ``kv_blocks_total``, ``queued_tokens``, ``running``, ``waiting``
        (and ``contexts``, the capacity keys), as :meth:`NativeEngine.load_stats` counts them
        in the child, which sends them every :data:`STATS_INTERVAL_S` while
        they change (so at most that old).  Raises :class:`EngineUnavailable`
        when the child is gone, :class:`EngineClosed` after :meth:`close`."""
        self._check()
        return dict(self._stats)

    async def fetch_stats(self) -> Dict[str, int]:
        """The worker's load now (a round trip), as :meth:`load_stats` counts it."""
        stats = await self._call("stats")
        self._stats = stats
        return dict(stats)

    @property
    def alive(self) -> bool:
        """The worker serves: not closed, not known dead, its process running."""
        return not self._closed and self._dead is None and self.process.is_alive()

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the worker (idempotent): its engine is closed as in process
        (running generations end with ``abort``, pending calls raise
        :class:`EngineClosed`), then the process is joined -- terminated
        after ``timeout`` seconds (what was still running then raises
        :class:`EngineClosed`), killed if it still runs 2 s later.  Every
        later call raises :class:`EngineClosed`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._send_raw(("close", None, None))
        except Exception:  # noqa: BLE001  (already gone)
            pass
        _stop_process(self.process, graceful=timeout)
        self._reader.join(timeout=5.0)
        self._fail_all(E.EngineClosed("the engine is closed"))  # what the reader had not failed yet
        if not self._reader.is_alive():
            self._conn.close()

    def __enter__(self) -> "ProcessEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("dead" if self._dead else "alive")
        return f"<ProcessEngine {self.label} pid={self.pid} model={self.name!r} {state}>"

    # ------------------------------------------------------------ machinery
    def _check(self) -> None:
        if self._closed:
            raise E.EngineClosed("the engine is closed")
        if self._dead is not None:
            raise E.EngineUnavailable(self._dead)

    def _open(self, call: _Call) -> int:
        with self._lock:
            self._check()
            call_id = next(self._ids)
            self._calls[call_id] = call
            return call_id

    def _forget(self, call_id: int) -> None:
        with self._lock:
            self._calls.pop(call_id, None)

    def _send_raw(self, msg: tuple) -> None:
        data = _frame(*msg)  # before the lock: an argument that does not pickle fails alone
        with self._send_lock:
            self._conn.send_bytes(data)

    def _send(self, msg: tuple) -> None:
        """Send a call; the worker being gone raises as a call would."""
        self._check()
        try:
            self._send_raw(msg)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise TypeError(f"engine {self.name!r}: an argument cannot be sent to the worker process: {e}") from e
        except (OSError, EOFError, ValueError) as e:  # broken pipe, or closed under us
            self._check()
            raise E.EngineUnavailable(f"engine {self.name!r}: the worker process is gone ({e!r})") from e

    def _post_quiet(self, msg: tuple) -> None:
        """Send something nobody waits for; ignored when the worker is gone or closed."""
        if self._closed or self._dead is not None:
            return
        try:
            self._send_raw(msg)
        except (pickle.PicklingError, TypeError, AttributeError) as e:
            raise TypeError(f"engine {self.name!r}: an argument cannot be sent to the worker process: {e}") from e
        except (OSError, EOFError, ValueError):
            pass

    async def _call(self, method: str, *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        call_id = self._open(_Call(loop, fut))
        try:
            self._send(("call", call_id, (method, args)))
        except BaseException:
            self._forget(call_id)
            raise
        try:
            return await fut
        except asyncio.CancelledError:
            # also when the answer had arrived: the child undoes a finished fill
            self._forget(call_id)
            self._post_quiet(("cancel", call_id, None))
            raise

    def _read(self) -> None:
        """The reader thread: answers to their calls, until the child is gone."""
        conn, sentinel = self._conn, self.process.sentinel
        outbox = Outbox()  # a message's stream events: one wake-up per caller loop
        try:
            while True:
                ready = multiprocessing.connection.wait([conn, sentinel])
                if conn not in ready:  # exited; whatever it sent before is read first
                    if not conn.poll():
                        break
                try:
                    kind, call_id, blob = pickle.loads(conn.recv_bytes())
                except (EOFError, OSError):
                    break
                with outbox.holding():
                    for kind, call_id, payload in self._decode(kind, call_id, blob):
                        self._answer(kind, call_id, payload, outbox)
        except Exception:  # noqa: BLE001  (a bug here must not leave callers waiting)
            log.exception("engine worker %s: reading its answers failed", self.label)
        finally:
            self.process.join(timeout=1.0)  # the exit code, if it has one now
            if self._closed:
                self._fail_all(E.EngineClosed("the engine is closed"))
            else:
                reason = (f"engine {self.name!r}: the worker process ({self.label}, pid {self.pid}) is gone "
                          f"(exit code {_exitcode(self.process)})")
                log.error("%s", reason)
                with self._lock:
                    if self._dead is None:
                        self._dead = reason
                self._fail_all(E.EngineUnavailable(reason))

    def _decode(self, kind: str, call_id: Optional[int], blob: bytes) -> List[tuple]:
        """A message's answers, (kind, call id, payload) each: one, or an
        ``evs`` message's (streams' events and ends: their kinds and call ids,
        then their payloads pickled together)."""
        ids = [(kind, call_id)]
        try:
            payload = pickle.loads(blob)
            if kind == "evs":
                ids, payloads = payload
                return [(k, c, p) for (k, c), p in zip(ids, pickle.loads(payloads), strict=True)]
            if kind == "err":
                payload = _unpack_error(payload)
            return [(kind, call_id, payload)]
        except Exception as e:  # noqa: BLE001  (those answers are lost, not the worker)
            return [("err", c, E.EngineError(f"engine {self.name!r}: an answer of the worker could not be read: "
                                             f"{e!r}")) for _, c in ids]

    def _answer(self, kind: str, call_id: Optional[int], payload: Any, outbox: Outbox) -> None:
        if kind == "stats":
            self._stats = payload
            return
        with self._lock:
            call = (self._calls.pop(call_id, None) if kind in ("ok", "err", "end")
                    else self._calls.get(call_id))
        if call is not None:
            call.deliver(kind, payload, outbox)

    def _fail_all(self, err: BaseException) -> None:
        with self._lock:
            calls, self._calls = list(self._calls.values()), {}
        for call in calls:
            e = type(err)(*err.args)  # one per caller: a raised exception keeps its traceback
            call.deliver("err", e)


def _exitcode(process: Any) -> Any:
    code = process.exitcode
    if code is not None and code < 0:
        try:
            return f"{code}, {signal.Signals(-code).name}"
        except ValueError:
            pass
    return code


def _stop_process(process: Any, graceful: float) -> None:
    """Join ``process``: wait ``graceful`` seconds, then SIGTERM, then SIGKILL."""
    process.join(timeout=graceful)
    if process.is_alive():
        process.terminate()
        process.join(timeout=2.0)
    if process.is_alive():
        process.kill()
        process.join(timeout=5.0)


# ====================================================================== child side
def _child_main(conn: Any, native_kwargs: Dict[str, Any], policy: Any, name: str, log_level: int) -> None:
    """The worker process: build the engine, say so, serve until told to stop
    or the parent goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent closes us
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format=f"%(asctime)s {name}[%(process)d] %(levelname)s %(name)s: %(message)s")
    send_lock = threading.Lock()

    def send(kind: str, call_id: Optional[int], payload: Any) -> None:
        try:
            data = _frame(kind, call_id, payload)
        except Exception as e:  # noqa: BLE001  (the caller gets an error instead of waiting forever)
            err = TypeError(f"the engine worker's answer cannot be sent back: {e!r}")
            data = _frame("err" if call_id is not None else "failed", call_id, _pack_error(err))
        with send_lock:
            conn.send_bytes(data)

    kwargs = dict(native_kwargs)
    path = kwargs.pop("path")
    threads = kwargs.pop("threads", None)
    try:
        import torch

        if threads:
            torch.set_num_threads(int(threads))
        from .native.setup import build_native_engine, model_dir

        resolved = model_dir(path, kwargs.get("zoo"))  # the directory the parent reads the tokenizer from
        engine = build_native_engine(path, kwargs, policy)
    except BaseException as e:  # noqa: BLE001  (reported to the parent, which raises it)
        log.debug("engine worker failed to start", exc_info=True)
        try:
            send("failed", None, _pack_error(e))
        except (OSError, ValueError):
            pass
        return
    info = {"name": engine.name, "model_dir": str(resolved), "vocab_size": engine.vocab_size,
            "max_model_len": engine.max_model_len, "block_size": engine.block_size,
            "eos_token_ids": sorted(engine.eos_token_ids), "pid": os.getpid(), "device": str(engine.device),
            "interception": type(engine.interception).__name__,
            "ranking": type(engine.scheduler.ranking).__name__,
            "inner_ranking": (type(engine.scheduler.ranking.inner).__name__
                              if hasattr(engine.scheduler.ranking, "inner") else None),
            # Parrot's capacity regulation as built from the policy (latency cap, throughput cap; None: none)
            "capacity": [engine.scheduler.capacity.latency_tokens, engine.scheduler.capacity.throughput_tokens],
            "torch_threads": torch.get_num_threads(), "stats": _engine_load(engine),
            "variant_names": sorted(engine.variant_names)}
    from .constraints.grammar import serve_in_worker

    serve_in_worker(engine.name, engine.tokenizer)  # grammar processors shipped here rebuild for its tokenizer
    try:
        send("ready", None, info)
        asyncio.run(_ChildServer(engine, conn, send).serve())
    except (OSError, ValueError):  # the parent is gone
        pass
    finally:
        engine.close()
    # Everything is answered and the engine closed: skip the interpreter's teardown of torch and
    # the model (seconds on a busy machine), which nothing needs.
    conn.close()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _ChildServer:
    """The child's asyncio side: one task per call, answers by call id."""

    #: seconds a finished fill is kept for a cancel that crossed its answer (undone like a cancelled fill)
    KEEP_FILL_S = 5.0

    def __init__(self, engine: Any, conn: Any, send: Callable[[str, Optional[int], Any], None]):
        self.engine, self.conn, self._send = engine, conn, send
        self.tasks: Dict[int, asyncio.Task] = {}
        self.fills: Dict[int, Any] = {}  # call id -> FillOp of fills answered in the last KEEP_FILL_S
        self.streams: Dict[Any, List[List[Any]]] = {}  # context id -> its streams' logits processors
        self.parent_gone = False
        self.evs: List[tuple] = []  # a stream's (kind, call id, payload) to send at the end of this loop turn

    def send(self, kind: str, call_id: Optional[int], payload: Any) -> None:
        self.flush_evs()  # what a stream emitted before goes first
        if self.parent_gone:
            return
        try:
            self._send(kind, call_id, payload)
        except (OSError, ValueError):  # the parent is gone: stop
            self.parent_gone = True
            self.inbox.put_nowait(None)

    def send_stream(self, kind: str, call_id: int, payload: Any) -> None:
        """Send a stream's event (or its end, or error) with the others of
        this loop turn: those of one engine step arrive in one turn, and go
        out as one message."""
        if not self.evs:
            asyncio.get_running_loop().call_soon(self.flush_evs)
        self.evs.append((kind, call_id, payload))

    def flush_evs(self) -> None:
        evs, self.evs = self.evs, []
        batch: List[tuple] = []
        for msg in evs:
            if msg[0] == "err":  # alone, as before: what it carries may not unpickle in the parent
                self._send_batch(batch)
                batch = []
                self.send(*msg)
            else:
                batch.append(msg)
        self._send_batch(batch)

    def _send_batch(self, batch: List[tuple]) -> None:
        """Events and ends (TokenEvents and None) as one ``evs`` message."""
        if len(batch) > 1:
            try:
                payloads = pickle.dumps([p for _, _, p in batch], protocol=pickle.HIGHEST_PROTOCOL)
            except Exception:  # noqa: BLE001  (one by one, each failing alone)
                pass
            else:
                self.send("evs", None, ([(k, c) for k, c, _ in batch], payloads))
                return
        for msg in batch:
            self.send(*msg)

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        self.inbox: asyncio.Queue = asyncio.Queue()

        def read() -> None:
            while True:
                try:
                    msg = pickle.loads(self.conn.recv_bytes())
                except (EOFError, OSError):
                    msg = None  # the parent closed the pipe or died
                except Exception:  # noqa: BLE001
                    log.exception("engine worker: a message could not be read")
                    continue
                try:
                    loop.call_soon_threadsafe(self.inbox.put_nowait, msg)
                except RuntimeError:  # loop closed
                    return
                if msg is None or msg[0] == "close":
                    return

        threading.Thread(target=read, name="interlace-worker-reader", daemon=True).start()
        pusher = loop.create_task(self.push_stats())
        while True:
            msg = await self.inbox.get()
            if msg is None:
                self.parent_gone = True
                break
            kind, call_id, blob = msg
            if kind == "close":
                break
            try:
                payload = pickle.loads(blob)
            except Exception as e:  # noqa: BLE001  (e.g. a class this process cannot import)
                if call_id is not None and kind in ("call", "gen"):
                    err = TypeError(f"the engine worker cannot read the call's arguments: {e!r}")
                    self.send("err", call_id, _pack_error(err))
                else:
                    log.warning("engine worker: a %r message could not be read: %r", kind, e)
                continue
            try:
                self.dispatch(kind, call_id, payload)
            except Exception:  # noqa: BLE001
                log.exception("engine worker: message %r failed", kind)
        pusher.cancel()
        log.debug("engine worker: closing its engine")
        # close as in process: running streams end with "abort", pending calls raise EngineClosed
        await asyncio.to_thread(self.engine.close)
        log.debug("engine worker: engine closed; %d calls to finish", len(self.tasks))
        if self.tasks:
            await asyncio.wait(list(self.tasks.values()), timeout=2.0)
        for t in self.tasks.values():
            t.cancel()
        self.flush_evs()
        log.debug("engine worker: done")

    def dispatch(self, kind: str, call_id: int, payload: Any) -> None:
        if kind == "call":
            method, args = payload
            self.start(call_id, self.call(call_id, method, args))
        elif kind == "gen":
            self.start(call_id, self.generate(call_id, *payload))
        elif kind == "post":
            method, args = payload
            if method in _POSTS:
                try:
                    getattr(self.engine, method)(*args)
                except Exception:  # noqa: BLE001  (nobody waits for it)
                    log.warning("engine worker: %s%r failed", method, args, exc_info=True)
        elif kind == "cancel":
            task = self.tasks.get(call_id)
            if task is not None and not task.done():
                task.cancel()  # the engine call's own cancellation: a fill undone, a stream aborted
            else:
                op = self.fills.pop(call_id, None)
                if op is not None:  # its answer had crossed the cancel: undo it as a cancelled fill
                    self.engine.undo_fill(op)
        else:
            log.error("engine worker: unknown message %r", kind)

    def start(self, call_id: int, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks[call_id] = task
        task.add_done_callback(lambda t: self.tasks.pop(call_id, None))

    async def call(self, call_id: int, method: str, args: tuple) -> None:
        try:
            if method == "fill":
                result = await self.fill(call_id, *args)
            elif method == "stats":
                result = await self.stats()
            elif method == "resume":
                result = await self.resume(*args)
            elif method == "last_logits":
                lg = await self.engine.last_logits(*args)
                result = None if lg is None else lg.float().cpu().numpy()
            elif method in _ASYNC_CALLS:
                result = await getattr(self.engine, method)(*args)
            else:
                raise E.EngineError(f"engine worker: unknown call {method!r}")
        except asyncio.CancelledError:
            raise  # the parent gave up on it: no answer
        except Exception as e:  # noqa: BLE001  (the caller's)
            self.send("err", call_id, _pack_error(e))
        else:
            self.send("ok", call_id, result)

    async def fill(self, call_id: int, context_id: Any, tokens: List[int], parent_id: Any,
                   hint: Optional[RequestHint], variant: Optional[str] = None) -> int:
        """:meth:`NativeEngine.fill`, keeping its operation so that a cancel
        arriving after the answer left still undoes it."""
        from .native.sequence import FillOp

        op = FillOp(None)
        n = await self.engine.fill(context_id, tokens, parent_id, hint, variant, op=op)  # undone if cancelled
        self.fills[call_id] = op  # the op holds its context: kept only for the crossing window
        asyncio.get_running_loop().call_later(self.KEEP_FILL_S, self.fills.pop, call_id, None)
        return n

    async def push_stats(self) -> None:
        """Send the engine's load whenever it changed, every STATS_INTERVAL_S at most."""
        last = None
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            try:
                stats = await self.stats()
            except Exception:  # noqa: BLE001  (closing)
                continue
            if stats != last:
                self.send("stats", None, stats)
                last = stats

    async def resume(self, context_id: Any, tokens: List[int], hooks: Sequence[tuple] = (),
                     hint: Optional[RequestHint] = None) -> None:
        """:meth:`NativeEngine.resume` (with the caller's ``hint``), after the
        ``on_resume()`` calls the caller made on its processors, on this
        stream's copies of them."""
        streams = self.streams.get(context_id)
        if streams:
            procs = streams[-1]
            for i, n in hooks:
                if i < len(procs):
                    for _ in range(n):
                        procs[i].on_resume()
        await self.engine.resume(context_id, tokens, hint)

    async def generate(self, call_id: int, context_id: Any, sampling: SamplingParams, parent_id: Any,
                       hint: Optional[RequestHint], blobs: Sequence[bytes] = ()) -> None:
        procs: List[Any] = []
        try:
            for i, blob in enumerate(blobs):  # the processors, rebuilt here
                try:
                    procs.append(pickle.loads(blob))
                except Exception as e:  # noqa: BLE001
                    raise E.InvalidSampling(f"engine {self.engine.name!r}: logits processor {i} cannot be rebuilt "
                                            f"in the worker process: {e!r}") from e
            if procs:
                sampling.logits_processors = procs
                self.streams.setdefault(context_id, []).append(procs)
            async for ev in self.engine.generate(context_id, sampling, parent_id, hint):
                self.send_stream("ev", call_id, ev)
        except asyncio.CancelledError:
            raise  # the generator's own cleanup aborted it; the parent is not listening
        except Exception as e:  # noqa: BLE001
            self.send_stream("err", call_id, _pack_error(e))
        else:
            self.send_stream("end", call_id, None)
        finally:
            if procs:
                streams = [s for s in self.streams.get(context_id, ()) if s is not procs]
                if streams:
                    self.streams[context_id] = streams
                else:
                    self.streams.pop(context_id, None)

    async def stats(self) -> Dict[str, int]:
        return _engine_load(self.engine)


def _engine_load(eng: Any) -> Dict[str, int]:
    """:meth:`NativeEngine.load_stats`: a snapshot read without waiting for the engine thread."""
    return dict(eng.load_stats())
