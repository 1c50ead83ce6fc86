//! `toy tokenize`: token ids of a text, as `llama-tokenize` prints them.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use toy_core::gguf::GgufFile;
use toy_core::tokenizer::Tokenizer;

#[derive(Args, Debug)]
pub struct TokenizeArgs {
    /// The model: a GGUF file, or a name `toy list` prints (only its tokenizer is read).
    pub model: PathBuf,
    /// The text to tokenize.
    pub text: String,
    /// Print `{"ids":[..]}`.
    #[arg(long)]
    pub json: bool,
    /// Print only the list of ids, like `llama-tokenize --ids`.
    #[arg(long, conflicts_with = "json")]
    pub ids: bool,
    /// Do not add BOS/EOS even where the model's metadata asks for them.
    #[arg(long)]
    pub no_special: bool,
    /// Treat special-token text (e.g. <|im_end|>) as plain text.
    #[arg(long)]
    pub no_parse_special: bool,
}

pub fn run(mut args: TokenizeArgs) -> Result<()> {
    args.model = crate::models::resolve_model(&args.model)?;
    let file = GgufFile::open(&args.model)?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    let ids = tokenizer.encode(&args.text, !args.no_special, !args.no_parse_special)?;
    if args.json {
        println!("{}", serde_json::json!({ "ids": ids }));
    } else if args.ids {
        println!("{ids:?}");
    } else {
        for id in ids {
            let piece = String::from_utf8_lossy(tokenizer.token_bytes(id)).into_owned();
            println!("{id:6} -> '{piece}'");
        }
    }
    Ok(())
}
