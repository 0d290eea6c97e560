"""Zoo variants served by the gateway (issue #15): each a model name, all of
one base in one block-shared engine (or replicas holding their variants)."""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

from helpers.gateway_server import LiveGateway, wait_idle
from interlace.gateway.config import ConfigError, parse_config

KEY = "zoo-key"
ASK = [{"role": "user", "content": "Name a large city in Europe and say one thing about it."}]
NATIVE = {"kv_cache_tokens": 4096, "dtype": "float32"}


def zoo_config(zoo, **model_extra) -> dict:
    return {"server": {"api_keys": [KEY]}, "zoo": str(zoo.root),
            "models": {name: {"path": f"zoo/{name}", **NATIVE, **model_extra}
                       for name in ("smol", "smol-ft", "smol-lora")}}


def ask(url: str, model: str) -> str:
    c = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    r = c.chat.completions.create(model=model, messages=ASK, max_tokens=24, temperature=0)
    return r.choices[0].message.content


@pytest.fixture(scope="module")
def live(smol_zoo):
    with LiveGateway(zoo_config(smol_zoo)) as gw:
        yield gw


def test_variants_share_one_engine_and_answer_as_alone(live, smol_zoo):
    models = httpx.get(live.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"]
    assert [(m["id"], m["root"], m["parent"]) for m in models] == [
        ("smol", "zoo/smol", "zoo/smol"), ("smol-ft", "zoo/smol-ft", "zoo/smol"),
        ("smol-lora", "zoo/smol-lora", "zoo/smol")]
    engines = {id(m.engine.inner) for m in live.gateway.models.values()}
    assert len(engines) == 1 and len(live.gateway.engines) == 1  # one engine for the three
    # all three at once (one mixed batch), then each alone: the same greedy text
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        mixed = list(pool.map(lambda m: ask(live.url, m), ["smol", "smol-ft", "smol-lora"] * 2))
    sequential = [ask(live.url, m) for m in ("smol", "smol-ft", "smol-lora")]
    assert mixed == sequential * 2
    assert len(set(sequential)) == 3, sequential  # the variants answer differently
    # the full fine-tune served from its own directory as an ordinary model answers the same
    plain = {"server": {"api_keys": [KEY]}, "models": {"ft": {"path": str(smol_zoo.ft_dir), **NATIVE}}}
    with LiveGateway(plain) as gw:
        assert ask(gw.url, "ft") == sequential[1]
    assert wait_idle(live, model="smol-ft")["contexts"] == 0


def test_replicas_hold_their_variants(smol_zoo):
    replicas = [{"kind": "native", "variants": ["smol-ft"]}, {"kind": "native", "variants": ["smol", "smol-lora"]}]
    with LiveGateway(zoo_config(smol_zoo, replicas=replicas)) as gw:
        for m in ("smol-ft", "smol-lora", "smol-ft"):
            ask(gw.url, m)
        metrics = httpx.get(gw.url + "/metrics").text
        rs = gw.gateway.engines[0]
        held = [sorted(r.engine.variant_names) for r in rs.replicas]
        assert held == [["smol", "smol-ft"], ["smol", "smol-lora"]]  # the base is in every engine
        placed = {r.name: sum(r.routed.values()) for r in rs.replicas}
        assert placed == {"0": 2, "1": 1}, placed
        assert 'interlace_replica_routed_total{model="smol-ft",reason="load",replica="0"}' in metrics


def test_zoo_config_errors(smol_zoo, tmp_path):
    from interlace.gateway.models import zoo_engine_specs

    bad = zoo_config(smol_zoo)
    bad["models"]["other"] = {"path": "zoo/nope"}
    with pytest.raises(ConfigError, match="nope"):
        zoo_engine_specs(parse_config(bad, "<t>"))
    with pytest.raises(ConfigError, match="not vllm"):
        parse_config({"models": {"a": {"path": "zoo/smol", "engine": "vllm"}}}, "<t>")
    with pytest.raises(ConfigError, match="only for zoo models"):
        parse_config({"models": {"a": {"path": "embedded", "replicas": [{"kind": "native", "variants": ["x"]}]}}},
                     "<t>")
    uncovered = zoo_config(smol_zoo, replicas=[{"kind": "native", "variants": ["smol-ft"]}])
    with pytest.raises(ConfigError, match="no replica holds the variant"):
        zoo_engine_specs(parse_config(uncovered, "<t>"))
    # an empty zoo directory: the variant is unknown, nothing is created there
    empty = tmp_path / "empty"
    cfg = {"zoo": str(empty), "models": {"a": {"path": "zoo/smol"}}}
    with pytest.raises(ConfigError, match="no variant 'smol'"):
        zoo_engine_specs(parse_config(cfg, "<t>"))
    assert not empty.exists()


def test_serve_checks_zoo_models_before_starting(smol_zoo):
    """``interlace serve``'s pre-start check: zoo paths are looked up in the
    zoo (not on disk), and an unknown variant is one clear line."""
    from interlace.cli import UserError, check_serve_config

    check_serve_config(parse_config(zoo_config(smol_zoo), "<t>"))
    bad = zoo_config(smol_zoo)
    bad["models"]["x"] = {"path": "zoo/missing"}
    with pytest.raises(UserError, match="no variant 'missing'"):
        check_serve_config(parse_config(bad, "<t>"))
