"""The engine protocol over a remote vLLM OpenAI-compatible server (issue #11).

One gateway may front vLLM servers reached over HTTP, as replicas (a
fallback where vLLM cannot run in the gateway's process): configure a model
with ``engine: {kind: openai, url: http://host:8000/v1, model: ...,
api_key: ..., timeout_s: ...}``.  Contexts, forks, text rules and
pause/resume are :class:`~engine_ext.request_engine.RequestEngine`'s, as for
the in-process :class:`~engine_ext.vllm.VLLMEngine`; this module opens the
requests over HTTP and says when the server is gone.

How each piece maps onto the server
-----------------------------------
* Every fill, decode and resume is one streaming ``POST {url}/completions``
  whose ``prompt`` is the context's whole token id list; the server's
  **automatic prefix caching** (``--enable-prefix-caching``, the default in
  vLLM's v1 engine) finds what an earlier request of the context or its
  parent computed.  ``return_token_ids: true`` (vLLM >= 0.10) makes each
  server-sent event carry the token ids it adds (``choices[0].token_ids``);
  Interlace detokenizes them itself with the model's tokenizer and applies
  the native engine's rules, so stop strings, ``pause_on`` and
  ``skip_special_tokens`` behave as on the other engines (stop strings are
  not sent to the server).
* Closing a stream (pause, abort, free, a consumer that goes away) closes
  the HTTP response; vLLM aborts a request whose client disconnected.
* Grammars (the gateway's constrained decoding) go as vLLM's
  ``structured_outputs`` field (``{"json": schema}`` or ``{"grammar": lark}``).
  The gateway's JSON schemas carry llguidance layout options
  (``x-guidance``: no free whitespace) and its tool-call grammars are
  llguidance Lark; start the server with
  ``--structured-outputs-config.backend guidance`` for the output to match
  the other engines (a server on xgrammar ignores ``x-guidance``; it is asked
  for ``disable_any_whitespace`` instead).
* ``load_stats()``: the frontend's queued tokens (the base class), plus the
  server's ``vllm:kv_cache_usage_perc``, ``vllm:num_requests_running`` and
  ``vllm:num_requests_waiting`` scraped from ``/metrics`` every second by a
  background task (for this model; other clients' requests included).  The
  server's block size and block count come from ``vllm:cache_config_info``
  at start-up (block size 16 and no count where ``/metrics`` is missing).
* Prefix-cache hits (``TokenEvent.cached_tokens``): every request asks for
  the usage event (``stream_options.include_usage``) and reads its
  ``prompt_tokens_details.cached_tokens``, which a vLLM server sends when
  started with ``--enable-prompt-tokens-details`` (else none are reported).
  The usage comes after a request's last token: a fill's prefill request
  reports them, a generation's only if its stream is read to that event.

Failures
--------
A refused or reset connection, a stream cut short, or a 5xx answer marks the
engine *dead* for good (``alive`` False, :meth:`_backend_failed` True):
every running or paused stream ends at once with
:class:`~engine_ext.errors.EngineUnavailable`, and every later call raises
it (a :class:`~engine_ext.replicas.ReplicaSet` then sends new contexts to
the other replicas).  The metrics task doubles as a health check: a refused
connection marks an idle engine dead within about a second.  No answer
within ``timeout_s`` raises ``EngineUnavailable`` for that request only
(a slow server is not a dead one; a ReplicaSet still takes the replica
out).  A 4xx answer raises :class:`~engine_ext.errors.ContextTooLong` or
:class:`~engine_ext.errors.InvalidSampling` with the server's message
(401/403/404/429 -- a wrong key, an unloaded model, an overloaded proxy --
a plain ``EngineError``).  A fill the server refuses is undone, as a
cancelled one is.

What it cannot do
-----------------
* No ranking inside the server: vLLM schedules the requests in its own
  order (FCFS or its ``priority``); Interlace's RequestHint is not sent.
  The hints of ``fill``, ``generate``, ``resume`` and ``set_request_hint``
  are accepted (and validated: a bad one is refused as on every engine)
  and otherwise ignored.
* Pause is always discard with prefix reuse (the server keeps nothing for
  a paused context but the cached blocks nobody evicted); the interception
  policy is used for its tool-duration predictor only.
* ``computed_tokens`` is an upper bound (the server does not say which
  cached blocks it still holds); arbitrary Python logits processors, the
  KeyGuard's duplicate-key check and ``last_logits`` are not available.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from pathlib import Path
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple

from . import errors as E
from .protocol import SamplingParams
from .request_engine import Chunk, RequestEngine

log = logging.getLogger(__name__)

#: Seconds a request may wait for the server's next bytes, unless ``timeout_s`` says otherwise.
DEFAULT_TIMEOUT_S = 120.0
#: Seconds to connect (and for start-up's small requests), at most.
CONNECT_TIMEOUT_S = 10.0
#: How often the server's /metrics are read (seconds); 0 turns it off.
METRICS_INTERVAL_S = 1.0
#: Text both tokenizers must encode alike at start-up.
PROBE_TEXT = "Hello, world! The quick brown fox: 1234 + 5678 = ?\n\tÜnïcödé 你好 🙂 "

_TOO_LONG = re.compile(r"context length|max_model_len|maximum context|too long|exceeds? the model", re.I)
_METRIC = re.compile(r"^(vllm:[A-Za-z_]+)(?:\{([^}]*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


class _QuietMetrics(logging.Filter):
    """Keeps httpx's per-request INFO line for the once-a-second /metrics read out of the logs."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno <= logging.INFO and "/metrics" in record.getMessage())


def _quiet_metrics_requests() -> None:
    hx = logging.getLogger("httpx")
    if not any(isinstance(f, _QuietMetrics) for f in hx.filters):
        hx.addFilter(_QuietMetrics())


def _split_url(url: str) -> Tuple[str, str]:
    """(the OpenAI API base ending in /v1, the server root for /metrics and /tokenize)."""
    url = url.rstrip("/")
    if url.endswith("/v1"):
        return url, url[:-3]
    return url + "/v1", url


def _message(body: Any, text: str) -> str:
    """The server's error message out of an error body (vLLM's ``{"error": {"message"}}``)."""
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            msg = err.get("message") or err.get("detail")
            if msg:
                return str(msg)
        elif isinstance(err, str):
            return err
        if body.get("detail"):
            return json.dumps(body["detail"])[:500]
    return (text or "").strip()[:500] or "(no message)"


def parse_metrics(text: str, model: Optional[str]) -> Dict[str, float]:
    """``kv_cache_usage`` (mean over the server's engines), ``running`` and
    ``waiting`` (sums) for ``model`` from vLLM's Prometheus text."""
    usage: List[float] = []
    running = waiting = 0.0
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        m = _METRIC.match(line)
        if m is None:
            continue
        name, labels, value = m.groups()
        if name not in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting"):
            continue
        lab = dict(_LABEL.findall(labels or ""))
        if model is not None and lab.get("model_name", model) != model:
            continue
        try:
            v = float(value)
        except ValueError:
            continue
        if v != v:  # NaN
            continue
        if name == "vllm:kv_cache_usage_perc":
            usage.append(v)
        elif name == "vllm:num_requests_running":
            running += v
        else:
            waiting += v
    return {"kv_cache_usage": sum(usage) / len(usage) if usage else 0.0, "running": int(running),
            "waiting": int(waiting)}


def parse_cache_config(text: str) -> Dict[str, int]:
    """``block_size`` and ``num_blocks`` from ``vllm:cache_config_info`` (what it has of them)."""
    out: Dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info"):
            m = _METRIC.match(line)
            lab = dict(_LABEL.findall((m.group(2) if m else "") or ""))
            for key, label in (("block_size", "block_size"), ("num_blocks", "num_gpu_blocks")):
                if str(lab.get(label, "")).isdigit() and int(lab[label]) > 0:
                    out[key] = int(lab[label])
            break
    return out


def _cached_tokens(usage: Any) -> Optional[int]:
    """``usage.prompt_tokens_details.cached_tokens`` of a server's event, if it has them."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    n = details.get("cached_tokens") if isinstance(details, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 0 else None


class OpenAIEngine(RequestEngine):
    """:class:`~engine_ext.protocol.Engine` over a vLLM OpenAI-compatible
    server at ``url`` (its ``/v1`` base).  Build it with
    :func:`load_openai_engine`, which checks the server and reads its limits."""

    def __init__(self, url: str, tokenizer: Any, *, model: str, max_model_len: int, vocab_size: int,
                 api_key: Optional[str] = None, timeout_s: float = DEFAULT_TIMEOUT_S, block_size: int = 16,
                 num_blocks: int = 0, name: str = "openai", interception: Any = None,
                 metrics_interval_s: float = METRICS_INTERVAL_S):
        import httpx

        super().__init__(tokenizer, name=name, interception=interception)
        self.url, self.root = _split_url(url)
        self.model = model
        self.max_model_len = int(max_model_len)
        self.vocab_size = int(vocab_size)
        self.block_size = int(block_size)
        self.num_blocks = int(num_blocks)
        self.timeout_s = float(timeout_s)
        self.metrics_interval_s = float(metrics_interval_s)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._failure: Optional[str] = None
        self._metrics_task: Optional[asyncio.Task] = None

        async def start() -> Any:
            # created on the engine loop: every request runs there
            client = httpx.AsyncClient(
                headers=self._headers,
                timeout=httpx.Timeout(self.timeout_s, connect=min(CONNECT_TIMEOUT_S, self.timeout_s), pool=None),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
            if self.metrics_interval_s > 0:
                _quiet_metrics_requests()
                self._metrics_task = asyncio.get_running_loop().create_task(self._scrape_metrics())
            return client
        try:
            self._client = self._run(start(), timeout=30)
        except BaseException:
            self._stop_loop()
            raise

    # ------------------------------------------------------------- the backend
    def _body(self, prompt: List[int], sampling: SamplingParams, max_tokens: int, grammar: Any) -> Dict[str, Any]:
        body: Dict[str, Any] = {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": sampling.temperature, "top_p": sampling.top_p,
            "stop_token_ids": [int(t) for t in sampling.stop_token_ids], "ignore_eos": sampling.ignore_eos,
            "skip_special_tokens": sampling.skip_special_tokens, "stream": True,
            "return_token_ids": True,  # each event carries the ids it adds (choices[0].token_ids)
            # a last event with the usage: its prompt_tokens_details.cached_tokens are the prefix-cache
            # hits (a vLLM server started with --enable-prompt-tokens-details sends them)
            "stream_options": {"include_usage": True},
        }
        if sampling.top_k:
            body["top_k"] = sampling.top_k
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if sampling.logprobs:
            body["logprobs"] = 1
        if grammar is not None:
            body["structured_outputs"] = grammar
        return body

    async def _open(self, rid: str, prompt: List[int], sampling: SamplingParams, max_tokens: int,
                    extra: Dict[str, Any], grammar: Any) -> AsyncIterator[Chunk]:
        """One streaming completions request; ``extra`` (the job's arrival,
        the RequestHint -- a ``resume``'s and ``set_request_hint``'s too,
        accepted and validated like every engine's) has nowhere to go on an
        OpenAI server: the remote scheduler ranks by its own rules."""
        import httpx

        body = self._body(prompt, sampling, max_tokens, grammar)
        finished = False
        try:
            async with self._client.stream("POST", f"{self.url}/completions", json=body) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    raise self._http_error(resp.status_code, resp.text)
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if "error" in obj:
                        err = obj["error"] if isinstance(obj["error"], dict) else {}
                        raise self._http_error(int(err.get("code") or 500), data)
                    for choice in obj.get("choices") or ():
                        chunk = self._chunk(choice, sampling)
                        finished = finished or chunk.finished
                        yield chunk
                    cached = _cached_tokens(obj.get("usage"))
                    if cached is not None:
                        yield Chunk((), cached_tokens=cached)
            if not finished:
                raise self._dead_now(f"{self.url} ended a stream before its last token")
        except E.EngineError:
            raise
        except httpx.TimeoutException as e:
            if self._closed:
                raise E.EngineClosed(f"the {self.name} engine was closed") from e
            raise E.EngineUnavailable(f"the server at {self.url} did not answer within {self.timeout_s:g} s "
                                      f"({type(e).__name__})") from e
        except httpx.TransportError as e:  # refused, reset, cut short
            if self._closed:
                raise E.EngineClosed(f"the {self.name} engine was closed") from e
            raise self._dead_now(f"{self.url}: {type(e).__name__}: {str(e) or 'connection lost'}") from e
        except (ValueError, KeyError, TypeError) as e:  # not what a vLLM server sends
            raise E.EngineError(f"unexpected answer from {self.url}: {type(e).__name__}: {e}") from e

    def _chunk(self, choice: Dict[str, Any], sampling: SamplingParams) -> Chunk:
        toks = choice.get("token_ids")
        reason = choice.get("finish_reason")
        if toks is None:
            if reason is None and not choice.get("text"):
                toks = []
            else:
                raise E.EngineError(f"the server at {self.url} sent no token ids (return_token_ids); "
                                    "it must be a vLLM OpenAI server, version 0.10 or later")
        toks = [int(t) for t in toks]
        bad = [t for t in toks if not 0 <= t < self.vocab_size]
        if bad:
            raise E.EngineError(f"the server at {self.url} sampled token ids outside the tokenizer's vocabulary "
                                f"[0, {self.vocab_size}): {bad[:5]!r}; the model and the tokenizer do not match")
        lps: List[Optional[float]] = []
        if sampling.logprobs and isinstance(choice.get("logprobs"), dict):
            lps = [None if v is None else float(v) for v in choice["logprobs"].get("token_logprobs") or ()]
        if reason == "abort":  # the server dropped the request (shutting down, or its own preemption limit)
            raise E.EngineUnavailable(f"the server at {self.url} aborted the request")
        return Chunk(toks, lps, reason is not None, reason)

    def _http_error(self, status: int, text: str) -> E.EngineError:
        try:
            body = json.loads(text)
        except ValueError:
            body = None
        msg = _message(body, text)
        where = f"the server at {self.url}"
        if status >= 500:
            return self._dead_now(f"{where} answered {status}: {msg}")
        if status in (401, 403):
            return E.EngineError(f"{where} refused the request ({status}: check engine.api_key): {msg}")
        if status == 404:
            return E.EngineError(f"{where} answered 404 (is model {self.model!r} still served?): {msg}")
        if status == 429:  # not EngineUnavailable: a ReplicaSet would take the replica out for good
            return E.EngineError(f"{where} is overloaded (429), retry later: {msg}")
        if _TOO_LONG.search(msg):
            return E.ContextTooLong(f"{where} refused the request: {msg}")
        return E.InvalidSampling(f"{where} refused the request ({status}): {msg}")

    def _dead_now(self, reason: str) -> E.EngineError:
        """Mark the engine dead (on the engine loop) and wake every live stream."""
        if self._closed:
            return E.EngineClosed(f"the {self.name} engine was closed")
        if self._failure is None:
            self._failure = self._dead = reason
            log.error("the %s engine is gone: %s", self.name, reason)
            for ctx in list(self.contexts.values()):
                if ctx.gen is not None and not ctx.gen.done:
                    self._fail(ctx, E.EngineUnavailable(f"the {self.name} engine is gone: {reason}"))
        return E.EngineUnavailable(f"the {self.name} engine is gone: {self._failure}")

    async def _scrape_metrics(self) -> None:
        """Every ``metrics_interval_s``: the server's KV usage and queues into
        ``load_stats()``; a refused connection marks the engine dead."""
        import httpx

        timeout = max(self.metrics_interval_s * 5, 5.0)
        while not self._closed and self._failure is None:
            try:
                try:
                    r = await self._client.get(f"{self.root}/metrics", timeout=timeout)
                except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
                    # a pooled connection the server closed (it may be gone): one more try on a new one
                    r = await self._client.get(f"{self.root}/metrics", timeout=timeout)
                if r.status_code == 200:
                    self._stats = parse_metrics(r.text, self.model)
            except asyncio.CancelledError:
                raise
            except httpx.ConnectError as e:
                if not self._closed:
                    self._dead_now(f"{self.root} refused the connection ({type(e).__name__}: {e})")
                return
            except Exception as e:  # noqa: BLE001  (a slow or odd answer: try again later)
                log.debug("reading %s/metrics: %s", self.root, e)
            await asyncio.sleep(self.metrics_interval_s)

    def _grammar(self, parts: Any) -> Optional[Dict[str, Any]]:
        """vLLM's ``structured_outputs`` request field for a grammar given as
        ``{"json": schema}`` or ``{"grammar": lark}`` (llguidance's dialect)."""
        if isinstance(parts, SamplingParams):  # a base class that hands over the sampling itself
            parts = self._grammar_parts(parts)  # type: ignore[attr-defined]
            if parts is None:
                return None
        if "json" in parts:
            return {"json": parts["json"], "disable_any_whitespace": True}
        return {"grammar": parts["grammar"]}

    async def _shutdown(self) -> None:
        task, self._metrics_task = self._metrics_task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001  (cancelled, or it had failed)
                pass
        await self._client.aclose()

    def _backend_failed(self) -> bool:
        return self._failure is not None

    def _backend_error(self, e: BaseException) -> Optional[E.EngineError]:
        import httpx

        if isinstance(e, httpx.TimeoutException):
            return E.EngineUnavailable(f"the server at {self.url} did not answer in time: {e}")
        if isinstance(e, httpx.TransportError):
            return self._dead_now(f"{self.url}: {type(e).__name__}: {e}")
        return None


# ==================================================================== start-up
def _resolve_dir(tokenizer_path: str) -> Path:
    if str(tokenizer_path) == "embedded":
        from .embedded import embedded_model_dir

        return Path(embedded_model_dir())
    return Path(tokenizer_path)


def _server_models(client: Any, api: str) -> List[Dict[str, Any]]:
    import httpx

    try:
        r = client.get(f"{api}/models")
    except httpx.HTTPError as e:
        raise E.EngineUnavailable(f"no vLLM OpenAI server answers at {api}: {type(e).__name__}: {e}") from e
    if r.status_code in (401, 403):
        raise ValueError(f"the server at {api} refused the API key ({r.status_code}); set engine.api_key")
    if r.status_code != 200:
        raise E.EngineUnavailable(f"GET {api}/models answered {r.status_code}: {_message(_json(r), r.text)}")
    data = (_json(r) or {}).get("data")
    if not isinstance(data, list):
        raise ValueError(f"GET {api}/models did not answer an OpenAI model list; is {api} an OpenAI server?")
    return [m for m in data if isinstance(m, dict) and m.get("id")]


def _json(r: Any) -> Any:
    try:
        return r.json()
    except ValueError:
        return None


def _check_tokenizer(client: Any, api: str, root: str, model: str, tokenizer: Any, vocab_size: int,
                     tokenizer_dir: Path) -> None:
    """The server must tokenize like ``tokenizer`` and accept exactly the ids [0, vocab_size)."""
    import httpx

    try:
        probe = PROBE_TEXT + " ".join(t for t in (tokenizer.eos_token, tokenizer.bos_token) if t)
        r = client.post(f"{root}/tokenize", json={"model": model, "prompt": probe, "add_special_tokens": False})
        if r.status_code == 200:
            theirs = (_json(r) or {}).get("tokens")
            ours = tokenizer.encode(probe)
            if theirs != ours:
                raise ValueError(f"the tokenizer at {tokenizer_dir} does not match model {model!r} of the server at "
                                 f"{api}: {probe!r} is {ours[:12]}... here and {str(theirs)[:80]}... there")
        else:
            log.warning("%s/tokenize answered %s: the tokenizer match is checked by vocabulary size only",
                        root, r.status_code)

        def accepts(tok: int) -> bool:
            r = client.post(f"{api}/completions", json={"model": model, "prompt": [tok], "max_tokens": 1,
                                                        "temperature": 0.0})
            if r.status_code == 200:
                return True
            msg = _message(_json(r), r.text)
            if r.status_code == 400 and "vocab" in msg.lower():
                return False
            raise E.EngineUnavailable(f"the server at {api} answered a probe with {r.status_code}: {msg}")

        if not accepts(vocab_size - 1):
            raise ValueError(f"the server at {api} has fewer tokens than the tokenizer at {tokenizer_dir} "
                             f"({vocab_size}): model {model!r} is not the tokenizer's model")
        if accepts(vocab_size):
            raise ValueError(f"the server at {api} has more tokens than the tokenizer at {tokenizer_dir} "
                             f"({vocab_size}): model {model!r} is not the tokenizer's model")
    except httpx.HTTPError as e:
        raise E.EngineUnavailable(f"the server at {api} failed during start-up: {type(e).__name__}: {e}") from e


def load_openai_engine(engine: Dict[str, Any], tokenizer_path: str, policy: Any = None, *,
                       name: str = "openai") -> OpenAIEngine:
    """An :class:`OpenAIEngine` for ``engine: {kind: openai, url, model?, api_key?, timeout_s?}``.

    ``tokenizer_path`` is the model's local Hugging Face directory (or
    ``embedded``): its tokenizer detokenizes the server's tokens and its
    ``config.json`` gives the vocabulary size.  Checks that the server is up
    and serves ``model`` (default: the only model it serves), reads its
    ``max_model_len`` (and block size from ``/metrics``), and that it
    tokenizes like the local tokenizer.  Raises
    :class:`~engine_ext.errors.EngineUnavailable` when nothing answers at the
    URL and :class:`ValueError` (naming the URL) when the model is not served
    or the tokenizer does not match.  ``policy`` (the model's PolicySpec):
    its ranking cannot run in a remote server (logged when not FCFS); its
    interception is always discard with prefix reuse."""
    import httpx

    from .tokenizer import Tokenizer
    from .policies import ToolDurations, make_interception

    url = str(engine.get("url") or "")
    if not re.match(r"^https?://[^\s/]+", url):
        raise ValueError(f"engine.url must be an http(s) URL of a vLLM OpenAI server (…/v1), got {url!r}")
    api, root = _split_url(url)
    timeout_s = float(engine.get("timeout_s") or DEFAULT_TIMEOUT_S)
    api_key = engine.get("api_key")

    model_dir = _resolve_dir(tokenizer_path)
    tokenizer = Tokenizer.from_model_dir(model_dir, needed_by="the openai engine")
    config = tokenizer.config  # the model's config.json
    vocab_size = int(config.get("vocab_size") or tokenizer.vocab_size)

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(headers=headers, timeout=httpx.Timeout(max(timeout_s, CONNECT_TIMEOUT_S),
                                                             connect=CONNECT_TIMEOUT_S)) as client:
        models = _server_models(client, api)
        served = [m["id"] for m in models]
        model = engine.get("model")
        if model is None:
            if len(served) != 1:
                raise ValueError(f"the server at {api} serves {len(served)} models ({', '.join(served) or 'none'}); "
                                 "name one in engine.model")
            model = served[0]
        card = next((m for m in models if m["id"] == model), None)
        if card is None:
            raise ValueError(f"the server at {api} does not serve model {model!r}; it serves: "
                             f"{', '.join(served) or 'nothing'}")
        max_model_len = card.get("max_model_len") or config.get("max_position_embeddings")
        if not max_model_len:
            raise ValueError(f"the server at {api} does not say model {model!r}'s max_model_len (not vLLM?)")
        cache: Dict[str, int] = {}
        try:
            r = client.get(f"{root}/metrics")
            if r.status_code == 200:
                cache = parse_cache_config(r.text)
        except httpx.HTTPError as e:
            log.warning("no %s/metrics (%s): block size 16 assumed, no server stats", root, e)
        _check_tokenizer(client, api, root, model, tokenizer, vocab_size, model_dir)

    ranking = getattr(policy, "ranking", "fcfs") if policy is not None else "fcfs"
    if ranking not in ("fcfs", None):
        log.warning("the openai engine at %s cannot rank inside the remote server: ranking %s is not applied "
                    "(the server schedules in its own order)", api, ranking)
    interception = make_interception("discard", None, ToolDurations())
    log.info("openai engine %s: model %r at %s, max_model_len %s, block size %s", name, model, api, max_model_len,
             cache.get("block_size", 16))
    return OpenAIEngine(api, tokenizer, model=str(model), max_model_len=int(max_model_len), vocab_size=vocab_size,
                        api_key=api_key, timeout_s=timeout_s, block_size=cache.get("block_size", 16),
                        num_blocks=cache.get("num_blocks", 0), name=name, interception=interception)
