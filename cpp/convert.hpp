// The one converter from OpenVINO's LLM graphs to this project's op, in memory: a stateful SDPA
// LLM (as optimum-intel exports it) goes through OpenVINO's own SDPAToPagedAttention pass, as GenAI
// applies it, and every PagedAttentionExtension it makes is replaced by our PagedAttention
// (ie_internal_opset, 9 to 17 inputs, 2 outputs). Used by the engine (through cxx), which
// `pa-engine convert` and tools/pa_convert.py run.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include <openvino/core/model.hpp>
#include <openvino/core/type/element_type.hpp>

namespace paged_attention {

struct ConvertConfig {
    // Token slots per cache block.
    int block_size = 32;
    // f32, f16, bf16, u8 (OpenVINO's u8 layout: key [?, Hkv, BS + 8, D] by channel, value
    // [?, Hkv, BS, Dv + 8] by token) or u4 (OpenVINO's u4 layout: key [?, Hkv, BS + 16, D], value
    // [?, Hkv, BS, Dv + 16], two values per byte). u8 is OpenVINO's CPU default, and the engine's.
    ov::element::Type cache_type = ov::element::u8;
    // Also give the graph what score-driven eviction needs: outputs scores.N, inputs
    // score_aggregation_window and the rotation inputs.
    bool serving = false;
    // Compute logits only for the rows named by a new input `sampled_tokens_indices` (i64 [N]),
    // when the logits come from a MatMul: a prefill chunk then costs one LM-head row, not T.
    bool gather_logits = true;
    // Ask the pass for what OpenVINO's op has and ours lacks (xattention inputs 17-19, adaptive
    // R-KV inputs 21-24 and output 2, qq_bias inputs 26-27): the conversion is then refused,
    // naming the first such input. For checking the refusals on graphs the pass really makes.
    bool allow_xattention = false;
    bool allow_adaptive_rkv = false;
    bool allow_qq_bias = false;
};

struct ConvertReport {
    size_t converted = 0;
    bool gathered_logits = false;
};

// The cache type of an element code of include/paged_attention.h (PA_ELEM_*; the Rust
// ElemType's discriminant); throws for a code that is no cache type.
ov::element::Type cache_element_type(int code);
bool is_cache_type(const ov::element::Type& type);

// Converts `model` in place. Attention sinks and a value head size other than the key's (Dv != D)
// are carried over to our op. Throws std::runtime_error with a message naming the node and the
// input when the graph uses what our op does not implement (xattention, adaptive R-KV, token type
// ids, qq_bias, write_kv_cache=false), or when it is not a stateful SDPA LLM the pass can transform.
ConvertReport convert_to_our_op(const std::shared_ptr<ov::Model>& model, const ConvertConfig& config);

}  // namespace paged_attention
