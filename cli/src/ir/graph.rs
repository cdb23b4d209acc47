//! From a parsed IR to a checked [`Model`]: layer kinds, Const data out of the `.bin`, edges
//! resolved and checked, a topological order, and shape inference through the op.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::error::IrError;
use super::owned::OwnedTensor;
use super::types::{compatible, parse_dim, parse_shape_attr, IrType};
use super::xml::{parse_net, RawLayer, RawNet, RawPort};
use paged_attention::dtype::ElemType;
use paged_attention::op::contract::{
    INPUTS, KEY_CACHE, MAX_INPUTS, MIN_INPUTS, NUM_OUTPUTS, PAST_LENS, VALUE_CACHE,
};
use paged_attention::op::{infer_shapes_with_past_lens, PartialInput, PartialShape};
use paged_attention::tensor::shape_elems;

/// The op's type and opset as they appear in an IR.
pub const PA_TYPE: &str = "PagedAttention";
pub const PA_VERSION: &str = "ie_internal_opset";

/// One port of a layer.
#[derive(Clone, Debug, PartialEq)]
pub struct Port {
    pub id: u64,
    pub ty: IrType,
    pub shape: PartialShape,
}

/// What a layer does.
#[derive(Clone, Debug, PartialEq)]
pub enum Kind {
    Parameter { elem: ElemType, shape: PartialShape },
    Const(OwnedTensor),
    Convert { to: ElemType },
    PagedAttention,
    Result,
}

/// A layer with its ports and, per input port, the producer `(layer index, output position)`.
#[derive(Clone, Debug, PartialEq)]
pub struct Layer {
    pub id: u64,
    pub name: String,
    pub kind: Kind,
    pub inputs: Vec<Port>,
    pub outputs: Vec<Port>,
    pub sources: Vec<(usize, usize)>,
}

/// One PagedAttention input a Parameter feeds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PaFeed {
    /// IR id of the PagedAttention layer.
    pub layer_id: u64,
    /// Input index of the op (SPEC order).
    pub input: usize,
    /// The op's name for that input (`key_cache`...).
    pub input_name: &'static str,
    /// A Convert sits between the Parameter and the op: the op reads (and, for caches, writes)
    /// a converted copy, not the caller's tensor.
    pub via_convert: bool,
}

/// A model input.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamInfo {
    /// The layer's `name`: the key of [`super::Model::run`]'s input map.
    pub name: String,
    /// Position among the Parameters, in document order.
    pub index: usize,
    pub layer_id: u64,
    pub elem: ElemType,
    pub shape: PartialShape,
    /// The PagedAttention inputs it reaches (directly or through Converts).
    pub feeds: Vec<PaFeed>,
}

/// A loaded, checked IR.
#[derive(Clone, Debug)]
pub struct Model {
    pub name: String,
    /// IR version (10 or 11).
    pub version: u32,
    pub(crate) layers: Vec<Layer>,
    /// Layer indices in an order where every producer precedes its consumers.
    pub(crate) order: Vec<usize>,
    pub(crate) params: Vec<ParamInfo>,
    /// Indices of the Result layers in document order.
    pub(crate) results: Vec<usize>,
}

/// Where Const data comes from.
enum Weights<'a> {
    File {
        path: PathBuf,
        data: Option<Vec<u8>>,
    },
    Bytes(&'a [u8]),
    None,
}

impl Weights<'_> {
    fn get(&mut self, id: u64) -> Result<&[u8], IrError> {
        match self {
            Weights::Bytes(b) => Ok(b),
            Weights::None => Err(IrError::MissingBin {
                path: PathBuf::from("(none given)"),
                id,
                source: std::io::Error::new(std::io::ErrorKind::NotFound, "no weights given"),
            }),
            Weights::File { path, data } => {
                if data.is_none() {
                    let bytes = std::fs::read(&*path).map_err(|source| IrError::MissingBin {
                        path: path.clone(),
                        id,
                        source,
                    })?;
                    *data = Some(bytes);
                }
                Ok(data.as_deref().unwrap_or_default())
            }
        }
    }
}

fn port_of(l: &RawLayer, p: &RawPort) -> Result<Port, IrError> {
    let ty = match &p.precision {
        None => IrType::Dynamic,
        Some(s) => IrType::parse(s).ok_or_else(|| IrError::Precision {
            id: l.id,
            port: p.id.to_string(),
            found: s.clone(),
        })?,
    };
    let dims = p
        .dims
        .iter()
        .map(|d| {
            parse_dim(d).ok_or_else(|| {
                IrError::layer(
                    l.id,
                    &l.name,
                    format!("port {}: dimension `{d}` is not an integer >= -1", p.id),
                )
            })
        })
        .collect::<Result<Vec<i64>, IrError>>()?;
    Ok(Port {
        id: p.id,
        ty,
        shape: PartialShape(Some(dims)),
    })
}

fn data_str<'a>(l: &'a RawLayer, key: &str) -> Result<&'a str, IrError> {
    l.data_attr(key)
        .ok_or_else(|| IrError::layer(l.id, &l.name, format!("<data> has no `{key}` attribute")))
}

fn data_u64(l: &RawLayer, key: &str) -> Result<u64, IrError> {
    let s = data_str(l, key)?;
    s.trim().parse::<u64>().map_err(|_| {
        IrError::layer(
            l.id,
            &l.name,
            format!("<data> `{key}` = \"{s}\" is not a non-negative integer"),
        )
    })
}

/// An element type attribute of `<data>` that the executor can run.
fn data_elem(l: &RawLayer, key: &str) -> Result<ElemType, IrError> {
    let s = data_str(l, key)?;
    let ty = IrType::parse(s).ok_or_else(|| IrError::Precision {
        id: l.id,
        port: format!("<data {key}>"),
        found: s.to_string(),
    })?;
    ty.elem().ok_or_else(|| {
        IrError::layer(
            l.id,
            &l.name,
            format!("{key} {ty} is not supported by this executor (f32, f16, bf16 and i32 are)"),
        )
    })
}

fn port_counts(l: &RawLayer, ins: (usize, usize), outs: usize) -> Result<(), IrError> {
    let (n_in, n_out) = (l.inputs.len(), l.outputs.len());
    if n_in < ins.0 || n_in > ins.1 || n_out != outs {
        let want_in = if ins.0 == ins.1 {
            ins.0.to_string()
        } else {
            format!("{} to {}", ins.0, ins.1)
        };
        return Err(IrError::layer(
            l.id,
            &l.name,
            format!(
                "{} takes {want_in} input(s) and {outs} output(s), but the layer has {n_in} and {n_out}",
                l.ty
            ),
        ));
    }
    Ok(())
}

fn check_port_type(l: &RawLayer, port: &Port, elem: ElemType) -> Result<(), IrError> {
    if port.ty != IrType::Dynamic && port.ty != IrType::from(elem) {
        return Err(IrError::layer(
            l.id,
            &l.name,
            format!(
                "output port {} has precision {}, but the layer produces {elem}",
                port.id, port.ty
            ),
        ));
    }
    Ok(())
}

fn const_tensor(l: &RawLayer, weights: &mut Weights<'_>) -> Result<OwnedTensor, IrError> {
    let elem = data_elem(l, "element_type")?;
    let shape_s = data_str(l, "shape")?;
    let shape: Vec<usize> = parse_shape_attr(shape_s)
        .filter(|s| s.is_static())
        .and_then(|s| s.0)
        .map(|d| d.into_iter().map(|v| v as usize).collect())
        .ok_or_else(|| {
            IrError::layer(
                l.id,
                &l.name,
                format!("Const shape \"{shape_s}\" is not a static shape"),
            )
        })?;
    let offset = data_u64(l, "offset")?;
    let size = data_u64(l, "size")?;
    let bin = weights.get(l.id)?;
    let bin_len = bin.len() as u64;
    let end =
        offset
            .checked_add(size)
            .filter(|&e| e <= bin_len)
            .ok_or(IrError::ConstOutOfBounds {
                id: l.id,
                name: l.name.clone(),
                offset,
                size,
                bin_len,
            })?;
    let expected = shape_elems(&shape).and_then(|n| elem.bytes_for(n));
    if expected.map(|e| e as u64) != Some(size) {
        return Err(IrError::ConstSize {
            id: l.id,
            name: l.name.clone(),
            size,
            shape,
            elem: elem.to_string(),
            expected: expected.map_or_else(|| "more than addressable".into(), |e| e.to_string()),
        });
    }
    // Both bounds are within the slice (checked above), and the slice's length is `size`.
    let bytes = &bin[offset as usize..end as usize];
    OwnedTensor::from_le_bytes(elem, shape, bytes)
        .map_err(|e| IrError::layer(l.id, &l.name, e.to_string()))
}

fn layer_of(l: &RawLayer, weights: &mut Weights<'_>) -> Result<Layer, IrError> {
    let inputs = l
        .inputs
        .iter()
        .map(|p| port_of(l, p))
        .collect::<Result<Vec<_>, _>>()?;
    let outputs = l
        .outputs
        .iter()
        .map(|p| port_of(l, p))
        .collect::<Result<Vec<_>, _>>()?;
    let mut seen = std::collections::HashSet::new();
    for p in inputs.iter().chain(&outputs) {
        if !seen.insert(p.id) {
            return Err(IrError::layer(
                l.id,
                &l.name,
                format!("port id {} is used twice", p.id),
            ));
        }
    }
    let kind = match l.ty.as_str() {
        "Parameter" => {
            port_counts(l, (0, 0), 1)?;
            let elem = data_elem(l, "element_type")?;
            let s = data_str(l, "shape")?;
            let shape = parse_shape_attr(s).ok_or_else(|| {
                IrError::layer(
                    l.id,
                    &l.name,
                    format!("Parameter shape \"{s}\" does not parse"),
                )
            })?;
            check_port_type(l, &outputs[0], elem)?;
            if !compatible(&shape, &outputs[0].shape) {
                return Err(IrError::layer(
                    l.id,
                    &l.name,
                    format!(
                        "Parameter shape {shape} contradicts its output port {}",
                        outputs[0].shape
                    ),
                ));
            }
            Kind::Parameter { elem, shape }
        }
        "Const" => {
            port_counts(l, (0, 0), 1)?;
            let t = const_tensor(l, weights)?;
            check_port_type(l, &outputs[0], t.elem_type())?;
            if !compatible(&PartialShape::from_static(t.shape()), &outputs[0].shape) {
                return Err(IrError::layer(
                    l.id,
                    &l.name,
                    format!(
                        "Const shape {:?} contradicts its output port {}",
                        t.shape(),
                        outputs[0].shape
                    ),
                ));
            }
            Kind::Const(t)
        }
        "Convert" => {
            port_counts(l, (1, 1), 1)?;
            let to = data_elem(l, "destination_type")?;
            check_port_type(l, &outputs[0], to)?;
            Kind::Convert { to }
        }
        "Result" => {
            port_counts(l, (1, 1), 0)?;
            Kind::Result
        }
        PA_TYPE if l.version == PA_VERSION => {
            port_counts(l, (MIN_INPUTS, MAX_INPUTS), NUM_OUTPUTS)?;
            Kind::PagedAttention
        }
        _ => {
            return Err(IrError::UnknownType {
                id: l.id,
                name: l.name.clone(),
                ty: l.ty.clone(),
                version: l.version.clone(),
            })
        }
    };
    Ok(Layer {
        id: l.id,
        name: l.name.clone(),
        kind,
        inputs,
        outputs,
        sources: Vec::new(),
    })
}

impl Model {
    /// Reads `xml_path` and the `.bin` beside it (same stem). The `.bin` is read only if a
    /// Const layer needs it.
    pub fn load(xml_path: impl AsRef<Path>) -> Result<Model, IrError> {
        let path = xml_path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| IrError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        let mut w = Weights::File {
            path: path.with_extension("bin"),
            data: None,
        };
        Self::build(parse_net(&text)?, &mut w)
    }

    /// Builds a model from IR text and the weights' bytes (`None`: there is no `.bin`).
    pub fn from_xml(xml: &str, bin: Option<&[u8]>) -> Result<Model, IrError> {
        let mut w = match bin {
            Some(b) => Weights::Bytes(b),
            None => Weights::None,
        };
        Self::build(parse_net(xml)?, &mut w)
    }

    fn build(net: RawNet, weights: &mut Weights<'_>) -> Result<Model, IrError> {
        let mut index: HashMap<u64, usize> = HashMap::new();
        for (i, l) in net.layers.iter().enumerate() {
            if index.insert(l.id, i).is_some() {
                return Err(IrError::Structure {
                    detail: format!("two layers have id {}", l.id),
                });
            }
        }
        let mut layers = net
            .layers
            .iter()
            .map(|l| layer_of(l, weights))
            .collect::<Result<Vec<_>, _>>()?;
        let mut sources: Vec<Vec<Option<(usize, usize)>>> =
            layers.iter().map(|l| vec![None; l.inputs.len()]).collect();
        for e in &net.edges {
            let err = |detail: String| IrError::Edge {
                from_layer: e.from_layer,
                from_port: e.from_port,
                to_layer: e.to_layer,
                to_port: e.to_port,
                detail,
            };
            let &fl = index
                .get(&e.from_layer)
                .ok_or_else(|| err(format!("from-layer {} does not exist", e.from_layer)))?;
            let &tl = index
                .get(&e.to_layer)
                .ok_or_else(|| err(format!("to-layer {} does not exist", e.to_layer)))?;
            let (src, dst) = (&layers[fl], &layers[tl]);
            let out_pos = src.outputs.iter().position(|p| p.id == e.from_port);
            let Some(out_pos) = out_pos else {
                return Err(err(if src.inputs.iter().any(|p| p.id == e.from_port) {
                    format!("port {} of layer {} is an input port; an edge must leave from an output port", e.from_port, e.from_layer)
                } else {
                    format!("layer {} has no port {}", e.from_layer, e.from_port)
                }));
            };
            let in_pos = dst.inputs.iter().position(|p| p.id == e.to_port);
            let Some(in_pos) = in_pos else {
                return Err(err(if dst.outputs.iter().any(|p| p.id == e.to_port) {
                    format!(
                        "port {} of layer {} is an output port; an edge must end at an input port",
                        e.to_port, e.to_layer
                    )
                } else {
                    format!("layer {} has no port {}", e.to_layer, e.to_port)
                }));
            };
            if let Some((pl, pp)) = sources[tl][in_pos] {
                return Err(err(format!(
                    "input port {} of layer {} already has a producer (layer {} port {})",
                    e.to_port, e.to_layer, layers[pl].id, layers[pl].outputs[pp].id
                )));
            }
            let (a, b) = (&src.outputs[out_pos], &dst.inputs[in_pos]);
            if a.ty != IrType::Dynamic && b.ty != IrType::Dynamic && a.ty != b.ty {
                return Err(err(format!(
                    "precision {} at the source but {} at the destination",
                    a.ty, b.ty
                )));
            }
            if !compatible(&a.shape, &b.shape) {
                return Err(err(format!(
                    "shape {} at the source but {} at the destination",
                    a.shape, b.shape
                )));
            }
            sources[tl][in_pos] = Some((fl, out_pos));
        }
        for (l, srcs) in layers.iter_mut().zip(sources) {
            l.sources = srcs
                .into_iter()
                .enumerate()
                .map(|(i, s)| {
                    s.ok_or_else(|| {
                        IrError::layer(
                            l.id,
                            &l.name,
                            format!("input port {} has no incoming edge", l.inputs[i].id),
                        )
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
        }
        let order = topo_order(&layers)?;
        for &i in &order {
            infer_layer(&layers, i)?;
        }
        let params = param_infos(&layers);
        let results = (0..layers.len())
            .filter(|&i| layers[i].kind == Kind::Result)
            .collect();
        Ok(Model {
            name: net.name,
            version: net.version,
            layers,
            order,
            params,
            results,
        })
    }

    /// The model's inputs, in document order.
    pub fn parameters(&self) -> &[ParamInfo] {
        &self.params
    }

    /// The layers, in document order.
    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }
}

/// Kahn's algorithm in document order, so the order is deterministic.
fn topo_order(layers: &[Layer]) -> Result<Vec<usize>, IrError> {
    let n = layers.len();
    let mut pending: Vec<usize> = layers.iter().map(|l| l.sources.len()).collect();
    let mut consumers: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, l) in layers.iter().enumerate() {
        for &(s, _) in &l.sources {
            consumers[s].push(i);
        }
    }
    let mut ready: std::collections::VecDeque<usize> =
        (0..n).filter(|&i| pending[i] == 0).collect();
    let mut order = Vec::with_capacity(n);
    while let Some(i) = ready.pop_front() {
        order.push(i);
        for &c in &consumers[i] {
            pending[c] -= 1;
            if pending[c] == 0 {
                ready.push_back(c);
            }
        }
    }
    if order.len() != n {
        let stuck = (0..n).find(|&i| pending[i] > 0).unwrap_or(0);
        return Err(IrError::Structure {
            detail: format!("the graph has a cycle through layer {}", layers[stuck].id),
        });
    }
    Ok(order)
}

/// The element type and shape a layer's output position carries.
fn out_port(layers: &[Layer], (l, p): (usize, usize)) -> &Port {
    &layers[l].outputs[p]
}

/// Checks a layer's declared outputs against what its inputs imply.
fn infer_layer(layers: &[Layer], i: usize) -> Result<(), IrError> {
    let l = &layers[i];
    match &l.kind {
        Kind::Convert { to } => {
            let src = out_port(layers, l.sources[0]);
            let from_ok = match src.ty {
                IrType::Dynamic => true,
                t => t.elem().is_some_and(|e| e.is_float() == to.is_float()),
            };
            if !from_ok {
                return Err(IrError::layer(
                    l.id,
                    &l.name,
                    format!("Convert from {} to {to} is not supported (f32/f16/bf16 among themselves, and i32 to i32)", src.ty),
                ));
            }
            if !compatible(&src.shape, &l.outputs[0].shape) {
                return Err(IrError::layer(
                    l.id,
                    &l.name,
                    format!(
                        "output port {} has shape {}, but the input's shape is {}",
                        l.outputs[0].id, l.outputs[0].shape, src.shape
                    ),
                ));
            }
        }
        Kind::PagedAttention => {
            // The caches are written in place: a Const (directly or through Converts) would be
            // a read-only mapping of the weights in OpenVINO, or a constant silently changed.
            for k in [KEY_CACHE, VALUE_CACHE] {
                let mut at = l.sources[k].0;
                while let Kind::Convert { .. } = layers[at].kind {
                    at = layers[at].sources[0].0;
                }
                if let Kind::Const(_) = layers[at].kind {
                    return Err(IrError::layer(
                        l.id,
                        &l.name,
                        format!(
                            "input {k} (`{}`) comes from the Const layer `{}`; the op writes the caches in place, so they must be model inputs (Parameters)",
                            INPUTS[k].name, layers[at].name
                        ),
                    ));
                }
            }
            let mut partial = Vec::with_capacity(l.sources.len());
            for (k, &s) in l.sources.iter().enumerate() {
                let p = out_port(layers, s);
                let elem = match p.ty {
                    IrType::Dynamic => None,
                    t => Some(t.elem().ok_or_else(|| {
                        IrError::layer(
                            l.id,
                            &l.name,
                            format!(
                                "input {k} (`{}`) has element type {t}; PagedAttention takes f32, f16, bf16 or i32",
                                INPUTS[k].name
                            ),
                        )
                    })?),
                };
                partial.push(PartialInput::new(elem, p.shape.clone()));
            }
            let past_lens = match &layers[l.sources[PAST_LENS].0].kind {
                Kind::Const(t) => t.view().as_i32(),
                _ => None,
            };
            let inferred =
                infer_shapes_with_past_lens(&partial, past_lens).map_err(|source| IrError::Op {
                    id: l.id,
                    name: l.name.clone(),
                    source,
                })?;
            for (k, info) in inferred.iter().enumerate() {
                let port = &l.outputs[k];
                let ty_ok = match (port.ty, info.elem) {
                    (IrType::Dynamic, _) | (_, None) => true,
                    (t, Some(e)) => t == IrType::from(e),
                };
                if !ty_ok || !compatible(&port.shape, &info.shape) {
                    return Err(IrError::layer(
                        l.id,
                        &l.name,
                        format!(
                            "output port {} is declared {} {}, but shape inference gives {} {}",
                            port.id,
                            port.ty,
                            port.shape,
                            info.elem.map_or("dynamic", |e| e.name()),
                            info.shape
                        ),
                    ));
                }
            }
        }
        Kind::Parameter { .. } | Kind::Const(_) | Kind::Result => {}
    }
    Ok(())
}

fn param_infos(layers: &[Layer]) -> Vec<ParamInfo> {
    let mut consumers: Vec<Vec<(usize, usize)>> = vec![Vec::new(); layers.len()];
    for (i, l) in layers.iter().enumerate() {
        for (k, &(s, _)) in l.sources.iter().enumerate() {
            consumers[s].push((i, k));
        }
    }
    let mut out = Vec::new();
    for (i, l) in layers.iter().enumerate() {
        let Kind::Parameter { elem, shape } = &l.kind else {
            continue;
        };
        let mut feeds = Vec::new();
        // (layer, reached through a Convert); Convert chains are short, and the graph is acyclic.
        let mut stack = vec![(i, false)];
        while let Some((at, via)) = stack.pop() {
            for &(c, k) in &consumers[at] {
                match layers[c].kind {
                    Kind::PagedAttention => feeds.push(PaFeed {
                        layer_id: layers[c].id,
                        input: k,
                        input_name: INPUTS[k].name,
                        via_convert: via,
                    }),
                    Kind::Convert { .. } => stack.push((c, true)),
                    _ => {}
                }
            }
        }
        feeds.sort_by_key(|f| (f.layer_id, f.input));
        out.push(ParamInfo {
            name: l.name.clone(),
            index: out.len(),
            layer_id: l.id,
            elem: *elem,
            shape: shape.clone(),
            feeds,
        });
    }
    out
}
