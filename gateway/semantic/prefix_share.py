"""Sharing prompt prefixes by forking engine contexts (Parrot section 5.3).

A semantic call's prompt is a sequence of *pieces*: constant template text
and input variables' values (and, for chat calls, the chat template's
head).  Parrot does not compare prompts token by token; it hashes each
prompt at its variable boundaries (``PrefixHash``) and looks the hashes up:
two calls whose prompts agree up to a boundary can share the KV of that
prefix.  Here a shared prefix becomes a *prefix context*, filled once, that
every call wanting it forks (copy-on-write blocks) before filling the rest
of its own prompt.

Which boundary a call forks at: the longest one (at least ``min_tokens``
long) that already has a prefix context, or that another call dispatched
with it wants too (the store counts *demand* per hash: a map stage's calls
arrive together), or that is *static* -- constant template text only, the
long system prompt of a GPTs-style application, shared by calls that come
later.  A prefix context may itself fork a shorter one (a system prompt,
then a document several questions are asked about).

A prefix context lives while a fork of it does (the engine refuses to free
a context with live forks) and is freed with its last fork: its full blocks
stay in the engine's prefix cache, so a call that comes later still skips
them -- the engine continues a fork with cached blocks too
(``BlockManager.extend_prefix``), which catches whatever else repeats (a
boundary inside a variable, text after the fork point).  Forks add what the
block cache cannot: calls dispatched together share one computation of the
prefix (the cache only holds blocks once they are computed), partial blocks
included.

The same hashes place a new context when the model runs on several replicas
(Parrot's FindEngine, :mod:`engine_ext.replicas`): the first fill of a
prefix context or of a call's own context carries them in
``RequestHint.prefix_keys`` (:func:`hint_keys`: those at least
``min_tokens`` long, the shortest first -- a boundary shorter than that
is a chat template's head or a few words every prompt may start with,
which would pull unrelated calls onto one replica), so a call goes to the
replica that holds its prefix.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import itertools
import logging
from array import array
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

from ...engine_ext.protocol import MAX_PREFIX_KEYS, RequestHint

if TYPE_CHECKING:  # the seams' types (imports for annotations only)
    from ...engine_ext.protocol import Engine

log = logging.getLogger(__name__)


@dataclass
class Piece:
    """A run of prompt tokens ending at a variable boundary."""

    tokens: List[int]
    static: bool  # constant text of the template (or the chat head), not a variable's value


def boundary_keys(model: str, pieces: Sequence[Piece]) -> List[Tuple[bytes, int, bool]]:
    """``(hash, tokens, static)`` after each piece: the hash chains the
    pieces' token ids (a hit means the whole prefix is equal); ``static``
    says every piece up to there is constant."""
    h = hashlib.blake2b(model.encode(), digest_size=16, person=b"interlace-pfx").digest()
    out, n, static = [], 0, True
    for p in pieces:
        h = hashlib.blake2b(h + array("i", p.tokens).tobytes(), digest_size=16).digest()
        n += len(p.tokens)
        static = static and p.static
        out.append((h, n, static))
    return out


def hint_keys(keys: Sequence[Tuple[bytes, int, bool]], min_tokens: int = 0) -> Tuple[str, ...]:
    """``RequestHint.prefix_keys`` of a prompt whose :func:`boundary_keys`
    are ``keys``: the hex digests of the prefixes at least ``min_tokens``
    long, shortest first; of a prompt with more boundaries than a hint
    carries (:data:`MAX_PREFIX_KEYS`), the shortest, the ones other prompts
    are likelier to share."""
    return tuple(k.hex() for k, n, _ in keys if n >= min_tokens)[:MAX_PREFIX_KEYS]


def with_prefix_keys(hint: Optional[RequestHint], prefix_keys: Tuple[str, ...]) -> Optional[RequestHint]:
    """``hint`` carrying ``prefix_keys`` (for the first fill of a new context)."""
    if not prefix_keys:
        return hint
    return dataclasses.replace(hint, prefix_keys=prefix_keys) if hint is not None else RequestHint(
        prefix_keys=prefix_keys)


@dataclass(eq=False)
class PrefixEntry:
    key: bytes
    context_id: Tuple
    tokens: int
    parent: Optional["PrefixEntry"]
    ready: "asyncio.Future[None]"
    children: int = 0  # live forks: calls' contexts and longer prefixes


@dataclass
class Shared:
    """What :meth:`PrefixStore.acquire` gives a call: fork ``entry`` and
    fill the pieces from ``next_piece`` on."""

    entry: PrefixEntry
    next_piece: int
    filled: int  # tokens this call filled into new prefix contexts


class PrefixStore:
    """The prefix contexts of one model's engine."""

    def __init__(self, engine: Engine, model: str, *, min_tokens: int = 16):
        self.engine, self.model = engine, model
        self.min_tokens = min_tokens
        self.entries: Dict[bytes, PrefixEntry] = {}
        self.demand: Counter = Counter()
        self._ids = itertools.count()

    # ------------------------------------------------------------------ demand
    def want(self, keys: Sequence[Tuple[bytes, int, bool]]) -> None:
        """A call that will acquire soon (dispatched in the same batch as others)."""
        for k, _, _ in keys:
            self.demand[k] += 1

    def unwant(self, keys: Sequence[Tuple[bytes, int, bool]]) -> None:
        for k, _, _ in keys:
            self.demand[k] -= 1
            if self.demand[k] <= 0:
                del self.demand[k]

    def _worth(self, key: bytes, n: int, static: bool) -> bool:
        return n >= self.min_tokens and (key in self.entries or self.demand[key] >= 2 or static)

    # ----------------------------------------------------------------- acquire
    async def acquire(self, pieces: Sequence[Piece], keys: Sequence[Tuple[bytes, int, bool]],
                      hint: Any = None) -> Optional[Shared]:
        """The prefix context the call should fork (creating it, and shorter
        ones it builds on, if needed), or None: fill everything.  Call it
        once per :meth:`want`; it drops the call's demand."""
        try:
            k = max((i for i, (key, n, st) in enumerate(keys) if self._worth(key, n, st)), default=None)
            if k is None:
                return None
            filled = [0]
            entry = await self._ensure(k, pieces, keys, hint, filled)
        finally:
            self.unwant(keys)
        if entry is None:
            return None
        entry.children += 1
        return Shared(entry, k + 1, filled[0])

    async def _ensure(self, k: int, pieces: Sequence[Piece], keys: Sequence[Tuple[bytes, int, bool]],
                      hint: Any, filled: List[int]) -> Optional[PrefixEntry]:
        key, n, _ = keys[k]
        entry = self.entries.get(key)
        if entry is None:
            # build on the longest shorter prefix that exists or that more calls want than this one
            j = max((i for i in range(k) if keys[i][0] in self.entries
                     or (keys[i][1] >= self.min_tokens and self.demand[keys[i][0]] > max(1, self.demand[key]))),
                    default=None)
            parent = await self._ensure(j, pieces, keys, hint, filled) if j is not None else None
            if key in self.entries:  # made by another call meanwhile
                return await self._ensure(k, pieces, keys, hint, filled)
            entry = PrefixEntry(key, ("svp", self.model, next(self._ids)), n, parent,
                                asyncio.get_running_loop().create_future())
            self.entries[key] = entry
            tokens = [t for p in pieces[(j + 1 if j is not None else 0):k + 1] for t in p.tokens]
            if parent is not None:
                parent.children += 1
            try:
                # the hashes up to this boundary: a replica set places the prefix where it is shared
                await self.engine.fill(entry.context_id, tokens,
                                       parent_context_id=parent.context_id if parent else None,
                                       hint=with_prefix_keys(hint, hint_keys(keys[:k + 1], self.min_tokens)))
            except BaseException as e:
                del self.entries[key]
                if parent is not None:
                    self._release(parent)
                entry.ready.set_exception(e if isinstance(e, Exception) else RuntimeError("cancelled"))
                entry.ready.exception()  # retrieved: nobody may be waiting
                raise
            filled[0] += len(tokens)
            entry.ready.set_result(None)
            return entry
        try:
            await asyncio.shield(entry.ready)
        except asyncio.CancelledError:
            raise
        except Exception:  # its maker failed or was cancelled: fill without sharing
            return None
        return entry if self.entries.get(key) is entry else None

    # ----------------------------------------------------------------- release
    def release(self, shared: Shared) -> None:
        """The call's fork of ``shared.entry`` is freed."""
        self._release(shared.entry)

    def _release(self, entry: PrefixEntry) -> None:
        entry.children -= 1
        if entry.children == 0:
            self._free(entry)

    def _free(self, entry: PrefixEntry) -> None:
        if self.entries.get(entry.key) is entry:
            del self.entries[entry.key]
        self.engine.free_context_nowait(entry.context_id)
        if entry.parent is not None:
            self._release(entry.parent)

    def clear(self) -> None:
        """Shutdown: free every prefix context (forks first)."""
        for entry in sorted(self.entries.values(), key=lambda e: -e.tokens):
            self.engine.free_context_nowait(entry.context_id)
        self.entries.clear()
        self.demand.clear()
