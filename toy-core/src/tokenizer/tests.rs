//! Unit tests of the tokenizer's internals (byte tables, pieces, space cleanup, pre-tokenizer
//! splits, the streaming decoder).

use super::bpe::{PRE_TOKENIZERS, byte_decoder, byte_encoder, pre_tokenizer};
use super::pieces::piece_for;
use super::vocab::{ATTR_BYTE, ATTR_CONTROL, ATTR_NORMAL, ATTR_UNUSED};
use super::*;
use crate::gguf::GgufFile;
use std::collections::HashSet;

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
                "Hello", " ", " world", " ", "1", "2", "3", "4", "5", " it", "'s", "\n\n", "ok",
                "!!",
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
                "Hello", " ", " world", " ", "123", "45", " it", "'", "s", "\n", "\n", "ok", "!!",
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
