//! The software-prefetch cursor the decode loops of every x86 tier tick while they compute.

use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};

/// Prefetch cursor over one slice: `per` cache lines per [`Pf::tick`] (or per group of ticks,
/// [`Pf::tick_every`]) until its end.
#[derive(Clone, Copy)]
pub(super) struct Pf {
    p: usize,
    end: usize,
    per: usize,
    /// Ticks since the last group ([`Pf::tick_every`]).
    c: usize,
}

impl Pf {
    /// Spreads the lines of `x` over `ticks` ticks.
    pub(super) fn new<C>(x: &[C], ticks: usize) -> Pf {
        Pf::grouped(x, ticks, 1)
    }

    /// Spreads the lines of `x` over `ticks` ticks in groups, one every `every` ticks (for
    /// [`Pf::tick_every`] with the same `every`).
    pub(super) fn grouped<C>(x: &[C], ticks: usize, every: usize) -> Pf {
        let start = x.as_ptr() as usize;
        let end = start + std::mem::size_of_val(x);
        let p = start & !63;
        Pf {
            p,
            end,
            per: (end - p)
                .div_ceil(64)
                .div_ceil((ticks / every.max(1)).max(1)),
            c: 0,
        }
    }

    /// A cursor that never prefetches (for the loops outside decode tiles).
    pub(super) fn none() -> Pf {
        Pf {
            p: 0,
            end: 0,
            per: 0,
            c: 0,
        }
    }

    /// A tick of a cursor made by [`Pf::grouped`] with the same `every`: the next group of
    /// lines at every `every`-th call. `every` should be a constant where the caller is
    /// compiled (1 makes this [`Pf::tick`]).
    #[inline(always)]
    pub(super) fn tick_every(&mut self, every: usize) {
        if every > 1 {
            self.c += 1;
            if self.c < every {
                return;
            }
            self.c = 0;
        }
        self.tick();
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
