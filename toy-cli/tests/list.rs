//! `toy list` and model names end to end: a machine's Hugging Face cache, Ollama store, LM
//! Studio folder, `$TOY_MODEL_DIR` and current directory, laid out in a scratch folder as those
//! tools lay them out (fixture models as the blobs), then listed and opened by name.

#![cfg(unix)] // the Hugging Face cache is symlinks

mod common;

use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Output;

use common::{root, toy_command};
use serde_json::Value;
use sha2::{Digest, Sha256};
use toy_core::gguf::{GgufFile, GgufWriter, Value as GgufValue};

/// The revision `refs/main` names, and an older snapshot that must not be listed.
const MAIN_REVISION: &str = "0e7d9d3a3b06b5e1e6fba2a7d1c43d64c1a2b1f4";
const OLD_REVISION: &str = "5c0ffee3b06b5e1e6fba2a7d1c43d64c1a2b1f40";

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(root().join("fixtures/models").join(name)).unwrap()
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

/// A fresh, empty scratch folder for one test.
fn scratch(tag: &str) -> PathBuf {
    common::scratch_dir("list-tests", tag)
}

/// A home folder with the three tools' downloads, a model folder and a working directory.
struct Machine {
    dir: PathBuf,
}

impl Machine {
    fn new(tag: &str) -> Self {
        let dir = scratch(tag);
        for sub in ["home", "hf", "ollama", "mine", "work"] {
            std::fs::create_dir_all(dir.join(sub)).unwrap();
        }
        Machine { dir }
    }

    /// `hf download tiny-org/Tiny-Llama-GGUF tiny-q4_k_m.gguf`, downloaded twice: an older
    /// revision first, then the one `refs/main` names.
    fn with_huggingface(self) -> Self {
        let bytes = fixture("tiny-kq-q4_k_m.gguf");
        let repo = self.dir.join("hf/hub/models--tiny-org--Tiny-Llama-GGUF");
        let hash = sha256_hex(&bytes);
        write(&repo.join("blobs").join(&hash), &bytes);
        write(&repo.join("refs/main"), MAIN_REVISION.as_bytes());
        for (revision, file) in [
            (OLD_REVISION, "tiny-old.gguf"),
            (MAIN_REVISION, "tiny-q4_k_m.gguf"),
        ] {
            let snapshot = repo.join("snapshots").join(revision);
            std::fs::create_dir_all(&snapshot).unwrap();
            symlink(format!("../../blobs/{hash}"), snapshot.join(file)).unwrap();
        }
        self
    }

    /// `ollama pull tinyqwen`, and the same model as `someone/tinyqwen:q8` (one blob, two tags).
    fn with_ollama(self) -> Self {
        let bytes = fixture("tiny-qwen2.gguf");
        let hex = sha256_hex(&bytes);
        let root = self.dir.join("ollama");
        write(&root.join("blobs").join(format!("sha256-{hex}")), &bytes);
        let manifest = serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
            "config": {
                "mediaType": "application/vnd.docker.container.image.v1+json",
                "digest": format!("sha256:{}", sha256_hex(b"{}")),
                "size": 2,
            },
            "layers": [
                {"mediaType": "application/vnd.ollama.image.model", "digest": format!("sha256:{hex}"), "size": bytes.len()},
                {"mediaType": "application/vnd.ollama.image.params", "digest": format!("sha256:{}", sha256_hex(b"x")), "size": 1},
            ],
        });
        for path in ["library/tinyqwen/latest", "someone/tinyqwen/q8"] {
            let file = root.join("manifests/registry.ollama.ai").join(path);
            write(&file, manifest.to_string().as_bytes());
        }
        self
    }

    /// A model LM Studio downloaded to `~/.lmstudio/models/{publisher}/{repo}/`.
    fn with_lm_studio(self) -> Self {
        let file = self
            .dir
            .join("home/.lmstudio/models/tiny-pub/Tiny-Llama3-GGUF/tiny-llama3.gguf");
        write(&file, &fixture("tiny-llama3.gguf"));
        self
    }

    /// A model in a subfolder of `$TOY_MODEL_DIR` (its `general.file_type` left out), a model split in two as llama-gguf-split
    /// names and marks the parts (only the first is listed), and a `.gguf` in the working
    /// directory that is not a GGUF at all.
    fn with_folders(self) -> Self {
        let mine = self.dir.join("mine");
        // Without general.file_type: its quant is the type that holds most bytes.
        let gemma = GgufFile::open(root().join("fixtures/models/tiny-gemma3-q8_0.gguf")).unwrap();
        let mut unlabelled = GgufWriter::from_file_with_tensors(&gemma).unwrap();
        assert!(unlabelled.remove("general.file_type").is_some());
        std::fs::create_dir_all(mine.join("sub")).unwrap();
        unlabelled
            .write_atomic(mine.join("sub/tiny-gemma3-q8_0.gguf"))
            .unwrap();
        let whole = GgufFile::open(root().join("fixtures/models/tiny-llama3.gguf")).unwrap();
        let mut first = GgufWriter::from_file_with_tensors(&whole).unwrap();
        first.set("split.count", GgufValue::U16(2)).unwrap();
        first
            .write_atomic(mine.join("big-00001-of-00002.gguf"))
            .unwrap();
        write(&mine.join("big-00002-of-00002.gguf"), b"GGUF part two");
        write(
            &self.dir.join("work/garbage.gguf"),
            b"this is not a GGUF file",
        );
        self
    }

    /// `toy ARGS` with this machine's environment, from its working directory.
    fn toy(&self, args: &[&str]) -> Output {
        let mut cmd = toy_command();
        // Variables that would point the stores elsewhere than this machine's.
        for var in ["HF_HUB_CACHE", "XDG_CACHE_HOME", "LMSTUDIO_MODELS"] {
            cmd.env_remove(var);
        }
        cmd.env("HOME", self.dir.join("home"))
            .env("HF_HOME", self.dir.join("hf"))
            .env("OLLAMA_MODELS", self.dir.join("ollama"))
            .env("TOY_MODEL_DIR", self.dir.join("mine"))
            .current_dir(self.dir.join("work"))
            .args(args)
            .output()
            .unwrap()
    }

    fn list_json(&self) -> Vec<Value> {
        let out = self.toy(&["list", "--json"]);
        assert!(out.status.success(), "{}", stderr(&out));
        serde_json::from_slice::<Value>(&out.stdout)
            .unwrap()
            .as_array()
            .unwrap()
            .clone()
    }
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn full(tag: &str) -> Machine {
    Machine::new(tag)
        .with_huggingface()
        .with_ollama()
        .with_lm_studio()
        .with_folders()
}

#[test]
fn list_finds_every_store_with_names_and_runnable_flags() {
    let machine = full("listed");
    let listed = machine.list_json();
    let mine = machine.dir.join("mine");
    let model_in_mine = mine.join("sub/tiny-gemma3-q8_0.gguf");
    let split = mine.join("big-00001-of-00002.gguf");
    let names: Vec<&str> = listed.iter().map(|m| m["name"].as_str().unwrap()).collect();
    // (name, source, architecture, quant); the model fixtures run.
    let runnable = [
        (
            "tiny-org/Tiny-Llama-GGUF/tiny-q4_k_m.gguf",
            "huggingface",
            "llama",
            // general.file_type's name: most of its bytes are Q4_K, some Q6_K.
            "Q4_K_M",
        ),
        ("tinyqwen:latest", "ollama", "qwen2", "Q8_0"),
        ("someone/tinyqwen:q8", "ollama", "qwen2", "Q8_0"),
        (
            "tiny-pub/Tiny-Llama3-GGUF/tiny-llama3.gguf",
            "lmstudio",
            "llama",
            "Q8_0",
        ),
        (
            model_in_mine.to_str().unwrap(),
            "toy_model_dir",
            "gemma3",
            "Q8_0",
        ),
    ];
    assert_eq!(listed.len(), runnable.len() + 2, "{names:?}");
    for (name, source, architecture, quant) in runnable {
        let m = listed
            .iter()
            .find(|m| m["name"] == name)
            .unwrap_or_else(|| panic!("{name} not in {names:?}"));
        assert_eq!(m["source"], source, "{m}");
        assert_eq!(m["architecture"], architecture, "{m}");
        assert_eq!(m["quant"], quant, "{m}");
        assert_eq!(m["runnable"], true, "{m}");
        assert!(m["reason"].is_null(), "{m}");
        assert!(m["parameters"].as_u64().unwrap() > 100_000, "{m}");
        let path = Path::new(m["path"].as_str().unwrap());
        assert_eq!(
            m["size_bytes"].as_u64().unwrap(),
            std::fs::metadata(path).unwrap().len(),
            "{m}"
        );
    }
    // Not runnable, each with its one-line reason; the second part of the split is left out.
    let garbage = listed.iter().find(|m| m["name"] == "garbage.gguf").unwrap();
    assert_eq!(garbage["source"], "cwd");
    assert_eq!(garbage["runnable"], false);
    assert!(
        garbage["reason"]
            .as_str()
            .unwrap()
            .contains("not a GGUF file"),
        "{garbage}"
    );
    let first_part = listed
        .iter()
        .find(|m| m["name"] == split.to_str().unwrap())
        .unwrap();
    assert_eq!(first_part["runnable"], false);
    assert!(
        first_part["reason"].as_str().unwrap().contains("split"),
        "{first_part}"
    );
    assert!(
        !names
            .iter()
            .any(|n| n.contains("tiny-old") || n.contains("00002-of")),
        "{names:?}"
    );

    // The table: a header, a row per file, the reason of the ones that do not run.
    let out = machine.toy(&["list"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let table = String::from_utf8(out.stdout).unwrap();
    assert_eq!(table.lines().count(), listed.len() + 1, "{table}");
    assert!(table.starts_with("NAME"), "{table}");
    assert!(table.contains("tinyqwen:latest"), "{table}");
    assert!(table.contains("no: not a GGUF file"), "{table}");
}

#[test]
fn commands_open_models_by_their_listed_names() {
    let machine = full("named");
    for (name, architecture) in [
        ("tinyqwen:latest", "qwen2"),
        ("tinyqwen", "qwen2"), // no tag: `latest`, as ollama reads it
        ("someone/tinyqwen:q8", "qwen2"),
        ("tiny-org/Tiny-Llama-GGUF/tiny-q4_k_m.gguf", "llama"),
        ("tiny-pub/Tiny-Llama3-GGUF/tiny-llama3.gguf", "llama"),
    ] {
        let out = machine.toy(&["describe", name, "--json"]);
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        let card: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(card["architecture"], architecture, "{name}");
    }
    let out = machine.toy(&["tokenize", "tinyqwen", "Hello world", "--ids"]);
    assert!(out.status.success(), "{}", stderr(&out));

    // A name no store knows: one line that says what was tried and where to look.
    for name in ["nosuch:model", "tiny-org/Tiny-Llama-GGUF/missing.gguf"] {
        let out = machine.toy(&["describe", name]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert!(!err.contains("panicked"), "{err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
        assert!(err.contains(name) && err.contains("toy list"), "{err}");
        assert!(err.contains("Ollama manifest"), "{err}");
    }
}

#[test]
fn an_empty_machine_says_where_it_looked() {
    let machine = Machine::new("empty");
    let out = machine.toy(&["list"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("No GGUF models")
            && text.contains("Ollama")
            && text.contains("current directory"),
        "{text}"
    );
    assert!(machine.list_json().is_empty());
    let help = machine.toy(&["list", "--help"]);
    let help = String::from_utf8_lossy(&help.stdout);
    for needle in ["HF_HOME", "OLLAMA_MODELS", "TOY_MODEL_DIR", "toy infer"] {
        assert!(help.contains(needle), "{needle}: {help}");
    }
}
