//! `vmsight mount DIR`: a read-only FUSE file system showing `DIR/<host>/<vm>/<guest path>`
//! for every running VM with a view server.
//!
//! Every disk the VM's server shows appears where the guest mounts it (`tree.rs`): the root
//! disk is `DIR/<host>/<vm>/`, an extra disk `DIR/<host>/<vm>/<mount point>/`, hiding the
//! directory below as a mount does; directories on the way to a mount point that the disk
//! below lacks (`@disk2`) are made up (empty, mode 0555).
//!
//! Inode numbers: 1 is `DIR`, 2 is `DIR/<host>`; inode `i` of disk `d` of the VM in slot `s`
//! is `s << 40 | d << 32 | i` (slots start at 1 and are never reused, so a restarted VM of the
//! same name gets fresh inode numbers; disks 0..=254, disk 255 numbers the made-up
//! directories).

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

use crate::protocol::{Attr, DiskId, ErrorCode, FsRequest, Request, Response, MAX_READ};
use crate::server::{ViewClient, ViewError};
use crate::tree::{Components, MountTable};

/// Attribute and entry cache lifetime: short, because the guest keeps changing.
const TTL: Duration = Duration::from_secs(1);
const ROOT: u64 = 1;
const HOST: u64 = 2;
const GUEST_ROOT: u32 = 2;
/// The disk number of made-up directories.
const MADE_UP: u8 = u8::MAX;
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

/// A file or directory of one VM: an inode of one of its disks, or a made-up directory
/// (disk [`MADE_UP`], `ino` indexes [`Vm::made_up`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Node {
    disk: u8,
    ino: u32,
}

impl Node {
    fn root_of(disk: u8) -> Node {
        Node {
            disk,
            ino: GUEST_ROOT,
        }
    }
}

struct Vm {
    slot: u32,
    name: String,
    paths: VmPaths,
    pid: u32,
    client: Option<ViewClient>,
    /// Where each disk is mounted (refreshed when the VM's directory is looked up or listed).
    table: MountTable,
    /// The guest paths of the directories that are mount points or lead to one, as they were
    /// looked up: a mount stays on its directory as in Linux (renaming a parent moves it).
    grafts: HashMap<Node, Components>,
    /// The paths of the made-up directories.
    made_up: Vec<Components>,
}

impl Vm {
    /// VM `name` in inode slot `slot`, its runtime files at `paths`, nothing asked of it yet.
    fn new(slot: u32, name: String, paths: VmPaths, pid: u32) -> Vm {
        Vm {
            slot,
            name,
            paths,
            pid,
            client: None,
            table: MountTable::default(),
            grafts: HashMap::new(),
            made_up: Vec::new(),
        }
    }

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

    /// Asks the file system of `node`'s disk (never a made-up directory).
    fn fs(&mut self, node: Node, op: FsRequest) -> Result<Response, i32> {
        if node.disk == MADE_UP {
            return Err(libc::EINVAL);
        }
        self.call(&Request::fs(DiskId::from(node.disk), op))
    }

    /// Re-reads which disk is mounted where; on failure the old table stays.
    fn refresh_mounts(&mut self) -> Result<(), i32> {
        match self.call(&Request::Mounts)? {
            Response::Mounts(list) => {
                self.table = MountTable::new(&list, |d| d < DiskId::from(MADE_UP));
                Ok(())
            }
            _ => Err(libc::EIO),
        }
    }

    /// The guest's metadata of a disk inode.
    fn stat(&mut self, node: Node) -> Result<Attr, i32> {
        match self.fs(node, FsRequest::Stat(node.ino))? {
            Response::Attr(a) => Ok(a),
            _ => Err(libc::EIO),
        }
    }

    /// The node at guest path `path`, which is a mount point or leads to one; `below` is the
    /// directory entry there on the disk below, if it has one.
    fn graft(&mut self, path: Components, below: Option<Attr>, disk_below: u8) -> Node {
        let node = match (self.table.disk_at(&path), below) {
            // A disk number the table kept fits in a u8 (below MADE_UP).
            (Some(d), _) => Node::root_of(u8::try_from(d).unwrap_or(MADE_UP)),
            (None, Some(a)) if a.kind() == FileKind::Directory => Node {
                disk: disk_below,
                ino: a.ino,
            },
            (None, _) => self.made_up_dir(&path),
        };
        if self.table.leads_to_mount(&path) {
            self.grafts.insert(node, path);
        }
        node
    }

    fn made_up_dir(&mut self, path: &[Vec<u8>]) -> Node {
        let i = match self.made_up.iter().position(|p| p.as_slice() == path) {
            Some(i) => i,
            None => {
                self.made_up.push(path.to_vec());
                self.made_up.len() - 1
            }
        };
        Node {
            disk: MADE_UP,
            ino: u32::try_from(i).unwrap_or(u32::MAX),
        }
    }

    /// The VM's root directory: the root disk's, or a made-up one when no disk is on `/`.
    fn root(&mut self) -> Node {
        self.graft(Vec::new(), None, MADE_UP)
    }

    /// Resolves `name` in directory `dir`, crossing into a disk mounted there.
    fn lookup(&mut self, dir: Node, name: &[u8]) -> Result<Node, i32> {
        if let Some(parent) = self.grafts.get(&dir) {
            let mut path = parent.clone();
            path.push(name.to_vec());
            if self.table.disk_at(&path).is_some() || self.table.leads_to_mount(&path) {
                let below = match dir.disk {
                    MADE_UP => None,
                    _ => self.lookup_on_disk(dir, name).ok(),
                };
                return Ok(self.graft(path, below, dir.disk));
            }
        }
        if dir.disk == MADE_UP {
            return Err(libc::ENOENT);
        }
        let a = self.lookup_on_disk(dir, name)?;
        Ok(Node {
            disk: dir.disk,
            ino: a.ino,
        })
    }

    fn lookup_on_disk(&mut self, dir: Node, name: &[u8]) -> Result<Attr, i32> {
        let op = FsRequest::Lookup {
            dir: dir.ino,
            name: name.to_vec(),
        };
        match self.fs(dir, op)? {
            Response::Attr(a) => Ok(a),
            _ => Err(libc::EIO),
        }
    }

    /// The entries of directory `dir` (name, node, kind), with the disks mounted in it in
    /// place of what they hide.
    fn entries(&mut self, dir: Node) -> Result<Vec<(Vec<u8>, Node, FileType)>, i32> {
        let mut out = Vec::new();
        if dir.disk != MADE_UP {
            let Response::Entries(list) = self.fs(dir, FsRequest::ReadDir(dir.ino))? else {
                return Err(libc::EIO);
            };
            out.extend(list.into_iter().map(|e| {
                let node = Node {
                    disk: dir.disk,
                    ino: e.ino,
                };
                (e.name, node, file_type(e.kind))
            }));
        } else if usize::try_from(dir.ino).map_or(true, |i| i >= self.made_up.len()) {
            return Err(libc::ENOENT);
        }
        let Some(path) = self.grafts.get(&dir).cloned() else {
            return Ok(out);
        };
        for name in self.table.names_below(&path) {
            let node = self.lookup(dir, &name)?;
            out.retain(|(n, _, _)| *n != name);
            out.push((name, node, FileType::Directory));
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out)
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

/// Slots are 24 bits wide (16 million VM instances per mount).
const SLOT_BITS: u32 = 24;

fn split(ino: u64) -> (u32, Node) {
    let slot = (ino >> 40) as u32;
    let disk = ((ino >> 32) & 0xff) as u8;
    let ino = (ino & 0xffff_ffff) as u32;
    (slot, Node { disk, ino })
}

fn join(slot: u32, n: Node) -> u64 {
    (u64::from(slot) << 40) | (u64::from(n.disk) << 32) | u64::from(n.ino)
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
            if slot >= 1 << SLOT_BITS {
                tracing::warn!("{}: no inode numbers left for more VMs", f.record.name);
                continue;
            }
            self.next_slot += 1;
            self.vms.insert(
                f.record.name.clone(),
                Vm::new(slot, f.record.name, f.paths, f.record.pid),
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

    /// Attributes of `node` of the VM in `slot`.
    fn attr_of(&mut self, slot: u32, node: Node) -> Result<FileAttr, i32> {
        let ino = join(slot, node);
        if node.disk == MADE_UP {
            return Ok(self.synthetic_attr(ino));
        }
        let name = self.by_slot.get(&slot).ok_or(libc::ENOENT)?;
        let vm = self.vms.get_mut(name).ok_or(libc::ENOENT)?;
        Ok(guest_attr(ino, &vm.stat(node)?))
    }

    fn getattr_inner(&mut self, ino: u64) -> Result<FileAttr, i32> {
        match ino {
            ROOT | HOST => Ok(self.synthetic_attr(ino)),
            _ => {
                let (slot, node) = split(ino);
                self.attr_of(slot, node)
            }
        }
    }

    fn lookup_inner(&mut self, parent: u64, name: &OsStr) -> Result<FileAttr, i32> {
        let (slot, node) = match parent {
            ROOT if name.as_bytes() == self.opts.host.as_bytes() => {
                return Ok(self.synthetic_attr(HOST))
            }
            ROOT => return Err(libc::ENOENT),
            HOST => {
                let n = name.to_str().ok_or(libc::ENOENT)?;
                if !self.vms.contains_key(n) {
                    self.rescan();
                }
                let vm = self.vms.get_mut(n).ok_or(libc::ENOENT)?;
                vm.refresh_mounts()?;
                (vm.slot, vm.root())
            }
            _ => {
                let (slot, dir) = split(parent);
                let vm = self.vm_of(parent).ok_or(libc::ENOENT)?;
                (slot, vm.lookup(dir, name.as_bytes())?)
            }
        };
        self.attr_of(slot, node)
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
                for vm in self.vms.values_mut() {
                    // A server that does not answer is still listed; looking it up fails.
                    let _ = vm.refresh_mounts();
                    let root = join(vm.slot, vm.root());
                    out.push(DirItem::Entry(
                        root,
                        FileType::Directory,
                        vm.name.as_bytes().to_vec(),
                    ));
                }
                Ok(out)
            }
            _ => {
                let (slot, dir) = split(ino);
                let vm = self.vm_of(ino).ok_or(libc::ENOENT)?;
                // `..` is answered by the kernel from its dentry cache; the number is unused.
                let mut out = vec![dot(ino), dotdot(ino)];
                out.extend(
                    vm.entries(dir)?
                        .into_iter()
                        .map(|(name, node, kind)| DirItem::Entry(join(slot, node), kind, name)),
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
        let (_, node) = split(ino);
        let Some(vm) = self.vm_of(ino) else {
            return reply.error(libc::ENOENT);
        };
        match vm.fs(node, FsRequest::ReadLink(node.ino)) {
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
        let (_, node) = split(ino);
        let Some(vm) = self.vm_of(ino) else {
            return reply.error(libc::ENOENT);
        };
        let req = FsRequest::Read {
            ino: node.ino,
            offset,
            len: size.min(MAX_READ),
        };
        match vm.fs(node, req) {
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

    /// VM slot 1 named `vm` whose runtime files are `paths`.
    fn test_vm(paths: VmPaths) -> Vm {
        Vm::new(1, "vm".into(), paths, 1)
    }

    #[test]
    fn inode_numbers_split_and_join() {
        let n = |disk, ino| Node { disk, ino };
        assert_eq!(split(join(7, n(0, 12))), (7, n(0, 12)));
        assert_eq!(split(join(7, n(3, 12))), (7, n(3, 12)));
        let max = (1 << SLOT_BITS) - 1;
        assert_eq!(
            split(join(max, n(MADE_UP, u32::MAX))),
            (max, n(MADE_UP, u32::MAX))
        );
        // Synthetic inodes live in slot 0, guest inodes never do.
        assert_eq!(split(ROOT).0, 0);
        assert_eq!(split(HOST).0, 0);
    }

    /// A one-directory file system: / (2) with `d` (12, a directory, empty), and `mnt` (13) when
    /// `with_mnt`, which holds `hidden` (14) — what a disk mounted on /mnt must hide.
    struct Disk {
        with_mnt: bool,
    }

    impl vmsight_fsview::FsRead for Disk {
        fn stat(&self, ino: u32) -> Option<vmsight_fsview::InodeMeta> {
            let known = matches!(ino, 2 | 12) || (self.with_mnt && matches!(ino, 13 | 14));
            known.then_some(vmsight_fsview::InodeMeta {
                mode: if ino == 14 { 0o100644 } else { 0o040755 },
                uid: 0,
                gid: 0,
                size: 0,
                mtime: 0,
                ctime: 0,
                atime: 0,
                links: 1,
            })
        }
        fn read_dir(&self, ino: u32) -> Option<Vec<vmsight_fsview::ViewEntry>> {
            let e = |name: &str, ino, kind| vmsight_fsview::ViewEntry {
                name: name.as_bytes().to_vec(),
                ino,
                kind,
            };
            match ino {
                2 if self.with_mnt => Some(vec![
                    e("d", 12, FileKind::Directory),
                    e("mnt", 13, FileKind::Directory),
                ]),
                2 => Some(vec![e("d", 12, FileKind::Directory)]),
                13 if self.with_mnt => Some(vec![e("hidden", 14, FileKind::Regular)]),
                12 => Some(Vec::new()),
                _ => None,
            }
        }
        fn lookup_in(&self, dir: u32, name: &[u8]) -> Option<u32> {
            self.read_dir(dir)?
                .into_iter()
                .find(|e| e.name == name)
                .map(|e| e.ino)
        }
        fn read_link(&self, _: u32) -> Option<Vec<u8>> {
            None
        }
        fn read(&self, _: u32, _: u64, _: &mut [u8]) -> vmsight_fsview::Result<usize> {
            Ok(0)
        }
    }

    fn names(entries: &[(Vec<u8>, Node, FileType)]) -> Vec<String> {
        entries
            .iter()
            .map(|(n, _, _)| String::from_utf8_lossy(n).into_owned())
            .collect()
    }

    #[test]
    fn disks_appear_at_their_mount_points_and_hide_what_is_below() {
        use crate::server::{ServedDisk, ViewServer};
        let dir = tempfile::tempdir().unwrap();
        let paths = VmPaths::new(dir.path());
        let disk = |disk, mount: &str, with_mnt| ServedDisk {
            disk,
            mount: mount.into(),
            source: Arc::new(Disk { with_mnt }) as Arc<dyn vmsight_fsview::FsRead>,
        };
        let _server = ViewServer::bind_disks(
            paths.view_socket(),
            vec![
                disk(0, "/", true),
                disk(1, "/mnt", false),
                disk(2, "/@disk2", false),
                disk(3, "/mnt/d/deeper", false),
            ],
        )
        .unwrap();
        let mut vm = test_vm(paths);
        vm.refresh_mounts().unwrap();
        let root = vm.root();
        assert_eq!(root, Node::root_of(0));
        let top = vm.entries(root).unwrap();
        assert_eq!(names(&top), ["@disk2", "d", "mnt"]);
        // /mnt is disk 1's root, not the root disk's directory 13 with `hidden`.
        let mnt = vm.lookup(root, b"mnt").unwrap();
        assert_eq!(mnt, Node::root_of(1));
        assert!(top.iter().any(|(n, node, _)| n == b"mnt" && *node == mnt));
        assert_eq!(vm.lookup(mnt, b"hidden"), Err(libc::ENOENT));
        assert_eq!(names(&vm.entries(mnt).unwrap()), ["d"]);
        // /mnt/d is disk 1's directory, leading to disk 3 on /mnt/d/deeper (made up: disk 1
        // has no `deeper`).
        let d = vm.lookup(mnt, b"d").unwrap();
        assert_eq!(d, Node { disk: 1, ino: 12 });
        assert_eq!(names(&vm.entries(d).unwrap()), ["deeper"]);
        assert_eq!(vm.lookup(d, b"deeper").unwrap(), Node::root_of(3));
        // /@disk2 is disk 2's root; the root disk's /d is untouched.
        assert_eq!(vm.lookup(root, b"@disk2").unwrap(), Node::root_of(2));
        let d0 = vm.lookup(root, b"d").unwrap();
        assert_eq!(d0, Node { disk: 0, ino: 12 });
        assert!(vm.entries(d0).unwrap().is_empty());
        assert_eq!(vm.lookup(root, b"nothing"), Err(libc::ENOENT));
    }

    #[test]
    fn a_mount_point_missing_on_the_disk_below_is_made_up() {
        use crate::server::{ServedDisk, ViewServer};
        let dir = tempfile::tempdir().unwrap();
        let paths = VmPaths::new(dir.path());
        let disk = |disk, mount: &str| ServedDisk {
            disk,
            mount: mount.into(),
            source: Arc::new(Disk { with_mnt: false }) as Arc<dyn vmsight_fsview::FsRead>,
        };
        let _server =
            ViewServer::bind_disks(paths.view_socket(), vec![disk(0, "/"), disk(1, "/srv/a")])
                .unwrap();
        let mut vm = test_vm(paths);
        vm.refresh_mounts().unwrap();
        let root = vm.root();
        let srv = vm.lookup(root, b"srv").unwrap();
        assert_eq!(srv.disk, MADE_UP);
        assert_eq!(names(&vm.entries(srv).unwrap()), ["a"]);
        assert_eq!(vm.lookup(srv, b"a").unwrap(), Node::root_of(1));
        assert_eq!(vm.lookup(srv, b"b"), Err(libc::ENOENT));
        // Looked up again: the same made-up directory.
        assert_eq!(vm.lookup(root, b"srv").unwrap(), srv);
    }

    #[test]
    fn a_vm_without_a_readable_disk_shows_an_empty_directory() {
        use crate::server::{ServedDisk, ViewServer};
        let dir = tempfile::tempdir().unwrap();
        let paths = VmPaths::new(dir.path());
        let root_disk = ServedDisk {
            disk: 0,
            mount: "/".into(),
            source: std::sync::RwLock::new(crate::server::Empty),
        };
        let server = ViewServer::bind_disks(paths.view_socket(), vec![root_disk]).unwrap();
        let mut vm = test_vm(paths);
        vm.refresh_mounts().unwrap();
        let root = vm.root();
        assert_eq!(root.disk, MADE_UP);
        assert!(vm.entries(root).unwrap().is_empty());
        assert_eq!(vm.lookup(root, b"etc"), Err(libc::ENOENT));
        // A server that is gone is an error, not an empty tree.
        drop(server);
        vm.client = None;
        assert_eq!(vm.refresh_mounts(), Err(libc::EIO));
    }

    #[test]
    fn times_before_the_epoch() {
        assert_eq!(time(-5), UNIX_EPOCH - Duration::from_secs(5));
        assert_eq!(time(5), UNIX_EPOCH + Duration::from_secs(5));
    }
}
