//! The fixed-size record carried by the rings, its kinds and the accessors vmsight uses.
//!
//! The syscall channel's kinds, all 128 bytes (header 32 bytes + 12 payload words):
//!
//! | kind | `pc` | payload |
//! |---|---|---|
//! | [`kind::SYSCALL_ENTRY`] | address of the `syscall` instruction | nr, args[6], user rsp, task, tid/tgid, comm[16] |
//! | [`kind::SYSCALL_RETURN`] | user RIP the kernel returns to | task, tid/tgid, rax, user rsp, rflags, kernel insn, 0, cs |
//! | [`kind::DATA`] | guest address of the piece | arg/len/offset word, 88 bytes |
//!
//! An entry whose [`Record::data_count`] is `n > 0` is followed in the same ring by `n`
//! [`kind::DATA`] records (fewer only if [`flags::DATA_LOST`] is set), which carry the entry's
//! timestamp and CR3. The block-tag channel's kinds are in [`crate::blocktag`].

use crate::control::COMM_LEN;

/// Record kinds stored in [`Record::kind`].
pub mod kind {
    /// An unused slot (never pushed by the plugin).
    pub const EMPTY: u16 = 0;
    /// A monitored task executed a user-mode `syscall` instruction (before the kernel ran).
    pub const SYSCALL_ENTRY: u16 = 1;
    /// A monitored task is about to return to user mode through `sysretq` or `iretq` (the
    /// exit of a syscall, but also of interrupts and exceptions taken in user mode; vmsight
    /// pairs returns with entries).
    pub const SYSCALL_RETURN: u16 = 2;
    /// A piece of a string or buffer argument of the preceding [`SYSCALL_ENTRY`].
    pub const DATA: u16 = 3;
    /// [`super::chunk_sum`] checksums of the 4 KiB file-offset-aligned chunks of a `write`/`pwrite64`
    /// buffer (at entry, following the entry like DATA) or of a `read`/`pread64` buffer (at
    /// the return, flagged [`super::flags::LATE`]). Layout version 3. See [`super::sums`].
    pub const SUMS: u16 = 4;
    /// The guest kernel submitted a bio (block-tag channel, see [`crate::blocktag`]).
    pub const BLOCK_SUBMIT: u16 = 5;
    /// A guest process declared itself background or foreground (block-tag channel).
    pub const BACKGROUND: u16 = 6;
}

/// Bits of [`Record::flags`] (bits 0..8; bits 8..16 of an entry hold the DATA count).
pub mod flags {
    /// One or more register reads failed; the affected fields are zero.
    pub const REG_FAULT: u16 = 1 << 0;
    /// Entry: some of the announced DATA records could not be pushed (ring full).
    pub const DATA_LOST: u16 = 1 << 2;
    /// Return: through `iretq` (else `sysretq`).
    pub const VIA_IRET: u16 = 1 << 3;
    /// DATA: last piece of this argument.
    pub const FINAL: u16 = 1 << 5;
    /// DATA: the string had no NUL within the limit, or the buffer was longer than captured.
    pub const TRUNCATED: u16 = 1 << 6;
    /// DATA: reading guest memory failed at the end of this piece (unmapped or not present);
    /// the bytes before the fault are in the piece.
    pub const FAULT: u16 = 1 << 7;
    /// On a DATA piece: captured at the call's return, not at its entry (the string's page
    /// was not present at entry; the kernel faulted it in while handling the call). Its
    /// timestamp is the entry's; it follows other records in the ring.
    pub const LATE: u16 = 1 << 8;
}

/// Payload word indices of a [`kind::SYSCALL_ENTRY`] record.
pub mod syscall {
    /// RAX at entry: the syscall number (the kernel uses its low 32 bits).
    pub const NR: usize = 0;
    /// First of the six argument registers: rdi, rsi, rdx, r10, r8, r9.
    pub const ARGS: usize = 1;
    /// RSP at entry (the user stack pointer).
    pub const SP: usize = 7;
    /// Guest `task_struct` pointer of the calling thread.
    pub const TASK: usize = 8;
    /// `task->pid` (tid) in bits 0..32, `task->tgid` in bits 32..64.
    pub const IDS: usize = 9;
    /// `task->comm`, 16 bytes in two words.
    pub const COMM: usize = 10;
}

/// Payload word indices of a [`kind::SYSCALL_RETURN`] record.
pub mod ret {
    /// Guest `task_struct` pointer of the returning thread.
    pub const TASK: usize = 0;
    /// tid in bits 0..32, tgid in bits 32..64.
    pub const IDS: usize = 1;
    /// RAX: the syscall's return value (for syscall returns).
    pub const RAX: usize = 2;
    /// User RSP after the return.
    pub const SP: usize = 3;
    /// User RFLAGS after the return (sysret: R11; iret: from the frame).
    pub const RFLAGS: usize = 4;
    /// Guest address of the kernel's `sysretq`/`iretq` instruction.
    pub const INSN: usize = 5;
    /// Reserved (zero).
    pub const RESERVED: usize = 6;
    /// CS the kernel returns to (sysret: 0x33 implied; iret: from the frame).
    pub const CS: usize = 7;
}

/// Payload layout of a [`kind::DATA`] record.
pub mod data {
    /// Word 0: argument index (bits 0..8), piece length (bits 16..32), byte offset of the
    /// piece within the argument (bits 32..64).
    pub const META: usize = 0;
    /// First word of the bytes.
    pub const BYTES: usize = 1;
    /// Capacity of one piece in bytes.
    pub const CAPACITY: usize = 88;
    /// Argument indices of DATA pieces that are not an argument's bytes (defined once in
    /// `vmsight_proto::syscall::extra_arg`): a write's partial head and tail chunks (sent with
    /// [`super::kind::SUMS`] records), a task's exe, cwd, parent's TGID and comm.
    pub use vmsight_proto::syscall::extra_arg::{
        COMM as COMM_ARG, CWD as CWD_ARG, EXE as EXE_ARG, HEAD as HEAD_ARG, PPID as PPID_ARG,
        TAIL as TAIL_ARG,
    };
}

/// Payload layout of a [`kind::SUMS`] record (layout version 3).
///
/// Chunk `i` of a call covers file bytes `[first + i*4096, first + (i+1)*4096)` where `first`
/// is the file position rounded up to 4 KiB; only chunks lying wholly inside the buffer are
/// summed. A call's sums are spread over consecutive records; the last has `FINAL`.
pub mod sums {
    /// Word 0: fd (bits 0..32), sums used in this record (32..36), position source (36..40,
    /// see [`POS_ARG`] ...), read direction (bit 40), `O_APPEND` (bit 41), valid-sum mask
    /// (48..54: bit k set when slot k holds a checksum; a chunk that could not be read is
    /// skipped and its bit is clear).
    pub const META: usize = 0;
    /// Word 1: file position of the buffer's first byte.
    pub const POS: usize = 1;
    /// Word 2: buffer length considered (write: the length argument; read: bytes returned).
    pub const LEN: usize = 2;
    /// Word 3: index of the chunk in slot 0.
    pub const FIRST: usize = 3;
    /// Word 4: guest `struct inode *` of the file (0 if unknown): a file identity shared by
    /// every process and fd while the inode is in memory.
    pub const INODE: usize = 4;
    /// Word 5: `inode->i_size` at the time of the call.
    pub const ISIZE: usize = 5;
    /// First checksum word.
    pub const SUMS: usize = 6;
    /// Checksums per record.
    pub const PER_RECORD: usize = 6;
    /// Chunk size the sums cover.
    pub const CHUNK: u64 = 4096;
    /// Position unknown (the fd table could not be read).
    pub const POS_UNKNOWN: u8 = 0;
    /// Position from the syscall's offset argument (`pread64`/`pwrite64`).
    pub const POS_ARG: u8 = 1;
    /// Position from `file->f_pos`.
    pub const POS_FPOS: u8 = 2;
    /// Position from `inode->i_size` (`O_APPEND` writes).
    pub const POS_ISIZE: u8 = 3;
}

/// The checksum of a 4 KiB chunk that matches a write syscall's buffer to the disk block it
/// lands in (Sky §3.4), computed by the plugin at the syscall and by the classifier at the
/// block request: XXH3-64 (`xxhash-rust`). It replaced FNV-1a 64, whose multiply chain per
/// byte hashed 4 KiB chunks at 0.87 GB/s on the 2-core test machine, against 28 GB/s for
/// XXH3 (one-off loop over 4 KiB chunks): under insights every byte a monitored process
/// reads or writes is hashed twice, at the syscall and at the block request.
pub fn chunk_sum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// Decoded [`kind::SUMS`] record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SumsHeader {
    /// File descriptor of the call.
    pub fd: u32,
    /// Checksums used in this record (0..=6).
    pub count: usize,
    /// One of `sums::POS_*`.
    pub pos_source: u8,
    /// A read (sums of the filled buffer at the return), else a write.
    pub read: bool,
    /// The file was opened with `O_APPEND`.
    pub append: bool,
    /// Bit k: slot k holds a checksum.
    pub valid: u8,
    /// File position of the buffer's first byte.
    pub pos: u64,
    /// Buffer length considered.
    pub len: u64,
    /// Chunk index of slot 0.
    pub first: u64,
    /// Guest inode pointer (0 unknown).
    pub inode: u64,
    /// `i_size` at the call.
    pub i_size: u64,
}

/// How a [`kind::SYSCALL_RETURN`] went back to user mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReturnVia {
    /// `sysretq` (RIP from RCX, RFLAGS from R11).
    Sysret,
    /// `iretq` (RIP, CS, RFLAGS, RSP from the frame on the kernel stack).
    Iret,
}

/// One 128-byte record. Plain old data: every bit pattern is a valid value, so reading a slot
/// another process scribbled on yields garbage values, never undefined behaviour.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Record {
    /// One of [`kind`].
    pub kind: u16,
    /// Bits of [`flags`]; entries keep the DATA count in bits 8..16.
    pub flags: u16,
    /// vCPU index that produced the record.
    pub vcpu: u32,
    /// Host CLOCK_MONOTONIC nanoseconds when the record was produced (DATA: the entry's).
    pub timestamp_ns: u64,
    /// Guest CR3 with the PCID bits (11:0) and the no-flush bit (63) cleared: identifies the
    /// address space.
    pub cr3: u64,
    /// Entry: address of the `syscall` instruction. Return: user RIP returned to. DATA: guest
    /// address of the piece's first byte.
    pub pc: u64,
    /// Kind-specific payload.
    pub payload: [u64; 12],
}

fn comm_words(c: &[u8; COMM_LEN]) -> [u64; 2] {
    let mut a = [0u8; 8];
    let mut b = [0u8; 8];
    a.copy_from_slice(&c[..8]);
    b.copy_from_slice(&c[8..]);
    [u64::from_ne_bytes(a), u64::from_ne_bytes(b)]
}

impl Record {
    /// Builds a [`kind::SYSCALL_ENTRY`] record (task fields zero; see
    /// [`Record::set_task`]).
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn syscall_entry(
        vcpu: u32,
        timestamp_ns: u64,
        cr3: u64,
        pc: u64,
        nr: u64,
        args: [u64; 6],
        sp: u64,
    ) -> Self {
        let mut payload = [0u64; 12];
        payload[syscall::NR] = nr;
        payload[syscall::ARGS..syscall::ARGS + 6].copy_from_slice(&args);
        payload[syscall::SP] = sp;
        Self {
            kind: kind::SYSCALL_ENTRY,
            flags: 0,
            vcpu,
            timestamp_ns,
            cr3,
            pc,
            payload,
        }
    }

    /// Builds a [`kind::SYSCALL_RETURN`] record (task fields zero; see [`Record::set_task`]).
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn syscall_return(
        vcpu: u32,
        timestamp_ns: u64,
        cr3: u64,
        via: ReturnVia,
        insn: u64,
        rip: u64,
        rax: u64,
    ) -> Self {
        let mut payload = [0u64; 12];
        payload[ret::RAX] = rax;
        payload[ret::INSN] = insn;
        Self {
            kind: kind::SYSCALL_RETURN,
            flags: if via == ReturnVia::Iret {
                flags::VIA_IRET
            } else {
                0
            },
            vcpu,
            timestamp_ns,
            cr3,
            pc: rip,
            payload,
        }
    }

    /// Builds a [`kind::DATA`] record holding `bytes` (at most [`data::CAPACITY`]; the rest
    /// is ignored) of argument `arg` at byte `offset`, read from guest address `addr`.
    /// `extra` are [`flags::FINAL`], [`flags::TRUNCATED`], [`flags::FAULT`].
    #[allow(clippy::too_many_arguments)]
    pub fn data(
        vcpu: u32,
        entry_ts: u64,
        cr3: u64,
        addr: u64,
        arg: u8,
        offset: u32,
        bytes: &[u8],
        extra: u16,
    ) -> Self {
        let n = bytes.len().min(data::CAPACITY);
        let mut raw = [0u8; data::CAPACITY];
        raw[..n].copy_from_slice(&bytes[..n]);
        let mut payload = [0u64; 12];
        payload[data::META] = u64::from(arg) | ((n as u64) << 16) | (u64::from(offset) << 32);
        for (i, chunk) in raw.chunks_exact(8).enumerate() {
            let mut w = [0u8; 8];
            w.copy_from_slice(chunk);
            payload[data::BYTES + i] = u64::from_ne_bytes(w);
        }
        Self {
            kind: kind::DATA,
            flags: extra & (flags::FINAL | flags::TRUNCATED | flags::FAULT | flags::LATE),
            vcpu,
            timestamp_ns: entry_ts,
            cr3,
            pc: addr,
            payload,
        }
    }

    /// Builds a [`kind::SUMS`] record carrying `h` and up to [`sums::PER_RECORD`] checksums
    /// (`h.count` and `h.valid` describe which slots are used). `extra` may hold
    /// [`flags::FINAL`], [`flags::LATE`], [`flags::FAULT`], [`flags::TRUNCATED`].
    pub fn sums(
        vcpu: u32,
        entry_ts: u64,
        cr3: u64,
        buf_addr: u64,
        h: &SumsHeader,
        vals: &[u64],
        extra: u16,
    ) -> Self {
        let mut payload = [0u64; 12];
        let count = h.count.min(sums::PER_RECORD).min(vals.len());
        payload[sums::META] = u64::from(h.fd)
            | ((count as u64) << 32)
            | (u64::from(h.pos_source & 0xf) << 36)
            | (u64::from(h.read) << 40)
            | (u64::from(h.append) << 41)
            | (u64::from(h.valid & 0x3f) << 48);
        payload[sums::POS] = h.pos;
        payload[sums::LEN] = h.len;
        payload[sums::FIRST] = h.first;
        payload[sums::INODE] = h.inode;
        payload[sums::ISIZE] = h.i_size;
        payload[sums::SUMS..sums::SUMS + count].copy_from_slice(&vals[..count]);
        Self {
            kind: kind::SUMS,
            flags: extra & (flags::FINAL | flags::TRUNCATED | flags::FAULT | flags::LATE),
            vcpu,
            timestamp_ns: entry_ts,
            cr3,
            pc: buf_addr,
            payload,
        }
    }

    /// The header fields of a [`kind::SUMS`] record (counts clamped: the slot may have been
    /// scribbled on).
    pub fn sums_header(&self) -> SumsHeader {
        let m = self.payload[sums::META];
        SumsHeader {
            fd: m as u32,
            count: (((m >> 32) & 0xf) as usize).min(sums::PER_RECORD),
            pos_source: ((m >> 36) & 0xf) as u8,
            read: m & (1 << 40) != 0,
            append: m & (1 << 41) != 0,
            valid: ((m >> 48) & 0x3f) as u8,
            pos: self.payload[sums::POS],
            len: self.payload[sums::LEN],
            first: self.payload[sums::FIRST],
            inode: self.payload[sums::INODE],
            i_size: self.payload[sums::ISIZE],
        }
    }

    /// The valid checksums of a [`kind::SUMS`] record as (chunk index, checksum).
    pub fn sums_values(&self) -> Vec<(u64, u64)> {
        self.sums_iter().collect()
    }

    /// The (chunk index, checksum) pairs of a SUMS record, in order, without allocating.
    pub fn sums_iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        let h = self.sums_header();
        (0..h.count)
            .filter(move |k| h.valid & (1 << k) != 0)
            .map(move |k| (h.first.wrapping_add(k as u64), self.payload[sums::SUMS + k]))
    }

    /// Stores the task identity of an entry or return record.
    pub fn set_task(&mut self, task: u64, tid: u32, tgid: u32, comm: Option<&[u8; COMM_LEN]>) {
        let (t, ids) = match self.kind {
            kind::SYSCALL_ENTRY => (syscall::TASK, syscall::IDS),
            kind::SYSCALL_RETURN => (ret::TASK, ret::IDS),
            _ => return,
        };
        self.payload[t] = task;
        self.payload[ids] = u64::from(tid) | (u64::from(tgid) << 32);
        if let (kind::SYSCALL_ENTRY, Some(c)) = (self.kind, comm) {
            let w = comm_words(c);
            self.payload[syscall::COMM] = w[0];
            self.payload[syscall::COMM + 1] = w[1];
        }
    }

    // --- entries ---------------------------------------------------------------------------

    /// Syscall number of an entry record.
    pub fn syscall_nr(&self) -> u64 {
        self.payload[syscall::NR]
    }

    /// The six argument registers of an entry record.
    pub fn syscall_args(&self) -> [u64; 6] {
        let mut a = [0u64; 6];
        a.copy_from_slice(&self.payload[syscall::ARGS..syscall::ARGS + 6]);
        a
    }

    /// User stack pointer of an entry record.
    pub fn user_sp(&self) -> u64 {
        self.payload[syscall::SP]
    }

    /// Number of [`kind::DATA`] records that follow an entry.
    pub fn data_count(&self) -> u8 {
        if self.kind == kind::SYSCALL_ENTRY {
            (self.flags >> 8) as u8
        } else {
            0
        }
    }

    /// Sets the DATA count of an entry.
    pub fn set_data_count(&mut self, n: u8) {
        self.flags = (self.flags & 0x00ff) | (u16::from(n) << 8);
    }

    /// `task->comm` of an entry record (NUL-padded).
    pub fn comm(&self) -> [u8; COMM_LEN] {
        let mut out = [0u8; COMM_LEN];
        if self.kind == kind::SYSCALL_ENTRY {
            out[..8].copy_from_slice(&self.payload[syscall::COMM].to_ne_bytes());
            out[8..].copy_from_slice(&self.payload[syscall::COMM + 1].to_ne_bytes());
        }
        out
    }

    /// `task->comm` as text (lossy, up to the first NUL).
    pub fn comm_string(&self) -> String {
        crate::control::comm_to_string(&self.comm())
    }

    // --- entries and returns ---------------------------------------------------------------

    fn ids(&self) -> u64 {
        match self.kind {
            kind::SYSCALL_ENTRY => self.payload[syscall::IDS],
            kind::SYSCALL_RETURN => self.payload[ret::IDS],
            _ => 0,
        }
    }

    /// Guest `task_struct` pointer (entries and returns; 0 if unknown).
    pub fn task(&self) -> u64 {
        match self.kind {
            kind::SYSCALL_ENTRY => self.payload[syscall::TASK],
            kind::SYSCALL_RETURN => self.payload[ret::TASK],
            _ => 0,
        }
    }

    /// `task->pid`, the thread ID (entries and returns).
    pub fn tid(&self) -> u32 {
        self.ids() as u32
    }

    /// `task->tgid`, the process ID (entries and returns).
    pub fn tgid(&self) -> u32 {
        (self.ids() >> 32) as u32
    }

    // --- returns ---------------------------------------------------------------------------

    /// How a return record went back to user mode (`None` for other kinds).
    pub fn return_via(&self) -> Option<ReturnVia> {
        (self.kind == kind::SYSCALL_RETURN).then_some(if self.flags & flags::VIA_IRET != 0 {
            ReturnVia::Iret
        } else {
            ReturnVia::Sysret
        })
    }

    /// User RIP a return record resumes at (`pc`).
    pub fn return_rip(&self) -> u64 {
        self.pc
    }

    /// RAX at the return: the syscall's result for syscall returns.
    pub fn return_value(&self) -> u64 {
        self.payload[ret::RAX]
    }

    /// User RSP after a return.
    pub fn return_sp(&self) -> u64 {
        self.payload[ret::SP]
    }

    /// User RFLAGS after a return.
    pub fn return_rflags(&self) -> u64 {
        self.payload[ret::RFLAGS]
    }

    /// Guest address of the kernel's return instruction.
    pub fn return_insn(&self) -> u64 {
        self.payload[ret::INSN]
    }

    /// CS returned to.
    pub fn return_cs(&self) -> u64 {
        self.payload[ret::CS]
    }

    // --- data ------------------------------------------------------------------------------

    /// Argument index (0..6) a DATA record belongs to.
    pub fn data_arg(&self) -> u8 {
        self.payload[data::META] as u8
    }

    /// Byte offset of a DATA piece within its argument.
    pub fn data_offset(&self) -> u32 {
        (self.payload[data::META] >> 32) as u32
    }

    /// Length of a DATA piece (clamped to the capacity: the record may have been scribbled
    /// on).
    pub fn data_len(&self) -> usize {
        (((self.payload[data::META] >> 16) & 0xffff) as usize).min(data::CAPACITY)
    }

    /// True if this DATA piece is the last of its argument.
    pub fn data_final(&self) -> bool {
        self.flags & flags::FINAL != 0
    }

    /// Appends the bytes of a DATA piece to `out`.
    pub fn append_data(&self, out: &mut Vec<u8>) {
        let (raw, n) = self.data_raw();
        out.extend_from_slice(&raw[..n]);
    }

    /// The payload bytes of a DATA piece and how many of them are used (`data_len`), without
    /// allocating.
    pub fn data_raw(&self) -> ([u8; data::CAPACITY], usize) {
        let mut raw = [0u8; data::CAPACITY];
        for (b, w) in raw.chunks_exact_mut(8).zip(&self.payload[data::BYTES..]) {
            b.copy_from_slice(&w.to_ne_bytes());
        }
        (raw, self.data_len())
    }

    /// The bytes of a DATA piece.
    pub fn data_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.data_len());
        self.append_data(&mut v);
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_round_trip() {
        let mut r = Record::syscall_entry(1, 2, 0x1000, 0x401000, 39, [1, 2, 3, 4, 5, 6], 0x7ff0);
        let mut comm = [0u8; COMM_LEN];
        comm[..5].copy_from_slice(b"hello");
        r.set_task(0xffff_8880_0123_4000, 77, 70, Some(&comm));
        r.set_data_count(3);
        r.flags |= flags::REG_FAULT;
        assert_eq!(r.syscall_nr(), 39);
        assert_eq!(r.syscall_args(), [1, 2, 3, 4, 5, 6]);
        assert_eq!(r.user_sp(), 0x7ff0);
        assert_eq!(r.task(), 0xffff_8880_0123_4000);
        assert_eq!((r.tid(), r.tgid()), (77, 70));
        assert_eq!(r.comm(), comm);
        assert_eq!(r.comm_string(), "hello");
        assert_eq!(r.data_count(), 3);
        assert_eq!(r.flags & 0xff, flags::REG_FAULT);
        assert_eq!(r.return_via(), None);
    }

    #[test]
    fn return_round_trip() {
        let mut r = Record::syscall_return(
            0,
            5,
            0x2000,
            ReturnVia::Iret,
            0xffff_ffff_81c0_1234,
            0x401002,
            42,
        );
        r.set_task(0xffff_8880_0000_1000, 9, 8, None);
        assert_eq!(r.return_via(), Some(ReturnVia::Iret));
        assert_eq!(r.return_rip(), 0x401002);
        assert_eq!(r.return_value(), 42);
        assert_eq!(r.return_insn(), 0xffff_ffff_81c0_1234);
        assert_eq!((r.task(), r.tid(), r.tgid()), (0xffff_8880_0000_1000, 9, 8));
        assert_eq!(r.data_count(), 0);
        let s = Record::syscall_return(0, 5, 0, ReturnVia::Sysret, 1, 2, 3);
        assert_eq!(s.return_via(), Some(ReturnVia::Sysret));
    }

    #[test]
    fn sums_round_trip() {
        let h = SumsHeader {
            fd: 7,
            count: 3,
            pos_source: sums::POS_FPOS,
            read: true,
            append: true,
            valid: 0b101,
            pos: 100,
            len: 20000,
            first: 6,
            inode: 0xffff_8880_1234_0000,
            i_size: 1 << 33,
        };
        let r = Record::sums(
            1,
            2,
            3,
            0x7000,
            &h,
            &[10, 11, 12],
            flags::FINAL | flags::LATE,
        );
        assert_eq!(r.kind, kind::SUMS);
        assert_eq!(r.sums_header(), h);
        assert_eq!(r.sums_values(), vec![(6, 10), (8, 12)]);
        assert_eq!(r.flags, flags::FINAL | flags::LATE);
        let mut s = r;
        s.payload[sums::META] |= 0xf << 32; // scribbled count
        assert_eq!(s.sums_header().count, sums::PER_RECORD);
    }

    #[test]
    fn chunk_sum_is_xxh3_64() {
        // Reference values of XXH3-64 with seed 0 (xxhash's own test vectors).
        assert_eq!(chunk_sum(b""), 0x2d06_8005_38d3_94c2);
        assert_eq!(chunk_sum(b"a"), 0xe6c6_32b6_1e96_4e1f);
        let chunk = [0xa5u8; 4096];
        assert_ne!(chunk_sum(&chunk), chunk_sum(&chunk[..4095]));
    }

    #[test]
    fn data_round_trip_and_clamping() {
        let r = Record::data(
            1,
            9,
            0x3000,
            0x7fff_0000,
            1,
            88,
            b"/etc/passwd",
            flags::FINAL,
        );
        assert_eq!(r.kind, kind::DATA);
        assert_eq!(r.data_arg(), 1);
        assert_eq!(r.data_offset(), 88);
        assert_eq!(r.data_len(), 11);
        assert!(r.data_final());
        assert_eq!(r.data_bytes(), b"/etc/passwd");
        let big = [7u8; 200];
        let r = Record::data(0, 0, 0, 0, 0, 0, &big, 0);
        assert_eq!(r.data_len(), data::CAPACITY);
        assert_eq!(r.data_bytes(), vec![7u8; data::CAPACITY]);
        let mut s = r;
        s.payload[data::META] |= 0xffff << 16; // scribbled length
        assert_eq!(s.data_len(), data::CAPACITY);
    }
}
