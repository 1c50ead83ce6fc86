//! `toy describe`: the architecture card of a model.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use toy_core::config::ModelConfig;
use toy_core::gguf::GgufFile;
use toy_core::tokenizer::Tokenizer;

#[derive(Args, Debug)]
pub struct DescribeArgs {
    /// The model: a GGUF file, or a name `toy list` prints.
    pub model: PathBuf,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn run(mut args: DescribeArgs) -> Result<()> {
    args.model = crate::models::resolve_model(&args.model)?;
    let file = GgufFile::open(&args.model)?;
    let config = ModelConfig::from_gguf(&file)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let params: u64 = file.tensors.iter().map(|t| t.n_elements()).sum();
    let mut types: BTreeMap<String, (usize, u64)> = BTreeMap::new();
    for t in &file.tensors {
        let e = types.entry(t.ggml_type.name().to_string()).or_default();
        e.0 += 1;
        e.1 += t.n_bytes();
    }
    let tensor_bytes: u64 = types.values().map(|v| v.1).sum();

    if args.json {
        let out = serde_json::json!({
            "file": args.model,
            "architecture": config.architecture,
            "name": config.name,
            "parameters": params,
            "layers": config.n_layer,
            "d_model": config.d_model,
            "heads": config.n_head,
            "kv_heads": config.n_head_kv,
            "head_dim": config.head_dim,
            "ffn": config.d_ff,
            "context_length": config.context_length,
            "rope": {"theta": config.rope_theta, "dims": config.rope_dim, "description": config.describe_rope()},
            "rms_eps": config.rms_eps,
            "tied_embeddings": config.tied_embeddings,
            "attention_bias": config.attn_bias,
            "qk_norm": format!("{:?}", config.qk_norm),
            "ffn_description": config.describe_ffn(),
            "distinctive": config.distinctive(),
            "vocab_size": config.vocab_size,
            "tokenizer": tokenizer.kind(),
            "tensor_types": types.iter().map(|(k, (n, b))| (k.clone(), serde_json::json!({"tensors": n, "bytes": b}))).collect::<serde_json::Map<_, _>>(),
            "tensor_bytes": tensor_bytes,
            "gguf_version": file.version,
        });
        println!("{out}");
        return Ok(());
    }
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!("{}", args.model.display());
    println!(
        "  architecture   {}{}",
        config.architecture,
        config
            .name
            .as_deref()
            .map(|n| format!(" ({n})"))
            .unwrap_or_default()
    );
    println!("  parameters     {} ({:.1} M)", params, params as f64 / 1e6);
    println!("  layers         {}", config.n_layer);
    println!("  d_model        {}", config.d_model);
    println!(
        "  heads          {} query, {} key/value (GQA {}:1), head dim {}",
        config.n_head,
        config.n_head_kv,
        config.n_head / config.n_head_kv,
        config.head_dim
    );
    println!("  ffn            {}", config.describe_ffn());
    println!("  context        {}", config.context_length);
    println!("  rope           {}", config.describe_rope());
    let norm = match config.norm {
        toy_core::config::NormKind::Rms => "rms eps   ",
        toy_core::config::NormKind::Layer => "layernorm eps",
    };
    println!("  {norm:<14} {:e}", config.rms_eps);
    let extras = config.distinctive();
    if !extras.is_empty() {
        println!("  distinctive    {}", extras.join(", "));
    }
    println!(
        "  output head    {}",
        if config.tied_embeddings {
            "tied to token_embd"
        } else {
            "output.weight"
        }
    );
    println!(
        "  vocab          {} ({})",
        config.vocab_size,
        tokenizer.kind()
    );
    println!(
        "  tensors        {} in GGUF v{}, {:.1} MiB",
        file.tensors.len(),
        file.version,
        mib(tensor_bytes)
    );
    for (ty, (n, b)) in &types {
        println!("    {ty:<6} {n:>4} tensors {:>9.1} MiB", mib(*b));
    }
    Ok(())
}
