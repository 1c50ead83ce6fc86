//! `toy eval`: mean cross-entropy and perplexity of a model on a text file (an image classifier
//! on a folder of images: `crate::vision`).

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use toy_core::config::ModelConfig;
use toy_core::gguf::GgufFile;
use toy_core::tokenizer::Tokenizer;
use toy_kernels::ToyBackend;
use toy_train::eval::{EvalOptions, Scoring, perplexity};
use toy_train::lmc::Interpolation;

use crate::backend::{BackendJob, Compute, dispatch};
use crate::infer::load_any_model;
use crate::models::resolve_model;
use toy_models::CausalLm;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Method {
    /// Non-overlapping windows; every token after the first of each window is scored.
    All,
    /// llama.cpp's `llama-perplexity`: full windows only, each starting with BOS, only the
    /// second half of each window scored.
    Llama,
}

#[derive(Args, Debug, Clone)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct EvalArgs {
    #[command(subcommand)]
    pub command: Option<EvalCommand>,
    /// The model: a GGUF file, or a name `toy list` prints.
    #[arg(required = true)]
    pub model: Option<PathBuf>,
    /// The text to evaluate on (UTF-8); for an image classifier, a folder with one sub-folder
    /// of images per class.
    #[arg(long, required = true)]
    pub data: Option<PathBuf>,
    #[command(flatten)]
    pub window: WindowArgs,
    /// Also print every scored token's log-probability with the K most likely alternatives.
    #[arg(long, value_name = "K", num_args = 0..=1, default_missing_value = "5")]
    pub logprobs: Option<usize>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand, Debug, Clone)]
pub enum EvalCommand {
    /// Linear mode connectivity: evaluate the models (1 − α)·A + α·B along the line between two
    /// checkpoints of the same architecture.
    Lmc(LmcArgs),
}

#[derive(Args, Debug, Clone)]
pub struct LmcArgs {
    /// The model at α = 0.
    pub a: PathBuf,
    /// The model at α = 1.
    pub b: PathBuf,
    /// The text to evaluate on (UTF-8).
    #[arg(long)]
    pub data: PathBuf,
    /// Interpolation points.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0,0.1,0.2,0.3,0.4,0.5,0.6,0.7,0.8,0.9,1"
    )]
    pub alphas: Vec<f32>,
    #[command(flatten)]
    pub window: WindowArgs,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// How the text is cut into windows and which positions are scored.
#[derive(Args, Debug, Clone)]
pub struct WindowArgs {
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
}

impl WindowArgs {
    /// The text's tokens and the evaluation options for a model of `context_length`.
    fn prepare(
        &self,
        tokenizer: &Tokenizer,
        data: &Path,
        context_length: usize,
        logprobs: Option<usize>,
    ) -> Result<(Vec<u32>, EvalOptions)> {
        let text = std::fs::read_to_string(data)
            .with_context(|| format!("cannot read {} as UTF-8 text", data.display()))?;
        let add_bos = !self.no_bos;
        let tokens = tokenizer.encode(&text, add_bos, true)?;
        let bos = match self.method {
            Method::Llama if add_bos && tokenizer.adds_bos() => tokenizer.bos_id(),
            _ => None,
        };
        let options = EvalOptions {
            context: self.context.unwrap_or(512.min(context_length)),
            scoring: match self.method {
                Method::All => Scoring::All,
                Method::Llama => Scoring::SecondHalf,
            },
            bos,
            max_windows: self.chunks,
            logprobs,
        };
        Ok((tokens, options))
    }
}

struct EvalJob(EvalArgs);

impl BackendJob for EvalJob {
    type Output = ();

    fn run<B: ToyBackend>(self, device: B::Device) -> Result<()> {
        let args = self.0;
        let model_path = args
            .model
            .as_deref()
            .context("give the model to evaluate")?;
        let data = args
            .data
            .as_deref()
            .context("give the text to evaluate on with --data")?;
        let (file, _config, model) = load_any_model::<B>(model_path, &device)?;
        let tokenizer = Tokenizer::from_gguf(&file)?;
        let (tokens, options) =
            args.window
                .prepare(&tokenizer, data, model.context_length(), args.logprobs)?;
        let context = options.context;
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
                "model": model_path,
                "data": data,
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

struct LmcJob(LmcArgs);

impl BackendJob for LmcJob {
    type Output = ();

    fn run<B: ToyBackend>(self, device: B::Device) -> Result<()> {
        let args = self.0;
        let open =
            |p: &Path| GgufFile::open(p).with_context(|| format!("cannot open {}", p.display()));
        let (a, b) = (open(&args.a)?, open(&args.b)?);
        let tokenizer = Tokenizer::from_gguf(&a)?;
        let context_length = ModelConfig::from_gguf(&a)?.context_length;
        let (tokens, options) =
            args.window
                .prepare(&tokenizer, &args.data, context_length, None)?;
        let bar = ProgressBar::new(args.alphas.len() as u64).with_style(
            ProgressStyle::with_template("interpolating [{bar:30}] {pos}/{len} {msg}")
                .expect("static template"),
        );
        let line = Interpolation::new(&a, &b)?;
        let mut rows = Vec::new();
        for &alpha in &args.alphas {
            bar.set_message(format!("α = {alpha}"));
            let mixed = line.at(alpha)?;
            let (_, model) = toy_models::load::<B>(&mixed, &device, |_, _| {})?;
            let r = perplexity(&model, &tokens, &options, |_, _| {})?;
            rows.push((alpha, r));
            bar.inc(1);
        }
        bar.finish_and_clear();
        // The barrier: how far the loss along the line rises above the straight line between
        // the endpoints' losses (0 when the two models are linearly connected).
        let (first, last) = (&rows[0], &rows[rows.len() - 1]);
        let barrier = rows
            .iter()
            .map(|(alpha, r)| {
                let t = (alpha - first.0) / (last.0 - first.0).max(f32::EPSILON);
                r.mean_nll - ((1.0 - t as f64) * first.1.mean_nll + t as f64 * last.1.mean_nll)
            })
            .fold(0.0f64, f64::max);
        let mut out = std::io::stdout().lock();
        if args.json {
            let points: Vec<_> = rows
                .iter()
                .map(|(alpha, r)| serde_json::json!({"alpha": alpha, "mean_nll": r.mean_nll, "perplexity": r.perplexity, "top1_accuracy": r.top1_accuracy}))
                .collect();
            let json = serde_json::json!({"a": args.a, "b": args.b, "data": args.data, "context": options.context, "scored": first.1.scored, "points": points, "barrier": barrier});
            writeln!(out, "{json}")?;
        } else {
            writeln!(
                out,
                "{:>6}  {:>10}  {:>11}",
                "alpha", "mean NLL", "perplexity"
            )?;
            for (alpha, r) in &rows {
                writeln!(
                    out,
                    "{alpha:>6.2}  {:>10.5}  {:>11.4}",
                    r.mean_nll, r.perplexity
                )?;
            }
            writeln!(
                out,
                "barrier: {barrier:.5} nats ({} tokens scored per point)",
                first.1.scored
            )?;
        }
        Ok(())
    }
}

pub fn run(compute: Compute, args: EvalArgs) -> Result<()> {
    match args.command.clone() {
        Some(EvalCommand::Lmc(lmc)) => {
            if lmc.alphas.is_empty() {
                anyhow::bail!("give at least one α with --alphas");
            }
            let (a, b) = (resolve_model(&lmc.a)?, resolve_model(&lmc.b)?);
            dispatch(compute, LmcJob(LmcArgs { a, b, ..lmc }))
        }
        None => {
            // A folder of class folders: an image classifier's evaluation.
            if let (Some(model), Some(data)) = (&args.model, &args.data)
                && data.is_dir()
            {
                return crate::vision::eval(compute, model, data, args.json);
            }
            let model = args.model.as_deref().map(resolve_model).transpose()?;
            dispatch(compute, EvalJob(EvalArgs { model, ..args }))
        }
    }
}
