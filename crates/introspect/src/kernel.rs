//! Linux kernel objects read from guest memory with the kernel profile: tasks, their
//! executables, working directories and open files, and the per-CPU current task.
//!
//! [`KernelView::new`] locates the kernel image in guest RAM (`phys_base`), derives the paging
//! depth, and from then on reads kernel virtual addresses through the kernel's own page tables
//! (`init_top_pgt`). Every walk is bounded ([`Limits`]), lists are checked for loops and
//! pointers for plausibility: the guest keeps running while we read, so a racing or corrupt
//! structure yields a [`KernelError`], never a hang or a panic.

use std::collections::HashSet;
use std::sync::Arc;

use serde::Serialize;
use thiserror::Error;

use crate::memory::{AddressSpace, GuestRam, MemError, PagingMode};

pub mod pages;
use crate::profile::{Addr, KernelProfile, ProfileError};

/// Virtual base of the kernel image mapping (`__START_KERNEL_map`).
pub const START_KERNEL_MAP: u64 = 0xffff_ffff_8000_0000;
/// Kernel load addresses are multiples of `CONFIG_PHYSICAL_ALIGN` (2 MiB on Debian).
const PHYSICAL_ALIGN: u64 = 0x20_0000;
/// `task_struct.flags` bit of kernel threads.
const PF_KTHREAD: u32 = 0x0020_0000;
/// `PATH_MAX`.
const PATH_MAX: usize = 4096;
/// Start of the kernel half of the address space with 4-level paging.
const KERNEL_HALF_4: u64 = 0xffff_8000_0000_0000;
/// Start of the kernel half with 5-level paging.
const KERNEL_HALF_5: u64 = 0xff00_0000_0000_0000;

/// Problems reading kernel objects.
#[derive(Debug, Error)]
pub enum KernelError {
    #[error("the kernel profile lacks something this needs: {0}")]
    Profile(#[from] ProfileError),
    #[error("cannot read {what} at {addr:#x}: {source}")]
    Read {
        what: &'static str,
        addr: u64,
        source: MemError,
    },
    #[error("the guest kernel was not found in guest RAM: no \"Linux version\" banner at any 2 MiB-aligned load address. Is the guest booted, and is the profile that of the running kernel?")]
    KernelNotFound,
    #[error("page_offset_base is {0:#x}, which is not a direct-map base of 4- or 5-level paging; the kernel is not initialized yet or the profile does not match")]
    BadPageOffset(u64),
    #[error("the kernel page tables at {root:#x} ({levels}-level) do not map the kernel image: {detail}")]
    PageTables {
        root: u64,
        levels: u8,
        detail: String,
    },
    #[error("{what} is NULL.")]
    Null { what: &'static str },
    #[error(
        "{what} is {value:#x}, which is not a kernel address; the structure is corrupt or changing"
    )]
    BadPointer { what: &'static str, value: u64 },
    #[error("the {what} list has more than {max} entries; the structure is corrupt or changing")]
    ListTooLong { what: &'static str, max: usize },
    #[error("the {what} list loops at {addr:#x} without returning to its head; the structure is corrupt or changing")]
    ListLoop { what: &'static str, addr: u64 },
    #[error(
        "A path has more than {max} components; the dentry/mount chain is corrupt or changing."
    )]
    PathTooDeep { max: usize },
    #[error(
        "{what} is {value}, more than the limit of {max}; the structure is corrupt or changing."
    )]
    Implausible {
        what: &'static str,
        value: u64,
        max: u64,
    },
    #[error("no task with pid {0} in the guest")]
    NoSuchTask(i32),
    #[error("CPU {cpu} does not exist; the guest has {count} CPU(s)")]
    NoSuchCpu { cpu: u32, count: u32 },
}

/// Bounds on every walk over guest structures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most tasks (processes, or threads of one process) a list walk accepts.
    pub max_tasks: usize,
    /// Largest `fdtable.max_fds` accepted (the kernel's own cap, `sysctl fs.nr_open`, defaults
    /// to 1 Mi).
    pub max_fds: u32,
    /// Most path components (dentries plus mount crossings) in one path walk.
    pub max_path_depth: usize,
    /// Longest file-name component.
    pub max_name: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_tasks: 1 << 18,
            max_fds: 1 << 20,
            max_path_depth: PATH_MAX / 2,
            max_name: 255,
        }
    }
}

/// A task (thread) as `ps` and `/proc/PID/{exe,cwd,root}` show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TaskInfo {
    /// Address of the `task_struct`.
    pub task: Addr,
    /// Thread id (`task_struct.pid`).
    pub pid: i32,
    /// Process id (`task_struct.tgid`).
    pub tgid: i32,
    /// `real_parent->tgid` (0 for init and kthreadd, like `ps`).
    pub ppid: i32,
    /// `task_struct.comm`.
    pub comm: String,
    /// `PF_KTHREAD` is set.
    pub kernel_thread: bool,
    /// `mm->exe_file` path; `None` without an mm (kernel threads, exiting tasks).
    pub exe: Option<String>,
    /// `fs->pwd` path; `None` without an fs_struct.
    pub cwd: Option<String>,
    /// `fs->root` path; `None` without an fs_struct.
    pub root: Option<String>,
}

/// An open file descriptor, as `/proc/PID/fd/N` and `/proc/PID/fdinfo/N` show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FdInfo {
    pub fd: u32,
    /// Address of the `struct file`.
    pub file: Addr,
    /// Like the `/proc/PID/fd/N` link: an absolute path (with " (deleted)" for unlinked
    /// files), `pipe:[INO]`, `socket:[INO]` or `anon_inode:NAME`.
    pub path: String,
    /// `file.f_pos`.
    pub pos: i64,
    /// `file.f_flags` (O_* flags; `/proc/PID/fdinfo` adds O_CLOEXEC from the fd table).
    pub flags: u32,
    /// `inode.i_mode` (type and permission bits).
    pub mode: u16,
    /// `inode.i_size`.
    pub size: i64,
    /// `inode.i_ino`.
    pub ino: u64,
}

/// Member offsets resolved once from the profile.
#[derive(Debug, Clone)]
struct Offsets {
    task_pid: u64,
    task_tgid: u64,
    task_comm: u64,
    task_comm_len: usize,
    task_mm: u64,
    task_real_parent: u64,
    task_tasks: u64,
    task_group_leader: u64,
    task_fs: u64,
    task_files: u64,
    task_flags: u64,
    task_signal: u64,
    task_thread_group: Option<u64>,
    /// `(task_struct.thread_node, signal_struct.thread_head)`.
    thread_node_head: Option<(u64, u64)>,
    list_next: u64,
    mm_pgd: u64,
    mm_exe_file: u64,
    files_fdt: u64,
    fdt_max_fds: u64,
    fdt_fd: u64,
    file_path: u64,
    file_inode: u64,
    file_pos: u64,
    file_flags: u64,
    path_mnt: u64,
    path_dentry: u64,
    dentry_parent: u64,
    dentry_name: u64,
    dentry_inode: u64,
    dentry_hash: Option<u64>,
    qstr_name: u64,
    qstr_len: u64,
    inode_mode: u64,
    inode_ino: u64,
    inode_size: u64,
    inode_sb: u64,
    inode_nlink: Option<u64>,
    fs_root: u64,
    fs_pwd: u64,
    mount_mnt: u64,
    mount_parent: u64,
    mount_mountpoint: u64,
    vfsmount_root: u64,
    /// `(super_block.s_type, file_system_type.name)`.
    sb_type_name: Option<(u64, u64)>,
}

impl Offsets {
    fn resolve(p: &KernelProfile) -> Result<Offsets, ProfileError> {
        let m = |s: &str, f: &str| p.member(s, f).map(|l| l.offset);
        let opt = |s: &str, f: &str| p.member(s, f).ok().map(|l| l.offset);
        let comm = p.member("task_struct", "comm")?;
        Ok(Offsets {
            task_pid: m("task_struct", "pid")?,
            task_tgid: m("task_struct", "tgid")?,
            task_comm: comm.offset,
            task_comm_len: usize::try_from(comm.size).unwrap_or(16).min(64),
            task_mm: m("task_struct", "mm")?,
            task_real_parent: m("task_struct", "real_parent")?,
            task_tasks: m("task_struct", "tasks")?,
            task_group_leader: m("task_struct", "group_leader")?,
            task_fs: m("task_struct", "fs")?,
            task_files: m("task_struct", "files")?,
            task_flags: m("task_struct", "flags")?,
            task_signal: m("task_struct", "signal")?,
            task_thread_group: opt("task_struct", "thread_group"),
            thread_node_head: opt("task_struct", "thread_node")
                .zip(opt("signal_struct", "thread_head")),
            list_next: m("list_head", "next")?,
            mm_pgd: m("mm_struct", "pgd")?,
            mm_exe_file: m("mm_struct", "exe_file")?,
            files_fdt: m("files_struct", "fdt")?,
            fdt_max_fds: m("fdtable", "max_fds")?,
            fdt_fd: m("fdtable", "fd")?,
            file_path: m("file", "f_path")?,
            file_inode: m("file", "f_inode")?,
            file_pos: m("file", "f_pos")?,
            file_flags: m("file", "f_flags")?,
            path_mnt: m("path", "mnt")?,
            path_dentry: m("path", "dentry")?,
            dentry_parent: m("dentry", "d_parent")?,
            dentry_name: m("dentry", "d_name")?,
            dentry_inode: m("dentry", "d_inode")?,
            dentry_hash: opt("dentry", "d_hash"),
            qstr_name: m("qstr", "name")?,
            qstr_len: m("qstr", "len")?,
            inode_mode: m("inode", "i_mode")?,
            inode_ino: m("inode", "i_ino")?,
            inode_size: m("inode", "i_size")?,
            inode_sb: m("inode", "i_sb")?,
            inode_nlink: opt("inode", "i_nlink"),
            fs_root: m("fs_struct", "root")?,
            fs_pwd: m("fs_struct", "pwd")?,
            mount_mnt: m("mount", "mnt")?,
            mount_parent: m("mount", "mnt_parent")?,
            mount_mountpoint: m("mount", "mnt_mountpoint")?,
            vfsmount_root: m("vfsmount", "mnt_root")?,
            sb_type_name: opt("super_block", "s_type").zip(opt("file_system_type", "name")),
        })
    }
}

/// Kernel symbols the view uses.
#[derive(Debug, Clone, Copy)]
struct Symbols {
    init_task: u64,
    per_cpu_offset: u64,
    current_task: u64,
    nr_cpu_ids: Option<u64>,
}

/// The guest kernel's view of itself, read from guest RAM.
#[derive(Debug)]
pub struct KernelView {
    ram: Arc<GuestRam>,
    space: AddressSpace,
    phys_base: u64,
    page_offset_base: u64,
    off: Offsets,
    sym: Symbols,
    limits: Limits,
}

impl KernelView {
    /// Finds the running kernel in `ram`: its load address (`phys_base`, found by checking
    /// `linux_banner` and the `phys_base` variable at each 2 MiB-aligned candidate, 0 first),
    /// `page_offset_base`, the paging depth (`__pgtable_l5_enabled` when the profile has it,
    /// else the range of `page_offset_base`) and its page tables (`init_top_pgt`), and checks
    /// that those tables map the kernel image where it was found.
    pub fn new(ram: Arc<GuestRam>, profile: &KernelProfile) -> Result<KernelView, KernelError> {
        let off = Offsets::resolve(profile)?;
        let sym = Symbols {
            init_task: profile.symbol("init_task")?,
            per_cpu_offset: profile.symbol("__per_cpu_offset")?,
            current_task: profile.symbol("current_task")?,
            nr_cpu_ids: profile.symbol("nr_cpu_ids").ok(),
        };
        let image_off = |name: &str| -> Result<u64, KernelError> {
            let va = profile.symbol(name)?;
            va.checked_sub(START_KERNEL_MAP)
                .ok_or(KernelError::BadPointer {
                    what: "a kernel image symbol",
                    value: va,
                })
        };
        let banner = image_off("linux_banner")?;
        let phys_base_var = match profile.symbol("phys_base") {
            Ok(_) => Some(image_off("phys_base")?),
            Err(_) => None,
        };
        let phys_base = find_phys_base(&ram, banner, phys_base_var)?;
        let phys = |o: u64| o + phys_base;

        let pob_pa = phys(image_off("page_offset_base")?);
        let page_offset_base = ram
            .read_u64_phys(pob_pa)
            .map_err(|source| KernelError::Read {
                what: "page_offset_base",
                addr: pob_pa,
                source,
            })?;
        let l5 = match profile.symbol("__pgtable_l5_enabled") {
            Ok(_) => {
                let pa = phys(image_off("__pgtable_l5_enabled")?);
                let mut b = [0u8; 4];
                ram.read_phys(pa, &mut b)
                    .map_err(|source| KernelError::Read {
                        what: "__pgtable_l5_enabled",
                        addr: pa,
                        source,
                    })?;
                Some(u32::from_le_bytes(b) != 0)
            }
            Err(_) => None,
        };
        let mode = mode_from(page_offset_base, l5)?;
        let root = phys(image_off("init_top_pgt")?);
        let space = AddressSpace::with_mode(root, mode);
        let banner_va = START_KERNEL_MAP + banner;
        match space.translate(&ram, banner_va) {
            Ok(t) if t.pa == phys(banner) => {}
            other => {
                return Err(KernelError::PageTables {
                    root,
                    levels: mode.levels(),
                    detail: match other {
                        Ok(t) => format!(
                            "linux_banner {banner_va:#x} translates to {:#x}, not {:#x}",
                            t.pa,
                            phys(banner)
                        ),
                        Err(e) => e.to_string(),
                    },
                })
            }
        }
        Ok(KernelView {
            ram,
            space,
            phys_base,
            page_offset_base,
            off,
            sym,
            limits: Limits::default(),
        })
    }

    /// Replaces the walk bounds.
    pub fn with_limits(mut self, limits: Limits) -> KernelView {
        self.limits = limits;
        self
    }

    /// The guest RAM.
    pub fn ram(&self) -> &Arc<GuestRam> {
        &self.ram
    }

    /// The kernel's address space (`init_top_pgt`).
    pub fn kernel_space(&self) -> AddressSpace {
        self.space
    }

    /// The paging depth the guest uses.
    pub fn paging_mode(&self) -> PagingMode {
        self.space.mode()
    }

    /// Physical load offset of the kernel image (0 when loaded where linked).
    pub fn phys_base(&self) -> u64 {
        self.phys_base
    }

    /// Base of the kernel's direct map of physical memory.
    pub fn page_offset_base(&self) -> u64 {
        self.page_offset_base
    }

    /// Copies kernel virtual memory (exactly `buf.len()` bytes).
    pub fn read_kernel(&self, va: u64, buf: &mut [u8]) -> Result<(), KernelError> {
        self.read(va, buf, "kernel memory")
    }

    fn read(&self, va: u64, buf: &mut [u8], what: &'static str) -> Result<(), KernelError> {
        self.space
            .read_virt_exact(&self.ram, va, buf)
            .map_err(|source| KernelError::Read {
                what,
                addr: va,
                source,
            })
    }

    fn u64_at(&self, va: u64, what: &'static str) -> Result<u64, KernelError> {
        let mut b = [0u8; 8];
        self.read(va, &mut b, what)?;
        Ok(u64::from_le_bytes(b))
    }

    fn u32_at(&self, va: u64, what: &'static str) -> Result<u32, KernelError> {
        let mut b = [0u8; 4];
        self.read(va, &mut b, what)?;
        Ok(u32::from_le_bytes(b))
    }

    fn u16_at(&self, va: u64, what: &'static str) -> Result<u16, KernelError> {
        let mut b = [0u8; 2];
        self.read(va, &mut b, what)?;
        Ok(u16::from_le_bytes(b))
    }

    fn kernel_half(&self) -> u64 {
        match self.space.mode() {
            PagingMode::FourLevel => KERNEL_HALF_4,
            PagingMode::FiveLevel => KERNEL_HALF_5,
        }
    }

    /// A pointer that may be NULL; anything else must be a kernel address.
    fn opt_ptr_at(&self, va: u64, what: &'static str) -> Result<Option<u64>, KernelError> {
        let v = self.u64_at(va, what)?;
        if v == 0 {
            return Ok(None);
        }
        if v < self.kernel_half() {
            return Err(KernelError::BadPointer { what, value: v });
        }
        Ok(Some(v))
    }

    /// A pointer that must be a non-NULL kernel address.
    fn ptr_at(&self, va: u64, what: &'static str) -> Result<u64, KernelError> {
        self.opt_ptr_at(va, what)?.ok_or(KernelError::Null { what })
    }

    /// The nodes of a circular `list_head` list, without the head, with loop detection.
    fn walk_list(&self, head: u64, what: &'static str) -> Result<Vec<u64>, KernelError> {
        let mut out = Vec::new();
        let mut seen = HashSet::new();
        let mut cur = self.ptr_at(head + self.off.list_next, what)?;
        while cur != head {
            if !seen.insert(cur) {
                return Err(KernelError::ListLoop { what, addr: cur });
            }
            if out.len() >= self.limits.max_tasks {
                return Err(KernelError::ListTooLong {
                    what,
                    max: self.limits.max_tasks,
                });
            }
            out.push(cur);
            cur = self.ptr_at(cur + self.off.list_next, what)?;
        }
        Ok(out)
    }

    /// `init_task` (pid 0, the boot CPU's idle task).
    pub fn init_task(&self) -> u64 {
        self.sym.init_task
    }

    /// Every process (thread-group leader) on `init_task.tasks`, in list order (creation
    /// order), without `init_task` itself — what `ps -e` lists.
    pub fn processes(&self) -> Result<Vec<u64>, KernelError> {
        let head = self.sym.init_task + self.off.task_tasks;
        Ok(self
            .walk_list(head, "init_task.tasks")?
            .into_iter()
            .map(|n| n - self.off.task_tasks)
            .collect())
    }

    /// All threads of `task`'s thread group, the leader first.
    pub fn threads(&self, task: u64) -> Result<Vec<u64>, KernelError> {
        let leader = self.ptr_at(
            task + self.off.task_group_leader,
            "task_struct.group_leader",
        )?;
        if let Some(tg) = self.off.task_thread_group {
            // A ring through every thread, without a separate head.
            let head = leader + tg;
            let mut out = vec![leader];
            out.extend(
                self.walk_list(head, "task_struct.thread_group")?
                    .into_iter()
                    .map(|n| n - tg),
            );
            return Ok(out);
        }
        if let Some((node, head_off)) = self.off.thread_node_head {
            let signal = self.ptr_at(leader + self.off.task_signal, "task_struct.signal")?;
            return Ok(self
                .walk_list(signal + head_off, "signal_struct.thread_head")?
                .into_iter()
                .map(|n| n - node)
                .collect());
        }
        Ok(vec![leader])
    }

    /// Every thread of every process (without `init_task`).
    pub fn all_threads(&self) -> Result<Vec<u64>, KernelError> {
        let mut out = Vec::new();
        for p in self.processes()? {
            out.extend(self.threads(p)?);
            if out.len() > self.limits.max_tasks {
                return Err(KernelError::ListTooLong {
                    what: "thread",
                    max: self.limits.max_tasks,
                });
            }
        }
        Ok(out)
    }

    /// The task whose thread id is `tid` (0 is `init_task`).
    pub fn task_by_pid(&self, tid: i32) -> Result<u64, KernelError> {
        if tid == 0 {
            return Ok(self.sym.init_task);
        }
        for p in self.processes()? {
            if self.pid(p)? == tid {
                return Ok(p);
            }
            for t in self.threads(p)? {
                if self.pid(t)? == tid {
                    return Ok(t);
                }
            }
        }
        Err(KernelError::NoSuchTask(tid))
    }

    /// `task_struct.pid` (the thread id).
    pub fn pid(&self, task: u64) -> Result<i32, KernelError> {
        Ok(self.u32_at(task + self.off.task_pid, "task_struct.pid")? as i32)
    }

    /// `task_struct.tgid` (the process id).
    pub fn tgid(&self, task: u64) -> Result<i32, KernelError> {
        Ok(self.u32_at(task + self.off.task_tgid, "task_struct.tgid")? as i32)
    }

    /// `real_parent->tgid`, 0 for tasks whose parent is `init_task`.
    pub fn ppid(&self, task: u64) -> Result<i32, KernelError> {
        let parent = self.ptr_at(task + self.off.task_real_parent, "task_struct.real_parent")?;
        self.tgid(parent)
    }

    /// `task_struct.comm`.
    pub fn comm(&self, task: u64) -> Result<String, KernelError> {
        let mut b = vec![0u8; self.off.task_comm_len];
        self.read(task + self.off.task_comm, &mut b, "task_struct.comm")?;
        let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
        Ok(String::from_utf8_lossy(&b[..end]).into_owned())
    }

    /// The task's user address space (`mm->pgd`), `None` for kernel threads.
    pub fn user_space(&self, task: u64) -> Result<Option<AddressSpace>, KernelError> {
        let Some(mm) = self.opt_ptr_at(task + self.off.task_mm, "task_struct.mm")? else {
            return Ok(None);
        };
        let pgd = self.ptr_at(mm + self.off.mm_pgd, "mm_struct.pgd")?;
        let t = self
            .space
            .translate(&self.ram, pgd)
            .map_err(|source| KernelError::Read {
                what: "mm_struct.pgd",
                addr: pgd,
                source,
            })?;
        Ok(Some(AddressSpace::with_mode(t.pa, self.space.mode())))
    }

    /// Everything `ps` and `/proc/PID/{exe,cwd,root}` show about a task.
    pub fn task_info(&self, task: u64) -> Result<TaskInfo, KernelError> {
        let flags = self.u32_at(task + self.off.task_flags, "task_struct.flags")?;
        let exe = match self.opt_ptr_at(task + self.off.task_mm, "task_struct.mm")? {
            Some(mm) => match self.opt_ptr_at(mm + self.off.mm_exe_file, "mm_struct.exe_file")? {
                Some(file) => Some(self.file_path(file)?),
                None => None,
            },
            None => None,
        };
        let (cwd, root) = match self.opt_ptr_at(task + self.off.task_fs, "task_struct.fs")? {
            Some(fs) => (
                Some(self.path_at(fs + self.off.fs_pwd)?),
                Some(self.path_at(fs + self.off.fs_root)?),
            ),
            None => (None, None),
        };
        Ok(TaskInfo {
            task: Addr(task),
            pid: self.pid(task)?,
            tgid: self.tgid(task)?,
            ppid: self.ppid(task)?,
            comm: self.comm(task)?,
            kernel_thread: flags & PF_KTHREAD != 0,
            exe,
            cwd,
            root,
        })
    }

    /// Number of possible CPUs (`nr_cpu_ids`), 1 when the profile lacks it.
    pub fn nr_cpus(&self) -> Result<u32, KernelError> {
        let Some(sym) = self.sym.nr_cpu_ids else {
            return Ok(1);
        };
        let n = self.u32_at(sym, "nr_cpu_ids")?;
        if n == 0 || n > 8192 {
            return Err(KernelError::Implausible {
                what: "nr_cpu_ids",
                value: u64::from(n),
                max: 8192,
            });
        }
        Ok(n)
    }

    /// The task running on (or last scheduled on) `cpu`:
    /// `*(__per_cpu_offset[cpu] + &current_task)`.
    pub fn current_task(&self, cpu: u32) -> Result<u64, KernelError> {
        let count = self.nr_cpus()?;
        if cpu >= count {
            return Err(KernelError::NoSuchCpu { cpu, count });
        }
        let base = self.u64_at(
            self.sym.per_cpu_offset + 8 * u64::from(cpu),
            "__per_cpu_offset[cpu]",
        )?;
        self.ptr_at(base.wrapping_add(self.sym.current_task), "current_task")
    }

    /// The open files of `task` (empty when it has no `files_struct`).
    pub fn fds(&self, task: u64) -> Result<Vec<FdInfo>, KernelError> {
        let Some(files) = self.opt_ptr_at(task + self.off.task_files, "task_struct.files")? else {
            return Ok(Vec::new());
        };
        let fdt = self.ptr_at(files + self.off.files_fdt, "files_struct.fdt")?;
        let max_fds = self.u32_at(fdt + self.off.fdt_max_fds, "fdtable.max_fds")?;
        if max_fds > self.limits.max_fds {
            return Err(KernelError::Implausible {
                what: "fdtable.max_fds",
                value: u64::from(max_fds),
                max: u64::from(self.limits.max_fds),
            });
        }
        let array = self.ptr_at(fdt + self.off.fdt_fd, "fdtable.fd")?;
        let mut out = Vec::new();
        let mut chunk = vec![0u8; 512 * 8];
        let mut fd: u32 = 0;
        while fd < max_fds {
            let n = (max_fds - fd).min(512) as usize;
            let buf = &mut chunk[..n * 8];
            self.read(array + u64::from(fd) * 8, buf, "fdtable.fd[]")?;
            for (i, p) in buf.chunks_exact(8).enumerate() {
                let mut b = [0u8; 8];
                b.copy_from_slice(p);
                let file = u64::from_le_bytes(b);
                if file == 0 {
                    continue;
                }
                if file < self.kernel_half() {
                    return Err(KernelError::BadPointer {
                        what: "fdtable.fd[]",
                        value: file,
                    });
                }
                out.push(self.fd_info(fd + i as u32, file)?);
            }
            fd += n as u32;
        }
        Ok(out)
    }

    /// One open file.
    pub fn fd_info(&self, fd: u32, file: u64) -> Result<FdInfo, KernelError> {
        let inode = self.ptr_at(file + self.off.file_inode, "file.f_inode")?;
        Ok(FdInfo {
            fd,
            file: Addr(file),
            path: self.file_path(file)?,
            pos: self.u64_at(file + self.off.file_pos, "file.f_pos")? as i64,
            flags: self.u32_at(file + self.off.file_flags, "file.f_flags")?,
            mode: self.u16_at(inode + self.off.inode_mode, "inode.i_mode")?,
            size: self.u64_at(inode + self.off.inode_size, "inode.i_size")? as i64,
            ino: self.u64_at(inode + self.off.inode_ino, "inode.i_ino")?,
        })
    }

    /// The path of an open file (`file.f_path`), rendered like `/proc/PID/fd/N`.
    pub fn file_path(&self, file: u64) -> Result<String, KernelError> {
        self.path_at(file + self.off.file_path)
    }

    /// Renders the `struct path` at `path`, like the kernel's `d_path`: pseudo files of
    /// pipefs/sockfs/anon_inodefs as `pipe:[INO]`, `socket:[INO]`, `anon_inode:NAME`;
    /// others by walking `d_parent` up to the mount root and crossing to
    /// `mnt_parent`/`mnt_mountpoint` until the root of the mount tree, with " (deleted)"
    /// for unlinked dentries. Paths are absolute from the root of the mount namespace (what a
    /// non-chrooted reader of `/proc` sees).
    pub fn path_at(&self, path: u64) -> Result<String, KernelError> {
        let vfsmnt = self.ptr_at(path + self.off.path_mnt, "path.mnt")?;
        let dentry = self.ptr_at(path + self.off.path_dentry, "path.dentry")?;
        self.d_path(vfsmnt, dentry)
    }

    fn d_path(&self, vfsmnt: u64, dentry: u64) -> Result<String, KernelError> {
        if let Some(name) = self.pseudo_name(dentry)? {
            return Ok(name);
        }
        let deleted = self.d_unlinked(dentry)?;
        let o = &self.off;
        let mut mount = vfsmnt
            .checked_sub(o.mount_mnt)
            .ok_or(KernelError::BadPointer {
                what: "path.mnt",
                value: vfsmnt,
            })?;
        let mut vfsmnt = vfsmnt;
        let mut dentry = dentry;
        let mut parts: Vec<Vec<u8>> = Vec::new();
        let mut total = 0usize;
        let mut steps = 0usize;
        loop {
            steps += 1;
            if steps > self.limits.max_path_depth {
                return Err(KernelError::PathTooDeep {
                    max: self.limits.max_path_depth,
                });
            }
            let mnt_root = self.ptr_at(vfsmnt + o.vfsmount_root, "vfsmount.mnt_root")?;
            if dentry == mnt_root {
                let parent = self.ptr_at(mount + o.mount_parent, "mount.mnt_parent")?;
                if parent == mount {
                    break; // the root of the mount tree
                }
                dentry = self.ptr_at(mount + o.mount_mountpoint, "mount.mnt_mountpoint")?;
                mount = parent;
                vfsmnt = mount + o.mount_mnt;
                continue;
            }
            let parent = self.ptr_at(dentry + o.dentry_parent, "dentry.d_parent")?;
            if parent == dentry {
                break; // a disconnected tree: the kernel stops here too
            }
            let name = self.dentry_name(dentry)?;
            total += name.len() + 1;
            if total > PATH_MAX {
                return Err(KernelError::Implausible {
                    what: "the path length",
                    value: total as u64,
                    max: PATH_MAX as u64,
                });
            }
            parts.push(name);
            dentry = parent;
        }
        let mut s = Vec::with_capacity(total + 12);
        for part in parts.iter().rev() {
            s.push(b'/');
            s.extend_from_slice(part);
        }
        if s.is_empty() {
            s.push(b'/');
        }
        if deleted {
            s.extend_from_slice(b" (deleted)");
        }
        Ok(String::from_utf8_lossy(&s).into_owned())
    }

    /// `dentry.d_name` as bytes.
    fn dentry_name(&self, dentry: u64) -> Result<Vec<u8>, KernelError> {
        let qstr = dentry + self.off.dentry_name;
        let len = self.u32_at(qstr + self.off.qstr_len, "qstr.len")? as usize;
        if len > self.limits.max_name {
            return Err(KernelError::Implausible {
                what: "dentry.d_name.len",
                value: len as u64,
                max: self.limits.max_name as u64,
            });
        }
        let name = self.ptr_at(qstr + self.off.qstr_name, "qstr.name")?;
        let mut b = vec![0u8; len];
        self.read(name, &mut b, "dentry.d_name")?;
        Ok(b)
    }

    /// `d_unlinked`: unhashed and not a root; without `dentry.d_hash` in the profile, an
    /// inode with no links.
    fn d_unlinked(&self, dentry: u64) -> Result<bool, KernelError> {
        let parent = self.ptr_at(dentry + self.off.dentry_parent, "dentry.d_parent")?;
        if parent == dentry {
            return Ok(false);
        }
        if let Some(hash) = self.off.dentry_hash {
            // hlist_bl_node { next, pprev }: unhashed when pprev is NULL.
            let pprev = self.u64_at(dentry + hash + 8, "dentry.d_hash.pprev")?;
            return Ok(pprev == 0);
        }
        if let Some(nlink) = self.off.inode_nlink {
            if let Some(inode) =
                self.opt_ptr_at(dentry + self.off.dentry_inode, "dentry.d_inode")?
            {
                return Ok(self.u32_at(inode + nlink, "inode.i_nlink")? == 0);
            }
        }
        Ok(false)
    }

    /// The name of the file system type of the dentry's inode (e.g. `pipefs`).
    pub fn fs_type(&self, dentry: u64) -> Result<Option<String>, KernelError> {
        let Some((s_type, name_off)) = self.off.sb_type_name else {
            return Ok(None);
        };
        let Some(inode) = self.opt_ptr_at(dentry + self.off.dentry_inode, "dentry.d_inode")? else {
            return Ok(None);
        };
        let sb = self.ptr_at(inode + self.off.inode_sb, "inode.i_sb")?;
        let ty = self.ptr_at(sb + s_type, "super_block.s_type")?;
        let name = self.ptr_at(ty + name_off, "file_system_type.name")?;
        let b = self
            .space
            .read_cstring(&self.ram, name, 64)
            .map_err(|source| KernelError::Read {
                what: "file_system_type.name",
                addr: name,
                source,
            })?;
        Ok(Some(String::from_utf8_lossy(&b).into_owned()))
    }

    /// The `d_dname` rendering of pipes, sockets and anonymous inodes.
    fn pseudo_name(&self, dentry: u64) -> Result<Option<String>, KernelError> {
        let Some(fs) = self.fs_type(dentry)? else {
            return Ok(None);
        };
        let ino = || -> Result<u64, KernelError> {
            let inode = self.ptr_at(dentry + self.off.dentry_inode, "dentry.d_inode")?;
            self.u64_at(inode + self.off.inode_ino, "inode.i_ino")
        };
        Ok(match fs.as_str() {
            "pipefs" => Some(format!("pipe:[{}]", ino()?)),
            "sockfs" => Some(format!("socket:[{}]", ino()?)),
            "anon_inodefs" => Some(format!(
                "anon_inode:{}",
                String::from_utf8_lossy(&self.dentry_name(dentry)?)
            )),
            _ => None,
        })
    }
}

/// The paging depth from `__pgtable_l5_enabled` (when known) and `page_offset_base`, which
/// must agree with it: 5-level direct-map bases lie below the 4-level kernel half.
fn mode_from(page_offset_base: u64, l5: Option<bool>) -> Result<PagingMode, KernelError> {
    let by_base = if (KERNEL_HALF_5..KERNEL_HALF_4).contains(&page_offset_base) {
        PagingMode::FiveLevel
    } else if (KERNEL_HALF_4..START_KERNEL_MAP).contains(&page_offset_base) {
        PagingMode::FourLevel
    } else {
        return Err(KernelError::BadPageOffset(page_offset_base));
    };
    match l5 {
        Some(true) if by_base == PagingMode::FiveLevel => Ok(PagingMode::FiveLevel),
        Some(false) if by_base == PagingMode::FourLevel => Ok(PagingMode::FourLevel),
        Some(_) => Err(KernelError::BadPageOffset(page_offset_base)),
        None => Ok(by_base),
    }
}

/// The kernel's physical load offset: the first 2 MiB-aligned `c` where `linux_banner` reads
/// "Linux version " and, when known, the `phys_base` variable holds `c`.
fn find_phys_base(
    ram: &GuestRam,
    banner_off: u64,
    phys_base_off: Option<u64>,
) -> Result<u64, KernelError> {
    let top = ram
        .layout()
        .regions()
        .iter()
        .map(|r| r.gpa.saturating_add(r.size))
        .max()
        .unwrap_or(0);
    let mut c = 0u64;
    while c.saturating_add(banner_off) < top {
        let mut b = [0u8; 14];
        if ram.read_phys(c + banner_off, &mut b).is_ok() && &b == b"Linux version " {
            let ok = match phys_base_off {
                Some(o) => ram.read_u64_phys(c + o).ok() == Some(c),
                None => true,
            };
            if ok {
                return Ok(c);
            }
        }
        c += PHYSICAL_ALIGN;
    }
    Err(KernelError::KernelNotFound)
}

#[cfg(test)]
mod tests;
