//! What the x86 tiers' [`QuantMicro`](super::super::QuantMicro) products share: the choice of their
//! compile-time variants (zero points subtracted or folded away, bytes or u4 nibbles) and the
//! value products' blocks of up to 4 rows. Each tier gives its loops ([`QuantLoops`]); the bounds
//! are checked by the caller before any of this runs.

use super::prefetch::Pf;

/// The arguments of a tier's `qk_tiles`: `(q, ldq, rows, k, ldk, zp, len, s, lds)` as in
/// `QuantMicro::qk` (`k` the rows' bytes, `ldk` their stride).
pub(super) type QkArgs<'a> = (
    &'a [f32],
    usize,
    usize,
    &'a [u8],
    usize,
    &'a [f32],
    usize,
    &'a mut [f32],
    usize,
);

/// The arguments of a tier's block of value products: `(acc, lda, w, n, v, ldv, zp, len)`, the
/// accumulators and weights from the block's first row.
pub(super) type PvArgs<'a> = (
    *mut f32,
    usize,
    *const f32,
    usize,
    *const u8,
    usize,
    &'a [f32],
    usize,
);

/// A tier's u8 product loops at each variant: `SUB`, whether the zero points are subtracted
/// (they are all 0 when not); `U4`, whether the elements are nibbles (else bytes).
pub(super) trait QuantLoops {
    /// The logits of `QuantMicro::qk`, `pf` ticked as the tier's tiles go.
    ///
    /// # Safety
    /// The CPU has the tier's features and the arguments passed `qk_bounds`.
    unsafe fn qk_tiles<const SUB: bool, const U4: bool>(args: QkArgs<'_>, pf: Pf);
    /// `QuantMicro::pv` for `R` (1 to 4) rows held in registers.
    ///
    /// # Safety
    /// The CPU has the tier's features, and `R` rows of the accumulators (stride `lda`, `len`
    /// elements) and of `n` weights, and `n` value rows (stride `ldv`, the bytes of `len`
    /// elements) are in bounds.
    unsafe fn pv_r<const SUB: bool, const U4: bool, const R: usize>(args: PvArgs<'_>, pf: &mut Pf);
}

/// Implements [`QuantLoops`] for a tier by the free `qk_tiles` and `pv_r` of the module it is
/// invoked in (which names `QuantLoops`, `QkArgs`, `PvArgs` and `Pf`).
macro_rules! u8_loops_by {
    ($tier:ty) => {
        impl QuantLoops for $tier {
            unsafe fn qk_tiles<const SUB: bool, const U4: bool>(args: QkArgs<'_>, pf: Pf) {
                // SAFETY: the caller's guarantee (`QuantLoops::qk_tiles`).
                unsafe { qk_tiles::<SUB, U4>(args, pf) }
            }
            unsafe fn pv_r<const SUB: bool, const U4: bool, const R: usize>(
                args: PvArgs<'_>,
                pf: &mut Pf,
            ) {
                // SAFETY: the caller's guarantee (`QuantLoops::pv_r`).
                unsafe { pv_r::<SUB, U4, R>(args, pf) }
            }
        }
    };
}
pub(super) use u8_loops_by;

/// `T::qk_tiles` at the variant of `sub` and `u4`.
///
/// # Safety
/// As [`QuantLoops::qk_tiles`].
pub(super) unsafe fn qk<T: QuantLoops>(args: QkArgs<'_>, (sub, u4): (bool, bool), pf: Pf) {
    // SAFETY: the caller's guarantee.
    unsafe {
        match (sub, u4) {
            (false, false) => T::qk_tiles::<false, false>(args, pf),
            (true, false) => T::qk_tiles::<true, false>(args, pf),
            (false, true) => T::qk_tiles::<false, true>(args, pf),
            (true, true) => T::qk_tiles::<true, true>(args, pf),
        }
    }
}

/// `QuantMicro::pv` in blocks of up to 4 rows (`T::pv_r`) at the variant of `sub` and `u4`.
///
/// # Safety
/// The CPU has the tier's features and the arguments passed `pv_bounds`.
#[allow(clippy::type_complexity)]
pub(super) unsafe fn pv<T: QuantLoops>(
    (acc, lda, rows, w, v, ldv, zp, len): (
        &mut [f32],
        usize,
        usize,
        &[f32],
        &[u8],
        usize,
        &[f32],
        usize,
    ),
    (sub, u4): (bool, bool),
    mut pf: Pf,
) {
    let n = zp.len();
    let mut r = 0;
    while r < rows {
        let take = (rows - r).min(4);
        // SAFETY: the caller guarantees the features and that `pv_bounds` checked rows
        // `r..r + take` of `acc` (stride `lda`, `len` elements), `rows * n` weights of `w` and
        // the `n` value rows (stride `ldv`, the bytes of `len` elements each).
        unsafe {
            let (a, wp) = (acc.as_mut_ptr().add(r * lda), w.as_ptr().add(r * n));
            let (args, pf) = ((a, lda, wp, n, v.as_ptr(), ldv, zp, len), &mut pf);
            match (sub, u4) {
                (false, false) => pv_block::<T, false, false>(take, args, pf),
                (true, false) => pv_block::<T, true, false>(take, args, pf),
                (false, true) => pv_block::<T, false, true>(take, args, pf),
                (true, true) => pv_block::<T, true, true>(take, args, pf),
            }
        }
        r += take;
    }
}

/// `T::pv_r` for a block of `take` (1 to 4) rows.
///
/// # Safety
/// As [`QuantLoops::pv_r`] with `R = take`.
#[inline(always)]
unsafe fn pv_block<T: QuantLoops, const SUB: bool, const U4: bool>(
    take: usize,
    args: PvArgs<'_>,
    pf: &mut Pf,
) {
    // SAFETY: the caller's guarantee, for `take` rows.
    unsafe {
        match take {
            4 => T::pv_r::<SUB, U4, 4>(args, pf),
            3 => T::pv_r::<SUB, U4, 3>(args, pf),
            2 => T::pv_r::<SUB, U4, 2>(args, pf),
            _ => T::pv_r::<SUB, U4, 1>(args, pf),
        }
    }
}
