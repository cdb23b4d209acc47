//! Fast kernels: the same four steps as `reference`, tiled, parallel and SIMD.
//!
//! Dispatch rule, one line per submodule:
//! - `rotate`, `insert`: one rayon task per KV head (KV heads never share cache rows, and
//!   within a head the rows are written in the reference's order, so aliasing block tables
//!   behave exactly as in the reference).
//! - `partition`: cuts attention into work items (sequence, KV head, query tile, key chunk).
//!   Decode-like sequences (all new tokens fit in one query tile) get their context split into
//!   chunks (flash-decoding), one item per chunk covering every KV head (a block stores its
//!   heads contiguously, so the item streams whole blocks); prefill sequences get query tiles of
//!   about 64 rows (tokens x the G query heads of one KV head) over the whole visible key range. The cut depends only on the
//!   plan, never on the thread count, so results are bit-identical for any number of threads.
//! - `attention`: runs one item (each KV block read once for all rows of the tile, masked
//!   tiles skipped, online softmax per row) and merges the chunks of each row in a fixed order.
//! - `decode`: runs decode items (every KV head of a sequence, one key chunk) with the
//!   `DecodeMicro` loops, which keep the next tile's cache lines coming while they compute.
//! - `prefill`: runs the items of prefill sequences (transposed logits, `TileMicro` loops).
//! - `scores`: step 4 from the logits the items stashed for the score rows (or, when that stash
//!   would exceed its budget, by recomputing those logits tile by tile).
//! - `pool`: reused buffers for the partial softmaxes and stashed logits of a call.
//! - `prefill_amx`: prefill items of a bf16 query with their QK and PV products on AMX-BF16
//!   tiles (same masks, softmax step and output writing as `prefill`).
//! - `micro`: the inner loops of each SIMD level (one tier per file under `micro/x86/`, scalar
//!   twins in `micro/`).
//!
//! SIMD levels, chosen at run time ([`SimdLevel::detected`]): `amx` (the `avx512` loops, plus
//! AMX-BF16 tiles for the QK and PV products of prefill items of a bf16 query), else `avx512`
//! (AVX-512 F + BW + VL + DQ, 16-wide with masked tails), else `avx2` (AVX2 + FMA + F16C,
//! 8-wide), else `scalar`. `PA_SIMD=scalar|avx2|avx512|amx` forces a level for a process; a
//! level the CPU lacks gives the best one it has (the levels are nested: every AMX CPU has
//! AVX-512, every AVX-512 CPU has AVX2). [`execute_with`] picks a level per call (tests), with
//! the same fallback ([`SimdLevel::effective`]).
//!
//! Precision: an f32 or f16 query is f32 math on every level. Only a bf16 query (the model or
//! the host's precision hint asked for bf16) lets the `amx` level round its operands to bf16:
//! f32/f16 value rows and the softmax weights are rounded to nearest even, f32/f16 keys are
//! split into two bf16, products are exact and summed in f32, softmax stays f32, and the result
//! stays within 1e-2 of a float64 reference fed the same (bf16 query, cache-typed) values, as
//! OpenVINO's own op under a bf16 hint.
//!
//! Falls back to the reference kernels only when `D`, `H` or `Hkv` is 0 (nothing to tile).

mod attention;
mod decode;
pub mod insert;
pub(crate) mod micro;
mod partition;
mod pool;
mod prefill;
#[cfg(target_arch = "x86_64")]
mod prefill_amx;
pub mod rotate;
mod scores;
mod shared;

use crate::dtype::Float;
use crate::error::{PaError, Result};
use crate::op::{PaInputs, PaOutputs, Plan};
use crate::threads::Runner;
use micro::scalar::Scalar;
use micro::x86::avx2::Avx2;
#[cfg(target_arch = "x86_64")]
use micro::x86::avx512::Avx512;
use micro::{Amx, TileMicro};
use std::any::TypeId;
use std::sync::OnceLock;

/// Instruction set the fast kernels use, ordered by capability: a CPU that has a level has
/// every lower one, so falling back means taking the lower of two levels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SimdLevel {
    /// Plain Rust loops.
    Scalar,
    /// AVX2 + FMA + F16C.
    Avx2,
    /// AVX-512 F + BW + VL + DQ (with AVX2, FMA and F16C).
    Avx512,
    /// The AVX-512 loops, plus AMX-BF16 tiles for the products of prefill items of a bf16
    /// query (Linux grants the process tile data when this level is detected).
    Amx,
}

impl SimdLevel {
    /// Every level, lowest first.
    pub const ALL: [SimdLevel; 4] = [
        SimdLevel::Scalar,
        SimdLevel::Avx2,
        SimdLevel::Avx512,
        SimdLevel::Amx,
    ];

    /// The best level this CPU (and, for AMX, the OS) supports. On Linux, detecting AMX asks
    /// the kernel for tile-data permission for the whole process (once).
    pub fn detected() -> SimdLevel {
        #[cfg(target_arch = "x86_64")]
        if Avx512::detect().is_some() {
            return if amx_detected() {
                SimdLevel::Amx
            } else {
                SimdLevel::Avx512
            };
        }
        if Avx2::detect().is_some() {
            SimdLevel::Avx2
        } else {
            SimdLevel::Scalar
        }
    }

    /// The level a call asking for `self` runs at: `self` when the CPU has it, else the best
    /// level the CPU has.
    pub fn effective(self) -> SimdLevel {
        self.min(SimdLevel::detected())
    }

    /// The `PA_SIMD` spelling of the level.
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
            SimdLevel::Amx => "amx",
        }
    }

    /// The level spelled `name` (as [`SimdLevel::name`] gives it).
    pub fn parse(name: &str) -> Option<SimdLevel> {
        SimdLevel::ALL.into_iter().find(|l| l.name() == name)
    }

    /// The detected level, or the one `PA_SIMD=scalar|avx2|avx512|amx` asks for (read once per
    /// process) when the CPU has it; asking for a level the CPU lacks (`PA_SIMD=avx512` without
    /// AVX-512) gives the best one it has, and an unknown name the detected one.
    pub fn from_env() -> SimdLevel {
        static LEVEL: OnceLock<SimdLevel> = OnceLock::new();
        *LEVEL.get_or_init(|| {
            std::env::var("PA_SIMD")
                .ok()
                .and_then(|v| SimdLevel::parse(&v))
                .map_or_else(SimdLevel::detected, SimdLevel::effective)
        })
    }
}

fn amx_detected() -> bool {
    #[cfg(target_arch = "x86_64")]
    return Amx::detect().is_some();
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Prefill items (one KV head's query tile each) this process has run on AMX tiles: lets
/// tests prove the AMX path ran.
pub fn amx_items_run() -> u64 {
    #[cfg(target_arch = "x86_64")]
    return prefill_amx::ITEMS.load(std::sync::atomic::Ordering::Relaxed);
    #[cfg(not(target_arch = "x86_64"))]
    0
}

/// The AMX token when prefill items of this call may use tiles: the `Amx` level, a bf16 query
/// (the precision rule: any other query type is f32 math) and a CPU/OS that grants AMX.
fn amx_for<Q: 'static>(opts: FastOptions) -> Option<Amx> {
    if opts.simd.effective() < SimdLevel::Amx || TypeId::of::<Q>() != TypeId::of::<half::bf16>() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    return Amx::detect();
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// How step 4 gets the logits of the score rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoresMode {
    /// Stash them during attention when the stash fits its budget, else recompute.
    Auto,
    /// Always recompute (the path taken for very long score windows).
    Recompute,
}

/// Options of one fast call.
#[derive(Clone, Copy, Debug)]
pub struct FastOptions {
    pub simd: SimdLevel,
    pub scores: ScoresMode,
    /// Where the parallel regions run (results do not depend on it).
    pub runner: Runner,
}

impl Default for FastOptions {
    fn default() -> Self {
        FastOptions {
            simd: SimdLevel::from_env(),
            scores: ScoresMode::Auto,
            runner: Runner::Auto,
        }
    }
}

/// Validates and executes with the fast kernels at the given options (used by tests to hold
/// each SIMD level against the reference in one process).
pub fn execute_with(
    opts: FastOptions,
    inputs: &mut PaInputs<'_>,
    outputs: &mut PaOutputs<'_>,
) -> Result<()> {
    let plan = crate::op::validate(inputs)?;
    crate::op::validate::check_outputs(&plan, outputs)?;
    run(&plan, inputs, outputs, opts)
}

/// Runs a validated plan with the fast kernels.
pub fn run(
    plan: &Plan,
    inputs: &mut PaInputs<'_>,
    outputs: &mut PaOutputs<'_>,
    opts: FastOptions,
) -> Result<()> {
    if plan.d == 0 || plan.h == 0 || plan.hkv == 0 {
        // Nothing to tile; the reference does no arithmetic here.
        return super::run_reference(plan, inputs, outputs);
    }
    let level = opts.simd.effective();
    #[cfg(target_arch = "x86_64")]
    if let (SimdLevel::Avx512 | SimdLevel::Amx, Some(m)) = (level, Avx512::detect()) {
        return run_micro(m, plan, inputs, outputs, opts);
    }
    match (level, Avx2::detect()) {
        (SimdLevel::Scalar, _) | (_, None) => run_micro(Scalar, plan, inputs, outputs, opts),
        (_, Some(m)) => run_micro(m, plan, inputs, outputs, opts),
    }
}

fn run_micro<M: TileMicro>(
    m: M,
    plan: &Plan,
    inputs: &mut PaInputs<'_>,
    outputs: &mut PaOutputs<'_>,
    opts: FastOptions,
) -> Result<()> {
    macro_rules! go {
        ($q:ty, $c:ty) => {
            run_typed::<M, $q, $c>(m, plan, inputs, outputs, opts)
        };
    }
    use crate::dtype::ElemType as E;
    use half::{bf16, f16};
    match (plan.query_type, plan.cache_type) {
        (E::F32, E::F32) => go!(f32, f32),
        (E::F32, E::F16) => go!(f32, f16),
        (E::F32, E::BF16) => go!(f32, bf16),
        (E::F16, E::F32) => go!(f16, f32),
        (E::F16, E::F16) => go!(f16, f16),
        (E::F16, E::BF16) => go!(f16, bf16),
        (E::BF16, E::F32) => go!(bf16, f32),
        (E::BF16, E::F16) => go!(bf16, f16),
        (E::BF16, E::BF16) => go!(bf16, bf16),
        (q, c) => Err(PaError::InvalidArgument {
            detail: format!("no kernel for query type {q} with cache type {c}"),
        }),
    }
}

fn missing(what: &str) -> PaError {
    PaError::InvalidArgument {
        detail: format!("{what} does not have the validated element type"),
    }
}

fn run_typed<M: TileMicro, Q: Float, C: Float>(
    m: M,
    plan: &Plan,
    inputs: &mut PaInputs<'_>,
    outputs: &mut PaOutputs<'_>,
    opts: FastOptions,
) -> Result<()> {
    let block_indices = inputs
        .block_indices
        .as_i32()
        .ok_or_else(|| missing("block_indices"))?;
    if let Some(rot) = &plan.rotation {
        let rbi = inputs
            .rotated_block_indices
            .as_ref()
            .and_then(|t| t.as_i32());
        let rd = inputs.rotation_deltas.as_ref().and_then(|t| t.as_i32());
        let lut = inputs.rotation_trig_lut.as_ref();
        let (rbi, rd, lut) = match (rbi, rd, lut) {
            (Some(a), Some(b), Some(c)) => (a, b, c),
            _ => return Err(missing("rotation inputs")),
        };
        let kc = inputs
            .key_cache
            .as_float_mut::<C>()
            .ok_or_else(|| missing("key_cache"))?;
        rotate::rotate(opts.runner, plan, rot.delta_cols, kc, rbi, rd, lut);
    }
    let key = inputs.key.as_float::<Q>().ok_or_else(|| missing("key"))?;
    let value = inputs
        .value
        .as_float::<Q>()
        .ok_or_else(|| missing("value"))?;
    {
        let kc = inputs
            .key_cache
            .as_float_mut::<C>()
            .ok_or_else(|| missing("key_cache"))?;
        let vc = inputs
            .value_cache
            .as_float_mut::<C>()
            .ok_or_else(|| missing("value_cache"))?;
        insert::insert_all(
            opts.runner,
            plan,
            &mut [(key, kc), (value, vc)],
            block_indices,
        );
    }
    let query = inputs
        .query
        .as_float::<Q>()
        .ok_or_else(|| missing("query"))?;
    let kc = inputs.key_cache.as_ref();
    let vc = inputs.value_cache.as_ref();
    let kc = kc.as_float::<C>().ok_or_else(|| missing("key_cache"))?;
    let vc = vc.as_float::<C>().ok_or_else(|| missing("value_cache"))?;
    let out = outputs
        .output
        .as_float_mut::<Q>()
        .ok_or_else(|| missing("output"))?;
    let scores_out = outputs
        .scores
        .as_float_mut::<Q>()
        .ok_or_else(|| missing("scores"))?;

    let part = partition::Partition::new(plan, opts.scores);
    let ctx = attention::Ctx {
        plan,
        part: &part,
        query,
        kc,
        vc,
        block_indices,
        runner: opts.runner,
        amx: amx_for::<Q>(opts),
    };
    let (stats, stash) = attention::attention(m, &ctx, out);
    match stash {
        Some(stash) => {
            scores::from_stash(m, &ctx, &stats, &stash, scores_out);
            pool::give(stash);
        }
        None => scores::recompute(m, &ctx, &stats, scores_out),
    }
    Ok(())
}
