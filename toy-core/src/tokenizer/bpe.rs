//! Byte-level BPE (`gpt2` vocabularies): llama.cpp's pre-tokenizer regexes and the table of
//! `tokenizer.ggml.pre` values, GPT-2's byte-to-character tables, and the `tokenizers` pipeline
//! (pre-tokenizer sequence, `ByteLevel`, BPE with the GGUF merges).

use std::collections::{HashMap, HashSet};

use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::gguf::{GgufFile, Value};

use super::{Result, TokenizerError};

/// llama.cpp's pre-tokenizer regexes (`llm_tokenizer_bpe`), applied in order.
const RE_GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
const RE_LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const RE_PORO: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// llama.cpp runs the GPT-2 regex with a hand-written matcher (`unicode_regex_split_custom_gpt2`)
/// that, where the regex has no alternative left (a lone whitespace before a non-space that no
/// other branch takes, e.g. the `\n` in `"a\nb"`), takes the whitespace run as a piece of its own:
/// that is the regex with a final `|\s+`, which is the form Hugging Face's ByteLevel uses too.
fn gpt2_effective(re: &str) -> String {
    if re == RE_GPT2 {
        format!("{re}|\\s+")
    } else {
        re.to_string()
    }
}

/// One family of `tokenizer.ggml.pre` values: the regexes and the flags llama.cpp sets for it.
pub(super) struct PreTokenizerSpec {
    pub(super) names: &'static [&'static str],
    regexes: &'static [&'static str],
    /// `clean_up_tokenization_spaces` in detokenization.
    pub(super) clean_spaces: bool,
    /// Use a word as one token when it is in the vocabulary, without merging (llama3 and kin).
    ignore_merges: bool,
    /// Default of `add_bos_token` when the metadata does not say.
    pub(super) add_bos: bool,
}

/// The `tokenizer.ggml.pre` values toy knows, grouped by the regexes llama.cpp uses for them
/// (`llama_vocab::impl::load` and `llm_tokenizer_bpe` in llama.cpp 0c1e57098). Values that need
/// behavior toy does not implement (add_sep, custom splitters, whitespace escaping) are absent and
/// refused.
pub(super) const PRE_TOKENIZERS: &[PreTokenizerSpec] = &[
    PreTokenizerSpec {
        names: &["default"],
        regexes: &[
            r"[\p{P}\$\+<=>\^~\|]+",
            RE_GPT2,
            r"\p{N}+",
            r"[0-9][0-9][0-9]",
        ],
        clean_spaces: true,
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerSpec {
        names: &[
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
        ],
        regexes: &[RE_LLAMA3],
        clean_spaces: true,
        ignore_merges: true,
        add_bos: true,
    },
    PreTokenizerSpec {
        names: &["dbrx", "smaug-bpe"],
        regexes: &[RE_LLAMA3],
        clean_spaces: true,
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerSpec {
        names: &[
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "mpt",
            "olmo",
            "exaone4",
        ],
        regexes: &[RE_GPT2],
        clean_spaces: true,
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerSpec {
        names: &["trillion", "granite-docling"],
        regexes: &[RE_GPT2],
        clean_spaces: false,
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerSpec {
        names: &["smollm", "command-r"],
        regexes: &[r"\p{N}", RE_GPT2],
        clean_spaces: false,
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerSpec {
        names: &[
            "starcoder",
            "refact",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ],
        regexes: &[r"\p{N}", RE_GPT2],
        clean_spaces: true,
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerSpec {
        names: &[
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "hunyuan",
            "solar-open",
        ],
        regexes: &[RE_QWEN2],
        clean_spaces: false,
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerSpec {
        names: &["megrez", "stablelm2"],
        regexes: &[RE_QWEN2],
        clean_spaces: true,
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerSpec {
        names: &["falcon"],
        regexes: &[
            r"[\p{P}\$\+<=>\^~\|`]+",
            // Falcon's second regex is the GPT-2 one.
            RE_GPT2,
            r"[0-9][0-9][0-9]",
        ],
        clean_spaces: true,
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerSpec {
        names: &["poro-chat"],
        regexes: &[RE_PORO],
        clean_spaces: false,
        ignore_merges: false,
        add_bos: false,
    },
    PreTokenizerSpec {
        names: &["bloom", "gpt3-finnish"],
        regexes: &[RE_PORO],
        clean_spaces: true,
        ignore_merges: false,
        add_bos: false,
    },
];

pub(super) fn supported_pre_list() -> String {
    let mut names: Vec<&str> = PRE_TOKENIZERS
        .iter()
        .flat_map(|s| s.names.iter().copied())
        .collect();
    names.sort_unstable();
    names.join(", ")
}

/// GPT-2's byte-to-character table (every byte maps to a printable character).
pub(super) fn byte_encoder() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut extra = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        table[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(256 + extra).unwrap_or('\0');
            extra += 1;
            c
        };
    }
    table
}

pub(super) fn byte_decoder() -> HashMap<char, u8> {
    byte_encoder()
        .iter()
        .enumerate()
        .map(|(b, &c)| (c, b as u8))
        .collect()
}

/// The `tokenizers` pipeline for a byte-level BPE vocabulary: the pre-tokenizer regexes of
/// `spec`, GPT-2 byte encoding, and BPE with the GGUF merges.
pub(super) fn build_byte_level_bpe(
    file: &GgufFile,
    tokens: &[String],
    spec: &PreTokenizerSpec,
) -> Result<tokenizers::Tokenizer> {
    let merge_values = file
        .get_array("tokenizer.ggml.merges")?
        .ok_or(TokenizerError::MissingKey("tokenizer.ggml.merges"))?;

    // Later duplicates win, as in llama.cpp.
    let vocab: tokenizers::models::bpe::Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    // llama.cpp splits each merge at the first space after the first byte and keeps the first
    // rank of a repeated pair. `tokenizers` needs both halves and the result in the vocabulary;
    // a merge that fails that can only produce a non-token in llama.cpp too (which it then spells
    // in bytes), so leaving it out changes nothing for the vocabularies converters write.
    let mut seen = HashSet::with_capacity(merge_values.len());
    let mut merges = Vec::with_capacity(merge_values.len());
    for (i, v) in merge_values.iter().enumerate() {
        let Value::String(line) = v else {
            return Err(TokenizerError::Invalid(format!(
                "tokenizer.ggml.merges[{i}] is not a string"
            )));
        };
        // The first space at byte 1 or later (a space is ASCII, so this is a char boundary).
        let Some(pos) = line.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else {
            continue;
        };
        let (a, b) = (&line[..pos], &line[pos + 1..]);
        if !vocab.contains_key(a) || !vocab.contains_key(b) {
            continue;
        }
        if !vocab.contains_key(&format!("{a}{b}")) {
            continue;
        }
        if seen.insert((a.to_string(), b.to_string())) {
            merges.push((a.to_string(), b.to_string()));
        }
    }

    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(spec.ignore_merges)
        .build()
        .map_err(|e| TokenizerError::Invalid(format!("cannot build the BPE model: {e}")))?;

    let pre_tokenizer = pre_tokenizer(spec)?;
    let mut hf = tokenizers::Tokenizer::new(bpe);
    hf.with_pre_tokenizer(Some(pre_tokenizer));
    hf.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::default()));
    Ok(hf)
}

/// llama.cpp's regexes for `spec`, one `Split(Isolated)` each, then GPT-2 byte encoding.
pub(super) fn pre_tokenizer(spec: &PreTokenizerSpec) -> Result<Sequence> {
    let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(spec.regexes.len() + 1);
    for re in spec.regexes {
        let pattern = SplitPattern::Regex(gpt2_effective(re));
        let split = Split::new(pattern, SplitDelimiterBehavior::Isolated, false).map_err(|e| {
            TokenizerError::Invalid(format!("cannot compile pre-tokenizer regex {re:?}: {e}"))
        })?;
        steps.push(split.into());
    }
    steps.push(ByteLevel::new(false, false, false).into());
    Ok(Sequence::new(steps))
}
