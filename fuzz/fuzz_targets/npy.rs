//! The .npy reader (cli/src/npy.rs, the `pa` command's): a whole file in memory, then the
//! conversions `pa run` applies.
#![no_main]
use libfuzzer_sys::fuzz_target;

use paged_attention_cli::npy::{encode_npy, parse_npy};

fuzz_target!(|data: &[u8]| {
    let Ok(arr) = parse_npy(data) else {
        return;
    };
    // What parses must write back to the same array.
    let again = parse_npy(&encode_npy(arr.dtype, &arr.shape, &arr.bytes))
        .expect("re-encoding a parsed array must parse");
    assert_eq!(again.shape, arr.shape);
    assert_eq!(again.bytes, arr.bytes);
    let _ = arr.to_f64();
    let _ = arr.to_mask();
    let _ = arr.into_tensor();
});
