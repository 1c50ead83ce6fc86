//! `toy new DIR [--lib]`: a Cargo project that uses toy's crates, ready to `cargo run`.
//!
//! The app is toy-models' own `train_loop` and `generate` examples (a tiny llama trained on a
//! paragraph with burn's Adam, then sampled; text from a GGUF), taken from the source at build
//! time, so what `toy new` writes is code the test suite compiles and runs; the library exposes
//! the training as a generic function with a test. Both depend on toy's crates by path (the
//! checkout this `toy` was built from, or `--toy-path`) or by version (`--toy-version`, once the
//! crates are published), and a path project starts from toy's own `Cargo.lock`, so it builds
//! with the versions toy is tested with.

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;

/// `toy new` options (the command's description is on `Command::New` in main.rs).
#[derive(Args, Debug)]
#[command(after_help = "\
What it writes:
  Cargo.toml   burn (Flex CPU backend + Autodiff), toy-core, toy-kernels, toy-models
  Cargo.lock   toy's own (path dependencies only): the versions toy is tested with
  src/main.rs  train a tiny llama on a paragraph with burn's Adam, then sample from it
  src/bin/generate.rs
               `cargo run --release --bin generate -- MODEL.gguf \"prompt\"`: text from a GGUF
  src/lib.rs   (--lib) the same training as `train_tiny_model`, with a test
  README.md, .gitignore

Examples:
  toy new my-app && cd my-app && cargo run --release
  toy new my-lib --lib && cd my-lib && cargo test --release
  toy new my-app --toy-path ~/src/toy")]
pub struct NewArgs {
    /// The folder to create (it may exist if empty). Its name is the package's name unless
    /// `--name` gives one.
    pub dir: PathBuf,
    /// A library crate (src/lib.rs with a test) instead of an application.
    #[arg(long)]
    pub lib: bool,
    /// The package name (default: the folder's name).
    #[arg(long)]
    pub name: Option<String>,
    /// A checkout of toy to depend on by path (default: the one this `toy` was built from).
    #[arg(long, value_name = "DIR", conflicts_with = "toy_version")]
    pub toy_path: Option<PathBuf>,
    /// Depend on toy's crates from crates.io at this version instead of by path.
    #[arg(long, value_name = "VERSION")]
    pub toy_version: Option<String>,
}

/// The checkout this binary was compiled from (`toy-cli`'s parent folder).
const BUILT_FROM: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

pub fn run(args: NewArgs) -> Result<()> {
    let name = match &args.name {
        Some(name) => name.clone(),
        None => args
            .dir
            .canonicalize()
            .unwrap_or_else(|_| args.dir.clone())
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
    };
    check_package_name(&name)?;
    let source = match (&args.toy_version, &args.toy_path) {
        (Some(version), _) => Source::Version(version.clone()),
        (None, Some(path)) => Source::Path(checkout(path)?),
        (None, None) => Source::Path(checkout(Path::new(BUILT_FROM)).with_context(|| {
            "the toy checkout this binary was built from is gone: pass --toy-path DIR (a \
             checkout of toy) or --toy-version VERSION"
        })?),
    };
    let files = project_files(&name, args.lib, &source)?;
    write_project(&args.dir, &files)?;
    let kind = if args.lib { "library" } else { "application" };
    println!("created the {kind} `{name}` in {}", args.dir.display());
    let first = if args.lib {
        "cargo test --release"
    } else {
        "cargo run --release"
    };
    println!("next: cd {} && {first}", args.dir.display());
    Ok(())
}

/// Where the toy crates come from.
enum Source {
    /// A toy checkout (canonical path).
    Path(PathBuf),
    /// A crates.io version.
    Version(String),
}

/// `path` if it is a toy checkout (it holds `toy-models/Cargo.toml`), canonicalized.
fn checkout(path: &Path) -> Result<PathBuf> {
    let dir = path
        .canonicalize()
        .with_context(|| format!("{} does not exist", path.display()))?;
    if !dir.join("toy-models/Cargo.toml").is_file() {
        bail!(
            "{} is not a toy checkout (it has no toy-models/Cargo.toml)",
            dir.display()
        );
    }
    Ok(dir)
}

/// Cargo's rules for a package name, with a message that says what to do.
fn check_package_name(name: &str) -> Result<()> {
    let valid = name.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
        && name.len() <= 64;
    if !valid {
        bail!(
            "`{name}` is not a valid package name (a letter, then letters, digits, `-` or `_`): \
             pass --name NAME"
        );
    }
    const TAKEN: [&str; 9] = [
        "toy",
        "toy-core",
        "toy-kernels",
        "toy-models",
        "toy-train",
        "toy-serve",
        "toy-quant",
        "toy-cli",
        "burn",
    ];
    if TAKEN.contains(&name) || name == "test" || name == "core" || name == "std" {
        bail!("`{name}` is the name of a crate the project depends on: pass --name NAME");
    }
    Ok(())
}

/// Every file of the project, as (relative path, contents).
fn project_files(name: &str, lib: bool, source: &Source) -> Result<Vec<(PathBuf, String)>> {
    let dep = |krate: &str, folder: &str| match source {
        Source::Path(root) => format!(
            "{krate} = {{ path = \"{}\" }}",
            root.join(folder).display().to_string().replace('\\', "/")
        ),
        Source::Version(v) => format!("{krate} = \"{v}\""),
    };
    let deps = [
        dep("toy-core", "toy-core"),
        dep("toy-kernels", "kernels"),
        dep("toy-models", "toy-models"),
    ]
    .join("\n");
    // The app has two binaries (src/main.rs and src/bin/generate.rs): plain `cargo run` runs the
    // first.
    let default_run = if lib {
        String::new()
    } else {
        format!("\ndefault-run = \"{name}\"")
    };
    let cargo_toml = CARGO_TOML
        .replace("{default_run}", &default_run)
        .replace("{name}", name)
        .replace("{toy_deps}", &deps);
    let (code, run) = if lib {
        (
            vec![("src/lib.rs", LIB_RS.to_string())],
            "cargo test --release",
        )
    } else {
        (app_sources(), "cargo run --release")
    };
    let readme = README_MD
        .replace("{name}", name)
        .replace("{run}", run)
        .replace(
            "{what}",
            if lib {
                "A library that trains a tiny llama with toy's crates: `train_tiny_model` in \
                 `src/lib.rs`, checked by its test."
            } else {
                "An application that trains a tiny llama with toy's crates and samples from it \
                 (`src/main.rs`), and one that generates text from a GGUF file \
                 (`src/bin/generate.rs`: `cargo run --release --bin generate -- MODEL.gguf \
                 \"prompt\"`)."
            },
        );
    let mut files = vec![(PathBuf::from("Cargo.toml"), cargo_toml)];
    files.extend(
        code.into_iter()
            .map(|(path, text)| (PathBuf::from(path), text)),
    );
    files.push((PathBuf::from("README.md"), readme));
    files.push((PathBuf::from(".gitignore"), "/target\n".to_string()));
    if let Source::Path(root) = source
        && let Ok(lock) = fs::read_to_string(root.join("Cargo.lock"))
    {
        // Cargo drops the entries the project does not use and adds its own package.
        files.push((PathBuf::from("Cargo.lock"), lock));
    }
    Ok(files)
}

/// The application's files: toy-models' examples, their `cargo run -p toy-models --example`
/// lines rewritten for the new project.
fn app_sources() -> Vec<(&'static str, String)> {
    vec![
        (
            "src/main.rs",
            TRAIN_LOOP_RS.replace(
                "cargo run --release -p toy-models --example train_loop",
                "cargo run --release",
            ),
        ),
        (
            "src/bin/generate.rs",
            GENERATE_RS.replace(
                "cargo run --release -p toy-models --example generate --",
                "cargo run --release --bin generate --",
            ),
        ),
    ]
}

/// Create `dir` (or use it if empty) and write `files` into it; on a failure, remove what was
/// written, so a retry starts clean.
fn write_project(dir: &Path, files: &[(PathBuf, String)]) -> Result<()> {
    let created = !dir.exists();
    if !created {
        let mut entries = fs::read_dir(dir)
            .with_context(|| format!("{} exists and is not a readable folder", dir.display()))?;
        if entries.next().is_some() {
            bail!(
                "{} exists and is not empty: choose a new folder (toy new never overwrites)",
                dir.display()
            );
        }
    }
    let write_all = || -> Result<()> {
        fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        for (path, contents) in files {
            let path = dir.join(path);
            if let Some(parent) = path.parent() {
                fs::create_dir_all(parent)
                    .with_context(|| format!("cannot create {}", parent.display()))?;
            }
            fs::write(&path, contents)
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
        Ok(())
    };
    let result = write_all();
    if result.is_err() {
        if created {
            let _ = fs::remove_dir_all(dir);
        } else {
            for (path, _) in files {
                let _ = fs::remove_file(dir.join(path));
            }
            let _ = fs::remove_dir(dir.join("src/bin"));
            let _ = fs::remove_dir(dir.join("src"));
        }
    }
    result
}

const CARGO_TOML: &str = r#"[package]
name = "{name}"
version = "0.1.0"
edition = "2024"{default_run}

[dependencies]
anyhow = "1"
# burn's CPU backend (Flex) and autodiff. Never enable burn's `cpu` feature: its build downloads
# LLVM. For a GPU, add `burn-cubecl = "=0.21.0"` and `cubecl = { version = "=0.10.0", features =
# ["wgpu"] }` and run on `burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>`
# (what `toy --backend wgpu` runs).
burn = { version = "=0.21.0", default-features = false, features = ["std", "flex", "autodiff"] }
{toy_deps}

[profile.release]
debug = "line-tables-only"
"#;

const README_MD: &str = r#"# {name}

{what}

Made by `toy new`. Run it:

```sh
{run}
```

The first build compiles burn (several minutes); later ones take seconds.

- `toy_models::LlamaConfig` describes the model; `init::<B>(&device)` makes one with random
  weights, `toy_models::load_model` reads any GGUF toy runs.
- The model is a burn `Module`: on `Autodiff<Flex>` its parameters take gradients, and any burn
  optimizer trains it; `model.valid()` is the same weights for inference.
- `toy_models::generate::generate` samples from it with llama.cpp's sampler chain
  (`toy_core::sampling`); `toy_models::save` writes a GGUF that `toy infer` and llama.cpp read.
"#;

/// toy-models' examples, compiled and run by the test suite; `toy new` copies them.
const TRAIN_LOOP_RS: &str = include_str!("../../toy-models/examples/train_loop.rs");
const GENERATE_RS: &str = include_str!("../../toy-models/examples/generate.rs");

const LIB_RS: &str = r#"//! A tiny llama trained with toy's crates and burn's own optimizer.

use anyhow::Result;
use burn::module::AutodiffModule;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use toy_kernels::ToyBackend;
use toy_models::{LlamaConfig, Transformer};

/// A two-layer llama over bytes (a vocabulary of 256) trained on `text` for `steps` steps of
/// burn's Adam; returns the trained model (without its autodiff graph) and the first and last
/// losses.
pub fn train_tiny_model<B>(
    text: &str,
    steps: usize,
    device: &B::Device,
) -> Result<(Transformer<B::InnerBackend>, f32, f32)>
where
    B: AutodiffBackend + ToyBackend,
    B::InnerBackend: ToyBackend,
{
    let bytes: Vec<i64> = text.bytes().map(i64::from).collect();
    let len = 32.min(bytes.len().saturating_sub(2));
    anyhow::ensure!(len >= 2, "the text is too short to train on");
    // n_layer, d_model, n_head, n_head_kv, head_dim, d_ff, vocab, context.
    let mut model = LlamaConfig::new(2, 64, 4, 2, 16, 128, 256, 64).init::<B>(device);
    let mut optimizer = AdamConfig::new().init();
    let batch = 8;
    let mut seed = 1u64;
    let (mut first, mut last) = (None, 0.0);
    for _ in 0..steps {
        let (mut inputs, mut targets) = (Vec::new(), Vec::new());
        for _ in 0..batch {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let start = (seed >> 33) as usize % (bytes.len() - len);
            inputs.extend_from_slice(&bytes[start..start + len]);
            targets.extend_from_slice(&bytes[start + 1..start + len + 1]);
        }
        let inputs = Tensor::<B, 2, Int>::from_data(TensorData::new(inputs, [batch, len]), device);
        let targets =
            Tensor::<B, 2, Int>::from_data(TensorData::new(targets, [batch, len]), device);
        let loss = model.loss(inputs, targets);
        last = loss.clone().into_scalar().elem::<f32>();
        first.get_or_insert(last);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optimizer.step(3e-3, model, grads);
    }
    Ok((model.valid(), first.unwrap_or(last), last))
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, Flex};

    use super::*;

    #[test]
    fn the_loss_falls() {
        let text = "the quick brown fox jumps over the lazy dog. ".repeat(4);
        let (_, first, last) =
            train_tiny_model::<Autodiff<Flex>>(&text, 60, &Default::default()).unwrap();
        assert!(last < first / 2.0, "loss {first} -> {last}");
    }
}
"#;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn package_names_follow_cargo() {
        assert!(check_package_name("my-app").is_ok());
        assert!(check_package_name("my_app2").is_ok());
        for bad in ["", "2app", "my app", "toy-models", "über", "a.b"] {
            let err = check_package_name(bad).unwrap_err().to_string();
            assert!(err.contains("--name"), "{bad}: {err}");
        }
    }

    /// The examples' usage lines are what `app_sources` rewrites: if an example's header changes,
    /// the generated project must not tell users to run `-p toy-models --example`.
    #[test]
    fn the_app_is_the_examples_with_their_usage_pointed_at_the_project() {
        let files = project_files("demo", false, &Source::Version("0.1.0".into())).unwrap();
        let get = |p: &str| &files.iter().find(|(q, _)| q == Path::new(p)).unwrap().1;
        let main = get("src/main.rs");
        let generate = get("src/bin/generate.rs");
        assert!(main.contains("//! cargo run --release\n"), "{main}");
        assert!(generate.contains("cargo run --release --bin generate -- MODEL.gguf"));
        for text in [main, generate] {
            assert!(!text.contains("--example"), "{text}");
        }
        assert!(get("README.md").contains("--bin generate"));
        // Two binaries: plain `cargo run` needs to know which.
        assert!(get("Cargo.toml").contains("default-run = \"demo\""));
    }

    #[test]
    fn refuses_a_folder_that_is_not_empty_and_writes_nothing() {
        let dir = std::env::temp_dir().join(format!("toy-new-busy-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("keep.txt"), "mine").unwrap();
        let files = project_files("busy", false, &Source::Version("0.1.0".into())).unwrap();
        let err = write_project(&dir, &files).unwrap_err().to_string();
        assert!(err.contains("not empty"), "{err}");
        let names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["keep.txt"]);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_path_project_points_at_the_checkout_and_takes_its_lock() {
        let root = checkout(Path::new(BUILT_FROM)).unwrap();
        let files = project_files("demo", true, &Source::Path(root.clone())).unwrap();
        let get = |p: &str| &files.iter().find(|(q, _)| q == Path::new(p)).unwrap().1;
        let toml = get("Cargo.toml");
        assert!(toml.contains("name = \"demo\""), "{toml}");
        assert!(
            !toml.contains("default-run"),
            "a library has no binary to run: {toml}"
        );
        let models = format!(
            "toy-models = {{ path = \"{}\" }}",
            root.join("toy-models").display()
        );
        assert!(toml.contains(&models), "{toml}");
        assert!(get("src/lib.rs").contains("pub fn train_tiny_model"));
        assert!(get("Cargo.lock").contains("name = \"burn\""));
        assert!(!files.iter().any(|(p, _)| p == Path::new("src/main.rs")));
    }
}
