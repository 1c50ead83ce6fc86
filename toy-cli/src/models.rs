//! The model stores on this machine — the Hugging Face cache, Ollama's store, LM Studio's
//! folders — where each is, and how a model's name there (what `toy list` prints) maps to its
//! GGUF file ([`resolve_model`], which every command that opens a model calls first).

use std::path::{Component, Path, PathBuf};

use anyhow::{Context, Result, bail};

/// The media type of the layer of an Ollama manifest that is the GGUF file.
const OLLAMA_MODEL_LAYER: &str = "application/vnd.ollama.image.model";
/// Ollama's own registry: its names leave the host out.
const OLLAMA_REGISTRY: &str = "registry.ollama.ai";

/// Where each tool keeps its models: its own environment variable, else its default under $HOME.
pub struct Stores {
    pub hf_hub: Option<PathBuf>,
    pub ollama: Option<PathBuf>,
    pub lm_studio: Vec<PathBuf>,
    pub model_dir: Option<PathBuf>,
}

/// An environment variable as a path; set but empty counts as unset, as the tools themselves do.
fn env_path(var: &str) -> Option<PathBuf> {
    std::env::var_os(var)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

impl Stores {
    pub fn from_env() -> Self {
        let home = env_path("HOME");
        let under_home = |rel: &str| home.as_ref().map(|h| h.join(rel));
        Stores {
            // huggingface_hub's order: HF_HUB_CACHE, HF_HOME/hub, $XDG_CACHE_HOME/huggingface/hub.
            hf_hub: env_path("HF_HUB_CACHE")
                .or_else(|| env_path("HF_HOME").map(|h| h.join("hub")))
                .or_else(|| env_path("XDG_CACHE_HOME").map(|c| c.join("huggingface/hub")))
                .or_else(|| under_home(".cache/huggingface/hub")),
            ollama: env_path("OLLAMA_MODELS").or_else(|| under_home(".ollama/models")),
            lm_studio: match env_path("LMSTUDIO_MODELS") {
                Some(dir) => vec![dir],
                // LM Studio 0.3 moved its folder from ~/.cache/lm-studio to ~/.lmstudio.
                None => [".lmstudio/models", ".cache/lm-studio/models"]
                    .into_iter()
                    .filter_map(under_home)
                    .collect(),
            },
            model_dir: env_path("TOY_MODEL_DIR"),
        }
    }

    /// Where `toy list` looks, for the message when it finds nothing.
    pub fn places(&self) -> String {
        let named = |what: &str, dir: &PathBuf| format!("{what} {}", dir.display());
        let mut places: Vec<String> = Vec::new();
        places.extend(
            self.hf_hub
                .iter()
                .map(|d| named("the Hugging Face cache", d)),
        );
        places.extend(self.ollama.iter().map(|d| named("Ollama's store", d)));
        places.extend(
            self.lm_studio
                .iter()
                .map(|d| named("LM Studio's folder", d)),
        );
        places.push(match &self.model_dir {
            Some(dir) => named("$TOY_MODEL_DIR", dir),
            None => "$TOY_MODEL_DIR (not set)".into(),
        });
        places.push("the current directory".into());
        places.join(", ")
    }
}

/// The repo id of a Hugging Face cache folder: huggingface_hub names it `models--` and the id
/// with each `/` as `--` (`models--org--repo`), which ids cannot contain themselves.
pub fn hf_repo_id(folder_name: &str) -> Option<String> {
    Some(folder_name.strip_prefix("models--")?.replace("--", "/"))
}

/// The snapshot folder of a cached Hugging Face repo: the revision `refs/main` names (what a
/// plain download fetched last), else the newest snapshot.
pub fn hf_snapshot(repo_dir: &Path) -> Option<PathBuf> {
    let snapshots = repo_dir.join("snapshots");
    if let Ok(revision) = std::fs::read_to_string(repo_dir.join("refs/main")) {
        let dir = snapshots.join(revision.trim());
        if !revision.trim().is_empty() && dir.is_dir() {
            return Some(dir);
        }
    }
    std::fs::read_dir(&snapshots)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|entry| entry.file_type().is_ok_and(|t| t.is_dir()))
        .max_by_key(|entry| entry.metadata().and_then(|m| m.modified()).ok())
        .map(|entry| entry.path())
}

/// The name `ollama run` knows a manifest by: `model:tag` from the default registry's `library`,
/// `namespace/model:tag` from elsewhere on it, `host/namespace/model:tag` from other registries.
pub fn ollama_name(host: &str, namespace: &str, model: &str, tag: &str) -> String {
    match (host, namespace) {
        (OLLAMA_REGISTRY, "library") => format!("{model}:{tag}"),
        (OLLAMA_REGISTRY, _) => format!("{namespace}/{model}:{tag}"),
        _ => format!("{host}/{namespace}/{model}:{tag}"),
    }
}

/// The manifest of an Ollama name `[[host/]namespace/]model[:tag]`: the inverse of [`ollama_name`].
fn ollama_manifest(root: &Path, name: &str) -> Option<PathBuf> {
    // A host may carry a port (`localhost:5000/ns/model`): only a colon after the last `/` tags.
    let (path, tag) = match name.rsplit_once(':') {
        Some((path, tag)) if !tag.contains('/') && !tag.is_empty() => (path, tag),
        _ => (name, "latest"),
    };
    let [host, namespace, model] = match path.split('/').collect::<Vec<_>>()[..] {
        [model] => [OLLAMA_REGISTRY, "library", model],
        [namespace, model] => [OLLAMA_REGISTRY, namespace, model],
        [host, namespace, model] => [host, namespace, model],
        _ => return None,
    };
    Some(
        root.join("manifests")
            .join(host)
            .join(namespace)
            .join(model)
            .join(tag),
    )
}

/// The GGUF file of an Ollama manifest: the layer of media type `application/vnd.ollama.image.model`,
/// whose digest `sha256:HEX` is stored as `blobs/sha256-HEX`.
pub fn ollama_blob(root: &Path, manifest: &Path) -> Result<PathBuf> {
    let text = std::fs::read_to_string(manifest)
        .with_context(|| format!("cannot read the Ollama manifest {}", manifest.display()))?;
    let json: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("the Ollama manifest {} is not JSON", manifest.display()))?;
    let digest = json["layers"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|layer| layer["mediaType"] == OLLAMA_MODEL_LAYER)
        .and_then(|layer| layer["digest"].as_str())
        .with_context(|| {
            format!(
                "the Ollama manifest {} has no model layer",
                manifest.display()
            )
        })?;
    match digest.strip_prefix("sha256:") {
        Some(hex) if !hex.is_empty() && hex.chars().all(|c| c.is_ascii_hexdigit()) => {
            Ok(root.join("blobs").join(format!("sha256-{hex}")))
        }
        _ => bail!(
            "the Ollama manifest {} has digest {digest:?}, not sha256:HEX",
            manifest.display()
        ),
    }
}

/// `arg` as a store name (`a/b/c`): a relative path of plain parts; `./x`, `../x`, `/x` are paths.
fn as_store_name(arg: &Path) -> Option<String> {
    let parts: Option<Vec<&str>> = arg
        .components()
        .map(|c| match c {
            Component::Normal(part) => part.to_str(),
            _ => None,
        })
        .collect();
    parts.filter(|p| !p.is_empty()).map(|p| p.join("/"))
}

/// The file a model argument names: the path itself when it exists, else the model a store knows
/// by that name (as `toy list` prints it): an Ollama `model[:tag]`, a Hugging Face
/// `org/repo/file.gguf` (from the snapshot `refs/main` names), an LM Studio
/// `publisher/repo/file.gguf`.
pub fn resolve_model(arg: &Path) -> Result<PathBuf> {
    // Anything at that path wins; a folder goes on to the open's own "is a directory" error.
    let not_a_file = match std::fs::metadata(arg) {
        Ok(_) => return Ok(arg.to_path_buf()),
        Err(e) => e,
    };
    let stores = Stores::from_env();
    let mut tried = Vec::new();
    if let Some(name) = as_store_name(arg) {
        if let Some(root) = &stores.ollama
            && let Some(manifest) = ollama_manifest(root, &name)
        {
            if manifest.is_file() {
                return ollama_blob(root, &manifest);
            }
            tried.push(format!("the Ollama manifest {}", manifest.display()));
        }
        if let Some(hub) = &stores.hf_hub
            && let [org, repo, in_repo] = name.splitn(3, '/').collect::<Vec<_>>()[..]
        {
            // The folder name hf_repo_id reads back.
            let repo_dir = hub.join(format!("models--{org}--{repo}"));
            if let Some(file) = hf_snapshot(&repo_dir).map(|s| s.join(in_repo))
                && file.is_file()
            {
                return Ok(file);
            }
            tried.push(format!("the Hugging Face cache {}", repo_dir.display()));
        }
        if name.split('/').count() >= 3 {
            for root in &stores.lm_studio {
                let file = root.join(&name);
                if file.is_file() {
                    return Ok(file);
                }
                tried.push(format!("LM Studio's {}", file.display()));
            }
        }
    }
    let tried = if tried.is_empty() {
        String::new()
    } else {
        format!(", nor a model name (tried {})", tried.join(", "))
    };
    bail!(
        "{}: {not_a_file}{tried}; `toy list` shows the models on this machine and their names",
        arg.display()
    )
}
