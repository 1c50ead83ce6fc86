//! A GGUF file from anywhere: parse and validate it, read every metadata value, build the model
//! configuration and the tokenizer it describes, dequantize every tensor, and write it back.
//!
//! Invariants beyond "no panic, no out-of-memory": every tensor toy accepts lies inside the
//! file and dequantizes to exactly its element count; a file toy reads, toy writes back in a
//! form it reads again, and writing that again gives the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use toy_core::config::ModelConfig;
use toy_core::gguf::{GgufFile, GgufWriter, tensor_to_f32};
use toy_core::tokenizer::Tokenizer;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes(data.to_vec()) else {
        return;
    };
    for (key, value) in &file.metadata {
        let _ = value.summary();
        let _ = (file.get_str(key), file.get_u64(key), file.get_f64(key));
        let _ = (file.get_bool(key), file.get_array(key));
    }
    let _ = file.architecture();
    if let Ok(config) = ModelConfig::from_gguf(&file) {
        let _ = (
            config.distinctive(),
            config.describe_ffn(),
            config.describe_rope(),
        );
    }
    if let Ok(tokenizer) = Tokenizer::from_gguf(&file) {
        if let Ok(ids) = tokenizer.encode("Hello, world! <|im_start|> 123", true, true) {
            let _ = tokenizer.decode(&ids);
        }
    }
    for info in &file.tensors {
        let bytes = file.tensor_data(info);
        assert_eq!(bytes.len() as u64, info.n_bytes(), "tensor {:?}", info.name);
        if let Ok(values) = tensor_to_f32(&file, info) {
            assert_eq!(
                values.len() as u64,
                info.n_elements(),
                "tensor {:?}",
                info.name
            );
        }
    }
    let write = |file: &GgufFile| {
        let writer = GgufWriter::from_file_with_tensors(file).expect("a file toy read copies");
        let mut out = Vec::new();
        writer.write_to(&mut out).expect("writing to memory");
        out
    };
    let first = write(&file);
    let again = GgufFile::from_bytes(first.clone()).expect("toy reads what it wrote");
    assert_eq!(again.tensors.len(), file.tensors.len());
    assert_eq!(write(&again), first, "a rewrite changed the bytes");
});
