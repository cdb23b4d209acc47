#!/usr/bin/env bash
# Coverage-guided fuzzing of the library (fuzz/, see docs/reliability.md).
#
#   scripts/fuzz.sh [TARGET|all] [SECONDS]     default: all 25
#
# Targets: ir_xml npy infer_shapes execute cache_manager scheduler. Each target runs for SECONDS
# (one after another, one process: the machine may have 2 cores), starting from the corpus in
# fuzz/corpus/TARGET, seeded from models/ by fuzz/seeds.py and grown by every run. A crash, a
# failed check, a hang (> 20 s per input) or a run that does not stop in time fails the script
# (exit 1); the input that triggered it is kept in fuzz/artifacts/TARGET/. Reproduce with
#   fuzz/target/<host>/release/TARGET fuzz/artifacts/TARGET/crash-...
#
# Built with stable Rust: libFuzzer (libfuzzer-sys, which compiles it with the C++ compiler) and
# LLVM's SanitizerCoverage passes enabled through RUSTFLAGS; no sanitizer runtime, so the harness
# itself catches out-of-bounds accesses (guard pages) and wrong results (model checks).
# Extra libFuzzer flags can be passed in FUZZ_FLAGS (e.g. FUZZ_FLAGS="-jobs=2 -workers=2").
set -euo pipefail
cd "$(dirname "$0")/.."

all=(ir_xml npy infer_shapes execute cache_manager scheduler)
which=${1:-all}
secs=${2:-25}
if [ "$which" = all ]; then
  targets=("${all[@]}")
else
  targets=("$which")
  [[ " ${all[*]} " == *" $which "* ]] || { echo "fuzz.sh: unknown target '$which' (one of: ${all[*]}, all)" >&2; exit 2; }
fi
[[ "$secs" =~ ^[0-9]+$ ]] && [ "$secs" -ge 1 ] || { echo "fuzz.sh: SECONDS must be a positive integer" >&2; exit 2; }

host=$(rustc -vV | sed -n 's/^host: //p')
# The instrumentation applies to the target crates only (--target keeps build scripts and
# proc-macros uninstrumented); `--cfg fuzzing` is what cargo-fuzz sets too.
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing"
# Overflow checks and debug assertions come from fuzz/Cargo.toml's release profile.
export CARGO_TARGET_DIR="$PWD/fuzz/target"
echo "== fuzz: build (${targets[*]})"
(cd fuzz && cargo build --release -j2 --locked --target "$host" $(printf -- '--bin %s ' "${targets[@]}"))
python3 fuzz/seeds.py fuzz/corpus

failed=()
for t in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$t" "fuzz/artifacts/$t"
  log="fuzz/artifacts/$t/last-run.log"
  echo "== fuzz: $t for ${secs}s"
  rc=0
  # -max_total_time stops libFuzzer; `timeout` is the backstop if it ever does not (the KILL
  # after a further 30 s covers a process that ignores TERM).
  timeout -k 30 $((secs + 120)) "fuzz/target/$host/release/$t" \
    -max_total_time="$secs" -timeout=20 -rss_limit_mb=2048 -max_len=1200000 -print_final_stats=1 \
    -artifact_prefix="fuzz/artifacts/$t/" ${FUZZ_FLAGS:-} "fuzz/corpus/$t" >"$log" 2>&1 || rc=$?
  grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb|Done)|cov:' "$log" | tail -3 || true
  if [ "$rc" -ne 0 ]; then
    echo "fuzz: $t FAILED (exit $rc); log $log:" >&2
    grep -E -A12 'panicked|ERROR|SUMMARY|Test unit written' "$log" | head -40 >&2 || tail -40 "$log" >&2
    failed+=("$t")
  fi
done
if [ ${#failed[@]} -ne 0 ]; then
  echo "fuzz: failures in: ${failed[*]}" >&2
  exit 1
fi
echo "fuzz: no crash found in ${targets[*]} (${secs}s each)"
