/*
 * paged_attention.h: C ABI of the PagedAttention op (OpenVINO `ie_internal_opset` semantics).
 *
 * The op's contract (16 inputs, 2 outputs, their order, shapes and meaning) is SPEC.md; the
 * README shows a complete example. This header is hand-written and committed; the Rust side
 * (src/ffi/) follows it, and tests compile it with -Wall -Wextra -Werror as C and C++.
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
 *    running at the same time do not write the same buffers (caches, outputs). Work inside one
 *    call is spread over a thread pool (RAYON_NUM_THREADS sets its size); results do not depend
 *    on the number of threads.
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
/* The op takes 9 to 16 inputs and produces 2 outputs. */
#define PA_MIN_INPUTS 9
#define PA_MAX_INPUTS 16
#define PA_NUM_OUTPUTS 2

/* Status codes (pa_status). Numbers are stable. */
typedef int32_t pa_status;
#define PA_STATUS_OK 0
#define PA_STATUS_NULL_POINTER 1     /* a required pointer was NULL */
#define PA_STATUS_INVALID_ARGUMENT 2 /* bad enum value, negative dim, overlapping buffers, ... */
#define PA_STATUS_INPUT_COUNT 3      /* fewer than 9 or more than 16 inputs */
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

/* A concrete tensor: dense, row-major, `dims[0..rank]` in memory order.
 * `data` must be aligned to the element size. It may be NULL only when the tensor has no
 * elements. An optional input given with zero elements means "not provided". */
typedef struct pa_tensor {
    int32_t elem_type;          /* PA_ELEM_F32, PA_ELEM_F16, PA_ELEM_BF16 or PA_ELEM_I32 */
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
 * inputs:  array of n_inputs (9..16) partial shapes in SPEC order; not NULL. An optional input
 *          not provided is passed with a static zero dimension (e.g. rank 1, dims {0}) or
 *          omitted at the end.
 * outputs: array of 2 written on success: output [T, H*D] and scores [sum(past_lens) + T]
 *          (dim -1 when unknown), element type of the query. Not NULL.
 * Reports contradictions already visible (e.g. key width not num_kv_heads * head_size). */
pa_status pa_infer_shapes(const pa_partial_shape *inputs, size_t n_inputs, pa_partial_shape *outputs);

/* Validates a concrete call (every rule of SPEC.md) without writing anything.
 * inputs:        array of n_inputs (9..16) tensors in SPEC order; not NULL.
 * output_shapes: if not NULL, an array of 2 that receives the exact output shapes the call
 *                needs (so the caller can size the output buffers). */
pa_status pa_validate(const pa_tensor *inputs, size_t n_inputs, pa_partial_shape *output_shapes);

/* Validates, then executes: rotates the listed cached keys, inserts the new keys/values into
 * key_cache / value_cache (inputs 3 and 4, written in place), computes attention into
 * outputs[0] ([T, H*D]) and the scores into outputs[1] ([sum(past_lens) + T]), both of the
 * query's element type and exactly that size.
 * inputs:  n_inputs (9..16) tensors in SPEC order; not NULL.
 * outputs: n_outputs (must be 2) tensors; not NULL. Output buffers must not overlap any input.
 * Buffers written (caches, outputs) must not overlap each other or the read-only inputs.
 * On any error nothing is written. */
pa_status pa_execute(const pa_tensor *inputs, size_t n_inputs, const pa_tensor *outputs, size_t n_outputs);

/* As pa_execute, with the plain scalar reference kernels (slow; for testing the fast paths). */
pa_status pa_execute_reference(const pa_tensor *inputs, size_t n_inputs, const pa_tensor *outputs, size_t n_outputs);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* PAGED_ATTENTION_H */
