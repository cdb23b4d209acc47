//! The IR loader and the .npy reader never panic on corrupted files: thousands of seeded
//! mutations (byte flips, truncations, deleted and duplicated spans, digit changes in
//! dimensions, offsets and sizes) of the golden suite's real files must each load or fail
//! with an error. A panic, an out-of-bounds read or an allocation from an unchecked size
//! (which would abort the process) fails the test.

use paged_attention_cli::ir::Model;
use paged_attention_cli::npy::parse_npy;
use std::path::PathBuf;

/// splitmix64: a seeded stream independent of the code under test.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn mutate(rng: &mut Rng, src: &[u8]) -> Vec<u8> {
    let mut v = src.to_vec();
    for _ in 0..1 + rng.below(3) {
        if v.is_empty() {
            break;
        }
        let at = rng.below(v.len());
        match rng.below(6) {
            0 => v[at] = rng.next() as u8,
            1 => v.truncate(at),
            2 => {
                let end = (at + 1 + rng.below(64)).min(v.len());
                v.drain(at..end);
            }
            3 => {
                let end = (at + 1 + rng.below(64)).min(v.len());
                let span: Vec<u8> = v[at..end].to_vec();
                v.splice(at..at, span);
            }
            4 => {
                // A digit becomes another number: dims, offsets, sizes, ids.
                if let Some(p) = v[at..].iter().position(u8::is_ascii_digit) {
                    let digits = [
                        "0",
                        "-1",
                        "9",
                        "4294967296",
                        "18446744073709551615",
                        "99999999999",
                    ];
                    let d = digits[rng.below(digits.len())].as_bytes();
                    v.splice(at + p..at + p + 1, d.iter().copied());
                }
            }
            _ => v[at] ^= 1 << rng.below(8),
        }
    }
    v
}

fn case_dirs() -> Vec<PathBuf> {
    let models = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&models)
        .expect("models/")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.join("model.xml").exists())
        .collect();
    dirs.sort();
    assert!(dirs.len() >= 30, "expected the golden suite in models/");
    dirs
}

#[test]
fn mutated_ir_files_load_or_fail_with_an_error_never_panic() {
    let mut rng = Rng(0x5eed);
    let (mut loaded, mut rejected) = (0, 0);
    for dir in case_dirs() {
        let xml = std::fs::read(dir.join("model.xml")).expect("model.xml");
        let bin = std::fs::read(dir.join("model.bin")).unwrap_or_default();
        for i in 0..60 {
            let (x, b) = if i % 4 == 3 {
                (xml.clone(), mutate(&mut rng, &bin))
            } else {
                (mutate(&mut rng, &xml), bin.clone())
            };
            let text = String::from_utf8_lossy(&x);
            let r = std::panic::catch_unwind(|| Model::from_xml(&text, Some(&b)).map(|_| ()));
            match r {
                Ok(Ok(())) => loaded += 1,
                Ok(Err(e)) => {
                    assert!(!e.to_string().is_empty(), "an error without a message");
                    rejected += 1
                }
                Err(_) => panic!(
                    "the loader panicked on a mutation of {}/model.xml (iteration {i})",
                    dir.display()
                ),
            }
        }
    }
    assert!(
        rejected > 1000,
        "mutations should mostly be rejected ({loaded} loaded, {rejected} rejected)"
    );
}

#[test]
fn mutated_npy_files_parse_or_fail_with_an_error_never_panic() {
    let mut rng = Rng(0xa11ce);
    let mut rejected = 0;
    for dir in case_dirs() {
        for entry in std::fs::read_dir(&dir).expect("case dir").flatten() {
            let p = entry.path();
            if p.extension().is_none_or(|e| e != "npy") {
                continue;
            }
            let bytes = std::fs::read(&p).expect("npy");
            assert!(
                parse_npy(&bytes).is_ok(),
                "{} must parse unmodified",
                p.display()
            );
            for _ in 0..8 {
                let m = mutate(&mut rng, &bytes);
                match std::panic::catch_unwind(|| parse_npy(&m).map(|_| ())) {
                    Ok(Ok(())) => {}
                    Ok(Err(_)) => rejected += 1,
                    Err(_) => panic!("parse_npy panicked on a mutation of {}", p.display()),
                }
            }
        }
    }
    assert!(
        rejected > 100,
        "mutations should often be rejected ({rejected})"
    );
}
