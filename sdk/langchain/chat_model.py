"""``ChatInterlace``: a LangChain chat model over Interlace's OpenAI-compatible endpoint.

    from interlace.sdk.langchain import ChatInterlace

    llm = ChatInterlace(model="smollm2", base_url="http://127.0.0.1:8000/v1", temperature=0)
    llm.invoke("Hello")

It speaks HTTP with httpx (no ``openai`` / ``langchain-openai`` dependency):
``POST {base_url}/chat/completions``, streaming with server-sent events.  The
gateway enforces ``tool_choice`` and ``response_format`` by constrained decoding,
so ``bind_tools(..., tool_choice=...)`` and ``with_structured_output`` get calls and
JSON that follow the schema even from a small model (unless ``max_tokens`` cuts
them short).

Errors are the SDK's (:mod:`interlace.sdk.errors`): a 4xx answer raises the typed
error with the server's message (``BadRequestError`` ...) and is never retried;
429, 5xx and connection failures are retried ``max_retries`` times with
exponential backoff, then raise ``ServerError`` / ``APIConnectionError`` /
``APITimeoutError``.  A failure reported inside a stream raises too.

:meth:`ChatInterlace._chat_body` is the one place the request body is built;
``to_semantic`` calls it to send exactly the prompt and sampling this model would.
"""

from __future__ import annotations

import asyncio
import functools
import ssl
import time
from contextlib import asynccontextmanager
from operator import itemgetter
from typing import Any, AsyncIterator, Callable, Dict, Iterator, List, Literal, Mapping, Optional, Sequence, Union

import httpx
from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.chat_models import BaseChatModel, LangSmithParams
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, convert_to_openai_messages
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.base import OutputParserLike
from langchain_core.output_parsers.openai_tools import (JsonOutputKeyToolsParser, PydanticToolsParser,
                                                        make_invalid_tool_call, parse_tool_call)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils import from_env, secret_from_env
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr

from .. import _wire
from ..errors import APIConnectionError, APITimeoutError, InterlaceError, error_from_body

__all__ = ["ChatInterlace", "DEFAULT_BASE_URL"]

#: Where ``interlace serve`` listens by default; like ChatOpenAI's, the URL includes ``/v1``.
DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
#: First retry waits this long, each next one twice as long, at most RETRY_MAX_S (a
#: ``Retry-After`` header up to RETRY_MAX_S wins).  Module-level so tests can shorten them.
RETRY_BACKOFF_S = 0.5
RETRY_MAX_S = 8.0
#: Body keys ``_chat_body`` manages itself: streaming is chosen by the call path.
_STREAM_KEYS = ("stream", "stream_options")

ToolLike = Union[Dict[str, Any], type, Callable[..., Any], BaseTool]


@functools.lru_cache(maxsize=1)
def _ssl_context() -> ssl.SSLContext:
    """One TLS context for every client: building one costs ~30 ms (the CA bundle), a
    client that reuses it ~1 ms -- so an asyncio call can afford its own client."""
    return httpx.create_ssl_context()


def _retryable(status: int) -> bool:
    return status == 429 or status >= 500


def _retry_delay(attempt: int, response: Optional[httpx.Response]) -> float:
    after = response.headers.get("retry-after") if response is not None else None
    try:
        if after is not None and 0 <= float(after) <= RETRY_MAX_S:
            return float(after)
    except ValueError:
        pass  # an HTTP date: use the backoff
    return min(RETRY_BACKOFF_S * 2 ** attempt, RETRY_MAX_S)


def _transport_error(e: httpx.TransportError) -> InterlaceError:
    """httpx's failures as the SDK's, so callers catch one family of errors."""
    if isinstance(e, httpx.TimeoutException):
        return APITimeoutError(f"the request to the Interlace server timed out ({type(e).__name__}: {e})")
    return APIConnectionError(f"cannot talk to the Interlace server ({type(e).__name__}: {e})")


def _usage(usage: Optional[Mapping[str, Any]]) -> Optional[UsageMetadata]:
    if not usage:
        return None
    inp, out = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    meta = UsageMetadata(input_tokens=inp, output_tokens=out, total_tokens=int(usage.get("total_tokens") or inp + out))
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if isinstance(cached, int):
        meta["input_token_details"] = InputTokenDetails(cache_read=cached)
    return meta


def _tool_calls(raw_calls: Sequence[Mapping[str, Any]]) -> tuple:
    """Server tool calls as LangChain's: arguments that do not parse become invalid calls
    (the gateway only sends JSON objects, but a proxy or another server might not)."""
    calls, invalid = [], []
    for raw in raw_calls:
        try:
            call = parse_tool_call(dict(raw), return_id=True)
        except Exception as e:  # noqa: BLE001  (OutputParserException, or a malformed call)
            invalid.append(make_invalid_tool_call(dict(raw), str(e)))
        else:
            if call is not None:
                calls.append(call)
    return calls, invalid


def _chat_result(data: Mapping[str, Any]) -> ChatResult:
    """A ``chat.completion`` object as a ChatResult."""
    if not data.get("choices"):
        raise InterlaceError(f"the server answered without choices: {str(data)[:300]}")
    choice = data["choices"][0]
    message = choice.get("message") or {}
    calls, invalid = _tool_calls(message.get("tool_calls") or [])
    finish = choice.get("finish_reason")
    metadata = {"model_name": data.get("model"), "finish_reason": finish, "model_provider": "interlace"}
    if data.get("id"):
        metadata["id"] = data["id"]
    ai = AIMessage(content=message.get("content") or "", tool_calls=calls, invalid_tool_calls=invalid,
                   usage_metadata=_usage(data.get("usage")), response_metadata=metadata)
    return ChatResult(generations=[ChatGeneration(message=ai, generation_info={"finish_reason": finish})],
                      llm_output={"model_name": data.get("model"), "token_usage": data.get("usage")})


class _StreamReader:
    """Turns the SSE events of one completion into message chunks.

    Text and tool-call deltas are passed on as they come; the finish reason, the
    model's name and the usage (sent after the finish) go in one last chunk with
    ``chunk_position="last"``, so a sum of the chunks counts them once."""

    def __init__(self) -> None:
        self.decoder = _wire.SSEDecoder()
        self.done = False
        self.model: Optional[str] = None
        self.finish: Optional[str] = None
        self.usage: Optional[Mapping[str, Any]] = None

    def feed(self, line: str) -> List[ChatGenerationChunk]:
        data = self.decoder.feed(line)
        if data is None or self.done:
            return []
        if _wire.is_done(data):
            self.done = True
            return [self._last()]
        event = _wire.parse_event(data)
        if "error" in event:  # a failure after the first byte: an error event, then [DONE]
            raise error_from_body(event)
        self.model = event.get("model") or self.model
        self.usage = event.get("usage") or self.usage
        out = []
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            self.finish = choice.get("finish_reason") or self.finish
            calls = [tool_call_chunk(name=(tc.get("function") or {}).get("name"),
                                     args=(tc.get("function") or {}).get("arguments"),
                                     id=tc.get("id"), index=tc.get("index"))
                     for tc in delta.get("tool_calls") or []]
            if delta.get("content") or calls:
                out.append(ChatGenerationChunk(message=AIMessageChunk(content=delta.get("content") or "",
                                                                      tool_call_chunks=calls)))
        return out

    def end(self) -> List[ChatGenerationChunk]:
        """The connection closed: a stream that did not end with ``[DONE]`` was cut off, and
        its answer is unknown -- an error, not a silent end."""
        if self.done:
            return []
        data = self.decoder.flush()
        if data is None or not _wire.is_done(data):
            raise APIConnectionError("the completion stream ended before [DONE]")
        self.done = True
        return [self._last()]

    def _last(self) -> ChatGenerationChunk:
        message = AIMessageChunk(content="", usage_metadata=_usage(self.usage), chunk_position="last",
                                 response_metadata={"model_name": self.model, "finish_reason": self.finish,
                                                    "model_provider": "interlace"})
        return ChatGenerationChunk(message=message, generation_info={"finish_reason": self.finish})


def _tool_choice(choice: Union[str, bool, Dict[str, Any]], tools: Sequence[Mapping[str, Any]]) -> Any:
    """LangChain's ``tool_choice`` spellings as OpenAI's (what the gateway reads)."""
    names = [t["function"]["name"] for t in tools if t.get("type") == "function"]
    if isinstance(choice, dict):
        return choice
    if choice is True:
        if len(names) != 1:
            raise ValueError(f"tool_choice=True needs exactly one tool; got {len(names)}: {names}")
        choice = names[0]
    if choice == "any":
        return "required"
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, str):
        if choice not in names:
            raise ValueError(f"tool_choice {choice!r} names no bound tool (tools: {names})")
        return {"type": "function", "function": {"name": choice}}
    raise ValueError(f"unsupported tool_choice {choice!r}: use 'auto', 'none', 'any'/'required', "
                     "a tool's name, True or an OpenAI tool_choice dict")


def _response_format(schema: Union[Dict[str, Any], type], strict: Optional[bool]) -> Dict[str, Any]:
    """``response_format`` of type json_schema for a pydantic class, TypedDict, function or
    JSON schema (an OpenAI ``response_format`` or ``json_schema`` object passes through)."""
    if isinstance(schema, dict) and schema.get("type") == "json_schema" and "json_schema" in schema:
        return schema
    if isinstance(schema, dict) and "name" in schema and "schema" in schema:
        return {"type": "json_schema", "json_schema": schema}
    function = convert_to_openai_tool(schema, strict=strict)["function"]
    spec = {"name": function["name"], "schema": function["parameters"]}
    if function.get("description"):
        spec["description"] = function["description"]
    if strict is not None:
        spec["strict"] = strict
    return {"type": "json_schema", "json_schema": spec}


class ChatInterlace(BaseChatModel):
    """A chat model served by an Interlace gateway (``interlace serve``).

    Constructed like ``ChatOpenAI``: ``model``, ``base_url`` (with ``/v1``; default
    ``$INTERLACE_BASE_URL``, else ``http://127.0.0.1:8000/v1``), ``api_key`` (default
    ``$INTERLACE_API_KEY``; without one no ``Authorization`` header is sent), the
    sampling parameters (only those set are sent, so the server's defaults apply to
    the rest), ``timeout``, ``max_retries``.  A per-call ``model=`` picks another
    served model; other per-call keyword arguments become request fields.
    """

    model_config = ConfigDict(populate_by_name=True)

    model_name: str = Field(default="smollm2", alias="model")
    """The served model's name (``models:`` in the gateway's config)."""
    base_url: str = Field(default_factory=from_env("INTERLACE_BASE_URL", default=DEFAULT_BASE_URL))
    """The OpenAI-compatible root, ``/v1`` included."""
    api_key: Optional[SecretStr] = Field(default_factory=secret_from_env("INTERLACE_API_KEY", default=None))
    """One of the gateway's ``server.api_keys``; None for a gateway without keys."""
    temperature: Optional[float] = None
    max_tokens: Optional[int] = None
    top_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Optional[Union[List[str], str]] = None
    """Default stop sequences (a call's ``stop`` replaces them)."""
    timeout: Optional[float] = 120.0
    """Seconds to connect, and between two reads of an answer; None waits forever."""
    max_retries: int = Field(default=2, ge=0)
    """Retries of 429, 5xx and connection failures (a 4xx is the request's fault: never retried)."""
    streaming: bool = False
    """``invoke`` streams (then aggregates) when True."""
    model_kwargs: Dict[str, Any] = Field(default_factory=dict)
    """Other request fields sent with every call (e.g. ``{"top_k": 40}``)."""
    http_client: Optional[httpx.Client] = Field(default=None, exclude=True)
    """An httpx client for the sync calls (proxies, a test transport); default: one of our own."""
    http_async_client: Optional[httpx.AsyncClient] = Field(default=None, exclude=True)
    """An httpx client for the asyncio calls; default: a fresh one per call (asyncio clients
    belong to one event loop, and a model outlives loops)."""

    _client: Optional[httpx.Client] = PrivateAttr(default=None)

    # ------------------------------------------------------------------ LangChain plumbing
    @property
    def _llm_type(self) -> str:
        return "interlace-chat"

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return True

    @classmethod
    def get_lc_namespace(cls) -> List[str]:
        """The public import path (``load`` imports it to rebuild a serialized model)."""
        return ["interlace", "sdk", "langchain"]

    @property
    def lc_secrets(self) -> Dict[str, str]:
        return {"api_key": "INTERLACE_API_KEY"}

    @property
    def _default_params(self) -> Dict[str, Any]:
        params = {"temperature": self.temperature, "max_tokens": self.max_tokens, "top_p": self.top_p,
                  "seed": self.seed, "stop": self._stop_list(None), **self.model_kwargs}
        return {k: v for k, v in params.items() if v is not None}

    @property
    def _identifying_params(self) -> Dict[str, Any]:
        return {"model_name": self.model_name, "base_url": self.base_url, **self._default_params}

    def _get_ls_params(self, stop: Optional[List[str]] = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider="interlace", ls_model_name=kwargs.get("model") or self.model_name,
                                 ls_model_type="chat")
        temperature = kwargs.get("temperature", self.temperature)
        if temperature is not None:
            params["ls_temperature"] = temperature
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        stops = self._stop_list(stop)
        if stops:
            params["ls_stop"] = stops
        return params

    @property
    def server_root(self) -> str:
        """The gateway's root without ``/v1`` (where ``/health`` and ``/v1/sessions`` hang)."""
        root = self.base_url.rstrip("/")
        return root[:-3] if root.endswith("/v1") else root

    # ------------------------------------------------------------------------ the request
    def _stop_list(self, stop: Optional[List[str]]) -> Optional[List[str]]:
        stops = stop if stop is not None else self.stop
        if isinstance(stops, str):
            stops = [stops]
        return list(stops) if stops else None

    def _chat_body(self, messages: List[BaseMessage], stop: Optional[List[str]] = None,
                   **kwargs: Any) -> Dict[str, Any]:
        """The JSON body this model sends to ``/chat/completions`` (without ``stream`` /
        ``stream_options``, which the call path adds): ``model`` (a per-call ``model=`` wins),
        ``messages`` in OpenAI's shape, the sampling keys that are set (``temperature``,
        ``max_tokens``, ``top_p``, ``seed``, ``stop``), ``model_kwargs``, then the call's
        keyword arguments -- ``tools`` / ``tool_choice`` / ``response_format`` when bound.
        Keys whose value is None are left out, so the server's defaults apply."""
        body: Dict[str, Any] = {"model": kwargs.pop("model", None) or self.model_name,
                                "messages": convert_to_openai_messages(messages)}
        body.update(self._default_params)
        stops = self._stop_list(stop)
        body.pop("stop", None)
        if stops:
            body["stop"] = stops
        for key, value in kwargs.items():
            if key in _STREAM_KEYS:
                continue
            if value is None:
                body.pop(key, None)
            else:
                body[key] = value
        return body

    def _headers(self) -> Dict[str, str]:
        key = self.api_key.get_secret_value() if self.api_key is not None else None
        return _wire.headers(key)

    def _request(self, client: Union[httpx.Client, httpx.AsyncClient], body: Dict[str, Any]) -> httpx.Request:
        return client.build_request("POST", self.base_url.rstrip("/") + "/chat/completions", json=body,
                                    headers=self._headers(), timeout=httpx.Timeout(self.timeout))

    def _sync_client(self) -> httpx.Client:
        if self.http_client is not None:
            return self.http_client
        if self._client is None:  # lazily: constructing a model stays cheap
            self._client = httpx.Client(verify=_ssl_context())
        return self._client

    @asynccontextmanager
    async def _async_client(self) -> AsyncIterator[httpx.AsyncClient]:
        if self.http_async_client is not None:
            yield self.http_async_client
        else:
            async with httpx.AsyncClient(verify=_ssl_context()) as client:
                yield client

    def _send(self, body: Dict[str, Any], stream: bool) -> httpx.Response:
        """The answer to ``body`` once it is a success (the caller closes a streamed one);
        429 / 5xx / connection failures are retried, any other error raises at once."""
        client = self._sync_client()
        for attempt in range(self.max_retries + 1):
            response = None
            try:
                response = client.send(self._request(client, body), stream=stream)
            except httpx.TransportError as e:
                if attempt == self.max_retries:
                    raise _transport_error(e) from e
            else:
                if response.is_success:
                    return response
                try:
                    response.read()
                finally:
                    response.close()
                if not _retryable(response.status_code) or attempt == self.max_retries:
                    _wire.decode(response)  # raises the typed error
            time.sleep(_retry_delay(attempt, response))
        raise AssertionError("unreachable")

    async def _asend(self, client: httpx.AsyncClient, body: Dict[str, Any], stream: bool) -> httpx.Response:
        """:meth:`_send` for asyncio."""
        for attempt in range(self.max_retries + 1):
            response = None
            try:
                response = await client.send(self._request(client, body), stream=stream)
            except httpx.TransportError as e:
                if attempt == self.max_retries:
                    raise _transport_error(e) from e
            else:
                if response.is_success:
                    return response
                try:
                    await response.aread()
                finally:
                    await response.aclose()
                if not _retryable(response.status_code) or attempt == self.max_retries:
                    _wire.decode(response)
            await asyncio.sleep(_retry_delay(attempt, response))
        raise AssertionError("unreachable")

    @staticmethod
    def _stream_body(body: Dict[str, Any]) -> Dict[str, Any]:
        return {**body, "stream": True, "stream_options": {"include_usage": True}}

    # ------------------------------------------------------------------- the call paths
    def _generate(self, messages: List[BaseMessage], stop: Optional[List[str]] = None,
                  run_manager: Optional[CallbackManagerForLLMRun] = None, **kwargs: Any) -> ChatResult:
        response = self._send(self._chat_body(messages, stop, **kwargs), stream=False)
        return _chat_result(_wire.decode(response))

    async def _agenerate(self, messages: List[BaseMessage], stop: Optional[List[str]] = None,
                         run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
                         **kwargs: Any) -> ChatResult:
        body = self._chat_body(messages, stop, **kwargs)
        async with self._async_client() as client:
            response = await self._asend(client, body, stream=False)
        return _chat_result(_wire.decode(response))

    def _stream(self, messages: List[BaseMessage], stop: Optional[List[str]] = None,
                run_manager: Optional[CallbackManagerForLLMRun] = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        response = self._send(self._stream_body(self._chat_body(messages, stop, **kwargs)), stream=True)
        reader = _StreamReader()
        try:
            for line in response.iter_lines():
                yield from reader.feed(line)
            yield from reader.end()
        except httpx.TransportError as e:
            raise _transport_error(e) from e
        finally:
            response.close()

    async def _astream(self, messages: List[BaseMessage], stop: Optional[List[str]] = None,
                       run_manager: Optional[AsyncCallbackManagerForLLMRun] = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        body = self._stream_body(self._chat_body(messages, stop, **kwargs))
        async with self._async_client() as client:
            response = await self._asend(client, body, stream=True)
            reader = _StreamReader()
            try:
                async for line in response.aiter_lines():
                    for chunk in reader.feed(line):
                        yield chunk
                for chunk in reader.end():
                    yield chunk
            except httpx.TransportError as e:
                raise _transport_error(e) from e
            finally:
                await response.aclose()

    # ------------------------------------------------------------- tools and structure
    def bind_tools(self, tools: Sequence[ToolLike], *,
                   tool_choice: Optional[Union[str, bool, Dict[str, Any]]] = None,
                   strict: Optional[bool] = None, parallel_tool_calls: Optional[bool] = None,
                   **kwargs: Any) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (anything ``convert_to_openai_tool`` takes).  ``tool_choice``: ``"auto"``,
        ``"none"``, ``"any"`` / ``"required"`` (some call), a tool's name (that call), ``True``
        (the single tool) or an OpenAI dict.  The gateway enforces a forced choice by
        constrained decoding; ``parallel_tool_calls=False`` stops after one call."""
        formatted = [convert_to_openai_tool(tool, strict=strict) for tool in tools]
        if tool_choice is not None and tool_choice is not False:
            kwargs["tool_choice"] = _tool_choice(tool_choice, formatted)
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(self, schema: Optional[Union[Dict[str, Any], type]] = None, *,
                               method: Literal["json_schema", "json_mode", "function_calling"] = "json_schema",
                               include_raw: bool = False, strict: Optional[bool] = None,
                               **kwargs: Any) -> Runnable[LanguageModelInput, Union[Dict[str, Any], Any]]:
        """Answers parsed into ``schema`` (a pydantic v1/v2 class, TypedDict, JSON schema or
        OpenAI function/tool dict).

        ``method``: ``"json_schema"`` (default) sends ``response_format`` json_schema, which
        the gateway enforces while decoding; ``"json_mode"`` sends json_object (any JSON
        object: say in the prompt which keys you want); ``"function_calling"`` forces one call
        of a tool made from the schema.  ``include_raw=True`` returns ``{"raw", "parsed",
        "parsing_error"}`` instead of raising when the answer does not parse."""
        if method not in ("json_schema", "json_mode", "function_calling"):
            raise ValueError(f"unknown method {method!r}: use 'json_schema', 'json_mode' or 'function_calling'")
        if method == "json_mode" and strict is not None:
            raise ValueError("strict has no meaning with method='json_mode'")
        if schema is None and method != "json_mode":
            raise ValueError(f"method={method!r} needs a schema")
        pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        # what BaseChatModel reports to callbacks (on_chat_model_start's options) and tracing
        traced = {"method": method} if method == "json_mode" else {"method": method, "strict": strict}
        trace = {"ls_structured_output_format": {"kwargs": traced, "schema": schema}} if schema is not None else {}
        parser: OutputParserLike
        if method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, strict=strict, parallel_tool_calls=False,
                                  **trace, **kwargs)
            parser = (PydanticToolsParser(tools=[schema], first_tool_only=True) if pydantic
                      else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True))
        else:
            fmt = _response_format(schema, strict) if method == "json_schema" else {"type": "json_object"}
            llm = self.bind(response_format=fmt, **trace, **kwargs)
            parser = PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser()
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        unparsed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([unparsed], exception_key="parsing_error")
