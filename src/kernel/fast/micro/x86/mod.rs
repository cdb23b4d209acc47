//! x86_64 micro-kernels, one file per instruction-set tier and trait; each tier's scalar twin
//! lives in the parent module.
//!
//! - `avx2`: AVX2 + FMA + F16C [`Micro`] (8-wide), chosen only after runtime detection.
//! - `avx2_decode`: its [`DecodeMicro`] loops (decode tiles, with software prefetch).
//! - `avx2_tile`: its [`TileMicro`] loops (prefill tiles on transposed logits).
//! - `avx2_u8`: its `QuantMicro` loops (u8 cache bytes).
//! - `avx512`: AVX-512 F + BW + VL + DQ [`Micro`] (16-wide, masked tails) and the QK / PV
//!   register blocks its decode and prefill loops share.
//! - `avx512_decode`, `avx512_tile`, `avx512_u8`: its [`DecodeMicro`], [`TileMicro`] and
//!   `QuantMicro` (u8 cache bytes) loops.
//! - `amx`: AMX-BF16 tile configuration and the QK / PV tile products of prefill items under
//!   bf16 math (its twin is `scalar_amx` in the parent module).
//! - `bf16`: AVX512-BF16: the bf16 packing of those products' operands (shared with `amx`) and
//!   the same products by `vdpbf16ps` on CPUs without AMX (twin: `scalar_amx`).
//! - `prefetch`, `bounds`: the prefetch cursor and the slice checks every tier uses.
//! - `u8_loops`: the variant choice and row blocks the tiers' `QuantMicro` products share.

// The tier files name the traits as `super::Micro` etc., as they did beside them.
pub(crate) use super::{DecodeMicro, Micro, TileMicro};

pub(crate) mod amx;
pub(crate) mod avx2;
pub(crate) mod avx2_decode;
mod avx2_tile;
mod avx2_u8;
pub(crate) mod avx512;
mod avx512_decode;
mod avx512_tile;
mod avx512_u8;
pub(crate) mod bf16;
mod bounds;
mod prefetch;
mod u8_loops;

/// A tier's proof from its `detect()`, or `None` after saying on stderr that `name` (the
/// instruction set) is missing here and the tests of `what` are skipped: the guard every
/// test of a tier the test machine may lack starts with.
#[cfg(test)]
pub(crate) fn detected<T>(proof: Option<T>, name: &str, what: &str) -> Option<T> {
    if proof.is_none() {
        eprintln!("{name} not available on this machine: {what} tests skipped");
    }
    proof
}

/// Cephes `expf`, the one exp every vector width evaluates: `x = n*ln2 + r` (ln2 split in a
/// high part exact in few bits and a low correction), `exp(r) ~ 1 + r + r^2*P(r)` with `P`
/// in Horner order; about 1 ulp on `[X_MIN, X_MAX]`.
mod cephes {
    pub const LN2_HI: f32 = 0.693_359_4;
    pub const LN2_LO: f32 = -2.121_944_4e-4;
    pub const P: [f32; 6] = [
        1.987_569_1e-4,
        1.398_2e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ];
    /// Below this `exp` is taken as exactly 0; above `X_MAX` it would overflow.
    pub const X_MIN: f32 = -87.33654;
    pub const X_MAX: f32 = 88.376_26;
}
