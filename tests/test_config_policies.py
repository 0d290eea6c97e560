"""The ``engine:`` policy section: defaults, per-model overrides, clear errors,
and the profile a model's policies reason with (file, built-in or measured once
and cached)."""

from __future__ import annotations

import json
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from interlace.engine_ext.policies import INTERCEPTION_NAMES, RANKING_NAMES, Profile
from interlace.engine_ext.native.setup import engine_profile
from interlace.gateway.config import ConfigError, load_config, parse_config


def test_defaults_are_the_papers():
    m = load_config("configs/default.yaml").models["smollm2"]
    p = m.policy
    assert (p.interception, p.ranking, p.starvation_threshold, p.refresh_interval) == ("infercept", "lamps", 100, 1)
    assert p.profile == "auto" and p.prefix_caching is True
    assert p.swap_space_tokens == 16384  # as large as the KV cache
    r = m.retention  # a gateway setting beside the engine policy
    assert (r.enabled, r.max_contexts, r.max_tokens, r.ttl_s) == (True, 64, 8192, 600.0)  # half the KV cache
    bare_m = parse_config({"models": {"m": {"path": "x", "kv_cache_tokens": 1000}}}).models["m"]
    bare = bare_m.policy
    assert (bare.interception, bare.ranking, bare.swap_space_tokens, bare_m.retention.max_tokens) == (
        "infercept", "lamps", 1000, 500)


def test_models_override_the_engine_section():
    cfg = parse_config({"engine": {"interception": "swap", "ranking": "fcfs", "profile": "h100-llama-3-8b",
                                   "retention": {"ttl_s": 5, "max_contexts": 3}},
                        "models": {"a": {"path": "x"},
                                   "b": {"path": "x", "interception": "preserve", "retention": {"max_contexts": 1},
                                         "starvation_threshold": 7}}})
    a, b = cfg.models["a"].policy, cfg.models["b"].policy
    ar, br = cfg.models["a"].retention, cfg.models["b"].retention
    assert (a.interception, a.ranking, ar.max_contexts, ar.ttl_s) == ("swap", "fcfs", 3, 5.0)
    assert (b.interception, b.ranking, b.starvation_threshold) == ("preserve", "fcfs", 7)
    assert (br.max_contexts, br.ttl_s) == (1, 5.0)  # key by key
    assert "interception" not in cfg.models["b"].engine_args  # the engine's own arguments stay apart


@pytest.mark.parametrize("data,where,choices", [
    ({"engine": {"interception": "nope"}, "models": {"m": {"path": "x"}}}, "engine.interception", INTERCEPTION_NAMES),
    ({"models": {"m": {"path": "x", "ranking": "fifo"}}}, "models.m.ranking", RANKING_NAMES),
])
def test_unknown_policy_names_list_the_choices(data, where, choices):
    with pytest.raises(ConfigError) as e:
        parse_config(data, "gw.yaml")
    msg = str(e.value)
    assert f"gw.yaml: {where}: " in msg and all(repr(c) in msg for c in choices)


def test_bad_profile_is_a_config_error_naming_the_file(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError, match=rf"gw.yaml: engine.profile: .*{missing}"):
        parse_config({"engine": {"profile": str(missing)}, "models": {"m": {"path": "x"}}}, "gw.yaml")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": "m"}))
    with pytest.raises(ConfigError, match=rf"gw.yaml: models.m.profile: {bad}: missing fields"):
        parse_config({"models": {"m": {"path": "x", "profile": str(bad)}}}, "gw.yaml")
    with pytest.raises(ConfigError, match="engine.retention.ttl_s"):
        parse_config({"engine": {"retention": {"ttl_s": 0}}, "models": {"m": {"path": "x"}}}, "gw.yaml")


def fake_engine():
    return SimpleNamespace(model=torch.nn.Linear(1, 1), device=torch.device("cpu"), name="tiny", block_size=16,
                           blocks=SimpleNamespace(num_blocks=64), scheduler=SimpleNamespace(max_batched_tokens=128))


def test_auto_profile_is_measured_once_then_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("INTERLACE_CACHE", str(tmp_path))
    measured = Profile.load("h100-llama-3-8b")
    calls = []
    prof = types.ModuleType("interlace.engine_ext.native.profiler")
    prof.measure_profile = lambda engine, quick=False: calls.append(quick) or measured
    prof.METHOD = 7
    monkeypatch.setitem(sys.modules, prof.__name__, prof)
    first = engine_profile(fake_engine(), "auto", host_pool_tokens=512)
    second = engine_profile(fake_engine(), "auto", host_pool_tokens=512)
    assert calls == [True] and first == second  # measured once (quickly), then read from the cache
    (cached,) = (tmp_path / "profiles").iterdir()
    assert cached.name == "tiny-float32-cpu-bs16-m7.json"  # a new measuring method measures again
    # the times are the model's and device's; the capacities are this engine's
    assert first.fwd_seconds == measured.fwd_seconds
    assert (first.kv_capacity_tokens, first.max_batched_tokens, first.host_capacity_tokens) == (1024, 128, 512)
    cached.write_text("{broken")  # a damaged cache entry is measured again, not an error
    engine_profile(fake_engine(), "auto")
    assert calls == [True, True] and Profile.load(cached).fwd_seconds == measured.fwd_seconds


def test_named_profile_is_used_as_is():
    assert engine_profile(fake_engine(), "h100-gpt-j-6b") == Profile.load("h100-gpt-j-6b")
