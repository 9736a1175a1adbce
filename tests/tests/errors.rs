//! Bad input gets a one-line error and a non-zero exit, before any guest boots.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use vmsight_tests::*;

#[test]
fn missing_qemu_is_a_one_line_error() {
    let out = vmsight()
        .env("VMSIGHT_QEMU", "/nonexistent/qemu-system-x86_64")
        .args(["run", "--", "true"])
        .output()
        .unwrap();
    let r = Run::from(out);
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(r.one_line_error().contains("QEMU was not found"), "{r:?}");
}

#[test]
fn missing_kernel_is_a_one_line_error() {
    let r = run(&["run", "--kernel", "/nonexistent/vmlinuz", "--", "true"]);
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(r.one_line_error().contains("/nonexistent/vmlinuz"), "{r:?}");
}

#[test]
fn unreadable_disk_is_a_one_line_error() {
    let r = run(&["run", "--disk", "/nonexistent/disk.img", "--", "true"]);
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(
        r.one_line_error().contains("/nonexistent/disk.img"),
        "{r:?}"
    );
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("dir-not-file");
    std::fs::create_dir(&p).unwrap();
    let r = run(&["run", "--disk", p.to_str().unwrap(), "--", "true"]);
    assert_eq!(r.code, Some(1), "{r:?}");
    r.one_line_error();
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
        let line = r.one_line_error();
        assert!(line.starts_with("vmsight: "), "{args:?}: {line}");
    }
}

#[test]
fn no_command_without_a_terminal_is_an_error() {
    let r = run(&["run"]);
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(r.one_line_error().contains("no command"), "{r:?}");
}

#[test]
fn bad_storage_and_streaming_options_are_one_line_errors() {
    for (args, code, needle) in [
        (
            vec!["run", "--cache-policy", "fifo", "--", "true"],
            2,
            "fifo",
        ),
        (
            vec!["run", "--cache-mode", "sometimes", "--", "true"],
            2,
            "sometimes",
        ),
        (
            vec!["run", "--disk-model", "floppy", "--", "true"],
            2,
            "floppy",
        ),
        (vec!["run", "--cache-size", "lots", "--", "true"], 2, "lots"),
        (
            vec![
                "run",
                "--stream-lazy",
                "--stream-lazy-cache-mb",
                "0",
                "--",
                "true",
            ],
            2,
            "stream-lazy-cache-mb",
        ),
        (
            vec!["run", "--stream-lazy-cache-mb", "4", "--", "true"],
            2,
            "--stream-lazy",
        ),
        (
            vec!["run", "--disk", "x.img,mount=rel", "--", "true"],
            2,
            "absolute",
        ),
        (
            vec!["run", "--record-writes", "x.rec", "--", "true"],
            2,
            "DISK:FILE",
        ),
        (
            vec!["run", "--record-writes", "5:/tmp/r.rec", "--", "true"],
            1,
            "disk 5",
        ),
        (
            vec!["run", "--insight-paths", "/a", "--", "true"],
            1,
            "--insights",
        ),
        (
            vec!["run", "--redis", "redis://127.0.0.1:1/", "--", "true"],
            1,
            "Redis",
        ),
        (
            vec!["run", "--stage", "dedup", "--", "true"],
            1,
            "no such stage",
        ),
        (
            vec!["run", "--stage", "icache:size=x", "--", "true"],
            1,
            "size \"x\"",
        ),
        (
            vec!["run", "--stage", "write-tap", "--", "true"],
            1,
            "cannot be requested",
        ),
        (vec!["run", "--stage=", "--", "true"], 2, "needs a name"),
        (
            vec!["run", "--disk", "x.img,io_threads=0", "--", "true"],
            2,
            "io_threads",
        ),
        (
            vec!["run", "--disk", "x.img,io=aio", "--", "true"],
            2,
            "io=\"aio\" must be threads or io_uring",
        ),
        (
            vec![
                "run",
                "--disk",
                "x.img,io=io_uring,io_threads=2",
                "--",
                "true",
            ],
            2,
            "io_threads=N applies to io=threads only",
        ),
        (
            vec!["run", "--metrics", "not-an-address", "--", "true"],
            1,
            "not-an-address",
        ),
        (vec!["stats", "no-such-vm"], 1, "no running VM"),
        (vec!["stream", "no-such-vm"], 1, "no running VM"),
        (
            vec!["replay", "/nonexistent/base.img", "/nonexistent/rec"],
            1,
            "/nonexistent",
        ),
        (
            vec!["report", "/nonexistent/insights.jsonl"],
            1,
            "/nonexistent",
        ),
    ] {
        let r = run(&args);
        assert_eq!(r.code, Some(code), "{args:?}: {r:?}");
        let line = r.one_line_error();
        assert!(line.contains(needle), "{args:?}: {line}");
    }
}

#[test]
fn a_metrics_port_in_use_fails_before_the_guest_runs_and_leaves_nothing() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    let r = run(&[
        "run",
        "--name",
        "metrics-busy",
        "--metrics",
        &addr,
        "--",
        "true",
    ]);
    assert_eq!(r.code, Some(1), "{r:?}");
    let line = r.one_line_error();
    assert!(line.contains(&addr) && line.contains("in use"), "{line}");
    // No VM is left behind: `vmsight ps` does not list it.
    let ps = run(&["ps", "--json"]);
    assert!(!ps.stdout.contains("metrics-busy"), "{ps:?}");
}

/// QEMU exits during its start-up, before it connects to any backend (here: a wrapper that
/// refuses every run but `--version`): vmsight reports QEMU's message and exits, instead of
/// waiting for ever for the disk's and the NIC's frontend.
#[test]
fn a_qemu_that_exits_before_connecting_is_reported_and_vmsight_ends() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let wrapper = dir.path().join("qemu-system-x86_64");
    std::fs::write(
        &wrapper,
        "#!/bin/sh\ncase \"$1\" in --version) exec qemu-system-x86_64 \"$@\";; esac\n\
         echo 'qemu-system-x86_64: refusing to start (test wrapper)' >&2\nexit 1\n",
    )
    .unwrap();
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut c = vmsight();
    c.args(["run", "--qemu", wrapper.to_str().unwrap(), "--", "true"]);
    let r = output_within(
        c,
        std::time::Duration::from_secs(120),
        "vmsight run (failing QEMU)",
    );
    assert_ne!(r.code, Some(0), "{r:?}");
    assert!(
        r.stderr.contains("refusing to start (test wrapper)"),
        "{r:?}"
    );
}

/// `--run-as` takes auto, self, a user or UID:GID, and never root's ids: each refusal names
/// the value and the reason, before any guest boots.
#[test]
fn bad_run_as_values_are_refused_with_the_reason() {
    for (value, want) in [
        ("no-such-user-anywhere", "no such user"),
        ("1:x", "expected auto, self, a user's name or UID:GID"),
        ("0:0", "uid and gid 0 are root"),
    ] {
        let r = run(&["run", "--run-as", value, "--", "true"]);
        assert_ne!(r.code, Some(0), "{value}: {r:?}");
        assert!(
            r.stderr.contains(&format!("--run-as {value}")) && r.stderr.contains(want),
            "{value}: {r:?}"
        );
        assert!(
            !r.stderr.contains("boot"),
            "{value}: refused before booting: {r:?}"
        );
    }
}
