//! Pure logic of the plugin (no QEMU calls): argument parsing, the kernel profile, instruction
//! decoding, the syscall argument table and task classification. Kept free of QEMU symbols so
//! the tests can compile it on its own.

use std::path::{Path, PathBuf};

use vmsight_proto::profile::{KernelProfile, ProfileError};
use vmsight_proto::redirect::{Reg, NREGS};
use vmsight_ring::{MonitorFilters, COMM_LEN};

/// First non-canonical address above the lower (user) half on x86-64 (48-bit addressing).
pub const USER_SPACE_END: u64 = 0x0000_8000_0000_0000;
/// CR3 bits that are not part of the page-table base: PCID (11:0) and the no-flush bit (63).
pub const CR3_NON_BASE_BITS: u64 = 0xfff | (1 << 63);
/// Default number of syscalls between two publications of a vCPU's scoreboard count.
pub const DEFAULT_SYNC_EVERY: u64 = 1024;
/// Default number of `write(2)` buffer bytes captured (`buf=`).
pub const DEFAULT_BUF_BYTES: usize = 64;
/// Longest string argument captured (Linux `PATH_MAX`).
pub const MAX_STRING: usize = 4096;
/// Most `real_parent` hops a classification walks.
pub const MAX_ANCESTOR_HOPS: u32 = 64;

/// Default cap of bytes checksummed per syscall (`sumcap=`, KiB).
pub const DEFAULT_SUM_CAP_KIB: u64 = 1024;
/// Largest `sumcap=` (KiB): keeps a call's SUMS + head/tail DATA records within the 255 an
/// entry can announce.
pub const MAX_SUM_CAP_KIB: u64 = 2048;

pub(crate) const USAGE: &str = "usage: -plugin libvmsight_plugin.so,shm=PATH[,profile=PATH]\
                     [,records=on|off][,buf=N][,sync=N][,verbose=on|off][,sums=on|off]\
                     [,sumcap=KIB][,blk=PATH]";

/// Errors that make the plugin refuse to install.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// The mandatory `shm=` argument is absent.
    #[error("the argument shm=PATH (the channel file created by vmsight) is missing")]
    MissingShm,
    /// An argument is not `key=value`.
    #[error("the plugin argument {0:?} is not of the form key=value")]
    Malformed(String),
    /// An argument has an unusable value.
    #[error("the plugin argument {key}={value:?} is invalid: {reason}")]
    BadValue {
        /// Argument name.
        key: String,
        /// Its value.
        value: String,
        /// Why it was rejected.
        reason: &'static str,
    },
    /// An unknown argument.
    #[error(
        "The plugin argument {0:?} is unknown (known: shm, profile, records, buf, sync, verbose, \
         sums, sumcap, blk, symsync, count)."
    )]
    Unknown(String),
    /// The channel file could not be attached.
    #[error("cannot attach the vmsight channel: {0}")]
    Channel(#[from] vmsight_ring::Error),
    /// The kernel profile cannot be read.
    #[error("cannot use the kernel profile: {0}")]
    ProfileFile(#[source] ProfileError),
    /// The kernel profile lacks what the plugin needs.
    #[error("cannot use the kernel profile {path}: {source}")]
    Profile {
        /// The profile file.
        path: PathBuf,
        /// What is wrong.
        #[source]
        source: LayoutError,
    },
    /// Loaded into user-mode QEMU.
    #[error("the plugin needs full-system emulation (qemu-system-x86_64), not user mode")]
    NotSystemMode,
    /// Loaded into a QEMU for another architecture.
    #[error("the plugin supports only x86_64 guests, but QEMU emulates {0}")]
    WrongTarget(String),
    /// The channel has fewer vCPU slots than the machine can have vCPUs.
    #[error(
        "The machine can have {qemu} vCPUs but the channel file has only {channel} vCPU slots; \
         create the channel with at least {qemu}."
    )]
    TooManyVcpus {
        /// QEMU's maximum vCPU count.
        qemu: i64,
        /// Slots in the channel.
        channel: u32,
    },
}

/// Parsed plugin arguments.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// Channel file (`shm=`).
    pub shm: PathBuf,
    /// Kernel profile JSON (`profile=`); without it only counting works.
    pub profile: Option<PathBuf>,
    /// Monitoring and records (`records=`, default on). Off: count only, no callbacks.
    pub records: bool,
    /// `write`/`pwrite64` buffer bytes captured at entry (`buf=`, 0..=4096, default 64).
    pub buf: usize,
    /// Publish scoreboard counts every this many syscalls per vCPU (`sync=`).
    pub sync_every: u64,
    /// Print a per-vCPU summary to stderr at exit (`verbose=`).
    pub verbose: bool,
    /// Checksum read/write buffers of regular files (`sums=`, default on; needs the fd-table
    /// members in the profile).
    pub sums: bool,
    /// Most bytes checksummed per syscall (`sumcap=` in KiB, 4..=2048, default 1024).
    pub sum_cap: u64,
    /// Block-tag channel file (`blk=`): hook the guest's block submission and prctl entry
    /// and push one record per bio and per background declaration (FoxyIdle). Needs
    /// `profile=`.
    pub blk: Option<PathBuf>,
    /// SymCall's synchronous transport (`symsync=`, default off; API v7): arm every kernel
    /// translation block for kernel-triggered redirections and watch for return markers in
    /// kernel code. Needs `profile=`.
    pub symsync: bool,
    /// Count `syscall` instructions per vCPU (`count=`, default on). Off, with nothing else
    /// asked of the plugin (`records=off`, no `blk=`, no `symsync=`), the plugin is dormant.
    pub count: bool,
}

impl Options {
    /// Whether the plugin needs a translation callback. Registering one costs every guest
    /// memory access a store in QEMU 10 (the value is kept for memory callbacks, whether
    /// any plugin asked for them or not), so a plugin with nothing to do registers none.
    pub fn translates(&self) -> bool {
        self.count || self.records || self.blk.is_some() || self.symsync
    }

    /// Parses `key=value` arguments as QEMU passes them.
    pub fn parse<'a>(args: impl IntoIterator<Item = &'a str>) -> Result<Self, PluginError> {
        let mut shm = None;
        let mut o = Options {
            shm: PathBuf::new(),
            profile: None,
            records: true,
            buf: DEFAULT_BUF_BYTES,
            sync_every: DEFAULT_SYNC_EVERY,
            verbose: false,
            sums: true,
            sum_cap: DEFAULT_SUM_CAP_KIB * 1024,
            blk: None,
            symsync: false,
            count: true,
        };
        for arg in args {
            let (k, v) = arg
                .split_once('=')
                .ok_or_else(|| PluginError::Malformed(arg.to_string()))?;
            let bad = |reason| PluginError::BadValue {
                key: k.to_string(),
                value: v.to_string(),
                reason,
            };
            let boolean = || match v {
                "on" | "yes" | "true" => Ok(true),
                "off" | "no" | "false" => Ok(false),
                _ => Err(bad("expected on or off")),
            };
            match k {
                "shm" | "profile" | "blk" if v.is_empty() => return Err(bad("the path is empty")),
                "blk" => o.blk = Some(PathBuf::from(v)),
                "shm" => shm = Some(PathBuf::from(v)),
                "profile" => o.profile = Some(PathBuf::from(v)),
                "records" => o.records = boolean()?,
                "verbose" => o.verbose = boolean()?,
                "sums" => o.sums = boolean()?,
                "symsync" => o.symsync = boolean()?,
                "count" => o.count = boolean()?,
                "sumcap" => {
                    o.sum_cap = v
                        .parse::<u64>()
                        .ok()
                        .filter(|n| (4..=MAX_SUM_CAP_KIB).contains(n))
                        .ok_or_else(|| bad("expected KiB between 4 and 2048"))?
                        * 1024;
                }
                "buf" => {
                    o.buf = v
                        .parse::<usize>()
                        .ok()
                        .filter(|n| *n <= MAX_STRING)
                        .ok_or_else(|| bad("expected an integer between 0 and 4096"))?;
                }
                "sync" => {
                    o.sync_every = v
                        .parse::<u64>()
                        .ok()
                        .filter(|n| (1..=1 << 40).contains(n))
                        .ok_or_else(|| bad("expected an integer between 1 and 2^40"))?;
                }
                _ => return Err(PluginError::Unknown(arg.to_string())),
            }
        }
        o.shm = shm.ok_or(PluginError::MissingShm)?;
        Ok(o)
    }
}

// ---------------------------------------------------------------------------------------------
// Kernel profile

/// What the plugin needs from the kernel profile (`profile.json`, format in
/// [`vmsight_proto::profile`]): per-CPU `current_task`, a few `task_struct` and
/// `mm_struct` member offsets and the address of `page_offset_base`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelLayout {
    /// Offset of `current_task` in a CPU's per-CPU area (add the kernel GS base).
    pub current_task: u64,
    /// `task_struct.pid` offset (4 bytes).
    pub pid: u64,
    /// `task_struct.tgid` offset (4 bytes).
    pub tgid: u64,
    /// `task_struct.comm` offset (16 bytes).
    pub comm: u64,
    /// `task_struct.real_parent` offset (pointer).
    pub real_parent: u64,
    /// `task_struct.signal` offset (pointer): one `signal_struct` per process, shared by its
    /// threads and kept across execve, so it tells a process from a later one that reuses
    /// its PID.
    pub signal: u64,
    /// `task_struct.mm` offset (pointer).
    pub mm: u64,
    /// `mm_struct.pgd` offset (pointer, direct-map address).
    pub mm_pgd: u64,
    /// Address of the `page_offset_base` variable (holds the direct-map base).
    pub page_offset_base: u64,
    /// The fd-table path to a file's position and inode, when the profile has it (buffer
    /// checksums need it).
    pub files: Option<FileLayout>,
    /// The block submission path, when the profile has it (FoxyIdle's block tags need it).
    pub block: Option<BlockLayout>,
    /// Executable and working directory paths, when the profile has them.
    pub paths: Option<PathLayout>,
}

/// Where the plugin hooks the guest kernel for FoxyIdle, and the offsets it reads there:
/// `blk_mq_submit_bio(struct bio *bio)` entry (rdi = bio, in the submitter's context) and
/// `__x64_sys_prctl(const struct pt_regs *regs)` entry (rdi = the user registers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockLayout {
    /// Address of `blk_mq_submit_bio`.
    pub submit_bio: u64,
    /// Address of `__x64_sys_prctl`, when present (guest declarations need it).
    pub prctl: Option<u64>,
    /// `task_struct.flags` (u32).
    pub task_flags: u64,
    /// `bio.bi_bdev` (pointer).
    pub bi_bdev: u64,
    /// `bio.bi_opf` (u32).
    pub bi_opf: u64,
    /// `bio.bi_iter.bi_sector` (u64): `bi_iter` plus `bvec_iter.bi_sector`.
    pub bi_sector: u64,
    /// `bio.bi_iter.bi_size` (u32).
    pub bi_size: u64,
    /// `block_device.bd_disk` (pointer).
    pub bd_disk: u64,
    /// `gendisk.major` (i32).
    pub major: u64,
    /// `gendisk.first_minor` (i32).
    pub first_minor: u64,
    /// `gendisk.disk_name` (char[32]; the first 8 bytes are read).
    pub disk_name: u64,
    /// `pt_regs.{di,si,dx}`: the first three syscall arguments.
    pub regs_di: u64,
    pub regs_si: u64,
    pub regs_dx: u64,
}

impl BlockLayout {
    /// The hook addresses and offsets, when the profile has all of them (`prctl` optional).
    fn from_profile(p: &KernelProfile) -> Option<BlockLayout> {
        let m = |strukt, member, size| member_offset(p, strukt, member, size).ok();
        let iter = p.member("bio", "bi_iter").ok()?.offset;
        let name = p.member("gendisk", "disk_name").ok()?;
        if name.size < 8 || name.offset > MAX_MEMBER_OFFSET {
            return None;
        }
        Some(BlockLayout {
            submit_bio: symbol(p, "blk_mq_submit_bio").ok()?,
            prctl: symbol(p, "__x64_sys_prctl").ok(),
            task_flags: m("task_struct", "flags", 4)?,
            bi_bdev: m("bio", "bi_bdev", 8)?,
            bi_opf: m("bio", "bi_opf", 4)?,
            bi_sector: iter.checked_add(m("bvec_iter", "bi_sector", 8)?)?,
            bi_size: iter.checked_add(m("bvec_iter", "bi_size", 4)?)?,
            bd_disk: m("block_device", "bd_disk", 8)?,
            major: m("gendisk", "major", 4)?,
            first_minor: m("gendisk", "first_minor", 4)?,
            disk_name: name.offset,
            regs_di: m("pt_regs", "di", 8)?,
            regs_si: m("pt_regs", "si", 8)?,
            regs_dx: m("pt_regs", "dx", 8)?,
        })
    }
}

/// Offsets along `current->files->fdt->fd[fd]->{f_pos,f_flags,f_inode->{i_size,i_mode}}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FileLayout {
    /// `task_struct.files` (pointer).
    pub task_files: u64,
    /// `files_struct.fdt` (pointer).
    pub files_fdt: u64,
    /// `fdtable.max_fds` (u32).
    pub fdt_max_fds: u64,
    /// `fdtable.fd` (pointer to the `struct file *` array).
    pub fdt_fd: u64,
    /// `file.f_pos` (loff_t).
    pub f_pos: u64,
    /// `file.f_flags` (u32).
    pub f_flags: u64,
    /// `file.f_inode` (pointer).
    pub f_inode: u64,
    /// `inode.i_size` (loff_t).
    pub i_size: u64,
    /// `inode.i_mode` (u16).
    pub i_mode: u64,
}

/// What the plugin cannot find in a kernel profile.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    /// A symbol is missing.
    #[error("it has no symbol {0}")]
    MissingSymbol(String),
    /// A struct member is missing.
    #[error("it has no member {strukt}.{member}")]
    MissingMember {
        /// The struct.
        strukt: String,
        /// The member.
        member: String,
    },
    /// A member has another size than the plugin reads, or an implausible offset.
    #[error("{strukt}.{member} has size {size} at offset {offset}, expected {expected} bytes")]
    BadMember {
        /// The struct.
        strukt: String,
        /// The member.
        member: String,
        /// Its size in the profile.
        size: u64,
        /// Its offset in the profile.
        offset: u64,
        /// The size the plugin reads.
        expected: u64,
    },
    /// `current_task` is not a per-CPU offset.
    #[error("current_task ({0:#x}) is not a per-CPU offset")]
    NotPerCpu(u64),
}

/// Largest struct member offset believed (a corrupt profile must not send reads far away).
const MAX_MEMBER_OFFSET: u64 = 1 << 20;

/// The offset of `strukt.member`, checking it has `size` bytes.
fn member_offset(
    p: &KernelProfile,
    strukt: &str,
    member: &str,
    size: u64,
) -> Result<u64, LayoutError> {
    let m = p
        .member(strukt, member)
        .map_err(|_| LayoutError::MissingMember {
            strukt: strukt.into(),
            member: member.into(),
        })?;
    if m.size != size || m.offset > MAX_MEMBER_OFFSET {
        return Err(LayoutError::BadMember {
            strukt: strukt.into(),
            member: member.into(),
            size: m.size,
            offset: m.offset,
            expected: size,
        });
    }
    Ok(m.offset)
}

fn symbol(p: &KernelProfile, name: &str) -> Result<u64, LayoutError> {
    p.symbol(name)
        .map_err(|_| LayoutError::MissingSymbol(name.into()))
}

impl FileLayout {
    /// The fd-table offsets, when the profile has all of them.
    fn from_profile(p: &KernelProfile) -> Option<FileLayout> {
        let m = |strukt, member, size| member_offset(p, strukt, member, size).ok();
        Some(FileLayout {
            task_files: m("task_struct", "files", 8)?,
            files_fdt: m("files_struct", "fdt", 8)?,
            fdt_max_fds: m("fdtable", "max_fds", 4)?,
            fdt_fd: m("fdtable", "fd", 8)?,
            f_pos: m("file", "f_pos", 8)?,
            f_flags: m("file", "f_flags", 4)?,
            f_inode: m("file", "f_inode", 8)?,
            i_size: m("inode", "i_size", 8)?,
            i_mode: m("inode", "i_mode", 2)?,
        })
    }
}

/// Where a task's executable and working directory are, and the offsets `d_path` walks:
/// `task->mm->exe_file->f_path` and `task->fs->pwd`, then `dentry->d_parent` up to the mount's
/// root and `mount->mnt_parent`/`mnt_mountpoint` across mounts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathLayout {
    pub task_mm: u64,
    pub mm_exe_file: u64,
    pub file_path: u64,
    pub task_fs: u64,
    pub fs_pwd: u64,
    pub path_mnt: u64,
    pub path_dentry: u64,
    pub dentry_parent: u64,
    pub dentry_name: u64,
    pub qstr_len: u64,
    pub qstr_name: u64,
    pub vfsmount_root: u64,
    /// `mount.mnt`: the `struct vfsmount` embedded in a `struct mount`.
    pub mount_mnt: u64,
    pub mount_parent: u64,
    pub mount_mountpoint: u64,
}

impl PathLayout {
    /// The offsets, when the profile has all of them.
    fn from_profile(p: &KernelProfile) -> Option<PathLayout> {
        let m = |strukt, member, size| member_offset(p, strukt, member, size).ok();
        // Embedded structs: any size, a plausible offset.
        let e = |strukt, member| {
            p.member(strukt, member)
                .ok()
                .map(|m| m.offset)
                .filter(|&o| o <= MAX_MEMBER_OFFSET)
        };
        Some(PathLayout {
            task_mm: m("task_struct", "mm", 8)?,
            mm_exe_file: m("mm_struct", "exe_file", 8)?,
            file_path: m("file", "f_path", 16)?,
            task_fs: m("task_struct", "fs", 8)?,
            fs_pwd: m("fs_struct", "pwd", 16)?,
            path_mnt: m("path", "mnt", 8)?,
            path_dentry: m("path", "dentry", 8)?,
            dentry_parent: m("dentry", "d_parent", 8)?,
            dentry_name: e("dentry", "d_name")?,
            qstr_len: m("qstr", "len", 4)?,
            qstr_name: m("qstr", "name", 8)?,
            vfsmount_root: m("vfsmount", "mnt_root", 8)?,
            mount_mnt: e("mount", "mnt")?,
            mount_parent: m("mount", "mnt_parent", 8)?,
            mount_mountpoint: m("mount", "mnt_mountpoint", 8)?,
        })
    }
}

/// Reads guest kernel memory (the plugin's vCPU reads; tests use a map).
pub trait KernelRead {
    /// Fills `out` from `addr`; false if any of it could not be read.
    fn read(&mut self, addr: u64, out: &mut [u8]) -> bool;

    fn u64_at(&mut self, addr: u64) -> Option<u64> {
        let mut b = [0u8; 8];
        self.read(addr, &mut b).then(|| u64::from_le_bytes(b))
    }
}

/// Longest path [`d_path`] renders (the kernel's `PATH_MAX`).
pub const PATH_MAX: usize = 4096;
/// Most components and mount crossings [`d_path`] walks.
pub const MAX_PATH_STEPS: usize = 256;
/// Longest name of one component (`NAME_MAX`).
const NAME_MAX: usize = 255;

/// Renders the `struct path` at `path` like the kernel's `d_path` into `out` (cleared): the
/// dentry names up to the mount's root, crossing to the parent mount at each mount root,
/// until the root of the mount tree. `None` when a read fails or the walk is implausible
/// (too deep, too long, a name longer than `NAME_MAX`): guest memory is untrusted.
pub fn d_path<M: KernelRead>(
    l: &PathLayout,
    m: &mut M,
    path: u64,
    out: &mut Vec<u8>,
) -> Option<()> {
    let mut vfsmnt = m.u64_at(path.wrapping_add(l.path_mnt))?;
    let mut dentry = m.u64_at(path.wrapping_add(l.path_dentry))?;
    let mut mount = vfsmnt.checked_sub(l.mount_mnt)?;
    // Components are collected leaf first, then reversed.
    let mut parts: Vec<(usize, usize)> = Vec::new();
    let mut names: Vec<u8> = Vec::new();
    for _ in 0..MAX_PATH_STEPS {
        let root = m.u64_at(vfsmnt.wrapping_add(l.vfsmount_root))?;
        if dentry == root {
            let parent = m.u64_at(mount.wrapping_add(l.mount_parent))?;
            if parent == mount {
                join_reversed(&parts, &names, out);
                return Some(());
            }
            dentry = m.u64_at(mount.wrapping_add(l.mount_mountpoint))?;
            mount = parent;
            vfsmnt = mount.wrapping_add(l.mount_mnt);
            continue;
        }
        let parent = m.u64_at(dentry.wrapping_add(l.dentry_parent))?;
        if parent == dentry {
            join_reversed(&parts, &names, out); // a disconnected tree
            return Some(());
        }
        let q = dentry.wrapping_add(l.dentry_name);
        let mut b4 = [0u8; 4];
        if !m.read(q.wrapping_add(l.qstr_len), &mut b4) {
            return None;
        }
        let len = u32::from_le_bytes(b4) as usize;
        if len == 0 || len > NAME_MAX || names.len() + parts.len() + len + 1 > PATH_MAX {
            return None;
        }
        let name = m.u64_at(q.wrapping_add(l.qstr_name))?;
        let at = names.len();
        names.resize(at + len, 0);
        if !m.read(name, &mut names[at..]) {
            return None;
        }
        parts.push((at, len));
        dentry = parent;
    }
    None
}

fn join_reversed(parts: &[(usize, usize)], names: &[u8], out: &mut Vec<u8>) {
    out.clear();
    for &(at, len) in parts.iter().rev() {
        out.push(b'/');
        out.extend_from_slice(&names[at..at + len]);
    }
    if out.is_empty() {
        out.push(b'/');
    }
}

/// A task's executable path (`task->mm->exe_file`), `None` for a kernel thread, an exiting
/// task or a failed read.
pub fn task_exe<M: KernelRead>(
    l: &PathLayout,
    m: &mut M,
    task: u64,
    out: &mut Vec<u8>,
) -> Option<()> {
    let mm = m.u64_at(task.wrapping_add(l.task_mm)).filter(|&p| p != 0)?;
    let file = m
        .u64_at(mm.wrapping_add(l.mm_exe_file))
        .filter(|&p| p != 0)?;
    d_path(l, m, file.wrapping_add(l.file_path), out)
}

/// A task's working directory (`task->fs->pwd`), `None` for an exiting task or a failed read.
pub fn task_cwd<M: KernelRead>(
    l: &PathLayout,
    m: &mut M,
    task: u64,
    out: &mut Vec<u8>,
) -> Option<()> {
    let fs = m.u64_at(task.wrapping_add(l.task_fs)).filter(|&p| p != 0)?;
    d_path(l, m, fs.wrapping_add(l.fs_pwd), out)
}

impl KernelLayout {
    /// Extracts the layout from a kernel profile.
    pub fn from_profile(p: &KernelProfile) -> Result<Self, LayoutError> {
        // Per-CPU symbols are offsets from __per_cpu_start (0 on x86-64 with absolute
        // per-CPU symbols).
        let pcpu_start = symbol(p, "__per_cpu_start").unwrap_or(0);
        let current_task = symbol(p, "current_task")?.wrapping_sub(pcpu_start);
        if current_task >= 1 << 32 {
            return Err(LayoutError::NotPerCpu(current_task));
        }
        let m = |strukt, member, size| member_offset(p, strukt, member, size);
        Ok(Self {
            current_task,
            pid: m("task_struct", "pid", 4)?,
            tgid: m("task_struct", "tgid", 4)?,
            comm: m("task_struct", "comm", COMM_LEN as u64)?,
            real_parent: m("task_struct", "real_parent", 8)?,
            signal: m("task_struct", "signal", 8)?,
            mm: m("task_struct", "mm", 8)?,
            mm_pgd: m("mm_struct", "pgd", 8)?,
            page_offset_base: symbol(p, "page_offset_base")?,
            files: FileLayout::from_profile(p),
            block: BlockLayout::from_profile(p),
            paths: PathLayout::from_profile(p),
        })
    }

    /// Reads a profile file and extracts the layout.
    pub fn load(path: &Path) -> Result<Self, PluginError> {
        let profile = KernelProfile::load(path).map_err(PluginError::ProfileFile)?;
        Self::from_profile(&profile).map_err(|source| PluginError::Profile {
            path: path.to_owned(),
            source,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Instructions

/// True if `bytes` (one whole decoded instruction) is `syscall`: `0f 05` preceded only by
/// legacy or REX prefixes.
pub fn is_syscall_insn(bytes: &[u8]) -> bool {
    let Some((prefixes, op)) = bytes.split_last_chunk::<2>() else {
        return false;
    };
    *op == [0x0f, 0x05] && prefixes.iter().all(|&b| is_prefix(b))
}

/// True if `bytes` (one whole decoded instruction) enters the kernel through a 32-bit
/// system call gate: `int 0x80` (`cd 80`) or `sysenter` (`0f 34`), with legacy or REX
/// prefixes only. A 64-bit Debian userland never uses them (glibc's x86-64 ABI is `syscall`);
/// 32-bit (i386) programs and hand-written code do.
pub fn is_compat_syscall_insn(bytes: &[u8]) -> bool {
    let Some((prefixes, op)) = bytes.split_last_chunk::<2>() else {
        return false;
    };
    (*op == [0xcd, 0x80] || *op == [0x0f, 0x34]) && prefixes.iter().all(|&b| is_prefix(b))
}

/// A legacy (segment, operand/address size, lock, rep) or REX prefix byte.
fn is_prefix(b: u8) -> bool {
    matches!(
        b,
        0x26 | 0x2e | 0x36 | 0x3e | 0x64 | 0x65 | 0x66 | 0x67 | 0xf0 | 0xf2 | 0xf3
    ) || (0x40..=0x4f).contains(&b)
}

/// Kernel instructions the plugin instruments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelInsn {
    /// `mov %reg, %cr3`; `reg` is the source GPR number (0 = rax … 15 = r15).
    Cr3Write {
        /// Source register number.
        reg: u8,
    },
    /// `sysretq` (`48 0f 07`).
    Sysretq,
    /// `iretq` (`48 cf`).
    Iretq,
}

/// Decodes one whole kernel instruction. `mov %reg, %cr3` is `0f 22 /r` with ModRM.reg = 3
/// (the mod field is ignored: the operand is always a register), optionally preceded by one
/// REX prefix whose B bit extends r/m (REX.R would select CR11, which does not exist;
/// REX.W is ignored in 64-bit mode). `sysretq`/`iretq` need REX.W (their forms without it
/// return to 32-bit code, which the 64-bit syscall path never does).
pub fn decode_kernel_insn(bytes: &[u8]) -> Option<KernelInsn> {
    match bytes {
        [0x48, 0x0f, 0x07] => Some(KernelInsn::Sysretq),
        [0x48, 0xcf] => Some(KernelInsn::Iretq),
        [0x0f, 0x22, modrm] if modrm & 0x38 == 0x18 => {
            Some(KernelInsn::Cr3Write { reg: modrm & 7 })
        }
        [rex @ 0x40..=0x4f, 0x0f, 0x22, modrm] if modrm & 0x38 == 0x18 && rex & 0x4 == 0 => {
            Some(KernelInsn::Cr3Write {
                reg: (modrm & 7) | ((rex & 1) << 3),
            })
        }
        _ => None,
    }
}

/// Names of the GPRs by x86 register number, as QEMU's gdbstub names them.
pub const GPR_NAMES: [&str; 16] = [
    "rax", "rcx", "rdx", "rbx", "rsp", "rbp", "rsi", "rdi", "r8", "r9", "r10", "r11", "r12", "r13",
    "r14", "r15",
];

/// Page-table base of a CR3 value (PCID and no-flush bits cleared).
pub fn cr3_base(cr3: u64) -> u64 {
    cr3 & !CR3_NON_BASE_BITS
}

/// True for an address in the upper (kernel) half, with 4- or 5-level paging.
pub fn is_kernel_addr(a: u64) -> bool {
    a >> 63 == 1
}

// ---------------------------------------------------------------------------------------------
// Syscall tables (x86-64 numbers)

/// Linux x86-64 syscall numbers the plugin acts on.
pub mod nr {
    #![allow(missing_docs)]
    pub const READ: u32 = 0;
    pub const WRITE: u32 = 1;
    pub const PREAD64: u32 = 17;
    pub const PWRITE64: u32 = 18;
    pub const READV: u32 = 19;
    pub const WRITEV: u32 = 20;
    pub const PREADV: u32 = 295;
    pub const PWRITEV: u32 = 296;
    pub const PREADV2: u32 = 327;
    pub const PWRITEV2: u32 = 328;
    pub const CLONE: u32 = 56;
    pub const FORK: u32 = 57;
    pub const VFORK: u32 = 58;
    pub const EXECVE: u32 = 59;
    pub const EXIT: u32 = 60;
    pub const CHDIR: u32 = 80;
    pub const FCHDIR: u32 = 81;
    pub const PRCTL: u32 = 157;
    pub const EXIT_GROUP: u32 = 231;
    pub const OPENAT: u32 = 257;
    pub const EXECVEAT: u32 = 322;
    pub const CLONE3: u32 = 435;
}

/// Calls after which a task's executable or working directory may differ: the plugin reads
/// them again at a successful return.
pub fn changes_details(nr: u32) -> bool {
    matches!(nr, nr::EXECVE | nr::EXECVEAT | nr::CHDIR | nr::FCHDIR)
}

/// `clone` flag: the new task is a thread of the caller's process.
pub const CLONE_THREAD: u64 = 0x0001_0000;

/// Indices of the NUL-terminated string arguments (paths, names) of syscall `nr`, captured
/// at entry: the single syscall table of [`vmsight_proto::syscall`].
pub fn string_args(nr: u32) -> impl Iterator<Item = u8> {
    vmsight_proto::syscall::string_args(u64::from(nr))
}

/// Indices of the `loff_t *` arguments of syscall `nr` (sendfile, splice, copy_file_range)
/// whose 8-byte value is captured at entry when the pointer is not NULL.
pub fn offset_args(nr: u32) -> impl Iterator<Item = u8> {
    vmsight_proto::syscall::offset_args(u64::from(nr))
}

/// For syscalls whose buffer the plugin captures: `(pointer arg, length arg)`.
pub fn buffer_arg(nr: u32) -> Option<(usize, usize)> {
    vmsight_proto::syscall::buffer_arg(u64::from(nr))
}

/// `O_APPEND` in `file->f_flags`.
pub const O_APPEND: u32 = 0o2000;
/// `S_IFMT` / `S_IFREG` of `inode->i_mode`.
pub const S_IFMT: u16 = 0o170000;
/// Regular file.
pub const S_IFREG: u16 = 0o100000;

/// Where a checksummed call's file position comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PosArg {
    /// The file's position (`read`, `write`, `readv`, `writev`).
    FilePos,
    /// The 4th argument (`pread64`, `pwrite64`, `preadv`, `pwritev`).
    Arg3,
    /// The 4th argument, or the file's position when it is -1 (`preadv2`, `pwritev2`).
    Arg3OrFilePos,
}

/// How a checksummed I/O call describes its buffer and file position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SumKind {
    /// A read (checksummed at its return), else a write (at its entry).
    pub read: bool,
    /// The 2nd argument is an array of `struct iovec`, the 3rd its length; else a buffer
    /// and its length.
    pub vectored: bool,
    pub pos: PosArg,
    /// The 6th argument holds `RWF_*` flags (`preadv2`, `pwritev2`).
    pub rwf_flags: bool,
}

/// Buffer checksums the plugin computes for syscall `nr` (Sky §3.4), plain and vectored.
pub fn sum_kind(nr: u32) -> Option<SumKind> {
    let k = |read, vectored, pos, rwf_flags| {
        Some(SumKind {
            read,
            vectored,
            pos,
            rwf_flags,
        })
    };
    match nr {
        nr::READ => k(true, false, PosArg::FilePos, false),
        nr::WRITE => k(false, false, PosArg::FilePos, false),
        nr::PREAD64 => k(true, false, PosArg::Arg3, false),
        nr::PWRITE64 => k(false, false, PosArg::Arg3, false),
        nr::READV => k(true, true, PosArg::FilePos, false),
        nr::WRITEV => k(false, true, PosArg::FilePos, false),
        nr::PREADV => k(true, true, PosArg::Arg3, false),
        nr::PWRITEV => k(false, true, PosArg::Arg3, false),
        nr::PREADV2 => k(true, true, PosArg::Arg3OrFilePos, true),
        nr::PWRITEV2 => k(false, true, PosArg::Arg3OrFilePos, true),
        _ => None,
    }
}

/// `RWF_APPEND` / `RWF_NOAPPEND` of `preadv2`/`pwritev2` (Linux 4.16 / 6.0).
pub const RWF_APPEND: u64 = 0x10;
pub const RWF_NOAPPEND: u64 = 0x20;

/// Whether a write of kind `k` with arguments `args` to a file with `f_flags` appends at
/// `i_size`: `O_APPEND` does even for a positional write, `RWF_APPEND` asks for it per call
/// and `RWF_NOAPPEND` cancels `O_APPEND` (mm/filemap.c, `kiocb_set_rw_flags`).
pub fn write_appends(k: SumKind, args: &[u64; 6], f_flags: u32) -> bool {
    let rwf = if k.rwf_flags { args[5] } else { 0 };
    if rwf & RWF_APPEND != 0 {
        return true;
    }
    f_flags & O_APPEND != 0 && rwf & RWF_NOAPPEND == 0
}

/// Most `struct iovec` entries of one call (the kernel's `UIO_MAXIOV`; more is `EINVAL`).
pub const MAX_IOV: u64 = 1024;

/// One piece of a (possibly vectored) buffer: its first byte's offset in the whole buffer,
/// its guest address and its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Segment {
    pub start: u64,
    pub addr: u64,
    pub len: u64,
}

/// Builds the segment list of an iovec array from its raw little-endian bytes (16 per entry:
/// base, length), skipping empty entries. Returns the total length (saturating), or `None`
/// for a length the kernel refuses (`EINVAL`: one above `isize::MAX`).
pub fn iov_segments(raw: &[u8], out: &mut Vec<Segment>) -> Option<u64> {
    out.clear();
    let mut total = 0u64;
    for e in raw.chunks_exact(16) {
        let word = |i: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&e[i..i + 8]);
            u64::from_le_bytes(b)
        };
        let (addr, len) = (word(0), word(8));
        if len > i64::MAX as u64 {
            return None;
        }
        if len == 0 {
            continue;
        }
        out.push(Segment {
            start: total,
            addr,
            len,
        });
        total = total.saturating_add(len);
    }
    Some(total)
}

/// Splits the byte range `[off, off + len)` of a segmented buffer into guest address runs,
/// calling `f(addr, dst_offset, n)` for each in order; stops at the buffer's end. Returns
/// the bytes covered.
pub fn for_each_run(
    segs: &[Segment],
    off: u64,
    len: u64,
    mut f: impl FnMut(u64, usize, usize),
) -> u64 {
    let mut i = segs.partition_point(|s| s.start.saturating_add(s.len) <= off);
    let mut done = 0u64;
    while done < len {
        let Some(s) = segs.get(i) else { break };
        let at = off + done;
        let inner = at.saturating_sub(s.start);
        let n = (s.len - inner).min(len - done);
        f(s.addr.wrapping_add(inner), done as usize, n as usize);
        done += n;
        i += 1;
    }
    done
}

/// How a buffer of `len` bytes written at file position `pos` splits into 4 KiB
/// file-offset-aligned chunks (Sky §3.4.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkPlan {
    /// Buffer offset of the first whole chunk.
    pub first_buf: u64,
    /// Chunk index (file offset / 4096) of the first whole chunk.
    pub first_chunk: u64,
    /// Whole chunks inside the buffer.
    pub whole: u64,
    /// Bytes before the first whole chunk (the partial head; the whole buffer when it has
    /// no whole chunk and does not cross a boundary).
    pub head_len: u64,
    /// Buffer offset and length of the partial tail after the last whole chunk (0 length:
    /// none). When the buffer has no whole chunk but crosses one boundary, head and tail are
    /// the two sides of it.
    pub tail_start: u64,
    /// Length of the tail.
    pub tail_len: u64,
}

/// Plans the chunks of a buffer of `len` bytes at file position `pos`.
pub fn chunk_plan(pos: u64, len: u64) -> ChunkPlan {
    const C: u64 = 4096;
    let end = pos.saturating_add(len);
    let first_off = pos.div_ceil(C).saturating_mul(C); // first boundary at or after pos
    let last_off = end / C * C; // last boundary at or before end
    if first_off >= end || first_off > last_off {
        // No boundary strictly inside: one partial piece.
        return ChunkPlan {
            first_buf: len,
            first_chunk: first_off / C,
            whole: 0,
            head_len: len,
            tail_start: len,
            tail_len: 0,
        };
    }
    let head_len = first_off - pos;
    let whole = (last_off - first_off) / C;
    ChunkPlan {
        first_buf: head_len,
        first_chunk: first_off / C,
        whole,
        head_len,
        tail_start: last_off - pos,
        tail_len: end - last_off,
    }
}

/// What a monitored syscall entry means for classification.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifecycle {
    /// Nothing.
    None,
    /// May create a new process (fork, vfork, clone without CLONE_THREAD, clone3 unless the
    /// flags say thread): invalidate classifications so the child is classified fresh.
    Fork,
    /// `clone3`: the flags are in user memory (`struct clone_args.flags`, first word at
    /// arg 0); read them to decide.
    Clone3,
    /// `exit_group`: the process ends; forget it and invalidate.
    ExitGroup,
}

/// Classifies a syscall entry by its effect on the process tree.
pub fn lifecycle(nr: u32, arg0: u64) -> Lifecycle {
    match nr {
        nr::FORK | nr::VFORK => Lifecycle::Fork,
        nr::CLONE if arg0 & CLONE_THREAD == 0 => Lifecycle::Fork,
        nr::CLONE3 => Lifecycle::Clone3,
        nr::EXIT_GROUP => Lifecycle::ExitGroup,
        _ => Lifecycle::None,
    }
}

/// Where a string argument ends within a chunk just read: `Some(len)` if a NUL is at `len`.
pub fn nul_position(chunk: &[u8]) -> Option<usize> {
    chunk.iter().position(|&b| b == 0)
}

/// Splits `len` captured bytes into DATA pieces of `cap` bytes: yields (offset, length).
/// An empty capture still yields one (empty) piece so every captured argument has a record
/// carrying its FINAL/FAULT/TRUNCATED flags.
pub fn pieces(len: usize, cap: usize) -> impl Iterator<Item = (usize, usize)> {
    let cap = cap.max(1);
    let n = len.div_ceil(cap).max(1);
    (0..n).map(move |i| (i * cap, (len - i * cap).min(cap)))
}

// ---------------------------------------------------------------------------------------------
// Classification

/// The task fields a classification reads for each task it visits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskFields {
    /// `task->pid`.
    pub pid: u32,
    /// `task->tgid`.
    pub tgid: u32,
    /// `task->real_parent`.
    pub real_parent: u64,
    /// `task->signal`: the process's identity while it lives (see [`MonitoredSet`]).
    pub signal: u64,
    /// `task->comm`.
    pub comm: [u8; COMM_LEN],
}

/// The processes the plugin monitors: TGID → the process's `signal_struct` (0: not seen yet,
/// a TGID vmsight asked for, bound at first sight).
///
/// A process that dies without `exit_group` (killed by a signal) is never seen leaving; when
/// its TGID comes back on another process (PID reuse), the identity differs, the stale entry
/// is dropped and the newcomer is classified on its own (comm and ancestors).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MonitoredSet(std::collections::BTreeMap<u32, u64>);

impl MonitoredSet {
    /// A set of TGIDs vmsight gave, bound to the first process seen with each.
    pub fn from_tgids(tgids: impl IntoIterator<Item = u32>) -> Self {
        Self(tgids.into_iter().map(|t| (t, 0)).collect())
    }

    /// Whether `t`'s process is monitored.
    pub fn contains(&self, t: &TaskFields) -> bool {
        self.0
            .get(&t.tgid)
            .is_some_and(|&id| id == 0 || id == t.signal)
    }

    /// Records `t`'s process as monitored, binding an unbound TGID; true when the TGID list
    /// changed.
    pub fn insert(&mut self, t: &TaskFields) -> bool {
        self.0.insert(t.tgid, t.signal).is_none()
    }

    /// Drops the entry of `t`'s TGID when it belongs to another process (which died unseen);
    /// true when one was dropped.
    pub fn drop_stale(&mut self, t: &TaskFields) -> bool {
        let stale = self
            .0
            .get(&t.tgid)
            .is_some_and(|&id| id != 0 && id != t.signal);
        if stale {
            self.0.remove(&t.tgid);
        }
        stale
    }

    /// Forgets a process that called `exit_group`; true when it was there.
    pub fn remove(&mut self, tgid: u32) -> bool {
        self.0.remove(&tgid).is_some()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The monitored TGIDs, ascending.
    pub fn tgids(&self) -> impl Iterator<Item = u32> + '_ {
        self.0.keys().copied()
    }
}

/// Access to guest tasks (the plugin reads guest memory; tests use a map).
pub trait TaskMemory {
    /// Reads the fields of the task at `task`, or `None` if the read failed.
    fn fields(&mut self, task: u64) -> Option<TaskFields>;
}

/// Why a task is monitored (or not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// `monitor_all` is set.
    All,
    /// Its TGID is monitored.
    Tgid,
    /// Its comm matches a filter.
    Comm,
    /// An ancestor (that many hops up) is monitored by TGID or comm.
    Ancestor(u32),
    /// Not monitored.
    No,
}

impl Verdict {
    /// True for every verdict but [`Verdict::No`].
    pub fn monitored(self) -> bool {
        self != Verdict::No
    }
}

/// Result of [`classify`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Classification {
    /// The decision.
    pub verdict: Verdict,
    /// `real_parent` hops walked.
    pub hops: u32,
    /// A task read failed during the walk (the walk stopped there; the verdict is what was
    /// known so far).
    pub read_error: bool,
}

/// Decides whether the task `me` is monitored: if `monitor_all`, or its process or an
/// ancestor's is monitored (`is_monitored`: the filter TGIDs plus processes the plugin
/// already monitors, [`MonitoredSet::contains`]), or its or an ancestor's comm matches a
/// filter. Walks `real_parent` at
/// most [`MAX_ANCESTOR_HOPS`] times, stopping at pid 1 (init), pid 0 or a self-parent.
pub fn classify<M: TaskMemory>(
    f: &MonitorFilters,
    is_monitored: impl Fn(&TaskFields) -> bool,
    me: &TaskFields,
    mem: &mut M,
) -> Classification {
    let done = |verdict, hops, read_error| Classification {
        verdict,
        hops,
        read_error,
    };
    if f.monitor_all {
        return done(Verdict::All, 0, false);
    }
    if is_monitored(me) {
        return done(Verdict::Tgid, 0, false);
    }
    if f.comm_matches(&me.comm) {
        return done(Verdict::Comm, 0, false);
    }
    if me.pid <= 1 {
        return done(Verdict::No, 0, false);
    }
    let mut cur = me.real_parent;
    let mut hops = 0;
    while hops < MAX_ANCESTOR_HOPS && cur != 0 {
        let Some(t) = mem.fields(cur) else {
            return done(Verdict::No, hops, true);
        };
        hops += 1;
        if t.pid == 0 {
            break; // the idle task (parent of init and kthreadd) is nobody's monitored parent
        }
        if is_monitored(&t) || f.comm_matches(&t.comm) {
            return done(Verdict::Ancestor(hops), hops, false);
        }
        if t.pid <= 1 || t.real_parent == cur {
            break;
        }
        cur = t.real_parent;
    }
    done(Verdict::No, hops, false)
}

/// The registers that differ between `saved` and `now` (bit `i`: `Reg::ALL[i]`).
///
/// EFLAGS.RF is left out: when the guest takes an interrupt between the restore and the
/// `syscall` instruction (QEMU checks for one right after the PC moves), QEMU pushes RF=1 for
/// a hardware interrupt, the guest's `iretq` restores it, and it stays set until the end of the
/// first block it returns to, which starts at that instruction. RF only suppresses a code
/// breakpoint on that one instruction (and `syscall` stores RFLAGS without it), so the
/// guest's state is still the saved one.
pub fn mismatch_mask(saved: &[u64; NREGS], now: &[u64; NREGS]) -> u64 {
    Reg::ALL
        .iter()
        .filter(|r| {
            let ignore = if **r == Reg::Eflags { EFLAGS_RF } else { 0 };
            (now[r.index()] ^ saved[r.index()]) & !ignore != 0
        })
        .fold(0u64, |m, r| m | 1 << r.index())
}

/// The interrupt flag in EFLAGS.
pub const EFLAGS_IF: u64 = 1 << 9;
/// The resume flag in EFLAGS.
pub const EFLAGS_RF: u64 = 1 << 16;
