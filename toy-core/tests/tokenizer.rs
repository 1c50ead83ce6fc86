//! The tokenizer against llama.cpp's own output on SmolLM2 (fixtures/smollm2/tokenize.json), a
//! SentencePiece vocabulary trained for the purpose (fixtures/tokenizer/), and the errors a user
//! can cause.

use std::path::{Path, PathBuf};

use serde_json::Value as Json;
use toy_core::gguf::GgufFile;
use toy_core::tokenizer::{StreamDecoder, Tokenizer, TokenizerError};

#[path = "../../test-support/smollm2.rs"]
mod smollm2_path;

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("workspace root")
        .to_path_buf()
}

fn read_json(path: &Path) -> Json {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("bad JSON in {}: {e}", path.display()))
}

/// The real SmolLM2 model's tokenizer.
fn smollm2() -> Tokenizer {
    let path = smollm2_path::smollm2("Q4_1");
    let file = GgufFile::open(&path).expect("open SmolLM2 GGUF");
    Tokenizer::from_gguf(&file).expect("SmolLM2 tokenizer")
}

fn ids(v: &Json) -> Vec<u32> {
    v.as_array()
        .expect("array of ids")
        .iter()
        .map(|x| u32::try_from(x.as_u64().expect("id")).expect("id fits u32"))
        .collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

#[test]
fn smollm2_matches_llama_cpp_on_every_case() {
    let tok = smollm2();
    let oracle = read_json(&repo_root().join("fixtures/smollm2/tokenize.json"));
    let cases = oracle["cases"].as_array().expect("cases");
    assert!(
        cases.len() >= 28,
        "expected the 28 oracle cases, found {}",
        cases.len()
    );

    let mut failures = Vec::new();
    for case in cases {
        let name = case["name"].as_str().expect("name");
        let text = case["text"].as_str().expect("text");

        let got = tok.encode(text, true, true).expect("encode");
        let want = ids(&case["ids"]);
        if got != want {
            failures.push(format!(
                "{name}: parse_special=true\n  got  {got:?}\n  want {want:?}"
            ));
        }

        let got = tok.encode(text, true, false).expect("encode");
        let want = ids(&case["ids_parse_special_false"]);
        if got != want {
            failures.push(format!(
                "{name}: parse_special=false\n  got  {got:?}\n  want {want:?}"
            ));
        }

        let want_ids = ids(&case["ids"]);
        let pieces: Vec<Vec<u8>> = case["pieces_hex"]
            .as_array()
            .unwrap()
            .iter()
            .map(|h| unhex(h.as_str().unwrap()))
            .collect();
        for (id, want) in want_ids.iter().zip(&pieces) {
            if tok.token_bytes(*id) != want.as_slice() {
                failures.push(format!(
                    "{name}: piece of {id} is {:02x?}, llama.cpp {:02x?}",
                    tok.token_bytes(*id),
                    want
                ));
            }
        }

        let decoded = tok.decode(&want_ids);
        if decoded != case["decoded"].as_str().unwrap() {
            failures.push(format!(
                "{name}: decoded {decoded:?}, llama.cpp {:?}",
                case["decoded"]
            ));
        }
        let removed = String::from_utf8_lossy(&tok.detokenize(&want_ids, true, false)).into_owned();
        if removed != case["decoded_remove_special"].as_str().unwrap() {
            failures.push(format!(
                "{name}: decoded (remove_special, no unparse) {removed:?}, llama.cpp {:?}",
                case["decoded_remove_special"]
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn smollm2_metadata() {
    let tok = smollm2();
    let oracle = read_json(&repo_root().join("fixtures/smollm2/tokenize.json"));
    let info = &oracle["tokenizer"];
    assert_eq!(
        tok.vocab_size() as u64,
        info["vocab_size"].as_u64().unwrap()
    );
    assert_eq!(tok.bos_id().map(u64::from), info["bos_id"].as_u64());
    assert_eq!(tok.eos_id().map(u64::from), info["eos_id"].as_u64());
    assert_eq!(tok.adds_bos(), info["add_bos"].as_bool().unwrap());
    assert_eq!(tok.adds_eos(), info["add_eos"].as_bool().unwrap());
    assert_eq!(tok.padding_id(), Some(2));
    assert_eq!(tok.kind(), "byte-level BPE (smollm)");
    // llama.cpp's end-of-generation set: <|endoftext|>, <|im_end|>, and <reponame> (found as the
    // FIM repo token by its text).
    assert_eq!(tok.eog_ids(), vec![0, 2, 4]);
    assert!(tok.is_eog(2) && tok.is_eog(0) && tok.is_eog(4) && !tok.is_eog(1) && !tok.is_eog(3));
    for special in info["special_tokens"].as_array().unwrap() {
        let id = special["id"].as_u64().unwrap() as u32;
        assert_eq!(tok.token_text(id), special["text"].as_str().unwrap());
        assert_eq!(tok.token_id(special["text"].as_str().unwrap()), Some(id));
        assert!(tok.is_control(id));
    }
    assert_eq!(tok.chat_template(), info["chat_template"].as_str());
    // Out-of-range ids never panic.
    assert_eq!(tok.token_text(u32::MAX), "");
    assert!(tok.token_bytes(u32::MAX).is_empty());
    assert_eq!(tok.decode(&[19556, u32::MAX, 905]), "Hello world");
}

/// Streaming must hand out only whole characters even when a character spans tokens, and the
/// concatenated chunks must equal the full decode.
#[test]
fn smollm2_stream_decode_emoji_and_cjk() {
    let tok = smollm2();
    for text in [
        "I love 🦀 and 🐍! 👍🏽❤️",
        "你好，世界。日本語のテキスト。한국어 문장",
        "Ångström → €100",
    ] {
        let ids = tok.encode(text, false, false).unwrap();
        // The point of the test: some token must end inside a character.
        assert!(
            ids.iter()
                .any(|&id| std::str::from_utf8(tok.token_bytes(id)).is_err()),
            "{text:?} no longer splits a character across tokens; pick another string"
        );
        let mut dec = StreamDecoder::new(&tok);
        let mut streamed = String::new();
        let mut chunks = 0;
        for &id in &ids {
            let chunk = dec.push(id);
            assert!(
                !chunk.contains('\u{FFFD}'),
                "partial character leaked for {text:?}: {chunk:?}"
            );
            if !chunk.is_empty() {
                chunks += 1;
            }
            streamed.push_str(&chunk);
        }
        assert!(dec.pending().is_empty());
        assert_eq!(dec.finish(), "");
        assert_eq!(streamed, text);
        assert_eq!(streamed, tok.decode(&ids));
        assert!(chunks < ids.len(), "some tokens must have been held back");
    }
}

#[test]
fn smollm2_special_tokens_parse_or_not() {
    let tok = smollm2();
    // Texts of special tokens are split out with parse_special and spelled out without it.
    let text = "<|im_start|>assistant\n<|im_end|><|endoftext|>";
    let mut want = vec![1];
    want.extend(tok.encode("assistant\n", false, false).unwrap());
    want.extend([2, 0]);
    assert_eq!(tok.encode(text, false, true).unwrap(), want);
    let plain = tok.encode(text, false, false).unwrap();
    assert!(!plain.contains(&1) && !plain.contains(&2) && !plain.contains(&0));
    assert_eq!(tok.decode(&plain), text);
    // Adjacent and repeated special tokens.
    assert_eq!(
        tok.encode("<|im_end|><|im_end|>", false, true).unwrap(),
        vec![2, 2]
    );
}

fn fixture_gguf(name: &str) -> GgufFile {
    let path = repo_root().join("fixtures/tokenizer").join(name);
    GgufFile::open(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (regenerate with fixtures/tokenizer/make_fixtures.py)",
            path.display()
        )
    })
}

#[test]
fn sentencepiece_matches_sentencepiece_and_llama_cpp_rules() {
    let file = fixture_gguf("spm-tiny.gguf");
    let tok = Tokenizer::from_gguf(&file).expect("SentencePiece tokenizer");
    assert_eq!(tok.kind(), "SentencePiece");
    let expected = read_json(&repo_root().join("fixtures/tokenizer/spm-tiny.expected.json"));
    assert_eq!(
        tok.vocab_size() as u64,
        expected["vocab_size"].as_u64().unwrap()
    );
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_id(), Some(2));
    assert_eq!(tok.unknown_id(), Some(0));
    assert!(tok.adds_bos() && !tok.adds_eos());
    assert_eq!(tok.eog_ids(), vec![2]);

    let cases = expected["cases"].as_array().unwrap();
    assert!(cases.len() >= 10);
    let mut failures = Vec::new();
    let mut byte_fallback_seen = false;
    for case in cases {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        let got = tok
            .encode(
                text,
                case["add_special"].as_bool().unwrap(),
                case["parse_special"].as_bool().unwrap(),
            )
            .unwrap();
        if got != want {
            failures.push(format!("{text:?}: got {got:?}, want {want:?}"));
        }
        byte_fallback_seen |= want.iter().any(|&id| tok.token_text(id).starts_with("<0x"));
        if let Some(decoded) = case.get("decoded").and_then(Json::as_str) {
            let got = tok.decode(&want);
            if got != decoded {
                failures.push(format!("{text:?}: decoded {got:?}, want {decoded:?}"));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert!(
        byte_fallback_seen,
        "the fixture must exercise <0xNN> byte fallback"
    );
}

#[test]
fn sentencepiece_stream_decode_byte_tokens() {
    let file = fixture_gguf("spm-tiny.gguf");
    let tok = Tokenizer::from_gguf(&file).unwrap();
    // Characters unseen in training come out as <0xNN> byte tokens, one byte each.
    let text = "snow ☃ and 🦀";
    let ids = tok.encode(text, false, false).unwrap();
    let mut dec = StreamDecoder::new(&tok);
    let mut out = String::new();
    for &id in &ids {
        out.push_str(&dec.push(id));
    }
    out.push_str(&dec.finish());
    // Streaming keeps the space the SentencePiece prefix added; decode removes it.
    assert_eq!(out, format!(" {text}"));
    assert_eq!(tok.decode(&ids), text);
}

#[test]
fn unknown_pre_tokenizer_is_refused_with_the_list() {
    let file = fixture_gguf("bpe-unknown-pre.gguf");
    let err = Tokenizer::from_gguf(&file).unwrap_err();
    assert!(
        matches!(err, TokenizerError::UnsupportedPre { ref pre, .. } if pre == "no-such-pre"),
        "{err:?}"
    );
    let msg = err.to_string();
    for name in [
        "no-such-pre",
        "smollm",
        "llama-bpe",
        "qwen2",
        "gpt-2",
        "default",
    ] {
        assert!(msg.contains(name), "message should mention {name}: {msg}");
    }
}

#[test]
fn gguf_without_tokenizer_is_a_clear_error() {
    let file = fixture_gguf("no-tokenizer.gguf");
    let err = Tokenizer::from_gguf(&file).unwrap_err();
    assert!(
        matches!(err, TokenizerError::MissingKey("tokenizer.ggml.model")),
        "{err:?}"
    );
    assert!(err.to_string().contains("no tokenizer"), "{err}");
}

#[test]
fn small_byte_level_bpe_fixture() {
    // A hand-made gpt2 vocabulary with a user-defined token, checked against ids computed by
    // hand in the fixture script.
    let file = fixture_gguf("bpe-tiny.gguf");
    let tok = Tokenizer::from_gguf(&file).expect("tiny BPE");
    let expected = read_json(&repo_root().join("fixtures/tokenizer/bpe-tiny.expected.json"));
    assert_eq!(
        tok.kind(),
        format!("byte-level BPE ({})", expected["pre"].as_str().unwrap())
    );
    for case in expected["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let got = tok
            .encode(
                text,
                case["add_special"].as_bool().unwrap(),
                case["parse_special"].as_bool().unwrap(),
            )
            .unwrap();
        assert_eq!(got, ids(&case["ids"]), "{text:?}");
        assert_eq!(
            tok.decode(&got),
            case["decoded"].as_str().unwrap(),
            "{text:?}"
        );
    }
}

/// SmolLM2's template, read from the GGUF, renders as jinja2 renders it (fixtures/chat), and the
/// rendered prompt tokenizes into its chat markers.
#[test]
fn smollm2_chat_template_from_gguf() {
    use toy_core::chat::{ChatMessage, render};
    let tok = smollm2();
    let template = tok.chat_template().expect("SmolLM2 ships a chat template");
    let fixture = read_json(&repo_root().join("fixtures/chat/cases.json"));
    assert_eq!(fixture["templates"]["smollm2"].as_str(), Some(template));
    let mut checked = 0;
    for case in fixture["cases"].as_array().unwrap() {
        if case["template"] != "smollm2" {
            continue;
        }
        let messages: Vec<ChatMessage> = serde_json::from_value(
            fixture["conversations"][case["conversation"].as_str().unwrap()].clone(),
        )
        .unwrap();
        let agp = case["add_generation_prompt"].as_bool().unwrap();
        let got = render(template, &messages, agp, "", "").expect("render");
        assert_eq!(Some(got.as_str()), case["expected"].as_str(), "{case}");
        checked += 1;
    }
    assert_eq!(checked, 10);

    let prompt = render(template, &[ChatMessage::new("user", "Hi")], true, "", "").unwrap();
    let ids = tok.encode(&prompt, true, true).unwrap();
    // system turn, user turn, assistant header: three <|im_start|>, two <|im_end|>.
    assert_eq!(ids[0], 1);
    assert_eq!(ids.iter().filter(|&&t| t == 1).count(), 3);
    assert_eq!(ids.iter().filter(|&&t| t == 2).count(), 2);
    assert_eq!(tok.decode(&ids), prompt);
}
