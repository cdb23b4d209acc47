// Registration only: the list of extensions this library adds to OpenVINO.
//
// OpenVINO looks up `create_extensions` in the loaded library. rustc's export list of a cdylib
// hides a symbol defined in C++, so the exported `create_extensions` is defined in Rust
// (src/ffi/openvino.rs) and forwards here.
#include <exception>
#include <memory>
#include <vector>

#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>

#include "paged_attention_op.hpp"

// Fills `*ext` (a std::vector<ov::Extension::Ptr>) as OPENVINO_CREATE_EXTENSIONS would.
// Returns 0 on success, 1 if an exception was thrown (then `*ext` is left as it was).
extern "C" int pa_ov_fill_extensions(void* ext) noexcept {
    try {
        auto& out = *static_cast<std::vector<ov::Extension::Ptr>*>(ext);
        out = {std::make_shared<ov::OpExtension<paged_attention::PagedAttention>>()};
        return 0;
    } catch (...) {
        return 1;
    }
}
