//! The fixed-size record carried by the rings.

/// Record kinds stored in [`Record::kind`].
pub mod kind {
    /// An unused slot (never pushed by the plugin).
    pub const EMPTY: u16 = 0;
    /// Entry of a user-mode `syscall` instruction; payload layout in [`super::syscall`].
    pub const SYSCALL_ENTRY: u16 = 1;
}

/// Bits of [`Record::flags`]. The high byte holds the inline data length.
pub mod flags {
    /// `payload[syscall::DATA..]` holds guest bytes copied at entry (`peek=on`).
    pub const DATA: u16 = 1 << 0;
    /// The guest memory read for the inline data failed (nothing or only part was copied).
    pub const DATA_FAULT: u16 = 1 << 1;
    /// One or more register reads failed; the affected fields are zero.
    pub const REG_FAULT: u16 = 1 << 2;
}

/// Payload word indices of a [`kind::SYSCALL_ENTRY`] record.
pub mod syscall {
    /// RAX at entry: the syscall number (the kernel uses its low 32 bits).
    pub const NR: usize = 0;
    /// First of the six argument registers: rdi, rsi, rdx, r10, r8, r9.
    pub const ARGS: usize = 1;
    /// RSP at entry (the user stack pointer; Sky tells threads apart by it).
    pub const SP: usize = 7;
    /// First of four words (32 bytes) of inline guest data (see [`super::flags::DATA`]).
    pub const DATA: usize = 8;
    /// Capacity of the inline data in bytes.
    pub const DATA_BYTES: usize = 32;
}

/// One 128-byte record. Plain old data: every bit pattern is a valid value, so reading a slot
/// another process scribbled on yields garbage values, never undefined behaviour.
///
/// A record needs 11 words for a syscall entry (header, time, CR3, PC, number, six arguments)
/// plus the user stack pointer and 32 bytes of inline data; 64 bytes cannot hold that, 128 can
/// and keeps slots cache-line aligned.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Record {
    /// One of [`kind`].
    pub kind: u16,
    /// Bits of [`flags`]; bits 8..16 hold the inline data length in bytes.
    pub flags: u16,
    /// vCPU index that produced the record.
    pub vcpu: u32,
    /// Host CLOCK_MONOTONIC nanoseconds when the record was produced.
    pub timestamp_ns: u64,
    /// Guest CR3 with the PCID bits (11:0) and the no-flush bit (63) cleared: identifies the
    /// address space.
    pub cr3: u64,
    /// Guest virtual address of the instruction.
    pub pc: u64,
    /// Kind-specific payload.
    pub payload: [u64; 12],
}

impl Record {
    /// Builds a [`kind::SYSCALL_ENTRY`] record.
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

    /// Syscall number of a syscall-entry record.
    pub fn syscall_nr(&self) -> u64 {
        self.payload[syscall::NR]
    }

    /// The six argument registers of a syscall-entry record.
    pub fn syscall_args(&self) -> [u64; 6] {
        let mut a = [0u64; 6];
        a.copy_from_slice(&self.payload[syscall::ARGS..syscall::ARGS + 6]);
        a
    }

    /// User stack pointer of a syscall-entry record.
    pub fn user_sp(&self) -> u64 {
        self.payload[syscall::SP]
    }

    /// Stores up to [`syscall::DATA_BYTES`] bytes of inline data and sets [`flags::DATA`].
    /// Returns how many bytes were stored.
    pub fn set_data(&mut self, bytes: &[u8]) -> usize {
        let n = bytes.len().min(syscall::DATA_BYTES);
        let mut raw = [0u8; syscall::DATA_BYTES];
        raw[..n].copy_from_slice(&bytes[..n]);
        for (i, chunk) in raw.chunks_exact(8).enumerate() {
            let mut w = [0u8; 8];
            w.copy_from_slice(chunk);
            self.payload[syscall::DATA + i] = u64::from_ne_bytes(w);
        }
        // n <= 32, so the cast cannot truncate.
        self.flags = (self.flags & 0x00ff) | flags::DATA | ((n as u16) << 8);
        n
    }

    /// The inline data, if [`flags::DATA`] is set. The length comes from the record, which may
    /// have been scribbled on, so it is clamped to the capacity.
    pub fn data(&self) -> Option<Vec<u8>> {
        if self.flags & flags::DATA == 0 {
            return None;
        }
        let n = usize::from(self.flags >> 8).min(syscall::DATA_BYTES);
        let mut out = Vec::with_capacity(syscall::DATA_BYTES);
        for w in &self.payload[syscall::DATA..syscall::DATA + 4] {
            out.extend_from_slice(&w.to_ne_bytes());
        }
        out.truncate(n);
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn syscall_record_round_trip() {
        let mut r = Record::syscall_entry(1, 2, 0x1000, 0x401000, 39, [1, 2, 3, 4, 5, 6], 0x7ff0);
        assert_eq!(r.syscall_nr(), 39);
        assert_eq!(r.syscall_args(), [1, 2, 3, 4, 5, 6]);
        assert_eq!(r.user_sp(), 0x7ff0);
        assert_eq!(r.data(), None);
        assert_eq!(r.set_data(b"hello"), 5);
        assert_eq!(r.data().as_deref(), Some(&b"hello"[..]));
        assert_eq!(r.set_data(&[7u8; 40]), 32);
        assert_eq!(r.data().map(|d| d.len()), Some(32));
    }

    #[test]
    fn scribbled_data_length_is_clamped() {
        let r = Record {
            flags: flags::DATA | (255 << 8),
            ..Record::default()
        };
        assert_eq!(r.data().map(|d| d.len()), Some(32));
    }
}
