//! vCPU redirection: run a guest function on a vCPU and put the vCPU back exactly as it was.
//!
//! The primitive behind synchronous upcalls into a guest (SymCall): at a trigger point the
//! plugin saves the vCPU's general registers, flags and segment bases, optionally writes guest
//! memory, builds a call frame (a return address pushed below the stack pointer), sets the
//! requested registers and moves the PC to the entry. When the vCPU executes a *return marker*
//! (the 7-byte no-op [`RETURN_MARKER`]) with the frame's stack pointer, the plugin reads the
//! registers there (the function's results), restores every saved register and moves the PC
//! back. Needs plugin API v7 (QEMU 11.1: register and memory writes, `qemu_plugin_set_pc`).
//!
//! Requests travel as JSON on the control socket (`vmsight cpu NAME redirect`) and as fixed
//! atomics in the plugin channel's mailbox (`vmsight_ring::redirect`); these types are the one
//! definition both use.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// The return marker: `nopl 0x564d5352(%rax)` (`0f 1f 80 52 53 4d 56`, "RSMV" in its
/// displacement), a no-op the plugin recognises when it translates code. A redirected
/// function returns to an address holding it.
pub const RETURN_MARKER: [u8; 7] = [0x0f, 0x1f, 0x80, 0x52, 0x53, 0x4d, 0x56];

/// The safe-point marker: `nopl 0x45464153(%rax)` (`0f 1f 80 53 41 46 45`, "SAFE"). A guest
/// kernel module executes it where a [`Trigger::Kernel`] request may be taken whatever the
/// interrupt flag says (SymCall's module: in its wake-up interrupt handler).
pub const SAFE_POINT_MARKER: [u8; 7] = [0x0f, 0x1f, 0x80, 0x53, 0x41, 0x46, 0x45];

/// Most registers a request may set.
pub const MAX_SET_REGS: usize = 16;
/// Most guest bytes a request may write before the redirection.
pub const MAX_MEMORY_WRITE: usize = 256;
/// Longest a caller waits for the guest function to return.
pub const MAX_TIMEOUT_MS: u64 = 600_000;

/// The registers the primitive saves, may set and restores: the general registers, the flags
/// and the segment bases (gdb names). RIP moves only with the entry and the restore.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reg {
    Rax,
    Rbx,
    Rcx,
    Rdx,
    Rsi,
    Rdi,
    Rbp,
    Rsp,
    R8,
    R9,
    R10,
    R11,
    R12,
    R13,
    R14,
    R15,
    Eflags,
    FsBase,
    GsBase,
    KGsBase,
}

/// Number of [`Reg`]s.
pub const NREGS: usize = 20;

impl Reg {
    /// Every register, in index order.
    pub const ALL: [Reg; NREGS] = [
        Reg::Rax,
        Reg::Rbx,
        Reg::Rcx,
        Reg::Rdx,
        Reg::Rsi,
        Reg::Rdi,
        Reg::Rbp,
        Reg::Rsp,
        Reg::R8,
        Reg::R9,
        Reg::R10,
        Reg::R11,
        Reg::R12,
        Reg::R13,
        Reg::R14,
        Reg::R15,
        Reg::Eflags,
        Reg::FsBase,
        Reg::GsBase,
        Reg::KGsBase,
    ];

    /// The System V argument registers, in order.
    pub const ARGS: [Reg; 6] = [Reg::Rdi, Reg::Rsi, Reg::Rdx, Reg::Rcx, Reg::R8, Reg::R9];

    /// Position in [`Reg::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The register at `i` of [`Reg::ALL`].
    pub fn from_index(i: usize) -> Option<Reg> {
        Reg::ALL.get(i).copied()
    }

    /// The name QEMU's gdbstub (and the plugin API) uses.
    pub fn name(self) -> &'static str {
        match self {
            Reg::Rax => "rax",
            Reg::Rbx => "rbx",
            Reg::Rcx => "rcx",
            Reg::Rdx => "rdx",
            Reg::Rsi => "rsi",
            Reg::Rdi => "rdi",
            Reg::Rbp => "rbp",
            Reg::Rsp => "rsp",
            Reg::R8 => "r8",
            Reg::R9 => "r9",
            Reg::R10 => "r10",
            Reg::R11 => "r11",
            Reg::R12 => "r12",
            Reg::R13 => "r13",
            Reg::R14 => "r14",
            Reg::R15 => "r15",
            Reg::Eflags => "eflags",
            Reg::FsBase => "fs_base",
            Reg::GsBase => "gs_base",
            Reg::KGsBase => "k_gs_base",
        }
    }

    /// Parses a gdb register name.
    pub fn parse(name: &str) -> Option<Reg> {
        Reg::ALL.into_iter().find(|r| r.name() == name)
    }
}

/// Where the vCPU is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "at", rename_all = "kebab-case")]
pub enum Trigger {
    /// At the next user-mode `syscall` instruction of a monitored task of this process,
    /// before the call runs (the call then runs normally after the restore).
    Syscall {
        /// The process (TGID).
        tgid: u32,
    },
    /// At the start of the next translation block any vCPU executes in kernel mode with
    /// interrupts enabled (a point where an interrupt could be taken), whatever it runs, or at
    /// a [`SAFE_POINT_MARKER`] the guest executes. The
    /// function runs with interrupts disabled (the flags are restored after). If it returns
    /// `not_here` in rax, the vCPU is restored and the next such point is tried (the guest's
    /// way of saying "not a safe point", e.g. RCU not watching). SymCall's synchronous
    /// transport.
    Kernel {
        /// The rax value that means "not here, try again".
        not_here: u64,
    },
}

/// The call frame built on the vCPU's stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Frame {
    /// The return address pushed for the function: an address holding [`RETURN_MARKER`].
    pub return_to: u64,
    /// Bytes left untouched below the stack pointer first (128 for user code: the System V
    /// red zone; 0 for the kernel, which is built without one).
    pub reserve: u64,
}

/// Guest memory written (through the vCPU's page tables) before the redirection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemWrite {
    pub addr: u64,
    pub bytes: Vec<u8>,
}

/// One redirection.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RedirectRequest {
    pub trigger: Trigger,
    /// The guest function's first instruction.
    pub entry: u64,
    /// The call frame; without one the caller arranges the return itself (the vCPU is
    /// restored when a return marker runs with the stack pointer the redirection left).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frame: Option<Frame>,
    /// Registers set at the entry (arguments go in [`Reg::ARGS`]).
    #[serde(default)]
    pub regs: BTreeMap<Reg, u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory: Option<MemWrite>,
    /// How long the caller waits for the trigger and the return together.
    pub timeout_ms: u64,
}

/// Why a redirect request is refused before it reaches the plugin.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RedirectError {
    #[error("the entry address is 0")]
    NoEntry,
    #[error("a redirection may set at most {MAX_SET_REGS} registers, not {0}")]
    TooManyRegs(usize),
    #[error("a syscall-triggered frame sets rsp itself; do not set rsp as well")]
    RspWithFrame,
    #[error(
        "a redirection writes 1 to {MAX_MEMORY_WRITE} bytes of guest memory, not {0} (the \
         write is copied through a fixed mailbox)"
    )]
    MemoryWriteSize(usize),
    #[error("the timeout must be between 1 ms and {MAX_TIMEOUT_MS} ms, not {0} ms")]
    Timeout(u64),
    #[error("TGID 0 is the idle task, which makes no syscalls")]
    ZeroTgid,
}

impl RedirectRequest {
    /// Checks the request's limits.
    pub fn validate(&self) -> Result<(), RedirectError> {
        if self.entry == 0 {
            return Err(RedirectError::NoEntry);
        }
        if self.regs.len() > MAX_SET_REGS {
            return Err(RedirectError::TooManyRegs(self.regs.len()));
        }
        let syscall = matches!(self.trigger, Trigger::Syscall { .. });
        // A kernel-mode frame goes below the requested stack (the caller's own stack).
        if syscall && self.frame.is_some() && self.regs.contains_key(&Reg::Rsp) {
            return Err(RedirectError::RspWithFrame);
        }
        if let Some(m) = &self.memory {
            if m.bytes.is_empty() || m.bytes.len() > MAX_MEMORY_WRITE {
                return Err(RedirectError::MemoryWriteSize(m.bytes.len()));
            }
        }
        if self.timeout_ms == 0 || self.timeout_ms > MAX_TIMEOUT_MS {
            return Err(RedirectError::Timeout(self.timeout_ms));
        }
        if let Trigger::Syscall { tgid: 0 } = self.trigger {
            return Err(RedirectError::ZeroTgid);
        }
        Ok(())
    }

    /// A plain call: arguments in the System V registers, a frame returning to `return_to`
    /// below the user red zone.
    pub fn call(trigger: Trigger, entry: u64, args: &[u64], return_to: u64) -> RedirectRequest {
        RedirectRequest {
            trigger,
            entry,
            frame: Some(Frame {
                return_to,
                reserve: 128,
            }),
            regs: Reg::ARGS
                .iter()
                .copied()
                .zip(args.iter().copied())
                .collect(),
            memory: None,
            timeout_ms: 10_000,
        }
    }
}

/// Why the plugin could not redirect at a trigger (the vCPU then continued untouched).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(rename_all = "kebab-case")]
pub enum RedirectFailure {
    #[error("QEMU's plugin API cannot write registers (plugin API v7, QEMU 11.1, is needed)")]
    NoWrites,
    #[error("QEMU refused to write a register; the vCPU was left as it was")]
    RegisterWrite,
    #[error("the guest memory write failed (page not present?); the vCPU was left as it was")]
    MemoryWrite,
    #[error("the return address could not be pushed (stack page not present?)")]
    StackWrite,
    #[error("the vCPU's registers could not be read")]
    RegisterRead,
    #[error("restoring the vCPU after the return failed for at least one register")]
    Restore,
    #[error("the plugin found no valid request in the mailbox")]
    BadRequest,
}

impl RedirectFailure {
    /// Wire code in the mailbox (0 is success).
    pub fn code(self) -> u64 {
        match self {
            RedirectFailure::NoWrites => 1,
            RedirectFailure::RegisterWrite => 2,
            RedirectFailure::MemoryWrite => 3,
            RedirectFailure::StackWrite => 4,
            RedirectFailure::RegisterRead => 5,
            RedirectFailure::Restore => 6,
            RedirectFailure::BadRequest => 7,
        }
    }

    pub fn from_code(c: u64) -> Option<RedirectFailure> {
        [
            RedirectFailure::NoWrites,
            RedirectFailure::RegisterWrite,
            RedirectFailure::MemoryWrite,
            RedirectFailure::StackWrite,
            RedirectFailure::RegisterRead,
            RedirectFailure::Restore,
            RedirectFailure::BadRequest,
        ]
        .into_iter()
        .find(|f| f.code() == c)
    }
}

/// What a completed redirection did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RedirectOutcome {
    /// The vCPU taken at the trigger, and the one that reached the return marker (the guest
    /// may migrate a user task meanwhile).
    pub vcpu: u32,
    pub return_vcpu: u32,
    /// The PC the vCPU was taken from (and put back to).
    pub pc: u64,
    /// Guest-visible time from the redirection to the return marker.
    pub elapsed_ns: u64,
    /// The registers at the trigger (what was restored).
    pub saved: BTreeMap<Reg, u64>,
    /// The registers at the return marker (`rax`: the function's result).
    pub at_return: BTreeMap<Reg, u64>,
    /// Registers that differed from `saved` when the vCPU next reached the trigger point
    /// after the restore (empty: every register restored exactly); `None` if the plugin
    /// did not see the vCPU there again before the caller stopped waiting.
    pub restore_mismatch: Option<Vec<Reg>>,
    /// The values the check found in the registers of `restore_mismatch` (empty when every
    /// register was restored, or not checked).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub at_check: BTreeMap<Reg, u64>,
}

/// Converts a fixed register array (mailbox order) into a map.
pub fn reg_map(values: &[u64; NREGS]) -> BTreeMap<Reg, u64> {
    Reg::ALL.iter().map(|r| (*r, values[r.index()])).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> RedirectRequest {
        RedirectRequest::call(Trigger::Syscall { tgid: 7 }, 0x401000, &[1, 2, 3], 0x401100)
    }

    #[test]
    fn registers_round_trip_by_name_and_index() {
        for (i, r) in Reg::ALL.iter().enumerate() {
            assert_eq!(r.index(), i);
            assert_eq!(Reg::from_index(i), Some(*r));
            assert_eq!(Reg::parse(r.name()), Some(*r));
        }
        assert_eq!(
            Reg::parse("rip"),
            None,
            "RIP moves only by entry and restore"
        );
        assert_eq!(Reg::from_index(NREGS), None);
    }

    #[test]
    fn a_call_puts_arguments_in_the_system_v_registers() {
        let r = req();
        assert_eq!(r.regs[&Reg::Rdi], 1);
        assert_eq!(r.regs[&Reg::Rsi], 2);
        assert_eq!(r.regs[&Reg::Rdx], 3);
        assert_eq!(r.regs.len(), 3);
        assert_eq!(r.frame.unwrap().reserve, 128);
        assert!(r.validate().is_ok());
    }

    #[test]
    fn requests_outside_the_limits_are_refused() {
        let mut r = req();
        r.entry = 0;
        assert_eq!(r.validate(), Err(RedirectError::NoEntry));
        let mut r = req();
        r.regs.insert(Reg::Rsp, 1);
        assert_eq!(r.validate(), Err(RedirectError::RspWithFrame));
        let mut r = req();
        r.memory = Some(MemWrite {
            addr: 1,
            bytes: vec![0; MAX_MEMORY_WRITE + 1],
        });
        assert_eq!(
            r.validate(),
            Err(RedirectError::MemoryWriteSize(MAX_MEMORY_WRITE + 1))
        );
        let mut r = req();
        r.timeout_ms = 0;
        assert_eq!(r.validate(), Err(RedirectError::Timeout(0)));
        let mut r = req();
        r.trigger = Trigger::Syscall { tgid: 0 };
        assert_eq!(r.validate(), Err(RedirectError::ZeroTgid));
    }

    #[test]
    fn json_form_is_stable() {
        let j = serde_json::to_value(req()).unwrap();
        assert_eq!(j["trigger"]["at"], "syscall");
        assert_eq!(j["trigger"]["tgid"], 7);
        assert_eq!(j["regs"]["rdi"], 1);
        let back: RedirectRequest = serde_json::from_value(j).unwrap();
        assert_eq!(back, req());
    }

    #[test]
    fn failure_codes_round_trip() {
        for c in 1..=7 {
            assert_eq!(RedirectFailure::from_code(c).unwrap().code(), c);
        }
        assert_eq!(RedirectFailure::from_code(0), None);
        assert_eq!(RedirectFailure::from_code(99), None);
    }
}
