//! Application-supplied I/O classes (Sky §3.6): the register convention libvmsight uses.
//!
//! `read`/`write`: args[3] (r10) = [`VMSIGHT_HINT_MAGIC`], args[4] (r8) = class.
//! `pread64`/`pwrite64`: args[4] (r8) = magic, args[5] (r9) = class.
//! The kernel ignores the extra registers, so the call behaves like the plain one.

use vmsight_introspect::syscall::EntryEvent;

/// Magic number in the spare argument register: ASCII "vmsight1".
pub const VMSIGHT_HINT_MAGIC: u64 = 0x766d_7369_6768_7431;

/// Syscall numbers (x86-64) that carry hints.
pub(crate) mod nr {
    pub const READ: u64 = 0;
    pub const WRITE: u64 = 1;
    pub const PREAD64: u64 = 17;
    pub const PWRITE64: u64 = 18;
}

/// The class an application supplied with this call, if any (classes above 255 are not
/// hints).
pub fn hint_of(e: &EntryEvent) -> Option<u8> {
    let (m, c) = match e.nr {
        nr::READ | nr::WRITE => (3, 4),
        nr::PREAD64 | nr::PWRITE64 => (4, 5),
        _ => return None,
    };
    if e.args[m] == VMSIGHT_HINT_MAGIC {
        u8::try_from(e.args[c]).ok()
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_follow_the_register_convention() {
        let mut e = EntryEvent {
            nr: nr::WRITE,
            args: [3, 0x1000, 10, VMSIGHT_HINT_MAGIC, 1, 0],
            ..Default::default()
        };
        assert_eq!(hint_of(&e), Some(1));
        e.nr = nr::PWRITE64; // magic must then be in args[4]
        assert_eq!(hint_of(&e), None);
        e.args = [3, 0x1000, 10, 4096, VMSIGHT_HINT_MAGIC, 2];
        assert_eq!(hint_of(&e), Some(2));
        e.args[5] = 300;
        assert_eq!(hint_of(&e), None);
        e.nr = 257;
        assert_eq!(hint_of(&e), None);
    }
}
