//! `extern "C"` functions of `include/paged_attention_cache.h`: the block manager and the
//! scheduler behind opaque handles. Each function checks its pointers, calls safe Rust in
//! `crate::cache`, and maps the error through [`super::boundary`] (panics caught, message kept
//! for `pa_last_error_message`). A failed call leaves the handle and caller buffers unchanged.

use super::boundary;
use crate::cache::{
    copy_blocks_kv, fill_rotation_lut, rotation_lut_len, BlockCopy, BlockManager, CacheStats,
    EvictionPolicy, ManagerConfig, Request, RotationDirection, Scheduler, SchedulerConfig,
    SchedulerCounters, Step,
};
use crate::error::PaError;

/// Opaque `pa_cache_manager`.
pub struct PaCacheManager(BlockManager);

/// Opaque `pa_scheduler`: the scheduler and the arrays of its last step (which the
/// `pa_scheduler_step` view points into).
pub struct PaScheduler {
    sched: Scheduler,
    step: Step,
    ids: Vec<u64>,
    emits: Vec<u8>,
}

/// C `pa_cache_stats`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PaCacheStats {
    pub block_size: usize,
    pub total_blocks: usize,
    pub used_blocks: usize,
    pub free_blocks: usize,
    pub cached_blocks: usize,
    pub shared_blocks: usize,
    pub used_slots: usize,
    pub fragmentation: usize,
    pub sequences: usize,
}

impl From<CacheStats> for PaCacheStats {
    fn from(s: CacheStats) -> Self {
        PaCacheStats {
            block_size: s.block_size,
            total_blocks: s.total_blocks,
            used_blocks: s.used_blocks,
            free_blocks: s.free_blocks,
            cached_blocks: s.cached_blocks,
            shared_blocks: s.shared_blocks,
            used_slots: s.used_slots,
            fragmentation: s.fragmentation,
            sequences: s.sequences,
        }
    }
}

/// C `pa_scheduler_counters`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PaSchedulerCounters {
    pub steps: u64,
    pub preemptions: u64,
    pub forks: u64,
    pub prefix_hits: u64,
    pub prefix_hit_tokens: u64,
    pub block_copies: u64,
    pub evictions: u64,
    pub evicted_blocks: u64,
    pub rotated_blocks: u64,
}

impl From<SchedulerCounters> for PaSchedulerCounters {
    fn from(c: SchedulerCounters) -> Self {
        PaSchedulerCounters {
            steps: c.steps,
            preemptions: c.preemptions,
            forks: c.forks,
            prefix_hits: c.prefix_hits,
            prefix_hit_tokens: c.prefix_hit_tokens,
            block_copies: c.block_copies,
            evictions: c.evictions,
            evicted_blocks: c.evicted_blocks,
            rotated_blocks: c.rotated_blocks,
        }
    }
}

/// C `pa_scheduler_config`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PaSchedulerConfig {
    pub num_blocks: usize,
    pub block_size: usize,
    pub prefix_caching: i32,
    pub max_batched_tokens: usize,
    pub max_seqs: usize,
    /// 0 disables eviction.
    pub eviction_budget: usize,
    pub eviction_start: usize,
    pub eviction_recent: usize,
}

/// C `pa_scheduler_step`: a view of the scheduler's last step.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PaSchedulerStep {
    pub num_seqs: usize,
    pub num_tokens: usize,
    pub num_block_indices: usize,
    pub scores_len: usize,
    pub seq_ids: *const u64,
    pub past_lens: *const i32,
    pub subsequence_begins: *const i32,
    pub block_indices: *const i32,
    pub block_indices_begins: *const i32,
    pub emits: *const u8,
    pub token_ids: *const u32,
    pub token_seq: *const i32,
    pub token_pos: *const i32,
    pub num_copies: usize,
    pub copies: *const BlockCopy,
    pub num_rotated: usize,
    pub rotated_block_indices: *const i32,
    pub rotation_deltas: *const i32,
    pub lut_rows: usize,
    pub num_preempted: usize,
    pub preempted: *const u64,
}

fn null(what: &str) -> PaError {
    PaError::NullPointer { what: what.into() }
}

/// A read-only C array; NULL is allowed when `n == 0`.
///
/// # Safety
/// For `n > 0` and non-NULL `p`: `p` points to `n` valid `T` that stay unchanged for `'a`.
unsafe fn input<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T], PaError> {
    if n == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(null(what));
    }
    if !(p as usize).is_multiple_of(std::mem::align_of::<T>()) {
        return Err(PaError::Alignment {
            name: what.into(),
            align: std::mem::align_of::<T>(),
        });
    }
    // SAFETY: non-NULL and aligned (checked); length and validity are the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// A writable C array; NULL is allowed when `n == 0`.
///
/// # Safety
/// For `n > 0` and non-NULL `p`: `p` points to `n` writable `T`, not aliased during `'a`.
unsafe fn output<'a, T>(p: *mut T, n: usize, what: &str) -> Result<&'a mut [T], PaError> {
    if n == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return Err(null(what));
    }
    if !(p as usize).is_multiple_of(std::mem::align_of::<T>()) {
        return Err(PaError::Alignment {
            name: what.into(),
            align: std::mem::align_of::<T>(),
        });
    }
    // SAFETY: non-NULL and aligned (checked); the caller gives n writable, unaliased T.
    Ok(unsafe { std::slice::from_raw_parts_mut(p, n) })
}

/// Writes `v` through `p` when `p` is not NULL.
///
/// # Safety
/// `p` is NULL or points to a writable, aligned `T`.
unsafe fn put<T>(p: *mut T, v: T) {
    if !p.is_null() {
        // SAFETY: the caller's contract: non-NULL `p` is writable and aligned.
        unsafe { p.write(v) };
    }
}

/// The handle behind `p`.
///
/// # Safety
/// `p` is NULL or a live handle from the matching `*_create`, used by one thread at a time.
unsafe fn handle<'a, T>(p: *mut T, what: &str) -> Result<&'a mut T, PaError> {
    // SAFETY: the caller's contract (a live, exclusively used handle or NULL).
    unsafe { p.as_mut() }.ok_or_else(|| null(what))
}

fn buffer_size(name: &str, expected: usize, found: usize) -> PaError {
    PaError::BufferSize {
        name: name.into(),
        expected,
        found,
    }
}

// ---------------------------------------------------------------- block manager

/// # Safety
/// `out` must be NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn pa_cache_manager_create(
    num_blocks: usize,
    block_size: usize,
    prefix_caching: i32,
    out: *mut *mut PaCacheManager,
) -> i32 {
    boundary(|| {
        if out.is_null() {
            return Err(null("out"));
        }
        let m = BlockManager::new(ManagerConfig {
            num_blocks,
            block_size,
            prefix_caching: prefix_caching != 0,
        })?;
        // SAFETY: `out` is non-NULL (checked) and writable per the header.
        unsafe { out.write(Box::into_raw(Box::new(PaCacheManager(m)))) };
        Ok(())
    })
}

/// # Safety
/// `m` is NULL or a handle from `pa_cache_manager_create` not destroyed yet.
#[no_mangle]
pub unsafe extern "C" fn pa_cache_manager_destroy(m: *mut PaCacheManager) {
    // SAFETY: the caller passes NULL or a live handle from pa_cache_manager_create, once.
    unsafe { destroy_handle(m) }
}

/// # Safety
/// Header contract: `m` live handle; `prompt` holds `n` tokens (NULL when n = 0);
/// `out_cached` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn pa_cache_add_sequence(
    m: *mut PaCacheManager,
    seq_id: u64,
    prompt: *const u32,
    n: usize,
    out_cached: *mut usize,
) -> i32 {
    boundary(|| {
        // SAFETY: header contract for `m` and `prompt`.
        let (m, prompt) = unsafe { (handle(m, "manager")?, input(prompt, n, "prompt")?) };
        let cached = m.0.add_sequence(seq_id, prompt)?;
        // SAFETY: header contract for `out_cached`.
        unsafe { put(out_cached, cached) };
        Ok(())
    })
}

/// # Safety
/// Header contract: `m` live; `tokens` holds `n` tokens (NULL when n = 0); `copies` holds
/// `copies_cap` entries; out pointers NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn pa_cache_append(
    m: *mut PaCacheManager,
    seq_id: u64,
    tokens: *const u32,
    n: usize,
    out_past_len: *mut usize,
    copies: *mut BlockCopy,
    copies_cap: usize,
    out_num_copies: *mut usize,
) -> i32 {
    boundary(|| {
        // SAFETY: header contract for `m`, `tokens` and `copies`.
        let (m, tokens, copies) = unsafe {
            (
                handle(m, "manager")?,
                input(tokens, n, "tokens")?,
                output(copies, copies_cap, "copies")?,
            )
        };
        if copies.is_empty() {
            return Err(buffer_size("copies", 1, 0));
        }
        let a = m.0.append(seq_id, tokens)?;
        copies[..a.copies.len()].copy_from_slice(&a.copies);
        // SAFETY: header contract for the out pointers.
        unsafe {
            put(out_past_len, a.past_len);
            put(out_num_copies, a.copies.len());
        }
        Ok(())
    })
}

/// # Safety
/// `m` live handle.
#[no_mangle]
pub unsafe extern "C" fn pa_cache_fork(m: *mut PaCacheManager, parent: u64, child: u64) -> i32 {
    // SAFETY: header contract for `m`.
    boundary(|| unsafe { handle(m, "manager") }?.0.fork(parent, child))
}

/// # Safety
/// `m` live handle.
#[no_mangle]
pub unsafe extern "C" fn pa_cache_free_sequence(m: *mut PaCacheManager, seq_id: u64) -> i32 {
    // SAFETY: header contract for `m`.
    boundary(|| unsafe { handle(m, "manager") }?.0.free(seq_id))
}

/// # Safety
/// `m` live handle.
#[no_mangle]
pub unsafe extern "C" fn pa_cache_truncate(
    m: *mut PaCacheManager,
    seq_id: u64,
    new_len: usize,
) -> i32 {
    // SAFETY: header contract for `m`.
    boundary(|| unsafe { handle(m, "manager") }?.0.truncate(seq_id, new_len))
}

/// # Safety
/// `m` live handle.
#[no_mangle]
pub unsafe extern "C" fn pa_cache_mark_computed(m: *mut PaCacheManager) -> i32 {
    boundary(|| {
        // SAFETY: header contract for `m`.
        unsafe { handle(m, "manager") }?.0.mark_computed();
        Ok(())
    })
}

/// # Safety
/// `m` live handle; out pointers NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn pa_cache_sequence_info(
    m: *mut PaCacheManager,
    seq_id: u64,
    out_len: *mut usize,
    out_num_blocks: *mut usize,
) -> i32 {
    boundary(|| {
        // SAFETY: header contract for `m`.
        let m = unsafe { handle(m, "manager") }?;
        let (len, nb) = (m.0.len(seq_id)?, m.0.block_table(seq_id)?.len());
        // SAFETY: header contract for the out pointers.
        unsafe {
            put(out_len, len);
            put(out_num_blocks, nb);
        }
        Ok(())
    })
}

/// # Safety
/// `m` live; `seq_ids` holds `num_seqs` ids; `block_indices` holds `cap` entries;
/// `block_indices_begins` holds `num_seqs + 1`; `out_n` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn pa_cache_block_inputs(
    m: *mut PaCacheManager,
    seq_ids: *const u64,
    num_seqs: usize,
    block_indices: *mut i32,
    cap: usize,
    block_indices_begins: *mut i32,
    out_n: *mut usize,
) -> i32 {
    boundary(|| {
        // SAFETY: header contract for `m` and `seq_ids`.
        let (m, ids) = unsafe { (handle(m, "manager")?, input(seq_ids, num_seqs, "seq_ids")?) };
        let (bi, bib) = m.0.block_inputs(ids)?;
        if bi.len() > cap {
            return Err(buffer_size("block_indices", bi.len(), cap));
        }
        // SAFETY: header contract for the output arrays.
        let (dst, dstb) = unsafe {
            (
                output(block_indices, bi.len(), "block_indices")?,
                output(block_indices_begins, bib.len(), "block_indices_begins")?,
            )
        };
        dst.copy_from_slice(&bi);
        dstb.copy_from_slice(&bib);
        // SAFETY: header contract for `out_n`.
        unsafe { put(out_n, bi.len()) };
        Ok(())
    })
}

/// # Safety
/// `m` live; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn pa_cache_get_stats(m: *mut PaCacheManager, out: *mut PaCacheStats) -> i32 {
    boundary(|| {
        // SAFETY: header contract for `m`.
        let m = unsafe { handle(m, "manager") }?;
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: non-NULL (checked), writable per the header.
        unsafe { out.write(m.0.stats().into()) };
        Ok(())
    })
}

/// # Safety
/// `m` live; `scores` holds `n` floats.
#[no_mangle]
pub unsafe extern "C" fn pa_cache_accumulate_scores(
    m: *mut PaCacheManager,
    seq_id: u64,
    scores: *const f32,
    n: usize,
) -> i32 {
    boundary(|| {
        // SAFETY: header contract for `m` and `scores`.
        let (m, s) = unsafe { (handle(m, "manager")?, input(scores, n, "scores")?) };
        m.0.accumulate_scores(seq_id, s)
    })
}

/// # Safety
/// `m` live; `copies` holds `copies_cap` entries; out pointers NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn pa_cache_evict(
    m: *mut PaCacheManager,
    seq_id: u64,
    start: usize,
    recent: usize,
    budget: usize,
    copies: *mut BlockCopy,
    copies_cap: usize,
    out_num_copies: *mut usize,
    out_evicted_blocks: *mut usize,
) -> i32 {
    boundary(|| {
        // SAFETY: header contract for `m` and `copies`.
        let (m, copies) = unsafe { (handle(m, "manager")?, output(copies, copies_cap, "copies")?) };
        if m.0.block_table(seq_id)?.len() > budget && copies.len() < budget {
            return Err(buffer_size("copies", budget, copies.len()));
        }
        let ev = m.0.evict(
            seq_id,
            EvictionPolicy {
                start,
                recent,
                budget,
            },
        )?;
        copies[..ev.copies.len()].copy_from_slice(&ev.copies);
        // SAFETY: header contract for the out pointers.
        unsafe {
            put(out_num_copies, ev.copies.len());
            put(out_evicted_blocks, ev.evicted.len());
        }
        Ok(())
    })
}

/// # Safety
/// `m` live; out pointers NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn pa_cache_pending_rotation(
    m: *mut PaCacheManager,
    out_num_rotated: *mut usize,
    out_lut_rows: *mut usize,
) -> i32 {
    boundary(|| {
        // SAFETY: header contract for `m`.
        let m = unsafe { handle(m, "manager") }?;
        let p = m.0.pending_rotations();
        let rows = p.iter().map(|&(_, d)| d as usize + 1).max().unwrap_or(0);
        // SAFETY: header contract for the out pointers.
        unsafe {
            put(out_num_rotated, p.len());
            put(out_lut_rows, rows);
        }
        Ok(())
    })
}

/// # Safety
/// `m` live; `block_indices` holds `blocks_cap`, `deltas` holds `deltas_cap` entries;
/// `out_num_rotated` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn pa_cache_take_rotation(
    m: *mut PaCacheManager,
    block_indices: *mut i32,
    blocks_cap: usize,
    deltas: *mut i32,
    deltas_cap: usize,
    out_num_rotated: *mut usize,
) -> i32 {
    boundary(|| {
        // SAFETY: header contract for `m`.
        let m = unsafe { handle(m, "manager") }?;
        let r = m.0.pending_rotations().len();
        let bs = m.0.block_size();
        if blocks_cap < r {
            return Err(buffer_size("block_indices", r, blocks_cap));
        }
        if deltas_cap < r * bs {
            return Err(buffer_size("deltas", r * bs, deltas_cap));
        }
        // SAFETY: header contract for the output arrays.
        let (bi, d) = unsafe {
            (
                output(block_indices, r, "block_indices")?,
                output(deltas, r * bs, "deltas")?,
            )
        };
        if let Some(rot) = m.0.take_rotation() {
            bi.copy_from_slice(&rot.block_indices);
            d.copy_from_slice(&rot.deltas);
        }
        // SAFETY: header contract for `out_num_rotated`.
        unsafe { put(out_num_rotated, r) };
        Ok(())
    })
}

/// # Safety
/// `out` holds `out_len` floats.
#[no_mangle]
pub unsafe extern "C" fn pa_cache_rotation_lut(
    rows: usize,
    head_size: usize,
    base: f64,
    backward: i32,
    out: *mut f32,
    out_len: usize,
) -> i32 {
    boundary(|| {
        let dir = if backward != 0 {
            RotationDirection::Backward
        } else {
            RotationDirection::Forward
        };
        let len = rotation_lut_len(rows, head_size, base)?;
        if out_len != len {
            return Err(buffer_size("out", len, out_len));
        }
        // SAFETY: header contract for `out`.
        let out = unsafe { output(out, out_len, "out") }?;
        fill_rotation_lut(out, head_size, base, dir);
        Ok(())
    })
}

/// # Safety
/// `key_cache` and `value_cache` each hold `num_blocks * block_bytes` writable bytes and do
/// not overlap; `copies` holds `n` entries.
#[no_mangle]
pub unsafe extern "C" fn pa_cache_copy_blocks(
    key_cache: *mut std::ffi::c_void,
    value_cache: *mut std::ffi::c_void,
    num_blocks: usize,
    block_bytes: usize,
    copies: *const BlockCopy,
    n: usize,
) -> i32 {
    // SAFETY: the same contract with equal block sizes.
    unsafe {
        pa_cache_copy_blocks_kv(
            key_cache,
            value_cache,
            num_blocks,
            block_bytes,
            block_bytes,
            copies,
            n,
        )
    }
}

/// # Safety
/// `key_cache` holds `num_blocks * key_block_bytes` and `value_cache` `num_blocks *
/// value_block_bytes` writable bytes, not overlapping; `copies` holds `n` entries.
#[no_mangle]
pub unsafe extern "C" fn pa_cache_copy_blocks_kv(
    key_cache: *mut std::ffi::c_void,
    value_cache: *mut std::ffi::c_void,
    num_blocks: usize,
    key_block_bytes: usize,
    value_block_bytes: usize,
    copies: *const BlockCopy,
    n: usize,
) -> i32 {
    boundary(|| {
        let total = |bb: usize| {
            num_blocks
                .checked_mul(bb)
                .ok_or_else(|| PaError::InvalidArgument {
                    detail: "num_blocks * block_bytes overflows".into(),
                })
        };
        let (kbytes, vbytes) = (total(key_block_bytes)?, total(value_block_bytes)?);
        if kbytes > 0 || vbytes > 0 {
            // NULL first: two NULL caches are "missing", not "the same buffer".
            for (p, what, len) in [
                (key_cache, "key_cache", kbytes),
                (value_cache, "value_cache", vbytes),
            ] {
                if p.is_null() && len > 0 {
                    return Err(null(what));
                }
            }
            let (k, v) = (key_cache as usize, value_cache as usize);
            if k.checked_add(kbytes).is_none() || v.checked_add(vbytes).is_none() {
                return Err(PaError::InvalidArgument {
                    detail: format!(
                        "caches of {kbytes} / {vbytes} bytes at {key_cache:p} / {value_cache:p} \
                         would run past the end of the address space"
                    ),
                });
            }
            if kbytes > 0 && vbytes > 0 && k < v + vbytes && v < k + kbytes {
                return Err(PaError::InvalidArgument {
                    detail: if k == v {
                        "key_cache and value_cache are the same buffer".into()
                    } else {
                        "key_cache and value_cache overlap".into()
                    },
                });
            }
        }
        // SAFETY: header contract: two non-overlapping caches of `kbytes` / `vbytes` bytes, `n`
        // copies.
        let (k, v, c) = unsafe {
            (
                output(key_cache as *mut u8, kbytes, "key_cache")?,
                output(value_cache as *mut u8, vbytes, "value_cache")?,
                input(copies, n, "copies")?,
            )
        };
        copy_blocks_kv(k, v, key_block_bytes, value_block_bytes, c)
    })
}

// ---------------------------------------------------------------- scheduler

/// # Safety
/// `cfg` readable; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn pa_scheduler_create(
    cfg: *const PaSchedulerConfig,
    out: *mut *mut PaScheduler,
) -> i32 {
    boundary(|| {
        // SAFETY: header contract: `cfg` NULL or a readable config.
        let c = unsafe { cfg.as_ref() }.ok_or_else(|| null("cfg"))?;
        if out.is_null() {
            return Err(null("out"));
        }
        let sched = Scheduler::new(SchedulerConfig {
            num_blocks: c.num_blocks,
            block_size: c.block_size,
            prefix_caching: c.prefix_caching != 0,
            max_batched_tokens: c.max_batched_tokens,
            max_seqs: c.max_seqs,
            eviction: (c.eviction_budget > 0).then_some(EvictionPolicy {
                start: c.eviction_start,
                recent: c.eviction_recent,
                budget: c.eviction_budget,
            }),
        })?;
        let h = PaScheduler {
            sched,
            step: Step::default(),
            ids: vec![],
            emits: vec![],
        };
        // SAFETY: `out` is non-NULL (checked) and writable per the header.
        unsafe { out.write(Box::into_raw(Box::new(h))) };
        Ok(())
    })
}

/// # Safety
/// `s` is NULL or a handle from `pa_scheduler_create` not destroyed yet.
#[no_mangle]
pub unsafe extern "C" fn pa_scheduler_destroy(s: *mut PaScheduler) {
    // SAFETY: the caller passes NULL or a live handle from pa_scheduler_create, once.
    unsafe { destroy_handle(s) }
}

/// # Safety
/// `s` live; `prompt` holds `n` tokens.
#[no_mangle]
pub unsafe extern "C" fn pa_scheduler_add_request(
    s: *mut PaScheduler,
    id: u64,
    prompt: *const u32,
    n: usize,
    max_new_tokens: usize,
    priority: i32,
) -> i32 {
    boundary(|| {
        // SAFETY: header contract for `s` and `prompt`.
        let (s, prompt) = unsafe { (handle(s, "scheduler")?, input(prompt, n, "prompt")?) };
        s.sched.add_request(Request {
            id,
            prompt: prompt.to_vec(),
            max_new_tokens,
            priority,
        })
    })
}

/// # Safety
/// `s` live; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn pa_scheduler_schedule(
    s: *mut PaScheduler,
    out: *mut PaSchedulerStep,
) -> i32 {
    boundary(|| {
        // SAFETY: header contract for `s`.
        let s = unsafe { handle(s, "scheduler") }?;
        if out.is_null() {
            return Err(null("out"));
        }
        s.step = s.sched.schedule()?;
        s.ids = s.step.seqs.iter().map(|q| q.id).collect();
        s.emits = s.step.seqs.iter().map(|q| u8::from(q.emits)).collect();
        let st = &s.step;
        let (nrot, rbi, rd, rows) = match &st.rotation {
            Some(r) => (
                r.len(),
                r.block_indices.as_ptr(),
                r.deltas.as_ptr(),
                r.lut_rows(),
            ),
            None => (0, std::ptr::null(), std::ptr::null(), 0),
        };
        let view = PaSchedulerStep {
            num_seqs: st.seqs.len(),
            num_tokens: st.num_tokens(),
            num_block_indices: st.block_indices.len(),
            scores_len: st.scores_len(),
            seq_ids: s.ids.as_ptr(),
            past_lens: st.past_lens.as_ptr(),
            subsequence_begins: st.subsequence_begins.as_ptr(),
            block_indices: st.block_indices.as_ptr(),
            block_indices_begins: st.block_indices_begins.as_ptr(),
            emits: s.emits.as_ptr(),
            token_ids: st.token_ids.as_ptr(),
            token_seq: st.token_seq.as_ptr(),
            token_pos: st.token_pos.as_ptr(),
            num_copies: st.copies.len(),
            copies: st.copies.as_ptr(),
            num_rotated: nrot,
            rotated_block_indices: rbi,
            rotation_deltas: rd,
            lut_rows: rows,
            num_preempted: st.preempted.len(),
            preempted: st.preempted.as_ptr(),
        };
        // SAFETY: `out` is non-NULL (checked) and writable per the header.
        unsafe { out.write(view) };
        Ok(())
    })
}

/// # Safety
/// `s` live; `scores` holds `n` floats.
#[no_mangle]
pub unsafe extern "C" fn pa_scheduler_accumulate_scores(
    s: *mut PaScheduler,
    scores: *const f32,
    n: usize,
) -> i32 {
    boundary(|| {
        // SAFETY: header contract for `s` and `scores`.
        let (s, sc) = unsafe { (handle(s, "scheduler")?, input(scores, n, "scores")?) };
        s.sched.accumulate_scores(&s.step, sc)
    })
}

/// # Safety
/// `s` live; `seq_ids` and `tokens` hold `n` entries; `out_finished` NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn pa_scheduler_complete_step(
    s: *mut PaScheduler,
    seq_ids: *const u64,
    tokens: *const u32,
    n: usize,
    out_finished: *mut usize,
) -> i32 {
    boundary(|| {
        // SAFETY: header contract for `s`, `seq_ids` and `tokens`.
        let (s, ids, toks) = unsafe {
            (
                handle(s, "scheduler")?,
                input(seq_ids, n, "seq_ids")?,
                input(tokens, n, "tokens")?,
            )
        };
        let sampled: Vec<_> = ids.iter().copied().zip(toks.iter().copied()).collect();
        let fin = s.sched.complete_step(&sampled)?;
        // The C ABI reports the count only: drop the finished list, which would otherwise grow.
        s.sched.take_finished();
        // SAFETY: header contract for `out_finished`.
        unsafe { put(out_finished, fin.len()) };
        Ok(())
    })
}

/// # Safety
/// `s` live; out pointers NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn pa_scheduler_counts(
    s: *mut PaScheduler,
    out_waiting: *mut usize,
    out_running: *mut usize,
) -> i32 {
    boundary(|| {
        // SAFETY: header contract for `s`.
        let s = unsafe { handle(s, "scheduler") }?;
        // SAFETY: header contract for the out pointers.
        unsafe {
            put(out_waiting, s.sched.num_waiting());
            put(out_running, s.sched.num_running());
        }
        Ok(())
    })
}

/// # Safety
/// `s` live; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn pa_scheduler_stats(s: *mut PaScheduler, out: *mut PaCacheStats) -> i32 {
    boundary(|| {
        // SAFETY: header contract for `s`.
        let s = unsafe { handle(s, "scheduler") }?;
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: non-NULL (checked), writable per the header.
        unsafe { out.write(s.sched.manager().stats().into()) };
        Ok(())
    })
}

/// # Safety
/// `s` live.
#[no_mangle]
pub unsafe extern "C" fn pa_scheduler_fork(
    s: *mut PaScheduler,
    parent: u64,
    child: u64,
    first_token: u32,
    max_new_tokens: usize,
) -> i32 {
    boundary(|| {
        // SAFETY: header contract for `s`.
        let s = unsafe { handle(s, "scheduler") }?;
        s.sched.fork(parent, child, first_token, max_new_tokens)
    })
}

/// # Safety
/// `s` live; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn pa_scheduler_get_counters(
    s: *mut PaScheduler,
    out: *mut PaSchedulerCounters,
) -> i32 {
    boundary(|| {
        // SAFETY: header contract for `s`.
        let s = unsafe { handle(s, "scheduler") }?;
        if out.is_null() {
            return Err(null("out"));
        }
        // SAFETY: non-NULL (checked), writable per the header.
        unsafe { out.write(s.sched.counters().into()) };
        Ok(())
    })
}

/// Frees a handle made by `Box::into_raw`; NULL is a no-op; a panic in a destructor is caught.
///
/// # Safety
/// `p` is NULL or came from `Box::into_raw` and is not used afterwards.
unsafe fn destroy_handle<T>(p: *mut T) {
    if !p.is_null() {
        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // SAFETY: the function's contract: `p` came from Box::into_raw, freed once.
            drop(unsafe { Box::from_raw(p) })
        }));
    }
}
