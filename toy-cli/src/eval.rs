//! `toy eval`: mean cross-entropy and perplexity of a model on a text file.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use toy_core::tokenizer::Tokenizer;
use toy_kernels::ToyBackend;
use toy_train::eval::{EvalOptions, Scoring, perplexity};

use crate::backend::{BackendJob, BackendKind, dispatch};
use crate::infer::load_model;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Method {
    /// Non-overlapping windows; every token after the first of each window is scored.
    All,
    /// llama.cpp's `llama-perplexity`: full windows only, each starting with BOS, only the
    /// second half of each window scored.
    Llama,
}

#[derive(Args, Debug, Clone)]
pub struct EvalArgs {
    /// The model, a GGUF file.
    pub model: PathBuf,
    /// The text to evaluate on (UTF-8).
    #[arg(long)]
    pub data: PathBuf,
    /// Window length in tokens (default: 512, or the model's context if shorter).
    #[arg(long, short = 'c')]
    pub context: Option<usize>,
    /// Which positions of each window are scored.
    #[arg(long, value_enum, default_value = "all")]
    pub method: Method,
    /// Evaluate only the first N windows.
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Do not add BOS to the text even where the tokenizer asks for it.
    #[arg(long)]
    pub no_bos: bool,
    /// Also print every scored token's log-probability with the K most likely alternatives.
    #[arg(long, value_name = "K", num_args = 0..=1, default_missing_value = "5")]
    pub logprobs: Option<usize>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

struct EvalJob(EvalArgs);

impl BackendJob for EvalJob {
    type Output = ();

    fn run<B: ToyBackend>(self, device: B::Device) -> Result<()> {
        let args = self.0;
        let (file, _config, model) = load_model::<B>(&args.model, &device)?;
        let tokenizer = Tokenizer::from_gguf(&file)?;
        let text = std::fs::read_to_string(&args.data)
            .with_context(|| format!("cannot read {} as UTF-8 text", args.data.display()))?;
        let add_bos = !args.no_bos;
        let tokens = tokenizer.encode(&text, add_bos, true)?;
        let context = args.context.unwrap_or(512.min(model.context_length));
        let bos = match args.method {
            Method::Llama if add_bos && tokenizer.adds_bos() => tokenizer.bos_id(),
            _ => None,
        };
        let options = EvalOptions {
            context,
            scoring: match args.method {
                Method::All => Scoring::All,
                Method::Llama => Scoring::SecondHalf,
            },
            bos,
            max_windows: args.chunks,
            logprobs: args.logprobs,
        };
        let bar = ProgressBar::new(0).with_style(
            ProgressStyle::with_template("evaluating [{bar:30}] {pos}/{len} windows, ETA {eta}")
                .expect("static template"),
        );
        let result = perplexity(&model, &tokens, &options, |done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
        })?;
        bar.finish_and_clear();

        let mut out = std::io::stdout().lock();
        if args.json {
            let json = serde_json::json!({
                "model": args.model,
                "data": args.data,
                "method": options.scoring,
                "context": context,
                "text_tokens": tokens.len(),
                "windows": result.windows,
                "scored": result.scored,
                "mean_nll": result.mean_nll,
                "perplexity": result.perplexity,
                "top1_accuracy": result.top1_accuracy,
            });
            let mut json = json;
            if let Some(tokens) = &result.tokens {
                json["tokens"] = tokens
                    .iter()
                    .map(|t| {
                        let top: Vec<_> = t
                            .top
                            .iter()
                            .map(|&(id, lp)| serde_json::json!({"id": id, "text": piece(&tokenizer, id), "logprob": lp}))
                            .collect();
                        serde_json::json!({"pos": t.pos, "id": t.id, "text": piece(&tokenizer, t.id), "logprob": t.logprob, "top": top})
                    })
                    .collect();
            }
            writeln!(out, "{json}")?;
        } else {
            writeln!(
                out,
                "{} tokens, {} windows of {context}, {} scored ({:?}): mean NLL {:.6} nats, perplexity {:.4}, top-1 {:.1}%",
                tokens.len(),
                result.windows,
                result.scored,
                options.scoring,
                result.mean_nll,
                result.perplexity,
                100.0 * result.top1_accuracy
            )?;
            for t in result.tokens.iter().flatten() {
                let top: Vec<String> = t
                    .top
                    .iter()
                    .map(|&(id, lp)| format!("{:?} {lp:.3}", piece(&tokenizer, id)))
                    .collect();
                writeln!(
                    out,
                    "{:>6} {:<16} {:>9.4}   {}",
                    t.pos,
                    format!("{:?}", piece(&tokenizer, t.id)),
                    t.logprob,
                    top.join(", ")
                )?;
            }
        }
        Ok(())
    }
}

/// A token's text (lossy where the piece is a partial UTF-8 sequence).
fn piece(tokenizer: &Tokenizer, id: u32) -> String {
    String::from_utf8_lossy(tokenizer.token_bytes(id)).into_owned()
}

pub fn run(backend: BackendKind, args: EvalArgs) -> Result<()> {
    dispatch(backend, EvalJob(args))
}
