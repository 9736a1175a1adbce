//! Process tracking for traced tasks: PID, TID, PPID, command, executable and working
//! directory, read from guest kernel memory (the kernel profile says where), never from inside
//! the guest. A record is written when a task is first seen and again after a successful
//! execve/execveat/chdir/fchdir changed what it reports.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use serde::Serialize;
use vmsight_introspect::kernel::{KernelView, TaskInfo};
use vmsight_introspect::memory::GuestRam;
use vmsight_introspect::syscall::{nr, Completed, EntryEvent, JsonSink, Outcome, SyscallObserver};
use vmsight_introspect::KernelProfile;

/// One `"type": "process"` line of `--trace-json`.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ProcessRecord {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub pid: i32,
    pub tid: i32,
    pub ppid: i32,
    pub comm: String,
    pub exe: Option<String>,
    pub cwd: Option<String>,
    /// Host CLOCK_MONOTONIC time of the event that triggered the read.
    pub ts_ns: u64,
}

impl ProcessRecord {
    fn from_info(i: &TaskInfo, ts_ns: u64) -> Self {
        ProcessRecord {
            kind: "process",
            pid: i.tgid,
            tid: i.pid,
            ppid: i.ppid,
            comm: i.comm.clone(),
            exe: i.exe.clone(),
            cwd: i.cwd.clone(),
            ts_ns,
        }
    }
}

/// Reads task details from guest memory for the tasks the trace sees.
pub struct ProcessObserver {
    qemu_pid: u32,
    profile: PathBuf,
    view: Option<KernelView>,
    /// Set when opening guest memory failed, so it is not retried on every event.
    broken: bool,
    last: HashMap<u64, ProcessRecord>,
    json: Option<JsonSink>,
    text: Option<Box<dyn Write + Send>>,
    pub read_errors: u64,
}

impl ProcessObserver {
    pub fn new(
        qemu_pid: u32,
        profile: PathBuf,
        json: Option<JsonSink>,
        text: Option<Box<dyn Write + Send>>,
    ) -> Self {
        ProcessObserver {
            qemu_pid,
            profile,
            view: None,
            broken: false,
            last: HashMap::new(),
            json,
            text,
            read_errors: 0,
        }
    }

    fn view(&mut self) -> Option<&KernelView> {
        if self.view.is_none() && !self.broken {
            let opened = KernelProfile::load(&self.profile)
                .map_err(|e| e.to_string())
                .and_then(|p| {
                    let ram =
                        GuestRam::open_qemu(self.qemu_pid, None).map_err(|e| e.to_string())?;
                    KernelView::new(Arc::new(ram), &p).map_err(|e| e.to_string())
                });
            match opened {
                Ok(v) => self.view = Some(v),
                Err(e) => {
                    tracing::warn!("process tracking is off: cannot read guest kernel memory: {e}");
                    self.broken = true;
                }
            }
        }
        self.view.as_ref()
    }

    fn refresh(&mut self, task: u64, ts_ns: u64) {
        let Some(view) = self.view() else { return };
        let info = match view.task_info(task) {
            Ok(i) => i,
            Err(e) => {
                // The task may have exited before the trace thread got to it.
                tracing::debug!("cannot read task {task:#x}: {e}");
                self.read_errors += 1;
                return;
            }
        };
        let rec = ProcessRecord::from_info(&info, ts_ns);
        let changed = self.last.get(&task).is_none_or(|old| {
            (old.pid, old.tid, old.ppid, &old.comm, &old.exe, &old.cwd)
                != (rec.pid, rec.tid, rec.ppid, &rec.comm, &rec.exe, &rec.cwd)
        });
        if !changed {
            return;
        }
        if let Some(j) = &self.json {
            j.write_value(&rec);
        }
        if let Some(t) = self.text.as_mut() {
            let _ = writeln!(
                t,
                "# {} {} process ppid={} comm={} exe={} cwd={}",
                rec.pid,
                rec.tid,
                rec.ppid,
                rec.comm,
                rec.exe.as_deref().unwrap_or("?"),
                rec.cwd.as_deref().unwrap_or("?")
            );
        }
        self.last.insert(task, rec);
    }
}

impl SyscallObserver for ProcessObserver {
    fn on_entry(&mut self, e: &EntryEvent) {
        if !self.last.contains_key(&e.task) {
            self.refresh(e.task, e.ts_ns);
        }
        if matches!(e.nr, nr::EXIT | nr::EXIT_GROUP) {
            // The task pointer may be reused by a new task once this one is gone.
            self.last.remove(&e.task);
        }
    }

    fn on_complete(&mut self, c: &Completed) {
        let changes = matches!(
            c.entry.nr,
            nr::EXECVE | nr::EXECVEAT | nr::CHDIR | nr::FCHDIR
        );
        if changes && c.outcome == Outcome::Returned(0) {
            self.refresh(c.entry.task, c.exit_ts_ns.unwrap_or(c.entry.ts_ns));
        }
    }

    fn finish(&mut self) {
        if let Some(t) = self.text.as_mut() {
            let _ = t.flush();
        }
    }
}
