//! Engine tests with crafted writes on small real images (made with mkfs): jbd2 transactions
//! applied at commit, checkpoints without duplicates, the pending set, garbage metadata.

use super::journal::tests::txn_blocks;
use super::journal::{JournalSuper, JBD2_MAGIC};
use super::*;
use crate::block::FileSource;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

struct Img {
    _dir: tempfile::TempDir,
    path: PathBuf,
    file: std::fs::File,
    index: Index,
}

fn make(mkfs: &str, args: &[&str]) -> Img {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src");
    std::fs::create_dir_all(src.join("sub")).unwrap();
    std::fs::write(src.join("f.txt"), b"hello file\n").unwrap();
    std::fs::write(src.join("sub/g.txt"), vec![b'g'; 5000]).unwrap();
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
