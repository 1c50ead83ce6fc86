//! The legacy `/v1/completions`: prompts (texts or token ids) × `n` engine jobs, with echo and
//! OpenAI's legacy logprobs ([`LegacyLogprobs`]), answered whole or streamed
//! ([`CompletionStream`]).

use std::collections::VecDeque;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use toy_core::tokenizer::Tokenizer;

use super::jobs::{collect, engine_error, gen_jobs, note_finish, submit, usage};
use super::request::{
    check_ids, check_model, constraint, encode, fingerprint, fit_context, read_json, ready,
    token_string, unix_now,
};
use super::sse::{Meta, SseSource, sse};
use super::{AppState, logged};
use crate::api::{CompletionRequest, PromptItem};
use crate::engine::{GenEvent, ModelInfo, TokenLogprob};
use crate::error::ApiError;
use crate::state::{Admission, RequestLog};

/// OpenAI's legacy `logprobs` object for a run of tokens starting at text offset `offset`.
#[derive(Default)]
struct LegacyLogprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<Option<f32>>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<usize>,
}

impl LegacyLogprobs {
    fn push(&mut self, tok: &Tokenizer, id: u32, lp: Option<&TokenLogprob>, offset: &mut usize) {
        let s = token_string(tok, id);
        self.text_offset.push(*offset);
        *offset += s.chars().count();
        self.tokens.push(s);
        self.token_logprobs.push(lp.map(|l| l.logprob));
        self.top_logprobs.push(match lp {
            None => Value::Null,
            Some(l) => {
                let mut m = serde_json::Map::new();
                for &(id, v) in &l.top {
                    m.entry(token_string(tok, id)).or_insert(json!(v));
                }
                Value::Object(m)
            }
        });
    }

    fn json(&self) -> Value {
        json!({
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        })
    }
}

pub(super) async fn completions(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let s2 = s.clone();
    logged(s, "completions", "cmpl", async move |log| {
        let req: CompletionRequest = read_json(&s2, &headers, body).await?;
        let info = ready(&s2)?;
        check_model(&info, req.model.as_deref())?;
        if req.suffix.as_deref().is_some_and(|x| !x.is_empty()) {
            return Err(ApiError::invalid(
                Some("suffix"),
                "suffix (insertion) is not supported by toy serve",
            ));
        }
        if req.best_of.is_some_and(|b| b > 1) {
            return Err(ApiError::invalid(
                Some("best_of"),
                "best_of is not supported by toy serve; use n",
            ));
        }
        let checked = req.sampling.check(info.vocab)?;
        let logprobs = req.logprobs.map(|k| k as usize);
        if logprobs.is_some_and(|k| k > 20) {
            return Err(ApiError::invalid(
                Some("logprobs"),
                "logprobs must be between 0 and 20",
            ));
        }
        let echo = req.echo.unwrap_or(false);
        let items = req.prompt.items();
        if items.is_empty() {
            return Err(ApiError::invalid(Some("prompt"), "prompt is an empty list"));
        }
        if items.len() * checked.n > 64 {
            return Err(ApiError::invalid(
                Some("prompt"),
                "at most 64 sequences (prompts × n) per request",
            ));
        }
        // OpenAI's default for completions is 16 tokens.
        let max_tokens = req.max_tokens.unwrap_or(16);
        if max_tokens == 0 && !echo {
            return Err(ApiError::invalid(
                Some("max_tokens"),
                "max_tokens 0 only makes sense with echo (scoring the prompt)",
            ));
        }
        let mut prompts = Vec::new();
        let mut echo_texts = Vec::new();
        for item in items {
            let (ids, text) = match item {
                PromptItem::Text(t) => (encode(&info, t.clone(), true, true).await?, t),
                PromptItem::Ids(ids) => {
                    check_ids(&info, &ids, "prompt")?;
                    let text = info.tokenizer.decode(&ids);
                    (ids, text)
                }
            };
            if ids.is_empty() {
                return Err(ApiError::invalid(Some("prompt"), "the prompt is empty"));
            }
            fit_context(&info, ids.len(), Some(max_tokens), "prompt")?;
            prompts.push(ids);
            echo_texts.push(text);
        }
        let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
        let constraint = constraint(&info, &checked).await?;
        let jobs = gen_jobs(
            &prompts,
            &checked,
            max_tokens as usize,
            logprobs,
            echo && logprobs.is_some(),
            constraint.as_ref(),
        );
        let (mut rx, admission) = submit(&s2, jobs)?;
        let l = log.as_mut().expect("log");
        l.prompt_tokens = prompt_tokens;
        l.stream = checked.stream;
        let meta = Meta {
            id: l.id.clone(),
            created: unix_now(),
            model: info.id.clone(),
            fingerprint: fingerprint(&s2),
        };
        let n = checked.n;
        if checked.stream {
            let total = prompts.len() * n;
            let stream = CompletionStream {
                meta,
                info: info.clone(),
                shared: s2.clone(),
                rx,
                total,
                done: 0,
                prompt_tokens,
                completion_tokens: 0,
                cached_tokens: vec![0; prompts.len()],
                n,
                include_usage: checked.include_usage,
                logprobs: logprobs.is_some(),
                echo: echo.then(|| (0..total).map(|i| echo_texts[i / n].clone()).collect()),
                prompts: (0..total).map(|i| prompts[i / n].clone()).collect(),
                offsets: vec![0; total],
                out: VecDeque::new(),
                finished: false,
                log: log.take(),
                _admission: admission,
            };
            return Ok(sse(stream));
        }
        let outs = collect(&s2, &mut rx, prompts.len() * n).await?;
        drop(admission);
        let mut completion_tokens = 0;
        let mut cached_tokens = vec![0; prompts.len()];
        let mut choices = Vec::new();
        for (i, c) in outs.into_iter().enumerate() {
            let f = c.finish.expect("collected");
            completion_tokens += f.completion_tokens;
            // Choices `i / n` share a prompt: count its best reuse once.
            cached_tokens[i / n] = cached_tokens[i / n].max(f.cached_tokens);
            note_finish(l, &f);
            let mut text = String::new();
            let mut lps = LegacyLogprobs::default();
            let mut offset = 0;
            if echo {
                text.push_str(&echo_texts[i / n]);
                if logprobs.is_some() {
                    let p = &prompts[i / n];
                    for (k, &id) in p.iter().enumerate() {
                        let lp = c.prompt_logprobs.get(k).and_then(Option::as_ref);
                        lps.push(&info.tokenizer, id, lp, &mut offset);
                    }
                }
            }
            text.push_str(&c.text);
            if logprobs.is_some() {
                for (id, lp) in c.ids.iter().zip(&c.logprobs) {
                    lps.push(&info.tokenizer, *id, Some(lp), &mut offset);
                }
            }
            choices.push(json!({
                "text": text,
                "index": i,
                "logprobs": if logprobs.is_some() { lps.json() } else { Value::Null },
                "finish_reason": f.reason.as_str(),
            }));
        }
        Ok(axum::Json(json!({
            "id": meta.id,
            "object": "text_completion",
            "created": meta.created,
            "model": meta.model,
            "system_fingerprint": meta.fingerprint,
            "choices": choices,
            "usage": usage(prompt_tokens, completion_tokens, cached_tokens.iter().sum()),
        }))
        .into_response())
    })
    .await
}

struct CompletionStream {
    meta: Meta,
    info: Arc<ModelInfo>,
    shared: AppState,
    rx: mpsc::UnboundedReceiver<(usize, GenEvent)>,
    total: usize,
    done: usize,
    prompt_tokens: usize,
    completion_tokens: usize,
    /// Per prompt, its best prefix-cache reuse among its `n` choices.
    cached_tokens: Vec<usize>,
    n: usize,
    include_usage: bool,
    logprobs: bool,
    /// Prompt texts still to echo, per choice.
    echo: Option<Vec<String>>,
    prompts: Vec<Vec<u32>>,
    offsets: Vec<usize>,
    out: VecDeque<String>,
    finished: bool,
    log: Option<RequestLog>,
    _admission: Admission,
}

impl CompletionStream {
    fn chunk(&self, index: usize, text: &str, logprobs: Value, finish: Option<&str>) -> String {
        let mut c = json!({
            "id": self.meta.id,
            "object": "text_completion",
            "created": self.meta.created,
            "model": self.meta.model,
            "system_fingerprint": self.meta.fingerprint,
            "choices": [{"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}],
        });
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        c.to_string()
    }

    fn fail(&mut self, e: ApiError) {
        self.out.push_back(e.body().to_string());
        self.finished = true;
        if let Some(log) = &mut self.log {
            log.status = e.status.as_u16();
            log.error = Some(e.message);
            log.completed = true;
        }
    }

    async fn fill(&mut self) {
        // Echoed prompts come first (without logprobs, those come with PromptLogprobs).
        // (With logprobs the prompt is sent when its logprobs arrive.)
        if !self.logprobs
            && let Some(echo) = self.echo.take()
        {
            for (i, text) in echo.iter().enumerate() {
                let c = self.chunk(i, text, Value::Null, None);
                self.out.push_back(c);
            }
        }
        while self.out.is_empty() && !self.finished {
            let Some((i, event)) = self.rx.recv().await else {
                let e = engine_error(&self.shared, "the engine stopped".into());
                self.fail(e);
                return;
            };
            match event {
                GenEvent::PromptLogprobs(lps) => {
                    let text = self.echo.as_ref().map(|e| e[i].clone()).unwrap_or_default();
                    let mut l = LegacyLogprobs::default();
                    let prompt = self.prompts[i].clone();
                    for (k, id) in prompt.into_iter().enumerate() {
                        let lp = lps.get(k).and_then(Option::as_ref);
                        l.push(&self.info.tokenizer, id, lp, &mut self.offsets[i]);
                    }
                    let c = self.chunk(i, &text, l.json(), None);
                    self.out.push_back(c);
                }
                GenEvent::Token { id, text, logprob } => {
                    let lp = if self.logprobs {
                        let mut l = LegacyLogprobs::default();
                        l.push(
                            &self.info.tokenizer,
                            id,
                            logprob.as_ref(),
                            &mut self.offsets[i],
                        );
                        l.json()
                    } else {
                        Value::Null
                    };
                    if !text.is_empty() || self.logprobs {
                        let c = self.chunk(i, &text, lp, None);
                        self.out.push_back(c);
                    }
                }
                GenEvent::Done(f) => {
                    let c = self.chunk(i, &f.tail, Value::Null, Some(f.reason.as_str()));
                    self.out.push_back(c);
                    self.completion_tokens += f.completion_tokens;
                    let p = i / self.n;
                    self.cached_tokens[p] = self.cached_tokens[p].max(f.cached_tokens);
                    if let Some(log) = &mut self.log {
                        note_finish(log, &f);
                    }
                    self.done += 1;
                    if self.done == self.total {
                        if self.include_usage {
                            let c = json!({
                                "id": self.meta.id,
                                "object": "text_completion",
                                "created": self.meta.created,
                                "model": self.meta.model,
                                "system_fingerprint": self.meta.fingerprint,
                                "choices": [],
                                "usage": usage(
                                    self.prompt_tokens,
                                    self.completion_tokens,
                                    self.cached_tokens.iter().sum(),
                                ),
                            });
                            self.out.push_back(c.to_string());
                        }
                        self.out.push_back("[DONE]".into());
                        self.finished = true;
                        if let Some(log) = &mut self.log {
                            log.completed = true;
                        }
                    }
                }
                GenEvent::Error(message) => {
                    let e = engine_error(&self.shared, message);
                    self.fail(e);
                }
            }
        }
    }
}

impl SseSource for CompletionStream {
    async fn next_data(&mut self) -> Option<String> {
        if self.out.is_empty() && !self.finished {
            self.fill().await;
        }
        self.out.pop_front()
    }
}
