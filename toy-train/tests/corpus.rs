//! The bundled corpus and tokenizer (`fixtures/corpus/`): toy's tokenizer built from the GGUF
//! gives the ids of the `tokenizers` library that trained it, and round-trips the whole corpus.

use std::path::PathBuf;

use toy_core::gguf::GgufFile;
use toy_core::tokenizer::Tokenizer;

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fixtures/corpus")
}

fn tokenizer() -> Tokenizer {
    let file = GgufFile::open(corpus_dir().join("tokenizer.gguf")).unwrap();
    Tokenizer::from_gguf(&file).unwrap()
}

#[test]
fn bundled_tokenizer_matches_hf_tokenizers() {
    let tok = tokenizer();
    assert_eq!(tok.vocab_size(), 828);
    assert_eq!(tok.bos_id(), Some(0));
    assert_eq!(tok.eos_id(), Some(0));
    assert!(tok.adds_bos());
    assert_eq!(tok.token_text(0), "<|endoftext|>");
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(corpus_dir().join("tokenizer.expected.json")).unwrap(),
    )
    .unwrap();
    for case in expected["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(tok.encode(text, true, true).unwrap(), want, "{text:?}");
    }
}

#[test]
fn bundled_corpus_round_trips() {
    let tok = tokenizer();
    let text = std::fs::read_to_string(corpus_dir().join("stories.txt")).unwrap();
    let ids = tok.encode(&text, false, true).unwrap();
    let expected: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(corpus_dir().join("tokenizer.expected.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        ids.len() as u64,
        expected["corpus_tokens"].as_u64().unwrap()
    );
    // Stories are separated by the end-of-text token, parsed as one special token.
    assert_eq!(ids.iter().filter(|&&i| i == 0).count(), 500);
    assert_eq!(tok.decode(&ids), text);
}
