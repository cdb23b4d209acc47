// The OpenVINO op class of PagedAttention (`ie_internal_opset`, 9..17 inputs, 2 outputs).
// A thin shim: shape inference, validation and execution are the Rust library's, reached
// through include/paged_attention.h. Registration lives in extension.cpp.
#pragma once

#include <array>
#include <memory>
#include <string>

#include <openvino/core/model.hpp>
#include <openvino/op/op.hpp>

namespace paged_attention {

size_t set_inference_precision(const std::shared_ptr<ov::Model>& model, const std::string& precision);

class PagedAttention : public ov::op::Op {
public:
    OPENVINO_OP("PagedAttention", "ie_internal_opset");

    PagedAttention() = default;
    explicit PagedAttention(const ov::OutputVector& args, std::string inference_precision = "");

    // Asks pa_infer_shapes for the output types and shapes; its error message becomes the
    // node validation failure.
    void validate_and_infer_types() override;
    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& new_args) const override;
    // One attribute, `inference_precision`: "f32", "bf16", or "" (absent in the IR: f32). The
    // precision the deployment chose (docs/contract.md, "Precision"); the plugin hands the op
    // the same tensors under every INFERENCE_PRECISION_HINT, so whoever builds or compiles the
    // model sets it (set_inference_precision). Everything else is an input.
    bool visit_attributes(ov::AttributeVisitor& visitor) override;
    const std::string& inference_precision() const {
        return m_inference_precision;
    }
    bool has_evaluate() const override;
    // Runs pa_execute; key_cache and value_cache (inputs 3, 4) are written in place, so the
    // caller sees the update only when it shares its buffers with the request.
    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override;

private:
    friend size_t set_inference_precision(const std::shared_ptr<ov::Model>&, const std::string&);
    std::string m_inference_precision;
    // The Constant inputs the node was last validated with, when all its inputs are Constants
    // (the CPU plugin's run-time shape inference clone): validating it again with the same
    // ones is skipped. Sized PA_MAX_INPUTS (a static_assert in the .cpp checks).
    std::array<ov::Output<ov::Node>, 17> m_constant_sources;
    bool m_constant_sources_valid = false;
};

// Sets `inference_precision` ("f32" or "bf16", as OpenVINO spells INFERENCE_PRECISION_HINT's
// element types; "" clears it) on every PagedAttention node of `model`; returns how many. Call
// it before compile_model with the hint the model is compiled with (the CPU plugin's default:
// core.get_property("CPU", ov::hint::inference_precision)). Throws ov::Exception on another value.
size_t set_inference_precision(const std::shared_ptr<ov::Model>& model, const std::string& precision);

}  // namespace paged_attention
