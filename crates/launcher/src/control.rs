//! The control socket of a running VM (`<runtime>/<name>/control.sock`): other vmsight
//! commands (e.g. `vmsight stream NAME`) ask the `vmsight run` process to do things.
//!
//! The messages are [`ControlRequest`] and [`ControlReply`] (`vmsight_proto::control`, JSON
//! lines: `{"cmd": "..."}` in, `{"ok": true, ...}` or `{"ok": false, "error": "sentence"}`
//! out). This module is the framing: one request per connection, request lines longer than
//! 64 KiB refused, a client that sends nothing for 5 s dropped. The socket is served by
//! [`vmsight_proto::server::UnixServer`], which sleeps until a client connects or the server
//! stops.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use vmsight_proto::control::{ControlReply, ControlRequest, RequestError};
use vmsight_proto::server::{ServeError, UnixServer};

/// Longest request line accepted.
const MAX_LINE: u64 = 64 * 1024;
/// Longest reply line read.
const MAX_REPLY: u64 = 16 << 20;
/// A client that sends nothing for this long is dropped (it must not pin a thread).
const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a client waits for the answer (`stream-start` waits for crawls).
const CALL_TIMEOUT: Duration = Duration::from_secs(120);

/// Errors of the control socket, on both sides.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The server could not start.
    #[error(transparent)]
    Serve(#[from] ServeError),
    /// The socket cannot be reached (no such VM, or it is ending).
    #[error("cannot reach the VM's control socket {path}: {source}")]
    Connect {
        /// The socket.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The request could not be sent.
    #[error("cannot send the request to {path}: {source}")]
    Send {
        /// The socket.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// No answer came.
    #[error("no answer from the VM on {path}: {source}")]
    Receive {
        /// The socket.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The answer is not a control reply.
    #[error("the VM's answer on {path} is not a control reply: {source}")]
    BadReply {
        /// The socket.
        path: PathBuf,
        /// Cause.
        #[source]
        source: serde_json::Error,
    },
    /// A request given as JSON is not a control request.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// The VM refused the request; the sentence says why.
    #[error("{0}")]
    Refused(String),
}

/// Answers one request. A refusal is [`ControlReply::Refused`] with a sentence.
pub type Service = Arc<dyn Fn(ControlRequest) -> ControlReply + Send + Sync>;

/// The listening control socket; stops accepting and removes the socket when dropped.
#[derive(Debug)]
pub struct ControlServer {
    server: UnixServer,
}

impl ControlServer {
    /// Binds `path` and answers requests with `service`, each connection on a short-lived
    /// thread of its own (a stuck client cannot block the next one).
    pub fn serve(path: &Path, service: Service) -> Result<Self, ControlError> {
        let server = UnixServer::bind(path, "vmsight-control", move |conn| match conn {
            Ok(conn) => {
                let s = Arc::clone(&service);
                let spawned = std::thread::Builder::new()
                    .name("vmsight-control-conn".into())
                    .spawn(move || serve_one(conn, &s));
                if let Err(e) = spawned {
                    tracing::warn!("control: cannot start a connection thread: {e}");
                }
            }
            Err(e) => tracing::warn!("control: accept failed: {e}"),
        })?;
        Ok(Self { server })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        self.server.path()
    }
}

/// Reads one request from `conn` and writes the answer.
fn serve_one(conn: UnixStream, service: &Service) {
    let _ = conn.set_read_timeout(Some(CLIENT_TIMEOUT));
    let _ = conn.set_write_timeout(Some(CLIENT_TIMEOUT));
    let Ok(mut write_half) = conn.try_clone() else {
        return;
    };
    let mut line = String::new();
    let mut reader = BufReader::new(conn.take(MAX_LINE + 1));
    let reply = match reader.read_line(&mut line) {
        Ok(0) => return,
        Ok(n) if n as u64 > MAX_LINE => {
            ControlReply::Refused("the request is longer than 64 KiB".into())
        }
        Ok(_) => match ControlRequest::parse(&line) {
            Ok(req) => service(req),
            Err(e) => ControlReply::Refused(e.to_string()),
        },
        Err(e) => ControlReply::Refused(format!("cannot read the request: {e}")),
    };
    let _ = writeln!(write_half, "{}", reply.to_line());
}

/// Sends `req` to the control socket at `path` and returns the answer; a refusal is
/// [`ControlError::Refused`].
pub fn request(path: &Path, req: ControlRequest) -> Result<ControlReply, ControlError> {
    let mut conn = UnixStream::connect(path).map_err(|source| ControlError::Connect {
        path: path.into(),
        source,
    })?;
    let _ = conn.set_read_timeout(Some(CALL_TIMEOUT));
    writeln!(conn, "{}", req.to_line()).map_err(|source| ControlError::Send {
        path: path.into(),
        source,
    })?;
    let mut line = String::new();
    BufReader::new(conn.take(MAX_REPLY))
        .read_line(&mut line)
        .map_err(|source| ControlError::Receive {
            path: path.into(),
            source,
        })?;
    match ControlReply::parse(&line) {
        Ok(ControlReply::Refused(reason)) => Err(ControlError::Refused(reason)),
        Ok(reply) => Ok(reply),
        Err(source) => Err(ControlError::BadReply {
            path: path.into(),
            source,
        }),
    }
}

/// [`request`] for a request and reply as JSON values (`{"cmd": ...}` in, the whole reply
/// object out).
pub fn call(path: &Path, req: &Value) -> Result<Value, ControlError> {
    let req = ControlRequest::from_value(req.clone())?;
    let reply = request(path, req)?;
    serde_json::to_value(reply).map_err(|source| ControlError::BadReply {
        path: path.into(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use vmsight_proto::control::VmStatus;

    fn status(disks: usize) -> VmStatus {
        VmStatus {
            disks: (0..disks)
                .map(|disk| vmsight_proto::control::DiskStatus {
                    disk,
                    streaming: false,
                    tap: json!({"events": 0}),
                    inference: None,
                    stages: Vec::new(),
                    stage_counters: Default::default(),
                })
                .collect(),
            insights: None,
        }
    }

    fn typed_server(sock: &Path) -> ControlServer {
        let service: Service = Arc::new(|req| match req {
            ControlRequest::Status => ControlReply::Status(status(2)),
            ControlRequest::StreamStart => ControlReply::Refused("nothing to stream".into()),
            ControlRequest::DedupGc { .. } => ControlReply::DedupGc { freed: 3 },
            ControlRequest::Idle { .. } => ControlReply::IdleMarks(Vec::new()),
            ControlRequest::ShareResize { .. } => ControlReply::Refused("no share".into()),
            ControlRequest::HylicsController => ControlReply::Refused("no controller".into()),
            ControlRequest::Redirect(_) => ControlReply::Refused("no plugin".into()),
            ControlRequest::SymSpy | ControlRequest::SymCall(_) => {
                ControlReply::Refused("no symbiotic interface".into())
            }
            ControlRequest::Swap { .. } => ControlReply::Refused("no swap disk".into()),
        });
        ControlServer::serve(sock, service).expect("binds")
    }

    #[test]
    fn typed_requests_get_typed_answers() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = dir.path().join("control.sock");
        let srv = typed_server(&sock);
        assert_eq!(srv.path(), sock);
        assert_eq!(
            request(&sock, ControlRequest::Status).expect("answers"),
            ControlReply::Status(status(2))
        );
        let e = request(&sock, ControlRequest::StreamStart).expect_err("refused");
        assert_eq!(e.to_string(), "nothing to stream");
        let gc = ControlRequest::DedupGc {
            volume: "/v".into(),
        };
        assert_eq!(
            request(&sock, gc).expect("answers"),
            ControlReply::DedupGc { freed: 3 }
        );
        let v = call(&sock, &json!({"cmd": "status"})).expect("answers");
        assert_eq!(v["ok"], true);
        assert_eq!(v["disks"][1]["disk"], 1);
        drop(srv);
        assert!(!sock.exists(), "the socket is removed with the server");
    }

    #[test]
    fn bad_requests_are_refused_and_the_server_keeps_serving() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = dir.path().join("control.sock");
        let _srv = typed_server(&sock);
        let e = call(&sock, &json!({"nocmd": 1})).expect_err("refused");
        assert!(e.to_string().contains("no \"cmd\""), "{e}");
        let e = call(&sock, &json!({"cmd": "nope"})).expect_err("refused");
        assert!(e.to_string().contains("unknown command"), "{e}");
        // Garbage and an over-long line reach the server and are answered.
        for bad in ["not json".to_string(), "x".repeat(70_000)] {
            let mut c = UnixStream::connect(&sock).expect("connects");
            // The server stops reading an over-long line at its limit,
            // answers and closes, so the rest of the write may meet a
            // closed socket; the answer is still there to read.
            if let Err(e) = writeln!(c, "{bad}") {
                assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe, "{e}");
            }
            let mut line = String::new();
            BufReader::new(c).read_line(&mut line).expect("reads");
            let reply = ControlReply::parse(&line).expect("a reply");
            assert!(matches!(reply, ControlReply::Refused(_)), "{line}");
        }
        assert!(request(&sock, ControlRequest::Status).is_ok());
    }

    #[test]
    fn missing_socket_is_a_clear_error() {
        let e = request(
            Path::new("/nonexistent/control.sock"),
            ControlRequest::Status,
        )
        .expect_err("no socket");
        assert!(matches!(e, ControlError::Connect { .. }), "{e}");
        assert!(e.to_string().contains("cannot reach"), "{e}");
    }
}
