//! `toy convert`: rewrite a model with its weights in another type.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Args, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};
use toy_core::gguf::{GgmlType, GgufFile, GgufWriter, Value, quantize, tensor_to_f32};

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

    /// llama.cpp's `general.file_type` (`enum llama_ftype`).
    fn file_type(self) -> u32 {
        match self {
            Target::F32 => 0,
            Target::F16 => 1,
            Target::Q4_0 => 2,
            Target::Q8_0 => 7,
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
    let mut writer = GgufWriter::from_file(&file);
    if file.get("general.file_type").is_some() {
        writer.set("general.file_type", Value::U32(args.to.file_type()))?;
    }
    let bar = ProgressBar::new(file.tensors.len() as u64).with_style(
        ProgressStyle::with_template("converting [{bar:30}] {pos}/{len} tensors {msg}")
            .expect("static template"),
    );
    for info in &file.tensors {
        bar.set_message(info.name.clone());
        let values = tensor_to_f32(&file, info)
            .with_context(|| format!("cannot read tensor {}", info.name))?;
        let target = args.to.ggml_type();
        let ty = if info.dims.len() == 2 && info.dims[0] % target.block_size() as u64 == 0 {
            target
        } else {
            GgmlType::F32
        };
        let data = quantize(ty, &values)?;
        writer.add_tensor(&info.name, &info.dims, ty, data)?;
        bar.inc(1);
    }
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
