//! A slice that several rayon tasks write at once, each into its own disjoint part.

use std::marker::PhantomData;

/// Shared write access to a slice whose users promise to touch disjoint ranges.
pub(crate) struct SharedMut<'a, T> {
    ptr: *mut T,
    len: usize,
    _borrow: PhantomData<&'a mut [T]>,
}

// SAFETY: a SharedMut is only a pointer to a `&mut [T]` borrowed for 'a; sending or sharing it
// across threads is as safe as sending the elements (`T: Send`), given the disjointness contract
// of `part`.
unsafe impl<T: Send> Send for SharedMut<'_, T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SharedMut<'_, T> {}

impl<'a, T> SharedMut<'a, T> {
    pub(crate) fn new(s: &'a mut [T]) -> Self {
        SharedMut {
            ptr: s.as_mut_ptr(),
            len: s.len(),
            _borrow: PhantomData,
        }
    }

    /// Panics unless elements `off..off + len` lie inside the slice.
    fn check(&self, off: usize, len: usize) {
        assert!(
            off <= self.len && len <= self.len - off,
            "SharedMut: range out of bounds"
        );
    }

    /// Asks the CPU to start loading part `i` of `parts` of elements `off..off + len` (a hint:
    /// no slice is made, so the range may be one another task holds).
    pub(crate) fn prefetch(&self, off: usize, len: usize, part: (usize, usize)) {
        self.check(off, len);
        let p = self.ptr.wrapping_add(off) as *const u8;
        crate::kernel::prefetch::prefetch_lines(p, len * std::mem::size_of::<T>(), part);
    }

    /// The address and byte length of elements `off..off + len`, for prefetch hints (no slice
    /// is made, so the range may be one another task holds).
    pub(crate) fn hint(&self, off: usize, len: usize) -> (*const u8, usize) {
        self.check(off, len);
        (
            self.ptr.wrapping_add(off) as *const u8,
            len * std::mem::size_of::<T>(),
        )
    }

    /// `len` elements from `off`.
    ///
    /// # Safety
    /// No two live slices obtained from this `SharedMut` may overlap.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn part(&self, off: usize, len: usize) -> &mut [T] {
        self.check(off, len);
        // SAFETY: in bounds (asserted); exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), len) }
    }
}
