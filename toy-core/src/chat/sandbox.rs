//! A chat template renders in a child process with an address-space limit (Linux).
//!
//! minijinja bounds loops (fuel), recursion, `range` and `*` repetition, but not the size of a
//! string built by concatenation: `{% set ns.s = ns.s ~ ns.s %}` sixty times asks for exabytes,
//! and a failed allocation aborts the whole process (Rust cannot recover from one). So the
//! render runs in a forked copy of the process whose address space may grow by
//! [`MEMORY_BUDGET`] only: a template that exhausts it kills the copy, and the caller gets a
//! one-line error instead of losing the model, the server and every other request.
//!
//! Forking copies the process's page tables and marks its pages copy-on-write: ~40 ms per GiB
//! resident on the machines measured, so forking a server that holds a model for every request
//! would be slow. [`start`] therefore forks, while the process is still small (before the model
//! loads), a *zygote*: a copy that only waits for render jobs on a socket and forks a small
//! child for each (~0.5 ms). Where no zygote was started (a library user, a test), each render
//! forks the process itself. Forking a multi-threaded process leaves only the forking thread in
//! the child; glibc makes `malloc` usable there, and the child runs nothing but minijinja and
//! `write`, then `_exit`s. A child that still blocks (a lock held by a thread that did not come
//! along) is killed after `TIMEOUT`.

use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::{ChatError, RenderJob};

/// How much the render's address space may grow.
pub const MEMORY_BUDGET: u64 = 512 << 20;

/// How long a render may take, wall clock (the fuel budget stops a busy loop in about a second).
const TIMEOUT: Duration = Duration::from_secs(30);

/// The socket to the zygote, once [`start`] made one.
static ZYGOTE: Mutex<Option<UnixStream>> = Mutex::new(None);

/// Fork the zygote that renders every later template (see the module comment). Call it early,
/// before the process holds a model: the zygote keeps a copy of the process as it is now. A
/// program that never calls it still renders safely, forking itself per render.
pub fn start() -> std::io::Result<()> {
    let (parent, child) = UnixStream::pair()?;
    // SAFETY: the child runs only `zygote` (this crate's code) and `_exit`s.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if pid == 0 {
        drop(parent);
        zygote(child);
    }
    drop(child);
    *ZYGOTE.lock().unwrap_or_else(|e| e.into_inner()) = Some(parent);
    Ok(())
}

/// The zygote's life: each job in, rendered in a limited child of its own, the reply out —
/// until the parent closes the socket (or exits).
fn zygote(mut socket: UnixStream) -> ! {
    while let Ok(frame) = read_frame(&mut socket) {
        let reply = match serde_json::from_slice::<RenderJob>(&frame) {
            Ok(job) => encode(&isolated(|| job.render_here())),
            Err(e) => encode(&Err(ChatError::Template(format!("bad render job: {e}")))),
        };
        if write_frame(&mut socket, &reply).is_err() {
            break;
        }
    }
    // SAFETY: ends the zygote without running the parent's exit handlers.
    unsafe { libc::_exit(0) }
}

/// Render `job` in a child process limited to [`MEMORY_BUDGET`] more address space: the
/// zygote's where there is one, else a fork of this process.
#[cfg_attr(fuzzing, allow(dead_code))] // (a fuzzing build renders in process)
pub(super) fn render(job: &RenderJob<'_>) -> Result<String, ChatError> {
    {
        let mut zygote = ZYGOTE.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(socket) = zygote.as_mut() {
            let frame = serde_json::to_vec(job).expect("a render job serializes");
            match write_frame(socket, &frame).and_then(|()| read_frame(socket)) {
                Ok(reply) => return decode(&reply),
                // The zygote is gone (killed from outside): fork this process from now on.
                Err(_) => *zygote = None,
            }
        }
    }
    isolated(|| job.render_here())
}

/// One length-prefixed message.
fn write_frame(socket: &mut UnixStream, bytes: &[u8]) -> std::io::Result<()> {
    socket.write_all(&(bytes.len() as u64).to_le_bytes())?;
    socket.write_all(bytes)
}

fn read_frame(socket: &mut UnixStream) -> std::io::Result<Vec<u8>> {
    let mut len = [0u8; 8];
    socket.read_exact(&mut len)?;
    let mut bytes = vec![0u8; u64::from_le_bytes(len) as usize];
    socket.read_exact(&mut bytes)?;
    Ok(bytes)
}

/// Run `render` in a forked child limited to [`MEMORY_BUDGET`] more address space, and return
/// what it returned.
fn isolated(render: impl FnOnce() -> Result<String, ChatError>) -> Result<String, ChatError> {
    let failed =
        |what: &str| ChatError::Template(format!("could not render the chat template: {what}"));
    let address_space =
        current_address_space().ok_or_else(|| failed("/proc/self/statm unreadable"))?;
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(failed(&std::io::Error::last_os_error().to_string()));
    }
    // SAFETY: both descriptors were just opened and are owned here only.
    let (read_end, write_end) =
        unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    let null = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/null")
        .ok();
    // SAFETY: the child only renders (allocating through glibc's fork-safe malloc), writes to
    // the pipe and `_exit`s; see the module comment.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(failed(&std::io::Error::last_os_error().to_string()));
    }
    if pid == 0 {
        child(render, write_end, null, address_space);
    }
    drop(write_end);
    drop(null);
    let reply = read_reply(read_end, pid);
    let status = reap(pid);
    match reply {
        Some(reply) if status == Some(0) => decode(&reply),
        _ if status == Some(OUT_OF_STACK) => Err(ChatError::Template(
            "the chat template nests too deeply to render (the renderer ran out of stack: \
             thousands of chained operators, filters or attributes?); it is not a usable chat \
             template"
                .into(),
        )),
        _ => Err(ChatError::Template(format!(
            "the chat template needed more than {} MiB or {} s to render (a runaway template?); \
             it is not a usable chat template",
            MEMORY_BUDGET >> 20,
            TIMEOUT.as_secs()
        ))),
    }
}

/// The child's whole life: limit, render, reply, exit — never returning into the caller's code.
fn child(
    render: impl FnOnce() -> Result<String, ChatError>,
    out: OwnedFd,
    null: Option<std::fs::File>,
    address_space: u64,
) -> ! {
    use std::os::fd::AsRawFd;
    // SAFETY: plain system calls on this process and descriptors it owns.
    unsafe {
        // The abort message of a failed allocation is the parent's to report, in its words.
        if let Some(null) = &null {
            libc::dup2(null.as_raw_fd(), libc::STDERR_FILENO);
        }
        let limit = libc::rlimit {
            rlim_cur: address_space + MEMORY_BUDGET,
            rlim_max: address_space + MEMORY_BUDGET,
        };
        libc::setrlimit(libc::RLIMIT_AS, &limit);
        // minijinja's parser and compiler recurse once per operator of a chain (`1+1+1…`,
        // `x|f|f…`) with no depth limit of their own, so a few hundred KiB of template run the
        // stack out. A fault here is that (the child runs only minijinja): exit with a code the
        // parent reads as such, on the alternate signal stack Rust's runtime gave this thread.
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = out_of_stack as *const () as libc::sighandler_t;
        action.sa_flags = libc::SA_ONSTACK;
        libc::sigaction(libc::SIGSEGV, &action, std::ptr::null_mut());
        libc::sigaction(libc::SIGBUS, &action, std::ptr::null_mut());
    }
    let reply = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(render)) {
        Ok(result) => encode(&result),
        Err(_) => encode(&Err(ChatError::Template(
            "the template renderer panicked".into(),
        ))),
    };
    let mut rest = &reply[..];
    while !rest.is_empty() {
        // SAFETY: `rest` is valid for its length; `out` is the pipe's open write end.
        let n = unsafe { libc::write(out.as_raw_fd(), rest.as_ptr().cast(), rest.len()) };
        if n <= 0 {
            break;
        }
        rest = &rest[n as usize..];
    }
    // SAFETY: ends the child without running the parent's exit handlers or destructors.
    unsafe { libc::_exit(0) }
}

/// The exit code of a child whose render ran out of stack.
const OUT_OF_STACK: i32 = 86;

extern "C" fn out_of_stack(_: libc::c_int) {
    // SAFETY: `_exit` is async-signal-safe.
    unsafe { libc::_exit(OUT_OF_STACK) }
}

/// The child's reply, read until it closes the pipe or [`TIMEOUT`] passes (then it is killed).
fn read_reply(read_end: OwnedFd, pid: libc::pid_t) -> Option<Vec<u8>> {
    use std::os::fd::AsRawFd;
    let deadline = Instant::now() + TIMEOUT;
    let fd = read_end.as_raw_fd();
    let mut file = std::fs::File::from(read_end);
    let mut reply = Vec::new();
    let mut buf = [0u8; 1 << 16];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut poll = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let ready =
            unsafe { libc::poll(&mut poll, 1, left.as_millis().min(i32::MAX as u128) as i32) };
        if ready < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        if ready <= 0 {
            // SAFETY: `pid` is this process's child, not yet reaped.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            return None;
        }
        match file.read(&mut buf) {
            Ok(0) => return Some(reply),
            Ok(n) => reply.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
}

/// Wait for the child; its exit code, or `None` where a signal ended it.
fn reap(pid: libc::pid_t) -> Option<i32> {
    let mut status = 0;
    loop {
        // SAFETY: `pid` is this process's child; `status` is written by the call.
        let r = unsafe { libc::waitpid(pid, &mut status, 0) };
        if r == pid {
            return libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
        }
        if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return None;
        }
    }
}

/// The process's address space in bytes (the first field of `/proc/self/statm`, in pages).
fn current_address_space() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().next()?.parse().ok()?;
    // SAFETY: no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * page.max(4096) as u64)
}

/// A render's result as bytes: a tag (`O`k, `T`emplate error, `R`efused) and the text.
fn encode(result: &Result<String, ChatError>) -> Vec<u8> {
    let (tag, text) = match result {
        Ok(s) => (b'O', s),
        Err(ChatError::Template(m)) => (b'T', m),
        Err(ChatError::Refused(m)) => (b'R', m),
    };
    let mut out = Vec::with_capacity(1 + text.len());
    out.push(tag);
    out.extend_from_slice(text.as_bytes());
    out
}

/// The inverse of [`encode`].
fn decode(reply: &[u8]) -> Result<String, ChatError> {
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    match reply.split_first() {
        Some((b'O', s)) => Ok(text(s)),
        Some((b'R', s)) => Err(ChatError::Refused(text(s))),
        Some((b'T', s)) => Err(ChatError::Template(text(s))),
        _ => Err(ChatError::Template(
            "the template renderer gave no answer".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use std::borrow::Cow;

    use super::*;

    /// Without a zygote the caller forks itself, under the same limit: a runaway template is an
    /// error, not an abort (the zygote's path: `chat::tests`).
    #[test]
    fn a_fork_of_the_caller_stops_a_runaway_template() {
        let messages = serde_json::json!([]);
        let job = |template: &'static str| RenderJob {
            template: template.into(),
            messages: Cow::Borrowed(&messages),
            tools: None,
            add_generation_prompt: false,
            bos_token: "".into(),
            eos_token: "".into(),
        };
        let err = isolated(|| job(super::super::tests::DOUBLING).render_here()).unwrap_err();
        assert!(
            matches!(&err, ChatError::Template(m) if m.contains("MiB")),
            "{err:?}"
        );
        assert_eq!(isolated(|| job("ok").render_here()).unwrap(), "ok");
    }
}
