//! u8 caches for tests: a case's past tokens quantized into OpenVINO-layout caches, the case seen
//! through the dequantized caches (what the float64 reference compares with), and the case as an
//! op call on u8 caches.

use super::call::{idx, Call, Data, Owned};
use super::ref64::Case;
use paged_attention::kernel::quant::{self, KeyQuant, QuantLayout};
use paged_attention::op::validate::SeqPlan;

/// (key mode, value group) variants: by-channel keys with one value group and with groups of 16,
/// by-token keys with one group, by-token key groups of 8 with value groups of 32.
pub const LAYOUTS: [(KeyQuant, usize); 4] = [
    (KeyQuant::ByChannel, 0),
    (KeyQuant::ByChannel, 16),
    (KeyQuant::ByToken { group: 0 }, 0),
    (KeyQuant::ByToken { group: 8 }, 32),
];

/// The layout of `(key, value_group)` for the case's geometry, a group of the whole head (D
/// for keys, Dv for values) written as 0 (one group), as the op reads it from the shapes.
pub fn layout_for(c: &Case, key: KeyQuant, value_group: usize) -> QuantLayout {
    layout_for_bits(c, key, value_group, 8)
}

/// [`layout_for`] with `bits`-bit elements (8: u8, 4: u4).
pub fn layout_for_bits(c: &Case, key: KeyQuant, value_group: usize, bits: usize) -> QuantLayout {
    let one = |g: usize, w: usize| if g == w { 0 } else { g };
    QuantLayout {
        hkv: c.hkv,
        d: c.d,
        dv: c.dv,
        bs: c.bs,
        key: match key {
            KeyQuant::ByToken { group } => KeyQuant::ByToken {
                group: one(group, c.d),
            },
            k => k,
        },
        value_group: one(value_group, c.dv),
        bits,
    }
}

/// The case as an op call whose caches are u8 (u4 when `l.bits` is 4) of layout `l`, holding
/// the past tokens (quantized as a prefill of each sequence would).
pub fn u8_call(c: &Case, l: &QuantLayout) -> Call {
    let (kc, vc) = u8_caches_with_past(c, l);
    let data = |b: Vec<u8>| {
        if l.bits == 4 {
            Data::U4(b)
        } else {
            Data::U8(b)
        }
    };
    let mut call = c.to_call();
    call.inputs[idx::KEY_CACHE] = Owned::new(&l.key_cache_dims(c.nb).unwrap(), data(kc));
    call.inputs[idx::VALUE_CACHE] = Owned::new(&l.value_cache_dims(c.nb).unwrap(), data(vc));
    call
}

/// Bytes of a cache of `dims` elements of `bits` bits.
fn cache_bytes(dims: [usize; 4], bits: usize) -> usize {
    dims.iter().product::<usize>() * bits / 8
}

/// Rows `[T, Hkv*W]` of the case's cache of rows `W` wide (`D` keys, `Dv` values) at each
/// sequence's first `upto(s)` positions.
pub fn cached_rows(
    c: &Case,
    (cache, w): (&[f64], usize),
    upto: impl Fn(usize) -> usize,
) -> Vec<f32> {
    let mut rows = Vec::new();
    for s in 0..c.seqs.len() {
        for pos in 0..upto(s) {
            for h in 0..c.hkv {
                let r = ((c.block_of(s, pos) * c.hkv + h) * c.bs + pos % c.bs) * w;
                rows.extend(cache[r..r + w].iter().map(|&x| x as f32));
            }
        }
    }
    rows
}

/// The past tokens of `c` quantized into fresh u8 caches, as a prefill of each sequence would.
pub fn u8_caches_with_past(c: &Case, l: &QuantLayout) -> (Vec<u8>, Vec<u8>) {
    let mut kc = vec![0u8; cache_bytes(l.key_cache_dims(c.nb).unwrap(), l.bits)];
    let mut vc = vec![0u8; cache_bytes(l.value_cache_dims(c.nb).unwrap(), l.bits)];
    let mut begin = 0;
    let seqs: Vec<SeqPlan> = c
        .seqs
        .iter()
        .enumerate()
        .map(|(s, sq)| {
            let sp = SeqPlan {
                past: 0,
                begin,
                n: sq.past,
                block_begin: c.block_indices_begins[s] as usize,
                score_tokens: 0,
                score_offset: 0,
            };
            begin += sq.past;
            sp
        })
        .collect();
    let keys = cached_rows(c, (&c.key_cache, c.d), |s| c.seqs[s].past);
    let values = cached_rows(c, (&c.value_cache, c.dv), |s| c.seqs[s].past);
    quant::insert_u8(l, &seqs, &c.block_indices, &keys, &values, &mut kc, &mut vc);
    (kc, vc)
}

/// `c` with its caches replaced by the dequantized u8 caches (after the call) and its new keys and
/// values by their dequantized rows, so the float64 reference inserts exactly what the u8 cache
/// holds.
pub fn dequantized_case(c: &Case, l: &QuantLayout, kc: &[u8], vc: &[u8]) -> Case {
    let mut out = c.clone();
    let (mut row, mut vrow) = (vec![0f32; c.d], vec![0f32; c.dv]);
    for block in 0..c.nb {
        for h in 0..c.hkv {
            for slot in 0..c.bs {
                let r = c.row(block, h, slot);
                quant::key_row(l, kc, block, h, slot, &mut row);
                out.key_cache[r..r + c.d]
                    .iter_mut()
                    .zip(&row)
                    .for_each(|(o, &x)| *o = x as f64);
                let r = c.vrow(block, h, slot);
                quant::value_row(l, vc, block, h, slot, &mut vrow);
                out.value_cache[r..r + c.dv]
                    .iter_mut()
                    .zip(&vrow)
                    .for_each(|(o, &x)| *o = x as f64);
            }
        }
    }
    let mut t = 0;
    for (s, sq) in c.seqs.iter().enumerate() {
        for i in 0..sq.n {
            let pos = sq.past + i;
            for h in 0..c.hkv {
                let (b, slot) = (c.block_of(s, pos), pos % c.bs);
                let (r, vr) = (c.row(b, h, slot), c.vrow(b, h, slot));
                let (dst, vdst) = ((t * c.hkv + h) * c.d, (t * c.hkv + h) * c.dv);
                out.key[dst..dst + c.d].copy_from_slice(&out.key_cache[r..r + c.d]);
                out.value[vdst..vdst + c.dv].copy_from_slice(&out.value_cache[vr..vr + c.dv]);
            }
            t += 1;
        }
    }
    out
}
