//! The output processor: turns the tokens an output samples into its text, incrementally
//! (never half a character), holds back what may begin a stop string, cuts the text at one, and
//! says why an output ends. The engine core knows tokens only; this is where they become text.

use crate::error::Result;
use crate::request::{Event, RequestId};
use crate::tokenizer::{StreamDecoder, TextTokenizer};
use paged_attention::cache::FinishReason;

/// The text side of one output of a request.
#[derive(Default)]
pub(crate) struct OutputText {
    pub generated: Vec<u32>,
    decoder: StreamDecoder,
    /// Decoded text so far, and how much of it was emitted (the rest may start a stop string).
    text: String,
    emitted: usize,
    pub done: bool,
}

/// What a token did to its output.
pub(crate) struct Accepted {
    /// Text that can be shown now (possibly empty).
    pub text: String,
    /// The output ends here (a stop id or a stop string); its reason is `Stop`.
    pub stop: bool,
}

impl OutputText {
    /// Records a sampled token: its text, a stop id (`is_stop_id`), or a stop string of `stop`.
    pub fn accept(
        &mut self,
        tok: &TextTokenizer,
        token: u32,
        is_stop_id: bool,
        stop: &[String],
    ) -> Result<Accepted> {
        self.generated.push(token);
        if !is_stop_id {
            let piece = self.decoder.push(tok, token)?;
            self.text.push_str(&piece);
        }
        // A stop string ends the output; its text ends before it.
        let mut cut = None;
        if !stop.is_empty() {
            let longest = stop.iter().map(|s| s.len()).max().unwrap_or(0);
            let from = self.emitted.saturating_sub(longest);
            let from = (0..=from)
                .rev()
                .find(|&i| self.text.is_char_boundary(i))
                .unwrap_or(0);
            cut = stop
                .iter()
                .filter(|s| !s.is_empty())
                .filter_map(|s| self.text[from..].find(s.as_str()).map(|p| from + p))
                .min();
        }
        if let Some(at) = cut {
            self.text.truncate(at);
        }
        let ends = cut.is_some() || is_stop_id;
        // Emit what can no longer start a stop string.
        let hold = if ends {
            0
        } else {
            stop.iter()
                .map(|s| s.len().saturating_sub(1))
                .max()
                .unwrap_or(0)
        };
        let mut upto = self.text.len().saturating_sub(hold).max(self.emitted);
        while !self.text.is_char_boundary(upto) {
            upto -= 1;
        }
        let upto = upto.max(self.emitted);
        let text = self.text[self.emitted..upto].to_string();
        self.emitted = upto;
        Ok(Accepted { text, stop: ends })
    }

    /// Ends the output: the text still held back (flushed from the decoder unless a stop ended
    /// it) as a last `Token` event, then its `Finished` event.
    pub fn finish(
        &mut self,
        tok: &TextTokenizer,
        request: RequestId,
        index: usize,
        reason: FinishReason,
        events: &mut Vec<Event>,
    ) -> Result<()> {
        if self.done {
            return Ok(());
        }
        self.done = true;
        if reason != FinishReason::Stop {
            let rest = self.decoder.flush(tok)?;
            self.text.push_str(&rest);
        }
        if self.emitted < self.text.len() {
            let text = self.text[self.emitted..].to_string();
            self.emitted = self.text.len();
            events.push(Event::Token {
                request,
                index,
                token: *self.generated.last().unwrap_or(&0),
                text,
                logprobs: None,
            });
        }
        events.push(Event::Finished {
            request,
            index,
            reason,
            token_ids: self.generated.clone(),
            text: self.text.clone(),
        });
        Ok(())
    }
}
