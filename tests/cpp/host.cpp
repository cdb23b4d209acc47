// A C++ host of the extension: loads the library with ov::Core::add_extension, reads
// tests/cpp/host_model.xml (16 Parameters with the seed example's shapes: 8 heads, head size 16,
// block 16; written by the former tests/python/ir_util.py, now tools/ir_writer.py's
// paged_attention_ir), compiles it on CPU and runs one
// mixed call (a 3-token prefill continuation and a decode) with caller-owned buffers, checking
// outputs, scores and the in-place cache writes against a small double-precision reference
// written here. Then a call with a block id out of range must throw an ov::Exception carrying the
// library's message and write nothing, and the next good call must work.
//
// Usage: host <extension library> <model.xml>. Exit status 0 on success.
//
// Also compiles include/paged_attention.h as C++ under the test's -Wall -Wextra -Werror.
#include "paged_attention.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include <openvino/openvino.hpp>

namespace {

constexpr int H = 8, HKV = 8, D = 16, BS = 16, NB = 6, B = 2;
constexpr double TOL = 2e-6;  // f32: |ours - expected| <= TOL * max(1, |expected|)

int failures = 0;

void check(bool ok, const std::string& what) {
    if (!ok) {
        std::fprintf(stderr, "FAIL: %s\n", what.c_str());
        ++failures;
    }
}

float next_value(uint32_t& state) {  // deterministic values in [-1, 1)
    state = state * 1664525u + 1013904223u;
    return static_cast<float>(state >> 8) / static_cast<float>(1u << 23) - 1.0f;
}

struct Call {
    std::vector<int32_t> past{5, 17}, begins{0, 3, 4}, blocks{4, -1, 1, 3}, block_begins{0, 2, 4};
    std::vector<int32_t> window{2, 1};  // seq 0: last 2 new tokens; seq 1: its only one
    int T() const { return begins[B]; }
};

size_t at(int block, int head, int slot, int d) {
    return ((static_cast<size_t>(block) * HKV + head) * BS + slot) * D + d;
}

// Double-precision reference of SPEC.md steps 2-4 (no rotation, ALiBi or sliding window here).
void reference(const Call& c, const std::vector<float>& q, const std::vector<float>& k, const std::vector<float>& v,
               std::vector<double>& kc, std::vector<double>& vc, std::vector<double>& out, std::vector<double>& scores) {
    for (int s = 0; s < B; ++s) {
        for (int i = 0; i < c.begins[s + 1] - c.begins[s]; ++i) {
            const int p = c.past[s] + i, row = c.begins[s] + i;
            const int blk = c.blocks[c.block_begins[s] + p / BS];
            for (int h = 0; h < HKV; ++h)
                for (int d = 0; d < D; ++d) {
                    kc[at(blk, h, p % BS, d)] = k[row * HKV * D + h * D + d];
                    vc[at(blk, h, p % BS, d)] = v[row * HKV * D + h * D + d];
                }
        }
    }
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));  // input scale is 0
    out.assign(static_cast<size_t>(c.T()) * H * D, 0.0);
    scores.clear();
    for (int s = 0; s < B; ++s) {
        const int n = c.begins[s + 1] - c.begins[s], L = c.past[s] + n;
        std::vector<double> acc(L, 0.0);
        for (int i = 0; i < n; ++i) {
            const int p = c.past[s] + i, row = c.begins[s] + i;
            for (int h = 0; h < H; ++h) {
                const int kh = h / (H / HKV);
                std::vector<double> w(p + 1);
                double mx = -INFINITY, sum = 0;
                for (int j = 0; j <= p; ++j) {
                    const int blk = c.blocks[c.block_begins[s] + j / BS];
                    double dot = 0;
                    for (int d = 0; d < D; ++d) dot += q[row * H * D + h * D + d] * kc[at(blk, kh, j % BS, d)];
                    w[j] = scale * dot;
                    mx = std::max(mx, w[j]);
                }
                for (int j = 0; j <= p; ++j) sum += (w[j] = std::exp(w[j] - mx));
                for (int j = 0; j <= p; ++j) {
                    w[j] /= sum;
                    const int blk = c.blocks[c.block_begins[s] + j / BS];
                    for (int d = 0; d < D; ++d) out[row * H * D + h * D + d] += w[j] * vc[at(blk, kh, j % BS, d)];
                    if (i >= n - std::min(c.window[s], n)) acc[j] += w[j];
                }
            }
        }
        scores.insert(scores.end(), acc.begin(), acc.end());
    }
}

double max_err(const float* ours, const std::vector<double>& expected) {
    double e = 0;
    for (size_t i = 0; i < expected.size(); ++i)
        e = std::max(e, std::fabs(ours[i] - expected[i]) / std::max(1.0, std::fabs(expected[i])));
    return e;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 3) {
        std::fprintf(stderr, "usage: %s <extension library> <model.xml>\n", argv[0]);
        return 2;
    }
    static_assert(PA_MIN_INPUTS == 9 && PA_MAX_INPUTS == 17 && PA_NUM_OUTPUTS == 2, "header constants");
    try {
        ov::Core core;
        core.add_extension(argv[1]);
        ov::CompiledModel compiled = core.compile_model(core.read_model(argv[2]), "CPU");
        ov::InferRequest req = compiled.create_infer_request();

        Call c;
        const int T = c.T();
        uint32_t state = 12345;
        std::vector<float> q(T * H * D), k(T * HKV * D), v(T * HKV * D), kc(NB * HKV * BS * D), vc(kc.size());
        for (auto* buf : {&q, &k, &v, &kc, &vc})
            for (float& x : *buf) x = next_value(state);
        const std::vector<float> kc0 = kc, vc0 = vc;
        std::vector<double> ekc(kc.begin(), kc.end()), evc(vc.begin(), vc.end()), eout, escores;
        reference(c, q, k, v, ekc, evc, eout, escores);

        float scale = 0.0f;
        int32_t sliding_window = 0;
        const ov::element::Type f32 = ov::element::f32, i32 = ov::element::i32;
        auto i32v = [&](std::vector<int32_t>& x) { return ov::Tensor(i32, ov::Shape{x.size()}, x.data()); };
        // Every input is the caller's buffer, set explicitly on every call (OPENVINO.md).
        auto run = [&](Call& call) {
            std::vector<ov::Tensor> in = {
                ov::Tensor(f32, ov::Shape{size_t(T), size_t(H * D)}, q.data()),
                ov::Tensor(f32, ov::Shape{size_t(T), size_t(HKV * D)}, k.data()),
                ov::Tensor(f32, ov::Shape{size_t(T), size_t(HKV * D)}, v.data()),
                ov::Tensor(f32, ov::Shape{NB, HKV, BS, D}, kc.data()),
                ov::Tensor(f32, ov::Shape{NB, HKV, BS, D}, vc.data()),
                i32v(call.past), i32v(call.begins), i32v(call.blocks), i32v(call.block_begins),
                ov::Tensor(f32, ov::Shape{}, &scale),
                ov::Tensor(i32, ov::Shape{}, &sliding_window),
                ov::Tensor(f32, ov::Shape{0}),     // alibi_slopes: not provided
                ov::Tensor(i32, ov::Shape{0}),     // rotated_block_indices: not provided
                ov::Tensor(i32, ov::Shape{0, 0}),  // rotation_deltas
                ov::Tensor(f32, ov::Shape{0, D}),  // rotation_trig_lut
                i32v(call.window),
            };
            for (size_t i = 0; i < in.size(); ++i) req.set_input_tensor(i, in[i]);
            req.infer();
        };
        auto check_good_call = [&](const char* when) {
            const ov::Tensor out = req.get_output_tensor(0), scores = req.get_output_tensor(1);
            check(out.get_shape() == ov::Shape{size_t(T), size_t(H * D)}, std::string(when) + ": output shape");
            check(scores.get_size() == escores.size(), std::string(when) + ": scores size");
            const double eo = max_err(out.data<const float>(), eout), es = max_err(scores.data<const float>(), escores);
            // Every slot of this layout holds a token or is in an unreferenced block, except
            // block 4 slots 8.. (seq 0's last block, past its 8 tokens): don't-care per SPEC.
            for (int slot = 8; slot < BS; ++slot)
                for (int h = 0; h < HKV; ++h)
                    for (int d = 0; d < D; ++d) ekc[at(4, h, slot, d)] = kc[at(4, h, slot, d)], evc[at(4, h, slot, d)] = vc[at(4, h, slot, d)];
            const double ek = max_err(kc.data(), ekc), ev = max_err(vc.data(), evc);
            std::printf("%s: max error vs double reference: output %.3g, scores %.3g, key_cache %.3g, value_cache %.3g\n",
                        when, eo, es, ek, ev);
            check(eo <= TOL && es <= TOL, std::string(when) + ": outputs differ from the reference");
            check(ek <= TOL && ev <= TOL, std::string(when) + ": caches not updated in place as expected");
        };

        run(c);
        check_good_call("first call");

        Call bad = c;
        bad.blocks[0] = 99;
        const std::vector<float> kc1 = kc, vc1 = vc;
        bool threw = false;
        try {
            run(bad);
        } catch (const ov::Exception& e) {
            threw = true;
            const std::string msg = e.what();
            check(msg.find("block_indices[0] = 99 is outside 0..6") != std::string::npos,
                  "the exception carries the library's message, got: " + msg);
        }
        check(threw, "a block id out of range throws ov::Exception");
        check(kc == kc1 && vc == vc1, "a rejected call leaves the caches untouched");

        run(c);  // the same call again: the same tokens land in the same slots
        check_good_call("call after the rejected one");
        check(kc0 != kc, "caches changed at all");
    } catch (const std::exception& e) {
        std::fprintf(stderr, "FAIL: unexpected exception: %s\n", e.what());
        return 1;
    }
    if (failures) return 1;
    std::printf("host: all checks passed\n");
    return 0;
}
