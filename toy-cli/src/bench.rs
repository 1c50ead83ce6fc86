//! `toy bench`: prompt processing (ppN) and generation (tgN) speed, llama-bench style, optionally
//! side by side with llama.cpp's own `llama-bench` on the same file in the same run.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use burn::tensor::{Int, Tensor, TensorData};
use clap::Args;
use toy_kernels::ToyBackend;

use crate::backend::{BackendJob, Compute, dispatch};
use crate::infer::load_any_model;
use toy_models::CausalLm;

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// The model: a GGUF file, or a name `toy list` prints.
    pub model: PathBuf,
    /// Prompt lengths to measure (prompt processing, one forward each).
    #[arg(short = 'p', long, value_delimiter = ',', default_value = "128")]
    pub prompt: Vec<usize>,
    /// Tokens to generate one at a time (text generation).
    #[arg(short = 'n', long, default_value_t = 64)]
    pub n_gen: usize,
    /// Repetitions of each test after one warm-up (the median is reported).
    #[arg(short = 'r', long, default_value_t = 3)]
    pub reps: usize,
    /// CPU threads (default: all cores).
    #[arg(short = 't', long)]
    pub threads: Option<usize>,
    /// Also run this `llama-bench` binary on the same file and print its numbers alongside.
    #[arg(long, value_name = "PATH")]
    pub vs_llama_cpp: Option<PathBuf>,
    /// Print the results as JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    pub test: String,
    pub tokens: usize,
    pub toy_tok_s: f64,
    pub toy_samples: Vec<f64>,
    pub llama_cpp_tok_s: Option<f64>,
}

struct BenchJob(BenchArgs);

/// A memory figure of this process from `/proc/self/status` in MB (`VmRSS`: resident now,
/// `VmHWM`: the peak so far); `None` off Linux.
fn proc_mb(field: &str) -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    let kb: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb / 1024.0)
}

/// What `toy bench` measured: the rows, and the process's peak resident memory after loading
/// the model and after all the tests.
struct Measured {
    rows: Vec<Row>,
    peak_rss_after_load_mb: Option<f64>,
    peak_rss_mb: Option<f64>,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

impl BackendJob for BenchJob {
    type Output = Measured;

    fn run<B: ToyBackend>(self, device: B::Device) -> Result<Measured> {
        let args = self.0;
        let (_file, config, model) = load_any_model::<B>(&args.model, &device)?;
        let peak_rss_after_load_mb = proc_mb("VmHWM");
        // Token i of a run: a fixed, arbitrary id (the speed does not depend on which).
        let tokens = |from: usize, n: usize| {
            let v: Vec<i64> = (from..from + n)
                .map(|i| ((i * 7919 + 17) % config.vocab_size) as i64)
                .collect();
            Tensor::<B, 2, Int>::from_data(TensorData::new(v, [1, n]), &device)
        };
        // Tokens/s of `n` tokens fed `chunk` at a time from an empty cache (a prompt is one chunk
        // of `n`, generation `n` chunks of one): one warm-up, then `reps` measured runs.
        let measure = |n: usize, chunk: usize| -> Vec<f64> {
            (0..=args.reps)
                .filter_map(|rep| {
                    let mut cache = model.new_cache();
                    let start = Instant::now();
                    for from in (0..n).step_by(chunk) {
                        // Reading the logits back forces the computation to finish.
                        model
                            .forward_last(tokens(from, chunk), &mut cache)
                            .into_data();
                    }
                    let tok_s = n as f64 / start.elapsed().as_secs_f64();
                    (rep > 0).then_some(tok_s)
                })
                .collect()
        };
        let row = |test: String, tokens: usize, samples: Vec<f64>| Row {
            test,
            tokens,
            toy_tok_s: median(&mut samples.clone()),
            toy_samples: samples,
            llama_cpp_tok_s: None,
        };
        let mut rows: Vec<Row> = args
            .prompt
            .iter()
            .filter(|&&p| p > 0) // `-p 0`: no prompt test, as in llama-bench
            .map(|&p| row(format!("pp{p}"), p, measure(p, p)))
            .collect();
        if args.n_gen > 0 {
            rows.push(row(
                format!("tg{}", args.n_gen),
                args.n_gen,
                measure(args.n_gen, 1),
            ));
        }
        Ok(Measured {
            rows,
            peak_rss_after_load_mb,
            peak_rss_mb: proc_mb("VmHWM"),
        })
    }
}

/// Run llama-bench and return `test name -> avg tokens/s`.
fn llama_bench(path: &PathBuf, args: &BenchArgs, threads: usize) -> Result<Vec<(String, f64)>> {
    let prompts: Vec<String> = args.prompt.iter().map(|p| p.to_string()).collect();
    let out = Command::new(path)
        .args(["-m"])
        .arg(&args.model)
        .args([
            "-t",
            &threads.to_string(),
            "-p",
            &prompts.join(","),
            "-n",
            &args.n_gen.to_string(),
        ])
        .args(["-r", &args.reps.max(1).to_string(), "-o", "json"])
        .output()
        .with_context(|| format!("cannot run {}", path.display()))?;
    if !out.status.success() {
        let stderr = String::from_utf8_lossy(&out.stderr);
        let last = stderr
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("no output");
        bail!("{} {} ({last})", path.display(), out.status);
    }
    let rows: Vec<serde_json::Value> =
        serde_json::from_slice(&out.stdout).context("cannot parse llama-bench JSON")?;
    Ok(rows
        .iter()
        .filter_map(|r| {
            let (p, n) = (r["n_prompt"].as_u64()?, r["n_gen"].as_u64()?);
            let name = if n == 0 {
                format!("pp{p}")
            } else {
                format!("tg{n}")
            };
            Some((name, r["avg_ts"].as_f64()?))
        })
        .collect())
}

pub fn run(compute: Compute, mut args: BenchArgs) -> Result<()> {
    args.model = crate::models::resolve_model(&args.model)?;
    if args.reps == 0 || args.threads == Some(0) {
        bail!("--reps and --threads must be at least 1");
    }
    if args.prompt.iter().all(|&p| p == 0) && args.n_gen == 0 {
        bail!("nothing to measure: give a prompt length (-p) or a generation length (-n) above 0");
    }
    let backend = compute.backend;
    let threads = args.threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    });
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build_global()
        .ok();
    let measured = dispatch(compute, BenchJob(args.clone()))?;
    let mut rows = measured.rows;
    if let Some(path) = &args.vs_llama_cpp {
        for (name, ts) in llama_bench(path, &args, threads)? {
            if let Some(row) = rows.iter_mut().find(|r| r.test == name) {
                row.llama_cpp_tok_s = Some(ts);
            }
        }
    }
    let model = args
        .model
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    if args.json {
        println!(
            "{}",
            serde_json::json!({
                "model": model,
                "backend": backend.name(),
                "threads": threads,
                "rows": rows,
                "peak_rss_after_load_mb": measured.peak_rss_after_load_mb,
                "peak_rss_mb": measured.peak_rss_mb,
            })
        );
        return Ok(());
    }
    println!("| model | backend | threads | test | toy t/s | llama.cpp t/s | toy / llama.cpp |");
    println!("| --- | --- | ---: | --- | ---: | ---: | ---: |");
    for r in &rows {
        let (lc, ratio) = match r.llama_cpp_tok_s {
            Some(l) => (format!("{l:.2}"), format!("{:.2}", r.toy_tok_s / l)),
            None => ("—".into(), "—".into()),
        };
        println!(
            "| {model} | {} | {threads} | {} | {:.2} | {lc} | {ratio} |",
            backend.name(),
            r.test,
            r.toy_tok_s
        );
    }
    if let (Some(load), Some(peak)) = (measured.peak_rss_after_load_mb, measured.peak_rss_mb) {
        println!("\ntoy peak RSS: {load:.0} MB after loading, {peak:.0} MB after the tests");
    }
    Ok(())
}
