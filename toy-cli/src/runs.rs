//! `toy runs`: list training runs with their losses, and plot their loss curves.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use toy_train::report::{Curve, RunSummary, curve, loss_svg, summarize};

#[derive(Args, Debug)]
pub struct RunsArgs {
    /// Where the runs are (each a directory with an events.jsonl).
    #[arg(long, default_value = "runs", global = true)]
    pub dir: PathBuf,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    #[command(subcommand)]
    pub action: Option<RunsAction>,
}

#[derive(Subcommand, Debug)]
pub enum RunsAction {
    /// Write the loss curves of one or more runs as an SVG chart.
    Plot {
        /// Run ids (directory names under --dir) or paths to run directories.
        #[arg(required = true)]
        runs: Vec<String>,
        /// The SVG file to write.
        #[arg(short, long, default_value = "loss.svg")]
        output: PathBuf,
    },
}

pub fn run(args: RunsArgs) -> Result<()> {
    match args.action {
        None => list(&args.dir, args.json),
        Some(RunsAction::Plot { runs, output }) => plot(&args.dir, &runs, &output),
    }
}

fn list(dir: &PathBuf, json: bool) -> Result<()> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            bail!("no runs in {}: `toy train` creates them", dir.display())
        }
        Err(e) => return Err(e).with_context(|| format!("cannot read {}", dir.display())),
    };
    let mut runs: Vec<RunSummary> = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        // Training runs only: `toy serve --events` runs have an event log but no config.json.
        if path.join("events.jsonl").is_file() && path.join("config.json").is_file() {
            runs.push(summarize(&path).with_context(|| format!("cannot read {}", path.display()))?);
        }
    }
    runs.sort_by(|a, b| a.started.total_cmp(&b.started));
    if json {
        println!("{}", serde_json::to_string(&runs)?);
        return Ok(());
    }
    if runs.is_empty() {
        println!("no runs in {}", dir.display());
        return Ok(());
    }
    let opt = |v: Option<f64>| v.map(|l| format!("{l:.4}")).unwrap_or_else(|| "—".into());
    println!(
        "{:<20} {:<18} {:>9} {:>11} {:>9} {:>9} {:>8}  status",
        "run", "recipe", "params", "steps", "loss", "eval", "time"
    );
    for r in &runs {
        let recipe = match &r.preset {
            Some(p) => format!("{} {p}", r.recipe),
            None => r.recipe.clone(),
        };
        let status = if r.finished {
            "finished"
        } else {
            "stopped (toy train --resume)"
        };
        println!(
            "{:<20} {:<18} {:>9} {:>11} {:>9} {:>9} {:>7.0}s  {status}",
            r.id,
            recipe,
            r.n_params,
            format!("{}/{}", r.steps_done, r.steps_total),
            opt(r.loss),
            opt(r.eval_loss),
            r.elapsed_s,
        );
    }
    Ok(())
}

fn plot(dir: &std::path::Path, runs: &[String], output: &PathBuf) -> Result<()> {
    let mut curves: Vec<Curve> = Vec::new();
    for run in runs {
        let path = if std::path::Path::new(run).join("events.jsonl").is_file() {
            PathBuf::from(run)
        } else {
            dir.join(run)
        };
        if !path.join("events.jsonl").is_file() {
            bail!(
                "{run}: no run there (looked for {})",
                path.join("events.jsonl").display()
            );
        }
        curves.push(curve(&path, run).with_context(|| format!("cannot read {}", path.display()))?);
    }
    toy_core::atomic::write_atomic(output, loss_svg(&curves).as_bytes())
        .with_context(|| format!("cannot write {}", output.display()))?;
    eprintln!(
        "wrote {} ({} run{})",
        output.display(),
        curves.len(),
        if curves.len() == 1 { "" } else { "s" }
    );
    Ok(())
}
