//! OpenAI's API: its error JSON (on every error status), and its completion and chat requests
//! read into a prompt and generation parameters, each fault blamed on its field.

use super::tools::{self, ToolRequest};
use crate::request::{ChatMessage, Constraint, GenerationParams, Prompt, RequestError};
use crate::sampling::{Penalties, Sampling, MAX_TOP_LOGPROBS};
use axum::body::Body;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::time::Duration;

/// OpenAI's error JSON with `status`; `param` names the request field at fault.
pub(crate) fn error(
    status: StatusCode,
    message: impl Into<String>,
    param: Option<&str>,
) -> Response {
    let kind = if status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    };
    let code = match status {
        StatusCode::NOT_FOUND if param == Some("model") => json!("model_not_found"),
        StatusCode::UNAUTHORIZED => json!("invalid_api_key"),
        _ => Value::Null,
    };
    let body =
        json!({"error": {"message": message.into(), "type": kind, "param": param, "code": code}});
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

pub(crate) fn bad(message: impl Into<String>, param: Option<&str>) -> Response {
    error(StatusCode::BAD_REQUEST, message, param)
}

/// A refusal of the engine's, as a 400 blaming its field (the prompt's is `prompt_field`).
pub(crate) fn refused(e: &RequestError, prompt_field: &str) -> Response {
    bad(e.message.clone(), Some(e.param.unwrap_or(prompt_field)))
}

/// `e` blamed on `field` when it is the constraint's fault and the constraint came from `field`
/// (the engine blames [`Constraint::param`]).
pub(crate) fn blame_constraint(e: &RequestError, field: Option<&'static str>) -> RequestError {
    let mut e = e.clone();
    if let (Some(f), Some(p)) = (field, e.param) {
        if ["response_format", "guided_regex", "guided_grammar"].contains(&p) {
            e.param = Some(f);
        }
    }
    e
}

/// Which endpoint a request came to.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Kind {
    Completion,
    Chat,
}

impl Kind {
    /// The request field that holds the prompt.
    pub fn prompt_field(self) -> &'static str {
        match self {
            Kind::Completion => "prompt",
            Kind::Chat => "messages",
        }
    }
}

/// A request, read.
pub(crate) struct Parsed {
    pub prompt: Prompt,
    pub params: GenerationParams,
    pub stream: bool,
    pub include_usage: bool,
    /// Completions' `echo`: the prompt's text (and with `logprobs`, its tokens' log-probabilities)
    /// comes before the completion.
    pub echo: bool,
    /// A chat request's tools (`None`: it offers none).
    pub tools: Option<ToolRequest>,
    /// The field the structured-output constraint came from.
    pub constraint_field: Option<&'static str>,
}

/// The body as a JSON object: at most `max_bytes`, all of it within `timeout`.
pub(crate) async fn read_json(
    body: Body,
    max_bytes: usize,
    timeout: Duration,
) -> Result<Value, Response> {
    let bytes = match tokio::time::timeout(timeout, axum::body::to_bytes(body, max_bytes)).await {
        Err(_) => {
            return Err(error(
                StatusCode::REQUEST_TIMEOUT,
                format!("the request body did not arrive within {timeout:?}"),
                None,
            ))
        }
        Ok(Err(_)) => {
            return Err(error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the request body is over {max_bytes} bytes (or was cut short)"),
                None,
            ))
        }
        Ok(Ok(b)) => b,
    };
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|e| bad(format!("the body is not valid JSON: {e}"), None))?;
    if !v.is_object() {
        return Err(bad("the body must be a JSON object", None));
    }
    Ok(v)
}

fn field<'a>(v: &'a Value, name: &str) -> Option<&'a Value> {
    v.get(name).filter(|x| !x.is_null())
}

/// Reads a request of `kind` for the served model `model_name` with context `context`.
pub(crate) fn parse(
    v: &Value,
    kind: Kind,
    model_name: &str,
    context: Option<usize>,
) -> Result<Parsed, Response> {
    not_served(v, kind)?;
    let model = field(v, "model").ok_or_else(|| bad("`model` is required", Some("model")))?;
    let model = model
        .as_str()
        .ok_or_else(|| bad("`model` must be a string", Some("model")))?;
    if model != model_name {
        return Err(error(
            StatusCode::NOT_FOUND,
            format!("the model `{model}` does not exist; this server serves `{model_name}`"),
            Some("model"),
        ));
    }
    let (prompt, max_keys, default_max): (Prompt, &[&str], usize) = match kind {
        Kind::Completion => (Prompt::Text(completion_prompt(v)?), &["max_tokens"], 16),
        // No max_tokens: up to the context, as OpenAI does.
        Kind::Chat => (
            Prompt::Chat {
                messages: chat_messages(v)?,
                tools: None,
            },
            &["max_tokens", "max_completion_tokens"],
            context.unwrap_or(4096),
        ),
    };
    let mut p = parse_params(v, max_keys, default_max, context)?;
    p.prompt = prompt;
    let (logprobs, echo) = logprobs_and_echo(v, kind)?;
    p.params.logprobs = logprobs;
    // Echo with logprobs: the prompt's tokens get theirs too.
    p.params.prompt_logprobs = logprobs.filter(|_| echo);
    p.echo = echo;
    if kind == Kind::Chat {
        p.tools = tools::read(v)?;
    }
    Ok(p)
}

/// The logprobs asked for (how many top tokens a token gets, `None`: no logprobs) and
/// completions' `echo`. Chat: `logprobs` a boolean, `top_logprobs` 0-20; completions:
/// `logprobs` 0-5, as OpenAI's ranges.
fn logprobs_and_echo(v: &Value, kind: Kind) -> Result<(Option<usize>, bool), Response> {
    let int_in = |key: &str, hi: u64| -> Result<Option<usize>, Response> {
        match field(v, key) {
            None => Ok(None),
            Some(x) => match x.as_u64() {
                Some(n) if n <= hi && (x.is_u64() || x.is_i64()) => Ok(Some(n as usize)),
                _ => Err(bad(
                    format!("`{key}` must be an integer from 0 to {hi}, got {x}"),
                    Some(key),
                )),
            },
        }
    };
    let flag = |key: &str| -> Result<bool, Response> {
        match field(v, key) {
            None => Ok(false),
            Some(x) => x
                .as_bool()
                .ok_or_else(|| bad(format!("`{key}` must be a boolean"), Some(key))),
        }
    };
    match kind {
        Kind::Chat => {
            let on = flag("logprobs")?;
            let top = int_in("top_logprobs", MAX_TOP_LOGPROBS as u64)?;
            if !on && top.is_some_and(|n| n > 0) {
                return Err(bad(
                    "`top_logprobs` needs `logprobs`: true",
                    Some("top_logprobs"),
                ));
            }
            Ok((on.then(|| top.unwrap_or(0)), false))
        }
        Kind::Completion => Ok((int_in("logprobs", MAX_COMPLETION_LOGPROBS)?, flag("echo")?)),
    }
}

/// The most top log-probabilities a completions token can ask for (OpenAI's limit).
const MAX_COMPLETION_LOGPROBS: u64 = 5;

/// The request fields this server serves, on both endpoints (`user` is OpenAI's end-user id for
/// abuse monitoring: accepted, and changes nothing) and on one of them.
const SERVED: [&str; 22] = [
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "n",
    "stop",
    "stream",
    "stream_options",
    "ignore_eos",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_grammar",
    "guided_choice",
];
const SERVED_COMPLETION: [&str; 3] = ["prompt", "logprobs", "echo"];
const SERVED_CHAT: [&str; 7] = [
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
];

/// OpenAI fields not served yet, each with the one value that asks for nothing (so a client that
/// spells out the default still works); any other value is refused, never ignored.
fn asks_nothing(key: &str, x: &Value, v: &Value) -> bool {
    let empty = |x: &Value| {
        x.as_array().is_some_and(Vec::is_empty) || x.as_object().is_some_and(|o| o.is_empty())
    };
    let zero = |x: &Value| x.as_f64() == Some(0.0);
    match key {
        "echo" => x == &Value::Bool(false),
        "top_logprobs" => zero(x),
        "best_of" => x
            .as_u64()
            .is_some_and(|b| Some(b) == v.get("n").and_then(Value::as_u64).or(Some(1))),
        "functions" => empty(x),
        "function_call" => x == "none",
        "suffix" => x == "",
        _ => false,
    }
}

/// Refuses, naming it, the first field this server does not serve (docs/api.md): an OpenAI
/// parameter it does not implement yet, asked for with a value other than its default, or a
/// field it does not know. `null` is absent.
fn not_served(v: &Value, kind: Kind) -> Result<(), Response> {
    let own: &[&str] = match kind {
        Kind::Completion => &SERVED_COMPLETION,
        Kind::Chat => &SERVED_CHAT,
    };
    let Some(obj) = v.as_object() else {
        return Ok(());
    };
    for (key, x) in obj {
        if x.is_null() || SERVED.contains(&key.as_str()) || own.contains(&key.as_str()) {
            continue;
        }
        if asks_nothing(key, x, v) {
            continue;
        }
        let what = match key.as_str() {
            // Served on the other endpoint (chat's `top_logprobs` and tools, completions' `echo`).
            "top_logprobs" | "echo" | "tools" | "tool_choice" | "parallel_tool_calls" => {
                "is not a parameter of this endpoint"
            }
            "best_of" | "functions" | "function_call" | "suffix" => {
                "is not served by this server yet"
            }
            _ => "is not a parameter this server knows",
        };
        return Err(bad(
            format!("`{key}` {what} (docs/api.md lists what is served)"),
            Some(key),
        ));
    }
    Ok(())
}

fn completion_prompt(v: &Value) -> Result<String, Response> {
    match field(v, "prompt") {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            Ok(a[0].as_str().unwrap_or_default().to_owned())
        }
        Some(_) => Err(bad(
            "`prompt` must be a string (or a list of one string)",
            Some("prompt"),
        )),
        None => Err(bad("`prompt` is required", Some("prompt"))),
    }
}

fn chat_messages(v: &Value) -> Result<Vec<ChatMessage>, Response> {
    let msgs = field(v, "messages")
        .and_then(Value::as_array)
        .ok_or_else(|| {
            bad(
                "`messages` must be a list of {role, content}",
                Some("messages"),
            )
        })?;
    let mut out = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str);
        let (tool_calls, tool_call_id) = tools::message_fields(m, i)?;
        let content = match m.get("content") {
            Some(Value::String(s)) => Some(s.clone()),
            // Content parts: the text ones, joined.
            Some(Value::Array(parts)) => Some(
                parts
                    .iter()
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect::<Vec<_>>()
                    .join(""),
            ),
            // An assistant's calls stand for its content.
            None | Some(Value::Null) if tool_calls.is_some() => Some(String::new()),
            _ => None,
        };
        match (role, content) {
            (Some(r), Some(c)) => out.push(ChatMessage {
                role: r.to_owned(),
                content: c,
                tool_calls,
                tool_call_id,
                name: m.get("name").and_then(Value::as_str).map(str::to_owned),
            }),
            _ => {
                return Err(bad(
                    "every message needs a string `role` and `content`",
                    Some("messages"),
                ))
            }
        }
    }
    if out.is_empty() {
        return Err(bad("`messages` is empty", Some("messages")));
    }
    Ok(out)
}

/// The fields both endpoints share, checked; the prompt is filled in by the caller.
fn parse_params(
    v: &Value,
    max_tokens_keys: &[&str],
    default_max: usize,
    context: Option<usize>,
) -> Result<Parsed, Response> {
    let mut max_new = default_max;
    for key in max_tokens_keys {
        if let Some(m) = field(v, key) {
            let n = m
                .as_i64()
                .filter(|_| m.is_i64() || m.is_u64())
                .ok_or_else(|| bad(format!("`{key}` must be an integer"), Some(key)))?;
            if n < 1 {
                return Err(bad(
                    format!("`{key}` must be at least 1, got {n}"),
                    Some(key),
                ));
            }
            if let Some(ctx) = context {
                if n as u64 >= ctx as u64 {
                    return Err(bad(format!("`{key}` is {n}; the model's context is {ctx} tokens (prompt and completion)"), Some(key)));
                }
            }
            max_new = n as usize;
        }
    }
    let num = |key: &str, default: f64, lo: f64, hi: f64| -> Result<f64, Response> {
        match field(v, key) {
            None => Ok(default),
            Some(x) => {
                let f = x
                    .as_f64()
                    .ok_or_else(|| bad(format!("`{key}` must be a number"), Some(key)))?;
                if !(lo..=hi).contains(&f) {
                    return Err(bad(
                        format!("`{key}` must be in [{lo}, {hi}], got {f}"),
                        Some(key),
                    ));
                }
                Ok(f)
            }
        }
    };
    let temperature = num("temperature", 1.0, 0.0, 2.0)?;
    let top_p = num("top_p", 1.0, 0.0, 1.0)?;
    let top_k = match field(v, "top_k") {
        None => 0,
        Some(x) => match x.as_i64() {
            Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            _ => return Err(bad("`top_k` must be an integer >= -1", Some("top_k"))),
        },
    };
    let logit_bias = match field(v, "logit_bias") {
        None => Vec::new(),
        Some(Value::Object(o)) => {
            let mut bias = Vec::with_capacity(o.len());
            for (k, b) in o {
                let (Ok(t), Some(b)) = (k.parse::<u32>(), b.as_f64()) else {
                    return Err(bad(
                        format!("`logit_bias` maps token ids to numbers; got {k:?}: {b}"),
                        Some("logit_bias"),
                    ));
                };
                bias.push((t, b as f32));
            }
            bias
        }
        Some(_) => {
            return Err(bad(
                "`logit_bias` must be an object of token ids to numbers",
                Some("logit_bias"),
            ))
        }
    };
    // Ranges are checked by the engine (GenerationParams::validate), naming the field.
    let penalties = Penalties {
        repetition: num("repetition_penalty", 1.0, f64::MIN, f64::MAX)? as f32,
        presence: num("presence_penalty", 0.0, f64::MIN, f64::MAX)? as f32,
        frequency: num("frequency_penalty", 0.0, f64::MIN, f64::MAX)? as f32,
        logit_bias,
    };
    let seed = match field(v, "seed") {
        None => None,
        Some(x) => Some(
            x.as_i64()
                .map(|s| s as u64)
                .or_else(|| x.as_u64())
                .ok_or_else(|| bad("`seed` must be an integer", Some("seed")))?,
        ),
    };
    let n = match field(v, "n") {
        None => 1,
        Some(x) => match x.as_u64() {
            Some(n) if (1..=16).contains(&n) => n as usize,
            _ => return Err(bad("`n` must be an integer from 1 to 16", Some("n"))),
        },
    };
    let stop = match field(v, "stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.len() <= 16 && a.iter().all(Value::is_string) => a
            .iter()
            .filter_map(|s| s.as_str().map(str::to_owned))
            .collect(),
        Some(_) => {
            return Err(bad(
                "`stop` must be a string or a list of up to 16 strings",
                Some("stop"),
            ))
        }
    };
    let stream = match field(v, "stream") {
        None => false,
        Some(x) => x
            .as_bool()
            .ok_or_else(|| bad("`stream` must be a boolean", Some("stream")))?,
    };
    let include_usage = field(v, "stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let ignore_eos = field(v, "ignore_eos")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let (constraint, constraint_field) = match constraint(v)? {
        Some((c, f)) => (Some(c), Some(f)),
        None => (None, None),
    };
    let params = GenerationParams {
        max_new_tokens: max_new,
        sampling: Sampling {
            temperature: temperature as f32,
            top_k,
            top_p: top_p as f32,
        },
        penalties,
        seed,
        stop,
        stop_token_ids: None,
        ignore_eos,
        n,
        logprobs: None,
        prompt_logprobs: None,
        constraint,
    };
    // The engine's own checks, on the values as it holds them (a top_p that rounds to 0 in f32).
    params
        .validate()
        .map_err(|e| refused(&blame_constraint(&e, constraint_field), "prompt"))?;
    Ok(Parsed {
        prompt: Prompt::Ids(Vec::new()),
        params,
        stream,
        include_usage,
        echo: false,
        tools: None,
        constraint_field,
    })
}

/// The structured-output constraint of a request, and the field it came from: OpenAI's
/// `response_format`, or vLLM's `structured_outputs` ({json, regex, choice, grammar}) or its
/// older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`. At most one.
fn constraint(v: &Value) -> Result<Option<(Constraint, &'static str)>, Response> {
    let mut found: Option<(Constraint, &'static str)> = None;
    let mut take = |c: Option<Constraint>, f: &'static str| -> Result<(), Response> {
        let Some(c) = c else { return Ok(()) };
        if let Some((_, first)) = &found {
            return Err(bad(
                format!("`{f}` and `{first}` both constrain the output; give one"),
                Some(f),
            ));
        }
        found = Some((c, f));
        Ok(())
    };
    if let Some(rf) = field(v, "response_format") {
        take(response_format(rf)?, "response_format")?;
    }
    if let Some(so) = field(v, "structured_outputs") {
        let Some(o) = so.as_object() else {
            return Err(bad(
                "`structured_outputs` must be an object",
                Some("structured_outputs"),
            ));
        };
        for (k, x) in o.iter().filter(|(_, x)| !x.is_null()) {
            let c = match k.as_str() {
                "json" => Some(json_schema(x, "structured_outputs")?),
                "regex" => Some(Constraint::Regex(string(x, "structured_outputs", k)?)),
                "grammar" => Some(Constraint::Lark(string(x, "structured_outputs", k)?)),
                "choice" => Some(choice(x, "structured_outputs")?),
                "json_object" if x.as_bool() == Some(true) => Some(Constraint::JsonObject),
                "json_object" if x.as_bool() == Some(false) => None,
                _ => {
                    return Err(bad(
                        format!("`structured_outputs.{k}` is not served (json, regex, choice, grammar and json_object are)"),
                        Some("structured_outputs"),
                    ))
                }
            };
            take(c, "structured_outputs")?;
        }
    }
    if let Some(x) = field(v, "guided_json") {
        take(Some(json_schema(x, "guided_json")?), "guided_json")?;
    }
    if let Some(x) = field(v, "guided_regex") {
        let r = string(x, "guided_regex", "guided_regex")?;
        take(Some(Constraint::Regex(r)), "guided_regex")?;
    }
    if let Some(x) = field(v, "guided_grammar") {
        let g = string(x, "guided_grammar", "guided_grammar")?;
        take(Some(Constraint::Lark(g)), "guided_grammar")?;
    }
    if let Some(x) = field(v, "guided_choice") {
        take(Some(choice(x, "guided_choice")?), "guided_choice")?;
    }
    Ok(found)
}

fn string(x: &Value, f: &'static str, what: &str) -> Result<String, Response> {
    x.as_str()
        .map(str::to_owned)
        .ok_or_else(|| bad(format!("`{what}` must be a string"), Some(f)))
}

/// A JSON schema given as an object (or a string holding one, as vLLM takes it).
fn json_schema(x: &Value, f: &'static str) -> Result<Constraint, Response> {
    let schema = match x {
        Value::String(s) => serde_json::from_str(s)
            .map_err(|e| bad(format!("the JSON schema is not JSON: {e}"), Some(f)))?,
        x => x.clone(),
    };
    Ok(Constraint::JsonSchema(schema))
}

/// One of a list of strings, exactly.
fn choice(x: &Value, f: &'static str) -> Result<Constraint, Response> {
    let list: Option<Vec<&str>> = x
        .as_array()
        .filter(|a| !a.is_empty())
        .and_then(|a| a.iter().map(Value::as_str).collect());
    let list =
        list.ok_or_else(|| bad("the choice must be a non-empty list of strings", Some(f)))?;
    let alternatives: Vec<String> = list.iter().map(|s| regex_syntax::escape(s)).collect();
    Ok(Constraint::Regex(format!("({})", alternatives.join("|"))))
}

/// OpenAI's `response_format`: `text` (no constraint), `json_object`, or `json_schema` with
/// `json_schema.schema` (`name` and `strict` accepted; the schema is always enforced).
fn response_format(rf: &Value) -> Result<Option<Constraint>, Response> {
    let f = Some("response_format");
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Constraint::JsonObject)),
        Some("json_schema") => {
            let Some(js) = rf.get("json_schema").filter(|j| j.is_object()) else {
                return Err(bad(
                    "`response_format.json_schema` must be an object {name, schema, strict}",
                    f,
                ));
            };
            if js.get("name").is_some_and(|n| !n.is_string()) {
                return Err(bad(
                    "`response_format.json_schema.name` must be a string",
                    f,
                ));
            }
            if js
                .get("strict")
                .is_some_and(|s| !(s.is_boolean() || s.is_null()))
            {
                return Err(bad(
                    "`response_format.json_schema.strict` must be a boolean",
                    f,
                ));
            }
            match js.get("schema").filter(|s| !s.is_null()) {
                Some(s) => Ok(Some(Constraint::JsonSchema(s.clone()))),
                // No schema: any JSON object.
                None => Ok(Some(Constraint::JsonObject)),
            }
        }
        Some(t) => Err(bad(
            format!("`response_format.type` `{t}` is not one of text, json_object, json_schema"),
            f,
        )),
        None => Err(bad(
            "`response_format` must be an object with a `type` (text, json_object, json_schema)",
            f,
        )),
    }
}
