//! The software-prefetch cursor the decode loops of every x86 tier tick while they compute.

use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};

/// Prefetch cursor over one slice: `per` cache lines per [`Pf::tick`] until its end.
#[derive(Clone, Copy)]
pub(super) struct Pf {
    p: usize,
    end: usize,
    per: usize,
}

impl Pf {
    /// Spreads the lines of `x` over `ticks` ticks.
    pub(super) fn new<C>(x: &[C], ticks: usize) -> Pf {
        let start = x.as_ptr() as usize;
        let end = start + std::mem::size_of_val(x);
        let p = start & !63;
        Pf {
            p,
            end,
            per: (end - p).div_ceil(64).div_ceil(ticks.max(1)),
        }
    }

    /// A cursor that never prefetches (for the loops outside decode tiles).
    pub(super) fn none() -> Pf {
        Pf {
            p: 0,
            end: 0,
            per: 0,
        }
    }

    #[inline(always)]
    pub(super) fn tick(&mut self) {
        for _ in 0..self.per {
            if self.p >= self.end {
                return;
            }
            // SAFETY: a prefetch is a hint that never faults, whatever the address; SSE is part
            // of the x86_64 baseline.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(self.p as *const i8) };
            self.p += 64;
        }
    }
}
