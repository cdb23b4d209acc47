//! Fast kernels: the same four steps as `reference`, tiled, parallel and SIMD.
//!
//! Dispatch rule, one line per submodule:
//! - `rotate`, `insert`: one rayon task per KV head (KV heads never share cache rows, and
//!   within a head the rows are written in the reference's order, so aliasing block tables
//!   behave exactly as in the reference).
//! - `source`: a cache type as a source of key and value tiles ([`source::Source`]): what a
//!   call prepares once, how a decode item's rows meet its keys and values, which f32 tiles a
//!   prefill item reads, and how its decode work is cut. Float caches there; quantized ones in
//!   `quantized`. Everything else below is written once for every cache type.
//! - `partition`: cuts attention into work items (sequence, KV heads, query tile, key chunk).
//!   Decode-like sequences (all new tokens fit in one query tile) get their context split into
//!   chunks (flash-decoding), one item per chunk covering every KV head (a block stores its
//!   heads contiguously, so the item streams whole blocks); prefill sequences get query tiles of
//!   about 64 rows (tokens x the G query heads of one KV head) over the whole visible key
//!   range. The cut depends only on the plan and the cache type's tuning, never on the thread
//!   count, so results are bit-identical for any number of threads.
//! - `attention`: the driver: runs every item (each KV block read once for all rows of the
//!   tile, masked tiles skipped, online softmax per row) and merges the chunks of each row in a
//!   fixed order.
//! - `tile`: what items share: the call's context, per-thread scratch, query rows,
//!   masks and ALiBi, prefetch hints.
//! - `decode`: runs decode items of float caches (every KV head of a sequence, one key chunk)
//!   with the `DecodeMicro` loops, which keep the next tile's cache lines coming while they compute.
//! - `prefill`: runs the items of prefill sequences (transposed logits, `TileMicro` loops).
//! - `scores`: step 4 from the logits the items stashed for the score rows (or, when that stash
//!   would exceed its budget, by recomputing those logits tile by tile), or from the partial
//!   scores the items of a source that asks for it (`Tuning::direct_scores`) summed themselves.
//! - `pool`: reused buffers for the partial softmaxes and stashed logits of a call.
//! - `prefill_amx`: prefill items under bf16 math (or f32 math with a bf16 cache on AMX) with
//!   their QK and PV products on bf16 products: AMX-BF16 tiles, or `vdpbf16ps` without AMX
//!   (same masks, softmax step and output writing as `prefill`).
//! - `quantized`: u8 caches in OpenVINO's layouts as a source: insertion (one task per KV
//!   head), decode tiles that read the bytes through the `QuantMicro` loops (dequantized in
//!   registers), prefill tiles dequantized once per call or one block at a time into f32 tiles
//!   for the `TileMicro` loops. `u4`: u4 caches read through their u8 form.
//! - `float`: f32, f16 and bf16 caches as a source (`decode`, `prefill`, `prefill_amx`).
//! - `micro`: the inner loops of each SIMD level (one tier per file under `micro/x86/`, built
//!   on x86_64 only; scalar twins in `micro/`, the only tier elsewhere).
//!
//! Every softmax step (decode rows, prefill lanes, AMX spans, the chunk merge) is
//! `kernel::softmax::OnlineSoftmax`'s; index arithmetic is `kernel::layout`'s; the call is bound
//! and dispatched by `kernel::bind` (`Fast` is the fast family's `TypedOp`), as for the
//! reference.
//!
//! SIMD levels, chosen at run time ([`SimdLevel::detected`]): `amx` (the `avx512bf16` level
//! with AMX-BF16 tiles for the QK and PV products of prefill items under bf16 math or with a
//! bf16 cache), else `avx512bf16` (the `avx512` loops with `vdpbf16ps` for those products under
//! bf16 math), else `avx512` (AVX-512 F + BW + VL + DQ, 16-wide with masked tails), else `avx2`
//! (AVX2 + FMA + F16C, 8-wide), else `scalar`. The caller picks a level per call
//! ([`FastOptions::simd`]; the C ABI reads `PA_SIMD` at its edge, `ffi::env`); a level the CPU
//! lacks gives the best one it has (the levels are nested: every AMX CPU has AVX512-BF16, every
//! AVX512-BF16 CPU has AVX-512, every AVX-512 CPU has AVX2; [`SimdLevel::effective`]).
//!
//! Precision ([`Precision`], the caller's choice, see `docs/contract.md`): in `F32` an f32 or
//! f16 query is f32 math on every level. On the `amx` level, prefill items of such a query with
//! a bf16 cache run on tiles with every operand cut into bf16 parts that sum to it (f32 query:
//! three, f16: two, weights: three; a bf16 cache is exact), which keeps f32 accuracy (see
//! `prefill_amx`). bf16 math (a bf16 query in either precision, or any query in `Bf16`) lets
//! the `avx512bf16` and `amx` levels round the operands of prefill items to bf16: the query
//! (rounded to nearest even when it is not bf16), f32/f16 value rows and the softmax weights
//! are rounded, f32/f16 keys are split into two bf16, products are exact and summed in f32,
//! softmax stays f32, and the result stays within 1e-2 of a float64 reference fed the rounded
//! query and the cache's values, as OpenVINO's own op under a bf16 hint. Decode items stay f32
//! math. Below `avx512bf16` `Bf16` computes in f32 ([`Precision::effective`]).
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
mod tile;
mod u4;
pub(crate) use tile::prefetch_part;
mod float;
mod quantized;
mod source;

use super::bind::{dispatch, Bound, TypedOp};
use crate::dtype::Float;
use crate::error::Result;
use crate::op::quant_layout::QuantLayout;
use crate::op::{PaInputs, PaOutputs, Plan};
use crate::threads::Runner;
use micro::scalar::Scalar;
#[cfg(target_arch = "x86_64")]
use micro::x86::{avx2::Avx2, avx512::Avx512};
#[cfg(target_arch = "x86_64")]
use micro::Bf16;
use micro::{Amx, Bf16Tier, Kernels};
use std::any::TypeId;

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
    /// The AVX-512 loops, plus `vdpbf16ps` (AVX512-BF16) for the products of prefill items
    /// under bf16 math (a bf16 query, or the bf16 precision).
    Avx512Bf16,
    /// The AVX-512 loops, plus AMX-BF16 tiles for the products of prefill items of a bf16
    /// query (Linux grants the process tile data when this level is detected).
    Amx,
}

impl SimdLevel {
    /// Every level, lowest first.
    pub const ALL: [SimdLevel; 5] = [
        SimdLevel::Scalar,
        SimdLevel::Avx2,
        SimdLevel::Avx512,
        SimdLevel::Avx512Bf16,
        SimdLevel::Amx,
    ];

    /// The best level this CPU (and, for AMX, the OS) supports. On Linux, detecting AMX asks
    /// the kernel for tile-data permission for the whole process (once).
    pub fn detected() -> SimdLevel {
        #[cfg(target_arch = "x86_64")]
        {
            if Avx512::detect().is_some() {
                return if Amx::detect().is_some() {
                    SimdLevel::Amx
                } else if Bf16::detect().is_some() {
                    SimdLevel::Avx512Bf16
                } else {
                    SimdLevel::Avx512
                };
            }
            if Avx2::detect().is_some() {
                return SimdLevel::Avx2;
            }
        }
        SimdLevel::Scalar
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
            SimdLevel::Avx512Bf16 => "avx512bf16",
            SimdLevel::Amx => "amx",
        }
    }

    /// The level spelled `name` (as [`SimdLevel::name`] gives it).
    pub fn parse(name: &str) -> Option<SimdLevel> {
        SimdLevel::ALL.into_iter().find(|l| l.name() == name)
    }
}

/// Prefill items (one KV head's query tile each) this process has run on AMX tiles: lets
/// tests prove the AMX path ran. Feature `test-hooks` only (one relaxed increment per item).
#[cfg(feature = "test-hooks")]
pub fn amx_items_run() -> u64 {
    #[cfg(target_arch = "x86_64")]
    return prefill_amx::ITEMS.load(std::sync::atomic::Ordering::Relaxed);
    #[cfg(not(target_arch = "x86_64"))]
    0
}

/// Runs `rounds` x 16 `vdpbf16ps` (16 lanes x 2 multiply-adds, 64 flops each) on the calling
/// thread on registers, for measuring the bf16 dot-product peak (`pa_machine`); false, having
/// run nothing, on a CPU without AVX512-BF16.
pub fn bf16_dot_products(rounds: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if let Some(b) = Bf16::detect() {
        std::hint::black_box(b.dot_products(rounds));
        return true;
    }
    let _ = rounds;
    false
}

/// Runs `rounds` x 4 AMX-BF16 tile products (16 x 16 x 32 multiply-adds, 16384 flops each) on
/// the calling thread on tiles that stay in registers, for measuring the tiles' peak
/// (`pa_machine`); false, having run nothing, on a CPU (or OS) without AMX.
pub fn amx_bf16_tile_products(rounds: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if let Some(a) = Amx::detect() {
        a.tile_products(rounds);
        return true;
    }
    let _ = rounds;
    false
}

/// Where the prefill items of this call run their QK and PV products on bf16 products:
/// - AMX tiles at the `amx` level (CPU and OS granting AMX) for bf16 math (a bf16 query or the
///   bf16 precision) or a bf16 cache (an f32 or f16 query then gets f32 math on tiles, its
///   operands cut into bf16 parts, see `prefill_amx`);
/// - `vdpbf16ps` at the `avx512bf16` level (or `amx` without tiles) for bf16 math only: cut
///   into parts, f32 math costs more dot products than the FMA loops take.
///
/// `None` otherwise: the f32 FMA loops. An f32 or f16 cache with f32 math stays on them on
/// every level (measured, README "Performance").
fn bf16_tier_for<Q: 'static, C: 'static>(opts: FastOptions) -> Option<Bf16Tier> {
    let level = opts.simd.effective();
    let bf16 = bf16_math::<Q>(opts);
    #[cfg(target_arch = "x86_64")]
    {
        let bf = bf16_dot_for(level)?;
        let amx = (level >= SimdLevel::Amx && (bf16 || is_bf16::<C>()))
            .then(Amx::detect)
            .flatten();
        (amx.is_some() || bf16).then_some(Bf16Tier { bf, amx })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (level, bf16);
        None
    }
}

/// The AVX512-BF16 token when `level` may use bf16 products (`avx512bf16` or above).
#[cfg(target_arch = "x86_64")]
fn bf16_dot_for(level: SimdLevel) -> Option<Bf16> {
    if level.effective() < SimdLevel::Avx512Bf16 {
        return None;
    }
    Bf16::detect()
}

#[cfg(not(target_arch = "x86_64"))]
fn bf16_dot_for(_level: SimdLevel) -> Option<Bf16Tier> {
    None
}

fn is_bf16<T: 'static>() -> bool {
    TypeId::of::<T>() == TypeId::of::<half::bf16>()
}

/// Whether every cached key and value the prefill items of this call read is finite. The tiles'
/// f32 math cuts an f32/f16 query and the softmax weights into bf16 parts: a non-finite key or
/// value would meet parts of mixed sign or zero parts (inf - inf, 0 * inf = NaN) where the
/// contract's rule gives +-inf or 0, so such a call stays on the FMA loops. One read of those
/// rows, next to a prefill that reads them many times.
fn prefill_rows_finite<C: Float>(
    plan: &Plan,
    part: &partition::Partition,
    (kc, vc): (&[C], &[C]),
    bi: &[i32],
) -> bool {
    let d = plan.d;
    plan.seqs.iter().enumerate().all(|(s, sp)| {
        !part.seqs[s].prefill
            || (0..plan.hkv).all(|kvh| {
                crate::kernel::layout::tiles(0, sp.ctx(), plan.bs).all(|(j0, j1)| {
                    let off = crate::kernel::layout::seq_row(plan, bi, sp, kvh, j0);
                    let rows = off..off + (j1 - j0) * d;
                    // A fold without early exit per block, so it vectorizes.
                    let finite = |r: &[C]| r.iter().fold(true, |a, x| a & x.to_f32().is_finite());
                    finite(&kc[rows.clone()]) && finite(&vc[rows])
                })
            })
    })
}

/// How step 4 gets the logits of the score rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScoresMode {
    /// Stash them during attention when the stash fits its budget, else recompute.
    Auto,
    /// Always recompute (the path taken for very long score windows).
    Recompute,
}

/// The inference precision a call computes in: the deployment's choice (OpenVINO's
/// `INFERENCE_PRECISION_HINT`, the C ABI's `pa_precision`), never read from the environment
/// here (see `docs/contract.md`, "Precision").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    /// f32 math for an f32 or f16 query (2e-6 of a float64 reference); a bf16 query is bf16
    /// math in every precision.
    #[default]
    F32,
    /// OpenVINO's bf16 inference precision: the QK and PV products of prefill items take their
    /// operands rounded to bf16 (nearest even) and sum in f32, softmax in f32, as OpenVINO's own
    /// op under a bf16 hint. Decode items keep f32 math. Runs on CPUs with AVX512-BF16 (the
    /// `avx512` level with `vdpbf16ps`) or AMX; elsewhere the call falls back to `F32`
    /// ([`Precision::effective`]).
    Bf16,
}

impl Precision {
    /// The C ABI's and the op attribute's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        }
    }

    /// The precision spelled `name`.
    pub fn parse(name: &str) -> Option<Precision> {
        [Precision::F32, Precision::Bf16]
            .into_iter()
            .find(|p| p.name() == name)
    }

    /// The precision a call asking for `self` at `level` computes in: `Bf16` needs bf16
    /// products (AVX512-BF16 at the `avx512` level or above); without them the nearest exact
    /// precision, `F32`.
    pub fn effective(self, level: SimdLevel) -> Precision {
        match self {
            Precision::Bf16 if bf16_dot_for(level).is_some() => Precision::Bf16,
            _ => Precision::F32,
        }
    }
}

/// Options of one fast call: what the caller (C ABI, extension, tests) chose. The kernel reads
/// no environment variable; `PA_SIMD` and `PA_BF16_QUERY` are read at the C ABI's edge
/// (`ffi::env`).
#[derive(Clone, Copy, Debug)]
pub struct FastOptions {
    pub simd: SimdLevel,
    pub scores: ScoresMode,
    /// Where the parallel regions run (results do not depend on it).
    pub runner: Runner,
    /// The inference precision ([`Precision`]).
    pub precision: Precision,
    /// A call whose [`call_work`] is below this runs on the calling thread alone (0: never)
    /// when its runner is the library's pool or the caller's rayon pool, whose threads sleep
    /// between calls: for a small call, waking them costs more than they save. Results do not
    /// depend on it.
    pub serial_below: usize,
    /// The same for a host's runner ([`Runner::Host`]), whose threads are usually awake
    /// between calls (OpenVINO's run the model's other nodes): only a tiny call stays serial.
    pub host_serial_below: usize,
}

impl Default for FastOptions {
    fn default() -> Self {
        FastOptions {
            simd: SimdLevel::detected(),
            scores: ScoresMode::Auto,
            runner: Runner::Auto,
            precision: Precision::F32,
            serial_below: SERIAL_BELOW,
            host_serial_below: HOST_SERIAL_BELOW,
        }
    }
}

/// [`FastOptions::serial_below`]'s default, in [`call_work`] units: a one-token decode at
/// SmolLM2's shapes (9 query heads, 3 KV heads, head size 64) up to about 700 keys, or a 5-row
/// verify step up to about 340. Through the C ABI on the library's own pool (2-core AMD EPYC
/// Zen 4, 30 layers' caches with 18 MB read between calls, as a model's weights evict them), a
/// 1-token decode over 500 keys took 0.10-0.12 ms on the calling thread against 0.15-0.30 ms
/// on two pool threads woken for it. Every call of a model with Llama's head shapes is far
/// above it.
pub const SERIAL_BELOW: usize = 3_000_000;

/// [`FastOptions::host_serial_below`]'s default: a one-token decode at SmolLM2's shapes up to
/// about 70 keys. Inside OpenVINO (its threads, SmolLM2's whole graph decoding at 2 threads on
/// the same 2-core Zen 4), two threads took 0.034 ms an attention call where the calling thread
/// alone took 0.048 at 100 to 300 keys, 0.078 against 0.106 at 440 to 640 keys, and about as
/// long (0.041-0.047) at 40 to 240 keys.
pub const HOST_SERIAL_BELOW: usize = 300_000;

/// How much work a call's attention is, in multiply-adds: its query rows' products with the keys
/// and values they see, plus [`READ_COST`] per key and value element read from the cache (once
/// per KV head: a decode of a few rows is bound by those reads, not by its products).
pub fn call_work(plan: &Plan) -> usize {
    let per_key = plan.d + plan.dv;
    plan.seqs
        .iter()
        .map(|sp| {
            let keys = sp.ctx() - crate::kernel::layout::window_start(plan, sp.past);
            keys.saturating_mul(per_key)
                .saturating_mul(sp.n * plan.h + plan.hkv * READ_COST)
        })
        .fold(0usize, usize::saturating_add)
}

/// Multiply-adds one cache element read costs, in [`call_work`].
const READ_COST: usize = 8;

/// Whether prefill items run bf16 math (operands rounded to bf16, see the module doc): a bf16
/// query, or the bf16 precision where the CPU has bf16 products.
fn bf16_math<Q: 'static>(opts: FastOptions) -> bool {
    is_bf16::<Q>() || opts.precision.effective(opts.simd) == Precision::Bf16
}

/// Validates and executes with the fast kernels at the given options (used by tests to hold
/// each SIMD level against the reference in one process).
pub fn execute_with(
    opts: FastOptions,
    inputs: &mut PaInputs<'_>,
    outputs: &mut PaOutputs<'_>,
) -> Result<()> {
    let Some(plan) = super::validated(inputs, outputs)? else {
        return Ok(());
    };
    run(&plan, inputs, outputs, opts)
}

/// Runs a validated plan with the fast kernels, on the micro-kernels of the asked level (or the
/// best one below it this CPU has), in one region of the runner for the whole call (see
/// [`Runner::region`]: a host's fork/join is paid once, not once per parallel step), or on the
/// calling thread alone when the call is smaller than [`FastOptions::serial_below`] (a host's
/// runner: [`FastOptions::host_serial_below`]).
fn run(
    plan: &Plan,
    inputs: &mut PaInputs<'_>,
    outputs: &mut PaOutputs<'_>,
    opts: FastOptions,
) -> Result<()> {
    let below = match opts.runner {
        Runner::Host(_) => opts.host_serial_below,
        _ => opts.serial_below,
    };
    let opts = if call_work(plan) < below {
        FastOptions {
            runner: Runner::Serial,
            ..opts
        }
    } else {
        opts
    };
    opts.runner
        .region(|runner| run_in(plan, inputs, outputs, FastOptions { runner, ..opts }))
}

fn run_in(
    plan: &Plan,
    inputs: &mut PaInputs<'_>,
    outputs: &mut PaOutputs<'_>,
    opts: FastOptions,
) -> Result<()> {
    if plan.d == 0 || plan.h == 0 || plan.hkv == 0 {
        // Nothing to tile; the reference does no arithmetic here.
        return super::run_reference(plan, inputs, outputs);
    }
    struct Call<'p, 'a, 'b> {
        plan: &'p Plan,
        inputs: &'p mut PaInputs<'a>,
        outputs: &'p mut PaOutputs<'b>,
        opts: FastOptions,
    }
    impl OnMicro for Call<'_, '_, '_> {
        type Out = Result<()>;
        fn on<M: Kernels>(self, m: M) -> Result<()> {
            let opts = self.opts;
            dispatch(Fast { m, opts }, self.plan, self.inputs, self.outputs)
        }
    }
    on_level(
        opts.simd,
        Call {
            plan,
            inputs,
            outputs,
            opts,
        },
    )
}

/// Work run on the micro-kernels of one SIMD level (see [`on_level`]).
pub(crate) trait OnMicro {
    type Out;
    fn on<M: Kernels>(self, m: M) -> Self::Out;
}

/// Runs `op` on the micro-kernels of `level`, or of the best level below it this CPU has:
/// the one place a tier is chosen.
pub(crate) fn on_level<O: OnMicro>(level: SimdLevel, op: O) -> O::Out {
    #[cfg(target_arch = "x86_64")]
    {
        let level = level.effective();
        if let (SimdLevel::Avx512 | SimdLevel::Avx512Bf16 | SimdLevel::Amx, Some(m)) =
            (level, Avx512::detect())
        {
            return op.on(m);
        }
        if let (SimdLevel::Avx2, Some(m)) = (level, Avx2::detect()) {
            return op.on(m);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = level;
    op.on(Scalar)
}

/// The fast kernels on micro-kernels `M`, as a [`TypedOp`].
struct Fast<M> {
    m: M,
    opts: FastOptions,
}

impl<M: Kernels> TypedOp for Fast<M> {
    fn run<Q: Float, C: Float>(self, plan: &Plan, b: Bound<'_, Q, C>) -> Result<()> {
        let Fast { m, opts } = self;
        if let Some(rot) = &b.rotation {
            rotate::rotate(
                opts.runner,
                plan,
                rot.delta_cols,
                &mut *b.key_cache,
                rot.blocks,
                rot.deltas,
                &rot.lut,
            );
        }
        insert::insert_all(
            m,
            opts.runner,
            plan,
            &mut [
                (b.key, &mut *b.key_cache, plan.d),
                (b.value, &mut *b.value_cache, plan.dv),
            ],
            b.block_indices,
        );
        let (tier, bf16) = (bf16_tier_for::<Q, C>(opts), bf16_math::<Q>(opts));
        let (caches, bi) = ((&*b.key_cache, &*b.value_cache), b.block_indices);
        // The bf16 products pack K and V alike (D wide): a value head of another size runs on
        // the f32 tiles.
        let tier = |part: &partition::Partition| {
            tier.filter(|_| {
                plan.dv == plan.d && (bf16 || prefill_rows_finite(plan, part, caches, bi))
            })
        };
        let inputs = (b.query, caches, b.block_indices);
        pipeline(
            m,
            opts,
            plan,
            inputs,
            (b.output, b.scores),
            ((), tier, bf16),
        )
    }

    fn run_quant<Q: Float>(
        self,
        plan: &Plan,
        layout: &QuantLayout,
        b: Bound<'_, Q, u8>,
    ) -> Result<()> {
        let Fast { m, opts } = self;
        let mut b = b;
        quantized::write(opts.runner, plan, layout, &mut b);
        let caches = (&*b.key_cache, &*b.value_cache);
        // Prefill items run on bf16 products under bf16 math only (D-wide K and V panels).
        let bf16 = bf16_math::<Q>(opts);
        let tier = bf16_tier_for::<Q, u8>(opts).filter(|_| bf16 && plan.dv == plan.d);
        pipeline(
            m,
            opts,
            plan,
            (b.query, caches, b.block_indices),
            (b.output, b.scores),
            (*layout, |_| tier, bf16),
        )
    }
}

/// Steps 3 and 4 of a call whose caches hold their new rows: the partition of cache type `C`,
/// its items and merge (`attention`), then the scores (from the stashed logits, or recomputed).
/// `tier(part)`: whether prefill items run on bf16 products (AMX tiles or `vdpbf16ps`).
#[allow(clippy::type_complexity)]
fn pipeline<M: Kernels, Q: Float, C: source::Source>(
    m: M,
    opts: FastOptions,
    plan: &Plan,
    (query, (kc, vc), block_indices): (&[Q], (&[C], &[C]), &[i32]),
    (output, scores): (&mut [Q], &mut [Q]),
    (layout, tier, bf16_math): (
        C::Layout,
        impl FnOnce(&partition::Partition) -> Option<Bf16Tier>,
        bool,
    ),
) -> Result<()> {
    let threads = opts.runner.max_threads();
    let part = partition::Partition::new(plan, opts.scores, threads, &C::TUNING);
    let ctx = source::Ctx {
        plan,
        part: &part,
        query,
        kc,
        vc,
        block_indices,
        runner: opts.runner,
        bf16_tier: tier(&part),
        bf16_math,
        layout,
    };
    let fs = attention::attention(m, &ctx, output)?;
    match &fs.stash {
        Some(stash) => scores::from_stash(m, &ctx, (&fs.stats, stash, &fs.direct), scores),
        None => scores::recompute(m, &ctx, (&fs.direct, scores)),
    }
    if let Some(stash) = fs.stash {
        pool::give(stash);
    }
    pool::give(fs.direct);
    Ok(())
}
