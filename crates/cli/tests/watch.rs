//! `vmsight watch` end to end: the real binary discovers a VM in a fake runtime directory,
//! subscribes to its real event bus and prints what is published.

#![allow(clippy::unwrap_used)] // helpers outside #[test] functions unwrap too

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::Duration;

use vmsight_events::{Addresser, EventBus, Message, EVENTS_SOCKET};

fn event(path: &str) -> vmsight_fsview::FsEvent {
    vmsight_fsview::FsEvent {
        kind: vmsight_fsview::EventKind::Create,
        path: path.into(),
        old_path: None,
        ino: 20,
        old: None,
        new: None,
        range: None,
        data: None,
        txn: None,
        observed_ns: 1,
    }
}

fn watch(args: &[&str], publish: &[&str]) -> String {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("web1");
    std::fs::create_dir(&dir).unwrap();
    let rec = format!(r#"{{"name":"web1","pid":{}}}"#, std::process::id());
    std::fs::write(dir.join("vm.json"), rec).unwrap();
    let bus = EventBus::bind(dir.join(EVENTS_SOCKET)).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_vmsight"))
        .arg("watch")
        .args(args)
        .env("VMSIGHT_RUNTIME", t.path())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // Publish only once the watcher is subscribed (bounded wait, nothing timed is asserted).
    for _ in 0..300 {
        if bus.stats().clients > 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(bus.stats().clients, 1, "vmsight watch never subscribed");
    let addr = Addresser::new("h", "web1");
    for p in publish {
        bus.publish(&addr.wrap(event(p)));
    }
    let mut out = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    assert!(child.wait().unwrap().success());
    out
}

#[test]
fn readable_lines_for_matching_events() {
    let out = watch(
        &["/etc/*", "--count", "2"],
        &["/var/x", "/etc/passwd", "/etc/a/b", "/etc/hosts"],
    );
    assert_eq!(
        out,
        "2 h:web1:/etc/passwd create\n4 h:web1:/etc/hosts create\n"
    );
}

#[test]
fn json_lines_and_vm_filter() {
    let out = watch(
        &["--json", "--vm", "web1", "--count", "1", "*:web1:/**"],
        &["/a/b"],
    );
    let m = Message::from_json(out.trim_end()).unwrap();
    assert_eq!(m.channel(), "h:web1:/a/b");
    assert_eq!(m.seq, 1);
}

#[test]
fn bad_patterns_are_usage_errors() {
    let out = Command::new(env!("CARGO_BIN_EXE_vmsight"))
        .args(["watch", "etc/passwd"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("must start with '/'"), "{err}");
}
