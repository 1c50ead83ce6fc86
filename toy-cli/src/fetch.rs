//! `toy fetch`: download a GGUF file from the Hugging Face hub into the hub's own cache layout,
//! so that `toy list`, `huggingface_hub`, llama.cpp's `-hf` and every other tool that reads that
//! cache find it, and a second `toy fetch` (or `hf download`) of the same file costs nothing.
//!
//! The protocol is huggingface_hub's `hf_hub_download`: a HEAD of
//! `{endpoint}/{repo}/resolve/{revision}/{file}`, not following the redirect to the file store,
//! gives the commit (`X-Repo-Commit`), the file's id (`X-Linked-Etag`: for a file stored in
//! LFS, as every GGUF is, the SHA-256 of its bytes), its size and where to read it. The bytes go
//! to `blobs/{etag}.incomplete` under `models--{org}--{name}/`, a download cut short is resumed
//! from there with a `Range` request, and only bytes whose SHA-256 is the etag are renamed to
//! `blobs/{etag}`; `snapshots/{commit}/{file}` is then a relative link to the blob and
//! `refs/{revision}` names the commit.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Component, Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};

use crate::models::Stores;

/// The hub's address unless `HF_ENDPOINT` names a mirror.
const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
/// Redirects within the hub (a renamed repository) followed before giving up.
const MAX_REDIRECTS: usize = 5;

/// `toy fetch` options (the command's description is on `Command::Fetch` in main.rs).
#[derive(Args, Debug)]
#[command(after_help = "\
The file goes where `hf download` puts it: $HF_HUB_CACHE, else $HF_HOME/hub, else
~/.cache/huggingface/hub, as models--ORG--NAME/snapshots/COMMIT/FILE (a link to
blobs/SHA256). `toy list` then shows it, and every command takes REPO/FILE as the model's name.

A download cut short (Ctrl-C, a dropped connection) resumes where it stopped when run again;
the file appears under its name only once all of it has arrived and its SHA-256 is the one the
hub lists.

Environment:
  HF_TOKEN     an access token, for gated and private repositories (else the token that
               `hf auth login` saved in $HF_HOME/token)
  HF_ENDPOINT  the hub's address (default https://huggingface.co), for a mirror
  HTTPS_PROXY  a proxy

Examples:
  toy fetch bartowski/SmolLM2-135M-Instruct-GGUF SmolLM2-135M-Instruct-Q4_K_M.gguf
  toy fetch bartowski/SmolLM2-135M-Instruct-GGUF        (its only GGUF, or its Q4_K_M one)
  toy infer bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q4_K_M.gguf -p \"Hi\"")]
pub struct FetchArgs {
    /// The repository on the hub: ORG/NAME.
    pub repo: String,
    /// The file to download (a path in the repository). Without it: the repository's only GGUF
    /// file, or its Q4_K_M one when it has several.
    pub file: Option<String>,
    /// The branch, tag or commit to download from.
    #[arg(long, default_value = "main")]
    pub revision: String,
}

pub fn run(args: FetchArgs) -> Result<()> {
    check_repo_id(&args.repo)?;
    check_relative(&args.revision, "revision")?;
    let hub = Hub::from_env()?;
    let cache = Stores::from_env()
        .hf_hub
        .context("no Hugging Face cache folder: set HF_HUB_CACHE, HF_HOME or HOME")?;
    let file = match &args.file {
        Some(file) => file.clone(),
        None => hub.pick_gguf(&args.repo, &args.revision)?,
    };
    check_relative(&file, "file name")?;
    let path = hub.download(&cache, &args.repo, &args.revision, &file)?;
    eprintln!(
        "run it with: toy infer {}/{} -p \"...\"",
        args.repo,
        file.trim_start_matches('/')
    );
    println!("{}", path.display());
    Ok(())
}

/// A repository id: `org/name`, each part of letters, digits, `-`, `_` and `.`.
fn check_repo_id(repo: &str) -> Result<()> {
    let parts: Vec<&str> = repo.split('/').collect();
    let ok_part = |p: &str| {
        !p.is_empty()
            && p != "."
            && p != ".."
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    if parts.len() != 2 || !parts.iter().all(|p| ok_part(p)) {
        bail!(
            "`{repo}` is not a repository id: give ORG/NAME, e.g. bartowski/SmolLM2-135M-Instruct-GGUF"
        );
    }
    Ok(())
}

/// A file name or revision that stays inside its folder when joined to it (no `..`, no root):
/// names come from the command line and from the hub's file listing, which a mirror controls.
fn check_relative(name: &str, what: &str) -> Result<()> {
    let path = Path::new(name);
    let inside = !name.is_empty()
        && !name.contains('\\')
        && path.components().all(|c| matches!(c, Component::Normal(_)));
    if !inside {
        bail!("`{name}` is not a {what} toy can store: it must be a relative path without `..`");
    }
    Ok(())
}

/// What the hub says about one file of one revision.
struct Remote {
    /// The commit the revision points at.
    commit: String,
    /// The file's id: the SHA-256 of its bytes for an LFS file (64 hex digits), git's blob id
    /// otherwise.
    etag: String,
    size: Option<u64>,
    /// Where its bytes are (the file store the hub redirects to, or the resolve URL itself).
    location: String,
}

impl Remote {
    /// The SHA-256 the bytes must have, where the hub gives one.
    fn sha256(&self) -> Option<&str> {
        (self.etag.len() == 64 && self.etag.bytes().all(|b| b.is_ascii_hexdigit()))
            .then_some(self.etag.as_str())
    }
}

struct Hub {
    endpoint: String,
    token: Option<String>,
    /// Follows no redirects: the hub's redirect to its file store is read, not taken.
    agent: ureq::Agent,
    /// For the bytes: follows redirects (without the token, which goes to the hub only).
    downloads: ureq::Agent,
}

impl Hub {
    fn from_env() -> Result<Self> {
        let endpoint = std::env::var("HF_ENDPOINT")
            .ok()
            .filter(|e| !e.is_empty())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.into())
            .trim_end_matches('/')
            .to_string();
        if !endpoint.starts_with("http://") && !endpoint.starts_with("https://") {
            bail!("HF_ENDPOINT={endpoint} is not an http(s) address");
        }
        let agent = |redirects| {
            ureq::AgentBuilder::new()
                .redirects(redirects)
                .timeout_connect(Duration::from_secs(30))
                // A stalled connection fails (and the next run resumes) instead of hanging.
                .timeout_read(Duration::from_secs(60))
                .user_agent(concat!("toy/", env!("CARGO_PKG_VERSION")))
                .try_proxy_from_env(true)
                .build()
        };
        Ok(Hub {
            endpoint,
            token: token(),
            agent: agent(0),
            downloads: agent(MAX_REDIRECTS as u32),
        })
    }

    /// A request to `url` by `agent`, with the token when `url` is on the hub.
    fn request_by(&self, agent: &ureq::Agent, method: &str, url: &str) -> ureq::Request {
        let req = agent.request(method, url);
        match &self.token {
            Some(token) if url.starts_with(&self.endpoint) => {
                req.set("Authorization", &format!("Bearer {token}"))
            }
            _ => req,
        }
    }

    fn request(&self, method: &str, url: &str) -> ureq::Request {
        self.request_by(&self.agent, method, url)
    }

    /// Send `req`; a status of 400 and above becomes an error that says what to do.
    fn send(&self, req: ureq::Request, what: &str) -> Result<ureq::Response> {
        match req.call() {
            Ok(res) => Ok(res),
            Err(ureq::Error::Status(status, res)) => {
                let code = res.header("X-Error-Code").unwrap_or("").to_string();
                let hint = match (status, code.as_str()) {
                    (401 | 403, _) if self.token.is_none() => {
                        "; a gated or private repository needs a token: set HF_TOKEN (huggingface.co/settings/tokens)"
                    }
                    (401 | 403, _) => {
                        "; check that HF_TOKEN may read it (a gated model's terms are accepted on its page)"
                    }
                    (404, "RepoNotFound") => {
                        ": no such repository (or a private one: set HF_TOKEN)"
                    }
                    (404, "RevisionNotFound") => ": no such revision",
                    (404, "EntryNotFound") | (404, _) => {
                        ": no such file (`toy fetch REPO` without a file lists the GGUF files)"
                    }
                    (429, _) => ": too many requests; wait and run it again",
                    _ => "",
                };
                bail!("{what}: the hub answered {status}{hint}")
            }
            Err(e) => bail!(
                "{what}: cannot reach {}: {e} (HF_ENDPOINT sets another address)",
                self.endpoint
            ),
        }
    }

    /// The repository's GGUF file to fetch when none is named: the only one, else the Q4_K_M
    /// one (the usual default download), else an error that lists them.
    fn pick_gguf(&self, repo: &str, revision: &str) -> Result<String> {
        let url = format!(
            "{}/api/models/{repo}/revision/{}",
            self.endpoint,
            encode_path(revision)
        );
        let res = self.send(self.request("GET", &url), repo)?;
        let info: serde_json::Value = serde_json::from_reader(res.into_reader().take(64 << 20))
            .with_context(|| format!("{repo}: the hub's file listing is not JSON"))?;
        let mut ggufs: Vec<String> = info["siblings"]
            .as_array()
            .map(|files| {
                files
                    .iter()
                    .filter_map(|f| f["rfilename"].as_str())
                    .filter(|name| name.to_ascii_lowercase().ends_with(".gguf"))
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        ggufs.sort();
        let q4_k_m: Vec<&String> = ggufs
            .iter()
            .filter(|f| f.to_ascii_uppercase().contains("Q4_K_M"))
            .collect();
        match (ggufs.len(), q4_k_m.as_slice()) {
            (0, _) => bail!("{repo} has no GGUF file at revision {revision}"),
            (1, _) => Ok(ggufs.remove(0)),
            (_, [one]) => {
                eprintln!(
                    "{repo} has {} GGUF files; fetching the Q4_K_M one (name another to fetch it)",
                    ggufs.len()
                );
                Ok((*one).clone())
            }
            _ => bail!(
                "{repo} has {} GGUF files; name the one to fetch after the repository: {}",
                ggufs.len(),
                ggufs.join(", ")
            ),
        }
    }

    /// The HEAD of the file's resolve URL: its commit, id, size and location.
    fn remote(&self, repo: &str, revision: &str, file: &str) -> Result<Remote> {
        let what = format!("{repo}/{file}");
        let mut url = format!(
            "{}/{repo}/resolve/{}/{}",
            self.endpoint,
            encode_path(revision),
            encode_path(file)
        );
        for _ in 0..=MAX_REDIRECTS {
            let req = self
                .request("HEAD", &url)
                .set("Accept-Encoding", "identity");
            let res = self.send(req, &what)?;
            let header = |name: &str| res.header(name).map(str::to_string);
            let location = header("Location");
            // A redirect within the hub (a renamed repository) is followed; one to the file
            // store is where the bytes are, and its headers are the file's.
            if (300..400).contains(&res.status())
                && let Some(loc) = &location
                && loc.starts_with('/')
            {
                url = format!("{}{loc}", self.endpoint);
                continue;
            }
            let commit = header("X-Repo-Commit").with_context(|| {
                format!(
                    "{what}: the server gave no X-Repo-Commit: is HF_ENDPOINT a Hugging Face hub?"
                )
            })?;
            let etag = header("X-Linked-Etag")
                .or_else(|| header("ETag"))
                .map(|e| e.trim_start_matches("W/").trim_matches('"').to_string())
                .filter(|e| !e.is_empty())
                .with_context(|| format!("{what}: the hub gave no ETag for the file"))?;
            check_relative(&commit, "commit")?;
            check_relative(&etag, "file id")?;
            let size = header("X-Linked-Size")
                .or_else(|| header("Content-Length"))
                .and_then(|s| s.parse().ok());
            let location = match location {
                Some(loc) if (300..400).contains(&res.status()) => loc,
                _ => url,
            };
            return Ok(Remote {
                commit,
                etag,
                size,
                location,
            });
        }
        bail!("{what}: more than {MAX_REDIRECTS} redirects")
    }

    /// Download `file` into the cache (resuming a partial download) and return the path of its
    /// snapshot entry.
    fn download(&self, cache: &Path, repo: &str, revision: &str, file: &str) -> Result<PathBuf> {
        let remote = self.remote(repo, revision, file)?;
        let storage = cache.join(format!("models--{}", repo.replace('/', "--")));
        let blob = storage.join("blobs").join(&remote.etag);
        let pointer = storage.join("snapshots").join(&remote.commit).join(file);
        if revision != remote.commit {
            let refs = storage.join("refs").join(revision);
            fs::create_dir_all(refs.parent().unwrap())?;
            toy_core::atomic::write_atomic(&refs, remote.commit.as_bytes())
                .with_context(|| format!("writing {}", refs.display()))?;
        }
        if blob.is_file() {
            eprintln!("{repo}/{file}: already downloaded");
        } else {
            fs::create_dir_all(blob.parent().unwrap())
                .with_context(|| format!("creating {}", storage.display()))?;
            self.fetch_blob(&remote, &blob, &format!("{repo}/{file}"))?;
        }
        link(&blob, &pointer)?;
        Ok(pointer)
    }

    /// The bytes of `remote` into `blob`, through `blob.incomplete`.
    fn fetch_blob(&self, remote: &Remote, blob: &Path, what: &str) -> Result<()> {
        let name = blob.file_name().unwrap().to_string_lossy();
        let partial = blob.with_file_name(format!("{name}.incomplete"));
        // Where huggingface_hub keeps its lock for the same blob, so that neither tool writes
        // it while the other does: `{cache}/.locks/models--ORG--NAME/ETAG.lock` (left in place,
        // as huggingface_hub leaves its own).
        let storage = blob.parent().and_then(Path::parent).unwrap();
        let locks = storage
            .parent()
            .unwrap()
            .join(".locks")
            .join(storage.file_name().unwrap());
        fs::create_dir_all(&locks).with_context(|| format!("creating {}", locks.display()))?;
        let lock_path = locks.join(format!("{name}.lock"));
        let lock = File::create(&lock_path)
            .with_context(|| format!("creating {}", lock_path.display()))?;
        if lock.try_lock().is_err() {
            bail!(
                "{what}: another download of this file is running (it holds {})",
                lock_path.display()
            );
        }
        let mut out = OpenOptions::new()
            .create(true)
            .read(true)
            .append(true)
            .open(&partial)
            .with_context(|| format!("opening {}", partial.display()))?;
        // The hash covers what an earlier run left, read back, and then every new byte.
        let mut hasher = Sha256::new();
        let mut have = io::copy(&mut out, &mut HashWriter(&mut hasher))
            .with_context(|| format!("reading {}", partial.display()))?;
        if remote.size.is_some_and(|size| have > size) {
            (have, hasher) = (0, Sha256::new());
            out.set_len(0)?;
        }
        // An earlier run that got every byte but stopped before the rename has nothing to ask.
        let complete = have > 0 && remote.size == Some(have);
        let mut body: Box<dyn Read> = Box::new(io::empty());
        if !complete {
            let mut req = self.request_by(&self.downloads, "GET", &remote.location);
            if have > 0 {
                req = req.set("Range", &format!("bytes={have}-"));
            }
            let res = self.send(req, what)?;
            if have > 0 && res.status() != 206 {
                // The server sent the whole file: start over.
                (have, hasher) = (0, Sha256::new());
                out.set_len(0)?;
            }
            body = Box::new(res.into_reader());
        }
        let size_text = remote.size.map_or("unknown size".into(), |s| {
            format!("{:.1} MB", s as f64 / 1e6)
        });
        if have > 0 {
            eprintln!(
                "{what}: resuming at {:.1} MB of {size_text}",
                have as f64 / 1e6
            );
        } else {
            eprintln!("{what}: downloading {size_text}");
        }
        let bar = ProgressBar::new(remote.size.unwrap_or(0)).with_style(
            ProgressStyle::with_template(
                "{bytes}/{total_bytes} [{bar:30}] {bytes_per_sec} ETA {eta}",
            )
            .unwrap()
            .progress_chars("=> "),
        );
        bar.set_position(have);
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = match body.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    bar.abandon();
                    out.sync_all().ok();
                    bail!(
                        "{what}: the download stopped at {:.1} MB: {e}; run the same command again to resume",
                        bar.position() as f64 / 1e6
                    );
                }
            };
            out.write_all(&buf[..n])
                .with_context(|| format!("writing {}", partial.display()))?;
            hasher.update(&buf[..n]);
            bar.inc(n as u64);
        }
        bar.finish_and_clear();
        out.sync_all()?;
        let got = out.metadata()?.len();
        if let Some(size) = remote.size
            && got != size
        {
            bail!(
                "{what}: the download stopped at {got} of {size} bytes; run the same command again to resume"
            );
        }
        if let Some(want) = remote.sha256() {
            let sha = format!("{:x}", hasher.finalize());
            if !sha.eq_ignore_ascii_case(want) {
                drop(out);
                fs::remove_file(&partial).ok();
                bail!(
                    "{what}: the downloaded bytes have SHA-256 {sha}, not the hub's {want}; nothing was kept (run it again)"
                );
            }
        }
        fs::rename(&partial, blob)
            .with_context(|| format!("moving {} into place", blob.display()))?;
        drop(lock);
        Ok(())
    }
}

/// Feeds what is written to a hash.
struct HashWriter<'a>(&'a mut Sha256);

impl Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.update(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// `pointer` as a relative link to `blob` (`../../blobs/ETAG`, one more `..` per folder in the
/// file's name), as huggingface_hub makes it; a copy where links cannot be made.
fn link(blob: &Path, pointer: &Path) -> Result<()> {
    let storage = blob.parent().and_then(Path::parent).unwrap();
    let depth = pointer
        .strip_prefix(storage)
        .map(|p| p.components().count() - 1)
        .unwrap_or(2);
    let mut target = PathBuf::new();
    for _ in 0..depth {
        target.push("..");
    }
    target.push("blobs");
    target.push(blob.file_name().unwrap());
    fs::create_dir_all(pointer.parent().unwrap())
        .with_context(|| format!("creating {}", pointer.display()))?;
    if fs::symlink_metadata(pointer).is_ok() {
        fs::remove_file(pointer)?;
    }
    #[cfg(unix)]
    let linked = std::os::unix::fs::symlink(&target, pointer);
    #[cfg(not(unix))]
    let linked = fs::copy(blob, pointer).map(|_| ());
    linked.with_context(|| format!("linking {} to its blob", pointer.display()))
}

/// The token of `HF_TOKEN`, else the one `hf auth login` saved.
fn token() -> Option<String> {
    if let Ok(t) = std::env::var("HF_TOKEN")
        && !t.trim().is_empty()
    {
        return Some(t.trim().to_string());
    }
    let path = std::env::var_os("HF_TOKEN_PATH")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HF_HOME").map(|h| PathBuf::from(h).join("token")))
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/huggingface/token"))
        })?;
    let t = fs::read_to_string(path).ok()?;
    let t = t.trim();
    (!t.is_empty()).then(|| t.to_string())
}

/// A path for a URL: each byte outside the unreserved set and `/` as `%XX`.
fn encode_path(path: &str) -> String {
    let mut out = String::new();
    for b in path.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_leave_the_cache_are_refused() {
        for bad in ["../x.gguf", "/etc/passwd", "a/../../b", "", "a\\..\\b"] {
            assert!(check_relative(bad, "file name").is_err(), "{bad}");
        }
        for good in ["x.gguf", "Q4/x-Q4_K_M.gguf"] {
            assert!(check_relative(good, "file name").is_ok(), "{good}");
        }
        for bad in ["org", "org/name/x", "../name", "org/na me", "org/"] {
            assert!(check_repo_id(bad).is_err(), "{bad}");
        }
        assert!(check_repo_id("bartowski/SmolLM2-135M-Instruct-GGUF").is_ok());
    }

    #[test]
    fn paths_are_percent_encoded() {
        assert_eq!(encode_path("a b/c+d.gguf"), "a%20b/c%2Bd.gguf");
        assert_eq!(encode_path("refs/pr/1"), "refs/pr/1");
    }
}
