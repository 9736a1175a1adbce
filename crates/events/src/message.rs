//! The message every transport carries: an [`FsEvent`] addressed by host and VM, with a
//! per-VM sequence number. One JSON object per line; written bytes travel base64-encoded in
//! `data_b64` (standard alphabet, with padding), never as a JSON number array.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use vmsight_fsview::FsEvent;

/// One addressed event. The JSON form is the event's own fields (`type`, `path`, `ino`, ...)
/// flattened next to `host`, `vm`, `seq` and `emitted_ns` (docs/filestream.md, "Message
/// schema").
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Host name of the machine running the VM.
    pub host: String,
    /// VM name (`vmsight run --name`).
    pub vm: String,
    /// Per-VM sequence number, from 1, without gaps at the source (a subscriber that sees a
    /// gap lost messages).
    pub seq: u64,
    /// Host wall-clock time (ns since the epoch) at which the message was published.
    pub emitted_ns: u64,
    /// The event.
    pub event: FsEvent,
}

#[derive(Serialize, Deserialize)]
struct Wire {
    host: String,
    vm: String,
    seq: u64,
    emitted_ns: u64,
    #[serde(flatten)]
    event: FsEvent,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    data_b64: Option<String>,
}

/// Why a line could not be decoded.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// Not the JSON we expect.
    #[error("malformed message: {0}")]
    Json(#[from] serde_json::Error),
    /// `data_b64` is not valid base64.
    #[error("malformed message: data_b64 is not base64: {0}")]
    Base64(#[from] base64::DecodeError),
}

impl Message {
    /// The channel the message is published on: `host:vm:/guest/path`.
    pub fn channel(&self) -> String {
        format!("{}:{}:{}", self.host, self.vm, self.event.path)
    }

    /// The JSON line (without the newline); `data` is included only if `with_data`.
    pub fn to_json(&self, with_data: bool) -> String {
        let ev = &self.event;
        let wire = Wire {
            host: self.host.clone(),
            vm: self.vm.clone(),
            seq: self.seq,
            emitted_ns: self.emitted_ns,
            // Rebuilt without `data` so the bytes are not also written as a number array.
            event: FsEvent {
                kind: ev.kind,
                path: ev.path.clone(),
                old_path: ev.old_path.clone(),
                ino: ev.ino,
                old: ev.old.clone(),
                new: ev.new.clone(),
                range: ev.range,
                data: None,
                txn: ev.txn,
                observed_ns: ev.observed_ns,
            },
            data_b64: match (&ev.data, with_data) {
                (Some(d), true) => Some(base64::engine::general_purpose::STANDARD.encode(d)),
                _ => None,
            },
        };
        // Serialising plain strings and integers into a String cannot fail.
        serde_json::to_string(&wire).unwrap_or_default()
    }

    /// Parses one JSON line.
    pub fn from_json(line: &str) -> Result<Message, DecodeError> {
        let w: Wire = serde_json::from_str(line)?;
        let mut event = w.event;
        event.data = match w.data_b64 {
            Some(s) => Some(base64::engine::general_purpose::STANDARD.decode(s)?),
            None => None,
        };
        Ok(Message {
            host: w.host,
            vm: w.vm,
            seq: w.seq,
            emitted_ns: w.emitted_ns,
            event,
        })
    }
}

/// Something other than a message on an embedded-bus stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum Notice {
    /// The subscription is active; messages published from now on are delivered.
    Subscribed {
        /// The normalised patterns.
        patterns: Vec<String>,
        /// Whether `data_b64` is included.
        data: bool,
    },
    /// `count` matching messages were not delivered because the client was too slow.
    Dropped {
        /// How many.
        count: u64,
    },
    /// The request was refused; the server closes the connection.
    Error {
        /// Why.
        message: String,
    },
}

/// One line of an embedded-bus stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamItem {
    /// An event.
    Message(Message),
    /// A notice.
    Notice(Notice),
}

impl StreamItem {
    /// Parses a line of an embedded-bus stream.
    pub fn parse(line: &str) -> Result<StreamItem, DecodeError> {
        // Notices have a `type` that no event kind uses; try them first, they are short.
        if let Ok(n) = serde_json::from_str::<Notice>(line) {
            return Ok(StreamItem::Notice(n));
        }
        Message::from_json(line).map(StreamItem::Message)
    }
}

/// Current host wall-clock time in ns since the epoch.
pub fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// Addresses events from one VM: fills in host and VM names, numbers them from 1 and stamps
/// them. Shared by every transport of that VM so they all carry the same `seq`.
#[derive(Debug)]
pub struct Addresser {
    host: String,
    vm: String,
    next: AtomicU64,
}

impl Addresser {
    /// Events of VM `vm` on host `host`.
    pub fn new(host: impl Into<String>, vm: impl Into<String>) -> Addresser {
        Addresser {
            host: host.into(),
            vm: vm.into(),
            next: AtomicU64::new(1),
        }
    }

    /// Wraps `event` into the next message.
    pub fn wrap(&self, event: FsEvent) -> Message {
        Message {
            host: self.host.clone(),
            vm: self.vm.clone(),
            seq: self.next.fetch_add(1, Ordering::Relaxed),
            emitted_ns: now_ns(),
            event,
        }
    }
}

/// The host name used in channels: `$VMSIGHT_HOST` if set, else the kernel's host name, with
/// any `:` replaced (it separates channel fields).
pub fn host_name() -> String {
    let raw = std::env::var("VMSIGHT_HOST")
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| {
            std::fs::read_to_string("/proc/sys/kernel/hostname")
                .ok()
                .map(|s| s.trim().to_string())
        })
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "localhost".to_string());
    raw.replace([':', '/'], "_")
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmsight_fsview::{EventKind, Value};

    fn ev() -> FsEvent {
        FsEvent {
            kind: EventKind::Write,
            path: "/var/log/syslog".into(),
            old_path: None,
            ino: 12,
            old: None,
            new: Some(Value::Size(10)),
            range: Some((0, 5)),
            data: Some(b"hello".to_vec()),
            txn: Some(7),
            observed_ns: 99,
        }
    }

    #[test]
    fn json_round_trip_with_and_without_data() {
        let a = Addresser::new("h", "v");
        let m = a.wrap(ev());
        assert_eq!(m.seq, 1);
        assert_eq!(a.wrap(ev()).seq, 2);
        assert_eq!(m.channel(), "h:v:/var/log/syslog");
        let line = m.to_json(true);
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["type"], "write");
        assert_eq!(v["host"], "h");
        assert_eq!(v["data_b64"], "aGVsbG8=");
        assert!(v.get("data").is_none(), "{line}");
        assert_eq!(v["range"], serde_json::json!([0, 5]));
        assert_eq!(v["new"], serde_json::json!({"size": 10}));
        assert_eq!(Message::from_json(&line).unwrap(), m);

        let line = m.to_json(false);
        assert!(!line.contains("data"), "{line}");
        let back = Message::from_json(&line).unwrap();
        assert_eq!(back.event.data, None);
        assert!(!line.contains('\n'));
    }

    #[test]
    fn stream_items() {
        let m = Addresser::new("h", "v").wrap(ev());
        assert_eq!(
            StreamItem::parse(&m.to_json(true)).unwrap(),
            StreamItem::Message(m)
        );
        assert_eq!(
            StreamItem::parse(r#"{"type":"dropped","count":3}"#).unwrap(),
            StreamItem::Notice(Notice::Dropped { count: 3 })
        );
        assert!(StreamItem::parse(r#"{"type":"bogus"}"#).is_err());
        assert!(StreamItem::parse("not json").is_err());
        let bad = m_with_bad_b64();
        assert!(matches!(
            Message::from_json(&bad),
            Err(DecodeError::Base64(_))
        ));
    }

    fn m_with_bad_b64() -> String {
        let m = Addresser::new("h", "v").wrap(ev());
        m.to_json(true).replace("aGVsbG8=", "!!!")
    }

    #[test]
    fn host_name_has_no_separators() {
        let h = host_name();
        assert!(!h.is_empty() && !h.contains(':') && !h.contains('/'));
    }
}
