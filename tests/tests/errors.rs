//! Bad input gets a one-line error and a non-zero exit, before any guest boots.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use vmsight_tests::*;

fn one_line_error(r: &Run) -> String {
    let lines: Vec<&str> = r.stderr.trim().lines().collect();
    assert_eq!(lines.len(), 1, "expected a one-line error: {r:?}");
    lines[0].to_string()
}

#[test]
fn missing_qemu_is_a_one_line_error() {
    let out = vmsight()
        .env("VMSIGHT_QEMU", "/nonexistent/qemu-system-x86_64")
        .args(["run", "--", "true"])
        .output()
        .unwrap();
    let r = Run::from(out);
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(one_line_error(&r).contains("QEMU was not found"), "{r:?}");
}

#[test]
fn missing_kernel_is_a_one_line_error() {
    let r = run(&["run", "--kernel", "/nonexistent/vmlinuz", "--", "true"]);
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(one_line_error(&r).contains("/nonexistent/vmlinuz"), "{r:?}");
}

#[test]
fn unreadable_disk_is_a_one_line_error() {
    let r = run(&["run", "--disk", "/nonexistent/disk.img", "--", "true"]);
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(
        one_line_error(&r).contains("/nonexistent/disk.img"),
        "{r:?}"
    );
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("dir-not-file");
    std::fs::create_dir(&p).unwrap();
    let r = run(&["run", "--disk", p.to_str().unwrap(), "--", "true"]);
    assert_eq!(r.code, Some(1), "{r:?}");
    one_line_error(&r);
}

#[test]
fn bad_cli_values_are_one_line_errors() {
    for args in [
        vec!["run", "--vcpus", "0", "--", "true"],
        vec!["run", "--vcpus", "many", "--", "true"],
        vec!["run", "--mem", "lots", "--", "true"],
        vec!["run", "--mem", "64", "--", "true"],
        vec!["run", "--disk", ",ro", "--", "true"],
        vec!["run", "--disk", "x.img,bogus", "--", "true"],
        vec!["run", "--name", "bad/name", "--", "true"],
        vec!["run", "--accel", "warp", "--", "true"],
        vec!["frobnicate"],
    ] {
        let r = run(&args);
        assert!(matches!(r.code, Some(1) | Some(2)), "{args:?}: {r:?}");
        let line = one_line_error(&r);
        assert!(line.starts_with("vmsight: "), "{args:?}: {line}");
    }
}

#[test]
fn no_command_without_a_terminal_is_an_error() {
    let r = run(&["run"]);
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(one_line_error(&r).contains("no command"), "{r:?}");
}
