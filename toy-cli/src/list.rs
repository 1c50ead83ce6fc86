//! `toy list`: the GGUF models already on this machine — in the Hugging Face cache, Ollama's
//! store, LM Studio's folders (`models.rs` knows their layouts), `$TOY_MODEL_DIR` and the current
//! directory — with the name each answers to, and whether toy runs it.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::Args;
use serde::Serialize;
use toy_core::config::ModelConfig;
use toy_core::gguf::{DEQUANT_TYPES, GgmlType, GgufFile, tensor_to_f32};

use crate::models::{Stores, hf_repo_id, hf_snapshot, ollama_blob, ollama_name};

/// `toy list` options (the command's description is on `Command::List` in main.rs).
#[derive(Args, Debug)]
#[command(after_help = "\
Where it looks (a folder that does not exist is skipped):
  Hugging Face  $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub (what
                `hf download` fills); the snapshot that refs/main names, else the newest
  Ollama        $OLLAMA_MODELS, else ~/.ollama/models (what `ollama pull` fills)
  LM Studio     $LMSTUDIO_MODELS, else ~/.lmstudio/models and ~/.cache/lm-studio/models
  your folder   $TOY_MODEL_DIR and its subfolders
  here          the .gguf files in the current directory (not its subfolders)

NAME is what `toy infer`, `serve`, `describe`, `bench`, `eval` and `tokenize` take in place of a
path: `org/repo/file.gguf` (Hugging Face), `model:tag` (Ollama; `model` alone is `model:latest`),
`publisher/repo/file.gguf` (LM Studio), or the file's path. QUANT is llama.cpp's name for the
file's recipe (Q4_K_M) where the file records one, else the type that holds most of its bytes.
RUNS says whether toy can run the file, and if not, why (an architecture or tensor type toy does
not support, a model split over several files, a broken file).

Examples:
  toy list
  toy infer qwen2.5:0.5b -p \"The capital of France is\"
  toy describe bartowski/SmolLM2-135M-Instruct-GGUF/SmolLM2-135M-Instruct-Q8_0.gguf
  toy list --json | jq -r '.[] | select(.runnable) | .name'")]
pub struct ListArgs {
    /// Print a JSON array, one object per file (source, name, path, architecture, parameters,
    /// quant, size_bytes, runnable, reason), instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// One model file and what toy makes of it.
#[derive(Debug, Serialize)]
struct Listed {
    /// Where it was found: huggingface, ollama, lmstudio, toy_model_dir or cwd.
    source: &'static str,
    /// What to give `toy infer` and the other commands.
    name: String,
    path: PathBuf,
    architecture: Option<String>,
    parameters: Option<u64>,
    quant: Option<String>,
    size_bytes: u64,
    runnable: bool,
    /// Why toy cannot run it; `None` when it can.
    reason: Option<String>,
}

impl Listed {
    /// A file that could not be examined (its manifest is broken), with why.
    fn broken(source: &'static str, name: String, path: PathBuf, reason: String) -> Self {
        Listed {
            source,
            name,
            path,
            architecture: None,
            parameters: None,
            quant: None,
            size_bytes: 0,
            runnable: false,
            reason: Some(reason),
        }
    }

    /// Open `path` and read what toy needs to know from its header (the file is mapped, not read).
    fn examine(source: &'static str, name: String, path: PathBuf) -> Self {
        let file = match GgufFile::open(&path) {
            Ok(file) => file,
            Err(e) => return Listed::broken(source, name, path, e.to_string()),
        };
        let reason = why_not_runnable(&file);
        Listed {
            source,
            name,
            size_bytes: std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0),
            path,
            architecture: file.architecture().ok().map(str::to_string),
            parameters: Some(file.tensors.iter().map(|t| t.n_elements()).sum()),
            quant: quant_name(&file),
            runnable: reason.is_none(),
            reason,
        }
    }
}

/// Why toy cannot run `file`, in the words `toy infer` would use; `None` when it can.
fn why_not_runnable(file: &GgufFile) -> Option<String> {
    if let Ok(Some(parts)) = file.get_u64("split.count")
        && parts > 1
    {
        return Some(format!(
            "the first of {parts} split files; toy reads one-file GGUFs (join them with `llama-gguf-split --merge`)"
        ));
    }
    if let Err(e) = ModelConfig::from_gguf(file) {
        return Some(e.to_string());
    }
    let unreadable = file
        .tensors
        .iter()
        .find(|t| !DEQUANT_TYPES.contains(&t.ggml_type))?;
    // The loader reads tensors through tensor_to_f32, which refuses a type toy cannot read
    // before it touches any data: its error is the loader's, at no cost.
    tensor_to_f32(file, unreadable).err().map(|e| e.to_string())
}

/// The file's quantization as llama.cpp prints it: the name of its `general.file_type` (the
/// recipe, such as Q4_K_M, whose tensors mix types: SmolLM2's Q4_K_M is mostly Q5_0, the fallback
/// for rows that are not whole Q4_K blocks), else the tensor type that holds the most bytes.
fn quant_name(file: &GgufFile) -> Option<String> {
    let recipe = file.get_u64("general.file_type").ok().flatten();
    if let Some(name) = recipe.and_then(llama_ftype_name) {
        return Some(name.to_string());
    }
    let mut bytes_by_type: HashMap<GgmlType, u64> = HashMap::new();
    for t in &file.tensors {
        *bytes_by_type.entry(t.ggml_type).or_default() += t.n_bytes();
    }
    let (dominant, _) = bytes_by_type
        .into_iter()
        .max_by_key(|&(ty, bytes)| (bytes, ty.id()))?;
    Some(dominant.name().to_string())
}

/// llama.cpp's names of the `general.file_type` codes (`enum llama_ftype` in llama.h), by code;
/// the empty ones are codes llama.cpp has retired.
#[rustfmt::skip]
const LLAMA_FTYPE_NAMES: [&str; 39] = [
    "F32", "F16", "Q4_0", "Q4_1", "", "", "", "Q8_0", "Q5_0", "Q5_1", "Q2_K", "Q3_K_S", "Q3_K_M",
    "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K", "IQ2_XXS", "IQ2_XS", "Q2_K_S",
    "IQ3_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL", "IQ3_S", "IQ3_M", "IQ2_S", "IQ2_M", "IQ4_XS", "IQ1_M",
    "BF16", "", "", "", "TQ1_0", "TQ2_0", "MXFP4_MOE",
];

/// llama.cpp's name of a `general.file_type` (1024 marks one llama.cpp guessed).
fn llama_ftype_name(code: u64) -> Option<&'static str> {
    let name = *LLAMA_FTYPE_NAMES.get(usize::try_from(code & !1024).ok()?)?;
    (!name.is_empty()).then_some(name)
}

/// The part number of a file named as llama.cpp's gguf-split names them: `…-00002-of-00003.gguf`.
fn split_part(path: &Path) -> Option<u32> {
    let stem = path.file_stem()?.to_str()?;
    let (rest, parts) = stem.rsplit_once("-of-")?;
    parts.parse::<u32>().ok()?;
    rest.rsplit_once('-')?.1.parse().ok()
}

/// A `.gguf` file to list: the later parts of a split model are left out (the first stands for it).
fn is_listed_gguf(path: &Path) -> bool {
    let gguf = path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    gguf && split_part(path).is_none_or(|part| part == 1)
}

/// The entries of `dir` split into (folders, other entries), each sorted; nothing when `dir` is
/// missing. A symlinked folder counts as an entry, not a folder, so a link loop cannot trap a walk.
fn entries(dir: &Path) -> (Vec<PathBuf>, Vec<PathBuf>) {
    let (mut folders, mut others) = (Vec::new(), Vec::new());
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        match entry.file_type() {
            Ok(t) if t.is_dir() => folders.push(entry.path()),
            _ => others.push(entry.path()),
        }
    }
    folders.sort();
    others.sort();
    (folders, others)
}

/// The `.gguf` files to list in `dir`, and in its subfolders when `recursive`.
fn gguf_files(dir: &Path, recursive: bool) -> Vec<PathBuf> {
    let (folders, others) = entries(dir);
    let mut files: Vec<PathBuf> = others.into_iter().filter(|p| is_listed_gguf(p)).collect();
    if recursive {
        files.extend(folders.iter().flat_map(|f| gguf_files(f, true)));
    }
    files
}

/// The files `depth` folders down from `dir` (0: its own files).
fn files_at_depth(dir: &Path, depth: usize) -> Vec<PathBuf> {
    let (folders, others) = entries(dir);
    match depth {
        0 => others,
        _ => folders
            .iter()
            .flat_map(|f| files_at_depth(f, depth - 1))
            .collect(),
    }
}

/// `path` below `root` as a `/`-separated name (the form store names take on every system).
fn relative_name(path: &Path, root: &Path) -> String {
    let relative = path.strip_prefix(root).unwrap_or(path);
    let parts: Vec<_> = relative
        .components()
        .map(|c| c.as_os_str().to_string_lossy())
        .collect();
    parts.join("/")
}

/// The GGUF files of the Hugging Face cache: `models--{org}--{repo}/snapshots/{revision}/{file}`,
/// each a symlink to `../../blobs/{hash}`.
fn huggingface_models(hub: &Path) -> Vec<Listed> {
    let mut found = Vec::new();
    for repo_dir in entries(hub).0 {
        let folder_name = repo_dir.file_name().unwrap_or_default().to_string_lossy();
        let Some(repo_id) = hf_repo_id(&folder_name) else {
            continue;
        };
        let Some(snapshot) = hf_snapshot(&repo_dir) else {
            continue;
        };
        for path in gguf_files(&snapshot, true) {
            // `org/repo/file` resolves; a repo without an org (old ones, like `gpt2`) would read
            // as `repo/file`, which does not, so such files go by their path.
            let name = if repo_id.contains('/') {
                format!("{repo_id}/{}", relative_name(&path, &snapshot))
            } else {
                path.display().to_string()
            };
            found.push(Listed::examine("huggingface", name, path));
        }
    }
    found
}

/// The models Ollama has pulled: one manifest per `manifests/{host}/{namespace}/{model}/{tag}`.
fn ollama_models(root: &Path) -> Vec<Listed> {
    let manifests = root.join("manifests");
    let mut found = Vec::new();
    for manifest in files_at_depth(&manifests, 3) {
        let relative = relative_name(&manifest, &manifests);
        let [host, namespace, model, tag] = relative.split('/').collect::<Vec<_>>()[..] else {
            continue;
        };
        let name = ollama_name(host, namespace, model, tag);
        found.push(match ollama_blob(root, &manifest) {
            Ok(blob) => Listed::examine("ollama", name, blob),
            Err(e) => Listed::broken("ollama", name, manifest, format!("{e:#}")),
        });
    }
    found
}

/// The models LM Studio has downloaded: `{publisher}/{repo}/{file}.gguf`.
fn lm_studio_models(root: &Path) -> Vec<Listed> {
    files_at_depth(root, 2)
        .into_iter()
        .filter(|path| is_listed_gguf(path))
        .map(|path| Listed::examine("lmstudio", relative_name(&path, root), path))
        .collect()
}

/// Every model of every store, each store's in name order.
fn find_models(stores: &Stores) -> Vec<Listed> {
    let mut found = Vec::new();
    found.extend(stores.hf_hub.iter().flat_map(|hub| huggingface_models(hub)));
    found.extend(stores.ollama.iter().flat_map(|root| ollama_models(root)));
    found.extend(
        stores
            .lm_studio
            .iter()
            .flat_map(|root| lm_studio_models(root)),
    );
    // A plain folder may hold files a store already listed ($TOY_MODEL_DIR set to the Hugging
    // Face cache, the current directory inside LM Studio's): those keep their store's name.
    let mut seen: HashSet<PathBuf> = found
        .iter()
        .filter_map(|m| m.path.canonicalize().ok())
        .collect();
    let folders = [
        stores
            .model_dir
            .clone()
            .map(|dir| ("toy_model_dir", dir, true)),
        Some(("cwd", PathBuf::from("."), false)),
    ];
    for (source, dir, recursive) in folders.into_iter().flatten() {
        for path in gguf_files(&dir, recursive) {
            if path.canonicalize().is_ok_and(|real| !seen.insert(real)) {
                continue;
            }
            // `./model.gguf` reads better as `model.gguf`, and means the same.
            let name = path
                .strip_prefix(".")
                .unwrap_or(&path)
                .display()
                .to_string();
            found.push(Listed::examine(source, name, path));
        }
    }
    found
}

/// A parameter count as model cards write it: 648K, 135M, 1.2B.
fn short_count(n: u64) -> String {
    let n = n as f64;
    let (value, unit) = match n {
        n if n >= 1e9 => (n / 1e9, "B"),
        n if n >= 1e6 => (n / 1e6, "M"),
        n if n >= 1e3 => (n / 1e3, "K"),
        n => return format!("{n}"),
    };
    if value >= 100.0 {
        format!("{value:.0}{unit}")
    } else {
        format!("{value:.1}{unit}")
    }
}

/// A file size in binary units: 11 B, 1.3 MiB, 4.1 GiB.
fn short_size(bytes: u64) -> String {
    let (kib, b) = (1024.0, bytes as f64);
    if b < kib {
        format!("{bytes} B")
    } else if b >= kib * kib * kib {
        format!("{:.1} GiB", b / (kib * kib * kib))
    } else if b >= kib * kib {
        format!("{:.1} MiB", b / (kib * kib))
    } else {
        format!("{:.1} KiB", b / kib)
    }
}

/// The models as an aligned table, one row each; the last column is not padded.
fn table(models: &[Listed]) -> String {
    let header = ["NAME", "SOURCE", "ARCH", "PARAMS", "QUANT", "SIZE", "RUNS"].map(String::from);
    let unknown = || "-".to_string();
    let mut rows = vec![header];
    rows.extend(models.iter().map(|m| {
        [
            m.name.clone(),
            m.source.to_string(),
            m.architecture.clone().unwrap_or_else(unknown),
            m.parameters.map(short_count).unwrap_or_else(unknown),
            m.quant.clone().unwrap_or_else(unknown),
            short_size(m.size_bytes),
            match &m.reason {
                None => "yes".to_string(),
                Some(reason) => format!("no: {}", reason.replace('\n', " ")),
            },
        ]
    }));
    let mut widths = [0; 7];
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in &rows {
        let cells: Vec<String> = row
            .iter()
            .zip(widths)
            .enumerate()
            .map(|(column, (cell, width))| match column {
                // Numbers right-aligned, so that their digits line up; the last column unpadded.
                3 | 5 => format!("{cell:>width$}"),
                6 => cell.clone(),
                _ => format!("{cell:<width$}"),
            })
            .collect();
        out.push_str(&cells.join("  "));
        out.push('\n');
    }
    out
}

pub fn run(args: ListArgs) -> Result<()> {
    let stores = Stores::from_env();
    let models = find_models(&stores);
    let mut out = std::io::stdout().lock();
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&models)?)?;
    } else if models.is_empty() {
        writeln!(out, "No GGUF models found in {}.", stores.places())?;
    } else {
        write!(out, "{}", table(&models))?;
    }
    Ok(())
}
