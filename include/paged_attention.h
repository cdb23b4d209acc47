/*
 * paged_attention.h: C ABI of the PagedAttention op (OpenVINO `ie_internal_opset` semantics).
 *
 * The op's contract (17 inputs, 2 outputs, their order, shapes and meaning) is docs/contract.md
 * in the source repository ("SPEC.md" below); the inputs and outputs are listed below with their
 * PA_INPUT_* / PA_OUTPUT_* indices, and the README shows a complete example. This header is
 * hand-written and committed; the Rust side (src/ffi/) follows it, and tests compile it with
 * -Wall -Wextra -Werror as C and C++ and check its status codes, indices and struct layouts
 * against the Rust definitions (tests/header_abi.rs).
 *
 * Conventions for every function below:
 *  - Functions return a pa_status (int32_t). PA_STATUS_OK (0) is success; every other code is
 *    one of the PA_STATUS_* numbers, whose meaning never changes and which are never reused.
 *  - On failure a message naming the input and the value found is kept per thread; read it
 *    with pa_last_error_message(). A failed call writes nothing into caller buffers.
 *  - No function panics, aborts or throws across this boundary; an internal bug surfaces as
 *    PA_STATUS_PANIC with a message.
 *  - Ownership: the library never keeps, frees or reallocates caller memory. Pointers need to
 *    stay valid only for the duration of the call.
 *  - Thread safety: every function may be called from many threads at once, provided calls
 *    running at the same time do not write the same buffers (caches, outputs).
 *  - Threads inside one call: pa_execute spreads its work over the library's own pool;
 *    pa_execute_ex runs it on the caller's threads through a pa_runner (the OpenVINO extension
 *    passes OpenVINO's own parallel-for, so INFERENCE_NUM_THREADS, streams and CPU pinning
 *    apply). The library's pool has pa_set_num_threads() threads, else PA_NUM_THREADS (an
 *    environment variable read when the pool is built), else one per CPU the process may run
 *    on; its workers always run on the process's CPUs (the affinity of the thread that loaded
 *    the library), never on the narrowed set of a pinned thread that made the first call.
 *    A caller already running on a rayon pool (Rust) keeps the work on that pool.
 *    Results are bit-identical for every thread count and runner.
 */
#ifndef PAGED_ATTENTION_H
#define PAGED_ATTENTION_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PA_VERSION_MAJOR 0
#define PA_VERSION_MINOR 1
#define PA_VERSION_PATCH 0

/* Largest rank a pa_tensor / pa_partial_shape can describe. */
#define PA_MAX_RANK 8
/* The op takes 9 to 17 inputs and produces 2 outputs. */
#define PA_MIN_INPUTS 9
#define PA_MAX_INPUTS 17
#define PA_NUM_OUTPUTS 2

/* Inputs, in the order every function below takes them ("SPEC order"), and outputs.
 * T = tokens in the call, B = sequences, H / Hkv = query / KV heads, D = head size, BS = block
 * size, NB = blocks; "float" is f32, f16 or bf16 (the caches also u8, see PA_ELEM_U8).
 * Inputs 9..16 are optional: omitted at the end of the list or given with zero elements. */
#define PA_INPUT_QUERY 0                     /* [T, H*D] float */
#define PA_INPUT_KEY 1                       /* [T, Hkv*D] float, the new tokens' keys */
#define PA_INPUT_VALUE 2                     /* [T, Hkv*Dv] float (Dv: value head size, often D) */
#define PA_INPUT_KEY_CACHE 3                 /* [NB, Hkv, BS, D], written in place */
#define PA_INPUT_VALUE_CACHE 4               /* [NB, Hkv, BS, Dv], written in place */
#define PA_INPUT_PAST_LENS 5                 /* [B] i32: tokens already cached per sequence */
#define PA_INPUT_SUBSEQUENCE_BEGINS 6        /* [B+1] i32: each sequence's first row in query */
#define PA_INPUT_BLOCK_INDICES 7             /* [N] i32: physical blocks of all sequences */
#define PA_INPUT_BLOCK_INDICES_BEGINS 8      /* [B+1] i32: each sequence's first block_indices entry */
#define PA_INPUT_SCALE 9                     /* scalar float (optional; absent or 0: 1/sqrt(D)) */
#define PA_INPUT_SLIDING_WINDOW 10           /* scalar i32 (optional) */
#define PA_INPUT_ALIBI_SLOPES 11             /* [H] float (optional) */
#define PA_INPUT_ROTATED_BLOCK_INDICES 12    /* [R] i32 (optional): blocks whose keys are re-rotated */
#define PA_INPUT_ROTATION_DELTAS 13          /* [R, BS], [R, 1] or [R] i32 (optional): LUT rows */
#define PA_INPUT_ROTATION_TRIG_LUT 14        /* [M, D] f32 or f16 (optional): D/2 cos, D/2 sin a row */
#define PA_INPUT_SCORE_AGGREGATION_WINDOW 15 /* scalar or [B] i32 (optional) */
#define PA_INPUT_SINKS 16                    /* [H] or [1, H, 1, 1] float (optional): a logit per head */
#define PA_OUTPUT_OUTPUT 0                   /* [T, H*Dv], query's type */
#define PA_OUTPUT_SCORES 1                   /* [sum(past_lens) + T], query's type */

/* Status codes (pa_status). Numbers are stable. */
typedef int32_t pa_status;
#define PA_STATUS_OK 0
#define PA_STATUS_NULL_POINTER 1     /* a required pointer was NULL */
#define PA_STATUS_INVALID_ARGUMENT 2 /* bad enum value, negative dim, overlapping buffers, ... */
#define PA_STATUS_INPUT_COUNT 3      /* fewer than 9 or more than 17 inputs */
#define PA_STATUS_RANK 4             /* an input's rank does not match the contract */
#define PA_STATUS_ELEMENT_TYPE 5     /* an input's element type does not match the contract */
#define PA_STATUS_SHAPE 6            /* dimensions contradict each other */
#define PA_STATUS_VALUE 7            /* an index, offset or length is out of range */
#define PA_STATUS_BUFFER_SIZE 8      /* a buffer's size does not match what is required */
#define PA_STATUS_ALIGNMENT 9        /* a data pointer is not aligned to its element size */
#define PA_STATUS_PANIC 10           /* internal error, caught at the boundary */
#define PA_STATUS_OUT_OF_BLOCKS 11   /* cache manager: no free block left */
#define PA_STATUS_UNKNOWN_SEQUENCE 12 /* cache manager: no such sequence */
#define PA_STATUS_INVALID_STATE 13   /* cache manager: operation not valid now */
#define PA_STATUS_OUT_OF_MEMORY 14   /* a buffer the call needs could not be allocated */

/* Element types (the elem_type field). Numbers are stable. */
#define PA_ELEM_DYNAMIC (-1) /* only in pa_partial_shape: type not known yet */
#define PA_ELEM_F32 0
#define PA_ELEM_F16 1  /* IEEE 754 binary16 */
#define PA_ELEM_BF16 2 /* bfloat16 (upper half of an f32) */
#define PA_ELEM_I32 3
/* Quantized cache bytes: key_cache / value_cache only (both u8), in OpenVINO's CPU-plugin layout
 * (docs/contract.md, "u8 caches"). value_cache is [NB, Hkv, BS, D + 8*D/G] (per token and group
 * of G channels: f32 scale, f32 zero point, G bytes); key_cache is [NB, Hkv, BS + 8, D] (keys by
 * channel: per block and head, D f32 scales, D f32 zero points, then BS rows of D bytes) or, with
 * BS rows, [NB, Hkv, BS, D + 8*D/Gk] (keys by token, like values). D is key.dims[1] / Hkv; the
 * key cache's row count says the key mode; each cache's last dim says its group size. New tokens
 * are quantized on insertion (a by-channel block that grows is re-quantized as a whole, as
 * OpenVINO does); attention reads the caches dequantized ((q - zp) * scale). Rotation of a u8
 * key cache dequantizes each rotated block's keys, rotates them and quantizes them again. */
#define PA_ELEM_U8 4
/* Quantized cache nibbles: key_cache / value_cache only (both u4), in OpenVINO's CPU-plugin u4
 * layout (docs/contract.md, "u4 caches"): PA_ELEM_U8's layout with every quantized value a
 * nibble, two per byte (element 2i in the high nibble of byte i), and the f32 scale and zero
 * point still 8 bytes, which are 16 u4 elements: value_cache [NB, Hkv, BS, D + 16*D/G], key_cache
 * [NB, Hkv, BS + 16, D] (by channel) or [NB, Hkv, BS, D + 16*D/Gk] (by token). dims count
 * elements; `data` holds ceil(elements / 2) bytes. D and the group sizes must be even. */
#define PA_ELEM_U4 5

/* A concrete tensor: dense, row-major, `dims[0..rank]` in memory order.
 * `data` must be aligned to the element size (u8 and u4 caches: any address). It may be NULL only when the tensor has no
 * elements. An optional input given with zero elements means "not provided". */
typedef struct pa_tensor {
    int32_t elem_type;          /* PA_ELEM_F32, PA_ELEM_F16, PA_ELEM_BF16, PA_ELEM_I32, PA_ELEM_U8 or PA_ELEM_U4 */
    int32_t rank;               /* 0 (scalar) .. PA_MAX_RANK */
    int64_t dims[PA_MAX_RANK];  /* dims[0..rank], each >= 0; the rest is ignored */
    void *data;                 /* read for inputs; written for caches (inputs 3, 4) and outputs */
} pa_tensor;

/* A partial shape for shape inference: rank -1 means dynamic rank; a dim of -1 is dynamic;
 * elem_type may be PA_ELEM_DYNAMIC. */
typedef struct pa_partial_shape {
    int32_t elem_type;
    int32_t rank;
    int64_t dims[PA_MAX_RANK];
} pa_partial_shape;

/* Version as (major << 16) | (minor << 8) | patch. Thread-safe, never fails. */
uint32_t pa_version(void);

/* Version as a static NUL-terminated string ("0.1.0"); never NULL, never freed by the caller. */
const char *pa_version_string(void);

/* Static name of a status code ("PA_STATUS_VALUE"); "PA_STATUS_UNKNOWN" for other numbers.
 * Never NULL; the caller does not free it. */
const char *pa_status_name(pa_status status);

/* Copies the calling thread's last error message, NUL-terminated and truncated to fit, into
 * `buf` (`len` bytes). Returns the message's full length without the NUL (0 when the last call
 * on this thread succeeded), so a caller can size a buffer by calling with buf = NULL, len = 0.
 * `buf` may be NULL only when len is 0. Thread-safe: each thread has its own message. */
size_t pa_last_error_message(char *buf, size_t len);

/* Shape inference on partial shapes.
 * inputs:  array of n_inputs (9..17) partial shapes in SPEC order; not NULL. An optional input
 *          not provided is passed with a static zero dimension (e.g. rank 1, dims {0}) or
 *          omitted at the end.
 * outputs: array of 2 written on success: output [T, H*D] and scores [sum(past_lens) + T]
 *          (dim -1 when unknown), element type of the query. Not NULL.
 * Reports contradictions already visible (e.g. key width not num_kv_heads * head_size). */
pa_status pa_infer_shapes(const pa_partial_shape *inputs, size_t n_inputs, pa_partial_shape *outputs);

/* Validates a concrete call (every rule of SPEC.md) without writing anything.
 * inputs:        array of n_inputs (9..17) tensors in SPEC order; not NULL.
 * output_shapes: if not NULL, an array of 2 that receives the exact output shapes the call
 *                needs (so the caller can size the output buffers). */
pa_status pa_validate(const pa_tensor *inputs, size_t n_inputs, pa_partial_shape *output_shapes);

/* Validates, then executes: rotates the listed cached keys, inserts the new keys/values into
 * key_cache / value_cache (inputs 3 and 4, written in place), computes attention into
 * outputs[0] ([T, H*D]) and the scores into outputs[1] ([sum(past_lens) + T]), both of the
 * query's element type and exactly that size.
 * inputs:  n_inputs (9..17) tensors in SPEC order; not NULL.
 * outputs: n_outputs (must be 2) tensors; not NULL. Output buffers must not overlap any input.
 * Buffers written (caches, outputs) must not overlap each other or the read-only inputs.
 * On any error nothing is written. */
pa_status pa_execute(const pa_tensor *inputs, size_t n_inputs, const pa_tensor *outputs, size_t n_outputs);

/* A host's parallel-for (the pattern of oneDNN's threadpool interop and XNNPACK's pthreadpool).
 * parallel_for(ctx, n, task, task_ctx) must call task(task_ctx, i) exactly once for every
 * i in [0, n), on any of its threads, in any order, concurrently or not, and return only after
 * all those calls have returned. The library calls it from the thread that called
 * pa_execute_ex, with n <= max_threads. With max_threads > 1 it is called once per call, with
 * n = max_threads: the first task to start runs the call and the others help with each of its
 * parallel regions (a helper waiting more than 2 ms for the next region returns early); with
 * max_threads = 1, once per parallel region. Tasks claim work items until none is left, so a
 * runner that runs tasks one after another is slow but correct.
 * `task` never throws or unwinds. parallel_for must not be NULL; max_threads >= 1. */
typedef void (*pa_task_fn)(void *task_ctx, size_t i);
typedef void (*pa_parallel_for_fn)(void *ctx, size_t n, pa_task_fn task, void *task_ctx);
typedef struct pa_runner {
    pa_parallel_for_fn parallel_for;
    void *ctx;          /* passed to parallel_for as is */
    size_t max_threads; /* threads parallel_for can run at once */
} pa_runner;

/* The inference precision of a call: the deployment's choice (OpenVINO's
 * INFERENCE_PRECISION_HINT; docs/contract.md, "Precision").
 * PA_PRECISION_F32:  an f32 or f16 query is f32 math (2e-6 of a float64 reference).
 * PA_PRECISION_BF16: as OpenVINO's own op under a bf16 hint: prefill products (QK, PV) take the
 *                    query, keys, values and softmax weights rounded to bf16 and sum in f32;
 *                    softmax in f32; decode stays f32. Within 1e-2 of float64 attention of the
 *                    rounded operands. On a CPU without AVX512-BF16 or AMX the call computes
 *                    in f32 and says so once on stderr.
 * A bf16 query is bf16 math in both. PA_BF16_QUERY=1 (=0) in the environment overrides the
 * argument with bf16 (f32), read once per process; pa_execute computes in f32 unless it does. */
typedef int32_t pa_precision;
#define PA_PRECISION_F32 0
#define PA_PRECISION_BF16 1

/* As pa_execute, with the work on `runner`'s threads (NULL: the library's own pool) and in
 * `precision` (any other value: PA_STATUS_INVALID_ARGUMENT, nothing written). The runner needs
 * to stay valid only for the duration of the call. */
pa_status pa_execute_ex(const pa_tensor *inputs, size_t n_inputs, const pa_tensor *outputs, size_t n_outputs,
                        const pa_runner *runner, pa_precision precision);

/* Sets the number of threads of the library's own pool (0: PA_NUM_THREADS, else one per CPU of
 * the process). Takes effect at the next call; calls running keep their pool. n <= 4096
 * (PA_STATUS_INVALID_ARGUMENT otherwise). Thread-safe. */
pa_status pa_set_num_threads(size_t n);

/* The number of threads the library's pool has (or will have when first used). Never fails. */
size_t pa_get_num_threads(void);

/* As pa_execute, with the plain scalar reference kernels (slow; for testing the fast paths). */
pa_status pa_execute_reference(const pa_tensor *inputs, size_t n_inputs, const pa_tensor *outputs, size_t n_outputs);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* PAGED_ATTENTION_H */
