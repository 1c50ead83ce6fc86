//! The `toy` binary end to end: outputs against llama.cpp's oracle, and bad input that must end
//! in a one-line error (non-zero exit, no panic, no huge allocation).

mod common;
#[path = "../../test-support/tmpfs.rs"]
mod tmpfs;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::{root, smollm2, toy};
use serde_json::Value;
use sha2::{Digest, Sha256};
use tmpfs::Tmpfs;
use toy_core::gguf::{GgmlType, GgufFile, GgufWriter, Value as GgufValue};

fn model(kind: &str) -> String {
    smollm2(kind).to_string_lossy().into_owned()
}

fn oracle(name: &str) -> Value {
    serde_json::from_str(
        &std::fs::read_to_string(root().join("fixtures/smollm2").join(name)).unwrap(),
    )
    .unwrap()
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cli-tests");
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// A failed run: non-zero exit, exactly one line on stderr starting with `error:` that mentions
/// `needle`, and no panic.
fn assert_clean_error(out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "expected failure, got success; stderr: {stderr}"
    );
    assert_eq!(out.status.code(), Some(1), "exit code; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "panic: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "want one line, got: {stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    assert!(
        lines[0].to_lowercase().contains(&needle.to_lowercase()),
        "{:?} does not mention {needle:?}",
        lines[0]
    );
}

#[test]
fn infer_json_greedy_matches_llama_cpp() {
    let case = &oracle("greedy.json")["results"]["Q8_0"][0];
    let out = toy(&[
        "infer",
        &model("Q8_0"),
        "-p",
        case["prompt"].as_str().unwrap(),
        "-n",
        "16",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // stdout holds only the JSON object.
    let v: Value = serde_json::from_slice(&out.stdout).expect("stdout is one JSON object");
    assert_eq!(ids(&v["prompt_ids"]), ids(&case["prompt_ids"]));
    assert_eq!(ids(&v["ids"]), ids(&case["gen_ids"])[..16]);
    assert!(v["text"].as_str().unwrap().starts_with(" Paris."));
    assert!(
        v["prompt_tokens_per_s"].as_f64().unwrap() > 0.0
            && v["gen_tokens_per_s"].as_f64().unwrap() > 0.0
    );
}

#[test]
fn infer_streams_text_and_stops_at_eog() {
    // Greedy on the original Q4_1 file, llama.cpp ends this answer with <|im_end|> at step 29
    // (oracle first_eog_index): without --ignore-eos, toy must print exactly the text before it.
    let case = &oracle("greedy.json")["results"]["Q4_1"][0];
    assert_eq!(case["first_eog_index"], 29);
    let prompt = case["prompt"].as_str().unwrap();
    let out = toy(&[
        "infer",
        &model("Q4_1"),
        "-p",
        prompt,
        "-n",
        "40",
        "--temperature",
        "0",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(
        text.trim_end(),
        case["gen_text_until_eog"].as_str().unwrap().trim_end()
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("generation: 29 tokens"),
        "speed line: {stderr}"
    );
}

#[test]
fn infer_seed_makes_sampling_repeatable() {
    let run = |seed: &str| {
        let out = toy(&[
            "infer",
            &model("Q8_0"),
            "-p",
            "Once upon a time",
            "-n",
            "12",
            "--seed",
            seed,
            "--json",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        ids(&serde_json::from_slice::<Value>(&out.stdout).unwrap()["ids"])
    };
    assert_eq!(run("42"), run("42"));
}

#[test]
fn tokenize_matches_llama_tokenize() {
    let cases = oracle("tokenize.json");
    for case in cases["cases"].as_array().unwrap().iter().take(12) {
        let text = case["text"].as_str().unwrap();
        if text.is_empty() {
            continue; // clap needs a value; covered by the library tests
        }
        let out = toy(&["tokenize", &model("Q4_1"), text, "--json"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            ids(&v["ids"]),
            ids(&case["llama_tokenize_cli_ids"]),
            "{text:?}"
        );
    }
}

#[test]
fn describe_reports_the_card() {
    let out = toy(&["describe", &model("Q4_1"), "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["architecture"], "llama");
    assert_eq!(v["parameters"], 134_515_008u64); // as transformers counts them (hf_reference.json)
    assert_eq!(
        (
            v["layers"].as_u64(),
            v["heads"].as_u64(),
            v["kv_heads"].as_u64()
        ),
        (Some(30), Some(9), Some(3))
    );
    assert_eq!(
        (v["head_dim"].as_u64(), v["vocab_size"].as_u64()),
        (Some(64), Some(49152))
    );
    assert_eq!(v["tensor_types"]["Q4_1"]["tensors"], 210);
    assert_eq!(v["tensor_types"]["Q8_0"]["tensors"], 1);
    assert!(v["tokenizer"].as_str().unwrap().contains("smollm"));
}

/// `toy convert` writes exactly the bytes gguf-py writes (the oracle's derive.py files).
#[test]
fn convert_is_byte_identical_to_gguf_py() {
    let meta = oracle("greedy.json");
    for (to, kind) in [("q8_0", "Q8_0"), ("f32", "F32")] {
        let out_path = scratch(&format!("convert.{kind}.gguf"));
        let out = toy(&[
            "convert",
            &model("Q4_1"),
            out_path.to_str().unwrap(),
            "--to",
            to,
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let digest = Sha256::digest(std::fs::read(&out_path).unwrap());
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            meta["model_files"][kind]["sha256"].as_str().unwrap(),
            "{kind}"
        );
        std::fs::remove_file(&out_path).unwrap();
    }
}

#[test]
fn missing_file_is_a_clean_error() {
    assert_clean_error(
        &toy(&["describe", "/nonexistent/model.gguf"]),
        "/nonexistent/model.gguf",
    );
    let out = toy(&["infer", "/nonexistent/model.gguf", "-p", "hi"]);
    assert_clean_error(&out, "No such file");
    assert_eq!(
        String::from_utf8_lossy(&out.stderr)
            .matches("No such file")
            .count(),
        1,
        "cause repeated"
    );
}

#[test]
fn directory_is_a_clean_error() {
    assert_clean_error(&toy(&["infer", "/tmp", "-p", "hi"]), "directory");
}

#[test]
fn wrong_magic_is_a_clean_error() {
    let p = scratch("magic.gguf");
    std::fs::write(&p, b"GGML\x03\x00\x00\x00 not a gguf file at all").unwrap();
    assert_clean_error(
        &toy(&["infer", p.to_str().unwrap(), "-p", "hi"]),
        "not a GGUF file",
    );
}

fn fixture_bytes() -> Vec<u8> {
    std::fs::read(root().join("fixtures/gguf/tensors.gguf")).unwrap()
}

#[test]
fn truncated_file_is_a_clean_error() {
    let bytes = fixture_bytes();
    for cut in [10, 100, bytes.len() / 2, bytes.len() - 1] {
        let p = scratch(&format!("trunc{cut}.gguf"));
        std::fs::write(&p, &bytes[..cut]).unwrap();
        let out = toy(&["describe", p.to_str().unwrap()]);
        let msg = String::from_utf8_lossy(&out.stderr).to_lowercase();
        assert!(
            msg.contains("truncated") || msg.contains("corrupt"),
            "cut {cut}: {msg}"
        );
        assert_clean_error(&out, "");
    }
}

#[test]
fn huge_counts_are_clean_errors() {
    // Header: magic(4) version(4) n_tensors(8) n_kv(8); then the first key's length (8).
    let mut huge_tensors = fixture_bytes();
    huge_tensors[8..16].copy_from_slice(&(1u64 << 60).to_le_bytes());
    let mut huge_string = fixture_bytes();
    huge_string[24..32].copy_from_slice(&u64::MAX.to_le_bytes());
    for (name, bytes, needle) in [
        ("tensors", huge_tensors, "tensor count"),
        ("string", huge_string, "length"),
    ] {
        let p = scratch(&format!("huge-{name}.gguf"));
        std::fs::write(&p, bytes).unwrap();
        assert_clean_error(&toy(&["infer", p.to_str().unwrap(), "-p", "hi"]), needle);
    }
}

#[test]
fn unsupported_architecture_is_a_clean_error() {
    let file = GgufFile::open(model("Q4_1")).unwrap();
    let mut w = GgufWriter::from_file(&file);
    w.set("general.architecture", GgufValue::String("mamba".into()))
        .unwrap();
    w.add_tensor(
        "token_embd.weight",
        &[32, 4],
        GgmlType::F32,
        vec![0u8; 32 * 4 * 4],
    )
    .unwrap();
    let p = scratch("mamba.gguf");
    w.write_atomic(&p).unwrap();
    let out = toy(&["infer", p.to_str().unwrap(), "-p", "hi"]);
    assert_clean_error(&out, "unsupported architecture \"mamba\"");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("llama"),
        "should name the supported ones"
    );
}

#[test]
fn missing_tensor_is_a_clean_error() {
    let file = GgufFile::open(model("Q4_1")).unwrap();
    let mut w = GgufWriter::from_file(&file);
    for t in file
        .tensors
        .iter()
        .filter(|t| t.name != "blk.7.ffn_up.weight")
    {
        w.copy_tensor(&file, t).unwrap();
    }
    let p = scratch("missing-tensor.gguf");
    w.write_atomic(&p).unwrap();
    assert_clean_error(
        &toy(&["infer", p.to_str().unwrap(), "-p", "hi"]),
        "blk.7.ffn_up.weight",
    );
    std::fs::remove_file(&p).unwrap();
}

#[test]
fn shape_mismatch_is_a_clean_error() {
    // blk.3.attn_q.weight with 64 outputs instead of 576: the loader must name it and both shapes.
    let file = GgufFile::open(model("Q4_1")).unwrap();
    let mut w = GgufWriter::from_file(&file);
    for t in &file.tensors {
        if t.name == "blk.3.attn_q.weight" {
            w.add_tensor(&t.name, &[576, 64], GgmlType::F32, vec![0u8; 576 * 64 * 4])
                .unwrap();
        } else {
            w.copy_tensor(&file, t).unwrap();
        }
    }
    let p = scratch("shape-mismatch.gguf");
    w.write_atomic(&p).unwrap();
    let out = toy(&["infer", p.to_str().unwrap(), "-p", "hi"]);
    assert_clean_error(&out, "blk.3.attn_q.weight");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("[576, 64]"),
        "should show the shape found"
    );
    std::fs::remove_file(&p).unwrap();
}

#[test]
fn oversize_request_is_a_clean_error() {
    assert_clean_error(
        &toy(&["infer", &model("Q8_0"), "-p", "hi", "-n", "9000"]),
        "exceeds the context of 8192",
    );
}

#[test]
fn bench_arguments_are_checked() {
    // `-p 0` means no prompt test (as in llama-bench); zero repetitions is an error, not a panic.
    let out = toy(&[
        "bench",
        &model("Q8_0"),
        "-p",
        "0",
        "-n",
        "2",
        "-r",
        "1",
        "-t",
        "1",
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("tg2") && !stdout.contains("pp0"),
        "{stdout}"
    );
    assert_clean_error(&toy(&["bench", &model("Q8_0"), "-r", "0"]), "at least 1");
    assert_clean_error(
        &toy(&["bench", &model("Q8_0"), "-p", "0", "-n", "0"]),
        "nothing to measure",
    );
}

/// `toy eval` and `toy bench` run every family, GPT-2 included: on a tiny GPT-2 and a tiny
/// gemma3 (Q8_0), `toy eval --method llama -c 32` gives llama-perplexity's PPL on the same text
/// (recorded with `llama-perplexity -m M -f fixtures/finetune/instructions.txt -c 32 -b 32`,
/// llama.cpp of shared/anchors: 50972.7474 and 539.3903; toy measured 50984.05 and 539.92,
/// 0.02% and 0.1% apart, over the same 40 and 32 windows), and `toy bench` reports both tests.
#[test]
fn eval_and_bench_run_gpt2_and_gemma3() {
    for (name, llama_ppl, windows) in [
        ("tiny-gpt2", 50972.7474, 40),
        ("tiny-gemma3-q8_0", 539.3903, 32),
    ] {
        let m = root().join(format!("fixtures/models/{name}.gguf"));
        let data = root().join("fixtures/finetune/instructions.txt");
        let out = toy(&[
            "eval",
            m.to_str().unwrap(),
            "--data",
            data.to_str().unwrap(),
            "-c",
            "32",
            "--method",
            "llama",
            "--json",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["windows"], windows, "{name}");
        let ppl = v["perplexity"].as_f64().unwrap();
        assert!(
            (ppl / llama_ppl - 1.0).abs() < 5e-3,
            "{name}: toy PPL {ppl}, llama-perplexity {llama_ppl}"
        );
        let out = toy(&[
            "bench",
            m.to_str().unwrap(),
            "-p",
            "16",
            "-n",
            "4",
            "-r",
            "1",
            "--json",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains("pp16") && text.contains("tg4"),
            "{name}: {text}"
        );
    }
}

/// `toy convert` onto a full disk and into a read-only directory: a one-line error, the file
/// already under the output's name untouched, and no partial or temporary file left taking the
/// space.
#[test]
fn convert_onto_a_full_disk_or_read_only_dir_loses_nothing() {
    let Some(disk) = Tmpfs::mount(scratch("full-disk"), "16m") else {
        return;
    };
    let out_path = disk.path().join("model.Q8_0.gguf");
    std::fs::write(&out_path, b"the previous file").unwrap();
    let convert = || {
        let out_s = out_path.to_str().unwrap();
        toy(&["convert", &model("Q4_1"), out_s, "--to", "q8_0"])
    };
    assert_clean_error(&convert(), "No space left on device");
    assert_eq!(std::fs::read(&out_path).unwrap(), b"the previous file");
    assert_eq!(disk.names(), ["model.Q8_0.gguf"]);

    disk.remount_read_only();
    assert_clean_error(&convert(), "Read-only file system");
    assert_eq!(std::fs::read(&out_path).unwrap(), b"the previous file");
}
