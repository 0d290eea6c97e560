"""The Python SDK (interlace.sdk).

Two parts.  The pure parts -- template conversion, annotations, the
requests the SDK sends, error mapping, SSE reading, polling -- against
``httpx.MockTransport`` handlers, so each is checked exactly and fast.
Then the SDK end to end against a live ``interlace serve`` subprocess with
the embedded model (greedy, a few tokens per output), as a user runs it.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Annotated, Any, Callable, Dict, List

import httpx
import pytest

import interlace.sdk as sdk
from interlace.sdk import (APIConnectionError, AsyncClient, AuthenticationError, BadRequestError, Client,
                           ConflictError, GetTimeoutError, Input, InterlaceError, NoSessionError, NotFoundError,
                           Output, PermissionDeniedError, ProducerFailedError, SemanticVariable, ServerError,
                           SessionLimitError, semantic_function)
from helpers.gateway_server import serve_subprocess
from interlace.sdk._wire import sse_events
from interlace.sdk.spec import to_server_template


# ======================================================== pure: templates
def test_template_shorthand_becomes_server_syntax() -> None:
    t = to_server_template("Write {{task}} in {{ lang }}.\nCode: {{code}}", ["task", "lang"], ["code"])
    assert t == "Write {{input:task}} in {{input:lang}}.\nCode: {{output:code}}"


def test_template_in_server_syntax_is_kept() -> None:
    t = "A {{input:task}} B {{output:code}}"
    assert to_server_template(t, ["task"], ["code"]) == t


@pytest.mark.parametrize("template, problem", [
    ("{{task}} {{code}} {{other}}", "names no input or output"),
    ("{{output:task}} {{code}}", "names the input 'task'"),
    ("{{task}}", "not used in the template"),
    ("{{task}} {{code}} {{code}}", "appears twice"),
])
def test_template_mistakes_are_named(template: str, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        to_server_template(template, ["task"], ["code"])


# ============================================== pure: semantic functions
@semantic_function(model="m1")
def write_code(task: Input, code: Output(max_tokens=16, temperature=0, stop="\n\n", transform={"strip": True})):
    """
    You are an expert software engineer.
    Write python code of {{task}}.
    Code: {{code}}"""


def test_semantic_function_reads_docstring_and_annotations() -> None:
    # This module uses `from __future__ import annotations`: the annotations arrive as strings.
    assert write_code.template == ("You are an expert software engineer.\nWrite python code of {{input:task}}.\n"
                                   "Code: {{output:code}}")
    assert write_code.inputs == ("task",)
    assert write_code.outputs["code"].to_json() == {
        "sampling": {"max_tokens": 16, "temperature": 0, "stop": ["\n\n"]}, "transform": {"strip": True}}
    assert write_code.__name__ == "write_code"


def test_semantic_function_options_and_annotated() -> None:
    @semantic_function(template="{{input:a}} then {{b}} -> {{x}} and {{output:y}}", chat=True)
    def f(a: Input, x: Output, b: Annotated[str, Input()] = "B", y: Annotated[str, Output(max_tokens=3)] = ""):
        """ignored: template= wins"""

    assert f.template == "{{input:a}} then {{input:b}} -> {{output:x}} and {{output:y}}"
    assert f.inputs == ("a", "b") and list(f.outputs) == ["x", "y"] and f.chat is True
    assert f.outputs["x"].to_json() == {} and f.outputs["y"].to_json() == {"sampling": {"max_tokens": 3}}


@pytest.mark.parametrize("define, problem", [
    (lambda: semantic_function(lambda task, code: None), "needs an Input or Output annotation"),
    (lambda: semantic_function(template="{{a}}")(_no_output), "no Output parameter"),
    (lambda: semantic_function(_no_doc), "no prompt"),
    (lambda: semantic_function(template="{{a}} {{out}} {{zzz}}")(_a_out), "names no input or output"),
    (lambda: semantic_function(template="{{out}}")(_a_out), "['a'] not used"),
    (lambda: semantic_function(template="{{session}} {{out}}")(_session_param), "reserved"),
])
def test_semantic_function_mistakes_fail_at_definition(define: Callable[[], Any], problem: str) -> None:
    with pytest.raises(TypeError, match=re.escape(problem)):
        define()


def _no_output(a: Input): ...
def _no_doc(a: Input, out: Output): ...
def _a_out(a: Input, out: Output): ...
def _session_param(session: Input, out: Output): ...


def test_output_rejects_an_unknown_criterion() -> None:
    with pytest.raises(ValueError, match="criterion"):
        Output(criterion="fast")


# ============================================ pure: requests via a mock
class FakeServer:
    """Answers the SDK's requests from a table ``(method, path) -> handler`` and records them."""

    def __init__(self, routes: Dict[tuple, Callable[[httpx.Request], httpx.Response]]):
        self.routes = routes
        self.requests: List[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        handler = self.routes.get((request.method, request.url.path))
        if handler is None:
            return httpx.Response(404, json={"error": {"message": f"no route {request.url.path}",
                                                       "type": "invalid_request_error", "code": "not_found"}})
        return handler(request)

    def client(self, **kw: Any) -> Client:
        return Client("http://sdk.test", transport=httpx.MockTransport(self), **kw)

    def aclient(self, **kw: Any) -> AsyncClient:
        return AsyncClient("http://sdk.test", transport=httpx.MockTransport(self), **kw)


SESSION = {"id": "ses_1", "token": "sst_1", "ttl_s": 600.0, "expires_at": 1.0, "limits": {}}


def fake_session_routes(calls: List[dict]) -> Dict[tuple, Callable[[httpx.Request], httpx.Response]]:
    def submit(req: httpx.Request) -> httpx.Response:
        body = json.loads(req.content)
        calls.append(body)
        n = len(calls)
        return httpx.Response(201, json={"id": f"call_{n}", "state": "pending",
                                         "outputs": {k: f"sv_{n}_{k}" for k in body["outputs"]}})

    return {
        ("POST", "/v1/sessions"): lambda r: httpx.Response(201, json=SESSION),
        ("DELETE", "/v1/sessions/ses_1"): lambda r: httpx.Response(200, json={"id": "ses_1", "deleted": True}),
        ("POST", "/v1/sessions/ses_1/calls"): submit,
        ("POST", "/v1/sessions/ses_1/variables"): lambda r: httpx.Response(
            201, json={"id": "sv_new", "name": json.loads(r.content).get("name"), "ready": True}),
    }


def test_semantic_function_submits_the_contracts_body() -> None:
    calls: List[dict] = []
    fake = FakeServer(fake_session_routes(calls))

    @semantic_function
    def two(a: Input, b: Input, first: Output(max_tokens=4), second: Output(criterion="latency")):
        """{{a}} {{first}} {{b}} {{second}}"""

    with fake.client(api_key="k", model="default-model") as client:
        with client.session(ttl_s=30) as s:
            v = s.variable("hello", name="greeting")
            first, second = two(v, "constant")
            code = write_code("sorting")
        assert s.closed
    assert (first.id, second.id, code.id) == ("sv_1_first", "sv_1_second", "sv_2_code")
    assert first.session is s and first.name == "first"
    assert calls[0] == {"template": "{{input:a}} {{output:first}} {{input:b}} {{output:second}}",
                        "inputs": {"a": "sv_new", "b": {"value": "constant"}},
                        "outputs": {"first": {"sampling": {"max_tokens": 4}}, "second": {"criterion": "latency"}},
                        "chat": False, "model": "default-model"}
    assert calls[1]["model"] == "m1"  # the decorator's model wins over the client's
    create, var = fake.requests[0], fake.requests[1]
    assert json.loads(create.content) == {"ttl_s": 30}
    assert create.headers["authorization"] == "Bearer k"          # the API key creates the session
    assert var.headers["authorization"] == "Bearer sst_1"         # the session's token for the rest
    assert json.loads(var.content) == {"name": "greeting", "value": "hello"}
    assert fake.requests[-1].method == "DELETE"


def test_output_may_fill_a_declared_variable() -> None:
    calls: List[dict] = []
    with FakeServer(fake_session_routes(calls)).client() as client, client.session():
        target = SemanticVariable(sdk.current_session(), "sv_declared")
        write_code("x", code=target)
    assert calls[0]["outputs"]["code"]["variable"] == "sv_declared"


def test_calls_outside_a_session_fail_clearly_and_sessions_nest() -> None:
    with pytest.raises(NoSessionError, match="outside any session"):
        write_code("x")
    fake = FakeServer(fake_session_routes([]))
    with fake.client() as client:
        with client.session() as outer:
            assert sdk.current_session() is outer
            with client.session() as inner:
                assert write_code("x").session is inner
            assert sdk.current_session() is outer
            assert write_code("x", session=inner).session is inner  # session= wins
    assert sdk.current_session() is None


def test_input_types_are_checked() -> None:
    with FakeServer(fake_session_routes([])).client() as client, client.session() as s:
        with pytest.raises(TypeError, match="SemanticVariable or a str"):
            write_code(42)
        with pytest.raises(TypeError, match="text"):
            s.variable(42)
        with pytest.raises(TypeError, match="missing a required argument"):
            write_code()


ERRORS = [
    (400, "cycle", BadRequestError), (401, "invalid_session_token", AuthenticationError),
    (403, "permission_denied", PermissionDeniedError), (404, "variable_not_found", NotFoundError),
    (408, "timeout", GetTimeoutError), (409, "variable_already_set", ConflictError),
    (413, "session_bytes", SessionLimitError), (413, "request_too_large", BadRequestError),
    (429, "session_limit", SessionLimitError), (424, "producer_failed", ProducerFailedError),
    (500, None, ServerError), (503, None, ServerError), (418, "teapot", InterlaceError),
]


@pytest.mark.parametrize("status, code, cls", ERRORS)
def test_error_bodies_become_typed_exceptions(status: int, code: str, cls: type) -> None:
    body = {"error": {"message": f"it went wrong ({status})", "type": "x", "param": "inputs.a", "code": code,
                      "call": "call_9"}}
    fake = FakeServer({("POST", "/v1/sessions"): lambda r: httpx.Response(status, json=body)})
    with fake.client() as client, pytest.raises(InterlaceError) as info:
        client.session()
    err = info.value
    assert type(err) is cls
    assert (str(err), err.status, err.code, err.param) == (f"it went wrong ({status})", status, code, "inputs.a")
    if cls is ProducerFailedError:
        assert err.call == "call_9"


@pytest.mark.parametrize("type_, code, cls", [
    ("server_error", "internal_error", ServerError), ("invalid_request_error", None, BadRequestError),
    ("server_error", "producer_failed", ProducerFailedError), ("other", None, InterlaceError)])
def test_a_stream_error_without_status_is_typed_by_code_then_type(type_: str, code: str, cls: type) -> None:
    from interlace.sdk.errors import error_from_body

    err = error_from_body({"error": {"message": "boom", "type": type_, "code": code}})
    assert type(err) is cls and err.status is None


def test_a_non_json_error_keeps_the_status_and_text() -> None:
    fake = FakeServer({("POST", "/v1/sessions"): lambda r: httpx.Response(502, text="bad gateway")})
    with fake.client() as client, pytest.raises(ServerError, match="bad gateway") as info:
        client.session()
    assert info.value.status == 502


def test_transport_failures_are_typed() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    with Client("http://sdk.test", transport=httpx.MockTransport(refuse)) as client:
        with pytest.raises(APIConnectionError, match="connection refused"):
            client.session()
    with Client("http://127.0.0.1:1", timeout=5) as client:  # nothing listens on port 1
        with pytest.raises(APIConnectionError):
            client.session()


def test_get_asks_again_after_408_until_the_value_exists() -> None:
    answers = [httpx.Response(408, json={"error": {"message": "not yet", "code": "timeout"}})] * 2 + [
        httpx.Response(200, json={"id": "sv_1", "name": None, "value": "done"})]
    seen: List[httpx.Request] = []

    def get(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        return answers[len(seen) - 1]

    routes = fake_session_routes([])
    routes[("GET", "/v1/sessions/ses_1/variables/sv_1")] = get
    with FakeServer(routes).client() as client, client.session() as s:
        v = SemanticVariable(s, "sv_1")
        assert v.get(criterion="latency") == "done" and v.value == "done"
    assert len(seen) == 3
    assert seen[0].url.params["criterion"] == "latency" and seen[0].url.params["stream"] == "false"
    assert 0 < float(seen[0].url.params["timeout_s"]) <= sdk.client.POLL_S


def test_get_with_a_timeout_raises_once_it_has_passed() -> None:
    seen: List[float] = []

    def get(req: httpx.Request) -> httpx.Response:
        seen.append(float(req.url.params["timeout_s"]))
        return httpx.Response(408, json={"error": {"message": "no value yet", "code": "timeout"}})

    routes = fake_session_routes([])
    routes[("GET", "/v1/sessions/ses_1/variables/sv_1")] = get
    with FakeServer(routes).client() as client, client.session() as s:
        with pytest.raises(GetTimeoutError, match="no value"):
            SemanticVariable(s, "sv_1").get(timeout=0)
    assert seen == [0.0]  # "is there a value yet?": answered at once, asked once


def sse(*events: Any, done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events] + (["data: [DONE]\n\n"] if done else [])
    return "".join(lines).encode()


def test_sse_reader() -> None:
    text = ': keep-alive\n\ndata: {"delta": "a"}\n\nevent: x\ndata: {"delta":\ndata: "b"}\n\ndata: [DONE]\n\n'
    assert list(sse_events(text.splitlines())) == [{"delta": "a"}, {"delta": "b"}]
    with pytest.raises(APIConnectionError, match="before \\[DONE\\]"):
        list(sse_events(['data: {"delta": "a"}', ""]))


@pytest.mark.parametrize("body, expect", [
    (sse({"delta": " Hel"}, {"delta": "lo "}, {"value": "Hello"}), ([" Hel", "lo "], "Hello", None)),
    (sse({"delta": "x"}, {"error": {"message": "json_field 'a': the output is not JSON", "code": "producer_failed",
                                    "call": "call_7"}}), (["x"], None, ProducerFailedError)),
    (sse({"delta": "x"}, done=False), (["x"], None, APIConnectionError)),
    (sse({"delta": "x"}), (["x"], None, APIConnectionError)),  # [DONE] without a value
])
def test_stream_sync_and_async(body: bytes, expect: tuple) -> None:
    deltas, value, error = expect

    def get(req: httpx.Request) -> httpx.Response:
        assert req.url.params["stream"] == "true"
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    routes = fake_session_routes([])
    routes[("GET", "/v1/sessions/ses_1/variables/sv_1")] = get
    fake = FakeServer(routes)
    got: List[str] = []
    with fake.client() as client, client.session() as s:
        v = SemanticVariable(s, "sv_1")
        if error is None:
            got = list(v.stream())
        else:
            with pytest.raises(error) as info:
                for d in v.stream():
                    got.append(d)
            if error is ProducerFailedError:
                assert info.value.call == "call_7" and "not JSON" in str(info.value)
    assert got == deltas and v.value == value

    async def run() -> List[str]:
        out: List[str] = []
        async with fake.aclient() as client, client.session() as s:
            av = SemanticVariable(s, "sv_1")
            if error is None:
                out = [d async for d in av.astream()]
                assert av.value == value
            else:
                with pytest.raises(error):
                    async for d in av.astream():
                        out.append(d)
        return out

    assert asyncio.run(run()) == deltas


def test_a_variable_belongs_to_its_kind_of_session() -> None:
    fake = FakeServer(fake_session_routes([]))
    with fake.client() as client, client.session() as s:
        with pytest.raises(TypeError, match=r"use \.get\(\)"):
            asyncio.run(SemanticVariable(s, "sv_1").aget())

    async def run() -> None:
        async with fake.aclient() as client, client.session() as s:
            with pytest.raises(TypeError, match=r"use \.aget\(\)"):
                SemanticVariable(s, "sv_1").get()
            v = write_code("x")            # in an async session, calling gives an awaitable
            assert asyncio.iscoroutine(v)
            assert (await v).id == "sv_1_code"

    asyncio.run(run())


def test_close_tolerates_an_already_expired_session_but_delete_does_not() -> None:
    routes = fake_session_routes([])
    routes[("DELETE", "/v1/sessions/ses_1")] = lambda r: httpx.Response(
        404, json={"error": {"message": "no session ses_1", "code": "session_not_found"}})
    fake = FakeServer(routes)
    with fake.client() as client:
        s = client.session()
        with pytest.raises(NotFoundError, match="no session"):
            s.delete()
        with client.session() as s2:
            pass
        assert s2.closed


def test_the_sdk_imports_neither_torch_nor_the_engine() -> None:
    from test_public_api import run_without_torch

    proc = run_without_torch("""
        import sys
        import interlace.sdk
        assert not any(m.startswith(("torch", "interlace.engine_ext")) for m in sys.modules), sorted(sys.modules)
    """)
    assert proc.returncode == 0, proc.stderr


def test_everything_is_exported() -> None:
    for name in sdk.__all__:
        assert getattr(sdk, name) is not None
    assert issubclass(sdk.APITimeoutError, APIConnectionError)
    assert all(issubclass(getattr(sdk, n), InterlaceError) for n in sdk.__all__ if n.endswith("Error"))


# ============================================== end to end: interlace serve
API_KEY = "sdk-test-key"
NO_TOOLS_KEY = "sdk-test-key-without-tools"
MAX_VARIABLES = 64
MAX_BYTES = 65536
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """``interlace serve`` in a subprocess; terminated (then killed) at the end, whatever happened."""
    config = {
        "server": {"api_keys": [{"key": API_KEY, "name": "sdk", "server_tools": ["calculator"]},
                                {"key": NO_TOOLS_KEY, "name": "sdk_no_tools"}],
                   "default_max_tokens": 64,
                   "sessions": {"max_variables": MAX_VARIABLES, "max_bytes": MAX_BYTES}},
        "models": {"smollm2": {"path": "embedded", "kv_cache_tokens": 8192, "dtype": "float32"}},
    }
    with serve_subprocess(config, tmp_path_factory.mktemp("sdk_server")) as url:
        yield url


@pytest.fixture
def client(server: str):
    with Client(server, api_key=API_KEY, model="smollm2") as c:
        yield c


@semantic_function
def topic_of(subject: Input, topic: Output(max_tokens=MAX_TOKENS, stop=["\n"])):
    """Name one interesting fact about {{subject}}.
    Fact: {{topic}}"""


@semantic_function(chat=False)
def question_about(fact: Input, question: Output(max_tokens=MAX_TOKENS, stop=["\n"], transform={"strip": True})):
    """Here is a fact: {{fact}}
    A question a student could ask about it: {{question}}"""


def test_e2e_chain_of_two_semantic_functions(client: Client) -> None:
    with client.session() as s:
        fact = topic_of("the moon")
        question = question_about(fact)          # submitted before fact has a value
        text = question.get(timeout=120)
        assert isinstance(text, str) and text and text == text.strip()
        assert isinstance(fact.get(), str) and fact.value
        info = s.info()
        assert info["calls"]["done"] == 2 and info["calls"]["failed"] == 0
        assert info["usage"]["completion_tokens"] > 0


def test_e2e_async_gather(server: str) -> None:
    subjects = ["the sun", "rivers", "cats", "music"]

    async def run() -> tuple:
        async with AsyncClient(server, api_key=API_KEY, model="smollm2") as aclient:
            async with aclient.session() as s:
                facts = await asyncio.gather(*(topic_of(x) for x in subjects))
                values = await asyncio.gather(*(f.aget(criterion="throughput", timeout=120) for f in facts))
                call = await s.submit(PROMPT, outputs={"out": Output(max_tokens=MAX_TOKENS)})
                deltas = [d async for d in call.output.astream()]
                objective = (await call.ainfo())["objective"]
                info = await s.info()
        return facts, values, deltas, call.output.value, objective, info

    facts, values, deltas, streamed, objective, info = asyncio.run(run())
    assert len({f.id for f in facts}) == len(subjects)
    assert all(isinstance(v, str) and v for v in values) and [f.value for f in facts] == values
    assert len(deltas) > 1 and "".join(deltas) == streamed
    assert objective is None   # no criterion given for the streamed one
    assert info["calls"]["done"] == len(subjects) + 1


def test_e2e_criterion_reaches_the_scheduler(client: Client) -> None:
    with client.session() as s:
        subject = s.variable(name="subject")
        fact = topic_of(subject)
        question = question_about(fact)
        other = question_about(fact)
        with pytest.raises(GetTimeoutError):
            question.get(criterion="latency", timeout=0.1)   # recorded even though it timed out
        # the producer and its single predecessor are latency-critical; a sibling is not
        assert [v.producer.info()["objective"] for v in (question, fact, other)] == ["latency", "latency", None]
        upfront = s.submit(PROMPT, outputs={"out": Output(max_tokens=2, criterion="throughput")})
        assert upfront.info()["objective"] == "throughput"
        subject.set("glaciers")
        # both finish (a 135M model may well answer a stop sequence first: the text may be empty)
        assert isinstance(question.get(timeout=120), str) and isinstance(other.get(timeout=120), str)


PROMPT = "Q: What is the capital of France?\nA:{{out}}"


def test_e2e_stream_deltas_are_the_raw_text_and_value_is_transformed(client: Client) -> None:
    with client.session() as s:
        raw = s.submit(PROMPT, outputs={"out": Output(max_tokens=MAX_TOKENS)}).output
        first_word = s.submit(PROMPT, outputs={"out": Output(max_tokens=MAX_TOKENS,
                                                             transform={"regex": r"\w+"})}).output
        deltas = list(first_word.stream(criterion="latency"))
        raw_text = raw.get()
    assert len(deltas) > 1 and "".join(deltas) == raw_text          # greedy: the same text both times
    assert first_word.value == re.search(r"\w+", raw_text).group(0)  # the transformed value, not the deltas
    assert first_word.value != raw_text


def test_e2e_strip_and_regex_group_transforms(client: Client) -> None:
    with client.session() as s:
        raw = s.submit(PROMPT, outputs={"out": Output(max_tokens=MAX_TOKENS)}).output.get()
        stripped = s.submit(PROMPT, outputs={"out": Output(max_tokens=MAX_TOKENS, transform={"strip": True})})
        group = s.submit(PROMPT, outputs={"out": Output(max_tokens=MAX_TOKENS,
                                                        transform={"strip": True, "regex": r"(\w+)\W*(\w+)",
                                                                   "group": 2})})
        assert raw != raw.strip()  # the model's answer starts with a space: strip has work to do
        assert stripped.output.get() == raw.strip()
        assert group.output.get() == re.search(r"(\w+)\W*(\w+)", raw.strip(), re.DOTALL).group(2)


def test_e2e_wrong_api_key(server: str) -> None:
    with Client(server, api_key="not-the-key") as c, pytest.raises(AuthenticationError) as info:
        c.session()
    assert info.value.status == 401 and "API key" in str(info.value)


def test_e2e_another_sessions_variable_is_not_found(client: Client) -> None:
    with client.session() as a, client.session() as b:
        foreign = a.variable("from session a")
        with pytest.raises(NotFoundError) as info:
            b.submit("Say {{x}}: {{y}}", inputs={"x": foreign}, outputs={"y": Output(max_tokens=4)})
        assert info.value.status == 404 and info.value.code == "variable_not_found"
        with pytest.raises(NotFoundError):   # reading it through b's session is not possible either
            SemanticVariable(b, foreign.id).get(timeout=1)
        assert foreign.get() == "from session a"


def test_e2e_producer_failure(client: Client) -> None:
    with client.session() as s:
        call = s.submit(PROMPT, outputs={"out": Output(max_tokens=MAX_TOKENS, transform={"json_field": "a"})})
        with pytest.raises(ProducerFailedError) as info:
            call.output.get(timeout=120)
        err = info.value
        assert err.status == 424 and err.code == "producer_failed" and err.call == call.id
        assert "not JSON" in str(err)
        with pytest.raises(ProducerFailedError, match="not JSON"):   # the stream reports it too
            list(call.output.stream())
        # and it flows downstream: a call reading the failed variable fails as well
        after = question_about(call.output)
        with pytest.raises(ProducerFailedError):
            after.get(timeout=120)
        assert call.info()["state"] == "failed"


def test_e2e_set_a_declared_variable_and_conflict(client: Client) -> None:
    with client.session() as s:
        subject = s.variable(name="subject")
        fact = topic_of(subject)
        with pytest.raises(GetTimeoutError):
            fact.get(timeout=0)    # nothing can run before the input is set
        t0 = time.monotonic()
        with pytest.raises(GetTimeoutError, match="ask again"):
            fact.get(timeout=0.5)
        assert time.monotonic() - t0 >= 0.5
        subject.set("volcanoes")
        assert fact.get(timeout=120)
        with pytest.raises(ConflictError):
            subject.set("again")


def test_e2e_session_is_freed_on_exit(client: Client) -> None:
    with client.session() as s:
        v = s.variable("kept until the end")
        assert s.info()["variables"] == 1
    assert s.closed
    with pytest.raises(NotFoundError) as info:
        s.info()
    assert info.value.code == "session_not_found"
    with pytest.raises(NotFoundError):
        v.get(timeout=1)
    with pytest.raises(NotFoundError):
        s.delete()   # delete() reports that it is gone; close() (the with block's) does not mind
    s.close()


def test_e2e_an_idle_session_expires_after_its_ttl(client: Client) -> None:
    with client.session(ttl_s=1) as s:
        assert s.ttl_s == 1
        v = s.variable("short-lived")
        time.sleep(1.5)
        with pytest.raises(NotFoundError, match="expired"):
            v.get(timeout=1)
    assert s.closed   # leaving the block did not fail on the session that was already gone


def test_e2e_tool_node(server: str, client: Client) -> None:
    with client.session() as s:
        expr = s.variable(name="expr")
        call = s.tool("calculator", {"expression": "{{expr}}"}, inputs={"expr": expr},
                      output=Output(transform={"json_field": "result"}))
        expr.set("6*7")
        assert call.output.get(timeout=60) == "42"
        assert call.info()["kind"] == "tool" and call.info()["state"] == "done"
    with Client(server, api_key=NO_TOOLS_KEY) as other, other.session() as s:
        with pytest.raises(PermissionDeniedError) as info:
            s.tool("calculator", {"expression": "1+1"})
        assert info.value.status == 403 and "calculator" in str(info.value)


def test_e2e_session_limits(client: Client) -> None:
    with client.session() as s:
        with pytest.raises(SessionLimitError) as info:
            s.variable("x" * (MAX_BYTES + 1))
        assert (info.value.status, info.value.code) == (413, "session_bytes")
        for _ in range(MAX_VARIABLES):
            s.variable("v")
        with pytest.raises(SessionLimitError) as info:
            s.variable("one too many")
        assert (info.value.status, info.value.code) == (429, "session_limit")
        assert s.info()["variables"] == MAX_VARIABLES


LONG_PREFIX = ("You are a careful assistant that answers questions about geography, history and science. "
               "Always answer in one short sentence, without any introduction, and never repeat the question. "
               "If you do not know the answer, say that you do not know. Be precise about names, dates and "
               "numbers, and prefer the most widely accepted answer. ") * 2


def test_e2e_shared_prefix_is_forked(client: Client) -> None:
    with client.session() as s:
        question = s.variable(name="question")
        calls = [s.submit(LONG_PREFIX + "Question: {{q}}\nAnswer" + suffix + ":{{a}}", inputs={"q": question},
                          outputs={"a": Output(max_tokens=8)}) for suffix in (" 1", " 2")]
        question.set("What is the capital of Italy?")   # both calls become ready together
        assert all(c.output.get(timeout=120) for c in calls)
        usage = s.info()["usage"]
    assert usage["forked_tokens"] >= 64, usage
