//! `toy_core::atomic` under faults: a failing producer, a full disk, a read-only directory, and a
//! writer killed at random moments.

#[path = "../../test-support/tmpfs.rs"]
mod tmpfs;

use std::fs;
use std::io;
use std::path::PathBuf;

use tmpfs::{Tmpfs, names};
use toy_core::atomic::{write_atomic, write_atomic_with};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("toy-atomic-{name}-{}", std::process::id()));
    let _ = fs::remove_dir_all(&dir);
    fs::create_dir_all(&dir).unwrap();
    dir
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

/// A full disk: the write fails with the OS's error, the old file is whole, and no
/// temporary file takes the space.
#[test]
fn a_full_disk_leaves_the_old_file() {
    let Some(disk) = Tmpfs::mount(scratch("full"), "1m") else {
        return;
    };
    let path = disk.path().join("model.gguf");
    write_atomic(&path, &[1; 300 << 10]).unwrap();
    let err = write_atomic(&path, &[2; 2 << 20]).unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    assert_eq!(fs::read(&path).unwrap(), [1; 300 << 10]);
    assert_eq!(disk.names(), ["model.gguf"]);
    // The space is back: a write that fits succeeds.
    write_atomic(&path, &[3; 600 << 10]).unwrap();
}

/// A read-only directory (a read-only mount: root ignores permission bits).
#[test]
fn a_read_only_directory_is_an_error() {
    let Some(disk) = Tmpfs::mount(scratch("ro"), "1m") else {
        return;
    };
    let path = disk.path().join("config.json");
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
