//! A hostile vocabulary: tokens, scores, types, merges, special ids and flags as a GGUF file
//! would carry them, built into a tokenizer and used to encode and decode hostile text.
//! Invariants: building fails with an error or succeeds; every id it encodes to is inside the
//! vocabulary; decoding any ids (in or out of the vocabulary) does not panic.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use toy_core::gguf::{GgufFile, GgufWriter, Value, ValueType};
use toy_core::tokenizer::Tokenizer;

#[derive(Debug, Arbitrary)]
struct Vocab {
    bpe: bool,
    pre: Option<String>,
    tokens: Vec<String>,
    scores: Option<Vec<f32>>,
    types: Option<Vec<i32>>,
    merges: Option<Vec<String>>,
    ids: Vec<(u8, u32)>,
    flags: Vec<(u8, bool)>,
    text: String,
    decode: Vec<u32>,
}

const ID_KEYS: [&str; 6] = ["bos", "eos", "unknown", "padding", "eot", "eom"];
const FLAG_KEYS: [&str; 3] = ["add_bos_token", "add_eos_token", "add_space_prefix"];

fn strings(v: &[String]) -> Value {
    Value::Array(
        ValueType::String,
        v.iter().cloned().map(Value::String).collect(),
    )
}

fuzz_target!(|v: Vocab| {
    let mut w = GgufWriter::new();
    let mut set = |key: String, value: Value| w.set(key, value).expect("a valid key");
    set("general.architecture".into(), Value::String("llama".into()));
    let model = if v.bpe { "gpt2" } else { "llama" };
    set("tokenizer.ggml.model".into(), Value::String(model.into()));
    if let Some(pre) = &v.pre {
        set("tokenizer.ggml.pre".into(), Value::String(pre.clone()));
    }
    set("tokenizer.ggml.tokens".into(), strings(&v.tokens));
    if let Some(scores) = &v.scores {
        let scores = scores.iter().map(|&s| Value::F32(s)).collect();
        set(
            "tokenizer.ggml.scores".into(),
            Value::Array(ValueType::F32, scores),
        );
    }
    if let Some(types) = &v.types {
        let types = types.iter().map(|&t| Value::I32(t)).collect();
        set(
            "tokenizer.ggml.token_type".into(),
            Value::Array(ValueType::I32, types),
        );
    }
    if let Some(merges) = &v.merges {
        set("tokenizer.ggml.merges".into(), strings(merges));
    }
    for &(key, id) in &v.ids {
        let key = ID_KEYS[key as usize % ID_KEYS.len()];
        set(format!("tokenizer.ggml.{key}_token_id"), Value::U32(id));
    }
    for &(key, on) in &v.flags {
        let key = FLAG_KEYS[key as usize % FLAG_KEYS.len()];
        set(format!("tokenizer.ggml.{key}"), Value::Bool(on));
    }
    let mut bytes = Vec::new();
    w.write_to(&mut bytes).expect("writing to memory");
    let file = GgufFile::from_bytes(bytes).expect("toy reads what it wrote");
    let Ok(tokenizer) = Tokenizer::from_gguf(&file) else {
        return;
    };
    let n = tokenizer.vocab_size() as u32;
    for (add_special, parse_special) in [(false, false), (true, true)] {
        if let Ok(ids) = tokenizer.encode(&v.text, add_special, parse_special) {
            assert!(ids.iter().all(|&id| id < n), "an id outside the vocabulary");
            let _ = tokenizer.decode(&ids);
        }
    }
    let _ = tokenizer.detokenize(&v.decode, true, false);
    let _ = tokenizer.decode(&v.decode);
});
