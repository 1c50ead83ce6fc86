//! Function calling: a chat request's `tools` and `tool_choice` checked, the tools handed to the
//! chat template (its `tools` variable, as transformers and llama.cpp's jinja path pass it), and
//! the model's tool-call syntax parsed back into OpenAI `tool_calls` — whole, or as streamed
//! deltas ([`CallSplitter`]).
//!
//! The syntaxes toy reads ([`Syntax`]), chosen by what the model's chat template writes:
//! - Hermes, as Qwen 2.5/3, SmolLM3, Hermes and many fine-tunes write it:
//!   `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, one block per call (llama.cpp's
//!   `COMMON_CHAT_FORMAT_HERMES_2_PRO`);
//! - Mistral (v3 to v7 templates): `[TOOL_CALLS]` then a JSON array of `{"name", "arguments"}`
//!   to the end of the output (llama.cpp's `COMMON_CHAT_FORMAT_MISTRAL_NEMO`);
//! - Mistral v11 (Mistral Small 3.2, Magistral, Devstral templates, whose calls carry `[ARGS]`):
//!   `[TOOL_CALLS]name[ARGS]{…}` per call, as mistral-common's v11 tokenizer writes them;
//! - Granite 3: `<|tool_call|>` then a JSON array of calls to the end of the output (llama.cpp's
//!   `COMMON_CHAT_FORMAT_GRANITE`).
//!
//! A template that writes none of these markers has no syntax toy knows, and a request with
//! tools gets a 400 saying so.
//!
//! `tool_choice`: `auto` (the default) lets the model choose and parses what it wrote; `required`
//! and a named function constrain the output with a grammar (llguidance, as structured output
//! does) to one or more calls whose `arguments` follow each function's `parameters` schema;
//! `none` renders the conversation without tools and parses nothing.

use serde_json::{Value, json};

use crate::error::ApiError;

/// How a model writes its tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Syntax {
    /// What starts the calls (the model's special token, rendered as text).
    open: &'static str,
    /// What ends one call's block; None: the calls run to the end of the output.
    close: Option<&'static str>,
    /// The body is a JSON array of calls (else one call object per block).
    list: bool,
    /// The body is the function's name, this marker, then its arguments' JSON (Mistral v11);
    /// each call has its own opening marker, which also ends the call before it.
    args: Option<&'static str>,
}

impl Syntax {
    pub const HERMES: Syntax = Syntax {
        open: "<tool_call>",
        close: Some("</tool_call>"),
        list: false,
        args: None,
    };
    pub const MISTRAL: Syntax = Syntax {
        open: "[TOOL_CALLS]",
        close: None,
        list: true,
        args: None,
    };
    pub const MISTRAL_V11: Syntax = Syntax {
        open: "[TOOL_CALLS]",
        close: None,
        list: false,
        args: Some("[ARGS]"),
    };
    pub const GRANITE: Syntax = Syntax {
        open: "<|tool_call|>",
        close: None,
        list: true,
        args: None,
    };

    /// The syntax `template` writes tool calls in, if toy knows it (a template that writes
    /// `[ARGS]` as well as `[TOOL_CALLS]` is Mistral v11's).
    pub fn of_template(template: &str) -> Option<Syntax> {
        [
            Syntax::HERMES,
            Syntax::MISTRAL_V11,
            Syntax::MISTRAL,
            Syntax::GRANITE,
        ]
        .into_iter()
        .find(|s| template.contains(s.open) && s.args.is_none_or(|a| template.contains(a)))
    }

    /// The calls a block's body holds, if it is one (a list syntax's body is an array of them).
    fn parse_body(&self, body: &str) -> Option<Vec<ToolCall>> {
        if let Some(marker) = self.args {
            let (name, arguments) = body.split_once(marker)?;
            let name = name.trim();
            let arguments: Value = serde_json::from_str(arguments.trim()).ok()?;
            if name.is_empty() || name.contains(char::is_whitespace) || !arguments.is_object() {
                return None;
            }
            return Some(vec![ToolCall {
                name: name.to_string(),
                arguments: arguments.to_string(),
            }]);
        }
        let v: Value = serde_json::from_str(body.trim()).ok()?;
        match v {
            Value::Array(items) if self.list => items.iter().map(call_of).collect(),
            v => Some(vec![call_of(&v)?]),
        }
    }
}

/// What the request asked of its tools.
#[derive(Debug, Clone, PartialEq)]
pub enum Choice {
    Auto,
    Required,
    /// One function: its name and `parameters` schema.
    Named {
        name: String,
        parameters: Value,
    },
}

/// Checked `tools` of a request whose `tool_choice` is not `none`.
#[derive(Debug, Clone)]
pub struct ToolRequest {
    /// The `tools` array as the client sent it (what the template renders).
    pub tools: Value,
    pub choice: Choice,
    /// `parallel_tool_calls`: a forced call may be several.
    parallel: bool,
    /// Each function's name and `parameters` schema (`{"type": "object"}` when absent).
    functions: Vec<(String, Value)>,
    /// How the model writes its calls.
    pub syntax: Syntax,
}

/// Check `tools` and `tool_choice`. `Ok(None)`: no tools, or `tool_choice: "none"`.
pub fn check(
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
    parallel: bool,
    template: &str,
) -> Result<Option<ToolRequest>, ApiError> {
    let invalid = |param: &str, msg: String| ApiError::invalid(Some(param), msg);
    let list = match tools {
        None | Some(Value::Null) => &[][..],
        Some(Value::Array(a)) => &a[..],
        Some(_) => return Err(invalid("tools", "tools must be an array".into())),
    };
    let mut functions = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let param = format!("tools[{i}]");
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(invalid(
                &param,
                format!("{param}.type must be \"function\" (the only kind of tool)"),
            ));
        }
        let f = t.get("function").filter(|f| f.is_object()).ok_or_else(|| {
            invalid(
                &param,
                format!("{param}.function must be an object with a name"),
            )
        })?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| invalid(&param, format!("{param}.function.name must be a string")))?;
        if functions.iter().any(|(n, _)| n == name) {
            return Err(invalid(&param, format!("two tools are named {name:?}")));
        }
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object"}),
            Some(p) if p.is_object() => p.clone(),
            Some(_) => {
                return Err(invalid(
                    &param,
                    format!("{param}.function.parameters must be a JSON schema object"),
                ));
            }
        };
        functions.push((name.to_string(), parameters));
    }
    let choice = match tool_choice {
        None | Some(Value::Null) => Choice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => return Ok(None),
            "auto" => Choice::Auto,
            "required" => Choice::Required,
            other => {
                return Err(invalid(
                    "tool_choice",
                    format!(
                        "tool_choice must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": …}}}}, got {other:?}"
                    ),
                ));
            }
        },
        Some(v) => {
            let name = v
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    invalid(
                        "tool_choice",
                        "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": …}}".into(),
                    )
                })?;
            let Some((_, parameters)) = functions.iter().find(|(n, _)| n == name) else {
                return Err(invalid(
                    "tool_choice",
                    format!("tool_choice names {name:?}, which is not one of the tools"),
                ));
            };
            Choice::Named {
                name: name.to_string(),
                parameters: parameters.clone(),
            }
        }
    };
    if functions.is_empty() {
        return match choice {
            Choice::Auto => Ok(None),
            _ => Err(invalid(
                "tool_choice",
                "tool_choice asks for a tool call but tools is empty".into(),
            )),
        };
    }
    let Some(syntax) = Syntax::of_template(template) else {
        return Err(invalid(
            "tools",
            "this model's chat template has no tool-call syntax toy knows (Hermes <tool_call> blocks, Mistral [TOOL_CALLS] and [TOOL_CALLS]name[ARGS], Granite <|tool_call|>): \
             start toy serve with a --chat-template-file that has one, or send the request without tools"
                .into(),
        ));
    };
    Ok(Some(ToolRequest {
        tools: Value::Array(list.to_vec()),
        choice,
        parallel,
        functions,
        syntax,
    }))
}

impl ToolRequest {
    /// The grammar that forces a call (`required`, or a named function), as Lark for
    /// llguidance: in the template's syntax, one or more calls (`<tool_call>` blocks, or the
    /// marker and an array), each an object with one of the allowed names and arguments
    /// following that function's schema. `None` for `auto`. The marker is forced as text: the
    /// model writes it with ordinary tokens, which decode to the same text.
    pub fn grammar(&self) -> Option<llguidance::api::TopLevelGrammar> {
        let one = |name: &str, parameters: &Value| {
            json!({
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": parameters},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        };
        let schema = match &self.choice {
            Choice::Auto => return None,
            Choice::Named { name, parameters } => one(name, parameters),
            Choice::Required => json!({
                "anyOf": self.functions.iter().map(|(n, p)| one(n, p)).collect::<Vec<_>>()
            }),
        };
        let open = self.syntax.open;
        let repeat = if self.parallel { "+" } else { "" };
        if let Some(marker) = self.syntax.args {
            // `[TOOL_CALLS]name[ARGS]{…}` per call: one rule per allowed function.
            let allowed: Vec<(&str, &Value)> = match &self.choice {
                Choice::Auto => return None,
                Choice::Named { name, parameters } => vec![(name.as_str(), parameters)],
                Choice::Required => self
                    .functions
                    .iter()
                    .map(|(n, p)| (n.as_str(), p))
                    .collect(),
            };
            let literal = |s: String| serde_json::to_string(&s).expect("a string");
            let names: Vec<String> = (0..allowed.len()).map(|i| format!("fn{i}")).collect();
            let mut lark = format!(
                "start: call{repeat}\ncall: {} ({})\n",
                literal(open.to_string()),
                names.join(" | ")
            );
            for (i, (name, parameters)) in allowed.into_iter().enumerate() {
                let mut schema = parameters.clone();
                schema["x-guidance"] = crate::grammar::json_layout();
                lark += &format!(
                    "fn{i}: {} args{i}\nargs{i}: %json {schema}\n",
                    literal(format!("{name}{marker}"))
                );
            }
            return Some(llguidance::api::TopLevelGrammar::from_lark(lark));
        }
        let lark = match self.syntax.close {
            Some(close) => {
                let mut schema = schema;
                schema["x-guidance"] = crate::grammar::json_layout();
                format!(
                    "start: call{repeat}\ncall: \"{open}\\n\" body \"\\n{close}\"\nbody: %json {schema}\n"
                )
            }
            None => {
                let mut array = json!({"type": "array", "items": schema, "minItems": 1});
                if !self.parallel {
                    array["maxItems"] = json!(1);
                }
                array["x-guidance"] = crate::grammar::json_layout();
                format!("start: \"{open}\" body\nbody: %json {array}\n")
            }
        };
        Some(llguidance::api::TopLevelGrammar::from_lark(lark))
    }
}

/// The `finish_reason` of a choice that made `called` tool calls: a natural stop after a call is
/// OpenAI's `tool_calls`; a length cut stays `length`.
pub fn finish_reason(reason: &str, called: bool) -> &str {
    match reason {
        "stop" if called => "tool_calls",
        r => r,
    }
}

/// One parsed call, in OpenAI's shape (`arguments` is a JSON string).
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

impl ToolCall {
    /// `{"id", "type": "function", "function": {"name", "arguments"}}`, with `index` in a stream.
    pub fn to_json(&self, id: &str, index: Option<usize>) -> Value {
        let mut v = json!({
            "id": id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        });
        if let Some(i) = index {
            v["index"] = json!(i);
        }
        v
    }
}

/// A JSON call as a call, if it is one (`{"name": …, "arguments": …}`; arguments given as a
/// JSON string are kept as that string).
fn call_of(v: &Value) -> Option<ToolCall> {
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(s)) => s.clone(),
        Some(a) => a.to_string(),
    };
    Some(ToolCall { name, arguments })
}

/// What a generated text says: content before the calls (None when only whitespace) and the
/// calls. A block that does not parse stays in the content, as the model wrote it.
pub fn parse(text: &str, syntax: Syntax) -> (Option<String>, Vec<ToolCall>) {
    let mut splitter = CallSplitter::new(syntax);
    let mut pieces = splitter.push(text);
    pieces.extend(splitter.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for p in pieces {
        match p {
            Piece::Text(t) => content.push_str(&t),
            Piece::Call(c) => calls.push(c),
        }
    }
    let content = if calls.is_empty() {
        Some(content)
    } else {
        Some(content.trim().to_string()).filter(|c| !c.is_empty())
    };
    (content, calls)
}

/// A piece of streamed output: text for `delta.content`, or a whole call.
#[derive(Debug, Clone, PartialEq)]
pub enum Piece {
    Text(String),
    Call(ToolCall),
}

/// Splits streamed text into content and calls: text passes through at once except what could
/// be the start of the syntax's marker, which waits until it is known; a block is held until
/// its end (`</tool_call>`, or the end of the output for the list syntaxes) and comes out as
/// its calls.
#[derive(Debug)]
pub struct CallSplitter {
    syntax: Syntax,
    pending: String,
    in_call: bool,
}

impl CallSplitter {
    pub fn new(syntax: Syntax) -> Self {
        CallSplitter {
            syntax,
            pending: String::new(),
            in_call: false,
        }
    }

    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        self.pending.push_str(text);
        let Syntax { open, close, .. } = self.syntax;
        let mut out = Vec::new();
        loop {
            if self.in_call {
                // A block ends at its closing marker (taken with it), or in Mistral v11 at the
                // next call's marker (left to open the next block). A list runs to the end of
                // the output: `finish` parses it.
                let end = match (close, self.syntax.args) {
                    (Some(close), _) => self.pending.find(close).map(|e| (e, close)),
                    (None, Some(_)) => self.pending.find(open).map(|e| (e, "")),
                    (None, None) => break,
                };
                let Some((end, closing)) = end else { break };
                let block = self.pending[..end].to_string();
                self.pending.drain(..end + closing.len());
                self.in_call = false;
                match self.syntax.parse_body(&block) {
                    Some(calls) => out.extend(calls.into_iter().map(Piece::Call)),
                    None => out.push(Piece::Text(format!("{open}{block}{closing}"))),
                }
            } else if let Some(start) = self.pending.find(open) {
                if start > 0 {
                    out.push(Piece::Text(self.pending[..start].to_string()));
                }
                self.pending.drain(..start + open.len());
                self.in_call = true;
            } else {
                // Keep the longest tail that is a prefix of the marker.
                let keep = (1..open.len().min(self.pending.len() + 1))
                    .rev()
                    .find(|&k| {
                        self.pending.is_char_boundary(self.pending.len() - k)
                            && open.starts_with(&self.pending[self.pending.len() - k..])
                    })
                    .unwrap_or(0);
                let emit = self.pending.len() - keep;
                if emit > 0 {
                    out.push(Piece::Text(self.pending[..emit].to_string()));
                    self.pending.drain(..emit);
                }
                break;
            }
        }
        out
    }

    /// The end of the output: a list syntax's calls, and what was held back as text (an
    /// unclosed or unparsable block included).
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut rest = std::mem::take(&mut self.pending);
        if std::mem::take(&mut self.in_call) {
            if self.syntax.close.is_none()
                && let Some(calls) = self.syntax.parse_body(&rest)
            {
                return calls.into_iter().map(Piece::Call).collect();
            }
            rest.insert_str(0, self.syntax.open);
        }
        if rest.is_empty() {
            vec![]
        } else {
            vec![Piece::Text(rest)]
        }
    }
}

/// A message of the request as the template reads it: `role`, `content` (text), and for
/// assistant turns with calls their `tool_calls` with `arguments` decoded to an object — Hermes
/// templates write `tool_call.arguments | tojson`, and llama.cpp hands them objects too.
pub fn template_message(role: &str, content: String, raw: &crate::api::Message) -> Value {
    let mut m = json!({"role": role, "content": content});
    if let Some(calls) = &raw.tool_calls {
        let calls: Vec<Value> = calls
            .iter()
            .map(|c| {
                let mut c = c.clone();
                if let Some(args) = c.pointer("/function/arguments").and_then(Value::as_str)
                    && let Ok(obj) = serde_json::from_str::<Value>(args)
                {
                    c["function"]["arguments"] = obj;
                }
                c
            })
            .collect();
        m["tool_calls"] = Value::Array(calls);
    }
    if let Some(id) = &raw.tool_call_id {
        m["tool_call_id"] = json!(id);
    }
    if let Some(name) = &raw.name {
        m["name"] = json!(name);
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    const HERMES: &str =
        "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}<tool_call>{% endif %}";
    const H: Syntax = Syntax::HERMES;

    fn parse_hermes(text: &str) -> (Option<String>, Vec<ToolCall>) {
        parse(text, H)
    }

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"]}}}])
    }

    #[test]
    fn parses_calls_and_content() {
        let (content, calls) = parse_hermes(
            "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>",
        );
        assert_eq!(content.as_deref(), Some("Let me look."));
        assert_eq!(
            calls,
            vec![
                ToolCall {
                    name: "get_weather".into(),
                    arguments: r#"{"city":"Paris"}"#.into()
                },
                ToolCall {
                    name: "f".into(),
                    arguments: "{}".into()
                },
            ]
        );
        // No call: all content, whitespace kept. A broken block stays text.
        assert_eq!(parse_hermes(" hi ").0.as_deref(), Some(" hi "));
        let broken = "<tool_call>\n{not json}\n</tool_call>";
        assert_eq!(parse_hermes(broken), (Some(broken.to_string()), vec![]));
        let (content, calls) = parse_hermes("<tool_call>{\"name\": \"f\"");
        assert!(calls.is_empty());
        assert_eq!(content.as_deref(), Some("<tool_call>{\"name\": \"f\""));
    }

    #[test]
    fn streamed_pieces_equal_the_whole_parse_at_every_split() {
        let text = "ok <tool <tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": \"é<\"}}\n</tool_call> tail <tool_ca";
        let whole = {
            let mut s = CallSplitter::new(H);
            let mut p = s.push(text);
            p.extend(s.finish());
            p
        };
        let flatten = |pieces: Vec<Piece>| {
            let mut out: Vec<Piece> = Vec::new();
            for p in pieces {
                match (out.last_mut(), p) {
                    (Some(Piece::Text(a)), Piece::Text(b)) => a.push_str(&b),
                    (_, p) => out.push(p),
                }
            }
            out
        };
        for step in 1..8 {
            let pieces = stream_in_steps(text, H, step);
            assert_eq!(flatten(pieces), flatten(whole.clone()), "step {step}");
        }
        assert_eq!(
            flatten(whole),
            vec![
                Piece::Text("ok <tool ".into()),
                Piece::Call(ToolCall {
                    name: "a".into(),
                    arguments: r#"{"x":"é<"}"#.into()
                }),
                Piece::Text(" tail <tool_ca".into()),
            ]
        );
    }

    #[test]
    fn checks_tools_and_choices() {
        let t = weather();
        let r = check(Some(&t), None, false, HERMES).unwrap().unwrap();
        assert_eq!(r.choice, Choice::Auto);
        assert!(r.grammar().is_none());
        assert!(
            check(Some(&t), Some(&json!("none")), false, HERMES)
                .unwrap()
                .is_none()
        );
        assert!(
            check(Some(&json!([])), None, false, HERMES)
                .unwrap()
                .is_none()
        );
        let named = json!({"type": "function", "function": {"name": "get_weather"}});
        let r = check(Some(&t), Some(&named), false, HERMES)
            .unwrap()
            .unwrap();
        let Choice::Named { name, parameters } = &r.choice else {
            panic!("{:?}", r.choice)
        };
        assert_eq!(name, "get_weather");
        assert_eq!(parameters["required"], json!(["city", "unit"]));
        assert!(r.grammar().is_some());
        for (tools, choice, template, param) in [
            (json!({}), None, HERMES, "tools"),
            (json!([{"type": "code"}]), None, HERMES, "tools[0]"),
            (
                json!([{"type": "function", "function": {}}]),
                None,
                HERMES,
                "tools[0]",
            ),
            (t.clone(), Some(json!("sometimes")), HERMES, "tool_choice"),
            (
                t.clone(),
                Some(json!({"type": "function", "function": {"name": "nope"}})),
                HERMES,
                "tool_choice",
            ),
            (json!([]), Some(json!("required")), HERMES, "tool_choice"),
            (t.clone(), None, "{{ messages }}", "tools"),
        ] {
            let e = check(Some(&tools), choice.as_ref(), false, template).unwrap_err();
            assert_eq!(
                e.param.as_deref(),
                Some(param),
                "{tools} {choice:?}: {}",
                e.message
            );
        }
    }

    #[test]
    fn mistral_and_granite_calls_are_a_list_after_their_marker() {
        let mistral = "{% for m in messages %}{% if m.tool_calls %}[TOOL_CALLS]{{ m.tool_calls | tojson }}{% endif %}{% endfor %}";
        let granite = "<|start_of_role|>system<|end_of_role|>Call tools as <|tool_call|>[...]";
        assert_eq!(Syntax::of_template(HERMES), Some(Syntax::HERMES));
        assert_eq!(Syntax::of_template(mistral), Some(Syntax::MISTRAL));
        assert_eq!(Syntax::of_template(granite), Some(Syntax::GRANITE));
        assert_eq!(Syntax::of_template("{{ messages }}"), None);
        let two = two_calls();
        let (content, calls) = parse(
            r#"[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f", "arguments": {}}]"#,
            Syntax::MISTRAL,
        );
        assert_eq!((content, calls), (None, two.clone()));
        let (content, calls) = parse(
            r#"Sure. <|tool_call|>[{"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}]"#,
            Syntax::GRANITE,
        );
        assert_eq!(content.as_deref(), Some("Sure."));
        assert_eq!(calls, two[..1]);
        // A cut or broken list stays text, as the model wrote it.
        let cut = r#"[TOOL_CALLS][{"name": "f", "argum"#;
        assert_eq!(parse(cut, Syntax::MISTRAL), (Some(cut.to_string()), vec![]));
        // Streamed in any pieces, the calls come out at the end, after the text before them.
        let text = r#"ok [TOOL [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "f"}]"#;
        for (step, (texts, calls)) in split_in_pieces(text, Syntax::MISTRAL, 5)
            .into_iter()
            .enumerate()
        {
            assert_eq!(texts, "ok [TOOL ", "step {}", step + 1);
            assert_eq!(calls, two, "step {}", step + 1);
        }
    }

    /// `get_weather(city: Paris)` and `f()`, as the list tests' texts write them.
    fn two_calls() -> Vec<ToolCall> {
        vec![
            ToolCall {
                name: "get_weather".into(),
                arguments: r#"{"city":"Paris"}"#.into(),
            },
            ToolCall {
                name: "f".into(),
                arguments: "{}".into(),
            },
        ]
    }

    /// What a `CallSplitter` gives for `text` pushed `step` characters at a time.
    fn stream_in_steps(text: &str, syntax: Syntax, step: usize) -> Vec<Piece> {
        let mut s = CallSplitter::new(syntax);
        let chars: Vec<char> = text.chars().collect();
        let mut pieces: Vec<Piece> = chars
            .chunks(step)
            .flat_map(|chunk| s.push(&chunk.iter().collect::<String>()))
            .collect();
        pieces.extend(s.finish());
        pieces
    }

    /// Streamed in pieces of every size up to `max`, `text` splits into this text and these calls.
    fn split_in_pieces(text: &str, syntax: Syntax, max: usize) -> Vec<(String, Vec<ToolCall>)> {
        (1..=max)
            .map(|step| {
                let mut texts = String::new();
                let mut calls = Vec::new();
                for p in stream_in_steps(text, syntax, step) {
                    match p {
                        Piece::Text(t) => texts.push_str(&t),
                        Piece::Call(c) => calls.push(c),
                    }
                }
                (texts, calls)
            })
            .collect()
    }

    #[test]
    fn mistral_v11_calls_are_name_args_json_after_each_marker() {
        let v11 = "{%- for tc in m.tool_calls %}[TOOL_CALLS]{{ tc.function.name }}[ARGS]{{ tc.function.arguments|tojson }}{%- endfor %}";
        assert_eq!(Syntax::of_template(v11), Some(Syntax::MISTRAL_V11));
        let two = two_calls();
        let text = r#"Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]f[ARGS]{}"#;
        let (content, calls) = parse(text, Syntax::MISTRAL_V11);
        assert_eq!((content.as_deref(), calls), (Some("Sure."), two.clone()));
        for (step, (texts, calls)) in split_in_pieces(text, Syntax::MISTRAL_V11, 7)
            .into_iter()
            .enumerate()
        {
            assert_eq!(texts, "Sure.", "step {}", step + 1);
            assert_eq!(calls, two, "step {}", step + 1);
        }
        // A cut call, or one without `[ARGS]`, stays text as the model wrote it.
        for broken in [
            r#"[TOOL_CALLS]f[ARGS]{"a"#,
            "[TOOL_CALLS]f{}",
            r#"[TOOL_CALLS][ARGS]{}"#,
        ] {
            assert_eq!(
                parse(broken, Syntax::MISTRAL_V11),
                (Some(broken.to_string()), vec![]),
                "{broken}"
            );
        }
        // Forced calls: one (parallel off), or several, each a known name with its schema.
        for (parallel, seed) in [(false, 5), (true, 9)] {
            let r = check(Some(&weather()), Some(&json!("required")), parallel, v11)
                .unwrap()
                .unwrap();
            let text = crate::grammar::tests::sample_with_random_logits(r.grammar().unwrap(), seed);
            assert!(text.starts_with("[TOOL_CALLS]get_weather[ARGS]{"), "{text}");
            let (content, calls) = parse(&text, r.syntax);
            assert_eq!(content, None, "{text}");
            assert!(
                !calls.is_empty() && (parallel || calls.len() == 1),
                "{text}"
            );
            for c in calls {
                assert_eq!(c.name, "get_weather");
                let args: Value = serde_json::from_str(&c.arguments).unwrap();
                assert!(args["city"].is_string(), "{text}");
            }
        }
    }

    #[test]
    fn forced_calls_in_a_list_syntax_follow_the_schema() {
        // One call (parallel_tool_calls off: the array holds one item, so random logits end it).
        let mistral = "{% if tools %}[TOOL_CALLS]{% endif %}";
        let r = check(Some(&weather()), Some(&json!("required")), false, mistral)
            .unwrap()
            .unwrap();
        assert_eq!(r.syntax, Syntax::MISTRAL);
        let text = crate::grammar::tests::sample_with_random_logits(r.grammar().unwrap(), 11);
        assert!(text.starts_with("[TOOL_CALLS]"), "{text}");
        let (content, calls) = parse(&text, r.syntax);
        assert_eq!(content, None, "{text}");
        assert_eq!(calls.len(), 1, "{text}");
        assert_eq!(calls[0].name, "get_weather");
        let args: Value = serde_json::from_str(&calls[0].arguments).unwrap();
        assert!(args["city"].is_string(), "{text}");
    }

    /// A forced call, with random logits, is a parsable call whose arguments follow the schema.
    #[test]
    fn forced_calls_follow_the_schema() {
        // One call (parallel_tool_calls off): the grammar ends after it.
        let r = check(Some(&weather()), Some(&json!("required")), false, HERMES)
            .unwrap()
            .unwrap();
        let text = crate::grammar::tests::sample_with_random_logits(r.grammar().unwrap(), 7);
        let (content, calls) = parse(&text, r.syntax);
        assert_eq!(content, None, "{text}");
        assert_eq!(calls.len(), 1, "{text}");
        for c in calls {
            assert_eq!(c.name, "get_weather");
            let args: Value = serde_json::from_str(&c.arguments).unwrap();
            assert!(args["city"].is_string(), "{text}");
            assert!(
                ["c", "f"].contains(&args["unit"].as_str().unwrap()),
                "{text}"
            );
        }
    }
}
