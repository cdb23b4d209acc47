#!/usr/bin/env bash
# README's first command: installs OpenVINO 2026.4.1 into .venv if needed, builds the library
# and the OpenVINO extension module, and runs the golden suite in models/ through this crate's IR
# executor and through OpenVINO with the extension loaded. Extra arguments go to `pa conformance`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
cargo build --release --workspace --lib --bin pa
exec target/release/pa conformance --require-openvino "$@" models
