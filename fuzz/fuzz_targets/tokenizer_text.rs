//! Arbitrary text through real tokenizers: the bundled corpus's byte-level BPE (`tokenizers`-
//! trained, every byte in its alphabet) and the SentencePiece fixture. Byte-level BPE must give
//! the text back exactly from its ids' pieces; SentencePiece must not panic, and its ids must be in the
//! vocabulary. The first input byte picks the tokenizer and the flags.
#![no_main]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use toy_core::gguf::GgufFile;
use toy_core::tokenizer::Tokenizer;

fn load(bytes: &[u8]) -> Tokenizer {
    let file = GgufFile::from_bytes(bytes.to_vec()).expect("fixture parses");
    Tokenizer::from_gguf(&file).expect("fixture tokenizer builds")
}

static BPE: LazyLock<Tokenizer> =
    LazyLock::new(|| load(include_bytes!("../../fixtures/corpus/tokenizer.gguf")));
static SPM: LazyLock<Tokenizer> =
    LazyLock::new(|| load(include_bytes!("../../fixtures/tokenizer/spm-tiny.gguf")));

fuzz_target!(|data: &[u8]| {
    let Some((&flags, text)) = data.split_first() else {
        return;
    };
    let text = String::from_utf8_lossy(text);
    let bpe = flags & 1 == 0;
    let (add_special, parse_special) = (flags & 2 != 0, flags & 4 != 0);
    let tokenizer = if bpe { &*BPE } else { &*SPM };
    let Ok(ids) = tokenizer.encode(&text, add_special, parse_special) else {
        return;
    };
    let n = tokenizer.vocab_size() as u32;
    assert!(ids.iter().all(|&id| id < n), "an id outside the vocabulary");
    // The pieces themselves (before llama.cpp's optional clean-up of spaces before punctuation,
    // which `detokenize` applies as llama.cpp does) give back every byte of the text.
    let pieces: Vec<u8> = ids
        .iter()
        .flat_map(|&id| tokenizer.token_bytes(id).iter().copied())
        .collect();
    if bpe && !add_special && !parse_special {
        assert_eq!(pieces, text.as_bytes(), "byte-level BPE lost text");
    }
    let _ = tokenizer.detokenize(&ids, true, parse_special);
    // Streamed decoding (what `toy serve` sends), a token at a time, gives the same text as the
    // pieces decoded at once: a character split across tokens is held back, not mangled.
    let mut stream = toy_core::tokenizer::StreamDecoder::new(tokenizer);
    let mut streamed = String::new();
    for &id in &ids {
        streamed.push_str(&stream.push(id));
    }
    streamed.push_str(&stream.finish());
    assert_eq!(
        streamed,
        String::from_utf8_lossy(&pieces),
        "streamed text differs"
    );
});
