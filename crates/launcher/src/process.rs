//! Process tracking for traced tasks: PID, TID, PPID, command, executable and working
//! directory, read from guest kernel memory (the kernel profile says where), never from inside
//! the guest. A record is written when a task is first seen and again after a successful
//! execve/execveat/chdir/fchdir changed what it reports.
//!
//! The reads happen as the records leave the rings ([`SyscallObserver::on_drained`]), not when
//! the ordered calls arrive 20 ms later: a short-lived process (a few ms under TCG) has
//! usually exited by then, taking its `mm` (exe) and `fs` (cwd) with it.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use serde::Serialize;
use vmsight_introspect::kernel::{KernelView, TaskInfo};
use vmsight_introspect::memory::QemuRam;
use vmsight_introspect::syscall::event::{COMM_ARG, CWD_ARG, EXE_ARG};
use vmsight_introspect::syscall::{
    nr, Completed, Drained, EntryEvent, JsonSink, Outcome, SyscallObserver,
};
use vmsight_introspect::KernelProfile;

/// One `"type": "process"` line of `--trace-json`.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ProcessRecord {
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub pid: i32,
    pub tid: i32,
    /// `real_parent->tgid`, from the plugin's reading in the guest (at the process's first
    /// syscall) or vmsight's own; `None` when neither had it.
    pub ppid: Option<i32>,
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
            ppid: Some(i.ppid),
            comm: i.comm.clone(),
            exe: i.exe.clone(),
            cwd: i.cwd.clone(),
            ts_ns,
        }
    }
}

/// Reads task details from guest memory for the tasks the trace sees.
pub struct ProcessObserver {
    ram: QemuRam,
    profile: PathBuf,
    view: Option<KernelView>,
    /// Set when opening guest memory failed, so it is not retried on every event.
    broken: bool,
    last: HashMap<u64, ProcessRecord>,
    /// Details read as the records left the rings, by (task, TID), for the ordered events to
    /// use. The TID keeps a task pointer reused by the next process apart: the drained
    /// records run ahead of the ordered ones.
    early: HashMap<(u64, u32), TaskInfo>,
    /// Tasks whose drained entry was a call that changes their details (execve, chdir..):
    /// read again at their drained return.
    changing: HashMap<(u64, u32), u64>,
    json: Option<JsonSink>,
    text: Option<Box<dyn Write + Send>>,
    pub read_errors: u64,
}

impl ProcessObserver {
    pub fn new(
        ram: QemuRam,
        profile: PathBuf,
        json: Option<JsonSink>,
        text: Option<Box<dyn Write + Send>>,
    ) -> Self {
        ProcessObserver {
            ram,
            profile,
            view: None,
            broken: false,
            last: HashMap::new(),
            early: HashMap::new(),
            changing: HashMap::new(),
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
                    let ram = self.ram.open().map_err(|e| e.to_string())?;
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

    /// Reads `task` now; a failure (the task is gone) is counted.
    fn read(&mut self, task: u64) -> Option<TaskInfo> {
        match self.view()?.task_info(task) {
            Ok(i) => Some(i),
            Err(e) => {
                tracing::debug!("cannot read task {task:#x}: {e}");
                self.read_errors += 1;
                None
            }
        }
    }

    /// Reads `task` as its record leaves the ring, for [`Self::refresh`].
    fn read_early(&mut self, task: u64, tid: u32) {
        if self.early.len() >= MAX_EARLY {
            self.early.clear(); // tasks that never reached an ordered event (a bound)
        }
        if let Some(i) = self.read(task) {
            self.early.insert((task, tid), i);
        }
    }

    /// Writes the record of `e`'s task if it changed: from the early read when there is one,
    /// else read now; what the plugin read in the guest at the event (`plugin`) wins, and
    /// alone makes a record when the task is gone.
    fn refresh(&mut self, e: &EntryEvent, ts_ns: u64, plugin: &PluginDetails) {
        let task = e.task;
        let info = self
            .early
            .remove(&(task, e.tid))
            .or_else(|| self.read(task))
            // Read too late: the task pointer belongs to another task now (a reused slab).
            .filter(|i| (i.tgid, i.pid) == (e.tgid as i32, e.tid as i32));
        let mut rec = match info {
            Some(i) => ProcessRecord::from_info(&i, ts_ns),
            None if plugin.any() => ProcessRecord {
                kind: "process",
                pid: e.tgid as i32,
                tid: e.tid as i32,
                ppid: self.last.get(&task).and_then(|r| r.ppid),
                comm: e.comm.clone(),
                exe: self.last.get(&task).and_then(|r| r.exe.clone()),
                cwd: self.last.get(&task).and_then(|r| r.cwd.clone()),
                ts_ns,
            },
            None => return,
        };
        if plugin.any() {
            // The read above may be of a later moment (an exec since): the event's own name.
            rec.comm = e.comm.clone();
            plugin.apply(&mut rec);
        }
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
                rec.ppid.map_or_else(|| "?".to_string(), |p| p.to_string()),
                rec.comm,
                rec.exe.as_deref().unwrap_or("?"),
                rec.cwd.as_deref().unwrap_or("?")
            );
        }
        self.last.insert(task, rec);
    }
}

/// What the plugin read in the guest while the task was in the call (DATA pieces of the
/// entry: at the first syscall of a process, and at a successful execve/chdir's return).
#[derive(Debug, Default)]
struct PluginDetails {
    exe: Option<String>,
    cwd: Option<String>,
    comm: Option<String>,
    ppid: Option<i32>,
}

impl PluginDetails {
    fn of(e: &EntryEvent) -> Self {
        let whole = |a| {
            e.arg_data(a)
                .filter(|d| !d.fault && !d.truncated && !d.bytes.is_empty())
        };
        let text = |a| whole(a).map(|d| String::from_utf8_lossy(&d.bytes).into_owned());
        PluginDetails {
            exe: text(EXE_ARG),
            cwd: text(CWD_ARG),
            comm: text(COMM_ARG),
            ppid: e.parent_tgid(),
        }
    }

    fn any(&self) -> bool {
        self.exe.is_some() || self.cwd.is_some() || self.comm.is_some() || self.ppid.is_some()
    }

    fn apply(&self, rec: &mut ProcessRecord) {
        if let Some(p) = self.ppid {
            rec.ppid = Some(p);
        }
        if let Some(x) = &self.exe {
            rec.exe = Some(x.clone());
        }
        if let Some(x) = &self.cwd {
            rec.cwd = Some(x.clone());
        }
        if let Some(x) = &self.comm {
            rec.comm = x.clone();
        }
    }
}

/// Most early reads kept at once.
const MAX_EARLY: usize = 4096;

/// Calls after which a task's exe or cwd may differ.
fn changes_details(nr: u64) -> bool {
    matches!(nr, nr::EXECVE | nr::EXECVEAT | nr::CHDIR | nr::FCHDIR)
}

impl SyscallObserver for ProcessObserver {
    fn on_drained(&mut self, ev: &Drained) {
        match *ev {
            Drained::Entry { task, tid, nr, .. } => {
                let seen = self.last.get(&task).is_some_and(|r| r.tid == tid as i32);
                if !seen && !self.early.contains_key(&(task, tid)) {
                    self.read_early(task, tid);
                }
                if changes_details(nr) {
                    self.changing.insert((task, tid), nr);
                }
            }
            Drained::Return { task, tid, .. } => {
                if self.changing.remove(&(task, tid)).is_some() {
                    self.read_early(task, tid);
                }
            }
        }
    }

    fn on_entry(&mut self, e: &EntryEvent) {
        let plugin = PluginDetails::of(e);
        let seen = self
            .last
            .get(&e.task)
            .is_some_and(|r| r.tid == e.tid as i32);
        if !seen || plugin.any() {
            self.refresh(e, e.ts_ns, &plugin);
        }
        if matches!(e.nr, nr::EXIT | nr::EXIT_GROUP) {
            // The task pointer may be reused by a new task once this one is gone.
            self.last.remove(&e.task);
            self.early.remove(&(e.task, e.tid));
            self.changing.remove(&(e.task, e.tid));
        }
    }

    fn on_complete(&mut self, c: &Completed) {
        if changes_details(c.entry.nr) && c.outcome == Outcome::Returned(0) {
            let plugin = PluginDetails::of(&c.entry);
            let ts = c.exit_ts_ns.unwrap_or(c.entry.ts_ns);
            self.refresh(&c.entry, ts, &plugin);
        }
    }

    fn finish(&mut self) {
        if let Some(t) = self.text.as_mut() {
            let _ = t.flush();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vmsight_introspect::syscall::event::{ArgData, PPID_ARG};

    fn entry_with(pieces: &[(u8, &[u8])]) -> EntryEvent {
        EntryEvent {
            data: pieces
                .iter()
                .map(|(arg, bytes)| ArgData {
                    arg: *arg,
                    bytes: bytes.to_vec(),
                    truncated: false,
                    fault: false,
                })
                .collect(),
            ..EntryEvent::default()
        }
    }

    #[test]
    fn the_plugins_parent_pid_is_taken_only_when_it_is_a_plausible_pid() {
        let d = PluginDetails::of(&entry_with(&[(PPID_ARG, &412i32.to_le_bytes())]));
        assert_eq!(d.ppid, Some(412));
        assert!(d.any());
        let mut rec = ProcessRecord {
            kind: "process",
            pid: 500,
            tid: 500,
            ppid: None,
            comm: "sh".into(),
            exe: None,
            cwd: None,
            ts_ns: 0,
        };
        d.apply(&mut rec);
        assert_eq!(rec.ppid, Some(412));
        // Guest data: a wrong length, a negative or an impossible PID is ignored.
        for bad in [
            &[1u8, 0, 0][..],
            &(-1i32).to_le_bytes(),
            &(1i32 << 30).to_le_bytes(),
        ] {
            let d = PluginDetails::of(&entry_with(&[(PPID_ARG, bad)]));
            assert_eq!(d.ppid, None, "{bad:?}");
            assert!(!d.any());
        }
        let exe = PluginDetails::of(&entry_with(&[(EXE_ARG, b"/bin/sh")]));
        assert_eq!((exe.exe.as_deref(), exe.ppid), (Some("/bin/sh"), None));
    }

    #[test]
    fn a_task_gone_before_vmsight_reads_it_keeps_the_parent_the_plugin_read() {
        // No guest memory to read (no such QEMU, no profile): as for a task that exited
        // before vmsight looked, only the plugin's reading is left.
        let mut obs = ProcessObserver::new(
            QemuRam {
                pid: u32::MAX,
                ram_size: None,
            },
            PathBuf::from("/nonexistent/profile.json"),
            None,
            None,
        );
        let mut e = entry_with(&[
            (EXE_ARG, b"/tmp/probe"),
            (CWD_ARG, b"/usr/share/doc"),
            (PPID_ARG, &412i32.to_le_bytes()),
        ]);
        (e.task, e.tgid, e.tid, e.comm) = (0xffff_8880_0001_0000, 500, 500, "probe".into());
        obs.on_entry(&e);
        let rec = &obs.last[&e.task];
        assert_eq!(
            (rec.pid, rec.ppid, rec.exe.as_deref(), rec.cwd.as_deref()),
            (500, Some(412), Some("/tmp/probe"), Some("/usr/share/doc"))
        );
    }
}
