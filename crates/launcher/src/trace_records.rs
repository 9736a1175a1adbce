//! The seam between the ring's record layout (vmsight-ring) and the trace session: decoding
//! records into syscall events, setting the plugin's monitor filters, and building observers.

use std::io::Write;
use std::sync::{Arc, Mutex};

use std::path::Path;

use vmsight_introspect::syscall::{
    ArgData, EntryEvent, IoSums, JsonSink, JsonWriter, PosSource, ReturnEvent, ReturnVia,
    StraceWriter, SumsPiece, SyscallObserver,
};

use crate::process::ProcessObserver;
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
            io: None,
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
        kind::DATA => {
            let piece = ArgData {
                arg: r.data_arg(),
                bytes: r.data_bytes(),
                truncated: r.flags & vmsight_ring::flags::TRUNCATED != 0,
                fault: r.flags & vmsight_ring::flags::FAULT != 0,
            };
            Some(if r.flags & vmsight_ring::flags::LATE != 0 {
                RawEvent::LateData {
                    vcpu: r.vcpu,
                    entry_ts: r.timestamp_ns,
                    piece,
                    offset: r.data_offset(),
                }
            } else {
                RawEvent::Data {
                    vcpu: r.vcpu,
                    offset: r.data_offset(),
                    piece,
                }
            })
        }
        kind::SUMS => {
            let h = r.sums_header();
            let f = r.flags;
            let piece = SumsPiece {
                header: IoSums {
                    fd: h.fd,
                    read: h.read,
                    append: h.append,
                    pos_source: match h.pos_source {
                        vmsight_ring::sums::POS_ARG => PosSource::Arg,
                        vmsight_ring::sums::POS_FPOS => PosSource::FilePos,
                        vmsight_ring::sums::POS_ISIZE => PosSource::InodeSize,
                        _ => PosSource::Unknown,
                    },
                    file_pos: h.pos,
                    len: h.len,
                    inode: h.inode,
                    i_size: h.i_size,
                    chunks: Vec::new(),
                    truncated: f & vmsight_ring::flags::TRUNCATED != 0,
                    fault: f & vmsight_ring::flags::FAULT != 0,
                    complete: false,
                },
                sums: r.sums_values(),
                last: f & vmsight_ring::flags::FINAL != 0,
            };
            Some(RawEvent::Sums {
                vcpu: r.vcpu,
                entry_ts: r.timestamp_ns,
                late: f & vmsight_ring::flags::LATE != 0,
                piece,
            })
        }
        _ => None,
    }
}

/// Tells the plugin what to monitor. For `@cmd`, nothing is monitored until the guest reports
/// the command's PID (`cmd_pid`).
pub fn set_target(
    host: &mut ChannelHost,
    target: &TraceTarget,
    cmd_pid: Option<u32>,
) -> Result<(), vmsight_ring::Error> {
    let filters = match (target, cmd_pid) {
        (TraceTarget::Command, None) => MonitorFilters::none(),
        (TraceTarget::Command, Some(pid)) | (&TraceTarget::Pid(pid), _) => {
            MonitorFilters::none().with_tgid(pid)?
        }
        (TraceTarget::Comm(c), _) => MonitorFilters::none().with_comm(c)?,
    };
    host.set_filters(&filters).map(|_generation| ())
}

/// Starts the trace session with the writers `cfg` asks for, plus process tracking through
/// guest memory (QEMU's RAM, found by `qemu_pid`).
pub fn start_session(
    host: Arc<Mutex<ChannelHost>>,
    cfg: &TraceConfig,
    qemu_pid: u32,
    profile: &Path,
    extra: Vec<Box<dyn SyscallObserver>>,
) -> std::io::Result<TraceSession> {
    let mut observers: Vec<Box<dyn SyscallObserver>> = extra;
    let text_out = |cfg: &TraceConfig| -> std::io::Result<Box<dyn Write + Send>> {
        Ok(match &cfg.out {
            Some(p) => Box::new(std::io::LineWriter::new(
                std::fs::OpenOptions::new()
                    .append(true)
                    .create(true)
                    .open(p)?,
            )),
            None => Box::new(std::io::stderr()),
        })
    };
    if let Some(p) = &cfg.out {
        // Start empty; both writers below append.
        std::fs::File::create(p)?;
    }
    let json = match &cfg.json {
        Some(p) => Some(JsonSink::new(Box::new(std::io::BufWriter::new(
            std::fs::File::create(p)?,
        )))),
        None => None,
    };
    observers.push(Box::new(ProcessObserver::new(
        qemu_pid,
        profile.to_path_buf(),
        json.clone(),
        if cfg.text { Some(text_out(cfg)?) } else { None },
    )));
    if cfg.text {
        observers.push(Box::new(StraceWriter::new(
            text_out(cfg)?,
            cfg.filter.clone(),
        )));
    }
    if let Some(j) = json {
        observers.push(Box::new(JsonWriter::new(j, cfg.filter.clone())));
    }
    TraceSession::start(host, observers)
}
