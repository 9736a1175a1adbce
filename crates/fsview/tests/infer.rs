//! The inference engine against real file systems changed by the kernel: make an image with
//! mkfs, crawl it, change it through a loop mount, feed the blocks that differ to the engine as
//! writes (in several orders, whole and split into sectors) and check the events and that the
//! engine's view equals a fresh crawl of the changed image.
//!
//! Needs root (loop mounts) and e2fsprogs; a missing tool fails the test.

mod common;

use common::run;
use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;
use std::sync::Arc;
use vmsight_fsview::{
    Engine, EngineConfig, EventKind, FileKind, FileSource, FsEvent, FsRead, Index, Owner,
    StaticView, Value,
};

fn make_source(root: &Path) {
    let w = |p: &str, data: &[u8]| {
        let path = root.join(p);
        fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        fs::write(&path, data).expect("write");
    };
    let pattern = |n: usize| -> Vec<u8> { (0..n).map(|i| (i * 13 + i / 97) as u8).collect() };
    w("a.txt", b"alpha\n");
    w("b.txt", b"bravo\n");
    w("c.txt", b"charlie\n");
    w("big.bin", &pattern(100_000));
    w("small.txt", b"small\n");
    w("data.bin", &pattern(16384));
    w("log.txt", b"line 1\n");
    w("olddir/child.txt", b"child\n");
    w("olddir/inner/deep.txt", b"deep\n");
    fs::create_dir_all(root.join("emptydir")).expect("mkdir");
    fs::create_dir_all(root.join("keep")).expect("mkdir");
    symlink("a.txt", root.join("keep/oldlink")).expect("symlink");
    fs::set_permissions(root.join("c.txt"), fs::Permissions::from_mode(0o644)).expect("chmod");
}

/// The guest-side workload, run by the kernel on a loop mount.
const WORKLOAD: &str = r#"
set -e
mkdir -p d1/sub e
printf 'hello\n' > d1/new.txt
sync
mv a.txt d1/moved.txt
mv olddir e/olddir2
sync
rm b.txt
rmdir emptydir
sync
ln c.txt d1/c-link
ln -s /some/target d1/sym
ln -s /a/much/longer/symlink/target/that/does/not/fit/into/the/inode/itself/at/all d1/longsym
truncate -s 100 big.bin
truncate -s 50000 small.txt
chmod 600 c.txt
chown 1234:5678 c.txt
dd if=/dev/urandom of=data.bin bs=4096 count=2 seek=1 conv=notrunc status=none
printf 'appended line\n' >> log.txt
"#;

struct Case {
    before: Vec<u8>,
    after: Vec<u8>,
    after_path: std::path::PathBuf,
    index: Index,
    _dir: tempfile::TempDir,
}

fn build_case(mkfs: &str, args: &[&str]) -> Case {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = dir.path().join("src");
    fs::create_dir_all(&src).expect("mkdir");
    make_source(&src);
    let img = dir.path().join("fs.img");
    let img_s = img.to_str().expect("utf8");
    let src_s = src.to_str().expect("utf8");
    let mut a: Vec<&str> = vec!["-F", "-q"];
    a.extend_from_slice(args);
    a.extend_from_slice(&["-d", src_s, img_s, "64M"]);
    run(mkfs, &a);
    let before = fs::read(&img).expect("read");
    let mnt = dir.path().join("mnt");
    fs::create_dir_all(&mnt).expect("mkdir");
    let mnt_s = mnt.to_str().expect("utf8");
    run("mount", &["-o", "loop", img_s, mnt_s]);
    let res = std::process::Command::new("sh")
        .args(["-c", WORKLOAD])
        .current_dir(&mnt)
        .output();
    run("umount", &[mnt_s]);
    let res = res.expect("sh");
    assert!(
        res.status.success(),
        "workload failed: {}",
        String::from_utf8_lossy(&res.stderr)
    );
    let after = fs::read(&img).expect("read");
    let index =
        Index::crawl(&vmsight_fsview::MemSource(before.clone()), None).expect("crawl before");
    Case {
        before,
        after,
        after_path: img,
        index,
        _dir: dir,
    }
}

impl Case {
    fn bs(&self) -> usize {
        self.index.fs_info().block_size as usize
    }
    /// File-system blocks that differ between the two images.
    fn changed(&self) -> Vec<u64> {
        let bs = self.bs();
        (0..self.before.len() / bs)
            .filter(|&b| self.before[b * bs..(b + 1) * bs] != self.after[b * bs..(b + 1) * bs])
            .map(|b| b as u64)
            .collect()
    }
    fn engine(&self, cfg: EngineConfig) -> Engine {
        let disk = Arc::new(FileSource::open(&self.after_path).expect("open"));
        Engine::new(disk, self.index.clone(), cfg).expect("engine")
    }
    /// Feed `blocks` (in this order) as writes; `split` feeds each block as 512-byte sectors.
    fn feed(&self, e: &mut Engine, blocks: &[u64], split: bool, out: &mut Vec<FsEvent>) {
        let bs = self.bs();
        for (k, &b) in blocks.iter().enumerate() {
            let off = b as usize * bs;
            let data = &self.after[off..off + bs];
            let ns = 1_000 + k as u64;
            if split {
                for (i, s) in data.chunks(512).enumerate().rev() {
                    e.write((off + i * 512) as u64, s, ns, out);
                }
            } else {
                e.write(off as u64, data, ns, out);
            }
        }
    }
}

fn shuffled(v: &[u64], seed: u64) -> Vec<u64> {
    let mut v = v.to_vec();
    let mut s = seed;
    for i in (1..v.len()).rev() {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        v.swap(i, (s >> 33) as usize % (i + 1));
    }
    v
}

/// `journal` (in log order) with the blocks of each transaction shuffled, each commit block
/// kept after the blocks before it. This is the reordering a guest can produce: the virtqueue
/// completes a transaction's descriptor and log blocks in any order, but jbd2 writes the commit
/// block (with a preflush) only after they are on disk, and the next transaction's blocks after
/// that. Arbitrary reordering across commit blocks never happens and is not tested.
fn shuffled_within_transactions(c: &Case, journal: &[u64], seed: u64) -> Vec<u64> {
    let bs = c.bs();
    let is_commit = |b: u64| {
        let off = b as usize * bs;
        c.after.get(off..off + 8).is_some_and(|h| {
            h[..4] == 0xC03B_3998u32.to_be_bytes() && h[4..8] == 2u32.to_be_bytes()
        })
    };
    let mut out = Vec::with_capacity(journal.len());
    let mut seg: Vec<u64> = Vec::new();
    for (i, &b) in journal.iter().enumerate() {
        if is_commit(b) {
            out.extend(shuffled(&seg, seed + i as u64));
            seg.clear();
            out.push(b);
        } else {
            seg.push(b);
        }
    }
    out.extend(shuffled(&seg, seed));
    out
}

fn has(ev: &[FsEvent], kind: EventKind, path: &str) -> Option<FsEvent> {
    ev.iter()
        .find(|e| e.kind == kind && e.path == path)
        .cloned()
}

const NAME_KINDS: [EventKind; 7] = [
    EventKind::Create,
    EventKind::Mkdir,
    EventKind::Symlink,
    EventKind::Link,
    EventKind::Delete,
    EventKind::Rmdir,
    EventKind::Rename,
];

/// The events the workload must produce.
fn check_events(ev: &[FsEvent], what: &str) {
    let names: BTreeSet<(String, String, Option<String>)> = ev
        .iter()
        .filter(|e| NAME_KINDS.contains(&e.kind))
        .map(|e| (format!("{:?}", e.kind), e.path.clone(), e.old_path.clone()))
        .collect();
    let s = |k: &str, p: &str, o: Option<&str>| (k.to_string(), p.to_string(), o.map(String::from));
    let expected: BTreeSet<_> = [
        s("Mkdir", "/d1", None),
        s("Mkdir", "/d1/sub", None),
        s("Mkdir", "/e", None),
        s("Create", "/d1/new.txt", None),
        s("Rename", "/d1/moved.txt", Some("/a.txt")),
        s("Rename", "/e/olddir2", Some("/olddir")),
        s("Delete", "/b.txt", None),
        s("Rmdir", "/emptydir", None),
        s("Link", "/d1/c-link", Some("/c.txt")),
        s("Symlink", "/d1/sym", None),
        s("Symlink", "/d1/longsym", None),
    ]
    .into_iter()
    .collect();
    assert_eq!(names, expected, "{what}: name events");
    let sym = has(ev, EventKind::Symlink, "/d1/sym").expect("symlink");
    assert_eq!(
        sym.new,
        Some(Value::Target("/some/target".into())),
        "{what}"
    );
    let t = has(ev, EventKind::Truncate, "/big.bin").expect("truncate");
    assert_eq!(
        (t.old, t.new),
        (Some(Value::Size(100_000)), Some(Value::Size(100)))
    );
    let x = has(ev, EventKind::Extend, "/small.txt").expect("extend");
    assert_eq!(x.new, Some(Value::Size(50_000)), "{what}");
    let m = has(ev, EventKind::Chmod, "/c.txt").expect("chmod");
    assert_eq!(m.new, Some(Value::Mode(0o100600)), "{what}");
    let o = has(ev, EventKind::Chown, "/c.txt").expect("chown");
    assert_eq!(
        o.new,
        Some(Value::Owner {
            uid: 1234,
            gid: 5678
        }),
        "{what}"
    );
    let x = has(ev, EventKind::Extend, "/log.txt").expect("log extend");
    assert_eq!(x.new, Some(Value::Size(21)), "{what}");
    // Data writes: the overwritten range of data.bin, the new file and the appended line.
    let covered = |path: &str, s: u64, e: u64| {
        let mut r: Vec<(u64, u64)> = ev
            .iter()
            .filter(|x| x.kind == EventKind::Write && x.path == path)
            .filter_map(|x| x.range)
            .collect();
        r.sort();
        let mut pos = s;
        for (a, b) in r {
            if a <= pos && b > pos {
                pos = b;
            }
        }
        pos >= e
    };
    assert!(covered("/data.bin", 4096, 12288), "{what}: data.bin write");
    assert!(covered("/d1/new.txt", 0, 6), "{what}: new.txt write");
    assert!(covered("/log.txt", 7, 21), "{what}: log.txt append");
    for e in ev.iter().filter(|e| e.kind == EventKind::Write) {
        let (s, end) = e.range.expect("range");
        assert!(s < end, "{what}: empty write {e:?}");
        if e.path == "/log.txt" {
            assert!(end <= 21, "{what}: write past the end of file: {e:?}");
        }
    }
    assert!(
        !ev.iter().any(|e| e.path.starts_with("/olddir")),
        "{what}: stale paths"
    );
}

/// Walk both views from the root and compare names, metadata, contents and link targets.
fn check_view(engine: &dyn FsRead, fresh: &dyn FsRead, what: &str) {
    let mut stack = vec![("/".to_string(), 2u32)];
    let mut files = 0;
    while let Some((path, ino)) = stack.pop() {
        let a = engine
            .read_dir(ino)
            .unwrap_or_else(|| panic!("{what}: {path} not a dir"));
        let b = fresh.read_dir(ino).expect("fresh dir");
        assert_eq!(a, b, "{what}: entries of {path}");
        for e in a {
            let p = format!(
                "{}/{}",
                path.trim_end_matches('/'),
                String::from_utf8_lossy(&e.name)
            );
            let (ma, mb) = (engine.stat(e.ino), fresh.stat(e.ino));
            let (ma, mb) = (ma.expect("engine stat"), mb.expect("fresh stat"));
            assert_eq!(
                (ma.mode, ma.uid, ma.gid, ma.size, ma.links, ma.mtime),
                (mb.mode, mb.uid, mb.gid, mb.size, mb.links, mb.mtime),
                "{what}: meta of {p}"
            );
            match e.kind {
                FileKind::Directory => stack.push((p, e.ino)),
                FileKind::Symlink => {
                    assert_eq!(
                        engine.read_link(e.ino),
                        fresh.read_link(e.ino),
                        "{what}: {p}"
                    )
                }
                FileKind::Regular => {
                    let mut x = vec![0u8; mb.size as usize];
                    let mut y = vec![0u8; mb.size as usize];
                    engine.read(e.ino, 0, &mut x).expect("read");
                    fresh.read(e.ino, 0, &mut y).expect("read");
                    assert!(x == y, "{what}: content of {p}");
                    files += 1;
                }
                _ => {}
            }
        }
    }
    assert!(files > 8, "{what}: walked {files} files");
}

fn fresh_view(c: &Case) -> StaticView {
    let disk = Arc::new(FileSource::open(&c.after_path).expect("open"));
    let idx = Index::crawl(disk.as_ref(), None).expect("crawl after");
    StaticView::new(idx, disk)
}

/// Home-location writes only (file systems without a journal): several orders.
fn home_path_case(mkfs: &str, args: &[&str]) {
    let c = build_case(mkfs, args);
    let fresh = fresh_view(&c);
    let changed = c.changed();
    assert!(!changed.is_empty());
    let orders: Vec<(&str, Vec<u64>, bool)> = vec![
        ("ascending", changed.clone(), false),
        ("descending", changed.iter().rev().copied().collect(), false),
        ("shuffled", shuffled(&changed, 1), false),
        ("shuffled sectors", shuffled(&changed, 2), true),
    ];
    for (what, order, split) in orders {
        let mut e = c.engine(EngineConfig::default());
        assert!(!e.has_journal());
        let mut ev = Vec::new();
        c.feed(&mut e, &order, split, &mut ev);
        e.flush(9_999, &mut ev);
        let what = format!("{mkfs} {args:?} {what}");
        check_events(&ev, &what);
        check_view(&e, &fresh, &what);
        let st = e.stats();
        assert_eq!(st.metadata_errors, 0, "{what}: {st:?}");
    }
}

#[test]
fn ext2_home_writes() {
    home_path_case("mkfs.ext2", &["-b", "4096"]);
}

#[test]
fn ext4_no_journal_1k() {
    home_path_case("mkfs.ext4", &["-O", "^has_journal", "-b", "1024"]);
}

/// With a journal: feed the journal blocks first (the transactions, in jbd2's own layout,
/// checksums included), then the home-location writes (checkpoints and data).
fn journal_case(args: &[&str]) {
    let c = build_case("mkfs.ext4", args);
    let fresh = fresh_view(&c);
    let changed = c.changed();
    let (journal, home): (Vec<u64>, Vec<u64>) = changed
        .iter()
        .partition(|&&b| matches!(c.index.owner(b), Owner::Journal { .. }));
    assert!(journal.len() > 3, "the workload was journalled");
    for (what, jorder) in [
        ("journal in order", journal.clone()),
        (
            "journal shuffled",
            shuffled_within_transactions(&c, &journal, 3),
        ),
    ] {
        let what = format!("{args:?} {what}");
        let mut e = c.engine(EngineConfig::default());
        assert!(e.has_journal());
        let mut ev = Vec::new();
        c.feed(&mut e, &jorder, false, &mut ev);
        let st = e.stats();
        assert!(st.txns_applied >= 1, "{what}: {st:?}");
        assert_eq!(st.journal_csum_errors, 0, "{what}: {st:?}");
        assert_eq!(st.journal_errors, 0, "{what}: {st:?}");
        // Every metadata event appeared at commit time, tagged with its transaction.
        let meta: Vec<&FsEvent> = ev.iter().filter(|e| e.kind != EventKind::Write).collect();
        assert!(
            meta.iter().all(|e| e.txn.is_some()),
            "{what}: untagged event"
        );
        let n_meta = meta.len();
        let mut home_ev = Vec::new();
        c.feed(&mut e, &home, false, &mut home_ev);
        e.flush(99_999, &mut home_ev);
        let dup: Vec<&FsEvent> = home_ev
            .iter()
            .filter(|e| e.kind != EventKind::Write)
            .collect();
        assert!(
            dup.is_empty(),
            "{what}: checkpoint writes produced events: {dup:?}"
        );
        assert!(e.stats().checkpoint_writes > 0, "{what}");
        ev.extend(home_ev);
        assert!(n_meta > 10, "{what}");
        // The syncs split the workload into transactions, applied in order.
        let txn = |k: EventKind, p: &str| has(&ev, k, p).and_then(|e| e.txn).expect("txn");
        let t_mkdir = txn(EventKind::Mkdir, "/d1");
        let t_rename = txn(EventKind::Rename, "/d1/moved.txt");
        let t_delete = txn(EventKind::Delete, "/b.txt");
        let t_chown = txn(EventKind::Chown, "/c.txt");
        assert!(
            t_mkdir < t_rename && t_rename < t_delete && t_delete < t_chown,
            "{what}: transactions {t_mkdir} {t_rename} {t_delete} {t_chown}"
        );
        assert!(st.txns_applied >= 4, "{what}: {st:?}");
        check_events(&ev, &what);
        check_view(&e, &fresh, &what);
        let st = e.stats();
        assert_eq!(st.metadata_errors, 0, "{what}: {st:?}");
        eprintln!("{what}: {st:?}");
    }
}

#[test]
fn ext4_journal_extents_csum_v3() {
    journal_case(&["-b", "4096"]);
}

#[test]
fn ext4_journal_blockmap() {
    journal_case(&["-O", "^extent,^64bit,^metadata_csum", "-b", "4096"]);
}

/// Overload: with data dropped, names and attributes still come through and nothing is
/// reported as written.
#[test]
fn drop_data_keeps_metadata() {
    let c = build_case("mkfs.ext2", &["-b", "4096"]);
    let mut e = c.engine(EngineConfig {
        drop_data: true,
        ..EngineConfig::default()
    });
    let mut ev = Vec::new();
    c.feed(&mut e, &c.changed(), false, &mut ev);
    e.flush(1, &mut ev);
    assert!(ev.iter().all(|x| x.kind != EventKind::Write));
    assert!(has(&ev, EventKind::Rename, "/d1/moved.txt").is_some());
    assert!(has(&ev, EventKind::Chown, "/c.txt").is_some());
    let st = e.stats();
    assert!(
        st.dropped_data_writes > 0 && st.dropped_data_bytes > 0,
        "{st:?}"
    );
}

/// A file system inside a partition: device offsets are shifted by the partition start.
#[test]
fn partition_offset() {
    let c = build_case("mkfs.ext2", &["-b", "1024"]);
    const START: usize = 1 << 20;
    let mut disk_after = vec![0u8; START];
    disk_after.extend_from_slice(&c.after);
    let mut disk_before = vec![0u8; START];
    disk_before.extend_from_slice(&c.before);
    let part = vmsight_fsview::Partition {
        number: 1,
        start: START as u64,
        size: c.after.len() as u64,
        kind: vmsight_fsview::PartitionType::Mbr(0x83),
    };
    let index = Index::crawl(&vmsight_fsview::MemSource(disk_before), Some(&part)).expect("crawl");
    let disk = Arc::new(vmsight_fsview::MemSource(disk_after.clone()));
    let mut e = Engine::new(disk.clone(), index, EngineConfig::default()).expect("engine");
    let mut ev = Vec::new();
    let bs = c.bs();
    // Writes as the tap sees them: whole-device offsets, runs of adjacent blocks merged
    // into one multi-block write.
    let changed = c.changed();
    let mut k = 0;
    let mut multi = 0;
    while k < changed.len() {
        let mut n = 1;
        while k + n < changed.len() && changed[k + n] == changed[k] + n as u64 {
            n += 1;
        }
        let off = START + changed[k] as usize * bs;
        e.write(off as u64, &disk_after[off..off + n * bs], 1, &mut ev);
        multi += usize::from(n > 1);
        k += n;
    }
    assert!(multi > 0, "some writes span several blocks");
    e.flush(2, &mut ev);
    check_events(&ev, "partition at 1 MiB");
    let fresh = StaticView::new(
        Index::crawl(disk.as_ref(), Some(&part)).expect("crawl after"),
        disk.clone(),
    );
    check_view(&e, &fresh, "partition at 1 MiB");
}
