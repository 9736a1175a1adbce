//! The per-VM runtime directory (sockets, shared memory, state) and its cleanup.
//!
//! Every running VM owns `<runtime>/<name>/`, which is also how other vmsight commands find
//! running VMs (`vm.json`). The directory and everything in it is removed when the VM ends,
//! whatever the reason, by the [`RuntimeDir`] guard.

use std::fs;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use vmsight_proto::layout::{RuntimeLayout, VmPaths, VM_RECORD};

use crate::error::LaunchError;

/// The base directory and `vm.json` are defined with the rest of the runtime layout in
/// [`vmsight_proto::layout`], which every command that looks for VMs shares.
pub use vmsight_proto::layout::{runtime_base, VmRecord};

/// Owns a VM's runtime directory; removes it on drop.
#[derive(Debug)]
pub struct RuntimeDir {
    dir: PathBuf,
}

impl RuntimeDir {
    /// Creates `<base>/<name>`, refusing if a live VM already uses the name.
    pub fn create(base: &Path, name: &str) -> Result<RuntimeDir, LaunchError> {
        let dir = base.join(name);
        let err = |source: io::Error| LaunchError::RuntimeDir {
            path: dir.clone(),
            source,
        };
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(base)
            .map_err(err)?;
        check_base(base).map_err(|source| LaunchError::RuntimeDir {
            path: base.to_path_buf(),
            source,
        })?;
        prune_stale(base);
        if dir.exists() {
            match VmPaths::new(&dir).read_record() {
                Some(r) if r.owner_alive() && r.pid != std::process::id() => {
                    return Err(LaunchError::NameInUse(name.to_string(), dir));
                }
                _ => {
                    tracing::info!("removing stale runtime directory {}", dir.display());
                    detach_mounts_under(&dir);
                    fs::remove_dir_all(&dir).map_err(err)?;
                }
            }
        }
        // The VM's owner's only (sockets, the guest's command line and console): 0700 whatever
        // the umask, set again after creation since the umask may have taken bits away.
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&dir)
            .map_err(err)?;
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o700)).map_err(err)?;
        Ok(RuntimeDir { dir })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Path of `name` in the directory (names: [`vmsight_proto::layout`]).
    pub fn join(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The well-known files of the directory.
    pub fn paths(&self) -> VmPaths {
        VmPaths::new(&self.dir)
    }

    /// Writes `vm.json` atomically.
    pub fn write_record(&self, rec: &VmRecord) -> Result<(), LaunchError> {
        let tmp = self.join(&format!("{VM_RECORD}.tmp"));
        let data = serde_json::to_vec_pretty(rec).map_err(io::Error::other)?;
        write_private(&tmp, data)?;
        fs::rename(&tmp, self.paths().record())?;
        Ok(())
    }
}

/// Refuses a runtime base another user could change: it must belong to this user or root and
/// be writable by nobody else (another user owning `/tmp/vmsight-UID` first could swap a VM's
/// directory for one of its own, with its own sockets, under every vmsight command).
fn check_base(base: &Path) -> io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let m = fs::symlink_metadata(base)?;
    // SAFETY: geteuid has no arguments and cannot fail.
    let me = unsafe { libc::geteuid() };
    let why = if !m.is_dir() {
        Some("it is not a directory".to_owned())
    } else if m.uid() != me && m.uid() != 0 {
        Some(format!("it belongs to uid {}", m.uid()))
    } else if m.mode() & 0o022 != 0 {
        Some(format!(
            "others may write to it (mode {:o})",
            m.mode() & 0o7777
        ))
    } else {
        None
    };
    match why {
        None => Ok(()),
        Some(w) => Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!("refusing the runtime base: {w}; remove it or set VMSIGHT_RUNTIME"),
        )),
    }
}

/// Creates (or truncates) `path` with mode 0600: a file of the runtime directory (the guest's
/// command line, its console, QEMU's command line and log) is its owner's only, whatever the
/// umask (which can only take bits away from 0600).
pub fn create_private(path: &Path) -> io::Result<fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
}

/// Writes `data` to `path` through [`create_private`].
pub fn write_private(path: &Path, data: impl AsRef<[u8]>) -> io::Result<()> {
    use std::io::Write;
    create_private(path)?.write_all(data.as_ref())
}

/// Removes the runtime directories that killed `vmsight run`s left behind (their plugin
/// channel alone is 8 MiB per vCPU, on tmpfs where /run is one). Best effort: another vmsight
/// may prune at once.
fn prune_stale(base: &Path) {
    for p in RuntimeLayout::at(base).stale() {
        detach_mounts_under(p.dir());
        match fs::remove_dir_all(p.dir()) {
            Ok(()) => tracing::info!("removed stale runtime directory {}", p.dir().display()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!("cannot remove stale {}: {e}", p.dir().display()),
        }
    }
}

/// Detaches what a killed run left mounted in its runtime directory (the share's tmpfs,
/// `--shared-mem`), deepest first, so the directory can be removed. Best effort: without the
/// right to unmount, the removal reports the busy mount point.
fn detach_mounts_under(dir: &Path) {
    let Ok(info) = fs::read_to_string("/proc/self/mountinfo") else {
        return;
    };
    let mut points: Vec<PathBuf> = info
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|p| PathBuf::from(unescape_mount_path(p)))
        .filter(|p| p.starts_with(dir) && p != dir)
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    for p in points {
        match nix::mount::umount2(&p, nix::mount::MntFlags::MNT_DETACH) {
            Ok(()) => tracing::info!("detached {} left by a killed run", p.display()),
            Err(e) => tracing::warn!("cannot detach {}: {e}", p.display()),
        }
    }
}

/// A mount point as `/proc/self/mountinfo` writes it: space, tab, newline and backslash as
/// three-digit octal escapes.
fn unescape_mount_path(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| b[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match octal {
            Some(d) => {
                let v = d.iter().fold(0u32, |v, c| v * 8 + u32::from(c - b'0'));
                out.push(v as u8); // the kernel escapes single bytes (at most \377)
                i += 4;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl Drop for RuntimeDir {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_dir_all(&self.dir) {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::warn!("cannot remove {}: {e}", self.dir.display());
            }
        }
    }
}

/// Lists the VMs running on this host (live owner process), skipping stale directories.
pub fn list_running(base: &Path) -> Vec<VmRecord> {
    RuntimeLayout::at(base)
        .running()
        .into_iter()
        .map(|vm| vm.record)
        .collect()
}

/// Working copies older than this whose VM is not running are left-overs of a killed
/// `vmsight run` (a SIGKILL skips [`WorkingCopy`]'s drop); younger ones may belong to a VM
/// that is still starting.
pub const STALE_COPY_AGE: std::time::Duration = std::time::Duration::from_secs(600);

/// Removes the per-VM directories under `vms` (working copies of root disks) whose VM is not
/// among `running` and that nothing touched for `min_age`; returns how many went. Each copy
/// holds hundreds of MiB, so without this every killed VM leaks one.
pub fn sweep_stale_copies(vms: &Path, running: &[String], min_age: std::time::Duration) -> usize {
    let Ok(rd) = fs::read_dir(vms) else {
        return 0;
    };
    let now = std::time::SystemTime::now();
    let mut removed = 0;
    for e in rd.filter_map(Result::ok) {
        let name = e.file_name().to_string_lossy().into_owned();
        if running.contains(&name) {
            continue;
        }
        let newest = fs::read_dir(e.path())
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .filter_map(|f| f.metadata().ok()?.modified().ok())
            .chain(e.metadata().ok().and_then(|m| m.modified().ok()))
            .max();
        let old = newest.is_some_and(|t| now.duration_since(t).unwrap_or_default() >= min_age);
        if old && fs::remove_dir_all(e.path()).is_ok() {
            tracing::info!(vm = %name, "removed the stale working copy of a VM that is gone");
            removed += 1;
        }
    }
    removed
}

/// A working copy of a disk image that is deleted on drop unless kept.
#[derive(Debug)]
pub struct WorkingCopy {
    pub path: PathBuf,
    keep: bool,
}

impl WorkingCopy {
    /// Copies `from` to `to` sharing blocks where the file system can (reflink), else sparsely.
    pub fn create(from: &Path, to: &Path) -> Result<WorkingCopy, LaunchError> {
        let err = |source: io::Error| LaunchError::RootCopy {
            from: from.to_path_buf(),
            to: to.to_path_buf(),
            source,
        };
        if let Some(parent) = to.parent() {
            fs::create_dir_all(parent).map_err(err)?;
        }
        sparse_copy(from, to, Durability::Scratch).map_err(err)?;
        Ok(WorkingCopy {
            path: to.to_path_buf(),
            keep: false,
        })
    }

    /// Uses an existing image in place (`--persist`): never deleted.
    pub fn in_place(path: &Path) -> WorkingCopy {
        WorkingCopy {
            path: path.to_path_buf(),
            keep: true,
        }
    }
}

impl Drop for WorkingCopy {
    fn drop(&mut self) {
        if !self.keep {
            let _ = fs::remove_file(&self.path);
            if let Some(parent) = self.path.parent() {
                // Only removes the per-VM directory if it is now empty.
                let _ = fs::remove_dir(parent);
            }
        }
    }
}

/// Whether a copy must be on the disk before it is used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// A scratch copy, deleted at the end of the run (a VM's working copy, a replay's image):
    /// the page cache serves it, and a crash loses nothing worth keeping. Not syncing it saves
    /// the start-up the write-back of the whole copy (about 230 ms for the default root disk's
    /// 500 MiB of data, measured with strace: the single largest item of `prepare`).
    Scratch,
    /// A copy that outlives the run (a persistent root disk): synced before it is used.
    Durable,
}

/// Reflink if possible, else copy only the data extents (SEEK_DATA/SEEK_HOLE), so a 4 GiB image
/// with 700 MiB of data costs 700 MiB of I/O or nothing at all.
pub fn sparse_copy(from: &Path, to: &Path, durability: Durability) -> io::Result<()> {
    let src = fs::File::open(from)?;
    let len = src.metadata()?.len();
    let dst = fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(to)?;
    // SAFETY: FICLONE takes the source fd as its argument; both fds are open for the call.
    let rc = unsafe { libc::ioctl(dst.as_raw_fd(), libc::FICLONE, src.as_raw_fd()) };
    if rc == 0 {
        return Ok(());
    }
    dst.set_len(len)?;
    let mut off: i64 = 0;
    let end = i64::try_from(len).map_err(io::Error::other)?;
    while off < end {
        // SAFETY: lseek on a valid fd with no memory arguments.
        let data = unsafe { libc::lseek(src.as_raw_fd(), off, libc::SEEK_DATA) };
        if data < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                break; // no more data: the rest is a hole
            }
            return Err(e);
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(src.as_raw_fd(), data, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut pos_in = data;
        let mut pos_out = data;
        while pos_in < hole {
            let want = usize::try_from(hole - pos_in)
                .unwrap_or(usize::MAX)
                .min(1 << 30);
            // SAFETY: the offsets point to valid i64s owned by this frame; fds are open.
            let n = unsafe {
                libc::copy_file_range(
                    src.as_raw_fd(),
                    &mut pos_in,
                    dst.as_raw_fd(),
                    &mut pos_out,
                    want,
                    0,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EXDEV | libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP)
                ) {
                    // Another file system (a base on tmpfs, the copy on ext4) or one without
                    // copy_file_range: copy the rest of this data run by reads and writes.
                    copy_by_hand(&src, &dst, pos_in as u64, hole as u64)?;
                    break;
                }
                return Err(e);
            }
            if n == 0 {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "source shrank while copying",
                ));
            }
        }
        off = hole;
    }
    if durability == Durability::Durable {
        dst.sync_all()?;
    }
    Ok(())
}

/// Copies bytes `from..to` of `src` to the same offsets of `dst` through a 1 MiB buffer.
fn copy_by_hand(src: &fs::File, dst: &fs::File, from: u64, to: u64) -> io::Result<()> {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; 1 << 20];
    let mut at = from;
    while at < to {
        let want = usize::try_from(to - at)
            .unwrap_or(usize::MAX)
            .min(buf.len());
        let n = src.read_at(&mut buf[..want], at)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "source shrank while copying",
            ));
        }
        dst.write_all_at(&buf[..n], at)?;
        at += n as u64;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn mount_points_are_unescaped_as_mountinfo_escapes_them() {
        use super::unescape_mount_path;
        assert_eq!(
            unescape_mount_path("/run/vmsight/a\\040b/x"),
            "/run/vmsight/a b/x"
        );
        assert_eq!(unescape_mount_path("/t\\011\\134"), "/t\t\\");
        assert_eq!(unescape_mount_path("/no\\9escape\\"), "/no\\9escape\\");
    }

    #[test]
    fn a_vms_directory_is_0700_and_a_base_others_may_write_to_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().expect("tempdir");
        let base = d.path().join("base");
        let rt = super::RuntimeDir::create(&base, "v").expect("create");
        let mode = |p: &std::path::Path| std::fs::metadata(p).expect("stat").permissions().mode();
        assert_eq!(mode(rt.path()) & 0o777, 0o700);
        assert_eq!(mode(&base) & 0o022, 0);
        drop(rt);
        std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o777)).expect("chmod");
        let e = super::RuntimeDir::create(&base, "v").expect_err("a world-writable base");
        assert!(e.to_string().contains("others may write to it"), "{e}");
        assert!(!base.join("v").exists());
    }

    #[test]
    fn stale_working_copies_go_and_running_or_young_ones_stay() {
        let d = tempfile::tempdir().expect("tempdir");
        for vm in ["gone", "alive", "young"] {
            std::fs::create_dir_all(d.path().join(vm)).expect("dir");
            std::fs::write(d.path().join(vm).join("root.img"), b"x").expect("file");
        }
        let running = vec!["alive".to_string()];
        // Nothing is older than an hour yet.
        assert_eq!(
            super::sweep_stale_copies(d.path(), &running, std::time::Duration::from_secs(3600)),
            0
        );
        // With no minimum age, only the running VM's copy stays.
        assert_eq!(
            super::sweep_stale_copies(d.path(), &running, std::time::Duration::ZERO),
            2
        );
        assert!(d.path().join("alive/root.img").exists());
        assert!(!d.path().join("gone").exists() && !d.path().join("young").exists());
    }

    use super::*;
    use std::io::{Seek, SeekFrom, Write};

    #[test]
    fn sparse_copy_preserves_content_and_holes() {
        let d = tempfile::tempdir().unwrap();
        let a = d.path().join("a.img");
        let mut f = fs::File::create(&a).unwrap();
        f.set_len(64 << 20).unwrap();
        f.seek(SeekFrom::Start(1 << 20)).unwrap();
        f.write_all(&[7u8; 8192]).unwrap();
        f.seek(SeekFrom::Start(40 << 20)).unwrap();
        f.write_all(b"tail data").unwrap();
        drop(f);
        let b = d.path().join("b.img");
        sparse_copy(&a, &b, Durability::Durable).unwrap();
        assert_eq!(fs::read(&a).unwrap(), fs::read(&b).unwrap());
        use std::os::unix::fs::MetadataExt;
        let blocks = fs::metadata(&b).unwrap().blocks();
        assert!(
            blocks * 512 < 4 << 20,
            "copy is not sparse: {blocks} blocks"
        );
    }

    /// A base on tmpfs copied to the temporary directory: copy_file_range fails with EXDEV
    /// there (kernel 6.18), and the copy falls back to reads and writes.
    #[test]
    fn sparse_copy_crosses_file_systems() {
        let shm = Path::new("/dev/shm");
        if !shm.is_dir() {
            return; // no tmpfs to copy from on this host
        }
        let src = tempfile::tempdir_in(shm).unwrap();
        let a = src.path().join("a.img");
        let mut f = fs::File::create(&a).unwrap();
        f.set_len(8 << 20).unwrap();
        f.seek(SeekFrom::Start(3 << 20)).unwrap();
        f.write_all(&[9u8; 5000]).unwrap();
        drop(f);
        let d = tempfile::tempdir().unwrap();
        let b = d.path().join("b.img");
        sparse_copy(&a, &b, Durability::Durable).unwrap();
        assert_eq!(fs::read(&a).unwrap(), fs::read(&b).unwrap());
    }

    #[test]
    fn runtime_dir_is_exclusive_and_removed() {
        let d = tempfile::tempdir().unwrap();
        let r = RuntimeDir::create(d.path(), "vm1").unwrap();
        r.write_record(&VmRecord {
            name: "vm1".into(),
            pid: 1, // init is always alive
            qemu_pid: None,
            started_unix: 0,
            disks: vec![],
            accel: "tcg".into(),
            qemu: None,
            plugin_api: None,
        })
        .unwrap();
        assert!(matches!(
            RuntimeDir::create(d.path(), "vm1"),
            Err(LaunchError::NameInUse(..))
        ));
        assert_eq!(list_running(d.path()).len(), 1);
        let p = r.path().to_path_buf();
        drop(r);
        assert!(!p.exists());
    }

    #[test]
    fn stale_runtime_dir_is_replaced() {
        let d = tempfile::tempdir().unwrap();
        let stale = d.path().join("vm2");
        fs::create_dir(&stale).unwrap();
        fs::write(
            stale.join("vm.json"),
            r#"{"name":"vm2","pid":4000000000,"qemu_pid":null,"started_unix":0,"disks":[],"accel":"tcg"}"#,
        )
        .unwrap();
        let r = RuntimeDir::create(d.path(), "vm2").unwrap();
        assert!(r.path().exists());
        assert!(list_running(d.path()).is_empty());
    }

    #[test]
    fn other_vms_stale_dirs_are_pruned_and_live_or_starting_ones_kept() {
        let d = tempfile::tempdir().unwrap();
        let record = |name: &str, pid: u64| {
            let dir = d.path().join(name);
            fs::create_dir(&dir).unwrap();
            fs::write(
                dir.join("vm.json"),
                format!(
                    r#"{{"name":"{name}","pid":{pid},"qemu_pid":null,"started_unix":0,"disks":[],"accel":"tcg"}}"#
                ),
            )
            .unwrap();
            fs::write(dir.join("plugin.shm"), b"ring").unwrap();
            dir
        };
        let killed = record("killed", 4_000_000_000);
        let live = record("live", 1); // init is always alive
        let starting = d.path().join("starting"); // no vm.json yet
        fs::create_dir(&starting).unwrap();
        let _r = RuntimeDir::create(d.path(), "new").unwrap();
        assert!(!killed.exists(), "a dead owner's directory is removed");
        assert!(live.join("plugin.shm").exists() && starting.exists());
    }
}
