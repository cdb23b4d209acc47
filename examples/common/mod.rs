//! What the probes and the kernel benchmark share: deterministic inputs.

use paged_attention::Float;

/// `n` values in [-1, 1) from a xorshift stream seeded by `seed` (the same for every element
/// type: each value is made in f32, then converted).
pub fn noise<Q: Float>(n: usize, seed: u64) -> Vec<Q> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            Q::from_f32((x >> 40) as f32 / (1u64 << 23) as f32 - 1.0)
        })
        .collect()
}
