//! Evaluation: mean cross-entropy and perplexity of a model on tokens.
//!
//! Windowing ([`Scoring`]): a text longer than the context is cut into non-overlapping windows
//! of `context` tokens, each evaluated from an empty KV cache.
//! - [`Scoring::All`]: every position of a window after its first is scored (predicting the
//!   next token from everything before it in the window); the last, shorter window is kept if it
//!   has at least two tokens. Every token but the first of each window is scored once.
//! - [`Scoring::SecondHalf`]: llama.cpp's `llama-perplexity` method. Only full windows; the
//!   first token of each window is replaced by BOS when the tokenizer adds one; only the tokens
//!   of the second half are scored (positions `context/2 .. context-1` predict the tokens after
//!   them), so every scored token has at least `context/2` tokens of context.
//!
//! The log-softmax and the NLL sums are computed in f64 on the host; perplexity is
//! `exp(mean NLL)`.

use burn::tensor::{Int, Tensor, TensorData};
use serde::Serialize;
use toy_kernels::ToyBackend;
use toy_models::CausalLm;

use crate::TrainError;
use crate::data::Batch;

/// Which positions of each window are scored (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scoring {
    /// Every position of a window after its first; a shorter last window is kept.
    All,
    /// The second half of every full window only (llama.cpp's `llama-perplexity`).
    SecondHalf,
}

/// How to cut and score a token sequence.
#[derive(Debug, Clone)]
pub struct EvalOptions {
    /// Window length in tokens.
    pub context: usize,
    /// Which positions of each window are scored.
    pub scoring: Scoring,
    /// Put this token first in every window ([`Scoring::SecondHalf`] only; llama.cpp's BOS).
    pub bos: Option<u32>,
    /// Evaluate at most this many windows.
    pub max_windows: Option<usize>,
    /// Also report every scored token's log-probability with this many top alternatives.
    pub logprobs: Option<usize>,
}

/// One scored token: its log-probability and the most likely alternatives at its position.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TokenLogprob {
    /// Index of the token in the evaluated sequence.
    pub pos: usize,
    /// The token's id.
    pub id: u32,
    /// `ln p(token | everything before it in its window)`.
    pub logprob: f64,
    /// The `k` most likely tokens at this position, most likely first (ties: lowest id).
    pub top: Vec<(u32, f64)>,
}

/// The result of an evaluation.
#[derive(Debug, Clone, Serialize)]
pub struct EvalResult {
    /// Mean negative log-likelihood per scored token, in nats.
    pub mean_nll: f64,
    /// `exp(mean_nll)`.
    pub perplexity: f64,
    /// Tokens scored.
    pub scored: usize,
    /// Windows (or held-out batches) evaluated.
    pub windows: usize,
    /// Fraction of scored tokens that were the model's top-1 prediction.
    pub top1_accuracy: f64,
    /// Per-token log-probabilities, when asked for.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<Vec<TokenLogprob>>,
}

impl EvalResult {
    fn from_sums(nll: f64, correct: usize, scored: usize, windows: usize) -> Self {
        let mean_nll = nll / scored.max(1) as f64;
        EvalResult {
            mean_nll,
            perplexity: mean_nll.exp(),
            scored,
            windows,
            top1_accuracy: correct as f64 / scored.max(1) as f64,
            tokens: None,
        }
    }
}

/// Per-position NLL and top-1 hit of `inputs[b, t]` predicting `targets` (`b·t` ids, row-major).
///
/// The log-softmax is taken on the host in f64, as llama.cpp's perplexity tool does, so that an
/// f32 sum over a large vocabulary adds no rounding of its own to the comparison.
fn score<B: ToyBackend>(
    model: &impl CausalLm<B>,
    inputs: Tensor<B, 2, Int>,
    targets: &[u32],
    top_k: usize,
) -> Result<Scores, TrainError> {
    let logits = model.forward(inputs, &mut model.new_cache());
    let vocab = logits.dims()[2];
    let logits = logits
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| TrainError::Backend(format!("{e:?}")))?;
    let mut scores = Scores::default();
    for (row, &target) in logits.chunks_exact(vocab).zip(targets) {
        // Argmax with ties to the lowest id.
        let (best, max) =
            row.iter()
                .enumerate()
                .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
                    if v > bv { (i, v) } else { (bi, bv) }
                });
        let sum: f64 = row.iter().map(|&v| ((v - max) as f64).exp()).sum();
        let logsumexp = max as f64 + sum.ln();
        let target = target as usize;
        if target >= vocab {
            return Err(TrainError::Data(format!(
                "token id {target} is outside the model's vocabulary of {vocab}"
            )));
        }
        scores.nll.push(logsumexp - row[target] as f64);
        scores.hit.push(best == target);
        if top_k > 0 {
            let mut order: Vec<u32> = (0..vocab as u32).collect();
            let k = top_k.min(vocab);
            // Largest logits first, ties to the lowest id; only the first k need ordering.
            let cmp =
                |a: &u32, b: &u32| row[*b as usize].total_cmp(&row[*a as usize]).then(a.cmp(b));
            order.select_nth_unstable_by(k - 1, cmp);
            order.truncate(k);
            order.sort_by(cmp);
            scores.top.push(
                order
                    .iter()
                    .map(|&i| (i, row[i as usize] as f64 - logsumexp))
                    .collect(),
            );
        }
    }
    Ok(scores)
}

/// Per-position results of [`score`].
#[derive(Default)]
struct Scores {
    nll: Vec<f64>,
    hit: Vec<bool>,
    /// Top-k `(id, logprob)` per position, when asked for.
    top: Vec<Vec<(u32, f64)>>,
}

/// Mean NLL over held-out batches (every position scored).
pub fn evaluate_batches<B: ToyBackend>(
    model: &impl CausalLm<B>,
    batches: &[Batch],
) -> Result<EvalResult, TrainError> {
    let device = model.device();
    let (mut nll, mut correct, mut scored) = (0.0, 0, 0);
    for batch in batches {
        let (inputs, _) = batch.tensors::<B>(&device);
        let targets: Vec<u32> = batch
            .tokens
            .chunks_exact(batch.seq_len + 1)
            .flat_map(|w| w[1..].iter().copied())
            .collect();
        let s = score(model, inputs, &targets, 0)?;
        nll += s.nll.iter().sum::<f64>();
        correct += s.hit.iter().filter(|&&x| x).count();
        scored += s.nll.len();
    }
    Ok(EvalResult::from_sums(nll, correct, scored, batches.len()))
}

/// Cross-entropy and perplexity of `tokens` under `model` (see the module docs for windowing).
/// `progress(done, total)` is called after each window.
pub fn perplexity<B: ToyBackend>(
    model: &impl CausalLm<B>,
    tokens: &[u32],
    options: &EvalOptions,
    mut progress: impl FnMut(usize, usize),
) -> Result<EvalResult, TrainError> {
    let n_ctx = options.context;
    if n_ctx < 2 {
        return Err(TrainError::Config(
            "the evaluation context must be at least 2 tokens".into(),
        ));
    }
    if n_ctx > model.context_length() {
        return Err(TrainError::Config(format!(
            "context {n_ctx} is longer than the model's {}; pass a smaller --context",
            model.context_length()
        )));
    }
    let mut windows: Vec<Vec<u32>> = match options.scoring {
        Scoring::All => tokens
            .chunks(n_ctx)
            .filter(|w| w.len() >= 2)
            .map(<[u32]>::to_vec)
            .collect(),
        Scoring::SecondHalf => tokens
            .chunks_exact(n_ctx)
            .map(|w| {
                let mut w = w.to_vec();
                if let Some(bos) = options.bos {
                    w[0] = bos;
                }
                w
            })
            .collect(),
    };
    if let Some(max) = options.max_windows {
        windows.truncate(max);
    }
    if windows.is_empty() {
        let need = match options.scoring {
            Scoring::All => 2,
            Scoring::SecondHalf => n_ctx,
        };
        return Err(TrainError::Data(format!(
            "{} tokens are too few to evaluate: this method needs at least {need} (lower --context)",
            tokens.len()
        )));
    }
    let first = match options.scoring {
        Scoring::All => 0,
        Scoring::SecondHalf => n_ctx / 2,
    };
    let device = model.device();
    let (mut nll, mut correct, mut scored) = (0.0, 0, 0);
    let mut details = Vec::new();
    for (i, w) in windows.iter().enumerate() {
        let ids: Vec<i64> = w.iter().map(|&t| t as i64).collect();
        let n = ids.len();
        let inputs = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [1, n]), &device).narrow(
            1,
            0,
            n - 1,
        );
        let s = score(model, inputs, &w[1..], options.logprobs.unwrap_or(0))?;
        nll += s.nll[first..].iter().sum::<f64>();
        correct += s.hit[first..].iter().filter(|&&x| x).count();
        scored += s.nll.len() - first;
        if options.logprobs.is_some() {
            // Window i starts at token i·n_ctx; its position j predicts token j + 1.
            for j in first..s.nll.len() {
                details.push(TokenLogprob {
                    pos: i * n_ctx + j + 1,
                    id: w[j + 1],
                    logprob: -s.nll[j],
                    top: s.top[j].clone(),
                });
            }
        }
        progress(i + 1, windows.len());
    }
    let mut result = EvalResult::from_sums(nll, correct, scored, windows.len());
    if options.logprobs.is_some() {
        result.tokens = Some(details);
    }
    Ok(result)
}
