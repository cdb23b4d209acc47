//! A measurement, not a check (ignored by default): the share of this CPU's f32 FMA peak the
//! prefill tile loops reach, on one item's shape (64 query rows, D=128, 16 key tiles of 32 keys:
//! 512 KiB of keys and values, L2-resident where L2 is larger than that), per SIMD tier:
//! `cargo test --release -p paged_attention --lib tile_loops_share_of_fma_peak -- --ignored --nocapture`.
//! Bursts of the loops alternate with bursts of an FMA loop (24 independent accumulators, what
//! `pa_machine` runs) and the best of each is kept, so a noisy host disturbs both alike.

use super::TileMicro;
use std::time::Instant;

const ROWS: usize = 64;
const KEYS: usize = 32;
const D: usize = 128;
const TILES: usize = 16;

/// Seconds `iters` rounds of 24 independent FMAs on 16-float vectors (`wide`), or of 12 on
/// 8-float vectors, take: the FMA peak, the accumulators in registers.
#[cfg(target_arch = "x86_64")]
fn peak_secs(wide: bool, iters: usize) -> f64 {
    use std::arch::x86_64::*;
    #[target_feature(enable = "avx512f")]
    fn run512(iters: usize) -> f32 {
        let (m, c) = (_mm512_set1_ps(0.999_999), _mm512_set1_ps(1e-7));
        let (mut a, mut b) = ([_mm512_set1_ps(1.0); 12], [_mm512_set1_ps(2.0); 12]);
        for _ in 0..iters {
            for i in 0..12 {
                a[i] = _mm512_fmadd_ps(a[i], m, c);
                b[i] = _mm512_fmadd_ps(b[i], m, c);
            }
        }
        let s = (0..12).fold(_mm512_setzero_ps(), |s, i| {
            _mm512_add_ps(s, _mm512_add_ps(a[i], b[i]))
        });
        _mm512_reduce_add_ps(s)
    }
    // 12 accumulators: with `m` and `c`, 14 of the 16 ymm registers (24 would spill).
    #[target_feature(enable = "avx2,fma")]
    fn run256(iters: usize) -> f32 {
        let (m, c) = (_mm256_set1_ps(0.999_999), _mm256_set1_ps(1e-7));
        let mut a = [_mm256_set1_ps(1.0); 12];
        for _ in 0..iters {
            for x in a.iter_mut() {
                *x = _mm256_fmadd_ps(*x, m, c);
            }
        }
        let s = a
            .iter()
            .fold(_mm256_setzero_ps(), |s, &x| _mm256_add_ps(s, x));
        let mut o = [0f32; 8];
        // SAFETY: `o` holds 8 floats.
        unsafe { _mm256_storeu_ps(o.as_mut_ptr(), s) };
        o.iter().sum()
    }
    let t = Instant::now();
    // SAFETY: the caller passes `wide` only for a tier whose token proves AVX-512F, and the
    // AVX2 tier's token proves AVX2 and FMA.
    let s = unsafe {
        if wide {
            run512(iters)
        } else {
            run256(iters)
        }
    };
    std::hint::black_box(s);
    t.elapsed().as_secs_f64()
}

/// Prints the share of the FMA peak (16-float vectors when `wide`, else 8) that `qk_t`, `pv_t`,
/// both, and both with `softmax_t` between them reach, counting 2 flops per multiply-add of the
/// products (the softmax step counts none).
#[cfg(target_arch = "x86_64")]
fn measure<M: TileMicro>(m: M, tier: &str, wide: bool) {
    let lanes = if wide { 16.0 } else { 8.0 };
    let mut x = 0x1234_5678u32;
    let mut r = |a: f32| {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        (x >> 8) as f32 / (1u32 << 24) as f32 * a - a / 2.0
    };
    // Every buffer starts on a 64-byte boundary, as the kernel's scratch does (`aligned`) and as
    // OpenVINO allocates its tensors, so no load splits a cache line that the kernel's would not
    // (a `Vec` of this size may start 16 bytes off a line).
    use crate::kernel::fast::prefill::aligned;
    let (mut qb, mut kb, mut vb, mut sb, mut ab) = Default::default();
    let (qt, k, v) = (
        aligned(&mut qb, D * ROWS),
        aligned(&mut kb, TILES * KEYS * D),
        aligned(&mut vb, TILES * KEYS * D),
    );
    for x in qt.iter_mut().chain(k.iter_mut()).chain(v.iter_mut()) {
        *x = r(1.0);
    }
    let (qt, k, v): (&[f32], &[f32], &[f32]) = (qt, k, v);
    let (st, acc) = (aligned(&mut sb, KEYS * ROWS), aligned(&mut ab, ROWS * D));
    let (mut ml, mut ll, c) = (
        vec![f32::NEG_INFINITY; ROWS],
        vec![0f32; ROWS],
        vec![1f32; ROWS],
    );
    let mut cc = vec![0f32; ROWS];
    let none: &[f32] = &[];
    // Steps of a pass: QK, the softmax step, PV (the softmax step only between the other two).
    let mut pass = |(qk, soft, pv): (bool, bool, bool)| {
        let t = Instant::now();
        for j in 0..TILES {
            let kt = &k[j * KEYS * D..(j + 1) * KEYS * D];
            let vt = &v[j * KEYS * D..(j + 1) * KEYS * D];
            if qk {
                for r0 in (0..ROWS).step_by(M::QK_ROWS) {
                    let rr = M::QK_ROWS.min(ROWS - r0);
                    let s = &mut st[r0..];
                    m.qk_t(&qt[r0..], ROWS, rr, kt, KEYS, D, s, ROWS, 0.05, none);
                }
            }
            let cf = if soft {
                m.softmax_t(st, ROWS, ROWS, KEYS, &mut ml, &mut ll, &mut cc);
                &cc
            } else {
                &c
            };
            if pv {
                m.pv_t(st, ROWS, ROWS, vt, KEYS, D, cf, acc, none);
            }
        }
        std::hint::black_box(&acc);
        t.elapsed().as_secs_f64()
    };
    let flops = (2 * ROWS * KEYS * D * TILES) as f64;
    let iters = 2000;
    let modes = [
        ("qk_t", (true, false, false), 1.0),
        ("pv_t", (false, false, true), 1.0),
        ("qk_t + pv_t", (true, false, true), 2.0),
        ("qk_t + softmax_t + pv_t", (true, true, true), 2.0),
    ];
    let mut best = [f64::MAX; 4];
    let mut bp = f64::MAX;
    for _ in 0..60 {
        bp = bp.min(peak_secs(wide, iters));
        for (b, (_, mode, _)) in best.iter_mut().zip(modes) {
            *b = b.min(pass(mode));
        }
    }
    let fmas = if wide { 24 } else { 12 };
    let peak = (iters * fmas) as f64 * lanes * 2.0 / bp;
    eprintln!("{tier}: FMA peak {:.1} GFLOP/s per thread", peak / 1e9);
    for (b, (name, _, products)) in best.iter().zip(modes) {
        eprintln!(
            "  {name}: {:.0}% of it",
            100.0 * products * flops / b / peak
        );
    }
}

#[test]
#[ignore = "a measurement: run with --ignored --nocapture"]
fn tile_loops_share_of_fma_peak() {
    #[cfg(target_arch = "x86_64")]
    {
        if let Some(m) = super::x86::avx512::Avx512::detect() {
            measure(m, "avx512", true);
        }
        if let Some(m) = super::x86::avx2::Avx2::detect() {
            measure(m, "avx2", false);
        }
    }
}
