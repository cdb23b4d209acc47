//! The IR document as plain data: a small element tree built with `quick-xml`, then read into
//! [`RawNet`] (layers, ports, `<data>` attributes, edges) without interpreting layer types.
//! `<rt_info>` subtrees are skipped wherever they appear; unknown elements are ignored.

use quick_xml::events::{BytesStart, Event};
use quick_xml::Reader;

use super::error::IrError;

/// Deepest element nesting accepted. IRs nest 6 levels (`net/layers/layer/output/port/dim`);
/// the cap keeps a hostile document from building a tree too deep to drop on the stack.
const MAX_DEPTH: usize = 64;

#[derive(Debug, Default)]
struct Element {
    name: String,
    attrs: Vec<(String, String)>,
    children: Vec<Element>,
    text: String,
    /// Byte offset of the start tag, for messages.
    pos: u64,
}

impl Element {
    fn attr(&self, key: &str) -> Option<&str> {
        self.attrs
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
    fn children<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Element> + 'a {
        self.children.iter().filter(move |c| c.name == name)
    }
    fn child<'a>(&'a self, name: &'a str) -> Option<&'a Element> {
        self.children(name).next()
    }
}

fn xml_err(reader: &Reader<&[u8]>, e: impl std::fmt::Display) -> IrError {
    IrError::Xml {
        pos: reader.error_position().max(reader.buffer_position()),
        detail: e.to_string(),
    }
}

fn start_element(reader: &Reader<&[u8]>, e: &BytesStart<'_>) -> Result<Element, IrError> {
    let name = String::from_utf8_lossy(e.name().as_ref()).into_owned();
    let mut attrs = Vec::new();
    // quick-xml's duplicate check compares each attribute with all before it (quadratic in the
    // attributes of an element: 200,000 took 75 s); a hash set does it in linear time.
    let mut seen = std::collections::HashSet::new();
    for a in e.attributes().with_checks(false) {
        let a = a.map_err(|err| xml_err(reader, format!("in <{name}>: {err}")))?;
        let key = String::from_utf8_lossy(a.key.as_ref()).into_owned();
        if !seen.insert(key.clone()) {
            return Err(xml_err(
                reader,
                format!("in <{name}>: duplicate attribute `{key}`"),
            ));
        }
        let value = a
            .unescape_value()
            .map_err(|err| xml_err(reader, format!("attribute `{key}` of <{name}>: {err}")))?
            .into_owned();
        attrs.push((key, value));
    }
    Ok(Element {
        name,
        attrs,
        pos: reader.buffer_position(),
        ..Default::default()
    })
}

/// Parses the document into its root element.
fn parse_tree(text: &str) -> Result<Element, IrError> {
    let mut reader = Reader::from_str(text);
    reader.config_mut().trim_text(true);
    let mut stack: Vec<Element> = Vec::new();
    let mut root: Option<Element> = None;
    let attach = |stack: &mut Vec<Element>,
                  root: &mut Option<Element>,
                  el: Element,
                  reader: &Reader<&[u8]>|
     -> Result<(), IrError> {
        match stack.last_mut() {
            Some(parent) => parent.children.push(el),
            None if root.is_none() => *root = Some(el),
            None => {
                return Err(xml_err(
                    reader,
                    format!("a second root element <{}> after <net>", el.name),
                ))
            }
        }
        Ok(())
    };
    loop {
        let ev = reader.read_event().map_err(|e| xml_err(&reader, e))?;
        match ev {
            Event::Start(e) => {
                if e.name().as_ref() == b"rt_info" {
                    reader
                        .read_to_end(e.name())
                        .map_err(|err| xml_err(&reader, err))?;
                    continue;
                }
                if stack.len() >= MAX_DEPTH {
                    return Err(xml_err(
                        &reader,
                        format!("elements nested deeper than {MAX_DEPTH} levels"),
                    ));
                }
                let el = start_element(&reader, &e)?;
                stack.push(el);
            }
            Event::Empty(e) => {
                if e.name().as_ref() == b"rt_info" {
                    continue;
                }
                let el = start_element(&reader, &e)?;
                attach(&mut stack, &mut root, el, &reader)?;
            }
            Event::End(_) => {
                // quick-xml has already checked that the end name matches.
                let el = stack
                    .pop()
                    .ok_or_else(|| xml_err(&reader, "closing tag without an opening tag"))?;
                attach(&mut stack, &mut root, el, &reader)?;
            }
            Event::Text(t) => {
                if let Some(top) = stack.last_mut() {
                    let s = t.decode().map_err(|e| xml_err(&reader, e))?;
                    top.text.push_str(&s);
                } else if !t.iter().all(u8::is_ascii_whitespace) {
                    return Err(xml_err(&reader, "text outside the root element"));
                }
            }
            Event::CData(t) => {
                if let Some(top) = stack.last_mut() {
                    top.text.push_str(&String::from_utf8_lossy(&t));
                }
            }
            Event::GeneralRef(r) => {
                if let Some(top) = stack.last_mut() {
                    // Only <dim> text is read, and it holds digits; keep the reference visible.
                    top.text.push('&');
                    top.text.push_str(&String::from_utf8_lossy(&r));
                    top.text.push(';');
                }
            }
            Event::Eof => break,
            Event::Comment(_) | Event::Decl(_) | Event::PI(_) | Event::DocType(_) => {}
        }
    }
    if let Some(open) = stack.last() {
        return Err(IrError::Xml {
            pos: reader.buffer_position(),
            detail: format!("document ends inside <{}>", open.name),
        });
    }
    root.ok_or_else(|| IrError::Xml {
        pos: 0,
        detail: "the document has no root element".into(),
    })
}

/// One port of a layer, as written.
#[derive(Clone, Debug, PartialEq)]
pub struct RawPort {
    pub id: u64,
    /// The `precision` attribute, uninterpreted (`None` when absent).
    pub precision: Option<String>,
    /// `<dim>` texts, uninterpreted.
    pub dims: Vec<String>,
    /// The `names` attribute (tensor names), if any.
    pub names: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct RawLayer {
    pub id: u64,
    pub name: String,
    pub ty: String,
    pub version: String,
    /// Attributes of `<data>`, if present.
    pub data: Vec<(String, String)>,
    pub inputs: Vec<RawPort>,
    pub outputs: Vec<RawPort>,
}

impl RawLayer {
    pub fn data_attr(&self, key: &str) -> Option<&str> {
        self.data
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RawEdge {
    pub from_layer: u64,
    pub from_port: u64,
    pub to_layer: u64,
    pub to_port: u64,
}

#[derive(Clone, Debug, PartialEq)]
pub struct RawNet {
    pub name: String,
    pub version: u32,
    pub layers: Vec<RawLayer>,
    pub edges: Vec<RawEdge>,
}

fn parse_u64(el: &Element, key: &str, what: &str) -> Result<u64, IrError> {
    let v = el.attr(key).ok_or_else(|| IrError::Structure {
        detail: format!("{what} (byte {}) has no `{key}` attribute", el.pos),
    })?;
    v.trim().parse::<u64>().map_err(|_| IrError::Structure {
        detail: format!(
            "{what} (byte {}): `{key}` = \"{v}\" is not a non-negative integer",
            el.pos
        ),
    })
}

fn parse_ports(layer: &Element, which: &str, id: u64) -> Result<Vec<RawPort>, IrError> {
    let Some(group) = layer.child(which) else {
        return Ok(Vec::new());
    };
    group
        .children("port")
        .map(|p| {
            Ok(RawPort {
                id: parse_u64(p, "id", &format!("a port of layer {id}"))?,
                precision: p.attr("precision").map(str::to_string),
                dims: p
                    .children("dim")
                    .map(|d| d.text.trim().to_string())
                    .collect(),
                names: p.attr("names").map(str::to_string),
            })
        })
        .collect()
}

/// Parses IR XML text (v10 or v11) into its layers and edges.
pub fn parse_net(text: &str) -> Result<RawNet, IrError> {
    let root = parse_tree(text)?;
    if root.name != "net" {
        return Err(IrError::Structure {
            detail: format!("the root element is <{}>, not <net>", root.name),
        });
    }
    let version = match root.attr("version") {
        None => {
            return Err(IrError::Structure {
                detail: "<net> has no `version` attribute".into(),
            })
        }
        Some(v) => match v.trim().parse::<u32>() {
            Ok(n @ (10 | 11)) => n,
            _ => {
                return Err(IrError::Structure {
                    detail: format!("IR version \"{v}\" is not supported (10 and 11 are)"),
                })
            }
        },
    };
    let mut layers = Vec::new();
    if let Some(ls) = root.child("layers") {
        for l in ls.children("layer") {
            let id = parse_u64(l, "id", "a <layer>")?;
            let ty = l.attr("type").ok_or_else(|| IrError::Structure {
                detail: format!("layer {id} has no `type` attribute"),
            })?;
            layers.push(RawLayer {
                id,
                name: l.attr("name").unwrap_or("").to_string(),
                ty: ty.to_string(),
                version: l.attr("version").unwrap_or("").to_string(),
                data: l.child("data").map(|d| d.attrs.clone()).unwrap_or_default(),
                inputs: parse_ports(l, "input", id)?,
                outputs: parse_ports(l, "output", id)?,
            });
        }
    } else {
        return Err(IrError::Structure {
            detail: "<net> has no <layers>".into(),
        });
    }
    let mut edges = Vec::new();
    if let Some(es) = root.child("edges") {
        for e in es.children("edge") {
            edges.push(RawEdge {
                from_layer: parse_u64(e, "from-layer", "an <edge>")?,
                from_port: parse_u64(e, "from-port", "an <edge>")?,
                to_layer: parse_u64(e, "to-layer", "an <edge>")?,
                to_port: parse_u64(e, "to-port", "an <edge>")?,
            });
        }
    }
    Ok(RawNet {
        name: root.attr("name").unwrap_or("").to_string(),
        version,
        layers,
        edges,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rt_info_is_skipped_at_every_level() {
        let xml = r#"<?xml version="1.0"?>
<net name="m" version="11">
  <layers>
    <layer id="0" name="p" type="Parameter" version="opset1">
      <data shape="2" element_type="f32"/>
      <rt_info><attribute name="x" version="0" value="y"/><nested><deep/></nested></rt_info>
      <output><port id="0" precision="FP32" names="p"><dim>2</dim><rt_info><attribute name="a"/></rt_info></port></output>
    </layer>
  </layers>
  <edges/>
  <rt_info><layers><layer id="9"/></layers></rt_info>
</net>"#;
        let net = parse_net(xml).unwrap();
        assert_eq!(net.layers.len(), 1, "rt_info's <layer> must not be read");
        assert_eq!(net.layers[0].outputs[0].dims, vec!["2".to_string()]);
        assert_eq!(net.layers[0].data_attr("element_type"), Some("f32"));
    }

    #[test]
    fn unclosed_document_is_an_xml_error() {
        let err = parse_net("<net version=\"11\"><layers>").unwrap_err();
        assert!(matches!(err, IrError::Xml { .. }), "{err}");
    }

    #[test]
    fn deep_nesting_is_refused() {
        let xml = format!("<net version=\"11\">{}", "<a>".repeat(100_000));
        let err = parse_net(&xml).unwrap_err();
        assert!(err.to_string().contains("nested deeper"), "{err}");
    }
}
