//! A VM's files and sockets are its owner's only (docs/security.md): checked against a second
//! local user the test makes, with vmsight started under umask 000, from that user's side
//! (its own `open` and `connect`, as python3 run through `setpriv`) and from the owner's
//! (vmsight's commands keep working).
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::process::Command;

use vmsight_tests::*;

/// The second local user: a system user without a home, made on first use.
const OTHER: &str = "vmsight-other";

fn uid_of(user: &str) -> Option<u32> {
    let o = Command::new("id").args(["-u", user]).output().ok()?;
    o.status
        .success()
        .then(|| String::from_utf8_lossy(&o.stdout).trim().parse().ok())?
}

fn other_user() -> u32 {
    if let Some(u) = uid_of(OTHER) {
        return u;
    }
    let st = Command::new("useradd")
        .args([
            "--system",
            "--no-create-home",
            "--shell",
            "/usr/sbin/nologin",
            OTHER,
        ])
        .status()
        .expect("useradd (Debian's passwd package; the guest tests run as root)");
    assert!(st.success(), "useradd {OTHER} failed");
    uid_of(OTHER).unwrap()
}

/// Opens a file for reading: prints `read` or `denied ERRNO`.
const READ: &str = "import sys
try:
    open(sys.argv[1], 'rb').read(1)
    print('read')
except OSError as e:
    print('denied', e.errno)";

/// Connects to a socket and sends one line: prints `denied ERRNO` (no connection), `answered`
/// (a reply came) or `closed` (the server hung up without a word).
const CONNECT: &str = "import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except OSError as e:
    print('denied', e.errno)
    sys.exit()
s.settimeout(20)
try:
    s.sendall(b'not a request\\n')
    d = s.recv(4096)
except OSError:
    d = b''
print('answered' if d else 'closed')";

/// Runs `code` with python3, as the other user when `other`, else as the test (root).
fn python(other: bool, code: &str, arg: &std::path::Path) -> String {
    // Debian's python3 (scripts/setup-host.sh installs it): another user may not reach a
    // python3 found in root's PATH (a pyenv shim under /root).
    let mut c = if other {
        let mut c = Command::new("setpriv");
        c.args([
            "--reuid",
            OTHER,
            "--regid",
            OTHER,
            "--clear-groups",
            "/usr/bin/python3",
        ]);
        c
    } else {
        Command::new("/usr/bin/python3")
    };
    let o = c.args(["-c", code]).arg(arg).output().expect("python3");
    assert!(o.status.success(), "{o:?}");
    String::from_utf8_lossy(&o.stdout).trim().to_owned()
}

fn set_mode(p: &std::path::Path, mode: u32) {
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn another_local_user_can_neither_read_a_vms_files_nor_use_its_sockets_even_under_umask_000() {
    let other = other_user();
    // SAFETY: umask only sets the process's file-mode mask; this file holds one test, so no
    // other test creates files meanwhile. vmsight inherits it.
    let old = unsafe { libc::umask(0) };
    let name = vm_name("security");
    let mut vm = LiveVm::start(&["--name", &name, "--", "sh", "-c", "echo READY; read _"]);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    vm.wait_line("READY");
    let dir = vmsight_launcher::runtime::runtime_base().join(&name);
    assert_eq!(
        std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
        0o700,
        "{}",
        dir.display()
    );

    // Every file and socket: no bit for group or others, and the other user gets EACCES.
    let (mut files, mut sockets) = (0, 0);
    for e in std::fs::read_dir(&dir).unwrap() {
        let e = e.unwrap();
        let (path, meta) = (e.path(), e.metadata().unwrap());
        let mode = meta.permissions().mode();
        assert_eq!(mode & 0o077, 0, "{} is mode {mode:o}", path.display());
        if meta.file_type().is_socket() {
            sockets += 1;
            assert_eq!(
                python(true, CONNECT, &path),
                "denied 13",
                "{}",
                path.display()
            );
        } else if meta.is_file() {
            files += 1;
            assert_eq!(python(true, READ, &path), "denied 13", "{}", path.display());
        }
    }
    // The guest command, its console, QEMU's command line, vm.json, the plugin channel;
    // QMP, control, the disk and the guest channels.
    assert!(
        files >= 4 && sockets >= 4,
        "{files} files, {sockets} sockets"
    );

    // Past the modes: with the directory and the control socket opened up, the other user
    // reaches the socket, and vmsight hangs up on it (SO_PEERCRED) while answering the owner.
    let control = dir.join("control.sock");
    set_mode(&dir, 0o711);
    set_mode(&control, 0o666);
    let theirs = python(true, CONNECT, &control);
    let ours = python(false, CONNECT, &control);
    set_mode(&control, 0o600);
    set_mode(&dir, 0o700);
    assert_eq!((theirs.as_str(), ours.as_str()), ("closed", "answered"));

    // The owner's commands still work.
    let r = run(&["stats", &name, "--json"]);
    assert_eq!(r.code, Some(0), "{r:?}");
    let r = run(&["ps"]);
    assert!(r.stdout.contains(&name), "{r:?}");

    vm.send("go");
    let (code, _, err) = vm.finish();
    assert_eq!(code, Some(0), "{err}");
    assert!(
        err.contains(&format!("refused a connection from uid {other}")),
        "the refusal is logged: {err}"
    );
}

/// The fields of a `/proc/.../status` file.
fn status_fields(text: &str) -> std::collections::HashMap<String, String> {
    text.lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
        .collect()
}

/// `/proc/PID/status` fields.
fn status(pid: u32) -> std::collections::HashMap<String, String> {
    status_fields(&std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap())
}

/// The real uid of a `/proc/PID/status`.
fn real_uid(st: &std::collections::HashMap<String, String>) -> u32 {
    st["Uid"]
        .split_whitespace()
        .next()
        .unwrap()
        .parse()
        .unwrap()
}

fn pgrep_children(parent: u32, name: &str) -> Vec<u32> {
    let o = Command::new("pgrep")
        .args(["-P", &parent.to_string(), "-x", name])
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout)
        .split_whitespace()
        .map(|p| p.parse().unwrap())
        .collect()
}

#[test]
fn qemu_and_virtiofsd_run_as_an_unprivileged_identity_of_the_vm_when_vmsight_is_root() {
    // SAFETY: geteuid only reads the process's credentials and cannot fail.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(
        euid, 0,
        "this test checks what vmsight does as root: run it as root (make test does)"
    );
    let name = vm_name("confined");
    let mut vm = LiveVm::start(&[
        "--name",
        &name,
        "--shared-mem",
        "16M",
        "--",
        "sh",
        "-c",
        "echo data > /hylics/f && echo \"owner $(stat -c %u:%g /hylics/f)\" && echo READY; read _",
    ]);
    vm.wait_line("READY");
    let base = vmsight_launcher::runtime::runtime_base();
    let rec = vmsight_launcher::runtime::list_running(&base)
        .into_iter()
        .find(|r| r.name == name)
        .unwrap();

    // QEMU: the VM's own uid and gid, no capability, its seccomp sandbox on, chrooted into
    // the empty jail of the runtime directory.
    let qemu_pid = rec.qemu_pid.unwrap();
    let q = status(qemu_pid);
    let uid = real_uid(&q);
    assert!(uid >= vmsight_launcher::confine::DYNAMIC_BASE, "{q:?}");
    assert_eq!(q["Uid"], format!("{uid}\t{uid}\t{uid}\t{uid}"), "{q:?}");
    assert_eq!(q["Gid"], format!("{uid}\t{uid}\t{uid}\t{uid}"), "{q:?}");
    assert_eq!(
        q["Groups"],
        uid.to_string(),
        "no supplementary group: {q:?}"
    );
    for caps in ["CapEff", "CapPrm", "CapInh", "CapAmb"] {
        assert_eq!(q[caps], "0000000000000000", "{caps}: {q:?}");
    }
    assert_eq!(
        (q["Seccomp"].as_str(), q["NoNewPrivs"].as_str()),
        ("2", "1")
    );
    assert_eq!(
        std::fs::read_link(format!("/proc/{qemu_pid}/root")).unwrap(),
        base.join(&name).join("jail")
    );

    // virtiofsd: the same identity; its sandboxed worker holds capabilities only in a user
    // namespace of its own, not the host's.
    let vfs = pgrep_children(rec.pid, "virtiofsd");
    assert_eq!(vfs.len(), 1, "one virtiofsd for the share: {vfs:?}");
    let v = status(vfs[0]);
    assert_eq!(
        (real_uid(&v), v["CapEff"].as_str()),
        (uid, "0000000000000000")
    );
    let host_ns = std::fs::read_link("/proc/self/ns/user").unwrap();
    let workers = pgrep_children(vfs[0], "virtiofsd");
    assert!(!workers.is_empty(), "virtiofsd's sandboxed process");
    for w in workers {
        let st = status(w);
        assert_eq!(real_uid(&st), uid, "{st:?}");
        let ns = std::fs::read_link(format!("/proc/{w}/ns/user")).unwrap();
        assert!(
            st["CapEff"] == "0000000000000000" || ns != host_ns,
            "capabilities in the host's user namespace: {st:?}"
        );
    }

    // The guest's root owns its files; on the host they belong to the VM's identity.
    let host_file = base.join(&name).join("hylics/share/f");
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(&host_file).unwrap();
    assert_eq!((meta.uid(), meta.gid()), (uid, uid));

    vm.send("go");
    let (code, out, err) = vm.finish();
    assert_eq!(code, Some(0), "{err}");
    assert!(
        out.iter().any(|l| l == "owner 0:0"),
        "the guest sees its root: {out:?}"
    );
}

/// `/proc/PID/task/*/status` of every thread of `pid`, as `status` gives it.
fn thread_status(pid: u32) -> Vec<std::collections::HashMap<String, String>> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|t| {
            let st = std::fs::read_to_string(t.ok()?.path().join("status")).ok()?;
            Some(status_fields(&st))
        })
        .collect()
}

/// No capability in any of the five sets.
const NO_CAPS: &str = "0000000000000000";

#[test]
fn the_threads_that_take_guest_requests_run_under_a_filter_that_refuses_forbidden_calls() {
    let name = vm_name("seccomp");
    let started = uptime();
    let mut vm = LiveVm::start_with_env(
        &[
            "--name",
            &name,
            "--trace",
            "--trace-out",
            "/dev/null",
            "--",
            "sh",
            "-c",
            "dd if=/dev/urandom of=/root/f bs=64k count=64 2>/dev/null && sync && \
             echo \"sum $(sha256sum /root/f | cut -c1-64)\" && \
             echo 3 > /proc/sys/vm/drop_caches && \
             echo \"again $(sha256sum /root/f | cut -c1-64)\" && echo READY; read _",
        ],
        &[(vmsight_vhostd::seccomp::PROBE_ENV, "1")],
    );
    vm.wait_line("READY");
    // The kernel's view of each thread: the disk's I/O pool, the disk's and the NIC's vring
    // workers and the plugin channel's reader (tracing is on) are filtered (mode 2) and hold
    // no capability in any set; the NIC's vhost-user relays and the disk's file-update
    // stream consumer are filtered (the deny list) and keep them;
    // vmsight's main thread is neither filtered nor stripped.
    let vm_pid = vm.pid();
    let threads = thread_status(vm_pid);
    let named = |prefix: &str| -> Vec<&std::collections::HashMap<String, String>> {
        threads
            .iter()
            .filter(|t| t["Name"].starts_with(prefix))
            .collect()
    };
    let show = |t: &std::collections::HashMap<String, String>| {
        format!(
            "{} seccomp {} caps eff {} prm {} bnd {}",
            t["Name"], t["Seccomp"], t["CapEff"], t["CapPrm"], t["CapBnd"]
        )
    };
    let all: Vec<String> = threads.iter().map(show).collect();
    let main = named("vmsight");
    assert_eq!(main[0]["Seccomp"], "0", "main thread: {all:#?}");
    assert_ne!(main[0]["CapEff"], NO_CAPS, "main thread: {all:#?}");
    let confined = [("vmsight-io", 1), ("vring_worker", 2), ("vmsight-trace", 1)];
    for (prefix, at_least) in confined {
        let ts = named(prefix);
        assert!(ts.len() >= at_least, "{prefix}: {all:#?}");
        for t in ts {
            assert_eq!(t["Seccomp"], "2", "{}", show(t));
            for set in ["CapEff", "CapPrm", "CapInh", "CapBnd", "CapAmb"] {
                assert_eq!(t[set], NO_CAPS, "{set} of {}", show(t));
            }
        }
    }
    // (The kernel keeps 15 bytes of a thread's name.)
    let services: Vec<_> = ["vmsight-vu-rel", "vmsight-stream"]
        .iter()
        .flat_map(|prefix| named(prefix))
        .collect();
    assert!(
        services.len() >= 2,
        "the NIC's relays, the disk's stream: {all:#?}"
    );
    for t in services {
        assert_eq!(t["Seccomp"], "2", "{}", show(t));
        assert_ne!(t["CapEff"], NO_CAPS, "{}", show(t));
    }

    vm.send("go");
    let (code, out, err) = vm.finish();
    assert_eq!(code, Some(0), "{err}");
    // The disk still works under the filters: the bytes read back (from the disk, the page
    // cache dropped) are those written.
    let field = |k: &str| {
        out.iter()
            .find_map(|l| l.strip_prefix(k).map(str::to_owned))
            .unwrap_or_else(|| panic!("no {k:?} in {out:?}"))
    };
    assert_eq!(field("sum "), field("again "));
    // The test-only probe: each filtered thread tried a forbidden call and was refused.
    for class in [
        "vring worker",
        "NIC vring worker",
        "I/O pool",
        "plugin channel reader",
        "guest service",
    ] {
        let want = format!(
            "seccomp probe ({class} thread): a forbidden call (unshare) was refused: \
             Operation not permitted"
        );
        assert!(err.contains(&want), "{want:?} in {err}");
    }
    assert!(!err.contains("was allowed"), "{err}");
    // The kernel's log (audit records of refused calls, an oracle outside vmsight): every
    // filtered thread's probe is there (unshare, call 272), and no other call of any thread
    // was refused while the guest wrote and read its disk with tracing on.
    let log = refused_calls(vm_pid, started - 1.0);
    for (prefix, _) in confined
        .iter()
        .chain(&[("vmsight-vu-rel", 1), ("vmsight-stream", 1)])
    {
        assert!(
            log.iter()
                .any(|(t, nr)| t.starts_with(prefix) && *nr == libc::SYS_unshare),
            "the probe of {prefix} in the kernel log: {log:?}"
        );
    }
    let others: Vec<_> = log
        .iter()
        .filter(|(_, nr)| *nr != libc::SYS_unshare)
        .collect();
    assert!(
        others.is_empty(),
        "calls refused besides the probe's: {others:?}"
    );
}

/// Seconds since boot, the clock of the kernel log's timestamps.
fn uptime() -> f64 {
    std::fs::read_to_string("/proc/uptime")
        .ok()
        .and_then(|u| u.split_whitespace().next()?.parse().ok())
        .expect("/proc/uptime")
}

/// The calls the kernel logged as refused by a seccomp filter (`audit: type=1326`) in the
/// process `pid` since `since` (seconds since boot; a pid is reused): (thread name, call
/// number).
fn refused_calls(pid: u32, since: f64) -> Vec<(String, i64)> {
    let o = Command::new("dmesg").output().expect("dmesg");
    assert!(o.status.success(), "dmesg: {o:?}");
    let pid = format!("pid={pid}");
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter(|l| l.contains("type=1326"))
        .filter_map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            let field = |k: &str| words.iter().find_map(|w| w.strip_prefix(k));
            let at: f64 = l
                .strip_prefix('[')?
                .split(']')
                .next()?
                .trim()
                .parse()
                .ok()?;
            if at < since || !words.contains(&pid.as_str()) {
                return None;
            }
            let comm = field("comm=")?.trim_matches('"').to_owned();
            Some((comm, field("syscall=")?.parse().ok()?))
        })
        .collect()
}
