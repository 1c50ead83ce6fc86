//! Request bodies of the OpenAI API (the fields toy reads; others are ignored, as OpenAI-
//! compatible servers do) and their validation into engine parameters.

use std::collections::HashMap;

use serde::Deserialize;
use serde_json::Value;
use toy_core::sampling::SamplingParams;

use crate::error::ApiError;

/// The longest stop string a request may give, in bytes (OpenAI's own limit is undocumented;
/// real ones are a few tokens: `"\n\n"`, `"</answer>"`, `"User:"`).
pub const MAX_STOP_BYTES: usize = 1024;

/// `stop`: one string or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Sampling fields shared by chat and completions (plus llama.cpp's extensions `top_k`,
/// `min_p`, `repeat_penalty`, `ignore_eos`, `cache_prompt`).
#[derive(Debug, Clone, Deserialize, Default)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub repeat_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub n: Option<u32>,
    pub logit_bias: Option<HashMap<String, f32>>,
    pub ignore_eos: Option<bool>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// llama-server's field: `false` runs the whole prompt (and keeps nothing for later
    /// requests), for numbers that do not depend on what ran before.
    pub cache_prompt: Option<bool>,
    /// `{"type": "text" | "json_object" | "json_schema", …}` (OpenAI's structured output).
    pub response_format: Option<Value>,
    /// A JSON schema the output must follow (llama-server's extension field).
    pub json_schema: Option<Value>,
    /// A grammar the output must follow: Lark (llguidance's syntax) or llama.cpp's GBNF.
    pub grammar: Option<String>,
}

/// Sampling settings checked and turned into what the engine takes.
#[derive(Debug, Clone)]
pub struct Checked {
    pub params: SamplingParams,
    pub n: usize,
    pub stop: Vec<String>,
    pub logit_bias: Vec<(u32, f32)>,
    pub ignore_eos: bool,
    pub stream: bool,
    pub include_usage: bool,
    pub cache_prompt: bool,
    /// The grammar the output must follow (compiled per model by [`crate::grammar::Grammars`]).
    pub grammar: Option<crate::grammar::Requested>,
}

fn range(name: &str, v: Option<f32>, lo: f32, hi: f32, default: f32) -> Result<f32, ApiError> {
    match v {
        None => Ok(default),
        Some(x) if x.is_finite() && x >= lo && x <= hi => Ok(x),
        Some(x) => Err(ApiError::invalid(
            Some(name),
            format!("{name} must be between {lo} and {hi}, got {x}"),
        )),
    }
}

impl Sampling {
    /// OpenAI's defaults: temperature 1, top_p 1, no top-k/min-p, penalties over the generated
    /// tokens only.
    pub fn check(&self, vocab: usize) -> Result<Checked, ApiError> {
        let temperature = range("temperature", self.temperature, 0.0, 2.0, 1.0)?;
        let top_p = range("top_p", self.top_p, 0.0, 1.0, 1.0)?;
        if top_p == 0.0 && temperature > 0.0 {
            return Err(ApiError::invalid(
                Some("top_p"),
                "top_p must be greater than 0",
            ));
        }
        let min_p = range("min_p", self.min_p, 0.0, 1.0, 0.0)?;
        let presence = range("presence_penalty", self.presence_penalty, -2.0, 2.0, 0.0)?;
        let frequency = range("frequency_penalty", self.frequency_penalty, -2.0, 2.0, 0.0)?;
        let repeat = range("repeat_penalty", self.repeat_penalty, 0.0, 10.0, 1.0)?;
        let top_k = self.top_k.unwrap_or(0);
        if top_k < 0 {
            return Err(ApiError::invalid(
                Some("top_k"),
                "top_k must be 0 (off) or more",
            ));
        }
        let n = self.n.unwrap_or(1);
        if !(1..=16).contains(&n) {
            return Err(ApiError::invalid(
                Some("n"),
                format!("n must be between 1 and 16, got {n}"),
            ));
        }
        let stop = self.stop.clone().map(Stop::into_vec).unwrap_or_default();
        if stop.len() > 4 {
            return Err(ApiError::invalid(
                Some("stop"),
                format!("at most 4 stop sequences, got {}", stop.len()),
            ));
        }
        // Generated text is held back while it could still be the start of a stop string and
        // searched at every token: a megabyte-long one would hold back a whole answer and make
        // each token cost a scan of it.
        if let Some(long) = stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
            return Err(ApiError::invalid(
                Some("stop"),
                format!(
                    "a stop sequence may be at most {MAX_STOP_BYTES} bytes, got one of {}",
                    long.len()
                ),
            ));
        }
        let mut logit_bias = Vec::new();
        for (k, &v) in self.logit_bias.iter().flatten() {
            let id: u32 = k
                .parse()
                .ok()
                .filter(|&id| (id as usize) < vocab)
                .ok_or_else(|| {
                    ApiError::invalid(
                        Some("logit_bias"),
                        format!("logit_bias key {k:?} is not a token id below {vocab}"),
                    )
                })?;
            if !(-100.0..=100.0).contains(&v) {
                return Err(ApiError::invalid(
                    Some("logit_bias"),
                    format!("logit_bias values must be between -100 and 100, got {v}"),
                ));
            }
            logit_bias.push((id, v));
        }
        let seed = self.seed.map(|s| s as u64).unwrap_or_else(rand::random);
        let params = SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            repeat_penalty: repeat,
            repeat_last_n: -1,
            presence_penalty: presence,
            frequency_penalty: frequency,
            seed,
        };
        Ok(Checked {
            params,
            n: n as usize,
            stop,
            logit_bias,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            stream: self.stream.unwrap_or(false),
            include_usage: self
                .stream_options
                .as_ref()
                .and_then(|o| o.include_usage)
                .unwrap_or(false),
            cache_prompt: self.cache_prompt.unwrap_or(true),
            grammar: crate::grammar::requested(
                self.response_format.as_ref(),
                self.json_schema.as_ref(),
                self.grammar.as_deref(),
            )?,
        })
    }
}

/// A message's `content`: a string, or a list of parts of which toy reads the text ones.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Clone, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    /// An assistant turn's calls (`[{"id", "type": "function", "function": {"name", "arguments"}}]`).
    #[serde(default)]
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` turn: the call it answers.
    #[serde(default)]
    pub tool_call_id: Option<String>,
    #[serde(default)]
    pub name: Option<String>,
}

impl Message {
    pub fn text(&self, i: usize) -> Result<String, ApiError> {
        match &self.content {
            None => Ok(String::new()),
            Some(Content::Text(s)) => Ok(s.clone()),
            Some(Content::Parts(parts)) => {
                let mut out = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => out.push_str(t),
                        (kind, _) => {
                            return Err(ApiError::invalid(
                                Some(&format!("messages[{i}].content")),
                                format!(
                                    "content parts of type {kind:?} are not supported: this model reads text only"
                                ),
                            ));
                        }
                    }
                }
                Ok(out)
            }
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<Message>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    pub tools: Option<Value>,
    /// `"none"`, `"auto"`, `"required"` or `{"type": "function", "function": {"name": …}}`.
    pub tool_choice: Option<Value>,
    /// Whether a forced call (`required`) may be several calls; off by default, as in
    /// llama-server (small models repeat calls when allowed to).
    pub parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

/// `prompt` (completions) and `input` (embeddings): text or token ids, one or many.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

/// One prompt of a [`Prompt`].
pub enum PromptItem {
    Text(String),
    Ids(Vec<u32>),
}

impl Prompt {
    pub fn items(self) -> Vec<PromptItem> {
        match self {
            Prompt::Text(s) => vec![PromptItem::Text(s)],
            Prompt::Texts(v) => v.into_iter().map(PromptItem::Text).collect(),
            Prompt::Ids(v) => vec![PromptItem::Ids(v)],
            Prompt::IdLists(v) => v.into_iter().map(PromptItem::Ids).collect(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
    pub max_tokens: Option<u64>,
    pub echo: Option<bool>,
    pub logprobs: Option<u32>,
    pub suffix: Option<String>,
    pub best_of: Option<u32>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

#[derive(Debug, Clone, Deserialize)]
pub struct EmbeddingRequest {
    pub model: Option<String>,
    pub input: Prompt,
    pub encoding_format: Option<String>,
    pub dimensions: Option<u32>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct TokenizeRequest {
    pub content: String,
    pub add_special: Option<bool>,
    pub parse_special: Option<bool>,
    pub with_pieces: Option<bool>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct DetokenizeRequest {
    pub tokens: Vec<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampling(json: &str) -> Sampling {
        serde_json::from_str(json).expect("parses")
    }

    #[test]
    fn openai_defaults_and_ranges() {
        let c = sampling("{}").check(100).unwrap();
        assert_eq!(c.params.temperature, 1.0);
        assert_eq!(c.params.top_p, 1.0);
        assert_eq!(c.params.top_k, 0);
        assert_eq!(c.params.min_p, 0.0);
        assert_eq!(c.params.repeat_last_n, -1);
        assert_eq!(c.n, 1);
        assert!(!c.stream);
        let c = sampling(r#"{"temperature":0,"seed":5,"stop":"\n","n":2,"stream":true,"stream_options":{"include_usage":true},"logit_bias":{"7":-100}}"#)
            .check(100)
            .unwrap();
        assert!(c.params.is_greedy());
        assert_eq!(c.params.seed, 5);
        assert_eq!(c.stop, vec!["\n".to_string()]);
        assert_eq!((c.n, c.stream, c.include_usage), (2, true, true));
        assert_eq!(c.logit_bias, vec![(7, -100.0)]);
        for (bad, param) in [
            (r#"{"temperature":2.5}"#, "temperature"),
            (r#"{"top_p":1.5}"#, "top_p"),
            (r#"{"n":0}"#, "n"),
            (r#"{"presence_penalty":-3}"#, "presence_penalty"),
            (r#"{"stop":["a","b","c","d","e"]}"#, "stop"),
            (
                format!(r#"{{"stop":"{}"}}"#, "x".repeat(MAX_STOP_BYTES + 1)).as_str(),
                "stop",
            ),
            (r#"{"logit_bias":{"100":1}}"#, "logit_bias"),
            (r#"{"logit_bias":{"x":1}}"#, "logit_bias"),
            (r#"{"logit_bias":{"3":101}}"#, "logit_bias"),
        ] {
            let e = sampling(bad).check(100).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{bad}: {}", e.message);
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST);
        }
    }

    #[test]
    fn prompts_and_contents_in_every_shape() {
        let p: Prompt = serde_json::from_str(r#""hi""#).unwrap();
        assert!(matches!(p.items()[..], [PromptItem::Text(_)]));
        let p: Prompt = serde_json::from_str(r#"[1, 2, 3]"#).unwrap();
        assert!(matches!(&p.items()[..], [PromptItem::Ids(ids)] if ids == &[1, 2, 3]));
        let p: Prompt = serde_json::from_str(r#"[[1], [2, 3]]"#).unwrap();
        assert_eq!(p.items().len(), 2);
        let p: Prompt = serde_json::from_str(r#"["a", "b"]"#).unwrap();
        assert_eq!(p.items().len(), 2);
        let m: Message = serde_json::from_str(
            r#"{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}"#,
        )
        .unwrap();
        assert_eq!(m.text(0).unwrap(), "ab");
        let m: Message = serde_json::from_str(
            r#"{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}"#,
        )
        .unwrap();
        assert!(m.text(0).unwrap_err().message.contains("image_url"));
        let m: Message = serde_json::from_str(r#"{"role":"assistant","content":null}"#).unwrap();
        assert_eq!(m.text(0).unwrap(), "");
    }
}
