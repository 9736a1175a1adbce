//! The control socket's messages (`<runtime>/<vm>/control.sock`): what other vmsight commands
//! (`vmsight stats NAME`, `vmsight stream NAME`) ask a running `vmsight run`, and its answers.
//!
//! Wire format, unchanged from the untyped protocol: one JSON object per line, one request per
//! connection. A request is `{"cmd":"status"}`, `{"cmd":"stream-start"}` or
//! `{"cmd":"dedup-gc","volume":"/abs/path"}`; the reply is `{"ok":true, ...fields}` or
//! `{"ok":false,"error":"sentence"}`. The framing (line length
//! limits, timeouts, the socket) is the launcher's `control` module.
//!
//! The counters inside a status (`tap`, `inference`, each block stage's snapshot, `insights`)
//! are defined by the subsystems that keep them (the write tap, the inference engine, the
//! stage registry, the insight engine) and travel here as JSON values: this crate does not
//! depend on those subsystems.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// A request on the control socket.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "kebab-case")]
pub enum ControlRequest {
    /// Counters of every disk and of the insight engine.
    Status,
    /// Start file-update streaming on every disk that is not streaming yet (a VM started with
    /// `--no-stream`), wait (bounded) for the crawls, and answer with the new status.
    StreamStart,
    /// Collect the garbage of a dedup volume this VM serves (`vmsight dedup gc VOL` on a
    /// volume in use): the volume's worker frees the chunks only its index holds.
    DedupGc {
        /// The volume directory, absolute (as `vmsight ps` lists the VM's disks).
        volume: PathBuf,
    },
    /// FoxyIdle's background marks (`vmsight idle NAME add|remove|list`): add or remove a
    /// mark, or only list them; the reply lists the marks afterwards.
    Idle {
        action: IdleAction,
        /// A guest PID or command name (`comm`); absent for `list`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        target: Option<String>,
    },
    /// Resize the VM's shared in-memory file system (`vmsight hylics NAME resize SIZE`); the
    /// reply is the share afterwards. Shrinking below what is in use is refused.
    ShareResize {
        /// The new size limit, bytes.
        bytes: u64,
    },
    /// The share-size controller's state (`vmsight hylics NAME controller`).
    HylicsController,
    /// Run a guest function on a vCPU and restore the vCPU (`vmsight cpu NAME redirect`);
    /// the reply comes when the function returned, the plugin refused, or the timeout fired.
    Redirect(crate::redirect::RedirectRequest),
    /// The symbiotic interface's state and the guest's SymSpy page (`vmsight sym NAME spy`).
    SymSpy,
    /// A symcall into the guest module (`vmsight sym NAME call`); the reply comes when the
    /// guest answered or the timeout fired.
    SymCall(crate::sym::CallRequest),
    /// The swap disk and its cache (`vmsight swap NAME status`); with `cache_bytes`, resize
    /// the cache first (`vmsight swap NAME cache SIZE`). The reply is a [`ControlReply::Swap`].
    Swap {
        #[serde(default, skip_serializing_if = "Option::is_none")]
        cache_bytes: Option<u64>,
    },
}

/// What an [`ControlRequest::Idle`] request does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IdleAction {
    Add,
    Remove,
    List,
}

/// One background mark of a running VM.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdleMark {
    /// `pid:N` or `comm:NAME`.
    pub target: String,
    /// Who set it: `run` (`--background`), `cli` (`vmsight idle`), `guest` (libvmsight).
    pub source: String,
}

/// The `cmd` of every [`ControlRequest`] (a test checks the list against the enum).
const COMMANDS: [&str; 10] = [
    "status",
    "stream-start",
    "dedup-gc",
    "idle",
    "share-resize",
    "hylics-controller",
    "redirect",
    "sym-spy",
    "sym-call",
    "swap",
];

impl ControlRequest {
    /// The request's `cmd` (the match keeps [`COMMANDS`] complete: a new variant must be
    /// named here).
    pub fn command(&self) -> &'static str {
        match self {
            ControlRequest::Status => COMMANDS[0],
            ControlRequest::StreamStart => COMMANDS[1],
            ControlRequest::DedupGc { .. } => COMMANDS[2],
            ControlRequest::Idle { .. } => COMMANDS[3],
            ControlRequest::ShareResize { .. } => COMMANDS[4],
            ControlRequest::HylicsController => COMMANDS[5],
            ControlRequest::Redirect(_) => COMMANDS[6],
            ControlRequest::SymSpy => COMMANDS[7],
            ControlRequest::SymCall(_) => COMMANDS[8],
            ControlRequest::Swap { .. } => COMMANDS[9],
        }
    }
}

/// Why a request line is not a valid request.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// Not a JSON object.
    #[error("the request is not JSON: {0}")]
    NotJson(#[source] serde_json::Error),
    /// No `cmd` string.
    #[error("the request has no \"cmd\" string")]
    NoCommand,
    /// A `cmd` this version does not know.
    #[error("unknown command {0:?} (known: {known})", known = COMMANDS.join(", "))]
    UnknownCommand(String),
    /// A known command with unusable fields.
    #[error("bad arguments for {cmd:?}: {source}")]
    BadArguments {
        /// The command.
        cmd: String,
        /// What is wrong.
        #[source]
        source: serde_json::Error,
    },
}

impl ControlRequest {
    /// Parses one request line (without its newline), naming what is wrong if it is not a
    /// request.
    pub fn parse(line: &str) -> Result<ControlRequest, RequestError> {
        let v: Value = serde_json::from_str(line.trim()).map_err(RequestError::NotJson)?;
        ControlRequest::from_value(v)
    }

    /// The request in an already parsed JSON value.
    pub fn from_value(v: Value) -> Result<ControlRequest, RequestError> {
        let cmd = v
            .get("cmd")
            .and_then(Value::as_str)
            .ok_or(RequestError::NoCommand)?
            .to_string();
        if !COMMANDS.contains(&cmd.as_str()) {
            return Err(RequestError::UnknownCommand(cmd));
        }
        serde_json::from_value(v).map_err(|source| RequestError::BadArguments { cmd, source })
    }

    /// The request as one line of JSON (without the newline).
    pub fn to_line(&self) -> String {
        // Unit variants and a path always serialise.
        serde_json::to_string(self).unwrap_or_default()
    }
}

/// What one disk is doing, in a [`VmStatus`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DiskStatus {
    /// Disk index (0 = root disk).
    pub disk: usize,
    /// File-update events flow for this disk (crawled and attached).
    pub streaming: bool,
    /// Write-tap counters (events, bytes, queue, drops).
    #[serde(default)]
    pub tap: Value,
    /// Inference counters, when the disk is streamed.
    #[serde(default)]
    pub inference: Option<Value>,
    /// One summary line per reporting block stage of the disk.
    #[serde(default)]
    pub stages: Vec<String>,
    /// Each reporting stage's counters under the stage's key (`cache` for the iCache, ...).
    #[serde(flatten)]
    pub stage_counters: BTreeMap<String, Value>,
}

/// The answer to [`ControlRequest::Status`].
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct VmStatus {
    /// Every streamed disk.
    #[serde(default)]
    pub disks: Vec<DiskStatus>,
    /// Insight engine counters, with `--insights`.
    #[serde(default)]
    pub insights: Option<Value>,
}

/// A reply on the control socket.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(into = "WireReply", try_from = "WireReply")]
pub enum ControlReply {
    /// The status ([`ControlRequest::Status`]).
    Status(VmStatus),
    /// Streaming was started ([`ControlRequest::StreamStart`]).
    StreamStarted {
        /// The status once the crawls finished (or the wait ended).
        status: VmStatus,
        /// Disks attached by this request (empty: every disk was streaming already).
        attached: Vec<usize>,
    },
    /// The garbage collection of a dedup volume ran ([`ControlRequest::DedupGc`]).
    DedupGc {
        /// Chunks freed.
        freed: u64,
    },
    /// The background marks after an [`ControlRequest::Idle`] request.
    IdleMarks(Vec<IdleMark>),
    /// The share after a [`ControlRequest::ShareResize`] request.
    Share(crate::hylics::ShareInfo),
    /// The controller after a [`ControlRequest::HylicsController`] request.
    Controller(crate::hylics::ControllerStatus),
    /// A completed [`ControlRequest::Redirect`].
    Redirected(crate::redirect::RedirectOutcome),
    /// The answer to [`ControlRequest::SymSpy`].
    SymSpy(Box<crate::sym::SpyReport>),
    /// The answer to [`ControlRequest::SymCall`].
    SymCalled(crate::sym::CallReply),
    /// The answer to [`ControlRequest::Swap`].
    Swap(Box<crate::swap::SwapReport>),
    /// The request was refused; the sentence says why.
    Refused(String),
}

impl ControlReply {
    /// The reply as one line of JSON (without the newline).
    pub fn to_line(&self) -> String {
        serde_json::to_string(self)
            .unwrap_or_else(|e| format!(r#"{{"ok":false,"error":"cannot encode the reply: {e}"}}"#))
    }

    /// Parses one reply line.
    pub fn parse(line: &str) -> Result<ControlReply, serde_json::Error> {
        serde_json::from_str(line.trim())
    }
}

/// The reply as it is on the wire: `ok` and either `error` or the status fields.
#[derive(Debug, Serialize, Deserialize)]
struct WireReply {
    ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    disks: Option<Vec<DiskStatus>>,
    /// `null` in a status without insights (as the untyped protocol wrote it); absent in a
    /// refusal.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    insights: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    attached: Option<Vec<usize>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    freed: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    marks: Option<Vec<IdleMark>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    share: Option<crate::hylics::ShareInfo>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    controller: Option<crate::hylics::ControllerStatus>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    redirect: Option<crate::redirect::RedirectOutcome>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    spy: Option<Box<crate::sym::SpyReport>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    symcall: Option<crate::sym::CallReply>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    swap: Option<Box<crate::swap::SwapReport>>,
}

impl WireReply {
    /// An `ok` reply with no field set.
    fn empty(ok: bool) -> WireReply {
        WireReply {
            ok,
            error: None,
            disks: None,
            insights: None,
            attached: None,
            freed: None,
            marks: None,
            share: None,
            controller: None,
            redirect: None,
            spy: None,
            symcall: None,
            swap: None,
        }
    }
}

impl From<ControlReply> for WireReply {
    fn from(r: ControlReply) -> WireReply {
        let ok = |status: VmStatus, attached| WireReply {
            disks: Some(status.disks),
            insights: Some(status.insights.unwrap_or(Value::Null)),
            attached,
            ..WireReply::empty(true)
        };
        match r {
            ControlReply::Status(s) => ok(s, None),
            ControlReply::StreamStarted { status, attached } => ok(status, Some(attached)),
            ControlReply::DedupGc { freed } => WireReply {
                freed: Some(freed),
                ..WireReply::empty(true)
            },
            ControlReply::IdleMarks(marks) => WireReply {
                marks: Some(marks),
                ..WireReply::empty(true)
            },
            ControlReply::Share(share) => WireReply {
                share: Some(share),
                ..WireReply::empty(true)
            },
            ControlReply::Controller(c) => WireReply {
                controller: Some(c),
                ..WireReply::empty(true)
            },
            ControlReply::Redirected(o) => WireReply {
                redirect: Some(o),
                ..WireReply::empty(true)
            },
            ControlReply::SymSpy(r) => WireReply {
                spy: Some(r),
                ..WireReply::empty(true)
            },
            ControlReply::SymCalled(r) => WireReply {
                symcall: Some(r),
                ..WireReply::empty(true)
            },
            ControlReply::Swap(r) => WireReply {
                swap: Some(r),
                ..WireReply::empty(true)
            },
            ControlReply::Refused(error) => WireReply {
                error: Some(error),
                ..WireReply::empty(false)
            },
        }
    }
}

/// A reply with `"ok": true` but no status in it.
#[derive(Debug, thiserror::Error)]
#[error(
    "the reply has none of \"error\", \"disks\", \"freed\", \"marks\", \"share\", \"controller\", \
     \"redirect\", \"spy\", \"symcall\" and \"swap\""
)]
pub struct NoStatus;

impl TryFrom<WireReply> for ControlReply {
    type Error = NoStatus;

    fn try_from(w: WireReply) -> Result<ControlReply, NoStatus> {
        if !w.ok {
            let reason = w
                .error
                .unwrap_or_else(|| "the VM refused the request without a reason".into());
            return Ok(ControlReply::Refused(reason));
        }
        if let (Some(freed), None) = (w.freed, &w.disks) {
            return Ok(ControlReply::DedupGc { freed });
        }
        if let (Some(marks), None) = (w.marks, &w.disks) {
            return Ok(ControlReply::IdleMarks(marks));
        }
        if let (Some(share), None) = (w.share, &w.disks) {
            return Ok(ControlReply::Share(share));
        }
        if let (Some(c), None) = (w.controller, &w.disks) {
            return Ok(ControlReply::Controller(c));
        }
        if let (Some(o), None) = (w.redirect, &w.disks) {
            return Ok(ControlReply::Redirected(o));
        }
        if let (Some(r), None) = (w.spy, &w.disks) {
            return Ok(ControlReply::SymSpy(r));
        }
        if let (Some(r), None) = (w.symcall, &w.disks) {
            return Ok(ControlReply::SymCalled(r));
        }
        if let (Some(r), None) = (w.swap, &w.disks) {
            return Ok(ControlReply::Swap(r));
        }
        let status = VmStatus {
            disks: w.disks.ok_or(NoStatus)?,
            insights: w.insights.filter(|v| !v.is_null()),
        };
        Ok(match w.attached {
            Some(attached) => ControlReply::StreamStarted { status, attached },
            None => ControlReply::Status(status),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn requests_are_cmd_tagged() {
        assert_eq!(ControlRequest::Status.to_line(), r#"{"cmd":"status"}"#);
        assert_eq!(
            ControlRequest::StreamStart.to_line(),
            r#"{"cmd":"stream-start"}"#
        );
        assert_eq!(
            ControlRequest::parse(" {\"cmd\":\"stream-start\"}\n").expect("parses"),
            ControlRequest::StreamStart
        );
    }

    #[test]
    fn every_command_is_known_to_the_parser() {
        let redirect = ControlRequest::Redirect(crate::redirect::RedirectRequest::call(
            crate::redirect::Trigger::Syscall { tgid: 9 },
            0x1000,
            &[5],
            0x2000,
        ));
        for req in [
            ControlRequest::Status,
            ControlRequest::StreamStart,
            ControlRequest::DedupGc {
                volume: "/v".into(),
            },
            ControlRequest::Idle {
                action: IdleAction::List,
                target: None,
            },
            ControlRequest::ShareResize { bytes: 1 },
            ControlRequest::HylicsController,
            redirect,
            ControlRequest::Swap { cache_bytes: None },
            ControlRequest::Swap {
                cache_bytes: Some(64 << 20),
            },
        ] {
            let line = req.to_line();
            assert!(
                line.contains(&format!(r#""cmd":"{}""#, req.command())),
                "{line}"
            );
            assert_eq!(ControlRequest::parse(&line).expect("parses"), req, "{line}");
        }
    }

    #[test]
    fn the_command_list_matches_the_enum() {
        for (cmd, req) in COMMANDS
            .iter()
            .zip([ControlRequest::Status, ControlRequest::StreamStart])
        {
            assert_eq!(req.to_line(), format!(r#"{{"cmd":"{cmd}"}}"#));
        }
        let gc = ControlRequest::DedupGc {
            volume: "/v".into(),
        };
        assert_eq!(gc.to_line(), r#"{"cmd":"dedup-gc","volume":"/v"}"#);
        assert_eq!(ControlRequest::parse(&gc.to_line()).expect("parses"), gc);
        assert_eq!(COMMANDS[2], "dedup-gc");
        let idle = ControlRequest::Idle {
            action: IdleAction::Add,
            target: Some("updatedb".into()),
        };
        assert_eq!(
            idle.to_line(),
            r#"{"cmd":"idle","action":"add","target":"updatedb"}"#
        );
        assert_eq!(
            ControlRequest::parse(&idle.to_line()).expect("parses"),
            idle
        );
        assert_eq!(
            ControlRequest::parse(r#"{"cmd":"idle","action":"list"}"#).expect("parses"),
            ControlRequest::Idle {
                action: IdleAction::List,
                target: None
            }
        );
        assert_eq!(COMMANDS[3], "idle");
        let resize = ControlRequest::ShareResize { bytes: 1 << 20 };
        assert_eq!(
            resize.to_line(),
            r#"{"cmd":"share-resize","bytes":1048576}"#
        );
        assert_eq!(
            ControlRequest::parse(&resize.to_line()).expect("parses"),
            resize
        );
        assert_eq!(COMMANDS[4], "share-resize");
    }

    #[test]
    fn bad_requests_say_what_is_wrong() {
        let e = ControlRequest::parse("not json").expect_err("bad");
        assert!(e.to_string().starts_with("the request is not JSON"), "{e}");
        let e = ControlRequest::parse(r#"{"nocmd":1}"#).expect_err("bad");
        assert_eq!(e.to_string(), "the request has no \"cmd\" string");
        let e = ControlRequest::parse(r#"{"cmd":"reboot"}"#).expect_err("bad");
        assert_eq!(
            e.to_string(),
            "unknown command \"reboot\" (known: status, stream-start, dedup-gc, idle, share-resize, hylics-controller, redirect, sym-spy, sym-call, swap)"
        );
    }

    fn status() -> VmStatus {
        VmStatus {
            disks: vec![DiskStatus {
                disk: 1,
                streaming: true,
                tap: json!({"events": 3}),
                inference: Some(json!({"events": 2})),
                stages: vec!["icache: 1 hit".into()],
                stage_counters: [("cache".to_string(), json!({"hits": 1}))].into(),
            }],
            insights: None,
        }
    }

    #[test]
    fn replies_keep_the_wire_format() {
        let v: Value =
            serde_json::from_str(&ControlReply::Status(status()).to_line()).expect("json");
        assert_eq!(v["ok"], true);
        assert_eq!(v["disks"][0]["disk"], 1);
        assert_eq!(v["disks"][0]["tap"]["events"], 3);
        assert_eq!(v["disks"][0]["cache"]["hits"], 1);
        assert_eq!(v["disks"][0]["stages"][0], "icache: 1 hit");
        assert!(v.get("error").is_none() && v.get("attached").is_none());
        assert!(v.get("insights").is_some_and(Value::is_null));
        let v: Value = serde_json::from_str(
            &ControlReply::StreamStarted {
                status: status(),
                attached: vec![1],
            }
            .to_line(),
        )
        .expect("json");
        assert_eq!(v["attached"], json!([1]));
        assert_eq!(
            ControlReply::Refused("no".into()).to_line(),
            r#"{"ok":false,"error":"no"}"#
        );
    }

    #[test]
    fn replies_round_trip() {
        for r in [
            ControlReply::Status(status()),
            ControlReply::StreamStarted {
                status: VmStatus::default(),
                attached: vec![],
            },
            ControlReply::DedupGc { freed: 7 },
            ControlReply::IdleMarks(vec![IdleMark {
                target: "pid:42".into(),
                source: "cli".into(),
            }]),
            ControlReply::IdleMarks(vec![]),
            ControlReply::Share(crate::hylics::ShareInfo {
                host_path: "/run/vmsight/a/share".into(),
                guest_path: "/hylics".into(),
                tag: "vmsight-hylics".into(),
                size_bytes: 64 << 20,
                used_bytes: 4096,
                files: 1,
                cache: "auto".into(),
                resizes: 1,
            }),
            ControlReply::Controller(crate::hylics::ControllerStatus {
                mode: "combined".into(),
                tau_secs: 1.5,
                target_bytes: 96 << 20,
                share_bytes: 128 << 20,
                ci_secs: 4.0,
                decisions: 3,
                tasks: 20,
                arrivals: 21,
                rejected_reports: 0,
                refused_shrinks: 1,
                advised_files: 2,
                last_r_secs: Some(1.2),
                last_lambda: None,
                last_reasons: vec!["queueing_reset".into()],
                log: Some("/tmp/c.log".into()),
            }),
            ControlReply::Swap(Box::new(crate::swap::SwapReport {
                swap_bytes: 1 << 29,
                cache_used_pages: 7,
                hit_rate: Some(0.5),
                ..Default::default()
            })),
            ControlReply::Refused("unknown command".into()),
        ] {
            assert_eq!(ControlReply::parse(&r.to_line()).expect("parses"), r);
        }
        assert_eq!(
            ControlReply::parse(r#"{"ok":false}"#).expect("parses"),
            ControlReply::Refused("the VM refused the request without a reason".into())
        );
        assert!(ControlReply::parse(r#"{"ok":true}"#).is_err());
    }
}
