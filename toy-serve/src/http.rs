//! The HTTP/1.1 accept loop: axum's router on hyper, with the read deadline `axum::serve` lacks.
//!
//! `axum::serve` gives hyper no timer, so a client that opens a connection and trickles its
//! headers a byte at a time (slow-loris) holds a connection and a task for as long as it likes.
//! Here hyper closes a connection whose request headers are not complete `read_timeout` after it
//! starts reading them (also an idle keep-alive connection); the body has the same deadline in
//! [`crate::server`]'s `read_json`.

use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Serve `app` on `listener` until `stop` turns true, then let the open connections finish
/// their requests (graceful shutdown) and return.
pub(crate) async fn serve_http(
    listener: TcpListener,
    app: Router,
    read_timeout: Duration,
    mut stop: watch::Receiver<bool>,
) {
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(read_timeout);
    let graceful = GracefulShutdown::new();
    loop {
        let stopped = async {
            let _ = stop.wait_for(|stopped| *stopped).await;
        };
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = stopped => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            // Out of file descriptors and the like: the connection is lost either way; pause
            // instead of spinning on the error (as axum::serve does).
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        // Streamed tokens are small writes: send each at once rather than wait for an ACK.
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let connection = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        tokio::spawn(async move {
            // A connection's errors (a reset, a timeout) end that connection only.
            let _ = connection.await;
        });
    }
    graceful.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::time::Instant;

    /// `app` served by [`serve_http`] on a free local port: the runtime, the address, the stop
    /// switch and the server's task.
    struct Running {
        runtime: tokio::runtime::Runtime,
        addr: std::net::SocketAddr,
        stop: watch::Sender<bool>,
        server: tokio::task::JoinHandle<()>,
    }

    impl Running {
        fn start(app: Router, read_timeout: Duration) -> Self {
            let runtime = tokio::runtime::Runtime::new().unwrap();
            let listener = runtime
                .block_on(TcpListener::bind(("127.0.0.1", 0)))
                .unwrap();
            let addr = listener.local_addr().unwrap();
            let (stop, stop_rx) = watch::channel(false);
            let server = runtime.spawn(serve_http(listener, app, read_timeout, stop_rx));
            Running {
                runtime,
                addr,
                stop,
                server,
            }
        }

        fn stop(self) {
            self.stop.send(true).unwrap();
            self.runtime.block_on(self.server).unwrap();
        }
    }

    /// A client that sends half of its headers and then nothing is disconnected after the
    /// read timeout; a whole request on another connection is still answered.
    #[test]
    fn a_client_trickling_its_headers_is_cut_off() {
        let app = Router::new().route("/", axum::routing::get(|| async { "hello" }));
        let server = Running::start(app, Duration::from_millis(300));
        let addr = server.addr;

        let mut slow = std::net::TcpStream::connect(addr).unwrap();
        slow.set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        slow.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n").unwrap();
        let started = Instant::now();
        let mut reply = Vec::new();
        // The server closes the connection (end of stream, maybe after a 408) or resets it.
        let _ = slow.read_to_end(&mut reply);
        let waited = started.elapsed();
        assert!(
            waited < Duration::from_secs(10),
            "a half-sent request held its connection for {waited:?}"
        );
        let reply = String::from_utf8_lossy(&reply);
        assert!(
            reply.is_empty() || reply.starts_with("HTTP/1.1 408"),
            "{reply}"
        );

        let mut fast = std::net::TcpStream::connect(addr).unwrap();
        fast.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .unwrap();
        let mut answer = String::new();
        fast.read_to_string(&mut answer).unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("hello"), "{answer}");

        server.stop();
    }

    /// The limit on concurrent streams per connection is one, by construction: the server
    /// speaks HTTP/1.1 only, whose requests on one connection run one after the other (a
    /// pipelining client waits for each answer in turn), and an HTTP/2 client is refused.
    #[test]
    fn one_connection_runs_one_request_at_a_time() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};
        let (running, most) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (r, m) = (running.clone(), most.clone());
        let app = Router::new().route(
            "/",
            axum::routing::get(move || {
                let (r, m) = (r.clone(), m.clone());
                async move {
                    let now = r.fetch_add(1, Ordering::SeqCst) + 1;
                    m.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    r.fetch_sub(1, Ordering::SeqCst);
                    "done"
                }
            }),
        );
        let server = Running::start(app, Duration::from_secs(5));
        let addr = server.addr;

        // Three requests written at once on one connection.
        let mut client = std::net::TcpStream::connect(addr).unwrap();
        client
            .write_all(
                b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n\
                  GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            )
            .unwrap();
        let mut answers = String::new();
        client.read_to_string(&mut answers).unwrap();
        assert_eq!(answers.matches("HTTP/1.1 200").count(), 3, "{answers}");
        assert_eq!(
            most.load(Ordering::SeqCst),
            1,
            "requests of one connection overlapped"
        );

        // HTTP/2's connection preface is not a request this server takes.
        let mut h2 = std::net::TcpStream::connect(addr).unwrap();
        h2.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        h2.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").unwrap();
        let mut reply = Vec::new();
        let _ = h2.read_to_end(&mut reply);
        let reply = String::from_utf8_lossy(&reply);
        assert!(!reply.contains("200"), "{reply}");

        server.stop();
    }
}
