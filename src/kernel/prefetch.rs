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

/// Asks the CPU to bring every cache line of `x` into its L2 cache (a hint; no effect on
/// results). A burst of these for data a few steps ahead keeps more lines in flight than the
/// L1 requests of [`prefetch_lines`] can.
#[inline]
pub(crate) fn prefetch_l2<T>(x: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let p = x.as_ptr() as *const u8;
        for l in 0..std::mem::size_of_val(x).div_ceil(64) {
            // SAFETY: prefetch never faults (the address is only a hint, hence `wrapping_add`);
            // SSE is part of the x86_64 baseline.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(l * 64) as *const i8) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = x;
}

/// Cache lines to request spread evenly over the steps of a loop (so the requests never queue
/// up behind each other, and the loop's own loads never wait behind a burst of them): `push`
/// ranges, `start` with the number of steps, then `tick` once a step requests the next share;
/// `finish` requests what is left.
#[derive(Default)]
pub(crate) struct Spread {
    lines: Vec<usize>,
    next: usize,
    per: usize,
}

impl Spread {
    /// Forgets the lines not yet requested.
    pub(crate) fn clear(&mut self) {
        self.lines.clear();
        self.next = 0;
    }

    /// Adds the lines of part `i` of `parts` equal parts of the `bytes` bytes at `p` (as
    /// [`prefetch_lines`] splits them; `p` need not be borrowed, it is only a hint).
    pub(crate) fn push(&mut self, p: *const u8, bytes: usize, (i, parts): (usize, usize)) {
        let lines = bytes.div_ceil(64);
        let base = p as usize;
        self.lines.extend(
            (lines * i / parts..lines * (i + 1) / parts).map(|l| base.wrapping_add(l * 64)),
        );
    }

    /// Spreads the lines over `ticks` ticks.
    pub(crate) fn start(&mut self, ticks: usize) {
        self.per = (self.lines.len() - self.next).div_ceil(ticks.max(1));
    }

    /// Requests the next share of lines.
    #[inline]
    pub(crate) fn tick(&mut self) {
        let end = (self.next + self.per).min(self.lines.len());
        for &a in &self.lines[self.next..end] {
            prefetch_lines(a as *const u8, 64, (0, 1));
        }
        self.next = end;
    }

    /// Requests every line not yet requested.
    pub(crate) fn finish(&mut self) {
        self.per = self.lines.len();
        self.tick();
    }
}
