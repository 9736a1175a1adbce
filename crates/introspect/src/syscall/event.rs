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

impl EntryEvent {
    /// The captured bytes of argument `i`, if any.
    pub fn arg_data(&self, i: u8) -> Option<&ArgData> {
        self.data.iter().find(|d| d.arg == i)
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

/// Adds a SUMS record to an entry: the first creates [`EntryEvent::io`], later ones append
/// their chunks. A record that does not belong (another fd or direction) is ignored.
pub fn append_sums(e: &mut EntryEvent, p: SumsPiece) {
    const MAX_CHUNKS: usize = 1 << 16;
    let io = e.io.get_or_insert_with(|| IoSums {
        chunks: Vec::new(),
        ..p.header.clone()
    });
    if io.fd != p.header.fd || io.read != p.header.read {
        return;
    }
    for (idx, sum) in p.sums {
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
    const MAX_ARG_BYTES: usize = 64 * 1024;
    match e.data.iter_mut().find(|d| d.arg == piece.arg) {
        // A late re-read replaces a capture that faulted with nothing in it.
        Some(d) if d.fault && d.bytes.is_empty() && offset == 0 => *d = piece,
        Some(d) => {
            if d.bytes.len() == offset as usize
                && d.bytes.len() + piece.bytes.len() <= MAX_ARG_BYTES
            {
                d.bytes.extend_from_slice(&piece.bytes);
                d.truncated = piece.truncated;
                d.fault = piece.fault;
            } else {
                d.truncated = true;
            }
        }
        None if offset == 0 => e.data.push(piece),
        None => e.data.push(ArgData {
            arg: piece.arg,
            bytes: Vec::new(),
            truncated: true,
            fault: piece.fault,
        }),
    }
}
