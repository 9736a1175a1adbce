//! A small QMP client: commands with replies matched by id, events forwarded to a channel.
//!
//! Hand-written rather than the `qapi` crate: qapi 0.15's sync client panics on an early EOF
//! (`read_capabilities` uses `expect`), which happens whenever QEMU dies during start-up, and it
//! decodes events against a schema pinned to one QEMU version, so a new event field breaks the
//! stream. vmsight needs a handful of commands and events and must never panic on QEMU's input.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// A QMP event as QEMU sent it.
#[derive(Debug, Clone)]
pub struct QmpEvent {
    pub name: String,
    pub data: Value,
}

/// Why a QMP session could not be set up or a command failed.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// QEMU's QMP socket did not accept a connection in time.
    #[error("cannot connect to {path}: {source}")]
    Connect {
        /// The QMP socket.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Setting up the connected socket failed.
    #[error("cannot set up the QMP connection {path}: {source}")]
    Setup {
        /// The QMP socket.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// QEMU sent no greeting.
    #[error("no QMP greeting on {path}: {source}")]
    NoGreeting {
        /// The QMP socket.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// The first line is not a QMP greeting.
    #[error("unexpected QMP greeting {greeting:?} on {path}")]
    BadGreeting {
        /// The QMP socket.
        path: PathBuf,
        /// What came instead.
        greeting: String,
    },
    /// The command could not be sent.
    #[error("cannot send {cmd}: {source}")]
    Send {
        /// The command.
        cmd: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// QEMU did not answer in time.
    #[error("no reply to {cmd} within {timeout:?}")]
    Timeout {
        /// The command.
        cmd: String,
        /// How long it waited.
        timeout: Duration,
    },
    /// QEMU answered with an error.
    #[error("{desc}")]
    Failed {
        /// QEMU's error class, e.g. `CommandNotFound`.
        class: String,
        /// QEMU's description.
        desc: String,
    },
    /// The connection closed before the answer.
    #[error("QMP connection closed")]
    Closed,
    /// A thread panicked while holding the session's state.
    #[error("QMP state poisoned")]
    Poisoned,
}

/// The reply of one command as the reader thread delivers it.
type Reply = Result<Value, QmpError>;
type Pending = Arc<Mutex<HashMap<u64, Sender<Reply>>>>;

/// A connected, negotiated QMP session.
pub struct Qmp {
    stream: Mutex<UnixStream>,
    pending: Pending,
    next_id: AtomicU64,
}

impl Qmp {
    /// Connects to QEMU's QMP socket, retrying until `timeout` (QEMU creates it during start-up),
    /// negotiates capabilities and starts a reader thread that sends events to `events`.
    pub fn connect(
        path: &Path,
        timeout: Duration,
        events: Sender<QmpEvent>,
    ) -> Result<Qmp, QmpError> {
        let setup = |source| QmpError::Setup {
            path: path.into(),
            source,
        };
        let stream = connect_retrying(path, timeout)?;
        let mut reader = BufReader::new(stream.try_clone().map_err(setup)?);
        stream.set_read_timeout(Some(timeout)).map_err(setup)?;
        read_greeting(&mut reader, path)?;
        stream.set_read_timeout(None).map_err(setup)?;
        let pending: Pending = Arc::default();
        let qmp = Qmp {
            stream: Mutex::new(stream),
            pending: pending.clone(),
            next_id: AtomicU64::new(1),
        };
        std::thread::Builder::new()
            .name("vmsight-qmp".into())
            .spawn(move || read_loop(reader, pending, events))
            .map_err(setup)?;
        qmp.execute("qmp_capabilities", None, timeout)?;
        Ok(qmp)
    }

    /// Runs a command and waits for its reply.
    pub fn execute(
        &self,
        cmd: &str,
        args: Option<Value>,
        timeout: Duration,
    ) -> Result<Value, QmpError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        self.pending
            .lock()
            .map_err(|_| QmpError::Poisoned)?
            .insert(id, tx);
        let mut msg = json!({ "execute": cmd, "id": id });
        if let Some(a) = args {
            msg["arguments"] = a;
        }
        let mut line = msg.to_string();
        line.push('\n');
        {
            let mut s = self.stream.lock().map_err(|_| QmpError::Poisoned)?;
            s.write_all(line.as_bytes())
                .map_err(|source| QmpError::Send {
                    cmd: cmd.into(),
                    source,
                })?;
        }
        match rx.recv_timeout(timeout) {
            Ok(r) => r,
            Err(_) => {
                if let Ok(mut p) = self.pending.lock() {
                    p.remove(&id);
                }
                Err(QmpError::Timeout {
                    cmd: cmd.into(),
                    timeout,
                })
            }
        }
    }
}

/// Connects to `path`, retrying until `timeout` (QEMU creates the socket during start-up).
fn connect_retrying(path: &Path, timeout: Duration) -> Result<UnixStream, QmpError> {
    let start = Instant::now();
    loop {
        match UnixStream::connect(path) {
            Ok(s) => return Ok(s),
            Err(e) if start.elapsed() < timeout => {
                tracing::trace!("QMP not ready yet: {e}");
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(source) => {
                return Err(QmpError::Connect {
                    path: path.into(),
                    source,
                })
            }
        }
    }
}

/// Reads and checks QEMU's greeting line.
fn read_greeting(reader: &mut BufReader<UnixStream>, path: &Path) -> Result<(), QmpError> {
    let mut greeting = String::new();
    reader
        .read_line(&mut greeting)
        .map_err(|source| QmpError::NoGreeting {
            path: path.into(),
            source,
        })?;
    let is_greeting = serde_json::from_str::<Value>(&greeting)
        .ok()
        .is_some_and(|g| g.get("QMP").is_some());
    if !is_greeting {
        return Err(QmpError::BadGreeting {
            path: path.into(),
            greeting,
        });
    }
    Ok(())
}

/// The result a reply line carries: its `return`, or its `error`.
fn reply_of(v: &Value) -> Reply {
    if let Some(r) = v.get("return") {
        return Ok(r.clone());
    }
    let field = |name: &str, default: &str| {
        v.get("error")
            .and_then(|e| e.get(name))
            .and_then(Value::as_str)
            .unwrap_or(default)
            .to_string()
    };
    Err(QmpError::Failed {
        class: field("class", "GenericError"),
        desc: field("desc", "unknown QMP error"),
    })
}

fn read_loop(mut reader: BufReader<UnixStream>, pending: Pending, events: Sender<QmpEvent>) {
    let mut line = String::new();
    loop {
        line.clear();
        match reader.read_line(&mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let Ok(v) = serde_json::from_str::<Value>(&line) else {
            tracing::warn!("ignoring malformed QMP line {line:?}");
            continue;
        };
        if let Some(name) = v.get("event").and_then(Value::as_str) {
            let ev = QmpEvent {
                name: name.to_string(),
                data: v.get("data").cloned().unwrap_or(Value::Null),
            };
            tracing::debug!("QMP event {} {}", ev.name, ev.data);
            // The receiver may be gone during shutdown; nothing else to do with the event.
            let _ = events.send(ev);
            continue;
        }
        let Some(id) = v.get("id").and_then(Value::as_u64) else {
            continue;
        };
        let reply = reply_of(&v);
        if let Ok(mut p) = pending.lock() {
            if let Some(tx) = p.remove(&id) {
                let _ = tx.send(reply);
            }
        }
    }
    // Wake every waiter: QEMU is gone.
    if let Ok(mut p) = pending.lock() {
        for (_, tx) in p.drain() {
            let _ = tx.send(Err(QmpError::Closed));
        }
    }
}

/// Creates the event channel a [`Qmp`] reports to.
pub fn event_channel() -> (Sender<QmpEvent>, Receiver<QmpEvent>) {
    mpsc::channel()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    /// A fake QMP server speaking the real wire format, to test framing and matching.
    fn serve(listener: UnixListener) {
        let (s, _) = listener.accept().unwrap();
        let mut w = s.try_clone().unwrap();
        let mut r = BufReader::new(s);
        writeln!(w, r#"{{"QMP": {{"version": {{}}, "capabilities": []}}}}"#).unwrap();
        let mut line = String::new();
        while r.read_line(&mut line).unwrap_or(0) > 0 {
            let v: Value = serde_json::from_str(&line).unwrap();
            let id = v["id"].clone();
            match v["execute"].as_str().unwrap() {
                "query-status" => {
                    writeln!(w, r#"{{"event": "STOP", "data": {{}}, "timestamp": {{}}}}"#).unwrap();
                    writeln!(w, "{}", json!({"return": {"status": "running"}, "id": id})).unwrap();
                }
                "bogus" => writeln!(
                    w,
                    "{}",
                    json!({"error": {"class": "CommandNotFound", "desc": "no bogus"}, "id": id})
                )
                .unwrap(),
                _ => writeln!(w, "{}", json!({"return": {}, "id": id})).unwrap(),
            }
            line.clear();
        }
    }

    #[test]
    fn commands_get_replies_and_events_are_forwarded() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        let l = UnixListener::bind(&path).unwrap();
        std::thread::spawn(move || serve(l));
        let (tx, rx) = event_channel();
        let q = Qmp::connect(&path, Duration::from_secs(5), tx).unwrap();
        let r = q
            .execute("query-status", None, Duration::from_secs(5))
            .unwrap();
        assert_eq!(r["status"], "running");
        let ev = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert_eq!(ev.name, "STOP");
        let e = q
            .execute("bogus", None, Duration::from_secs(5))
            .unwrap_err();
        assert_eq!(e.to_string(), "no bogus");
        assert!(
            matches!(&e, QmpError::Failed { class, .. } if class == "CommandNotFound"),
            "{e:?}"
        );
    }

    #[test]
    fn missing_socket_times_out_with_error() {
        let dir = tempfile::tempdir().unwrap();
        let (tx, _rx) = event_channel();
        let e = Qmp::connect(&dir.path().join("none"), Duration::from_millis(100), tx)
            .err()
            .unwrap();
        assert!(matches!(e, QmpError::Connect { .. }), "{e}");
        assert!(e.to_string().contains("cannot connect"), "{e}");
    }
}
