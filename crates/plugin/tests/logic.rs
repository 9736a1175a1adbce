//! Unit tests of the plugin's pure logic (argument parsing, instruction matching, CR3
//! masking). The module is compiled into this test directly: the library itself references
//! QEMU's API, which only exists inside QEMU, so a test binary linking it could not start.

#[path = "../src/logic.rs"]
#[allow(dead_code)]
mod logic;

use std::path::PathBuf;

use logic::{cr3_base, is_syscall_insn, Options, PluginError, DEFAULT_SYNC_EVERY};

#[test]
fn options_parse() {
    let o = Options::parse(["shm=/tmp/x.shm"]).expect("minimal");
    assert_eq!(o.shm, PathBuf::from("/tmp/x.shm"));
    assert!(o.records && !o.peek && !o.verbose);
    assert_eq!(o.sync_every, DEFAULT_SYNC_EVERY);
    let o = Options::parse(["records=off", "shm=/a", "peek=on", "sync=7", "verbose=yes"])
        .expect("full");
    assert!(!o.records && o.peek && o.verbose);
    assert_eq!(o.sync_every, 7);
    assert!(matches!(Options::parse([]), Err(PluginError::MissingShm)));
    assert!(matches!(
        Options::parse(["shm="]),
        Err(PluginError::BadValue { .. })
    ));
    assert!(matches!(
        Options::parse(["shm=/a", "records=maybe"]),
        Err(PluginError::BadValue { .. })
    ));
    assert!(matches!(
        Options::parse(["shm=/a", "sync=0"]),
        Err(PluginError::BadValue { .. })
    ));
    assert!(matches!(
        Options::parse(["shm=/a", "bogus=1"]),
        Err(PluginError::Unknown(_))
    ));
    assert!(matches!(
        Options::parse(["shm"]),
        Err(PluginError::Malformed(_))
    ));
    let msg = PluginError::MissingShm.to_string();
    assert!(msg.starts_with("The argument shm=PATH"), "{msg}");
}

#[test]
fn syscall_decoding() {
    assert!(is_syscall_insn(&[0x0f, 0x05]));
    assert!(is_syscall_insn(&[0x48, 0x0f, 0x05]));
    assert!(is_syscall_insn(&[0x66, 0x2e, 0x0f, 0x05]));
    assert!(!is_syscall_insn(&[0x0f, 0x34])); // sysenter
    assert!(!is_syscall_insn(&[0x0f]));
    assert!(!is_syscall_insn(&[]));
    assert!(!is_syscall_insn(&[0x90, 0x0f, 0x05])); // not a prefix
    assert!(!is_syscall_insn(&[0x0f, 0x05, 0x90]));
}

#[test]
fn cr3_masking() {
    assert_eq!(cr3_base(0x8000_0000_1234_5fff), 0x1234_5000);
    assert_eq!(cr3_base(0x1234_6000), 0x1234_6000);
}
