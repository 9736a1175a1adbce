//! Engine tests with crafted writes on small real images (made with mkfs): jbd2 transactions
//! applied at commit, checkpoints without duplicates, the pending set, garbage metadata.

use super::journal::tests::txn_blocks;
use super::journal::{JournalSuper, JBD2_MAGIC};
use super::*;
use crate::block::FileSource;
use crate::index::LazyConfig;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

struct Img {
    _dir: tempfile::TempDir,
    path: PathBuf,
    file: std::fs::File,
    index: Index,
}

fn make(mkfs: &str, args: &[&str]) -> Img {
    make_with(mkfs, args, |_| {})
}

/// `make`'s tree (`f.txt`, `sub/g.txt`) plus what `more` adds.
fn make_with(mkfs: &str, args: &[&str], more: impl FnOnce(&std::path::Path)) -> Img {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(src.join("sub")).unwrap();
    std::fs::write(src.join("f.txt"), b"hello file\n").unwrap();
    std::fs::write(src.join("sub/g.txt"), vec![b'g'; 5000]).unwrap();
    more(&src);
    let path = dir.path().join("fs.img");
    let st = std::process::Command::new(mkfs)
        .args(["-F", "-q"])
        .args(args)
        .args(["-d", src.to_str().unwrap(), path.to_str().unwrap(), "16M"])
        .status()
        .unwrap_or_else(|e| panic!("{mkfs} could not be run ({e}); install e2fsprogs"));
    assert!(st.success());
    let index = Index::crawl(&FileSource::open(&path).unwrap(), None).unwrap();
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
        .unwrap();
    Img {
        _dir: dir,
        path,
        file,
        index,
    }
}

impl Img {
    fn engine(&self, cfg: EngineConfig) -> Engine {
        let disk: Arc<dyn BlockSource> = Arc::new(FileSource::open(&self.path).unwrap());
        Engine::new(disk, self.index.clone(), cfg).unwrap()
    }
    fn bs(&self) -> u64 {
        u64::from(self.index.fs_info().block_size)
    }
    fn read(&self, block: u64) -> Vec<u8> {
        let mut b = vec![0u8; self.bs() as usize];
        self.file.read_exact_at(&mut b, block * self.bs()).unwrap();
        b
    }
    /// The guest writes `data` to `block`: the image changes, then the engine hears of it.
    fn write(&self, e: &mut Engine, block: u64, data: &[u8], out: &mut Vec<FsEvent>) {
        self.file.write_all_at(data, block * self.bs()).unwrap();
        e.write(block * self.bs(), data, 1, out);
    }
    fn journal_block(&self, pos: u64) -> u64 {
        let j = self.index.fs_info().journal_ino;
        let x = self
            .index
            .file_extents(j)
            .into_iter()
            .find(|x| x.file_block <= pos && pos < x.file_block + u64::from(x.len))
            .unwrap();
        x.disk_block + (pos - x.file_block)
    }
}

#[test]
fn transaction_applies_at_commit_and_checkpoint_is_silent() {
    let img = make("mkfs.ext4", &["-b", "1024"]);
    let mut e = img.engine(EngineConfig {
        capture_data: true,
        ..EngineConfig::default()
    });
    assert!(e.has_journal());
    let ino = img.index.lookup("/f.txt").unwrap();
    let old_mode = img.index.inode(ino).unwrap().mode;
    let (iblk, ioff) = img.index.inode_location(ino).unwrap();
    // The transaction: chmod 600 of f.txt (its inode-table block) and journalled data for
    // f.txt's first block that starts with the jbd2 magic (so it is escaped in the log).
    let mut itable = img.read(iblk);
    let m = (old_mode & !0o7777) | 0o600;
    itable[ioff as usize..ioff as usize + 2].copy_from_slice(&m.to_le_bytes());
    let data_blk = img.index.file_extents(ino)[0].disk_block;
    let mut data = img.read(data_blk);
    data[0..4].copy_from_slice(&JBD2_MAGIC.to_be_bytes());
    // At mount the kernel turns on the journal features matching the file system
    // (metadata_csum: checksum v3, 64bit) by rewriting the journal superblock.
    let mut sbb = img.read(img.journal_block(0));
    let incompat = u32::from_be_bytes(sbb[40..44].try_into().unwrap()) | 0x1 | 0x2 | 0x10;
    sbb[40..44].copy_from_slice(&incompat.to_be_bytes());
    let mut out = Vec::new();
    img.write(&mut e, img.journal_block(0), &sbb, &mut out);
    let jsb = JournalSuper::parse(&sbb).unwrap();
    assert!(jsb.csum_v3() && jsb.tag_bytes() == 16);
    let seq = jsb.sequence + 1;
    let blocks = txn_blocks(
        &jsb,
        seq,
        &[(iblk, itable.clone()), (data_blk, data.clone())],
        &[],
    );
    let n = blocks.len();
    for (k, b) in blocks.iter().enumerate() {
        let pos = u64::from(jsb.first) + k as u64;
        img.write(&mut e, img.journal_block(pos), b, &mut out);
        if k + 1 < n {
            assert!(out.is_empty(), "nothing before the commit: {out:?}");
            assert_eq!(
                e.stat(ino).unwrap().mode,
                old_mode,
                "view shows the old version"
            );
        }
    }
    assert_eq!(e.stat(ino).unwrap().mode, m);
    let chmod = out.iter().find(|x| x.kind == EventKind::Chmod).unwrap();
    assert_eq!(
        (chmod.path.as_str(), chmod.txn, chmod.new.clone()),
        ("/f.txt", Some(seq), Some(crate::Value::Mode(m)))
    );
    let w = out.iter().find(|x| x.kind == EventKind::Write).unwrap();
    assert_eq!(w.range, Some((0, 11)), "journalled data up to i_size");
    assert_eq!(
        w.data.as_deref().map(|d| &d[..4]),
        Some(&JBD2_MAGIC.to_be_bytes()[..])
    );
    assert_eq!(e.stats().txns_applied, 1);
    // Checkpoint: the same content reaches the home location later: no events.
    let mut out = Vec::new();
    img.write(&mut e, iblk, &itable, &mut out);
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(e.stats().checkpoint_writes, 1);

    // Next transaction logs the inode block again but also revokes it: not applied.
    let mut itable2 = itable.clone();
    itable2[ioff as usize..ioff as usize + 2].copy_from_slice(&(m | 0o044).to_le_bytes());
    let blocks = txn_blocks(&jsb, seq + 1, &[(iblk, itable2)], &[iblk]);
    for (k, b) in blocks.iter().enumerate() {
        let pos = u64::from(jsb.first) + (n + k) as u64;
        img.write(&mut e, img.journal_block(pos), b, &mut out);
    }
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(e.stat(ino).unwrap().mode, m);
    let st = e.stats();
    assert_eq!(
        (st.txns_applied, st.revoked_skipped, st.journal_csum_errors),
        (2, 1, 0)
    );
}

#[test]
fn pending_blocks_are_claimed_or_expire() {
    let img = make("mkfs.ext2", &["-b", "4096"]);
    let mut e = img.engine(EngineConfig {
        pending_ttl: Duration::from_secs(10),
        capture_data: true,
        ..EngineConfig::default()
    });
    let bs = img.bs();
    let free = (100..img.index.fs_info().blocks_count)
        .rev()
        .filter(|&b| img.index.owner(b) == Owner::Unknown)
        .take(2)
        .collect::<Vec<_>>();
    let mut out = Vec::new();
    // A write to a free block waits...
    img.write(&mut e, free[0], &vec![7u8; bs as usize], &mut out);
    assert!(out.is_empty());
    assert_eq!(e.stats().pending_blocks, 1);
    e.tick(5_000_000_000, &mut out);
    assert_eq!(e.stats().pending_blocks, 1);
    // ...and expires after its TTL (it was observed at 1 ns).
    e.tick(10_000_000_001, &mut out);
    let st = e.stats();
    assert_eq!((st.pending_blocks, st.pending_expired), (0, 1));
    assert!(out.is_empty());

    // A discard voids a waiting write.
    img.write(&mut e, free[0], &vec![8u8; bs as usize], &mut out);
    assert_eq!(e.stats().pending_blocks, 1);
    e.discard(free[0] * bs, bs, 1, &mut out);
    assert_eq!(e.stats().pending_blocks, 0);

    // Data first, then the inode that maps it (f.txt grows into a second block).
    img.write(&mut e, free[1], &vec![b'x'; bs as usize], &mut out);
    let ino = img.index.lookup("/f.txt").unwrap();
    let (iblk, ioff) = img.index.inode_location(ino).unwrap();
    let mut itable = img.read(iblk);
    let o = ioff as usize;
    let size = bs + 100;
    itable[o + 4..o + 8].copy_from_slice(&(size as u32).to_le_bytes());
    let blocks512 = state::le32(&itable, o + 28) + (bs / 512) as u32;
    itable[o + 28..o + 32].copy_from_slice(&blocks512.to_le_bytes());
    itable[o + 44..o + 48].copy_from_slice(&(free[1] as u32).to_le_bytes()); // i_block[1]
    img.write(&mut e, iblk, &itable, &mut out);
    assert!(out.is_empty(), "no events before the batch resolves");
    e.flush(2, &mut out);
    let kinds: Vec<EventKind> = out.iter().map(|x| x.kind).collect();
    assert_eq!(kinds, vec![EventKind::Extend, EventKind::Write], "{out:?}");
    assert_eq!(out[1].range, Some((bs, size)));
    assert_eq!(out[1].data.as_deref(), Some(&vec![b'x'; 100][..]));
    assert_eq!(e.stats().pending_claimed, 1);
    let mut buf = vec![0u8; 100];
    assert_eq!(e.read(ino, bs, &mut buf).unwrap(), 100);
    assert_eq!(buf, vec![b'x'; 100]);
}

#[test]
fn drop_data_and_split_events() {
    let img = make("mkfs.ext2", &["-b", "1024"]);
    let ino = img.index.lookup("/sub/g.txt").unwrap();
    let mut e = img.engine(EngineConfig {
        capture_data: true,
        max_event_data: 1000,
        ..EngineConfig::default()
    });
    // One 3-block write of g.txt's data (5000 bytes in 5 blocks, maybe not contiguous).
    let x = img.index.file_extents(ino)[0];
    assert!(x.len >= 2);
    let mut out = Vec::new();
    let buf = vec![b'z'; 2048];
    img.file.write_all_at(&buf, x.disk_block * 1024).unwrap();
    e.write(x.disk_block * 1024, &buf, 1, &mut out);
    let ranges: Vec<_> = out.iter().map(|x| x.range.unwrap()).collect();
    assert_eq!(ranges, vec![(0, 1000), (1000, 2000), (2000, 2048)]);
    e.set_drop_data(true);
    let mut out = Vec::new();
    e.write(x.disk_block * 1024, &buf, 2, &mut out);
    assert!(out.is_empty());
    let st = e.stats();
    assert_eq!((st.dropped_data_writes, st.dropped_data_bytes), (2, 2048));
}

#[test]
fn garbage_metadata_never_panics() {
    for (mkfs, args) in [
        ("mkfs.ext4", &["-b", "1024"][..]),
        ("mkfs.ext2", &["-b", "4096"][..]),
    ] {
        let img = make(mkfs, args);
        let mut e = img.engine(EngineConfig::default());
        let bs = img.bs() as usize;
        let mut seed = 99u64;
        let mut rnd = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            seed >> 33
        };
        // Every metadata block of the small image, overwritten with noise several times.
        let targets: Vec<u64> = (0..img.index.fs_info().blocks_count)
            .filter(|&b| !matches!(img.index.owner(b), Owner::Unknown | Owner::Data { .. }))
            .collect();
        let mut out = Vec::new();
        for round in 0..3 {
            for &b in &targets {
                let mut blk = img.read(b);
                for _ in 0..(1 + rnd() % 64) {
                    let i = rnd() as usize % bs;
                    blk[i] = rnd() as u8;
                }
                if round == 2 && rnd() % 4 == 0 {
                    blk[0..4].copy_from_slice(&JBD2_MAGIC.to_be_bytes());
                    blk[4..8].copy_from_slice(&(1 + rnd() as u32 % 5).to_be_bytes());
                }
                img.write(&mut e, b, &blk, &mut out);
            }
            e.flush(round, &mut out);
        }
        let st = e.stats();
        assert!(st.overlay_bytes < 64 << 20, "{st:?}");
        // The view still answers (whatever the noise made of it).
        let _ = e.read_dir(2);
        let _ = e.lookup("/sub/g.txt");
    }
}

/// One object of a view: path, metadata, link target, contents.
type Seen = (String, InodeMeta, Option<Vec<u8>>, Vec<u8>);

/// The whole tree as an `FsRead` shows it: every path with its metadata, link target and
/// contents.
fn walk(v: &dyn FsRead) -> Vec<Seen> {
    let mut out = Vec::new();
    let mut todo = vec![(2u32, String::new())];
    while let Some((dir, path)) = todo.pop() {
        for e in v.read_dir(dir).unwrap_or_default() {
            let p = format!("{path}/{}", String::from_utf8_lossy(&e.name));
            let meta = v.stat(e.ino).unwrap();
            let mut data = vec![0u8; meta.size.min(1 << 20) as usize];
            let n = v.read(e.ino, 0, &mut data).unwrap_or(0);
            data.truncate(n);
            out.push((p.clone(), meta, v.read_link(e.ino), data));
            if e.kind == FileKind::Directory {
                todo.push((e.ino, p));
            }
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Runs a debugfs script on a copy of the image and returns the changed image.
fn debugfs(img: &Img, script: &str) -> Vec<u8> {
    let copy = img.path.with_extension("next");
    std::fs::copy(&img.path, &copy).unwrap();
    let cmds = img.path.with_extension("cmds");
    std::fs::write(&cmds, script).unwrap();
    let out = std::process::Command::new("debugfs")
        .args(["-w", "-f", cmds.to_str().unwrap(), copy.to_str().unwrap()])
        .output()
        .expect("debugfs (e2fsprogs)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::read(&copy).unwrap()
}

/// The engine on a lazy index (sections of 8 inodes, 2 in the cache) produces the same events
/// and the same view as on the eager index, through creates, a slow symlink, attribute
/// changes, hard links, a cross-directory rename, the removal of a hard-linked file's primary
/// name (the other names are searched in the index), deletes and rmdirs.
#[test]
fn a_lazy_index_gives_the_engine_the_same_events_and_view() {
    for (mkfs, args) in [
        (
            "mkfs.ext4",
            &["-b", "1024", "-O", "^has_journal", "-N", "256"][..],
        ),
        ("mkfs.ext2", &["-b", "4096"][..]),
        ("mkfs.ext4", &["-b", "4096", "-O", "^extent,^64bit"][..]),
    ] {
        let img = make_with(mkfs, args, |src| {
            std::fs::create_dir(src.join("many")).unwrap();
            for k in 0..40 {
                std::fs::write(src.join(format!("many/e{k:02}")), vec![b'm'; k * 50]).unwrap();
            }
            std::fs::hard_link(src.join("many/e07"), src.join("sub/e07-link")).unwrap();
        });
        let lz = img.path.with_extension("lz");
        let cfg = LazyConfig {
            section_inodes: 8,
            max_sections: 2,
            ..LazyConfig::default()
        };
        let lazy = img.index.clone().into_lazy(&lz, &cfg).unwrap();
        let disk: Arc<dyn BlockSource> = Arc::new(FileSource::open(&img.path).unwrap());
        let ecfg = EngineConfig {
            capture_data: true,
            ..EngineConfig::default()
        };
        let mut a = img.engine(ecfg.clone());
        let mut b = Engine::new(disk, lazy, ecfg).unwrap();
        assert_eq!(walk(&a), walk(&b), "{mkfs} {args:?}: the crawl");
        let host = img.path.with_extension("data");
        std::fs::write(&host, vec![b'd'; 9000]).unwrap();
        let steps = [
            format!(
                "mkdir new\nwrite {} new/data.bin\nsymlink new/long /{}\nsymlink new/short t\n\
                 sif f.txt mode 0100600\nsif f.txt uid 4321\nln sub/g.txt new/g-hard\n\
                 sif sub/g.txt links_count 2\nrm many/e05\nmkdir many/sub2\n",
                host.display(),
                "long/".repeat(30)
            ),
            "unlink sub/g.txt\nsif new/g-hard links_count 1\nln f.txt sub/f-moved\nunlink f.txt\n\
             rmdir many/sub2\nrm new/data.bin\nunlink many/e07\nsif sub/e07-link links_count 1\n\
             sif many/e09 size 3\n"
                .to_string(),
        ];
        let bs = img.bs() as usize;
        for (k, script) in steps.iter().enumerate() {
            let before = std::fs::read(&img.path).unwrap();
            let after = debugfs(&img, script);
            let (mut ea, mut eb) = (Vec::new(), Vec::new());
            for (n, (x, y)) in before.chunks(bs).zip(after.chunks(bs)).enumerate() {
                if x != y {
                    img.write(&mut a, n as u64, y, &mut ea);
                    b.write(n as u64 * bs as u64, y, 1, &mut eb);
                }
            }
            a.flush(2, &mut ea);
            b.flush(2, &mut eb);
            assert!(!ea.is_empty(), "step {k} produced events");
            assert_eq!(ea, eb, "{mkfs} {args:?}: events of step {k}");
            assert_eq!(
                walk(&a),
                walk(&b),
                "{mkfs} {args:?}: the view after step {k}"
            );
        }
        let st = b.stats().index;
        assert!(st.lazy && st.sections_loaded > 0, "{st:?}");
        assert!(st.sections_evicted > 0, "{st:?}");
        assert!(st.resident_bytes <= st.peak_resident_bytes);
        assert!(!a.stats().index.lazy);
        assert_eq!(a.stats().index.inodes, st.inodes);
        let mut sa = a.stats();
        let mut sb = b.stats();
        for s in [&mut sa, &mut sb] {
            s.index = Default::default();
        }
        assert_eq!(sa, sb, "the engine's other counters");
    }
}

#[test]
fn zeroed_inode_tables_cost_no_memory_and_a_zeroed_inode_in_use_is_still_seen() {
    let img = make("mkfs.ext4", &["-O", "^has_journal", "-N", "2048"]);
    let mut e = img.engine(EngineConfig::default());
    let bs = img.bs() as usize;
    let count = img.index.fs_info().inodes_count;
    // The inode-table blocks that hold only never-used inodes (the tree uses inodes up to
    // about 14, and 256-byte inodes come 16 to a 4 KiB block), as ext4lazyinit writes them.
    let used = img.index.inode_location(16).unwrap().0;
    let unused: std::collections::BTreeSet<u64> = (17..=count)
        .map(|ino| img.index.inode_location(ino).unwrap().0)
        .filter(|&b| b != used)
        .collect();
    assert!(unused.len() >= 100, "{}", unused.len());
    let before = e.overlay_bytes();
    let mut out = Vec::new();
    for &b in &unused {
        img.write(&mut e, b, &vec![0; bs], &mut out);
    }
    assert!(out.is_empty(), "{out:?}");
    assert_eq!(
        e.overlay_bytes(),
        before,
        "no fingerprint kept per zero inode"
    );
    // Zeroing the block of inodes in use is a change the engine must see.
    let ino = img.index.lookup("/f.txt").unwrap();
    let (blk, _) = img.index.inode_location(ino).unwrap();
    img.write(&mut e, blk, &vec![0; bs], &mut out);
    assert!(e.stat(ino).is_none(), "the engine saw f.txt's inode go");
}
