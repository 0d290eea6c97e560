"""Typed errors raised by every engine (native, vLLM-backed, simulated).

Each error is raised *before* the engine changes any state, so a caller can
catch it and go on using the engine as if the call had never been made.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of all engine errors."""


class ContextNotFound(EngineError, KeyError):
    """The context id is unknown or was freed."""

    def __init__(self, context_id: object):
        super().__init__(f"context {context_id!r} does not exist (never filled, or already freed)")
        self.context_id = context_id

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return self.args[0]


class ContextExists(EngineError):
    """A fork was asked into a context id that is already in use."""


class ContextHasChildren(EngineError):
    """A parent context cannot be freed while forked children still share its KV."""


class ContextBusy(EngineError):
    """The context is generating (or paused) and cannot take this call now."""


class InvalidTokens(EngineError, ValueError):
    """Token ids outside the vocabulary, or an empty token list where one is required."""


class ContextTooLong(EngineError, ValueError):
    """The context would exceed the model's context length or the whole KV cache."""


class InvalidSampling(EngineError, ValueError):
    """Sampling parameters out of range."""


class EngineClosed(EngineError):
    """The engine was shut down (raised by every call made after ``close()``,
    and by calls still waiting when it happened)."""


class FillCancelled(EngineError):
    """A fill was undone because an earlier fill of the same context, which
    it extended, was cancelled by its caller.  Nothing of it was applied."""


class InvalidContextState(EngineError):
    """The call does not fit the context's state (e.g. resume of a context
    that is not paused, pause of one that is not generating)."""


class KVCacheExhausted(EngineError):
    """The KV cache is held by idle or paused contexts and nothing running can
    be preempted to make room: free some contexts."""


class EngineUnavailable(EngineError):
    """The engine replica serving this context is gone, or no replica is
    available for a new context (:class:`~interlace.engine_ext.replicas.ReplicaSet`);
    retry: a new request goes to a live replica."""


class UnknownVariant(EngineError, KeyError):
    """A fill names a model variant the engine does not serve
    (``native/block_sharing.py``), or another than the context's own."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""
