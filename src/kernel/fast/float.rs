//! Float caches (f32, f16, bf16) as a [`Source`]: decode items on the `DecodeMicro` loops
//! (`decode`), prefill items on the f32 tiles (`prefill`: f32 rows read in place, f16/bf16
//! rows widened once per call) or, for a bf16 query or cache on AMX CPUs, on AMX tiles
//! (`prefill_amx`).

use super::micro::Kernels;
use super::partition::{Item, Tuning};
use super::source::{Ctx, KeyTile, Out, Source};
use super::tile::SCRATCH;
use crate::dtype::{as_f32, Float};
use crate::error::Result;
use crate::kernel::layout::seq_row;

/// What prefill items of a float cache read besides the cache, prepared once per call.
pub(crate) enum Prepared {
    /// f32 copies of f16/bf16 K and V rows.
    Wide(super::prefill::Widened),
    /// bf16 K and V rows in AMX tile layouts (items of a bf16 query on AMX).
    #[cfg(target_arch = "x86_64")]
    Tiles(super::prefill_amx::Packed),
}

impl<C: Float> Source for C {
    const TUNING: Tuning = Tuning::FLOAT;
    type Layout = ();
    type Prep = Prepared;

    /// Packed for AMX tiles when the items run on them, else widened to f32 (see
    /// `prefill::prewiden`).
    fn prepare<M: Kernels, Q: Float>(m: M, ctx: &Ctx<'_, Q, C>) -> Result<Option<Prepared>> {
        #[cfg(target_arch = "x86_64")]
        if let Some(tier) = ctx.bf16_tier {
            let rows = super::prefill_amx::FloatRows { m, ctx };
            return Ok(super::prefill_amx::prepack(m, tier.bf, ctx, &rows).map(Prepared::Tiles));
        }
        Ok(super::prefill::prewiden(m, ctx).map(Prepared::Wide))
    }

    /// On bf16 products (AMX tiles or `vdpbf16ps`) when `ctx.bf16_tier` is set, else on the f32 tiles of `prefill`.
    fn prefill_item<M: Kernels, Q: Float>(m: M, ctx: &Ctx<'_, Q, C>, it: &Item, o: &Out<'_, Q, C>) {
        let prep = o.prep.as_ref();
        #[cfg(target_arch = "x86_64")]
        if let Some(tier) = ctx.bf16_tier {
            let packed = match prep {
                Some(Prepared::Tiles(p)) => Some(p),
                _ => None,
            };
            let rows = super::prefill_amx::FloatRows { m, ctx };
            return super::prefill_amx::run_item(m, tier, ctx, it, o, (packed, &rows));
        }
        let wide = match prep {
            Some(Prepared::Wide(w)) => Some(w),
            _ => None,
        };
        super::prefill::run_item(m, ctx, it, o, wide)
    }

    fn decode_item<M: Kernels, Q: Float>(m: M, ctx: &Ctx<'_, Q, C>, it: &Item, o: &Out<'_, Q, C>) {
        let (pw, sw) = (&o.pw, o.sw.as_ref());
        SCRATCH.with(|s| super::decode::run_decode_item(m, ctx, it, pw, sw, &mut s.borrow_mut()))
    }

    /// f32 rows read in place, f16/bf16 rows widened.
    fn keys<'s, Q>(ctx: &'s Ctx<'_, Q, C>, at: KeyTile, buf: &'s mut [f32]) -> &'s [f32] {
        let (plan, (sp, kvh, (j0, j1))) = (ctx.plan, at);
        let off = seq_row(plan, ctx.block_indices, sp, kvh, j0);
        let k = &ctx.kc[off..off + (j1 - j0) * plan.d];
        if let Some(k) = as_f32(k) {
            return k;
        }
        let buf = &mut buf[..k.len()];
        for (o, x) in buf.iter_mut().zip(k) {
            *o = x.to_f32();
        }
        buf
    }
}
