//! SentencePiece (`llama` vocabularies) as llama.cpp runs it: merge adjacent symbols, highest
//! score first, then fall back to `<0xNN>` byte tokens.

use std::collections::BinaryHeap;

use super::{Result, Tokenizer, TokenizerError};

impl Tokenizer {
    /// llama.cpp's `llm_tokenizer_spm_session::tokenize` on whitespace-escaped text: start from
    /// UTF-8 characters, repeatedly merge the adjacent pair whose concatenation is the
    /// highest-scoring vocabulary entry (leftmost on ties); symbols left that are not tokens
    /// become byte tokens.
    pub(super) fn spm_tokenize(&self, text: &str, out: &mut Vec<u32>) -> Result<()> {
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
}
