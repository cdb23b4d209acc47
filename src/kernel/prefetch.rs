//! Cache-line prefetch hints, for the kernels and the u8 quantizer alike (no effect on results).

/// Asks the CPU to start loading the cache lines of part `i` of `parts` equal parts of `x`
/// (a hint; no effect on results).
#[inline]
pub(crate) fn prefetch_part<T>(x: &[T], i: usize, parts: usize) {
    prefetch_lines(
        x.as_ptr() as *const u8,
        std::mem::size_of_val(x),
        (i, parts),
    );
}

/// [`prefetch_part`] of the `bytes` bytes at `p`, which need not be borrowed (a prefetch
/// reads nothing the program sees, and never faults).
#[inline]
pub(crate) fn prefetch_lines(p: *const u8, bytes: usize, (i, parts): (usize, usize)) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let lines = bytes.div_ceil(64);
        for l in lines * i / parts..lines * (i + 1) / parts {
            // SAFETY: prefetch never faults (the address is only a hint, hence `wrapping_add`);
            // SSE is part of the x86_64 baseline.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(l * 64) as *const i8) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, bytes, i, parts);
}
