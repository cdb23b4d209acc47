// Where the op's caches come from: a check the op class runs whenever its inputs change.
#pragma once

#include <openvino/core/node.hpp>

namespace paged_attention {

// Throws (as a node validation failure) when key_cache or value_cache (inputs 3, 4) cannot be
// written in place for the caller: fed by a Constant (read-only weights, or a constant the
// op would silently change) or by a Convert (the op would write a temporary converted copy,
// and the caller's cache would never see the new tokens).
void check_cache_inputs(const ov::Node& node);

}  // namespace paged_attention
