//! The IR loader and executor: one test per class of malformed input (asserting the error and
//! that it names the layer), and wiring checks of execution against `execute` called directly.
//! (Numeric truth comes from the golden suite, cli/tests/conformance.rs.)

use std::collections::HashMap;

use half::f16;
use paged_attention::execute;
use paged_attention::op::{InputArg, PaInputs, PaOutputs};
use paged_attention::tensor::TensorMut;
use paged_attention_cli::ir::{CacheLocation, IrError, Model, OwnedData, OwnedTensor};

const NAMES: [&str; 9] = [
    "query",
    "key",
    "value",
    "key_cache",
    "value_cache",
    "past_lens",
    "subsequence_begins",
    "block_indices",
    "block_indices_begins",
];

// H = 2, Hkv = 1, D = 4, BS = 2.
fn dims_of(i: usize) -> Vec<i64> {
    match i {
        0 => vec![-1, 8],
        1 | 2 => vec![-1, 4],
        3 | 4 => vec![-1, 1, 2, 4],
        _ => vec![-1],
    }
}

fn dims(d: &[i64]) -> String {
    d.iter().map(|v| format!("<dim>{v}</dim>")).collect()
}

fn port(id: u64, prec: &str, d: &[i64]) -> String {
    format!(r#"<port id="{id}" precision="{prec}">{}</port>"#, dims(d))
}

fn parameter(id: u64, name: &str, et: &str, prec: &str, d: &[i64]) -> String {
    let shape: Vec<String> = d
        .iter()
        .map(|v| if *v < 0 { "?".into() } else { v.to_string() })
        .collect();
    format!(
        r#"<layer id="{id}" name="{name}" type="Parameter" version="opset1"><data shape="{}" element_type="{et}"/><output>{}</output></layer>"#,
        shape.join(","),
        port(0, prec, d)
    )
}

fn pa_layer(id: u64, precs: &[&str]) -> String {
    let ins: String = (0..9)
        .map(|i| port(i as u64, precs[i], &dims_of(i)))
        .collect();
    format!(
        r#"<layer id="{id}" name="pa" type="PagedAttention" version="ie_internal_opset"><rt_info><attribute name="x" version="0" value="1"/></rt_info><input>{ins}</input><output>{}{}</output></layer>"#,
        port(9, "FP32", &[-1, 8]),
        port(10, "FP32", &[-1])
    )
}

fn result(id: u64, name: &str, d: &[i64]) -> String {
    format!(
        r#"<layer id="{id}" name="{name}" type="Result" version="opset1"><input>{}</input></layer>"#,
        port(0, "FP32", d)
    )
}

fn precision(i: usize) -> &'static str {
    if i >= 5 {
        "I32"
    } else {
        "FP32"
    }
}

/// Parameters 0..8 -> PagedAttention 9 -> Results 10 (output), 11 (scores).
fn base_layers() -> Vec<String> {
    let mut l: Vec<String> = (0..9)
        .map(|i| {
            let et = if i >= 5 { "i32" } else { "f32" };
            parameter(i as u64, NAMES[i], et, precision(i), &dims_of(i))
        })
        .collect();
    let precs: Vec<&str> = (0..9).map(precision).collect();
    l.push(pa_layer(9, &precs));
    l.push(result(10, "output", &[-1, 8]));
    l.push(result(11, "scores", &[-1]));
    l
}

fn base_edges() -> Vec<(u64, u64, u64, u64)> {
    let mut e: Vec<_> = (0..9).map(|i| (i, 0, 9, i)).collect();
    e.push((9, 9, 10, 0));
    e.push((9, 10, 11, 0));
    e
}

fn net(layers: &[String], edges: &[(u64, u64, u64, u64)]) -> String {
    let e: String = edges
        .iter()
        .map(|(a, b, c, d)| {
            format!(r#"<edge from-layer="{a}" from-port="{b}" to-layer="{c}" to-port="{d}"/>"#)
        })
        .collect();
    format!(
        "<?xml version=\"1.0\"?>\n<net name=\"t\" version=\"11\"><layers>{}</layers><edges>{e}</edges><rt_info><framework><attribute name=\"a\" value=\"b\"/></framework></rt_info></net>",
        layers.concat()
    )
}

fn base_xml() -> String {
    net(&base_layers(), &base_edges())
}

fn load_err(xml: &str, bin: Option<&[u8]>) -> IrError {
    match Model::from_xml(xml, bin) {
        Ok(_) => panic!("the model loaded, but an error was expected"),
        Err(e) => e,
    }
}

fn assert_mentions(e: &IrError, parts: &[&str]) {
    let msg = e.to_string();
    for p in parts {
        assert!(msg.contains(p), "error `{msg}` should mention `{p}`");
    }
}

#[test]
fn a_well_formed_ir_loads_and_lists_its_parameters() {
    let m = Model::from_xml(&base_xml(), None).unwrap();
    let p = m.parameters();
    assert_eq!(p.len(), 9);
    assert_eq!(p[3].name, "key_cache");
    assert_eq!(p[3].feeds.len(), 1);
    assert_eq!((p[3].feeds[0].input, p[3].feeds[0].via_convert), (3, false));
    assert_eq!(p[3].shape.to_string(), "[?,1,2,4]");
}

#[test]
fn malformed_xml_is_reported_with_a_position() {
    let xml = base_xml();
    let cut = &xml[..xml.len() / 2];
    assert!(matches!(load_err(cut, None), IrError::Xml { .. }));
    let bad = xml.replace("<edges>", "<edges><edge from-layer=\"0\"</edges>");
    assert!(matches!(load_err(&bad, None), IrError::Xml { .. }));
    let mismatched = xml.replace("</layers>", "</layer>");
    assert!(matches!(load_err(&mismatched, None), IrError::Xml { .. }));
}

#[test]
fn an_element_with_many_attributes_parses_in_linear_time_and_duplicates_are_refused() {
    let xml = base_xml();
    let at = xml.find("<layer ").expect("a layer") + "<layer ".len();
    // 200,000 extra attributes on the first layer (3.5 MB): quadratic duplicate checks took 75 s.
    let extra: String = (0..200_000).map(|i| format!("x{i}=\"1\" ")).collect();
    let big = format!("{}{extra}{}", &xml[..at], &xml[at..]);
    let t = std::time::Instant::now();
    Model::from_xml(&big, None).unwrap();
    let secs = t.elapsed().as_secs_f64();
    assert!(secs < 1.0, "200,000 attributes took {secs:.2} s");
    let dup = format!("{}x=\"1\" y=\"2\" x=\"3\" {}", &xml[..at], &xml[at..]);
    let e = load_err(&dup, None);
    assert!(matches!(e, IrError::Xml { .. }));
    assert_mentions(&e, &["duplicate attribute `x`", "<layer>"]);
}

#[test]
fn a_document_that_is_not_an_ir_is_refused() {
    let e = load_err("<model version=\"11\"/>", None);
    assert_mentions(&e, &["<model>", "not <net>"]);
    let e = load_err(
        &base_xml().replace("version=\"11\"><layers>", "version=\"7\"><layers>"),
        None,
    );
    assert_mentions(&e, &["IR version \"7\""]);
}

#[test]
fn unknown_layer_type_names_the_layer() {
    let xml = base_xml().replace(
        r#"name="scores" type="Result""#,
        r#"name="scores" type="Softmax""#,
    );
    let e = load_err(&xml, None);
    assert!(matches!(e, IrError::UnknownType { id: 11, .. }), "{e}");
    assert_mentions(&e, &["layer 11", "Softmax"]);
    // The op under another opset is not ours.
    let xml = base_xml().replace("ie_internal_opset", "opset13");
    assert!(matches!(
        load_err(&xml, None),
        IrError::UnknownType { id: 9, .. }
    ));
}

#[test]
fn wrong_precision_string_names_layer_and_port() {
    let xml = base_xml().replacen(r#"precision="FP32""#, r#"precision="FP33""#, 1);
    let e = load_err(&xml, None);
    assert!(matches!(e, IrError::Precision { id: 0, .. }), "{e}");
    assert_mentions(&e, &["FP33"]);
}

#[test]
fn bad_dimension_text_is_refused() {
    let xml = base_xml().replacen("<dim>8</dim>", "<dim>eight</dim>", 1);
    assert_mentions(&load_err(&xml, None), &["layer 0", "eight"]);
}

#[test]
fn dangling_edges_are_refused() {
    for (edge, expect) in [
        ((99, 0, 9, 0), "from-layer 99 does not exist"),
        ((0, 0, 98, 0), "to-layer 98 does not exist"),
        ((0, 5, 9, 0), "layer 0 has no port 5"),
        ((0, 0, 9, 42), "layer 9 has no port 42"),
    ] {
        let mut edges = base_edges();
        edges[0] = edge;
        let e = load_err(&net(&base_layers(), &edges), None);
        assert!(matches!(e, IrError::Edge { .. }), "{e}");
        assert_mentions(&e, &[expect]);
    }
}

#[test]
fn edges_must_run_from_output_to_input_ports() {
    let mut edges = base_edges();
    edges[0] = (9, 0, 10, 0); // PA input port 0 used as a source
    edges.pop();
    assert_mentions(
        &load_err(&net(&base_layers(), &edges), None),
        &["is an input port"],
    );
    let mut edges = base_edges();
    edges[0] = (0, 0, 9, 9); // into PA's output port
    assert_mentions(
        &load_err(&net(&base_layers(), &edges), None),
        &["is an output port"],
    );
}

#[test]
fn an_input_port_has_one_producer() {
    let mut edges = base_edges();
    edges.push((1, 0, 9, 0));
    let e = load_err(&net(&base_layers(), &edges), None);
    assert_mentions(&e, &["already has a producer"]);
}

#[test]
fn an_unconnected_input_port_is_refused() {
    let mut edges = base_edges();
    edges.remove(7);
    let e = load_err(&net(&base_layers(), &edges), None);
    assert_mentions(&e, &["layer 9", "input port 7 has no incoming edge"]);
}

#[test]
fn precisions_must_agree_across_an_edge() {
    let mut precs: Vec<&str> = (0..9).map(precision).collect();
    precs[1] = "FP16";
    let mut layers = base_layers();
    layers[9] = pa_layer(9, &precs);
    let e = load_err(&net(&layers, &base_edges()), None);
    assert!(
        matches!(
            e,
            IrError::Edge {
                to_layer: 9,
                to_port: 1,
                ..
            }
        ),
        "{e}"
    );
    assert_mentions(&e, &["FP32 at the source but FP16"]);
}

#[test]
fn shape_inference_errors_name_the_op_layer() {
    // query.dim1 = 6 is not a multiple of head_size 4.
    let mut layers = base_layers();
    layers[0] = parameter(0, "query", "f32", "FP32", &[-1, 6]);
    layers[9] = layers[9].replacen("<dim>-1</dim><dim>8</dim>", "<dim>-1</dim><dim>6</dim>", 1);
    let e = load_err(&net(&layers, &base_edges()), None);
    assert!(matches!(e, IrError::Op { id: 9, .. }), "{e}");
    assert_mentions(&e, &["not a multiple of head_size"]);
}

#[test]
fn declared_outputs_must_match_inference() {
    let mut layers = base_layers();
    layers[9] = layers[9].replace(&port(9, "FP32", &[-1, 8]), &port(9, "FP32", &[-1, 7]));
    layers[10] = result(10, "output", &[-1, 7]);
    let e = load_err(&net(&layers, &base_edges()), None);
    assert_mentions(&e, &["layer 9", "output port 9", "shape inference gives"]);
}

#[test]
fn a_cycle_is_refused() {
    let l = vec![
        r#"<layer id="0" name="a" type="Convert" version="opset1"><data destination_type="f32"/><input><port id="0" precision="FP32"><dim>2</dim></port></input><output><port id="1" precision="FP32"><dim>2</dim></port></output></layer>"#.to_string(),
        r#"<layer id="1" name="b" type="Convert" version="opset1"><data destination_type="f32"/><input><port id="0" precision="FP32"><dim>2</dim></port></input><output><port id="1" precision="FP32"><dim>2</dim></port></output></layer>"#.to_string(),
    ];
    let e = load_err(&net(&l, &[(0, 1, 1, 0), (1, 1, 0, 0)]), None);
    assert_mentions(&e, &["cycle"]);
}

/// The base model with `past_lens` (layer 5) as a Const of 2 i32 at `offset`/`size`.
fn const_past_lens_xml(offset: u64, size: u64, shape: &str) -> String {
    let mut layers = base_layers();
    layers[5] = format!(
        r#"<layer id="5" name="past_lens" type="Const" version="opset1"><data element_type="i32" shape="{shape}" offset="{offset}" size="{size}"/><output>{}</output></layer>"#,
        port(0, "I32", &[2])
    );
    net(&layers, &base_edges())
}

#[test]
fn const_data_outside_the_bin_is_refused() {
    let bin = [0u8; 8];
    let e = load_err(&const_past_lens_xml(4, 8, "2"), Some(&bin));
    assert!(
        matches!(
            e,
            IrError::ConstOutOfBounds {
                id: 5,
                offset: 4,
                size: 8,
                bin_len: 8,
                ..
            }
        ),
        "{e}"
    );
    // offset + size overflowing u64 is out of bounds, not a wrap-around.
    let e = load_err(&const_past_lens_xml(u64::MAX, 8, "2"), Some(&bin));
    assert!(matches!(e, IrError::ConstOutOfBounds { .. }), "{e}");
}

#[test]
fn const_size_must_match_its_shape() {
    let bin = [0u8; 64];
    let e = load_err(&const_past_lens_xml(0, 12, "2"), Some(&bin));
    assert!(
        matches!(
            e,
            IrError::ConstSize {
                id: 5,
                size: 12,
                ..
            }
        ),
        "{e}"
    );
    // A shape whose byte size overflows is refused before any allocation.
    let e = load_err(
        &const_past_lens_xml(0, 8, "4294967296,4294967296,4"),
        Some(&bin),
    );
    assert!(matches!(e, IrError::ConstSize { .. }), "{e}");
}

#[test]
fn a_missing_bin_names_the_file_and_the_layer() {
    let dir = std::env::temp_dir().join(format!("pa-ir-missing-bin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let xml = dir.join("m.xml");
    std::fs::write(&xml, const_past_lens_xml(0, 8, "2")).unwrap();
    let e = Model::load(&xml).unwrap_err();
    std::fs::remove_dir_all(&dir).ok();
    assert!(matches!(e, IrError::MissingBin { id: 5, .. }), "{e}");
    assert_mentions(&e, &["m.bin"]);
}

#[test]
fn the_seed_example_layer_loads() {
    // The op description's own example: a [-1, 128] trig LUT with head_size 16. It is fed empty,
    // so it must not be rejected before run time.
    let seed = std::fs::read_to_string(
        std::fs::read_dir("/work/shared/seeds")
            .ok()
            .and_then(|mut d| {
                d.find(|e| {
                    e.as_ref()
                        .is_ok_and(|e| e.file_name().to_string_lossy().starts_with("000_"))
                })
            })
            .map(|e| e.unwrap().path())
            .unwrap_or_default(),
    )
    .ok();
    let layer = match seed
        .as_deref()
        .and_then(|s| s.find("<layer id=\"42\"").map(|a| (s, a)))
    {
        Some((s, a)) => {
            let b = s[a..].find("</layer>").unwrap() + a + "</layer>".len();
            s[a..b].to_string()
        }
        None => return, // the seed text is not on this machine; models/seed_example covers it
    };
    let port_dims = |i: usize| -> Vec<i64> {
        match i {
            0..=2 | 14 => vec![-1, 128],
            3 | 4 => vec![-1, 8, 16, 16],
            11 => vec![8],
            13 => vec![-1, 1],
            9 | 10 | 15 => vec![],
            _ => vec![-1],
        }
    };
    let mut layers: Vec<String> = (0..16)
        .map(|i| {
            let int = matches!(i, 5..=8 | 10 | 12 | 13 | 15);
            let (et, prec) = if int { ("i32", "I32") } else { ("f32", "FP32") };
            parameter(100 + i as u64, &format!("in{i}"), et, prec, &port_dims(i))
        })
        .collect();
    layers.push(layer);
    layers.push(result(200, "output", &[-1, 128]));
    layers.push(result(201, "scores", &[-1]));
    let mut edges: Vec<_> = (0..16).map(|i| (100 + i, 0, 42, i)).collect();
    edges.push((42, 16, 200, 0));
    edges.push((42, 17, 201, 0));
    Model::from_xml(&net(&layers, &edges), None).expect("the seed's example layer must load");
}

// ---------------------------------------------------------------------------- execution

fn t_f32(shape: &[usize], seed: u32) -> OwnedTensor {
    let n: usize = shape.iter().product();
    // A deterministic spread of values in [-1, 1).
    let v = (0..n)
        .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 2000) as f32 / 1000.0 - 1.0)
        .collect();
    OwnedTensor::from_f32(shape.to_vec(), v).unwrap()
}

fn t_i32(v: &[i32]) -> OwnedTensor {
    OwnedTensor::from_i32(vec![v.len()], v.to_vec()).unwrap()
}

/// Two sequences: past 2 + 2 new (blocks 3, 0), past 0 + 1 new (block 2); NB = 4.
fn base_inputs() -> Vec<OwnedTensor> {
    vec![
        t_f32(&[3, 8], 1),
        t_f32(&[3, 4], 2),
        t_f32(&[3, 4], 3),
        t_f32(&[4, 1, 2, 4], 4),
        t_f32(&[4, 1, 2, 4], 5),
        t_i32(&[2, 0]),
        t_i32(&[0, 2, 3]),
        t_i32(&[3, 0, 2]),
        t_i32(&[0, 2, 3]),
    ]
}

/// `execute` called directly on copies: (output, scores, key cache, value cache).
fn direct(inputs: &[OwnedTensor]) -> [OwnedTensor; 4] {
    let mut kc = inputs[3].clone();
    let mut vc = inputs[4].clone();
    let mut list: Vec<InputArg> = inputs[..3]
        .iter()
        .map(|t| InputArg::Ref(t.view()))
        .collect();
    list.push(InputArg::Mut(kc.view_mut()));
    list.push(InputArg::Mut(vc.view_mut()));
    list.extend(inputs[5..9].iter().map(|t| InputArg::Ref(t.view())));
    let mut pa = PaInputs::from_list(list).unwrap();
    let mut out = vec![0f32; 3 * 8];
    let mut scores = vec![0f32; 2 + 3];
    let mut o = PaOutputs {
        output: TensorMut::new(&[3, 8], &mut out),
        scores: TensorMut::new(&[5], &mut scores),
    };
    execute(&mut pa, &mut o).unwrap();
    drop(pa);
    [
        OwnedTensor::from_f32(vec![3, 8], out).unwrap(),
        OwnedTensor::from_f32(vec![5], scores).unwrap(),
        kc,
        vc,
    ]
}

fn input_map(inputs: &[OwnedTensor]) -> HashMap<String, OwnedTensor> {
    NAMES
        .iter()
        .zip(inputs)
        .map(|(n, t)| (n.to_string(), t.clone()))
        .collect()
}

#[test]
fn running_an_ir_matches_execute_and_writes_caches_in_place() {
    let m = Model::from_xml(&base_xml(), None).unwrap();
    let inputs = base_inputs();
    let want = direct(&inputs);
    let mut map = input_map(&inputs);
    let out = m.run(&mut map).unwrap();
    assert_eq!(out.results.len(), 2);
    assert_eq!(out.results[0].name, "output");
    assert_eq!(out.pa_output(0), Some(&want[0]));
    assert_eq!(out.pa_output(1), Some(&want[1]));
    assert_eq!(map["key_cache"], want[2], "key cache written in place");
    assert_eq!(map["value_cache"], want[3], "value cache written in place");
    assert_ne!(
        map["key_cache"], inputs[3],
        "the call must have inserted keys"
    );
    assert!(matches!(&out.caches[0].location, CacheLocation::Parameter(n) if n == "key_cache"));
    assert_eq!(out.cache(3, &map), Some(&want[2]));
}

#[test]
fn const_inputs_are_read_from_the_bin() {
    let bin: Vec<u8> = [2i32, 0].iter().flat_map(|v| v.to_le_bytes()).collect();
    let m = Model::from_xml(&const_past_lens_xml(0, 8, "2"), Some(&bin)).unwrap();
    let inputs = base_inputs();
    let want = direct(&inputs);
    let mut map = input_map(&inputs);
    map.remove("past_lens");
    let out = m.run(&mut map).unwrap();
    assert_eq!(out.pa_output(0), Some(&want[0]));
    assert_eq!(out.pa_output(1), Some(&want[1]));
}

#[test]
fn through_a_convert_the_op_writes_a_copy() {
    // key_cache given as f16, converted to f32 before the op.
    let mut layers = base_layers();
    layers[3] = parameter(3, "key_cache", "f16", "FP16", &dims_of(3));
    layers.push(format!(
        r#"<layer id="12" name="kc_convert" type="Convert" version="opset1"><data destination_type="f32"/><input>{}</input><output>{}</output></layer>"#,
        port(0, "FP16", &dims_of(3)),
        port(1, "FP32", &dims_of(3))
    ));
    let mut edges = base_edges();
    edges[3] = (3, 0, 12, 0);
    edges.push((12, 1, 9, 3));
    let m = Model::from_xml(&net(&layers, &edges), None).unwrap();
    assert!(m.parameters()[3].feeds[0].via_convert);

    let mut inputs = base_inputs();
    let kc16 = match inputs[3].data() {
        OwnedData::F32(v) => v.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>(),
        _ => unreachable!(),
    };
    let kc16 = OwnedTensor::new(inputs[3].shape().to_vec(), OwnedData::F16(kc16)).unwrap();
    inputs[3] = kc16.convert(paged_attention::ElemType::F32).unwrap();
    let want = direct(&inputs);
    let mut map = input_map(&inputs);
    map.insert("key_cache".into(), kc16.clone());
    let out = m.run(&mut map).unwrap();
    assert_eq!(out.pa_output(0), Some(&want[0]));
    assert_eq!(
        map["key_cache"], kc16,
        "the caller's f16 cache is not written"
    );
    assert!(matches!(out.caches[0].location, CacheLocation::Copy(_)));
    assert_eq!(
        out.cache(3, &map),
        Some(&want[2]),
        "the converted copy holds the writes"
    );
    assert_eq!(
        map["value_cache"], want[3],
        "the value cache is still in place"
    );
}

#[test]
fn run_checks_its_inputs() {
    let m = Model::from_xml(&base_xml(), None).unwrap();
    let mut map = input_map(&base_inputs());
    map.remove("key");
    let e = m.run(&mut map).unwrap_err();
    assert_mentions(&e, &["key", "no tensor given"]);

    let mut map = input_map(&base_inputs());
    map.insert("query".into(), t_f32(&[3, 7], 0));
    assert_mentions(&m.run(&mut map).unwrap_err(), &["query", "[?,8]"]);

    let mut map = input_map(&base_inputs());
    map.insert("past_lens".into(), t_f32(&[2], 0));
    assert_mentions(&m.run(&mut map).unwrap_err(), &["past_lens", "i32"]);

    let mut map = input_map(&base_inputs());
    map.insert("extra".into(), t_f32(&[2], 0));
    assert_mentions(&m.run(&mut map).unwrap_err(), &["extra", "no Parameter"]);
}

#[test]
fn op_errors_at_run_time_leave_caches_in_the_map() {
    let m = Model::from_xml(&base_xml(), None).unwrap();
    let mut map = input_map(&base_inputs());
    // A block id outside 0..NB.
    map.insert("block_indices".into(), t_i32(&[3, 9, 2]));
    let e = m.run(&mut map).unwrap_err();
    assert!(matches!(e, IrError::Op { id: 9, .. }), "{e}");
    assert_eq!(
        map["key_cache"],
        base_inputs()[3],
        "caches restored unchanged"
    );
    assert!(map.contains_key("value_cache"));
}

#[test]
fn huge_past_lens_fail_cleanly() {
    let m = Model::from_xml(&base_xml(), None).unwrap();
    let mut map = input_map(&base_inputs());
    map.insert("past_lens".into(), t_i32(&[i32::MAX, i32::MAX]));
    assert!(matches!(m.run(&mut map).unwrap_err(), IrError::Op { .. }));
}

#[test]
fn a_const_cache_is_refused_at_load_time() {
    // Issue 11 item 2: the op writes the caches in place; a Const cache is read-only in
    // OpenVINO (SIGSEGV) or a constant silently changed. Refused when the IR loads.
    let mut layers = base_layers();
    layers[3] = format!(
        r#"<layer id="3" name="kc_const" type="Const" version="opset1"><data element_type="f32" shape="2,1,2,4" offset="0" size="64"/><output>{}</output></layer>"#,
        port(0, "FP32", &[2, 1, 2, 4])
    );
    let e = load_err(&net(&layers, &base_edges()), Some(&[0u8; 64]));
    assert_mentions(&e, &["key_cache", "kc_const", "Const", "Parameters"]);
}
