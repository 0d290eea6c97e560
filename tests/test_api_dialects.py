"""What the three APIs (chat completions, Responses, Messages) share below their wire modules:
the error shape each route speaks (gateway/errors.py ``dialect``), the end the drain gives a
stream of each (gateway/drain.py ``stream_ending``), and which stop string ended an output
(gateway/openai/completions.py ``stop_string``: Anthropic's ``stop_sequence``)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from interlace.gateway.drain import stream_ending
from interlace.gateway.errors import APIError, dialect
from interlace.gateway.openai.completions import stop_string


def test_messages_paths_answer_in_anthropics_shape_and_the_rest_in_openais():
    err = APIError(400, "must be at least 1", param="max_tokens", code="invalid_value")
    assert dialect("/v1/messages") == dialect("/v1/messages/count_tokens") == "anthropic"
    assert dialect("/v1/messagesX") == dialect("/v1/responses") == dialect("/v1/chat/completions") == "openai"
    body = json.loads(err.response("/v1/messages").body)
    assert body == {"type": "error", "error": {"type": "invalid_request_error",
                                               "message": "max_tokens: must be at least 1"}}
    assert json.loads(err.response("/v1/responses").body)["error"]["param"] == "max_tokens"
    assert APIError(529, "busy").body("anthropic")["error"]["type"] == "overloaded_error"
    assert APIError(404, "no").body("anthropic")["error"]["type"] == "not_found_error"
    assert APIError(418, "tea").body("anthropic")["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path,first,last", [
    ("/v1/chat/completions", b"data: {", b"data: [DONE]\n\n"),
    ("/v1/responses", b"event: error\ndata: {", b"}\n\n"),
    ("/v1/messages", b"event: error\ndata: {", b"}\n\n"),
])
def test_the_drain_ends_each_apis_stream_in_its_own_terms(path, first, last):
    out = stream_ending(path)
    assert out.startswith(first) and out.endswith(last)
    data = json.loads(out.split(b"data: ", 1)[1].split(b"\n", 1)[0])
    if path == "/v1/messages":
        assert data["type"] == "error" and data["error"]["type"] == "overloaded_error"
    elif path == "/v1/responses":
        assert data["type"] == "error" and data["code"] == "shutting_down"
    else:
        assert data["error"]["code"] == "shutting_down"


class _Tok:
    """Characters as tokens: id = code point; 0 is the end-of-sequence token."""

    eos_token_ids = (0,)

    @staticmethod
    def decode(ids):
        return "".join(chr(i) for i in ids if i)


def test_stop_string_names_the_string_that_completed_and_none_for_eos():
    model = SimpleNamespace(tokenizer=_Tok())
    ids = [ord(c) for c in "the answer is 4\n\nEND"]
    assert stop_string(model, ("\n\n", "END"), ids) == "END"  # completed last: the engine stopped on it
    assert stop_string(model, ("###", "END"), ids) == "END"
    assert stop_string(model, ("END",), ids + [0]) is None  # an end-of-sequence token ended it
    assert stop_string(model, (), ids) is None
    assert stop_string(model, ("nowhere",), ids) is None
