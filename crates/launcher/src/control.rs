//! The control socket of a running VM (`<runtime>/<name>/control.sock`): other vmsight
//! commands (e.g. `vmsight stream NAME`) ask the `vmsight run` process to do things.
//!
//! Protocol: the client sends one JSON object on one line, `{"cmd": "...", ...}`, and reads
//! one JSON line back: `{"ok": true, ...}` or `{"ok": false, "error": "sentence"}`. One
//! request per connection. Lines longer than 64 KiB are refused. The socket is served by
//! [`vmsight_proto::server::UnixServer`], which sleeps until a client connects or the server
//! stops.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_json::{json, Value};
use vmsight_proto::server::{ServeError, UnixServer};

/// Longest request line accepted.
const MAX_LINE: u64 = 64 * 1024;
/// A client that sends nothing for this long is dropped (it must not pin a thread).
const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);

/// Answers one request: `Ok(fields)` are merged into `{"ok": true}`; `Err(sentence)` becomes
/// `{"ok": false, "error": sentence}`.
pub type Handler = Arc<dyn Fn(&Value) -> Result<Value, String> + Send + Sync>;

/// The listening control socket; stops accepting and removes the socket when dropped.
#[derive(Debug)]
pub struct ControlServer {
    server: UnixServer,
}

impl ControlServer {
    /// Binds `path` and serves requests with `handler`, each connection on a short-lived
    /// thread of its own (a stuck client cannot block the next one).
    pub fn bind(path: &Path, handler: Handler) -> Result<Self, ServeError> {
        let server = UnixServer::bind(path, "vmsight-control", move |conn| match conn {
            Ok(conn) => {
                let h = handler.clone();
                let spawned = std::thread::Builder::new()
                    .name("vmsight-control-conn".into())
                    .spawn(move || serve_one(conn, &h));
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

fn serve_one(conn: UnixStream, handler: &Handler) {
    let _ = conn.set_read_timeout(Some(CLIENT_TIMEOUT));
    let _ = conn.set_write_timeout(Some(CLIENT_TIMEOUT));
    let Ok(write_half) = conn.try_clone() else {
        return;
    };
    let mut line = String::new();
    let mut reader = BufReader::new(conn.take(MAX_LINE + 1));
    let reply = match reader.read_line(&mut line) {
        Ok(n) if n as u64 > MAX_LINE => error_reply("the request is longer than 64 KiB"),
        Ok(0) => return,
        Ok(_) => match serde_json::from_str::<Value>(line.trim()) {
            Ok(req) if req.get("cmd").and_then(Value::as_str).is_some() => match handler(&req) {
                Ok(mut fields) => {
                    if let Some(obj) = fields.as_object_mut() {
                        obj.insert("ok".into(), Value::Bool(true));
                        fields
                    } else {
                        json!({"ok": true, "result": fields})
                    }
                }
                Err(e) => error_reply(&e),
            },
            Ok(_) => error_reply("the request has no \"cmd\" string"),
            Err(e) => error_reply(&format!("the request is not JSON: {e}")),
        },
        Err(e) => error_reply(&format!("cannot read the request: {e}")),
    };
    let mut w = write_half;
    let _ = writeln!(w, "{reply}");
}

fn error_reply(msg: &str) -> Value {
    json!({"ok": false, "error": msg})
}

/// Sends `req` to the control socket at `path` and returns the reply's fields, or the error
/// sentence the VM gave.
pub fn call(path: &Path, req: &Value) -> Result<Value, String> {
    let mut conn = UnixStream::connect(path).map_err(|e| {
        format!(
            "cannot reach the VM's control socket {}: {e}",
            path.display()
        )
    })?;
    let _ = conn.set_read_timeout(Some(Duration::from_secs(120)));
    writeln!(conn, "{req}").map_err(|e| format!("cannot send the request: {e}"))?;
    let mut line = String::new();
    BufReader::new(conn.take(16 << 20))
        .read_line(&mut line)
        .map_err(|e| format!("no answer from the VM: {e}"))?;
    let v: Value = serde_json::from_str(line.trim())
        .map_err(|e| format!("the VM's answer is not JSON: {e}"))?;
    if v.get("ok").and_then(Value::as_bool) == Some(true) {
        Ok(v)
    } else {
        Err(v
            .get("error")
            .and_then(Value::as_str)
            .unwrap_or("the VM refused the request without a reason")
            .to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_get_answers_and_errors_are_sentences() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sock = dir.path().join("control.sock");
        let handler: Handler = Arc::new(|req: &Value| match req["cmd"].as_str() {
            Some("echo") => Ok(json!({"echo": req["arg"].clone()})),
            _ => Err("unknown command".into()),
        });
        let srv = ControlServer::bind(&sock, handler).expect("binds");
        assert_eq!(srv.path(), sock);
        let r = call(&sock, &json!({"cmd": "echo", "arg": 7})).expect("answers");
        assert_eq!(r["echo"], 7);
        let e = call(&sock, &json!({"cmd": "nope"})).expect_err("refused");
        assert_eq!(e, "unknown command");
        let e = call(&sock, &json!({"nocmd": 1})).expect_err("refused");
        assert!(e.contains("no \"cmd\""), "{e}");
        // Garbage does not stop the server.
        let mut c = UnixStream::connect(&sock).expect("connects");
        writeln!(c, "not json").expect("writes");
        let mut line = String::new();
        BufReader::new(c).read_line(&mut line).expect("reads");
        assert!(line.contains("not JSON"), "{line}");
        assert!(call(&sock, &json!({"cmd": "echo", "arg": 1})).is_ok());
        drop(srv);
        assert!(!sock.exists(), "the socket is removed with the server");
    }

    #[test]
    fn missing_socket_is_a_clear_error() {
        let e = call(Path::new("/nonexistent/control.sock"), &json!({"cmd": "x"}))
            .expect_err("no socket");
        assert!(e.contains("cannot reach"), "{e}");
    }
}
