//! Tool calls found in a model's text as it streams in. The text goes in as it comes (any
//! split); out come pieces: content, a call's start (its name), and its arguments in fragments,
//! so a stream can send them as OpenAI does. Text that may still turn out to be the start of a
//! call is held back until it is known not to be. A whole text is parsed by the same code in one
//! push, so a stream and a whole answer always agree.
//!
//! A call is a JSON object with the function's name under `name` and its arguments (an object)
//! under `arguments` or `parameters`. Its surroundings are the syntax's:
//! - Hermes (Qwen2.5, SmolLM2): `<tool_call>` CALL `</tool_call>`, any number, after optional
//!   content; inside the tags one object, or a list of them, or several separated by `,` / `;`.
//! - Llama 3.x JSON: the answer starts (after spaces, or `<|python_tag|>`) with CALL, and further
//!   calls follow separated by `;`. An answer that does not start so is content, all of it.
//!
//! Text after the first call that is not a call is dropped (only the text before it is content).

/// What an output's text turns into, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    /// Text of `message.content`.
    Content(String),
    /// Call `index` (0, 1, ...) starts: its function's name.
    Call { index: usize, name: String },
    /// More of call `index`'s arguments: the fragments of one JSON text.
    Arguments { index: usize, text: String },
}

/// Where calls are in the text: between tags (Hermes), or at its start (Llama 3.x).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Syntax {
    /// The tags around calls; `None`: calls only at the start of the answer.
    pub tags: Option<(&'static str, &'static str)>,
    /// A special token that may precede the calls (kept when the tokenizer does not skip it).
    pub lead: Option<&'static str>,
}

/// The keys a call's arguments may be under.
const ARGUMENT_KEYS: [&str; 2] = ["arguments", "parameters"];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Content, watching for the opening tag (tags) or for the first character (no tags).
    Text,
    /// Inside a call region: between objects, or in one.
    Calls,
    /// The answer is content to its end (no tags, and it did not start with a call).
    Plain,
}

/// The tool calls of one output, parsed as its text arrives.
#[derive(Debug)]
pub struct CallStream {
    syntax: Syntax,
    mode: Mode,
    /// Text received and not yet consumed (a possible tag, the answer's leading spaces).
    buf: String,
    /// The text of the current call region so far, for when it turns out to hold no call.
    region: String,
    /// Calls found in the current region.
    region_calls: usize,
    /// The object being read in the region.
    obj: Option<Obj>,
    /// Calls started so far.
    calls: usize,
    /// Calls kept (`parallel_tool_calls: false` keeps one); later ones are read and dropped.
    max_calls: usize,
}

impl CallStream {
    pub(crate) fn new(syntax: Syntax, max_calls: usize) -> CallStream {
        CallStream {
            syntax,
            mode: Mode::Text,
            buf: String::new(),
            region: String::new(),
            region_calls: 0,
            obj: None,
            calls: 0,
            max_calls: max_calls.max(1),
        }
    }

    /// Calls started so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// The pieces `text` (the next part of the output) completes.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        self.run(&mut out, false);
        out
    }

    /// The pieces still held back, at the end of the output.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        self.run(&mut out, true);
        if self.mode == Mode::Calls && self.region_calls == 0 {
            // A region that never held a call was text after all.
            if let Some(o) = self.obj.take() {
                self.region.push_str(&o.raw);
            }
            let region = std::mem::take(&mut self.region);
            self.content(&mut out, region);
        }
        let rest = std::mem::take(&mut self.buf);
        self.content(&mut out, rest);
        out
    }

    fn content(&mut self, out: &mut Vec<Piece>, text: String) {
        if text.is_empty() || self.calls > 0 {
            return;
        }
        match out.last_mut() {
            Some(Piece::Content(c)) => c.push_str(&text),
            _ => out.push(Piece::Content(text)),
        }
    }

    /// Consumes `buf` as far as it can be; `end`: no more text comes.
    fn run(&mut self, out: &mut Vec<Piece>, end: bool) {
        loop {
            let progressed = match self.mode {
                Mode::Plain => {
                    let rest = std::mem::take(&mut self.buf);
                    self.content(out, rest);
                    false
                }
                Mode::Text => self.text(out, end),
                Mode::Calls => self.calls_region(out),
            };
            if !progressed {
                return;
            }
        }
    }

    /// Text mode; true when it switched mode.
    fn text(&mut self, out: &mut Vec<Piece>, end: bool) -> bool {
        match self.syntax.tags {
            Some((open, _)) => {
                if let Some(p) = self.buf.find(open) {
                    let before: String = self.buf.drain(..p).collect();
                    // Spaces just before a call are not content.
                    let keep = before.trim_end().len();
                    self.content(out, before[..keep].to_owned());
                    self.buf.drain(..open.len());
                    self.enter_region(format!("{}{open}", &before[keep..]));
                    return true;
                }
                // Hold back what may begin the tag, and the spaces before it.
                let tail = if end { 0 } else { held_tail(&self.buf, open) };
                let send: String = self.buf.drain(..self.buf.len() - tail).collect();
                self.content(out, send);
                false
            }
            None => {
                let trimmed = self.buf.trim_start();
                let spaces = self.buf.len() - trimmed.len();
                if trimmed.starts_with('{') {
                    let lead: String = self.buf.drain(..spaces).collect();
                    self.enter_region(lead);
                    return true;
                }
                if let Some(tag) = self.syntax.lead {
                    if trimmed.starts_with(tag) {
                        let lead: String = self.buf.drain(..spaces + tag.len()).collect();
                        self.enter_region(lead);
                        return true;
                    }
                    if !end && tag.starts_with(trimmed) {
                        return false; // may still be the lead token (or only spaces so far)
                    }
                }
                if trimmed.is_empty() && !end {
                    return false;
                }
                self.mode = Mode::Plain;
                true
            }
        }
    }

    fn enter_region(&mut self, consumed: String) {
        self.mode = Mode::Calls;
        self.region = consumed;
        self.region_calls = 0;
    }

    /// Inside a call region; true when it left it.
    fn calls_region(&mut self, out: &mut Vec<Piece>) -> bool {
        let mut pos = 0;
        let mut left = false;
        let buf = std::mem::take(&mut self.buf);
        while pos < buf.len() {
            if let Some(obj) = self.obj.as_mut() {
                let used = obj.feed(&buf[pos..]);
                pos += used;
                if obj.done {
                    let obj = self.obj.take().expect("checked");
                    self.object_done(obj, out);
                    if self.mode != Mode::Calls {
                        left = true;
                        break;
                    }
                }
                continue;
            }
            let rest = &buf[pos..];
            let c = rest.chars().next().expect("not empty");
            if c == '{' {
                self.obj = Some(Obj::default());
                continue;
            }
            if let Some((_, close)) = self.syntax.tags {
                if rest.starts_with(close) {
                    pos += close.len();
                    self.region.push_str(close);
                    if self.region_calls == 0 {
                        let region = std::mem::take(&mut self.region);
                        self.content(out, region);
                    }
                    self.region.clear();
                    self.mode = Mode::Text;
                    left = true;
                    break;
                }
                if close.starts_with(rest) {
                    break; // may be the closing tag: wait for more
                }
            }
            // Between objects: separators, and whatever else is not a call.
            pos += c.len_utf8();
            if self.region_calls == 0 {
                self.region.push(c);
            }
        }
        self.buf = buf[pos..].to_owned();
        self.drain_obj(out);
        left
    }

    /// An object ended: a call, or (when it has no name) text or nothing.
    fn object_done(&mut self, mut obj: Obj, out: &mut Vec<Piece>) {
        if obj.name.is_none() {
            if self.region_calls == 0 && self.calls == 0 && self.syntax.tags.is_none() {
                // Llama 3.x: an answer that starts with a JSON object that is not a call.
                self.region.push_str(&obj.raw);
                let region = std::mem::take(&mut self.region);
                self.content(out, region);
                self.mode = Mode::Plain;
            } else if self.region_calls == 0 {
                self.region.push_str(&obj.raw);
            }
            return;
        }
        self.drain(&mut obj, out);
        if obj.args.is_none() {
            self.emit_args(&obj, "{}".into(), out);
        }
    }

    fn drain_obj(&mut self, out: &mut Vec<Piece>) {
        if let Some(mut obj) = self.obj.take() {
            self.drain(&mut obj, out);
            self.obj = Some(obj);
        }
    }

    /// Sends what an object has ready: its start once its name is known, then its arguments.
    fn drain(&mut self, obj: &mut Obj, out: &mut Vec<Piece>) {
        let Some(name) = obj.name.clone() else {
            return;
        };
        if obj.index.is_none() {
            obj.index = Some(self.calls);
            self.calls += 1;
            self.region_calls += 1;
            self.region.clear();
            if let Some(index) = obj.index.filter(|&i| i < self.max_calls) {
                out.push(Piece::Call { index, name });
            }
        }
        if let Some(text) = obj.pending_args() {
            self.emit_args(obj, text, out);
        }
    }

    fn emit_args(&self, obj: &Obj, text: String, out: &mut Vec<Piece>) {
        let Some(index) = obj.index.filter(|&i| i < self.max_calls) else {
            return;
        };
        if text.is_empty() {
            return;
        }
        match out.last_mut() {
            Some(Piece::Arguments { index: i, text: t }) if *i == index => t.push_str(&text),
            _ => out.push(Piece::Arguments { index, text }),
        }
    }
}

/// Bytes at the end of `text` to hold back: a proper prefix of `tag` there, and the spaces
/// before it.
fn held_tail(text: &str, tag: &str) -> usize {
    let mut tail = 0;
    for (i, _) in text.char_indices() {
        if tag.starts_with(&text[i..]) {
            tail = text.len() - i;
            break;
        }
    }
    let before = &text[..text.len() - tail];
    tail + (before.len() - before.trim_end().len())
}

/// Where a scan is inside a call object's members.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum At {
    #[default]
    Key,
    Colon,
    Value,
    InValue,
    After,
}

/// One JSON object, scanned a character at a time: its top-level `name` and arguments found as
/// soon as they are complete (the arguments also while they are still arriving).
#[derive(Debug, Default)]
struct Obj {
    raw: String,
    depth: u32,
    in_str: bool,
    escaped: bool,
    at: At,
    key_start: usize,
    key: Option<String>,
    val_start: usize,
    name: Option<String>,
    args: Option<Args>,
    /// The call's index once started.
    index: Option<usize>,
    done: bool,
}

/// Where the arguments' value is in `raw`, and how much of it was sent.
#[derive(Debug)]
struct Args {
    start: usize,
    end: Option<usize>,
    sent: usize,
    /// An object or a list (sent as it arrives); else a string or a scalar, sent once whole.
    nested: bool,
}

impl Obj {
    /// Reads `text` up to the object's end; returns the bytes used.
    fn feed(&mut self, text: &str) -> usize {
        for (i, c) in text.char_indices() {
            let at = self.raw.len();
            self.raw.push(c);
            self.step(c, at);
            if self.done {
                return i + c.len_utf8();
            }
        }
        text.len()
    }

    fn step(&mut self, c: char, at: usize) {
        if self.in_str {
            if self.escaped {
                self.escaped = false;
            } else if c == '\\' {
                self.escaped = true;
            } else if c == '"' {
                self.in_str = false;
                if self.depth == 1 {
                    match self.at {
                        At::Key => {
                            self.key = serde_json::from_str(&self.raw[self.key_start..]).ok();
                            self.at = At::Colon;
                        }
                        At::InValue => self.value_end(at + 1),
                        _ => {}
                    }
                }
            }
            return;
        }
        match c {
            '"' => {
                self.in_str = true;
                if self.depth == 1 {
                    match self.at {
                        At::Key => self.key_start = at,
                        At::Value => self.value_begin(at, false),
                        _ => {}
                    }
                }
            }
            '{' | '[' => {
                if self.depth == 1 && self.at == At::Value {
                    self.value_begin(at, true);
                }
                self.depth += 1;
            }
            '}' | ']' => {
                if self.depth <= 1 {
                    if self.at == At::InValue {
                        self.value_end(at);
                    }
                    self.depth = 0;
                    self.done = true;
                } else {
                    self.depth -= 1;
                    if self.depth == 1 && self.at == At::InValue {
                        self.value_end(at + 1);
                    }
                }
            }
            ':' if self.depth == 1 && self.at == At::Colon => self.at = At::Value,
            ',' if self.depth == 1 => {
                if self.at == At::InValue {
                    self.value_end(at);
                }
                self.at = At::Key;
            }
            c if self.depth == 1 && self.at == At::Value && !c.is_whitespace() => {
                self.value_begin(at, false)
            }
            _ => {}
        }
    }

    fn is_args_key(&self) -> bool {
        self.key
            .as_deref()
            .is_some_and(|k| ARGUMENT_KEYS.contains(&k))
    }

    fn value_begin(&mut self, at: usize, nested: bool) {
        self.val_start = at;
        self.at = At::InValue;
        if self.is_args_key() && self.args.is_none() {
            self.args = Some(Args {
                start: at,
                end: None,
                sent: at,
                nested,
            });
        }
    }

    fn value_end(&mut self, end: usize) {
        self.at = At::After;
        let span = self.raw[self.val_start..end].trim_end();
        let end = self.val_start + span.len();
        if self.key.as_deref() == Some("name") && self.name.is_none() {
            self.name = serde_json::from_str::<String>(span).ok();
        } else if self.is_args_key() {
            if let Some(a) = self.args.as_mut().filter(|a| a.start == self.val_start) {
                a.end = Some(end);
            }
        }
    }

    /// Arguments text not sent yet: an object's as far as it has arrived, else the whole value
    /// once complete (a string's content: some models quote the arguments' JSON).
    fn pending_args(&mut self) -> Option<String> {
        let raw = &self.raw;
        let a = self.args.as_mut()?;
        if a.nested {
            let upto = a.end.unwrap_or(raw.len());
            if upto <= a.sent {
                return None;
            }
            let text = raw[a.sent..upto].to_owned();
            a.sent = upto;
            return Some(text);
        }
        let end = a.end.filter(|&e| e > a.sent)?;
        a.sent = end;
        let span = &raw[a.start..end];
        Some(match serde_json::from_str::<serde_json::Value>(span) {
            Ok(serde_json::Value::String(s)) => s,
            Ok(serde_json::Value::Null) => "{}".into(),
            _ => span.to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HERMES: Syntax = Syntax {
        tags: Some(("<tool_call>", "</tool_call>")),
        lead: None,
    };
    const LLAMA: Syntax = Syntax {
        tags: None,
        lead: Some("<|python_tag|>"),
    };

    /// Content (None when there is none) and (name, arguments) per call, from pieces.
    type Message = (Option<String>, Vec<(String, String)>);

    fn assemble(pieces: impl IntoIterator<Item = Piece>) -> Message {
        let mut content = String::new();
        let mut calls: Vec<(String, String)> = Vec::new();
        for p in pieces {
            match p {
                Piece::Content(c) => {
                    assert!(calls.is_empty(), "content after a call: {c:?}");
                    content.push_str(&c)
                }
                Piece::Call { index, name } => {
                    assert_eq!(index, calls.len(), "calls start in order");
                    calls.push((name, String::new()));
                }
                Piece::Arguments { index, text } => calls[index].1.push_str(&text),
            }
        }
        ((!content.is_empty()).then_some(content), calls)
    }

    fn whole(syntax: Syntax, text: &str) -> Message {
        let mut s = CallStream::new(syntax, usize::MAX);
        let mut pieces = s.push(text);
        pieces.extend(s.finish());
        assemble(pieces)
    }

    /// The text fed in two parts split at every character boundary, and a character at a time:
    /// each gives `expected`.
    fn every_split(syntax: Syntax, text: &str, expected: &Message) {
        for (i, _) in text.char_indices().chain([(text.len(), ' ')]) {
            let mut s = CallStream::new(syntax, usize::MAX);
            let mut pieces = s.push(&text[..i]);
            pieces.extend(s.push(&text[i..]));
            pieces.extend(s.finish());
            assert_eq!(&assemble(pieces), expected, "split at byte {i} of {text:?}");
        }
        let mut s = CallStream::new(syntax, usize::MAX);
        let mut pieces = Vec::new();
        for c in text.chars() {
            pieces.extend(s.push(&c.to_string()));
        }
        pieces.extend(s.finish());
        assert_eq!(
            &assemble(pieces),
            expected,
            "a character at a time: {text:?}"
        );
    }

    fn calls(list: &[(&str, &str)]) -> Vec<(String, String)> {
        list.iter()
            .map(|(n, a)| (n.to_string(), a.to_string()))
            .collect()
    }

    fn check(syntax: Syntax, text: &str, content: Option<&str>, expected: &[(&str, &str)]) {
        let want = (content.map(str::to_owned), calls(expected));
        assert_eq!(whole(syntax, text), want, "whole text {text:?}");
        every_split(syntax, text, &want);
    }

    #[test]
    fn hermes_call_alone_has_no_content() {
        check(
            HERMES,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": [1, 2]}}\n</tool_call>",
            None,
            &[("get_weather", r#"{"city": "Paris", "days": [1, 2]}"#)],
        );
    }

    #[test]
    fn hermes_content_before_a_call_is_kept_and_spaces_dropped() {
        check(
            HERMES,
            "Let me look.\n\n<tool_call>{\"arguments\": {\"q\": \"a}b\\\"c\"}, \"name\": \"search\"}</tool_call>",
            Some("Let me look."),
            &[("search", r#"{"q": "a}b\"c"}"#)],
        );
    }

    #[test]
    fn hermes_parallel_calls_in_tags_and_in_a_list() {
        check(
            HERMES,
            "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": {\"x\": 1.5e3}}\n</tool_call>",
            None,
            &[("a", "{}"), ("b", r#"{"x": 1.5e3}"#)],
        );
        check(
            HERMES,
            "<tool_call>[\n{\"name\": \"a\", \"arguments\": {\"k\": \"é✓\"}},\n{\"name\": \"b\", \"arguments\": {\"n\": null}}\n]</tool_call>",
            None,
            &[("a", r#"{"k": "é✓"}"#), ("b", r#"{"n": null}"#)],
        );
    }

    #[test]
    fn hermes_text_without_a_call_is_all_content() {
        for text in [
            "Plain answer, no call.",
            "Ends with a tag prefix <tool_",
            "Spaces at the end   \n",
            "A < sign and <tool> and </tool_call> alone",
            "<tool_call>not json</tool_call> after",
            "<tool_call>{\"no_name\": 1}</tool_call>",
            "",
        ] {
            check(HERMES, text, (!text.is_empty()).then_some(text), &[]);
        }
    }

    #[test]
    fn hermes_quoted_arguments_and_missing_arguments() {
        check(
            HERMES,
            "<tool_call>{\"name\": \"f\", \"arguments\": \"{\\\"a\\\": 1}\"}</tool_call>",
            None,
            &[("f", r#"{"a": 1}"#)],
        );
        check(
            HERMES,
            "<tool_call>{\"name\": \"g\"}</tool_call>",
            None,
            &[("g", "{}")],
        );
    }

    #[test]
    fn hermes_text_after_the_calls_is_dropped() {
        check(
            HERMES,
            "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call> and then some words",
            None,
            &[("f", r#"{"a": 1}"#)],
        );
    }

    #[test]
    fn hermes_cut_short_call_keeps_what_arrived() {
        // finish_reason "length": the call started, its arguments are partial.
        check(
            HERMES,
            "<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": [1, 2",
            None,
            &[("f", r#"{"a": [1, 2"#)],
        );
        check(
            HERMES,
            "Hi <tool_call>{\"na",
            Some("Hi <tool_call>{\"na"),
            &[],
        );
    }

    #[test]
    fn llama3_calls_at_the_start() {
        check(
            LLAMA,
            " {\"name\": \"get_weather\", \"parameters\": {\"city\": \"Oslo\"}}",
            None,
            &[("get_weather", r#"{"city": "Oslo"}"#)],
        );
        check(
            LLAMA,
            "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"x\": 1}}; {\"name\": \"b\", \"parameters\": {}}",
            None,
            &[("a", r#"{"x": 1}"#), ("b", "{}")],
        );
    }

    #[test]
    fn llama3_text_is_content_even_when_it_holds_json() {
        for text in [
            "The weather is fine.",
            "Here: {\"name\": \"f\", \"parameters\": {}}",
            "{\"answer\": 42} is the JSON",
            "  ",
            "<|python",
        ] {
            check(LLAMA, text, Some(text), &[]);
        }
    }

    #[test]
    fn one_call_kept_when_parallel_calls_are_off() {
        let mut s = CallStream::new(HERMES, 1);
        let mut pieces = s.push("<tool_call>{\"name\": \"a\", \"arguments\": {\"x\": 1}}</tool_call><tool_call>{\"name\": \"b\", \"arguments\": {}}</tool_call>");
        pieces.extend(s.finish());
        assert_eq!(assemble(pieces), (None, calls(&[("a", r#"{"x": 1}"#)])));
    }

    #[test]
    fn name_and_first_arguments_arrive_before_the_call_ends() {
        let mut s = CallStream::new(HERMES, usize::MAX);
        let p = s.push("<tool_call>{\"name\": \"f\", \"arguments\": {\"city\": \"Pa");
        assert_eq!(
            p,
            vec![
                Piece::Call {
                    index: 0,
                    name: "f".into()
                },
                Piece::Arguments {
                    index: 0,
                    text: "{\"city\": \"Pa".into()
                }
            ]
        );
        let p = s.push("ris\"}}</tool_call>");
        assert_eq!(
            p,
            vec![Piece::Arguments {
                index: 0,
                text: "ris\"}".into()
            }]
        );
    }
}
