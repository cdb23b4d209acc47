//! The environment variables the library reads, all here at its edges (the C ABI, the
//! extension through it, the binaries and benchmarks): the kernels take options
//! (`kernel::fast::FastOptions`) and read none.
//!
//! - `PA_SIMD=scalar|avx2|avx512|avx512bf16|amx`: caps the SIMD level of every call (a level
//!   the CPU lacks gives the best one it has; an unknown name the detected one).
//! - `PA_BF16_QUERY=1` / `=0`: overrides the inference precision a caller asked for (bf16 /
//!   f32), for measuring one against the other without changing the caller; unset or any other
//!   value leaves the caller's choice.
//!
//! - `PA_SERIAL_BELOW=N`: calls whose work is below `N` (`kernel::fast::call_work`) run on
//!   the calling thread alone, whatever the runner (`FastOptions::serial_below` and
//!   `host_serial_below`; 0: never); unset or not a number: the library's defaults
//!   (`kernel::fast::SERIAL_BELOW` on its pool, `HOST_SERIAL_BELOW` on a host's runner).
//!
//! Each is read once per process.

use crate::kernel::fast::{FastOptions, Precision, SimdLevel};
use crate::threads::Runner;
use std::sync::{Once, OnceLock};

/// The detected level, or the one `PA_SIMD` asks for, capped at the detected one.
pub fn simd_level() -> SimdLevel {
    static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
    *LEVEL.get_or_init(|| {
        std::env::var("PA_SIMD")
            .ok()
            .and_then(|v| SimdLevel::parse(&v))
            .map_or_else(SimdLevel::detected, SimdLevel::effective)
    })
}

/// The work below which a call runs on the calling thread, whatever the runner, when
/// `PA_SERIAL_BELOW` sets it.
pub fn serial_below() -> Option<usize> {
    static BELOW: OnceLock<Option<usize>> = OnceLock::new();
    *BELOW.get_or_init(|| {
        std::env::var("PA_SERIAL_BELOW")
            .ok()
            .and_then(|v| v.trim().parse().ok())
    })
}

/// The precision `PA_BF16_QUERY` forces, if any: `1` bf16, `0` f32.
pub fn precision_override() -> Option<Precision> {
    static P: OnceLock<Option<Precision>> = OnceLock::new();
    *P.get_or_init(|| match std::env::var("PA_BF16_QUERY").as_deref() {
        Ok("1") => Some(Precision::Bf16),
        Ok("0") => Some(Precision::F32),
        _ => None,
    })
}

/// The options of a call made through an edge: the caller's runner and precision (unless
/// `PA_BF16_QUERY` overrides it), the level `PA_SIMD` allows. A bf16 precision the CPU cannot
/// run falls back to f32 (`Precision::effective`), said once per process on stderr.
pub fn fast_options(runner: Runner, asked: Precision) -> FastOptions {
    let simd = simd_level();
    let precision = precision_override().unwrap_or(asked);
    if precision.effective(simd) != precision {
        static SAID: Once = Once::new();
        SAID.call_once(|| {
            eprintln!(
                "paged_attention: bf16 inference precision asked, but this CPU (or PA_SIMD={}) has \
                 no bf16 products (AVX512-BF16 or AMX); computing in f32",
                simd.name()
            )
        });
    }
    let (defaults, below) = (FastOptions::default(), serial_below());
    FastOptions {
        simd,
        runner,
        precision,
        serial_below: below.unwrap_or(defaults.serial_below),
        host_serial_below: below.unwrap_or(defaults.host_serial_below),
        ..defaults
    }
}
