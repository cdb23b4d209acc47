//! A request's answer in OpenAI's shapes: one JSON body when the outputs are done, or
//! server-sent events as they come (`data: [DONE]` at the end). A stream whose client has gone
//! stops at once, whether or not it had text to send, and so drops its request's channel, which
//! makes the engine abort the request.

use super::openai::{error, Kind};
use super::tools::{CallDeltas, CallOutput};
use crate::request::{Event, Update};
use crate::FinishReason;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

pub(crate) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

pub(crate) fn new_id(kind: Kind) -> String {
    unique_id(match kind {
        Kind::Completion => "cmpl-",
        Kind::Chat => "chatcmpl-",
    })
}

/// `prefix` and a number no other id of this process has.
pub(crate) fn unique_id(prefix: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{prefix}{:x}{:06x}",
        now_secs(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// What every answer of a request names.
pub(crate) struct Answer {
    pub kind: Kind,
    pub id: String,
    pub model: String,
    pub n: usize,
    pub prompt_tokens: usize,
    /// How a chat answer's text becomes tool calls (`None`: it is all content).
    pub calls: Option<CallOutput>,
}

impl Answer {
    fn usage(&self, completion_tokens: usize) -> Value {
        json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
               "total_tokens": self.prompt_tokens + completion_tokens})
    }
}

/// The answer once every output has finished.
pub(crate) async fn whole(mut rx: UnboundedReceiver<Update>, a: Answer) -> Response {
    let mut done: Vec<Option<(FinishReason, usize, String)>> = vec![None; a.n];
    while let Some(u) = rx.recv().await {
        match u {
            Update::Event(Event::Finished {
                index,
                reason,
                token_ids,
                text,
                ..
            }) => {
                if index < a.n {
                    done[index] = Some((reason, token_ids.len(), text));
                }
                if done.iter().all(Option::is_some) {
                    break;
                }
            }
            Update::Failed { message, .. } => {
                return error(StatusCode::INTERNAL_SERVER_ERROR, message, None)
            }
            _ => {}
        }
    }
    let mut choices = Vec::new();
    let mut completion_tokens = 0;
    for (i, d) in done.into_iter().enumerate() {
        let Some((reason, ntok, text)) = d else {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "a request output was lost",
                None,
            );
        };
        completion_tokens += ntok;
        choices.push(match (a.kind, a.calls) {
            (Kind::Completion, _) => json!({"index": i, "text": text, "finish_reason": reason.as_str(), "logprobs": null}),
            (Kind::Chat, None) => json!({"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason.as_str(), "logprobs": null}),
            (Kind::Chat, Some(calls)) => {
                let (message, finish) = calls.message(&text, reason);
                json!({"index": i, "message": message, "finish_reason": finish, "logprobs": null})
            }
        });
    }
    let object = match a.kind {
        Kind::Chat => "chat.completion",
        Kind::Completion => "text_completion",
    };
    let body = json!({
        "id": a.id, "object": object, "created": now_secs(), "model": a.model, "choices": choices,
        "usage": a.usage(completion_tokens),
    });
    (
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

/// The answer as server-sent events; `slot` (the request's place in the queue) is held until
/// the stream ends.
pub(crate) fn stream(
    slot: impl Send + 'static,
    mut rx: UnboundedReceiver<Update>,
    a: Answer,
    include_usage: bool,
) -> Response {
    let (etx, erx) = unbounded_channel::<Result<SseEvent, Infallible>>();
    let object = match a.kind {
        Kind::Chat => "chat.completion.chunk",
        Kind::Completion => "text_completion",
    };
    let created = now_secs();
    tokio::spawn(async move {
        let _slot = slot;
        let chunk = |choices: Value| json!({"id": a.id, "object": object, "created": created, "model": a.model, "choices": choices});
        let send = |v: Value| {
            etx.send(Ok(SseEvent::default().data(v.to_string())))
                .is_ok()
        };
        if a.kind == Kind::Chat {
            for i in 0..a.n {
                if !send(chunk(
                    json!([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]),
                )) {
                    return;
                }
            }
        }
        let mut left = a.n;
        let mut completion_tokens = 0;
        // Per output, its text turned into content and call deltas.
        let mut calls: Vec<Option<CallDeltas>> =
            (0..a.n).map(|_| a.calls.map(|c| c.deltas())).collect();
        loop {
            // The client leaving ends the stream now, not at the next text it would have got.
            let u = tokio::select! {
                u = rx.recv() => u,
                () = etx.closed() => return,
            };
            let Some(u) = u else { break };
            let delta = |index: usize, d: Value| json!([{"index": index, "delta": d, "finish_reason": null}]);
            let piece = match u {
                Update::Event(Event::Token { index, text, .. }) if !text.is_empty() => {
                    match (a.kind, calls.get_mut(index).and_then(Option::as_mut)) {
                        (Kind::Completion, _) => {
                            json!([{"index": index, "text": text, "finish_reason": null, "logprobs": null}])
                        }
                        (Kind::Chat, None) => delta(index, json!({"content": text})),
                        (Kind::Chat, Some(c)) => {
                            for d in c.push(&text) {
                                if !send(chunk(delta(index, d))) {
                                    return;
                                }
                            }
                            continue;
                        }
                    }
                }
                Update::Event(Event::Finished {
                    index,
                    reason,
                    token_ids,
                    ..
                }) => {
                    left -= 1;
                    completion_tokens += token_ids.len();
                    let mut finish = reason.as_str();
                    if let Some(c) = calls.get_mut(index).and_then(Option::as_mut) {
                        let (deltas, f) = c.finish(reason);
                        finish = f;
                        for d in deltas {
                            if !send(chunk(delta(index, d))) {
                                return;
                            }
                        }
                    }
                    match a.kind {
                        Kind::Completion => {
                            json!([{"index": index, "text": "", "finish_reason": finish, "logprobs": null}])
                        }
                        Kind::Chat => {
                            json!([{"index": index, "delta": {}, "finish_reason": finish}])
                        }
                    }
                }
                Update::Failed { message, .. } => {
                    let e = json!({"error": {"message": message, "type": "server_error", "param": null, "code": null}});
                    send(e);
                    return;
                }
                _ => continue,
            };
            if !send(chunk(piece)) {
                return;
            }
            if left == 0 {
                break;
            }
        }
        if include_usage {
            let mut u = chunk(json!([]));
            u["usage"] = a.usage(completion_tokens);
            send(u);
        }
        let _ = etx.send(Ok(SseEvent::default().data("[DONE]")));
    });
    Sse::new(tokio_stream::wrappers::UnboundedReceiverStream::new(erx))
        .keep_alive(KeepAlive::default())
        .into_response()
}
