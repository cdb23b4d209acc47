//! The model runner: the OpenVINO side of a step. It converts the stateful graph to our op (in
//! memory, through the project's one converter), learns what each graph input is, allocates the
//! KV caches, compiles the model, and for each scheduled step performs its block copies, binds
//! its inputs (the caches once, as tensors over our memory; the small inputs copied) and runs
//! `infer()`. It knows no requests and no text: the engine core gives it a `Step` and reads the
//! logits back.

use crate::config::EngineConfig;
use crate::error::{EngineError, Result};
use crate::kv_cache::{self, CacheBuf, LayerDims};
use crate::model_dir::ModelDir;
use crate::ov::{CacheType, ConvertOptions, Property, Session};
use paged_attention::cache::{copy_blocks_kv, rotation_lut, RotationDirection, Step};
use paged_attention::ElemType;
use std::collections::HashMap;
use std::ops::Range;
use std::path::Path;
use std::time::{Duration, Instant};

/// Which model input an index of the compiled model is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Feed {
    InputIds,
    PositionIds,
    PastLens,
    SubsequenceBegins,
    BlockIndices,
    BlockIndicesBegins,
    MaxContextLen,
    SampledTokensIndices,
    KeyCache(usize),
    ValueCache(usize),
    /// Cache eviction's inputs (a graph converted for serving).
    ScoreWindow,
    RotatedBlocks,
    RotationDeltas,
    RotationLut,
}

/// The step's inputs, reused from step to step.
#[derive(Default)]
struct StepBuffers {
    input_ids: Vec<i64>,
    position_ids: Vec<i64>,
    sampled: Vec<i64>,
    past_lens: Vec<i32>,
    begins: Vec<i32>,
    block_indices: Vec<i32>,
    block_indices_begins: Vec<i32>,
    max_context_len: [i32; 1],
    score_window: Vec<i32>,
    rotated_blocks: Vec<i32>,
    rotation_deltas: Vec<i32>,
    rotation_lut: Vec<f32>,
    scores: Vec<f32>,
}

/// How the bridge's converter options look for `cfg` (the engine gathers logits rows).
pub(crate) fn convert_options(
    block_size: usize,
    cache_type: ElemType,
    serving: bool,
) -> Result<ConvertOptions> {
    let cache_type = CacheType::of(cache_type)
        .ok_or_else(|| EngineError::Config(format!("{cache_type} is not a KV cache type")))?;
    Ok(ConvertOptions {
        block_size: u32::try_from(block_size)
            .map_err(|_| EngineError::Config(format!("block size {block_size} is too large")))?,
        cache_type,
        serving,
        gather_logits: true,
        allow_xattention: false,
        allow_adaptive_rkv: false,
        allow_qq_bias: false,
    })
}

pub(crate) struct ModelRunner {
    session: cxx::UniquePtr<Session>,
    feeds: Vec<Feed>,
    logits_output: usize,
    /// Outputs `scores.N` (with eviction).
    score_outputs: Vec<usize>,
    gathered: bool,
    /// RoPE base and key head size, for the rotation LUT of eviction.
    rope_theta: f64,
    head_size: usize,
    /// Declared after `session`, so dropped after it: the request's tensors never outlive them.
    caches: Vec<(CacheBuf, CacheBuf)>,
    cache_type: CacheType,
    block_size: usize,
    buf: StepBuffers,
    /// The cache tensors are set once: the caches never move, and the request keeps them.
    caches_bound: bool,
    pub infer_time: Duration,
}

fn port_dims(name: &str, shape: &[i64], path: &Path) -> Result<[usize; 3]> {
    match shape {
        [_, h, r, c] if *h > 0 && *r > 0 && *c > 0 => Ok([*h as usize, *r as usize, *c as usize]),
        _ => Err(EngineError::Model {
            path: path.to_path_buf(),
            detail: format!("the converted graph's input `{name}` has shape {shape:?}, not [?, Hkv, rows, cols]"),
        }),
    }
}

/// The logits of a step: `rows` rows of `vocab` values.
pub(crate) struct Logits<'a> {
    data: &'a [f32],
    vocab: usize,
}

impl Logits<'_> {
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.vocab..(r + 1) * self.vocab]
    }
}

/// A model converted and compiled, its feeds learnt: a [`ModelRunner`] but for its caches,
/// which [`Compiled::allocate`] adds once their block count is chosen (from the memory every
/// compiled model of the engine left: a target's and its draft model's).
pub(crate) struct Compiled {
    session: cxx::UniquePtr<Session>,
    feeds: Vec<Feed>,
    layers: Vec<LayerDims>,
    logits_output: usize,
    score_outputs: Vec<usize>,
    rope_theta: f64,
    cache_type: CacheType,
    elem: ElemType,
    block_size: usize,
    /// Bytes of one block over all layers, keys and values.
    pub block_bytes: usize,
}

impl ModelRunner {
    /// Converts `md` with the settings of `cfg`, learns the feeds and compiles it.
    pub fn compile(md: &ModelDir, cfg: &EngineConfig) -> Result<Compiled> {
        let xml = md.xml.to_str().ok_or_else(|| EngineError::Model {
            path: md.xml.clone(),
            detail: "path is not UTF-8".into(),
        })?;
        let opts = convert_options(cfg.block_size, cfg.cache_type, cfg.eviction.is_some())?;
        let mut session =
            crate::ov::ffi::open_session(xml, &opts).map_err(|e| EngineError::Model {
                path: md.xml.clone(),
                detail: e.what().to_string(),
            })?;
        let (feeds, layers) = feeds(&session, &md.xml)?;
        let outputs = session.outputs();
        let logits_output = outputs
            .iter()
            .position(|p| p.name == "logits")
            .ok_or_else(|| EngineError::Model {
                path: md.xml.clone(),
                detail: "the model has no output named `logits`".into(),
            })?;
        let score_outputs: Vec<usize> = outputs
            .iter()
            .enumerate()
            .filter(|(_, p)| p.name.starts_with("scores."))
            .map(|(i, _)| i)
            .collect();
        if cfg.eviction.is_some() && score_outputs.len() != layers.len() {
            return Err(EngineError::Model {
                path: md.xml.clone(),
                detail: format!(
                    "cache eviction needs a scores output per layer; the converted graph has {} for {} layers",
                    score_outputs.len(),
                    layers.len()
                ),
            });
        }
        let block_bytes = kv_cache::bytes_per_block(&layers, cfg.cache_type, &md.xml)?;
        let mut props = Vec::new();
        if let Some(p) = cfg.precision {
            props.push(Property {
                key: "INFERENCE_PRECISION_HINT".into(),
                value: p.as_str().into(),
            });
        }
        if let Some(t) = cfg.threads {
            props.push(Property {
                key: "INFERENCE_NUM_THREADS".into(),
                value: t.to_string(),
            });
        }
        session.pin_mut().compile(&cfg.device, &props)?;
        Ok(Compiled {
            session,
            feeds,
            layers,
            logits_output,
            score_outputs,
            rope_theta: md.config.rope_theta,
            cache_type: opts.cache_type,
            elem: cfg.cache_type,
            block_size: cfg.block_size,
            block_bytes,
        })
    }
}

impl Compiled {
    /// The runner, with caches of `num_blocks` blocks.
    pub fn allocate(self, num_blocks: usize) -> Result<ModelRunner> {
        let caches = kv_cache::allocate(&self.layers, self.elem, num_blocks)?;
        Ok(ModelRunner {
            gathered: self.session.gathered_logits(),
            session: self.session,
            feeds: self.feeds,
            logits_output: self.logits_output,
            score_outputs: self.score_outputs,
            rope_theta: self.rope_theta,
            head_size: self.layers[0].0[2],
            caches,
            cache_type: self.cache_type,
            block_size: self.block_size,
            buf: StepBuffers::default(),
            caches_bound: false,
            infer_time: Duration::ZERO,
        })
    }
}

impl ModelRunner {
    /// Performs the step's block copies, binds its inputs and runs `infer()`.
    pub fn execute(&mut self, step: &Step) -> Result<()> {
        for (k, v) in &mut self.caches {
            let (kb, vb) = (k.block_bytes, v.block_bytes);
            copy_blocks_kv(k.bytes_mut(), v.bytes_mut(), kb, vb, &step.copies)?;
        }
        self.fill(step)?;
        let b = &self.buf;
        for (index, feed) in self.feeds.iter().enumerate() {
            let mut dims = [0usize; 4];
            let (rank, data): (usize, &[u8]) = match *feed {
                Feed::InputIds => vec_arg(&mut dims, &b.input_ids),
                Feed::PositionIds => vec_arg(&mut dims, &b.position_ids),
                Feed::SampledTokensIndices => vec_arg(&mut dims, &b.sampled),
                Feed::PastLens => vec_arg(&mut dims, &b.past_lens),
                Feed::SubsequenceBegins => vec_arg(&mut dims, &b.begins),
                Feed::BlockIndices => vec_arg(&mut dims, &b.block_indices),
                Feed::BlockIndicesBegins => vec_arg(&mut dims, &b.block_indices_begins),
                Feed::MaxContextLen => (0, as_bytes(&b.max_context_len)),
                Feed::ScoreWindow => vec_arg(&mut dims, &b.score_window),
                Feed::RotatedBlocks => vec_arg(&mut dims, &b.rotated_blocks),
                Feed::RotationDeltas => {
                    dims[..2].copy_from_slice(&[b.rotated_blocks.len(), self.block_size]);
                    (2, as_bytes(&b.rotation_deltas))
                }
                Feed::RotationLut => {
                    let rows = b.rotation_lut.len() / self.head_size;
                    dims[..2].copy_from_slice(&[rows, if rows == 0 { 0 } else { self.head_size }]);
                    (2, as_bytes(&b.rotation_lut))
                }
                Feed::KeyCache(_) | Feed::ValueCache(_) if self.caches_bound => continue,
                Feed::KeyCache(l) | Feed::ValueCache(l) => {
                    let c = match *feed {
                        Feed::KeyCache(_) => &mut self.caches[l].0,
                        _ => &mut self.caches[l].1,
                    };
                    // SAFETY: the cache's words hold its `shape` of `cache_type` elements, owned
                    // by `self`. The caches are set once and never move (their vectors are never
                    // resized), and `session` is declared before them in `ModelRunner`, so it is
                    // dropped first: the request's tensor never outlives the memory.
                    unsafe {
                        self.session.pin_mut().set_input(
                            index,
                            self.cache_type,
                            &c.shape,
                            c.words.as_mut_ptr().cast(),
                        )?
                    };
                    continue;
                }
            };
            // The small per-step inputs are copied into the request's own tensors.
            self.session
                .pin_mut()
                .copy_input(index, &dims[..rank], data)?;
        }
        self.caches_bound = true;
        let t = Instant::now();
        self.session.pin_mut().infer()?;
        self.infer_time += t.elapsed();
        if !self.score_outputs.is_empty() {
            // Eviction ranks blocks by the scores summed over the layers.
            let n = step.scores_len();
            self.buf.scores.clear();
            self.buf.scores.resize(n, 0.0);
            for &o in &self.score_outputs {
                let layer = self.session.output_f32(o)?;
                if layer.len() != n {
                    return Err(EngineError::OpenVino(format!(
                        "scores output of {} values, {n} expected",
                        layer.len()
                    )));
                }
                for (acc, v) in self.buf.scores.iter_mut().zip(layer) {
                    *acc += v;
                }
            }
        }
        Ok(())
    }

    /// The step's attention scores summed over the layers (with eviction).
    pub fn scores(&self) -> Option<&[f32]> {
        (!self.score_outputs.is_empty()).then_some(&self.buf.scores[..])
    }

    /// The logits of the last step, and for each sequence of it (in batch order) the range of
    /// its rows: its `logits_rows` trailing token rows (empty when it has none).
    pub fn logits(&self, step: &Step) -> Result<(Logits<'_>, Vec<Range<usize>>)> {
        let data = self.session.output_f32(self.logits_output)?;
        let rows_total = if self.gathered {
            self.buf.sampled.len()
        } else {
            step.num_tokens()
        };
        if rows_total == 0 || data.len() % rows_total != 0 {
            return Err(EngineError::OpenVino(format!(
                "logits of {} values for {rows_total} rows",
                data.len()
            )));
        }
        let rows = if self.gathered {
            step.logits_ranges()
        } else {
            step.seqs
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let end = step.subsequence_begins[i + 1] as usize;
                    end - s.logits_rows..end
                })
                .collect()
        };
        let vocab = data.len() / rows_total;
        Ok((Logits { data, vocab }, rows))
    }

    /// The step's inputs from the scheduler's `Step`.
    fn fill(&mut self, step: &Step) -> Result<()> {
        let b = &mut self.buf;
        b.input_ids.clear();
        b.input_ids.extend(step.token_ids.iter().map(|&t| t as i64));
        b.position_ids.clear();
        b.position_ids
            .extend(step.token_pos.iter().map(|&p| p as i64));
        b.past_lens.clone_from(&step.past_lens);
        b.begins.clone_from(&step.subsequence_begins);
        b.block_indices.clone_from(&step.block_indices);
        b.block_indices_begins
            .clone_from(&step.block_indices_begins);
        b.max_context_len[0] = step
            .seqs
            .iter()
            .map(|s| (s.past_len + s.num_tokens) as i32)
            .max()
            .unwrap_or(0);
        b.sampled.clear();
        b.sampled.extend(step.logits_token_rows().map(|r| r as i64));
        if b.sampled.is_empty() {
            // The LM head still needs a row; nothing reads it.
            b.sampled.push(0);
        }
        if !self.score_outputs.is_empty() {
            // Each sequence's scores sum the attention of its new tokens (the window n_s).
            b.score_window.clear();
            b.score_window
                .extend(step.seqs.iter().map(|s| s.num_tokens as i32));
            b.rotated_blocks.clear();
            b.rotation_deltas.clear();
            b.rotation_lut.clear();
            if let Some(r) = &step.rotation {
                b.rotated_blocks.extend_from_slice(&r.block_indices);
                b.rotation_deltas.extend_from_slice(&r.deltas);
                b.rotation_lut = rotation_lut(
                    r.lut_rows(),
                    self.head_size,
                    self.rope_theta,
                    RotationDirection::Backward,
                )?;
            }
        }
        Ok(())
    }
}

/// What each input of the converted graph is, and the cache geometry of each layer.
fn feeds(session: &Session, xml: &Path) -> Result<(Vec<Feed>, Vec<LayerDims>)> {
    let mut feeds = Vec::new();
    let mut dims: HashMap<(bool, usize), [usize; 3]> = HashMap::new();
    for p in session.inputs() {
        let layer = |prefix: &str| {
            p.name
                .strip_prefix(prefix)
                .and_then(|n| n.parse::<usize>().ok())
        };
        let f = match p.name.as_str() {
            "input_ids" => Feed::InputIds,
            "position_ids" => Feed::PositionIds,
            "past_lens" => Feed::PastLens,
            "subsequence_begins" => Feed::SubsequenceBegins,
            "block_indices" => Feed::BlockIndices,
            "block_indices_begins" => Feed::BlockIndicesBegins,
            "max_context_len" => Feed::MaxContextLen,
            "sampled_tokens_indices" => Feed::SampledTokensIndices,
            "score_aggregation_window" => Feed::ScoreWindow,
            "model_rotation_trig_lut" => Feed::RotationLut,
            _ if layer("rotated_block_indices.").is_some() => Feed::RotatedBlocks,
            _ if layer("rotation_deltas.").is_some() => Feed::RotationDeltas,
            n => {
                if let Some(l) = layer("key_cache.") {
                    dims.insert((true, l), port_dims(n, &p.shape, xml)?);
                    Feed::KeyCache(l)
                } else if let Some(l) = layer("value_cache.") {
                    dims.insert((false, l), port_dims(n, &p.shape, xml)?);
                    Feed::ValueCache(l)
                } else {
                    return Err(EngineError::Model {
                        path: xml.to_path_buf(),
                        detail: format!(
                            "the paged graph has an input `{n}` ({} {:?}) the engine does not feed \
                             (a model with extra inputs, such as token_type_ids or images, is not a \
                             text-generation model the engine runs)",
                            p.element_type, p.shape
                        ),
                    });
                }
            }
        };
        feeds.push(f);
    }
    let n = dims.len() / 2;
    let layers: Option<Vec<LayerDims>> = (0..n)
        .map(|l| Some((*dims.get(&(true, l))?, *dims.get(&(false, l))?)))
        .collect();
    match layers {
        Some(layers) if n > 0 => Ok((feeds, layers)),
        _ => Err(EngineError::Model {
            path: xml.to_path_buf(),
            detail:
                "the paged graph's key_cache.N / value_cache.N inputs are not numbered 0.. in pairs"
                    .into(),
        }),
    }
}

/// A step buffer as a 1-D input: rank 1 with its length in `dims[0]`, its bytes.
fn vec_arg<'a, T: Plain>(dims: &mut [usize; 4], v: &'a [T]) -> (usize, &'a [u8]) {
    dims[0] = v.len();
    (1, as_bytes(v))
}

/// Element types whose values are plain bytes (no padding, every bit pattern valid).
trait Plain: Copy {}
impl Plain for i32 {}
impl Plain for i64 {}
impl Plain for f32 {}

fn as_bytes<T: Plain>(v: &[T]) -> &[u8] {
    // SAFETY: `T` is a plain number type (no padding), so its memory is `size_of_val(v)`
    // initialised bytes; the result borrows `v`.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}
