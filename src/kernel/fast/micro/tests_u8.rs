//! Every tier's [`QuantMicro`] loops (the scalar twin included) against float64 on seeded random
//! bytes, at the vector edges: row counts around the 4-row blocks, key counts around the 4-key
//! blocks, lengths that leave every tail of 8 and 16 lanes (odd ones: a u4 row's last byte
//! half used), zero points all 0 (by-channel keys) or not; the products on u8 bytes and on u4
//! nibbles (read as `kernel::quant::q_at` reads them, independently of [`QRows::at`]), and on
//! u4 nibbles bit for bit as on the same values unpacked to bytes (the products differ only in
//! how elements are read). Buffers carry NaN sentinels past the ranges a loop may write. Bounds as in
//! `micro::tests`: a sum of `n` f32 products is within `(n + 2) * eps * sum |terms|`.

use super::scalar::Scalar;
use super::{QRows, QuantMicro};
use crate::kernel::quant::{dequant, q_at};

const EPS: f64 = f32::EPSILON as f64;
const ROWS: [usize; 6] = [1, 2, 3, 4, 5, 9];
const KEYS: [usize; 6] = [1, 3, 4, 5, 8, 33];
const LENS: [usize; 9] = [1, 7, 8, 9, 15, 16, 17, 40, 128];

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn f(&mut self, a: f32) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| (self.next() >> 32) as u8).collect()
    }
    fn zps(&mut self, n: usize, zero: bool) -> Vec<f32> {
        (0..n)
            .map(|_| if zero { 0.0 } else { 127.5 + self.f(127.5) })
            .collect()
    }
}

fn check(what: &str, got: f32, want: f64, tol: f64) {
    assert!(
        (got as f64 - want).abs() <= tol,
        "{what}: got {got}, want {want} (tol {tol:e})"
    );
}

/// Bytes for the micro-kernels' prefetch hints (never read by them).
static PF_BYTES: [u8; 1 << 16] = [0x5a; 1 << 16];

/// Whether `a` and `b` hold the same bits (NaN included).
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// Rows of `n` elements of `bits` bits, `ld` bytes apart, the last row cut to its elements'
/// bytes (a loop reading past a row's last element would leave the slice).
fn qrows(rng: &mut Rng, bits: usize, n: usize, len: usize, ld: usize) -> Vec<u8> {
    let mut b = rng.bytes(n * ld);
    b.truncate((n - 1) * ld + (len * bits).div_ceil(8));
    b
}

/// Element `c` of row `t`, as the quantizer's own reader takes it.
fn elem(b: &[u8], ld: usize, bits: usize, t: usize, c: usize) -> f64 {
    q_at(&b[t * ld..], c, bits) as f64
}

/// u4 rows (`n` of `len` elements, `ld` bytes apart) unpacked to u8 rows at the same stride.
fn widened(b: &[u8], ld: usize, n: usize, len: usize) -> Vec<u8> {
    let mut w = vec![0u8; n * ld];
    for t in 0..n {
        for c in 0..len {
            w[t * ld + c] = q_at(&b[t * ld..], c, 4);
        }
    }
    w
}

fn qk<M: QuantMicro>(m: M, tier: &str, bits: usize) {
    let mut rng = Rng(0x5eed_0008 + bits as u64);
    for rows in ROWS {
        for n in KEYS {
            for len in LENS {
                for zero in [true, false] {
                    let what = format!("{tier} u{bits} qk rows={rows} n={n} len={len} zp0={zero}");
                    let (ldq, ldk, lds) = (len + 2, len + 5, n + 3);
                    let q: Vec<f32> = (0..rows * ldq).map(|_| rng.f(1.0)).collect();
                    let kb = qrows(&mut rng, bits, n, len, ldk);
                    let k = QRows::new(&kb, ldk, bits);
                    let zp = rng.zps(n, zero);
                    let mut s = vec![f32::NAN; rows * lds];
                    m.qk(&q, ldq, rows, k, &zp, len, &mut s, lds, &[]);
                    // Prefetch hints (an unaligned slice of any length) change no bit.
                    let mut hinted = vec![f32::NAN; rows * lds];
                    let pf = &PF_BYTES[3..3 + 97 * n];
                    m.qk(&q, ldq, rows, k, &zp, len, &mut hinted, lds, pf);
                    assert!(
                        same_bits(&s, &hinted),
                        "{what}: prefetch hints changed results"
                    );
                    if bits == 4 {
                        let wide = widened(&kb, ldk, n, len);
                        let k8 = QRows::new(&wide, ldk, 8);
                        let mut s8 = vec![f32::NAN; rows * lds];
                        m.qk(&q, ldq, rows, k8, &zp, len, &mut s8, lds, &[]);
                        assert!(same_bits(&s, &s8), "{what}: not the bits of its bytes");
                    }
                    for r in 0..rows {
                        for t in 0..n {
                            let terms = (0..len).map(|c| {
                                let e = elem(&kb, ldk, bits, t, c);
                                q[r * ldq + c] as f64 * (e - zp[t] as f64)
                            });
                            let (want, abs) =
                                terms.fold((0.0, 0.0), |(a, b), x| (a + x, b + x.abs()));
                            // one more rounding per term: the f32 subtraction of the zero point
                            let tol = (len as f64 + 4.0) * EPS * abs.max(1e-30);
                            check(&what, s[r * lds + t], want, tol);
                        }
                        let tail = &s[r * lds + n..(r + 1) * lds];
                        assert!(tail.iter().all(|v| v.is_nan()), "{what}: wrote past n");
                    }
                }
            }
        }
    }
}

fn pv<M: QuantMicro>(m: M, tier: &str, bits: usize) {
    let mut rng = Rng(0x9f3_0008 + bits as u64);
    for rows in ROWS {
        for n in KEYS {
            for (len, zero) in LENS.into_iter().flat_map(|l| [(l, true), (l, false)]) {
                let what = format!("{tier} u{bits} pv rows={rows} n={n} len={len} zp0={zero}");
                let (lda, ldv) = (len + 3, len + 6);
                let mut acc = vec![f32::NAN; rows * lda];
                for r in 0..rows {
                    for c in 0..len {
                        acc[r * lda + c] = rng.f(1.0);
                    }
                }
                let before = acc.clone();
                let w: Vec<f32> = (0..rows * n).map(|_| rng.f(1.0).abs()).collect();
                let vb = qrows(&mut rng, bits, n, len, ldv);
                let v = QRows::new(&vb, ldv, bits);
                let zp = rng.zps(n, zero);
                let mut hinted = acc.clone();
                m.pv(&mut acc, lda, rows, &w, v, &zp, len, &[]);
                // Prefetch hints (an unaligned slice of any length) change no bit.
                let pf = &PF_BYTES[5..5 + 61 * len];
                m.pv(&mut hinted, lda, rows, &w, v, &zp, len, pf);
                assert!(
                    same_bits(&acc, &hinted),
                    "{what}: prefetch hints changed results"
                );
                if bits == 4 {
                    let wide = widened(&vb, ldv, n, len);
                    let v8 = QRows::new(&wide, ldv, 8);
                    let mut acc8 = before.clone();
                    m.pv(&mut acc8, lda, rows, &w, v8, &zp, len, &[]);
                    assert!(same_bits(&acc, &acc8), "{what}: not the bits of its bytes");
                }
                for r in 0..rows {
                    for c in 0..len {
                        let terms = (0..n).map(|t| {
                            w[r * n + t] as f64 * (elem(&vb, ldv, bits, t, c) - zp[t] as f64)
                        });
                        let a0 = before[r * lda + c] as f64;
                        let (want, abs) =
                            terms.fold((a0, a0.abs()), |(a, b), x| (a + x, b + x.abs()));
                        let tol = (n as f64 + 4.0) * EPS * abs;
                        check(&what, acc[r * lda + c], want, tol);
                    }
                    let tail = &acc[r * lda + len..(r * lda + lda).min(acc.len())];
                    assert!(tail.iter().all(|v| v.is_nan()), "{what}: wrote past len");
                }
            }
        }
    }
}

fn fold<M: QuantMicro>(m: M, tier: &str) {
    let mut rng = Rng(0xf01d_0008);
    for rows in ROWS {
        for len in LENS {
            let what = format!("{tier} fold rows={rows} len={len}");
            let (ldx, ldo) = (len + 2, len + 5);
            let x: Vec<f32> = (0..rows * ldx).map(|_| rng.f(3.0)).collect();
            let scale: Vec<f32> = (0..len).map(|_| rng.f(0.01).abs()).collect();
            let zp = rng.zps(len, false);
            let mut out = vec![f32::NAN; rows * ldo];
            let mut cst = vec![f32::NAN; rows + 2];
            m.fold(&x, ldx, rows, &scale, &zp, &mut out, ldo, &mut cst);
            for r in 0..rows {
                let mut want = 0f64;
                let mut abs = 0f64;
                for c in 0..len {
                    // One rounding: the product is f32's, exactly as every tier forms it.
                    let o = x[r * ldx + c] * scale[c];
                    assert_eq!(
                        out[r * ldo + c].to_bits(),
                        o.to_bits(),
                        "{what} out {r} {c}"
                    );
                    want += o as f64 * zp[c] as f64;
                    abs += (o as f64 * zp[c] as f64).abs();
                }
                check(&what, cst[r], want, (len as f64 + 2.0) * EPS * abs);
                let tail = &out[r * ldo + len..(r + 1) * ldo];
                assert!(tail.iter().all(|v| v.is_nan()), "{what}: wrote past len");
            }
            assert!(
                cst[rows..].iter().all(|v| v.is_nan()),
                "{what}: cst past rows"
            );
        }
    }
}

fn elementwise<M: QuantMicro>(m: M, tier: &str) {
    let mut rng = Rng(0xe1e_0008);
    for len in LENS {
        let what = format!("{tier} len={len}");
        let src = rng.bytes(len);
        let zp = rng.zps(len, false);
        let scale: Vec<f32> = (0..len).map(|_| rng.f(0.01).abs()).collect();
        let mut out = vec![f32::NAN; len + 9];
        m.dequant(&src, &zp, &scale, &mut out[..len]);
        for i in 0..len {
            let want = dequant(src[i], scale[i], zp[i]);
            assert_eq!(out[i].to_bits(), want.to_bits(), "{what} dequant {i}");
        }
        assert!(
            out[len..].iter().all(|v| v.is_nan()),
            "{what}: dequant wrote past"
        );
        let mut out = vec![f32::NAN; len + 9];
        m.dequant_uniform(&src, zp[0], scale[0], &mut out[..len]);
        for i in 0..len {
            let want = dequant(src[i], scale[0], zp[0]);
            assert_eq!(out[i].to_bits(), want.to_bits(), "{what} uniform {i}");
        }
        assert!(
            out[len..].iter().all(|v| v.is_nan()),
            "{what}: uniform wrote past"
        );
        let s: Vec<f32> = (0..len)
            .map(|i| {
                if i % 5 == 3 {
                    f32::NEG_INFINITY
                } else {
                    rng.f(20.0)
                }
            })
            .collect();
        let want_max = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(m.max(&s).to_bits(), want_max.to_bits(), "{what} max");
        let mut with_nan = s.clone();
        with_nan[len / 2] = f32::NAN;
        let want_max = with_nan.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(
            m.max(&with_nan).to_bits(),
            want_max.to_bits(),
            "{what} max, NaN"
        );
        assert_eq!(m.max(&s[..0]), f32::NEG_INFINITY, "{what} max of none");
        // 1 to 6 rows (whole groups of four and the rest), 3 gap elements between rows that
        // must stay untouched, a different `sub` per row.
        for rows in 1..=6 {
            let lds = len + 3;
            let mut st = vec![f32::NAN; rows * lds];
            let subs: Vec<f32> = (0..rows).map(|r| 5.0 - r as f32).collect();
            for r in 0..rows {
                for (o, &x) in st[r * lds..][..len].iter_mut().zip(&s) {
                    *o = x - r as f32 * 0.5;
                }
            }
            let before = st.clone();
            let mut sums = vec![f32::NAN; rows];
            m.exp_sum(&mut st, lds, len, &subs, &mut sums);
            for r in 0..rows {
                let row = &before[r * lds..][..len];
                let want: Vec<f64> = row.iter().map(|&x| ((x - subs[r]) as f64).exp()).collect();
                for (i, (&g, &w)) in st[r * lds..][..len].iter().zip(&want).enumerate() {
                    check(
                        &format!("{what} exp {rows}x{i} row {r}"),
                        g,
                        w,
                        4.0 * EPS * w,
                    );
                }
                let total: f64 = want.iter().sum();
                let tol = (len as f64 + 8.0) * EPS * total;
                check(
                    &format!("{what} exp sum {rows} row {r}"),
                    sums[r],
                    total,
                    tol,
                );
                assert!(
                    st[r * lds + len..(r + 1) * lds].iter().all(|v| v.is_nan()),
                    "{what}: exp_sum wrote between rows"
                );
            }
        }
    }
}

fn all<M: QuantMicro>(m: M, tier: &str) {
    for bits in [8, 4] {
        qk(m, tier, bits);
        pv(m, tier, bits);
    }
    fold(m, tier);
    elementwise(m, tier);
}

#[test]
fn every_u8_tier_matches_float64_at_the_vector_edges() {
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
    }
    eprintln!("u8 micro tiers exercised: {}", ran.join(" "));
}

/// `all_zero` (which picks the loops without zero-point subtraction) agrees with `== 0.0` on
/// every element: signed zeros count, NaN, subnormals and anything else do not.
#[test]
fn all_zero_means_every_element_equals_zero() {
    let odd = [
        f32::NAN,
        -f32::NAN,
        f32::MIN_POSITIVE / 4.0,
        -1e-45,
        1.0,
        f32::INFINITY,
    ];
    for len in [0, 1, 7, 32, 33] {
        let mut x: Vec<f32> = (0..len)
            .map(|i| if i % 2 == 0 { 0.0 } else { -0.0 })
            .collect();
        assert!(super::all_zero(&x), "len {len}");
        for at in 0..len {
            for &v in &odd {
                let keep = x[at];
                x[at] = v;
                let want = x.iter().all(|&z| z == 0.0);
                assert!(!want && !super::all_zero(&x), "len {len} at {at} {v:e}");
                x[at] = keep;
            }
        }
    }
}
