//! `/v1/chat/completions`: the chat template rendered and tokenized, one engine job per
//! choice, answered whole or streamed as `chat.completion.chunk`s ([`ChatStream`]).

use std::collections::VecDeque;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use toy_core::chat;
use toy_core::tokenizer::Tokenizer;

use super::jobs::{collect, engine_error, gen_jobs, note_finish, submit, usage};
use super::request::{
    check_model, constraint, encode, fingerprint, fit_context, new_id, read_json, ready,
    token_string, unix_now,
};
use super::sse::{Meta, SseSource, sse};
use super::{AppState, logged};
use crate::api::ChatRequest;
use crate::engine::{GenEvent, ModelInfo, TokenLogprob};
use crate::error::ApiError;
use crate::grammar::Requested;
use crate::state::{Admission, RequestLog};
use crate::tools::{self, CallSplitter, Piece};

fn chat_logprob_entry(tok: &Tokenizer, lp: &TokenLogprob) -> Value {
    let entry = |id: u32, logprob: f32| {
        json!({
            "token": token_string(tok, id),
            "logprob": logprob,
            "bytes": tok.token_bytes(id),
        })
    };
    let mut e = entry(lp.id, lp.logprob);
    e["top_logprobs"] = lp.top.iter().map(|&(id, l)| entry(id, l)).collect();
    e
}

pub(super) async fn chat(State(s): State<AppState>, headers: HeaderMap, body: Body) -> Response {
    let s2 = s.clone();
    logged(s, "chat", "chatcmpl", async move |log| {
        let req: ChatRequest = read_json(&s2, &headers, body).await?;
        let info = ready(&s2)?;
        check_model(&info, req.model.as_deref())?;
        if req.messages.is_empty() {
            return Err(ApiError::invalid(
                Some("messages"),
                "messages must contain at least one message",
            ));
        }
        let mut checked = req.sampling.check(info.vocab)?;
        let top_logprobs = req.top_logprobs.unwrap_or(0);
        if top_logprobs > 20 {
            return Err(ApiError::invalid(
                Some("top_logprobs"),
                format!("top_logprobs must be between 0 and 20, got {top_logprobs}"),
            ));
        }
        let want_logprobs = req.logprobs.unwrap_or(false);
        if req.top_logprobs.is_some() && !want_logprobs {
            return Err(ApiError::invalid(
                Some("top_logprobs"),
                "top_logprobs needs logprobs: true",
            ));
        }
        let max_tokens = req.max_completion_tokens.or(req.max_tokens);
        if max_tokens == Some(0) {
            return Err(ApiError::invalid(
                Some("max_tokens"),
                "max_tokens must be at least 1",
            ));
        }
        let template = info.tokenizer.chat_template().ok_or_else(|| {
            ApiError::invalid(
                Some("messages"),
                "this model has no chat template (tokenizer.chat_template): use /v1/completions, or start toy serve with --chat-template-file",
            )
        })?;
        let tools = tools::check(
            req.tools.as_ref(),
            req.tool_choice.as_ref(),
            req.parallel_tool_calls.unwrap_or(false),
            template,
        )?;
        if let Some(grammar) = tools.as_ref().and_then(|t| t.grammar()) {
            if checked.grammar.is_some() {
                return Err(ApiError::invalid(
                    Some("tool_choice"),
                    "a forced tool call (tool_choice required or named) cannot be combined with response_format, json_schema or grammar",
                ));
            }
            checked.grammar = Some(Requested {
                grammar,
                param: "tool_choice",
            });
        }
        let mut messages = Vec::with_capacity(req.messages.len());
        for (i, m) in req.messages.iter().enumerate() {
            let role = if m.role == "developer" { "system" } else { m.role.as_str() };
            messages.push(tools::template_message(role, m.text(i)?, m));
        }
        let prompt_text = chat::render_json(
            template,
            &Value::Array(messages),
            tools.as_ref().map(|t| &t.tools),
            true,
            info.tokenizer.bos_text().unwrap_or_default(),
            info.tokenizer.eos_text().unwrap_or_default(),
        )
        .map_err(|e| ApiError::invalid(Some("messages"), e.to_string()))?;
        // As `toy infer --chat` and llama.cpp tokenize a rendered chat.
        let prompt = encode(&info, prompt_text, true, true).await?;
        let max_new = fit_context(&info, prompt.len(), max_tokens, "messages")?;
        let constraint = constraint(&info, &checked).await?;
        let jobs = gen_jobs(
            std::slice::from_ref(&prompt),
            &checked,
            max_new,
            want_logprobs.then_some(top_logprobs as usize),
            false,
            constraint.as_ref(),
        );
        let (mut rx, admission) = submit(&s2, jobs)?;
        let l = log.as_mut().expect("log");
        l.prompt_tokens = prompt.len();
        l.stream = checked.stream;
        let meta = Meta {
            id: l.id.clone(),
            created: unix_now(),
            model: info.id.clone(),
            fingerprint: fingerprint(&s2),
        };
        if checked.stream {
            let stream = ChatStream {
                meta,
                info: info.clone(),
                shared: s2.clone(),
                rx,
                n: checked.n,
                done: 0,
                prompt_tokens: prompt.len(),
                completion_tokens: 0,
                cached_tokens: 0,
                include_usage: checked.include_usage,
                logprobs: want_logprobs,
                calls: tools.as_ref().map(|t| {
                    (0..checked.n)
                        .map(|_| (CallSplitter::new(t.syntax), 0))
                        .collect()
                }),
                out: VecDeque::new(),
                opened: false,
                finished: false,
                log: log.take(),
                _admission: admission,
            };
            return Ok(sse(stream));
        }
        let choices = collect(&s2, &mut rx, checked.n).await?;
        drop(admission);
        let mut completion_tokens = 0;
        let mut cached_tokens = 0;
        let choices: Vec<Value> = choices
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                let f = c.finish.expect("collected");
                completion_tokens += f.completion_tokens;
                // The choices share one prompt: report the best reuse among them.
                cached_tokens = cached_tokens.max(f.cached_tokens);
                note_finish(l, &f);
                let logprobs = if want_logprobs {
                    json!({
                        "content": c.logprobs.iter().map(|lp| chat_logprob_entry(&info.tokenizer, lp)).collect::<Vec<_>>(),
                        "refusal": null,
                    })
                } else {
                    Value::Null
                };
                let mut message = json!({"role": "assistant", "content": c.text, "refusal": null});
                let mut finish = f.reason.as_str();
                if let Some(t) = &tools {
                    let (content, calls) = tools::parse(&c.text, t.syntax);
                    message["content"] = json!(content);
                    if !calls.is_empty() {
                        message["tool_calls"] = calls
                            .iter()
                            .map(|call| call.to_json(&new_id("call"), None))
                            .collect();
                    }
                    finish = tools::finish_reason(finish, !calls.is_empty());
                }
                json!({
                    "index": i,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                })
            })
            .collect();
        Ok(axum::Json(json!({
            "id": meta.id,
            "object": "chat.completion",
            "created": meta.created,
            "model": meta.model,
            "system_fingerprint": meta.fingerprint,
            "choices": choices,
            "usage": usage(prompt.len(), completion_tokens, cached_tokens),
        }))
        .into_response())
    })
    .await
}

struct ChatStream {
    meta: Meta,
    info: Arc<ModelInfo>,
    shared: AppState,
    rx: mpsc::UnboundedReceiver<(usize, GenEvent)>,
    n: usize,
    done: usize,
    prompt_tokens: usize,
    completion_tokens: usize,
    cached_tokens: usize,
    include_usage: bool,
    logprobs: bool,
    /// With tools: each choice's splitter of content from calls, and its calls so far.
    calls: Option<Vec<(CallSplitter, usize)>>,
    out: VecDeque<String>,
    opened: bool,
    finished: bool,
    log: Option<RequestLog>,
    _admission: Admission,
}

impl ChatStream {
    fn chunk(&self, choices: Value) -> String {
        let mut c = json!({
            "id": self.meta.id,
            "object": "chat.completion.chunk",
            "created": self.meta.created,
            "model": self.meta.model,
            "system_fingerprint": self.meta.fingerprint,
            "choices": choices,
        });
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        c.to_string()
    }

    fn delta(&self, index: usize, delta: Value, logprobs: Value, finish: Option<&str>) -> String {
        self.chunk(json!([{
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish,
        }]))
    }
}

impl SseSource for ChatStream {
    async fn next_data(&mut self) -> Option<String> {
        if !self.opened {
            // Open every choice with the assistant role, as OpenAI does.
            self.opened = true;
            for i in 0..self.n {
                let d = self.delta(
                    i,
                    json!({"role": "assistant", "content": ""}),
                    Value::Null,
                    None,
                );
                self.out.push_back(d);
            }
        }
        if self.out.is_empty() && !self.finished {
            self.fill().await;
        }
        self.out.pop_front()
    }
}

impl ChatStream {
    async fn fill(&mut self) {
        while self.out.is_empty() && !self.finished {
            let Some((i, event)) = self.rx.recv().await else {
                let e = engine_error(&self.shared, "the engine stopped".into());
                self.fail(e);
                return;
            };
            match event {
                GenEvent::PromptLogprobs(_) => {}
                GenEvent::Token { text, logprob, .. } => {
                    let lp = match (&logprob, self.logprobs) {
                        (Some(lp), true) => json!({
                            "content": [chat_logprob_entry(&self.info.tokenizer, lp)],
                            "refusal": null,
                        }),
                        _ => Value::Null,
                    };
                    self.text(i, text, lp, false);
                }
                GenEvent::Done(f) => {
                    self.text(i, f.tail.clone(), Value::Null, true);
                    let called = self.calls.as_ref().is_some_and(|c| c[i].1 > 0);
                    let reason = tools::finish_reason(f.reason.as_str(), called);
                    let d = self.delta(i, json!({}), Value::Null, Some(reason));
                    self.out.push_back(d);
                    self.completion_tokens += f.completion_tokens;
                    self.cached_tokens = self.cached_tokens.max(f.cached_tokens);
                    if let Some(log) = &mut self.log {
                        note_finish(log, &f);
                    }
                    self.done += 1;
                    if self.done == self.n {
                        if self.include_usage {
                            let mut c: Value =
                                serde_json::from_str(&self.chunk(json!([]))).unwrap_or_default();
                            c["usage"] = usage(
                                self.prompt_tokens,
                                self.completion_tokens,
                                self.cached_tokens,
                            );
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

    /// Choice `i`'s next text as content deltas — or, with tools, as content and `tool_calls`
    /// deltas (a call's id and name, then its arguments) once each call is whole. `last`: the
    /// choice is done, so held-back text goes out.
    fn text(&mut self, i: usize, text: String, lp: Value, last: bool) {
        let Some(calls) = &mut self.calls else {
            if !text.is_empty() || !lp.is_null() {
                let d = self.delta(i, json!({"content": text}), lp, None);
                self.out.push_back(d);
            }
            return;
        };
        let mut pieces = calls[i].0.push(&text);
        if last {
            pieces.extend(calls[i].0.finish());
        }
        let mut lp = Some(lp).filter(|l| !l.is_null());
        for piece in pieces {
            match piece {
                Piece::Text(t) if t.is_empty() => {}
                Piece::Text(t) => {
                    let l = lp.take().unwrap_or(Value::Null);
                    let d = self.delta(i, json!({"content": t}), l, None);
                    self.out.push_back(d);
                }
                Piece::Call(call) => {
                    let calls = self.calls.as_mut().expect("calls come from the splitter");
                    let index = calls[i].1;
                    calls[i].1 += 1;
                    let mut head = call.to_json(&new_id("call"), Some(index));
                    head["function"]["arguments"] = json!("");
                    let d = self.delta(i, json!({"tool_calls": [head]}), Value::Null, None);
                    self.out.push_back(d);
                    let args = json!({"index": index, "function": {"arguments": call.arguments}});
                    let d = self.delta(i, json!({"tool_calls": [args]}), Value::Null, None);
                    self.out.push_back(d);
                }
            }
        }
        // A token whose text is held back still reports its logprob.
        if let Some(l) = lp {
            let d = self.delta(i, json!({"content": ""}), l, None);
            self.out.push_back(d);
        }
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
}
