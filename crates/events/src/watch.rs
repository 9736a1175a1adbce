//! Discovery of running VMs and the `vmsight watch` client, which merges the event streams of
//! every local VM's embedded bus.

use std::collections::HashMap;
use std::io::{self, BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use vmsight_fsview::Value;
use vmsight_proto::layout::RuntimeLayout;

use crate::bus::subscribe;
use crate::message::{Message, Notice, StreamItem};
use crate::pattern::Pattern;

pub use vmsight_proto::layout::{runtime_base, EVENTS_SOCKET};

/// A running VM found in the runtime directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunningVm {
    /// VM name.
    pub name: String,
    /// Its runtime directory (`<base>/<name>`).
    pub dir: PathBuf,
    /// The vmsight process that owns it.
    pub pid: u32,
}

impl RunningVm {
    /// Path of a file in the VM's runtime directory.
    pub fn join(&self, file: &str) -> PathBuf {
        self.dir.join(file)
    }
}

/// VMs under `base` whose `vm.json` names a live process, sorted by name.
pub fn running_vms(base: &Path) -> Vec<RunningVm> {
    RuntimeLayout::at(base)
        .running()
        .into_iter()
        .map(|vm| RunningVm {
            name: vm.record.name,
            dir: vm.paths.dir().to_path_buf(),
            pid: vm.record.pid,
        })
        .collect()
}

/// Options of [`watch`].
#[derive(Debug, Clone)]
pub struct WatchOptions {
    /// Only this VM.
    pub vm: Option<String>,
    /// Ask for written bytes (`data_b64`).
    pub data: bool,
    /// Print JSON lines instead of readable lines.
    pub json: bool,
    /// Where running VMs are found.
    pub runtime: PathBuf,
    /// How often to look for new VMs.
    pub rescan: Duration,
    /// Stop after this many messages.
    pub limit: Option<u64>,
    /// Set to stop watching.
    pub stop: Arc<AtomicBool>,
}

impl Default for WatchOptions {
    fn default() -> Self {
        WatchOptions {
            vm: None,
            data: false,
            json: false,
            runtime: runtime_base(),
            rescan: Duration::from_secs(1),
            limit: None,
            stop: Arc::new(AtomicBool::new(false)),
        }
    }
}

enum Feed {
    Line(String, String),
    Ended(String, PathBuf),
}

/// Watches every running VM (or `opts.vm`) for messages matching any of `patterns` (all if
/// empty) and writes them to `out` until `opts.stop` is set, `opts.limit` messages were
/// written, or writing fails. VMs that start later are picked up at the next rescan.
pub fn watch(patterns: &[Pattern], opts: &WatchOptions, out: &mut dyn Write) -> io::Result<u64> {
    let (tx, rx) = mpsc::channel::<Feed>();
    // VM name -> runtime dir of the instance we are connected to.
    let mut active: HashMap<String, PathBuf> = HashMap::new();
    let mut written = 0u64;
    let mut next_scan = Instant::now();
    loop {
        if opts.stop.load(Ordering::SeqCst) || opts.limit.is_some_and(|l| written >= l) {
            return Ok(written);
        }
        if Instant::now() >= next_scan {
            for vm in running_vms(&opts.runtime) {
                if opts.vm.as_ref().is_some_and(|n| *n != vm.name) || active.contains_key(&vm.name)
                {
                    continue;
                }
                let sock = vm.join(EVENTS_SOCKET);
                match subscribe(&sock, patterns, opts.data) {
                    Ok(reader) => {
                        tracing::info!("watching {}", vm.name);
                        active.insert(vm.name.clone(), vm.dir.clone());
                        let tx = tx.clone();
                        let (name, dir) = (vm.name.clone(), vm.dir.clone());
                        thread::Builder::new()
                            .name("watch-vm".into())
                            .spawn(move || {
                                for line in reader.lines() {
                                    let Ok(line) = line else { break };
                                    if tx.send(Feed::Line(name.clone(), line)).is_err() {
                                        return;
                                    }
                                }
                                let _ = tx.send(Feed::Ended(name, dir));
                            })?;
                    }
                    Err(e) => tracing::debug!("{}: no event stream yet: {e}", sock.display()),
                }
            }
            next_scan = Instant::now() + opts.rescan;
        }
        let wait = next_scan
            .saturating_duration_since(Instant::now())
            .min(Duration::from_millis(200));
        match rx.recv_timeout(wait) {
            Ok(Feed::Line(vm, line)) => {
                if let Some((text, is_message)) = render(&vm, &line, opts.json) {
                    out.write_all(text.as_bytes())?;
                    out.write_all(b"\n")?;
                    out.flush()?;
                    written += u64::from(is_message);
                }
            }
            Ok(Feed::Ended(vm, dir)) => {
                tracing::info!("{vm}: event stream ended");
                if active.get(&vm) == Some(&dir) {
                    active.remove(&vm);
                }
            }
            Err(_) => {}
        }
    }
}

/// Turns one stream line into output and whether it is a message (None: not shown).
fn render(vm: &str, line: &str, json: bool) -> Option<(String, bool)> {
    match StreamItem::parse(line) {
        Ok(StreamItem::Message(m)) => {
            Some((if json { line.to_string() } else { readable(&m) }, true))
        }
        Ok(StreamItem::Notice(Notice::Dropped { count })) => Some((
            if json {
                serde_json::json!({"type": "dropped", "vm": vm, "count": count}).to_string()
            } else {
                format!("# {vm}: {count} messages dropped (watcher too slow)")
            },
            false,
        )),
        Ok(StreamItem::Notice(_)) => None,
        Err(e) => {
            tracing::warn!("{vm}: {e}");
            None
        }
    }
}

fn value(v: &Value) -> String {
    match v {
        Value::Mode(m) => format!("{:o}", m & 0o7777),
        Value::Owner { uid, gid } => format!("{uid}:{gid}"),
        Value::Size(s) => s.to_string(),
        Value::Time(t) => t.to_string(),
        Value::Target(t) => t.clone(),
    }
}

/// The readable form: `seq host:vm:/path type details`.
pub fn readable(m: &Message) -> String {
    let ev = &m.event;
    let kind = serde_json::to_value(ev.kind)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    let mut s = format!("{} {} {}", m.seq, m.channel(), kind);
    if let Some(old) = &ev.old_path {
        s.push_str(&format!(" from {old}"));
    }
    match (&ev.old, &ev.new) {
        (Some(o), Some(n)) => s.push_str(&format!(" {} -> {}", value(o), value(n))),
        (None, Some(n)) => s.push_str(&format!(" {}", value(n))),
        (Some(o), None) => s.push_str(&format!(" was {}", value(o))),
        (None, None) => {}
    }
    if let Some((a, b)) = ev.range {
        s.push_str(&format!(" [{a},{b})"));
    }
    if let Some(d) = &ev.data {
        s.push_str(&format!(" {} bytes", d.len()));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bus::EventBus;
    use crate::message::Addresser;
    use vmsight_fsview::{EventKind, FsEvent};

    fn ev(kind: EventKind, path: &str) -> FsEvent {
        FsEvent {
            kind,
            path: path.into(),
            old_path: None,
            ino: 5,
            old: None,
            new: None,
            range: None,
            data: None,
            txn: None,
            observed_ns: 0,
        }
    }

    fn fake_vm(base: &Path, name: &str) -> EventBus {
        let dir = base.join(name);
        std::fs::create_dir_all(&dir).unwrap();
        let rec = serde_json::json!({"name": name, "pid": std::process::id()});
        std::fs::write(dir.join("vm.json"), rec.to_string()).unwrap();
        EventBus::bind(dir.join(EVENTS_SOCKET)).unwrap()
    }

    #[test]
    fn discovery_skips_dead_and_broken_entries() {
        let d = tempfile::tempdir().unwrap();
        let _a = fake_vm(d.path(), "a");
        std::fs::create_dir(d.path().join("dead")).unwrap();
        // pid 0 has no /proc entry.
        std::fs::write(d.path().join("dead/vm.json"), r#"{"name":"dead","pid":0}"#).unwrap();
        std::fs::create_dir(d.path().join("junk")).unwrap();
        std::fs::write(d.path().join("junk/vm.json"), "{").unwrap();
        let vms = running_vms(d.path());
        assert_eq!(vms.len(), 1);
        assert_eq!(vms[0].name, "a");
        assert!(running_vms(&d.path().join("missing")).is_empty());
    }

    #[test]
    fn merges_vms_including_ones_that_start_later() {
        let d = tempfile::tempdir().unwrap();
        let bus_a = fake_vm(d.path(), "a");
        let opts = WatchOptions {
            runtime: d.path().to_path_buf(),
            rescan: Duration::from_millis(50),
            limit: Some(2),
            ..WatchOptions::default()
        };
        let pats = vec![Pattern::parse("/etc/**").unwrap()];
        let (done_tx, done_rx) = mpsc::channel();
        let o = opts.clone();
        let h = thread::spawn(move || {
            let mut out = Vec::new();
            watch(&pats, &o, &mut out).unwrap();
            done_tx.send(()).unwrap();
            String::from_utf8(out).unwrap()
        });
        let a = Addresser::new("h", "a");
        // Publish until the watcher is connected and has taken the message (no timing
        // assumption: repeat until the bus has a client).
        while bus_a.stats().clients == 0 {
            thread::sleep(Duration::from_millis(10));
        }
        bus_a.publish(&a.wrap(ev(EventKind::Create, "/tmp/ignored")));
        bus_a.publish(&a.wrap(ev(EventKind::Create, "/etc/a")));
        let bus_b = fake_vm(d.path(), "b");
        while bus_b.stats().clients == 0 {
            thread::sleep(Duration::from_millis(10));
        }
        bus_b.publish(&Addresser::new("h", "b").wrap(ev(EventKind::Mkdir, "/etc/b")));
        done_rx.recv().unwrap();
        let text = h.join().unwrap();
        assert_eq!(text, "2 h:a:/etc/a create\n1 h:b:/etc/b mkdir\n");
    }

    #[test]
    fn readable_lines() {
        let mut e = ev(EventKind::Rename, "/b");
        e.old_path = Some("/a".into());
        let m = Addresser::new("h", "v").wrap(e);
        assert_eq!(readable(&m), "1 h:v:/b rename from /a");
        let mut e = ev(EventKind::Chmod, "/f");
        e.old = Some(Value::Mode(0o100644));
        e.new = Some(Value::Mode(0o100600));
        assert_eq!(
            readable(&Addresser::new("h", "v").wrap(e)),
            "1 h:v:/f chmod 644 -> 600"
        );
        let mut e = ev(EventKind::Write, "/f");
        e.range = Some((0, 4));
        e.data = Some(vec![0; 4]);
        assert_eq!(
            readable(&Addresser::new("h", "v").wrap(e)),
            "1 h:v:/f write [0,4) 4 bytes"
        );
    }
}
