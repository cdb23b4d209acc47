//! The KV cache tensors: one key and one value buffer per layer, `[num_blocks, Hkv, rows, cols]`
//! elements of the cache type each, sized from the converted graph's cache inputs and a byte
//! budget, zeroed, and never moved (OpenVINO's request holds tensors over them).

use crate::error::{EngineError, Result};
use paged_attention::ElemType;
use std::path::Path;

/// A cache buffer: zeroed, 8-byte aligned bytes.
pub(crate) struct CacheBuf {
    pub words: Vec<u64>,
    /// `[num_blocks, Hkv, rows, cols]`.
    pub shape: [usize; 4],
    pub block_bytes: usize,
}

impl CacheBuf {
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let len = self.words.len() * 8;
        // SAFETY: u64 storage viewed as its bytes: same allocation and length in bytes, u8 has no
        // alignment or validity requirement, and the borrow of `self.words` covers the result.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), len) }
    }
}

/// A layer's key and value cache geometry, `[Hkv, rows, cols]` of a block each.
pub(crate) type LayerDims = ([usize; 3], [usize; 3]);

/// The caches of every layer: as many blocks as `budget` bytes hold over all layers. A block of a
/// cache is the `[Hkv, rows, cols]` elements of its graph input (with u8 and u4 caches the rows or
/// columns of scales and zero points the converter added), sized by the cache's element type.
/// A u4 block is whole bytes when D is even, which the op requires (it refuses the graph
/// otherwise); the check keeps block copies on byte boundaries whatever the shapes.
pub(crate) fn allocate(
    layers: &[LayerDims],
    elem: ElemType,
    budget: usize,
    block_size: usize,
    graph: &Path,
) -> Result<Vec<(CacheBuf, CacheBuf)>> {
    let block_bytes = |[h, r, c]: [usize; 3], what: &str, l: usize| -> Result<usize> {
        let n = h.checked_mul(r).and_then(|hr| hr.checked_mul(c));
        match n.and_then(|n| elem.bytes_for(n).map(|b| (n, b))) {
            Some((n, b)) if (n % 8 * elem.bits()).is_multiple_of(8) => Ok(b),
            _ => Err(EngineError::Model {
                path: graph.to_path_buf(),
                detail: format!(
                    "a block of {what}_cache.{l} ([{h}, {r}, {c}] {elem}) is not a whole number of bytes"
                ),
            }),
        }
    };
    let mut sizes = Vec::with_capacity(layers.len());
    for (l, &(k, v)) in layers.iter().enumerate() {
        sizes.push((block_bytes(k, "key", l)?, block_bytes(v, "value", l)?));
    }
    let per_block: usize = sizes.iter().map(|(k, v)| k + v).sum();
    let num_blocks = budget / per_block.max(1);
    if num_blocks == 0 {
        return Err(EngineError::Config(format!(
            "a KV cache of {budget} bytes holds no block: one block of {block_size} tokens takes {per_block} bytes over {} layers",
            layers.len()
        )));
    }
    let make = |[h, r, c]: [usize; 3], block_bytes: usize| -> Result<CacheBuf> {
        let bytes = num_blocks * block_bytes;
        Ok(CacheBuf {
            words: zeroed_words(bytes.div_ceil(8))?,
            shape: [num_blocks, h, r, c],
            block_bytes,
        })
    };
    layers
        .iter()
        .zip(&sizes)
        .map(|(&(k, v), &(kb, vb))| Ok((make(k, kb)?, make(v, vb)?)))
        .collect()
}

/// `n` zero words from the allocator's zeroed memory (fresh pages are mapped zero and only
/// committed when written, so a large cache costs nothing until used), or an error when the
/// memory is not available.
fn zeroed_words(n: usize) -> Result<Vec<u64>> {
    let oom = || {
        EngineError::Config(format!(
            "cannot allocate a KV cache of {} bytes",
            n.saturating_mul(8)
        ))
    };
    if n == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u64>(n).map_err(|_| oom())?;
    // SAFETY: `layout` has a non-zero size (n > 0).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<u64>();
    if ptr.is_null() {
        return Err(oom());
    }
    // SAFETY: `ptr` was allocated by the global allocator with the layout of `n` u64s, all
    // initialised (zero), so it is a valid Vec with length and capacity `n`.
    Ok(unsafe { Vec::from_raw_parts(ptr, n, n) })
}
