/* Exercises the C ABI's edges from C: version, status names, shape inference (static and
 * dynamic), sizing the error message with a NULL buffer, NULL pointers, bad enums, a wrong
 * output size, and a GQA prefill + decode on a shared cache whose scores sum as they must.
 * Exit code 0 means every check passed; otherwise the failing check is printed. */
#include "paged_attention.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CHECK(cond)                                                        \
    do {                                                                   \
        if (!(cond)) {                                                     \
            char m_[512];                                                  \
            pa_last_error_message(m_, sizeof m_);                          \
            printf("FAILED line %d: %s (last error: %s)\n", __LINE__, #cond, m_); \
            return 1;                                                      \
        }                                                                  \
    } while (0)

static pa_tensor tensor(int32_t elem, int32_t rank, const int64_t *dims, void *data) {
    pa_tensor t;
    memset(&t, 0, sizeof t);
    t.elem_type = elem;
    t.rank = rank;
    for (int i = 0; i < rank; i++) t.dims[i] = dims[i];
    t.data = data;
    return t;
}

static pa_partial_shape pshape(int32_t elem, int32_t rank, const int64_t *dims) {
    pa_partial_shape s;
    memset(&s, 0, sizeof s);
    s.elem_type = elem;
    s.rank = rank;
    for (int i = 0; i < rank; i++) s.dims[i] = dims[i];
    return s;
}

enum { H = 4, HKV = 2, D = 8, BS = 4, NB = 3, T = 5 };

int main(void) {
    CHECK(pa_version() == ((PA_VERSION_MAJOR << 16) | (PA_VERSION_MINOR << 8) | PA_VERSION_PATCH));
    char expect_version[32];
    snprintf(expect_version, sizeof expect_version, "%d.%d.%d", PA_VERSION_MAJOR, PA_VERSION_MINOR,
             PA_VERSION_PATCH);
    CHECK(strcmp(pa_version_string(), expect_version) == 0);
    CHECK(strcmp(pa_status_name(PA_STATUS_VALUE), "PA_STATUS_VALUE") == 0);
    CHECK(strcmp(pa_status_name(12345), "PA_STATUS_UNKNOWN") == 0);

    /* Shape inference: T dynamic, everything else static. */
    const int64_t q_dims[2] = {-1, H * D}, kv_dims[2] = {-1, HKV * D};
    const int64_t c_dims[4] = {NB, HKV, BS, D}, b_dims[1] = {2}, b1_dims[1] = {3}, n_dims[1] = {-1};
    pa_partial_shape ps[9] = {
        pshape(PA_ELEM_F16, 2, q_dims), pshape(PA_ELEM_F16, 2, kv_dims), pshape(PA_ELEM_F16, 2, kv_dims),
        pshape(PA_ELEM_F32, 4, c_dims), pshape(PA_ELEM_F32, 4, c_dims), pshape(PA_ELEM_I32, 1, b_dims),
        pshape(PA_ELEM_I32, 1, b1_dims), pshape(PA_ELEM_I32, 1, n_dims), pshape(PA_ELEM_I32, 1, b1_dims),
    };
    pa_partial_shape out_ps[2];
    CHECK(pa_infer_shapes(ps, 9, out_ps) == PA_STATUS_OK);
    CHECK(out_ps[0].elem_type == PA_ELEM_F16 && out_ps[0].rank == 2);
    CHECK(out_ps[0].dims[0] == -1 && out_ps[0].dims[1] == H * D);
    CHECK(out_ps[1].rank == 1 && out_ps[1].dims[0] == -1);
    /* A contradiction: key width 3 * D. The message can be sized with a NULL buffer. */
    ps[1].dims[1] = 3 * D;
    CHECK(pa_infer_shapes(ps, 9, out_ps) == PA_STATUS_SHAPE);
    size_t need = pa_last_error_message(NULL, 0);
    CHECK(need > 0);
    char *msg = (char *)malloc(need + 1);
    CHECK(msg != NULL);
    CHECK(pa_last_error_message(msg, need + 1) == need && strlen(msg) == need);
    CHECK(strstr(msg, "key") != NULL && strstr(msg, "24") != NULL);
    free(msg);
    /* Truncation keeps a NUL. */
    char tiny[4];
    pa_last_error_message(tiny, sizeof tiny);
    CHECK(strlen(tiny) == 3);
    ps[1].dims[1] = HKV * D;
    CHECK(pa_infer_shapes(NULL, 9, out_ps) == PA_STATUS_NULL_POINTER);
    CHECK(pa_infer_shapes(ps, 9, NULL) == PA_STATUS_NULL_POINTER);
    CHECK(pa_infer_shapes(ps, 8, out_ps) == PA_STATUS_INPUT_COUNT);
    ps[0].elem_type = 42;
    CHECK(pa_infer_shapes(ps, 9, out_ps) == PA_STATUS_INVALID_ARGUMENT);
    ps[0].elem_type = PA_ELEM_F16;
    CHECK(pa_infer_shapes(ps, 9, out_ps) == PA_STATUS_OK);
    CHECK(pa_last_error_message(NULL, 0) == 0);

    /* Execute: sequence 0 prefills 3 tokens, sequence 1 decodes 2 tokens on a past of 5. */
    float q[T * H * D], k[T * HKV * D], v[T * HKV * D];
    for (int i = 0; i < T * H * D; i++) q[i] = (float)((i * 37 % 17) - 8) / 8.0f;
    for (int i = 0; i < T * HKV * D; i++) {
        k[i] = (float)((i * 11 % 13) - 6) / 6.0f;
        v[i] = (float)((i * 7 % 19) - 9) / 9.0f;
    }
    static float kc[NB * HKV * BS * D], vc[NB * HKV * BS * D];
    for (int i = 0; i < NB * HKV * BS * D; i++) {
        kc[i] = 0.25f;
        vc[i] = -0.5f;
    }
    int32_t past[2] = {0, 5}, sub[3] = {0, 3, 5}, bi[4] = {2, -1, 0, 1}, bib[3] = {0, 2, 4};
    float scale = 0.0f; /* 0 means 1/sqrt(D) */
    int32_t window = -1; /* every new token contributes to the scores */
    const int64_t qd[2] = {T, H * D}, kd[2] = {T, HKV * D}, one[1] = {2}, three[1] = {3}, four[1] = {4};
    const int64_t empty[1] = {0};
    pa_tensor in[16];
    in[0] = tensor(PA_ELEM_F32, 2, qd, q);
    in[1] = tensor(PA_ELEM_F32, 2, kd, k);
    in[2] = tensor(PA_ELEM_F32, 2, kd, v);
    in[3] = tensor(PA_ELEM_F32, 4, c_dims, kc);
    in[4] = tensor(PA_ELEM_F32, 4, c_dims, vc);
    in[5] = tensor(PA_ELEM_I32, 1, one, past);
    in[6] = tensor(PA_ELEM_I32, 1, three, sub);
    in[7] = tensor(PA_ELEM_I32, 1, four, bi);
    in[8] = tensor(PA_ELEM_I32, 1, three, bib);
    in[9] = tensor(PA_ELEM_F32, 0, NULL, &scale);
    for (int i = 10; i < 15; i++) in[i] = tensor(PA_ELEM_I32, 1, empty, NULL);
    in[11].elem_type = PA_ELEM_F32;
    in[14].elem_type = PA_ELEM_F32;
    in[15] = tensor(PA_ELEM_I32, 0, NULL, &window);

    pa_partial_shape shapes[2];
    CHECK(pa_validate(in, 16, shapes) == PA_STATUS_OK);
    CHECK(shapes[0].dims[0] == T && shapes[0].dims[1] == H * D && shapes[1].dims[0] == 3 + 7);
    float out[T * H * D], scores[10];
    const int64_t sd[1] = {10}, bad_sd[1] = {9};
    pa_tensor outs[2] = {tensor(PA_ELEM_F32, 2, qd, out), tensor(PA_ELEM_F32, 1, bad_sd, scores)};
    CHECK(pa_execute(in, 16, outs, 2) == PA_STATUS_BUFFER_SIZE);
    CHECK(kc[2 * HKV * BS * D] == 0.25f); /* nothing written */
    outs[1] = tensor(PA_ELEM_F32, 1, sd, scores);
    CHECK(pa_execute(in, 16, outs, 1) == PA_STATUS_INVALID_ARGUMENT);
    CHECK(pa_execute(in, 16, NULL, 2) == PA_STATUS_NULL_POINTER);
    CHECK(pa_execute(in, 16, outs, 2) == PA_STATUS_OK);
    for (int i = 0; i < T * H * D; i++) CHECK(isfinite(out[i]) && fabsf(out[i]) <= 1.0f + 1e-6f);
    /* Each new token's weights sum to 1 per head: scores sum to H * (new tokens). */
    float s0 = 0, s1 = 0;
    for (int j = 0; j < 3; j++) s0 += scores[j];
    for (int j = 3; j < 10; j++) s1 += scores[j];
    CHECK(fabsf(s0 - H * 3) < 1e-4f && fabsf(s1 - H * 2) < 1e-4f);
    /* The first prefill token sees only itself: its output is its own value row. */
    for (int h = 0; h < H; h++)
        for (int x = 0; x < D; x++) CHECK(fabsf(out[h * D + x] - v[(h / (H / HKV)) * D + x]) < 1e-6f);
    /* Token 1 of sequence 1 (position 6) went to block bi[2 + 6 / BS] = 1, slot 2. */
    CHECK(kc[((1 * HKV + 0) * BS + 2) * D + 0] == k[(4 * HKV + 0) * D + 0]);

    /* Bad enum in a tensor, negative dim, NULL data with elements. */
    in[5].elem_type = 99;
    CHECK(pa_validate(in, 16, NULL) == PA_STATUS_INVALID_ARGUMENT);
    in[5].elem_type = PA_ELEM_I32;
    in[5].dims[0] = -2;
    CHECK(pa_validate(in, 16, NULL) == PA_STATUS_INVALID_ARGUMENT);
    in[5].dims[0] = 2;
    in[5].data = NULL;
    CHECK(pa_validate(in, 16, NULL) == PA_STATUS_NULL_POINTER);
    in[5].data = past;
    CHECK(pa_validate(in, 16, NULL) == PA_STATUS_OK);
    printf("abi_check ok\n");
    return 0;
}
