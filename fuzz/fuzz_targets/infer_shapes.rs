//! `pa_infer_shapes` on partial shapes: dynamic ranks and dims, the edges of i64, bad enums.
#![no_main]
use libfuzzer_sys::fuzz_target;
use paged_attention::ffi::op::pa_infer_shapes;
use paged_attention::ffi::PaPartialShape;
use paged_attention_fuzz::Bytes;

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes::new(data);
    let n = 9 + b.below(8);
    let inputs: Vec<PaPartialShape> = (0..n)
        .map(|_| {
            let elem_type = b.below(7) as i32 - 1;
            let rank = b.below(11) as i32 - 1;
            let mut dims = [0i64; 8];
            for d in dims.iter_mut().take(rank.max(0) as usize) {
                *d = b.dim();
            }
            PaPartialShape {
                elem_type,
                rank,
                dims,
            }
        })
        .collect();
    let blank = PaPartialShape {
        elem_type: 77,
        rank: 77,
        dims: [77; 8],
    };
    let mut out = [blank; 2];
    // SAFETY: `inputs` holds n shapes and `out` two, as the header requires.
    let status = unsafe { pa_infer_shapes(inputs.as_ptr(), n, out.as_mut_ptr()) };
    if status == 0 {
        assert_eq!(out[0].rank, 2, "output must be [T, H*D]");
        assert_eq!(out[1].rank, 1, "scores must be rank 1");
        assert_eq!(out[0].elem_type, out[1].elem_type);
        for s in &out {
            assert!(s.dims[..s.rank as usize].iter().all(|&d| d >= -1));
        }
    } else {
        assert!(
            out.iter().all(|s| s.rank == 77),
            "a failed call wrote its outputs"
        );
    }
});
