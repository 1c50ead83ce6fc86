//! Embeds the bundled image corpus (`fixtures/digits/{train,val}/<digit>/*.png`, written by
//! `fixtures/digits/make_digits.py`) as a table of `(relative path, bytes)`, so that
//! `toy train --arch vit-tiny` runs with no arguments, from any directory.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            files(&path, out);
        } else if path.extension().is_some_and(|e| e == "png") {
            out.push(path);
        }
    }
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/digits");
    println!("cargo:rerun-if-changed={}", root.display());
    let mut paths = Vec::new();
    for split in ["train", "val"] {
        files(&root.join(split), &mut paths);
    }
    paths.sort();
    let mut table = String::from("&[\n");
    for path in &paths {
        let name = path.strip_prefix(&root).expect("under the root");
        let absolute = path.canonicalize().expect("a listed file exists");
        writeln!(
            table,
            "    ({:?}, include_bytes!({:?})),",
            name.to_string_lossy(),
            absolute.to_string_lossy()
        )
        .expect("writing to a string");
    }
    table.push(']');
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    std::fs::write(out.join("bundled_digits.rs"), table).expect("OUT_DIR is writable");
}
