#!/usr/bin/env bash
# The golden suite: installs OpenVINO 2026.4.1 into .venv if needed, builds the library, the
# OpenVINO extension module and `pa` (cli/), and runs models/ through `pa`'s IR executor and
# through OpenVINO with the extension loaded. Extra arguments go to `pa conformance`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
cargo build --release --workspace --lib --bin pa
exec target/release/pa conformance --require-openvino "$@" models
