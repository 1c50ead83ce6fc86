//! [`StreamDecoder`]: generated token ids to text as they come, one valid UTF-8 chunk at a time.

use super::Tokenizer;

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
    /// A decoder for ids of `tokenizer`, with nothing held back.
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
