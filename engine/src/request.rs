//! A request as the engine takes it: its prompt, its parameters (checked in one place, each
//! fault blamed on the parameter that has it), and what comes back: per-output events, and the
//! updates an engine client sends a request's caller.

use crate::sampling::{Penalties, Sampling, TokenLogprobs, MAX_TOP_LOGPROBS};
use crate::tools::ToolCall;
use paged_attention::cache::FinishReason;

/// A request's id, unique in its engine (the engine client hands them out).
pub type RequestId = u64;

/// What one request asks for.
#[derive(Clone, Debug)]
pub struct GenerationParams {
    pub max_new_tokens: usize,
    pub sampling: Sampling,
    /// Repetition, presence and frequency penalties and the logit bias.
    pub penalties: Penalties,
    /// Seed of the sampler (output `i` of the request draws from `seed + i`); `None`: a fresh one.
    pub seed: Option<u64>,
    /// Text that ends an output; it is not part of the text returned.
    pub stop: Vec<String>,
    /// Ids that end an output; `None`: the model's end-of-sequence ids.
    pub stop_token_ids: Option<Vec<u32>>,
    /// Generate `max_new_tokens` even past an end-of-sequence id.
    pub ignore_eos: bool,
    /// Outputs of the request (parallel samples sharing the prompt's blocks).
    pub n: usize,
    /// Each generated token's log-probability, with this many of the most likely tokens of its
    /// row (at most [`MAX_TOP_LOGPROBS`]); `None`: none computed.
    pub logprobs: Option<usize>,
    /// The same for the prompt's tokens ([`Event::PromptLogprobs`]); `None`: none computed.
    pub prompt_logprobs: Option<usize>,
    /// What the output's text must be (structured output), enforced by a token mask; `None`:
    /// free text.
    pub constraint: Option<Constraint>,
}

/// A constraint on an output's text (structured output). The engine compiles it for its
/// tokenizer when the request is added (`structured::Grammars::compile`), refusing a
/// schema or grammar the library cannot compile with a [`RequestError`] blamed on
/// [`Constraint::param`]; then each step masks the sampler's logits to the tokens the constraint
/// allows, allows an end-of-sequence id only where the text is complete, and ends the output
/// (reason `stop`) when nothing more may follow.
#[derive(Clone, Debug)]
pub enum Constraint {
    /// Any JSON object.
    JsonObject,
    /// JSON that a JSON Schema accepts.
    JsonSchema(serde_json::Value),
    /// Text that a regular expression matches as a whole.
    Regex(String),
    /// Text of a Lark grammar (llguidance's Lark dialect, `start` the start rule).
    Lark(String),
}

impl Constraint {
    /// The request field a fault in this constraint is blamed on, as the OpenAI server reads it
    /// (a caller that takes it from another field rewrites `RequestError::param`).
    pub fn param(&self) -> &'static str {
        match self {
            Constraint::JsonObject | Constraint::JsonSchema(_) => "response_format",
            Constraint::Regex(_) => "guided_regex",
            Constraint::Lark(_) => "guided_grammar",
        }
    }

    /// Its own shape (what needs no tokenizer); compiling it checks the rest.
    pub fn validate(&self) -> Result<(), RequestError> {
        let fault = |m: &str| Err(RequestError::param(self.param(), m));
        match self {
            Constraint::JsonObject => Ok(()),
            Constraint::JsonSchema(s) if !(s.is_object() || s.is_boolean()) => {
                fault("a JSON schema must be an object (or true/false)")
            }
            Constraint::JsonSchema(_) => Ok(()),
            Constraint::Regex(r) if r.is_empty() => fault("the regular expression is empty"),
            Constraint::Lark(g) if g.trim().is_empty() => fault("the grammar is empty"),
            Constraint::Regex(_) | Constraint::Lark(_) => Ok(()),
        }
    }
}

impl Default for GenerationParams {
    fn default() -> GenerationParams {
        GenerationParams {
            max_new_tokens: 64,
            sampling: Sampling::default(),
            penalties: Penalties::default(),
            seed: None,
            stop: Vec::new(),
            stop_token_ids: None,
            ignore_eos: false,
            n: 1,
            logprobs: None,
            prompt_logprobs: None,
            constraint: None,
        }
    }
}

impl GenerationParams {
    /// The parameters' own ranges (what does not depend on the model).
    pub fn validate(&self) -> Result<(), RequestError> {
        if self.n == 0 {
            return Err(RequestError::param("n", "`n` must be at least 1"));
        }
        if self.max_new_tokens == 0 {
            return Err(RequestError::param(
                "max_tokens",
                "max_new_tokens must be at least 1",
            ));
        }
        if let Some(c) = &self.constraint {
            c.validate()?;
        }
        let s = &self.sampling;
        if !(s.temperature >= 0.0 && s.temperature.is_finite()) {
            return Err(RequestError::param(
                "temperature",
                format!("temperature must be a number >= 0, got {}", s.temperature),
            ));
        }
        // Checked as the sampler holds it (f32): a positive f64 that rounds to 0 is refused here.
        if !(s.top_p > 0.0 && s.top_p <= 1.0) {
            return Err(RequestError::param(
                "top_p",
                format!(
                    "top_p must be in (0, 1] (as a 32-bit float), got {}",
                    s.top_p
                ),
            ));
        }
        for (name, n) in [
            ("logprobs", self.logprobs),
            ("prompt_logprobs", self.prompt_logprobs),
        ] {
            if let Some(n) = n.filter(|&n| n > MAX_TOP_LOGPROBS) {
                return Err(RequestError::param(
                    name,
                    format!("at most {MAX_TOP_LOGPROBS} top logprobs a token, got {n}"),
                ));
            }
        }
        let pen = &self.penalties;
        if !(pen.repetition > 0.0 && pen.repetition.is_finite()) {
            return Err(RequestError::param(
                "repetition_penalty",
                format!(
                    "repetition_penalty must be a number > 0, got {}",
                    pen.repetition
                ),
            ));
        }
        for (name, x) in [
            ("presence_penalty", pen.presence),
            ("frequency_penalty", pen.frequency),
        ] {
            if !(-2.0..=2.0).contains(&x) {
                return Err(RequestError::param(
                    name,
                    format!("{name} must be a number from -2 to 2, got {x}"),
                ));
            }
        }
        if let Some((t, b)) = pen
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            return Err(RequestError::param(
                "logit_bias",
                format!("the bias of token {t} must be a number from -100 to 100, got {b}"),
            ));
        }
        Ok(())
    }
}

/// Why a request was refused, and which of its parameters is at fault (`None`: the prompt).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestError {
    pub param: Option<&'static str>,
    pub message: String,
}

impl RequestError {
    pub fn param(param: &'static str, message: impl Into<String>) -> RequestError {
        RequestError {
            param: Some(param),
            message: message.into(),
        }
    }
    pub fn prompt(message: impl Into<String>) -> RequestError {
        RequestError {
            param: None,
            message: message.into(),
        }
    }
}

impl std::fmt::Display for RequestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// One chat message (`role`: system, user, assistant, tool, ...), as a chat template gets it
/// (the fields a message does not have are absent, not null, so `'tool_calls' in message` holds
/// only where there are calls).
#[derive(Clone, Debug, Default, serde::Serialize, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant message's tool calls.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// A tool message's answer to this call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// The author's name (OpenAI's `name`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

/// A prompt before tokenizing.
#[derive(Clone, Debug)]
pub enum Prompt {
    /// Plain text (the tokenizer's special tokens added, as GenAI does).
    Text(String),
    /// A conversation, through the chat template, with the `tools` it is given (OpenAI's tool
    /// objects).
    Chat {
        messages: Vec<ChatMessage>,
        tools: Option<Vec<serde_json::Value>>,
    },
    /// Token ids as they are.
    Ids(Vec<u32>),
}

/// What a step produced, per output of a request.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// New text for output `index` of `request` (empty while a character or a possible stop
    /// string is incomplete), and the token sampled, with its log-probabilities when the request
    /// asked for them (`None` on the last event of an output that only flushes held-back text).
    Token {
        request: RequestId,
        index: usize,
        token: u32,
        text: String,
        logprobs: Option<TokenLogprobs>,
    },
    /// The log-probabilities of `request`'s prompt tokens (asked with `prompt_logprobs`), sent
    /// once before its first token: `logprobs[i]` is the prompt's token `i + 1` under the
    /// tokens before it; `first` is the prompt's first token, which has none.
    PromptLogprobs {
        request: RequestId,
        first: u32,
        logprobs: Vec<TokenLogprobs>,
    },
    /// Output `index` of `request` ended; its generated ids (the stop token included, text after
    /// a stop string cut) and full text.
    Finished {
        request: RequestId,
        index: usize,
        reason: FinishReason,
        token_ids: Vec<u32>,
        text: String,
    },
}

impl Event {
    pub fn request(&self) -> RequestId {
        match self {
            Event::Token { request, .. }
            | Event::PromptLogprobs { request, .. }
            | Event::Finished { request, .. } => *request,
        }
    }
}

/// What an engine client sends the caller of a request, in this order: `Accepted` or
/// `Refused`, then the request's events, the last of them a `Finished` per output (or `Failed`
/// when the engine itself failed).
#[derive(Clone, Debug, PartialEq)]
pub enum Update {
    Accepted {
        request: RequestId,
        prompt_tokens: usize,
    },
    Refused {
        request: RequestId,
        error: RequestError,
    },
    Event(Event),
    /// The engine failed a step holding this request (an OpenVINO error, say); it is ended.
    Failed {
        request: RequestId,
        message: String,
    },
}
