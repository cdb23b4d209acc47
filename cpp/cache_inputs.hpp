// Where the op's caches come from: a check the op class runs whenever its inputs change.
#pragma once

#include <openvino/core/node.hpp>

namespace paged_attention {

// Rewires key_cache or value_cache (inputs 3, 4) fed by a Convert f16/bf16 -> f32/f16/bf16 of a
// Parameter (the CPU plugin's, on CPUs without native f16/bf16 or under another hint) to the
// Parameter itself, so the op writes the caller's buffer. Throws (as a node validation failure)
// when a cache cannot be written in place for the caller: fed by a Constant (read-only weights,
// or a constant the op would silently change) or by any other Convert that changes its type
// (the op would write a temporary converted copy, and the caller's cache would never see the
// new tokens).
void check_cache_inputs(ov::Node& node);

// Whether every input of `node` is a Constant (the CPU plugin's run-time shape inference clone).
bool all_inputs_constant(const ov::Node& node);

}  // namespace paged_attention
