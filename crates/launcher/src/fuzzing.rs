//! Fuzz entry points of the launcher's hostile inputs (see docs/fuzzing.md):
//!
//! - [`ring_records`]: the plugin's shared-memory channel. A plugin (or anything else that can
//!   write the file) controls the header, the ring indices and every record, so the input is a
//!   sequence of pushes through the real producer, scribbles anywhere in the file and
//!   re-attaches that validate the header; then the real trace session drains the rings,
//!   decodes the records into syscall events (`trace_records::convert`), pairs them in the
//!   tracker and formats them (strace text and JSON).
//! - [`write_recording`]: a `--record-writes` file, read back with the recording reader (every
//!   frame it accepts must re-encode to the same bytes) and replayed with [`replay`] over a
//!   small ext4 image (a damaged recording must be refused with an error, never replayed past
//!   the image).
//! - [`symspy_page`]: the guest module's SymSpy page (`--symbiotic`), written by the guest: a
//!   page built from a header (valid or not), field writes and raw scribbles, read by
//!   [`crate::sym::spy::parse`] the way vmsight reads a stable copy of it.
//! - [`hylics_request`]: the Hylics service's vsock requests, one JSON object per line from
//!   the guest: framed and parsed as the service does, with each request's destination, path
//!   (opened in a share with symlinks pointing in and out of it) and range checked.

use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};

use vmsight_blockdev::tap::{Recorder, RecordingReader, TapEvent, TapKind};
use vmsight_introspect::syscall::{
    JsonSink, JsonWriter, NameFilter, StraceWriter, SyscallObserver,
};
use vmsight_ring::{Channel, ChannelPlugin, Producer, Record};

use crate::stream::{replay, ReplayError};
use crate::trace::TraceSession;

#[path = "../../../fuzz/common/input.rs"]
mod input;
use input::{Input, Output};

/// Most operations of one ring input.
const MAX_RING_OPS: usize = 256;
/// Longest scribble.
const MAX_SCRIBBLE: usize = 512;

/// Outcome bits of [`ring_records`]: the session decoded syscall entries.
pub const ENTRIES: u32 = 1;
/// It decoded returns.
pub const RETURNS: u32 = 2;
/// It decoded argument data pieces.
pub const DATA: u32 = 4;
/// A re-attach refused a scribbled header.
pub const ATTACH_REFUSED: u32 = 8;
/// A re-attach accepted the header.
pub const ATTACHED: u32 = 16;
/// The host detected corrupt ring indices.
pub const CORRUPT_INDICES: u32 = 32;

/// One operation on the channel.
#[derive(Debug, Clone)]
pub enum RingOp {
    /// The plugin pushes `record` on `vcpu`'s ring (an unknown vCPU is refused).
    Push { vcpu: u8, record: Record },
    /// Bytes written at `offset` of the channel file (modulo its size).
    Scribble { offset: u32, bytes: Vec<u8> },
    /// The plugin attaches again (the header is validated).
    Attach,
}

/// A scratch directory on tmpfs when there is one (the channel lives there in a real run).
fn scratch() -> Option<tempfile::TempDir> {
    tempfile::tempdir_in("/dev/shm")
        .or_else(|_| tempfile::tempdir())
        .ok()
}

/// Runs one ring input; panics if a promise is broken. Returns the outcome bits reached.
pub fn ring_records(data: &[u8]) -> u32 {
    let mut inp = Input::new(data);
    let geometry = inp.u8();
    let vcpus = 1 + u32::from(geometry & 3);
    let records = 2u32 << ((geometry >> 2) & 7);
    let Some(dir) = scratch() else {
        return 0;
    };
    let path = dir.path().join("plugin.shm");
    let host = match Channel::create(&path, vcpus, records) {
        Ok(h) => h,
        Err(e) => panic!("a {vcpus} x {records} channel is valid: {e}"),
    };
    let plugin = match Channel::attach(&path) {
        Ok(p) => p,
        Err(e) => panic!("a fresh channel attaches: {e}"),
    };
    let Ok(file) = std::fs::OpenOptions::new().write(true).open(&path) else {
        return 0;
    };
    let size = file.metadata().map_or(0, |m| m.len());
    let mut producers: Vec<Option<Producer>> = (0..vcpus).map(|_| None).collect();
    let mut seen = 0;
    for _ in 0..MAX_RING_OPS {
        if inp.is_empty() {
            break;
        }
        match decode_ring_op(&mut inp) {
            RingOp::Push { vcpu, record } => push(&plugin, &mut producers, vcpu, &record),
            RingOp::Scribble { offset, bytes } => {
                let at = u64::from(offset) % size.max(1);
                let n = bytes.len().min((size - at) as usize);
                let _ = file.write_all_at(&bytes[..n], at);
            }
            RingOp::Attach => seen |= reattach(&path, size),
        }
    }
    drop(producers);
    seen | drain(host)
}

/// Pushes through `vcpu`'s producer (claimed on first use; an unknown vCPU is refused).
fn push(plugin: &ChannelPlugin, producers: &mut [Option<Producer>], vcpu: u8, rec: &Record) {
    let v = u32::from(vcpu);
    match producers.get_mut(usize::from(vcpu)) {
        Some(slot) => {
            if slot.is_none() {
                *slot = plugin.producer(v).ok();
            }
            if let Some(p) = slot {
                p.push(rec);
            }
        }
        None => assert!(plugin.producer(v).is_err(), "vCPU {v} is out of range"),
    }
}

/// Attaches again: the header is validated, and an accepted geometry fits the file.
fn reattach(path: &Path, size: u64) -> u32 {
    match Channel::attach(path) {
        Ok(p) => {
            let g = p.geometry();
            assert!(g.total_size <= size, "attached geometry fits the file");
            ATTACHED
        }
        Err(_) => ATTACH_REFUSED,
    }
}

/// Drains the rings through the real trace session into strace and JSON writers.
fn drain(host: vmsight_ring::ChannelHost) -> u32 {
    let host = Arc::new(Mutex::new(host));
    let observers: Vec<Box<dyn SyscallObserver>> = vec![
        Box::new(StraceWriter::new(
            Box::new(std::io::sink()),
            NameFilter::all(),
        )),
        Box::new(JsonWriter::new(
            JsonSink::new(Box::new(std::io::sink())),
            NameFilter::all(),
        )),
    ];
    let Ok(session) = TraceSession::start(host.clone(), observers) else {
        return 0;
    };
    let sum = session.finish();
    assert!(sum.entries + sum.returns <= sum.records, "{sum:?}");
    assert!(sum.data_pieces <= sum.records, "{sum:?}");
    let corrupt = host.lock().map_or(0, |h| h.corrupt_events());
    [
        (sum.entries, ENTRIES),
        (sum.returns, RETURNS),
        (sum.data_pieces, DATA),
        (corrupt, CORRUPT_INDICES),
    ]
    .iter()
    .filter(|(n, _)| *n > 0)
    .fold(0, |acc, (_, bit)| acc | bit)
}

fn decode_ring_op(inp: &mut Input<'_>) -> RingOp {
    match inp.u8() % 3 {
        0 => RingOp::Push {
            vcpu: inp.u8() % 5,
            record: decode_record(inp),
        },
        1 => RingOp::Scribble {
            offset: inp.u32(),
            bytes: inp.chunk(MAX_SCRIBBLE).to_vec(),
        },
        _ => RingOp::Attach,
    }
}

/// A record, field by field (little-endian); the kind (one of the eight smallest) and the
/// vCPU take one byte each so most records are ones the decoder knows (scribbles reach the
/// other values).
fn decode_record(inp: &mut Input<'_>) -> Record {
    let mut r = Record {
        kind: u16::from(inp.u8() % 8),
        flags: inp.u16(),
        vcpu: u32::from(inp.u8()),
        timestamp_ns: inp.u64(),
        cr3: inp.u64(),
        pc: inp.u64(),
        payload: [0; 12],
    };
    for w in r.payload.iter_mut() {
        *w = inp.u64();
    }
    r
}

fn encode_record(o: &mut Output, r: &Record) {
    o.u8(r.kind as u8).u16(r.flags).u8(r.vcpu as u8);
    o.u64(r.timestamp_ns).u64(r.cr3).u64(r.pc);
    for w in r.payload {
        o.u64(w);
    }
}

/// Encodes a ring input: `vcpus` (1-4), `records` per ring (a power of two, 2-256) and
/// `ops`.
pub fn encode_ring(vcpus: u8, records: u32, ops: &[RingOp]) -> Vec<u8> {
    let log = records.max(2).trailing_zeros().saturating_sub(1).min(7) as u8;
    let mut o = Output::default();
    o.u8((vcpus.clamp(1, 4) - 1) | (log << 2));
    for op in ops {
        match op {
            RingOp::Push { vcpu, record } => {
                o.u8(0).u8(*vcpu);
                encode_record(&mut o, record);
            }
            RingOp::Scribble { offset, bytes } => {
                o.u8(1).u32(*offset).chunk(bytes);
            }
            RingOp::Attach => {
                o.u8(2);
            }
        }
    }
    o.bytes
}

// ---- write recordings ------------------------------------------------------------------------

/// Outcome bits of [`write_recording`]: the reader accepted every frame.
pub const READ_ALL: u32 = 1;
/// The reader refused the file or a frame.
pub const READ_REFUSED: u32 = 2;
/// The replay succeeded.
pub const REPLAYED: u32 = 4;
/// The replay refused an event beyond the base image.
pub const REFUSED_BEYOND: u32 = 8;
/// The replay refused a damaged frame.
pub const REFUSED_DAMAGED: u32 = 16;

/// Size of the base image recordings are replayed over.
pub const BASE_IMAGE_SIZE: u64 = 4 << 20;

/// The base image shared by every case: a 4 MiB ext4 file system made with `mkfs.ext4` once
/// and kept at one path in the temporary directory, reused by later runs (`None` if it cannot
/// be made).
fn base_image() -> Option<&'static Path> {
    static BASE: OnceLock<Option<PathBuf>> = OnceLock::new();
    BASE.get_or_init(|| {
        // In the default temporary directory, beside `replay`'s scratch copy: the copy stays
        // a reflink or copy_file_range, fast enough for thousands of cases.
        let tmp = std::env::temp_dir();
        let img = tmp.join("vmsight-fuzz-replay-base.img");
        if std::fs::metadata(&img).is_ok_and(|m| m.len() == BASE_IMAGE_SIZE) {
            return Some(img);
        }
        // Made under another name and renamed: concurrent runs never see a half-made image.
        let fresh = tempfile::NamedTempFile::new_in(&tmp).ok()?;
        fresh.as_file().set_len(BASE_IMAGE_SIZE).ok()?;
        let ok = std::process::Command::new("mkfs.ext4")
            .args(["-q", "-F", "-b", "1024", "-N", "64"])
            .arg(fresh.path())
            .status()
            .ok()?
            .success();
        (ok && fresh.persist(&img).is_ok()).then_some(img)
    })
    .as_deref()
}

/// Runs one recording file through the reader and the replay; panics if a promise is broken.
/// Returns the outcome bits reached.
pub fn write_recording(data: &[u8]) -> u32 {
    let Some(dir) = scratch() else {
        return 0;
    };
    let rec = dir.path().join("fuzz.rec");
    if std::fs::write(&rec, data).is_err() {
        return 0;
    }
    let (events, complete) = read_back(&rec, data);
    let mut seen = if complete { READ_ALL } else { READ_REFUSED };
    let Some(base) = base_image() else {
        return seen;
    };
    let result = replay(base, &rec, "/mnt", true, &mut std::io::sink());
    seen |= check_replay(&result, &events, complete);
    seen
}

/// Reads `rec` to its end or first error; every accepted frame must re-encode to the bytes it
/// was read from. Returns the events and whether the whole file was accepted.
fn read_back(rec: &Path, data: &[u8]) -> (Vec<TapEvent>, bool) {
    let Ok(mut reader) = RecordingReader::open(rec) else {
        return (Vec::new(), false);
    };
    let mut events = Vec::new();
    let complete = loop {
        match reader.next_event() {
            Ok(Some(ev)) => events.push(ev),
            Ok(None) => break true,
            Err(_) => break false,
        }
        // Every frame is at least 33 bytes: this loop ends.
        assert!(events.len() <= data.len() / 33, "more frames than bytes");
    };
    let again = encode_recording(&events);
    let read = without_flush_ranges(data, &events);
    assert!(
        read.starts_with(&again),
        "accepted frames re-encode to the bytes they came from"
    );
    if complete {
        assert_eq!(
            again.len(),
            data.len(),
            "a complete read consumed every byte"
        );
    }
    (events, complete)
}

/// `data` with the offset and length fields of its flush frames zeroed: the reader ignores
/// them and the recorder writes zeroes there.
fn without_flush_ranges(data: &[u8], events: &[TapEvent]) -> Vec<u8> {
    let mut out = data.to_vec();
    let mut at = 8usize;
    for ev in events {
        if ev.kind == TapKind::Flush {
            if let Some(fields) = out.get_mut(at + 17..at + 33) {
                fields.fill(0);
            }
        }
        at += 33 + ev.payload_bytes() as usize;
    }
    out
}

/// What the replay of `events` must have done.
fn check_replay(
    result: &Result<crate::stream::ReplayStats, ReplayError>,
    events: &[TapEvent],
    complete: bool,
) -> u32 {
    let first_bad = events.iter().position(|ev| !replayable(ev));
    match result {
        Ok(stats) => {
            assert!(complete && first_bad.is_none(), "{events:?} replayed");
            assert_eq!(stats.tap_events, events.len() as u64);
            REPLAYED
        }
        Err(ReplayError::BeyondImage { frame, .. }) => {
            assert_eq!(first_bad.map(|i| i as u64 + 1), Some(*frame));
            REFUSED_BEYOND
        }
        Err(ReplayError::NoBytes { frame, .. }) => {
            assert_eq!(first_bad.map(|i| i as u64 + 1), Some(*frame));
            0
        }
        Err(ReplayError::Damaged { frame, .. }) => {
            assert!(!complete && first_bad.is_none());
            assert_eq!(*frame, events.len() as u64 + 1);
            REFUSED_DAMAGED
        }
        Err(ReplayError::Recording(_)) => {
            assert!(events.is_empty() && !complete);
            REFUSED_DAMAGED
        }
        Err(e) => panic!("the replay failed on its own: {e}"),
    }
}

/// Whether `ev` can be replayed over the base image.
fn replayable(ev: &TapEvent) -> bool {
    let inside = |offset: u64, len: u64| {
        offset
            .checked_add(len)
            .is_some_and(|e| e <= BASE_IMAGE_SIZE)
    };
    match &ev.kind {
        TapKind::Write {
            offset,
            data: Some(d),
            ..
        } => inside(*offset, d.len() as u64),
        TapKind::Write { data: None, .. } => false,
        TapKind::Discard { offset, len } | TapKind::WriteZeroes { offset, len } => {
            inside(*offset, *len)
        }
        TapKind::Flush => true,
    }
}

/// The bytes [`Recorder`] writes for `events`.
pub fn encode_recording(events: &[TapEvent]) -> Vec<u8> {
    let Some(dir) = scratch() else {
        return Vec::new();
    };
    let path = dir.path().join("again.rec");
    let recorded = Recorder::create(&path).and_then(|mut r| {
        for ev in events {
            r.record(ev)?;
        }
        r.flush()
    });
    match recorded {
        Ok(()) => std::fs::read(&path).unwrap_or_default(),
        Err(e) => panic!("re-recording failed: {e}"),
    }
}

/// Outcome bits of [`symspy_page`]: the page was refused (short, bad magic, other version).
pub const SPY_REFUSED: u32 = 1;
/// It was read without a problem.
pub const SPY_CLEAN: u32 = 2;
/// It was read with problems reported (and the bad values bounded).
pub const SPY_PROBLEMS: u32 = 4;
/// A read page listed at least one vCPU's task.
pub const SPY_CPUS: u32 = 8;
/// A read page listed at least one swap device.
pub const SPY_SWAPS: u32 = 16;

/// Most operations on one page.
const MAX_SPY_OPS: usize = 64;

/// One edit of the SymSpy page before it is read.
#[derive(Debug, Clone)]
pub enum SpyOp {
    /// Write `value` (little-endian, `width` bytes: 1, 2, 4 or 8) at `offset` (wrapping in the
    /// page).
    Write { offset: u16, width: u8, value: u64 },
    /// Copy `bytes` to `offset` (wrapping; cut at the page's end).
    Scribble { offset: u16, bytes: Vec<u8> },
}

/// The SymSpy page: the first byte says how the page starts (bit 0: with the module's magic
/// and interface version, bit 1: cut to a length from the next `u16`), then edits until the
/// input ends. Promises checked: no panic; a refused page says why; a read page has
/// `nr_cpus` in 1..=`MAX_CPUS`, at most that many tasks, each on a vCPU below it, at most
/// `MAX_SWAPS` swap devices, strings that fit their fields, and it serialises to JSON (what
/// `vmsight sym` prints).
pub fn symspy_page(data: &[u8]) -> u32 {
    use vmsight_proto::sym::{ABI_VERSION, GUEST, GUEST_MAGIC, MAX_CPUS, MAX_SWAPS};
    let mut inp = Input::new(data);
    let mode = inp.u8();
    let cut = inp.u16();
    let mut page = vec![0u8; GUEST.size];
    if mode & 1 != 0 {
        let m = GUEST.field("magic").offset;
        page[m..m + 8].copy_from_slice(&GUEST_MAGIC.to_le_bytes());
        let a = GUEST.field("abi").offset;
        page[a..a + 4].copy_from_slice(&ABI_VERSION.to_le_bytes());
    }
    let mut ops = 0;
    while !inp.is_empty() && ops < MAX_SPY_OPS {
        apply_spy_op(&mut page, &decode_spy_op(&mut inp));
        ops += 1;
    }
    if mode & 2 != 0 {
        page.truncate(usize::from(cut) % (GUEST.size + 1));
    }
    let mut problems = Vec::new();
    let Some(spy) = crate::sym::spy::parse(&page, &mut problems) else {
        assert!(!problems.is_empty(), "a refused page says why");
        return SPY_REFUSED;
    };
    assert!(
        (1..=MAX_CPUS as u32).contains(&spy.nr_cpus),
        "nr_cpus {}",
        spy.nr_cpus
    );
    assert!(spy.cpus.len() <= spy.nr_cpus as usize);
    assert!(spy
        .cpus
        .iter()
        .all(|c| c.cpu < spy.nr_cpus && c.comm.len() <= 16 * 3));
    assert!(spy.swaps.len() <= MAX_SWAPS);
    let field_len = |n: &str| GUEST.field(n).ty.size() * 3;
    assert!(spy.release.len() <= field_len("release") && spy.version.len() <= field_len("version"));
    serde_json::to_string(&spy).expect("a read page serialises");
    let mut bits = if problems.is_empty() {
        SPY_CLEAN
    } else {
        SPY_PROBLEMS
    };
    if !spy.cpus.is_empty() {
        bits |= SPY_CPUS;
    }
    if !spy.swaps.is_empty() {
        bits |= SPY_SWAPS;
    }
    bits
}

fn decode_spy_op(inp: &mut Input<'_>) -> SpyOp {
    if inp.u8().is_multiple_of(4) {
        let offset = inp.u16();
        SpyOp::Scribble {
            offset,
            bytes: inp.chunk(256).to_vec(),
        }
    } else {
        SpyOp::Write {
            offset: inp.u16(),
            width: [1, 2, 4, 8][usize::from(inp.u8() % 4)],
            value: inp.u64(),
        }
    }
}

fn apply_spy_op(page: &mut [u8], op: &SpyOp) {
    let n = page.len();
    let (at, bytes) = match op {
        SpyOp::Write {
            offset,
            width,
            value,
        } => (
            usize::from(*offset) % n,
            value.to_le_bytes()[..usize::from(*width)].to_vec(),
        ),
        SpyOp::Scribble { offset, bytes } => (usize::from(*offset) % n, bytes.clone()),
    };
    let len = bytes.len().min(n - at);
    page[at..at + len].copy_from_slice(&bytes[..len]);
}

/// Encodes a SymSpy input: `mode` (bit 0 valid header, bit 1 cut to `cut`) and the edits.
pub fn encode_spy(mode: u8, cut: u16, ops: &[SpyOp]) -> Vec<u8> {
    let mut o = Output::default();
    o.u8(mode);
    o.u16(cut);
    for op in ops {
        match op {
            SpyOp::Scribble { offset, bytes } => {
                o.u8(0);
                o.u16(*offset);
                o.chunk(bytes);
            }
            SpyOp::Write {
                offset,
                width,
                value,
            } => {
                o.u8(1);
                o.u16(*offset);
                o.u8(match width {
                    1 => 0,
                    2 => 1,
                    4 => 2,
                    _ => 3,
                });
                o.u64(*value);
            }
        }
    }
    o.bytes
}

/// Outcome bits of [`hylics_request`]: a line was refused (not JSON, not a request, too long,
/// cut short); the connection ends there.
pub const HY_BAD_LINE: u32 = 1;
/// A request's path opened a file of the share.
pub const HY_OPENED: u32 = 2;
/// A request's path was refused (outside the share, missing, not a regular file, empty).
pub const HY_OPEN_REFUSED: u32 = 4;
/// A send-file destination was refused (not `IP:PORT`, loopback, unspecified, multicast).
pub const HY_DEST_REFUSED: u32 = 8;
/// A request without a path was accepted (arrive, task, advice, sock-hold, sock-release).
pub const HY_OTHER: u32 = 16;

/// Most request lines of one input (each is at most 4097 bytes read).
const MAX_HYLICS_LINES: usize = 64;

/// The share requests are resolved in, and the files a path may reach.
struct Share {
    dir: PathBuf,
    /// (device, inode) of the share's regular files.
    inside: Vec<(u64, u64)>,
}

/// The share used by every case, made once at one path in the temporary directory (reused by
/// later runs): `root/share` holds `file`, `sub/file2`, a directory `sub/dir`, a fifo `fifo`,
/// the symlinks `link-in` (to `file`), `link-abs` (to `/file`), `link-out` (to `../secret`),
/// `link-etc` (to `/etc/passwd`) and `link-proc` (to `/proc/self/root/etc/passwd`); `root/secret`
/// is outside the share.
fn share() -> Option<&'static Share> {
    static SHARE: OnceLock<Option<Share>> = OnceLock::new();
    SHARE
        .get_or_init(|| make_share(&std::env::temp_dir().join("vmsight-fuzz-hylics")).ok())
        .as_ref()
}

fn make_share(root: &Path) -> std::io::Result<Share> {
    use std::os::unix::fs::{symlink, MetadataExt};
    let dir = root.join("share");
    std::fs::create_dir_all(dir.join("sub/dir"))?;
    std::fs::write(root.join("secret"), b"outside the share\n")?;
    std::fs::write(dir.join("file"), [7u8; 100])?;
    std::fs::write(dir.join("sub/file2"), b"2")?;
    let fifo = std::ffi::CString::new(dir.join("fifo").as_os_str().as_encoded_bytes())?;
    // SAFETY: mkfifo reads the NUL-terminated path, which outlives the call.
    let _ = unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) };
    for (name, to) in [
        ("link-in", "file"),
        ("link-abs", "/file"),
        ("link-out", "../secret"),
        ("link-etc", "/etc/passwd"),
        ("link-proc", "/proc/self/root/etc/passwd"),
    ] {
        match symlink(to, dir.join(name)) {
            Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => return Err(e),
            _ => {}
        }
    }
    let id = |p: PathBuf| std::fs::metadata(p).map(|m| (m.dev(), m.ino()));
    let inside = vec![id(dir.join("file"))?, id(dir.join("sub/file2"))?];
    Ok(Share { dir, inside })
}

/// Hylics vsock requests: the input is what the guest writes on its connection. Lines are
/// read the way the service reads them (at most [`MAX_REQUEST_LINE`] + 1 bytes up to a
/// newline) and parsed with its `parse_request`; the first refused line ends the connection.
/// Each accepted request's fields go through the service's own checks: the destination
/// (`parse_dest`), the path (`open_in_share`, in a share with files, a directory, a fifo and
/// symlinks inside and out of it), the range (`range`) and the connection (`flow_key`).
/// Promises checked: no panic; an accepted line is at most [`MAX_REQUEST_LINE`] bytes and
/// ends with its newline, a longer or unterminated one is refused; a path opens only a regular
/// file inside the share, whatever `..`, `/` or symlink it uses; an accepted destination is
/// never loopback, unspecified, multicast, broadcast or port 0; an accepted range lies inside
/// the file.
pub fn hylics_request(data: &[u8]) -> u32 {
    use std::io::{BufRead, Read};
    use vmsight_proto::hylics::MAX_REQUEST_LINE;
    let Some(share) = share() else {
        return 0;
    };
    let mut input = std::io::BufReader::new(data);
    let mut line = Vec::new();
    let mut seen = 0;
    for _ in 0..MAX_HYLICS_LINES {
        line.clear();
        let limit = (MAX_REQUEST_LINE + 1) as u64;
        match (&mut input).take(limit).read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
        let Some(req) = crate::hylics::offload::parse_request(&line) else {
            seen |= HY_BAD_LINE;
            break;
        };
        assert!(line.len() <= MAX_REQUEST_LINE && line.ends_with(b"\n"));
        seen |= check_request(share, &req);
    }
    seen
}

/// Runs an accepted request's fields through the service's checks.
fn check_request(share: &Share, req: &vmsight_proto::hylics::HylicsRequest) -> u32 {
    use vmsight_proto::hylics::HylicsRequest as R;
    match req {
        R::SendFile {
            dest,
            path,
            offset,
            len,
        } => check_dest(dest) | check_path(share, path, *offset, *len),
        R::SockSend {
            path,
            offset,
            len,
            tcp,
        } => {
            let _ = crate::hylics::handover::flow_key(&tcp.local, &tcp.remote);
            check_path(share, path, *offset, *len)
        }
        R::SockHold { local, remote } | R::SockRelease { local, remote } => {
            let _ = crate::hylics::handover::flow_key(local, remote);
            HY_OTHER
        }
        R::Task { response_secs } => {
            assert!(response_secs.is_finite(), "JSON has no NaN or infinity");
            HY_OTHER
        }
        R::Arrive | R::Advice => HY_OTHER,
    }
}

fn check_dest(dest: &str) -> u32 {
    let Ok(addr) = crate::hylics::offload::parse_dest(dest) else {
        return HY_DEST_REFUSED;
    };
    let ip = addr.ip();
    assert!(
        !(ip.is_loopback() || ip.is_unspecified() || ip.is_multicast() || addr.port() == 0),
        "{dest:?} is allowed as {addr}"
    );
    assert!(!matches!(ip, std::net::IpAddr::V4(v4) if v4.is_broadcast()));
    0
}

/// Opens `path` in the share: only the share's regular files open; then the range.
fn check_path(share: &Share, path: &str, offset: u64, len: u64) -> u32 {
    use std::os::unix::fs::MetadataExt;
    let file = match crate::hylics::offload::open_in_share(&share.dir, path) {
        Ok(f) => f,
        Err(_) => return HY_OPEN_REFUSED,
    };
    let meta = match file.metadata() {
        Ok(m) => m,
        Err(e) => panic!("an opened file has metadata: {e}"),
    };
    assert!(
        meta.is_file() && share.inside.contains(&(meta.dev(), meta.ino())),
        "{path:?} opened something that is not a file of the share"
    );
    let size = meta.len();
    match crate::hylics::offload::range(path, size, offset, len) {
        Ok(count) => assert!(offset <= size && count <= size - offset, "{offset}+{count}"),
        Err(_) => assert!(offset > size, "offset {offset} of {size} bytes is refused"),
    }
    HY_OPENED
}
