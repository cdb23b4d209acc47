// Checks where the caches come from. Runs in validate_and_infer_types, which the CPU plugin
// calls again after its own transformations: that is where a Convert it inserted in front of an
// f16/bf16 cache Parameter (INFERENCE_PRECISION_HINT other than the cache's type) shows up, so
// compile_model fails instead of evaluate() writing into a copy the caller never sees.
#include "cache_inputs.hpp"

#include <string>

#include <openvino/core/except.hpp>
#include <openvino/op/constant.hpp>
#include <openvino/op/convert.hpp>

namespace paged_attention {

void check_cache_inputs(const ov::Node& node) {
    // At run time the CPU plugin re-infers shapes on a clone whose inputs are all Constants
    // wrapping the call's tensors: that node is not a model, so there is nothing to check.
    bool all_constant = true;
    for (size_t i = 0; i < node.get_input_size(); ++i) {
        all_constant = all_constant && ov::is_type<ov::op::v0::Constant>(node.get_input_node_ptr(i));
    }
    if (all_constant) {
        return;
    }
    constexpr const char* names[] = {"key_cache", "value_cache"};
    for (size_t i = 3; i < 5 && i < node.get_input_size(); ++i) {
        const auto src = node.get_input_source_output(i).get_node_shared_ptr();
        const std::string what =
            std::string(names[i - 3]) + " (input " + std::to_string(i) + ") of PagedAttention `" +
            node.get_friendly_name() + "`";
        NODE_VALIDATION_CHECK(&node,
                              !ov::as_type_ptr<ov::op::v0::Constant>(src),
                              what,
                              " is the Constant `",
                              src->get_friendly_name(),
                              "`. The op writes the caches in place, and a Constant is read-only (the CPU plugin "
                              "maps it from the weights file) or would be changed for every later call. Make the "
                              "caches model inputs (Parameters or variables).");
        // A Convert to the same type is a placeholder the plugin removes (seen under hint f16:
        // `key_cache_decompressed_to_f32`, f16 -> f16); only a change of type makes a copy.
        if (ov::as_type_ptr<ov::op::v0::Convert>(src) &&
            src->get_input_element_type(0) != src->get_output_element_type(0)) {
            const ov::element::Type from = src->get_input_element_type(0);
            NODE_VALIDATION_CHECK(&node,
                                  false,
                                  what,
                                  " comes through the Convert `",
                                  src->get_friendly_name(),
                                  "` (",
                                  from,
                                  " -> ",
                                  src->get_output_element_type(0),
                                  "). The op writes the caches in place: it would write a temporary converted copy, "
                                  "and the caller's cache would never see the new tokens. The CPU plugin inserts this "
                                  "Convert for ",
                                  from,
                                  " caches unless the model is compiled with INFERENCE_PRECISION_HINT=",
                                  from,
                                  " (f16 needs a CPU with native f16); or declare the caches f32. A Convert in "
                                  "the model itself must go: feed the caches straight from Parameters or variables.");
        }
    }
}

}  // namespace paged_attention
