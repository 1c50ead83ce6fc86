//! The tokenizer of a GGUF model, built from its `tokenizer.ggml.*` metadata, that produces the same
//! token ids and text as llama.cpp (`llama_tokenize`, `llama_token_to_piece`, `llama_detokenize`).
//!
//! Two vocabulary types are supported:
//!
//! - `gpt2`: byte-level BPE. The pre-tokenizer regexes are chosen by `tokenizer.ggml.pre` exactly
//!   as llama.cpp's `llama-vocab.cpp` chooses them; the split and the merges run in the Hugging
//!   Face `tokenizers` crate (a sequence of `Split(…, Isolated)` pre-tokenizers — llama.cpp applies
//!   its regexes one after the other to the pieces the previous one left, keeping unmatched text as
//!   pieces of its own, which is what `Isolated` does — then `ByteLevel` and `BPE`).
//! - `llama`: SentencePiece. llama.cpp does not run a SentencePiece model: it merges adjacent
//!   symbols whose concatenation is a vocabulary entry, highest score first, with byte-fallback
//!   `<0xNN>` tokens. That algorithm is ported here as is (see [`Tokenizer::encode`]) because the
//!   usual Hugging Face rendition (BPE with merges derived from the scores) breaks score ties and
//!   treats control pieces differently.
//!
//! Special tokens (control, user-defined, unknown) are split out of the text before either model
//! runs, with llama.cpp's own partition (longest token text first, every occurrence), not with the
//! `tokenizers` added-vocabulary matcher (leftmost-longest), because the two differ when special
//! token texts overlap.

use std::collections::{BinaryHeap, HashMap, HashSet};
use std::fmt;

use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::gguf::{GgufError, GgufFile, Value};

/// Everything that can go wrong when building a tokenizer from GGUF metadata or encoding text.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error(
        "the GGUF file has no tokenizer (metadata key {0:?} is missing); it cannot turn text into \
         tokens — use a GGUF converted with its vocabulary (llama.cpp's convert_hf_to_gguf.py \
         writes one)"
    )]
    MissingKey(&'static str),
    #[error(
        "tokenizer model {0:?} is not supported; toy reads \"gpt2\" (byte-level BPE) and \"llama\" \
         (SentencePiece) vocabularies"
    )]
    UnsupportedModel(String),
    #[error(
        "pre-tokenizer {pre:?} (tokenizer.ggml.pre) is not supported; supported: {supported}. \
         toy refuses to guess because a wrong pre-tokenizer silently changes the token ids"
    )]
    UnsupportedPre { pre: String, supported: String },
    #[error("bad tokenizer metadata: {0}")]
    Invalid(String),
    #[error("bad tokenizer metadata: {0}")]
    Gguf(#[from] GgufError),
    #[error("cannot encode {text:?}: {reason}")]
    Encode { text: String, reason: String },
}

pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;

/// `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TokenType {
    Undefined,
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    fn from_gguf(v: i64) -> Self {
        match v {
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Undefined,
        }
    }
}

// Token attributes, as llama.cpp keeps them (`llama_token_attr`): the GGUF token type plus flags
// that llama.cpp's load-time heuristics add (a token can become control, or gain lstrip/rstrip).
const ATTR_UNDEFINED: u32 = 0;
const ATTR_UNKNOWN: u32 = 1 << 0;
const ATTR_UNUSED: u32 = 1 << 1;
const ATTR_NORMAL: u32 = 1 << 2;
const ATTR_CONTROL: u32 = 1 << 3;
const ATTR_USER_DEFINED: u32 = 1 << 4;
const ATTR_BYTE: u32 = 1 << 5;
const ATTR_LSTRIP: u32 = 1 << 7;
const ATTR_RSTRIP: u32 = 1 << 8;

fn attr_of(t: TokenType) -> u32 {
    match t {
        TokenType::Undefined => ATTR_UNDEFINED,
        TokenType::Normal => ATTR_NORMAL,
        TokenType::Unknown => ATTR_UNKNOWN,
        TokenType::Control => ATTR_CONTROL,
        TokenType::UserDefined => ATTR_USER_DEFINED,
        TokenType::Unused => ATTR_UNUSED,
        TokenType::Byte => ATTR_BYTE,
    }
}

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
struct PreTokenizerSpec {
    names: &'static [&'static str],
    regexes: &'static [&'static str],
    /// `clean_up_tokenization_spaces` in detokenization.
    clean_spaces: bool,
    /// Use a word as one token when it is in the vocabulary, without merging (llama3 and kin).
    ignore_merges: bool,
    /// Default of `add_bos_token` when the metadata does not say.
    add_bos: bool,
}

/// The `tokenizer.ggml.pre` values toy knows, grouped by the regexes llama.cpp uses for them
/// (`llama_vocab::impl::load` and `llm_tokenizer_bpe` in llama.cpp 0c1e57098). Values that need
/// behavior toy does not implement (add_sep, custom splitters, whitespace escaping) are absent and
/// refused.
const PRE_TOKENIZERS: &[PreTokenizerSpec] = &[
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

fn supported_pre_list() -> String {
    let mut names: Vec<&str> = PRE_TOKENIZERS
        .iter()
        .flat_map(|s| s.names.iter().copied())
        .collect();
    names.sort_unstable();
    names.join(", ")
}

/// Token texts that llama.cpp treats as end-of-generation (`special_eog_ids`), by text.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

// Texts llama.cpp uses to find the fill-in-the-middle tokens when the metadata does not name
// them; a token found this way becomes control, and pad/repo/sep ones end generation.
const FIM_PRE_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// The vocabulary-type specific part.
enum Model {
    /// Byte-level BPE run by the `tokenizers` crate.
    ByteLevelBpe {
        pre: String,
        hf: Box<tokenizers::Tokenizer>,
    },
    /// llama.cpp's SentencePiece algorithm over `tokens`/`scores`.
    SentencePiece,
}

/// A tokenizer equivalent to llama.cpp's for one GGUF vocabulary.
pub struct Tokenizer {
    model: Model,
    /// Token texts as stored in the GGUF (byte-level encoded for BPE, `▁` for spaces in SPM).
    tokens: Vec<String>,
    scores: Vec<f32>,
    attrs: Vec<u32>,
    token_to_id: HashMap<String, u32>,
    /// `llama_token_to_piece(id, special = true)` for every token.
    pieces: Vec<Vec<u8>>,
    /// Control, user-defined and unknown tokens, longest text first: the order in which
    /// llama.cpp splits them out of the text.
    special_tokens: Vec<u32>,
    eog: HashSet<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    clean_spaces: bool,
    chat_template: Option<String>,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind())
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .finish()
    }
}

/// A piece of text being tokenized: raw text (a byte range of the input) or a special token.
#[derive(Debug, Clone, Copy)]
enum Fragment {
    Text { start: usize, end: usize },
    Token(u32),
}

impl Tokenizer {
    /// Build the tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(file: &GgufFile) -> Result<Self> {
        let model_name = file
            .get_str("tokenizer.ggml.model")?
            .ok_or(TokenizerError::MissingKey("tokenizer.ggml.model"))?;
        let is_bpe = match model_name {
            "gpt2" => true,
            "llama" => false,
            other => return Err(TokenizerError::UnsupportedModel(other.to_string())),
        };

        let token_values = file
            .get_array("tokenizer.ggml.tokens")?
            .ok_or(TokenizerError::MissingKey("tokenizer.ggml.tokens"))?;
        let n = token_values.len();
        if n == 0 {
            return Err(TokenizerError::Invalid(
                "tokenizer.ggml.tokens is empty".into(),
            ));
        }
        if n > u32::MAX as usize {
            return Err(TokenizerError::Invalid(format!(
                "{n} tokens is more than toy supports"
            )));
        }
        let mut tokens = Vec::with_capacity(n);
        for (i, v) in token_values.iter().enumerate() {
            let s = v.as_str().ok_or_else(|| {
                TokenizerError::Invalid(format!("tokenizer.ggml.tokens[{i}] is not a string"))
            })?;
            // llama.cpp renames empty tokens so that every token has a distinct, findable text.
            tokens.push(if s.is_empty() {
                format!("[EMPTY_{i}]")
            } else {
                s.to_string()
            });
        }

        let scores = match file.get_array("tokenizer.ggml.scores")? {
            Some(values) => {
                if values.len() < n {
                    return Err(TokenizerError::Invalid(format!(
                        "tokenizer.ggml.scores has {} entries for {n} tokens",
                        values.len()
                    )));
                }
                values[..n]
                    .iter()
                    .enumerate()
                    .map(|(i, v)| {
                        v.as_f64().map(|x| x as f32).ok_or_else(|| {
                            TokenizerError::Invalid(format!(
                                "tokenizer.ggml.scores[{i}] is not a number"
                            ))
                        })
                    })
                    .collect::<Result<Vec<f32>>>()?
            }
            None => vec![0.0; n],
        };

        let mut attrs = match file.get_array("tokenizer.ggml.token_type")? {
            Some(values) => {
                if values.len() < n {
                    return Err(TokenizerError::Invalid(format!(
                        "tokenizer.ggml.token_type has {} entries for {n} tokens",
                        values.len()
                    )));
                }
                values[..n]
                    .iter()
                    .enumerate()
                    .map(|(i, v)| {
                        v.as_i64()
                            .map(|t| attr_of(TokenType::from_gguf(t)))
                            .ok_or_else(|| {
                                TokenizerError::Invalid(format!(
                                    "tokenizer.ggml.token_type[{i}] is not an integer"
                                ))
                            })
                    })
                    .collect::<Result<Vec<u32>>>()?
            }
            // llama.cpp: every token is normal when the file has no types.
            None => vec![ATTR_NORMAL; n],
        };

        // Later duplicates win, as in llama.cpp's `token_to_id[word] = i`.
        let mut token_to_id = HashMap::with_capacity(n);
        for (i, t) in tokens.iter().enumerate() {
            token_to_id.insert(t.clone(), i as u32);
        }

        // Defaults by vocabulary type, then by pre-tokenizer, then metadata overrides
        // (the order of `llama_vocab::impl::load`).
        let (mut bos, mut eos, mut unk): (Option<u32>, Option<u32>, Option<u32>) = if is_bpe {
            (Some(11), Some(11), None)
        } else {
            (Some(1), Some(2), Some(0))
        };
        let mut pad: Option<u32> = None;
        let (mut add_bos, mut add_eos, mut add_space_prefix, mut clean_spaces) = if is_bpe {
            (false, false, false, true)
        } else {
            (true, false, true, false)
        };

        let mut model = Model::SentencePiece;
        if is_bpe {
            let pre = file.get_str("tokenizer.ggml.pre")?.unwrap_or("default");
            let spec = PRE_TOKENIZERS
                .iter()
                .find(|s| s.names.contains(&pre))
                .ok_or_else(|| TokenizerError::UnsupportedPre {
                    pre: pre.to_string(),
                    supported: supported_pre_list(),
                })?;
            clean_spaces = spec.clean_spaces;
            add_bos = spec.add_bos;
            let hf = build_byte_level_bpe(file, &tokens, spec)?;
            model = Model::ByteLevelBpe {
                pre: pre.to_string(),
                hf: Box::new(hf),
            };
        }
        if let Some(v) = file.get_bool("tokenizer.ggml.add_space_prefix")? {
            add_space_prefix = v;
        }

        // A default id outside the vocabulary is disabled; a metadata id outside it is ignored.
        let in_range = |id: Option<u32>| id.filter(|&i| (i as usize) < n);
        bos = in_range(bos);
        eos = in_range(eos);
        unk = in_range(unk);
        let read_id = |key: &str, current: Option<u32>| -> Result<Option<u32>> {
            Ok(match file.get_u64(key)? {
                Some(id) if (id as usize) < n => Some(id as u32),
                _ => current,
            })
        };
        bos = read_id("tokenizer.ggml.bos_token_id", bos)?;
        eos = read_id("tokenizer.ggml.eos_token_id", eos)?;
        unk = read_id("tokenizer.ggml.unknown_token_id", unk)?;
        pad = read_id("tokenizer.ggml.padding_token_id", pad)?;
        let mut eot = read_id("tokenizer.ggml.eot_token_id", None)?;
        let mut eom = read_id("tokenizer.ggml.eom_token_id", None)?;
        let mut fim_pre = read_id("tokenizer.ggml.fim_pre_token_id", None)?;
        fim_pre = read_id("tokenizer.ggml.prefix_token_id", fim_pre)?;
        let mut fim_suf = read_id("tokenizer.ggml.fim_suf_token_id", None)?;
        fim_suf = read_id("tokenizer.ggml.suffix_token_id", fim_suf)?;
        let mut fim_mid = read_id("tokenizer.ggml.fim_mid_token_id", None)?;
        fim_mid = read_id("tokenizer.ggml.middle_token_id", fim_mid)?;
        let mut fim_pad = read_id("tokenizer.ggml.fim_pad_token_id", None)?;
        let mut fim_rep = read_id("tokenizer.ggml.fim_rep_token_id", None)?;
        let mut fim_sep = read_id("tokenizer.ggml.fim_sep_token_id", None)?;
        if let Some(v) = file.get_bool("tokenizer.ggml.add_bos_token")? {
            add_bos = v;
        }
        if let Some(v) = file.get_bool("tokenizer.ggml.add_eos_token")? {
            add_eos = v;
        }

        // llama.cpp finds these tokens by text when the metadata does not name them, and makes
        // them control tokens. llama.cpp walks a hash map, so when several texts of one kind are
        // present its pick is arbitrary; toy takes the lowest id.
        let find_by_text = |texts: &[&str]| -> Option<u32> {
            texts
                .iter()
                .filter_map(|t| token_to_id.get(*t).copied())
                .min()
        };
        for (slot, texts) in [
            (&mut eot, EOT_TEXTS),
            (&mut eom, &["<|eom_id|>"][..]),
            (&mut fim_pre, FIM_PRE_TEXTS),
            (&mut fim_suf, FIM_SUF_TEXTS),
            (&mut fim_mid, FIM_MID_TEXTS),
            (&mut fim_pad, FIM_PAD_TEXTS),
            (&mut fim_rep, FIM_REP_TEXTS),
            (&mut fim_sep, FIM_SEP_TEXTS),
        ] {
            if slot.is_none() {
                *slot = find_by_text(texts);
                if let Some(id) = *slot {
                    attrs[id as usize] |= ATTR_CONTROL;
                }
            }
        }

        // Control tokens whose text says "unused" are unused.
        for (i, t) in tokens.iter().enumerate() {
            if attrs[i] & ATTR_CONTROL != 0 && t.contains("unused") {
                attrs[i] |= ATTR_UNUSED;
            }
        }

        // The end-of-generation set.
        let mut eog: HashSet<u32> = [fim_pad, fim_rep, fim_sep].into_iter().flatten().collect();
        for text in EOG_TEXTS {
            if let Some(&id) = token_to_id.get(*text) {
                eog.insert(id);
                attrs[id as usize] |= ATTR_CONTROL;
            }
        }
        // gpt-oss: llama.cpp always renders these.
        for text in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
            if let Some(&id) = token_to_id.get(text) {
                attrs[id as usize] = ATTR_USER_DEFINED;
            }
        }
        eog.extend([eos, eot, eom].into_iter().flatten());
        let text_in_eog = |eog: &HashSet<u32>, text: &str| {
            token_to_id.get(text).copied().filter(|id| eog.contains(id))
        };
        // o200k_harmony / solar-open: `<|end|>` is not the end there.
        let has = |eog: &HashSet<u32>, text: &str| text_in_eog(eog, text).is_some();
        if let Some(end) = text_in_eog(&eog, "<|end|>") {
            let has_call = has(&eog, "<|call|>") || has(&eog, "<|calls|>");
            if has_call && (has(&eog, "<|return|>") || has(&eog, "<|flush|>")) {
                eog.remove(&end);
                attrs[end as usize] = ATTR_USER_DEFINED;
            }
        }
        // gemma4 / plamo: `</s>` is a normal token.
        if let Some(s) = text_in_eog(&eog, "</s>")
            && (has(&eog, "<|tool_response>") || has(&eog, "<|plamo:eos|>"))
        {
            eog.remove(&s);
            attrs[s as usize] = ATTR_NORMAL;
        }

        // Special tokens, longest first. llama.cpp's std::sort is not stable; toy breaks length
        // ties by id so that the order is reproducible.
        let mut special_tokens: Vec<u32> = (0..n as u32)
            .filter(|&i| attrs[i as usize] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN) != 0)
            .collect();
        special_tokens.sort_by(|&a, &b| {
            tokens[b as usize]
                .len()
                .cmp(&tokens[a as usize].len())
                .then(a.cmp(&b))
        });

        let byte_decoder = byte_decoder();
        let pieces = (0..n)
            .map(|i| piece_for(is_bpe, &tokens[i], attrs[i], &byte_decoder))
            .collect::<Vec<_>>();

        // Per-model token attributes that llama.cpp sets by model name (after the piece cache).
        let general_name = file
            .get_str("general.name")
            .ok()
            .flatten()
            .unwrap_or("")
            .to_lowercase();
        if general_name.contains("phi-3") || general_name.contains("phi3") {
            for &id in &special_tokens {
                attrs[id as usize] |= ATTR_RSTRIP;
            }
            if let Some(&id) = token_to_id.get("</s>") {
                attrs[id as usize] |= ATTR_RSTRIP;
            }
            for text in ["<unk>", "<s>", "<|endoftext|>"] {
                if let Some(&id) = token_to_id.get(text) {
                    attrs[id as usize] &= !ATTR_RSTRIP;
                }
            }
        }

        let chat_template = file.get_str("tokenizer.chat_template")?.map(str::to_string);

        Ok(Tokenizer {
            model,
            tokens,
            scores,
            attrs,
            token_to_id,
            pieces,
            special_tokens,
            eog,
            bos,
            eos,
            unk,
            pad,
            add_bos,
            add_eos,
            add_space_prefix,
            clean_spaces,
            chat_template,
        })
    }

    /// A human name for `describe`: "byte-level BPE (smollm)" or "SentencePiece".
    pub fn kind(&self) -> String {
        match &self.model {
            Model::ByteLevelBpe { pre, .. } => format!("byte-level BPE ({pre})"),
            Model::SentencePiece => "SentencePiece".to_string(),
        }
    }

    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// The BOS token's text (what chat templates get as `bos_token`).
    pub fn bos_text(&self) -> Option<&str> {
        self.bos.map(|id| self.token_text(id))
    }

    /// The EOS token's text (what chat templates get as `eos_token`).
    pub fn eos_text(&self) -> Option<&str> {
        self.eos.map(|id| self.token_text(id))
    }

    pub fn unknown_id(&self) -> Option<u32> {
        self.unk
    }

    pub fn padding_id(&self) -> Option<u32> {
        self.pad
    }

    /// Whether `encode(…, add_special = true)` starts with BOS.
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// Whether `encode(…, add_special = true)` ends with EOS.
    pub fn adds_eos(&self) -> bool {
        self.add_eos
    }

    /// Whether generation ends at this token (llama.cpp's `llama_vocab_is_eog`).
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.contains(&id)
    }

    /// The end-of-generation tokens, sorted.
    pub fn eog_ids(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.eog.iter().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// `tokenizer.chat_template`, if the file has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// A token's text as stored in the GGUF (`""` for an id outside the vocabulary).
    pub fn token_text(&self, id: u32) -> &str {
        self.tokens
            .get(id as usize)
            .map(String::as_str)
            .unwrap_or("")
    }

    /// The id of the token whose GGUF text is `text`.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    /// A token's score (`tokenizer.ggml.scores`, 0 when absent or out of range).
    pub fn token_score(&self, id: u32) -> f32 {
        self.scores.get(id as usize).copied().unwrap_or(0.0)
    }

    /// Whether a token is a control token (not text: BOS, EOS, chat markers …).
    pub fn is_control(&self, id: u32) -> bool {
        self.attr(id) & ATTR_CONTROL != 0
    }

    fn attr(&self, id: u32) -> u32 {
        self.attrs
            .get(id as usize)
            .copied()
            .unwrap_or(ATTR_UNDEFINED)
    }

    /// The bytes a token stands for, like `llama_token_to_piece(id, special = true)`: control
    /// tokens give their text; a piece can be part of a UTF-8 sequence. Empty for unused tokens
    /// and for ids outside the vocabulary.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.pieces
            .get(id as usize)
            .map(Vec::as_slice)
            .unwrap_or(&[])
    }

    /// Tokenize like `llama_tokenize(text, add_special, parse_special)`.
    ///
    /// `add_special` adds BOS and/or EOS as the metadata says (`add_bos_token`/`add_eos_token`,
    /// llama.cpp's defaults when absent). With `parse_special`, the texts of control and unknown
    /// tokens in `text` become those tokens; without it they are tokenized as plain text.
    /// User-defined tokens are always matched, as in llama.cpp.
    pub fn encode(&self, text: &str, add_special: bool, parse_special: bool) -> Result<Vec<u32>> {
        let fragments = self.partition(text, parse_special);
        let mut out = Vec::new();
        match &self.model {
            Model::ByteLevelBpe { hf, .. } => {
                if add_special && self.add_bos {
                    out.push(self.bos.ok_or_else(|| no_special(text, "BOS"))?);
                }
                for f in &fragments {
                    match *f {
                        Fragment::Text { start, end } => {
                            let piece = &text[start..end];
                            let enc = hf.encode_fast(piece, false).map_err(|e| {
                                TokenizerError::Encode {
                                    text: piece.into(),
                                    reason: e.to_string(),
                                }
                            })?;
                            out.extend_from_slice(enc.get_ids());
                        }
                        Fragment::Token(id) => out.push(id),
                    }
                }
                if add_special && self.add_eos {
                    out.push(self.eos.ok_or_else(|| no_special(text, "EOS"))?);
                }
            }
            Model::SentencePiece => {
                if add_special && self.add_bos {
                    out.push(self.bos.ok_or_else(|| no_special(text, "BOS"))?);
                }
                // Every text fragment is first or follows a special token, so each one gets the
                // space prefix (llama.cpp's `is_prev_special`).
                let mut is_prev_special = true;
                for f in &fragments {
                    match *f {
                        Fragment::Text { start, end } => {
                            let mut s = String::with_capacity(end - start + 3);
                            if self.add_space_prefix && is_prev_special {
                                s.push(' ');
                            }
                            s.push_str(&text[start..end]);
                            let escaped = s.replace(' ', "\u{2581}");
                            self.spm_tokenize(&escaped, &mut out)?;
                            is_prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            is_prev_special = true;
                        }
                    }
                }
                if add_special && self.add_eos {
                    out.push(self.eos.ok_or_else(|| no_special(text, "EOS"))?);
                }
            }
        }
        Ok(out)
    }

    /// llama.cpp's `tokenizer_st_partition`: split special token texts out of `text`, longest
    /// token first, every occurrence, honouring the lstrip/rstrip attributes.
    fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
        if text.is_empty() {
            return Vec::new();
        }
        let mut fragments = vec![Fragment::Text {
            start: 0,
            end: text.len(),
        }];
        for &id in &self.special_tokens {
            let attr = self.attrs[id as usize];
            if !parse_special && attr & (ATTR_CONTROL | ATTR_UNKNOWN) != 0 {
                continue;
            }
            let needle = self.tokens[id as usize].as_str();
            if !fragments.iter().any(
                |f| matches!(*f, Fragment::Text { start, end } if text[start..end].contains(needle)),
            ) {
                continue;
            }
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for f in fragments {
                let Fragment::Text { mut start, end } = f else {
                    next.push(f);
                    continue;
                };
                while let Some(rel) = text[start..end].find(needle) {
                    let at = start + rel;
                    let mut left_end = at;
                    if attr & ATTR_LSTRIP != 0 {
                        while left_end > start && is_c_space(text.as_bytes()[left_end - 1]) {
                            left_end -= 1;
                        }
                    }
                    if left_end > start {
                        next.push(Fragment::Text {
                            start,
                            end: left_end,
                        });
                    }
                    next.push(Fragment::Token(id));
                    start = at + needle.len();
                    if attr & ATTR_RSTRIP != 0 {
                        while start < end && is_c_space(text.as_bytes()[start]) {
                            start += 1;
                        }
                    }
                }
                if start < end {
                    next.push(Fragment::Text { start, end });
                }
            }
            fragments = next;
        }
        fragments
    }

    /// llama.cpp's `llm_tokenizer_spm_session::tokenize` on whitespace-escaped text: start from
    /// UTF-8 characters, repeatedly merge the adjacent pair whose concatenation is the
    /// highest-scoring vocabulary entry (leftmost on ties); symbols left that are not tokens
    /// become byte tokens.
    fn spm_tokenize(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        #[derive(Clone, Copy)]
        struct Symbol {
            prev: Option<usize>,
            next: Option<usize>,
            start: usize,
            len: usize,
        }
        struct Bigram {
            left: usize,
            right: usize,
            score: f32,
            size: usize,
        }
        impl PartialEq for Bigram {
            fn eq(&self, other: &Self) -> bool {
                self.cmp(other).is_eq()
            }
        }
        impl Eq for Bigram {}
        impl PartialOrd for Bigram {
            fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
                Some(self.cmp(other))
            }
        }
        impl Ord for Bigram {
            // Max-heap: higher score first, then the leftmost pair.
            fn cmp(&self, other: &Self) -> std::cmp::Ordering {
                self.score
                    .total_cmp(&other.score)
                    .then(other.left.cmp(&self.left))
            }
        }

        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (start, ch) in text.char_indices() {
            let i = symbols.len();
            symbols.push(Symbol {
                prev: i.checked_sub(1),
                next: None,
                start,
                len: ch.len_utf8(),
            });
            if i > 0 {
                symbols[i - 1].next = Some(i);
            }
        }

        let mut queue = BinaryHeap::new();
        let try_add = |queue: &mut BinaryHeap<Bigram>,
                       symbols: &[Symbol],
                       left: Option<usize>,
                       right: Option<usize>| {
            let (Some(left), Some(right)) = (left, right) else {
                return;
            };
            let start = symbols[left].start;
            let size = symbols[left].len + symbols[right].len;
            if let Some(&id) = self.token_to_id.get(&text[start..start + size]) {
                queue.push(Bigram {
                    left,
                    right,
                    score: self.scores[id as usize],
                    size,
                });
            }
        };
        for i in 1..symbols.len() {
            try_add(&mut queue, &symbols, Some(i - 1), Some(i));
        }
        while let Some(bigram) = queue.pop() {
            let (l, r) = (symbols[bigram.left], symbols[bigram.right]);
            // Stale: one side was merged into something else since this pair was queued.
            if l.len == 0 || r.len == 0 || l.len + r.len != bigram.size {
                continue;
            }
            symbols[bigram.left].len += r.len;
            symbols[bigram.right].len = 0;
            symbols[bigram.left].next = r.next;
            if let Some(next) = r.next {
                symbols[next].prev = Some(bigram.left);
            }
            let left = symbols[bigram.left];
            try_add(&mut queue, &symbols, left.prev, Some(bigram.left));
            try_add(&mut queue, &symbols, Some(bigram.left), left.next);
        }

        // Every merged symbol is a vocabulary entry; a symbol left as a single character may not
        // be (llama.cpp's `resegment`, whose reverse-merge branch cannot be reached for that
        // reason): emit its bytes as `<0xNN>` tokens.
        let mut cur = if symbols.is_empty() { None } else { Some(0) };
        while let Some(i) = cur {
            let s = symbols[i];
            let piece = &text[s.start..s.start + s.len];
            if let Some(&id) = self.token_to_id.get(piece) {
                out.push(id);
            } else {
                for &b in piece.as_bytes() {
                    out.push(self.byte_token(b).ok_or_else(|| TokenizerError::Encode {
                        text: text.replace('\u{2581}', " "),
                        reason: format!(
                            "the vocabulary has no byte token <0x{b:02X}> and no unknown token \
                             for {piece:?}"
                        ),
                    })?);
                }
            }
            cur = s.next;
        }
        Ok(())
    }

    /// llama.cpp's `byte_to_token` for SentencePiece vocabularies. Where llama.cpp would throw
    /// (no `<0xNN>` token and no single-byte token), toy uses the unknown token, as SentencePiece
    /// itself does.
    fn byte_token(&self, b: u8) -> Option<u32> {
        let hex = format!("<0x{b:02X}>");
        if let Some(&id) = self.token_to_id.get(&hex) {
            return Some(id);
        }
        if b.is_ascii()
            && let Some(&id) = self.token_to_id.get(&(b as char).to_string())
        {
            return Some(id);
        }
        self.unk
    }

    /// `llama_detokenize(ids, remove_special = false, unparse_special = true)` as text; bytes
    /// that do not form valid UTF-8 become U+FFFD. Ids outside the vocabulary render as nothing.
    pub fn decode(&self, ids: &[u32]) -> String {
        String::from_utf8_lossy(&self.detokenize(ids, false, true)).into_owned()
    }

    /// `llama_detokenize` as raw bytes. `remove_special` drops a leading BOS and a trailing EOS
    /// when the model adds them; `unparse_special` renders control tokens as their text (they
    /// render as nothing otherwise).
    pub fn detokenize(&self, ids: &[u32], remove_special: bool, unparse_special: bool) -> Vec<u8> {
        let mut ids = ids;
        // SentencePiece: the space added in front of the text is removed again.
        let mut remove_space = self.add_space_prefix;
        if remove_special && self.add_bos && !ids.is_empty() && ids.first() == self.bos.as_ref() {
            remove_space = false;
            ids = &ids[1..];
        }
        if remove_special && self.add_eos && ids.last().is_some() && ids.last() == self.eos.as_ref()
        {
            ids = &ids[..ids.len() - 1];
        }
        let mut text = Vec::new();
        for &id in ids {
            let skip = !unparse_special && self.attr(id) & (ATTR_CONTROL | ATTR_UNKNOWN) != 0;
            let mut piece = if skip { &[][..] } else { self.token_bytes(id) };
            if remove_space && piece.first() == Some(&b' ') {
                piece = &piece[1..];
            }
            remove_space = false;
            text.extend_from_slice(piece);
        }
        if self.clean_spaces {
            clean_up_spaces(&mut text);
        }
        text
    }
}

fn no_special(text: &str, which: &str) -> TokenizerError {
    TokenizerError::Encode {
        text: text.to_string(),
        reason: format!("the model asks for a {which} token but its vocabulary has none"),
    }
}

/// C's `isspace` in the "C" locale (what llama.cpp uses for lstrip/rstrip).
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}

/// GPT-2's byte-to-character table (every byte maps to a printable character).
fn byte_encoder() -> [char; 256] {
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

fn byte_decoder() -> HashMap<char, u8> {
    byte_encoder()
        .iter()
        .enumerate()
        .map(|(b, &c)| (c, b as u8))
        .collect()
}

/// `llama_token_to_piece(id, special = true)` for one token (llama.cpp's piece cache).
fn piece_for(is_bpe: bool, text: &str, attr: u32, byte_decoder: &HashMap<char, u8>) -> Vec<u8> {
    if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED) != 0 {
        return text.as_bytes().to_vec();
    }
    if attr & ATTR_NORMAL != 0 {
        if !is_bpe {
            return text.replace('\u{2581}', " ").into_bytes();
        }
        // Byte-level decoding; a character outside the byte map is rendered the way llama.cpp's
        // `llama_decode_text` does, so that the output stays identical even for broken vocabs.
        let mut out = Vec::with_capacity(text.len());
        for c in text.chars() {
            match byte_decoder.get(&c) {
                Some(&b) => out.push(b),
                None => {
                    out.extend_from_slice(b"[UNK_BYTE_0x");
                    let mut buf = [0u8; 4];
                    for b in c.encode_utf8(&mut buf).bytes() {
                        out.extend_from_slice(format!("{b:02x}").as_bytes());
                    }
                    out.extend_from_slice(text.as_bytes());
                    out.push(b']');
                }
            }
        }
        return out;
    }
    if attr & ATTR_BYTE != 0 {
        // `<0xNN>`: llama.cpp parses characters 3..5 with strtol (0 when they are not hex).
        let hex = text.get(3..5).unwrap_or("");
        let digits: String = hex.chars().take_while(|c| c.is_ascii_hexdigit()).collect();
        return vec![u8::from_str_radix(&digits, 16).unwrap_or(0)];
    }
    // Unused and undefined tokens render as nothing.
    Vec::new()
}

/// llama.cpp's `clean_up_tokenization_spaces` passes over detokenized bytes.
fn clean_up_spaces(text: &mut Vec<u8>) {
    // " ?", " !", " .", " ," lose the space.
    let mut out: Vec<u8> = Vec::with_capacity(text.len());
    for (i, &x) in text.iter().enumerate() {
        if i > 0 && text[i - 1] == b' ' && matches!(x, b'?' | b'!' | b'.' | b',') {
            out.pop();
        }
        out.push(x);
    }
    // " ' " becomes "'". llama.cpp overwrites the dropped space with NUL in place, so it no longer
    // counts as a space for the next character: do the same.
    let mut t = std::mem::take(&mut out);
    let mut i = 0;
    while i < t.len() {
        let x = t[i];
        if i > 0 && x == b'\'' && i + 1 < t.len() && t[i - 1] == b' ' && t[i + 1] == b' ' {
            out.pop();
            out.push(x);
            t[i + 1] = 0;
            i += 2;
            continue;
        }
        out.push(x);
        i += 1;
    }
    // " 's", " 'm", " 're", " 've" lose the space.
    let t = std::mem::take(&mut out);
    for (i, &x) in t.iter().enumerate() {
        if i > 0 && t[i - 1] == b' ' && x == b'\'' && i + 1 < t.len() {
            let x1 = t[i + 1];
            let x2 = t.get(i + 2).copied();
            let drop = matches!(x1, b's' | b'm')
                || (i + 2 < t.len() && matches!((x1, x2), (b'r', Some(b'e')) | (b'v', Some(b'e'))));
            if drop {
                out.pop();
            }
        }
        out.push(x);
    }
    *text = out;
}

/// The `tokenizers` pipeline for a byte-level BPE vocabulary: the pre-tokenizer regexes of
/// `spec`, GPT-2 byte encoding, and BPE with the GGUF merges.
fn build_byte_level_bpe(
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
fn pre_tokenizer(spec: &PreTokenizerSpec) -> Result<Sequence> {
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

/// Turns generated token ids into text as they come, holding back the bytes of a UTF-8 character
/// that is split across tokens until it completes (so every chunk is valid UTF-8, ready for
/// stdout or an SSE event). Pieces are `token_bytes` (control tokens as their text), with no
/// space cleanup — what llama.cpp's examples print while generating.
#[derive(Debug, Clone)]
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    pending: Vec<u8>,
}

impl<'a> StreamDecoder<'a> {
    pub fn new(tokenizer: &'a Tokenizer) -> Self {
        Self {
            tokenizer,
            pending: Vec::new(),
        }
    }

    /// Add one token; returns the text that is now complete (possibly empty).
    pub fn push(&mut self, id: u32) -> String {
        let tokenizer = self.tokenizer;
        self.push_bytes(tokenizer.token_bytes(id))
    }

    /// Add raw bytes; returns the text that is now complete (possibly empty).
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut rest: &[u8] = &self.pending;
        loop {
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    rest = &[];
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    // SAFETY-free: `valid_up_to` bytes are valid UTF-8 by definition.
                    out.push_str(std::str::from_utf8(&rest[..valid]).unwrap_or_default());
                    match e.error_len() {
                        // Invalid bytes (not a prefix of any character): never completable.
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            rest = &rest[valid + bad..];
                        }
                        // An incomplete character at the end: wait for the next token.
                        None => {
                            rest = &rest[valid..];
                            break;
                        }
                    }
                }
            }
        }
        let keep = rest.len();
        let drain_to = self.pending.len() - keep;
        self.pending.drain(..drain_to);
        out
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    /// End of stream: whatever is held back, with an incomplete character as U+FFFD.
    pub fn finish(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_a_bijection() {
        let enc = byte_encoder();
        let set: HashSet<char> = enc.iter().copied().collect();
        assert_eq!(set.len(), 256);
        assert_eq!(enc[b' ' as usize], 'Ġ');
        assert_eq!(enc[b'\n' as usize], 'Ċ');
        assert_eq!(enc[b'a' as usize], 'a');
    }

    #[test]
    fn clean_spaces_matches_llama_cpp_passes() {
        let mut t = b"Hello , world ! It ' s what they 're doing 'll".to_vec();
        clean_up_spaces(&mut t);
        assert_eq!(
            String::from_utf8(t).unwrap(),
            "Hello, world! It's what they're doing 'll"
        );
    }

    #[test]
    fn stream_decoder_holds_partial_characters() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fixtures/tokenizer/bpe-tiny.gguf");
        let tok = Tokenizer::from_gguf(&GgufFile::open(path).unwrap()).unwrap();
        let mut d = StreamDecoder::new(&tok);
        let crab = "🦀".as_bytes();
        assert_eq!(d.push_bytes(b"a "), "a ");
        assert_eq!(d.push_bytes(&crab[..1]), "");
        assert_eq!(d.push_bytes(&crab[1..3]), "");
        assert_eq!(d.pending().len(), 3);
        assert_eq!(d.push_bytes(&crab[3..]), "🦀");
        assert!(d.pending().is_empty());
        // An invalid byte is replaced, the valid text around it kept.
        assert_eq!(d.push_bytes(b"x\xffy"), "x\u{FFFD}y");
        // A truncated character at the end comes out as U+FFFD on finish.
        assert_eq!(d.push_bytes(&crab[..2]), "");
        assert_eq!(d.finish(), "\u{FFFD}");
        // Tokens of the tiny vocabulary are bytes 0..=255: push the crab byte by byte.
        let mut out = String::new();
        for &b in crab {
            out.push_str(&d.push(b as u32));
        }
        assert_eq!(out, "🦀");
    }

    #[test]
    fn byte_piece_parsing() {
        let dec = byte_decoder();
        assert_eq!(piece_for(false, "<0x0A>", ATTR_BYTE, &dec), vec![0x0a]);
        assert_eq!(piece_for(false, "<0xfF>", ATTR_BYTE, &dec), vec![0xff]);
        assert_eq!(piece_for(false, "▁hi", ATTR_NORMAL, &dec), b" hi".to_vec());
        assert_eq!(piece_for(true, "Ġhi", ATTR_NORMAL, &dec), b" hi".to_vec());
        assert_eq!(
            piece_for(true, "<|x|>", ATTR_CONTROL, &dec),
            b"<|x|>".to_vec()
        );
        assert!(piece_for(true, "[unused]", ATTR_UNUSED, &dec).is_empty());
    }

    /// Pieces of `text` after the pre-tokenizer of `pre`.
    fn pre_split(pre: &str, text: &str) -> Vec<String> {
        use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};
        let spec = PRE_TOKENIZERS
            .iter()
            .find(|s| s.names.contains(&pre))
            .unwrap();
        let mut pts = PreTokenizedString::from(text);
        pre_tokenizer(spec).unwrap().pre_tokenize(&mut pts).unwrap();
        pts.get_splits(OffsetReferential::Original, OffsetType::Byte)
            .into_iter()
            .map(|(_, (a, b), _)| text[a..b].to_string())
            .collect()
    }

    /// Splits worked out by hand from llama.cpp's regexes and its custom GPT-2 matcher.
    #[test]
    fn pre_tokenizer_splits() {
        let text = "Hello  world 12345 it's\n\nok!!";
        let cases: [(&str, &[&str]); 5] = [
            (
                "gpt-2",
                &[
                    "Hello", " ", " world", " 12345", " it", "'s", "\n", "\n", "ok", "!!",
                ],
            ),
            (
                "smollm",
                &[
                    "Hello", " ", " world", " ", "1", "2", "3", "4", "5", " it", "'s", "\n", "\n",
                    "ok", "!!",
                ],
            ),
            (
                "qwen2",
                &[
                    "Hello", " ", " world", " ", "1", "2", "3", "4", "5", " it", "'s", "\n\n",
                    "ok", "!!",
                ],
            ),
            (
                "llama-bpe",
                &[
                    "Hello", " ", " world", " ", "123", "45", " it", "'s", "\n\n", "ok", "!!",
                ],
            ),
            (
                "default",
                &[
                    "Hello", " ", " world", " ", "123", "45", " it", "'", "s", "\n", "\n", "ok",
                    "!!",
                ],
            ),
        ];
        for (pre, want) in cases {
            assert_eq!(pre_split(pre, text), want, "{pre}");
        }
        // Every regex toy lists compiles.
        for spec in PRE_TOKENIZERS {
            pre_tokenizer(spec).unwrap_or_else(|e| panic!("{:?}: {e}", spec.names));
        }
        // llama3: case-insensitive contractions, a non-letter glued to the following word.
        assert_eq!(
            pre_split("llama-bpe", "I'M (ok)"),
            ["I", "'M", " (", "ok", ")"]
        );
    }
}
