//! File-update streaming on real guests (issue 5), checked against oracles inside the guest:
//! `inotifywait` sees the same creates, deletes, renames and attribute changes as vmsight's
//! events; the FUSE view of the running VM equals the guest's own `find`/`sha256sum`; Redis and
//! `vmsight watch` deliver the same messages; a live attach starts streaming a running VM; an
//! overloaded stream keeps every metadata event and reports its data drops.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use vmsight_tests::*;

// ---------------------------------------------------------------------------------------------
// Helpers.

fn read_events(file: &Path) -> Vec<Value> {
    std::fs::read_to_string(file)
        .unwrap_or_else(|e| panic!("events file {}: {e}", file.display()))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("bad event line {l:?}: {e}")))
        .collect()
}

fn s<'a>(v: &'a Value, k: &str) -> &'a str {
    v[k].as_str().unwrap_or("")
}

fn has_event(evs: &[Value], ty: &str, path: &str) -> bool {
    evs.iter()
        .any(|e| s(e, "type") == ty && s(e, "path") == path)
}

// ---------------------------------------------------------------------------------------------
// Net effect of a step: the comparison rule between inotify and vmsight.

/// What one step (the changes between two `sync`-separated markers) did to one object.
#[derive(Debug, Default, Clone)]
struct Obj {
    /// Name at the start of the step (None: created in the step).
    start: Option<String>,
    /// Name at the end (None: deleted).
    end: Option<String>,
    dir: bool,
    attrib: bool,
    modify: bool,
    /// Renamed in from a directory inotify did not watch (a lone `MOVED_TO`).
    moved_in: bool,
}

/// Follows names through creates, deletes and renames (a directory rename moves the names
/// below it), so both streams reduce to the same per-step net effect.
#[derive(Debug, Default)]
struct NetEffect {
    objs: Vec<Obj>,
    by_name: BTreeMap<String, usize>,
    /// Directory renames of this step (old, new), to find the start name of a name first
    /// seen below a renamed directory.
    dir_moves: Vec<(String, String)>,
    /// The step's input lines, for failure messages.
    raw: Vec<String>,
}

impl NetEffect {
    fn obj(&mut self, name: &str) -> usize {
        if let Some(&i) = self.by_name.get(name) {
            return i;
        }
        // A name first seen below a directory created in this step is new too (inotifywait
        // -r watches a new directory only once it exists, so it can miss the creates in it).
        let in_new_dir = self.objs.iter().any(|o| {
            o.start.is_none()
                && o.dir
                && o.end
                    .as_ref()
                    .is_some_and(|e| name.starts_with(&format!("{e}/")))
        });
        if in_new_dir {
            self.create(name, false);
            return self.objs.len() - 1;
        }
        let mut start = name.to_string();
        for (old, new) in self.dir_moves.iter().rev() {
            if let Some(rest) = start.strip_prefix(&format!("{new}/")) {
                start = format!("{old}/{rest}");
            }
        }
        self.objs.push(Obj {
            start: Some(start),
            end: Some(name.to_string()),
            ..Obj::default()
        });
        self.by_name.insert(name.to_string(), self.objs.len() - 1);
        self.objs.len() - 1
    }

    fn create(&mut self, name: &str, dir: bool) {
        self.by_name.remove(name);
        self.objs.push(Obj {
            start: None,
            end: Some(name.to_string()),
            dir,
            ..Obj::default()
        });
        self.by_name.insert(name.to_string(), self.objs.len() - 1);
    }

    fn delete(&mut self, name: &str, dir: bool) {
        let i = self.obj(name);
        self.objs[i].end = None;
        self.objs[i].dir |= dir;
        self.by_name.remove(name);
    }

    fn rename(&mut self, from: &str, to: &str, dir: bool) {
        let i = self.obj(from);
        self.objs[i].dir |= dir;
        self.rename_obj(i, from, to);
    }

    fn rename_obj(&mut self, i: usize, from: &str, to: &str) {
        if self.by_name.get(from) == Some(&i) {
            self.by_name.remove(from);
        }
        self.by_name.remove(to);
        self.objs[i].end = Some(to.to_string());
        self.by_name.insert(to.to_string(), i);
        // Events do not say whether a renamed object is a directory: move any names below it
        // (a file has none).
        {
            let prefix = format!("{from}/");
            let moved: Vec<(String, usize)> = self
                .by_name
                .range(prefix.clone()..)
                .take_while(|(k, _)| k.starts_with(&prefix))
                .map(|(k, v)| (k.clone(), *v))
                .collect();
            for (k, v) in moved {
                let n = format!("{to}/{}", &k[prefix.len()..]);
                self.by_name.remove(&k);
                self.objs[v].end = Some(n.clone());
                self.by_name.insert(n, v);
            }
            self.dir_moves.push((from.to_string(), to.to_string()));
        }
    }

    fn attrib(&mut self, name: &str) {
        let i = self.obj(name);
        self.objs[i].attrib = true;
    }

    fn modify(&mut self, name: &str) {
        let i = self.obj(name);
        self.objs[i].modify = true;
    }

    /// Name changes as comparable items: `create D|F path`, `delete path`, `rename a -> b`.
    fn names(&self) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        for o in &self.objs {
            match (&o.start, &o.end) {
                (None, Some(e)) => {
                    out.insert(format!("create {} {e}", if o.dir { "D" } else { "F" }));
                }
                (Some(s), None) => {
                    out.insert(format!("delete {s}"));
                }
                (Some(s), Some(e)) if s != e => {
                    out.insert(format!("rename {s} -> {e}"));
                }
                _ => {}
            }
        }
        out
    }

    /// Attribute changes of objects that existed before the step and still exist (the
    /// attributes of a new object are part of its create; those of a deleted one are gone).
    fn attribs(&self) -> BTreeSet<String> {
        self.objs
            .iter()
            .filter(|o| o.attrib && o.start.is_some())
            .filter_map(|o| o.end.clone())
            .collect()
    }

    /// Objects whose data or size changed and that still exist.
    fn modified(&self) -> BTreeSet<String> {
        self.objs
            .iter()
            .filter(|o| o.modify)
            .filter_map(|o| o.end.clone())
            .collect()
    }
}

/// Splits inotifywait lines (`EVENTS|path`) into steps at `CREATE|/run/mark/N` and reduces each
/// step to its net effect, keeping paths under `trees`.
fn inotify_steps(lines: &[String], trees: &[&str]) -> Vec<NetEffect> {
    let mut steps = vec![NetEffect::default()];
    let under = |p: &str| trees.iter().any(|t| p.starts_with(&format!("{t}/")));
    let mut moved_from: Option<(String, bool)> = None;
    for l in lines {
        let Some((evs, path)) = l.split_once('|') else {
            continue;
        };
        // A directory's own watch reports it with a trailing slash, as `*_SELF` or as a
        // duplicate of its parent's event.
        if path.ends_with('/') {
            continue;
        }
        let evs: BTreeSet<&str> = evs.split(',').collect();
        if path.starts_with("/run/mark/") {
            if evs.contains("CREATE") {
                steps.push(NetEffect::default());
            }
            continue;
        }
        if !under(path) {
            continue;
        }
        let dir = evs.contains("ISDIR");
        let ne = steps.last_mut().unwrap();
        ne.raw.push(l.clone());
        if evs.contains("CREATE") {
            ne.create(path, dir);
        } else if evs.contains("DELETE") {
            ne.delete(path, dir);
        } else if evs.contains("MOVED_FROM") {
            moved_from = Some((path.to_string(), dir));
        } else if evs.contains("MOVED_TO") {
            match moved_from.take() {
                Some((from, _)) => ne.rename(&from, path, dir),
                // Moved in from a directory that is not watched.
                None => {
                    ne.create(path, dir);
                    if let Some(o) = ne.objs.last_mut() {
                        o.moved_in = true;
                    }
                }
            }
        } else if evs.contains("ATTRIB") {
            ne.attrib(path);
        } else if evs.contains("MODIFY") {
            ne.modify(path);
        }
    }
    steps
}

/// Splits vmsight's events of one disk into steps at the creates of `marks/N` and reduces each
/// step to its net effect, keeping paths under `trees`.
fn vmsight_steps(events: &[Value], marks: &str, trees: &[&str]) -> Vec<NetEffect> {
    let mut steps = vec![NetEffect::default()];
    let under = |p: &str| trees.iter().any(|t| p.starts_with(&format!("{t}/")));
    // The events of one transaction are a net change, not a syscall sequence (deletes, then
    // renames and creates, then attributes): old names refer to the state before it, new
    // names to the state after. Apply each transaction in those phases.
    let mut group: Vec<&Value> = Vec::new();
    let flush = |ne: &mut NetEffect, group: &mut Vec<&Value>| {
        let phase = |ty: &str| match ty {
            "delete" | "rmdir" => 0,
            "rename" => 1,
            "create" | "symlink" | "link" | "mkdir" => 2,
            _ => 3,
        };
        group.sort_by_key(|e| phase(s(e, "type")));
        // Renames: look every source up before any of them moves.
        let ids: Vec<Option<usize>> = group
            .iter()
            .map(|e| (s(e, "type") == "rename").then(|| ne.obj(s(e, "old_path"))))
            .collect();
        for (e, id) in group.iter().zip(ids) {
            let (ty, path) = (s(e, "type"), s(e, "path"));
            match ty {
                "create" | "symlink" | "link" => ne.create(path, false),
                "mkdir" => ne.create(path, true),
                "delete" => ne.delete(path, false),
                "rmdir" => ne.delete(path, true),
                "rename" => ne.rename_obj(id.unwrap(), s(e, "old_path"), path),
                "chmod" | "chown" | "mtime" => ne.attrib(path),
                "write" | "truncate" | "extend" => ne.modify(path),
                _ => {}
            }
        }
        group.clear();
    };
    let mut txn: Option<Value> = None;
    for e in events {
        let (ty, path) = (s(e, "type"), s(e, "path"));
        if ty == "create" && path.starts_with(&format!("{marks}/")) {
            flush(steps.last_mut().unwrap(), &mut group);
            steps.push(NetEffect::default());
            continue;
        }
        if !under(path) {
            continue;
        }
        if txn.as_ref() != Some(&e["txn"]) {
            flush(steps.last_mut().unwrap(), &mut group);
            txn = Some(e["txn"].clone());
        }
        steps.last_mut().unwrap().raw.push(e.to_string());
        group.push(e);
    }
    flush(steps.last_mut().unwrap(), &mut group);
    steps
}

/// Whether inotify's `create T DIR/NAME` is a name reported under a stale path: `inotifywait
/// -r` names a new object by the path its directory had when the watch was added, so when it
/// missed that directory's create and rename (both done before its watch on the parent
/// existed, as dpkg does with `doc.dpkg-new` -> `doc`), it reports `doc.dpkg-new/README` where
/// the file really is `doc/README`. Accepted when inotify never saw DIR created in the step and
/// vmsight reports the same NAME created under a directory it saw created in the step beside
/// DIR (same parent).
fn under_stale_watch_path(x: &str, ino: &BTreeSet<String>, vm: &BTreeSet<String>) -> bool {
    let Some((kind, path)) = x.strip_prefix("create ").and_then(|r| r.split_once(' ')) else {
        return false;
    };
    let Some((dir, name)) = path.rsplit_once('/') else {
        return false;
    };
    let Some((grand, _)) = dir.rsplit_once('/') else {
        return false;
    };
    if ino.contains(&format!("create D {dir}")) {
        return false;
    }
    vm.iter()
        .filter_map(|v| v.strip_prefix("create D "))
        .filter(|d| d.rsplit_once('/').map(|(g, _)| g) == Some(grand) && *d != dir)
        .any(|d| vm.contains(&format!("create {kind} {d}/{name}")))
}

/// The comparison rule (also in docs/filestream.md, "Guarantees and what cannot be seen"),
/// per step between two `sync`s:
/// - every name change inotify saw, reduced to its net effect over the step, is among
///   vmsight's (same reduction): a create, delete or rename undone within the step is
///   invisible on disk, and `a -> b -> c` is `a -> c`;
/// - a name inotify saw only arrive (a `MOVED_TO` without `MOVED_FROM`: renamed in from a
///   directory it did not watch) matches vmsight's rename to that name;
/// - a name inotify reports under a directory path it never saw created in the step matches
///   vmsight's create of the same name under a directory created beside it in the step
///   (`inotifywait -r` keeps a watch's old path when it missed the directory's rename);
/// - vmsight may report more names only below a directory created in the same step
///   (`inotifywait -r` watches a new directory only after it was created, so it misses what
///   is created in it right away, e.g. by dpkg), or in directories created during the run in
///   which inotify never reported any event at all (`unwatched`: dpkg's directories whose
///   watch inotifywait lost; a rename needs both its directories unwatched);
/// - every attribute change (ATTRIB) inotify saw on an object that existed before the step
///   and still exists is a `chmod`, `chown` or `mtime` event for that object; on objects
///   created in the step it is part of the create;
/// - every object inotify saw modified (MODIFY) that still exists has a `write`, `truncate`
///   or `extend` event in the step.
fn compare_step(n: usize, ino: &NetEffect, vm: &NetEffect, unwatched: &BTreeSet<String>) {
    let raw = format!(
        "\ninotify:\n{}\nvmsight:\n{}",
        ino.raw.join("\n"),
        vm.raw.join("\n")
    );
    let (a, b) = (ino.names(), vm.names());
    // A name inotify saw only arrive (renamed in from a directory it did not watch, e.g. one
    // dpkg created before inotifywait added its watch) is vmsight's rename to that name.
    let moved_in: BTreeMap<String, bool> = ino
        .objs
        .iter()
        .filter(|o| o.moved_in)
        .filter_map(|o| Some((o.end.clone()?, o.dir)))
        .collect();
    let b: BTreeSet<String> = b
        .into_iter()
        .map(|x| match x.split_once(" -> ") {
            Some((_, to)) if x.starts_with("rename ") && moved_in.contains_key(to) => {
                format!("create {} {to}", if moved_in[to] { "D" } else { "F" })
            }
            _ => x,
        })
        .collect();
    let missing: Vec<_> = a
        .difference(&b)
        .filter(|x| !under_stale_watch_path(x, &a, &b))
        .collect();
    assert!(
        missing.is_empty(),
        "step {n}: name changes inotify saw but vmsight did not: {missing:?}\n inotify {a:?}\n vmsight {b:?}{raw}"
    );
    let new_dirs: Vec<String> = a
        .iter()
        .filter_map(|x| x.strip_prefix("create D "))
        .map(|d| format!("{d}/"))
        .collect();
    let extra: Vec<_> = b
        .difference(&a)
        .filter(|x| {
            let p = x.rsplit(' ').next().unwrap_or("");
            !(x.starts_with("create ") && new_dirs.iter().any(|d| p.starts_with(d.as_str())))
        })
        .filter(|x| !in_unwatched_dirs(x, unwatched))
        .collect();
    assert!(
        extra.is_empty(),
        "step {n}: name changes vmsight reported that inotify did not see: {extra:?}\n inotify {a:?}\n vmsight {b:?}{raw}"
    );
    let (a, b) = (ino.attribs(), vm.attribs());
    let missing: Vec<_> = a.difference(&b).collect();
    assert!(
        missing.is_empty(),
        "step {n}: attribute changes inotify saw but vmsight did not: {missing:?} (vmsight: {b:?}){raw}"
    );
    let (a, b) = (ino.modified(), vm.modified());
    let missing: Vec<_> = a.difference(&b).collect();
    assert!(
        missing.is_empty(),
        "step {n}: data changes inotify saw but vmsight did not: {missing:?} (vmsight: {b:?}){raw}"
    );
}

/// Directories vmsight saw created during the run in which inotify reported no event at all:
/// `inotifywait -r` never watched them (it adds a watch only after it sees the directory
/// appear, and loses directories that dpkg renames into place).
fn unwatched_dirs(inotify: &[String], vm_steps: &[&[NetEffect]]) -> BTreeSet<String> {
    let parent = |p: &str| p.rsplit_once('/').map(|(d, _)| d.to_owned());
    let seen: BTreeSet<String> = inotify
        .iter()
        .filter_map(|l| l.split_once('|').and_then(|(_, p)| parent(p)))
        .collect();
    vm_steps
        .iter()
        .flat_map(|steps| steps.iter())
        .flat_map(NetEffect::names)
        .filter_map(|x| x.strip_prefix("create D ").map(str::to_owned))
        .filter(|d| !seen.contains(d))
        .collect()
}

/// Whether a name change happened only in directories inotify never watched (both
/// directories of a rename).
fn in_unwatched_dirs(x: &str, unwatched: &BTreeSet<String>) -> bool {
    let in_dir = |p: &str| {
        p.rsplit_once('/')
            .is_some_and(|(d, _)| unwatched.contains(d))
    };
    match x.strip_prefix("rename ").and_then(|r| r.split_once(" -> ")) {
        Some((from, to)) => in_dir(from) && in_dir(to),
        None => in_dir(x.rsplit(' ').next().unwrap_or("")),
    }
}

/// The workload on tree `$T`; `mark N` separates steps (sync; marker files on both disks,
/// each in its own transaction; then the inotify marker).
const TREE_WORKLOAD: &str = r#"
  mkdir $T/d1 $T/d2 $T/logs $T/olddir
  echo a > $T/a; echo b > $T/b; echo c > $T/c; echo 0123456789 > $T/trunc
  echo line1 > $T/logs/app.log; echo x > $T/olddir/child; echo y > $T/olddir/keep
  mark
  echo more >> $T/a; mv $T/b $T/b2; mark
  mv $T/c $T/d1/c; mv $T/olddir $T/d2/newdir; mark
  truncate -s 2 $T/trunc; chmod 600 $T/b2; chmod 700 $T/d1; chown 1234:5678 $T/d1/c; mark
  ln $T/b2 $T/d2/b2-link; ln -s ../a $T/d1/sym
  ln -s /a/very/long/symlink/target/that/does/not/fit/into/the/inode/because/it/is/longer/than/sixty/bytes $T/d1/longsym
  mark
  rm $T/d2/b2-link; rm $T/a; rm -r $T/d2/newdir; mark
  mv $T/logs/app.log $T/logs/app.log.1; echo line2 > $T/logs/app.log; mark
  touch -d @1000000000 $T/b2; chown 42 $T/d2; mark
  echo tmp > $T/tmpfile; mv $T/tmpfile $T/tmp2; mv $T/tmp2 $T/final; echo gone > $T/gone; rm $T/gone; mark
  mv $T/d1 $T/d1-renamed; mv $T/d1-renamed/c $T/c-back; mark
"#;

const INOTIFY_SCRIPT: &str = r#"
set -e
N=0
mark() { sync; N=$((N+1)); touch /var/tmp/stmarks/$N /mnt/w/.marks/$N; sync; touch /run/mark/$N; }
mkdir -p /mnt/w /srv/w /opt /run/mark /var/tmp/stmarks
mount /dev/vdb /mnt/w
mkdir -p /mnt/w/.marks
# The package is built before inotifywait starts: only its installation is watched.
mkdir -p /tmp/pkg/DEBIAN /tmp/pkg/opt/stpkg/bin /tmp/pkg/opt/stpkg/share/doc
printf 'Package: stpkg\nVersion: 1.0\nArchitecture: all\nMaintainer: t <t@example.com>\nDescription: test package\n' > /tmp/pkg/DEBIAN/control
printf '#!/bin/sh\necho hello\n' > /tmp/pkg/opt/stpkg/bin/hello; chmod 755 /tmp/pkg/opt/stpkg/bin/hello
echo readme > /tmp/pkg/opt/stpkg/share/doc/README
ln -s bin/hello /tmp/pkg/opt/stpkg/run
dpkg-deb --build /tmp/pkg /tmp/stpkg.deb >/dev/null
sync
inotifywait -m -r --exclude '^/mnt/w/\.marks' --format '%e|%w%f' -o /run/ino.log /mnt/w /srv/w /opt /run/mark 2>/run/ino.err &
IW=$!
while ! grep -q 'Watches established' /run/ino.err; do sleep 0.2; done
mark
for T in /mnt/w /srv/w; do
"#;

const INOTIFY_SCRIPT_END: &str = r#"
done
dpkg -i /tmp/stpkg.deb >/dev/null
mark
/opt/stpkg/run
mv /opt/stpkg/share/doc/README /opt/stpkg/README; chmod 700 /opt/stpkg/bin/hello; mark
sync; sleep 1
kill $IW
echo ===INOTIFY
cat /run/ino.log
echo ===END
"#;

#[test]
fn inotify_in_the_guest_sees_nothing_vmsight_misses() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("w.img");
    make_ext4(&img, 64);
    let events = dir.path().join("events.jsonl");
    let script = format!("{INOTIFY_SCRIPT}{TREE_WORKLOAD}{INOTIFY_SCRIPT_END}");
    let disk = format!("{},mount=/mnt/w", img.display());
    let mut args = vec!["run", "--disk", &disk, "--events"];
    let ev = events.to_str().unwrap();
    args.push(ev);
    args.extend_from_slice(&["--", "bash", "-c", &script]);
    let r = run(&args);
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(r.stdout.contains("hello\n"), "the package runs: {r:?}");
    let out: Vec<String> = r.stdout.lines().map(str::to_string).collect();
    let from = out.iter().position(|l| l == "===INOTIFY").unwrap() + 1;
    let to = out.iter().position(|l| l == "===END").unwrap();
    let inotify = &out[from..to];
    let evs = read_events(&events);

    let ino_extra = inotify_steps(inotify, &["/mnt/w"]);
    let ino_root = inotify_steps(inotify, &["/srv/w", "/opt"]);
    let extra_evs: Vec<Value> = evs
        .iter()
        .filter(|e| s(e, "path").starts_with("/mnt/w/"))
        .cloned()
        .collect();
    let root_evs: Vec<Value> = evs
        .iter()
        .filter(|e| !s(e, "path").starts_with("/mnt/w/"))
        .cloned()
        .collect();
    let vm_extra = vmsight_steps(&extra_evs, "/mnt/w/.marks", &["/mnt/w"]);
    let vm_root = vmsight_steps(&root_evs, "/var/tmp/stmarks", &["/srv/w", "/opt"]);
    // Marks: 1 after the setup, 10 per tree, 2 for dpkg; step k runs from mark k to mark k+1.
    let steps = 1 + 10 + 10 + 2 + 1;
    for (what, v) in [
        ("inotify", &ino_extra),
        ("vmsight extra disk", &vm_extra),
        ("vmsight root disk", &vm_root),
    ] {
        assert_eq!(v.len(), steps, "{what}: steps");
    }
    let unwatched = unwatched_dirs(inotify, &[&vm_extra, &vm_root]);
    let mut compared = 0;
    for n in 1..steps {
        compare_step(n, &ino_extra[n], &vm_extra[n], &unwatched);
        compare_step(n, &ino_root[n], &vm_root[n], &unwatched);
        compared += ino_extra[n].names().len() + ino_root[n].names().len();
        compared += ino_extra[n].attribs().len() + ino_root[n].attribs().len();
    }
    // Not vacuous: the workload's changes were seen by inotify and compared.
    assert!(compared >= 60, "only {compared} changes compared");
    // The dpkg step (net effect: the package's names appear, whatever temporary names dpkg
    // used) and the log rotation are in there.
    // What inotify sees of dpkg's new directories depends on when inotifywait adds its
    // watches; the package's directory itself is always seen, and vmsight sees every name.
    assert!(ino_root[steps - 3].names().contains("create D /opt/stpkg"));
    let dpkg = vm_root[steps - 3].names();
    for p in [
        "create D /opt/stpkg",
        "create D /opt/stpkg/bin",
        "create F /opt/stpkg/bin/hello",
        "create F /opt/stpkg/run",
        "create F /opt/stpkg/share/doc/README",
    ] {
        assert!(dpkg.contains(p), "{p} in {dpkg:?}");
    }
    for t in ["/mnt/w", "/srv/w"] {
        let rot = if t == "/mnt/w" {
            &vm_extra[7]
        } else {
            &vm_root[17]
        };
        let names = rot.names();
        assert!(
            names.contains(&format!("rename {t}/logs/app.log -> {t}/logs/app.log.1"))
                && names.contains(&format!("create F {t}/logs/app.log")),
            "log rotation in {t}: {names:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------

#[test]
fn stream_of_an_unknown_vm_is_a_clear_error() {
    let r = run(&["stream", "nosuchvm"]);
    assert_ne!(r.code, Some(0), "{r:?}");
    assert!(
        r.stderr.contains("no running VM named \"nosuchvm\""),
        "{r:?}"
    );
    let r = run(&["stream", "bad/name"]);
    assert_ne!(r.code, Some(0), "{r:?}");
    assert!(r.stderr.starts_with("vmsight: "), "{r:?}");
}

// ---------------------------------------------------------------------------------------------
// The guest's own view against `vmsight mount`.

const VIEW_SCRIPT: &str = r#"
set -e
mkdir -p /srv/view/sub/deep /srv/view/many
cd /srv/view
echo hello > a.txt
: > empty
head -c 5000 /dev/urandom > r5000
head -c 1048576 /dev/urandom > r1m
truncate -s 10M sparse; echo tail >> sparse
printf 'Nov 22 10:00:00 web1 sshd[1]: Failed password for root from 10.0.0.1\n' > sub/auth.log
for i in $(seq 1 60); do echo "file $i" > many/f$i; done
ln a.txt sub/hard; ln -s a.txt sym
ln -s /a/very/long/symlink/target/that/does/not/fit/into/the/inode/because/it/is/long sub/longsym
echo x > sub/deep/x
chmod 600 r5000; chmod 4755 sub/deep/x; chmod 700 sub/deep; chmod 0444 many/f3
chown 1234:5678 a.txt; chown 70000:70001 empty
sync
mv many/f1 sub/moved; rm many/f2; mkdir gone; rmdir gone; echo appended >> a.txt
dd if=/dev/urandom of=r1m bs=4096 count=3 seek=7 conv=notrunc status=none
sync
echo ===FIND
find /srv/view -printf '%P %s %m %U %G %T@ %y %l\n' | sort
echo ===SUM
cd /srv/view; find . -type f -print0 | sort -z | xargs -0 sha256sum
echo ===GREP
grep -rl "Failed password" /srv/view | sed 's|^/srv/view/||' | sort
echo ===PERM
find /srv/view -not -perm 644 -printf '%P\n' | sort
echo ===WAIT
read x
echo ===BYE
"#;

/// `find -printf '%P %s %m %U %G %T@ %y %l'` with times cut to whole seconds (the view's
/// resolution).
fn find_listing(root: &Path) -> Vec<String> {
    let o = Command::new("find")
        .arg(root)
        .args(["-printf", "%P %s %m %U %G %T@ %y %l\\n"])
        .output()
        .unwrap();
    let mut v: Vec<String> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(whole_seconds)
        .collect();
    v.sort();
    v
}

fn whole_seconds(line: &str) -> String {
    // Fields: path size mode uid gid time type [target]; the path never has spaces here.
    let mut f: Vec<String> = line.split(' ').map(str::to_string).collect();
    if f.len() > 5 {
        f[5] = f[5].split('.').next().unwrap_or("").to_string();
    }
    f.join(" ")
}

fn sh_out(cmd: &str, dir: &Path) -> Vec<String> {
    let o = Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .current_dir(dir)
        .output()
        .unwrap();
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

#[test]
fn mounted_view_of_the_running_guest_equals_its_own_find_and_sha256() {
    let name = vm_name("view");
    let mut vm = LiveVm::start(&["--name", &name, "--", "bash", "-c", VIEW_SCRIPT]);
    vm.wait_line("===WAIT");
    let guest_find: Vec<String> = {
        let mut v: Vec<String> = vm
            .section("===FIND", "===SUM")
            .iter()
            .map(|l| whole_seconds(l))
            .collect();
        v.sort();
        v
    };
    let guest_sum = vm.section("===SUM", "===GREP");
    let guest_grep = vm.section("===GREP", "===PERM");
    let guest_perm = vm.section("===PERM", "===WAIT");
    assert!(guest_find.len() > 70, "{guest_find:?}");
    assert_eq!(guest_grep, ["sub/auth.log"]);

    let mnt = tempfile::tempdir().unwrap();
    let mut mount = Bg(vmsight()
        .arg("mount")
        .arg(mnt.path())
        .args(["--vm", &name, "--host", "h"])
        .spawn()
        .unwrap());
    let tree = mnt.path().join("h").join(&name).join("srv/view");
    wait_until("the view to show /srv/view", 60, || {
        tree.join("a.txt").exists()
    });
    // The view follows the guest's committed state; it may lag the sync by a batch and the
    // kernel caches attributes for 1 s, so compare until equal (bounded).
    let mut host_find = Vec::new();
    let mut host_sum = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        host_find = find_listing(&tree);
        host_sum = sh_out(
            "find . -type f -print0 | sort -z | xargs -0 sha256sum",
            &tree,
        );
        if host_find == guest_find && host_sum == guest_sum {
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let diff: Vec<_> = guest_find
        .iter()
        .filter(|l| !host_find.contains(l))
        .map(|l| format!("guest: {l}"))
        .chain(
            host_find
                .iter()
                .filter(|l| !guest_find.contains(l))
                .map(|l| format!("view:  {l}")),
        )
        .collect();
    assert!(
        diff.is_empty(),
        "find listings differ:\n{}",
        diff.join("\n")
    );
    assert_eq!(host_sum, guest_sum, "sha256 of every file");
    // Legacy tools on the mount, as in the paper.
    let grep = sh_out(
        "grep -rl 'Failed password' . | sed 's|^\\./||' | sort",
        &tree,
    );
    assert_eq!(grep, guest_grep);
    let perm = sh_out("find . -not -perm 644 -printf '%P\\n' | sort", &tree);
    assert_eq!(perm, guest_perm);
    assert!(perm.contains(&"r5000".to_string()) && perm.contains(&"sub/deep/x".to_string()));

    let st = Command::new("fusermount3")
        .arg("-u")
        .arg(mnt.path())
        .status()
        .unwrap();
    assert!(st.success(), "unmount");
    // An external unmount ends `vmsight mount` cleanly.
    let mut status = None;
    wait_until("vmsight mount to exit after fusermount3 -u", 30, || {
        status = mount.0.try_wait().unwrap();
        status.is_some()
    });
    assert!(status.unwrap().success(), "vmsight mount: {status:?}");
    vm.send("go");
    let (code, out, err) = vm.finish();
    assert_eq!(code, Some(0), "{out:?} {err}");
    assert!(out.iter().any(|l| l == "===BYE"), "{out:?}");
}

// ---------------------------------------------------------------------------------------------
// Redis and `vmsight watch` deliver the same messages.

const REDIS_PASSWORD: &str = "st-s3cret";

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The guest writes probe files until the test has seen both subscribers receive one, then
/// runs the workload.
const REDIS_SCRIPT: &str = r#"
set -e
mkdir -p /srv/r; i=0
while ! read -t 1 x; do i=$((i+1)); echo $i > /srv/r/probe.$i; sync; done
cd /srv/r; mkdir d; echo a > d/a; sync
mv d/a d/b; chmod 600 d/b; echo more >> probe.1; sync
rm d/b; rmdir d; ln -s probe.1 link; sync
echo ===END
"#;

/// (seq, type, path) of the file events in JSON lines.
fn triples(lines: &[String]) -> BTreeSet<(u64, String, String)> {
    lines
        .iter()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| {
            let seq = v["seq"].as_u64()?;
            Some((seq, s(&v, "type").to_string(), s(&v, "path").to_string()))
        })
        .collect()
}

/// Payloads of `pmessage` replies in `redis-cli` output (non-tty: one element per line).
fn redis_payloads(lines: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        if lines[i] == "pmessage" && i + 3 < lines.len() {
            let (channel, payload) = (&lines[i + 2], &lines[i + 3]);
            let v: Value = serde_json::from_str(payload).unwrap();
            assert_eq!(
                channel,
                &format!("{}:{}:{}", s(&v, "host"), s(&v, "vm"), s(&v, "path")),
                "channel of {payload}"
            );
            out.push(payload.clone());
            i += 4;
        } else {
            i += 1;
        }
    }
    out
}

#[test]
fn redis_subscriber_and_watch_receive_the_same_events() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port().to_string();
    let _redis = Bg(Command::new("redis-server")
        .args(["--port", &port, "--bind", "127.0.0.1"])
        .args([
            "--requirepass",
            REDIS_PASSWORD,
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .arg("--dir")
        .arg(dir.path())
        .stdout(Stdio::null())
        .spawn()
        .expect("redis-server is not installed (scripts/setup-host.sh installs it)"));
    let cli = |args: &[&str]| {
        Command::new("redis-cli")
            .args(["-p", &port, "-a", REDIS_PASSWORD, "--no-auth-warning"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    wait_until("redis-server", 30, || {
        let o = cli(&["PING"]).wait_with_output().unwrap();
        String::from_utf8_lossy(&o.stdout).trim() == "PONG"
    });
    let mut sub = cli(&["PSUBSCRIBE", "*"]);
    let sub_lines = collect_lines(&mut sub);
    let _sub = Bg(sub);
    wait_until("the Redis subscription", 30, || {
        sub_lines.lock().unwrap().first().map(String::as_str) == Some("psubscribe")
    });

    let name = vm_name("redis");
    let events = dir.path().join("events.jsonl");
    let url = format!("redis://:{REDIS_PASSWORD}@127.0.0.1:{port}/");
    let mut vm = LiveVm::start(&[
        "--name",
        &name,
        "--redis",
        &url,
        "--events",
        events.to_str().unwrap(),
        "--",
        "bash",
        "-c",
        REDIS_SCRIPT,
    ]);
    let mut watch = vmsight()
        .args(["watch", "--json", "--vm", &name])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let watch_lines = collect_lines(&mut watch);
    let watch = Bg(watch);
    // Both subscribers are live once each has received a probe.
    let probe = |lines: &[String]| lines.iter().any(|l| l.contains("/srv/r/probe."));
    wait_until("probe events at both subscribers", 300, || {
        probe(&watch_lines.lock().unwrap()) && probe(&redis_payloads(&sub_lines.lock().unwrap()))
    });
    vm.send("go");
    let (code, out, err) = vm.finish();
    assert_eq!(code, Some(0), "{out:?} {err}");
    assert!(out.iter().any(|l| l == "===END"), "{out:?}");

    let file = triples(
        &std::fs::read_to_string(&events)
            .unwrap()
            .lines()
            .map(str::to_string)
            .collect::<Vec<_>>(),
    );
    let last = file.iter().map(|t| t.0).max().unwrap();
    let upto_last = |lines: &[String]| triples(lines).iter().any(|t| t.0 == last);
    wait_until("the last event at both subscribers", 60, || {
        upto_last(&watch_lines.lock().unwrap())
            && upto_last(&redis_payloads(&sub_lines.lock().unwrap()))
    });
    drop(watch);
    let w = triples(&watch_lines.lock().unwrap());
    let r = triples(&redis_payloads(&sub_lines.lock().unwrap()));
    // Compare from the first message both had (they subscribed at different times).
    let first = w.iter().next().unwrap().0.max(r.iter().next().unwrap().0);
    let w: BTreeSet<_> = w.into_iter().filter(|t| t.0 >= first).collect();
    let r: BTreeSet<_> = r.into_iter().filter(|t| t.0 >= first).collect();
    let f: BTreeSet<_> = file.into_iter().filter(|t| t.0 >= first).collect();
    assert_eq!(w, r, "watch vs Redis");
    assert_eq!(w, f, "watch vs the events file");
    let has = |ty: &str, p: &str| w.iter().any(|t| t.1 == ty && t.2 == p);
    for (ty, p) in [
        ("mkdir", "/srv/r/d"),
        ("create", "/srv/r/d/a"),
        ("rename", "/srv/r/d/b"),
        ("chmod", "/srv/r/d/b"),
        ("delete", "/srv/r/d/b"),
        ("rmdir", "/srv/r/d"),
        ("symlink", "/srv/r/link"),
    ] {
        assert!(has(ty, p), "{ty} {p} in {w:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Live attach.

const ATTACH_SCRIPT: &str = r#"
set -e
mkdir -p /srv/la; echo pre > /srv/la/pre; echo keep > /srv/la/keep; sync
echo ===READY
read x
cd /srv/la; mkdir sub; echo new > sub/new; mv pre sub/pre-moved; ln -s new sub/link; sync
chmod 600 keep; rm sub/pre-moved; sync
echo ===DONE
"#;

#[test]
fn live_attach_streams_a_vm_started_without_streaming() {
    let dir = tempfile::tempdir().unwrap();
    let events = dir.path().join("events.jsonl");
    let name = vm_name("attach");
    let mut vm = LiveVm::start(&[
        "--no-stream",
        // The inference counters end up in stderr: what a failure message needs.
        "--stats",
        "--name",
        &name,
        "--events",
        events.to_str().unwrap(),
        "--",
        "bash",
        "-c",
        ATTACH_SCRIPT,
    ]);
    vm.wait_line("===READY");
    let st = run(&["stream", &name, "--status"]);
    assert_eq!(st.code, Some(0), "{st:?}");
    assert!(st.stdout.contains("disk0: not streaming"), "{st:?}");
    assert!(
        read_events(&events).is_empty(),
        "no events before the attach"
    );

    let at = run(&["stream", &name]);
    assert_eq!(at.code, Some(0), "{at:?}");
    assert!(at.stdout.contains("disk0: streaming"), "{at:?}");
    let again = run(&["stream", &name]);
    assert_eq!(again.code, Some(0), "{again:?}");
    assert!(again.stdout.contains("already streaming"), "{again:?}");

    vm.send("go");
    let (code, out, err) = vm.finish();
    assert_eq!(code, Some(0), "{out:?} {err}");
    assert!(out.iter().any(|l| l == "===DONE"), "{out:?}");
    let evs = read_events(&events);
    for (ty, p) in [
        ("mkdir", "/srv/la/sub"),
        ("create", "/srv/la/sub/new"),
        ("rename", "/srv/la/sub/pre-moved"),
        ("symlink", "/srv/la/sub/link"),
        ("chmod", "/srv/la/keep"),
        ("delete", "/srv/la/sub/pre-moved"),
    ] {
        assert!(
            has_event(&evs, ty, p),
            "{ty} {p} in {evs:?}\nvmsight stderr:\n{err}"
        );
    }
    let rename = evs
        .iter()
        .find(|e| s(e, "type") == "rename" && s(e, "path") == "/srv/la/sub/pre-moved")
        .unwrap();
    assert_eq!(s(rename, "old_path"), "/srv/la/pre");
    // What happened before the attach is the crawl's starting state, not events.
    assert!(!has_event(&evs, "create", "/srv/la/pre"), "{evs:?}");
    assert_eq!(evs[0]["seq"].as_u64(), Some(1));
}

// ---------------------------------------------------------------------------------------------
// Overload.

const OVERLOAD_SCRIPT: &str = r#"
set -e
mount /dev/vdb /mnt; cd /mnt
for i in 1 2 3 4 5 6; do
  mkdir dir$i; echo m > dir$i/meta; sync
  fio --name=w$i --filename=dir$i/big --rw=write --bs=1M --size=24M --iodepth=32 --ioengine=libaio --direct=1 --output=/dev/null
  sync; mv dir$i/meta dir$i/meta-renamed; chmod 600 dir$i/big; sync
done
for i in 1 2 3 4 5 6; do rm dir$i/meta-renamed; done
sync
# A burst without syncs: more newly allocated data than the pending set holds before a commit.
mkdir burst; sync
for i in 1 2 3 4 5 6 7 8; do
  fio --name=b$i --filename=burst/b$i --rw=write --bs=1M --size=32M --iodepth=32 --ioengine=libaio --direct=1 --output=/dev/null
done
sync
echo ===DONE
"#;

#[test]
fn overloaded_stream_keeps_metadata_and_reports_dropped_data() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("o.img");
    make_ext4(&img, 768);
    let block: u64 = debugfs(&img, "stats")
        .lines()
        .find_map(|l| l.strip_prefix("Block size:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap();
    let events = dir.path().join("events.jsonl");
    let stats = dir.path().join("stats.json");
    let disk = format!("{},mount=/mnt/o", img.display());
    let r = guest_sh_bash(&[
        "--disk",
        &disk,
        "--stream-queue-mb",
        "1",
        "--events",
        events.to_str().unwrap(),
        "--stats-json",
        stats.to_str().unwrap(),
    ]);
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(r.stdout.contains("===DONE"), "{r:?}");
    let evs = read_events(&events);
    let st: Value = serde_json::from_str(&std::fs::read_to_string(&stats).unwrap()).unwrap();
    let disk1 = &st["disks"][1];
    eprintln!("tap {}\nstream {}", disk1["tap"], disk1["stream"]);
    // The queue stays within its limit whatever the guest does.
    let peak = disk1["tap"]["peak_queued_bytes"].as_u64().unwrap();
    assert!(peak <= 1 << 20, "peak queue {peak} B over the 1 MiB limit");
    // Every metadata change is there.
    for i in 1..=6 {
        let d = format!("/mnt/o/dir{i}");
        for (ty, p) in [
            ("mkdir", d.clone()),
            ("create", format!("{d}/meta")),
            ("create", format!("{d}/big")),
            ("rename", format!("{d}/meta-renamed")),
            ("chmod", format!("{d}/big")),
            ("delete", format!("{d}/meta-renamed")),
        ] {
            assert!(has_event(&evs, ty, &p), "{ty} {p}");
        }
    }
    for i in 1..=8 {
        let p = format!("/mnt/o/burst/b{i}");
        assert!(has_event(&evs, "create", &p), "create {p}");
    }
    // Data may be dropped, but only as reported: the bytes of the written files that no
    // `write` event covers are at most the reported dropped bytes plus the pending blocks
    // evicted by the pending set's cap.
    let mut missing = 0u64;
    let files = (1..=6)
        .map(|i| (format!("/mnt/o/dir{i}/big"), 24u64 << 20))
        .chain((1..=8).map(|i| (format!("/mnt/o/burst/b{i}"), 32u64 << 20)));
    for (p, size) in files {
        let mut ranges: Vec<(u64, u64)> = evs
            .iter()
            .filter(|e| s(e, "type") == "write" && s(e, "path") == p)
            .map(|e| {
                (
                    e["range"][0].as_u64().unwrap(),
                    e["range"][1].as_u64().unwrap(),
                )
            })
            .collect();
        ranges.sort_unstable();
        let (mut covered, mut end) = (0u64, 0u64);
        for (a, b) in ranges {
            let a = a.max(end);
            if b > a {
                covered += b - a;
                end = b;
            }
        }
        missing += size - covered.min(size);
    }
    let dropped = disk1["stream"]["dropped_data_bytes"].as_u64().unwrap();
    let evicted = disk1["stream"]["pending_evicted"].as_u64().unwrap() * block;
    eprintln!("missing {missing} B, dropped {dropped} B, evicted {evicted} B");
    // The mechanism engaged: the stream went into overload and dropped data (else this test
    // would only show that an unloaded stream keeps metadata).
    let episodes = disk1["stream"]["overload_episodes"].as_u64().unwrap();
    assert!(
        episodes > 0,
        "the stream never overloaded: {}",
        disk1["stream"]
    );
    assert!(dropped > 0, "overload dropped no data: {}", disk1["stream"]);
    assert!(
        missing <= dropped + evicted,
        "{missing} bytes of data have no write event, but only {dropped} dropped and {evicted} evicted bytes are reported"
    );
}

/// Runs [`OVERLOAD_SCRIPT`] with bash in a fresh guest.
fn guest_sh_bash(extra: &[&str]) -> Run {
    let mut args = vec!["run"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "bash", "-c", OVERLOAD_SCRIPT]);
    run(&args)
}

// ---------------------------------------------------------------------------------------------
// The comparison rule itself, on synthetic streams (no guest).

fn ev(txn: u64, ty: &str, path: &str, old: Option<&str>) -> Value {
    let mut v = serde_json::json!({ "txn": txn, "type": ty, "path": path });
    if let Some(o) = old {
        v["old_path"] = Value::from(o);
    }
    v
}

#[test]
fn net_effect_rule_matches_equal_streams_and_catches_missing_events() {
    let lines: Vec<String> = [
        "CREATE|/run/mark/1",
        "MOVED_FROM|/t/logs/app.log",
        "MOVED_TO|/t/logs/app.log.1",
        "CREATE|/t/logs/app.log",
        "MODIFY|/t/logs/app.log",
        "ATTRIB|/t/b",
        "CREATE|/t/tmp",
        "MOVED_FROM|/t/tmp",
        "MOVED_TO|/t/final",
        "CREATE|/t/gone",
        "DELETE|/t/gone",
        "MOVED_FROM,ISDIR|/t/d",
        "MOVED_TO,ISDIR|/t/e",
        "MOVED_FROM|/t/e/c",
        "MOVED_TO|/t/c",
        "CREATE,ISDIR|/t/new",
        "MOVED_TO|/t/arrived",
        "CREATE|/run/mark/2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let ino = inotify_steps(&lines, &["/t"]);
    assert_eq!(ino.len(), 3);
    let names = ino[1].names();
    assert_eq!(
        names,
        [
            "create D /t/new",
            "create F /t/arrived",
            "create F /t/final",
            "create F /t/logs/app.log",
            "rename /t/d -> /t/e",
            "rename /t/d/c -> /t/c",
            "rename /t/logs/app.log -> /t/logs/app.log.1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect::<BTreeSet<_>>()
    );
    // The engine reports one transaction as a set: creates before renames here, old names
    // refer to the state before it; plus a file dpkg-style created in the new directory.
    let good = vec![
        ev(1, "create", "/m/1", None),
        ev(5, "create", "/t/logs/app.log", None),
        ev(5, "rename", "/t/logs/app.log.1", Some("/t/logs/app.log")),
        ev(5, "create", "/t/final", None),
        ev(5, "rename", "/t/e", Some("/t/d")),
        ev(5, "rename", "/t/c", Some("/t/d/c")),
        ev(5, "mkdir", "/t/new", None),
        ev(5, "create", "/t/new/seen-only-by-vmsight", None),
        ev(5, "rename", "/t/arrived", Some("/unwatched/x")),
        ev(5, "mtime", "/t/logs", None),
        ev(5, "mtime", "/t/b", None),
        ev(6, "write", "/t/logs/app.log", None),
        ev(7, "create", "/m/2", None),
    ];
    let vm = vmsight_steps(&good, "/m", &["/t"]);
    assert_eq!(vm.len(), 3);
    compare_step(1, &ino[1], &vm[1], &BTreeSet::new());
    // Names only in directories inotify never watched (created in the run, no inotify event
    // inside them) are allowed; the same name in a watched directory is not.
    let unwatched: BTreeSet<String> = ["/t/pkg".to_string()].into();
    assert!(in_unwatched_dirs("rename /t/pkg/a -> /t/pkg/b", &unwatched));
    assert!(in_unwatched_dirs("create F /t/pkg/x", &unwatched));
    assert!(!in_unwatched_dirs("rename /t/pkg/a -> /t/a", &unwatched));
    assert!(!in_unwatched_dirs("create F /t/x", &unwatched));
    let mut with_pkg = good.clone();
    with_pkg.insert(1, ev(5, "mkdir", "/t/pkg", None));
    with_pkg.insert(2, ev(5, "create", "/t/pkg/readme", None));
    let vm_pkg = vmsight_steps(&with_pkg, "/m", &["/t"]);
    let found = unwatched_dirs(&["CREATE|/t/x".to_string()], &[&vm_pkg]);
    assert!(
        found.contains("/t/pkg") && !found.contains("/t"),
        "{found:?}"
    );
    // Each of these streams lacks something inotify saw, or adds a name it did not see.
    let broken: Vec<Vec<Value>> = vec![
        good.iter()
            .filter(|e| s(e, "type") != "rename")
            .cloned()
            .collect(),
        good.iter()
            .filter(|e| s(e, "path") != "/t/b")
            .cloned()
            .collect(),
        good.iter()
            .filter(|e| s(e, "type") != "write")
            .cloned()
            .collect(),
        good.iter()
            .cloned()
            .chain([ev(5, "create", "/t/spurious", None)])
            .collect(),
    ];
    for (i, b) in broken.iter().enumerate() {
        let mut b = b.clone();
        // Keep the closing mark last.
        b.sort_by_key(|e| s(e, "path") == "/m/2");
        let vm = vmsight_steps(&b, "/m", &["/t"]);
        let r = std::panic::catch_unwind(|| compare_step(1, &ino[1], &vm[1], &BTreeSet::new()));
        assert!(r.is_err(), "broken stream {i} passed the comparison");
    }
}
