//! u4 caches on the u8 kernel: insertion and rotation write the u4 bytes (`kernel::quant`, the
//! byte-checked code, at the layout's 4 bits). Decode items read the u4 bytes in place through
//! `quantized`'s loops (the micro-kernels widen nibbles in registers, `micro::QRows`). Prefill
//! items read u8 caches of the same layout at 8 bits (each nibble a byte, the f32 scales and
//! zero points copied), which dequantize to exactly the same values (`(q - zp) * scale`): the
//! blocks of prefill sequences are unpacked once per call ([`unpack`]), since many query tiles
//! read them. No second attention kernel.
//!
//! The call-wide buffers are held between calls (one pair per process, grown to the largest
//! call), so a prefill does not fault in fresh pages: their size is the u8 size of the prefill
//! sequences' blocks (twice their u4 size).

use super::shared::SharedMut;
use crate::error::{PaError, Result};
use crate::kernel::quant::{unpack_u4_slab, unpack_u4_token_rows, KeyQuant, QuantLayout};
use crate::op::Plan;
use crate::threads::Runner;
use std::sync::Mutex;

/// The reached blocks of a call as u8 caches.
pub(crate) struct Unpacked {
    /// The u8 layout (the u4 layout at 8 bits).
    pub layout: QuantLayout,
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
    l: &QuantLayout,
    (kc, vc, block_indices): (&[u8], &[u8], &[i32]),
    want: impl Fn(usize) -> bool,
) -> Result<Unpacked> {
    debug_assert_eq!(l.bits, 4);
    let u8l = QuantLayout { bits: 8, ..*l };
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
