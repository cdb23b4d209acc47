//! A request's answer in OpenAI's shapes: one JSON body when the outputs are done, or
//! server-sent events as they come (`data: [DONE]` at the end). A stream whose client has gone
//! stops at once, whether or not it had text to send, and so drops its request's channel, which
//! makes the engine abort the request.

use super::logprobs::{self, Entry};
use super::openai::{error, Kind};
use super::tools::{CallDeltas, CallOutput};
use crate::request::{Event, Update};
use crate::tokenizer::TextTokenizer;
use crate::FinishReason;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

pub(crate) fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A response id: the kind's prefix and 128 random bits from the OS (getrandom), so ids of
/// replicas behind one router, and of restarts, do not collide (a clock-and-counter id did).
/// Should the OS refuse randomness, the bits are the clock's nanoseconds, the process id and a
/// counter: unique within a machine, and the request is still served.
pub(crate) fn new_id(kind: Kind) -> String {
    unique_id(match kind {
        Kind::Completion => "cmpl-",
        Kind::Chat => "chatcmpl-",
    })
}

/// `prefix` and 128 random bits (see [`new_id`]).
pub(crate) fn unique_id(prefix: &str) -> String {
    let mut bits = [0u8; 16];
    if getrandom::fill(&mut bits).is_err() {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let tail = (u64::from(std::process::id()) << 32)
            | NEXT.fetch_add(1, Ordering::Relaxed) as u64 & 0xffff_ffff;
        bits[..8].copy_from_slice(&nanos.to_le_bytes());
        bits[8..].copy_from_slice(&tail.to_le_bytes());
    }
    format!("{prefix}{:032x}", u128::from_le_bytes(bits))
}

/// What every answer of a request names.
pub(crate) struct Answer {
    pub kind: Kind,
    pub id: String,
    pub model: String,
    pub n: usize,
    pub prompt_tokens: usize,
    /// The request asked for logprobs: every choice carries them.
    pub logprobs: bool,
    /// Completions' `echo`: this prompt text comes first in every choice.
    pub echo: Option<String>,
    /// Names the tokens of the logprobs.
    pub tokenizer: Arc<TextTokenizer>,
    /// How a chat answer's text becomes tool calls (`None`: it is all content).
    pub calls: Option<CallOutput>,
}

impl Answer {
    fn usage(&self, completion_tokens: usize) -> Value {
        json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
               "total_tokens": self.prompt_tokens + completion_tokens})
    }

    /// Every choice's gathering, each starting with the echoed prompt.
    fn choices(&self) -> Vec<Gathered> {
        (0..self.n)
            .map(|_| Gathered {
                text: self.echo.clone().unwrap_or_default(),
                ..Gathered::default()
            })
            .collect()
    }

    /// The `logprobs` value of a choice for `g`'s entries (taken), `null` when not asked.
    fn logprobs(&self, g: &mut Gathered) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        let entries = std::mem::take(&mut g.entries);
        match self.kind {
            Kind::Chat => logprobs::chat(&self.tokenizer, &entries),
            Kind::Completion => logprobs::completion(&self.tokenizer, &entries, &mut g.offset),
        }
    }
}

/// What a choice has gathered and not sent yet: its text and its tokens' logprobs (and for
/// completions, the text offset reached).
#[derive(Default)]
struct Gathered {
    text: String,
    entries: Vec<Entry>,
    offset: usize,
}

impl Gathered {
    /// Takes in an event of the choice's (or of its request's prompt).
    fn take(&mut self, e: &Event) {
        match e {
            Event::Token {
                token,
                text,
                logprobs,
                ..
            } => {
                self.text.push_str(text);
                if let Some(lp) = logprobs {
                    self.entries.push(Entry {
                        token: *token,
                        logprobs: Some(lp.clone()),
                    });
                }
            }
            Event::PromptLogprobs { .. } => self.entries.extend(Entry::of_prompt(e)),
            Event::Finished { .. } => {}
        }
    }
}

/// The choice index an event is for (`None`: every choice of the request).
fn choice_of(e: &Event) -> Option<usize> {
    match e {
        Event::Token { index, .. } | Event::Finished { index, .. } => Some(*index),
        Event::PromptLogprobs { .. } => None,
    }
}

/// The answer once every output has finished.
pub(crate) async fn whole(mut rx: UnboundedReceiver<Update>, a: Answer) -> Response {
    let mut done: Vec<Option<(FinishReason, usize)>> = vec![None; a.n];
    let mut got = a.choices();
    while let Some(u) = rx.recv().await {
        match u {
            Update::Event(e) => {
                let index = choice_of(&e);
                for (i, g) in got.iter_mut().enumerate() {
                    if index.is_none_or(|k| k == i) {
                        g.take(&e);
                    }
                }
                if let Event::Finished {
                    index,
                    reason,
                    token_ids,
                    ..
                } = e
                {
                    if index < a.n {
                        done[index] = Some((reason, token_ids.len()));
                    }
                    if done.iter().all(Option::is_some) {
                        break;
                    }
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
    for (i, (d, g)) in done.into_iter().zip(&mut got).enumerate() {
        let Some((reason, ntok)) = d else {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "a request output was lost",
                None,
            );
        };
        completion_tokens += ntok;
        let logprobs = a.logprobs(g);
        let text = std::mem::take(&mut g.text);
        choices.push(match (a.kind, a.calls) {
            (Kind::Completion, _) => json!({"index": i, "text": text, "finish_reason": reason.as_str(), "logprobs": logprobs}),
            (Kind::Chat, None) => json!({"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": reason.as_str(), "logprobs": logprobs}),
            (Kind::Chat, Some(calls)) => {
                let (message, finish) = calls.message(&text, reason);
                json!({"index": i, "message": message, "finish_reason": finish, "logprobs": logprobs})
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
/// the stream ends. A chunk goes out when a choice has new text (its tokens' logprobs with it,
/// those of tokens whose text is still held back in a later chunk), and one ends each choice.
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
                    json!([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]),
                )) {
                    return;
                }
            }
        }
        let mut got = a.choices();
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
            let e = match u {
                Update::Event(e) => e,
                Update::Failed { message, .. } => {
                    let e = json!({"error": {"message": message, "type": "server_error", "param": null, "code": null}});
                    send(e);
                    return;
                }
                _ => continue,
            };
            let index = choice_of(&e);
            for (i, g) in got.iter_mut().enumerate() {
                if index.is_none_or(|k| k == i) {
                    g.take(&e);
                }
            }
            let (i, reason) = match &e {
                Event::Token { index, .. } if got[*index].text.is_empty() => continue,
                Event::Token { index, .. } => (*index, None),
                Event::Finished {
                    index,
                    reason,
                    token_ids,
                    ..
                } => {
                    left -= 1;
                    completion_tokens += token_ids.len();
                    (*index, Some(*reason))
                }
                Event::PromptLogprobs { .. } => continue,
            };
            let Some(g) = got.get_mut(i) else { continue };
            let text = std::mem::take(&mut g.text);
            let finish = reason.map(|r| r.as_str());
            let piece = match (a.kind, calls.get_mut(i).and_then(Option::as_mut)) {
                (Kind::Completion, _) => {
                    json!([{"index": i, "text": text, "finish_reason": finish, "logprobs": a.logprobs(g)}])
                }
                (Kind::Chat, None) => {
                    let delta = if text.is_empty() {
                        json!({})
                    } else {
                        json!({ "content": text })
                    };
                    json!([{"index": i, "delta": delta, "logprobs": a.logprobs(g), "finish_reason": finish}])
                }
                // Tool calls: the text becomes content and call deltas as the parser reads it;
                // the logprobs of its tokens ride on the chunk that ends the choice.
                (Kind::Chat, Some(c)) => {
                    let mut deltas = c.push(&text);
                    let mut finish = None;
                    if let Some(r) = reason {
                        let (more, f) = c.finish(r);
                        deltas.extend(more);
                        finish = Some(f);
                    }
                    for d in deltas {
                        if !send(chunk(
                            json!([{"index": i, "delta": d, "logprobs": null, "finish_reason": null}]),
                        )) {
                            return;
                        }
                    }
                    let Some(f) = finish else { continue };
                    json!([{"index": i, "delta": {}, "logprobs": a.logprobs(g), "finish_reason": f}])
                }
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
