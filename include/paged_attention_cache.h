/*
 * paged_attention_cache.h: C ABI of the KV-cache block manager and scheduler that feed the
 * PagedAttention op (include/paged_attention.h). docs/cache.md has the design and an example.
 *
 * Hand-written and committed; the Rust side is src/ffi/cache.rs. Conventions are those of
 * paged_attention.h, which this header includes:
 *  - Functions return a pa_status; PA_STATUS_OK (0) is success. The cache-specific codes are
 *    PA_STATUS_OUT_OF_BLOCKS, PA_STATUS_UNKNOWN_SEQUENCE and PA_STATUS_INVALID_STATE; a pool
 *    or LUT too large for memory gives PA_STATUS_OUT_OF_MEMORY (nothing is created).
 *  - On failure the message is kept per thread: read it with pa_last_error_message(). A failed
 *    call changes neither the handle's state nor caller buffers.
 *  - No function panics or aborts across this boundary (PA_STATUS_PANIC instead).
 *  - Ownership: handles are created by *_create and freed by the matching *_destroy; the
 *    library keeps no pointer to caller memory after a call returns. Array arguments may be
 *    NULL only when their length is 0. "out" pointers documented as optional may be NULL.
 *  - Thread safety: a handle is not internally synchronized. Use one handle from one thread at
 *    a time (it may move between threads); different handles are independent.
 *  - Sequence and request ids are caller-chosen uint64_t values; token ids are uint32_t.
 *  - Block ids are indices into the caches' first dimension (key_cache / value_cache are
 *    [num_blocks, num_kv_heads, block_size, head_size]).
 */
#ifndef PAGED_ATTENTION_CACHE_H
#define PAGED_ATTENTION_CACHE_H

#include "paged_attention.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A block copy the caller performs on both caches before the next op call:
 * cache[dst, :, :, :] = cache[src, :, :, :] (see pa_cache_copy_blocks). */
typedef struct pa_block_copy {
    uint32_t src;
    uint32_t dst;
} pa_block_copy;

/* Usage statistics. */
typedef struct pa_cache_stats {
    size_t block_size;
    size_t total_blocks;
    size_t used_blocks;   /* referenced by at least one sequence */
    size_t free_blocks;   /* on the free list */
    size_t cached_blocks; /* unreferenced, kept for prefix reuse (also allocatable) */
    size_t shared_blocks; /* referenced by two or more sequences */
    size_t used_slots;    /* token slots of used blocks that hold a token */
    size_t fragmentation; /* token slots of used blocks that hold no token */
    size_t sequences;
} pa_cache_stats;

/* ---------------------------------------------------------------- block manager */

/* Opaque block manager: a pool of num_blocks blocks of block_size token slots, the sequences'
 * block tables, the prefix cache and pending key rotations. */
typedef struct pa_cache_manager pa_cache_manager;

/* Creates a manager. prefix_caching != 0 lets new sequences reuse computed full blocks of
 * equal prompt prefixes. num_blocks and block_size must be > 0.
 * out: not NULL; receives the handle, owned by the caller (free with pa_cache_manager_destroy). */
pa_status pa_cache_manager_create(size_t num_blocks, size_t block_size, int32_t prefix_caching,
                                  pa_cache_manager **out);

/* Frees the manager. NULL is a no-op. The handle must not be used afterwards. */
void pa_cache_manager_destroy(pa_cache_manager *m);

/* Creates an empty sequence `seq_id` (PA_STATUS_INVALID_STATE if it exists). With prefix
 * caching, leading full blocks of `prompt` (n tokens) that are cached and computed are reused:
 * out_cached (optional) receives how many prompt tokens are already in the cache (a multiple
 * of block_size, < n); append prompt[cached..n] next. prompt may be NULL when n is 0. */
pa_status pa_cache_add_sequence(pa_cache_manager *m, uint64_t seq_id, const uint32_t *prompt,
                                size_t n, size_t *out_cached);

/* Appends n tokens to the sequence, allocating blocks on demand.
 * out_past_len (optional): tokens cached before the append, the op's past_lens entry.
 * copies: caller buffer of copies_cap >= 1 entries; receives the copy-on-write copies
 *         (*out_num_copies of them, at most 1) to perform before the op call.
 * PA_STATUS_OUT_OF_BLOCKS (nothing changed) when the pool cannot supply the blocks. */
pa_status pa_cache_append(pa_cache_manager *m, uint64_t seq_id, const uint32_t *tokens, size_t n,
                          size_t *out_past_len, pa_block_copy *copies, size_t copies_cap,
                          size_t *out_num_copies);

/* Marks blocks filled since the last call as written by the op; call after each op call so
 * later prompts can reuse them from the prefix cache. */
pa_status pa_cache_mark_computed(pa_cache_manager *m);

/* Creates `child` sharing every block of `parent` (beam search); shared partially filled
 * blocks are copied on the next write (pa_cache_append returns the copy). */
pa_status pa_cache_fork(pa_cache_manager *m, uint64_t parent, uint64_t child);

/* Removes the sequence and drops its block references. */
pa_status pa_cache_free_sequence(pa_cache_manager *m, uint64_t seq_id);

/* Shortens the sequence to new_len tokens (<= its length), releasing blocks past the end
 * (speculative decoding: rejected draft tokens). */
pa_status pa_cache_truncate(pa_cache_manager *m, uint64_t seq_id, size_t new_len);

/* out_len, out_num_blocks (both optional): cached tokens and block-table length. */
pa_status pa_cache_sequence_info(pa_cache_manager *m, uint64_t seq_id, size_t *out_len,
                                 size_t *out_num_blocks);

/* The op's block_indices and block_indices_begins for a batch of num_seqs sequences, in order.
 * block_indices: caller buffer of cap entries (PA_STATUS_BUFFER_SIZE if too small; the sum of
 * the sequences' num_blocks is enough). block_indices_begins: num_seqs + 1 entries.
 * out_n (optional): entries written to block_indices. */
pa_status pa_cache_block_inputs(pa_cache_manager *m, const uint64_t *seq_ids, size_t num_seqs,
                                int32_t *block_indices, size_t cap, int32_t *block_indices_begins,
                                size_t *out_n);

/* out: not NULL; receives the statistics. */
pa_status pa_cache_get_stats(pa_cache_manager *m, pa_cache_stats *out);

/* Adds the op's scores output for this sequence (n = its length: past_lens + new tokens of
 * the call) to the per-block accumulators that eviction ranks by. */
pa_status pa_cache_accumulate_scores(pa_cache_manager *m, uint64_t seq_id, const float *scores,
                                     size_t n);

/* If the sequence holds more than `budget` blocks, evicts its lowest-scored blocks except the
 * first `start` and the last `recent` (recent >= 1, start + recent <= budget). Kept blocks
 * that move get a pending rotation (pa_cache_take_rotation).
 * copies: caller buffer of copies_cap >= budget entries when eviction happens; receives
 *         *out_num_copies copies (moved blocks shared with other sequences) to perform before
 *         the next op call. out_num_copies, out_evicted_blocks: optional. */
pa_status pa_cache_evict(pa_cache_manager *m, uint64_t seq_id, size_t start, size_t recent,
                         size_t budget, pa_block_copy *copies, size_t copies_cap,
                         size_t *out_num_copies, size_t *out_evicted_blocks);

/* out_num_rotated (optional): R, the blocks the next op call must rotate.
 * out_lut_rows (optional): rows the trig LUT needs (0 when R is 0). */
pa_status pa_cache_pending_rotation(pa_cache_manager *m, size_t *out_num_rotated,
                                    size_t *out_lut_rows);

/* Moves the pending rotations into the op's inputs 12 and 13 and clears them:
 * block_indices [R] (blocks_cap >= R), deltas [R, block_size] row-major (deltas_cap >=
 * R * block_size): LUT rows, i.e. positions to rotate back by. Pass them, with a LUT from
 * pa_cache_rotation_lut(..., backward = 1, ...), to the very next op call. */
pa_status pa_cache_take_rotation(pa_cache_manager *m, int32_t *block_indices, size_t blocks_cap,
                                 int32_t *deltas, size_t deltas_cap, size_t *out_num_rotated);

/* The op's rotation_trig_lut [rows, head_size] (f32) for RoPE base `base` (e.g. 10000):
 * row m = cos(m*f_i) for i < head_size/2, then s*sin(m*f_i), f_i = base^(-2i/head_size),
 * s = -1 when backward != 0 (row m rotates keys back by m positions, what eviction needs),
 * else +1. out: out_len == rows * head_size floats. head_size must be even. Thread-safe. */
pa_status pa_cache_rotation_lut(size_t rows, size_t head_size, double base, int32_t backward,
                                float *out, size_t out_len);

/* Performs block copies on both caches, any element type: each cache holds num_blocks blocks
 * of block_bytes bytes (num_kv_heads * block_size * head_size * element size). The two caches
 * must not overlap. copies: n entries. Thread-safe for distinct caches. */
pa_status pa_cache_copy_blocks(void *key_cache, void *value_cache, size_t num_blocks,
                               size_t block_bytes, const pa_block_copy *copies, size_t n);

/* As pa_cache_copy_blocks, for caches whose blocks differ in size: u8 caches (PA_ELEM_U8, see
 * paged_attention.h), e.g. key blocks of num_kv_heads * (block_size + 8) * head_size bytes (by
 * channel) and value blocks of num_kv_heads * block_size * (head_size + 8 * head_size / G) bytes.
 * A block's quantization parameters are inside it and are copied along. */
pa_status pa_cache_copy_blocks_kv(void *key_cache, void *value_cache, size_t num_blocks,
                                  size_t key_block_bytes, size_t value_block_bytes,
                                  const pa_block_copy *copies, size_t n);

/* ---------------------------------------------------------------- scheduler */

/* Opaque continuous-batching scheduler owning its own block manager. */
typedef struct pa_scheduler pa_scheduler;

typedef struct pa_scheduler_config {
    size_t num_blocks;
    size_t block_size;
    int32_t prefix_caching;    /* != 0: reuse cached prompt prefixes */
    size_t max_batched_tokens; /* token rows per op call */
    size_t max_seqs;           /* sequences per op call */
    size_t eviction_budget;    /* 0: no eviction; else blocks a sequence may hold */
    size_t eviction_start;     /* leading blocks kept by eviction */
    size_t eviction_recent;    /* most recent blocks kept by eviction (>= 1) */
} pa_scheduler_config;

/* One op call planned by pa_scheduler_schedule. Every pointer points into the scheduler and
 * stays valid until the next pa_scheduler_schedule or pa_scheduler_destroy; the caller does
 * not free them. Pointers of empty arrays may be NULL. */
typedef struct pa_scheduler_step {
    size_t num_seqs;                     /* B (0: nothing to run this step) */
    size_t num_tokens;                   /* T */
    size_t num_block_indices;            /* N */
    size_t scores_len;                   /* length of the op's scores output */
    const uint64_t *seq_ids;             /* [B] */
    const int32_t *past_lens;            /* [B]   op input 5 */
    const int32_t *subsequence_begins;   /* [B+1] op input 6 */
    const int32_t *block_indices;        /* [N]   op input 7 */
    const int32_t *block_indices_begins; /* [B+1] op input 8 */
    const uint8_t *emits;                /* [B] 1: sample a token from the sequence's last row */
    const uint32_t *token_ids;           /* [T] token id of each packed row */
    const int32_t *token_seq;            /* [T] batch index of each row */
    const int32_t *token_pos;            /* [T] position of each row in its cache: past_len + i
                                          * (after an eviction the kept tokens are renumbered
                                          * from 0, as the rotation of their keys does) */
    size_t num_copies;
    const pa_block_copy *copies;         /* perform before the op call, in order */
    size_t num_rotated;                  /* R (0: pass no rotation inputs) */
    const int32_t *rotated_block_indices; /* [R] op input 12 */
    const int32_t *rotation_deltas;      /* [R, block_size] op input 13 */
    size_t lut_rows;                     /* LUT rows needed (pa_cache_rotation_lut, backward) */
    size_t num_preempted;
    const uint64_t *preempted;           /* requests preempted this step (recomputed later) */
} pa_scheduler_step;

/* cfg: not NULL. out: not NULL; receives the handle (free with pa_scheduler_destroy). */
pa_status pa_scheduler_create(const pa_scheduler_config *cfg, pa_scheduler **out);

/* Frees the scheduler and its step arrays. NULL is a no-op. */
void pa_scheduler_destroy(pa_scheduler *s);

/* Queues a request: prompt of n >= 1 tokens (copied), max_new_tokens >= 1, priority (larger is
 * more important; the least important running request is preempted first). */
pa_status pa_scheduler_add_request(pa_scheduler *s, uint64_t id, const uint32_t *prompt, size_t n,
                                   size_t max_new_tokens, int32_t priority);

/* Plans the next op call into *out (not NULL). PA_STATUS_INVALID_STATE if the previous step
 * was not completed with pa_scheduler_complete_step. */
pa_status pa_scheduler_schedule(pa_scheduler *s, pa_scheduler_step *out);

/* Adds the op's scores output of the last step (n == scores_len) to the eviction scores. */
pa_status pa_scheduler_accumulate_scores(pa_scheduler *s, const float *scores, size_t n);

/* Completes the last step: one sampled token per sequence with emits[b] == 1, as parallel
 * arrays seq_ids[n], tokens[n]. out_finished (optional): requests that reached max_new_tokens
 * (their blocks are freed). */
pa_status pa_scheduler_complete_step(pa_scheduler *s, const uint64_t *seq_ids,
                                     const uint32_t *tokens, size_t n, size_t *out_finished);

/* out_waiting, out_running: optional. */
pa_status pa_scheduler_counts(pa_scheduler *s, size_t *out_waiting, size_t *out_running);

/* out: not NULL; statistics of the scheduler's block manager. */
pa_status pa_scheduler_stats(pa_scheduler *s, pa_cache_stats *out);

/* Forks the running request parent into a new request child (a parallel sample) between steps
 * (after pa_scheduler_complete_step, before the next schedule): the child shares the parent's
 * cached blocks (a write into a shared partial block is copied first: see the step's copies)
 * and continues from the parent's tokens with first_token in place of the parent's last
 * sampled token. The parent must be decoding (PA_STATUS_INVALID_STATE otherwise).
 * max_new_tokens counts all generated tokens, those inherited from the parent included, and
 * must exceed them. */
pa_status pa_scheduler_fork(pa_scheduler *s, uint64_t parent, uint64_t child, uint32_t first_token,
                            size_t max_new_tokens);

/* Events since pa_scheduler_create. */
typedef struct pa_scheduler_counters {
    uint64_t steps;             /* steps handed out by pa_scheduler_schedule */
    uint64_t preemptions;
    uint64_t forks;
    uint64_t prefix_hits;       /* admissions that reused cached blocks */
    uint64_t prefix_hit_tokens; /* tokens those admissions reused */
    uint64_t block_copies;      /* copies handed out (copy-on-write, eviction of shared blocks) */
    uint64_t evictions;         /* (sequence, step) pairs that lost blocks to eviction */
    uint64_t evicted_blocks;
    uint64_t rotated_blocks;    /* rotation entries handed out (keys re-rotated) */
} pa_scheduler_counters;

/* out: not NULL. */
pa_status pa_scheduler_get_counters(pa_scheduler *s, pa_scheduler_counters *out);

#ifdef __cplusplus
}
#endif

#endif /* PAGED_ATTENTION_CACHE_H */
