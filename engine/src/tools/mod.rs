//! Tool calls: the parsers of a model's calls (one name table, the names vLLM's
//! `--tool-call-parser` uses), the parser a chat template calls for, and the conversation a
//! template gets. A template that takes `tools` and messages' `tool_calls` gets them as
//! transformers passes them; one that does not (SmolLM2's) gets the tools described in the system
//! message and the calls written as the parser reads them, so the model sees them either way.

mod parse;

pub use parse::{CallStream, Piece};

use crate::request::ChatMessage;
use crate::structured::{compact, to_compact_string};
use parse::Syntax;
use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::{json, Value};

/// How a model writes its tool calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolParser {
    /// `<tool_call>{"name": .., "arguments": {..}}</tool_call>` (Hermes 2 Pro, Qwen2.5, SmolLM2).
    Hermes,
    /// `{"name": .., "parameters": {..}}` as the whole answer, optionally after `<|python_tag|>`,
    /// several separated by `;` (Llama 3.1, 3.2, 3.3).
    Llama3Json,
}

/// The parsers by name.
const PARSERS: [(&str, ToolParser); 2] = [
    ("hermes", ToolParser::Hermes),
    ("llama3_json", ToolParser::Llama3Json),
];

impl ToolParser {
    /// The parser named `name`, or an error listing the names.
    pub fn from_name(name: &str) -> Result<ToolParser, String> {
        PARSERS
            .iter()
            .find(|(n, _)| *n == name)
            .map(|&(_, p)| p)
            .ok_or_else(|| {
                let names: Vec<&str> = PARSERS.iter().map(|(n, _)| *n).collect();
                format!(
                    "unknown tool-call parser `{name}`; the parsers are {}",
                    names.join(", ")
                )
            })
    }

    pub fn name(self) -> &'static str {
        PARSERS
            .iter()
            .find(|(_, p)| *p == self)
            .map_or("?", |(n, _)| n)
    }

    /// The parser whose call text a chat template writes; `None`: it writes none.
    pub fn detect(template: &str) -> Option<ToolParser> {
        if template.contains("<tool_call>") {
            Some(ToolParser::Hermes)
        } else if template.contains("<|python_tag|>")
            || template.contains("<|start_header_id|>ipython")
        {
            Some(ToolParser::Llama3Json)
        } else {
            None
        }
    }

    fn syntax(self) -> Syntax {
        match self {
            ToolParser::Hermes => Syntax {
                tags: Some(("<tool_call>", "</tool_call>")),
                lead: None,
            },
            ToolParser::Llama3Json => Syntax {
                tags: None,
                lead: Some("<|python_tag|>"),
            },
        }
    }

    /// A parser for one output's text; it keeps the first `max_calls` calls.
    pub fn stream(self, max_calls: usize) -> CallStream {
        CallStream::new(self.syntax(), max_calls)
    }

    /// The calls as this parser reads them: an assistant turn for a template that does not
    /// render `tool_calls`.
    pub fn calls_text(self, calls: &[ToolCall]) -> String {
        // The name first, as models write it.
        let one = |c: &ToolCall, key: &str| {
            format!(
                "{{\"name\": {}, \"{key}\": {}}}",
                json!(c.name),
                to_compact_string(&c.arguments_value())
            )
        };
        match self {
            ToolParser::Hermes => calls
                .iter()
                .map(|c| format!("<tool_call>\n{}\n</tool_call>", one(c, "arguments")))
                .collect::<Vec<_>>()
                .join("\n"),
            ToolParser::Llama3Json => calls
                .iter()
                .map(|c| one(c, "parameters"))
                .collect::<Vec<_>>()
                .join("; "),
        }
    }

    /// The tools described for the system message of a template that does not take `tools`.
    pub fn tools_text(self, tools: &[Value]) -> String {
        let lines: Vec<String> = tools.iter().map(Value::to_string).collect();
        match self {
            ToolParser::Hermes => format!(
                "# Tools\n\nYou may call one or more functions to help with the request. Their \
                 signatures are within <tools></tools> XML tags:\n<tools>\n{}\n</tools>\n\nTo \
                 call a function, write a JSON object with its name and arguments within \
                 <tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \
                 \"arguments\": <args-json-object>}}\n</tool_call>",
                lines.join("\n")
            ),
            ToolParser::Llama3Json => format!(
                "You have access to the functions below. To call one, answer with JSON only, \
                 in the format {{\"name\": function name, \"parameters\": dictionary of argument \
                 name and its value}}.\n\n{}",
                lines.join("\n\n")
            ),
        }
    }

    /// A grammar (llguidance's Lark) of the calls this parser reads, of the tools `functions`
    /// (name, parameters' JSON schema; `null`: any object): one call, or with `many` one or
    /// more. The calls are written as the model writes them, name first, and the arguments
    /// match their schema, so they always parse and validate.
    pub fn calls_grammar(self, functions: &[(&str, &Value)], many: bool) -> String {
        let key = match self {
            ToolParser::Hermes => "arguments",
            ToolParser::Llama3Json => "parameters",
        };
        let (one, sep) = match self {
            ToolParser::Hermes => (r#""<tool_call>\n" call "\n</tool_call>""#, r#""\n""#),
            ToolParser::Llama3Json => ("call", r#""; ""#),
        };
        let mut g = if many {
            format!("start: one ({sep} one)*\none: {one}\n")
        } else {
            format!("start: {one}\n")
        };
        let alternatives: Vec<String> = (0..functions.len()).map(|i| format!("call_{i}")).collect();
        g += &format!("call: {}\n", alternatives.join(" | "));
        for (i, (name, schema)) in functions.iter().enumerate() {
            // The name and key as JSON strings, then quoted again as Lark strings.
            let head = format!("{{\"name\": {}, \"{key}\": ", json!(name));
            // Compact JSON, as `response_format` gets (`structured::compact`).
            let schema = match schema {
                Value::Object(_) | Value::Bool(_) => compact(schema).to_string(),
                _ => compact(&json!({"type": "object"})).to_string(),
            };
            g += &format!(
                "call_{i}: {} args_{i} \"}}\"\nargs_{i}: %json {schema}\n",
                json!(head)
            );
        }
        g
    }

    /// A tool's result as this parser's models read it, for a template that does not take tools.
    fn result_text(self, content: &str) -> String {
        match self {
            ToolParser::Hermes => format!("<tool_response>\n{content}\n</tool_response>"),
            ToolParser::Llama3Json => content.to_owned(),
        }
    }
}

/// What a chat template renders of tools (read from its source: a template that never names
/// `tools` ignores them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TemplateTools {
    /// It renders the `tools` variable.
    pub tools: bool,
    /// It renders assistant messages' `tool_calls`.
    pub tool_calls: bool,
}

impl TemplateTools {
    pub fn of(template: &str) -> TemplateTools {
        TemplateTools {
            tools: template.contains("tools"),
            tool_calls: template.contains("tool_calls"),
        }
    }
}

/// A call of an assistant message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments, a JSON text (OpenAI's `function.arguments`).
    pub arguments: String,
}

impl ToolCall {
    /// The arguments as JSON: the object they should be, else the text as a string.
    fn arguments_value(&self) -> Value {
        serde_json::from_str(&self.arguments).unwrap_or_else(|_| json!(self.arguments))
    }
}

/// As a chat template gets it: OpenAI's shape, with the arguments an object (transformers
/// templates write `arguments | tojson`, and vLLM passes them so).
impl Serialize for ToolCall {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(3))?;
        m.serialize_entry("id", &self.id)?;
        m.serialize_entry("type", "function")?;
        m.serialize_entry(
            "function",
            &json!({"name": self.name, "arguments": self.arguments_value()}),
        )?;
        m.end()
    }
}

/// The conversation for a template that renders what `template` says, with `tools` (OpenAI's
/// tool objects; `None`: the request offers none, or `tool_choice` is `none`). Returns the
/// `tools` variable the template gets.
pub fn prepare_chat(
    messages: &mut Vec<ChatMessage>,
    tools: Option<Vec<Value>>,
    parser: ToolParser,
    template: TemplateTools,
) -> Option<Vec<Value>> {
    if !template.tool_calls {
        for m in messages.iter_mut() {
            if let Some(calls) = m.tool_calls.take() {
                let text = parser.calls_text(&calls);
                m.content = if m.content.is_empty() {
                    text
                } else {
                    format!("{}\n{text}", m.content)
                };
            }
        }
    }
    if template.tools {
        return tools;
    }
    for m in messages.iter_mut().filter(|m| m.role == "tool") {
        m.content = parser.result_text(&m.content);
    }
    if let Some(tools) = tools.filter(|t| !t.is_empty()) {
        let text = parser.tools_text(&tools);
        match messages.first_mut() {
            Some(m) if m.role == "system" => m.content = format!("{}\n\n{text}", m.content),
            _ => messages.insert(
                0,
                ChatMessage {
                    role: "system".into(),
                    content: text,
                    ..ChatMessage::default()
                },
            ),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parser_names_round_trip_and_unknown_ones_list_the_names() {
        for (name, p) in PARSERS {
            assert_eq!(ToolParser::from_name(name), Ok(p));
            assert_eq!(p.name(), name);
        }
        let e = ToolParser::from_name("mistral").unwrap_err();
        assert!(e.contains("hermes, llama3_json"), "{e}");
    }

    #[test]
    fn the_parser_follows_the_template() {
        let qwen = r#"{%- if tools %}{{- "<tools>" }}{%- for tool in tools %}{{ tool | tojson }}{% endfor %}{{- "</tools>\n<tool_call>\n{\"name\": <function-name>}\n</tool_call>" }}{% endif %}"#;
        let llama = r#"{%- for m in messages %}{%- if m.role == "tool" %}{{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}{%- endif %}{%- endfor %}"#;
        let plain = "{% for m in messages %}{{ m.content }}{% endfor %}";
        assert_eq!(ToolParser::detect(qwen), Some(ToolParser::Hermes));
        assert_eq!(ToolParser::detect(llama), Some(ToolParser::Llama3Json));
        assert_eq!(ToolParser::detect(plain), None);
        assert_eq!(
            TemplateTools::of(plain),
            TemplateTools {
                tools: false,
                tool_calls: false
            }
        );
    }

    fn call() -> ToolCall {
        ToolCall {
            id: "call_1".into(),
            name: "get_weather".into(),
            arguments: r#"{"city": "Paris"}"#.into(),
        }
    }

    #[test]
    fn calls_written_as_text_parse_back() {
        for parser in [ToolParser::Hermes, ToolParser::Llama3Json] {
            let text = parser.calls_text(&[call(), call()]);
            let mut s = parser.stream(usize::MAX);
            let mut pieces = s.push(&text);
            pieces.extend(s.finish());
            let args: String = pieces
                .iter()
                .filter_map(|p| match p {
                    Piece::Arguments { index: 1, text } => Some(text.as_str()),
                    _ => None,
                })
                .collect();
            assert_eq!(s.calls(), 2, "{text}");
            // Written back as `json.dumps` writes it (the calls grammar's whitespace).
            assert_eq!(args, r#"{"city": "Paris"}"#, "{text}");
        }
    }

    #[test]
    fn a_template_without_tools_gets_them_in_the_system_message() {
        let mut messages = vec![
            ChatMessage {
                role: "user".into(),
                content: "Weather in Paris?".into(),
                ..ChatMessage::default()
            },
            ChatMessage {
                role: "assistant".into(),
                tool_calls: Some(vec![call()]),
                ..ChatMessage::default()
            },
            ChatMessage {
                role: "tool".into(),
                content: "sunny".into(),
                tool_call_id: Some("call_1".into()),
                ..ChatMessage::default()
            },
        ];
        let tools = vec![json!({"type": "function", "function": {"name": "get_weather"}})];
        let none = TemplateTools {
            tools: false,
            tool_calls: false,
        };
        let passed = prepare_chat(&mut messages, Some(tools), ToolParser::Hermes, none);
        assert_eq!(passed, None);
        assert_eq!(messages[0].role, "system");
        assert!(messages[0]
            .content
            .contains(r#"{"type":"function","function":{"name":"get_weather"}}"#));
        assert_eq!(
            messages[2].content,
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"
        );
        assert_eq!(messages[2].tool_calls, None);
        assert_eq!(
            messages[3].content,
            "<tool_response>\nsunny\n</tool_response>"
        );
    }

    /// Whether llguidance, on a vocabulary of single bytes, takes `text` as a whole output of
    /// `grammar` (which must compile).
    fn grammar_takes(grammar: &str, text: &str) -> bool {
        let env = toktrie::ApproximateTokEnv::single_byte_env();
        let factory = llguidance::ParserFactory::new_simple(&env).expect("factory");
        let g = llguidance::api::TopLevelGrammar::from_lark(grammar.to_owned());
        let mut m = llguidance::Matcher::new(factory.create_parser(g));
        assert_eq!(m.get_error(), None, "the grammar compiles:\n{grammar}");
        let bytes: Vec<u32> = text.bytes().map(u32::from).collect();
        m.consume_tokens(&bytes).is_ok() && m.is_accepting().unwrap_or(false)
    }

    #[test]
    fn the_calls_grammar_takes_valid_calls_only() {
        let weather = json!({"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": false});
        let add = json!({"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer", "minimum": 0}},
            "required": ["a", "b"]});
        let tools: [(&str, &Value); 2] = [("get_weather", &weather), ("add", &add)];
        let w = r#"{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}"#;
        let a = r#"{"name": "add", "arguments": {"a": -3, "b": 4}}"#;
        let tag = |c: &str| format!("<tool_call>\n{c}\n</tool_call>");
        let one = ToolParser::Hermes.calls_grammar(&tools, false);
        let many = ToolParser::Hermes.calls_grammar(&tools, true);
        assert!(grammar_takes(&one, &tag(w)));
        assert!(grammar_takes(&one, &tag(a)));
        let two = format!("{}\n{}", tag(w), tag(a));
        assert!(grammar_takes(&many, &two));
        assert!(!grammar_takes(&one, &two), "one call only");
        for bad in [
            r#"{"name": "get_time", "arguments": {}}"#,
            r#"{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}"#,
            r#"{"name": "get_weather", "arguments": {"city": "Paris"}}"#,
            r#"{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", "x": 1}}"#,
            r#"{"name": "add", "arguments": {"a": 1.5, "b": 4}}"#,
            r#"{"name": "add", "arguments": {"a": 1, "b": -4}}"#,
            r#"{"arguments": {"a": 1, "b": 4}, "name": "add"}"#,
        ] {
            assert!(!grammar_takes(&many, &tag(bad)), "{bad}");
        }
        assert!(!grammar_takes(&many, &format!("Sure. {}", tag(w))));
        // Arguments are compact JSON, the whitespace response_format's JSON has: `, ` and `: `,
        // nothing else (a small model would otherwise run on in newlines).
        for loose in [
            r#"{"name": "add", "arguments": {"a": 1,  "b": 4}}"#,
            r#"{"name": "add", "arguments": {"a":1, "b": 4}}"#,
            "{\"name\": \"add\", \"arguments\": {\n  \"a\": 1, \"b\": 4}}",
            "{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 4\n}}",
        ] {
            assert!(!grammar_takes(&many, &tag(loose)), "{loose}");
        }
        let any = json!(null);
        let untyped = ToolParser::Hermes.calls_grammar(&[("f", &any)], false);
        assert!(grammar_takes(
            &untyped,
            &tag(r#"{"name": "f", "arguments": {"x": [1, 2]}}"#)
        ));
        assert!(!grammar_takes(
            &untyped,
            &tag(r#"{"name": "f", "arguments": {"x": [1,2]}}"#)
        ));
        // A named function: only it.
        let only_add = ToolParser::Hermes.calls_grammar(&tools[1..], false);
        assert!(grammar_takes(&only_add, &tag(a)) && !grammar_takes(&only_add, &tag(w)));
        // Llama 3.x: the whole answer, `;` between calls, `parameters`.
        let llama = ToolParser::Llama3Json.calls_grammar(&tools, true);
        let l = r#"{"name": "add", "parameters": {"a": 1, "b": 2}}"#;
        assert!(grammar_takes(&llama, l));
        assert!(grammar_takes(&llama, &format!("{l}; {l}")));
        assert!(!grammar_takes(&llama, a));
        // What the grammar takes is what the parser reads, and how calls are written back.
        for parser in [ToolParser::Hermes, ToolParser::Llama3Json] {
            let text = parser.calls_text(&[ToolCall {
                id: "call_1".into(),
                name: "add".into(),
                arguments: r#"{"a": 7, "b": 8}"#.into(),
            }]);
            assert!(
                grammar_takes(&parser.calls_grammar(&tools, false), &text),
                "{text}"
            );
        }
    }

    #[test]
    fn a_template_with_tools_gets_them_as_they_are() {
        let mut messages = vec![ChatMessage {
            role: "assistant".into(),
            tool_calls: Some(vec![call()]),
            ..ChatMessage::default()
        }];
        let tools = vec![json!({"type": "function", "function": {"name": "f"}})];
        let both = TemplateTools {
            tools: true,
            tool_calls: true,
        };
        let passed = prepare_chat(&mut messages, Some(tools.clone()), ToolParser::Hermes, both);
        assert_eq!(passed, Some(tools));
        assert_eq!(messages.len(), 1);
        assert_eq!(
            serde_json::to_value(&messages[0]).unwrap()["tool_calls"],
            json!([{"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}])
        );
    }
}
