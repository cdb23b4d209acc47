// Registration only: the OpenVINO version check and the list of extensions this module adds.
//
// OpenVINO looks up `create_extensions` in the loaded library. rustc's export list of a cdylib
// hides a symbol defined in C++, so the exported `create_extensions` is defined in Rust
// (openvino/src/lib.rs) and forwards here.
#include <memory>
#include <vector>

#include <openvino/core/except.hpp>
#include <openvino/core/extension.hpp>
#include <openvino/core/op_extension.hpp>
#include <openvino/core/version.hpp>

#include "paged_attention_op.hpp"

#define PA_OV_STR2(x) #x
#define PA_OV_STR(x) PA_OV_STR2(x)

// openvino/src/lib.rs: 0 if `running` is release `built`, else 1 and the message in `buf`.
extern "C" int pa_ov_check_version(const char* running, const char* built, char* buf, size_t len);

// Fills `*ext` (a std::vector<ov::Extension::Ptr>) as OPENVINO_CREATE_EXTENSIONS would, after
// checking that the running OpenVINO is the release these headers are from. Throws
// ov::Exception on a mismatch (then `*ext` is left as it was): add_extension reports it.
extern "C" void pa_ov_create_extensions(void* ext) {
    static const char built[] = PA_OV_STR(OPENVINO_VERSION_MAJOR) "." PA_OV_STR(
        OPENVINO_VERSION_MINOR) "." PA_OV_STR(OPENVINO_VERSION_PATCH);
    char msg[1024];
    if (pa_ov_check_version(ov::get_openvino_version().buildNumber, built, msg, sizeof msg) != 0) {
        OPENVINO_THROW(msg);
    }
    auto& out = *static_cast<std::vector<ov::Extension::Ptr>*>(ext);
    out = {std::make_shared<ov::OpExtension<paged_attention::PagedAttention>>()};
}
