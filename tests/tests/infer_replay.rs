//! The ext4 inference engine on a real guest's write stream: a Debian guest mounts an extra
//! ext4 disk and runs a workload (create, mkdir, rename across directories, delete, rmdir,
//! link, symlink, truncate, extend, chmod, chown, overwrite, append, with syncs between steps)
//! while vmsight records the disk's completed writes (`--record-writes 1:FILE`). The recording
//! made by this run is replayed into the engine: metadata events must appear when their jbd2
//! transaction commits (a write to the journal area), checkpoints must add none, and the engine's
//! view must equal a fresh crawl of the image after the run. As in `vmsight replay`, the engine
//! reads a scratch copy of the image taken before the run, with each recorded write applied to
//! it before the engine sees the write; it never reads the final image (which differs from the
//! base copy in recorded blocks, and which the scratch copy must equal after the replay).
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::{symlink, FileExt};
use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use vmsight_blockdev::tap::{read_recording, TapEvent, TapKind};
use vmsight_fsview::{
    Engine, EngineConfig, EventKind, FileKind, FileSource, FsEvent, FsRead, Index, MemSource,
    StaticView, Value,
};
use vmsight_tests::*;

fn make_source(root: &Path) {
    let w = |p: &str, data: &[u8]| {
        let path = root.join(p);
        fs::create_dir_all(path.parent().unwrap()).unwrap();
        fs::write(&path, data).unwrap();
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
    fs::create_dir_all(root.join("emptydir")).unwrap();
    symlink("a.txt", root.join("oldlink")).unwrap();
}

const WORKLOAD: &str = "set -e; mount /dev/vdb /mnt; cd /mnt; \
    mkdir -p d1/sub e; printf 'hello\\n' > d1/new.txt; sync; \
    mv a.txt d1/moved.txt; mv olddir e/olddir2; sync; \
    rm b.txt; rmdir emptydir; sync; \
    ln c.txt d1/c-link; ln -s /some/target d1/sym; truncate -s 100 big.bin; \
    truncate -s 50000 small.txt; chmod 600 c.txt; chown 1234:5678 c.txt; \
    dd if=/dev/urandom of=data.bin bs=4096 count=2 seek=1 conv=notrunc status=none; \
    printf 'appended line\\n' >> log.txt; sync; cd /; umount /mnt; echo done";

fn has(ev: &[(FsEvent, bool)], kind: EventKind, path: &str) -> Option<FsEvent> {
    ev.iter()
        .map(|(e, _)| e)
        .find(|e| e.kind == kind && e.path == path)
        .cloned()
}

fn walk_equal(engine: &dyn FsRead, fresh: &dyn FsRead) -> usize {
    let mut stack = vec![("/".to_string(), 2u32)];
    let mut n = 0;
    while let Some((path, ino)) = stack.pop() {
        let a = engine.read_dir(ino).unwrap();
        assert_eq!(a, fresh.read_dir(ino).unwrap(), "entries of {path}");
        for e in a {
            let p = format!(
                "{}/{}",
                path.trim_end_matches('/'),
                String::from_utf8_lossy(&e.name)
            );
            let (x, y) = (engine.stat(e.ino).unwrap(), fresh.stat(e.ino).unwrap());
            assert_eq!(
                (x.mode, x.uid, x.gid, x.size, x.links, x.mtime),
                (y.mode, y.uid, y.gid, y.size, y.links, y.mtime),
                "metadata of {p}"
            );
            match e.kind {
                FileKind::Directory => stack.push((p, e.ino)),
                FileKind::Symlink => assert_eq!(engine.read_link(e.ino), fresh.read_link(e.ino)),
                FileKind::Regular => {
                    let mut a = vec![0u8; y.size as usize];
                    let mut b = vec![0u8; y.size as usize];
                    engine.read(e.ino, 0, &mut a).unwrap();
                    fresh.read(e.ino, 0, &mut b).unwrap();
                    assert!(a == b, "content of {p}");
                }
                _ => {}
            }
            n += 1;
        }
    }
    n
}

/// The journal's byte ranges on the disk.
fn journal_ranges(index: &Index) -> Vec<(u64, u64)> {
    let bs = u64::from(index.fs_info().block_size);
    index
        .file_extents(index.fs_info().journal_ino)
        .iter()
        .map(|x| (x.disk_block * bs, (x.disk_block + u64::from(x.len)) * bs))
        .collect()
}

/// What one replayed recording gave: the engine and every event with whether the tap write
/// that revealed it went to the journal area.
struct Replayed {
    engine: Engine,
    events: Vec<(FsEvent, bool)>,
}

/// Replays a recording the way `vmsight replay` does (crates/launcher/src/stream.rs `replay`):
/// the engine reads a scratch copy of the image as it was before the run (`base`), and each
/// recorded write is applied to that copy before the engine sees it, so the engine only ever
/// reads what the guest had written up to that point — never the final image. A write recorded
/// without its bytes cannot be replayed (the real replay refuses it too).
fn replay(index: &Index, base: &Path, scratch_path: &Path, stream: &[TapEvent]) -> Replayed {
    fs::copy(base, scratch_path).unwrap();
    let journal = journal_ranges(index);
    let in_journal = |off: u64| journal.iter().any(|&(s, e)| off >= s && off < e);
    let scratch = Arc::new(FileSource::open(scratch_path).unwrap());
    let disk = fs::OpenOptions::new()
        .write(true)
        .open(scratch_path)
        .unwrap();
    let mut engine = Engine::new(scratch, index.clone(), EngineConfig::default()).unwrap();
    assert!(engine.has_journal());
    let mut events: Vec<(FsEvent, bool)> = Vec::new();
    let mut out = Vec::new();
    for ev in stream {
        let mut journal_write = false;
        match &ev.kind {
            TapKind::Write { offset, data, .. } => {
                journal_write = in_journal(*offset);
                let bytes = data.as_ref().unwrap_or_else(|| {
                    panic!("tap event {} was recorded without its bytes", ev.seq)
                });
                disk.write_all_at(bytes, *offset).unwrap();
                engine.write(*offset, bytes, ev.observed_ns, &mut out);
            }
            TapKind::WriteZeroes { offset, len } => {
                let mut pos = *offset;
                while pos < offset + len {
                    let n = (offset + len - pos).min(1 << 20);
                    let zeros = vec![0u8; n as usize];
                    disk.write_all_at(&zeros, pos).unwrap();
                    engine.write(pos, &zeros, ev.observed_ns, &mut out);
                    pos += n;
                }
            }
            TapKind::Discard { offset, len } => {
                engine.discard(*offset, *len, ev.observed_ns, &mut out)
            }
            TapKind::Flush => engine.flush(ev.observed_ns, &mut out),
        }
        events.extend(out.drain(..).map(|e| (e, journal_write)));
    }
    Replayed { engine, events }
}

/// (offset, length) byte ranges on the disk.
type Ranges = Vec<(u64, u64)>;

/// Byte ranges of the recorded writes (write-zeroes included) and of the discards.
fn written_and_discarded(stream: &[TapEvent]) -> (Ranges, Ranges) {
    let (mut written, mut discarded) = (Vec::new(), Vec::new());
    for ev in stream {
        match &ev.kind {
            TapKind::Write { offset, len, .. } | TapKind::WriteZeroes { offset, len } => {
                written.push((*offset, *len))
            }
            TapKind::Discard { offset, len } => discarded.push((*offset, *len)),
            TapKind::Flush => {}
        }
    }
    (written, discarded)
}

/// The base image the replay starts from is not the final image: some block the recording
/// writes holds other bytes in the base than after the run, so a replay that read the final
/// image would see content the guest had not written yet. Returns how many 4 KiB blocks differ.
fn assert_base_differs_where_recorded(base: &[u8], fin: &[u8], stream: &[TapEvent]) -> usize {
    assert_eq!(base.len(), fin.len(), "the run changed the image size");
    let (written, _) = written_and_discarded(stream);
    let mut blocks: BTreeSet<u64> = BTreeSet::new();
    for (off, len) in written {
        blocks.extend((off / 4096)..(off + len).div_ceil(4096));
    }
    let differ = blocks
        .iter()
        .filter(|&&b| {
            let r = (b * 4096) as usize..((b + 1) * 4096).min(fin.len() as u64) as usize;
            base[r.clone()] != fin[r]
        })
        .count();
    assert!(
        differ > 0,
        "the base copy equals the final image in every recorded block"
    );
    differ
}

/// After the replay the scratch copy holds exactly the final image, outside the discarded
/// ranges (the real replay does not punch discards into its copy): the recording carried
/// every write, and the engine read the guest's bytes, not the final image's.
fn assert_scratch_is_final(scratch: &Path, fin: &[u8], stream: &[TapEvent]) {
    let mut got = fs::read(scratch).unwrap();
    let mut want = fin.to_vec();
    let (_, discarded) = written_and_discarded(stream);
    for (off, len) in discarded {
        let r = off as usize..(off + len).min(want.len() as u64) as usize;
        got[r.clone()].fill(0);
        want[r].fill(0);
    }
    let first = got.iter().zip(&want).position(|(a, b)| a != b);
    assert_eq!(
        first, None,
        "the replayed scratch copy differs from the final image (first byte shown)"
    );
}

/// Copies the freshly made image to `base` before the guest runs (the scratch copy's source,
/// as `vmsight replay BASE` takes it) and crawls that copy.
fn base_copy_and_index(img: &Path, base: &Path) -> Index {
    fs::copy(img, base).unwrap();
    Index::crawl(&MemSource(fs::read(base).unwrap()), None).unwrap()
}

/// Replays `stream` over a scratch copy of `base` and checks that this differs from reading
/// the final image `img`: the base differs from it in recorded blocks, and the scratch copy
/// becomes it. Returns the engine, the final image (the oracle for the engine's view: a fresh
/// crawl of what the guest left) and the events.
fn replay_checked(
    index: &Index,
    base: &Path,
    img: &Path,
    dir: &Path,
    stream: &[TapEvent],
) -> (Engine, Arc<FileSource>, Vec<(FsEvent, bool)>) {
    let fin = fs::read(img).unwrap();
    let differ = assert_base_differs_where_recorded(&fs::read(base).unwrap(), &fin, stream);
    let scratch_path = dir.join("scratch.img");
    let r = replay(index, base, &scratch_path, stream);
    assert_scratch_is_final(&scratch_path, &fin, stream);
    eprintln!("{differ} recorded 4 KiB blocks differ between the base copy and the final image");
    (r.engine, Arc::new(FileSource::open(img).unwrap()), r.events)
}

#[test]
fn recorded_guest_stream_yields_events_at_commit_time() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    make_source(&src);
    let img = dir.path().join("extra.img");
    let st = Command::new("mkfs.ext4")
        .args([
            "-F",
            "-q",
            "-b",
            "4096",
            "-E",
            "lazy_itable_init=0,lazy_journal_init=0",
        ])
        .arg("-d")
        .arg(&src)
        .arg(&img)
        .arg("64M")
        .status()
        .expect("mkfs.ext4 must be installed");
    assert!(st.success());
    let base = dir.path().join("extra-base.img");
    let index = base_copy_and_index(&img, &base);

    let rec = dir.path().join("extra.rec");
    let spec = format!("1:{}", rec.display());
    let r = guest_sh(
        &["--disk", img.to_str().unwrap(), "--record-writes", &spec],
        WORKLOAD,
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(r.stdout.contains("done"), "{r:?}");

    // Replay the recording of this run.
    let stream = read_recording(&rec).unwrap();
    assert!(stream.len() > 20, "{} tap events", stream.len());
    let (engine, after, events) = replay_checked(&index, &base, &img, dir.path(), &stream);
    let st = engine.stats();
    eprintln!("{} tap events, stats {st:?}", stream.len());
    for (e, j) in &events {
        eprintln!(
            "{j} {:?} {} {:?} txn={:?} {:?}",
            e.kind, e.path, e.old_path, e.txn, e.range
        );
    }
    assert!(st.txns_applied >= 4, "{st:?}");
    assert_eq!(
        (
            st.journal_csum_errors,
            st.journal_errors,
            st.metadata_errors
        ),
        (0, 0, 0),
        "{st:?}"
    );

    // Names.
    let kinds = [
        EventKind::Create,
        EventKind::Mkdir,
        EventKind::Symlink,
        EventKind::Link,
        EventKind::Delete,
        EventKind::Rmdir,
        EventKind::Rename,
    ];
    let names: BTreeSet<(String, String, Option<String>)> = events
        .iter()
        .map(|(e, _)| e)
        .filter(|e| kinds.contains(&e.kind))
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
    ]
    .into_iter()
    .collect();
    assert_eq!(names, expected);
    let sym = has(&events, EventKind::Symlink, "/d1/sym").unwrap();
    assert_eq!(sym.new, Some(Value::Target("/some/target".into())));
    let t = has(&events, EventKind::Truncate, "/big.bin").unwrap();
    assert_eq!(t.new, Some(Value::Size(100)));
    assert!(has(&events, EventKind::Extend, "/small.txt").is_some());
    let m = has(&events, EventKind::Chmod, "/c.txt").unwrap();
    assert_eq!(m.new, Some(Value::Mode(0o100600)));
    let o = has(&events, EventKind::Chown, "/c.txt").unwrap();
    assert_eq!(
        o.new,
        Some(Value::Owner {
            uid: 1234,
            gid: 5678
        })
    );
    for path in ["/data.bin", "/d1/new.txt", "/log.txt"] {
        assert!(
            has(&events, EventKind::Write, path).is_some(),
            "write to {path}"
        );
    }

    // Every metadata event came from a commit (a journal write) and names its transaction,
    // and the syncs separated the steps into increasing transactions.
    for (e, j) in &events {
        if e.kind != EventKind::Write {
            assert!(*j && e.txn.is_some(), "not at commit time: {e:?}");
        }
    }
    let txn = |k, p| has(&events, k, p).and_then(|e| e.txn).unwrap();
    let (a, b, c, d) = (
        txn(EventKind::Mkdir, "/d1"),
        txn(EventKind::Rename, "/d1/moved.txt"),
        txn(EventKind::Delete, "/b.txt"),
        txn(EventKind::Chown, "/c.txt"),
    );
    assert!(a < b && b < c && c < d, "transactions {a} {b} {c} {d}");
    assert!(st.checkpoint_writes > 0, "{st:?}");

    // The engine's view equals a fresh crawl of the image after the run.
    let fresh = StaticView::new(Index::crawl(after.as_ref(), None).unwrap(), after.clone());
    let n = walk_equal(&engine, &fresh);
    assert!(n > 10, "{n} entries compared");
}

/// A larger workload: the guest copies /usr/share/doc (about a thousand files and directories,
/// enough to wrap the journal of a 256 MiB file system several times), renames the copy and
/// deletes half of it, then copies and deletes the tree once more (so the journal wraps
/// however fast the disk is: faster I/O means fewer, larger commits). Every surviving file was
/// announced by a create under its original path, every deleted top-level entry by a delete or
/// rmdir, and the view equals a fresh crawl.
#[test]
fn recorded_copy_rename_delete_of_a_tree() {
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("big.img");
    fs::File::create(&img).unwrap().set_len(256 << 20).unwrap();
    let st = Command::new("mkfs.ext4")
        .args(["-F", "-q", "-b", "1024", "-J", "size=1"])
        .args(["-E", "lazy_itable_init=0,lazy_journal_init=0"])
        .arg(&img)
        .status()
        .expect("mkfs.ext4 must be installed");
    assert!(st.success());
    let base = dir.path().join("big-base.img");
    let index = base_copy_and_index(&img, &base);
    let rec = dir.path().join("big.rec");
    let spec = format!("1:{}", rec.display());
    let r = guest_sh(
        &["--disk", img.to_str().unwrap(), "--record-writes", &spec],
        "set -e; mount /dev/vdb /mnt; cp -a /usr/share/doc /mnt/doc; sync; \
         mv /mnt/doc /mnt/doc2; sync; ls /mnt/doc2 | head -c 0; rm -rf /mnt/doc2/[a-m]*; sync; \
         cp -a /usr/share/doc /mnt/tmp; sync; rm -rf /mnt/tmp; sync; \
         umount /mnt; echo done",
    );
    assert_eq!(r.code, Some(0), "{r:?}");
    let stream = read_recording(&rec).unwrap();
    let (engine, after, events) = replay_checked(&index, &base, &img, dir.path(), &stream);
    let st = engine.stats();
    eprintln!("{} tap events, stats {st:?}", stream.len());
    // The journal wrapped: more journal blocks were written than it has.
    let jino = index.fs_info().journal_ino;
    let bs = u64::from(index.fs_info().block_size);
    let jext = index.file_extents(jino);
    let jblocks: u64 = jext.iter().map(|x| u64::from(x.len)).sum();
    let written: u64 = stream
        .iter()
        .filter_map(|e| match &e.kind {
            TapKind::Write { offset, len, .. } => Some((*offset, *len)),
            _ => None,
        })
        .filter(|(o, _)| {
            jext.iter()
                .any(|x| *o >= x.disk_block * bs && *o < (x.disk_block + u64::from(x.len)) * bs)
        })
        .map(|(_, l)| l / bs)
        .sum();
    if std::env::var_os("INFER_DEBUG").is_some() {
        for (e, j) in &events {
            eprintln!(
                "EV {j} {:?} {} {:?} txn={:?} ino={}",
                e.kind, e.path, e.old_path, e.txn, e.ino
            );
        }
    }
    assert!(
        written > jblocks,
        "{written} journal blocks written, {jblocks} in the journal"
    );
    assert_eq!(
        (
            st.journal_csum_errors,
            st.journal_errors,
            st.metadata_errors
        ),
        (0, 0, 0),
        "{st:?}"
    );
    assert!(st.txns_applied >= 3, "{st:?}");
    let fresh = StaticView::new(Index::crawl(after.as_ref(), None).unwrap(), after.clone());
    let n = walk_equal(&engine, &fresh);
    assert!(n > 100, "{n} entries compared");

    let created: BTreeSet<&str> = events
        .iter()
        .filter(|(e, _)| {
            matches!(
                e.kind,
                EventKind::Create | EventKind::Mkdir | EventKind::Symlink | EventKind::Link
            )
        })
        .map(|(e, _)| e.path.as_str())
        .collect();
    let renamed = events.iter().any(|(e, _)| {
        e.kind == EventKind::Rename && e.path == "/doc2" && e.old_path.as_deref() == Some("/doc")
    });
    assert!(renamed, "rename /doc -> /doc2");
    // Every surviving entry was created under /doc.
    let mut stack = vec![("/doc2".to_string(), fresh.lookup("/doc2").unwrap())];
    let mut checked = 0;
    while let Some((p, ino)) = stack.pop() {
        for e in fresh.read_dir(ino).unwrap() {
            let path = format!("{p}/{}", String::from_utf8_lossy(&e.name));
            let orig = path.replacen("/doc2", "/doc", 1);
            assert!(created.contains(orig.as_str()), "no create for {orig}");
            checked += 1;
            if e.kind == FileKind::Directory {
                stack.push((path, e.ino));
            }
        }
    }
    assert!(checked > 100, "{checked} surviving entries");
    // Every deleted top-level entry was announced under its new parent.
    let deleted: BTreeSet<&str> = events
        .iter()
        .filter(|(e, _)| matches!(e.kind, EventKind::Delete | EventKind::Rmdir))
        .map(|(e, _)| e.path.as_str())
        .collect();
    let gone: Vec<String> = created
        .iter()
        .filter_map(|p| p.strip_prefix("/doc/"))
        .filter(|rest| !rest.contains('/'))
        .filter(|name| name.as_bytes()[0].is_ascii_lowercase() && name.as_bytes()[0] <= b'm')
        .map(|name| format!("/doc2/{name}"))
        .collect();
    assert!(!gone.is_empty());
    for g in &gone {
        assert!(deleted.contains(g.as_str()), "no delete for {g}");
    }
}
