//! Chat templates: the Jinja templates that Hugging Face models ship (`tokenizer.chat_template`
//! in GGUF) rendered with `minijinja` the way `transformers.apply_chat_template` renders them.
//!
//! What transformers sets up, and so what this module sets up:
//! - `trim_blocks` and `lstrip_blocks` on (a newline after a block tag is dropped, whitespace
//!   before a block tag on its line is dropped);
//! - the variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, and `tools`
//!   when the caller offers functions ([`render_json`]);
//! - transformers' `tojson` (Python's `json.dumps`: `", "` and `": "` separators, non-ASCII
//!   kept, keys in their given order, `indent`), not minijinja's HTML-safe compact one — tool
//!   schemas reach the prompt through it;
//! - the function `raise_exception(message)`, which templates call to refuse a conversation (for
//!   example roles that do not alternate);
//! - Python string and dict methods (`.strip()`, `.startswith()`, `.items()` …) through
//!   `minijinja-contrib`'s pycompat callback, and `{% break %}`/`{% continue %}`.
//!
//! A template comes from the model file, so it is untrusted input: it gets no loader (no
//! `include` of files), a budget of template instructions ([`TEMPLATE_FUEL`]) so nested loops
//! cannot hang the caller, and an output cap ([`MAX_RENDERED_BYTES`]). minijinja bounds
//! recursion, `range` and string repetition itself. What nothing inside the process can bound —
//! a string grown by concatenation until an allocation fails, which aborts — is bounded on
//! Linux by rendering in a forked child with an address-space limit ([`sandbox`]).

#[cfg(target_os = "linux")]
pub mod sandbox;

use std::borrow::Cow;

use minijinja::{Environment, Error, ErrorKind, context};
use serde::{Deserialize, Serialize};

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` (templates may accept others, e.g. `tool`).
    pub role: String,
    /// The text of the turn.
    pub content: String,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Why a chat template could not be rendered.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// The template does not parse or fails while rendering.
    #[error("chat template error: {0}")]
    Template(String),
    /// The template called `raise_exception`: the conversation is not one it accepts.
    #[error("the chat template refused the conversation: {0}")]
    Refused(String),
}

/// Template instructions one render may run: SmolLM2's template spends ~30 per message, so
/// this leaves room for long conversations and tool schemas and stops a runaway template in
/// about a second.
pub const TEMPLATE_FUEL: u64 = 20_000_000;

/// The most text one render may produce (far beyond any model's context).
pub const MAX_RENDERED_BYTES: usize = 16 << 20;

/// Marks errors that come from `raise_exception`, to tell them from template bugs.
const RAISED: &str = "raise_exception: ";

/// Render `template` for `messages`. With `add_generation_prompt`, the result ends with the
/// header of an assistant turn (what the model then completes).
pub fn render(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String, ChatError> {
    let messages = serde_json::to_value(messages).expect("messages serialize");
    render_json(
        template,
        &messages,
        None,
        add_generation_prompt,
        bos_token,
        eos_token,
    )
}

/// [`render`] for messages as OpenAI's API sends them (any fields: `tool_calls`,
/// `tool_call_id`, `name` …) and, when given, the `tools` a template describes to the model.
/// Without tools the variable is undefined, as in transformers.
pub fn render_json(
    template: &str,
    messages: &serde_json::Value,
    tools: Option<&serde_json::Value>,
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String, ChatError> {
    let job = RenderJob {
        template: template.into(),
        messages: Cow::Borrowed(messages),
        tools: tools.map(Cow::Borrowed),
        add_generation_prompt,
        bos_token: bos_token.into(),
        eos_token: eos_token.into(),
    };
    // (A fuzzing build renders in this process, where the fuzzer sees minijinja's coverage.)
    #[cfg(all(target_os = "linux", not(fuzzing)))]
    return sandbox::render(&job);
    #[cfg(any(not(target_os = "linux"), fuzzing))]
    job.render_here()
}

/// Everything one render needs: what [`render_json`] was given, borrowed there and owned where
/// the sandbox's zygote reads a job back from its socket.
#[derive(Serialize, Deserialize)]
struct RenderJob<'a> {
    template: Cow<'a, str>,
    messages: Cow<'a, serde_json::Value>,
    tools: Option<Cow<'a, serde_json::Value>>,
    add_generation_prompt: bool,
    bos_token: Cow<'a, str>,
    eos_token: Cow<'a, str>,
}

impl RenderJob<'_> {
    /// The render itself, in this process.
    fn render_here(&self) -> Result<String, ChatError> {
        let (template, messages, tools) = (&*self.template, &*self.messages, self.tools.as_deref());
        let (bos_token, eos_token) = (&*self.bos_token, &*self.eos_token);
        let add_generation_prompt = self.add_generation_prompt;
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, Error> {
                Err(Error::new(
                    ErrorKind::InvalidOperation,
                    format!("{RAISED}{message}"),
                ))
            },
        );
        env.add_filter("tojson", python_tojson);
        env.add_filter("indent", bounded_indent);
        env.add_function("strftime_now", |format: String| {
            crate::clock::strftime(&format, crate::clock::unix_now())
        });
        env.add_template("chat", template)
            .map_err(|e| ChatError::Template(describe(&e)))?;
        let tmpl = env
            .get_template("chat")
            .map_err(|e| ChatError::Template(describe(&e)))?;
        let mut out = CappedWriter::default();
        let messages = minijinja::Value::from_serialize(messages);
        let ctx = match tools {
            Some(tools) => context! {
                messages => messages,
                tools => minijinja::Value::from_serialize(tools),
                add_generation_prompt => add_generation_prompt,
                bos_token => bos_token,
                eos_token => eos_token,
            },
            None => context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => bos_token,
                eos_token => eos_token,
            },
        };
        let rendered = tmpl.render_captured_to(ctx, &mut out);
        match rendered {
            Ok(_) => String::from_utf8(out.bytes)
                .map_err(|_| ChatError::Template("the template produced invalid UTF-8".into())),
            Err(_) if out.overflowed => Err(ChatError::Template(format!(
                "the template's output passed {} MiB; it is not a usable chat template",
                MAX_RENDERED_BYTES >> 20
            ))),
            Err(e) if e.kind() == ErrorKind::OutOfFuel => Err(ChatError::Template(format!(
                "the template ran more than {TEMPLATE_FUEL} instructions (a runaway loop?); \
             it is not a usable chat template"
            ))),
            Err(e) => Err(match raised_message(&e) {
                Some(msg) => ChatError::Refused(msg),
                None => ChatError::Template(describe(&e)),
            }),
        }
    }
}

/// transformers' `tojson(x, indent=None)`: `json.dumps(x, ensure_ascii=False, indent=indent)`.
fn python_tojson(
    value: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> Result<minijinja::Value, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let mut out = String::new();
    dump_python(&json, indent, 0, &mut out).map_err(|TooLarge| {
        Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "tojson: the text passed {} MiB (indent={})",
                MAX_RENDERED_BYTES >> 20,
                indent.unwrap_or(0)
            ),
        )
    })?;
    // Marked safe, as jinja2's tojson is (no autoescape runs on chat templates anyway).
    Ok(minijinja::Value::from_safe_string(out))
}

/// A filter's result would pass [`MAX_RENDERED_BYTES`]: no render could use it, and building
/// it could take all memory (`tojson(indent=4555555555)`, found by the fuzzer).
struct TooLarge;

/// Python's `json.dumps` layout for `v`, refusing to grow `out` past [`MAX_RENDERED_BYTES`].
fn dump_python(
    v: &serde_json::Value,
    indent: Option<usize>,
    level: usize,
    out: &mut String,
) -> Result<(), TooLarge> {
    use serde_json::Value as J;
    let newline = |out: &mut String, level: usize| -> Result<(), TooLarge> {
        if let Some(n) = indent {
            let width = n.checked_mul(level).ok_or(TooLarge)?;
            if out.len().saturating_add(width) >= MAX_RENDERED_BYTES {
                return Err(TooLarge);
            }
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', width));
        }
        Ok(())
    };
    // With an indent, Python's item separator drops its trailing space.
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        J::Null => out.push_str("null"),
        J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        J::Number(n) => out.push_str(&n.to_string()),
        J::String(s) => python_string(s, out),
        J::Array(items) if items.is_empty() => out.push_str("[]"),
        J::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1)?;
                dump_python(item, indent, level + 1, out)?;
            }
            newline(out, level)?;
            out.push(']');
        }
        J::Object(map) if map.is_empty() => out.push_str("{}"),
        J::Object(map) => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, level + 1)?;
                python_string(k, out);
                out.push_str(": ");
                dump_python(item, indent, level + 1, out)?;
            }
            newline(out, level)?;
            out.push('}');
        }
    }
    if out.len() > MAX_RENDERED_BYTES {
        return Err(TooLarge);
    }
    Ok(())
}

/// minijinja's `indent` filter, refused when its result would pass [`MAX_RENDERED_BYTES`]
/// (`x|indent(99999999999)` asks for that many spaces per line before anything is written).
fn bounded_indent(
    value: minijinja::value::StringInput<'_>,
    width: Option<usize>,
    first: Option<bool>,
    blank: Option<bool>,
    kwargs: minijinja::value::Kwargs,
) -> Result<minijinja::Value, Error> {
    let w = match width {
        Some(w) => w,
        None => kwargs.peek::<Option<usize>>("width")?.unwrap_or(4),
    };
    let lines = value.as_str().bytes().filter(|&b| b == b'\n').count() + 1;
    let size = w
        .checked_mul(lines)
        .and_then(|spaces| spaces.checked_add(value.as_str().len()));
    if !matches!(size, Some(n) if n <= MAX_RENDERED_BYTES) {
        return Err(Error::new(
            ErrorKind::InvalidOperation,
            format!(
                "indent({w}) of {lines} lines would pass {} MiB",
                MAX_RENDERED_BYTES >> 20
            ),
        ));
    }
    minijinja::filters::indent(value, width, first, blank, kwargs)
}

/// A JSON string as `json.dumps(..., ensure_ascii=False)` writes it.
fn python_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Collects the rendered text and refuses to grow past [`MAX_RENDERED_BYTES`].
#[derive(Default)]
struct CappedWriter {
    bytes: Vec<u8>,
    overflowed: bool,
}

impl std::io::Write for CappedWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len() + buf.len() > MAX_RENDERED_BYTES {
            self.overflowed = true;
            return Err(std::io::Error::other("chat template output too large"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The message a template passed to `raise_exception`, if this error (or its cause) is one.
fn raised_message(e: &Error) -> Option<String> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if let Some(mj) = err.downcast_ref::<Error>()
            && let Some(detail) = mj.detail()
            && let Some(msg) = detail.strip_prefix(RAISED)
        {
            return Some(msg.to_string());
        }
        cur = err.source();
    }
    None
}

/// A one-line description with the template line, and the causes.
fn describe(e: &Error) -> String {
    let mut s = e.to_string();
    let mut cur = std::error::Error::source(e);
    while let Some(err) = cur {
        s.push_str(": ");
        s.push_str(&err.to_string());
        cur = err.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A string doubled sixty times: 2⁶⁰ bytes asked for in ~300 template instructions.
    pub(super) const DOUBLING: &str = "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}";

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn chatml_by_hand() {
        let msgs = [
            ChatMessage::new("user", "Hi"),
            ChatMessage::new("assistant", "Hello!"),
        ];
        assert_eq!(
            render(CHATML, &msgs, true, "", "").unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            render(CHATML, &msgs[..1], false, "", "").unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n"
        );
    }

    #[test]
    fn raise_exception_is_a_refusal() {
        let t = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok";
        let err = render(t, &[ChatMessage::new("assistant", "x")], false, "", "").unwrap_err();
        assert!(
            matches!(&err, ChatError::Refused(m) if m == "first must be user"),
            "{err:?}"
        );
        assert_eq!(
            render(t, &[ChatMessage::new("user", "x")], false, "", "").unwrap(),
            "ok"
        );
    }

    #[test]
    fn broken_template_is_an_error_not_a_panic() {
        let err = render("{% for m in messages %}", &[], false, "", "").unwrap_err();
        assert!(matches!(err, ChatError::Template(_)), "{err:?}");
        // An attribute of an undefined value fails, as in jinja2 (UndefinedError).
        let err = render("{{ messages[0].content }}", &[], false, "", "").unwrap_err();
        assert!(
            matches!(&err, ChatError::Template(m) if m.contains("undefined")),
            "{err:?}"
        );
        // Merely undefined renders empty, as in jinja2.
        assert_eq!(render("[{{ nothing }}]", &[], false, "", "").unwrap(), "[]");
    }

    /// Hostile templates fail in bounded time and memory (issue 21): nested loops run out of
    /// fuel, a flood of output hits the cap, `include` has no loader.
    #[test]
    fn hostile_templates_fail_quickly() {
        let nested = "{% for a in range(90000) %}{% for b in range(90000) %}{% for c in range(90000) %}{% endfor %}{% endfor %}{% endfor %}";
        let err = render(nested, &[], false, "", "").unwrap_err();
        assert!(
            matches!(&err, ChatError::Template(m) if m.contains("instructions")),
            "{err:?}"
        );
        let flood = "{% for a in range(100000) %}{{ 'x' * 1000 }}{% endfor %}";
        let err = render(flood, &[], false, "", "").unwrap_err();
        assert!(
            matches!(&err, ChatError::Template(m) if m.contains("MiB")),
            "{err:?}"
        );
        let include = "{% include '/etc/passwd' %}";
        assert!(render(include, &[], false, "", "").is_err());
        let recursion = "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}";
        assert!(render(recursion, &[], false, "", "").is_err());
        // Widths that ask for gigabytes before a byte is written (the fuzzer's find): refused
        // by the filters themselves, not by the sandbox's memory limit.
        for wide in [
            "{{ {'x': [1]} | tojson(indent=4555555555) }}",
            "{{ [[[[1]]]] | tojson(indent=9999999999999999999) }}",
            "{{ 'a\nb' | indent(99999999999) }}",
            "{{ 'a\nb' | indent(width=99999999999) }}",
        ] {
            let err = render(wide, &[], false, "", "").unwrap_err();
            assert!(
                matches!(&err, ChatError::Template(m) if m.contains("would pass 16 MiB") || m.contains("passed 16 MiB")),
                "{wide}: {err:?}"
            );
        }
        assert_eq!(
            render(
                "{{ 'a\nb' | indent(2) }}|{{ {'x': [1]} | tojson(indent=2) }}",
                &[],
                false,
                "",
                ""
            )
            .unwrap(),
            "a\n  b|{\n  \"x\": [\n    1\n  ]\n}"
        );
    }

    /// A string doubled in a loop asks for 2⁶⁰ bytes: on Linux the render's child process
    /// hits its address-space limit and the caller gets an error, its own memory untouched;
    /// the next render works.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_string_doubled_without_end_is_an_error_not_an_abort() {
        let err = render(DOUBLING, &[], false, "", "").unwrap_err();
        assert!(
            matches!(&err, ChatError::Template(m) if m.contains("MiB")),
            "{err:?}"
        );
        // Doubling within the budget is a template's own business.
        let few = DOUBLING.replace("range(60)", "range(10)");
        assert_eq!(render(&few, &[], false, "", "").unwrap(), "2048");
        assert_eq!(
            render(CHATML, &[ChatMessage::new("user", "Hi")], false, "", "").unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n"
        );
    }

    /// A chain of 300,000 `+` runs minijinja's parser out of stack (found by the chat_template
    /// fuzz target): the child that rendered it dies, and the caller gets an error naming that.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_template_nested_past_the_stack_is_an_error_not_a_crash() {
        let deep = format!("{{{{ 1{} }}}}", "+1".repeat(300_000));
        let err = render(&deep, &[], false, "", "").unwrap_err();
        assert!(
            matches!(&err, ChatError::Template(m) if m.contains("nests too deeply")),
            "{err:?}"
        );
        let shallow = format!("{{{{ 1{} }}}}", "+1".repeat(99));
        assert_eq!(render(&shallow, &[], false, "", "").unwrap(), "100");
    }

    /// The zygote renders, survives a child killed by a runaway template, and renders again.
    #[cfg(target_os = "linux")]
    #[test]
    fn the_sandbox_zygote_outlives_a_runaway_template() {
        sandbox::start().unwrap();
        let hi = [ChatMessage::new("user", "Hi")];
        let want = "<|im_start|>user\nHi<|im_end|>\n";
        assert_eq!(render(CHATML, &hi, false, "", "").unwrap(), want);
        assert!(render(DOUBLING, &hi, false, "", "").is_err());
        let refusal = "{{ raise_exception('no') }}";
        assert!(matches!(
            render(refusal, &hi, false, "", ""),
            Err(ChatError::Refused(m)) if m == "no"
        ));
        assert_eq!(render(CHATML, &hi, false, "", "").unwrap(), want);
    }

    #[test]
    fn python_methods_and_trim_blocks() {
        let t = "{% for m in messages %}\n  {% if m.content.strip().startswith('!') %}\n[{{ m.content.strip()|upper }}]\n  {% endif %}\n{% endfor %}";
        let msgs = [
            ChatMessage::new("user", "  !hi  "),
            ChatMessage::new("user", "no"),
        ];
        assert_eq!(render(t, &msgs, false, "", "").unwrap(), "[!HI]\n");
    }

    /// Every case of fixtures/chat/cases.json (jinja2 with transformers' settings).
    #[test]
    fn matches_jinja2_on_fixture_templates() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/chat/cases.json");
        let text = std::fs::read_to_string(&path).expect("fixtures/chat/cases.json");
        let fixture: serde_json::Value = serde_json::from_str(&text).unwrap();
        let cases = fixture["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 50);
        let mut refusals = 0;
        for case in cases {
            let template = fixture["templates"][case["template"].as_str().unwrap()]
                .as_str()
                .unwrap();
            let messages: Vec<ChatMessage> = serde_json::from_value(
                fixture["conversations"][case["conversation"].as_str().unwrap()].clone(),
            )
            .unwrap();
            let got = render(
                template,
                &messages,
                case["add_generation_prompt"].as_bool().unwrap(),
                case["bos_token"].as_str().unwrap(),
                case["eos_token"].as_str().unwrap(),
            );
            let label = format!(
                "{} / {} / agp={}",
                case["template"], case["conversation"], case["add_generation_prompt"]
            );
            match (case.get("expected").and_then(|v| v.as_str()), got) {
                (Some(want), Ok(got)) => assert_eq!(got, want, "{label}"),
                (None, Err(ChatError::Refused(msg))) => {
                    assert_eq!(msg, case["error"].as_str().unwrap(), "{label}");
                    refusals += 1;
                }
                (want, got) => panic!("{label}: want {want:?}, got {got:?}"),
            }
        }
        assert_eq!(refusals, 12);
    }

    /// Every case of fixtures/chat/tool_cases.json: tool conversations and `tools` through
    /// Qwen 2.5's template and transformers' `tojson` (jinja2, make_tool_fixtures.py).
    #[test]
    fn tools_and_tojson_match_transformers() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures/chat/tool_cases.json");
        let text = std::fs::read_to_string(&path).expect("fixtures/chat/tool_cases.json");
        let fixture: serde_json::Value = serde_json::from_str(&text).unwrap();
        let cases = fixture["cases"].as_array().unwrap();
        assert_eq!(cases.len(), 9);
        for case in cases {
            let template = fixture["templates"][case["template"].as_str().unwrap()]
                .as_str()
                .unwrap();
            let messages = &fixture["conversations"][case["conversation"].as_str().unwrap()];
            let tools = Some(&case["tools"]).filter(|t| !t.is_null());
            let got = render_json(template, messages, tools, true, "", "").unwrap();
            assert_eq!(
                got,
                case["expected"].as_str().unwrap(),
                "{} / {} / tools={}",
                case["template"],
                case["conversation"],
                tools.is_some()
            );
        }
    }
}
