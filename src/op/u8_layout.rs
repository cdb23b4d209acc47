//! The shapes of u8 caches in OpenVINO 2026.4.1's CPU-plugin layout ([`U8Layout`]), and how a
//! call's tensor shapes say which layout they hold (docs/contract.md, "u8 caches"). The bytes'
//! arithmetic (quantize, dequantize, insert) is `kernel::quant`'s.

/// Bytes of quantization parameters per group: f32 scale, then f32 zero point.
pub const PARAM_BYTES: usize = 8;

/// How keys are quantized.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyQuant {
    /// Per channel over the tokens of a block (OpenVINO's default): key cache
    /// `[NB, Hkv, BS + 8, D]`, scales and zero points of the block's D channels first.
    ByChannel,
    /// Per token like values (`KEY_CACHE_QUANT_MODE=BY_TOKEN`), in groups of `group` channels
    /// (0 = one group of D): key cache `[NB, Hkv, BS, D + 8 * D / group]`.
    ByToken { group: usize },
}

/// Layout of a pair of u8 caches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct U8Layout {
    /// KV heads.
    pub hkv: usize,
    /// Head size.
    pub d: usize,
    /// Tokens per block.
    pub bs: usize,
    pub key: KeyQuant,
    /// Channels per value group (0 = one group of D).
    pub value_group: usize,
}

/// The group size a `*_CACHE_GROUP_SIZE` of `group` means for head size `d`.
pub(crate) fn effective_group(group: usize, d: usize) -> usize {
    if group == 0 {
        d
    } else {
        group
    }
}

/// Bytes of one token row quantized by token: per group, 8 parameter bytes then the group's bytes.
/// `None` when `group` does not divide `d` (OpenVINO refuses to compile such a model).
pub fn token_row_bytes(d: usize, group: usize) -> Option<usize> {
    let g = effective_group(group, d);
    if g == 0 || !d.is_multiple_of(g) {
        return None;
    }
    (d / g).checked_mul(PARAM_BYTES)?.checked_add(d)
}

/// The group size of a by-token row of `cols` bytes for head size `d`: `cols = d + 8 * d / G`
/// for a `G` dividing `d`, given as 0 for one group of `d` (OpenVINO's default, so a layout read
/// from shapes equals the one its properties name). `None` when no group size gives `cols`.
pub fn group_of_row(cols: usize, d: usize) -> Option<usize> {
    let extra = cols.checked_sub(d)?;
    if d == 0 || extra == 0 || !extra.is_multiple_of(PARAM_BYTES) {
        return None;
    }
    let groups = extra / PARAM_BYTES;
    d.is_multiple_of(groups)
        .then_some(if groups == 1 { 0 } else { d / groups })
}

impl U8Layout {
    /// Shape `[NB, Hkv, rows, cols]` of the key cache; `None` for a group that does not divide D.
    pub fn key_cache_dims(&self, nb: usize) -> Option<[usize; 4]> {
        let hkv = self.hkv;
        match self.key {
            KeyQuant::ByChannel => Some([nb, hkv, self.bs.checked_add(PARAM_BYTES)?, self.d]),
            KeyQuant::ByToken { group } => {
                Some([nb, hkv, self.bs, token_row_bytes(self.d, group)?])
            }
        }
    }

    /// Shape `[NB, Hkv, BS, D + 8 * D / group]` of the value cache.
    pub fn value_cache_dims(&self, nb: usize) -> Option<[usize; 4]> {
        Some([
            nb,
            self.hkv,
            self.bs,
            token_row_bytes(self.d, self.value_group)?,
        ])
    }

    /// Bytes of one (block, head) slab of the key cache.
    pub(crate) fn key_slab(&self) -> usize {
        let [_, _, rows, cols] = self
            .key_cache_dims(1)
            .expect("layout checked by the caller");
        rows * cols
    }

    /// Bytes of one value row (one token of one head).
    pub(crate) fn value_row(&self) -> usize {
        token_row_bytes(self.d, self.value_group).expect("layout checked by the caller")
    }

    /// Whether every group size divides D and D, BS are non-zero.
    pub fn is_valid(&self) -> bool {
        self.hkv > 0
            && self.d > 0
            && self.bs > 0
            && self.key_cache_dims(1).is_some()
            && self.value_cache_dims(1).is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_of_row_inverts_token_row_bytes() {
        for d in [8usize, 20, 40, 64, 128] {
            for g in 1..=d {
                if let Some(cols) = token_row_bytes(d, g) {
                    let want = if g == d { 0 } else { g };
                    assert_eq!(group_of_row(cols, d), Some(want), "d {d} g {g}");
                }
            }
        }
        assert_eq!(group_of_row(64, 64), None);
        assert_eq!(group_of_row(60, 64), None);
        assert_eq!(group_of_row(76, 64), None); // 12 extra bytes: not whole groups
        assert_eq!(group_of_row(64 + 8 * 3, 64), None); // 3 groups do not divide 64
    }
}
