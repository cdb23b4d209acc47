//! `pa_validate` + `pa_execute` on concrete calls. Every buffer ends at a PROT_NONE guard page
//! and the read-only inputs are mapped read-only, so a read past an end or a write into an
//! input faults. A call `pa_validate` accepts must execute; a call it rejects must be rejected
//! by `pa_execute` too, with caches and outputs left untouched.
//!
//! Input: n_inputs (9 + b % 8), then per input: elem_type byte, rank byte, rank x i64 LE dims,
//! then the tensor's bytes (zero-padded when the input runs out).
#![no_main]
use libfuzzer_sys::fuzz_target;
use paged_attention::ffi::op::{pa_execute, pa_set_num_threads, pa_validate};
use paged_attention::ffi::{PaPartialShape, PaTensor};
use paged_attention_fuzz::{Bytes, GuardBuf};

/// Largest tensor (elements) and call (bytes) the harness maps; bigger declared shapes get a
/// zero-length buffer and are only validated when no integer input is involved.
const MAX_ELEMS: u64 = 1 << 16;
const MAX_TOTAL_BYTES: u64 = 1 << 20;

fn elem_size(t: i32) -> Option<u64> {
    match t {
        0 | 3 => Some(4),
        1 | 2 => Some(2),
        _ => None,
    }
}

/// Bytes the declared tensor covers, if it is one the harness can map.
fn declared_bytes(t: &PaTensor) -> Option<u64> {
    if !(0..=8).contains(&t.rank) {
        return None;
    }
    let mut n: u64 = 1;
    for &d in &t.dims[..t.rank as usize] {
        n = n.checked_mul(u64::try_from(d).ok()?)?;
    }
    (n <= MAX_ELEMS).then(|| n * elem_size(t.elem_type).unwrap_or(4))
}

fn tensor_header(b: &mut Bytes) -> PaTensor {
    let e = b.u8();
    let elem_type = if e < 0xF0 {
        (e % 4) as i32
    } else {
        e as i8 as i32
    };
    let r = b.u8();
    let rank = if r < 0xF0 {
        (r % 9) as i32
    } else {
        r as i8 as i32
    };
    let mut dims = [0i64; 8];
    for d in dims.iter_mut().take(rank.clamp(0, 8) as usize) {
        *d = b.i64();
    }
    PaTensor {
        elem_type,
        rank,
        dims,
        data: std::ptr::null_mut(),
    }
}

fuzz_target!(init: { pa_set_num_threads(1); }, |data: &[u8]| {
    let mut b = Bytes::new(data);
    let n = 9 + b.below(8);
    let flags = b.u8();
    let mut tensors = Vec::with_capacity(n);
    let mut bufs = Vec::with_capacity(n);
    let mut total = 0u64;
    let mut unmappable_int = false;
    let mut unmappable = false;
    for i in 0..n {
        let mut t = tensor_header(&mut b);
        let len = match declared_bytes(&t) {
            Some(len) if total + len <= MAX_TOTAL_BYTES => {
                total += len;
                len
            }
            _ => {
                // Integer inputs are read by validation itself; floats only by execution.
                unmappable_int |= t.elem_type == 3 || !(0..=2).contains(&i);
                unmappable = true;
                0
            }
        };
        let Some(mut buf) = GuardBuf::new(len as usize) else {
            return;
        };
        let src = b.take(len as usize);
        buf.bytes_mut()[..src.len()].copy_from_slice(src);
        // Caches (inputs 3, 4) are written in place; everything else is read-only.
        if i != 3 && i != 4 {
            buf.seal();
        }
        t.data = if len == 0 && flags & 1 == 0 {
            std::ptr::null_mut()
        } else {
            buf.ptr() as *mut _
        };
        tensors.push(t);
        bufs.push(buf);
    }
    if unmappable_int {
        return;
    }
    let blank = PaPartialShape { elem_type: 0, rank: -7, dims: [0; 8] };
    let mut shapes = [blank; 2];
    // SAFETY: `tensors` holds n tensors whose buffers cover their declared shapes (or are
    // empty for floats never read by validation); `shapes` holds two.
    let valid = unsafe { pa_validate(tensors.as_ptr(), n, shapes.as_mut_ptr()) };
    if unmappable {
        return;
    }
    let caches: Vec<Vec<u8>> = bufs[3..5].iter().map(|c| c.bytes().to_vec()).collect();
    // Outputs: exactly what validation asked for, or fuzzed ones when it refused the call.
    let mut outs = Vec::with_capacity(2);
    let mut out_bufs = Vec::with_capacity(2);
    for s in &shapes {
        let mut t = if valid == 0 {
            let mut dims = [0i64; 8];
            dims.copy_from_slice(&s.dims);
            PaTensor { elem_type: s.elem_type, rank: s.rank, dims, data: std::ptr::null_mut() }
        } else {
            tensor_header(&mut b)
        };
        let len = match declared_bytes(&t) {
            Some(len) => len,
            None if valid == 0 => return,
            None => 0,
        };
        let Some(mut buf) = GuardBuf::new(len as usize) else {
            return;
        };
        buf.bytes_mut().fill(0xA5);
        t.data = if len == 0 { std::ptr::null_mut() } else { buf.ptr() as *mut _ };
        outs.push(t);
        out_bufs.push(buf);
    }
    // SAFETY: as for pa_validate; the outputs' buffers cover their declared shapes.
    let status = unsafe { pa_execute(tensors.as_ptr(), n, outs.as_ptr(), 2) };
    if valid == 0 {
        assert!(status == 0 || status == 14, "validated call failed to execute: {status}");
    } else {
        assert_ne!(status, 0, "pa_execute accepted a call pa_validate refused ({valid})");
    }
    if status != 0 {
        assert!(bufs[3].bytes() == caches[0] && bufs[4].bytes() == caches[1], "failed call wrote a cache");
        assert!(out_bufs.iter().all(|o| o.bytes().iter().all(|&x| x == 0xA5)), "failed call wrote an output");
    }
});
