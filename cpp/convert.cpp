#include "convert.hpp"

#include <array>
#include <cmath>
#include <cstring>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <openvino/core/except.hpp>
#include <openvino/core/rt_info.hpp>
#include <openvino/op/constant.hpp>
#include <openvino/op/gather.hpp>
#include <openvino/op/matmul.hpp>
#include <openvino/op/parameter.hpp>
#include <openvino/op/result.hpp>
#include <openvino/pass/manager.hpp>
#include <openvino/pass/sdpa_to_paged_attention.hpp>

#include "paged_attention.h"
#include "paged_attention_op.hpp"

namespace paged_attention {
namespace {

constexpr const char* kBuiltin = "PagedAttentionExtension";

// OpenVINO 2026.4.1's input order of PagedAttentionExtension (docs/contract.md).
constexpr std::array<const char*, 28> kBuiltinInputs = {
    "query", "key", "value", "key_cache", "value_cache", "past_lens", "subsequence_begins",
    "block_indices", "block_indices_begins", "scale", "sliding_window", "alibi_slopes",
    "max_context_len", "score_aggregation_window", "rotated_block_indices", "rotation_deltas",
    "rotation_trig_lut", "xattention_threshold", "xattention_block_size", "xattention_stride",
    "sinks", "adaptive_rkv_start_size", "adaptive_rkv_evictable_sizes",
    "adaptive_rkv_diversity_block_set_indices", "adaptive_rkv_diversity_block_set_indices_begins",
    "token_type_ids", "qq_bias", "qq_bias_begins"};

// Our input i is the built-in's input kOursFromBuiltin[i]; built-in 12 (max_context_len) is
// dropped: our op derives it from past_lens and subsequence_begins.
constexpr std::array<size_t, 16> kOursFromBuiltin = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 14, 15, 16, 13};
constexpr size_t kFirstExtra = 17;
// The built-in's sinks input, our input 16 (the 17th) when the model uses it.
constexpr size_t kBuiltinSinks = 20;

// A refusal: a plain message (no source location), the node and input named by the caller.
template <typename... Args>
void require(bool ok, const Args&... parts) {
    if (!ok) {
        std::ostringstream msg;
        (msg << ... << parts);
        throw std::runtime_error(msg.str());
    }
}

std::string input_name(size_t i) {
    return i < kBuiltinInputs.size() ? kBuiltinInputs[i] : "input " + std::to_string(i);
}

// Reads one bool attribute of a node (PagedAttentionExtension's write_kv_cache).
class BoolAttribute : public ov::AttributeVisitor {
public:
    explicit BoolAttribute(std::string name) : name_(std::move(name)) {}
    void on_adapter(const std::string&, ov::ValueAccessor<void>&) override {}
    void on_adapter(const std::string& name, ov::ValueAccessor<bool>& adapter) override {
        if (name == name_) {
            value = adapter.get();
        }
    }
    std::optional<bool> value;

private:
    std::string name_;
};

// True when input i is a constant with no elements (how the pass says "not used").
bool is_empty_constant(const std::shared_ptr<ov::Node>& pa, size_t i) {
    const auto c = ov::as_type_ptr<ov::op::v0::Constant>(pa->get_input_node_shared_ptr(i));
    return c != nullptr && ov::shape_size(c->get_shape()) == 0;
}

// An extra input is neutral when it is a constant that is empty or a zero scalar: the built-in
// op then does nothing with it, and neither do we.
void check_neutral(const std::shared_ptr<ov::Node>& pa, size_t i, const std::string& where) {
    const std::string name = input_name(i);
    const auto src = pa->get_input_node_shared_ptr(i);
    const auto c = ov::as_type_ptr<ov::op::v0::Constant>(src);
    require(c != nullptr,
                    where,
                    ": input ",
                    i,
                    " (",
                    name,
                    ") is fed by ",
                    src->get_type_name(),
                    " `",
                    src->get_friendly_name(),
                    "`, not a constant: the model uses ",
                    name,
                    ", which our PagedAttention does not implement");
    const ov::Shape& shape = c->get_shape();
    const bool empty = ov::shape_size(shape) == 0;
    bool zero_scalar = false;
    if (shape.empty() && c->get_element_type().is_real()) {
        zero_scalar = c->cast_vector<double>().at(0) == 0.0;
    } else if (shape.empty()) {
        zero_scalar = c->cast_vector<int64_t>().at(0) == 0;
    }
    require(empty || zero_scalar,
                    where,
                    ": input ",
                    i,
                    " (",
                    name,
                    ") is the constant `",
                    c->get_friendly_name(),
                    "` of shape ",
                    shape,
                    ", not empty or zero: the model uses ",
                    name,
                    ", which our PagedAttention does not implement");
}

// Whether our input `i`, fed by `src`, says what its absence says (docs/contract.md): an empty
// alibi_slopes, rotation input or score_aggregation_window, a sliding_window <= 0, a scale of 0
// or exactly the default 1/sqrt(D) (computed as the op does, in f32). Such trailing inputs are
// dropped: the CPU plugin re-creates every input of the node as a Constant for its shape
// inference before each call, so each one costs every call something.
bool means_absent(size_t i, const ov::Output<ov::Node>& src, int64_t head_size) {
    const auto c = ov::as_type_ptr<ov::op::v0::Constant>(src.get_node_shared_ptr());
    if (!c) {
        return false;
    }
    const size_t n = ov::shape_size(c->get_shape());
    switch (i) {
    case PA_INPUT_ALIBI_SLOPES:
    case PA_INPUT_ROTATED_BLOCK_INDICES:
    case PA_INPUT_ROTATION_DELTAS:
    case PA_INPUT_ROTATION_TRIG_LUT:
    case PA_INPUT_SCORE_AGGREGATION_WINDOW:
        return n == 0;
    case PA_INPUT_SLIDING_WINDOW:
        return n == 1 && c->get_element_type() == ov::element::i32 && c->cast_vector<int32_t>()[0] <= 0;
    case PA_INPUT_SCALE: {
        if (n != 1 || c->get_element_type() != ov::element::f32 || head_size <= 0) {
            return false;
        }
        const float scale = c->cast_vector<float>()[0];
        const float fallback = 1.0f / std::sqrt(static_cast<float>(head_size));
        return scale == 0.0f || std::memcmp(&scale, &fallback, sizeof scale) == 0;
    }
    default:
        return false;
    }
}

int64_t rt_int(const ov::Node& node, const char* key) {
    const auto& rt = node.get_rt_info();
    const auto it = rt.find(key);
    require(it != rt.end(), kBuiltin, " `", node.get_friendly_name(), "` has no rt_info ", key);
    return std::stoll(it->second.as<std::string>());
}

// Types a cache Parameter (the pass leaves it dynamic) as our op reads it.
void type_cache(const std::shared_ptr<ov::Node>& pa,
                size_t port,
                int64_t heads,
                int64_t head_size,
                const ConvertConfig& cfg,
                const std::string& where) {
    const auto src = pa->get_input_node_shared_ptr(port);
    const auto param = ov::as_type_ptr<ov::op::v0::Parameter>(src);
    require(param != nullptr,
                    where,
                    ": input ",
                    port,
                    " (",
                    input_name(port),
                    ") is fed by ",
                    src->get_type_name(),
                    "; the op writes the caches in place, so they must be model inputs (Parameters)");
    const ov::element::Type et = cfg.cache_type;
    int64_t rows = cfg.block_size;
    int64_t cols = head_size;
    if (et == ov::element::u8 || et == ov::element::u4) {
        // OpenVINO's u8 and u4 layouts: keys by channel (f32 scale and zero point in 8 extra
        // rows of bytes, 16 of nibbles), values by token (8 extra bytes per token: 8 or 16
        // elements).
        (port == 3 ? rows : cols) += et == ov::element::u8 ? 8 : 16;
    }
    param->set_element_type(et);
    param->set_partial_shape(ov::PartialShape{ov::Dimension::dynamic(), heads, rows, cols});
    param->validate_and_infer_types();
}

std::shared_ptr<ov::Node> replace_one(const std::shared_ptr<ov::Node>& pa, const ConvertConfig& cfg) {
    const std::string where = std::string(kBuiltin) + " `" + pa->get_friendly_name() + "`";
    BoolAttribute write_kv("write_kv_cache");
    pa->visit_attributes(write_kv);
    require(write_kv.value.value_or(true),
                    where,
                    ": write_kv_cache=false; our op always writes the new tokens into the caches");
    const size_t n_in = pa->get_input_size();
    require(n_in >= kFirstExtra && n_in <= kBuiltinInputs.size(),
                    where,
                    " has ",
                    n_in,
                    " inputs; this converter knows the layouts with ",
                    kFirstExtra,
                    " to ",
                    kBuiltinInputs.size(),
                    " (OpenVINO 2026.4.1 order)");
    const bool sinks = n_in > kBuiltinSinks && !is_empty_constant(pa, kBuiltinSinks);
    for (size_t i = kFirstExtra; i < n_in; ++i) {
        if (!(sinks && i == kBuiltinSinks)) {
            check_neutral(pa, i, where);
        }
    }
    for (size_t k = 2; k < pa->get_output_size(); ++k) {
        require(pa->output(k).get_target_inputs().empty(),
                        where,
                        ": output ",
                        k,
                        " (adaptive_rkv_diversity) is used; our PagedAttention has no such output");
    }
    const int64_t k_heads = rt_int(*pa, "num_k_heads");
    const int64_t k_size = rt_int(*pa, "k_head_size");
    const int64_t v_heads = rt_int(*pa, "num_v_heads");
    const int64_t v_size = rt_int(*pa, "v_head_size");
    require(v_heads == k_heads,
                    where,
                    ": input 4 (value_cache) has ",
                    v_heads,
                    " heads, the key cache ",
                    k_heads,
                    "; our PagedAttention needs as many value heads as key heads");
    type_cache(pa, 3, k_heads, k_size, cfg, where);
    type_cache(pa, 4, v_heads, v_size, cfg, where);

    ov::OutputVector args;
    args.reserve(kOursFromBuiltin.size());
    for (const size_t b : kOursFromBuiltin) {
        args.push_back(pa->input_value(b));
    }
    if (sinks) {
        args.push_back(pa->input_value(kBuiltinSinks));
    } else {
        while (args.size() > PA_MIN_INPUTS && means_absent(args.size() - 1, args.back(), k_size)) {
            args.pop_back();
        }
    }
    auto ours = std::make_shared<PagedAttention>(args);
    ours->set_friendly_name(pa->get_friendly_name());
    ov::copy_runtime_info(pa, ours);
    for (size_t k = 0; k < 2 && k < pa->get_output_size(); ++k) {
        pa->output(k).replace(ours->output(k));
    }
    return ours;
}

// Inserts `Gather(hidden, sampled_tokens_indices, 0)` before the MatMul that makes the logits
// (the LM head), as GenAI does, so only the rows the sampler reads are computed.
bool gather_logits(const std::shared_ptr<ov::Model>& model) {
    for (const auto& result : model->get_results()) {
        const auto& names = result->get_input_tensor(0).get_names();
        if (names.count("logits") == 0) {
            continue;
        }
        const auto matmul = ov::as_type_ptr<ov::op::v0::MatMul>(result->get_input_node_shared_ptr(0));
        if (!matmul || matmul->get_transpose_a() || matmul->get_input_partial_shape(0).rank().is_dynamic()) {
            return false;
        }
        auto indices = std::make_shared<ov::op::v0::Parameter>(ov::element::i64, ov::PartialShape{-1});
        indices->set_friendly_name("sampled_tokens_indices");
        indices->get_output_tensor(0).set_names({"sampled_tokens_indices"});
        const auto axis = ov::op::v0::Constant::create(ov::element::i64, ov::Shape{}, {0});
        auto gather = std::make_shared<ov::op::v8::Gather>(matmul->input_value(0), indices, axis);
        matmul->input(0).replace_source_output(gather);
        model->add_parameters({indices});
        model->validate_nodes_and_infer_types();
        return true;
    }
    return false;
}

}  // namespace

namespace {
// The one C++ table of the cache types: the element codes of include/paged_attention.h (the
// discriminants of the Rust ElemType, src/dtype.rs, whose NAMES table holds the names) and
// OpenVINO's types. OpenVINO names them itself (f32, f16, bf16, u8, u4).
struct CacheTypeEntry {
    int code;
    ov::element::Type_t type;
};
constexpr CacheTypeEntry kCacheTypes[] = {
    {PA_ELEM_F32, ov::element::Type_t::f32},
    {PA_ELEM_F16, ov::element::Type_t::f16},
    {PA_ELEM_BF16, ov::element::Type_t::bf16},
    {PA_ELEM_U8, ov::element::Type_t::u8},
    {PA_ELEM_U4, ov::element::Type_t::u4},
};
}  // namespace

ov::element::Type cache_element_type(int code) {
    for (const auto& e : kCacheTypes) {
        if (e.code == code) {
            return e.type;
        }
    }
    OPENVINO_THROW("element code ", code, " is not a cache type (f32, f16, bf16, u8, u4)");
}

bool is_cache_type(const ov::element::Type& type) {
    for (const auto& e : kCacheTypes) {
        if (ov::element::Type(e.type) == type) {
            return true;
        }
    }
    return false;
}

ConvertReport convert_to_our_op(const std::shared_ptr<ov::Model>& model, const ConvertConfig& config) {
    require(config.block_size > 0, "block size must be positive, got ", config.block_size);
    require(is_cache_type(config.cache_type), "cache type ", config.cache_type, " is not one of f32, f16, bf16, u8, u4");
    for (const auto& op : model->get_ops()) {
        require(std::strcmp(op->get_type_name(), PagedAttention::get_type_info_static().name) != 0,
                        "the model already uses PagedAttention (",
                        PagedAttention::get_type_info_static().version_id,
                        "): nothing to convert");
        require(std::strcmp(op->get_type_name(), kBuiltin) != 0,
                        "the model already holds ",
                        kBuiltin,
                        " nodes; convert the stateful model it came from");
    }
    require(!model->get_sinks().empty() || !model->get_variables().empty(),
                    "the model is not stateful (no ReadValue/Assign KV cache): export it with "
                    "`optimum-cli export openvino --task text-generation-with-past`");
    ov::pass::Manager manager;
    manager.register_pass<ov::pass::SDPAToPagedAttention>(false,
                                                          config.serving,
                                                          config.serving,
                                                          config.serving,
                                                          config.allow_xattention,
                                                          config.allow_adaptive_rkv,
                                                          config.allow_qq_bias);
    manager.run_passes(model);

    std::vector<std::shared_ptr<ov::Node>> builtin;
    for (const auto& op : model->get_ordered_ops()) {
        if (std::strcmp(op->get_type_name(), kBuiltin) == 0) {
            builtin.push_back(op);
        }
    }
    require(!builtin.empty(),
                    "SDPAToPagedAttention found no ScaledDotProductAttention it could turn into ",
                    kBuiltin);
    ConvertReport report;
    for (const auto& pa : builtin) {
        replace_one(pa, config);
        ++report.converted;
    }
    model->validate_nodes_and_infer_types();
    if (config.gather_logits) {
        report.gathered_logits = gather_logits(model);
    }
    return report;
}

}  // namespace paged_attention
