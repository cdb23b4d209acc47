#!/usr/bin/env bash
# The project's test command (README "Build and test"); .ci/run calls it. On a fresh machine it installs
# what it needs (OpenVINO 2026.4.1 from PyPI into .venv), builds the C library and the OpenVINO
# extension module (the workspace's two cdylibs), and runs every suite: Rust tests (kernel vs
# float64 reference, validation, shape inference, C ABI, C/C++ programs, the C programs under
# valgrind, cache manager, install to a prefix; the IR loader and `pa` in cli/; that neither
# shipped library holds the IR loader or quick-xml), Python tests in OpenVINO, the golden
# conformance suite through both our executor and OpenVINO with the extension, and a short run of every fuzz target (FUZZ_SECONDS each, default 25; 0
# skips it), which fails the command if it finds a crash. The tests that read the test hooks
# (Cargo feature test-hooks) also run on a build with them, in target/test-hooks.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

echo "== setup"
./scripts/setup.sh

echo "== build (release: the C library, the OpenVINO extension module, the binaries)"
cargo build --release --workspace --bins --lib

echo "== rust tests"
cargo test --release --workspace

# The test hooks (Cargo feature test-hooks: per-item thread-kind counters and pa_item_counts_get,
# the AMX item counter, the pool workers' CPUs, a public run_reference_u8) are not in what
# ships, so the tests that read them run again on a build with them, in a target dir of its own
# (target/test-hooks: the library's output files carry no hash, so a build with other features
# in target/ would overwrite the shipped ones). Only the library, the OpenVINO extension (for
# one Python test) and the test binaries below are built there, not the engine.
HOOKS=(--release --no-default-features --features paged_attention/test-hooks)
HOOK_TESTS=(--test host_runner --test pool_affinity --test amx --test nonfinite --test u8_attention
  --test header_abi --test c_abi)
echo "== rust tests of the test hooks (feature test-hooks, target/test-hooks)"
# One build of the extension and the test binaries, so the library is compiled once: the tests'
# dev-dependencies change features of its dependencies (rayon's either), so the extension built
# alone would need a library of its own.
CARGO_TARGET_DIR=target/test-hooks cargo build "${HOOKS[@]}" -p paged_attention -p paged_attention_openvino \
  --lib "${HOOK_TESTS[@]}" --example scaling_sim
CARGO_TARGET_DIR=target/test-hooks cargo test "${HOOKS[@]}" -p paged_attention "${HOOK_TESTS[@]}"

echo "== instruction-set tiers this machine exercised against their scalar twins"
# (Informational: the tests above already assert that every tier the CPU has was run.)
{ grep -o -w -E 'avx2|avx512f|avx512_bf16|avx512_fp16|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ' | sed 's/^/CPU flags: /'; echo; } || true
cargo test --release -q --test fast_vs_reference every_tier -- --nocapture 2>&1 | grep -E '^tiers exercised' || true
CARGO_TARGET_DIR=target/test-hooks cargo test "${HOOKS[@]}" -q -p paged_attention --test amx -- --nocapture 2>&1 | grep -E '^TIER' | sort -u | head -3 || true

if [ -d tests/python ] || ls tools/test_*.py >/dev/null 2>&1; then
  echo "== python tests (OpenVINO)"
  export PA_EXTENSION_LIB="$PWD/target/release/libpaged_attention_openvino.so"
  .venv/bin/python -m pytest -q $( [ -d tests/python ] && echo tests/python ) $(ls tools/test_*.py 2>/dev/null)
  echo "== python tests of the test hooks (the extension built with test-hooks)"
  PA_TEST_HOOKS=1 PA_EXTENSION_LIB="$PWD/target/test-hooks/release/libpaged_attention_openvino.so" \
    .venv/bin/python -m pytest -q tests/python/test_openvino_ext.py -k test_work_runs_on_openvino_threads
fi

if [ -x target/release/pa ] && [ -d models ]; then
  echo "== conformance suite"
  target/release/pa conformance --require-openvino models
fi

if [ "${FUZZ_SECONDS:-25}" -gt 0 ]; then
  echo "== fuzz (short run of each target)"
  scripts/fuzz.sh all "${FUZZ_SECONDS:-25}"
fi
