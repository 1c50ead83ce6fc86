//! `toy merge BASE ADAPTER OUT`: fold a LoRA adapter into its base model.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Args;
use toy_core::config::ModelConfig;
use toy_core::gguf::{GgmlType, GgufFile};
use toy_train::adapter::{Adapter, QkLayout, merge};

#[derive(Args, Debug, Clone)]
pub struct MergeArgs {
    /// The base model GGUF the adapter was trained on.
    pub base: PathBuf,
    /// The adapter: a GGUF LoRA adapter (`adapter.gguf`), or a PEFT directory holding
    /// `adapter_config.json` and `adapter_model.safetensors`.
    pub adapter: PathBuf,
    /// Where to write the merged model (a standard GGUF).
    pub out: PathBuf,
    /// Weight type of the merged model: f32, or q8_0 (every 2-D weight re-quantized).
    #[arg(long = "type", default_value = "f32", value_parser = ["f32", "q8_0"])]
    pub ty: String,
}

pub fn run(args: MergeArgs) -> Result<()> {
    let base = GgufFile::open(&args.base)
        .with_context(|| format!("cannot open the base model {}", args.base.display()))?;
    let config = ModelConfig::from_gguf(&base)
        .with_context(|| format!("{} is not a model toy can read", args.base.display()))?;
    let adapter = if args.adapter.is_dir() {
        Adapter::read_peft(&args.adapter, QkLayout::of(&config))?
    } else {
        let file = GgufFile::open(&args.adapter)
            .with_context(|| format!("cannot open the adapter {}", args.adapter.display()))?;
        // llama.cpp refuses such a pair too: the tensor names would mean other things.
        let arch = file.get_str("general.architecture").ok().flatten();
        if arch.is_some_and(|a| a != config.architecture) {
            bail!(
                "the adapter {} is for {} models; {} is {}",
                args.adapter.display(),
                arch.unwrap_or_default(),
                args.base.display(),
                config.architecture
            );
        }
        Adapter::read_gguf(&file, &config)?
    };
    let ty = match args.ty.as_str() {
        "q8_0" => GgmlType::Q8_0,
        _ => GgmlType::F32,
    };
    let bytes = merge(&base, &adapter, ty)?
        .write_atomic(&args.out)
        .with_context(|| format!("cannot write {}", args.out.display()))?;
    eprintln!(
        "merged {} adapted matrices (rank {}, alpha {}) into {} ({:.1} MB, {})",
        adapter.tensors.len(),
        adapter.rank,
        adapter.alpha,
        args.out.display(),
        bytes as f64 / 1e6,
        args.ty
    );
    Ok(())
}
