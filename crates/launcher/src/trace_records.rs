//! The seam between the ring's record layout (vmsight-ring) and the trace session: decoding
//! records into syscall events, setting the plugin's monitor filters, and building observers.

use std::io::Write;
use std::sync::{Arc, Mutex};

use std::path::Path;

use vmsight_introspect::syscall::event::Spare;
use vmsight_introspect::syscall::{
    EntryEvent, IoSums, JsonSink, JsonWriter, PosSource, ReturnEvent, ReturnVia, StraceWriter,
    SyscallObserver,
};

use crate::process::ProcessObserver;
use vmsight_introspect::memory::QemuRam;
use vmsight_ring::{kind, ChannelHost, MonitorFilters, Record};

use crate::trace::{Piece, RawEvent, Sums, TraceConfig, TraceSession, TraceTarget};

/// Decodes one ring record, with buffers from `spare`; `None` for kinds the trace does not
/// use.
pub fn convert(r: &Record, spare: &mut Spare) -> Option<RawEvent> {
    match r.kind {
        kind::SYSCALL_ENTRY => Some(RawEvent::Entry(EntryEvent {
            ts_ns: r.timestamp_ns,
            vcpu: r.vcpu,
            cr3: r.cr3,
            pc: r.pc,
            task: r.task(),
            tid: r.tid(),
            tgid: r.tgid(),
            comm: spare.comm(vmsight_ring::control::comm_key(&r.comm())),
            nr: r.syscall_nr(),
            args: r.syscall_args(),
            sp: r.user_sp(),
            data: spare.data(),
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
            let piece = Piece::from_record(r);
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
            let mut piece = Sums::new(
                IoSums {
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
                f & vmsight_ring::flags::FINAL != 0,
            );
            for (chunk, sum) in r.sums_iter() {
                piece.push(chunk, sum);
            }
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
/// guest memory (QEMU's RAM, `ram`).
pub fn start_session(
    host: Arc<Mutex<ChannelHost>>,
    cfg: &TraceConfig,
    ram: QemuRam,
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
        ram,
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

#[cfg(test)]
mod tests {
    use super::*;
    use vmsight_ring::{flags, SumsHeader};

    #[test]
    fn pieces_and_sums_decode_as_the_records_own_accessors() {
        let mut spare = Spare::default();
        let bytes: Vec<u8> = (0..200u8).collect();
        for n in [0, 1, 7, 8, 87, 88, 200] {
            let r = Record::data(1, 5, 0, 0, 2, 88, &bytes[..n], flags::FAULT);
            let Some(RawEvent::Data { piece, offset, .. }) = convert(&r, &mut spare) else {
                panic!("not a data piece");
            };
            assert_eq!(piece.bytes(), r.data_bytes());
            assert_eq!(
                (piece.arg, offset, piece.fault, piece.truncated),
                (2, 88, true, false)
            );
        }
        let h = SumsHeader {
            fd: 4,
            first: 10,
            valid: 0b101101,
            ..SumsHeader::default()
        };
        for count in 0..=6 {
            let vals = [11, 12, 13, 14, 15, 16];
            let r = Record::sums(0, 5, 0, 0, &SumsHeader { count, ..h }, &vals, flags::LATE);
            let Some(RawEvent::Sums { piece, late, .. }) = convert(&r, &mut spare) else {
                panic!("not sums");
            };
            assert_eq!(piece.sums(), r.sums_values());
            assert!(late && !piece.last);
        }
    }

    #[test]
    fn a_recycled_entry_leaves_nothing_in_the_next() {
        let mut spare = Spare::default();
        let mut r = Record::syscall_entry(0, 1, 0, 0x1000, 257, [0; 6], 0);
        r.set_task(1, 2, 3, Some(b"longer-name\0\0\0\0\0"));
        let Some(RawEvent::Entry(mut e)) = convert(&r, &mut spare) else {
            panic!("not an entry");
        };
        let d = Record::data(0, 1, 0, 0, 1, 0, b"/etc/passwd", flags::FINAL);
        let Some(RawEvent::Data { piece, offset, .. }) = convert(&d, &mut spare) else {
            panic!("not a data piece");
        };
        vmsight_introspect::syscall::event::append_piece_ref(
            &mut e,
            piece.as_piece(),
            offset,
            &mut spare,
        );
        assert_eq!(
            e.arg_data(1).map(|d| &d.bytes[..]),
            Some(&b"/etc/passwd"[..])
        );
        spare.recycle(e);
        r.set_task(1, 2, 3, Some(b"sh\0\0\0\0\0\0\0\0\0\0\0\0\0\0"));
        let Some(RawEvent::Entry(e)) = convert(&r, &mut spare) else {
            panic!("not an entry");
        };
        assert_eq!((e.comm.as_str(), e.data.len()), ("sh", 0));
        assert!(e.data.capacity() > 0, "the argument list is reused");
    }
}
