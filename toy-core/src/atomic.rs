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
