//! `toy fetch` against a local stand-in for the Hugging Face hub (the real one cannot be reached
//! from CI): the hub's `resolve/` and `api/models` routes with its headers (`X-Repo-Commit`,
//! `X-Linked-Etag`, `X-Linked-Size`, `X-Error-Code`), a redirect to a file store on another
//! port that honours `Range`, a connection dropped half-way, bytes that do not match the SHA-256
//! the hub lists, and a gated repository.

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::{Arc, Mutex};

use common::{root, scratch_dir, success, toy_command};
use sha2::{Digest, Sha256};

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";
const TOKEN: &str = "hf_test_token";

/// A file of a repository, as the stand-in serves it.
#[derive(Clone)]
struct HubFile {
    /// The bytes the file store sends.
    served: Vec<u8>,
    /// The SHA-256 the hub lists (that of `served`, unless the test corrupts the download).
    sha256: String,
    /// Close the connection after this many bytes of the first download.
    cut_after: Option<usize>,
}

/// One request the stand-in saw.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    headers: HashMap<String, String>,
}

#[derive(Default)]
struct State {
    /// (repo, file) → file.
    files: HashMap<(String, String), HubFile>,
    gated: Vec<String>,
    seen: Vec<Seen>,
    downloads: usize,
}

/// The hub on one port, its file store on another.
struct FakeHub {
    endpoint: String,
    state: Arc<Mutex<State>>,
}

impl FakeHub {
    fn start() -> FakeHub {
        let hub = TcpListener::bind("127.0.0.1:0").unwrap();
        let store = TcpListener::bind("127.0.0.1:0").unwrap();
        let store_url = format!("http://{}", store.local_addr().unwrap());
        let state = Arc::new(Mutex::new(State::default()));
        for (listener, is_store) in [(hub.try_clone().unwrap(), false), (store, true)] {
            let (state, store_url) = (state.clone(), store_url.clone());
            std::thread::spawn(move || {
                for conn in listener.incoming().flatten() {
                    let (state, store_url) = (state.clone(), store_url.clone());
                    std::thread::spawn(move || serve(conn, &state, is_store, &store_url));
                }
            });
        }
        FakeHub {
            endpoint: format!("http://{}", hub.local_addr().unwrap()),
            state,
        }
    }

    fn add(&self, repo: &str, file: &str, bytes: &[u8]) {
        self.add_file(repo, file, bytes.to_vec(), sha256(bytes), None);
    }

    fn add_file(&self, repo: &str, file: &str, served: Vec<u8>, sha: String, cut: Option<usize>) {
        let f = HubFile {
            served,
            sha256: sha,
            cut_after: cut,
        };
        let mut s = self.state.lock().unwrap();
        s.files.insert((repo.into(), file.into()), f);
    }

    fn seen(&self) -> Vec<Seen> {
        self.state.lock().unwrap().seen.clone()
    }

    /// `toy fetch ARGS` against this hub, with `cache` as the Hugging Face cache.
    fn fetch(&self, cache: &Path, args: &[&str], token: Option<&str>) -> Output {
        let mut cmd = toy_command();
        cmd.arg("fetch")
            .args(args)
            .env("HF_ENDPOINT", &self.endpoint)
            .env("HF_HUB_CACHE", cache)
            // No token saved by `hf auth login` on this machine may leak in.
            .env("HF_HOME", cache.join("hf-home"))
            .env_remove("HF_TOKEN")
            .env_remove("HF_TOKEN_PATH");
        if let Some(t) = token {
            cmd.env("HF_TOKEN", t);
        }
        cmd.output().unwrap()
    }
}

fn sha256(bytes: &[u8]) -> String {
    format!("{:x}", Sha256::digest(bytes))
}

/// Answer one request on `conn` (then close it).
fn serve(conn: TcpStream, state: &Mutex<State>, is_store: bool, store_url: &str) {
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).is_err() || line.is_empty() {
        return;
    }
    let mut parts = line.split_whitespace();
    let (method, path) = (
        parts.next().unwrap_or("").to_string(),
        parts.next().unwrap_or("").to_string(),
    );
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).is_err() || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let mut s = state.lock().unwrap();
    s.seen.push(Seen {
        method: method.clone(),
        path: path.clone(),
        headers: headers.clone(),
    });
    let mut out = conn;
    let respond = |out: &mut TcpStream, status: &str, extra: &[(&str, String)], body: &[u8]| {
        let mut head = format!(
            "HTTP/1.1 {status}\r\nConnection: close\r\nContent-Length: {}\r\n",
            body.len()
        );
        for (k, v) in extra {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str("\r\n");
        let _ = out.write_all(head.as_bytes());
        if method != "HEAD" {
            let _ = out.write_all(body);
        }
    };
    if is_store {
        // GET /blob/{sha}: the file store, with ranges.
        let sha = path.trim_start_matches("/blob/");
        let Some(file) = s.files.values().find(|f| f.sha256 == sha).cloned() else {
            return respond(&mut out, "404 Not Found", &[], b"");
        };
        s.downloads += 1;
        let first = s.downloads == 1;
        drop(s);
        let start: usize = headers
            .get("range")
            .and_then(|r| r.strip_prefix("bytes=")?.strip_suffix('-')?.parse().ok())
            .unwrap_or(0);
        let body = &file.served[start..];
        let (status, mut extra) = if start > 0 {
            let range = format!(
                "bytes {start}-{}/{}",
                file.served.len() - 1,
                file.served.len()
            );
            ("206 Partial Content", vec![("Content-Range", range)])
        } else {
            ("200 OK", vec![])
        };
        extra.push(("Accept-Ranges", "bytes".into()));
        match file.cut_after {
            // Promise the whole body, send part of it, hang up.
            Some(cut) if first => {
                let head = format!(
                    "HTTP/1.1 {status}\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
                    body.len()
                );
                let _ = out.write_all(head.as_bytes());
                let _ = out.write_all(&body[..cut]);
                let _ = out.shutdown(std::net::Shutdown::Both);
            }
            _ => respond(&mut out, status, &extra, body),
        }
        return;
    }
    let error = |code: &str| vec![("X-Error-Code", code.to_string())];
    // /api/models/{org}/{name}/revision/{rev}: the repository's files.
    if let Some(rest) = path.strip_prefix("/api/models/") {
        let repo = rest.split("/revision/").next().unwrap_or("");
        let files: Vec<serde_json::Value> = s
            .files
            .keys()
            .filter(|(r, _)| r == repo)
            .map(|(_, f)| serde_json::json!({ "rfilename": f }))
            .chain([serde_json::json!({ "rfilename": "README.md" })])
            .collect();
        let body = serde_json::json!({ "sha": COMMIT, "siblings": files }).to_string();
        return respond(&mut out, "200 OK", &[], body.as_bytes());
    }
    // /{org}/{name}/resolve/{rev}/{file}
    let Some((repo, rest)) = path[1..].split_once("/resolve/") else {
        return respond(&mut out, "404 Not Found", &error("RepoNotFound"), b"");
    };
    let file_name = rest.split_once('/').map_or("", |(_, f)| f);
    if s.gated.iter().any(|g| g == repo)
        && headers.get("authorization") != Some(&format!("Bearer {TOKEN}"))
    {
        return respond(&mut out, "401 Unauthorized", &error("GatedRepo"), b"");
    }
    let Some(file) = s.files.get(&(repo.to_string(), file_name.to_string())) else {
        return respond(&mut out, "404 Not Found", &error("EntryNotFound"), b"");
    };
    let extra = [
        ("Location", format!("{store_url}/blob/{}", file.sha256)),
        ("X-Repo-Commit", COMMIT.to_string()),
        ("X-Linked-Etag", format!("\"{}\"", file.sha256)),
        ("X-Linked-Size", file.served.len().to_string()),
    ];
    respond(&mut out, "302 Found", &extra, b"");
}

fn fixture_bytes() -> Vec<u8> {
    std::fs::read(root().join("fixtures/models/tiny-qwen2.gguf")).unwrap()
}

fn storage(cache: &Path, repo: &str) -> PathBuf {
    cache.join(format!("models--{}", repo.replace('/', "--")))
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A download cut half-way fails with a message that says to run it again, keeps its bytes
/// only as `.incomplete`, and the second run asks for the rest and lands the file where
/// huggingface_hub puts it — where `toy list` finds it and a third run does not download again.
#[test]
fn a_cut_download_resumes_and_lands_in_the_hub_cache() {
    let cache = scratch_dir("fetch", "resume");
    let hub = FakeHub::start();
    let repo = "test-org/tiny-GGUF";
    let bytes = fixture_bytes();
    let half = bytes.len() / 2;
    hub.add_file(
        repo,
        "tiny-qwen2.gguf",
        bytes.clone(),
        sha256(&bytes),
        Some(half),
    );
    let args = [repo, "tiny-qwen2.gguf"];
    let sha = sha256(&bytes);
    let blob = storage(&cache, repo).join("blobs").join(&sha);
    let pointer = storage(&cache, repo)
        .join("snapshots")
        .join(COMMIT)
        .join("tiny-qwen2.gguf");

    let cut = hub.fetch(&cache, &args, None);
    assert!(!cut.status.success(), "a cut download must fail");
    let err = stderr(&cut);
    assert!(
        err.contains("run the same command again to resume"),
        "{err}"
    );
    assert!(
        !blob.exists() && !pointer.exists(),
        "nothing under the final names"
    );
    let partial = blob.with_file_name(format!("{sha}.incomplete"));
    assert_eq!(std::fs::metadata(&partial).unwrap().len(), half as u64);

    let out = success(&hub.fetch(&cache, &args, None));
    assert_eq!(out.trim(), pointer.display().to_string());
    let range = hub
        .seen()
        .iter()
        .rfind(|r| r.path.starts_with("/blob/"))
        .and_then(|r| r.headers.get("range").cloned());
    assert_eq!(
        range.as_deref(),
        Some(&*format!("bytes={half}-")),
        "resumed, not restarted"
    );
    assert_eq!(std::fs::read(&pointer).unwrap(), bytes);
    assert_eq!(
        std::fs::read_link(&pointer).unwrap(),
        Path::new("../../blobs").join(&sha),
        "a relative link to the blob, as huggingface_hub makes it"
    );
    assert!(!partial.exists());
    let refs = std::fs::read_to_string(storage(&cache, repo).join("refs/main")).unwrap();
    assert_eq!(refs, COMMIT);

    // `toy list` finds it under the name every command takes.
    let list = toy_command()
        .args(["list", "--json"])
        .env("HF_HUB_CACHE", &cache)
        .env("HOME", &cache)
        .env_remove("HF_HOME")
        .env_remove("OLLAMA_MODELS")
        .env_remove("LMSTUDIO_MODELS")
        .env_remove("TOY_MODEL_DIR")
        .current_dir(&cache)
        .output()
        .unwrap();
    let listed: serde_json::Value = serde_json::from_str(&success(&list)).unwrap();
    let entry = listed
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "test-org/tiny-GGUF/tiny-qwen2.gguf")
        .unwrap_or_else(|| panic!("toy list does not show it: {listed}"));
    assert_eq!(entry["architecture"], "qwen2");
    assert_eq!(entry["runnable"], true);

    // A third run finds the blob and downloads nothing.
    let downloads = |hub: &FakeHub| {
        hub.seen()
            .iter()
            .filter(|r| r.path.starts_with("/blob/"))
            .count()
    };
    let before = downloads(&hub);
    let again = hub.fetch(&cache, &args, None);
    success(&again);
    assert!(
        stderr(&again).contains("already downloaded"),
        "{}",
        stderr(&again)
    );
    assert_eq!(downloads(&hub), before);
}

/// Bytes whose SHA-256 is not the one the hub lists are refused and not kept.
#[test]
fn a_corrupted_download_is_rejected_and_nothing_is_kept() {
    let cache = scratch_dir("fetch", "corrupt");
    let hub = FakeHub::start();
    let repo = "test-org/corrupt-GGUF";
    let bytes = fixture_bytes();
    let mut served = bytes.clone();
    served[1000] ^= 0x40;
    hub.add_file(repo, "model.gguf", served, sha256(&bytes), None);
    let out = hub.fetch(&cache, &[repo, "model.gguf"], None);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("SHA-256") && err.contains(&sha256(&bytes)),
        "{err}"
    );
    let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(errors.len(), 1, "one line: {err}");
    let blobs = storage(&cache, repo).join("blobs");
    let left: Vec<_> = std::fs::read_dir(&blobs)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left in blobs/: {left:?}");
    assert!(
        !storage(&cache, repo)
            .join("snapshots")
            .join(COMMIT)
            .join("model.gguf")
            .exists()
    );
}

/// Without a file name the repository's only GGUF is fetched, or its Q4_K_M one, else the
/// choices are listed; a gated repository needs `HF_TOKEN`, which goes to the hub and not to the
/// file store.
#[test]
fn picks_the_gguf_and_sends_the_token_to_the_hub_only() {
    let cache = scratch_dir("fetch", "pick");
    let hub = FakeHub::start();
    let bytes = fixture_bytes();
    let gated = "test-org/gated-GGUF";
    hub.add(gated, "only.gguf", &bytes);
    hub.state.lock().unwrap().gated.push(gated.into());

    let refused = hub.fetch(&cache, &[gated], None);
    assert!(!refused.status.success());
    assert!(
        stderr(&refused).contains("401") && stderr(&refused).contains("HF_TOKEN"),
        "{}",
        stderr(&refused)
    );

    let out = success(&hub.fetch(&cache, &[gated], Some(TOKEN)));
    assert!(out.trim().ends_with("only.gguf"), "{out}");
    let seen = hub.seen();
    let head = seen.iter().rfind(|r| r.method == "HEAD").unwrap();
    assert_eq!(
        head.headers.get("authorization").map(String::as_str),
        Some(&*format!("Bearer {TOKEN}"))
    );
    let get = seen.iter().rfind(|r| r.path.starts_with("/blob/")).unwrap();
    assert!(
        !get.headers.contains_key("authorization"),
        "the token went to the file store"
    );

    let many = "test-org/many-GGUF";
    hub.add(many, "m-Q8_0.gguf", &bytes);
    hub.add(many, "m-Q4_K_M.gguf", &bytes);
    let out = success(&hub.fetch(&cache, &[many], None));
    assert!(out.trim().ends_with("m-Q4_K_M.gguf"), "{out}");
    hub.add(many, "m-Q4_K_M-v2.gguf", &bytes);
    let out = hub.fetch(&cache, &[many], None);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("m-Q8_0.gguf") && err.contains("m-Q4_K_M-v2.gguf"),
        "{err}"
    );

    let missing = hub.fetch(&cache, &[many, "absent.gguf"], None);
    assert!(
        stderr(&missing).contains("no such file"),
        "{}",
        stderr(&missing)
    );
    let bad = hub.fetch(&cache, &[many, "../../escape.gguf"], None);
    assert!(stderr(&bad).contains("without `..`"), "{}", stderr(&bad));
}
