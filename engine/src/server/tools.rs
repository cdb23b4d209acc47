//! OpenAI's tool fields on chat completions, read and checked (each fault blamed on its field):
//! `tools`, `tool_choice`, `parallel_tool_calls`, and messages' `tool_calls` and `tool_call_id`;
//! and a model's calls in OpenAI's shapes: a message's `tool_calls`, or a stream's deltas.

use super::openai::{bad, Parsed};
use super::response::unique_id;
use crate::request::{Constraint, Prompt};
use crate::tools::{prepare_chat, CallStream, Piece, TemplateTools, ToolCall, ToolParser};
use crate::FinishReason;
use axum::response::Response;
use serde_json::{json, Value};

/// Tools a request may offer (OpenAI's limit).
const MAX_TOOLS: usize = 128;

/// What the model may or must call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ToolChoice {
    /// No call: the tools are not shown to the model, and its text is not parsed.
    None,
    /// A call if the model writes one.
    Auto,
    /// One call or more, of any tool.
    Required,
    /// A call of this tool.
    Function(String),
}

/// A request's tools, read.
#[derive(Clone, Debug)]
pub(crate) struct ToolRequest {
    /// OpenAI's tool objects, as given (what the template gets).
    pub tools: Vec<Value>,
    pub choice: ToolChoice,
    /// More than one call per answer.
    pub parallel: bool,
}

impl ToolRequest {
    /// The tools' names and their parameters' schemas.
    pub fn functions(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.tools.iter().map(|t| {
            let f = &t["function"];
            (f["name"].as_str().unwrap_or_default(), &f["parameters"])
        })
    }

    /// How the answers' text becomes calls; `None` for `tool_choice: "none"`.
    pub fn output(&self, parser: ToolParser) -> Option<CallOutput> {
        (self.choice != ToolChoice::None).then_some(CallOutput {
            parser,
            max_calls: if self.parallel { usize::MAX } else { 1 },
        })
    }

    /// The grammar `required` and a named function are held to (llguidance's Lark): calls of
    /// the tools allowed, one or (`parallel_tool_calls` with `required`) more; `None` when the
    /// model is free.
    pub fn grammar(&self, parser: ToolParser) -> Option<String> {
        let all: Vec<(&str, &Value)> = self.functions().collect();
        match &self.choice {
            ToolChoice::None | ToolChoice::Auto => None,
            ToolChoice::Required => Some(parser.calls_grammar(&all, self.parallel)),
            ToolChoice::Function(name) => {
                let one: Vec<(&str, &Value)> = all.into_iter().filter(|(n, _)| n == name).collect();
                Some(parser.calls_grammar(&one, false))
            }
        }
    }

    /// The tools the template gets (none with `tool_choice: "none"`: the model is not offered
    /// what it may not call).
    pub fn for_template(&self) -> Option<Vec<Value>> {
        (self.choice != ToolChoice::None).then(|| self.tools.clone())
    }
}

/// The server's way with tools: the parser, and what the chat template renders.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ToolSetup {
    pub parser: ToolParser,
    pub template: TemplateTools,
}

impl ToolSetup {
    /// `parser` if given, else the one the template calls for, else Hermes (what SmolLM2 and
    /// most small models were trained on); and the source of the log line saying which.
    pub fn new(parser: Option<ToolParser>, template: Option<&str>) -> (ToolSetup, &'static str) {
        let detected = template.and_then(ToolParser::detect);
        let (parser, how) = match (parser, detected) {
            (Some(p), _) => (p, "--tool-call-parser"),
            (None, Some(p)) => (p, "the chat template"),
            (None, None) => (ToolParser::Hermes, "the default"),
        };
        let template = TemplateTools::of(template.unwrap_or(""));
        (ToolSetup { parser, template }, how)
    }
}

fn is_empty(x: &Value) -> bool {
    x.is_null() || x.as_array().is_some_and(Vec::is_empty)
}

/// A chat request's tools applied: the conversation as the template takes it (see
/// [`prepare_chat`]), and for `required` or a named function the grammar of the calls as the
/// request's constraint (its faults blamed on `tools`). Returns how the answers' text becomes
/// calls.
pub(crate) fn apply(setup: &ToolSetup, req: &mut Parsed) -> Result<Option<CallOutput>, Response> {
    if let Prompt::Chat { messages, tools } = &mut req.prompt {
        let offered = req.tools.as_ref().and_then(ToolRequest::for_template);
        *tools = prepare_chat(messages, offered, setup.parser, setup.template);
    }
    let Some(tools) = &req.tools else {
        return Ok(None);
    };
    if let Some(grammar) = tools.grammar(setup.parser) {
        if let Some(other) = req.constraint_field {
            return Err(bad(
                format!(
                    "`tool_choice` \"required\" or a named function cannot be combined with \
                     `{other}`: both constrain the output"
                ),
                Some("tool_choice"),
            ));
        }
        req.params.constraint = Some(Constraint::Lark(grammar));
        req.constraint_field = Some("tools");
    }
    Ok(tools.output(setup.parser))
}

/// The request's `tools`, `tool_choice` and `parallel_tool_calls`; `None` without tools.
pub(crate) fn read(v: &Value) -> Result<Option<ToolRequest>, Response> {
    let tools = v.get("tools").unwrap_or(&Value::Null);
    let choice = v.get("tool_choice").unwrap_or(&Value::Null);
    let parallel = match v.get("parallel_tool_calls").unwrap_or(&Value::Null) {
        Value::Null => true,
        Value::Bool(b) => *b,
        _ => {
            return Err(bad(
                "`parallel_tool_calls` must be a boolean",
                Some("parallel_tool_calls"),
            ))
        }
    };
    if is_empty(tools) {
        return match choice {
            Value::Null => Ok(None),
            c if c == "none" => Ok(None),
            _ => Err(bad(
                "`tool_choice` needs `tools` (only \"none\" is allowed without them)",
                Some("tool_choice"),
            )),
        };
    }
    let list = tools
        .as_array()
        .ok_or_else(|| bad("`tools` must be a list of tools", Some("tools")))?;
    if list.len() > MAX_TOOLS {
        return Err(bad(
            format!("`tools` holds {} tools; at most {MAX_TOOLS}", list.len()),
            Some("tools"),
        ));
    }
    let mut names: Vec<&str> = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let name = check_tool(t, i)?;
        if names.contains(&name) {
            let p = format!("tools[{i}].function.name");
            return Err(bad(format!("`{p}`: `{name}` is offered twice"), Some(&p)));
        }
        names.push(name);
    }
    let choice = match choice {
        Value::Null => ToolChoice::Auto,
        Value::String(s) if s == "none" => ToolChoice::None,
        Value::String(s) if s == "auto" => ToolChoice::Auto,
        Value::String(s) if s == "required" => ToolChoice::Required,
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    bad(
                        "`tool_choice.function.name` must name a tool",
                        Some("tool_choice"),
                    )
                })?;
            if !names.contains(&name) {
                return Err(bad(
                    format!("`tool_choice` names `{name}`, which is not among `tools`"),
                    Some("tool_choice"),
                ));
            }
            ToolChoice::Function(name.to_owned())
        }
        _ => {
            return Err(bad(
                "`tool_choice` must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                Some("tool_choice"),
            ))
        }
    };
    Ok(Some(ToolRequest {
        tools: list.clone(),
        choice,
        parallel,
    }))
}

/// Checks tool `i`; returns its name.
fn check_tool(t: &Value, i: usize) -> Result<&str, Response> {
    let fail = |field: &str, what: &str| {
        let p = format!("tools[{i}]{field}");
        bad(format!("`{p}` {what}"), Some(&p))
    };
    if !t.is_object() {
        return Err(fail(
            "",
            "must be an object {\"type\": \"function\", \"function\": {...}}",
        ));
    }
    if t.get("type").and_then(Value::as_str) != Some("function") {
        return Err(fail(".type", "must be \"function\""));
    }
    let f = t
        .get("function")
        .filter(|f| f.is_object())
        .ok_or_else(|| fail(".function", "must be an object with the function's `name`"))?;
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| fail(".function.name", "is required (a string)"))?;
    let name_ok = (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !name_ok {
        return Err(fail(
            ".function.name",
            "must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -",
        ));
    }
    if f.get("description")
        .is_some_and(|d| !d.is_string() && !d.is_null())
    {
        return Err(fail(".function.description", "must be a string"));
    }
    if f.get("strict")
        .is_some_and(|d| !d.is_boolean() && !d.is_null())
    {
        return Err(fail(".function.strict", "must be a boolean"));
    }
    match f.get("parameters") {
        None | Some(Value::Null) => {}
        Some(p @ Value::Object(_)) => {
            if let Err(e) = check_schema(p, "") {
                return Err(fail(
                    ".function.parameters",
                    &format!("is not a valid JSON schema: {e}"),
                ));
            }
        }
        Some(_) => {
            return Err(fail(
                ".function.parameters",
                "must be a JSON schema (an object)",
            ))
        }
    }
    Ok(name)
}

/// The JSON schema types.
const TYPES: [&str; 7] = [
    "object", "array", "string", "number", "integer", "boolean", "null",
];

/// What a JSON schema keyword's value must be.
#[derive(Clone, Copy)]
enum Shape {
    Schema,
    /// A non-empty list of schemas (`items` may also be one schema).
    Schemas,
    /// An object of schemas.
    SchemaMap,
    Types,
    Names,
    List,
    Number,
    Count,
    Text,
}

/// The keywords whose shape decides what a call's arguments are (a wrong one would make the
/// arguments' grammar meaningless); others are let through.
const KEYWORDS: [(&str, Shape); 32] = [
    ("type", Shape::Types),
    ("properties", Shape::SchemaMap),
    ("patternProperties", Shape::SchemaMap),
    ("$defs", Shape::SchemaMap),
    ("definitions", Shape::SchemaMap),
    ("items", Shape::Schemas),
    ("additionalProperties", Shape::Schema),
    ("additionalItems", Shape::Schema),
    ("not", Shape::Schema),
    ("contains", Shape::Schema),
    ("propertyNames", Shape::Schema),
    ("if", Shape::Schema),
    ("then", Shape::Schema),
    ("else", Shape::Schema),
    ("anyOf", Shape::Schemas),
    ("oneOf", Shape::Schemas),
    ("allOf", Shape::Schemas),
    ("prefixItems", Shape::Schemas),
    ("required", Shape::Names),
    ("enum", Shape::List),
    ("minimum", Shape::Number),
    ("maximum", Shape::Number),
    ("exclusiveMinimum", Shape::Number),
    ("exclusiveMaximum", Shape::Number),
    ("multipleOf", Shape::Number),
    ("pattern", Shape::Text),
    ("minLength", Shape::Count),
    ("maxLength", Shape::Count),
    ("minItems", Shape::Count),
    ("maxItems", Shape::Count),
    ("minProperties", Shape::Count),
    ("maxProperties", Shape::Count),
];

/// Checks the shape of a JSON schema's keywords; `at` is the JSON pointer of `s`.
fn check_schema(s: &Value, at: &str) -> Result<(), String> {
    let o = match s {
        Value::Bool(_) => return Ok(()),
        Value::Object(o) => o,
        _ => {
            return Err(format!(
                "at `{at}/`: a schema must be an object or a boolean"
            ))
        }
    };
    for (k, x) in o {
        let Some(&(_, shape)) = KEYWORDS.iter().find(|(name, _)| name == k) else {
            continue;
        };
        let here = format!("{at}/{k}");
        let fault = match shape {
            Shape::Schema => {
                check_schema(x, &here)?;
                None
            }
            Shape::Schemas => match x {
                Value::Array(a) if !a.is_empty() => {
                    for (j, sub) in a.iter().enumerate() {
                        check_schema(sub, &format!("{here}/{j}"))?;
                    }
                    None
                }
                Value::Object(_) | Value::Bool(_) if k == "items" => {
                    check_schema(x, &here)?;
                    None
                }
                _ => Some("must be a non-empty list of schemas"),
            },
            Shape::SchemaMap => match x.as_object() {
                Some(m) => {
                    for (name, sub) in m {
                        check_schema(sub, &format!("{here}/{name}"))?;
                    }
                    None
                }
                None => Some("must be an object of schemas"),
            },
            Shape::Types => {
                let one = |t: &Value| t.as_str().is_some_and(|t| TYPES.contains(&t));
                let fine = match x {
                    Value::Array(a) => !a.is_empty() && a.iter().all(one),
                    t => one(t),
                };
                (!fine).then_some(
                    "must be a JSON schema type (object, array, string, number, integer, \
                     boolean, null) or a list of them",
                )
            }
            Shape::Names => (!x.as_array().is_some_and(|a| a.iter().all(Value::is_string)))
                .then_some("must be a list of property names"),
            Shape::List => (!x.is_array()).then_some("must be a list"),
            Shape::Number => (!x.is_number()).then_some("must be a number"),
            Shape::Count => (!x.is_u64()).then_some("must be a non-negative integer"),
            Shape::Text => (!x.is_string()).then_some("must be a string"),
        };
        if let Some(what) = fault {
            return Err(format!("at `{here}`: {what}, got {x}"));
        }
    }
    Ok(())
}

/// A message's tool fields: an assistant's `tool_calls`, a tool's `tool_call_id`; `i` is its
/// index in `messages`.
pub(crate) fn message_fields(
    m: &Value,
    i: usize,
) -> Result<(Option<Vec<ToolCall>>, Option<String>), Response> {
    let fail = |field: &str, what: &str| {
        let p = format!("messages.[{i}].{field}");
        bad(format!("`{p}` {what}"), Some(&p))
    };
    let role = m.get("role").and_then(Value::as_str).unwrap_or_default();
    let calls = match m.get("tool_calls") {
        None | Some(Value::Null) => None,
        Some(Value::Array(list)) if role == "assistant" => {
            let mut calls = Vec::with_capacity(list.len());
            for (j, c) in list.iter().enumerate() {
                let f = c.get("function");
                let name = f.and_then(|f| f.get("name")).and_then(Value::as_str);
                let arguments = match f.and_then(|f| f.get("arguments")) {
                    Some(Value::String(s)) => Some(s.clone()),
                    Some(o @ Value::Object(_)) => Some(o.to_string()),
                    None | Some(Value::Null) => Some("{}".to_owned()),
                    Some(_) => None,
                };
                let (Some(name), Some(arguments)) = (name, arguments) else {
                    return Err(fail(
                        &format!("tool_calls[{j}]"),
                        "must be {\"id\", \"type\": \"function\", \"function\": {\"name\", \"arguments\"}}",
                    ));
                };
                calls.push(ToolCall {
                    id: c
                        .get("id")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_owned(),
                    name: name.to_owned(),
                    arguments,
                });
            }
            Some(calls)
        }
        Some(_) => {
            return Err(fail(
                "tool_calls",
                "must be a list of calls, on an assistant message",
            ))
        }
    };
    let id = match (role, m.get("tool_call_id")) {
        ("tool", Some(Value::String(s))) => Some(s.clone()),
        ("tool", _) => {
            return Err(fail(
                "tool_call_id",
                "is required on a tool message (the id of the call it answers)",
            ))
        }
        _ => None,
    };
    Ok((calls, id))
}

/// How an answer's text becomes calls.
#[derive(Clone, Copy, Debug)]
pub(crate) struct CallOutput {
    pub parser: ToolParser,
    pub max_calls: usize,
}

impl CallOutput {
    /// A whole answer's `message` and `finish_reason`.
    pub fn message(&self, text: &str, reason: FinishReason) -> (Value, &'static str) {
        let mut s = self.deltas();
        let mut pieces = s.calls.push(text);
        pieces.extend(s.calls.finish());
        let mut content = String::new();
        let mut calls: Vec<(String, String, String)> = Vec::new();
        for p in pieces {
            match p {
                Piece::Content(c) => content.push_str(&c),
                Piece::Call { name, .. } => calls.push((unique_id("call_"), name, String::new())),
                Piece::Arguments { index, text } => {
                    if let Some(c) = calls.get_mut(index) {
                        c.2.push_str(&text)
                    }
                }
            }
        }
        if calls.is_empty() {
            let m = json!({"role": "assistant", "content": content});
            return (m, reason.as_str());
        }
        let calls: Vec<Value> = calls
            .into_iter()
            .map(|(id, name, arguments)| {
                json!({"id": id, "type": "function", "function": {"name": name, "arguments": arguments}})
            })
            .collect();
        let content = (!content.is_empty()).then_some(content);
        let m = json!({"role": "assistant", "content": content, "tool_calls": calls});
        (m, finish_reason(true, reason))
    }

    /// A stream's converter of text to deltas.
    pub fn deltas(&self) -> CallDeltas {
        CallDeltas {
            calls: self.parser.stream(self.max_calls),
        }
    }
}

/// `tool_calls` when the answer made calls and ended by itself; a cut one keeps `length`.
fn finish_reason(called: bool, reason: FinishReason) -> &'static str {
    if called && reason == FinishReason::Stop {
        "tool_calls"
    } else {
        reason.as_str()
    }
}

/// One output's text turned into chat deltas as it streams: content, and calls as OpenAI sends
/// them (a call's first delta holds its index, id, type, name and empty arguments; then its
/// arguments come in fragments).
pub(crate) struct CallDeltas {
    calls: CallStream,
}

impl CallDeltas {
    /// The deltas `text` completes.
    pub fn push(&mut self, text: &str) -> Vec<Value> {
        self.calls.push(text).into_iter().map(delta).collect()
    }

    /// The deltas held back, at the end of the output, and its finish reason.
    pub fn finish(&mut self, reason: FinishReason) -> (Vec<Value>, &'static str) {
        let deltas = self.calls.finish().into_iter().map(delta).collect();
        (deltas, finish_reason(self.calls.calls() > 0, reason))
    }
}

fn delta(p: Piece) -> Value {
    match p {
        Piece::Content(c) => json!({"content": c}),
        Piece::Call { index, name } => json!({"tool_calls": [{"index": index,
            "id": unique_id("call_"), "type": "function",
            "function": {"name": name, "arguments": ""}}]}),
        Piece::Arguments { index, text } => {
            json!({"tool_calls": [{"index": index, "function": {"arguments": text}}]})
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn param(r: Result<Option<ToolRequest>, Response>) -> String {
        let r = r.expect_err("refused");
        assert_eq!(r.status(), axum::http::StatusCode::BAD_REQUEST);
        let body = futures_body(r);
        body["error"]["param"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    fn futures_body(r: Response) -> Value {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let bytes = rt
            .block_on(axum::body::to_bytes(r.into_body(), 1 << 20))
            .expect("body");
        serde_json::from_slice(&bytes).expect("JSON")
    }

    fn tool(name: &str, params: Value) -> Value {
        json!({"type": "function", "function": {"name": name, "parameters": params}})
    }

    #[test]
    fn bad_tools_are_blamed_on_their_field() {
        let ok = tool("f", json!({"type": "object"}));
        for (body, want) in [
            (json!({"tools": {"a": 1}}), "tools"),
            (
                json!({"tools": [{"type": "function"}]}),
                "tools[0].function",
            ),
            (
                json!({"tools": [ok, {"type": "function", "function": {"description": "x"}}]}),
                "tools[1].function.name",
            ),
            (
                json!({"tools": [tool("a b", json!({}))]}),
                "tools[0].function.name",
            ),
            (json!({"tools": [ok, ok]}), "tools[1].function.name"),
            (
                json!({"tools": [tool("f", json!(3))]}),
                "tools[0].function.parameters",
            ),
            (
                json!({"tools": [tool("f", json!({"type": "objekt"}))]}),
                "tools[0].function.parameters",
            ),
            (
                json!({"tools": [tool("f", json!({"properties": {"a": {"type": 1}}}))]}),
                "tools[0].function.parameters",
            ),
            (
                json!({"tools": [tool("f", json!({"required": "a"}))]}),
                "tools[0].function.parameters",
            ),
            (
                json!({"tools": [ok], "tool_choice": "sometimes"}),
                "tool_choice",
            ),
            (
                json!({"tools": [ok], "tool_choice": {"type": "function", "function": {"name": "g"}}}),
                "tool_choice",
            ),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (
                json!({"tools": [ok], "parallel_tool_calls": "yes"}),
                "parallel_tool_calls",
            ),
        ] {
            assert_eq!(param(read(&body)), want, "{body}");
        }
    }

    #[test]
    fn good_tools_are_read() {
        let t = tool(
            "get-weather_2",
            json!({"type": "object", "properties": {"city": {"type": ["string", "null"]},
                   "days": {"type": "array", "items": {"type": "integer", "minimum": 1}}},
                   "required": ["city"]}),
        );
        let r = read(&json!({"tools": [t], "parallel_tool_calls": false,
                             "tool_choice": {"type": "function", "function": {"name": "get-weather_2"}}}))
        .expect("read")
        .expect("tools");
        assert_eq!(r.choice, ToolChoice::Function("get-weather_2".into()));
        assert!(!r.parallel);
        assert_eq!(r.functions().next().map(|f| f.0), Some("get-weather_2"));
        assert!(read(&json!({"tools": [], "tool_choice": "none"}))
            .expect("read")
            .is_none());
        let none = read(&json!({"tools": [tool("f", json!({}))], "tool_choice": "none"}))
            .expect("read")
            .expect("tools");
        assert!(none.output(ToolParser::Hermes).is_none() && none.for_template().is_none());
    }

    #[test]
    fn a_whole_answer_becomes_a_message_with_unique_call_ids() {
        let out = CallOutput {
            parser: ToolParser::Hermes,
            max_calls: usize::MAX,
        };
        let (m, reason) = out.message(
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>\n<tool_call>\n{\"name\": \"g\", \"arguments\": {}}\n</tool_call>",
            FinishReason::Stop,
        );
        assert_eq!(reason, "tool_calls");
        assert_eq!(m["content"], Value::Null);
        let calls = m["tool_calls"].as_array().expect("calls");
        assert_eq!(
            calls[0]["function"],
            json!({"name": "f", "arguments": "{\"a\": 1}"})
        );
        assert_eq!(
            calls[1]["function"],
            json!({"name": "g", "arguments": "{}"})
        );
        assert_eq!(calls[0]["type"], "function");
        assert_ne!(calls[0]["id"], calls[1]["id"]);
        let (m, reason) = out.message("just text", FinishReason::Length);
        assert_eq!(
            (m["content"].as_str(), reason),
            (Some("just text"), "length")
        );
        assert!(m.get("tool_calls").is_none());
    }
}
