//! Files written whole or not at all.
//!
//! Every file toy writes for a user (converted and merged models, checkpoints, adapters, run
//! configs, bundled data, plots) goes through [`write_atomic_with`]: the bytes go to a hidden
//! temporary file in the target's directory (`.NAME.tmp-PID-N`), which is flushed to disk and
//! then renamed over the target, and the rename is made durable by syncing the directory. A
//! reader — or a process started after a crash — sees the old file or the new one, never part
//! of one. A write that fails (a full disk, a read-only directory, an error while producing the
//! bytes) removes its temporary file and leaves the target as it was. A process killed while
//! writing cannot clean up: its temporary file stays beside the target (hidden, never under the
//! target's name), as with git or rsync.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Write `bytes` to `path` atomically (see the module docs).
pub fn write_atomic(path: impl AsRef<Path>, bytes: &[u8]) -> io::Result<()> {
    write_atomic_with(path, |out| out.write_all(bytes))
}

/// Write what `write` produces to `path` atomically (see the module docs); returns what `write`
/// returned. `write` gets a buffered writer: many small writes cost nothing extra.
pub fn write_atomic_with<T>(
    path: impl AsRef<Path>,
    write: impl FnOnce(&mut dyn Write) -> io::Result<T>,
) -> io::Result<T> {
    let path = path.as_ref();
    let file_name = path.file_name().ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} does not name a file", path.display()),
        )
    })?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    // Unique per process and call, so concurrent writers never share a temporary file.
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let tmp = dir.join(format!(
        ".{}.tmp-{}-{}",
        file_name.to_string_lossy(),
        std::process::id(),
        COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let file = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
    let written = (|| {
        let mut out = BufWriter::with_capacity(1 << 20, file);
        let value = write(&mut out)?;
        let file = out.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        fs::rename(&tmp, path)?;
        Ok(value)
    })();
    match written {
        Ok(value) => {
            // Make the rename itself durable. Some filesystems cannot fsync a directory; the
            // data is already safe in the renamed file, so that is not an error.
            if let Ok(d) = File::open(&dir) {
                let _ = d.sync_all();
            }
            Ok(value)
        }
        Err(e) => {
            let _ = fs::remove_file(&tmp);
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("toy-atomic-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// Every name in `dir`, sorted.
    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    #[test]
    fn a_write_replaces_the_file_and_leaves_nothing_else() {
        let dir = scratch("replace");
        let path = dir.join("model.gguf");
        write_atomic(&path, b"old").unwrap();
        write_atomic(&path, b"new contents").unwrap();
        assert_eq!(fs::read(&path).unwrap(), b"new contents");
        assert_eq!(names(&dir), ["model.gguf"]);
        // A directory where the file should go: an error, and the temporary file is gone.
        fs::create_dir(dir.join("sub")).unwrap();
        let err = write_atomic(dir.join("sub"), b"x").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::IsADirectory, "{err}");
        assert_eq!(names(&dir), ["model.gguf", "sub"]);
        let err = write_atomic("/", b"x").unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidInput, "{err}");
    }

    /// The producer fails halfway: the error comes back, the old file is intact, and the
    /// temporary file is gone.
    #[test]
    fn a_failed_write_leaves_the_old_file() {
        let dir = scratch("failed");
        let path = dir.join("checkpoint.bin");
        write_atomic(&path, b"old").unwrap();
        let err = write_atomic_with(&path, |out| {
            out.write_all(&[7; 3 << 20])?;
            Err::<(), _>(io::Error::other("the producer failed"))
        })
        .unwrap_err();
        assert_eq!(err.to_string(), "the producer failed");
        assert_eq!(fs::read(&path).unwrap(), b"old");
        assert_eq!(names(&dir), ["checkpoint.bin"]);
    }

    /// A tmpfs of `size` at a fresh directory, unmounted on drop; `None` where this process may
    /// not mount (not root, or in a container without the capability).
    struct Mount(PathBuf);

    impl Mount {
        fn tmpfs(name: &str, size: &str) -> Option<Mount> {
            let dir = scratch(name);
            let ok = std::process::Command::new("mount")
                .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
                .arg(&dir)
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                eprintln!("skipped: cannot mount a tmpfs here (needs root)");
                return None;
            }
            Some(Mount(dir))
        }

        fn remount_read_only(&self) {
            let ok = std::process::Command::new("mount")
                .args(["-o", "remount,ro"])
                .arg(&self.0)
                .status()
                .unwrap();
            assert!(ok.success(), "remount read-only");
        }
    }

    impl Drop for Mount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// A full disk: the write fails with the OS's error, the old file is whole, and no
    /// temporary file takes the space.
    #[test]
    fn a_full_disk_leaves_the_old_file() {
        let Some(disk) = Mount::tmpfs("full", "1m") else {
            return;
        };
        let path = disk.0.join("model.gguf");
        write_atomic(&path, &[1; 300 << 10]).unwrap();
        let err = write_atomic(&path, &[2; 2 << 20]).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
        assert_eq!(fs::read(&path).unwrap(), [1; 300 << 10]);
        assert_eq!(names(&disk.0), ["model.gguf"]);
        // The space is back: a write that fits succeeds.
        write_atomic(&path, &[3; 600 << 10]).unwrap();
    }

    /// A read-only directory (a read-only mount: root ignores permission bits).
    #[test]
    fn a_read_only_directory_is_an_error() {
        let Some(disk) = Mount::tmpfs("ro", "1m") else {
            return;
        };
        let path = disk.0.join("config.json");
        write_atomic(&path, b"{}").unwrap();
        disk.remount_read_only();
        let err = write_atomic(&path, b"{\"new\": 1}").unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
        assert_eq!(fs::read(&path).unwrap(), b"{}");
    }

    /// A writer killed (SIGKILL) at random moments, again and again: the file under the
    /// target's name is always one whole version, never part of one.
    #[test]
    fn a_writer_killed_at_any_moment_leaves_a_whole_file() {
        let dir = scratch("killed");
        let path = dir.join("model.gguf");
        const LEN: usize = 4 << 20;
        let version = |v: u8| vec![v; LEN];
        write_atomic(&path, &version(0)).unwrap();
        let mut state = 0x2545_f491_u64;
        for round in 0..20 {
            // SAFETY: the child only writes files and never returns into the test harness.
            let pid = unsafe { libc::fork() };
            assert!(pid >= 0, "fork");
            if pid == 0 {
                let mut v = 0u8;
                loop {
                    v = v.wrapping_add(1);
                    let _ = write_atomic(&path, &version(v));
                }
            }
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            std::thread::sleep(std::time::Duration::from_micros(state % 40_000));
            // SAFETY: `pid` is this process's child.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, std::ptr::null_mut(), 0);
            }
            let bytes = fs::read(&path).unwrap();
            assert_eq!(bytes.len(), LEN, "round {round}: a partial file");
            assert!(
                bytes.iter().all(|&b| b == bytes[0]),
                "round {round}: two versions mixed"
            );
        }
        let _ = fs::remove_dir_all(&dir);
    }
}
