//! Reading a GGUF vocabulary: token texts, scores and types, the attributes llama.cpp derives
//! from them, and the special-token ids (BOS/EOS/EOT/FIM …, found by metadata key or by text) and
//! the end-of-generation set. [`Tokenizer::from_gguf`] lives here.

use std::collections::{HashMap, HashSet};

use crate::gguf::GgufFile;

use super::bpe::{PRE_TOKENIZERS, build_byte_level_bpe, byte_decoder, supported_pre_list};
use super::pieces::piece_for;
use super::{Model, Result, Tokenizer, TokenizerError};

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
pub(super) const ATTR_UNDEFINED: u32 = 0;
pub(super) const ATTR_UNKNOWN: u32 = 1 << 0;
pub(super) const ATTR_UNUSED: u32 = 1 << 1;
pub(super) const ATTR_NORMAL: u32 = 1 << 2;
pub(super) const ATTR_CONTROL: u32 = 1 << 3;
pub(super) const ATTR_USER_DEFINED: u32 = 1 << 4;
pub(super) const ATTR_BYTE: u32 = 1 << 5;
pub(super) const ATTR_LSTRIP: u32 = 1 << 7;
pub(super) const ATTR_RSTRIP: u32 = 1 << 8;

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
}
