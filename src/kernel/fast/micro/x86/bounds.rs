//! The slice bounds every x86 tier's entry points assert before they go to raw pointers (one
//! check per trait method, shared by the tiers, so a tier cannot be looser than another).

/// [`super::Micro::qk`]: `q` rows `< rows` (stride `d`), `n` keys, `s` entries `(r, j)`.
pub(super) fn qk(q: usize, rows: usize, k: usize, n: usize, d: usize, s: usize, lds: usize) {
    assert!(q >= rows * d && k >= n * d);
    assert!(rows == 0 || n == 0 || s >= (rows - 1) * lds + n);
}

/// [`super::DecodeMicro::dec_softmax_pv`].
#[allow(clippy::too_many_arguments)]
pub(super) fn dec_softmax_pv(
    s: usize,
    rows: usize,
    n: usize,
    v: usize,
    d: usize,
    st: usize,
    acc: usize,
) {
    assert!(s >= rows * n && v >= n * d && acc >= rows * d && st >= rows);
}

/// [`super::TileMicro::qk_t`]: the panel and `st` hold `rows8` lanes per row.
#[allow(clippy::too_many_arguments)]
pub(super) fn qk_t(
    qt: usize,
    ldq: usize,
    rows: usize,
    k: usize,
    n: usize,
    d: usize,
    st: usize,
    ldt: usize,
) {
    let rows8 = rows.div_ceil(8) * 8;
    assert!(ldq >= rows8 && ldt >= rows8 && k >= n * d);
    assert!(d == 0 || qt >= (d - 1) * ldq + rows8);
    assert!(n == 0 || st >= (n - 1) * ldt + rows8);
}

/// [`super::TileMicro::softmax_t`].
#[allow(clippy::too_many_arguments)]
pub(super) fn softmax_t(
    st: usize,
    ldt: usize,
    rows: usize,
    n: usize,
    m: usize,
    l: usize,
    c: usize,
) {
    let rows8 = rows.div_ceil(8) * 8;
    assert!(ldt >= rows8 && m >= rows8 && l >= rows8 && c >= rows8);
    assert!(n == 0 || st >= (n - 1) * ldt + rows8);
}

/// [`super::TileMicro::transpose`].
pub(super) fn transpose(src: usize, rows: usize, d: usize, dst: usize, ldd: usize) {
    let rows8 = rows.div_ceil(8) * 8;
    assert!(ldd >= rows8 && src >= rows8 * d);
    assert!(d == 0 || dst >= (d - 1) * ldd + rows8);
}

/// [`super::TileMicro::pv_t`].
#[allow(clippy::too_many_arguments)]
pub(super) fn pv_t(
    pt: usize,
    ldp: usize,
    rows: usize,
    v: usize,
    n: usize,
    d: usize,
    c: usize,
    acc: usize,
) {
    assert!(v >= n * d && c >= rows && acc >= rows * d);
    assert!(rows == 0 || n == 0 || (ldp >= rows && pt >= (n - 1) * ldp + rows));
}
