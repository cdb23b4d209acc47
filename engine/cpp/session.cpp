#include "session.hpp"

#include <cstring>
#include <string>
#include <vector>

#include <openvino/core/op_extension.hpp>
#include <openvino/runtime/properties.hpp>

#include "convert.hpp"
#include "paged_attention_op.hpp"
#include "paged_attention_engine/src/ov.rs.h"

namespace pa_engine {
namespace {

std::string str(rust::Str s) {
    return std::string(s.data(), s.size());
}

// The cxx enum's discriminants are the element codes (PA_ELEM_*), which the converter's one
// table maps.
ov::element::Type element(CacheType t) {
    return paged_attention::cache_element_type(static_cast<int>(t));
}

Port port(const ov::Output<const ov::Node>& out) {
    Port p;
    p.name = out.get_names().empty() ? rust::String("") : rust::String(out.get_any_name());
    p.element_type = out.get_element_type().get_type_name();
    const ov::PartialShape& ps = out.get_partial_shape();
    if (ps.rank().is_static()) {
        for (const auto& d : ps) {
            p.shape.push_back(d.is_static() ? d.get_length() : -1);
        }
    }
    return p;
}

}  // namespace

Session::Session(std::shared_ptr<ov::Model> model, size_t converted, bool gathered)
    : model_(std::move(model)), converted_(converted), gathered_(gathered) {}

rust::Vec<Port> Session::inputs() const {
    rust::Vec<Port> v;
    for (const auto& in : std::const_pointer_cast<const ov::Model>(model_)->inputs()) {
        v.push_back(port(in));
    }
    return v;
}

rust::Vec<Port> Session::outputs() const {
    rust::Vec<Port> v;
    for (const auto& out : std::const_pointer_cast<const ov::Model>(model_)->outputs()) {
        v.push_back(port(out));
    }
    return v;
}

size_t Session::converted_layers() const {
    return converted_;
}

bool Session::gathered_logits() const {
    return gathered_;
}

void Session::save(rust::Str xml) const {
    ov::save_model(model_, str(xml), false);
}

void Session::compile(rust::Str device, rust::Slice<const Property> properties) {
    ov::AnyMap config;
    for (const auto& p : properties) {
        config[str(p.key)] = str(p.value);
    }
    // Our op computes in the precision the model is compiled with (docs/contract.md,
    // "Precision"): the hint given, else the device's default (bf16 on CPUs with AVX512-BF16 or
    // AMX). The plugin does not tell a custom op, so the attribute carries it.
    ov::element::Type hint;
    const auto given = config.find(ov::hint::inference_precision.name());
    if (given != config.end()) {
        hint = ov::element::Type(given->second.as<std::string>());
    } else {
        hint = core_.get_property(str(device), ov::hint::inference_precision);
    }
    paged_attention::set_inference_precision(model_, hint == ov::element::bf16 ? "bf16" : "f32");
    compiled_ = core_.compile_model(model_, str(device), config);
    request_ = compiled_.create_infer_request();
}

void Session::set_input(size_t index, CacheType element_type, rust::Slice<const size_t> shape, uint8_t* data) {
    OPENVINO_ASSERT(index < compiled_.inputs().size(), "no input ", index);
    const ov::Shape s(shape.begin(), shape.end());
    request_.set_tensor(compiled_.input(index), ov::Tensor(element(element_type), s, data));
}

void Session::copy_input(size_t index, rust::Slice<const size_t> shape, rust::Slice<const uint8_t> data) {
    OPENVINO_ASSERT(index < compiled_.inputs().size(), "no input ", index);
    if (owned_.size() <= index) {
        owned_.resize(compiled_.inputs().size());
    }
    ov::Tensor& t = owned_[index];
    if (!t) {
        t = request_.get_tensor(compiled_.input(index));
    }
    t.set_shape(ov::Shape(shape.begin(), shape.end()));
    OPENVINO_ASSERT(t.get_byte_size() == data.size(), "input ", index, ": ", data.size(), " bytes for ", t.get_byte_size());
    if (!data.empty()) {
        std::memcpy(t.data(), data.data(), data.size());
    }
}

void Session::infer() {
    request_.infer();
}

rust::Slice<const float> Session::output_f32(size_t index) const {
    OPENVINO_ASSERT(index < compiled_.outputs().size(), "no output ", index);
    const ov::Tensor t = request_.get_tensor(compiled_.output(index));
    OPENVINO_ASSERT(t.get_element_type() == ov::element::f32,
                    "output ",
                    index,
                    " is ",
                    t.get_element_type(),
                    ", not f32");
    return rust::Slice<const float>(t.data<const float>(), t.get_size());
}

std::unique_ptr<Session> open_session(rust::Str xml, const ConvertOptions& options) {
    ov::Core core;
    // Our op is known to the reader, so an IR already on it is read and refused by name.
    core.add_extension(std::make_shared<ov::OpExtension<paged_attention::PagedAttention>>());
    std::shared_ptr<ov::Model> model = core.read_model(str(xml));
    paged_attention::ConvertConfig cfg;
    cfg.block_size = static_cast<int>(options.block_size);
    cfg.cache_type = element(options.cache_type);
    cfg.serving = options.serving;
    cfg.gather_logits = options.gather_logits;
    cfg.allow_xattention = options.allow_xattention;
    cfg.allow_adaptive_rkv = options.allow_adaptive_rkv;
    cfg.allow_qq_bias = options.allow_qq_bias;
    const auto report = paged_attention::convert_to_our_op(model, cfg);
    return std::make_unique<Session>(model, report.converted, report.gathered_logits);
}

}  // namespace pa_engine
