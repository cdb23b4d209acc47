//! `pa serve`: an OpenAI-compatible HTTP server on the engine (axum on tokio).
//!
//! The engine runs on its own thread and owns the model; HTTP handlers reach it through a
//! channel (a request's prompt and parameters in, its tokens and end out, on a channel of its
//! own). A client that goes away drops its channel: the engine thread sees it before its next
//! step (or when it next sends to it) and aborts the request, which frees its blocks at once.
//!
//! Routes: `POST /v1/completions`, `POST /v1/chat/completions` (streaming as server-sent events,
//! `data: [DONE]` at the end), `GET /v1/models`, `GET /health` (200 once the model is compiled),
//! `GET /metrics` (Prometheus text). Errors are OpenAI's error JSON.

use crate::engine::{Engine, EngineConfig, Event, GenerationParams, RequestId};
use crate::sampling::Sampling;
use crate::tokenizer::ChatMessage;
use crate::FinishReason;
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// How the server runs.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    pub host: String,
    pub port: u16,
    /// Bearer key every `/v1/` request must carry (`None`: no key).
    pub api_key: Option<String>,
    /// Requests admitted at once (running, waiting, and being answered); more get 503.
    pub max_queue: usize,
    /// Largest request body.
    pub max_body_bytes: usize,
    /// After SIGINT/SIGTERM, in-flight requests may finish for this long; then they are ended.
    pub shutdown_timeout: Duration,
    /// The name `/v1/models` lists and requests must use.
    pub model_name: String,
}

/// What the engine thread sends a request's handler.
#[derive(Debug)]
enum Out {
    Started {
        prompt_tokens: usize,
    },
    Token {
        index: usize,
        text: String,
    },
    Finished {
        index: usize,
        reason: FinishReason,
        token_ids: Vec<u32>,
        text: String,
    },
    Error(String),
}

enum Cmd {
    Add {
        prompt: Prompt,
        params: GenerationParams,
        tx: UnboundedSender<Out>,
    },
    AbortAll,
    Stop,
}

enum Prompt {
    Text(String),
    Chat(Vec<ChatMessage>),
}

/// Histogram of seconds, Prometheus style (cumulative buckets).
#[derive(Default, Clone)]
struct Histogram {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

impl Histogram {
    fn observe(&mut self, v: f64) {
        if self.counts.is_empty() {
            self.counts = vec![0; BUCKETS.len()];
        }
        for (c, b) in self.counts.iter_mut().zip(BUCKETS) {
            if v <= b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }
    fn render(&self, name: &str, help: &str, out: &mut String) {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} histogram\n"));
        for (i, b) in BUCKETS.iter().enumerate() {
            let c = self.counts.get(i).copied().unwrap_or(0);
            out.push_str(&format!("{name}_bucket{{le=\"{b}\"}} {c}\n"));
        }
        out.push_str(&format!(
            "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}\n",
            self.count, self.sum, self.count
        ));
    }
}

/// What `/metrics` shows, updated by the engine thread after every step.
#[derive(Default, Clone)]
struct Metrics {
    running: usize,
    waiting: usize,
    blocks_used: usize,
    blocks_total: usize,
    prefix_hits: u64,
    prefix_hit_tokens: u64,
    prompt_tokens: u64,
    preemptions: u64,
    generated_tokens: u64,
    requests_finished: u64,
    requests_aborted: u64,
    steps: u64,
    ttft: Histogram,
    tpot: Histogram,
}

struct App {
    cfg: ServeConfig,
    ready: AtomicBool,
    shutting_down: AtomicBool,
    in_flight: AtomicUsize,
    context: Mutex<Option<usize>>,
    cmds: Mutex<mpsc::Sender<Cmd>>,
    metrics: Mutex<Metrics>,
}

/// Holds a place in the queue until the response is done.
struct Slot(Arc<App>);
impl Drop for Slot {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

fn error(
    status: StatusCode,
    kind: &str,
    message: impl Into<String>,
    param: Option<&str>,
) -> Response {
    let code = match status {
        StatusCode::NOT_FOUND => json!("model_not_found"),
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

fn bad(message: impl Into<String>, param: Option<&str>) -> Response {
    error(
        StatusCode::BAD_REQUEST,
        "invalid_request_error",
        message,
        param,
    )
}

/// Compares without an early exit, so the time does not tell how much of a guess was right.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        diff |= (a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0xff)) as usize;
    }
    diff == 0
}

impl App {
    fn authorize(&self, headers: &HeaderMap) -> Result<(), Response> {
        let Some(key) = &self.cfg.api_key else {
            return Ok(());
        };
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .unwrap_or("");
        if same_secret(given.as_bytes(), key.as_bytes()) {
            Ok(())
        } else {
            Err(error(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                "missing or wrong API key (Authorization: Bearer KEY)",
                None,
            ))
        }
    }

    fn admit(self: &Arc<App>) -> Result<Slot, Response> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(error(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "the server is shutting down",
                None,
            ));
        }
        if !self.ready.load(Ordering::SeqCst) {
            return Err(error(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                "the model is still loading",
                None,
            ));
        }
        let n = self.in_flight.fetch_add(1, Ordering::SeqCst);
        let slot = Slot(self.clone());
        if n >= self.cfg.max_queue {
            let mut r = error(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                format!(
                    "the queue is full ({} requests); retry later",
                    self.cfg.max_queue
                ),
                None,
            );
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            return Err(r);
        }
        Ok(slot)
    }
}

/// The fields both endpoints share, checked.
struct Common {
    params: GenerationParams,
    stream: bool,
    include_usage: bool,
}

fn field<'a>(v: &'a Value, name: &str) -> Option<&'a Value> {
    v.get(name).filter(|x| !x.is_null())
}

fn parse_common(
    v: &Value,
    app: &App,
    max_tokens_key: &[&str],
    default_max: usize,
) -> Result<Common, Response> {
    let model = field(v, "model").ok_or_else(|| bad("`model` is required", Some("model")))?;
    let model = model
        .as_str()
        .ok_or_else(|| bad("`model` must be a string", Some("model")))?;
    if model != app.cfg.model_name {
        return Err(error(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!(
                "the model `{model}` does not exist; this server serves `{}`",
                app.cfg.model_name
            ),
            Some("model"),
        ));
    }
    let context = *app.context.lock().unwrap_or_else(|e| e.into_inner());
    let mut max_new = default_max;
    for key in max_tokens_key {
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
    if top_p == 0.0 {
        return Err(bad("`top_p` must be above 0", Some("top_p")));
    }
    let top_k = match field(v, "top_k") {
        None => 0,
        Some(x) => match x.as_i64() {
            Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            _ => return Err(bad("`top_k` must be an integer >= -1", Some("top_k"))),
        },
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
    Ok(Common {
        params: GenerationParams {
            max_new_tokens: max_new,
            sampling: Sampling {
                temperature: temperature as f32,
                top_k,
                top_p: top_p as f32,
            },
            seed,
            stop,
            stop_token_ids: None,
            ignore_eos,
            n,
        },
        stream,
        include_usage,
    })
}

async fn read_json(app: &App, body: Body) -> Result<Value, Response> {
    let bytes = axum::body::to_bytes(body, app.cfg.max_body_bytes)
        .await
        .map_err(|_| {
            error(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!("the request body is over {} bytes", app.cfg.max_body_bytes),
                None,
            )
        })?;
    let v: Value = serde_json::from_slice(&bytes)
        .map_err(|e| bad(format!("the body is not valid JSON: {e}"), None))?;
    if !v.is_object() {
        return Err(bad("the body must be a JSON object", None));
    }
    Ok(v)
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn new_id(prefix: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{prefix}-{:x}{:06x}",
        now_secs(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Completion,
    Chat,
}

async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    serve_request(app, headers, body, Kind::Completion).await
}

async fn chat_completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Body) -> Response {
    serve_request(app, headers, body, Kind::Chat).await
}

async fn serve_request(app: Arc<App>, headers: HeaderMap, body: Body, kind: Kind) -> Response {
    if let Err(r) = app.authorize(&headers) {
        return r;
    }
    let v = match read_json(&app, body).await {
        Ok(v) => v,
        Err(r) => return r,
    };
    let (prompt, common) = match parse(&app, &v, kind) {
        Ok(x) => x,
        Err(r) => return r,
    };
    let slot = match app.admit() {
        Ok(s) => s,
        Err(r) => return r,
    };
    let (tx, mut rx) = unbounded_channel();
    let n = common.params.n;
    let sent = app
        .cmds
        .lock()
        .map(|c| {
            c.send(Cmd::Add {
                prompt,
                params: common.params,
                tx,
            })
            .is_ok()
        })
        .unwrap_or(false);
    if !sent {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "the engine has stopped",
            None,
        );
    }
    let prompt_tokens = match rx.recv().await {
        Some(Out::Started { prompt_tokens }) => prompt_tokens,
        Some(Out::Error(m)) => {
            return bad(
                m,
                Some(if kind == Kind::Chat {
                    "messages"
                } else {
                    "prompt"
                }),
            )
        }
        _ => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "the engine dropped the request",
                None,
            )
        }
    };
    let id = new_id(if kind == Kind::Chat {
        "chatcmpl"
    } else {
        "cmpl"
    });
    let model = app.cfg.model_name.clone();
    if common.stream {
        stream_response(
            slot,
            rx,
            kind,
            id,
            model,
            n,
            prompt_tokens,
            common.include_usage,
        )
    } else {
        let mut done: Vec<Option<(FinishReason, usize, String)>> = vec![None; n];
        while let Some(out) = rx.recv().await {
            if let Out::Finished {
                index,
                reason,
                token_ids,
                text,
            } = out
            {
                if index < n {
                    done[index] = Some((reason, token_ids.len(), text));
                }
                if done.iter().all(Option::is_some) {
                    break;
                }
            }
        }
        drop(slot);
        let mut choices = Vec::new();
        let mut completion_tokens = 0;
        for (i, d) in done.into_iter().enumerate() {
            let Some((reason, ntok, text)) = d else {
                return error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "server_error",
                    "a request output was lost",
                    None,
                );
            };
            completion_tokens += ntok;
            choices.push(match kind {
                Kind::Completion => json!({"index": i, "text": text, "finish_reason": reason.as_str(), "logprobs": null}),
                Kind::Chat => json!({"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason.as_str(), "logprobs": null}),
            });
        }
        let object = if kind == Kind::Chat {
            "chat.completion"
        } else {
            "text_completion"
        };
        let body = json!({
            "id": id, "object": object, "created": now_secs(), "model": model, "choices": choices,
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens},
        });
        (
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response()
    }
}

fn parse(app: &App, v: &Value, kind: Kind) -> Result<(Prompt, Common), Response> {
    match kind {
        Kind::Completion => {
            let prompt = match field(v, "prompt") {
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
                    a[0].as_str().unwrap_or_default().to_owned()
                }
                Some(_) => {
                    return Err(bad(
                        "`prompt` must be a string (or a list of one string)",
                        Some("prompt"),
                    ))
                }
                None => return Err(bad("`prompt` is required", Some("prompt"))),
            };
            Ok((
                Prompt::Text(prompt),
                parse_common(v, app, &["max_tokens"], 16)?,
            ))
        }
        Kind::Chat => {
            let msgs = field(v, "messages")
                .and_then(Value::as_array)
                .ok_or_else(|| {
                    bad(
                        "`messages` must be a list of {role, content}",
                        Some("messages"),
                    )
                })?;
            let mut out = Vec::with_capacity(msgs.len());
            for m in msgs {
                let role = m.get("role").and_then(Value::as_str);
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
                    _ => None,
                };
                match (role, content) {
                    (Some(r), Some(c)) => out.push(ChatMessage {
                        role: r.to_owned(),
                        content: c,
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
            let default = app
                .context
                .lock()
                .map(|c| c.unwrap_or(4096))
                .unwrap_or(4096);
            // No max_tokens: up to the context, as OpenAI does.
            Ok((
                Prompt::Chat(out),
                parse_common(v, app, &["max_tokens", "max_completion_tokens"], default)?,
            ))
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn stream_response(
    slot: Slot,
    mut rx: UnboundedReceiver<Out>,
    kind: Kind,
    id: String,
    model: String,
    n: usize,
    prompt_tokens: usize,
    include_usage: bool,
) -> Response {
    let (etx, erx) = unbounded_channel::<Result<SseEvent, Infallible>>();
    let object = if kind == Kind::Chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let created = now_secs();
    tokio::spawn(async move {
        let _slot = slot;
        let chunk = |choices: Value| json!({"id": id, "object": object, "created": created, "model": model, "choices": choices});
        let send = |v: Value| {
            etx.send(Ok(SseEvent::default().data(v.to_string())))
                .is_ok()
        };
        if kind == Kind::Chat {
            for i in 0..n {
                if !send(chunk(
                    json!([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]),
                )) {
                    return;
                }
            }
        }
        let mut left = n;
        let mut completion_tokens = 0;
        while let Some(out) = rx.recv().await {
            let piece = match out {
                Out::Token { index, text } if !text.is_empty() => match kind {
                    Kind::Completion => {
                        json!([{"index": index, "text": text, "finish_reason": null, "logprobs": null}])
                    }
                    Kind::Chat => {
                        json!([{"index": index, "delta": {"content": text}, "finish_reason": null}])
                    }
                },
                Out::Finished {
                    index,
                    reason,
                    token_ids,
                    ..
                } => {
                    left -= 1;
                    completion_tokens += token_ids.len();
                    match kind {
                        Kind::Completion => {
                            json!([{"index": index, "text": "", "finish_reason": reason.as_str(), "logprobs": null}])
                        }
                        Kind::Chat => {
                            json!([{"index": index, "delta": {}, "finish_reason": reason.as_str()}])
                        }
                    }
                }
                _ => continue,
            };
            // A failed send: the client is gone; dropping `rx` tells the engine to abort.
            if !send(chunk(piece)) {
                return;
            }
            if left == 0 {
                break;
            }
        }
        if include_usage {
            let mut u = chunk(json!([]));
            u["usage"] = json!({"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                "total_tokens": prompt_tokens + completion_tokens});
            send(u);
        }
        let _ = etx.send(Ok(SseEvent::default().data("[DONE]")));
    });
    Sse::new(tokio_stream::wrappers::UnboundedReceiverStream::new(erx))
        .keep_alive(KeepAlive::default())
        .into_response()
}

async fn models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(r) = app.authorize(&headers) {
        return r;
    }
    let body = json!({"object": "list", "data": [{"id": app.cfg.model_name, "object": "model",
                      "created": now_secs(), "owned_by": "paged_attention"}]});
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn health(State(app): State<Arc<App>>) -> Response {
    if app.ready.load(Ordering::SeqCst) && !app.shutting_down.load(Ordering::SeqCst) {
        (
            [(header::CONTENT_TYPE, "application/json")],
            r#"{"status":"ok"}"#,
        )
            .into_response()
    } else {
        error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "not ready",
            None,
        )
    }
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let m = app.metrics.lock().map(|m| m.clone()).unwrap_or_default();
    let mut s = String::new();
    let mut gauge = |name: &str, help: &str, kind: &str, v: f64| {
        s.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
        ));
    };
    gauge(
        "pa_requests_running",
        "Requests whose sequences are running.",
        "gauge",
        m.running as f64,
    );
    gauge(
        "pa_requests_waiting",
        "Requests waiting to start.",
        "gauge",
        m.waiting as f64,
    );
    gauge(
        "pa_requests_in_flight",
        "HTTP requests admitted and not answered yet.",
        "gauge",
        app.in_flight.load(Ordering::SeqCst) as f64,
    );
    gauge(
        "pa_kv_blocks_used",
        "KV cache blocks referenced by a sequence.",
        "gauge",
        m.blocks_used as f64,
    );
    gauge(
        "pa_kv_blocks_total",
        "KV cache blocks in all.",
        "gauge",
        m.blocks_total as f64,
    );
    let hit_rate = if m.prompt_tokens == 0 {
        0.0
    } else {
        m.prefix_hit_tokens as f64 / m.prompt_tokens as f64
    };
    gauge(
        "pa_prefix_cache_hit_rate",
        "Prompt tokens served from the prefix cache / prompt tokens.",
        "gauge",
        hit_rate,
    );
    gauge(
        "pa_prefix_cache_hits_total",
        "Requests that reused cached prefix blocks.",
        "counter",
        m.prefix_hits as f64,
    );
    gauge(
        "pa_preemptions_total",
        "Sequences preempted for lack of blocks.",
        "counter",
        m.preemptions as f64,
    );
    gauge(
        "pa_generated_tokens_total",
        "Tokens generated.",
        "counter",
        m.generated_tokens as f64,
    );
    gauge(
        "pa_prompt_tokens_total",
        "Prompt tokens admitted.",
        "counter",
        m.prompt_tokens as f64,
    );
    gauge(
        "pa_requests_finished_total",
        "Requests finished (length or stop).",
        "counter",
        m.requests_finished as f64,
    );
    gauge(
        "pa_requests_aborted_total",
        "Requests aborted (client gone, shutdown).",
        "counter",
        m.requests_aborted as f64,
    );
    gauge(
        "pa_engine_steps_total",
        "Engine steps.",
        "counter",
        m.steps as f64,
    );
    m.ttft.render(
        "pa_time_to_first_token_seconds",
        "From admission to the first token.",
        &mut s,
    );
    m.tpot.render(
        "pa_time_per_output_token_seconds",
        "Mean time per output token after the first, per request.",
        &mut s,
    );
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], s).into_response()
}

/// A request's bookkeeping on the engine thread.
struct Client {
    tx: UnboundedSender<Out>,
    left: usize,
    added: Instant,
    first: Option<Instant>,
    tokens: usize,
}

/// The engine thread: loads the model, then serves commands and steps until told to stop.
fn engine_thread(
    dir: PathBuf,
    cfg: EngineConfig,
    app: Arc<App>,
    rx: mpsc::Receiver<Cmd>,
    loaded: std::sync::mpsc::Sender<Result<(), String>>,
) {
    let mut engine = match Engine::load(&dir, &cfg) {
        Ok(e) => e,
        Err(e) => {
            let _ = loaded.send(Err(e.to_string()));
            return;
        }
    };
    if let Ok(mut c) = app.context.lock() {
        *c = engine.context_len();
    }
    if let Ok(mut m) = app.metrics.lock() {
        m.blocks_total = engine.num_blocks();
    }
    app.ready.store(true, Ordering::SeqCst);
    let _ = loaded.send(Ok(()));
    let mut clients: HashMap<RequestId, Client> = HashMap::new();
    let mut finished = 0u64;
    let mut aborted = 0u64;
    let mut ttft = Histogram::default();
    let mut tpot = Histogram::default();
    loop {
        // Commands: wait for one when idle, else take what is there.
        let mut cmds = Vec::new();
        if engine.is_idle() {
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(c) => cmds.push(c),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
        }
        cmds.extend(rx.try_iter());
        for cmd in cmds {
            match cmd {
                Cmd::Stop => return,
                Cmd::AbortAll => {
                    for (id, c) in clients.drain() {
                        for e in engine.abort(id).unwrap_or_default() {
                            forward(&c.tx, e);
                        }
                        aborted += 1;
                    }
                }
                Cmd::Add { prompt, params, tx } => {
                    let ids = match prompt {
                        Prompt::Text(t) => engine.encode_prompt(&t, false),
                        Prompt::Chat(m) => engine.encode_chat(&m),
                    };
                    let n = params.n;
                    match ids.and_then(|ids| {
                        let len = ids.len();
                        engine.add_request(ids, params).map(|id| (id, len))
                    }) {
                        Ok((id, len)) => {
                            let _ = tx.send(Out::Started { prompt_tokens: len });
                            clients.insert(
                                id,
                                Client {
                                    tx,
                                    left: n,
                                    added: Instant::now(),
                                    first: None,
                                    tokens: 0,
                                },
                            );
                        }
                        Err(e) => {
                            let _ = tx.send(Out::Error(e.to_string()));
                        }
                    }
                }
            }
        }
        // Clients that went away: abort before the next step, freeing their blocks.
        let gone: Vec<RequestId> = clients
            .iter()
            .filter(|(_, c)| c.tx.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            clients.remove(&id);
            let _ = engine.abort(id);
            aborted += 1;
        }
        if !engine.is_idle() {
            match engine.step() {
                Ok(events) => {
                    let mut lost = Vec::new();
                    for e in events {
                        let (request, is_token, is_end) = match &e {
                            Event::Token { request, .. } => (*request, true, false),
                            Event::Finished { request, .. } => (*request, false, true),
                        };
                        let Some(c) = clients.get_mut(&request) else {
                            continue;
                        };
                        if is_token {
                            let now = Instant::now();
                            if c.first.is_none() {
                                c.first = Some(now);
                                ttft.observe((now - c.added).as_secs_f64());
                            }
                            c.tokens += 1;
                        }
                        let ok = forward(&c.tx, e);
                        if is_end {
                            c.left -= 1;
                            if c.left == 0 {
                                if let (Some(first), true) = (c.first, c.tokens > 1) {
                                    tpot.observe(
                                        first.elapsed().as_secs_f64() / (c.tokens - 1) as f64,
                                    );
                                }
                                clients.remove(&request);
                                finished += 1;
                                continue;
                            }
                        }
                        if !ok {
                            lost.push(request);
                        }
                    }
                    lost.sort_unstable();
                    lost.dedup();
                    for id in lost {
                        if clients.remove(&id).is_some() {
                            let _ = engine.abort(id);
                            aborted += 1;
                        }
                    }
                }
                Err(e) => {
                    // A failed step fails the requests in it; the server goes on.
                    eprintln!("pa serve: engine step failed: {e}");
                    for (id, c) in clients.drain() {
                        let _ = c.tx.send(Out::Error(format!("the engine failed: {e}")));
                        let _ = engine.abort(id);
                    }
                }
            }
        }
        if let Ok(mut m) = app.metrics.lock() {
            let st = engine.cache_stats();
            let c = engine.counters();
            let s = engine.stats();
            m.running = engine.num_running();
            m.waiting = engine.num_waiting();
            m.blocks_used = st.used_blocks;
            m.prefix_hits = c.prefix_hits;
            m.prefix_hit_tokens = c.prefix_hit_tokens;
            m.prompt_tokens = s.prompt_tokens;
            m.preemptions = c.preemptions;
            m.generated_tokens = s.generated_tokens;
            m.steps = s.steps;
            m.requests_finished = finished;
            m.requests_aborted = aborted;
            m.ttft = ttft.clone();
            m.tpot = tpot.clone();
        }
    }
}

/// Sends an engine event to its client; false when the client is gone.
fn forward(tx: &UnboundedSender<Out>, e: Event) -> bool {
    let out = match e {
        Event::Token { index, text, .. } => Out::Token { index, text },
        Event::Finished {
            index,
            reason,
            token_ids,
            text,
            ..
        } => Out::Finished {
            index,
            reason,
            token_ids,
            text,
        },
    };
    tx.send(out).is_ok()
}

/// Runs the server until SIGINT or SIGTERM; returns once in-flight requests have ended.
pub fn serve(dir: PathBuf, engine_cfg: EngineConfig, cfg: ServeConfig) -> Result<(), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    rt.block_on(async move {
        let addr = format!("{}:{}", cfg.host, cfg.port);
        let listener = tokio::net::TcpListener::bind(&addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let (ctx, crx) = mpsc::channel();
        let app = Arc::new(App {
            cfg: cfg.clone(),
            ready: AtomicBool::new(false),
            shutting_down: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            context: Mutex::new(None),
            cmds: Mutex::new(ctx.clone()),
            metrics: Mutex::new(Metrics::default()),
        });
        let (ltx, lrx) = mpsc::channel();
        let engine_app = app.clone();
        let engine = std::thread::Builder::new()
            .name("pa-engine".into())
            .spawn(move || engine_thread(dir, engine_cfg, engine_app, crx, ltx))
            .map_err(|e| format!("cannot start the engine thread: {e}"))?;
        eprintln!("pa serve: listening on http://{addr} (loading the model)");
        let router = Router::new()
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/models", get(models))
            .route("/health", get(health))
            .route("/metrics", get(metrics))
            .with_state(app.clone());
        // The model loads while the port already answers /health with 503.
        let loading = tokio::task::spawn_blocking(move || lrx.recv().unwrap_or_else(|_| Err("the engine thread ended".into())));
        let server_app = app.clone();
        let shutdown_cmds = ctx.clone();
        let timeout = cfg.shutdown_timeout;
        let shutdown = async move {
            wait_for_signal().await;
            eprintln!("pa serve: shutting down: no new requests; in-flight ones have {timeout:?} to finish");
            server_app.shutting_down.store(true, Ordering::SeqCst);
            // After the timeout, end whatever still runs, so its streams close.
            let cmds = shutdown_cmds.clone();
            tokio::spawn(async move {
                tokio::time::sleep(timeout).await;
                let _ = cmds.send(Cmd::AbortAll);
            });
        };
        let server = tokio::spawn(async move { axum::serve(listener, router).with_graceful_shutdown(shutdown).await });
        match loading.await {
            Ok(Ok(())) => eprintln!("pa serve: ready, model `{}`", cfg.model_name),
            Ok(Err(e)) => {
                server.abort();
                return Err(e);
            }
            Err(e) => return Err(e.to_string()),
        }
        let served = server.await.map_err(|e| e.to_string())?;
        let _ = ctx.send(Cmd::Stop);
        let _ = tokio::task::spawn_blocking(move || engine.join()).await;
        served.map_err(|e| format!("server: {e}"))
    })
}

async fn wait_for_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) {
        (Ok(mut i), Ok(mut t)) => {
            tokio::select! {
                _ = i.recv() => {}
                _ = t.recv() => {}
            }
        }
        _ => std::future::pending::<()>().await,
    }
}
