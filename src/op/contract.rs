//! The op's 17-input / 2-output contract as data: one table that shape inference, validation,
//! the C ABI and the IR loader all read.

/// Fewest inputs a call may pass (query .. block_indices_begins).
pub const MIN_INPUTS: usize = 9;
/// Most inputs a call may pass.
pub const MAX_INPUTS: usize = 17;
/// Number of outputs.
pub const NUM_OUTPUTS: usize = 2;

/// What element type an input must have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TypeRule {
    /// The query's type (f32, f16 or bf16): query, key, value.
    Query,
    /// Any float type; value_cache must match key_cache.
    Cache,
    /// Any float type, converted to f32 when read (scale, alibi_slopes, rotation_trig_lut).
    AnyFloat,
    /// i32.
    I32,
}

/// One row of the input table.
#[derive(Clone, Copy, Debug)]
pub struct InputSpec {
    pub index: usize,
    pub name: &'static str,
    /// Accepted ranks.
    pub ranks: &'static [usize],
    /// Ranks as written in messages.
    pub ranks_text: &'static str,
    pub ty: TypeRule,
    pub optional: bool,
}

const fn spec(
    index: usize,
    name: &'static str,
    ranks: &'static [usize],
    ranks_text: &'static str,
    ty: TypeRule,
    optional: bool,
) -> InputSpec {
    InputSpec {
        index,
        name,
        ranks,
        ranks_text,
        ty,
        optional,
    }
}

pub const QUERY: usize = 0;
pub const KEY: usize = 1;
pub const VALUE: usize = 2;
pub const KEY_CACHE: usize = 3;
pub const VALUE_CACHE: usize = 4;
pub const PAST_LENS: usize = 5;
pub const SUBSEQUENCE_BEGINS: usize = 6;
pub const BLOCK_INDICES: usize = 7;
pub const BLOCK_INDICES_BEGINS: usize = 8;
pub const SCALE: usize = 9;
pub const SLIDING_WINDOW: usize = 10;
pub const ALIBI_SLOPES: usize = 11;
pub const ROTATED_BLOCK_INDICES: usize = 12;
pub const ROTATION_DELTAS: usize = 13;
pub const ROTATION_TRIG_LUT: usize = 14;
pub const SCORE_AGGREGATION_WINDOW: usize = 15;
pub const SINKS: usize = 16;

/// The inputs in order. Scalars accept rank 0 or a one-element rank-1 tensor.
pub const INPUTS: [InputSpec; MAX_INPUTS] = [
    spec(QUERY, "query", &[2], "2", TypeRule::Query, false),
    spec(KEY, "key", &[2], "2", TypeRule::Query, false),
    spec(VALUE, "value", &[2], "2", TypeRule::Query, false),
    spec(KEY_CACHE, "key_cache", &[4], "4", TypeRule::Cache, false),
    spec(
        VALUE_CACHE,
        "value_cache",
        &[4],
        "4",
        TypeRule::Cache,
        false,
    ),
    spec(PAST_LENS, "past_lens", &[1], "1", TypeRule::I32, false),
    spec(
        SUBSEQUENCE_BEGINS,
        "subsequence_begins",
        &[1],
        "1",
        TypeRule::I32,
        false,
    ),
    spec(
        BLOCK_INDICES,
        "block_indices",
        &[1],
        "1",
        TypeRule::I32,
        false,
    ),
    spec(
        BLOCK_INDICES_BEGINS,
        "block_indices_begins",
        &[1],
        "1",
        TypeRule::I32,
        false,
    ),
    spec(
        SCALE,
        "scale",
        &[0, 1],
        "0 (scalar) or 1",
        TypeRule::AnyFloat,
        true,
    ),
    spec(
        SLIDING_WINDOW,
        "sliding_window",
        &[0, 1],
        "0 (scalar) or 1",
        TypeRule::I32,
        true,
    ),
    spec(
        ALIBI_SLOPES,
        "alibi_slopes",
        &[1],
        "1",
        TypeRule::AnyFloat,
        true,
    ),
    spec(
        ROTATED_BLOCK_INDICES,
        "rotated_block_indices",
        &[1],
        "1",
        TypeRule::I32,
        true,
    ),
    spec(
        ROTATION_DELTAS,
        "rotation_deltas",
        &[1, 2],
        "1 or 2",
        TypeRule::I32,
        true,
    ),
    spec(
        ROTATION_TRIG_LUT,
        "rotation_trig_lut",
        &[2],
        "2",
        TypeRule::AnyFloat,
        true,
    ),
    spec(
        SCORE_AGGREGATION_WINDOW,
        "score_aggregation_window",
        &[0, 1],
        "0 (scalar) or 1",
        TypeRule::I32,
        true,
    ),
    spec(SINKS, "sinks", &[1, 4], "1 or 4", TypeRule::AnyFloat, true),
];

pub const OUTPUT_NAMES: [&str; NUM_OUTPUTS] = ["output", "scores"];
