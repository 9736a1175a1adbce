//! Lookups: what the engine asks a source when it did not see the syscall that would have
//! told it (a process's working directory, an inherited fd), with a fake source.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::lookup::{FdFacts, Lookup, LookupSource, TaskFacts};

use super::*;

/// What the fake guest knows, and what it was asked.
#[derive(Default)]
struct Guest {
    cwd: HashMap<u32, String>,
    fds: HashMap<(u32, u32), (String, u64)>,
    tasks_asked: Vec<u32>,
    fds_asked: Vec<(u32, u32)>,
}

/// A source answering from a [`Guest`] the test keeps a handle on.
struct FakeLookup {
    guest: Arc<Mutex<Guest>>,
    source: LookupSource,
}

impl Lookup for FakeLookup {
    fn task(&mut self, pid: u32) -> Option<(TaskFacts, LookupSource)> {
        let mut g = self.guest.lock().unwrap();
        g.tasks_asked.push(pid);
        let cwd = g.cwd.get(&pid)?.clone();
        let facts = TaskFacts {
            tgid: pid,
            ppid: 1,
            comm: "guest".into(),
            exe: None,
            cwd: Some(cwd),
        };
        Some((facts, self.source))
    }

    fn fd(&mut self, pid: u32, fd: u32) -> Option<(FdFacts, LookupSource)> {
        let mut g = self.guest.lock().unwrap();
        g.fds_asked.push((pid, fd));
        let (path, pos) = g.fds.get(&(pid, fd))?.clone();
        let facts = FdFacts {
            path,
            flags: Some(1),
            pos: Some(pos),
        };
        Some((facts, self.source))
    }
}

/// A world whose engine asks a fake guest through `source`.
fn lookup_world(cfg: InsightConfig, source: LookupSource) -> (World, Arc<Mutex<Guest>>) {
    let w = world(cfg);
    let guest = Arc::new(Mutex::new(Guest::default()));
    w.engine.set_lookup(Some(Box::new(FakeLookup {
        guest: guest.clone(),
        source,
    })));
    (w, guest)
}

#[test]
fn a_relative_open_resolves_against_the_looked_up_cwd() {
    let (mut w, guest) = lookup_world(InsightConfig::default(), LookupSource::Profile);
    guest
        .lock()
        .unwrap()
        .cwd
        .insert(60, "/srv/app/../data".into());
    // The process's first event is the open: its cwd is asked for, then the path resolved.
    w.open(60, "app", "out/f", 3, 0o101);
    let d = content(40, 4096);
    let c = w.io_event(60, "app", 3, 0, &d, 0, false);
    w.syscall(&c);
    let i = w.block_write(0, &d);
    assert_eq!(i.content, Content::Data);
    assert_eq!(i.file.as_deref(), Some("/srv/data/out/f"), "normalised");
    // A child inherits the known cwd: nobody is asked about it.
    let c = w.call(60, "app", 57, [0; 6], 61);
    w.syscall(&c);
    w.open(61, "app", "g", 4, 0o101);
    let e = content(41, 4096);
    let c = w.io_event(61, "app", 4, 0, &e, 0, false);
    w.syscall(&c);
    assert_eq!(w.block_write(4096, &e).file.as_deref(), Some("/srv/data/g"));
    // No source knows pid 62's cwd: its relative paths stay relative, as without lookups.
    w.open(62, "other", "h", 3, 0o101);
    let f = content(42, 4096);
    let c = w.io_event(62, "other", 3, 0, &f, 0, false);
    w.syscall(&c);
    assert_eq!(w.block_write(8192, &f).file.as_deref(), Some("h"));
    assert_eq!(guest.lock().unwrap().tasks_asked, vec![60, 62]);
    let n = w.engine.counters();
    assert_eq!((n.lookups_task_profile, n.lookup_failures), (1, 1));
}

#[test]
fn a_write_on_an_inherited_fd_gets_the_looked_up_path_and_its_selection() {
    let cfg = InsightConfig {
        paths: vec!["/sel".into()],
        ..InsightConfig::default()
    };
    let (mut w, guest) = lookup_world(cfg, LookupSource::Profile);
    {
        let mut g = guest.lock().unwrap();
        g.cwd.insert(70, "/".into());
        // `prog > /sel/out 2> /other/log`: the shell opened both, prog never did.
        g.fds.insert((70, 1), ("/sel/out".into(), 8192));
        g.fds.insert((70, 2), ("/other/log".into(), 0));
        g.fds.insert((70, 5), ("socket:[4711]".into(), 0));
        g.fds.insert((70, 9), ("/sel/dir".into(), 0));
    }
    let d = content(50, 8192);
    let c = w.io_event(70, "prog", 1, 8192, &d, 8192, false);
    w.syscall(&c);
    let i = w.block_write(0, &d);
    assert_eq!(i.content, Content::Data);
    assert_eq!(i.file.as_deref(), Some("/sel/out"));
    assert_eq!((i.pid, i.file_offset, i.class), (Some(70), Some(8192), 4));
    // The position the source gave is where a plain write continues.
    let c = w.call(70, "prog", 1, [1, 0x7000, 100, 0, 0, 0], 100);
    w.syscall(&c);
    assert_eq!(w.engine.lock().fd_offset(70, 1), Some(8292));
    // Not selected by --insight-paths: not indexed, as if it had been opened in front of us.
    let e = content(51, 4096);
    let c = w.io_event(70, "prog", 2, 0, &e, 0, false);
    w.syscall(&c);
    assert_eq!(w.block_write(16384, &e).content, Content::Metadata);
    // A socket is known but names no file: sendfile to it is not a copy to follow.
    let c = w.call(70, "prog", 40, [5, 1, 0, 4096, 0, 0], 4096);
    w.syscall(&c);
    assert_eq!(w.engine.counters().copy_calls, 0);
    // A path relative to an inherited directory fd (openat(9, "x")).
    let mut c = w.call(70, "prog", 257, [9, 0x1000, 0o101, 0o644, 0, 0], 6);
    c.entry.data.push(ArgData {
        arg: 1,
        bytes: b"x".to_vec(),
        ..Default::default()
    });
    w.syscall(&c);
    let f = content(52, 4096);
    let c = w.io_event(70, "prog", 6, 0, &f, 0, false);
    w.syscall(&c);
    assert_eq!(w.block_write(20480, &f).file.as_deref(), Some("/sel/dir/x"));
    let n = w.engine.counters();
    assert_eq!((n.lookups_fd_profile, n.lookup_failures), (4, 0));
}

/// A source during whose lookups the block side classifies a request on another thread.
struct BlockSideDuring {
    engine: InsightEngine,
    classified: Arc<Mutex<Vec<bool>>>,
}

impl Lookup for BlockSideDuring {
    fn task(&mut self, _pid: u32) -> Option<(TaskFacts, LookupSource)> {
        let e = self.engine.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let i = e.lock().classify_read(0, 0, &[0u8; 4096]);
            let _ = tx.send(i);
        });
        // Were the engine locked during lookups, this would time out.
        let ok = rx.recv_timeout(Duration::from_secs(10)).is_ok();
        self.classified.lock().unwrap().push(ok);
        None
    }

    fn fd(&mut self, _pid: u32, _fd: u32) -> Option<(FdFacts, LookupSource)> {
        None
    }
}

#[test]
fn lookups_run_without_the_engines_lock() {
    let mut w = world(InsightConfig::default());
    let classified = Arc::new(Mutex::new(Vec::new()));
    w.engine.set_lookup(Some(Box::new(BlockSideDuring {
        engine: w.engine.clone(),
        classified: classified.clone(),
    })));
    let d = content(53, 4096);
    let c = w.io_event(95, "app", 3, 0, &d, 0, false);
    w.syscall(&c);
    assert_eq!(*classified.lock().unwrap(), vec![true]);
}

#[test]
fn each_process_and_fd_is_asked_once_until_a_seen_syscall_changes_it() {
    let (mut w, guest) = lookup_world(InsightConfig::default(), LookupSource::Profile);
    // The guest knows nothing about pid 80 (it exited before the trace thread got to it).
    for k in 0..3u8 {
        let d = content(60 + k, 4096);
        let c = w.io_event(80, "app", 5, u64::from(k) * 4096, &d, 0, false);
        w.syscall(&c);
        let c = w.call(80, "app", 8, [5, 0, 0, 0, 0, 0], 0); // lseek
        w.syscall(&c);
    }
    {
        let g = guest.lock().unwrap();
        assert_eq!(g.tasks_asked, vec![80]);
        assert_eq!(g.fds_asked, vec![(80, 5)]);
    }
    assert_eq!(w.engine.counters().lookup_failures, 2);
    // A failed call changes nothing and asks nothing.
    let c = w.call(80, "app", 8, [9, 0, 0, 0, 0, 0], -9);
    w.syscall(&c);
    // Opened in front of us: known without asking; closed: unknown, asked again at its use.
    w.open(80, "app", "/a", 5, 0o101);
    let c = w.call(80, "app", 8, [5, 0, 0, 0, 0, 0], 0);
    w.syscall(&c);
    let c = w.call(80, "app", 3, [5, 0, 0, 0, 0, 0], 0);
    w.syscall(&c);
    let c = w.call(80, "app", 8, [5, 0, 0, 0, 0, 0], 0);
    w.syscall(&c);
    // dup2 onto a missed fd forgets the miss too.
    let c = w.call(80, "app", 8, [6, 0, 0, 0, 0, 0], 0);
    w.syscall(&c);
    w.open(80, "app", "/b", 7, 0o101);
    let c = w.call(80, "app", 33, [7, 6, 0, 0, 0, 0], 6);
    w.syscall(&c);
    let c = w.call(80, "app", 8, [6, 0, 0, 0, 0, 0], 0);
    w.syscall(&c);
    // A new program: the process is asked about again (its cwd still unknown) at its next
    // event.
    let c = w.call(80, "app", 59, [0; 6], 0);
    w.syscall(&c);
    let c = w.call(80, "app", 8, [6, 0, 0, 0, 0, 0], 0);
    w.syscall(&c);
    {
        let g = guest.lock().unwrap();
        assert_eq!(g.tasks_asked, vec![80, 80]);
        assert_eq!(g.fds_asked, vec![(80, 5), (80, 5), (80, 6)]);
    }
    assert_eq!(w.engine.counters().lookup_failures, 5);
}

#[test]
fn counters_say_which_source_answered() {
    let (mut w, guest) = lookup_world(InsightConfig::default(), LookupSource::Symcall);
    {
        let mut g = guest.lock().unwrap();
        g.cwd.insert(90, "/home".into());
        g.cwd.insert(91, "/root".into());
        g.fds.insert((90, 1), ("/home/out".into(), 0));
        g.fds.insert((91, 1), ("/root/out".into(), 0));
    }
    let d = content(70, 4096);
    let c = w.io_event(90, "a", 1, 0, &d, 0, false);
    w.syscall(&c);
    // The same facts from the other source (a SymCall source falls back to the profile).
    w.engine.set_lookup(Some(Box::new(FakeLookup {
        guest: guest.clone(),
        source: LookupSource::Profile,
    })));
    let c = w.io_event(91, "b", 1, 0, &d, 0, false);
    w.syscall(&c);
    let n = w.engine.counters();
    assert_eq!(
        (
            n.lookups_task_symcall,
            n.lookups_fd_symcall,
            n.lookups_task_profile,
            n.lookups_fd_profile,
            n.lookup_failures
        ),
        (1, 1, 1, 1, 0)
    );
    assert_eq!(n.lookups_answered(), 4);
    let json = serde_json::to_value(&n).unwrap();
    assert_eq!(json["lookups_fd_symcall"], 1);
    assert_eq!(json["lookups_task_profile"], 1);
    // Without a source nothing is asked.
    w.engine.set_lookup(None);
    let c = w.io_event(92, "c", 1, 0, &d, 0, false);
    w.syscall(&c);
    assert_eq!(w.engine.counters(), n);
}
