//! What tokens render as: the piece of every token (llama.cpp's piece cache,
//! `llama_token_to_piece`) and the `clean_up_tokenization_spaces` pass over detokenized bytes.

use std::collections::HashMap;

use super::vocab::{ATTR_BYTE, ATTR_CONTROL, ATTR_NORMAL, ATTR_UNKNOWN, ATTR_USER_DEFINED};

/// `llama_token_to_piece(id, special = true)` for one token (llama.cpp's piece cache).
pub(super) fn piece_for(
    is_bpe: bool,
    text: &str,
    attr: u32,
    byte_decoder: &HashMap<char, u8>,
) -> Vec<u8> {
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
pub(super) fn clean_up_spaces(text: &mut Vec<u8>) {
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
