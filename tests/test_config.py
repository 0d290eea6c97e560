"""Gateway configuration: validation errors name the file, the key path and what was expected."""

import subprocess
import sys

import pytest

from interlace.gateway.config import ConfigError, load_config, parse_config


def write(tmp_path, text):
    p = tmp_path / "gw.yaml"
    p.write_text(text)
    return p


def test_default_config_is_valid():
    cfg = load_config("configs/default.yaml")
    assert cfg.port == 8000 and cfg.models["smollm2"].parser == "hermes"
    assert cfg.models["smollm2"].engine_args["dtype"] == "auto"


@pytest.mark.parametrize("text,needle", [
    ("models:\n  m: {path: embedded, dtype: fp64}\n", "models.m.dtype: 'fp64' is not one of"),
    ("models: {}\n", "models: {} should be non-empty"),
    ("server: {port: 99999}\nmodels:\n  m: {path: x}\n", "server.port: 99999 is greater than the maximum"),
    ("models:\n  m: {path: x, colour: red}\n", "models.m: Additional properties are not allowed ('colour'"),
    ("server: {port: 1}\n", "(top level): 'models' is a required property"),
    ("models: [1, 2\n", "not valid YAML"),
])
def test_invalid_config_messages(tmp_path, text, needle):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(p) in str(e.value) and needle in str(e.value)


def test_secrets_from_environment(monkeypatch):
    monkeypatch.setenv("GW_KEY", "s3cret")
    cfg = parse_config({"server": {"api_keys": ["os.environ/GW_KEY"]}, "models": {"m": {"path": "x"}}})
    assert [k.key for k in cfg.api_keys] == ["s3cret"] and cfg.api_keys[0].name == "key0"
    monkeypatch.delenv("GW_KEY")
    with pytest.raises(ConfigError, match=r"server.api_keys\[0\]: environment variable 'GW_KEY' is not set"):
        parse_config({"server": {"api_keys": ["os.environ/GW_KEY"]}, "models": {"m": {"path": "x"}}}, "f.yaml")


def test_serve_refuses_invalid_config(tmp_path):
    p = write(tmp_path, "models:\n  m: {path: embedded, block_size: 0}\n")
    out = subprocess.run([sys.executable, "-m", "interlace.cli", "serve", "--config", str(p)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"{p}: models.m.block_size: 0 is less than the minimum of 1" in out.stderr


def test_default_config_is_safe():
    """As shipped: no client may run server-side tools or force output, no browser origin is
    allowed, and requests without max_tokens get a bounded default."""
    cfg = load_config("configs/default.yaml")
    assert cfg.server_tools is False and cfg.replay is False
    assert cfg.cors_origins == [] and cfg.api_keys == []
    assert cfg.default_max_tokens == 1024


def test_api_keys_with_names_and_permissions():
    cfg = parse_config({"server": {"server_tools": ["calculator"], "replay": False, "api_keys": [
        "plain", {"key": "k2", "name": "agent", "server_tools": True, "replay": True},
        {"key": "k3", "name": "bench", "replay": True}]}, "models": {"m": {"path": "x"}}})
    plain, agent, bench = cfg.api_keys
    assert (plain.name, plain.server_tools, plain.replay) == ("key0", ["calculator"], False)  # server-level
    assert (agent.name, agent.server_tools, agent.replay) == ("agent", True, True)
    assert (bench.name, bench.server_tools, bench.replay) == ("bench", ["calculator"], True)
    assert "k2" not in repr(agent)  # a key's repr (logs) never shows the secret


@pytest.mark.parametrize("keys,needle", [
    (["a", "a"], "server.api_keys[1]: duplicate key"),
    ([{"key": "a", "name": "x"}, {"key": "b", "name": "x"}], "server.api_keys[1]: duplicate name 'x'"),
    ([{"key": "a", "server_tools": "python"}], "server.api_keys[0]"),
    ([{"key": "a", "admin": True}], "server.api_keys[0]"),
])
def test_invalid_api_keys(keys, needle):
    with pytest.raises(ConfigError) as e:
        parse_config({"server": {"api_keys": keys}, "models": {"m": {"path": "x"}}}, "f.yaml")
    assert needle in str(e.value)


def test_generate_with_missing_model_is_one_error_line():
    out = subprocess.run([sys.executable, "-m", "interlace.cli", "generate", "hi", "--model", "/nonexistent"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [
        "interlace: error: cannot load the model /nonexistent: model path '/nonexistent' is neither a model "
        "directory nor a .gguf file"]


@pytest.mark.parametrize("command,text,needle", [
    ("serve", "models:\n  m: {path: /nonexistent/model}\n", "models.m.path: '/nonexistent/model' does not exist"),
    ("serve", "models:\n  m: {path: embedded, parser: nope}\n", "models.m.parser: unknown parser 'nope'"),
    ("serve", "models:\n  m: {path: tests, weights: as-shipped}\n", "models.m.engine.weights: weights: as-shipped runs"),
    ("serve", "models:\n  m: {path: embedded}\nplugins: {modules: [no_such_plugin_mod]}\n",
     "cannot import a plugin module: No module named 'no_such_plugin_mod'"),
    ("plugins", "models:\n  m: {path: embedded}\nplugins: {modules: [no_such_plugin_mod]}\n",
     "No module named 'no_such_plugin_mod'"),
    ("plugins", "models: {}\n", "models: {} should be non-empty"),
    # garbage where the response store's SQLite file should be
    ("serve", "server: {responses: {path: corrupt.db}}\nmodels:\n  m: {path: embedded}\n",
     "server.responses.path: the response store"),
])
def test_cli_user_mistakes_are_one_clear_line(tmp_path, command, text, needle):
    (tmp_path / "corrupt.db").write_bytes(b"not a database " * 300)
    p = write(tmp_path, text)
    out = subprocess.run([sys.executable, "-m", "interlace.cli", command, "--config", str(p)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert needle in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_plugins_command_shows_tool_info(tmp_path):
    """`interlace plugins` prints what each tool's ``info()`` reports (e.g. its isolation)."""
    import os
    from pathlib import Path

    p = write(tmp_path, "models:\n  m: {path: embedded}\nplugins: {entrypoints: false, modules: [helpers.info_plugin]}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "interlace.cli", "plugins", "--config", str(p)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    i = lines.index("  tool    probe")
    assert lines[i + 1].strip() == "isolation: none (test probe)"
    assert lines[i + 2].strip() == 'limits: {"memory_mb": 1024}'


def test_plugins_lists_without_the_secrets_and_serve_names_the_missing_one(tmp_path):
    """`interlace plugins` needs none of the API keys' variables (issue 30): it lists the plugins
    with them unset; `serve` of the same file still stops on the first missing one, in one line."""
    import os

    p = write(tmp_path, "server:\n  api_keys: [os.environ/IL_TEST_UNSET_KEY, {key: os.environ/IL_TEST_UNSET_AGENT,"
                        " name: agent}]\n  metrics_key: os.environ/IL_TEST_UNSET_METRICS\nmodels:\n"
                        "  m: {path: embedded}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("IL_TEST_UNSET_")}
    listing = subprocess.run([sys.executable, "-m", "interlace.cli", "plugins", "--config", str(p)],
                             capture_output=True, text=True, timeout=120, env=env)
    assert listing.returncode == 0, listing.stderr
    assert "  tool    calculator" in listing.stdout.splitlines(), listing.stdout
    serve = subprocess.run([sys.executable, "-m", "interlace.cli", "serve", "--config", str(p)],
                           capture_output=True, text=True, timeout=120, env=env)
    assert serve.returncode == 2, serve.stderr
    assert "server.api_keys[0]: environment variable 'IL_TEST_UNSET_KEY' is not set" in serve.stderr
    assert "Traceback" not in serve.stderr, serve.stderr
    # the library call the listing makes: unset secrets stay as written, nothing else changes
    cfg = load_config(p, require_secrets=False)
    assert [k.key for k in cfg.api_keys] == ["os.environ/IL_TEST_UNSET_KEY", "os.environ/IL_TEST_UNSET_AGENT"]
    with pytest.raises(ConfigError, match="IL_TEST_UNSET_KEY"):
        load_config(p)


# ------------------------------------------------------------ engines and replicas (issue #11)
def test_engine_objects_and_replicas():
    cfg = parse_config({"models": {
        "plain": {"path": "embedded"},
        "two": {"path": "embedded", "kv_cache_tokens": 4096, "replicas": 2,
                "engine": {"kind": "native", "worker": "process", "max_seqs": 8}},
        "mixed": {"path": "/models/Llama-3.1-8B/", "replicas": [
            "native", {"kind": "vllm", "tensor_parallel_size": 2, "args": {"swap_space": 4}},
            {"kind": "openai", "url": "http://10.0.0.5:8000/v1", "api_key": "k", "timeout_s": 30}]},
    }}, "f.yaml")
    plain, two, mixed = (cfg.models[n] for n in ("plain", "two", "mixed"))
    native = {"kind": "native", "worker": "thread", "dtype": "auto", "block_size": 16, "kv_cache_tokens": 16384,
              "max_batched_tokens": 512, "max_seqs": 256, "attention": "auto"}
    # as before: one native in-process engine; its cache sized by GPU memory on CUDA (kv_cache_tokens not set)
    assert plain.engine == "native" and plain.replicas == [{**native, "gpu_memory_utilization": 0.9}]
    assert plain.engine_args["kv_cache_tokens"] == 16384
    assert two.replicas == [{**native, "worker": "process", "kv_cache_tokens": 4096, "max_seqs": 8}] * 2
    assert mixed.engine == "native" and [r["kind"] for r in mixed.replicas] == ["native", "vllm", "openai"]
    assert mixed.replicas[1] == {"kind": "vllm", "tensor_parallel_size": 2, "args": {"swap_space": 4}}
    assert "model" not in mixed.replicas[2]  # the remote model's name: the one its server serves
    vllm = parse_config({"models": {"m": {"path": "x", "engine": "vllm"}}}).models["m"]
    assert vllm.engine == "vllm" and vllm.replicas == [{"kind": "vllm"}]


@pytest.mark.parametrize("model,needle", [
    ({"engine": {"kind": "tgi"}}, "models.m.engine.kind: 'tgi' is not one of ['native', 'vllm', 'openai']"),
    ({"engine": "openai"}, "models.m.engine: 'openai' is not one of ['native', 'vllm']"),
    ({"engine": {"worker": "thread"}}, "models.m.engine: 'kind' is a required property"),
    ({"replicas": 0}, "models.m.replicas: 0 is less than the minimum of 1"),
    ({"replicas": []}, "models.m.replicas: [] should be non-empty"),
    ({"replicas": "2"}, "models.m.replicas: '2' is not of type 'integer', 'array'"),
    ({"engine": {"kind": "openai"}}, "models.m.engine: 'url' is a required property"),
    ({"replicas": [{"kind": "openai", "url": "ftp://host/v1"}]}, "models.m.replicas[0].url: 'ftp://host/v1' does not"),
    ({"engine": {"kind": "vllm", "tensor_parallel_size": 0}},
     "models.m.engine.tensor_parallel_size: 0 is less than the minimum of 1"),
    ({"engine": {"kind": "vllm", "gpu_memory_utilization": 1.5}},
     "models.m.engine.gpu_memory_utilization: 1.5 is greater than the maximum of 1"),
    ({"engine": {"kind": "vllm", "distributed_executor_backend": "slurm"}},
     "models.m.engine.distributed_executor_backend: 'slurm' is not one of"),
    ({"engine": {"kind": "vllm", "pin_budget": 1.5}}, "models.m.engine.pin_budget: 1.5 is greater than the maximum"),
    ({"engine": {"kind": "vllm", "pin_budget": "half"}}, "models.m.engine.pin_budget: 'half' is not of type"),
    ({"engine": {"kind": "vllm", "pin_ttl_s": 0}}, "models.m.engine.pin_ttl_s: 0 is less than or equal to the minimum"),
    ({"engine": {"kind": "vllm", "tensor_parallel": 2}},
     "models.m.engine: Additional properties are not allowed ('tensor_parallel' was unexpected)"),
    ({"replicas": ["native", {"kind": "vllm", "url": "http://x"}]},
     "models.m.replicas[1]: Additional properties are not allowed ('url' was unexpected)"),
    ({"engine": {"kind": "native", "worker": "fork"}}, "models.m.engine.worker: 'fork' is not one of"),
    ({"engine": {"kind": "native", "block_size": 0}}, "models.m.engine.block_size: 0 is less than the minimum"),
    ({"engine": "native", "replicas": ["native"]}, "models.m.replicas: a list of replicas names each one's engine"),
])
def test_invalid_engines_and_replicas(model, needle):
    with pytest.raises(ConfigError) as e:
        parse_config({"models": {"m": {"path": "x", **model}}}, "f.yaml")
    assert "f.yaml" in str(e.value) and needle in str(e.value), str(e.value)


def test_engine_secrets_from_environment(monkeypatch):
    monkeypatch.setenv("REMOTE_KEY", "s3cret")
    cfg = parse_config({"models": {"m": {"path": "x", "engine": {"kind": "openai", "url": "https://h/v1",
                                                                   "api_key": "os.environ/REMOTE_KEY"}}}})
    assert cfg.models["m"].replicas[0]["api_key"] == "s3cret"


def test_a_remote_replicas_api_key_is_not_printed(monkeypatch):
    monkeypatch.setenv("REMOTE_KEY", "s3cret-value")
    cfg = parse_config({"models": {"m": {"path": "x", "engine": {"kind": "openai", "url": "https://h/v1",
                                                                   "api_key": "os.environ/REMOTE_KEY"}}}})
    assert "s3cret-value" not in repr(cfg.models["m"]) and "***" in repr(cfg.models["m"])


def test_engine_threads_are_set_before_engines_load_and_shared_by_process_replicas(caplog):
    import asyncio
    import os

    import torch

    from interlace.gateway.app import Gateway
    from interlace.gateway.models import _process_threads

    old = torch.get_num_threads()
    seen = []

    def factory(spec):
        seen.append(torch.get_num_threads())
        raise RuntimeError("stop here")

    try:
        from interlace.engine_ext.native.cores import usable_cores

        for engine, expected in (({"threads": 1}, 1), ({}, usable_cores())):
            torch.set_num_threads(3)
            cfg = parse_config({"engine": engine, "models": {"m": {"path": "embedded"}}})
            caplog.clear()
            caplog.set_level("INFO", logger="interlace.gateway.app")
            with pytest.raises(RuntimeError, match="stop here"):
                asyncio.run(Gateway(cfg, engine_factory=factory).start(None))
            assert seen[-1] == expected
            assert any(f"native engine threads: at most {expected} (" in r.getMessage() for r in caplog.records)
        torch.set_num_threads(4)
        spec = parse_config({"models": {"m": {"path": "embedded", "replicas": [
            {"kind": "native", "worker": "process"}, {"kind": "native", "worker": "process", "threads": 3},
            {"kind": "native"}]}}}).models["m"]
        assert _process_threads(spec) == 2  # 4 threads over 2 process replicas
    finally:
        torch.set_num_threads(old)


@pytest.mark.parametrize("raw, needle", [
    ({"engine": {"threads": 0}}, "engine.threads"),
    ({"models": {"m": {"path": "embedded", "engine": {"kind": "native", "threads": 2}}}}, "only for a replica with worker: process"),
])
def test_thread_setting_errors(raw, needle):
    with pytest.raises(ConfigError, match=needle):
        parse_config({"models": {"m": {"path": "embedded"}}, **raw})


def test_every_native_setting_the_config_accepts_reaches_the_engine(monkeypatch):
    """The native engine declares its settings once (engine_ext/native/options.py): the config's enums
    are its names, and every native setting a config validates is passed on to NativeEngine.load (the
    gateway's own key list once dropped cuda_graphs and gpu_memory_utilization silently)."""
    from interlace.engine_ext.native import options
    from interlace.gateway import models
    from interlace.gateway.config import NATIVE_PROPERTIES

    assert NATIVE_PROPERTIES["dtype"]["enum"] == list(options.DTYPES)
    assert NATIVE_PROPERTIES["weights"]["enum"] == list(options.WEIGHTS)
    assert NATIVE_PROPERTIES["attention"]["enum"] == list(options.ATTENTION)
    assert set(NATIVE_PROPERTIES) == set(options.LOAD_KEYS)
    seen = {}
    monkeypatch.setattr(models, "load_native", lambda path, kwargs, policy: seen.update(kwargs) or "engine")
    cfg = parse_config({"models": {"m": {"path": "embedded", "cuda_graphs": False, "gpu_memory_utilization": 0.5,
                                         "max_model_len": 64}}})
    spec = cfg.models["m"]
    assert models.load_replica(spec, spec.replicas[0]) == "engine"
    assert (seen["cuda_graphs"], seen["gpu_memory_utilization"], seen["max_model_len"]) == (False, 0.5, 64)


def test_every_benchmark_command_runs_its_modules_main(monkeypatch):
    import importlib

    from interlace import cli

    for what, module in cli.BENCHMARKS.items():
        mod = importlib.import_module(f"interlace.bench.{module}")
        monkeypatch.setattr(mod, "main", lambda rest, what=what: (what, rest))
        assert cli.cmd_bench(cli.build_parser().parse_args(["bench", what])) == (what, [])


def test_responses_store_settings(tmp_path, monkeypatch):
    """server.responses: the SQLite file under INTERLACE_STATE_DIR by default, a relative path is
    the config file's, ':memory:' stays; the MCP label 'interlace' is the plugin tools', no server's."""
    from interlace.gateway.config import ConfigError, load_config, parse_config

    monkeypatch.setenv("INTERLACE_STATE_DIR", str(tmp_path / "state"))
    models = {"m": {"path": "embedded"}}
    cfg = parse_config({"models": models})
    assert cfg.responses.path == str(tmp_path / "state" / "responses.sqlite3")
    assert (cfg.responses.enabled, cfg.responses.ttl_s, cfg.responses.max_per_key) == (True, 30 * 86400.0, 10_000)
    f = tmp_path / "conf" / "gw.yaml"
    f.parent.mkdir()
    f.write_text("server: {responses: {path: data/r.db, ttl_s: 60, max_per_key: 3}}\nmodels: {m: {path: embedded}}\n")
    cfg = load_config(str(f))
    assert (cfg.responses.path, cfg.responses.ttl_s, cfg.responses.max_per_key) == (
        str(tmp_path / "conf" / "data" / "r.db"), 60.0, 3)
    assert parse_config({"server": {"responses": {"path": ":memory:"}}, "models": models}).responses.path == ":memory:"
    with pytest.raises(ConfigError, match="max_per_key"):
        parse_config({"server": {"responses": {"max_per_key": 0}}, "models": models})
    with pytest.raises(ConfigError, match="reserved"):
        parse_config({"models": models, "mcp_servers": {"interlace": {"command": "x"}}})
