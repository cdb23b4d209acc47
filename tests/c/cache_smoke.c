/* Smoke test of the cache manager's C ABI (include/paged_attention_cache.h): block manager
 * operations with their expected effects and errors, then a scheduler feeding pa_execute for a
 * few requests until they finish. Prints "ok" and returns 0 on success. */
#include "paged_attention_cache.h"
#include <math.h>
#include <stdio.h>
#include <string.h>

#define CHECK(cond, ...)                          \
    do {                                          \
        if (!(cond)) {                            \
            printf("line %d: ", __LINE__);        \
            printf(__VA_ARGS__);                  \
            printf("\n");                         \
            return 1;                             \
        }                                         \
    } while (0)

#define OK(call)                                                                        \
    do {                                                                                \
        pa_status st_ = (call);                                                         \
        if (st_ != PA_STATUS_OK) {                                                      \
            char m_[256];                                                               \
            pa_last_error_message(m_, sizeof m_);                                       \
            printf("line %d: %s -> %s: %s\n", __LINE__, #call, pa_status_name(st_), m_); \
            return 1;                                                                   \
        }                                                                               \
    } while (0)

static int manager_smoke(void) {
    pa_cache_manager *m = NULL;
    OK(pa_cache_manager_create(8, 4, 1, &m));
    uint32_t prompt[6] = {11, 12, 13, 14, 15, 16};
    size_t cached = 99, past = 99, ncopies = 99, len = 0, nblocks = 0;
    pa_block_copy copies[8];

    OK(pa_cache_add_sequence(m, 1, prompt, 6, &cached));
    CHECK(cached == 0, "cached %zu", cached);
    OK(pa_cache_append(m, 1, prompt, 6, &past, copies, 8, &ncopies));
    CHECK(past == 0 && ncopies == 0, "past %zu copies %zu", past, ncopies);
    OK(pa_cache_mark_computed(m));

    /* fork, then writing the shared partial block 1 copies it */
    OK(pa_cache_fork(m, 1, 2));
    uint32_t t = 77;
    OK(pa_cache_append(m, 2, &t, 1, &past, copies, 8, &ncopies));
    CHECK(past == 6 && ncopies == 1, "past %zu copies %zu", past, ncopies);
    pa_cache_stats s;
    OK(pa_cache_get_stats(m, &s));
    CHECK(s.used_blocks == 3 && s.shared_blocks == 1 && s.used_slots == 9 &&
              s.fragmentation == 3,
          "stats used %zu shared %zu slots %zu frag %zu", s.used_blocks, s.shared_blocks,
          s.used_slots, s.fragmentation);

    /* the copy on real caches: [NB=8, Hkv=1, BS=4, D=2] f32 */
    float kc[8 * 4 * 2], vc[8 * 4 * 2];
    for (int i = 0; i < 64; i++) { kc[i] = (float)i; vc[i] = (float)-i; }
    OK(pa_cache_copy_blocks(kc, vc, 8, 4 * 2 * sizeof(float), copies, 1));
    CHECK(kc[copies[0].dst * 8] == (float)(copies[0].src * 8), "key block not copied");

    /* prefix hit: the first full block of the prompt is reused */
    OK(pa_cache_add_sequence(m, 3, prompt, 6, &cached));
    CHECK(cached == 4, "prefix hit of %zu tokens", cached);

    /* rollback */
    OK(pa_cache_truncate(m, 2, 2));
    OK(pa_cache_sequence_info(m, 2, &len, &nblocks));
    CHECK(len == 2 && nblocks == 1, "len %zu blocks %zu", len, nblocks);

    /* batch block inputs */
    uint64_t ids[2] = {1, 2};
    int32_t bi[8], bib[3];
    size_t n = 0;
    OK(pa_cache_block_inputs(m, ids, 2, bi, 8, bib, &n));
    CHECK(n == 3 && bib[0] == 0 && bib[1] == 2 && bib[2] == 3, "block inputs n %zu", n);

    /* errors: unknown sequence, NULL handle, out of blocks (nothing changes) */
    pa_status st = pa_cache_free_sequence(m, 42);
    char msg[256];
    pa_last_error_message(msg, sizeof msg);
    CHECK(st == PA_STATUS_UNKNOWN_SEQUENCE && strstr(msg, "42") != NULL, "%d %s", st, msg);
    CHECK(pa_cache_fork(NULL, 1, 9) == PA_STATUS_NULL_POINTER, "NULL handle accepted");
    uint32_t many[64];
    memset(many, 0, sizeof many);
    st = pa_cache_append(m, 1, many, 64, NULL, copies, 8, NULL);
    CHECK(st == PA_STATUS_OUT_OF_BLOCKS, "got %s", pa_status_name(st));
    OK(pa_cache_sequence_info(m, 1, &len, NULL));
    CHECK(len == 6, "a failed append changed the length to %zu", len);

    /* eviction with rotation: seq 4 with 4 full blocks + 1, budget 3 keeps blocks 0, 3, 4 */
    OK(pa_cache_free_sequence(m, 2));
    OK(pa_cache_free_sequence(m, 3));
    OK(pa_cache_free_sequence(m, 1));
    uint32_t p4[17];
    for (int i = 0; i < 17; i++) p4[i] = 500 + (uint32_t)i;
    OK(pa_cache_add_sequence(m, 4, NULL, 0, NULL));
    OK(pa_cache_append(m, 4, p4, 17, NULL, copies, 8, NULL));
    float sc[17];
    for (int i = 0; i < 17; i++) sc[i] = (float)i; /* later blocks score higher */
    OK(pa_cache_accumulate_scores(m, 4, sc, 17));
    size_t evicted = 0, nrot = 0, rows = 0;
    OK(pa_cache_evict(m, 4, 1, 1, 3, copies, 8, &ncopies, &evicted));
    CHECK(evicted == 2 && ncopies == 0, "evicted %zu copies %zu", evicted, ncopies);
    OK(pa_cache_pending_rotation(m, &nrot, &rows));
    CHECK(nrot == 2 && rows == 9, "rotation of %zu blocks, %zu LUT rows", nrot, rows);
    int32_t rbi[2], rd[2 * 4];
    OK(pa_cache_take_rotation(m, rbi, 2, rd, 8, &nrot));
    CHECK(nrot == 2 && rd[0] == 8 && rd[7] == 8, "deltas %d %d", rd[0], rd[7]);
    float lut[9 * 8];
    OK(pa_cache_rotation_lut(9, 8, 10000.0, 1, lut, 9 * 8));
    CHECK(fabsf(lut[8 * 8 + 0] - cosf(8.0f)) < 1e-6f && fabsf(lut[8 * 8 + 4] + sinf(8.0f)) < 1e-6f,
          "LUT row 8 wrong");
    CHECK(pa_cache_rotation_lut(9, 7, 10000.0, 1, lut, 9 * 7) == PA_STATUS_INVALID_ARGUMENT,
          "odd head size accepted");
    pa_cache_manager_destroy(m);
    pa_cache_manager_destroy(NULL);
    return 0;
}

static pa_tensor tensor(int32_t elem, int32_t rank, const int64_t *dims, void *data) {
    pa_tensor t;
    memset(&t, 0, sizeof t);
    t.elem_type = elem;
    t.rank = rank;
    for (int i = 0; i < rank; i++) t.dims[i] = dims[i];
    t.data = data;
    return t;
}

/* Continuous batching feeding the op: 3 requests, chunked prefill, a fork of a decoding
 * request, decode to completion; the counters saw the fork and every step. */
static int scheduler_smoke(void) {
    enum { NB = 16, BS = 4, H = 2, HKV = 1, D = 8, MAXT = 8 };
    pa_scheduler_config cfg = {NB, BS, 1, MAXT, 4, 0, 0, 0};
    pa_scheduler *s = NULL;
    OK(pa_scheduler_create(&cfg, &s));
    uint32_t p[10] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
    OK(pa_scheduler_add_request(s, 100, p, 10, 5, 0));
    OK(pa_scheduler_add_request(s, 200, p, 6, 3, 1));
    OK(pa_scheduler_add_request(s, 300, p + 3, 5, 4, 0));

    static float kc[NB * HKV * BS * D], vc[NB * HKV * BS * D];
    float q[MAXT * H * D], k[MAXT * HKV * D], v[MAXT * HKV * D], out[MAXT * H * D];
    float scores[NB * BS + MAXT];
    size_t finished = 0, steps = 0, waiting = 1, running = 1;
    int forked = 0;
    while (waiting + running > 0) {
        CHECK(++steps < 100, "did not finish");
        pa_scheduler_step st;
        OK(pa_scheduler_schedule(s, &st));
        CHECK(st.num_tokens <= MAXT && st.num_rotated == 0, "step too large");
        OK(pa_cache_copy_blocks(kc, vc, NB, HKV * BS * D * sizeof(float), st.copies,
                                st.num_copies));
        size_t t = st.num_tokens, b = st.num_seqs;
        for (size_t i = 0; i < t * H * D; i++) q[i] = (float)((i * 7 + steps) % 11) / 11.0f;
        for (size_t i = 0; i < t * HKV * D; i++) {
            k[i] = (float)((st.token_ids[i / (HKV * D)] + i) % 5) / 5.0f;
            v[i] = (float)st.token_pos[i / (HKV * D)];
        }
        int64_t dq[2] = {(int64_t)t, H * D}, dk[2] = {(int64_t)t, HKV * D};
        int64_t dc[4] = {NB, HKV, BS, D}, db[1] = {(int64_t)b}, db1[1] = {(int64_t)b + 1};
        int64_t dn[1] = {(int64_t)st.num_block_indices}, ds[1] = {(int64_t)st.scores_len};
        pa_tensor in[9] = {
            tensor(PA_ELEM_F32, 2, dq, q),
            tensor(PA_ELEM_F32, 2, dk, k),
            tensor(PA_ELEM_F32, 2, dk, v),
            tensor(PA_ELEM_F32, 4, dc, kc),
            tensor(PA_ELEM_F32, 4, dc, vc),
            tensor(PA_ELEM_I32, 1, db, (void *)st.past_lens),
            tensor(PA_ELEM_I32, 1, db1, (void *)st.subsequence_begins),
            tensor(PA_ELEM_I32, 1, dn, (void *)st.block_indices),
            tensor(PA_ELEM_I32, 1, db1, (void *)st.block_indices_begins),
        };
        pa_tensor outs[2] = {tensor(PA_ELEM_F32, 2, dq, out),
                             tensor(PA_ELEM_F32, 1, ds, scores)};
        if (b > 0) {
            OK(pa_execute(in, 9, outs, 2));
            /* values are token positions: every output is a convex combination of 0..pos */
            for (size_t r = 0; r < t; r++)
                for (size_t x = 0; x < H * D; x++)
                    CHECK(out[r * H * D + x] >= -1e-5f &&
                              out[r * H * D + x] <= (float)st.token_pos[r] + 1e-4f,
                          "output row %zu out of range", r);
            OK(pa_scheduler_accumulate_scores(s, scores, st.scores_len));
        }
        uint64_t ids[4];
        uint32_t toks[4];
        size_t n = 0, fin = 0;
        for (size_t i = 0; i < b; i++)
            if (st.emits[i]) { ids[n] = st.seq_ids[i]; toks[n] = 1000 + (uint32_t)steps; n++; }
        OK(pa_scheduler_complete_step(s, ids, toks, n, &fin));
        finished += fin;
        if (!forked && fin == 0 && n > 0) {
            /* ids[0] just sampled a token, so it decodes next: fork a parallel sample of it */
            CHECK(pa_scheduler_fork(s, ids[0], 400, 77, 1) == PA_STATUS_INVALID_ARGUMENT,
                  "a fork with no tokens left to generate accepted");
            OK(pa_scheduler_fork(s, ids[0], 400, 77, 6));
            CHECK(pa_scheduler_fork(s, ids[0], 400, 77, 6) == PA_STATUS_INVALID_STATE,
                  "duplicate child accepted");
            forked = 1;
        }
        OK(pa_scheduler_counts(s, &waiting, &running));
    }
    CHECK(forked && finished == 4, "forked %d, finished %zu", forked, finished);
    pa_scheduler_counters c;
    OK(pa_scheduler_get_counters(s, &c));
    CHECK(c.forks == 1 && c.steps == steps && c.preemptions == 0 && c.evictions == 0,
          "counters: forks %llu, steps %llu", (unsigned long long)c.forks,
          (unsigned long long)c.steps);
    CHECK(pa_scheduler_get_counters(s, NULL) == PA_STATUS_NULL_POINTER, "NULL counters accepted");
    CHECK(pa_scheduler_fork(NULL, 1, 2, 0, 2) == PA_STATUS_NULL_POINTER, "NULL scheduler forked");
    pa_cache_stats cs;
    OK(pa_scheduler_stats(s, &cs));
    CHECK(cs.used_blocks == 0 && cs.free_blocks + cs.cached_blocks == NB, "blocks leaked");
    pa_scheduler_step st;
    CHECK(pa_scheduler_schedule(NULL, &st) == PA_STATUS_NULL_POINTER, "NULL scheduler accepted");
    pa_scheduler_destroy(s);
    return 0;
}

int main(void) {
    if (manager_smoke() != 0) return 1;
    if (scheduler_smoke() != 0) return 1;
    printf("ok\n");
    return 0;
}
