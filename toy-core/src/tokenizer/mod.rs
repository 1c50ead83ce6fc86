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
//!
//! The parts, one job each: `vocab` reads the vocabulary, token attributes and special-token ids
//! from the metadata (and builds the [`Tokenizer`]); `bpe` holds llama.cpp's pre-tokenizer table
//! and builds the byte-level BPE pipeline; `sentencepiece` is the SentencePiece merge loop;
//! `special` splits special tokens out of the text; `pieces` renders tokens as bytes and cleans
//! up detokenized text; `stream` is the [`StreamDecoder`].

mod bpe;
mod pieces;
mod sentencepiece;
mod special;
mod stream;
mod vocab;

#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet};
use std::fmt;

use crate::gguf::GgufError;

use self::pieces::clean_up_spaces;
use self::special::Fragment;
use self::vocab::{ATTR_CONTROL, ATTR_UNDEFINED, ATTR_UNKNOWN};

pub use self::stream::StreamDecoder;

/// Everything that can go wrong when building a tokenizer from GGUF metadata or encoding text.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A required tokenizer metadata key, named here, is absent: the file has no vocabulary.
    #[error(
        "the GGUF file has no tokenizer (metadata key {0:?} is missing); it cannot turn text into \
         tokens — use a GGUF converted with its vocabulary (llama.cpp's convert_hf_to_gguf.py \
         writes one)"
    )]
    MissingKey(&'static str),
    /// A `tokenizer.ggml.model` other than "gpt2" and "llama".
    #[error(
        "tokenizer model {0:?} is not supported; toy reads \"gpt2\" (byte-level BPE) and \"llama\" \
         (SentencePiece) vocabularies"
    )]
    UnsupportedModel(String),
    /// A `tokenizer.ggml.pre`, `pre`, that toy does not know; `supported` lists those it does.
    #[error(
        "pre-tokenizer {pre:?} (tokenizer.ggml.pre) is not supported; supported: {supported}. \
         toy refuses to guess because a wrong pre-tokenizer silently changes the token ids"
    )]
    UnsupportedPre {
        /// The `tokenizer.ggml.pre` value of the file.
        pre: String,
        /// The values toy supports, comma-separated.
        supported: String,
    },
    /// Malformed or inconsistent tokenizer metadata, or a BPE pipeline that cannot be built.
    #[error("bad tokenizer metadata: {0}")]
    Invalid(String),
    /// A GGUF error while reading the tokenizer metadata, such as a key of the wrong type.
    #[error("bad tokenizer metadata: {0}")]
    Gguf(#[from] GgufError),
    /// `text` could not be tokenized; `reason` says why.
    #[error("cannot encode {text:?}: {reason}")]
    Encode {
        /// The text, or the piece of it, that failed.
        text: String,
        /// Why it could not be tokenized.
        reason: String,
    },
}

/// This module's result type, failing with `TokenizerError` by default.
pub type Result<T, E = TokenizerError> = std::result::Result<T, E>;

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

impl Tokenizer {
    /// A human name for `describe`: "byte-level BPE (smollm)" or "SentencePiece".
    pub fn kind(&self) -> String {
        match &self.model {
            Model::ByteLevelBpe { pre, .. } => format!("byte-level BPE ({pre})"),
            Model::SentencePiece => "SentencePiece".to_string(),
        }
    }

    /// Number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The beginning-of-sequence token, if the vocabulary has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// The end-of-sequence token, if the vocabulary has one.
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

    /// The unknown token, if the vocabulary has one.
    pub fn unknown_id(&self) -> Option<u32> {
        self.unk
    }

    /// The padding token, if the metadata names one.
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

    /// `tokenizer.chat_template`, if the file has one (or the one set by
    /// [`Self::set_chat_template`]).
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Use `template` as the chat template instead of the file's (`--chat-template-file`: a
    /// model without one, or a fixed one).
    pub fn set_chat_template(&mut self, template: String) {
        self.chat_template = Some(template);
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
