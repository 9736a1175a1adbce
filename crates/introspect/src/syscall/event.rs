//! Syscall events as the daemon sees them, decoupled from the ring's record layout.

use serde::Serialize;

/// Bytes of one argument captured by the plugin at syscall entry (a path, a write buffer).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ArgData {
    pub arg: u8,
    pub bytes: Vec<u8>,
    /// The guest string/buffer was longer than what was captured.
    pub truncated: bool,
    /// Reading guest memory failed part-way (e.g. an unmapped page).
    pub fault: bool,
}

/// A monitored task executed `syscall`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct EntryEvent {
    pub ts_ns: u64,
    pub vcpu: u32,
    pub cr3: u64,
    /// Address of the `syscall` instruction.
    pub pc: u64,
    /// The guest kernel's `task_struct` pointer: the thread's identity while it lives.
    pub task: u64,
    pub tid: u32,
    pub tgid: u32,
    pub comm: String,
    pub nr: u64,
    pub args: [u64; 6],
    pub sp: u64,
    pub data: Vec<ArgData>,
    /// Buffer checksums of a `read`/`write`/`pread64`/`pwrite64` on a regular file (write:
    /// at entry; read: at the return, attached before the call completes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub io: Option<IoSums>,
}

/// Argument indices of the DATA pieces that are not an argument's bytes
/// (`vmsight_proto::syscall::extra_arg`): a write's partial head and tail chunks, a task's
/// exe, cwd, parent's TGID and new comm.
pub use vmsight_proto::syscall::extra_arg::{
    COMM as COMM_ARG, CWD as CWD_ARG, EXE as EXE_ARG, HEAD as HEAD_ARG, PPID as PPID_ARG,
    TAIL as TAIL_ARG,
};

/// Where the file position of an [`IoSums`] came from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PosSource {
    #[default]
    Unknown,
    /// The offset argument of `pread64`/`pwrite64`.
    Arg,
    /// `file->f_pos` read from the guest kernel at entry.
    FilePos,
    /// `inode->i_size` (an `O_APPEND` write).
    InodeSize,
}

/// The checksum (`vmsight_ring::chunk_sum`) of one 4 KiB file-offset-aligned chunk of an I/O
/// buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ChunkSum {
    /// File offset of the chunk (multiple of 4096).
    pub offset: u64,
    pub sum: u64,
}

/// The checksums the plugin computed for one read/write call (Sky §3.4), and what it read
/// from the guest's fd table.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct IoSums {
    pub fd: u32,
    pub read: bool,
    /// `O_APPEND` was set on the file.
    pub append: bool,
    pub pos_source: PosSource,
    /// File position of the buffer's first byte.
    pub file_pos: u64,
    /// Bytes of the buffer considered (write: length argument; read: bytes returned).
    pub len: u64,
    /// Guest `struct inode *` (stable file identity while the inode is cached; 0 unknown).
    pub inode: u64,
    /// `inode->i_size` at the call.
    pub i_size: u64,
    /// Whole chunks, in file order (a chunk that could not be read is missing).
    pub chunks: Vec<ChunkSum>,
    /// The plugin stopped at its per-call cap (`sumcap=`).
    pub truncated: bool,
    /// Some chunk could not be read from guest memory.
    pub fault: bool,
    /// The last record of the call arrived.
    pub complete: bool,
}

impl IoSums {
    /// File offset of the first byte after the buffer.
    pub fn end(&self) -> u64 {
        self.file_pos.saturating_add(self.len)
    }
}

/// The kernel's largest PID (`PID_MAX_LIMIT` on 64-bit).
pub const PID_MAX_LIMIT: i32 = 4 * 1024 * 1024;

impl EntryEvent {
    /// The captured bytes of argument `i`, if any.
    pub fn arg_data(&self, i: u8) -> Option<&ArgData> {
        self.data.iter().find(|d| d.arg == i)
    }

    /// The parent's TGID the plugin attached to a task's first entry (the `PPID_ARG` piece).
    /// Guest data, checked rather than trusted: exactly 4 bytes, whole, and a PID the kernel
    /// could give (0 to `PID_MAX_LIMIT`; 0 is the parent of init and kernel threads).
    pub fn parent_tgid(&self) -> Option<i32> {
        let d = self
            .arg_data(PPID_ARG)
            .filter(|d| !d.fault && !d.truncated)?;
        let p = i32::from_le_bytes(<[u8; 4]>::try_from(d.bytes.as_slice()).ok()?);
        (0..=PID_MAX_LIMIT).contains(&p).then_some(p)
    }
}

/// How the kernel went back to user mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ReturnVia {
    Sysret,
    Iret,
}

/// A monitored task returned to user mode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReturnEvent {
    pub ts_ns: u64,
    pub vcpu: u32,
    pub cr3: u64,
    pub task: u64,
    pub tid: u32,
    pub tgid: u32,
    /// Where user mode resumes.
    pub rip: u64,
    pub rax: u64,
    pub via: ReturnVia,
}

/// One SUMS record, decoded: the header of the call plus (chunk index, checksum) pairs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SumsPiece {
    pub header: IoSums,
    /// (chunk index = file offset / 4096, checksum).
    pub sums: Vec<(u64, u64)>,
    /// Last record of the call.
    pub last: bool,
}

/// A SUMS record borrowed from where it was decoded (see [`SumsPiece`]).
#[derive(Debug, Clone, Copy)]
pub struct SumsRef<'a> {
    pub header: &'a IoSums,
    /// (chunk index = file offset / 4096, checksum).
    pub sums: &'a [(u64, u64)],
    /// Last record of the call.
    pub last: bool,
}

impl SumsPiece {
    /// The piece, borrowed.
    pub fn as_ref(&self) -> SumsRef<'_> {
        SumsRef {
            header: &self.header,
            sums: &self.sums,
            last: self.last,
        }
    }
}

/// A piece of argument bytes borrowed from the record it was decoded from (see [`ArgData`]).
#[derive(Debug, Clone, Copy)]
pub struct PieceRef<'a> {
    pub arg: u8,
    pub bytes: &'a [u8],
    pub truncated: bool,
    pub fault: bool,
}

impl ArgData {
    /// The bytes as a piece, borrowed.
    pub fn as_piece(&self) -> PieceRef<'_> {
        PieceRef {
            arg: self.arg,
            bytes: &self.bytes,
            truncated: self.truncated,
            fault: self.fault,
        }
    }
}

/// Buffers of finished calls, for the next calls to reuse: the trace thread recycles every
/// completed entry here and builds new entries from it, so assembling a call allocates
/// little once the buffers have grown.
#[derive(Debug, Default)]
pub struct Spare {
    bytes: Vec<Vec<u8>>,
    data: Vec<Vec<ArgData>>,
    chunks: Vec<Vec<ChunkSum>>,
    comms: Vec<String>,
}

/// Most buffers of each kind kept: enough for the calls the trace thread completes after one
/// drain of the rings (a few hundred at a high syscall rate), so the next drain's entries find
/// theirs. Argument buffers are at most [`MAX_SPARE_BYTES`]: a few MiB at worst.
const MAX_SPARE: usize = 1024;
/// Largest argument buffer kept (a path, a partial chunk), in bytes.
const MAX_SPARE_BYTES: usize = 8192;
/// Largest chunk list kept (a 1 MiB buffer's), in chunks.
const MAX_SPARE_CHUNKS: usize = 256;

impl Spare {
    /// Keeps the buffers of an entry no one needs any more.
    pub fn recycle(&mut self, mut e: EntryEvent) {
        for d in e.data.drain(..) {
            if d.bytes.capacity() <= MAX_SPARE_BYTES {
                keep(&mut self.bytes, d.bytes);
            }
        }
        keep(&mut self.data, e.data);
        if self.comms.len() < MAX_SPARE && e.comm.capacity() > 0 {
            e.comm.clear();
            self.comms.push(e.comm);
        }
        if let Some(io) = e.io.filter(|io| io.chunks.capacity() <= MAX_SPARE_CHUNKS) {
            keep(&mut self.chunks, io.chunks);
        }
    }

    /// An empty argument list.
    pub fn data(&mut self) -> Vec<ArgData> {
        self.data.pop().unwrap_or_default()
    }

    /// `s`, lossily decoded as UTF-8, in an owned string.
    pub fn comm(&mut self, s: &[u8]) -> String {
        let mut c = self.comms.pop().unwrap_or_default();
        c.push_str(&String::from_utf8_lossy(s));
        c
    }

    /// `b` in an owned buffer.
    fn bytes(&mut self, b: &[u8]) -> Vec<u8> {
        let mut v = self.bytes.pop().unwrap_or_default();
        v.extend_from_slice(b);
        v
    }

    /// An empty chunk list.
    fn chunks(&mut self) -> Vec<ChunkSum> {
        self.chunks.pop().unwrap_or_default()
    }
}

/// Keeps `v`, emptied, in `list` if it holds memory and `list` has room.
fn keep<T>(list: &mut Vec<Vec<T>>, mut v: Vec<T>) {
    if list.len() < MAX_SPARE && v.capacity() > 0 {
        v.clear();
        list.push(v);
    }
}

/// Adds a SUMS record to an entry: the first creates [`EntryEvent::io`], later ones append
/// their chunks. A record that does not belong (another fd or direction) is ignored.
pub fn append_sums(e: &mut EntryEvent, p: SumsPiece) {
    append_sums_ref(e, p.as_ref(), &mut Spare::default());
}

/// [`append_sums`] of a borrowed record, with buffers from `spare`.
pub fn append_sums_ref(e: &mut EntryEvent, p: SumsRef<'_>, spare: &mut Spare) {
    const MAX_CHUNKS: usize = 1 << 16;
    let io = e.io.get_or_insert_with(|| IoSums {
        chunks: spare.chunks(),
        ..p.header.clone()
    });
    if io.fd != p.header.fd || io.read != p.header.read {
        return;
    }
    for &(idx, sum) in p.sums {
        if io.chunks.len() < MAX_CHUNKS {
            io.chunks.push(ChunkSum {
                offset: idx.saturating_mul(4096),
                sum,
            });
        }
    }
    io.truncated |= p.header.truncated;
    io.fault |= p.header.fault;
    io.complete |= p.last;
}

/// Adds a piece of argument bytes to an entry, in order; a piece that does not continue the
/// bytes so far (a lost piece before it) marks the argument truncated instead.
pub fn append_piece(e: &mut EntryEvent, piece: ArgData, offset: u32) {
    append_piece_ref(e, piece.as_piece(), offset, &mut Spare::default());
}

/// [`append_piece`] of a borrowed piece, with buffers from `spare`.
pub fn append_piece_ref(e: &mut EntryEvent, piece: PieceRef<'_>, offset: u32, spare: &mut Spare) {
    const MAX_ARG_BYTES: usize = 64 * 1024;
    match e.data.iter_mut().find(|d| d.arg == piece.arg) {
        // A late re-read replaces a capture that faulted with nothing in it.
        Some(d) if d.fault && d.bytes.is_empty() && offset == 0 => {
            d.bytes.extend_from_slice(piece.bytes);
            d.truncated = piece.truncated;
            d.fault = piece.fault;
        }
        Some(d) => {
            if d.bytes.len() == offset as usize
                && d.bytes.len() + piece.bytes.len() <= MAX_ARG_BYTES
            {
                d.bytes.extend_from_slice(piece.bytes);
                d.truncated = piece.truncated;
                d.fault = piece.fault;
            } else {
                d.truncated = true;
            }
        }
        None if offset == 0 => e.data.push(ArgData {
            arg: piece.arg,
            bytes: spare.bytes(piece.bytes),
            truncated: piece.truncated,
            fault: piece.fault,
        }),
        None => e.data.push(ArgData {
            arg: piece.arg,
            bytes: Vec::new(),
            truncated: true,
            fault: piece.fault,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(bytes: &[u8], fault: bool) -> ArgData {
        ArgData {
            arg: 1,
            bytes: bytes.to_vec(),
            truncated: false,
            fault,
        }
    }

    fn with_ppid(bytes: &[u8], truncated: bool, fault: bool) -> EntryEvent {
        EntryEvent {
            data: vec![ArgData {
                arg: PPID_ARG,
                bytes: bytes.to_vec(),
                truncated,
                fault,
            }],
            ..EntryEvent::default()
        }
    }

    #[test]
    fn a_parent_tgid_is_four_whole_bytes_of_a_possible_pid() {
        assert_eq!(
            with_ppid(&412i32.to_le_bytes(), false, false).parent_tgid(),
            Some(412)
        );
        assert_eq!(
            with_ppid(&0i32.to_le_bytes(), false, false).parent_tgid(),
            Some(0)
        );
        let max = PID_MAX_LIMIT.to_le_bytes();
        assert_eq!(
            with_ppid(&max, false, false).parent_tgid(),
            Some(PID_MAX_LIMIT)
        );
        // Malformed guest data is no parent: wrong length, out of range, faulted, truncated.
        for bytes in [&[1u8, 0, 0][..], &[1, 0, 0, 0, 0], &[]] {
            assert_eq!(
                with_ppid(bytes, false, false).parent_tgid(),
                None,
                "{bytes:?}"
            );
        }
        for p in [-1i32, PID_MAX_LIMIT + 1, i32::MAX, i32::MIN] {
            assert_eq!(
                with_ppid(&p.to_le_bytes(), false, false).parent_tgid(),
                None,
                "{p}"
            );
        }
        assert_eq!(
            with_ppid(&412i32.to_le_bytes(), true, false).parent_tgid(),
            None
        );
        assert_eq!(
            with_ppid(&412i32.to_le_bytes(), false, true).parent_tgid(),
            None
        );
        assert_eq!(EntryEvent::default().parent_tgid(), None);
    }

    #[test]
    fn a_late_re_read_replaces_an_empty_faulted_capture() {
        let mut e = EntryEvent::default();
        append_piece(&mut e, piece(b"", true), 0);
        append_piece(&mut e, piece(b"/tmp/x", false), 0);
        assert_eq!(e.data, vec![piece(b"/tmp/x", false)]);
    }

    #[test]
    fn recycled_buffers_come_back_empty() {
        let mut spare = Spare::default();
        let mut e = EntryEvent {
            comm: spare.comm(b"tar"),
            data: spare.data(),
            ..EntryEvent::default()
        };
        append_piece_ref(&mut e, piece(b"abc", false).as_piece(), 0, &mut spare);
        let sums = SumsPiece {
            sums: vec![(1, 7)],
            ..SumsPiece::default()
        };
        append_sums_ref(&mut e, sums.as_ref(), &mut spare);
        spare.recycle(e);
        let mut e = EntryEvent {
            comm: spare.comm(b"sh"),
            data: spare.data(),
            ..EntryEvent::default()
        };
        assert_eq!((e.comm.as_str(), e.data.len()), ("sh", 0));
        append_piece_ref(&mut e, piece(b"de", false).as_piece(), 0, &mut spare);
        append_sums_ref(&mut e, SumsPiece::default().as_ref(), &mut spare);
        assert_eq!(e.data, vec![piece(b"de", false)]);
        assert_eq!(e.io.map(|io| io.chunks.len()), Some(0));
    }
}
