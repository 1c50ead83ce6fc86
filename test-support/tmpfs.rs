//! A small tmpfs for fault tests (a full disk, a read-only directory). One file, included by
//! each test suite with `#[path = ".../test-support/tmpfs.rs"] mod tmpfs;`.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// A tmpfs mounted at a directory, unmounted (and the directory removed) on drop.
pub struct Tmpfs(PathBuf);

impl Tmpfs {
    /// Mount a tmpfs of `size` (`mount`'s syntax: "1m") at `dir`, made afresh; `None`, after
    /// saying "skipped" on stderr, where this process may not mount (not root).
    pub fn mount(dir: PathBuf, size: &str) -> Option<Tmpfs> {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mounted = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !mounted {
            eprintln!("skipped: cannot mount a tmpfs here (needs root)");
            return None;
        }
        Some(Tmpfs(dir))
    }

    pub fn path(&self) -> &Path {
        &self.0
    }

    /// Make it read-only (root ignores permission bits, so a read-only mount is the honest test).
    pub fn remount_read_only(&self) {
        let status = Command::new("mount")
            .args(["-o", "remount,ro"])
            .arg(&self.0)
            .status()
            .unwrap();
        assert!(status.success(), "remount read-only");
    }

    /// Every name in it, sorted.
    pub fn names(&self) -> Vec<String> {
        names(&self.0)
    }
}

/// Every name in `dir`, sorted (a test's check that nothing else was left there).
pub fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
