//! Hylics' shared in-memory file system of a running VM: what `vmsight run --shared-mem`
//! writes to `hylics.json`, what `vmsight hylics NAME path|info|resize` reads and what the
//! control socket answers after a resize.

use serde::{Deserialize, Serialize};

/// The VM's share: a host tmpfs served to the guest through virtio-fs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShareInfo {
    /// The host directory (the tmpfs mount point) host-side tools read and write.
    pub host_path: String,
    /// Where the guest mounts it.
    pub guest_path: String,
    /// The virtio-fs tag the guest mounts.
    pub tag: String,
    /// The tmpfs size limit, bytes.
    pub size_bytes: u64,
    /// Bytes in use when this was written (tmpfs blocks).
    pub used_bytes: u64,
    /// Files and directories in use (inodes).
    pub files: u64,
    /// virtiofsd's cache mode (`auto`, `always`, `never`, `metadata`).
    pub cache: String,
    /// Resizes since the VM started.
    pub resizes: u64,
}

/// The vsock port on the host (CID 2) where vmsight's Hylics service takes the guest
/// library's requests.
pub const SERVICE_PORT: u32 = 5100;
/// The guest's vsock CID (each VM has its own vsock device, so every guest can have the same).
pub const GUEST_CID: u32 = 3;
/// The longest request line accepted (a guest that sends more is disconnected).
pub const MAX_REQUEST_LINE: usize = 4096;
/// At most this many paths in one [`HylicsReply::Advice`] (the guest asks again for more).
pub const MAX_ADVICE_FILES: usize = 64;
/// The longest task response time the controller accepts from the guest, seconds (a day).
pub const MAX_RESPONSE_SECS: f64 = 86_400.0;

/// A request from the guest library (`libhylics`) on the vsock channel: one JSON object per
/// line; each gets one [`HylicsReply`] line.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case", deny_unknown_fields)]
pub enum HylicsRequest {
    /// Module scheme: the host opens a TCP connection to `dest` (`IP:PORT`, from the VM's own
    /// network namespace) and sends `len` bytes of the share's file `path` from `offset`
    /// (`len` 0: to the end of the file), without the bytes passing through the guest.
    SendFile {
        dest: String,
        /// Relative to the share's root (a leading `/` is allowed and means the same).
        path: String,
        #[serde(default)]
        offset: u64,
        #[serde(default)]
        len: u64,
    },
    /// Profiler: one task arrived now (the controller's λ). Optional: without any, the
    /// controller counts completed tasks as arrivals.
    Arrive,
    /// Profiler: one task completed, `response_secs` after it arrived (the controller's R).
    Task { response_secs: f64 },
    /// Which files should leave the share so that the controller's smaller size fits
    /// (answered with [`HylicsReply::Advice`]).
    Advice,
    /// Socket scheme, step 1: drop the frames of this TCP connection in both directions
    /// until it is handed over (the guest freezes its socket next).
    SockHold { local: String, remote: String },
    /// Socket scheme, step 2: recreate the frozen connection `tcp` at the host, send `len`
    /// bytes (0: to the end) of the share's file `path` from `offset` on it, wait until the
    /// peer acknowledged them, freeze it again; answered with [`HylicsReply::SockSent`] (the
    /// state to restore in the guest) or a failure (the guest restores its own state).
    SockSend {
        path: String,
        #[serde(default)]
        offset: u64,
        #[serde(default)]
        len: u64,
        tcp: TcpState,
    },
    /// Socket scheme, step 3: the guest restored its socket; its frames flow again.
    SockRelease { local: String, remote: String },
}

/// A frozen TCP connection, as `TCP_REPAIR` dumps it and restores it (the socket scheme).
/// Sequence numbers are absolute; windows are in bytes (already scaled).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TcpState {
    /// The guest's end, `IP:PORT` (IPv4).
    pub local: String,
    /// The peer, `IP:PORT`.
    pub remote: String,
    /// The next sequence number to send (`TCP_QUEUE_SEQ` of the send queue); the send queue
    /// is empty at a hand-over, so every byte before it was acknowledged.
    pub snd_seq: u32,
    /// The next sequence number expected from the peer (`TCP_QUEUE_SEQ` of the receive queue).
    pub rcv_seq: u32,
    /// The peer's MSS.
    pub mss: u32,
    /// Negotiated options (`tcpi_options`): timestamps, SACK, window scaling.
    pub tstamp: bool,
    pub sack: bool,
    pub wscale: bool,
    /// Window-scale shifts: the peer's (`snd`) and ours (`rcv`).
    pub snd_wscale: u8,
    pub rcv_wscale: u8,
    /// `TCP_TIMESTAMP`: the timestamp value the peer sees now.
    pub ts_val: u32,
    /// `TCP_REPAIR_WINDOW`.
    pub snd_wl1: u32,
    pub snd_wnd: u32,
    pub max_window: u32,
    pub rcv_wnd: u32,
    pub rcv_wup: u32,
    /// Host to guest only: bytes the peer sent while the host held the connection (unread,
    /// hex), which the guest puts back into its receive queue. At most
    /// [`MAX_HANDBACK_BYTES`].
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub rcv_data: String,
}

/// The most received bytes the host hands back to the guest with a connection.
pub const MAX_HANDBACK_BYTES: usize = 16 << 10;

/// The answer to a [`HylicsRequest`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum HylicsReply {
    /// Socket scheme: `bytes` sent on the connection; `tcp` is its state now. (First: the
    /// shapes are tried in order, and [`HylicsReply::Sent`] would match it too.)
    SockSent { ok: True, bytes: u64, tcp: TcpState },
    /// Done: `bytes` were sent.
    Sent { ok: True, bytes: u64 },
    /// The files to move out of the share, coldest first (paths relative to the share's
    /// root, starting with `/`; at most [`MAX_ADVICE_FILES`]), to free `free_bytes`; an empty
    /// list when nothing has to move.
    Advice {
        ok: True,
        free_bytes: u64,
        evict: Vec<String>,
    },
    /// Done, nothing to report (task reports).
    Ack { ok: True },
    /// Refused or failed; nothing more will be sent for this request.
    Failed { ok: False, error: String },
}

/// `true` on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "bool", into = "bool")]
pub struct True;

/// `false` on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "bool", into = "bool")]
pub struct False;

impl From<True> for bool {
    fn from(_: True) -> bool {
        true
    }
}

impl From<False> for bool {
    fn from(_: False) -> bool {
        false
    }
}

impl TryFrom<bool> for True {
    type Error = &'static str;
    fn try_from(b: bool) -> Result<Self, Self::Error> {
        b.then_some(True).ok_or("expected true")
    }
}

impl TryFrom<bool> for False {
    type Error = &'static str;
    fn try_from(b: bool) -> Result<Self, Self::Error> {
        (!b).then_some(False).ok_or("expected false")
    }
}

impl HylicsReply {
    /// A success.
    pub fn sent(bytes: u64) -> HylicsReply {
        HylicsReply::Sent { ok: True, bytes }
    }

    /// A success without data.
    pub fn ack() -> HylicsReply {
        HylicsReply::Ack { ok: True }
    }

    /// A failure with its sentence.
    pub fn failed(error: impl Into<String>) -> HylicsReply {
        HylicsReply::Failed {
            ok: False,
            error: error.into(),
        }
    }
}

/// The share-size controller of a running VM (`vmsight hylics NAME controller`, `vmsight run
/// --stats`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControllerStatus {
    /// `static`, `adaptive_only`, `queueing_only` or `combined`.
    pub mode: String,
    /// τ, the response-time SLO, seconds.
    pub tau_secs: f64,
    /// The size the controller wants, bytes.
    pub target_bytes: u64,
    /// The share's size now, bytes (above the target while the guest has not moved files out).
    pub share_bytes: u64,
    /// The current control interval, seconds.
    pub ci_secs: f64,
    /// Decisions made.
    pub decisions: u64,
    /// Task completions reported by the guest.
    pub tasks: u64,
    /// Task arrivals reported by the guest.
    pub arrivals: u64,
    /// Reports rejected (not a finite response time in [0, a day]) or dropped (more than the
    /// controller keeps per interval).
    pub rejected_reports: u64,
    /// Resizes to the target that were refused because the share held more than the target.
    pub refused_shrinks: u64,
    /// Files named in eviction advice to the guest.
    pub advised_files: u64,
    /// R of the last interval with tasks, seconds.
    #[serde(default)]
    pub last_r_secs: Option<f64>,
    /// λ of the last interval, tasks per second.
    #[serde(default)]
    pub last_lambda: Option<f64>,
    /// Why the last decision was made (`queueing_reset`, `adaptive_step`, ...).
    #[serde(default)]
    pub last_reasons: Vec<String>,
    /// The JSON decision log, if one is written.
    #[serde(default)]
    pub log: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wire_format_is_what_libhylics_writes_and_reads() {
        let r: HylicsRequest = serde_json::from_str(
            r#"{"op":"send-file","dest":"10.0.2.1:9000","path":"/v.mp4","offset":4096}"#,
        )
        .expect("parses");
        assert_eq!(
            r,
            HylicsRequest::SendFile {
                dest: "10.0.2.1:9000".into(),
                path: "/v.mp4".into(),
                offset: 4096,
                len: 0
            }
        );
        assert_eq!(
            serde_json::to_string(&HylicsReply::sent(7)).expect("json"),
            r#"{"ok":true,"bytes":7}"#
        );
        assert_eq!(
            serde_json::to_string(&HylicsReply::failed("no")).expect("json"),
            r#"{"ok":false,"error":"no"}"#
        );
        for r in [HylicsReply::sent(7), HylicsReply::failed("no")] {
            let s = serde_json::to_string(&r).expect("json");
            assert_eq!(serde_json::from_str::<HylicsReply>(&s).expect("parses"), r);
        }
    }

    #[test]
    fn profiler_and_advice_messages_round_trip() {
        let r: HylicsRequest =
            serde_json::from_str(r#"{"op":"task","response_secs":1.25}"#).expect("parses");
        assert_eq!(
            r,
            HylicsRequest::Task {
                response_secs: 1.25
            }
        );
        let r: HylicsRequest = serde_json::from_str(r#"{"op":"arrive"}"#).expect("parses");
        assert_eq!(r, HylicsRequest::Arrive);
        assert!(serde_json::from_str::<HylicsRequest>(r#"{"op":"task"}"#).is_err());
        let advice = HylicsReply::Advice {
            ok: True,
            free_bytes: 9,
            evict: vec!["/a b".into()],
        };
        let line = serde_json::to_string(&advice).expect("json");
        assert_eq!(line, r#"{"ok":true,"free_bytes":9,"evict":["/a b"]}"#);
        assert_eq!(
            serde_json::from_str::<HylicsReply>(&line).expect("parses"),
            advice
        );
        let ack = serde_json::to_string(&HylicsReply::ack()).expect("json");
        assert_eq!(ack, r#"{"ok":true}"#);
        assert_eq!(
            serde_json::from_str::<HylicsReply>(&ack).expect("parses"),
            HylicsReply::ack()
        );
    }

    #[test]
    fn socket_hand_over_messages_round_trip() {
        let tcp = TcpState {
            local: "10.0.2.15:8080".into(),
            remote: "10.0.2.1:40000".into(),
            snd_seq: 4_000_000_000,
            rcv_seq: 7,
            mss: 1460,
            tstamp: true,
            sack: true,
            wscale: true,
            snd_wscale: 7,
            rcv_wscale: 7,
            ts_val: 123,
            snd_wl1: 6,
            snd_wnd: 65_536,
            max_window: 65_536,
            rcv_wnd: 65_536,
            rcv_wup: 7,
            rcv_data: String::new(),
        };
        let req = HylicsRequest::SockSend {
            path: "/v".into(),
            offset: 0,
            len: 0,
            tcp: tcp.clone(),
        };
        let line = serde_json::to_string(&req).expect("json");
        assert!(line.starts_with(r#"{"op":"sock-send""#), "{line}");
        assert!(
            !line.contains("rcv_data"),
            "empty hand-back data is left out: {line}"
        );
        assert_eq!(
            serde_json::from_str::<HylicsRequest>(&line).expect("parses"),
            req
        );
        let reply = HylicsReply::SockSent {
            ok: True,
            bytes: 9,
            tcp: TcpState {
                rcv_data: "6869".into(),
                ..tcp
            },
        };
        let line = serde_json::to_string(&reply).expect("json");
        assert_eq!(
            serde_json::from_str::<HylicsReply>(&line).expect("parses"),
            reply
        );
        assert!(serde_json::from_str::<HylicsRequest>(
            r#"{"op":"sock-hold","local":"10.0.2.15:1","remote":"10.0.2.1:2"}"#
        )
        .is_ok());
    }

    #[test]
    fn unknown_operations_and_fields_are_refused() {
        assert!(serde_json::from_str::<HylicsRequest>(r#"{"op":"rm","path":"/"}"#).is_err());
        assert!(serde_json::from_str::<HylicsRequest>(
            r#"{"op":"send-file","dest":"a","path":"b","mode":1}"#
        )
        .is_err());
    }
}
