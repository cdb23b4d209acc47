//! u4 caches as a cache type of the op itself (`execute`, `execute_reference`, validation): the
//! layout is read from the shapes (dims count nibbles), insertion writes exactly the bytes of the
//! quantizer (`kernel::quant::insert_u8` at 4 bits, held to OpenVINO's u4 bytes by
//! tests/python/test_u4_ext.py), outputs match the float64 reference over the dequantized caches
//! on every layout, and shapes that no u4 layout has are refused with messages that say why.

mod common;

use common::call::{idx, Data, Runner, RUNNERS};
use common::ref64::{gen_case, reference, Features, Geometry, SeqKind};
use common::u8::{dequantized_case, layout_for_bits, u8_call, LAYOUTS};
use paged_attention::kernel::quant::{self, KeyQuant};
use paged_attention::{ElemType, PaError};

/// Worst `|got - want| / (1 + |want|)`.
fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() / (1.0 + w.abs()))
        .fold(0.0, f64::max)
}

/// Every layout, a few geometries (D = 40 leaves a tail after the 16-wide quantizer), decode,
/// prefill and mixed batches with windows and ALiBi as `Features` draws them (no rotation),
/// both entry points: the u4 bytes equal `insert_u8`'s at 4 bits, outputs and scores within
/// `tol` of float64 over the dequantized caches.
fn check(seeds: std::ops::Range<u64>, seqs: Option<Vec<SeqKind>>, max_past: Option<usize>) {
    let f = Features {
        rotation: Some(false),
        seqs,
        ..Features::default()
    };
    let tol = 2e-5;
    for (key, value_group) in LAYOUTS {
        // The last: a value head of another size (Dv 32 with D 64).
        for (hkv, g, d, dv) in [(2, 2, 64, 64), (1, 3, 40, 40), (2, 2, 64, 32)] {
            if value_group > dv || !dv.is_multiple_of(value_group.max(1)) {
                continue;
            }
            let mut geo = Geometry::new(ElemType::F32, ElemType::F32, hkv, g, d, 32);
            geo.max_past = max_past.unwrap_or(geo.max_past);
            geo.dv = dv;
            for seed in seeds.clone() {
                let c = gen_case(seed, &geo, &f);
                let l = layout_for_bits(&c, key, value_group, 4);
                for runner in RUNNERS {
                    let mut call = u8_call(&c, &l);
                    assert_eq!(call.inputs[idx::KEY_CACHE].data.elem_type(), ElemType::U4);
                    let mut want_kc = call.inputs[idx::KEY_CACHE].data.u8s().to_vec();
                    let mut want_vc = call.inputs[idx::VALUE_CACHE].data.u8s().to_vec();
                    let plan = call.validate().expect("u4 call validates");
                    assert_eq!(plan.u8.as_ref(), Some(&l), "layout read from the shapes");
                    let widen = |i: usize| -> Vec<f32> {
                        let v = call.inputs[i].data.to_f64();
                        v.iter().map(|&x| x as f32).collect()
                    };
                    let (k, v) = (widen(idx::KEY), widen(idx::VALUE));
                    let bi = &c.block_indices;
                    quant::insert_u8(&l, &plan.seqs, bi, &k, &v, &mut want_kc, &mut want_vc);
                    call.run(runner).expect("u4 call runs");
                    let kc = call.inputs[idx::KEY_CACHE].data.u8s();
                    let vc = call.inputs[idx::VALUE_CACHE].data.u8s();
                    assert!(kc == want_kc.as_slice(), "{runner:?} {l:?} key cache bytes");
                    assert!(
                        vc == want_vc.as_slice(),
                        "{runner:?} {l:?} value cache bytes"
                    );
                    let want = reference(&dequantized_case(&c, &l, kc, vc));
                    let o = rel_err(&call.outputs[0].data.to_f64(), &want.output);
                    let s = rel_err(&call.outputs[1].data.to_f64(), &want.scores);
                    assert!(
                        o <= tol && s <= tol,
                        "{runner:?} {l:?} seed {seed}: output {o:e}, scores {s:e} > {tol:e}\n{}",
                        c.describe()
                    );
                }
            }
        }
    }
}

#[test]
fn f32_query_on_u4_caches_end_to_end() {
    check(0..4, None, None);
    // long decodes: many online-softmax steps, keys cut into chunks past ~2000
    check(10..12, Some(vec![SeqKind::Decode; 2]), Some(2500));
    // many decodes: work items take runs of several KV heads (each unpacks its own)
    check(20..21, Some(vec![SeqKind::Decode; 140]), Some(70));
}

fn rejects(mut call: common::call::Call, needles: &[&str]) -> PaError {
    let before = call.snapshot();
    let err = call
        .run(Runner::Execute)
        .expect_err("a malformed u4 call must be refused");
    let msg = err.to_string();
    for n in needles {
        assert!(msg.contains(n), "message lacks {n:?}: {msg}");
    }
    assert_eq!(call.snapshot(), before, "a refused call wrote something");
    err
}

#[test]
fn shapes_no_u4_layout_has_are_refused() {
    let geo = Geometry::new(ElemType::F32, ElemType::F32, 2, 2, 64, 32);
    let c = gen_case(5, &geo, &Features::default());
    let sample = |key| u8_call(&c, &layout_for_bits(&c, key, 0, 4));
    let reshape = |call: &mut common::call::Call, i: usize, dim: usize, to: usize| {
        let t = &mut call.inputs[i];
        t.shape[dim] = to;
        let n: usize = t.shape.iter().product();
        t.data = Data::U4(vec![0; n / 2]);
    };
    // u8's 8 parameter rows are 16 u4 rows
    let mut call = sample(KeyQuant::ByChannel);
    reshape(&mut call, idx::KEY_CACHE, 2, 32 + 8);
    let err = rejects(call, &["u4 key_cache", "40 rows", "block_size + 16 = 48"]);
    assert!(matches!(err, PaError::Shape { .. }), "{err:?}");
    // 64 + 8 nibbles: half a group's parameters; 64 + 48: 3 groups do not divide 64
    for cols in [64 + 8, 64 + 48] {
        let mut call = sample(KeyQuant::ByChannel);
        reshape(&mut call, idx::VALUE_CACHE, 3, cols);
        rejects(
            call,
            &[
                "value_cache (u4",
                &format!("{cols} elements per token"),
                "no group size",
            ],
        );
    }
    // an odd head size: D = 63 from a key width of 2 * 63
    let mut call = sample(KeyQuant::ByChannel);
    for i in [idx::KEY, idx::VALUE] {
        let t = &mut call.inputs[i];
        t.shape[1] = 2 * 63;
        t.data = Data::F32(vec![0.0; t.shape[0] * 2 * 63]);
    }
    rejects(call, &["u4 caches", "must be even"]);
    // a u4 cache beside a u8 one
    let mut call = sample(KeyQuant::ByChannel);
    let n = call.inputs[idx::VALUE_CACHE].data.len();
    call.inputs[idx::VALUE_CACHE].data = Data::U8(vec![0; n]);
    rejects(call, &["value_cache", "u4"]);
}
