//! A cache type, as the pipeline sees it: a source of key and value tiles. The pipeline
//! (`partition`, the driver and merge in `attention`, the f32 prefill loop `prefill::attend`,
//! the scores) is written once; a cache type says how a call's rows are prepared, how a decode
//! item's rows meet its keys and values, which tiles a prefill item reads, and how many keys
//! and items its decode work is cut into ([`Tuning`]). Float caches (f32, f16, bf16) are
//! `float`; quantized caches (u8, and u4: nibbles read in place by decode, through their u8
//! form by prefill) are `quantized`.

use super::micro::{Bf16Tier, Kernels};
use super::partition::{Item, Partition, Tuning};
use super::shared::SharedMut;
use crate::dtype::Float;
use crate::error::Result;
use crate::op::{Plan, SeqPlan};

/// What an item writes, and what the call prepared for it: the partial-result slots, the
/// output rows (prefill items write theirs), the stash of score-row logits (when the partition
/// keeps one), the direct partial scores, and the cache type's preparation.
pub(crate) struct Out<'a, Q, C: Source> {
    pub pw: SharedMut<'a, f32>,
    pub out: SharedMut<'a, Q>,
    pub sw: Option<SharedMut<'a, f32>>,
    /// The direct partial scores (`partition::SeqLayout::direct`).
    pub direct: SharedMut<'a, f32>,
    pub prep: Option<C::Prep>,
}

/// The keys `j0..j1` (inside one block) of KV head `kvh` of a sequence: `(sp, kvh, (j0, j1))`.
pub(crate) type KeyTile<'a> = (&'a SeqPlan, usize, (usize, usize));

/// A cache type (its element: `f32`, `f16`, `bf16`, or `u8` bytes in OpenVINO's quantized
/// layouts).
pub(crate) trait Source: Copy + Send + Sync + 'static {
    /// How work on this cache is cut, and whether its items sum their score rows' weights
    /// themselves (`Tuning::direct_scores`).
    const TUNING: Tuning;
    /// How the cache lays out its rows, beyond the plan's shapes.
    type Layout: Copy + Send + Sync;
    /// What a call prepares once for its prefill items (rows widened or dequantized once,
    /// AMX tiles packed, u4 blocks of prefill sequences unpacked).
    type Prep: Sync;
    /// Prepares the call's prefill items, `None` when they read the cache tile by tile.
    fn prepare<M: Kernels, Q: Float>(m: M, ctx: &Ctx<'_, Q, Self>) -> Result<Option<Self::Prep>>;
    /// Runs one prefill item (see `prefill::run_item_on`): writes its rows' outputs, their
    /// `[max, sum]` slots, and its score rows' logits into the stash or (the sequence's
    /// `direct` partial scores) their final weights.
    fn prefill_item<M: Kernels, Q: Float>(
        m: M,
        ctx: &Ctx<'_, Q, Self>,
        it: &Item,
        o: &Out<'_, Q, Self>,
    );
    /// Runs one decode item: writes the `[max, sum, acc]` slot of each of its rows for its
    /// chunk (rows `[n][H]` from the sequence's `part_base`, `nchunks` slots of `Dv + 2` each),
    /// and its score rows' masked logits over its chunk's keys into the stash or (the
    /// sequence's `direct` partial scores) their final weights.
    fn decode_item<M: Kernels, Q: Float>(
        m: M,
        ctx: &Ctx<'_, Q, Self>,
        it: &Item,
        o: &Out<'_, Q, Self>,
    );
    /// The f32 keys of `at`, as the attention read them (`[n][D]`, in `buf` unless f32 in
    /// memory): what the scores recompute logits from when their stash would be over budget.
    fn keys<'s, Q>(ctx: &'s Ctx<'_, Q, Self>, at: KeyTile, buf: &'s mut [f32]) -> &'s [f32];
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
    /// Set when prefill items run their products on bf16 products (AMX tiles, or `vdpbf16ps`
    /// without AMX; see `bf16_tier_for` in `mod.rs`).
    pub bf16_tier: Option<Bf16Tier>,
    /// Whether those products run bf16 math (a bf16 query, or the bf16 precision) rather than
    /// f32 math on bf16 parts (AMX only).
    pub bf16_math: bool,
    /// How the cache type lays out its rows (quantized caches: OpenVINO's layout).
    pub layout: C::Layout,
}
