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
