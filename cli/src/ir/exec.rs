//! Running a [`Model`]: each layer in topological order, the op through [`paged_attention::execute`].
//!
//! In-place caches: when a Parameter feeds PagedAttention's input 3 or 4 directly, the op writes
//! into the caller's tensor in the input map, as OpenVINO does with shared buffers. When a
//! Convert (or a Const) sits between, the op writes a converted copy: the caller's tensor is left
//! as it was, and the written copy is returned in [`Outputs::caches`]. The caches to compare
//! after a call are therefore the Parameter's tensor only when no Convert sits between.

use std::collections::HashMap;

use super::error::IrError;
use super::graph::{Kind, Model};
use super::owned::OwnedTensor;
use super::types::fits;
use paged_attention::op::contract::{INPUTS, KEY_CACHE, VALUE_CACHE};
use paged_attention::op::{InputArg, PaInputs, PaOutputs};
use paged_attention::tensor::Tensor;

/// One Result of the model.
#[derive(Clone, Debug, PartialEq)]
pub struct ResultTensor {
    /// The Result layer's name.
    pub name: String,
    pub layer_id: u64,
    /// The PagedAttention output it shows, if one reaches it (directly or through Converts):
    /// `(layer id, output index)`.
    pub pa_output: Option<(u64, usize)>,
    pub tensor: OwnedTensor,
}

/// Where a cache the op wrote can be found after the call.
#[derive(Clone, Debug, PartialEq)]
pub enum CacheLocation {
    /// Written in place in the caller's tensor of this Parameter.
    Parameter(String),
    /// Written into a copy (the input came through a Convert or from a Const).
    Copy(OwnedTensor),
}

/// One cache input (3 or 4) of one PagedAttention layer, after the call.
#[derive(Clone, Debug, PartialEq)]
pub struct CacheAfter {
    pub layer_id: u64,
    /// 3 (`key_cache`) or 4 (`value_cache`).
    pub input: usize,
    pub location: CacheLocation,
}

/// What [`Model::run`] returns.
#[derive(Clone, Debug, PartialEq)]
pub struct Outputs {
    /// In document order of the Result layers.
    pub results: Vec<ResultTensor>,
    pub caches: Vec<CacheAfter>,
}

impl Outputs {
    /// The Result showing output `k` of the first PagedAttention layer that has one.
    pub fn pa_output(&self, k: usize) -> Option<&OwnedTensor> {
        self.results
            .iter()
            .filter(|r| r.pa_output.is_some_and(|(_, o)| o == k))
            .min_by_key(|r| r.pa_output.map(|(id, _)| id))
            .map(|r| &r.tensor)
    }

    /// Cache input `input` (3 or 4) of the first PagedAttention layer after the call, looking
    /// into the caller's map when it was written in place.
    pub fn cache<'a>(
        &'a self,
        input: usize,
        inputs: &'a HashMap<String, OwnedTensor>,
    ) -> Option<&'a OwnedTensor> {
        let c = self
            .caches
            .iter()
            .filter(|c| c.input == input)
            .min_by_key(|c| c.layer_id)?;
        match &c.location {
            CacheLocation::Parameter(name) => inputs.get(name),
            CacheLocation::Copy(t) => Some(t),
        }
    }
}

/// A value flowing along an edge.
enum Value {
    /// The caller's tensor of this Parameter.
    Param(String),
    /// Data of this Const layer (by layer index).
    Const(usize),
    Owned(OwnedTensor),
}

/// A cache taken out of its home for the op to write, and where it goes back.
enum Taken {
    Param(String, OwnedTensor),
    Owned(usize, usize, OwnedTensor),
    Copy(OwnedTensor),
}

impl Taken {
    fn tensor(&mut self) -> &mut OwnedTensor {
        match self {
            Taken::Param(_, t) | Taken::Owned(_, _, t) | Taken::Copy(t) => t,
        }
    }
}

impl Model {
    /// Runs the model. `inputs` maps each Parameter's name to its tensor; caches fed directly by
    /// a Parameter are written in place there (see the module comment for Converts).
    pub fn run(&self, inputs: &mut HashMap<String, OwnedTensor>) -> Result<Outputs, IrError> {
        self.check_inputs(inputs)?;
        let mut values: Vec<Vec<Option<Value>>> = self
            .layers
            .iter()
            .map(|l| l.outputs.iter().map(|_| None).collect())
            .collect();
        let mut out = Outputs {
            results: Vec::new(),
            caches: Vec::new(),
        };
        for &i in &self.order {
            let l = &self.layers[i];
            match &l.kind {
                Kind::Parameter { .. } => values[i][0] = Some(Value::Param(l.name.clone())),
                Kind::Const(_) => values[i][0] = Some(Value::Const(i)),
                Kind::Convert { to } => {
                    let src = self.view(&values, l.sources[0], inputs, i)?;
                    let t = OwnedTensor::from_view(&src)
                        .and_then(|t| t.convert(*to))
                        .map_err(|e| IrError::layer(l.id, &l.name, e.to_string()))?;
                    values[i][0] = Some(Value::Owned(t));
                }
                Kind::Result => {
                    let t = OwnedTensor::from_view(&self.view(&values, l.sources[0], inputs, i)?)
                        .map_err(|e| IrError::layer(l.id, &l.name, e.to_string()))?;
                    out.results.push(ResultTensor {
                        name: l.name.clone(),
                        layer_id: l.id,
                        pa_output: self.pa_source(l.sources[0]),
                        tensor: t,
                    });
                }
                Kind::PagedAttention => {
                    let [o0, o1] = self.run_pa(i, &mut values, inputs, &mut out)?;
                    values[i][0] = Some(Value::Owned(o0));
                    values[i][1] = Some(Value::Owned(o1));
                }
            }
        }
        // Results in document order, whatever the execution order was.
        let pos: HashMap<u64, usize> = self
            .results
            .iter()
            .enumerate()
            .map(|(k, &i)| (self.layers[i].id, k))
            .collect();
        out.results.sort_by_key(|r| pos.get(&r.layer_id).copied());
        Ok(out)
    }

    fn check_inputs(&self, inputs: &HashMap<String, OwnedTensor>) -> Result<(), IrError> {
        for p in &self.params {
            let t = inputs.get(&p.name).ok_or_else(|| IrError::Input {
                name: p.name.clone(),
                detail: format!("no tensor given for Parameter layer {}", p.layer_id),
            })?;
            if t.elem_type() != p.elem || !fits(t.shape(), &p.shape) {
                return Err(IrError::Input {
                    name: p.name.clone(),
                    detail: format!(
                        "Parameter layer {} is {} {}, but the tensor given is {} {:?}",
                        p.layer_id,
                        p.elem,
                        p.shape,
                        t.elem_type(),
                        t.shape()
                    ),
                });
            }
        }
        if let Some(extra) = inputs
            .keys()
            .find(|k| !self.params.iter().any(|p| &p.name == *k))
        {
            let names: Vec<&str> = self.params.iter().map(|p| p.name.as_str()).collect();
            return Err(IrError::Input {
                name: extra.clone(),
                detail: format!(
                    "the model has no Parameter of that name (it has: {})",
                    names.join(", ")
                ),
            });
        }
        Ok(())
    }

    /// The PagedAttention output reaching `src`, through Converts.
    fn pa_source(&self, mut src: (usize, usize)) -> Option<(u64, usize)> {
        loop {
            let l = &self.layers[src.0];
            match l.kind {
                Kind::PagedAttention => return Some((l.id, src.1)),
                Kind::Convert { .. } => src = l.sources[0],
                _ => return None,
            }
        }
    }

    /// A read-only view of the value produced at `src`, for layer `user`.
    fn view<'a>(
        &'a self,
        values: &'a [Vec<Option<Value>>],
        src: (usize, usize),
        inputs: &'a HashMap<String, OwnedTensor>,
        user: usize,
    ) -> Result<Tensor<'a>, IrError> {
        let l = &self.layers[user];
        let missing = |what: &str| {
            IrError::layer(
                l.id,
                &l.name,
                format!(
                    "the value from layer {} is not available ({what})",
                    self.layers[src.0].id
                ),
            )
        };
        match values[src.0].get(src.1).and_then(Option::as_ref) {
            Some(Value::Param(name)) => inputs.get(name).map(OwnedTensor::view).ok_or_else(|| {
                missing("its Parameter is also a cache this layer writes; a cache must be its own buffer")
            }),
            Some(Value::Const(c)) => match &self.layers[*c].kind {
                Kind::Const(t) => Ok(t.view()),
                _ => Err(missing("not a Const")),
            },
            Some(Value::Owned(t)) => Ok(t.view()),
            None => Err(missing("it is also a cache this layer writes; a cache must be its own buffer")),
        }
    }

    /// Takes cache input `k` of layer `i` out of its home so the op can write it.
    fn take_cache(
        &self,
        i: usize,
        k: usize,
        values: &mut [Vec<Option<Value>>],
        inputs: &mut HashMap<String, OwnedTensor>,
    ) -> Result<Taken, IrError> {
        let l = &self.layers[i];
        let (s, p) = l.sources[k];
        let shared = || {
            IrError::layer(
                l.id,
                &l.name,
                format!(
                    "input {k} (`{}`) shares its buffer with another cache input; each cache must be its own buffer",
                    INPUTS[k].name
                ),
            )
        };
        match values[s].get_mut(p).and_then(Option::take) {
            Some(Value::Param(name)) => {
                let t = inputs.remove(&name).ok_or_else(shared)?;
                values[s][p] = Some(Value::Param(name.clone()));
                Ok(Taken::Param(name, t))
            }
            Some(Value::Const(c)) => {
                values[s][p] = Some(Value::Const(c));
                match &self.layers[c].kind {
                    Kind::Const(t) => Ok(Taken::Copy(t.clone())),
                    _ => Err(shared()),
                }
            }
            Some(Value::Owned(t)) => Ok(Taken::Owned(s, p, t)),
            None => Err(shared()),
        }
    }

    fn run_pa(
        &self,
        i: usize,
        values: &mut [Vec<Option<Value>>],
        inputs: &mut HashMap<String, OwnedTensor>,
        out: &mut Outputs,
    ) -> Result<[OwnedTensor; 2], IrError> {
        let l = &self.layers[i];
        let mut kc = self.take_cache(i, KEY_CACHE, values, inputs)?;
        let vc = self.take_cache(i, VALUE_CACHE, values, inputs);
        let mut vc = match vc {
            Ok(v) => v,
            Err(e) => {
                restore(kc, values, inputs);
                return Err(e);
            }
        };
        let res = self.call_op(i, values, inputs, kc.tensor(), vc.tensor());
        for (k, taken) in [(KEY_CACHE, kc), (VALUE_CACHE, vc)] {
            let location = match &taken {
                Taken::Param(name, _) => CacheLocation::Parameter(name.clone()),
                Taken::Owned(_, _, t) | Taken::Copy(t) => CacheLocation::Copy(t.clone()),
            };
            if res.is_ok() {
                out.caches.push(CacheAfter {
                    layer_id: l.id,
                    input: k,
                    location,
                });
            }
            restore(taken, values, inputs);
        }
        res
    }

    fn call_op(
        &self,
        i: usize,
        values: &[Vec<Option<Value>>],
        inputs: &HashMap<String, OwnedTensor>,
        kc: &mut OwnedTensor,
        vc: &mut OwnedTensor,
    ) -> Result<[OwnedTensor; 2], IrError> {
        let l = &self.layers[i];
        let op_err = |source| IrError::Op {
            id: l.id,
            name: l.name.clone(),
            source,
        };
        let mut list = Vec::with_capacity(l.sources.len());
        let (mut kc, mut vc) = (Some(kc.view_mut()), Some(vc.view_mut()));
        for (k, &src) in l.sources.iter().enumerate() {
            list.push(match k {
                KEY_CACHE => InputArg::Mut(
                    kc.take()
                        .ok_or_else(|| IrError::layer(l.id, &l.name, "key_cache taken twice"))?,
                ),
                VALUE_CACHE => InputArg::Mut(
                    vc.take()
                        .ok_or_else(|| IrError::layer(l.id, &l.name, "value_cache taken twice"))?,
                ),
                _ => InputArg::Ref(self.view(values, src, inputs, i)?),
            });
        }
        let mut pa = PaInputs::from_list(list).map_err(op_err)?;
        // Validate before allocating: the outputs' sizes come from input values (past_lens).
        let plan = paged_attention::op::validate(&pa).map_err(op_err)?;
        let [s0, s1] = plan.output_shapes();
        let alloc = |shape: Vec<usize>| {
            OwnedTensor::zeros(plan.query_type, shape)
                .map_err(|e| IrError::layer(l.id, &l.name, format!("output: {e}")))
        };
        let (mut o0, mut o1) = (alloc(s0)?, alloc(s1)?);
        let mut outs = PaOutputs {
            output: o0.view_mut(),
            scores: o1.view_mut(),
        };
        paged_attention::execute(&mut pa, &mut outs).map_err(op_err)?;
        Ok([o0, o1])
    }
}

fn restore(
    taken: Taken,
    values: &mut [Vec<Option<Value>>],
    inputs: &mut HashMap<String, OwnedTensor>,
) {
    match taken {
        Taken::Param(name, t) => {
            inputs.insert(name, t);
        }
        Taken::Owned(s, p, t) => values[s][p] = Some(Value::Owned(t)),
        Taken::Copy(_) => {}
    }
}
