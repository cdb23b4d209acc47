//! The routes, their handlers, and what every handler shares: the API key, admission (a queue
//! bound, 503 while loading or draining), and OpenAI's error JSON on every error status, whoever
//! made the response.

use super::openai::{self, error, refused, Kind};
use super::response;
use super::ServeConfig;
use crate::client::EngineClient;
use crate::request::{RequestError, Update};
use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::json;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

pub(crate) struct App {
    pub cfg: ServeConfig,
    pub client: Arc<EngineClient>,
    pub ready: AtomicBool,
    pub shutting_down: AtomicBool,
    /// Requests admitted and not answered yet (a stream until its last event).
    pub in_flight: AtomicUsize,
}

/// Holds a place in the queue until the response is done.
pub(crate) struct Slot(Arc<App>);
impl Drop for Slot {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

pub(crate) fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .route("/debug/kv-cache-blocks", get(kv_cache_blocks))
        .fallback(not_found)
        .layer(axum::middleware::map_response(as_openai_error))
        .with_state(app)
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
                "missing or wrong API key (Authorization: Bearer KEY)",
                None,
            ))
        }
    }

    fn admit(self: &Arc<App>) -> Result<Slot, Response> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server is shutting down",
                None,
            ));
        }
        if !self.ready.load(Ordering::SeqCst) {
            return Err(error(
                StatusCode::SERVICE_UNAVAILABLE,
                "the model is still loading",
                None,
            ));
        }
        let n = self.in_flight.fetch_add(1, Ordering::SeqCst);
        let slot = Slot(self.clone());
        if n >= self.cfg.max_queue {
            let mut r = error(
                StatusCode::SERVICE_UNAVAILABLE,
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
    let v = match openai::read_json(body, app.cfg.max_body_bytes, app.cfg.read_timeout).await {
        Ok(v) => v,
        Err(r) => return r,
    };
    let context = app.client.inputs().context_len();
    let req = match openai::parse(&v, kind, &app.cfg.model_name, context) {
        Ok(x) => x,
        Err(r) => return r,
    };
    drop(v);
    let slot = match app.admit() {
        Ok(s) => s,
        Err(r) => return r,
    };
    // Tokenizing (and the chat template) runs here, on a blocking thread, not the engine's.
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let n = req.params.n;
    let client = app.client.clone();
    let (prompt, params) = (req.prompt, req.params);
    let blame = |e: &RequestError| {
        let e = openai::blame_constraint(e, req.constraint_field);
        refused(&e, kind.prompt_field())
    };
    let submitted = tokio::task::spawn_blocking(move || client.submit(prompt, params, tx)).await;
    match submitted {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return blame(&e),
        Err(_) => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the tokenizer failed",
                None,
            )
        }
    }
    let prompt_tokens = match rx.recv().await {
        Some(Update::Accepted { prompt_tokens, .. }) => prompt_tokens,
        Some(Update::Refused { error: e, .. }) => return blame(&e),
        _ => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "the engine dropped the request",
                None,
            )
        }
    };
    let answer = response::Answer {
        kind,
        id: response::new_id(kind),
        model: app.cfg.model_name.clone(),
        n,
        prompt_tokens,
    };
    if req.stream {
        response::stream(slot, rx, answer, req.include_usage)
    } else {
        let r = response::whole(rx, answer).await;
        drop(slot);
        r
    }
}

async fn models(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(r) = app.authorize(&headers) {
        return r;
    }
    let body = json!({"object": "list", "data": [{"id": app.cfg.model_name, "object": "model",
                      "created": response::now_secs(), "owned_by": "paged_attention"}]});
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
        error(StatusCode::SERVICE_UNAVAILABLE, "not ready", None)
    }
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let text = app.client.snapshot().prometheus(
        &app.cfg.model_name,
        app.cfg.metric_names,
        app.in_flight.load(Ordering::SeqCst),
    );
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// The prefix cache's block hashes and the KV-event batch they follow (for checking a
/// subscriber's replay); served only with `--kv-events-endpoint`, and behind the API key.
async fn kv_cache_blocks(State(app): State<Arc<App>>, headers: HeaderMap) -> Response {
    if let Err(r) = app.authorize(&headers) {
        return r;
    }
    let client = app.client.clone();
    match tokio::task::spawn_blocking(move || client.cache_blocks()).await {
        Ok(Some(b)) => (
            [(header::CONTENT_TYPE, "application/json")],
            json!({"seq": b.seq, "block_hashes": b.hashes}).to_string(),
        )
            .into_response(),
        _ => error(
            StatusCode::NOT_FOUND,
            "KV-cache events are not published (--kv-events-endpoint)",
            None,
        ),
    }
}

async fn not_found(method: Method, uri: Uri) -> Response {
    error(
        StatusCode::NOT_FOUND,
        format!("no route for {method} {}", uri.path()),
        None,
    )
}

/// Every error status gets OpenAI's error JSON, also those the router makes itself (405).
async fn as_openai_error(r: Response) -> Response {
    let status = r.status();
    let is_json = r
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return r;
    }
    let message = status.canonical_reason().unwrap_or("error").to_string();
    let mut out = error(status, message, None);
    for (name, value) in r.headers() {
        if name == header::ALLOW || name == header::RETRY_AFTER {
            out.headers_mut().insert(name.clone(), value.clone());
        }
    }
    out
}
