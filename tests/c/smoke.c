/* Smoke test of the op's C ABI: one decode step of one sequence, checked against a hand-written
 * expectation (a single key: softmax weight 1, so the output equals the value row), and a
 * rejected call whose message is read back. */
#define _POSIX_C_SOURCE 200112L /* setenv */
#include "paged_attention.h"
#ifdef PA_TEST_HOOKS /* a library built with the feature test-hooks (tests/c_abi.rs) */
#include "pa_test_hooks.h"
#endif
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static pa_tensor t1(int32_t elem, int64_t d0, void *data) {
    pa_tensor t;
    memset(&t, 0, sizeof t);
    t.elem_type = elem;
    t.rank = 1;
    t.dims[0] = d0;
    t.data = data;
    return t;
}

/* A host parallel-for that runs the tasks one after another, last first, and counts them
 * (a real host hands them to its threads; any order and any concurrency are allowed). */
static size_t g_tasks;
static void reverse_for(void *ctx, size_t n, pa_task_fn task, void *task_ctx) {
    (void)ctx;
    for (size_t i = n; i-- > 0;) {
        g_tasks++;
        task(task_ctx, i);
    }
}

int main(void) {
    /* This call is tiny: without this, the library runs it on the calling thread alone, and
       the host runner below would get no task. */
    setenv("PA_SERIAL_BELOW", "0", 1);
    enum { H = 2, HKV = 1, D = 4, BS = 4, NB = 2 };
    float q[H * D] = {1, 0, 0, 0, 0, 1, 0, 0};
    float k[HKV * D] = {0.5f, 0.25f, 0, 0};
    float v[HKV * D] = {1, 2, 3, 4};
    float kc[NB * HKV * BS * D];
    float vc[NB * HKV * BS * D];
    memset(kc, 0, sizeof kc);
    memset(vc, 0, sizeof vc);
    int32_t past[1] = {0}, sub[2] = {0, 1}, bi[1] = {1}, bib[2] = {0, 1};
    float out[H * D], scores[1];
    pa_tensor in[9];
    memset(in, 0, sizeof in);
    in[0].elem_type = PA_ELEM_F32; in[0].rank = 2; in[0].dims[0] = 1; in[0].dims[1] = H * D; in[0].data = q;
    in[1].elem_type = PA_ELEM_F32; in[1].rank = 2; in[1].dims[0] = 1; in[1].dims[1] = HKV * D; in[1].data = k;
    in[2] = in[1]; in[2].data = v;
    in[3].elem_type = PA_ELEM_F32; in[3].rank = 4; in[3].dims[0] = NB; in[3].dims[1] = HKV;
    in[3].dims[2] = BS; in[3].dims[3] = D; in[3].data = kc;
    in[4] = in[3]; in[4].data = vc;
    in[5] = t1(PA_ELEM_I32, 1, past);
    in[6] = t1(PA_ELEM_I32, 2, sub);
    in[7] = t1(PA_ELEM_I32, 1, bi);
    in[8] = t1(PA_ELEM_I32, 2, bib);
    pa_tensor outs[2];
    memset(outs, 0, sizeof outs);
    outs[0].elem_type = PA_ELEM_F32; outs[0].rank = 2; outs[0].dims[0] = 1; outs[0].dims[1] = H * D; outs[0].data = out;
    outs[1] = t1(PA_ELEM_F32, 1, scores);

    pa_partial_shape shapes[2];
    pa_status st = pa_validate(in, 9, shapes);
    if (st != PA_STATUS_OK || shapes[1].dims[0] != 1) { printf("validate failed: %d\n", st); return 1; }
    st = pa_execute(in, 9, outs, 2);
    if (st != PA_STATUS_OK) {
        char msg[256];
        pa_last_error_message(msg, sizeof msg);
        printf("execute failed: %s %s\n", pa_status_name(st), msg);
        return 1;
    }
    for (int h = 0; h < H; h++)
        for (int x = 0; x < D; x++)
            if (fabsf(out[h * D + x] - v[x]) > 1e-6f) { printf("out[%d] = %f\n", h * D + x, out[h * D + x]); return 1; }
    /* both heads give weight 1 to the only key */
    if (fabsf(scores[0] - 2.0f) > 1e-6f) { printf("scores[0] = %f\n", scores[0]); return 1; }
    /* the token went to block 1, slot 0 */
    if (kc[1 * BS * D + 0] != 0.5f || vc[1 * BS * D + 3] != 4.0f) { printf("cache not written\n"); return 1; }

    /* a block id out of range is rejected with a message naming it, and nothing is written */
    bi[0] = 7;
    out[0] = -99.0f;
    st = pa_execute(in, 9, outs, 2);
    char msg[256];
    size_t n = pa_last_error_message(msg, sizeof msg);
    if (st != PA_STATUS_VALUE || n == 0 || strstr(msg, "block_indices[0] = 7") == NULL || out[0] != -99.0f) {
        printf("expected a rejection, got %s: %s\n", pa_status_name(st), msg);
        return 1;
    }

    /* the same call on a host runner gives the same result; a bad runner is rejected */
    bi[0] = 1;
    memset(kc, 0, sizeof kc);
    memset(vc, 0, sizeof vc);
    float first[H * D];
    if (pa_execute(in, 9, outs, 2) != PA_STATUS_OK) { printf("second pa_execute failed\n"); return 1; }
    memcpy(first, out, sizeof first);
    memset(out, 0, sizeof out);
    pa_runner runner;
    runner.parallel_for = reverse_for;
    runner.ctx = NULL;
    runner.max_threads = 4;
    st = pa_execute_ex(in, 9, outs, 2, &runner, PA_PRECISION_F32);
    if (st != PA_STATUS_OK || g_tasks == 0 || memcmp(first, out, sizeof out) != 0) {
        printf("pa_execute_ex: %s, %zu tasks\n", pa_status_name(st), g_tasks);
        return 1;
    }
    runner.max_threads = 0;
    if (pa_execute_ex(in, 9, outs, 2, &runner, PA_PRECISION_F32) != PA_STATUS_INVALID_ARGUMENT) { printf("max_threads 0 accepted\n"); return 1; }
    runner.parallel_for = NULL;
    runner.max_threads = 2;
    if (pa_execute_ex(in, 9, outs, 2, &runner, PA_PRECISION_F32) != PA_STATUS_NULL_POINTER) { printf("NULL parallel_for accepted\n"); return 1; }
    if (pa_execute_ex(in, 9, outs, 2, NULL, PA_PRECISION_F32) != PA_STATUS_OK) { printf("NULL runner (library pool) failed\n"); return 1; }
    /* a precision that is no pa_precision is refused, the bf16 one accepted (a decode-only call:
       f32 math in either) */
    if (pa_execute_ex(in, 9, outs, 2, NULL, 7) != PA_STATUS_INVALID_ARGUMENT) { printf("precision 7 accepted\n"); return 1; }
    if (pa_execute_ex(in, 9, outs, 2, NULL, PA_PRECISION_BF16) != PA_STATUS_OK) { printf("bf16 precision failed\n"); return 1; }
    if (pa_set_num_threads(3) != PA_STATUS_OK || pa_get_num_threads() != 3) { printf("pa_set_num_threads(3)\n"); return 1; }
    if (pa_set_num_threads(100000) != PA_STATUS_INVALID_ARGUMENT) { printf("100000 threads accepted\n"); return 1; }
#ifdef PA_TEST_HOOKS
    pa_item_counts counts;
    if (pa_item_counts_get(&counts) != PA_STATUS_OK || counts.host == 0 || counts.pool == 0) {
        printf("item counts: host %llu pool %llu\n", (unsigned long long)counts.host, (unsigned long long)counts.pool);
        return 1;
    }
    if (pa_item_counts_get(NULL) != PA_STATUS_NULL_POINTER) { printf("pa_item_counts_get(NULL)\n"); return 1; }
#endif
    printf("ok %s\n", pa_version_string());
    return 0;
}
