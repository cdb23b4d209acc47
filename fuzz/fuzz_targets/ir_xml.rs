//! The IR loader (cli/src/ir/): XML text, then a NUL byte, then the weights (.bin) bytes.
#![no_main]
use libfuzzer_sys::fuzz_target;
use paged_attention_cli::ir::Model;

fuzz_target!(|data: &[u8]| {
    let cut = data.iter().position(|&b| b == 0).unwrap_or(data.len());
    let Ok(xml) = std::str::from_utf8(&data[..cut]) else {
        return;
    };
    let bin = data.get(cut + 1..);
    if let Ok(model) = Model::from_xml(xml, bin) {
        // Walk what the loader built; a model that loads must describe itself consistently.
        for p in model.parameters() {
            let _ = format!("{p:?}");
        }
        for l in model.layers() {
            let _ = format!("{l:?}");
        }
    }
});
