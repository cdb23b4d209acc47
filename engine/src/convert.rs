//! `pa-engine convert`: a stateful LLM IR to a paged IR on our op, written to disk, as the
//! engine converts it in memory (the one converter, `cpp/convert.cpp`).

use crate::error::{EngineError, Result};
use crate::model_runner::convert_options;
use paged_attention::dtype::DEFAULT_CACHE_TYPE;
use paged_attention::ElemType;
use std::path::Path;

/// How [`convert_ir`] converts.
#[derive(Clone, Debug)]
pub struct Conversion {
    pub block_size: usize,
    pub cache_type: ElemType,
    /// Also the scores outputs, score window and rotation inputs (what cache eviction feeds).
    pub serving: bool,
    /// Ask OpenVINO's pass for xattention, adaptive R-KV or qq_bias inputs too; the converter
    /// then refuses the graph (our op has none of them), naming the input.
    pub allow_xattention: bool,
    pub allow_adaptive_rkv: bool,
    pub allow_qq_bias: bool,
}

impl Default for Conversion {
    fn default() -> Conversion {
        Conversion {
            block_size: 32,
            cache_type: DEFAULT_CACHE_TYPE,
            serving: false,
            allow_xattention: false,
            allow_adaptive_rkv: false,
            allow_qq_bias: false,
        }
    }
}

/// Converts a stateful LLM IR to a paged IR on our op (`xml_out` and its `.bin`), as the engine
/// does in memory, but without gathering logits rows. Returns the number of attention layers
/// converted.
pub fn convert_ir(xml_in: &Path, xml_out: &Path, how: &Conversion) -> Result<usize> {
    let s = |p: &Path| {
        p.to_str()
            .map(str::to_owned)
            .ok_or_else(|| EngineError::Model {
                path: p.to_path_buf(),
                detail: "path is not UTF-8".into(),
            })
    };
    let mut opts = convert_options(how.block_size, how.cache_type, how.serving)?;
    opts.gather_logits = false;
    opts.allow_xattention = how.allow_xattention;
    opts.allow_adaptive_rkv = how.allow_adaptive_rkv;
    opts.allow_qq_bias = how.allow_qq_bias;
    let session =
        crate::ov::ffi::open_session(&s(xml_in)?, &opts).map_err(|e| EngineError::Model {
            path: xml_in.to_path_buf(),
            detail: e.what().to_string(),
        })?;
    session.save(&s(xml_out)?)?;
    Ok(session.converted_layers())
}
