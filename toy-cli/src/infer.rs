//! `toy infer`: generate text from a prompt.

use std::io::Write;
use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use toy_core::chat::{self, ChatMessage};
use toy_core::config::ModelConfig;
use toy_core::gguf::GgufFile;
use toy_core::sampling::{Sampler, SamplingParams, StopStrings};
use toy_core::tokenizer::{StreamDecoder, Tokenizer};
use toy_kernels::ToyBackend;
use toy_models::Model;
use toy_models::generate::{GenerateOptions, generate};

use crate::backend::{BackendJob, Compute, dispatch};

#[derive(Args, Debug, Clone)]
pub struct InferArgs {
    /// The model: a GGUF file, or a name `toy list` prints.
    pub model: PathBuf,
    /// The prompt (special tokens such as <|im_start|> are recognized).
    #[arg(short, long)]
    pub prompt: String,
    /// Most tokens to generate.
    #[arg(short = 'n', long = "n-predict", default_value_t = 64)]
    pub n_predict: usize,
    /// A Jinja chat template for --chat instead of the model's `tokenizer.chat_template`.
    #[arg(long, value_name = "FILE", requires = "chat")]
    pub chat_template_file: Option<PathBuf>,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    pub chat: bool,
    /// System message for --chat (default: the template's own).
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
    /// Sampling temperature; 0 = greedy (always the most likely token).
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f32,
    /// Keep only the K most likely tokens (0 = all).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability adds up to P (1.0 = all).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Drop tokens less likely than M × the most likely one (0 = off).
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Penalize tokens seen in the last 64 tokens (1.0 = off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Random seed (default: from the clock; printed so the run can be repeated).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when this text appears (repeatable).
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// Keep generating past end-of-generation tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Print one JSON object (prompt_ids, ids, text, speeds) instead of streaming text.
    #[arg(long)]
    pub json: bool,
}

/// Open a GGUF model of any supported architecture (GPT-2 too) and load it onto `device`, with
/// a progress bar on stderr.
pub fn load_any_model<B: ToyBackend>(
    path: &Path,
    device: &B::Device,
) -> Result<(GgufFile, ModelConfig, Model<B>)> {
    with_progress(path, |file, progress| {
        toy_models::load_model::<B>(file, device, progress)
    })
}

/// Open `path` and run `load` on it with a progress bar on stderr.
fn with_progress<M>(
    path: &Path,
    load: impl FnOnce(
        &GgufFile,
        &mut dyn FnMut(usize, usize),
    ) -> Result<(ModelConfig, M), toy_models::LoadError>,
) -> Result<(GgufFile, ModelConfig, M)> {
    let file = GgufFile::open(path)?;
    let bar = ProgressBar::new(0).with_style(
        ProgressStyle::with_template("loading {msg} [{bar:30}] {pos}/{len} tensors")
            .expect("static template"),
    );
    bar.set_message(
        path.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
    );
    let (config, model) = load(&file, &mut |done, total| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    })
    .with_context(|| format!("cannot load {}", path.display()))?;
    bar.finish_and_clear();
    Ok((file, config, model))
}

/// The text of `--chat-template-file`, checked to render a one-message chat (so a broken
/// template is refused at start, not on every request).
pub fn read_chat_template(path: Option<&Path>) -> Result<Option<String>> {
    let Some(path) = path else { return Ok(None) };
    let template = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the chat template {}", path.display()))?;
    chat::render(&template, &[ChatMessage::new("user", "Hi")], true, "", "")
        .with_context(|| format!("the chat template {} does not render", path.display()))?;
    Ok(Some(template))
}

struct InferJob(InferArgs);

impl BackendJob for InferJob {
    type Output = ();

    fn run<B: ToyBackend>(self, device: B::Device) -> Result<()> {
        let args = self.0;
        let (file, _config, model) = load_any_model::<B>(&args.model, &device)?;
        let mut tokenizer = Tokenizer::from_gguf(&file)?;
        if let Some(template) = read_chat_template(args.chat_template_file.as_deref())? {
            tokenizer.set_chat_template(template);
        }
        let prompt_text = if args.chat {
            let template = tokenizer.chat_template().context(
                "this model has no chat template (tokenizer.chat_template); run without --chat, or give one with --chat-template-file",
            )?;
            let mut messages = Vec::new();
            if let Some(system) = &args.system {
                messages.push(ChatMessage {
                    role: "system".into(),
                    content: system.clone(),
                });
            }
            messages.push(ChatMessage {
                role: "user".into(),
                content: args.prompt.clone(),
            });
            chat::render(
                template,
                &messages,
                true,
                tokenizer.bos_text().unwrap_or_default(),
                tokenizer.eos_text().unwrap_or_default(),
            )?
        } else {
            args.prompt.clone()
        };
        let prompt_ids = tokenizer.encode(&prompt_text, true, true)?;

        let seed = args.seed.unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
        let params = SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k as i32,
            top_p: args.top_p,
            min_p: args.min_p,
            repeat_penalty: args.repeat_penalty,
            seed,
            ..SamplingParams::default()
        };
        let mut sampler = Sampler::new(params);
        let options = GenerateOptions {
            max_new_tokens: args.n_predict,
            stop_at_eog: !args.ignore_eos,
        };

        let mut decoder = StreamDecoder::new(&tokenizer);
        let mut stops = StopStrings::new(args.stop.clone());
        let mut stdout = std::io::stdout().lock();
        let mut text = String::new();
        let stream = !args.json;
        let (ids, stats) = generate(
            &model,
            &prompt_ids,
            &options,
            &mut sampler,
            |id| tokenizer.is_eog(id),
            |id| {
                let piece = decoder.push(id);
                let (emit, stop) = stops.push(&piece);
                text.push_str(&emit);
                if stream {
                    // A closed stdout (e.g. `| head`) just ends the stream.
                    let _ = stdout
                        .write_all(emit.as_bytes())
                        .and_then(|_| stdout.flush());
                }
                if stop {
                    ControlFlow::Break(())
                } else {
                    ControlFlow::Continue(())
                }
            },
        )?;
        let tail = stops.finish(&decoder.finish());
        text.push_str(&tail);

        if args.json {
            let out = serde_json::json!({
                "prompt_ids": prompt_ids,
                "ids": ids,
                "text": text,
                "prompt_tokens_per_s": stats.prompt_tokens_per_s(),
                "gen_tokens_per_s": stats.gen_tokens_per_s(),
                "finish_reason": stats.finish_reason,
                "seed": seed,
            });
            writeln!(stdout, "{out}")?;
        } else {
            let _ = writeln!(stdout, "{tail}");
            eprintln!(
                "\nprompt: {} tokens, {:.1} tok/s | generation: {} tokens, {:.1} tok/s | seed {seed}",
                stats.prompt_tokens,
                stats.prompt_tokens_per_s(),
                stats.generated_tokens,
                stats.gen_tokens_per_s(),
            );
        }
        Ok(())
    }
}

pub fn run(compute: Compute, mut args: InferArgs) -> Result<()> {
    args.model = crate::models::resolve_model(&args.model)?;
    dispatch(compute, InferJob(args))
}
