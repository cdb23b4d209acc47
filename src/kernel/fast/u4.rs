//! u4 caches on the u8 kernel: insertion and rotation write the u4 bytes (`kernel::quant`, the
//! byte-checked code, at the layout's 4 bits); attention and scores read u8 caches of the same
//! layout at 8 bits (each nibble a byte, the f32 scales and zero points copied), which
//! dequantize to exactly the same values (`(q - zp) * scale`), through `quantized`'s loops. No
//! second attention kernel. Decode items unpack their own blocks and heads just before
//! attending ([`ItemBlocks`], per thread); the blocks of prefill sequences are unpacked once
//! per call ([`unpack`]), since many query tiles read them.
//!
//! The call-wide buffers are held between calls (one pair per process, grown to the largest
//! call), so a prefill does not fault in fresh pages: their size is the u8 size of the prefill
//! sequences' blocks (twice their u4 size).

use super::shared::SharedMut;
use crate::error::{PaError, Result};
use crate::kernel::prefetch::prefetch_part;
use crate::kernel::quant::{unpack_u4_slab, unpack_u4_token_rows, KeyQuant, U8Layout};
use crate::op::Plan;
use crate::threads::Runner;
use std::sync::Mutex;

/// The reached blocks of a call as u8 caches.
pub(crate) struct Unpacked {
    /// The u8 layout (the u4 layout at 8 bits).
    pub layout: U8Layout,
    pub kc: Vec<u8>,
    pub vc: Vec<u8>,
    /// The call's block table with every reached entry renumbered into the unpacked caches
    /// (entries no token reaches are -1).
    pub block_indices: Vec<i32>,
}

/// The unpacked key and value buffers kept between calls.
type Kept = (Vec<u8>, Vec<u8>);

static KEPT: Mutex<Kept> = Mutex::new((Vec::new(), Vec::new()));

/// A buffer of `n` bytes (contents unspecified), from the kept ones when there is one.
fn take(which: fn(&mut Kept) -> &mut Vec<u8>, n: usize) -> Result<Vec<u8>> {
    let mut v = {
        let mut kept = KEPT.lock().unwrap_or_else(|e| e.into_inner());
        std::mem::take(which(&mut kept))
    };
    if v.capacity() < n {
        v.clear();
        v.try_reserve_exact(n)
            .map_err(|_| PaError::InvalidArgument {
                detail: format!("cannot allocate {n} bytes to unpack the u4 caches"),
            })?;
    }
    v.resize(n, 0);
    Ok(v)
}

impl Unpacked {
    /// Gives the buffers back for the next call.
    pub fn keep(self) {
        let mut kept = KEPT.lock().unwrap_or_else(|e| e.into_inner());
        kept.0 = self.kc;
        kept.1 = self.vc;
    }
}

/// Unpacks the blocks of u4 caches `kc`, `vc` (layout `l`, 4 bits) that the plan's sequences
/// `want(s)` reach (validated: every reached entry of `block_indices` is a block of the caches).
pub(crate) fn unpack(
    runner: Runner,
    plan: &Plan,
    l: &U8Layout,
    (kc, vc, block_indices): (&[u8], &[u8], &[i32]),
    want: impl Fn(usize) -> bool,
) -> Result<Unpacked> {
    debug_assert_eq!(l.bits, 4);
    let u8l = U8Layout { bits: 8, ..*l };
    let mut renum = vec![-1i32; plan.nb];
    let mut reached = Vec::new();
    let mut table = vec![-1i32; block_indices.len()];
    for (_, sp) in plan.seqs.iter().enumerate().filter(|(s, _)| want(*s)) {
        for k in 0..sp.ctx().div_ceil(plan.bs) {
            let at = sp.block_begin + k;
            let b = block_indices[at] as usize;
            if renum[b] < 0 {
                renum[b] = reached.len() as i32;
                reached.push(b);
            }
            table[at] = renum[b];
        }
    }
    let (hkv, n) = (l.hkv, reached.len());
    let (ks4, ks8) = (l.key_slab(), u8l.key_slab());
    let (vr4, vr8) = (l.value_row() * l.bs, u8l.value_row() * l.bs);
    let mut k8 = take(|k| &mut k.0, n * hkv * ks8)?;
    let mut v8 = take(|k| &mut k.1, n * hkv * vr8)?;
    {
        let (ko, vo) = (SharedMut::new(&mut k8), SharedMut::new(&mut v8));
        runner.for_each(n * hkv, &|i| {
            let (r, h) = (i / hkv, i % hkv);
            let src = reached[r] * hkv + h;
            // SAFETY: item i alone writes slab i of each unpacked cache.
            let (kd, vd) = unsafe { (ko.part(i * ks8, ks8), vo.part(i * vr8, vr8)) };
            let ks = &kc[src * ks4..][..ks4];
            match l.key {
                KeyQuant::ByChannel => unpack_u4_slab(ks, l.d, kd),
                KeyQuant::ByToken { group } => unpack_u4_token_rows(ks, l.d, group, kd),
            }
            unpack_u4_token_rows(&vc[src * vr4..][..vr4], l.dv, l.value_group, vd);
        });
    }
    Ok(Unpacked {
        layout: u8l,
        kc: k8,
        vc: v8,
        block_indices: table,
    })
}

/// One decode item's blocks unpacked (a thread's buffers, reused across items and calls): the
/// item's keys stay in the core's cache between unpacking and attention, where unpacking the
/// whole call first would write and read back twice the u4 bytes through memory.
#[derive(Default)]
pub(crate) struct ItemBlocks {
    kc: Vec<u8>,
    vc: Vec<u8>,
    table: Vec<i32>,
}

impl ItemBlocks {
    /// Unpacks the blocks holding keys `k0..k1` of the sequence whose block list starts at
    /// `block_begin`, for KV heads `h0..h1` (other heads' bytes are stale), into u8 caches whose
    /// block `k - k0 / BS` is the sequence's `k`-th; returns them with a block table
    /// `[k1.div_ceil(BS)]` for a sequence whose `block_begin` is 0.
    #[allow(clippy::too_many_arguments)]
    pub fn unpack(
        &mut self,
        plan: &Plan,
        l: &U8Layout,
        (kc, vc, block_indices): (&[u8], &[u8], &[i32]),
        block_begin: usize,
        (k0, k1): (usize, usize),
        (h0, h1): (usize, usize),
    ) -> (&[u8], &[u8], &[i32]) {
        let u8l = U8Layout { bits: 8, ..*l };
        let (bs, hkv) = (plan.bs, l.hkv);
        let (kb0, kb1) = (k0 / bs, k1.div_ceil(bs));
        let n = kb1 - kb0;
        let (ks4, ks8) = (l.key_slab(), u8l.key_slab());
        let (vr4, vr8) = (l.value_row() * bs, u8l.value_row() * bs);
        for (v, len) in [(&mut self.kc, n * hkv * ks8), (&mut self.vc, n * hkv * vr8)] {
            if v.len() < len {
                v.resize(len, 0);
            }
        }
        self.table.clear();
        self.table
            .extend((0..kb1).map(|k| if k < kb0 { -1 } else { (k - kb0) as i32 }));
        let src_of = |k: usize, h: usize| block_indices[block_begin + k] as usize * hkv + h;
        for k in kb0..kb1 {
            for h in h0..h1 {
                let (src, dst) = (src_of(k, h), (k - kb0) * hkv + h);
                // The blocks are scattered, beyond the hardware prefetcher: request the next
                // (block, head)'s bytes while this one is unpacked.
                let next = if h + 1 < h1 {
                    Some(src + 1)
                } else if k + 1 < kb1 {
                    Some(src_of(k + 1, h0))
                } else {
                    None
                };
                if let Some(n) = next {
                    prefetch_part(&kc[n * ks4..][..ks4], 0, 1);
                    prefetch_part(&vc[n * vr4..][..vr4], 0, 1);
                }
                let kd = &mut self.kc[dst * ks8..][..ks8];
                let ks = &kc[src * ks4..][..ks4];
                match l.key {
                    KeyQuant::ByChannel => unpack_u4_slab(ks, l.d, kd),
                    KeyQuant::ByToken { group } => unpack_u4_token_rows(ks, l.d, group, kd),
                }
                let vd = &mut self.vc[dst * vr8..][..vr8];
                unpack_u4_token_rows(&vc[src * vr4..][..vr4], l.dv, l.value_group, vd);
            }
        }
        (&self.kc, &self.vc, &self.table)
    }
}
