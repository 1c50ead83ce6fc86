//! Generation jobs for the engine, shared by chat and legacy completions: building one job per
//! prompt × choice, queueing them under admission control, collecting what they produce, and
//! the usage and log entries made of their results.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::api::Checked;
use crate::engine::{Finish, GenEvent, GenParams, Job, TokenLogprob};
use crate::error::ApiError;
use crate::grammar::Constraint;
use crate::state::{Admission, RequestLog, Shared};

/// Queue `jobs` (after taking their places in the admission count).
pub(super) fn submit(
    s: &Arc<Shared>,
    jobs: Vec<GenParams>,
) -> Result<(mpsc::UnboundedReceiver<(usize, GenEvent)>, Admission), ApiError> {
    if jobs.len() > s.capacity {
        return Err(ApiError::invalid(
            Some("n"),
            format!(
                "this request needs {} sequences but the server takes at most {} at once (--max-concurrency + --max-queue)",
                jobs.len(),
                s.capacity
            ),
        ));
    }
    let admission = s
        .try_admit(jobs.len())
        .ok_or_else(|| ApiError::overloaded(s.capacity))?;
    let (tx, rx) = mpsc::unbounded_channel();
    for params in jobs {
        if !s.submit(Job::Generate {
            params,
            tx: tx.clone(),
        }) {
            return Err(ApiError::unavailable("the server is shutting down", 5));
        }
    }
    Ok((rx, admission))
}

pub(super) fn engine_error(s: &Shared, message: String) -> ApiError {
    if s.shutting_down.load(Ordering::SeqCst) {
        ApiError::unavailable(message, 5)
    } else {
        ApiError::internal(message)
    }
}

/// Everything one choice produced.
#[derive(Default)]
pub(super) struct ChoiceOut {
    pub(super) text: String,
    pub(super) ids: Vec<u32>,
    pub(super) logprobs: Vec<TokenLogprob>,
    pub(super) prompt_logprobs: Vec<Option<TokenLogprob>>,
    pub(super) finish: Option<Finish>,
}

/// Wait for every choice to finish.
pub(super) async fn collect(
    s: &Shared,
    rx: &mut mpsc::UnboundedReceiver<(usize, GenEvent)>,
    n: usize,
) -> Result<Vec<ChoiceOut>, ApiError> {
    let mut out: Vec<ChoiceOut> = (0..n).map(|_| ChoiceOut::default()).collect();
    let mut done = 0;
    while done < n {
        let Some((i, event)) = rx.recv().await else {
            return Err(engine_error(s, "the engine stopped".into()));
        };
        let c = &mut out[i];
        match event {
            GenEvent::PromptLogprobs(lps) => c.prompt_logprobs = lps,
            GenEvent::Token { id, text, logprob } => {
                c.ids.push(id);
                c.text.push_str(&text);
                c.logprobs.extend(logprob);
            }
            GenEvent::Done(f) => {
                c.text.push_str(&f.tail);
                c.finish = Some(f);
                done += 1;
            }
            GenEvent::Error(e) => return Err(engine_error(s, e)),
        }
    }
    Ok(out)
}

pub(super) fn note_finish(log: &mut RequestLog, f: &Finish) {
    log.completion_tokens += f.completion_tokens;
    log.finish_reason = Some(f.reason.as_str());
    log.queue_s = Some(log.queue_s.unwrap_or(0.0).max(f.queue_s));
    if let Some(t) = f.ttft_s {
        log.ttft_s = Some(log.ttft_s.map_or(t, |x: f64| x.min(t)));
    }
}

/// OpenAI's `usage`; `cached`: prompt tokens whose keys and values came from the prefix cache.
pub(super) fn usage(prompt: usize, completion: usize, cached: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// One engine job per prompt × `n` (index = prompt × n + choice), seeds seed, seed+1, ….
pub(super) fn gen_jobs(
    prompts: &[Vec<u32>],
    checked: &Checked,
    max_tokens: usize,
    logprobs: Option<usize>,
    prompt_logprobs: bool,
    constraint: Option<&Constraint>,
) -> Vec<GenParams> {
    let mut jobs = Vec::new();
    for prompt in prompts {
        for j in 0..checked.n {
            let mut sampling = checked.params.clone();
            sampling.seed = sampling.seed.wrapping_add(j as u64);
            jobs.push(GenParams {
                index: jobs.len(),
                prompt: prompt.clone(),
                max_tokens,
                sampling,
                logit_bias: checked.logit_bias.clone(),
                stop: checked.stop.clone(),
                logprobs,
                prompt_logprobs,
                ignore_eos: checked.ignore_eos,
                cache_prompt: checked.cache_prompt,
                constraint: constraint.cloned(),
            });
        }
    }
    jobs
}
