//! `toy`: train, run, evaluate and serve transformer language models from GGUF files.
//!
//! This binary only parses arguments, picks the backend and draws progress; the work lives in
//! the library crates.

mod backend;
mod bench;
mod convert;
mod describe;
mod eval;
mod fetch;
mod infer;
mod list;
mod merge;
mod models;
mod new;
mod runs;
mod serve;
mod tokenize;
mod train;
mod vision;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::backend::{BackendKind, Compute, FloatKind};

/// Run transformer language models from GGUF files — token-exact with llama.cpp — on the CPU or
/// any GPU (Vulkan/Metal/DX12 through wgpu, NVIDIA through CUDA).
///
/// Examples:
///   toy infer model.gguf -p "The capital of France is" -n 32
///   toy list                       (the GGUF models on this machine, and their names)
///   toy fetch bartowski/SmolLM2-135M-Instruct-GGUF   (from the Hugging Face hub)
///   toy infer qwen2.5:0.5b -p "Hi" (a name from `toy list`: Ollama, Hugging Face, LM Studio)
///   toy infer model.gguf --chat -p "Write a haiku about Rust"
///   toy --backend wgpu infer model.gguf -p "Once upon a time"
///   toy --backend cuda --dtype f16 infer model.gguf -p "Once upon a time"
///   toy tokenize model.gguf "Hello world"
///   toy describe model.gguf
///   toy convert model.Q4_1.gguf model.Q8_0.gguf --to q8_0
///   toy train                      (a tiny model on the bundled stories, ~1 minute)
///   toy train --arch vit-tiny      (an image classifier on the bundled digits)
///   toy eval model.gguf --data text.txt
///   toy classify vit.gguf digit.png
///   toy serve model.gguf           (OpenAI-compatible HTTP API and a chat page)
///   toy new my-app                 (a Cargo project that uses toy's crates)
#[derive(Parser, Debug)]
#[command(name = "toy", version, about, long_about = None, verbatim_doc_comment)]
struct Cli {
    /// Compute backend: `cpu` (burn Flex, native kernels), `ndarray` (burn NdArray, reference
    /// kernels), `wgpu` (any GPU through Vulkan/Metal/DX12; lavapipe without one), `metal`
    /// (wgpu on Metal, macOS), `cuda` (NVIDIA). `TOY_WGPU_DEVICE` picks the wgpu adapter.
    #[arg(
        long,
        global = true,
        env = "TOY_BACKEND",
        default_value = "cpu",
        value_enum
    )]
    backend: BackendKind,

    /// Float type of weights and activations on the GPU backends: `f32`, or `f16` (half the
    /// memory and bandwidth; quantized weights stay packed, kernels accumulate in f32).
    /// Inference, eval, bench and serve only: training and the CPU backends use f32.
    #[arg(
        long,
        global = true,
        env = "TOY_DTYPE",
        default_value = "f32",
        value_enum
    )]
    dtype: FloatKind,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate text from a prompt, streaming tokens as they come.
    Infer(infer::InferArgs),
    /// Print the token ids of a text, as llama-tokenize does.
    Tokenize(tokenize::TokenizeArgs),
    /// List the GGUF models on this machine (Hugging Face, Ollama and LM Studio downloads,
    /// $TOY_MODEL_DIR, ./): the name to give the other commands, and whether toy runs each.
    List(list::ListArgs),
    /// Download a GGUF file from the Hugging Face hub into its cache (resumable, SHA-256
    /// checked), where `toy list` and the other tools find it.
    Fetch(fetch::FetchArgs),
    /// Print a model's architecture card: shape, RoPE, vocabulary, tensor types and sizes.
    Describe(describe::DescribeArgs),
    /// Rewrite a model with its weights in another type (metadata and tokenizer kept).
    Convert(convert::ConvertArgs),
    /// Measure prompt processing and generation speed (tokens/s).
    Bench(bench::BenchArgs),
    /// Train a model from scratch (default: the tiny preset on the bundled corpus, ~1 minute).
    // Boxed: its many flags would make every other variant as large.
    Train(Box<train::TrainArgs>),
    /// Mean cross-entropy and perplexity of a model on a text file; top-1/top-5 accuracy and a
    /// confusion matrix of an image classifier on a folder of class folders.
    Eval(eval::EvalArgs),
    /// Classify images with a ViT (`toy train --arch vit-tiny`, or timm weights): the most
    /// likely classes with their probabilities.
    Classify(vision::ClassifyArgs),
    /// Fold a LoRA adapter (GGUF or PEFT) into its base model, writing a standard GGUF.
    Merge(merge::MergeArgs),
    /// List training runs with their losses (`toy runs plot RUN…` draws their loss curves).
    Runs(runs::RunsArgs),
    /// Serve a model over HTTP with OpenAI's API (chat, completions, embeddings) and a chat page.
    Serve(serve::ServeArgs),
    /// Start a Cargo project that uses toy's crates: an app that trains a tiny model and samples
    /// from it (or generates from a GGUF), or with `--lib` a library with a test.
    New(new::NewArgs),
}

/// Keep freed memory in the process instead of handing it back to the kernel at once.
///
/// Every op of a forward pass allocates its output, and glibc serves blocks of a few hundred KB
/// and more with `mmap`, returning them on `free`: the next pass then takes a page fault for
/// every 4 KiB it writes (SmolLM2 Q4_0 pp128: 160k faults and a third of the CPU time, 36% less
/// with this). Blocks up to 32 MiB (glibc's largest mmap threshold) now come from the heap, and
/// up to 1 GiB of freed heap stays mapped for reuse, as llama.cpp keeps its compute buffers.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only changes the allocator's thresholds; called before any thread starts.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

fn main() -> ExitCode {
    keep_freed_memory();
    let cli = Cli::parse();
    // Chat templates come from model files: they render in a child process with a memory
    // limit, forked from this one while it is still small (before a model loads).
    #[cfg(target_os = "linux")]
    if matches!(cli.command, Command::Infer(_) | Command::Serve(_))
        && let Err(e) = toy_core::chat::sandbox::start()
    {
        eprintln!("warning: no template sandbox process ({e}); templates will fork per render");
    }
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::from_env("TOY_LOG"))
        .init();
    let compute = Compute {
        backend: cli.backend,
        dtype: cli.dtype,
    };
    let result = match cli.command {
        Command::Infer(args) => infer::run(compute, args),
        Command::Tokenize(args) => tokenize::run(args),
        Command::Describe(args) => describe::run(args),
        Command::List(args) => list::run(args),
        Command::Fetch(args) => fetch::run(args),
        Command::Convert(args) => convert::run(args),
        Command::Bench(args) => bench::run(compute, args),
        Command::Train(args) => train::run(compute, *args),
        Command::Eval(args) => eval::run(compute, args),
        Command::Classify(args) => vision::classify(compute, args),
        Command::Merge(args) => merge::run(args),
        Command::Runs(args) => runs::run(args),
        Command::Serve(args) => serve::run(compute, args),
        Command::New(args) => new::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            // One line: the error and those of its causes that it does not already spell out.
            let mut line = String::new();
            for cause in err.chain().map(|c| c.to_string()) {
                if !line.contains(&cause) {
                    if !line.is_empty() {
                        line.push_str(": ");
                    }
                    line.push_str(&cause);
                }
            }
            eprintln!("error: {}", line.replace('\n', " "));
            ExitCode::FAILURE
        }
    }
}
