//! `vmsight mount DIR`: a read-only FUSE file system showing `DIR/<host>/<vm>/<guest path>`
//! for every running VM with a view server.
//!
//! Inode numbers: 1 is `DIR`, 2 is `DIR/<host>`; a guest inode `i` of the VM in slot `s` is
//! `s << 32 | i` (slots start at 1 and are never reused, so a restarted VM of the same name
//! gets fresh inode numbers). `DIR/<host>/<vm>` is the guest's root (guest inode 2).

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use fuser::{
    FileAttr, FileType, Filesystem, MountOption, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty,
    ReplyEntry, ReplyOpen, ReplyStatfs, Request as FuseRequest,
};
use vmsight_fsview::FileKind;
use vmsight_proto::layout::{runtime_base, RuntimeLayout, VmPaths};

use crate::protocol::{Attr, ErrorCode, Request, Response, MAX_READ};
use crate::server::{ViewClient, ViewError};

/// Attribute and entry cache lifetime: short, because the guest keeps changing.
const TTL: Duration = Duration::from_secs(1);
const ROOT: u64 = 1;
const HOST: u64 = 2;
const GUEST_ROOT: u32 = 2;
/// How long one request to a view server may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Options of [`mount`].
#[derive(Debug, Clone)]
pub struct MountOptions {
    /// Where running VMs are found.
    pub runtime: PathBuf,
    /// Name of the host directory (default: the host name, as in event channels).
    pub host: String,
    /// Show only this VM.
    pub vm: Option<String>,
    /// Let other users see the mount (needs `user_allow_other` in /etc/fuse.conf unless
    /// root); permissions are still checked against the guest's modes and owners.
    pub allow_other: bool,
    /// Set to unmount and return (in addition to SIGINT/SIGTERM/SIGHUP).
    pub stop: Arc<AtomicBool>,
}

impl Default for MountOptions {
    fn default() -> Self {
        MountOptions {
            runtime: runtime_base(),
            host: vmsight_events::host_name(),
            vm: None,
            allow_other: false,
            stop: Arc::new(AtomicBool::new(false)),
        }
    }
}

struct Vm {
    slot: u32,
    name: String,
    paths: VmPaths,
    pid: u32,
    client: Option<ViewClient>,
}

impl Vm {
    fn call(&mut self, req: &Request) -> Result<Response, i32> {
        if self.client.is_none() {
            self.client = Some(
                ViewClient::connect(self.paths.view_socket(), CALL_TIMEOUT).map_err(|e| {
                    tracing::warn!("{}: {e}", self.name);
                    libc::EIO
                })?,
            );
        }
        let Some(c) = self.client.as_mut() else {
            return Err(libc::EIO);
        };
        match c.call(req) {
            Ok(Response::Error { code, message }) => {
                tracing::debug!("{}: {req:?}: {message}", self.name);
                Err(errno(code))
            }
            Ok(r) => Ok(r),
            Err(e) => {
                // Reconnect on the next request (the VM may have restarted its server).
                tracing::warn!("{}: {e}", self.name);
                self.client = None;
                Err(libc::EIO)
            }
        }
    }
}

fn errno(code: ErrorCode) -> i32 {
    match code {
        ErrorCode::NotFound => libc::ENOENT,
        ErrorCode::NotDir => libc::ENOTDIR,
        ErrorCode::NotLink | ErrorCode::Invalid => libc::EINVAL,
        ErrorCode::Io => libc::EIO,
    }
}

enum DirItem {
    Entry(u64, FileType, Vec<u8>),
}

/// The FUSE file system.
pub struct ViewFs {
    opts: MountOptions,
    vms: BTreeMap<String, Vm>,
    by_slot: HashMap<u32, String>,
    next_slot: u32,
    dirs: HashMap<u64, Vec<DirItem>>,
    next_fh: u64,
    started: SystemTime,
}

fn file_type(kind: FileKind) -> FileType {
    match kind {
        FileKind::Regular | FileKind::Unknown => FileType::RegularFile,
        FileKind::Directory => FileType::Directory,
        FileKind::Symlink => FileType::Symlink,
        FileKind::CharDevice => FileType::CharDevice,
        FileKind::BlockDevice => FileType::BlockDevice,
        FileKind::Fifo => FileType::NamedPipe,
        FileKind::Socket => FileType::Socket,
    }
}

fn time(secs: i64) -> SystemTime {
    if secs >= 0 {
        UNIX_EPOCH + Duration::from_secs(secs.unsigned_abs())
    } else {
        UNIX_EPOCH - Duration::from_secs(secs.unsigned_abs())
    }
}

fn guest_attr(fuse_ino: u64, a: &Attr) -> FileAttr {
    FileAttr {
        ino: fuse_ino,
        size: a.size,
        // The index keeps no block counts; report the size in 512-byte units.
        blocks: a.size.div_ceil(512),
        atime: time(a.atime),
        mtime: time(a.mtime),
        ctime: time(a.ctime),
        crtime: time(a.ctime),
        kind: file_type(a.kind()),
        perm: a.mode & 0o7777,
        nlink: u32::from(a.links),
        uid: a.uid,
        gid: a.gid,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

fn split(ino: u64) -> (u32, u32) {
    ((ino >> 32) as u32, (ino & 0xffff_ffff) as u32)
}

fn join(slot: u32, guest: u32) -> u64 {
    (u64::from(slot) << 32) | u64::from(guest)
}

impl ViewFs {
    /// A file system over the VMs found with `opts`.
    pub fn new(opts: MountOptions) -> ViewFs {
        let mut fs = ViewFs {
            opts,
            vms: BTreeMap::new(),
            by_slot: HashMap::new(),
            next_slot: 1,
            dirs: HashMap::new(),
            next_fh: 1,
            started: SystemTime::now(),
        };
        fs.rescan();
        fs
    }

    /// Re-reads the runtime directory: adds VMs that started, drops VMs that ended.
    fn rescan(&mut self) {
        let found: Vec<_> = RuntimeLayout::at(&self.opts.runtime)
            .running()
            .into_iter()
            .filter(|v| self.opts.vm.as_ref().is_none_or(|n| *n == v.record.name))
            .filter(|v| v.paths.view_socket().exists())
            .collect();
        self.vms.retain(|name, vm| {
            found
                .iter()
                .any(|f| f.record.name == *name && f.record.pid == vm.pid && f.paths == vm.paths)
        });
        for f in found {
            if self.vms.contains_key(&f.record.name) {
                continue;
            }
            let slot = self.next_slot;
            self.next_slot = self.next_slot.saturating_add(1);
            self.vms.insert(
                f.record.name.clone(),
                Vm {
                    slot,
                    name: f.record.name,
                    paths: f.paths,
                    pid: f.record.pid,
                    client: None,
                },
            );
        }
        self.by_slot = self
            .vms
            .values()
            .map(|v| (v.slot, v.name.clone()))
            .collect();
    }

    fn synthetic_attr(&self, ino: u64) -> FileAttr {
        FileAttr {
            ino,
            size: 0,
            blocks: 0,
            atime: self.started,
            mtime: self.started,
            ctime: self.started,
            crtime: self.started,
            kind: FileType::Directory,
            perm: 0o555,
            nlink: 2,
            uid: 0,
            gid: 0,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    fn vm_of(&mut self, ino: u64) -> Option<&mut Vm> {
        let (slot, _) = split(ino);
        let name = self.by_slot.get(&slot)?;
        self.vms.get_mut(name)
    }

    fn stat_guest(&mut self, ino: u64) -> Result<FileAttr, i32> {
        let (_, guest) = split(ino);
        let vm = self.vm_of(ino).ok_or(libc::ENOENT)?;
        match vm.call(&Request::Stat(guest))? {
            Response::Attr(a) => Ok(guest_attr(ino, &a)),
            _ => Err(libc::EIO),
        }
    }

    fn getattr_inner(&mut self, ino: u64) -> Result<FileAttr, i32> {
        match ino {
            ROOT | HOST => Ok(self.synthetic_attr(ino)),
            _ => self.stat_guest(ino),
        }
    }

    fn lookup_inner(&mut self, parent: u64, name: &OsStr) -> Result<FileAttr, i32> {
        match parent {
            ROOT => {
                if name.as_bytes() == self.opts.host.as_bytes() {
                    Ok(self.synthetic_attr(HOST))
                } else {
                    Err(libc::ENOENT)
                }
            }
            HOST => {
                let Some(n) = name.to_str() else {
                    return Err(libc::ENOENT);
                };
                if !self.vms.contains_key(n) {
                    self.rescan();
                }
                let slot = self.vms.get(n).ok_or(libc::ENOENT)?.slot;
                self.stat_guest(join(slot, GUEST_ROOT))
            }
            _ => {
                let (slot, dir) = split(parent);
                let vm = self.vm_of(parent).ok_or(libc::ENOENT)?;
                let req = Request::Lookup {
                    dir,
                    name: name.as_bytes().to_vec(),
                };
                match vm.call(&req)? {
                    Response::Attr(a) => Ok(guest_attr(join(slot, a.ino), &a)),
                    _ => Err(libc::EIO),
                }
            }
        }
    }

    fn list(&mut self, ino: u64) -> Result<Vec<DirItem>, i32> {
        let dot = |i: u64| DirItem::Entry(i, FileType::Directory, b".".to_vec());
        let dotdot = |i: u64| DirItem::Entry(i, FileType::Directory, b"..".to_vec());
        match ino {
            ROOT => Ok(vec![
                dot(ROOT),
                dotdot(ROOT),
                DirItem::Entry(
                    HOST,
                    FileType::Directory,
                    self.opts.host.as_bytes().to_vec(),
                ),
            ]),
            HOST => {
                self.rescan();
                let mut out = vec![dot(HOST), dotdot(ROOT)];
                out.extend(self.vms.values().map(|v| {
                    DirItem::Entry(
                        join(v.slot, GUEST_ROOT),
                        FileType::Directory,
                        v.name.as_bytes().to_vec(),
                    )
                }));
                Ok(out)
            }
            _ => {
                let (slot, guest) = split(ino);
                let vm = self.vm_of(ino).ok_or(libc::ENOENT)?;
                let Response::Entries(list) = vm.call(&Request::ReadDir(guest))? else {
                    return Err(libc::EIO);
                };
                // `..` is answered by the kernel from its dentry cache; the number is unused.
                let mut out = vec![dot(ino), dotdot(ino)];
                out.extend(
                    list.into_iter()
                        .map(|e| DirItem::Entry(join(slot, e.ino), file_type(e.kind), e.name)),
                );
                Ok(out)
            }
        }
    }
}

impl Filesystem for ViewFs {
    fn lookup(&mut self, _req: &FuseRequest<'_>, parent: u64, name: &OsStr, reply: ReplyEntry) {
        match self.lookup_inner(parent, name) {
            Ok(a) => reply.entry(&TTL, &a, 0),
            Err(e) => reply.error(e),
        }
    }

    fn getattr(&mut self, _req: &FuseRequest<'_>, ino: u64, _fh: Option<u64>, reply: ReplyAttr) {
        match self.getattr_inner(ino) {
            Ok(a) => reply.attr(&TTL, &a),
            Err(e) => reply.error(e),
        }
    }

    fn readlink(&mut self, _req: &FuseRequest<'_>, ino: u64, reply: ReplyData) {
        let (_, guest) = split(ino);
        let Some(vm) = self.vm_of(ino) else {
            return reply.error(libc::ENOENT);
        };
        match vm.call(&Request::ReadLink(guest)) {
            Ok(Response::Link(t)) => reply.data(&t),
            Ok(_) => reply.error(libc::EIO),
            Err(e) => reply.error(e),
        }
    }

    fn open(&mut self, _req: &FuseRequest<'_>, ino: u64, flags: i32, reply: ReplyOpen) {
        if flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0 {
            return reply.error(libc::EROFS);
        }
        match self.getattr_inner(ino) {
            Ok(a) if a.kind == FileType::Directory => reply.error(libc::EISDIR),
            Ok(_) => reply.opened(0, 0),
            Err(e) => reply.error(e),
        }
    }

    fn read(
        &mut self,
        _req: &FuseRequest<'_>,
        ino: u64,
        _fh: u64,
        offset: i64,
        size: u32,
        _flags: i32,
        _lock_owner: Option<u64>,
        reply: ReplyData,
    ) {
        let Ok(offset) = u64::try_from(offset) else {
            return reply.error(libc::EINVAL);
        };
        let (_, guest) = split(ino);
        let Some(vm) = self.vm_of(ino) else {
            return reply.error(libc::ENOENT);
        };
        let req = Request::Read {
            ino: guest,
            offset,
            len: size.min(MAX_READ),
        };
        match vm.call(&req) {
            Ok(Response::Data(d)) => reply.data(&d),
            Ok(_) => reply.error(libc::EIO),
            Err(e) => reply.error(e),
        }
    }

    fn opendir(&mut self, _req: &FuseRequest<'_>, ino: u64, _flags: i32, reply: ReplyOpen) {
        match self.list(ino) {
            Ok(items) => {
                let fh = self.next_fh;
                self.next_fh += 1;
                self.dirs.insert(fh, items);
                reply.opened(fh, 0);
            }
            Err(e) => reply.error(e),
        }
    }

    fn readdir(
        &mut self,
        _req: &FuseRequest<'_>,
        _ino: u64,
        fh: u64,
        offset: i64,
        mut reply: ReplyDirectory,
    ) {
        let Some(items) = self.dirs.get(&fh) else {
            return reply.error(libc::EBADF);
        };
        let start = usize::try_from(offset).unwrap_or(0);
        for (i, DirItem::Entry(ino, kind, name)) in items.iter().enumerate().skip(start) {
            let next = i64::try_from(i + 1).unwrap_or(i64::MAX);
            if reply.add(*ino, next, *kind, OsStr::from_bytes(name)) {
                break; // buffer full; the kernel asks again from `next`
            }
        }
        reply.ok();
    }

    fn releasedir(
        &mut self,
        _req: &FuseRequest<'_>,
        _ino: u64,
        fh: u64,
        _flags: i32,
        reply: ReplyEmpty,
    ) {
        self.dirs.remove(&fh);
        reply.ok();
    }

    fn statfs(&mut self, _req: &FuseRequest<'_>, _ino: u64, reply: ReplyStatfs) {
        // Nothing is writable; sizes of the guests' file systems are not tracked.
        reply.statfs(0, 0, 0, 0, 0, 4096, 255, 4096);
    }

    fn access(&mut self, _req: &FuseRequest<'_>, _ino: u64, mask: i32, reply: ReplyEmpty) {
        // Permission bits are checked by the kernel (default_permissions); refuse writes.
        if mask & libc::W_OK != 0 {
            reply.error(libc::EROFS);
        } else {
            reply.ok();
        }
    }
}

/// Mounts the view on `dir` and serves it in the foreground until SIGINT/SIGTERM/SIGHUP,
/// `opts.stop`, or an external `fusermount3 -u`; unmounts before returning.
pub fn mount(dir: &Path, opts: MountOptions) -> Result<(), ViewError> {
    let err = |source| ViewError::Mount {
        path: dir.to_path_buf(),
        source,
    };
    let stop = Arc::clone(&opts.stop);
    for sig in [
        signal_hook::consts::SIGINT,
        signal_hook::consts::SIGTERM,
        signal_hook::consts::SIGHUP,
    ] {
        signal_hook::flag::register(sig, Arc::clone(&stop)).map_err(err)?;
    }
    let mut options = vec![
        MountOption::RO,
        MountOption::FSName("vmsight".into()),
        MountOption::Subtype("vmsight".into()),
        MountOption::DefaultPermissions,
        MountOption::NoDev,
        MountOption::NoSuid,
    ];
    if opts.allow_other {
        options.push(MountOption::AllowOther);
    }
    let fs = ViewFs::new(opts);
    let session = fuser::spawn_mount2(fs, dir, &options).map_err(err)?;
    tracing::info!("view mounted on {}", dir.display());
    while !stop.load(Ordering::SeqCst) && !session.guard.is_finished() {
        std::thread::sleep(Duration::from_millis(100));
    }
    // Dropping the session unmounts (a no-op if someone already did).
    drop(session);
    tracing::info!("view unmounted from {}", dir.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inode_numbers_split_and_join() {
        assert_eq!(split(join(7, 12)), (7, 12));
        assert_eq!(split(join(u32::MAX, u32::MAX)), (u32::MAX, u32::MAX));
        // Synthetic inodes live in slot 0, guest inodes never do.
        assert_eq!(split(ROOT).0, 0);
        assert_eq!(split(HOST).0, 0);
    }

    #[test]
    fn times_before_the_epoch() {
        assert_eq!(time(-5), UNIX_EPOCH - Duration::from_secs(5));
        assert_eq!(time(5), UNIX_EPOCH + Duration::from_secs(5));
    }
}
