//! Splitting special tokens (control, user-defined, unknown) out of the text before the model
//! runs, with llama.cpp's partition and its lstrip/rstrip handling.

use super::Tokenizer;
use super::vocab::{ATTR_CONTROL, ATTR_LSTRIP, ATTR_RSTRIP, ATTR_UNKNOWN};

/// A piece of text being tokenized: raw text (a byte range of the input) or a special token.
#[derive(Debug, Clone, Copy)]
pub(super) enum Fragment {
    Text { start: usize, end: usize },
    Token(u32),
}

impl Tokenizer {
    /// llama.cpp's `tokenizer_st_partition`: split special token texts out of `text`, longest
    /// token first, every occurrence, honouring the lstrip/rstrip attributes.
    pub(super) fn partition(&self, text: &str, parse_special: bool) -> Vec<Fragment> {
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
}

/// C's `isspace` in the "C" locale (what llama.cpp uses for lstrip/rstrip).
fn is_c_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r')
}
