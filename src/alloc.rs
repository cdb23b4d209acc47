//! Fallible allocation for buffers whose size comes from a caller: a size that cannot be
//! allocated becomes [`PaError::OutOfMemory`] instead of aborting the process (the C ABI
//! promises no aborts).

use crate::error::{PaError, Result};

/// `n` copies of `value`, or `OutOfMemory` naming `what` when the memory is not available.
pub fn try_vec<T: Clone>(n: usize, value: T, what: &str) -> Result<Vec<T>> {
    let mut v = try_with_capacity(n, what)?;
    v.resize(n, value);
    Ok(v)
}

/// An empty vector with room for `n` elements, or `OutOfMemory` naming `what`.
pub fn try_with_capacity<T>(n: usize, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| PaError::OutOfMemory {
        what: what.to_string(),
        bytes: n.saturating_mul(std::mem::size_of::<T>()),
    })?;
    Ok(v)
}
