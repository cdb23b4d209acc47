//! Hostile input at the C ABI (issue 11): sizes that wrap, sizes that cannot be allocated, calls
//! that declare huge dimensions with no data, and the messages such calls get. Each test here
//! reproduced a crash, hang or wrong answer before its fix.
//!
//! Tests that could abort or hang the process without the fix run their body in a child
//! process (this test binary, re-run with a filter), optionally under `ulimit -v`, with a time
//! limit: a regression then fails one test instead of killing the whole run.

use paged_attention::cache::{EvictionPolicy, Request, Scheduler, SchedulerConfig};
use paged_attention::ffi::cache::{
    pa_cache_copy_blocks, pa_cache_copy_blocks_kv, pa_cache_manager_create,
    pa_cache_manager_destroy, pa_cache_rotation_lut, pa_scheduler_create, pa_scheduler_destroy,
    PaCacheManager, PaScheduler, PaSchedulerConfig,
};
use paged_attention::ffi::op::{pa_execute, pa_infer_shapes, pa_last_error_message, pa_validate};
use paged_attention::ffi::{PaPartialShape, PaTensor};
use std::ffi::{c_void, CStr};
use std::process::Command;
use std::time::{Duration, Instant};

const OK: i32 = 0;
const INVALID_ARGUMENT: i32 = 2;
const SHAPE: i32 = 6;
const BUFFER_SIZE: i32 = 8;
const NULL_POINTER: i32 = 1;
const OUT_OF_MEMORY: i32 = 14;
const F32: i32 = 0;
const I32: i32 = 3;

const CHILD_ENV: &str = "PA_HARDENING_CHILD";

fn last_error() -> String {
    let mut buf = vec![0u8; 1024];
    // SAFETY: `buf` holds 1024 writable bytes.
    unsafe { pa_last_error_message(buf.as_mut_ptr().cast(), buf.len()) };
    CStr::from_bytes_until_nul(&buf)
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

/// Runs `body` in a child process (this binary filtered to `name`), under `ulimit -v
/// limit_kb` when given, and fails if the child does not exit successfully within `timeout`.
/// In the child itself, runs `body` directly.
fn isolated(name: &str, limit_kb: Option<u64>, timeout: Duration, body: impl FnOnce()) {
    if std::env::var(CHILD_ENV).as_deref() == Ok(name) {
        body();
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let ulimit = limit_kb.map_or(String::new(), |kb| format!("ulimit -v {kb}; "));
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "{ulimit}exec \"$0\" --exact \"$1\" --test-threads=1 --nocapture"
        ))
        .arg(&exe)
        .arg(name)
        .env(CHILD_ENV, name)
        .spawn()
        .unwrap();
    let start = Instant::now();
    loop {
        if let Some(st) = child.try_wait().unwrap() {
            assert!(st.success(), "{name}: child process failed: {st}");
            return;
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{name}: child process still running after {timeout:?} (hang)");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn tensor(elem: i32, dims: &[i64], data: *mut c_void) -> PaTensor {
    let mut d = [0i64; 8];
    d[..dims.len()].copy_from_slice(dims);
    PaTensor {
        elem_type: elem,
        rank: dims.len() as i32,
        dims: d,
        data,
    }
}

fn shape(elem: i32, dims: &[i64]) -> PaPartialShape {
    let mut d = [0i64; 8];
    d[..dims.len()].copy_from_slice(dims);
    PaPartialShape {
        elem_type: elem,
        rank: dims.len() as i32,
        dims: d,
    }
}

// ------------------------------------------------------------------ rotation LUT (item 3)

fn lut(rows: usize, head_size: usize, out: &mut [f32]) -> i32 {
    let p = if out.is_empty() {
        std::ptr::null_mut()
    } else {
        out.as_mut_ptr()
    };
    // SAFETY: `p` holds `out.len()` writable floats (or is NULL with length 0).
    unsafe { pa_cache_rotation_lut(rows, head_size, 10000.0, 1, p, out.len()) }
}

#[test]
fn rotation_lut_with_a_huge_row_count_fails_instead_of_aborting() {
    isolated(
        "rotation_lut_with_a_huge_row_count_fails_instead_of_aborting",
        None,
        Duration::from_secs(30),
        || {
            let mut out = [0f32; 4];
            assert_eq!(lut(1 << 40, 4, &mut out), BUFFER_SIZE, "{}", last_error());
        },
    );
}

#[test]
fn rotation_lut_whose_size_wraps_to_zero_is_rejected() {
    // 2^62 * 4 wraps to 0 in 64 bits: an empty `out` must not be accepted as the right size.
    let st = lut(1 << 62, 4, &mut []);
    assert_ne!(st, OK, "rows * head_size wrapped and the call succeeded");
    assert!(last_error().contains("overflow"), "{}", last_error());
}

#[test]
fn rotation_lut_checks_the_buffer_before_computing() {
    let mut out = [0f32; 1];
    let t = Instant::now();
    assert_eq!(lut(1 << 26, 2, &mut out), BUFFER_SIZE);
    let dt = t.elapsed();
    assert!(
        dt < Duration::from_millis(100),
        "a wrong out_len took {dt:?} to reject"
    );
    // The real thing still works: row 1 of a forward LUT, head size 2, is [cos 1, sin 1].
    let mut out = [0f32; 4];
    // SAFETY: `out` holds 4 writable floats.
    let st = unsafe { pa_cache_rotation_lut(2, 2, 10000.0, 0, out.as_mut_ptr(), 4) };
    assert_eq!(st, OK, "{}", last_error());
    assert_eq!(out, [1.0, 0.0, 1f64.cos() as f32, 1f64.sin() as f32]);
}

// ------------------------------------------------------------------ allocation (item 4)

/// 4 GB of address space, as in the reproduction.
const ULIMIT_KB: u64 = 4_000_000;

#[test]
fn cache_manager_create_reports_allocation_failure() {
    isolated(
        "cache_manager_create_reports_allocation_failure",
        Some(ULIMIT_KB),
        Duration::from_secs(60),
        || {
            for nb in [(1usize << 32) - 2, (1usize << 31) - 1] {
                let mut m: *mut PaCacheManager = std::ptr::null_mut();
                // SAFETY: `m` is writable.
                let st = unsafe { pa_cache_manager_create(nb, 16, 1, &mut m) };
                assert_ne!(st, OK, "{nb} blocks");
                assert!(m.is_null());
                let msg = last_error();
                assert!(
                    st == OUT_OF_MEMORY || st == INVALID_ARGUMENT,
                    "{nb}: {st} {msg}"
                );
            }
            // 2^31 - 1 blocks is an addressable pool (block ids are i32), so only memory
            // stops it: the status says so.
            let mut m: *mut PaCacheManager = std::ptr::null_mut();
            // SAFETY: `m` is writable.
            let st = unsafe { pa_cache_manager_create((1 << 31) - 1, 16, 1, &mut m) };
            assert_eq!(st, OUT_OF_MEMORY, "{}", last_error());
            assert!(last_error().contains("memory"), "{}", last_error());
            // A normal pool still works under the limit.
            // SAFETY: `m` is writable.
            let st = unsafe { pa_cache_manager_create(1024, 16, 1, &mut m) };
            assert_eq!(st, OK, "{}", last_error());
            // SAFETY: `m` is a live handle, destroyed once.
            unsafe { pa_cache_manager_destroy(m) };
        },
    );
}

#[test]
fn scheduler_create_reports_allocation_failure() {
    isolated(
        "scheduler_create_reports_allocation_failure",
        Some(ULIMIT_KB),
        Duration::from_secs(60),
        || {
            let mut cfg = PaSchedulerConfig {
                num_blocks: (1 << 31) - 1,
                block_size: 16,
                prefix_caching: 1,
                max_batched_tokens: 256,
                max_seqs: 8,
                eviction_budget: 0,
                eviction_start: 0,
                eviction_recent: 0,
            };
            let mut s: *mut PaScheduler = std::ptr::null_mut();
            // SAFETY: `cfg` readable, `s` writable.
            let st = unsafe { pa_scheduler_create(&cfg, &mut s) };
            assert_eq!(st, OUT_OF_MEMORY, "{}", last_error());
            assert!(s.is_null());
            cfg.num_blocks = 64;
            // SAFETY: as above.
            let st = unsafe { pa_scheduler_create(&cfg, &mut s) };
            assert_eq!(st, OK, "{}", last_error());
            // SAFETY: live handle, destroyed once.
            unsafe { pa_scheduler_destroy(s) };
        },
    );
}

#[test]
fn cache_manager_rejects_more_blocks_than_block_indices_can_name() {
    isolated(
        "cache_manager_rejects_more_blocks_than_block_indices_can_name",
        Some(ULIMIT_KB),
        Duration::from_secs(60),
        || {
            let mut m: *mut PaCacheManager = std::ptr::null_mut();
            // SAFETY: `m` is writable.
            let st = unsafe { pa_cache_manager_create(1 << 31, 16, 1, &mut m) };
            assert_eq!(st, INVALID_ARGUMENT, "{}", last_error());
            assert!(last_error().contains("2147483647"), "{}", last_error());
        },
    );
}

// ------------------------------------------------------------------ empty calls (item 5)

/// The nine required inputs of a call with no tokens, no sequences and no blocks, whose
/// caches declare `hkv` KV heads of size `d` (all tensors empty, all pointers NULL).
fn empty_call(hkv: i64, d: i64) -> (Vec<PaTensor>, Vec<PaTensor>, [i32; 2]) {
    let null = std::ptr::null_mut();
    let ins = vec![
        tensor(F32, &[0, hkv * d], null),
        tensor(F32, &[0, hkv * d], null),
        tensor(F32, &[0, hkv * d], null),
        tensor(F32, &[0, hkv, 1, d], null),
        tensor(F32, &[0, hkv, 1, d], null),
        tensor(I32, &[0], null),
        tensor(I32, &[1], null), // pointer filled in by the caller
        tensor(I32, &[0], null),
        tensor(I32, &[1], null),
    ];
    let outs = vec![tensor(F32, &[0, hkv * d], null), tensor(F32, &[0], null)];
    (ins, outs, [0, 0])
}

#[test]
fn an_empty_call_declaring_huge_head_counts_returns_at_once() {
    isolated(
        "an_empty_call_declaring_huge_head_counts_returns_at_once",
        None,
        Duration::from_secs(20),
        || {
            let (mut ins, outs, mut zeros) = empty_call(1 << 62, 1);
            ins[6].data = zeros.as_mut_ptr().cast();
            ins[8].data = zeros[1..].as_mut_ptr().cast();
            let t = Instant::now();
            // SAFETY: every tensor is empty except the two begins, which point at one i32.
            let st = unsafe { pa_execute(ins.as_ptr(), ins.len(), outs.as_ptr(), outs.len()) };
            assert_eq!(st, OK, "{}", last_error());
            assert!(t.elapsed() < Duration::from_secs(1), "{:?}", t.elapsed());
        },
    );
}

// ------------------------------------------------------------------ shape products (item 6)

#[test]
fn key_width_that_only_matches_after_wrapping_is_rejected() {
    // (2^61 + 1) * 8 = 2^64 + 8 wraps to 8.
    let hkv = (1i64 << 61) + 1;
    let d = 8;
    // The query's width is unknown (or 0 below), so no head-count rule rejects the call first.
    let ins = [
        shape(F32, &[-1, -1]),
        shape(F32, &[-1, 8]),
        shape(F32, &[-1, 8]),
        shape(F32, &[-1, hkv, 16, d]),
        shape(F32, &[-1, hkv, 16, d]),
        shape(I32, &[-1]),
        shape(I32, &[-1]),
        shape(I32, &[-1]),
        shape(I32, &[-1]),
    ];
    let mut out = [shape(-1, &[]); 2];
    // SAFETY: 9 readable shapes, 2 writable.
    let st = unsafe { pa_infer_shapes(ins.as_ptr(), ins.len(), out.as_mut_ptr()) };
    assert_eq!(st, SHAPE, "{}", last_error());
    assert!(last_error().contains("overflow"), "{}", last_error());

    // The same through pa_validate, with empty (NULL) tensors.
    let null = std::ptr::null_mut();
    let mut zeros = [0i32; 2];
    let mut tins = vec![
        tensor(F32, &[0, 0], null),
        tensor(F32, &[0, 8], null),
        tensor(F32, &[0, 8], null),
        tensor(F32, &[0, hkv, 16, d], null),
        tensor(F32, &[0, hkv, 16, d], null),
        tensor(I32, &[0], null),
        tensor(I32, &[1], null),
        tensor(I32, &[0], null),
        tensor(I32, &[1], null),
    ];
    tins[6].data = zeros.as_mut_ptr().cast();
    tins[8].data = zeros[1..].as_mut_ptr().cast();
    let mut shapes = [shape(-1, &[]); 2];
    // SAFETY: empty tensors, begins point at one i32 each; two writable shapes.
    let st = unsafe { pa_validate(tins.as_ptr(), tins.len(), shapes.as_mut_ptr()) };
    assert_eq!(st, SHAPE, "{}", last_error());
    assert!(last_error().contains("overflow"), "{}", last_error());
}

// ------------------------------------------------------------------ messages (item 10)

#[test]
fn a_pointer_whose_end_wraps_is_reported_as_such() {
    let (mut ins, outs, mut zeros) = empty_call(1, 4);
    ins[6].data = zeros.as_mut_ptr().cast();
    ins[8].data = zeros[1..].as_mut_ptr().cast();
    let mut all = ins.clone();
    // A one-element `scale` at the last aligned address: its end wraps past the top.
    all.push(tensor(F32, &[], (usize::MAX - 3) as *mut c_void));
    let mut shapes = [shape(-1, &[]); 2];
    // SAFETY: the library must reject the bad pointer without dereferencing it.
    let st = unsafe { pa_validate(all.as_ptr(), all.len(), shapes.as_mut_ptr()) };
    assert_ne!(st, OK);
    let msg = last_error();
    assert!(msg.contains("scale"), "{msg}");
    assert!(
        !msg.contains("too large") && msg.contains("address space"),
        "misleading message: {msg}"
    );
    drop(outs);
}

#[test]
fn copy_blocks_with_null_caches_reports_null_pointers() {
    let copies = [paged_attention::cache::BlockCopy { src: 0, dst: 1 }];
    // SAFETY: NULL caches must be rejected before use.
    let st = unsafe {
        pa_cache_copy_blocks(
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            2,
            64,
            copies.as_ptr(),
            1,
        )
    };
    assert_eq!(st, NULL_POINTER, "{}", last_error());
    assert!(last_error().contains("key_cache"), "{}", last_error());
    assert!(!last_error().contains("same buffer"), "{}", last_error());
}

#[test]
fn copy_blocks_kv_copies_u8_blocks_of_two_sizes_and_refuses_overlap() {
    // u8 caches, Hkv 1, BS 4, D 8: by-channel key blocks (4 + 8) * 8 = 96 bytes, by-token value
    // blocks 4 * (8 + 8) = 64 bytes
    let (kb, vb) = (96usize, 64usize);
    let mut kc: Vec<u8> = (0..3 * kb).map(|x| x as u8).collect();
    let mut vc: Vec<u8> = (0..3 * vb).map(|x| (x * 3) as u8).collect();
    let (k0, v0) = (kc.clone(), vc.clone());
    let copies = [paged_attention::cache::BlockCopy { src: 1, dst: 2 }];
    let kp = kc.as_mut_ptr().cast::<c_void>();
    let vp = vc.as_mut_ptr().cast::<c_void>();
    // SAFETY: both buffers hold 3 blocks of their size; one copy entry.
    let st = unsafe { pa_cache_copy_blocks_kv(kp, vp, 3, kb, vb, copies.as_ptr(), 1) };
    assert_eq!(st, OK, "{}", last_error());
    assert_eq!(kc[2 * kb..], k0[kb..2 * kb]);
    assert_eq!(vc[2 * vb..], v0[vb..2 * vb]);
    assert_eq!(kc[..2 * kb], k0[..2 * kb]);
    assert_eq!(vc[..2 * vb], v0[..2 * vb]);
    // the value cache declared inside the key cache's bytes
    // SAFETY: the declared ranges lie inside `kc`; the call must refuse them before writing.
    let st = unsafe {
        pa_cache_copy_blocks_kv(
            kp,
            kp.cast::<u8>().add(kb).cast(),
            2,
            kb,
            vb,
            copies.as_ptr(),
            1,
        )
    };
    assert_ne!(st, OK);
    assert!(last_error().contains("overlap"), "{}", last_error());
}

// ------------------------------------------------------------------ aggregation window (item 11)

#[test]
fn a_one_element_aggregation_window_applies_to_every_sequence() {
    // Three decoding sequences of one token each, past 0, D = 2, one block each.
    let d = 2usize;
    let mut q = vec![1f32; 3 * d];
    let mut k = vec![1f32; 3 * d];
    let mut v = vec![1f32; 3 * d];
    let mut kc = vec![0f32; 3 * d];
    let mut vc = vec![0f32; 3 * d];
    let mut past = [0i32; 3];
    let mut begins = [0i32, 1, 2, 3];
    let mut bi = [0i32, 1, 2];
    let mut bib = [0i32, 1, 2, 3];
    let null = std::ptr::null_mut();
    let mut win = [1i32];
    let ins = [
        tensor(F32, &[3, 2], q.as_mut_ptr().cast()),
        tensor(F32, &[3, 2], k.as_mut_ptr().cast()),
        tensor(F32, &[3, 2], v.as_mut_ptr().cast()),
        tensor(F32, &[3, 1, 1, 2], kc.as_mut_ptr().cast()),
        tensor(F32, &[3, 1, 1, 2], vc.as_mut_ptr().cast()),
        tensor(I32, &[3], past.as_mut_ptr().cast()),
        tensor(I32, &[4], begins.as_mut_ptr().cast()),
        tensor(I32, &[3], bi.as_mut_ptr().cast()),
        tensor(I32, &[4], bib.as_mut_ptr().cast()),
        tensor(F32, &[0], null),
        tensor(I32, &[0], null),
        tensor(F32, &[0], null),
        tensor(I32, &[0], null),
        tensor(I32, &[0], null),
        tensor(F32, &[0], null),
        tensor(I32, &[1], win.as_mut_ptr().cast()),
    ];
    let mut shapes = [shape(-1, &[]); 2];
    // SAFETY: every tensor points at a live buffer of its declared size (or is empty).
    let st = unsafe { pa_validate(ins.as_ptr(), ins.len(), shapes.as_mut_ptr()) };
    assert_eq!(st, OK, "{}", last_error());
    // And the partial form (what OpenVINO's shape inference sees).
    let parts: Vec<PaPartialShape> = ins
        .iter()
        .map(|t| PaPartialShape {
            elem_type: t.elem_type,
            rank: t.rank,
            dims: t.dims,
        })
        .collect();
    let mut out = [shape(-1, &[]); 2];
    // SAFETY: 16 readable shapes, 2 writable.
    let st = unsafe { pa_infer_shapes(parts.as_ptr(), parts.len(), out.as_mut_ptr()) };
    assert_eq!(st, OK, "{}", last_error());
    let mut o = vec![0f32; 3 * d];
    let mut s = vec![0f32; 3];
    let outs = [
        tensor(F32, &[3, 2], o.as_mut_ptr().cast()),
        tensor(F32, &[3], s.as_mut_ptr().cast()),
    ];
    // SAFETY: as above; the outputs hold the validated shapes.
    let st = unsafe { pa_execute(ins.as_ptr(), ins.len(), outs.as_ptr(), outs.len()) };
    assert_eq!(st, OK, "{}", last_error());
    // Each sequence attends to its one key: weight 1, and its one score is 1.
    assert_eq!(s, [1.0, 1.0, 1.0]);
    assert_eq!(o, vec![1f32; 3 * d]);
}

// ------------------------------------------------------------------ eviction in prefill (item 12)

#[test]
fn the_scheduler_never_evicts_a_sequence_still_in_chunked_prefill() {
    // A 40-token prompt fed in chunks of 8 with a budget of 3 blocks of 4: while the prompt is
    // not complete, its block table only grows; eviction starts once it decodes.
    let mut s = Scheduler::new(SchedulerConfig {
        num_blocks: 32,
        block_size: 4,
        prefix_caching: false,
        max_batched_tokens: 8,
        max_seqs: 4,
        eviction: Some(EvictionPolicy {
            start: 1,
            recent: 1,
            budget: 3,
        }),
    })
    .unwrap();
    s.add_request(Request {
        id: 7,
        prompt: (0..40).collect(),
        max_new_tokens: 6,
        priority: 0,
    })
    .unwrap();
    let mut prefill_steps = 0;
    let mut evicted_after_prompt = 0;
    let mut prev_len = 0;
    while !s.is_idle() {
        let st = s.schedule().unwrap();
        let q = &st.seqs[0];
        if q.past_len + q.num_tokens <= 40 && !q.emits {
            prefill_steps += 1;
            assert_eq!(st.evicted_blocks, 0, "evicted during prefill: {st:?}");
            assert_eq!(q.past_len, prev_len, "prefill chunk lost tokens");
        } else {
            evicted_after_prompt += st.evicted_blocks;
        }
        prev_len = q.past_len + q.num_tokens;
        // Last-token scores only (what a prefill step yields): rising, so that the oldest
        // middle blocks are the cheapest to drop.
        let scores: Vec<f32> = (0..st.scores_len()).map(|i| i as f32).collect();
        s.accumulate_scores(&st, &scores).unwrap();
        let sampled: Vec<_> = st
            .seqs
            .iter()
            .filter(|q| q.emits)
            .map(|q| (q.id, 1))
            .collect();
        s.complete_step(&sampled).unwrap();
    }
    assert_eq!(
        prefill_steps, 4,
        "40 tokens in chunks of 8: 4 chunks before the last"
    );
    assert!(
        evicted_after_prompt > 0,
        "eviction must still run once decoding"
    );
}
