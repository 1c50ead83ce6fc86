//! `toy convert`: rewrite a model with its weights in another type.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use toy_core::gguf::{GgmlType, GgufError, GgufFile, convert};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Target {
    F32,
    F16,
    #[value(name = "q8_0")]
    Q8_0,
    #[value(name = "q4_0")]
    Q4_0,
}

impl Target {
    fn ggml_type(self) -> GgmlType {
        match self {
            Target::F32 => GgmlType::F32,
            Target::F16 => GgmlType::F16,
            Target::Q8_0 => GgmlType::Q8_0,
            Target::Q4_0 => GgmlType::Q4_0,
        }
    }
}

#[derive(Args, Debug)]
pub struct ConvertArgs {
    /// The model to read (any supported tensor types).
    pub input: PathBuf,
    /// Where to write the converted model (written to a temporary file, then renamed).
    pub output: PathBuf,
    /// Type of the 2-D weight matrices. 1-D tensors (norms) stay F32, as llama-quantize does;
    /// every matrix gets the target type (like `llama-quantize --pure`).
    #[arg(long, value_enum)]
    pub to: Target,
}

pub fn run(args: ConvertArgs) -> Result<()> {
    if args.input == args.output {
        bail!("the output must be a different file from the input");
    }
    let file = GgufFile::open(&args.input)?;
    let bar = ProgressBar::new(file.tensors.len() as u64).with_style(
        ProgressStyle::with_template("converting [{bar:30}] {pos}/{len} tensors {msg}")
            .expect("static template"),
    );
    let writer = convert(&file, args.to.ggml_type(), |info, _| {
        bar.set_message(info.name.clone());
        bar.inc(1);
        Ok::<_, GgufError>(())
    })?;
    bar.set_message("writing");
    writer
        .write_atomic(&args.output)
        .with_context(|| format!("cannot write {}", args.output.display()))?;
    bar.finish_and_clear();
    eprintln!(
        "wrote {} ({} tensors, matrices as {:?})",
        args.output.display(),
        file.tensors.len(),
        args.to
    );
    Ok(())
}
