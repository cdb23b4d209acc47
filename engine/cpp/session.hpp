// One compiled paged model and its infer request, for the Rust engine (bridged by cxx in
// src/ov.rs). The model is converted in memory by the project's converter (cpp/convert.hpp);
// inputs are set as tensors over the caller's memory on every call (no copies), outputs read in
// place.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <openvino/openvino.hpp>

#include "rust/cxx.h"

namespace pa_engine {

struct ConvertOptions;
enum class CacheType : uint8_t;
struct Port;
struct Property;

class Session {
public:
    explicit Session(std::shared_ptr<ov::Model> model, size_t converted, bool gathered);

    rust::Vec<Port> inputs() const;
    rust::Vec<Port> outputs() const;
    size_t converted_layers() const;
    bool gathered_logits() const;
    void save(rust::Str xml) const;
    void compile(rust::Str device, rust::Slice<const Property> properties);
    void set_input(size_t index, CacheType element_type, rust::Slice<const size_t> shape, uint8_t* data);
    // Copies `data` into the request's own tensor of input `index`, reshaped to `shape` (for the
    // small per-step inputs: cheaper than a set_tensor, which looks the port up and checks it).
    void copy_input(size_t index, rust::Slice<const size_t> shape, rust::Slice<const uint8_t> data);
    void infer();
    rust::Slice<const float> output_f32(size_t index) const;

private:
    ov::Core core_;
    std::shared_ptr<ov::Model> model_;
    ov::CompiledModel compiled_;
    mutable ov::InferRequest request_;
    std::vector<ov::Tensor> owned_;  // the request's tensors of copy_input, by input index  // get_tensor is not const in OpenVINO's API
    size_t converted_;
    bool gathered_;
};

// Reads a stateful LLM IR and converts it to our op (cpp/convert.hpp).
std::unique_ptr<Session> open_session(rust::Str xml, const ConvertOptions& options);

}  // namespace pa_engine
