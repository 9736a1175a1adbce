//! `vmsight mount` end to end: an ext4 image made on the host with `mkfs.ext4 -d SRC`, crawled
//! and served by a real ViewServer under a fake runtime directory, mounted with the real
//! `vmsight mount` binary, and compared with SRC by `find`, sha256 and `grep -r`.
//!
//! Needs root (for owners in SRC and FUSE), e2fsprogs, fuse3 (`fusermount3`, /dev/fuse).

#![allow(clippy::unwrap_used)] // helpers outside #[test] functions unwrap too

use std::fs;
use std::io::Write;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use vmsight_fsview::{FileSource, Index, StaticView};
use vmsight_view::{ViewServer, VIEW_SOCKET};

fn run(cmd: &mut Command) -> String {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?} (is it installed?): {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn is_mounted(dir: &Path) -> bool {
    let mounts = fs::read_to_string("/proc/mounts").unwrap();
    let d = dir.to_str().unwrap();
    mounts.lines().any(|l| l.split(' ').nth(1) == Some(d))
}

/// Stops `vmsight mount` (SIGTERM, then a forced lazy unmount) whatever happens in the test.
struct MountGuard {
    child: Option<Child>,
    dir: PathBuf,
}

impl MountGuard {
    fn stop(&mut self) -> Option<std::process::ExitStatus> {
        let mut child = self.child.take()?;
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        // Bounded wait for a clean exit; no timing is asserted.
        for _ in 0..100 {
            if let Ok(Some(st)) = child.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = child.kill();
        let _ = child.wait();
        None
    }
}

impl Drop for MountGuard {
    fn drop(&mut self) {
        self.stop();
        if is_mounted(&self.dir) {
            let _ = Command::new("fusermount3")
                .arg("-uz")
                .arg(&self.dir)
                .status();
        }
    }
}

fn build_tree(src: &Path) {
    let w = |p: &str, data: &[u8]| {
        let path = src.join(p);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(path, data).unwrap();
    };
    w("empty", b"");
    w(
        "var/log/auth.log",
        b"Nov 22 sshd[1]: Accepted publickey\nNov 22 sshd[2]: Failed password for root\n",
    );
    w("var/log/syslog", b"nothing to see\n");
    w("etc/passwd", b"root:x:0:0:root:/root:/bin/bash\n");
    let big: Vec<u8> = (0..3_000_000u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    w("usr/lib/big.bin", &big);
    w("usr/lib/small.bin", &big[..70_001]);
    w("home/u/.secret", b"Failed password is also here\n");
    // Sparse: 10 MiB with data only at 5 MiB and at the end.
    let mut f = fs::File::create(src.join("sparse")).unwrap();
    f.set_len(10 << 20).unwrap();
    use std::io::{Seek, SeekFrom};
    f.seek(SeekFrom::Start(5 << 20)).unwrap();
    f.write_all(b"in the middle").unwrap();
    f.seek(SeekFrom::Start((10 << 20) - 4)).unwrap();
    f.write_all(b"tail").unwrap();
    drop(f);
    fs::hard_link(src.join("etc/passwd"), src.join("etc/passwd.hardlink")).unwrap();
    symlink("passwd", src.join("etc/fast-link")).unwrap();
    let long = format!("/{}/target", "long-directory-name".repeat(5));
    symlink(&long, src.join("etc/slow-link")).unwrap();
    symlink("../var/log", src.join("etc/logs")).unwrap();
    fs::create_dir_all(src.join("emptydir")).unwrap();
    fs::create_dir_all(src.join("private/inner")).unwrap();
    for i in 0..300 {
        w(&format!("many/file-{i:04}"), format!("{i}\n").as_bytes());
    }
    let mode = |p: &str, m: u32| {
        fs::set_permissions(src.join(p), fs::Permissions::from_mode(m)).unwrap();
    };
    mode("etc/passwd", 0o644);
    mode("home/u/.secret", 0o600);
    mode("usr/lib/small.bin", 0o4755);
    mode("var/log/syslog", 0o640);
    mode("private", 0o700);
    mode("empty", 0o444);
    run(Command::new("chown")
        .args(["-R", "1000:1000"])
        .arg(src.join("home")));
    run(Command::new("chown")
        .args(["-h", "1234:5678"])
        .arg(src.join("etc/slow-link")));
    run(Command::new("chown")
        .arg("0:4")
        .arg(src.join("var/log/syslog")));
    run(Command::new("chown")
        .arg("70000:70001")
        .arg(src.join("private")));
    // The index keeps whole seconds (no nanoseconds): give every entry a whole-second mtime.
    run(Command::new("find").arg(src).args([
        "-mindepth",
        "1",
        "-exec",
        "touch",
        "-h",
        "-d",
        "@1700000123",
        "{}",
        "+",
    ]));
}

/// `find` listing: `%P %s %m %U %G %T@ %y %l`, plus the link count `%n` of non-directories,
/// without the size of directories (ext4 and the host file system size directories
/// differently), sorted.
fn listing(root: &Path) -> Vec<String> {
    let mut lines: Vec<String> = run(Command::new("find").arg(root).args([
        "-mindepth",
        "1",
        "(",
        "-name",
        "lost+found",
        "-prune",
        ")",
        "-o",
        "(",
        "-type",
        "d",
        "-printf",
        "%P - %m %U %G %T@ %y %l\\n",
        ")",
        "-o",
        "-printf",
        "%P %s %m %U %G %T@ %y %l %n\\n",
    ]))
    .lines()
    .map(str::to_string)
    .collect();
    lines.sort();
    lines
}

fn sha(path: &Path) -> String {
    let mut h = Sha256::new();
    h.update(fs::read(path).unwrap());
    format!("{:x}", h.finalize())
}

#[test]
fn mount_shows_a_crawled_image_like_its_source() {
    assert!(
        Path::new("/dev/fuse").exists(),
        "/dev/fuse is missing: install fuse3 (scripts/setup-host.sh)"
    );
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    fs::create_dir(&src).unwrap();
    build_tree(&src);
    let img = t.path().join("disk.img");
    run(Command::new("mkfs.ext4")
        .args(["-F", "-q", "-d"])
        .arg(&src)
        .arg(&img)
        .arg("64M"));

    // The VM side: a crawl of the image behind a view server in a fake runtime directory.
    let disk = FileSource::open(&img).unwrap();
    let index = Index::crawl(&disk, None).unwrap();
    let runtime = t.path().join("run");
    let vmdir = runtime.join("v");
    fs::create_dir_all(&vmdir).unwrap();
    let rec = format!(r#"{{"name":"v","pid":{}}}"#, std::process::id());
    fs::write(vmdir.join("vm.json"), rec).unwrap();
    let _server = ViewServer::bind(
        vmdir.join(VIEW_SOCKET),
        StaticView::new(index, Arc::new(disk)),
    )
    .unwrap();

    let mnt = t.path().join("mnt");
    fs::create_dir(&mnt).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_vmsight"))
        .arg("mount")
        .arg(&mnt)
        .args(["--host", "h"])
        .env("VMSIGHT_RUNTIME", &runtime)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut guard = MountGuard {
        child: Some(child),
        dir: mnt.clone(),
    };
    let root = mnt.join("h/v");
    for _ in 0..300 {
        if root.join("etc").is_dir() {
            break;
        }
        if let Some(Ok(Some(st))) = guard.child.as_mut().map(Child::try_wait) {
            panic!("vmsight mount exited early: {st}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(root.join("etc").is_dir(), "the view never appeared");

    // Layout: one host, one VM.
    assert_eq!(names(&mnt), ["h"]);
    assert_eq!(names(&mnt.join("h")), ["v"]);

    // Metadata and names: find over the view equals find over the source.
    let want = listing(&src);
    let got = listing(&root);
    assert!(want.len() > 300, "{}", want.len());
    let diff: Vec<_> = want
        .iter()
        .zip(&got)
        .filter(|(a, b)| a != b)
        .take(10)
        .collect();
    assert!(
        want == got,
        "find differs ({} vs {} lines), first differences: {diff:#?}",
        want.len(),
        got.len()
    );

    // Contents: sha256 of every regular file.
    let files = run(Command::new("find")
        .arg(&src)
        .args(["-type", "f", "-printf", "%P\\n"]));
    let mut checked = 0;
    for rel in files.lines() {
        assert_eq!(sha(&src.join(rel)), sha(&root.join(rel)), "{rel}");
        checked += 1;
    }
    assert!(checked > 300);
    use std::os::unix::fs::MetadataExt;
    let ino = |p: &str| fs::metadata(root.join(p)).unwrap().ino();
    assert_eq!(
        ino("etc/passwd"),
        ino("etc/passwd.hardlink"),
        "hard links share an inode"
    );
    assert_ne!(ino("etc/passwd"), ino("var/log/syslog"));
    assert_eq!(
        fs::read_link(root.join("etc/fast-link")).unwrap(),
        Path::new("passwd")
    );
    assert_eq!(
        fs::read_to_string(root.join("etc/logs/syslog")).unwrap(),
        "nothing to see\n",
        "relative symlinks resolve inside the view"
    );

    // Legacy tools: grep -r.
    let out = Command::new("grep")
        .args(["-r", "Failed password"])
        .arg(&root)
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let mut hits: Vec<&str> = text
        .lines()
        .map(|l| l.strip_prefix(root.to_str().unwrap()).unwrap())
        .collect();
    hits.sort();
    assert_eq!(
        hits,
        [
            "/home/u/.secret:Failed password is also here",
            "/var/log/auth.log:Nov 22 sshd[2]: Failed password for root",
        ]
    );

    // Read-only.
    let e = fs::OpenOptions::new()
        .write(true)
        .open(root.join("etc/passwd"))
        .unwrap_err();
    assert_eq!(e.raw_os_error(), Some(30), "EROFS: {e}");
    let e = fs::File::create(root.join("new-file")).unwrap_err();
    assert_eq!(e.raw_os_error(), Some(30), "EROFS: {e}");
    assert!(fs::remove_file(root.join("etc/passwd")).is_err());

    // Clean unmount on SIGTERM.
    let st = guard.stop().expect("vmsight mount did not exit on SIGTERM");
    assert!(st.success(), "{st}");
    assert!(!is_mounted(&mnt), "still mounted after exit");
}

/// Registers a fake VM `name` under `runtime` served from `fs`.
fn fake_vm(runtime: &Path, name: &str, fs: Arc<dyn vmsight_fsview::FsRead>) -> ViewServer {
    let dir = runtime.join(name);
    fs::create_dir_all(&dir).unwrap();
    let rec = format!(r#"{{"name":"{name}","pid":{}}}"#, std::process::id());
    fs::write(dir.join("vm.json"), rec).unwrap();
    ViewServer::bind(dir.join(VIEW_SOCKET), fs).unwrap()
}

fn names(p: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(p)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

#[test]
fn vms_come_and_go_and_an_external_unmount_ends_the_mount() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    fs::create_dir_all(src.join("etc")).unwrap();
    fs::write(src.join("etc/hostname"), "guest\n").unwrap();
    let img = t.path().join("disk.img");
    run(Command::new("mkfs.ext4")
        .args(["-F", "-q", "-d"])
        .arg(&src)
        .arg(&img)
        .arg("16M"));
    let disk = FileSource::open(&img).unwrap();
    let index = Index::crawl(&disk, None).unwrap();
    let view: Arc<dyn vmsight_fsview::FsRead> = Arc::new(StaticView::new(index, Arc::new(disk)));
    let runtime = t.path().join("run");
    let _a = fake_vm(&runtime, "a", Arc::clone(&view));

    let mnt = t.path().join("mnt");
    fs::create_dir(&mnt).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_vmsight"))
        .arg("mount")
        .arg(&mnt)
        .args(["--host", "h"])
        .env("VMSIGHT_RUNTIME", &runtime)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let mut guard = MountGuard {
        child: Some(child),
        dir: mnt.clone(),
    };
    for _ in 0..300 {
        if mnt.join("h/a/etc").is_dir() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(names(&mnt.join("h")), ["a"]);

    // A VM that starts later shows up at the next listing (and by name right away).
    let b = fake_vm(&runtime, "b", Arc::clone(&view));
    assert_eq!(
        fs::read_to_string(mnt.join("h/b/etc/hostname")).unwrap(),
        "guest\n"
    );
    assert_eq!(names(&mnt.join("h")), ["a", "b"]);
    // A VM that ended disappears.
    drop(b);
    fs::remove_dir_all(runtime.join("b")).unwrap();
    assert_eq!(names(&mnt.join("h")), ["a"]);

    // `fusermount3 -u` from outside ends `vmsight mount` cleanly.
    run(Command::new("fusermount3").arg("-u").arg(&mnt));
    let mut child = guard.child.take().unwrap();
    let mut status = None;
    for _ in 0..100 {
        if let Some(st) = child.try_wait().unwrap() {
            status = Some(st);
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = child.kill();
    let st = status.expect("vmsight mount did not exit after fusermount3 -u");
    assert!(st.success(), "{st}");
    assert!(!is_mounted(&mnt));
}
