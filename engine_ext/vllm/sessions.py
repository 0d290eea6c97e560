"""The frontend half of preserve on vLLM: one vLLM *resumable* request (a
session) per Interlace context, kept across pauses, fills and follow-ups,
so the context's KV stays in vLLM between them (the engine-core half, and
why resumable requests: :mod:`engine_ext.vllm.pins`).

A session is one ``AsyncLLM.generate`` over an input stream: each segment
of the context (a fill, a generate, a resume after a tool call, a client's
follow-up) puts one ``StreamingInput`` carrying the context's *whole* token
list and that segment's sampling (its max_tokens, grammar, pause strings,
ranking hint); the scheduler keeps what it already computed and appends the
rest.  One reader task per session moves vLLM's outputs into a queue, so a
segment that is cancelled (a pause, a client that left) never cancels the
session itself.

A chunk ends in the engine -- on the pause token (the scheduler runs the
same pause rule), at max_tokens or at a stop token -- and the session then
waits with its KV.  When the frontend ends a segment first (a stop string,
a consumer that left, an explicit ``pause``), it asks the scheduler to stop
the chunk at its next output and *drains* the chunk's last outputs in the
background; the next segment waits for the drain, and the scheduler cuts
the tokens decoded past the context (module ``pins``: truncation).  A
session ends only here: when its context is freed, on shutdown, or when
vLLM ends it (engine death); the policy's releases free its KV but keep it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, AsyncIterator, List, Optional

from ..request_engine import Chunk

log = logging.getLogger(__name__)

_ids = itertools.count()

#: seconds a frontend stop may take to come back before the session is ended instead (a stuck chunk)
DRAIN_TIMEOUT_S = 120.0


class Session:
    """One vLLM resumable request and its reader."""

    def __init__(self, name: str):
        self.sid = f"{name}-session-{next(_ids)}"
        self.inputs: asyncio.Queue = asyncio.Queue()
        self.items: asyncio.Queue = asyncio.Queue()  # RequestOutputs, then None (ended) or an exception
        self.state = "new"                           # running | waiting | stopping | ended
        self.idle = asyncio.Event()                  # set while no chunk runs (waiting or ended)
        self.reader: Optional[asyncio.Task] = None
        self.drain: Optional[asyncio.Task] = None

    def _set(self, state: str) -> None:
        self.state = state
        if state in ("waiting", "ended"):
            self.idle.set()
        else:
            self.idle.clear()

    def send(self, llm: Any, prompt: List[int], params: Any) -> None:
        """Start the next chunk over ``prompt`` (the context's whole token list)."""
        from vllm.engine.protocol import StreamingInput
        from vllm.inputs import TokensPrompt

        self.inputs.put_nowait(StreamingInput(TokensPrompt(prompt_token_ids=list(prompt)), params))
        if self.reader is None:
            self.reader = asyncio.get_running_loop().create_task(self._read(llm, params))
        self._set("running")

    async def _read(self, llm: Any, params: Any) -> None:
        async def inputs() -> AsyncIterator[Any]:
            while True:
                item = await self.inputs.get()
                if item is None:
                    return
                yield item
        try:
            async for out in llm.generate(inputs(), params, request_id=self.sid):
                self.items.put_nowait(out)
        except asyncio.CancelledError:
            self.items.put_nowait(None)
            raise
        except BaseException as e:  # noqa: BLE001  (delivered to the segment reading it)
            self.items.put_nowait(e)
            return
        self.items.put_nowait(None)

    async def chunks(self, logprobs: bool) -> AsyncIterator[Chunk]:
        """The current chunk's outputs, to its end."""
        while True:
            item = await self.items.get()
            if item is None or isinstance(item, BaseException):
                self._set("ended")
                if item is not None:
                    raise item
                yield Chunk((), (), True, "abort")
                return
            o = item.outputs[0]
            lps: List[Optional[float]] = []
            if logprobs:
                for tok, entry in zip(o.token_ids, o.logprobs or []):
                    lp = entry.get(tok) if entry else None
                    lps.append(float(lp.logprob) if lp is not None else None)
            end = bool(item.finished) or o.finish_reason is not None
            if end:
                self._set("ended" if item.finished else "waiting")
            yield Chunk(list(o.token_ids), lps, end, o.finish_reason, getattr(item, "num_cached_tokens", None))
            if end:
                return

    def stop(self, llm: Any) -> None:
        """The frontend ended the segment before the engine did: stop the
        chunk at its next output and drain what is still in flight."""
        if self.state == "running":
            self._set("stopping")
            self.drain = asyncio.get_running_loop().create_task(self._drain(llm))

    async def _drain(self, llm: Any) -> None:
        try:
            await asyncio.wait_for(self._stop_and_drain(llm), DRAIN_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001  (a session that cannot stop is ended: its context refills)
            log.warning("vLLM session %s did not stop (%s: %s); ending it", self.sid, type(e).__name__, e)
            self.end()

    async def _stop_and_drain(self, llm: Any) -> None:
        await llm.engine_core.call_utility_async("scheduler", "stop", {"id": self.sid})
        while True:
            item = await self.items.get()
            if item is None or isinstance(item, BaseException) or item.finished:
                self._set("ended")
                return
            if item.outputs[0].finish_reason is not None:
                self._set("waiting")
                return

    def end(self) -> None:
        """End the session in vLLM (its blocks go back to the pool, with their prefix-cache hashes)."""
        self._set("ended")
        if self.drain is not None and not self.drain.done() and self.drain is not asyncio.current_task():
            self.drain.cancel()
        if self.reader is not None and not self.reader.done():
            self.reader.cancel()  # AsyncLLM.generate aborts the request when cancelled


class Segment:
    """The async context manager one segment decodes in (``RequestEngine._stream``)."""

    def __init__(self, engine: Any, ctx: Any, prompt: List[int], make_params: Any, logprobs: bool):
        self.engine, self.ctx, self.prompt = engine, ctx, prompt
        self.make_params, self.logprobs = make_params, logprobs
        self.session: Optional[Session] = None

    async def __aenter__(self) -> AsyncIterator[Chunk]:
        ctx = self.ctx
        s = ctx.backend
        while s is not None and s.state in ("running", "stopping"):  # a fill's chunk, a drain: one at a time
            await s.idle.wait()
        if s is None or s.state == "ended":
            s = ctx.backend = Session(self.engine.name)
        self.session = s
        s.send(self.engine.llm, self.prompt, self.make_params(s.sid))
        return s.chunks(self.logprobs)

    async def __aexit__(self, *exc: Any) -> bool:
        if self.session is not None:
            self.session.stop(self.engine.llm)
        return False
