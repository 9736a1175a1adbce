//! The seam between the ring's record layout (vmsight-ring) and the trace session: decoding
//! records into syscall events, setting the plugin's monitor filters, and building observers.

use std::io::Write;
use std::sync::{Arc, Mutex};

use vmsight_introspect::syscall::{
    ArgData, EntryEvent, JsonWriter, ReturnEvent, ReturnVia, StraceWriter, SyscallObserver,
};
use vmsight_ring::{kind, ChannelHost, MonitorFilters, Record};

use crate::trace::{RawEvent, TraceConfig, TraceSession, TraceTarget};

/// Decodes one ring record; `None` for kinds the trace does not use.
pub fn convert(r: &Record) -> Option<RawEvent> {
    match r.kind {
        kind::SYSCALL_ENTRY => Some(RawEvent::Entry(EntryEvent {
            ts_ns: r.timestamp_ns,
            vcpu: r.vcpu,
            cr3: r.cr3,
            pc: r.pc,
            task: r.task(),
            tid: r.tid(),
            tgid: r.tgid(),
            comm: r.comm_string(),
            nr: r.syscall_nr(),
            args: r.syscall_args(),
            sp: r.user_sp(),
            data: Vec::new(),
        })),
        kind::SYSCALL_RETURN => Some(RawEvent::Return(ReturnEvent {
            ts_ns: r.timestamp_ns,
            vcpu: r.vcpu,
            cr3: r.cr3,
            task: r.task(),
            tid: r.tid(),
            tgid: r.tgid(),
            rip: r.return_rip(),
            rax: r.return_value(),
            via: match r.return_via() {
                Some(vmsight_ring::ReturnVia::Iret) => ReturnVia::Iret,
                _ => ReturnVia::Sysret,
            },
        })),
        kind::DATA => Some(RawEvent::Data {
            vcpu: r.vcpu,
            offset: r.data_offset(),
            piece: ArgData {
                arg: r.data_arg(),
                bytes: r.data_bytes(),
                truncated: r.flags & vmsight_ring::flags::TRUNCATED != 0,
                fault: r.flags & vmsight_ring::flags::FAULT != 0,
            },
        }),
        _ => None,
    }
}

/// Tells the plugin what to monitor. For `@cmd`, nothing is monitored until the guest reports
/// the command's PID (`cmd_pid`).
pub fn set_target(
    host: &mut ChannelHost,
    target: &TraceTarget,
    cmd_pid: Option<u32>,
) -> Result<(), String> {
    let filters = match (target, cmd_pid) {
        (TraceTarget::Command, None) => MonitorFilters::none(),
        (TraceTarget::Command, Some(pid)) | (&TraceTarget::Pid(pid), _) => MonitorFilters::none()
            .with_tgid(pid)
            .map_err(|e| e.to_string())?,
        (TraceTarget::Comm(c), _) => MonitorFilters::none()
            .with_comm(c)
            .map_err(|e| e.to_string())?,
    };
    host.set_filters(&filters)
        .map(|_generation| ())
        .map_err(|e| e.to_string())
}

/// Starts the trace session with the writers `cfg` asks for.
pub fn start_session(
    host: Arc<Mutex<ChannelHost>>,
    cfg: &TraceConfig,
) -> std::io::Result<TraceSession> {
    let mut observers: Vec<Box<dyn SyscallObserver>> = Vec::new();
    if cfg.text {
        let out: Box<dyn Write + Send> = match &cfg.out {
            Some(p) => Box::new(std::io::BufWriter::new(std::fs::File::create(p)?)),
            None => Box::new(std::io::stderr()),
        };
        observers.push(Box::new(StraceWriter::new(out, cfg.filter.clone())));
    }
    if let Some(p) = &cfg.json {
        let out = Box::new(std::io::BufWriter::new(std::fs::File::create(p)?));
        observers.push(Box::new(JsonWriter::new(out, cfg.filter.clone())));
    }
    TraceSession::start(host, observers)
}
