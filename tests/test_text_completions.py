"""``GET /v1/models/{id}`` and the legacy ``POST /v1/completions`` against one live gateway,
through the official openai client where it can say it (gateway/openai/text_completions.py)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from helpers.gateway_server import LiveGateway, engine_state, wait_idle

KEY = "text-key"
ONE = "one-at-a-time-key"  # a key that may hold one completion in flight
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def live():
    # float32: greedy outputs must not depend on the CPU's bfloat16 support
    m = {"path": "embedded", "kv_cache_tokens": 4096, "dtype": "float32"}
    cfg = {"server": {"api_keys": [KEY, {"key": ONE, "name": "one", "limits": {"max_concurrent_requests": 1}}]},
           "models": {"smollm2": m}, "plugins": {"entrypoints": False}}
    with LiveGateway(cfg) as gw:
        yield gw


@pytest.fixture
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def _post(live, body: dict) -> httpx.Response:
    return httpx.post(live.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=120)


def _events(r: httpx.Response) -> list:
    data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data
    return [json.loads(d) for d in data[:-1]]


# --------------------------------------------------------------------------- models
def test_models_retrieve_is_the_listed_object(live, client):
    listed = {m.id: m.model_dump() for m in client.models.list().data}
    got = client.models.retrieve("smollm2")
    assert got.model_dump() == listed["smollm2"]
    assert got.object == "model" and got.owned_by == "interlace" and got.created > 0


def test_models_retrieve_unknown_and_slashed_ids(live, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("nope")
    assert e.value.code == "model_not_found" and e.value.param == "model"
    # an id with slashes reaches the route whole (and is unknown here), not a 404 of no route
    r = httpx.get(live.url + "/v1/models/org/some-model", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and "'org/some-model'" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(live.url + "/v1/models/smollm2").status_code == 401  # the key is needed as for the list


# ----------------------------------------------------------------------- completions
def test_string_prompt(live, client):
    r = client.completions.create(model="smollm2", prompt=PROMPT, temperature=0, max_tokens=6)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    choice = r.choices[0]
    assert choice.index == 0 and "Paris" in choice.text and choice.finish_reason in ("stop", "length")
    assert choice.logprobs is None
    n_prompt = len(live.gateway.models["smollm2"].tokenizer.encode(PROMPT, add_special_tokens=True))
    assert r.usage.prompt_tokens == n_prompt  # raw text: no chat template around it
    assert 0 < r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details is not None  # what the chat path reports, reused


def test_default_max_tokens_is_openais_16(live):
    r = _post(live, {"model": "smollm2", "prompt": "Once upon a time", "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 16 and r.json()["choices"][0]["finish_reason"] == "length"


def test_token_id_prompts_equal_the_text(live, client):
    ids = live.gateway.models["smollm2"].tokenizer.encode(PROMPT, add_special_tokens=True)
    text = client.completions.create(model="smollm2", prompt=PROMPT, temperature=0, max_tokens=5)
    for prompt in (ids, [ids], [PROMPT]):
        r = client.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=5)
        assert r.choices[0].text == text.choices[0].text and r.usage.prompt_tokens == len(ids), prompt


def test_streaming_with_usage(live, client):
    whole = client.completions.create(model="smollm2", prompt=PROMPT, temperature=0, max_tokens=8)
    chunks = list(client.completions.create(model="smollm2", prompt=PROMPT, temperature=0, max_tokens=8,
                                            stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "text_completion" for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_stop_and_echo_and_logprobs(live, client):
    full = client.completions.create(model="smollm2", prompt=PROMPT, temperature=0, max_tokens=8).choices[0].text
    cut = full.strip().split()[0]  # the first word ("Paris") as a stop string
    r = client.completions.create(model="smollm2", prompt=PROMPT, temperature=0, max_tokens=8, stop=[cut])
    assert r.choices[0].finish_reason == "stop" and cut not in r.choices[0].text
    assert r.choices[0].text == full[:full.index(cut)]
    e = client.completions.create(model="smollm2", prompt=PROMPT, temperature=0, max_tokens=4, echo=True)
    assert e.choices[0].text.startswith(PROMPT) and e.choices[0].text[len(PROMPT):] == full[:len(e.choices[0].text)
                                                                                         - len(PROMPT)]
    lp = client.completions.create(model="smollm2", prompt=PROMPT, temperature=0, max_tokens=4, logprobs=0)
    got = lp.choices[0].logprobs
    assert len(got.tokens) == lp.usage.completion_tokens == len(got.token_logprobs) == len(got.text_offset)
    assert "".join(got.tokens) == lp.choices[0].text and all(x <= 0 for x in got.token_logprobs)
    assert got.text_offset[0] == 0 and got.text_offset[1] == len(got.tokens[0])


def test_seed_makes_sampling_reproducible(live, client):
    def sample(seed):
        return client.completions.create(model="smollm2", prompt="My favourite animal is", temperature=1.0,
                                         max_tokens=12, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text
    a, b = sample(7), sample(7)
    assert a == b
    assert any(sample(s) != a for s in (8, 9, 10))  # the seed is what fixes it, not greedy decoding


def test_vllm_bench_serve_payload(live):
    """What ``vllm bench serve --backend openai`` posts (vllm 0.32's async_request_openai_completions):
    repetition_penalty 1.0, logprobs null, ignore_eos, stream with include_usage."""
    body = {"model": "smollm2", "prompt": PROMPT, "repetition_penalty": 1.0, "max_tokens": 10, "logprobs": None,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200
        events = _events(r)
    assert events[-1]["usage"]["completion_tokens"] == 10  # ignore_eos: every token asked for
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"


BAD = [
    ({"prompt": [PROMPT, PROMPT]}, "prompt", "unsupported_parameter"),
    ({"prompt": [[1, 2], [3]]}, "prompt", "unsupported_parameter"),
    ({"prompt": [1, 10 ** 9]}, "prompt", "invalid_value"),
    ({"prompt": [1, -3]}, "prompt", "invalid_value"),
    ({"prompt": []}, "prompt", "invalid_value"),
    ({"prompt": ""}, "prompt", "invalid_value"),
    ({"prompt": "word " * 9000}, "prompt", "context_length_exceeded"),
    ({"prompt": "x" * 10 ** 6}, "prompt", "context_length_exceeded"),
    ({"prompt": [1] * 20000}, "prompt", "context_length_exceeded"),  # over max_model_len (8192)
    ({"max_tokens": 5000}, "max_tokens", "context_length_exceeded"),
    ({"logprobs": 2}, "logprobs", "unsupported_parameter"),
    ({"logprobs": 6}, "logprobs", "invalid_value"),
    ({"echo": True, "logprobs": 0}, "echo", "unsupported_parameter"),
    ({"temperature": 5}, "temperature", "invalid_value"),
    ({"stop": ["a"] * 17}, "stop", "invalid_value"),
    ({"suffix": "the end"}, "suffix", "unsupported_parameter"),
    ({"n": 2}, "n", "unsupported_parameter"),
    ({"best_of": 3}, "best_of", "unsupported_parameter"),
    ({"repetition_penalty": 1.3}, "repetition_penalty", "unsupported_parameter"),
    ({"messages": []}, "messages", "unknown_parameter"),
]


@pytest.mark.parametrize("extra,param,code", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_invalid_requests_name_the_field(live, extra, param, code):
    r = _post(live, {"model": "smollm2", "prompt": PROMPT, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] is not None and err["param"].startswith(param) and err["code"] == code, err
    assert engine_state(live)["contexts"] == 0


def test_neutral_values_and_errors_through_the_client(live, client):
    r = client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2, n=1, best_of=1, presence_penalty=0,
                                  frequency_penalty=0, logit_bias={}, suffix=None, user="u-1")
    assert r.usage.completion_tokens <= 2
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=PROMPT)
    bad = openai.OpenAI(base_url=live.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="smollm2", prompt=PROMPT)


def test_per_key_limit_counts_text_completions(live):
    """A key that may hold one completion in flight (limits.max_concurrent_requests: 1) is refused a
    second one, text or chat, with 429 while a text completion streams."""
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    auth = {"Authorization": f"Bearer {ONE}"}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, headers=auth, timeout=60) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the connection
        assert next(lines).startswith("data: ")  # the first completion is in flight
        for path, more in (("/v1/completions", {"prompt": PROMPT}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            second = httpx.post(live.url + path, json={"model": "smollm2", "max_tokens": 1, **more}, headers=auth,
                                timeout=60)
            assert second.status_code == 429, second.text
            assert second.json()["error"]["code"] == "rate_limit_exceeded"
    st = wait_idle(live)
    assert st["contexts"] == 0 and st["used_blocks"] == 0


def test_client_disconnect_mid_stream_frees_the_context(live):
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as r:
        lines = r.iter_lines()
        for i, _ in enumerate(lines):
            if i == 6:
                assert engine_state(live)["contexts"] == 1  # generating, client still reading
                break
        lines.close()  # the client goes away mid-stream
    st = wait_idle(live)
    assert st["contexts"] == 0 and st["used_blocks"] == 0


def test_metrics_count_text_completions(live, client):
    client.completions.create(model="smollm2", prompt=PROMPT, max_tokens=2)
    text = httpx.get(live.url + "/metrics").text
    assert 'interlace_requests_total{endpoint="/v1/completions",model="smollm2",status="200"}' in text
    assert 'interlace_time_to_first_token_seconds_count{model="smollm2"}' in text
