//! The headers as a C compiler sees them, against the Rust definitions they must match: every
//! `PA_STATUS_*` name and number against the one status table (`Status`, src/error.rs) and
//! `pa_status_name`; the `PA_INPUT_*` / `PA_OUTPUT_*` indices and counts against the op's input
//! table (src/op/contract.rs); and `sizeof`, `_Alignof` and every field's `offsetof` and size of each
//! struct of both headers against `size_of` / `align_of` / `offset_of!` (and field sizes) of its `#[repr(C)]` twin.
//! The values come from a C program compiled against include/ and run, not from parsing.
//! With the feature `test-hooks`, the test-only header tests/c/pa_test_hooks.h is checked the
//! same way (its struct's twin, `PaItemCounts`, exists only in such builds).

mod support;

use paged_attention::cache::manager::BlockCopy;
use paged_attention::ffi::cache::{
    PaCacheStats, PaSchedulerConfig, PaSchedulerCounters, PaSchedulerStep,
};
#[cfg(feature = "test-hooks")]
use paged_attention::ffi::op::PaItemCounts;
use paged_attention::ffi::op::{pa_status_name, PaRunner};
use paged_attention::ffi::{PaPartialShape, PaTensor};
use paged_attention::op::contract::{INPUTS, MAX_INPUTS, MIN_INPUTS, NUM_OUTPUTS, OUTPUT_NAMES};
use paged_attention::Status;
use std::collections::BTreeMap;
use std::ffi::CStr;
use std::mem::{align_of, offset_of, size_of};
use std::process::Command;

/// The headers checked (paths from the repository root): the public ones, plus the test-only
/// one in builds that export its function.
fn headers() -> Vec<&'static str> {
    let mut h = vec![
        "include/paged_attention.h",
        "include/paged_attention_cache.h",
    ];
    if cfg!(feature = "test-hooks") {
        h.push("tests/c/pa_test_hooks.h");
    }
    h
}

struct Layout {
    c_name: &'static str,
    size: usize,
    align: usize,
    /// (name, offset, size) of each field.
    fields: Vec<(&'static str, usize, usize)>,
}

/// The size of the field `get` returns.
fn field_size<T, F>(_get: fn(&T) -> &F) -> usize {
    size_of::<F>()
}

/// The Rust twin of each C struct, with the fields the header declares.
macro_rules! layouts {
    ($($rust:ty => $c:literal { $($field:ident),* $(,)? })*) => {
        vec![$(Layout {
            c_name: $c,
            size: size_of::<$rust>(),
            align: align_of::<$rust>(),
            fields: vec![$((
                stringify!($field),
                offset_of!($rust, $field),
                field_size(|s: &$rust| &s.$field),
            )),*],
        },)*]
    };
}

fn rust_layouts() -> Vec<Layout> {
    #[allow(unused_mut)]
    let mut v = layouts! {
        PaTensor => "pa_tensor" { elem_type, rank, dims, data }
        PaPartialShape => "pa_partial_shape" { elem_type, rank, dims }
        PaRunner => "pa_runner" { parallel_for, ctx, max_threads }
        BlockCopy => "pa_block_copy" { src, dst }
        PaCacheStats => "pa_cache_stats" {
            block_size, total_blocks, used_blocks, free_blocks, cached_blocks, shared_blocks,
            used_slots, fragmentation, sequences,
        }
        PaSchedulerConfig => "pa_scheduler_config" {
            num_blocks, block_size, prefix_caching, max_batched_tokens, max_seqs,
            eviction_budget, eviction_start, eviction_recent,
        }
        PaSchedulerStep => "pa_scheduler_step" {
            num_seqs, num_tokens, num_block_indices, scores_len, seq_ids, past_lens,
            subsequence_begins, block_indices, block_indices_begins, emits, token_ids, token_seq,
            token_pos, num_copies, copies, num_rotated, rotated_block_indices, rotation_deltas,
            lut_rows, num_preempted, preempted,
        }
        PaSchedulerCounters => "pa_scheduler_counters" {
            steps, preemptions, forks, prefix_hits, prefix_hit_tokens, block_copies, evictions,
            evicted_blocks, rotated_blocks,
        }
    };
    #[cfg(feature = "test-hooks")]
    v.extend(layouts! {
        PaItemCounts => "pa_item_counts" { pool, host, other }
    });
    v
}

/// `text` without its `/* */` comments.
fn strip_comments(text: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find("/*") {
        out.push_str(&rest[..i]);
        let end = rest[i..].find("*/").expect("unterminated comment") + i + 2;
        rest = &rest[end..];
    }
    out + rest
}

/// Every `typedef struct NAME { ... }` of the headers, with its field names in order.
fn header_structs() -> BTreeMap<String, Vec<String>> {
    let mut structs = BTreeMap::new();
    for h in headers() {
        let text =
            strip_comments(&std::fs::read_to_string(support::root().join(h)).expect("header"));
        for part in text.split("typedef struct ").skip(1) {
            let Some((name, body)) = part.split_once('{') else {
                continue; // an opaque handle: `typedef struct pa_scheduler pa_scheduler;`
            };
            let name = name.trim();
            if name.contains(';') {
                continue;
            }
            let body = &body[..body.find('}').expect("struct body")];
            let fields = body
                .split(';')
                .map(str::trim)
                .filter(|d| !d.is_empty())
                .map(|d| {
                    let d = d.split('[').next().unwrap().trim_end();
                    let start = d.rfind([' ', '*']).map_or(0, |i| i + 1);
                    d[start..].to_string()
                })
                .collect();
            structs.insert(name.to_string(), fields);
        }
    }
    structs
}

/// Every `#define NAME` of the headers whose name starts with one of `prefixes`.
fn header_macros(prefixes: &[&str]) -> Vec<String> {
    let mut names = Vec::new();
    for h in headers() {
        let text = std::fs::read_to_string(support::root().join(h)).expect("header");
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("#define ") {
                let name = rest.split_whitespace().next().unwrap_or_default();
                if prefixes.iter().any(|p| name.starts_with(p)) {
                    names.push(name.to_string());
                }
            }
        }
    }
    names
}

/// Compiles and runs a C program (`tag`.c: each test its own) printing `key value` lines for the
/// given macros and structs.
fn c_values(
    tag: &str,
    macros: &[String],
    structs: &BTreeMap<String, Vec<String>>,
) -> BTreeMap<String, i64> {
    let mut src = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include \"paged_attention_cache.h\"\n",
    );
    if cfg!(feature = "test-hooks") {
        src += "#include \"pa_test_hooks.h\"\n";
    }
    src += "int main(void) {\n";
    for m in macros {
        src += &format!("    printf(\"{m} %lld\\n\", (long long)({m}));\n");
    }
    for (s, fields) in structs {
        src += &format!("    printf(\"{s} %zu\\n\", sizeof({s}));\n");
        src += &format!("    printf(\"{s}.align %zu\\n\", _Alignof({s}));\n");
        for f in fields {
            src += &format!("    printf(\"{s}.{f} %zu\\n\", offsetof({s}, {f}));\n");
            src += &format!("    printf(\"{s}.{f}.size %zu\\n\", sizeof((({s} *)0)->{f}));\n");
        }
    }
    src += "    return 0;\n}\n";
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
    let c = dir.join(format!("{tag}.c"));
    let exe = dir.join(tag);
    std::fs::write(&c, src).expect("write C source");
    support::run(
        Command::new("cc")
            .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-I"])
            .arg(support::root().join("include"))
            .arg("-I")
            .arg(support::root().join("tests/c"))
            .arg(&c)
            .arg("-o")
            .arg(&exe),
    );
    let out = support::run(&mut Command::new(&exe));
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .lines()
        .map(|l| {
            let (k, v) = l.split_once(' ').expect("key value");
            (k.to_string(), v.parse().expect("number"))
        })
        .collect()
}

#[test]
fn status_codes_match_the_header_in_both_directions() {
    let macros = header_macros(&["PA_STATUS_"]);
    let c = c_values("header_statuses", &macros, &BTreeMap::new());
    let rust: BTreeMap<String, i64> = Status::ALL
        .iter()
        .map(|s| (s.c_name().to_str().unwrap().to_string(), *s as i64))
        .collect();
    assert_eq!(
        c, rust,
        "PA_STATUS_* of the header (left) vs the Rust table (right)"
    );
    for s in Status::ALL {
        assert_eq!(Status::from_code(*s as i32), Some(*s));
        // SAFETY: pa_status_name returns a static NUL-terminated string for every input.
        let name = unsafe { CStr::from_ptr(pa_status_name(*s as i32)) };
        assert_eq!(name, s.c_name());
    }
    for unknown in [-1, Status::ALL.len() as i32, i32::MAX] {
        assert_eq!(Status::from_code(unknown), None);
        // SAFETY: as above.
        let name = unsafe { CStr::from_ptr(pa_status_name(unknown)) };
        assert_eq!(name, c"PA_STATUS_UNKNOWN");
    }
}

/// `PA_PRECISION_*` against the one table of precision codes (`ffi::op::PRECISIONS`).
#[test]
fn precision_codes_match_the_header() {
    let macros = header_macros(&["PA_PRECISION_"]);
    let c = c_values("header_precisions", &macros, &BTreeMap::new());
    let rust: BTreeMap<String, i64> = paged_attention::ffi::op::PRECISIONS
        .iter()
        .map(|&(code, p)| {
            (
                format!("PA_PRECISION_{}", p.name().to_uppercase()),
                code as i64,
            )
        })
        .collect();
    assert_eq!(
        c, rust,
        "PA_PRECISION_* of the header (left) vs the Rust table (right)"
    );
}

#[test]
fn input_and_output_indices_match_the_contract_table() {
    let macros = header_macros(&[
        "PA_INPUT_",
        "PA_OUTPUT_",
        "PA_MIN_INPUTS",
        "PA_MAX_INPUTS",
        "PA_NUM_OUTPUTS",
    ]);
    let c = c_values("header_indices", &macros, &BTreeMap::new());
    let mut rust = BTreeMap::new();
    for (i, input) in INPUTS.iter().enumerate() {
        rust.insert(format!("PA_INPUT_{}", input.name.to_uppercase()), i as i64);
    }
    for (i, name) in OUTPUT_NAMES.iter().enumerate() {
        rust.insert(format!("PA_OUTPUT_{}", name.to_uppercase()), i as i64);
    }
    rust.insert("PA_MIN_INPUTS".into(), MIN_INPUTS as i64);
    rust.insert("PA_MAX_INPUTS".into(), MAX_INPUTS as i64);
    rust.insert("PA_NUM_OUTPUTS".into(), NUM_OUTPUTS as i64);
    assert_eq!(c, rust, "the header (left) vs src/op/contract.rs (right)");
}

#[test]
fn struct_layouts_match_the_c_compiler() {
    let structs = header_structs();
    let layouts = rust_layouts();
    let listed: Vec<&str> = layouts.iter().map(|l| l.c_name).collect();
    assert_eq!(
        structs.keys().map(String::as_str).collect::<Vec<_>>(),
        {
            let mut v = listed.clone();
            v.sort();
            v
        },
        "every struct of the headers needs its Rust twin listed here"
    );
    let c = c_values("header_layouts", &[], &structs);
    for l in &layouts {
        let header_fields: Vec<&str> = structs[l.c_name].iter().map(String::as_str).collect();
        let rust_fields: Vec<&str> = l.fields.iter().map(|f| f.0).collect();
        assert_eq!(
            header_fields, rust_fields,
            "{}: fields, header vs Rust",
            l.c_name
        );
        assert_eq!(c[l.c_name], l.size as i64, "sizeof({})", l.c_name);
        assert_eq!(
            c[&format!("{}.align", l.c_name)],
            l.align as i64,
            "_Alignof({})",
            l.c_name
        );
        for (f, off, size) in &l.fields {
            assert_eq!(
                c[&format!("{}.{f}", l.c_name)],
                *off as i64,
                "offsetof({}, {f})",
                l.c_name
            );
            assert_eq!(
                c[&format!("{}.{f}.size", l.c_name)],
                *size as i64,
                "sizeof({}.{f})",
                l.c_name
            );
        }
    }
}
