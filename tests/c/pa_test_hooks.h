/*
 * pa_test_hooks.h: test hooks of the paged_attention library, NOT part of its public API.
 *
 * The function below is exported only by a library built with the Cargo feature `test-hooks`
 * (scripts/test.sh builds one in target/test-hooks); the library users get (`cargo build
 * --release`, the wheel, the OpenVINO extension) does not have it, and a program calling it
 * would not link. tests/c/smoke.c uses it when compiled with -DPA_TEST_HOOKS; tests/header_abi.rs
 * checks the struct against its Rust twin (src/ffi/op.rs) in feature builds.
 */
#ifndef PA_TEST_HOOKS_H
#define PA_TEST_HOOKS_H

#include "paged_attention.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Work items run so far in this process, by kind of thread (to check where work went). */
typedef struct pa_item_counts {
    uint64_t pool;  /* by the library's own pool workers */
    uint64_t host;  /* inside tasks of a pa_runner */
    uint64_t other; /* by other threads (the calling thread, or the caller's rayon pool) */
} pa_item_counts;

/* Writes the counts into *out (not NULL). Thread-safe. */
pa_status pa_item_counts_get(pa_item_counts *out);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* PA_TEST_HOOKS_H */
