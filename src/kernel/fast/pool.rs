//! Reused f32 buffers for the per-call results of attention (partial softmaxes, stashed score
//! logits). A fresh `vec![0.0; n]` of a few MiB is a fresh mapping: every call would fault in
//! and zero its pages (about 7% of a decode call on the shapes). Every element a call
//! reads from these buffers it has written first, so their old contents never matter.

use std::sync::Mutex;

/// Buffers kept between calls: at most this many, each at most this many f32 (16 MiB), so at
/// most 32 MiB stays allocated between calls.
const KEEP: usize = 2;
const KEEP_MAX_LEN: usize = 1 << 22;

static FREE: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());

/// A buffer of `n` f32 with unspecified (initialised) contents.
pub(crate) fn take(n: usize) -> Vec<f32> {
    let mut v = {
        let mut free = FREE.lock().unwrap_or_else(|e| e.into_inner());
        // The smallest kept buffer that fits, else the largest (to grow).
        let pick = (0..free.len())
            .filter(|&i| free[i].capacity() >= n)
            .min_by_key(|&i| free[i].capacity())
            .or_else(|| (0..free.len()).max_by_key(|&i| free[i].capacity()));
        pick.map(|i| free.swap_remove(i)).unwrap_or_default()
    };
    v.resize(n, 0.0);
    v
}

/// Returns a buffer for later calls (dropped when too large or when enough are kept).
pub(crate) fn give(v: Vec<f32>) {
    if v.capacity() == 0 || v.capacity() > KEEP_MAX_LEN {
        return;
    }
    let mut free = FREE.lock().unwrap_or_else(|e| e.into_inner());
    if free.len() < KEEP {
        free.push(v);
    }
}
