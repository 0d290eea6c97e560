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
    assert cfg.api_keys == ["s3cret"]
    monkeypatch.delenv("GW_KEY")
    with pytest.raises(ConfigError, match=r"server.api_keys\[0\]: environment variable 'GW_KEY' is not set"):
        parse_config({"server": {"api_keys": ["os.environ/GW_KEY"]}, "models": {"m": {"path": "x"}}}, "f.yaml")


def test_serve_refuses_invalid_config(tmp_path):
    p = write(tmp_path, "models:\n  m: {path: embedded, block_size: 0}\n")
    out = subprocess.run([sys.executable, "-m", "interlace.gateway.cli", "serve", "--config", str(p)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert f"{p}: models.m.block_size: 0 is less than the minimum of 1" in out.stderr
