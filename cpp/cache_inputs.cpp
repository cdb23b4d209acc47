// Checks where the caches come from. Runs in validate_and_infer_types, which the CPU plugin
// calls again after its own transformations: that is where a Convert it inserted in front of an
// f16/bf16 cache Parameter (on CPUs without native f16/bf16, or under another
// INFERENCE_PRECISION_HINT) shows up. That one is bypassed, so the op reads and writes the
// Parameter's buffer; any other source the op cannot write in place makes compile_model fail
// instead of evaluate() writing into a copy the caller never sees.
#include "cache_inputs.hpp"

#include <string>

#include <openvino/core/except.hpp>
#include <openvino/op/constant.hpp>
#include <openvino/op/convert.hpp>
#include <openvino/op/parameter.hpp>

namespace paged_attention {

bool all_inputs_constant(const ov::Node& node) {
    for (size_t i = 0; i < node.get_input_size(); ++i) {
        if (!ov::is_type<ov::op::v0::Constant>(node.get_input_node_ptr(i))) {
            return false;
        }
    }
    return true;
}

void check_cache_inputs(ov::Node& node) {
    // At run time the CPU plugin re-infers shapes on a clone whose inputs are all Constants
    // wrapping the call's tensors: that node is not a model, so there is nothing to check.
    if (all_inputs_constant(node)) {
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
        // An f16/bf16 Parameter converted to another float type (the CPU plugin widens it to
        // f32 on CPUs without native f16/bf16, whatever the hint) is bypassed: the op reads and
        // writes the Parameter's own f16/bf16 buffer, a cache type it takes with any query type.
        if (const auto cvt = ov::as_type_ptr<ov::op::v0::Convert>(src)) {
            const auto from = cvt->get_input_element_type(0);
            const auto to = cvt->get_output_element_type(0);
            // Likewise a u4 Parameter the CPU plugin widens to u8 (it does so in front of every
            // custom op): the op reads and writes the packed u4 buffer itself.
            const bool widened_float = (from == ov::element::f16 || from == ov::element::bf16) &&
                                       (to == ov::element::f32 || to == ov::element::f16 || to == ov::element::bf16);
            const bool widened_u4 = from == ov::element::u4 && to == ov::element::u8;
            if ((widened_float || widened_u4) &&
                ov::as_type_ptr<ov::op::v0::Parameter>(cvt->get_input_node_shared_ptr(0))) {
                node.set_argument(i, cvt->input_value(0));
                continue;
            }
            NODE_VALIDATION_CHECK(&node,
                                  from == to,
                                  what,
                                  " comes through the Convert `",
                                  src->get_friendly_name(),
                                  "` (",
                                  from,
                                  " -> ",
                                  to,
                                  "). The op writes the caches in place: it would write a temporary converted copy, "
                                  "and the caller's cache would never see the new tokens. Feed the caches straight "
                                  "from Parameters or variables (an f16/bf16 Parameter the CPU plugin widens to f32 "
                                  "is taken as it is), in the type the op should store");
        }
    }
}

}  // namespace paged_attention
