//! A cache type, as the pipeline sees it: a source of key and value tiles. The pipeline
//! (`partition`, the driver and merge in `attention`, the f32 prefill loop `prefill::attend`,
//! the scores) is written once; a cache type says how a call's rows are prepared, how a decode
//! item's rows meet its keys and values, which tiles a prefill item reads, and how many keys
//! and items its decode work is cut into ([`Tuning`]). Float caches (f32, f16, bf16) are
//! `float`; quantized caches (u8, and u4 through their u8 form) are `quantized`.

use super::micro::{Amx, TileMicro, U8Micro};
use super::partition::{Item, Partition, Tuning};
use super::shared::SharedMut;
use crate::dtype::Float;
use crate::error::Result;
use crate::op::{Plan, SeqPlan};

/// Where a prefill item writes: its rows' `[m, l]` partial-result slots, its output rows, and
/// the stash of score-row logits (when the partition keeps one).
pub(crate) type PrefillOut<'a, 'p, 'o, 's, Q> = (
    &'a SharedMut<'p, f32>,
    &'a SharedMut<'o, Q>,
    Option<&'a SharedMut<'s, f32>>,
);

/// A cache type (its element: `f32`, `f16`, `bf16`, or `u8` bytes in OpenVINO's quantized
/// layouts).
pub(crate) trait Source: Copy + Send + Sync + 'static {
    /// How decode work on this cache is cut.
    const TUNING: Tuning;
    /// How the cache lays out its rows, beyond the plan's shapes.
    type Layout: Copy + Send + Sync;
    /// What a call prepares once for its prefill items (rows widened or dequantized once,
    /// AMX tiles packed, u4 blocks unpacked).
    type Prep: Sync;
    /// Prepares the call's prefill items, `None` when they read the cache tile by tile.
    fn prepare<M: TileMicro + U8Micro, Q: Float>(
        m: M,
        ctx: &Ctx<'_, Q, Self>,
    ) -> Result<Option<Self::Prep>>;
    /// Runs one prefill item (see `prefill::run_item_on`).
    fn prefill_item<M: TileMicro + U8Micro, Q: Float>(
        m: M,
        ctx: &Ctx<'_, Q, Self>,
        it: &Item,
        out: PrefillOut<'_, '_, '_, '_, Q>,
        prep: Option<&Self::Prep>,
    );
    /// Runs one decode item: writes the `[max, sum, acc]` slot of each of its rows for its
    /// chunk into `pw` (rows `[n][H]` from the sequence's `part_base`, `nchunks` slots of
    /// `Dv + 2` each), and its score rows' masked logits over its chunk's keys into `sw`.
    fn decode_item<M: TileMicro + U8Micro, Q: Float>(
        m: M,
        ctx: &Ctx<'_, Q, Self>,
        it: &Item,
        pw: &SharedMut<'_, f32>,
        sw: Option<&SharedMut<'_, f32>>,
    );
    /// The f32 keys `j0..j1` (inside one block) of KV head `kvh` of sequence `sp`, as the
    /// attention read them (`[n][D]`, in `buf` unless f32 in memory): what the scores
    /// recompute logits from when their stash would be over budget.
    fn keys<'s, M: TileMicro + U8Micro, Q>(
        m: M,
        ctx: &'s Ctx<'_, Q, Self>,
        sp: &SeqPlan,
        kvh: usize,
        j0: usize,
        j1: usize,
        buf: &'s mut [f32],
    ) -> &'s [f32];
    /// Gives back what `prepare` took.
    fn release(_prep: Self::Prep) {}
}

/// What every item reads.
pub(crate) struct Ctx<'a, Q, C: Source> {
    pub plan: &'a Plan,
    pub part: &'a Partition,
    pub query: &'a [Q],
    pub kc: &'a [C],
    pub vc: &'a [C],
    pub block_indices: &'a [i32],
    /// Where the parallel regions run.
    pub runner: crate::threads::Runner,
    /// Set when prefill items run their products on AMX tiles (bf16 query only).
    pub amx: Option<Amx>,
    /// How the cache type lays out its rows (quantized caches: OpenVINO's layout).
    pub layout: C::Layout,
}
