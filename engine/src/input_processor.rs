//! The input processor: a prompt (text, a conversation, or ids) to token ids, on the caller's
//! thread (an engine client's caller: an HTTP handler's blocking task, `pa generate`'s submitter),
//! never on the engine's. What cannot fit the model's context is refused before the work that
//! would show it: a text longer in bytes than the context's tokens can cover is not tokenized,
//! and the chat template's output is capped at that length.

use crate::error::EngineError;
use crate::request::{Prompt, RequestError};
use crate::tokenizer::TextTokenizer;
use std::sync::Arc;

/// The cap on a prompt's bytes (and a chat template's output) when the model names no context.
const NO_CONTEXT_MAX_BYTES: usize = 64 << 20;

#[derive(Clone)]
pub struct InputProcessor {
    tokenizer: Arc<TextTokenizer>,
    context: Option<usize>,
    max_prompt_bytes: usize,
}

impl InputProcessor {
    pub fn new(tokenizer: Arc<TextTokenizer>, context: Option<usize>) -> InputProcessor {
        // No token covers more than `max_token_bytes` of a prompt; twice that leaves room for a
        // normalizer that drops characters.
        let max_prompt_bytes = context.map_or(NO_CONTEXT_MAX_BYTES, |c| {
            c.saturating_mul(tokenizer.max_token_bytes())
                .saturating_mul(2)
        });
        InputProcessor {
            tokenizer,
            context,
            max_prompt_bytes,
        }
    }

    pub fn tokenizer(&self) -> &Arc<TextTokenizer> {
        &self.tokenizer
    }

    /// The model's context (`max_position_embeddings`), when config.json gives it.
    pub fn context_len(&self) -> Option<usize> {
        self.context
    }

    /// The longest prompt text (or chat template output) that can fit the context.
    pub fn max_prompt_bytes(&self) -> usize {
        self.max_prompt_bytes
    }

    /// Token ids of a prompt, or why it cannot run (blamed on the prompt).
    pub fn process(&self, prompt: Prompt) -> Result<Vec<u32>, RequestError> {
        let over = |bytes: usize| {
            RequestError::prompt(format!(
                "the prompt is {bytes} bytes, more than the model's context of {} tokens can hold",
                self.context.unwrap_or(0)
            ))
        };
        let refused = |e: EngineError| RequestError::prompt(e.to_string());
        match prompt {
            Prompt::Ids(ids) => Ok(ids),
            Prompt::Text(text) => {
                if text.len() > self.max_prompt_bytes {
                    return Err(over(text.len()));
                }
                self.tokenizer.encode(&text, true).map_err(refused)
            }
            Prompt::Chat { messages, tools } => {
                let text = self
                    .tokenizer
                    .apply_chat_template(&messages, tools.as_deref(), true, self.max_prompt_bytes)
                    .map_err(refused)?;
                self.tokenizer.encode(&text, false).map_err(refused)
            }
        }
    }
}
