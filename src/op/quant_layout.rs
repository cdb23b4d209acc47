//! The shapes of u8 and u4 caches in OpenVINO 2026.4.1's CPU-plugin layout ([`QuantLayout`], whose
//! `bits` says which), and how a call's tensor shapes say which layout they hold
//! (docs/contract.md, "u8 caches", "u4 caches"). The bytes' arithmetic (quantize, dequantize,
//! insert) is `kernel::quant`'s.
//!
//! Shapes count elements (u4: nibbles); the parameters are 8 bytes per group either way, so they
//! take 8 u8 elements or 16 u4 elements.

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

/// Layout of a pair of quantized caches (u8, or u4 with `bits` 4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QuantLayout {
    /// KV heads.
    pub hkv: usize,
    /// Key head size.
    pub d: usize,
    /// Value head size (OpenVINO allows it to differ from the key's).
    pub dv: usize,
    /// Tokens per block.
    pub bs: usize,
    pub key: KeyQuant,
    /// Channels per value group (0 = one group of D).
    pub value_group: usize,
    /// Bits per quantized element: 8 (u8) or 4 (u4, two per byte, the even element in the
    /// high nibble).
    pub bits: usize,
}

/// Elements the 8 parameter bytes of a group take in a cache of `bits`-bit elements (8 for
/// u8, 16 for u4).
pub fn param_elems(bits: usize) -> usize {
    PARAM_BYTES * 8 / bits
}

/// The group size a `*_CACHE_GROUP_SIZE` of `group` means for head size `d`.
pub(crate) fn effective_group(group: usize, d: usize) -> usize {
    if group == 0 {
        d
    } else {
        group
    }
}

/// Bytes of one u8 token row quantized by token: per group, 8 parameter bytes then the group's
/// bytes. `None` when `group` does not divide `d` (OpenVINO refuses to compile such a model).
pub fn token_row_bytes(d: usize, group: usize) -> Option<usize> {
    token_row_bytes_bits(d, group, 8)
}

/// Bytes of one token row of `bits`-bit elements: per group, 8 parameter bytes then the group's
/// `G * bits / 8` bytes. `None` when `group` does not divide `d`, or (u4) a group is not a
/// whole number of bytes.
pub fn token_row_bytes_bits(d: usize, group: usize, bits: usize) -> Option<usize> {
    let g = effective_group(group, d);
    if g == 0 || !d.is_multiple_of(g) || !(g * bits).is_multiple_of(8) {
        return None;
    }
    (d / g).checked_mul(PARAM_BYTES)?.checked_add(d * bits / 8)
}

/// The group size of a u8 by-token row of `cols` bytes for head size `d` ([`group_of_row_bits`]).
pub fn group_of_row(cols: usize, d: usize) -> Option<usize> {
    group_of_row_bits(cols, d, 8)
}

/// The group size of a by-token row of `cols` elements of `bits` bits for head size `d`:
/// `cols = d + p * d / G` (`p` = [`param_elems`]) for a `G` dividing `d`, given as 0 for one
/// group of `d` (OpenVINO's default, so a layout read from shapes equals the one its
/// properties name). `None` when no group size gives `cols`.
pub fn group_of_row_bits(cols: usize, d: usize, bits: usize) -> Option<usize> {
    let p = param_elems(bits);
    let extra = cols.checked_sub(d)?;
    if d == 0 || extra == 0 || !extra.is_multiple_of(p) {
        return None;
    }
    let groups = extra / p;
    let g = d / groups;
    (d.is_multiple_of(groups) && (g * bits).is_multiple_of(8)).then_some(if groups == 1 {
        0
    } else {
        g
    })
}

impl QuantLayout {
    /// Shape `[NB, Hkv, rows, cols]` of the key cache, in elements; `None` for a group that
    /// does not divide D.
    pub fn key_cache_dims(&self, nb: usize) -> Option<[usize; 4]> {
        let hkv = self.hkv;
        match self.key {
            KeyQuant::ByChannel => Some([
                nb,
                hkv,
                self.bs.checked_add(param_elems(self.bits))?,
                self.d,
            ]),
            KeyQuant::ByToken { group } => {
                Some([nb, hkv, self.bs, self.token_row_elems(self.d, group)?])
            }
        }
    }

    /// Elements of one by-token row of `width` channels with groups of `group`
    /// (`width + p * width / group`).
    fn token_row_elems(&self, width: usize, group: usize) -> Option<usize> {
        token_row_bytes_bits(width, group, self.bits)?
            .checked_mul(8)
            .map(|b| b / self.bits)
    }

    /// Shape `[NB, Hkv, BS, Dv + p * Dv / group]` of the value cache, in elements.
    pub fn value_cache_dims(&self, nb: usize) -> Option<[usize; 4]> {
        Some([
            nb,
            self.hkv,
            self.bs,
            self.token_row_elems(self.dv, self.value_group)?,
        ])
    }

    /// Bytes of one (block, head) slab of the key cache.
    pub(crate) fn key_slab(&self) -> usize {
        let [_, _, rows, cols] = self
            .key_cache_dims(1)
            .expect("layout checked by the caller");
        rows * cols * self.bits / 8
    }

    /// Bytes of one value row (one token of one head).
    pub(crate) fn value_row(&self) -> usize {
        token_row_bytes_bits(self.dv, self.value_group, self.bits)
            .expect("layout checked by the caller")
    }

    /// Whether the bit width is 8 or 4, every group size divides its head size (u4: into whole
    /// bytes, so D and Dv are even) and D, Dv, BS are non-zero.
    pub fn is_valid(&self) -> bool {
        let even = |x: usize| x.is_multiple_of(2);
        (self.bits == 8 || (self.bits == 4 && even(self.d) && even(self.dv)))
            && self.hkv > 0
            && self.d > 0
            && self.dv > 0
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

    #[test]
    fn u4_shapes_match_the_plugin_ports() {
        // as OpenVINO 2026.4.1 reports its u4 ports (tools/ov_u4_cache.py): key
        // [?, Hkv, BS + 16, D], value [?, Hkv, BS, D + 16 * D / G]
        let l = QuantLayout {
            hkv: 2,
            d: 64,
            dv: 64,
            bs: 32,
            key: KeyQuant::ByChannel,
            value_group: 16,
            bits: 4,
        };
        assert_eq!(l.key_cache_dims(3), Some([3, 2, 48, 64]));
        assert_eq!(l.value_cache_dims(3), Some([3, 2, 32, 128]));
        assert_eq!(l.key_slab(), 48 * 32);
        assert_eq!(l.value_row(), 64);
        assert_eq!(group_of_row_bits(128, 64, 4), Some(16));
        assert_eq!(group_of_row_bits(80, 64, 4), Some(0));
        assert_eq!(group_of_row_bits(72, 64, 4), None); // 8 extra nibbles: half a group's params
        for d in [8usize, 20, 40, 64] {
            for g in (2..=d).step_by(2) {
                if let Some(bytes) = token_row_bytes_bits(d, g, 4) {
                    let want = if g == d { 0 } else { g };
                    assert_eq!(
                        group_of_row_bits(bytes * 2, d, 4),
                        Some(want),
                        "d {d} g {g}"
                    );
                }
            }
        }
        assert!(!QuantLayout {
            d: 7,
            dv: 7,
            value_group: 0,
            ..l
        }
        .is_valid());
        assert!(!QuantLayout {
            value_group: 1,
            ..l
        }
        .is_valid());
    }
}
