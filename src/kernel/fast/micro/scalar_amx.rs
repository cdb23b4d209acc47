//! Scalar twin of the AMX-BF16 tile products (`x86/amx.rs`): the same bf16 rounding of the
//! inputs (nearest even, subnormals to zero, as `vcvtneps2bf16` and `tdpbf16ps` treat them)
//! and the same f32 sums in the same order, one element at a time. Test oracle only.

/// bf16 bits of `x`, rounded to nearest even; f32 subnormals become a zero of the same sign.
pub(crate) fn round_bf16(x: f32) -> u16 {
    if x.is_subnormal() {
        return ((x.to_bits() >> 16) & 0x8000) as u16;
    }
    half::bf16::from_f32(x).to_bits()
}

/// `x` cut into three bf16 parts: each the rounding of what the earlier ones leave (an
/// infinite part leaves 0). Their sum is `x` within 2^-26 relative (f32), two are exact for f16.
pub(crate) fn split_bf16(x: f32) -> [u16; 3] {
    let mut r = x;
    [0; 3].map(|_| {
        let p = round_bf16(r);
        let pf = f32::from_bits((p as u32) << 16);
        r = if pf.is_infinite() { 0.0 } else { r - pf };
        p
    })
}

/// `x` rounded to bf16, as the tile product reads it.
fn bf(x: f32) -> f32 {
    f32::from_bits((round_bf16(x) as u32) << 16)
}

/// `st[j*ldt + r] = sum_x bf(q[r*d + x]) * bf(k[j*d + x])` for `r < rows`, `j < n` (x in
/// order, f32).
pub(crate) fn qk_t_bf16(
    q: &[f32],
    rows: usize,
    k: &[f32],
    n: usize,
    d: usize,
    st: &mut [f32],
    ldt: usize,
) {
    for j in 0..n {
        for r in 0..rows {
            let mut s = 0f32;
            for x in 0..d {
                s += bf(q[r * d + x]) * bf(k[j * d + x]);
            }
            st[j * ldt + r] = s;
        }
    }
}

/// `acc[x*lda + r] += sum_j bf(p[j*ldp + r]) * bf(v[j*d + x])` for `r < rows`, `x < d` (keys
/// in order, f32).
#[allow(clippy::too_many_arguments)]
pub(crate) fn pv_t_bf16(
    p: &[f32],
    ldp: usize,
    rows: usize,
    v: &[f32],
    n: usize,
    d: usize,
    acc: &mut [f32],
    lda: usize,
) {
    for x in 0..d {
        for r in 0..rows {
            let mut s = acc[x * lda + r];
            for j in 0..n {
                s += bf(p[j * ldp + r]) * bf(v[j * d + x]);
            }
            acc[x * lda + r] = s;
        }
    }
}
