//! Reused buffers for what a call allocates in proportion to its size: the partial softmaxes
//! and stashed score logits of attention (f32), the widened (f32) or AMX-packed (bf16 bits,
//! u16) K/V rows of prefill sequences. A fresh `vec![0; n]` of a few MiB is a fresh mapping:
//! every call would fault in and zero its pages (about 7% of a decode call on the issue's
//! shapes, 2% of a prefill). [`take`] hands out buffers with unspecified contents, so every
//! element a call reads from one it must have written first; [`Buf::zeroed`] is for the users
//! that rely on zeros.

use std::ops::{Deref, DerefMut};
use std::sync::Mutex;

/// Buffers kept between calls, per element type: at most this many, each at most this many
/// elements, so at most 4 x 16 MiB of f32 and 4 x 8 MiB of u16 stay allocated between calls.
const KEEP: usize = 4;
const KEEP_MAX_LEN: usize = 1 << 22;

/// An element type with a free list.
pub(crate) trait Pooled: Copy + Default + Send + 'static {
    fn free() -> &'static Mutex<Vec<Vec<Self>>>;
}

impl Pooled for f32 {
    fn free() -> &'static Mutex<Vec<Vec<f32>>> {
        static FREE: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());
        &FREE
    }
}

impl Pooled for u16 {
    fn free() -> &'static Mutex<Vec<Vec<u16>>> {
        static FREE: Mutex<Vec<Vec<u16>>> = Mutex::new(Vec::new());
        &FREE
    }
}

/// A buffer of `n` elements with unspecified (initialised) contents.
pub(crate) fn take<T: Pooled>(n: usize) -> Vec<T> {
    let mut v = {
        let mut free = T::free().lock().unwrap_or_else(|e| e.into_inner());
        // The smallest kept buffer that fits, else the largest (to grow).
        let pick = (0..free.len())
            .filter(|&i| free[i].capacity() >= n)
            .min_by_key(|&i| free[i].capacity())
            .or_else(|| (0..free.len()).max_by_key(|&i| free[i].capacity()));
        pick.map(|i| free.swap_remove(i)).unwrap_or_default()
    };
    v.resize(n, T::default());
    v
}

/// Returns a buffer for later calls (dropped when too large or when enough are kept).
pub(crate) fn give<T: Pooled>(v: Vec<T>) {
    if v.capacity() == 0 || v.capacity() > KEEP_MAX_LEN {
        return;
    }
    let mut free = T::free().lock().unwrap_or_else(|e| e.into_inner());
    if free.len() < KEEP {
        free.push(v);
    }
}

/// A pooled buffer that goes back to the pool when dropped.
pub(crate) struct Buf<T: Pooled>(Vec<T>);

impl<T: Pooled> Buf<T> {
    /// `n` zeros.
    pub fn zeroed(n: usize) -> Buf<T> {
        let mut v = take(n);
        v.fill(T::default());
        Buf(v)
    }

    /// `n` elements with unspecified (initialised) contents, as [`take`].
    pub fn any(n: usize) -> Buf<T> {
        Buf(take(n))
    }
}

impl<T: Pooled> Drop for Buf<T> {
    fn drop(&mut self) {
        give(std::mem::take(&mut self.0));
    }
}

impl<T: Pooled> Deref for Buf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.0
    }
}

impl<T: Pooled> DerefMut for Buf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.0
    }
}
