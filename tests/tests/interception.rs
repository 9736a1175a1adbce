//! Syscall interception checked against strace inside the guest (issue 3's oracle).
//!
//! Each workload runs as `/tmp/wl` (a copy of dash, so its `comm` is unique) under
//! `strace -f` inside the guest, while vmsight traces the same processes from outside with
//! `--trace wl`: both observe the very same execution, so even scheduling-dependent values
//! (pipe read sizes) must agree. Per thread, the sequences of (name, fd/path arguments,
//! return value) must be identical. A second test runs deterministic workloads twice, once
//! under each tool, as the issue states it.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use vmsight_tests::trace_compare::{diff, parse_strace, parse_vmsight_json, Runs};
use vmsight_tests::*;

/// Syscalls compared: file, memory, socket and process calls, with their fds, paths, flags,
/// modes, counts and offsets (tests/src/trace_compare.rs `compared`) and returns.
const FILTER: &str = "openat,read,write,close,execve,clone,clone3,fork,vfork,wait4,exit_group,exit,pipe2,dup2,rt_sigreturn,kill,unlinkat,newfstatat,getdents64,chdir,rename,mkdir,\
mmap,fstat,lseek,pread64,pwrite64,fcntl,ioctl,readv,writev,preadv,pwritev,preadv2,pwritev2,\
sendfile,splice,copy_file_range,socket,socketpair,bind,listen,connect,accept,accept4,sendto,\
recvfrom,sendmsg,recvmsg,shutdown,setsockopt,getsockopt";

/// A Python program (run as `python3 /tmp/io.py`) that makes the calls no coreutils tool
/// makes: vectored and positional I/O, copies without a user buffer, fcntl and ioctl, and
/// Unix sockets (stream, datagram, listening).
const PY_IO: &str = r#"cat > /tmp/io.py <<'PYEOF'
import array, fcntl, os, socket, termios
d = "/tmp/pyio"
os.makedirs(d, exist_ok=True)
src = os.open(d + "/src", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o640)
os.writev(src, [b"a" * 5000, b"b" * 3192, b"c" * 100])
os.pwritev(src, [b"d" * 4096, b"e" * 10], 16384)
os.pwritev(src, [b"f" * 300], -1, os.RWF_APPEND)
os.lseek(src, 0, os.SEEK_SET)
os.readv(src, [bytearray(1000), bytearray(9000)])
os.preadv(src, [bytearray(4096)], 8192)
os.preadv(src, [bytearray(77)], -1, 0)
os.fstat(src)
fl = fcntl.fcntl(src, fcntl.F_GETFL)
fcntl.fcntl(src, fcntl.F_SETFL, fl | os.O_APPEND)
fcntl.fcntl(src, fcntl.F_SETFD, fcntl.FD_CLOEXEC)
os.close(fcntl.fcntl(src, fcntl.F_DUPFD_CLOEXEC, 20))
dst = os.open(d + "/dst", os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
os.copy_file_range(src, dst, 6000, 0, 0)
os.sendfile(dst, src, 100, 2000)
r, w = os.pipe()
os.splice(src, w, 3000, offset_src=50)
fcntl.ioctl(r, termios.FIONREAD, array.array("i", [0]))
os.splice(r, dst, 3000)
os.close(r)
os.close(w)
os.pread(dst, 100, 10)
os.pwrite(dst, b"x" * 10, 20)
try:
    os.open(d + "/missing", os.O_RDONLY)
except FileNotFoundError:
    pass
a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
a.sendmsg([b"hello", b"world"])
b.recvmsg(64)
a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
a.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
a.shutdown(socket.SHUT_WR)
x, y = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
x.send(b"dgram")
y.recvfrom(64)
srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
srv.bind(d + "/sock")
srv.listen(4)
cli = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
cli.connect(d + "/sock")
conn, _ = srv.accept()
cli.sendall(b"ping")
conn.recv(16)
for s in (a, b, x, y, srv, cli, conn):
    s.close()
os.close(src)
os.close(dst)
PYEOF
rm -rf /tmp/pyio"#;

struct Workload {
    name: &'static str,
    /// Runs before tracing starts (unmonitored), e.g. to create input files.
    prep: &'static str,
    /// Runs as `/tmp/wl -c SCRIPT`.
    script: &'static str,
    filter: &'static str,
}

const WORKLOADS: &[Workload] = &[
    Workload {
        name: "cp-20mb",
        prep: "dd if=/dev/urandom of=/tmp/src bs=1M count=20 status=none",
        script: "cp /tmp/src /tmp/dst && sha256sum /tmp/dst > /tmp/out.sha",
        filter: FILTER,
    },
    Workload {
        name: "tar-czf",
        prep: "true",
        script: "tar czf /tmp/doc.tgz /usr/share/doc",
        filter: FILTER,
    },
    Workload {
        name: "find",
        prep: "true",
        script: "find / -xdev -name x",
        filter: FILTER,
    },
    Workload {
        name: "gpg-symmetric",
        // The agent is started outside the traced tree: a daemon that outlives the workload
        // would keep `strace -f` waiting for it.
        prep: "head -c 2000000 /dev/urandom > /tmp/secret && mkdir -p -m 700 /root/.gnupg && gpgconf --launch gpg-agent",
        script: "gpg --batch --yes --pinentry-mode loopback --passphrase pw --symmetric -o /tmp/secret.gpg /tmp/secret",
        filter: FILTER,
    },
    Workload {
        name: "pipeline",
        prep: "true",
        script: "cat /usr/share/common-licenses/GPL-3 | grep -i license | wc -l > /tmp/count",
        filter: FILTER,
    },
    Workload {
        name: "threads4",
        prep: "true",
        script: "threads4 > /tmp/threads.out",
        filter: FILTER,
    },
    Workload {
        name: "sigrestart",
        prep: "true",
        script: "sigrestart > /tmp/sig.out",
        filter: FILTER,
    },
    Workload {
        name: "python-io",
        prep: PY_IO,
        script: "python3 /tmp/io.py",
        filter: FILTER,
    },
    Workload {
        name: "forktree",
        prep: "true",
        script: "forktree 0 3 > /tmp/tree.out",
        filter: FILTER,
    },
];

/// Boots a guest that runs every workload under strace while vmsight traces `wl`; returns,
/// per workload, (strace output, vmsight JSON lines of that workload).
fn run_all_under_both(vcpus: u32) -> Vec<(String, String)> {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("trace.json");
    let mut script = String::from("set -e; cp /bin/dash /tmp/wl\n");
    for w in WORKLOADS {
        script.push_str(&format!(
            "{prep}\necho '=== {name}' >&2\nstrace -f -qq -X raw -o /tmp/{name}.strace -e trace={filter} /tmp/wl -c '{s}'\n",
            prep = w.prep,
            name = w.name,
            filter = w.filter,
            s = w.script
        ));
    }
    for w in WORKLOADS {
        script.push_str(&format!(
            "echo '##### {n}'; cat /tmp/{n}.strace\n",
            n = w.name
        ));
    }
    let r = guest_sh(
        &[
            "--vcpus",
            &vcpus.to_string(),
            "--trace",
            "wl",
            "--trace-json",
            json.to_str().unwrap(),
            "--trace-filter",
            FILTER,
        ],
        &script,
    );
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let strace_parts: Vec<&str> = r.stdout.split("##### ").skip(1).collect();
    assert_eq!(strace_parts.len(), WORKLOADS.len(), "{}", r.stdout);
    let json_text = std::fs::read_to_string(&json).expect("trace json");
    // Each workload is one `wl` process tree; split vmsight's records by tree root.
    let per_root = split_by_root(&json_text);
    assert_eq!(
        per_root.len(),
        WORKLOADS.len(),
        "one traced process tree per workload: {:?}",
        per_root
            .iter()
            .map(|p| p.lines().count())
            .collect::<Vec<_>>()
    );
    strace_parts
        .iter()
        .zip(per_root)
        .map(|(s, j)| {
            let body = s.split_once('\n').map(|x| x.1).unwrap_or("");
            (body.to_string(), j)
        })
        .collect()
}

/// Groups JSON lines by process tree. Records are in completion order, so a child's calls can
/// precede its creator's return: parent links (creator returns, process records' ppid) are
/// collected first, then every thread is attached to the root of its chain.
fn split_by_root(json: &str) -> Vec<String> {
    use std::collections::HashMap;
    let values: Vec<serde_json::Value> = json
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let mut parent: HashMap<u64, u64> = HashMap::new();
    let mut traced: std::collections::HashSet<u64> = Default::default();
    for v in &values {
        let tid = v["tid"].as_u64().unwrap_or(0);
        traced.insert(tid);
        if v["type"] == "syscall"
            && matches!(
                v["name"].as_str(),
                Some("clone" | "clone3" | "fork" | "vfork")
            )
        {
            if let Some(c) = v["ret"].as_i64().filter(|r| *r > 0) {
                parent.insert(c as u64, tid);
            }
        }
    }
    for v in &values {
        if v["type"] == "process" {
            let (tid, ppid) = (
                v["tid"].as_u64().unwrap_or(0),
                v["ppid"].as_u64().unwrap_or(0),
            );
            if traced.contains(&ppid) && tid != ppid {
                parent.entry(tid).or_insert(ppid);
            }
        }
    }
    let root_of = |mut t: u64| {
        for _ in 0..1000 {
            match parent.get(&t) {
                Some(p) => t = *p,
                None => break,
            }
        }
        t
    };
    let mut order: Vec<u64> = Vec::new();
    let mut trees: HashMap<u64, String> = HashMap::new();
    for (line, v) in json.lines().filter(|l| !l.trim().is_empty()).zip(&values) {
        if v["type"] != "syscall" {
            continue;
        }
        let r = root_of(v["tid"].as_u64().unwrap_or(0));
        if !trees.contains_key(&r) {
            order.push(r);
        }
        let t = trees.entry(r).or_default();
        t.push_str(line);
        t.push('\n');
    }
    order.into_iter().filter_map(|r| trees.remove(&r)).collect()
}

fn check_all(vcpus: u32) {
    let mut failures = Vec::new();
    for (w, (strace, json)) in WORKLOADS.iter().zip(run_all_under_both(vcpus)) {
        let mut expected = parse_strace(&strace, Runs::Same);
        let got = parse_vmsight_json(&json, Runs::Same);
        // strace reports the execve of /tmp/wl that vmsight cannot: at that moment the
        // process is still strace's child named "strace", not yet `wl`.
        if let Some(main) = expected.get_mut("0") {
            if main.first().is_some_and(|c| c.name == "execve") {
                main.remove(0);
            }
        }
        let calls: usize = expected.values().map(Vec::len).sum();
        assert!(
            calls > 5,
            "{}: strace saw only {calls} calls:\n{strace}",
            w.name
        );
        let d = diff(&expected, &got);
        if !d.is_empty() {
            failures.push(format!(
                "{} ({} vCPUs):\n  {}",
                w.name,
                vcpus,
                d.join("\n  ")
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn trace_matches_strace_per_thread_on_one_vcpu() {
    check_all(1);
}

#[test]
fn trace_matches_strace_per_thread_on_two_vcpus() {
    check_all(2);
}

/// The issue's literal form: workloads run once under strace and once under vmsight, in
/// separate boots, and the per-thread sequences still agree. Only workloads whose sequences
/// do not depend on scheduling qualify (threads racing for the lowest free fd do not); the
/// value rt_sigreturn restores (e.g. a child PID) differs between boots and is masked.
#[test]
fn separate_runs_of_deterministic_workloads_agree_with_strace() {
    fn mask_sigreturn(t: &mut vmsight_tests::trace_compare::Threads) {
        for calls in t.values_mut() {
            for c in calls.iter_mut().filter(|c| c.name == "rt_sigreturn") {
                c.ret = "*".into();
            }
        }
    }
    for (name, script) in [
        ("forktree", "forktree 0 3 > /tmp/o"),
        ("sigrestart", "sigrestart > /tmp/o"),
        ("cp", "cp /usr/share/common-licenses/GPL-3 /tmp/o"),
        ("find", "find /usr/share/doc -name x"),
    ] {
        let strace = guest_sh(
            &[],
            &format!(
                "cp /bin/dash /tmp/wl && strace -f -qq -X raw -o /tmp/s -e trace={FILTER} /tmp/wl -c '{script}' && cat /tmp/s"
            ),
        );
        assert_eq!(strace.code, Some(0), "{name}: {}", strace.stderr);
        let dir = tempfile::tempdir().unwrap();
        let json = dir.path().join("t.json");
        let traced = guest_sh(
            &[
                "--trace",
                "wl",
                "--trace-json",
                json.to_str().unwrap(),
                "--trace-filter",
                FILTER,
                "--trace-out",
                "/dev/null",
            ],
            &format!("cp /bin/dash /tmp/wl && /tmp/wl -c '{script}'"),
        );
        assert_eq!(traced.code, Some(0), "{name}: {}", traced.stderr);
        let mut expected = parse_strace(&strace.stdout, Runs::Separate);
        if let Some(main) = expected.get_mut("0") {
            if main.first().is_some_and(|c| c.name == "execve") {
                main.remove(0);
            }
        }
        let mut got = parse_vmsight_json(&std::fs::read_to_string(&json).unwrap(), Runs::Separate);
        mask_sigreturn(&mut expected);
        mask_sigreturn(&mut got);
        let d = diff(&expected, &got);
        assert!(d.is_empty(), "{name}:\n  {}", d.join("\n  "));
    }
}

/// Interception observes; it never changes what the guest computes.
#[test]
fn workload_outputs_are_identical_with_and_without_interception() {
    let script = "cp /bin/dash /tmp/wl && /tmp/wl -c '\
        head -c 3000000 /usr/bin/python3* > /tmp/in && cp /tmp/in /tmp/copy && \
        tar cf /tmp/doc.tar -C /usr/share doc/coreutils doc/tar && gzip -n -c /tmp/doc.tar > /tmp/doc.tar.gz && \
        cat /usr/share/common-licenses/GPL-3 | grep -i license | sort > /tmp/tcp && threads4 > /tmp/thr && forktree 0 3 | sed s/pid.*// > /tmp/tree && \
        mkdir -p -m 700 /root/.gnupg && gpg --batch --pinentry-mode loopback --passphrase pw -c -o /tmp/in.gpg /tmp/in && \
        gpg --batch --pinentry-mode loopback --passphrase pw -d /tmp/in.gpg > /tmp/in.dec 2>/dev/null && \
        gpgconf --kill gpg-agent && \
        sha256sum /tmp/in /tmp/copy /tmp/doc.tar /tmp/doc.tar.gz /tmp/tcp /tmp/thr /tmp/tree /tmp/in.dec'";
    let plain = guest_sh(&["--no-plugin"], script);
    let traced = guest_sh(&["--trace", "wl", "--trace-out", "/dev/null"], script);
    assert_eq!(plain.code, Some(0), "{}", plain.stderr);
    assert_eq!(traced.code, Some(0), "{}", traced.stderr);
    assert_eq!(plain.stdout.lines().count(), 8, "{}", plain.stdout);
    assert_eq!(plain.stdout, traced.stdout);
}

/// PID, PPID, comm, exe and cwd that vmsight reads from guest kernel memory equal what the
/// guest's own /proc says.
#[test]
fn process_details_match_the_guests_proc() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("p.json");
    // The probe is a long-lived process (so vmsight reads it while it lives) that reports its
    // own /proc view on stdout.
    let r = guest_sh(
        &["--trace", "probe", "--trace-json", json.to_str().unwrap(), "--trace-out", "/dev/null"],
        "cp /bin/dash /tmp/probe && cd /usr/share/doc && /tmp/probe -c '\
            echo $$ $PPID $(cat /proc/$$/comm) $(readlink /proc/$$/exe) $(readlink /proc/$$/cwd); sleep 2; :'",
    );
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let fields: Vec<&str> = r.stdout.split_whitespace().collect();
    assert_eq!(fields.len(), 5, "{}", r.stdout);
    let text = std::fs::read_to_string(&json).unwrap();
    let pid: u64 = fields[0].parse().unwrap();
    let rec = text
        .lines()
        .rev()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["type"] == "process" && v["pid"].as_u64() == Some(pid))
        .unwrap_or_else(|| panic!("no process record for pid {}: {text}", fields[0]));
    assert_eq!(rec["ppid"].to_string(), fields[1], "{rec}");
    assert_eq!(rec["comm"], fields[2], "{rec}");
    assert_eq!(rec["exe"], fields[3], "{rec}");
    assert_eq!(rec["cwd"], fields[4], "{rec}");
}

/// Selective monitoring: a busy unmonitored process next to a monitored one causes no syscall
/// callbacks (beyond the one that classifies its address space after each switch).
#[test]
fn unmonitored_processes_cause_no_syscall_callbacks() {
    let dir = tempfile::tempdir().unwrap();
    let stats = dir.path().join("s.json");
    let r = guest_sh(
        &[
            "--vcpus",
            "2",
            "--trace",
            "getppid_loop",
            "--trace-out",
            "/dev/null",
            "--stats-json",
            stats.to_str().unwrap(),
        ],
        "cp /usr/local/bin/getppid_loop /tmp/busy && /tmp/busy 1000000 & getppid_loop 20000; wait",
    );
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
    let (syscalls, callbacks) = (vcpu_sum(&v, "syscalls"), vcpu_sum(&v, "callbacks"));
    assert!(syscalls >= 1_020_000, "both loops ran: {syscalls}");
    assert!(
        callbacks >= 20_000,
        "the monitored loop was intercepted: {callbacks}"
    );
    assert!(
        callbacks < 25_000,
        "the unmonitored loop's million syscalls must not call back: {callbacks} callbacks"
    );
    // The trace thread may fall behind on a loaded host and the plugin then drops records
    // (counted per vCPU): each dropped entry or return loses at most one completed call.
    let completed = v["trace"]["tracker"]["completed"].as_u64().unwrap_or(0);
    let dropped = vcpu_sum(&v, "dropped");
    assert!(
        completed + dropped >= 20_000,
        "every monitored call completed or was counted as dropped: {completed} completed, \
         {dropped} dropped: {v}"
    );
}

/// A guest run of `script` with `--trace COMM`, and what vmsight wrote about it.
struct Traced {
    run: Run,
    /// The `--trace-json` records.
    records: Vec<serde_json::Value>,
    /// The `--stats-json` document.
    stats: serde_json::Value,
}

impl Traced {
    fn run(comm: &str, script: &str) -> Traced {
        let dir = tempfile::tempdir().unwrap();
        let (json, stats) = (dir.path().join("t.json"), dir.path().join("s.json"));
        let run = guest_sh(
            &[
                "--trace",
                comm,
                "--trace-json",
                json.to_str().unwrap(),
                "--trace-out",
                "/dev/null",
                "--stats-json",
                stats.to_str().unwrap(),
            ],
            script,
        );
        assert_eq!(run.code, Some(0), "{}", run.stderr);
        let records = std::fs::read_to_string(&json)
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        let stats = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
        Traced {
            run,
            records,
            stats,
        }
    }

    /// The records of one type (`syscall`, `process`) of process `pid`.
    fn of(&self, kind: &str, pid: i64) -> impl Iterator<Item = &serde_json::Value> + '_ {
        let kind = kind.to_string();
        self.records
            .iter()
            .filter(move |v| v["type"] == kind.as_str() && v["pid"].as_i64() == Some(pid))
    }
}

/// A plugin counter summed over the vCPUs of a `--stats-json` document.
fn vcpu_sum(stats: &serde_json::Value, key: &str) -> u64 {
    stats["vcpus"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c[key].as_u64().unwrap_or(0))
        .sum()
}

/// A monitored process killed by a signal never calls `exit_group`, so the plugin never sees
/// it leave. When its PID comes back on an unrelated process (forced here with the guest's
/// `ns_last_pid`), that process is not traced: the plugin tells the two apart by their
/// `signal_struct` and drops the stale entry.
#[test]
fn a_killed_monitored_process_does_not_make_its_pid_successor_monitored() {
    // The victim (comm `victim`) is a child of the monitored `wl`; the successor is started
    // by the unmonitored top shell, under the same comm (so no cached verdict could help).
    let t = Traced::run(
        "wl",
        "set -e; cp /bin/dash /tmp/wl; cp /bin/cat /tmp/victim
/tmp/wl -c '/tmp/victim /dev/zero > /dev/null & echo $! > /tmp/pid; wait' &
while [ ! -s /tmp/pid ]; do sleep 0.1; done
P=$(cat /tmp/pid); sleep 1; kill -9 $P; wait || true
echo $((P - 1)) > /proc/sys/kernel/ns_last_pid
sh -c 'echo $$ > /tmp/succ; exec /tmp/victim /etc/hostname' > /dev/null
echo victim $P successor $(cat /tmp/succ)",
    );
    let line = t
        .run
        .stdout
        .lines()
        .find(|l| l.starts_with("victim "))
        .unwrap();
    let w: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(w[1], w[3], "the guest did not reuse the PID: {line}");
    let pid: i64 = w[1].parse().unwrap();
    let reads = t.of("syscall", pid).filter(|v| v["name"] == "read").count();
    assert!(reads > 0, "the victim's reads of /dev/zero were traced");
    let successor: Vec<_> = t
        .of("syscall", pid)
        .filter(|v| {
            v["decoded"].as_array().is_some_and(|a| {
                a.iter()
                    .any(|x| matches!(x.as_str(), Some("\"/etc/hostname\"" | "\"/tmp/succ\"")))
            })
        })
        .collect();
    assert!(
        successor.is_empty(),
        "the successor was traced: {successor:?}"
    );
    let stale = vcpu_sum(&t.stats, "stale_tgids");
    assert!(
        stale >= 1,
        "the stale entry was dropped: {}",
        t.stats["vcpus"]
    );
}

/// A 64-bit program making 32-bit system calls (`int 0x80`): they are not traced (vmsight
/// follows the x86-64 `syscall` ABI), but every one is counted, so the blind spot shows.
/// The guest program checks that each call returned its PID (the kernel served them).
#[test]
fn int_0x80_calls_are_counted_as_compat_syscalls() {
    let t = Traced::run("int80", "int80 1000");
    assert!(t.run.stdout.contains("int80 1000 "), "{}", t.run.stdout);
    let compat = vcpu_sum(&t.stats, "compat_syscalls");
    assert_eq!(compat, 1000, "{}", t.stats["vcpus"]);
    // The program's 64-bit calls are traced as usual (its write of the result line).
    assert!(
        t.records
            .iter()
            .any(|v| v["type"] == "syscall" && v["name"] == "write"),
        "{:?}",
        t.records
    );
}

/// Processes that live a few milliseconds (a dash that exits at once; one that changes
/// directory and execs `true`) still get their exe, cwd and parent: the plugin reads them in
/// the guest at the process's first syscall and at a successful chdir and execve, while the
/// task surely lives. The oracle is the guest's own record: each process writes its PID, and
/// the shell knows what it ran, where, and its own PID (every probe's parent).
#[test]
fn short_lived_processes_get_exe_cwd_and_parent_at_each_change() {
    let t = Traced::run(
        "probe",
        "set -e; echo shell $$; cp /bin/dash /tmp/probe; cp /bin/true /tmp/probe2; cd /usr/share/doc
for i in $(seq 20); do /tmp/probe -c 'echo $$ >> /tmp/quick'; done
for i in $(seq 10); do /tmp/probe -c 'echo $$ >> /tmp/execs; cd /tmp; exec /tmp/probe2'; done
echo quick $(cat /tmp/quick); echo execs $(cat /tmp/execs)",
    );
    let pids = |tag: &str| -> Vec<i64> {
        let line = t.run.stdout.lines().find(|l| l.starts_with(tag)).unwrap();
        line.split_whitespace()
            .skip(1)
            .map(|p| p.parse().unwrap())
            .collect()
    };
    let (quick, execs) = (pids("quick "), pids("execs "));
    assert_eq!((quick.len(), execs.len()), (20, 10), "{}", t.run.stdout);
    let shell = pids("shell ")[0];
    for &pid in quick.iter().chain(&execs) {
        let parents: Vec<i64> = t
            .of("process", pid)
            .map(|v| v["ppid"].as_i64().unwrap_or(-1))
            .collect();
        assert!(
            !parents.is_empty() && parents.iter().all(|&p| p == shell),
            "pid {pid}: parents {parents:?}, the shell is {shell}"
        );
    }
    let of = |pid: i64| -> Vec<String> {
        t.of("process", pid)
            .map(|v| format!("{} {} {}", v["comm"], v["exe"], v["cwd"]))
            .collect()
    };
    let probe = r#""probe" "/tmp/probe""#;
    for pid in quick {
        assert_eq!(
            of(pid),
            [format!(r#"{probe} "/usr/share/doc""#)],
            "pid {pid}"
        );
    }
    for pid in execs {
        assert_eq!(
            of(pid),
            [
                format!(r#"{probe} "/usr/share/doc""#),
                format!(r#"{probe} "/tmp""#),
                r#""probe2" "/tmp/probe2" "/tmp""#.to_string(),
            ],
            "pid {pid}: first syscall, chdir, execve"
        );
    }
}
