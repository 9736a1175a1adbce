//! The insight engine's profile lookup source: what it did not see (the working directory of
//! a process traced from its middle, an fd inherited or opened before tracing began), read
//! from guest kernel memory with the kernel profile, as process tracking reads task details
//! (`crate::process`). See docs/insights.md, "Lookups".

use std::path::PathBuf;
use std::sync::Arc;

use vmsight_insight::{FdFacts, Lookup, LookupSource, PageOwner, PageOwnerSource, TaskFacts};
use vmsight_introspect::kernel::pages::PageOwners;
use vmsight_introspect::kernel::KernelView;
use vmsight_introspect::memory::QemuRam;
use vmsight_introspect::{KernelError, KernelProfile, MemError, ProfileError};

/// Why the profile source could not answer.
#[derive(Debug, thiserror::Error)]
pub enum ProfileLookupError {
    #[error("cannot load the kernel profile: {0}")]
    Profile(#[from] ProfileError),
    #[error("cannot open guest RAM: {0}")]
    Ram(#[from] MemError),
    #[error("cannot read guest kernel memory: {0}")]
    Kernel(#[from] KernelError),
    /// Guest memory could not be opened earlier; it is not retried.
    #[error("guest kernel memory is not readable (opening it failed before)")]
    Unavailable,
}

/// Where one fd's `struct file *` is: `task->files->fdt->fd[fd]` (profile member offsets).
#[derive(Debug, Clone, Copy)]
struct FdTableLayout {
    task_files: u64,
    files_fdt: u64,
    fdt_max_fds: u64,
    fdt_fd: u64,
}

impl FdTableLayout {
    fn resolve(p: &KernelProfile) -> Result<Self, ProfileError> {
        Ok(FdTableLayout {
            task_files: p.member("task_struct", "files")?.offset,
            files_fdt: p.member("files_struct", "fdt")?.offset,
            fdt_max_fds: p.member("fdtable", "max_fds")?.offset,
            fdt_fd: p.member("fdtable", "fd")?.offset,
        })
    }
}

/// Guest kernel memory, opened.
struct Opened {
    view: KernelView,
    fdt: FdTableLayout,
}

/// A [`Lookup`] that reads the guest kernel's task list and fd tables. Guest memory is opened
/// at the first question (the guest kernel runs by then); a failure to open it is reported
/// once and not retried.
pub struct ProfileLookup {
    ram: QemuRam,
    profile: PathBuf,
    opened: Option<Opened>,
    broken: bool,
}

impl ProfileLookup {
    /// A source reading the memory of the guest in `ram`, described by the kernel
    /// profile at `profile`.
    pub fn new(ram: QemuRam, profile: PathBuf) -> Self {
        ProfileLookup {
            ram,
            profile,
            opened: None,
            broken: false,
        }
    }

    fn open(&self) -> Result<Opened, ProfileLookupError> {
        let profile = KernelProfile::load(&self.profile)?;
        let ram = self.ram.open()?;
        Ok(Opened {
            view: KernelView::new(Arc::new(ram), &profile)?,
            fdt: FdTableLayout::resolve(&profile)?,
        })
    }

    fn opened(&mut self) -> Result<&Opened, ProfileLookupError> {
        if self.opened.is_none() && !self.broken {
            match self.open() {
                Ok(o) => self.opened = Some(o),
                Err(e) => {
                    tracing::warn!("insight lookups from guest memory are off: {e}");
                    self.broken = true;
                }
            }
        }
        self.opened.as_ref().ok_or(ProfileLookupError::Unavailable)
    }

    /// What the guest kernel says about process `pid`.
    pub fn task_facts(&mut self, pid: u32) -> Result<TaskFacts, ProfileLookupError> {
        let o = self.opened()?;
        let info = o.view.task_info(o.view.task_by_pid(pid as i32)?)?;
        Ok(TaskFacts {
            tgid: info.tgid as u32,
            ppid: info.ppid as u32,
            comm: info.comm,
            exe: info.exe,
            cwd: info.cwd,
        })
    }

    /// What the guest kernel says about fd `fd` of process `pid`; `None` when it is not open.
    pub fn fd_facts(&mut self, pid: u32, fd: u32) -> Result<Option<FdFacts>, ProfileLookupError> {
        let o = self.opened()?;
        let task = o.view.task_by_pid(pid as i32)?;
        let Some(file) = o.file_of(task, fd)? else {
            return Ok(None);
        };
        let info = o.view.fd_info(fd, file)?;
        Ok(Some(FdFacts {
            path: info.path,
            flags: Some(u64::from(info.flags)),
            pos: u64::try_from(info.pos).ok(),
        }))
    }
}

impl Opened {
    /// `task->files->fdt->fd[fd]`, `None` when the fd is not open (or the task has no files
    /// any more). Reads this one slot rather than the whole table (`KernelView::fds` renders
    /// every open file's path, and fails when any one of them cannot be read).
    fn file_of(&self, task: u64, fd: u32) -> Result<Option<u64>, KernelError> {
        let Some(files) = self.ptr(task + self.fdt.task_files, "task_struct.files")? else {
            return Ok(None);
        };
        let Some(fdt) = self.ptr(files + self.fdt.files_fdt, "files_struct.fdt")? else {
            return Ok(None);
        };
        let mut max = [0u8; 4];
        self.view
            .read_kernel(fdt + self.fdt.fdt_max_fds, &mut max)?;
        if fd >= u32::from_le_bytes(max) {
            return Ok(None);
        }
        let Some(array) = self.ptr(fdt + self.fdt.fdt_fd, "fdtable.fd")? else {
            return Ok(None);
        };
        self.ptr(array + u64::from(fd) * 8, "fdtable.fd[]")
    }

    /// A kernel pointer at `va`: `None` when NULL, an error when not in the kernel half.
    fn ptr(&self, va: u64, what: &'static str) -> Result<Option<u64>, KernelError> {
        let mut b = [0u8; 8];
        self.view.read_kernel(va, &mut b)?;
        match u64::from_le_bytes(b) {
            0 => Ok(None),
            v if v >> 63 == 1 => Ok(Some(v)),
            v => Err(KernelError::BadPointer { what, value: v }),
        }
    }
}

impl Lookup for ProfileLookup {
    fn task(&mut self, pid: u32) -> Option<(TaskFacts, LookupSource)> {
        match self.task_facts(pid) {
            Ok(t) => Some((t, LookupSource::Profile)),
            Err(e) => {
                // Usually the process exited before the trace thread got to it.
                tracing::debug!("insight lookup of pid {pid}: {e}");
                None
            }
        }
    }

    fn fd(&mut self, pid: u32, fd: u32) -> Option<(FdFacts, LookupSource)> {
        match self.fd_facts(pid, fd) {
            Ok(f) => f.map(|f| (f, LookupSource::Profile)),
            Err(e) => {
                tracing::debug!("insight lookup of pid {pid} fd {fd}: {e}");
                None
            }
        }
    }
}

/// Page ownership read from guest kernel memory (`vmsight_introspect::kernel::pages`) for the
/// insight classifier. Guest memory is opened at the first question after the guest kernel
/// set up its page tables: a failure that may pass (the kernel not running yet) is retried at
/// most once a second, one that cannot (the profile lacks the page members) ends the
/// attempts, reported once.
pub struct ProfilePages {
    ram: QemuRam,
    profile: PathBuf,
    owners: std::sync::OnceLock<PageOwners>,
    /// When the next attempt to open may run; `None` once the source gave up.
    retry: std::sync::Mutex<Option<std::time::Instant>>,
}

/// Retry interval of [`ProfilePages`] while the guest kernel is not readable yet.
const PAGES_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

impl ProfilePages {
    /// A source reading the memory of the guest in `ram` with the profile at `profile`.
    pub fn new(ram: QemuRam, profile: PathBuf) -> Self {
        ProfilePages {
            ram,
            profile,
            owners: std::sync::OnceLock::new(),
            retry: std::sync::Mutex::new(Some(std::time::Instant::now())),
        }
    }

    fn open(&self) -> Result<PageOwners, ProfileLookupError> {
        let profile = KernelProfile::load(&self.profile)?;
        let ram = self.ram.open()?;
        let view = KernelView::new(Arc::new(ram), &profile)?;
        Ok(PageOwners::new(view, &profile)?)
    }

    /// The reader, opening it if it is time to try.
    fn owners(&self) -> Option<&PageOwners> {
        if let Some(o) = self.owners.get() {
            return Some(o);
        }
        let mut retry = self.retry.try_lock().ok()?; // another thread is trying right now
        let now = std::time::Instant::now();
        if !retry.is_some_and(|at| now >= at) {
            return None;
        }
        match self.open() {
            Ok(o) => {
                let _ = self.owners.set(o);
                self.owners.get()
            }
            Err(
                ProfileLookupError::Kernel(KernelError::Profile(e))
                | ProfileLookupError::Profile(e),
            ) => {
                tracing::warn!("insights by page ownership are off: {e}");
                *retry = None;
                None
            }
            Err(e) => {
                tracing::debug!("guest page ownership not readable yet: {e}");
                *retry = Some(now + PAGES_RETRY);
                None
            }
        }
    }
}

impl PageOwnerSource for ProfilePages {
    fn owner(&self, gpa: u64) -> PageOwner {
        self.owners().map_or(PageOwner::Unknown, |o| o.owner(gpa))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No such QEMU.
    fn nowhere() -> QemuRam {
        QemuRam {
            pid: u32::MAX,
            ram_size: None,
        }
    }

    #[test]
    fn unreadable_guest_memory_answers_nothing_and_is_not_retried() {
        let mut l = ProfileLookup::new(nowhere(), PathBuf::from("/nonexistent/profile.json"));
        assert!(l.task(1).is_none());
        assert!(l.broken, "the failure to open is remembered");
        assert!(matches!(
            l.fd_facts(1, 0),
            Err(ProfileLookupError::Unavailable)
        ));
        assert!(l.fd(1, 0).is_none());
    }

    #[test]
    fn unreadable_guest_memory_owns_nothing_and_waits_before_retrying() {
        let p = ProfilePages::new(nowhere(), PathBuf::from("/nonexistent/profile.json"));
        assert_eq!(p.owner(0x1000), PageOwner::Unknown);
        // A missing profile cannot get better: the source gave up.
        assert!(p.retry.lock().unwrap().is_none());
        assert_eq!(p.owner(0x1000), PageOwner::Unknown);
    }
}
