//! The control socket of a running VM (`<runtime>/<name>/control.sock`): other vmsight
//! commands (e.g. `vmsight stream NAME`) ask the `vmsight run` process to do things.
//!
//! Protocol: the client sends one JSON object on one line, `{"cmd": "...", ...}`, and reads
//! one JSON line back: `{"ok": true, ...}` or `{"ok": false, "error": "sentence"}`. One
//! request per connection. Lines longer than 64 KiB are refused.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::{json, Value};

/// Longest request line accepted.
const MAX_LINE: u64 = 64 * 1024;
/// A client that sends nothing for this long is dropped (it must not pin a thread).
const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);

/// Answers one request: `Ok(fields)` are merged into `{"ok": true}`; `Err(sentence)` becomes
/// `{"ok": false, "error": sentence}`.
pub type Handler = Arc<dyn Fn(&Value) -> Result<Value, String> + Send + Sync>;

/// The listening control socket; stops accepting when dropped.
pub struct ControlServer {
    stop: Arc<AtomicBool>,
    path: std::path::PathBuf,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for ControlServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlServer")
            .field("path", &self.path)
            .finish()
    }
}

impl ControlServer {
    /// Binds `path` and serves requests with `handler` on a background thread.
    pub fn bind(path: &Path, handler: Handler) -> std::io::Result<Self> {
        let _ = std::fs::remove_file(path);
        let listener = UnixListener::bind(path)?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("vmsight-control".into())
            .spawn(move || {
                while !stop2.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((conn, _)) => {
                            let h = handler.clone();
                            // One short-lived thread per request: a stuck client cannot block
                            // the next one.
                            let _ = std::thread::Builder::new()
                                .name("vmsight-control-conn".into())
                                .spawn(move || serve_one(conn, &h));
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(50));
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(50)),
                    }
                }
            })?;
        Ok(Self {
            stop,
            path: path.to_owned(),
            thread: Some(thread),
        })
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn serve_one(conn: UnixStream, handler: &Handler) {
    let _ = conn.set_nonblocking(false);
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
        let _srv = ControlServer::bind(&sock, handler).expect("binds");
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
    }

    #[test]
    fn missing_socket_is_a_clear_error() {
        let e = call(Path::new("/nonexistent/control.sock"), &json!({"cmd": "x"}))
            .expect_err("no socket");
        assert!(e.contains("cannot reach"), "{e}");
    }
}
