//! `toy serve`: the OpenAI-compatible HTTP server (the work is in the toy-serve crate).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Result;
use clap::Args;
use toy_kernels::ToyBackend;
use toy_serve::ServeOptions;

use crate::backend::{BackendJob, BackendKind, Compute, dispatch};

/// `toy serve` options (the command's description is on `Command::Serve` in main.rs).
#[derive(Args, Debug, Clone)]
#[command(after_help = "\
Endpoints: POST /v1/chat/completions, /v1/completions, /v1/embeddings; GET /v1/models, /health,
/metrics; POST /tokenize, /detokenize; a chat page at /. Point any OpenAI client at
http://HOST:PORT/v1 (docs/server.md).

Examples:
  toy serve model.gguf                       http://127.0.0.1:8080/ (chat page at /)
  toy serve model.gguf --port 0              a free port; the URL is printed when ready
  toy serve model.gguf --host 0.0.0.0 --api-key secret --parallel 16
  curl http://127.0.0.1:8080/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"stream\":true}'")]
pub struct ServeArgs {
    /// The model: a GGUF file, or a name `toy list` prints.
    pub model: PathBuf,
    /// Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface).
    #[arg(long, default_value = ServeOptions::DEFAULT_HOST)]
    pub host: String,
    /// Port to listen on (0: any free port; the URL printed at start says which).
    #[arg(long, default_value_t = ServeOptions::DEFAULT_PORT)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on the API (not on / and /health).
    #[arg(long, env = "TOY_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Sequences generated at once (llama-server's -np). Each step is one forward pass over all
    /// of them (continuous batching): a decode token of each, plus prompt chunks of new ones.
    #[arg(long, visible_alias = "max-concurrency", default_value_t = ServeOptions::DEFAULT_PARALLEL)]
    pub parallel: usize,
    /// Most tokens in one forward pass (decode tokens count one each; long prompts are read in
    /// chunks that fit what is left).
    #[arg(long, default_value_t = ServeOptions::DEFAULT_BATCH_TOKENS)]
    pub batch_tokens: usize,
    /// MiB of keys and values kept from finished requests (the prefix cache, as llama-server's
    /// --cache-ram): a request whose prompt starts like an earlier one (a shared system prompt,
    /// the earlier turns of a chat) skips those tokens. Least recently used go first; 0: off.
    #[arg(long, value_name = "MIB", default_value_t = ServeOptions::DEFAULT_CACHE_RAM_MIB)]
    pub cache_ram: usize,
    /// Requests that may wait for a free slot; beyond that new ones get 429 with Retry-After.
    #[arg(long, default_value_t = ServeOptions::DEFAULT_MAX_QUEUE)]
    pub max_queue: usize,
    /// Context per request in tokens (prompt + completion; default and maximum: the model's).
    #[arg(long, conflicts_with = "ctx_size")]
    pub ctx: Option<usize>,
    /// Context of all the sequences together, as llama-server's -c: each of the --parallel
    /// sequences gets an equal share (-c 16384 with --parallel 32: 512 tokens per request).
    #[arg(short = 'c', long, value_name = "TOKENS")]
    pub ctx_size: Option<usize>,
    /// The model name clients use (default: the file name without .gguf).
    #[arg(long)]
    pub model_id: Option<String>,
    /// Largest request body in bytes; larger ones get 413.
    #[arg(long, default_value_t = ServeOptions::DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
    /// Seconds a client has to send a request's headers, and then its body: a slower one is
    /// disconnected (headers) or answered 408 (body), so trickling clients cannot hold
    /// connections (slow-loris). Also how long an idle keep-alive connection stays open.
    #[arg(long, default_value_t = ServeOptions::DEFAULT_READ_TIMEOUT_S, value_name = "SECONDS")]
    pub read_timeout: f64,
    /// Let web pages from ORIGIN call the API from a browser (repeat for several; `*` for any).
    /// Off by default: browsers then refuse other sites' scripts the server's answers.
    #[arg(long = "cors", value_name = "ORIGIN")]
    pub cors: Vec<String>,
    /// Log every request as a toy/v1 event in `<runs-dir>/<id>/events.jsonl`.
    #[arg(long)]
    pub events: bool,
    /// Where --events creates its run directory.
    #[arg(long, default_value = "runs")]
    pub runs_dir: PathBuf,
    /// A Jinja chat template to use instead of the model's `tokenizer.chat_template` (for a
    /// model that has none, or to fix one), as llama-server's --chat-template-file.
    #[arg(long, value_name = "FILE")]
    pub chat_template_file: Option<PathBuf>,
    /// Seconds in-flight requests get to finish after SIGINT/SIGTERM before they are failed.
    #[arg(long, default_value_t = ServeOptions::DEFAULT_SHUTDOWN_GRACE_S)]
    pub shutdown_grace: f64,
}

struct ServeJob(ServeArgs, BackendKind);

impl BackendJob for ServeJob {
    type Output = ();

    fn run<B: ToyBackend>(self, device: B::Device) -> Result<()> {
        let (a, backend) = (self.0, self.1);
        let chat_template = crate::infer::read_chat_template(a.chat_template_file.as_deref())?;
        // A context shared by the sequences: each gets its share (llama.cpp's n_ctx / n_seq).
        let ctx = match a.ctx_size {
            Some(total) => {
                let share = total / a.parallel.max(1);
                if share < 2 {
                    anyhow::bail!(
                        "--ctx-size {total} leaves {share} tokens to each of --parallel {} sequences: give at least {} tokens",
                        a.parallel,
                        2 * a.parallel.max(1)
                    );
                }
                Some(share)
            }
            None => a.ctx,
        };
        let options = ServeOptions {
            model: a.model,
            model_id: a.model_id,
            host: a.host,
            port: a.port,
            api_key: a.api_key.filter(|k| !k.is_empty()),
            max_concurrency: a.parallel,
            batch_tokens: a.batch_tokens,
            max_queue: a.max_queue,
            ctx,
            max_body_bytes: a.max_body_bytes,
            cors_origins: a.cors,
            read_timeout: Duration::from_secs_f64(a.read_timeout.clamp(0.1, 86400.0)),
            events_dir: a.events.then_some(a.runs_dir),
            shutdown_grace: Duration::from_secs_f64(a.shutdown_grace.clamp(0.0, 3600.0)),
            backend: backend.name().to_string(),
            chat_template,
            cache_ram_mib: a.cache_ram,
        };
        toy_serve::serve::<B>(options, device)?;
        Ok(())
    }
}

pub fn run(compute: Compute, mut args: ServeArgs) -> Result<()> {
    args.model = crate::models::resolve_model(&args.model)?;
    dispatch(compute, ServeJob(args, compute.backend))
}
