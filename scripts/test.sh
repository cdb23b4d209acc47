#!/usr/bin/env bash
# The project's test command (README "Test"); .ci/run calls it. On a fresh machine it installs
# what it needs (OpenVINO 2026.4.1 from PyPI into .venv), builds the C library and the OpenVINO
# extension module (the workspace's two cdylibs), and runs every suite: Rust tests (kernel vs
# float64 reference, validation, shape inference, C ABI, C/C++ programs, the C programs under
# valgrind, IR loader, cache manager, install to a prefix), Python tests in OpenVINO, the golden
# conformance suite through both our executor and OpenVINO with the extension, and a short run of every fuzz target (FUZZ_SECONDS each, default 25; 0
# skips it), which fails the command if it finds a crash.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

echo "== setup"
./scripts/setup.sh

echo "== build (release: the C library, the OpenVINO extension module, the binaries)"
cargo build --release --workspace --bins --lib

echo "== rust tests"
cargo test --release --workspace

echo "== instruction-set tiers this machine exercised against their scalar twins"
# (Informational: the tests above already assert that every tier the CPU has was run.)
{ grep -o -w -E 'avx2|avx512f|avx512_bf16|avx512_fp16|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ' | sed 's/^/CPU flags: /'; echo; } || true
cargo test --release -q --test fast_vs_reference every_tier -- --nocapture 2>&1 | grep -E '^tiers exercised' || true
cargo test --release -q --test amx -- --nocapture 2>&1 | grep -E '^TIER' | sort -u | head -3 || true

if [ -d tests/python ] || ls tools/test_*.py >/dev/null 2>&1; then
  echo "== python tests (OpenVINO)"
  export PA_EXTENSION_LIB="$PWD/target/release/libpaged_attention_openvino.so"
  .venv/bin/python -m pytest -q $( [ -d tests/python ] && echo tests/python ) $(ls tools/test_*.py 2>/dev/null)
fi

if [ -x target/release/pa ] && [ -d models ]; then
  echo "== conformance suite"
  target/release/pa conformance --require-openvino models
fi

if [ "${FUZZ_SECONDS:-25}" -gt 0 ]; then
  echo "== fuzz (short run of each target)"
  scripts/fuzz.sh all "${FUZZ_SECONDS:-25}"
fi
