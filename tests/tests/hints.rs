//! The guest side of application hints (issue 4, Sky §3.6), checked independently of the
//! classifier: vmsight's own syscall trace (`--trace-json`, raw argument registers) must show
//! the magic number and the class exactly on the calls libvmsight and the LD_PRELOAD shim were
//! asked to tag, and never on the others. Also checks the image's tools for the accuracy and
//! file-streaming checks (XFS/btrfs modules and mkfs, inotifywait, sqlite3, varmail).
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use serde_json::Value;
use vmsight_tests::*;

/// `VMSIGHT_HINT_MAGIC` of guest/lib/vmsight.h and docs/insights.md ("vmsight1").
const MAGIC: u64 = 0x766d_7369_6768_7431;
const PRELOAD: &str = "LD_PRELOAD=/usr/local/lib/libvmsight-preload.so";

#[derive(Debug, Clone)]
struct Call {
    pid: u64,
    comm: String,
    name: String,
    args: Vec<u64>,
}

impl Call {
    /// The class this call carries under the register convention, if it carries the magic.
    fn hint(&self) -> Option<u64> {
        let (m, c) = match self.name.as_str() {
            "read" | "write" => (3, 4),
            "pread64" | "pwrite64" => (4, 5),
            _ => return None,
        };
        (self.args.get(m) == Some(&MAGIC)).then(|| self.args[c])
    }
    fn fd(&self) -> u64 {
        self.args[0]
    }
    fn len(&self) -> u64 {
        self.args[2]
    }
}

fn parse(json: &str) -> Vec<Call> {
    json.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["type"] == "syscall")
        .map(|v| Call {
            pid: v["pid"].as_u64().unwrap(),
            comm: v["comm"].as_str().unwrap_or("").to_string(),
            name: v["name"].as_str().unwrap().to_string(),
            args: v["args"]
                .as_array()
                .unwrap()
                .iter()
                .map(|a| a.as_u64().unwrap())
                .collect(),
        })
        .collect()
}

/// The processes named `comm`, in order of their first traced call.
fn processes(calls: &[Call], comm: &str) -> Vec<u64> {
    let mut pids = Vec::new();
    for c in calls.iter().filter(|c| c.comm == comm) {
        if !pids.contains(&c.pid) {
            pids.push(c.pid);
        }
    }
    pids
}

fn calls_of<'a>(calls: &'a [Call], pid: u64, name: &str, fd: u64) -> Vec<&'a Call> {
    calls
        .iter()
        .filter(|c| c.pid == pid && c.name == name && c.fd() == fd)
        .collect()
}

/// Every call in `cs` (at least `min`) carries `want` (a class, or no hint for `None`).
fn assert_all(cs: &[&Call], want: Option<u64>, min: usize, what: &str) {
    assert!(
        cs.len() >= min,
        "{what}: {} calls, expected ≥ {min}: {cs:?}",
        cs.len()
    );
    for c in cs {
        assert_eq!(c.hint(), want, "{what}: {c:?}");
    }
}

#[test]
fn libvmsight_and_preload_shim_tag_exactly_the_requested_calls() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("trace.json");
    let script = format!(
        "set -e
mkdir -p /tmp/hinted /tmp/plain
head -c 40000 /dev/urandom > /tmp/hinted/src
# libvmsight, linked dynamically: each mode with its own class and chunk size.
hintwrite write /tmp/plain/w 3 30000 12345
hintwrite pwrite /tmp/plain/pw 7 30000 23456
hintwrite read /tmp/plain/w 4 30000 13579
hintwrite pread /tmp/plain/pw 9 30000 24680
hintwrite write /tmp/plain/bad 300 5000 5000
# The shim: dd reads fd 0 and writes fd 1 (it reopens if= and of= there).
export VMSIGHT_HINTS='/tmp/nomatch/*=1;/tmp/hinted/*=6'
{PRELOAD} dd if=/tmp/hinted/src of=/tmp/plain/dd1 bs=5555 status=none
{PRELOAD} dd if=/tmp/plain/dd1 of=/tmp/hinted/dd2 bs=6666 status=none
cd /tmp/hinted && {PRELOAD} dd if=/tmp/plain/dd1 of=rel bs=7777 status=none && cd /
{PRELOAD} sh -c 'printf %s 0123456789abc > /tmp/hinted/redir; printf %s 0123456789abcdef > /tmp/plain/redir'
# Hints never change the data.
cmp /tmp/hinted/src /tmp/plain/dd1
cmp /tmp/hinted/src /tmp/hinted/dd2
cmp /tmp/hinted/src /tmp/hinted/rel
test \"$(cat /tmp/hinted/redir)\" = 0123456789abc
test $(stat -c %s /tmp/plain/w) = 30000
test $(stat -c %s /tmp/plain/bad) = 5000
echo done"
    );
    let r = guest_sh(
        &[
            "--trace",
            "@cmd",
            "--trace-out",
            "/dev/null",
            "--trace-json",
            json.to_str().unwrap(),
            "--trace-filter",
            "read,write,pread64,pwrite64",
        ],
        &script,
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(r.stdout.contains("done"), "{r:?}");
    let calls = parse(&std::fs::read_to_string(&json).unwrap());

    // libvmsight: the file is fd 3 in every hintwrite.
    let hw = processes(&calls, "hintwrite");
    assert_eq!(hw.len(), 5, "five hintwrite processes traced: {hw:?}");
    assert_all(
        &calls_of(&calls, hw[0], "write", 3),
        Some(3),
        3,
        "vmsight_write",
    );
    assert_all(
        &calls_of(&calls, hw[1], "pwrite64", 3),
        Some(7),
        2,
        "vmsight_pwrite",
    );
    let reads: Vec<&Call> = calls_of(&calls, hw[2], "read", 3)
        .into_iter()
        .filter(|c| c.len() == 13579)
        .collect();
    assert_all(&reads, Some(4), 3, "vmsight_read");
    // The dynamic loader also reads fd 3 (the libraries) before main: select by chunk size.
    let preads: Vec<&Call> = calls_of(&calls, hw[3], "pread64", 3)
        .into_iter()
        .filter(|c| c.len() == 24680)
        .collect();
    assert_all(&preads, Some(9), 2, "vmsight_pread");
    // Class 300 is out of range: written, but without a hint.
    assert_all(
        &calls_of(&calls, hw[4], "write", 3),
        None,
        1,
        "class out of range",
    );

    // The shim.
    let dd = processes(&calls, "dd");
    assert_eq!(dd.len(), 3, "three dd processes traced: {dd:?}");
    assert_all(
        &calls_of(&calls, dd[0], "read", 0),
        Some(6),
        8,
        "dd1 reads hinted file",
    );
    assert_all(
        &calls_of(&calls, dd[0], "write", 1),
        None,
        8,
        "dd1 writes plain file",
    );
    assert_all(
        &calls_of(&calls, dd[1], "read", 0),
        None,
        7,
        "dd2 reads plain file",
    );
    assert_all(
        &calls_of(&calls, dd[1], "write", 1),
        Some(6),
        7,
        "dd2 writes hinted file",
    );
    assert_all(
        &calls_of(&calls, dd[2], "write", 1),
        Some(6),
        6,
        "relative path via getcwd",
    );
    // dash: redirection (open + dup2 onto fd 1) then the builtin printf writes fd 1.
    let redirected: Vec<&Call> = calls
        .iter()
        .filter(|c| c.name == "write" && c.fd() == 1 && c.comm == "sh")
        .collect();
    let hinted: Vec<&&Call> = redirected.iter().filter(|c| c.len() == 13).collect();
    let plain: Vec<&&Call> = redirected.iter().filter(|c| c.len() == 16).collect();
    assert_eq!((hinted.len(), plain.len()), (1, 1), "{redirected:?}");
    assert_eq!(hinted[0].hint(), Some(6), "{:?}", hinted[0]);
    assert_eq!(plain[0].hint(), None, "{:?}", plain[0]);

    // Nothing else in the whole trace carries the magic: no stale registers after a hinted
    // call (libvmsight clears r8-r10), no hint on unmatched fds.
    let expected_hinted = |c: &Call| {
        (hw[..4].contains(&c.pid) && c.fd() == 3)
            || (c.pid == dd[0] && c.name == "read" && c.fd() == 0)
            || ((c.pid == dd[1] || c.pid == dd[2]) && c.name == "write" && c.fd() == 1)
            || (c.comm == "sh" && c.fd() == 1 && c.len() == 13)
    };
    for c in &calls {
        if c.hint().is_some() {
            assert!(expected_hinted(c), "unexpected hint: {c:?}");
        }
    }
}

#[test]
fn image_has_the_workload_and_file_system_tools() {
    // Two extra disks to make XFS and btrfs on inside the guest (xfsprogs needs ≥ 300 MiB).
    let dir = tempfile::tempdir().unwrap();
    let (x, b) = (dir.path().join("xfs.img"), dir.path().join("btrfs.img"));
    for p in [&x, &b] {
        std::fs::File::create(p)
            .unwrap()
            .set_len(512 << 20)
            .unwrap();
    }
    let (dx, db) = (x.display().to_string(), b.display().to_string());
    let r = guest_sh(
        &["--disk", &dx, "--disk", &db],
        "set -e
modprobe xfs; modprobe btrfs
grep -qw xfs /proc/filesystems; grep -qw btrfs /proc/filesystems
mkfs.xfs -q /dev/vdb > /dev/null; mkfs.btrfs -q /dev/vdc > /dev/null
mkdir -p /mnt/x /mnt/b; mount /dev/vdb /mnt/x; mount /dev/vdc /mnt/b
varmail -d /mnt/x/vm -n 20 -o 200 -j > /tmp/x.json
varmail -d /mnt/b/vm -n 20 -o 200 > /tmp/b.txt
ls /mnt/x/vm | wc -l; grep -c . /tmp/b.txt
umount /mnt/x /mnt/b
for t in inotifywait sqlite3 mkfs.ext2 hintwrite; do command -v $t > /dev/null; done
cat /tmp/x.json; grep ^data_chunks /tmp/b.txt",
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    let mut lines = r.stdout.lines();
    assert_eq!(lines.next(), Some("16"), "80% of 20 slots exist: {r:?}");
    assert_eq!(lines.next(), Some("3"), "text summary has 3 lines: {r:?}");
    let v: Value = serde_json::from_str(lines.next().unwrap()).unwrap();
    assert!(v["ops"].as_u64().unwrap() >= 200, "{v}");
    assert_eq!(v["created"], v["deleted"], "{v}");
    // Every append and every initial file writes at least one chunk.
    let appends = v["appends"].as_u64().unwrap();
    assert!(v["data_chunks"].as_u64().unwrap() >= appends + 16, "{v}");
    assert!(lines.next().unwrap().starts_with("data_chunks "), "{r:?}");
}
