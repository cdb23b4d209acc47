// The OpenVINO op class of PagedAttention (`ie_internal_opset`, 9..17 inputs, 2 outputs).
// A thin shim: shape inference, validation and execution are the Rust library's, reached
// through include/paged_attention.h. Registration lives in extension.cpp.
#pragma once

#include <openvino/op/op.hpp>

namespace paged_attention {

class PagedAttention : public ov::op::Op {
public:
    OPENVINO_OP("PagedAttention", "ie_internal_opset");

    PagedAttention() = default;
    explicit PagedAttention(const ov::OutputVector& args);

    // Asks pa_infer_shapes for the output types and shapes; its error message becomes the
    // node validation failure.
    void validate_and_infer_types() override;
    std::shared_ptr<ov::Node> clone_with_new_inputs(const ov::OutputVector& new_args) const override;
    // The op has no attributes: everything is an input.
    bool visit_attributes(ov::AttributeVisitor& visitor) override;
    bool has_evaluate() const override;
    // Runs pa_execute; key_cache and value_cache (inputs 3, 4) are written in place, so the
    // caller sees the update only when it shares its buffers with the request.
    bool evaluate(ov::TensorVector& outputs, const ov::TensorVector& inputs) const override;
};

}  // namespace paged_attention
