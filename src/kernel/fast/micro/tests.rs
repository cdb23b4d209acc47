//! Every micro-kernel of every tier this CPU has (the scalar twin included) against float64 on
//! seeded random data, at the shapes where vector loops have edges: row counts around 4, 8, 16
//! and 32, key counts around the register blocks, head sizes that leave every tail length, and
//! f32/f16/bf16 rows. Buffers carry NaN sentinels past the ranges a kernel may write, so a
//! masked store that spills is caught too.
//!
//! Bounds: a sum of `n` products in f32 (any order, FMA or not) is within `(n + 2) * eps *
//! sum |terms|` of the exact value; each exp is within 4 eps (relative) of the exp of the same
//! f32 argument (the float64 side subtracts in f32 as the kernels do), hence `n + 8` for sums
//! of exps or of terms scaled by one.

use super::scalar::Scalar;
use super::{Micro, TileMicro};
use crate::dtype::Float;
use crate::kernel::softmax::OnlineSoftmax;
use half::{bf16, f16};

const EPS: f64 = f32::EPSILON as f64;

struct Rng(u64);
impl Rng {
    fn f(&mut self, a: f32) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
    }
    fn vec(&mut self, n: usize, a: f32) -> Vec<f32> {
        (0..n).map(|_| self.f(a)).collect()
    }
    fn typed<C: Float>(&mut self, n: usize) -> Vec<C> {
        (0..n).map(|_| C::from_f32(self.f(1.0))).collect()
    }
}

fn close(what: &str, got: f32, want: f64, tol: f64) {
    assert!(
        (got as f64 - want).abs() <= tol,
        "{what}: got {got}, want {want} (tol {tol:e})"
    );
}

fn untouched(what: &str, x: &[f32]) {
    assert!(x.iter().all(|v| v.is_nan()), "{what}: wrote past its range");
}

const ROWS: [usize; 8] = [1, 2, 3, 4, 5, 7, 8, 9];
const KEYS: [usize; 8] = [1, 2, 3, 5, 8, 9, 17, 33];
const DIMS: [usize; 10] = [1, 7, 15, 16, 17, 33, 64, 80, 96, 128];

fn qk<M: Micro, C: Float>(m: M, tier: &str) {
    let mut rng = Rng(0x5eed);
    for rows in ROWS {
        for n in KEYS {
            for d in DIMS {
                let what = format!("{tier} {:?} rows={rows} n={n} d={d}", C::TYPE);
                let q = rng.vec(rows * d, 1.0);
                let k: Vec<C> = rng.typed(n * d);
                let kf: Vec<f64> = k.iter().map(|x| x.to_f32() as f64).collect();
                let lds = n + 3;
                let mut s = vec![f32::NAN; rows * lds];
                m.qk(&q, rows, &k, n, d, &mut s, lds, 1.0);
                let mut sd = vec![f32::NAN; rows * n];
                m.dec_qk(&q, rows, &k, n, d, &mut sd, &k, 1.0);
                for r in 0..rows {
                    for j in 0..n {
                        let t = (0..d).map(|x| q[r * d + x] as f64 * kf[j * d + x]);
                        let (want, mag) = t.fold((0.0, 0.0), |(a, b), t| (a + t, b + t.abs()));
                        let tol = (d as f64 + 2.0) * EPS * mag;
                        close(&format!("{what} qk"), s[r * lds + j], want, tol);
                        close(&format!("{what} dec_qk"), sd[r * n + j], want, tol);
                    }
                    untouched(&format!("{what} qk"), &s[r * lds + n..(r + 1) * lds]);
                }
            }
        }
    }
}

/// `dec_qk` at the shapes of verify steps and grouped heads (a tile's rows are tokens x group):
/// row counts from 3 to 24 at head sizes up to 129, where the AVX-512 tier switches to keys in
/// lanes (both sides of its rule), key counts that leave partial vectors and passes (tiles
/// shorter than 32, blocks of 64 and 70 keys), a scale that is not a power of two, and one that
/// overflows the larger logits (capped at `f32::MAX`; `-inf` below). A NaN sentinel after the
/// last row catches a store past it.
fn dec_qk_rows<M: Micro, C: Float>(m: M, tier: &str) {
    let mut rng = Rng(0x9e71f);
    for rows in [3, 8, 9, 15, 17, 20, 24] {
        for n in [1, 5, 16, 17, 31, 32, 33, 64, 70] {
            for d in [1, 15, 16, 17, 63, 64, 80, 128, 129] {
                let what = format!("{tier} {:?} rows={rows} n={n} d={d}", C::TYPE);
                let q = rng.vec(rows * d, 1.0);
                let k: Vec<C> = rng.typed(n * d);
                let kf: Vec<f64> = k.iter().map(|x| x.to_f32() as f64).collect();
                let scale = 0.37f32;
                let mut s = vec![f32::NAN; rows * n + 17];
                m.dec_qk(&q, rows, &k, n, d, &mut s[..rows * n], &k, scale);
                let mut capped = vec![f32::NAN; rows * n];
                m.dec_qk(&q, rows, &k, n, d, &mut capped, &[], f32::MAX);
                untouched(&format!("{what} dec_qk"), &s[rows * n..]);
                for r in 0..rows {
                    for j in 0..n {
                        let t = (0..d).map(|x| q[r * d + x] as f64 * kf[j * d + x]);
                        let (dot, mag) = t.fold((0.0, 0.0), |(a, b), t| (a + t, b + t.abs()));
                        let (want, mag) = (dot * scale as f64, mag * scale as f64);
                        let tol = (d as f64 + 3.0) * EPS * mag;
                        close(
                            &format!("{what} dec_qk ({r}, {j})"),
                            s[r * n + j],
                            want,
                            tol,
                        );
                        let got = capped[r * n + j];
                        if dot > 1.01 {
                            assert_eq!(got, f32::MAX, "{what} dec_qk cap ({r}, {j})");
                        } else if dot < -1.01 {
                            assert_eq!(got, f32::NEG_INFINITY, "{what} dec_qk cap ({r}, {j})");
                        } else if dot.abs() < 0.99 {
                            assert!(got.is_finite(), "{what} dec_qk cap ({r}, {j}): {got}");
                        }
                    }
                }
            }
        }
    }
}

/// `dec_softmax_pv` from states where some rows are fresh (`m = -inf`), some have a running
/// max above or below the tile's, with masked keys and one fully masked row.
fn dec_softmax<M: Micro, C: Float>(m: M, tier: &str) {
    let mut rng = Rng(0xdec);
    for rows in ROWS {
        for n in [1, 3, 16, 17, 33] {
            for d in [1, 7, 16, 17, 80, 128] {
                let what = format!("{tier} {:?} rows={rows} n={n} d={d}", C::TYPE);
                let mut s = rng.vec(rows * n, 4.0);
                for r in 0..rows {
                    for j in 0..n {
                        // A causal-like edge per row, and row 1 fully masked.
                        if j > (r * 5) % (n + 1) + 1 || r == 1 {
                            s[r * n + j] = f32::NEG_INFINITY;
                        }
                    }
                }
                let fresh = |r: usize| r.is_multiple_of(3);
                let m0: Vec<f32> = (0..rows)
                    .map(|r| {
                        if fresh(r) {
                            f32::NEG_INFINITY
                        } else {
                            rng.f(4.0)
                        }
                    })
                    .collect();
                let l0: Vec<f32> = (0..rows)
                    .map(|r| if fresh(r) { 0.0 } else { 1.0 + rng.f(0.5) })
                    .collect();
                let acc0: Vec<f32> = (0..rows * d)
                    .map(|i| if fresh(i / d) { 0.0 } else { rng.f(1.0) })
                    .collect();
                let v: Vec<C> = rng.typed(n * d);
                let mut state: Vec<OnlineSoftmax> = (0..rows)
                    .map(|r| OnlineSoftmax {
                        max: m0[r],
                        sum: l0[r],
                    })
                    .collect();
                let mut acc = acc0.clone();
                let mut st = s.clone();
                m.dec_softmax_pv(&mut st, rows, n, &v, d, &mut state, &mut acc, &v);
                let (mm, l): (Vec<f32>, Vec<f32>) = state.iter().map(|s| (s.max, s.sum)).unzip();
                for r in 0..rows {
                    let row = &s[r * n..(r + 1) * n];
                    let mt = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mn = m0[r].max(mt);
                    assert_eq!(mm[r].to_bits(), mn.to_bits(), "{what}: m[{r}]");
                    let c = if m0[r] == f32::NEG_INFINITY || mt == f32::NEG_INFINITY {
                        1.0
                    } else {
                        ((m0[r] - mn) as f64).exp()
                    };
                    let e: Vec<f64> = row.iter().map(|&x| ((x - mn) as f64).exp()).collect();
                    let want_l = l0[r] as f64 * c + e.iter().sum::<f64>();
                    let tol = (n as f64 + 8.0) * EPS * want_l;
                    close(&format!("{what} l[{r}]"), l[r], want_l, tol);
                    for x in 0..d {
                        let a0 = acc0[r * d + x] as f64 * c;
                        let t = e
                            .iter()
                            .enumerate()
                            .map(|(j, w)| w * v[j * d + x].to_f32() as f64);
                        let (want, mag) = t.fold((a0, a0.abs()), |(a, b), t| (a + t, b + t.abs()));
                        let tol = (n as f64 + 8.0) * EPS * mag;
                        close(&format!("{what} acc[{r}][{x}]"), acc[r * d + x], want, tol);
                    }
                }
            }
        }
    }
}

/// add_exp_scaled, add_scaled, scale, widen and narrow at every length up to 40.
fn elementwise<M: Micro>(m: M, tier: &str) {
    let mut rng = Rng(0xe1e);
    for n in 0..=40 {
        let what = format!("{tier} n={n}");
        let x = rng.vec(n, 8.0);
        let e: Vec<f64> = x.iter().map(|&v| ((v - 1.5) as f64).exp()).collect();
        let d0 = rng.vec(n, 1.0);
        let mut dst = d0.clone();
        dst.extend([f32::NAN; 16]);
        m.add_exp_scaled(&mut dst[..n], &x, 1.5, 0.25);
        untouched(&format!("{what} add_exp_scaled"), &dst[n..]);
        for i in 0..n {
            let t = e[i] * 0.25;
            let tol = 8.0 * EPS * (d0[i].abs() as f64 + t);
            close(
                &format!("{what} add_exp_scaled"),
                dst[i],
                d0[i] as f64 + t,
                tol,
            );
        }

        // A product, then a sum: the same bits on every tier.
        let mut dst = d0.clone();
        dst.extend([f32::NAN; 16]);
        m.add_scaled(&mut dst[..n], &x, 0.375);
        untouched(&format!("{what} add_scaled"), &dst[n..]);
        for i in 0..n {
            let want = d0[i] + x[i] * 0.375;
            assert_eq!(dst[i].to_bits(), want.to_bits(), "{what} add_scaled [{i}]");
        }

        let mut sc = x.clone();
        sc.extend([f32::NAN; 16]);
        m.scale(&mut sc[..n], 0.3);
        untouched(&format!("{what} scale"), &sc[n..]);
        for i in 0..n {
            let want = x[i] as f64 * 0.3f32 as f64;
            close(&format!("{what} scale"), sc[i], want, EPS * want.abs());
        }

        // Logits with non-finite and overflowing values in every lane position: capped at
        // f32::MAX (+inf and overflow), NaN and -inf kept; exp keeps NaN.
        let special = [f32::INFINITY, f32::NAN, f32::NEG_INFINITY, 3e38, -3e38, 2.0];
        let x: Vec<f32> = (0..n).map(|i| special[i % special.len()]).collect();
        let mut sc = x.clone();
        sc.extend([f32::NAN; 16]);
        m.scale_logits(&mut sc[..n], 2.0);
        untouched(&format!("{what} scale_logits"), &sc[n..]);
        for i in 0..n {
            let p = x[i] * 2.0;
            let want = if p > f32::MAX { f32::MAX } else { p };
            assert!(
                sc[i].to_bits() == want.to_bits() || (sc[i].is_nan() && want.is_nan()),
                "{what} scale_logits({}) = {}, want {want}",
                x[i],
                sc[i]
            );
        }
        let mut dst = vec![0f32; n];
        m.add_exp_scaled(&mut dst, &sc[..n], f32::MAX, 0.5);
        for i in 0..n {
            let want = ((sc[i] - f32::MAX) as f64).exp() * 0.5;
            assert!(
                (dst[i].is_nan() && want.is_nan()) || (dst[i] as f64 - want).abs() <= 4.0 * EPS,
                "{what} add_exp_scaled({}) = {}, want {want}",
                sc[i],
                dst[i]
            );
        }

        let h: Vec<f16> = rng.typed(n);
        let b: Vec<bf16> = rng.typed(n);
        for (src, name) in [
            (h.iter().map(|v| v.to_f32()).collect::<Vec<_>>(), "f16"),
            (b.iter().map(|v| v.to_f32()).collect(), "bf16"),
        ] {
            let mut out = vec![f32::NAN; n + 16];
            if name == "f16" {
                m.widen(&h, &mut out[..n]);
            } else {
                m.widen(&b, &mut out[..n]);
            }
            assert_eq!(&out[..n], &src[..], "{what} widen {name}");
            untouched(&format!("{what} widen {name}"), &out[n..]);
        }

        // narrow against `half`'s conversions, bit for bit, on values where rounding has
        // edges: ties with even and odd last kept bits, just past a tie, denormals of both
        // formats, overflow to infinity, infinities, NaNs of both signs and payloads.
        let edges = [
            f32::from_bits(0x3f80_8000), // bf16 tie, even: stays
            f32::from_bits(0x3f81_8000), // bf16 tie, odd: rounds up
            f32::from_bits(0x3f80_8001),
            f32::from_bits(0x0000_8000), // f32 denormal, a bf16 tie
            f32::from_bits(0x8001_7fff),
            f32::from_bits(0x7f7f_ffff), // f32::MAX: bf16 rounds to inf
            65520.0,                     // f16 rounds to inf
            1.0 + 1.0 / 2048.0,          // f16 tie, even
            3e-6,                        // f16 denormal
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::from_bits(0xffc1_2345), // negative NaN with payload
            f32::from_bits(0x7f80_0001), // signalling NaN
            -0.0,
        ];
        let src: Vec<f32> = (0..n)
            .map(|i| {
                if i % 3 == 0 {
                    rng.f(4.0)
                } else {
                    edges[i % edges.len()]
                }
            })
            .collect();
        fn check<C: Float, M: Micro>(m: M, src: &[f32], what: &str, bits: impl Fn(C) -> u32) {
            let n = src.len();
            let sentinel = C::from_f32(7.0);
            let mut out = vec![sentinel; n + 16];
            m.narrow(src, &mut out[..n]);
            for (i, &x) in src.iter().enumerate() {
                let (got, want) = (bits(out[i]), bits(C::from_f32(x)));
                assert_eq!(
                    got,
                    want,
                    "{what} narrow {:?} of {x:e} ({:#x})",
                    C::TYPE,
                    x.to_bits()
                );
            }
            assert!(
                out[n..].iter().all(|v| *v == sentinel),
                "{what} narrow wrote past its range"
            );
        }
        check::<f16, M>(m, &src, &what, |v| v.to_bits() as u32);
        check::<bf16, M>(m, &src, &what, |v| v.to_bits() as u32);
        check::<f32, M>(m, &src, &what, |v| v.to_bits());
    }
}

/// qk_t, softmax_t, transpose and pv_t on panels whose row counts end in full, half (8 of 16)
/// and no vectors, in every row-vector count of a kernel block (up to 4) and past one block,
/// key counts that leave short key blocks, and the head sizes kernels specialize (64, 128);
/// lanes past `rows8` hold sentinels.
fn tile<M: TileMicro>(m: M, tier: &str) {
    let mut rng = Rng(0x711e);
    for rows in [
        1usize, 5, 8, 9, 16, 17, 24, 31, 32, 33, 40, 47, 56, 64, 72, 100,
    ] {
        let rows8 = rows.div_ceil(8) * 8;
        let ld = rows8 + 8;
        for n in [1, 2, 5, 6, 7, 12, 13, 16, 25, 32, 48] {
            for d in [1, 7, 16, 17, 33, 64, 128] {
                let what = format!("{tier} rows={rows} n={n} d={d}");
                // Query panel [d][ld]: rows..rows8 zero (the contract), past rows8 NaN.
                let mut qt = vec![f32::NAN; d * ld];
                for x in 0..d {
                    for r in 0..rows8 {
                        qt[x * ld + r] = if r < rows { rng.f(1.0) } else { 0.0 };
                    }
                }
                let k = rng.vec(n * d, 1.0);
                let mut st = vec![f32::NAN; n * ld];
                // A scale that is not a power of two, so a kernel that skipped it or applied
                // it twice cannot pass.
                let scale = 0.37f32;
                m.qk_t(&qt, ld, rows, &k, n, d, &mut st, ld, scale, &k);
                for j in 0..n {
                    for r in 0..rows {
                        let t = (0..d).map(|x| qt[x * ld + r] as f64 * k[j * d + x] as f64);
                        let (want, mag) = t.fold((0.0, 0.0), |(a, b), t| (a + t, b + t.abs()));
                        let (want, mag) = (want * scale as f64, mag * scale as f64);
                        let tol = (d as f64 + 3.0) * EPS * mag;
                        close(&format!("{what} qk_t"), st[j * ld + r], want, tol);
                    }
                    untouched(&format!("{what} qk_t"), &st[j * ld + rows8..(j + 1) * ld]);
                }
                // The cap: a scale that overflows the larger logits must leave f32::MAX there
                // (-inf stays: it is a masked key's), as `scale_logits` does.
                let mut sc = st.clone();
                m.qk_t::<f32>(&qt, ld, rows, &k, n, d, &mut sc, ld, f32::MAX, &[]);
                for j in 0..n {
                    for r in 0..rows {
                        let t = (0..d).map(|x| qt[x * ld + r] as f64 * k[j * d + x] as f64);
                        let want = t.sum::<f64>();
                        let got = sc[j * ld + r];
                        if want > 1.01 {
                            assert_eq!(got, f32::MAX, "{what} qk_t cap");
                        } else if want < -1.01 {
                            assert_eq!(got, f32::NEG_INFINITY, "{what} qk_t cap");
                        } else if want.abs() < 0.99 {
                            assert!(got.is_finite(), "{what} qk_t cap: {got}");
                        }
                    }
                }

                // softmax_t on fresh logits with masked keys, some rows fresh (-inf).
                for j in 0..n {
                    for r in 0..rows8 {
                        st[j * ld + r] = if r >= rows {
                            0.0
                        } else if j > (r * 3) % (n + 1) || r == 2 {
                            f32::NEG_INFINITY
                        } else {
                            rng.f(4.0)
                        };
                    }
                }
                let s0 = st.clone();
                let fresh = |r: usize| r.is_multiple_of(3) || r >= rows;
                let mut mm = vec![f32::NAN; ld];
                let mut l = vec![f32::NAN; ld];
                for r in 0..rows8 {
                    mm[r] = if fresh(r) {
                        f32::NEG_INFINITY
                    } else {
                        rng.f(4.0)
                    };
                    l[r] = if fresh(r) { 0.0 } else { 1.0 + rng.f(0.5) };
                }
                let (m0, l0) = (mm.clone(), l.clone());
                let mut c = vec![f32::NAN; ld];
                m.softmax_t(&mut st, ld, rows, n, &mut mm, &mut l, &mut c);
                for buf in [&mm, &l, &c] {
                    untouched(&format!("{what} softmax_t m/l/c"), &buf[rows8..]);
                }
                for r in 0..rows {
                    let mt = (0..n)
                        .map(|j| s0[j * ld + r])
                        .fold(f32::NEG_INFINITY, f32::max);
                    let mn = m0[r].max(mt);
                    assert_eq!(mm[r].to_bits(), mn.to_bits(), "{what}: softmax_t m[{r}]");
                    let msub = if mn == f32::NEG_INFINITY { 0.0 } else { mn };
                    let cw = ((m0[r] - msub) as f64).exp();
                    close(&format!("{what} c[{r}]"), c[r], cw, 4.0 * EPS * cw);
                    let mut sum = 0.0;
                    for j in 0..n {
                        let e = ((s0[j * ld + r] - msub) as f64).exp();
                        close(
                            &format!("{what} st[{j}][{r}]"),
                            st[j * ld + r],
                            e,
                            4.0 * EPS * e,
                        );
                        sum += e;
                    }
                    let want = l0[r] as f64 * cw + sum;
                    close(
                        &format!("{what} l[{r}]"),
                        l[r],
                        want,
                        (n as f64 + 8.0) * EPS * want,
                    );
                }
                for j in 0..n {
                    untouched(
                        &format!("{what} softmax_t st"),
                        &st[j * ld + rows8..(j + 1) * ld],
                    );
                }

                // pv_t with the weights just made (those of rows < rows).
                let v = rng.vec(n * d, 1.0);
                let acc0 = rng.vec(rows * d, 1.0);
                let mut acc = acc0.clone();
                acc.extend([f32::NAN; 17]);
                m.pv_t(&st, ld, rows, &v, n, d, &c, &mut acc[..rows * d], &v);
                untouched(&format!("{what} pv_t"), &acc[rows * d..]);
                for r in 0..rows {
                    for x in 0..d {
                        let a0 = acc0[r * d + x] as f64 * c[r] as f64;
                        let t = (0..n).map(|j| st[j * ld + r] as f64 * v[j * d + x] as f64);
                        let (want, mag) = t.fold((a0, a0.abs()), |(a, b), t| (a + t, b + t.abs()));
                        let tol = (n as f64 + 3.0) * EPS * mag;
                        close(&format!("{what} pv_t[{r}][{x}]"), acc[r * d + x], want, tol);
                    }
                }
            }
        }
        for d in [1, 7, 8, 17, 128] {
            let src = rng.vec(rows8 * d, 1.0);
            let mut dst = vec![f32::NAN; d * ld];
            m.transpose(&src, rows, d, &mut dst, ld);
            for x in 0..d {
                for r in 0..rows8 {
                    assert_eq!(dst[x * ld + r], src[r * d + x], "{tier} transpose");
                }
                untouched(
                    &format!("{tier} transpose"),
                    &dst[x * ld + rows8..(x + 1) * ld],
                );
            }
        }
    }
}

fn all<M: TileMicro>(m: M, tier: &str) {
    qk::<M, f32>(m, tier);
    qk::<M, f16>(m, tier);
    qk::<M, bf16>(m, tier);
    dec_qk_rows::<M, f32>(m, tier);
    dec_qk_rows::<M, f16>(m, tier);
    dec_qk_rows::<M, bf16>(m, tier);
    dec_softmax::<M, f32>(m, tier);
    dec_softmax::<M, f16>(m, tier);
    dec_softmax::<M, bf16>(m, tier);
    elementwise(m, tier);
    tile(m, tier);
}

#[test]
fn every_tier_matches_float64_at_the_vector_edges() {
    let mut ran = vec!["scalar"];
    all(Scalar, "scalar");
    #[cfg(target_arch = "x86_64")]
    {
        if let Some(m) = super::x86::avx2::Avx2::detect() {
            all(m, "avx2");
            ran.push("avx2");
        }
        if let Some(m) = super::x86::avx512::Avx512::detect() {
            all(m, "avx512");
            ran.push("avx512");
        }
        assert_eq!(
            ran.contains(&"avx512"),
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512dq"),
            "the AVX-512 tier must run exactly when the CPU has it"
        );
    }
    eprintln!("micro tiers exercised: {}", ran.join(" "));
}
