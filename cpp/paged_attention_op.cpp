// The op class: converts between OpenVINO's types and the C ABI's, nothing else. Every rule of
// the op (shapes, types, values) is checked by the Rust library, whose messages are passed on.
#include "paged_attention_op.hpp"

#include <array>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include <openvino/core/except.hpp>
#include <openvino/core/parallel.hpp>
#include <openvino/op/constant.hpp>

#include "cache_inputs.hpp"
#include "paged_attention.h"

namespace paged_attention {

namespace {

// No C ABI element type has this code, so the Rust side reports the input as having an
// unsupported element type; we add OpenVINO's name of the type to the message.
constexpr int32_t kUnsupportedElem = 1000;

int32_t elem_code(const ov::element::Type& t) {
    switch (t) {
    case ov::element::dynamic:
        return PA_ELEM_DYNAMIC;
    case ov::element::f32:
        return PA_ELEM_F32;
    case ov::element::f16:
        return PA_ELEM_F16;
    case ov::element::bf16:
        return PA_ELEM_BF16;
    case ov::element::i32:
        return PA_ELEM_I32;
    case ov::element::u8:
        return PA_ELEM_U8;
    case ov::element::u4:
        return PA_ELEM_U4;
    default:
        return kUnsupportedElem;
    }
}

ov::element::Type elem_type(int32_t code) {
    switch (code) {
    case PA_ELEM_F32:
        return ov::element::f32;
    case PA_ELEM_F16:
        return ov::element::f16;
    case PA_ELEM_BF16:
        return ov::element::bf16;
    case PA_ELEM_I32:
        return ov::element::i32;
    case PA_ELEM_U8:
        return ov::element::u8;
    case PA_ELEM_U4:
        return ov::element::u4;
    default:
        return ov::element::dynamic;
    }
}

// The calling thread's last message from the library (pa_last_error_message is per thread).
std::string last_error(pa_status status) {
    std::string msg(pa_last_error_message(nullptr, 0), '\0');
    if (!msg.empty()) {
        pa_last_error_message(msg.data(), msg.size() + 1);
    }
    return std::string(pa_status_name(status)) + ": " + msg;
}

// Names the OpenVINO element types of the inputs that the C ABI cannot describe, if any.
std::string unsupported_types(const std::vector<ov::element::Type>& types) {
    std::string s;
    for (size_t i = 0; i < types.size(); ++i) {
        if (elem_code(types[i]) == kUnsupportedElem) {
            s += " (input " + std::to_string(i) + " has OpenVINO element type " + types[i].get_type_name() + ")";
        }
    }
    return s;
}

ov::PartialShape to_ov(const pa_partial_shape& s) {
    if (s.rank < 0) {
        return ov::PartialShape::dynamic();
    }
    std::vector<ov::Dimension> dims;
    for (int32_t i = 0; i < s.rank; ++i) {
        dims.emplace_back(s.dims[i] < 0 ? ov::Dimension::dynamic() : ov::Dimension(s.dims[i]));
    }
    return ov::PartialShape(dims);
}

// The scores length, sum(past_lens) + T, depends on the values of past_lens. At run time the
// CPU plugin infers shapes on a copy of the node whose inputs are Constants holding the call's
// tensors: computing the length there makes both output shapes static, so the plugin hands
// evaluate() its own output buffers. Left dynamic, it would give evaluate() temporary tensors
// and copy them afterwards (the whole [T, H*D] output, every call). Invalid values (a negative
// length, a wrong rank or type) are left to pa_validate in evaluate(), which names them.
void known_scores_length(const ov::Node& node, pa_partial_shape& scores) {
    const auto* past = ov::as_type<const ov::op::v0::Constant>(node.get_input_node_ptr(5));
    const ov::PartialShape& query = node.get_input_partial_shape(0);
    if (!past || scores.rank != 1 || scores.dims[0] >= 0 || past->get_element_type() != ov::element::i32 ||
        past->get_shape().size() != 1 || query.rank().is_dynamic() || query.size() != 2 || query[0].is_dynamic()) {
        return;
    }
    int64_t total = query[0].get_length();
    const size_t n = past->get_shape()[0];
    const auto* values = static_cast<const int32_t*>(past->get_data_ptr());
    for (size_t i = 0; i < n; ++i) {
        if (values[i] < 0) {
            return;
        }
        total += values[i];
    }
    scores.dims[0] = total;
}

}  // namespace

PagedAttention::PagedAttention(const ov::OutputVector& args, std::string inference_precision)
    : ov::op::Op(args),
      m_inference_precision(std::move(inference_precision)) {
    constructor_validate_and_infer_types();
}

namespace {

// The attribute's spellings and their C ABI codes, one table.
constexpr std::array<std::pair<const char*, pa_precision>, 3> kPrecisions{{
    {"", PA_PRECISION_F32},
    {"f32", PA_PRECISION_F32},
    {"bf16", PA_PRECISION_BF16},
}};

bool precision_code(const std::string& name, pa_precision& code) {
    for (const auto& [n, c] : kPrecisions) {
        if (name == n) {
            code = c;
            return true;
        }
    }
    return false;
}

}  // namespace

size_t set_inference_precision(const std::shared_ptr<ov::Model>& model, const std::string& precision) {
    pa_precision code;
    OPENVINO_ASSERT(precision_code(precision, code),
                    "PagedAttention: inference_precision \"",
                    precision,
                    "\" is not f32, bf16 or empty");
    size_t n = 0;
    for (const auto& node : model->get_ops()) {
        if (auto pa = ov::as_type_ptr<PagedAttention>(node)) {
            pa->m_inference_precision = precision;
            ++n;
        }
    }
    return n;
}

void PagedAttention::validate_and_infer_types() {
    static_assert(PA_MAX_INPUTS == std::tuple_size<decltype(m_constant_sources)>::value,
                  "m_constant_sources holds PA_MAX_INPUTS inputs");
    const size_t n = get_input_size();
    // The CPU plugin's run-time shape inference clones the node onto Constants (one clone per
    // call, thrown away after) and validates the clone twice: in its constructor and once more.
    // Such a clone is never compiled, so the checks that only matter to a model (the node's
    // precision rt_info, where the caches come from) are skipped on it; the second time
    // nothing has changed, and the sources are held, so the same Constant is the same input.
    const bool all_constant = n <= m_constant_sources.size() && all_inputs_constant(*this);
    if (all_constant && m_constant_sources_valid) {
        bool same = true;
        for (size_t i = 0; same && i < n; ++i) {
            same = get_input_node_ptr(i) == m_constant_sources[i].get_node();
        }
        if (same) {
            return;
        }
    }
    m_constant_sources_valid = false;
    if (!all_constant) {
        // Keep the node in the precision its inputs are declared with: without this, the CPU
        // plugin under INFERENCE_PRECISION_HINT=f16 inserts Converts around it and evaluate()
        // writes the caches into converted copies. `precise_0` is ov::DisableFP16Compression's
        // key.
        auto& rt = get_rt_info();
        const auto precise = rt.find("precise_0");
        if (precise == rt.end() || !precise->second.is<bool>() || !precise->second.as<bool>()) {
            rt["precise_0"] = true;
        }
        check_cache_inputs(*this);
    }
    pa_precision code;
    NODE_VALIDATION_CHECK(this,
                          precision_code(m_inference_precision, code),
                          "inference_precision \"",
                          m_inference_precision,
                          "\" is not f32, bf16 or empty (f32)");

    std::array<pa_partial_shape, PA_MAX_INPUTS> in_small{};
    std::vector<pa_partial_shape> in_large;  // only for a node with too many inputs (refused)
    pa_partial_shape* in = in_small.data();
    if (n > in_small.size()) {
        in_large.resize(n);
        in = in_large.data();
    }
    for (size_t i = 0; i < n; ++i) {
        const ov::PartialShape& ps = get_input_partial_shape(i);
        pa_partial_shape& s = in[i];
        s = pa_partial_shape{};
        s.elem_type = elem_code(get_input_element_type(i));
        if (ps.rank().is_dynamic()) {
            s.rank = -1;
            continue;
        }
        NODE_VALIDATION_CHECK(this,
                              ps.size() <= PA_MAX_RANK,
                              "Input ",
                              i,
                              " has rank ",
                              ps.size(),
                              "; the op takes ranks up to 4");
        s.rank = static_cast<int32_t>(ps.size());
        for (size_t d = 0; d < ps.size(); ++d) {
            s.dims[d] = ps[d].is_static() ? ps[d].get_length() : -1;
        }
    }
    std::array<pa_partial_shape, PA_NUM_OUTPUTS> out{};
    const pa_status st = pa_infer_shapes(in, n, out.data());
    if (st == PA_STATUS_OK) {
        known_scores_length(*this, out[1]);
    } else {
        std::vector<ov::element::Type> types(n);
        for (size_t i = 0; i < n; ++i) {
            types[i] = get_input_element_type(i);
        }
        NODE_VALIDATION_CHECK(this, false, last_error(st), unsupported_types(types));
    }
    for (size_t i = 0; i < out.size(); ++i) {
        set_output_type(i, elem_type(out[i].elem_type), to_ov(out[i]));
    }
    if (all_constant) {
        for (size_t i = 0; i < n; ++i) {
            m_constant_sources[i] = input_value(i);
        }
        m_constant_sources_valid = true;
    }
}

std::shared_ptr<ov::Node> PagedAttention::clone_with_new_inputs(const ov::OutputVector& new_args) const {
    return std::make_shared<PagedAttention>(new_args, m_inference_precision);
}

bool PagedAttention::visit_attributes(ov::AttributeVisitor& visitor) {
    visitor.on_attribute("inference_precision", m_inference_precision);
    return true;
}

bool PagedAttention::has_evaluate() const {
    return true;
}

namespace {

// Describes `t` for the C ABI, over the tensor's own buffer: the caches (inputs 3, 4) and the
// outputs are written through it. A const ov::Tensor is a handle the callee may not re-point,
// not read-only memory, hence the const_cast.
pa_tensor describe(const ov::Tensor& t, size_t index, const char* what) {
    const ov::Shape& shape = t.get_shape();
    OPENVINO_ASSERT(shape.size() <= PA_MAX_RANK, "PagedAttention: ", what, " ", index, " has rank ", shape.size());
    const size_t size = t.get_size();
    OPENVINO_ASSERT(size == 0 || t.is_continuous(), "PagedAttention: ", what, " ", index, " is not a dense tensor");
    pa_tensor d{};
    d.elem_type = elem_code(t.get_element_type());
    d.rank = static_cast<int32_t>(shape.size());
    for (size_t i = 0; i < shape.size(); ++i) {
        d.dims[i] = static_cast<int64_t>(shape[i]);
    }
    d.data = size == 0 ? nullptr : const_cast<void*>(t.data());
    return d;
}

// Runs the library's work items on OpenVINO's threads: `ov::parallel_nt` runs on the TBB arena
// of the stream that called evaluate(), so INFERENCE_NUM_THREADS, NUM_STREAMS, CPU pinning and
// hybrid-core scheduling apply to our kernel as to OpenVINO's own ops.
void ov_parallel_for(void*, size_t n, pa_task_fn task, void* task_ctx) {
    ov::parallel_nt(static_cast<int>(n), [&](int ithr, int) { task(task_ctx, static_cast<size_t>(ithr)); });
}

pa_runner openvino_runner() {
    pa_runner r{};
    r.parallel_for = ov_parallel_for;
    r.ctx = nullptr;
    const int threads = parallel_get_max_threads();
    r.max_threads = threads > 0 ? static_cast<size_t>(threads) : 1;
    return r;
}

// OpenVINO's names of the inputs' element types the C ABI cannot describe (for messages).
std::string unsupported_input_types(const ov::TensorVector& inputs) {
    std::vector<ov::element::Type> types;
    types.reserve(inputs.size());
    for (const auto& t : inputs) {
        types.push_back(t.get_element_type());
    }
    return unsupported_types(types);
}

}  // namespace

// The per-call path allocates nothing of its own in the common case: the descriptors live on
// the stack, and the outputs the plugin hands over are used as they are. The CPU plugin infers
// the output shapes before every call (on a clone of this node, see known_scores_length), so
// they are normally right: pa_execute_ex then validates the call once, outputs included. Only
// when it refuses the call is pa_validate asked for the shapes (and for the message of an
// invalid call), the outputs sized, and the call made again; a refused call has written nothing.
bool PagedAttention::evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const {
    OPENVINO_ASSERT(outputs.size() == PA_NUM_OUTPUTS, "PagedAttention: expected 2 outputs, got ", outputs.size());
    const size_t n = inputs.size();
    OPENVINO_ASSERT(n <= PA_MAX_INPUTS, "PagedAttention: expected at most ", PA_MAX_INPUTS, " inputs, got ", n);
    // OpenVINO hands Constants straight from the mapped weights file, at any byte offset (a
    // serializer packs them without padding). Inputs read by value get an aligned copy when
    // their data is not aligned to their element; the caches (3, 4) are written in place, so
    // they cannot be copied: they come from the caller's Parameters, whose tensors OpenVINO
    // allocates aligned (or the caller's own memory, which the contract requires aligned).
    std::array<ov::Tensor, PA_MAX_INPUTS> aligned;
    std::array<pa_tensor, PA_MAX_INPUTS> in{};
    for (size_t i = 0; i < n; ++i) {
        const ov::Tensor* t = &inputs[i];
        const size_t align = t->get_element_type().size();
        if (i != 3 && i != 4 && align > 1 && t->get_size() != 0 &&
            reinterpret_cast<uintptr_t>(t->data()) % align != 0) {
            aligned[i] = ov::Tensor(t->get_element_type(), t->get_shape());
            std::memcpy(aligned[i].data(), t->data(), t->get_byte_size());
            t = &aligned[i];
        }
        in[i] = describe(*t, i, "input");
    }
    const pa_runner runner = openvino_runner();
    pa_precision precision = PA_PRECISION_F32;
    precision_code(m_inference_precision, precision);  // checked in validate_and_infer_types
    std::array<pa_tensor, PA_NUM_OUTPUTS> out{};
    for (size_t i = 0; i < PA_NUM_OUTPUTS; ++i) {
        out[i] = describe(outputs[i], i, "output");
    }
    pa_status st = pa_execute_ex(in.data(), n, out.data(), out.size(), &runner, precision);
    if (st == PA_STATUS_OK) {
        return true;
    }
    std::array<pa_partial_shape, PA_NUM_OUTPUTS> shapes{};
    st = pa_validate(in.data(), n, shapes.data());
    if (st != PA_STATUS_OK) {
        OPENVINO_THROW("PagedAttention: ", last_error(st), unsupported_input_types(inputs));
    }
    // The plugin hands over outputs of shape [0] when it could not infer them: size them.
    for (size_t i = 0; i < PA_NUM_OUTPUTS; ++i) {
        outputs[i].set_shape(to_ov(shapes[i]).to_shape());
        out[i] = describe(outputs[i], i, "output");
    }
    st = pa_execute_ex(in.data(), n, out.data(), out.size(), &runner, precision);
    if (st != PA_STATUS_OK) {
        OPENVINO_THROW("PagedAttention: ", last_error(st));
    }
    return true;
}

}  // namespace paged_attention
