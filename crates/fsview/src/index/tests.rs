//! Index tests: the stored form, and a lazy index answering exactly as the eager one it was
//! made from (generated trees, damaged images, eviction and reload), its counters, and damaged
//! section files. Images are made with `mkfs.ext4 -d` (e2fsprogs).
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

use super::*;
use crate::block::{FileSource, MemSource};
use crate::ext4::CrawlOptions;
use proptest::prelude::*;
use std::path::PathBuf;

#[test]
fn garbage_index_is_rejected() {
    assert!(Index::from_bytes(b"nope").is_err());
    let mut b = MAGIC.to_vec();
    b.extend_from_slice(&[0xFF; 64]);
    assert!(Index::from_bytes(&b).is_err());
}

// ---- trees and images -----------------------------------------------------------------------

/// One thing to create in the tree; parents and targets index earlier directories and files.
#[derive(Debug, Clone)]
enum Node {
    Dir {
        parent: usize,
        name: usize,
    },
    File {
        parent: usize,
        name: usize,
        size: usize,
    },
    Symlink {
        parent: usize,
        name: usize,
        target: usize,
    },
    HardLink {
        parent: usize,
        name: usize,
        file: usize,
    },
}

/// Names are drawn from a small pool, so the same name occurs in many directories.
const NAMES: &[&str] = &[
    "a",
    "README",
    "index.html",
    "LC_MESSAGES",
    "x.mo",
    "Makefile",
    "a-much-longer-name-that-takes-many-bytes-in-the-arena.txt",
    "ü-nicht-ascii",
    "z",
    "deep",
    "16x16",
    "share",
];

fn node() -> impl Strategy<Value = Node> {
    let p = 0..64usize;
    let n = 0..NAMES.len() * 3;
    prop_oneof![
        2 => (p.clone(), n.clone()).prop_map(|(parent, name)| Node::Dir { parent, name }),
        5 => (p.clone(), n.clone(), prop_oneof![Just(0usize), 1..200usize, 1000..6000usize, 20_000..90_000usize])
            .prop_map(|(parent, name, size)| Node::File { parent, name, size }),
        1 => (p.clone(), n.clone(), prop_oneof![1..40usize, 60..300usize])
            .prop_map(|(parent, name, target)| Node::Symlink { parent, name, target }),
        1 => (p, n, 0..64usize).prop_map(|(parent, name, file)| Node::HardLink { parent, name, file }),
    ]
}

fn name(i: usize) -> String {
    let base = NAMES[i % NAMES.len()];
    match i / NAMES.len() {
        0 => base.to_string(),
        k => format!("{base}.{k}"),
    }
}

/// Creates the tree under `root` (clashing names are skipped).
fn build_tree(root: &Path, nodes: &[Node]) {
    let mut dirs: Vec<PathBuf> = vec![root.to_path_buf()];
    let mut files: Vec<PathBuf> = Vec::new();
    for n in nodes {
        let (parent, nm) = match n {
            Node::Dir { parent, name }
            | Node::File { parent, name, .. }
            | Node::Symlink { parent, name, .. }
            | Node::HardLink { parent, name, .. } => (dirs[parent % dirs.len()].clone(), *name),
        };
        let path = parent.join(name(nm));
        if path.symlink_metadata().is_ok() {
            continue;
        }
        match n {
            Node::Dir { .. } => {
                std::fs::create_dir(&path).unwrap();
                dirs.push(path);
            }
            Node::File { size, .. } => {
                let data: Vec<u8> = (0..*size).map(|k| (k * 7 + nm) as u8).collect();
                std::fs::write(&path, data).unwrap();
                files.push(path);
            }
            Node::Symlink { target, .. } => {
                let t = "t/".repeat(target / 2) + &"x".repeat(target % 2 + 1);
                std::os::unix::fs::symlink(t, &path).unwrap();
            }
            Node::HardLink { file, .. } => {
                if let Some(f) = files.get(file % files.len().max(1)) {
                    std::fs::hard_link(f, &path).unwrap();
                }
            }
        }
    }
}

/// `mkfs.ext4 -d` of a tree into a 16 MiB image.
fn mkfs(dir: &Path, tree: &Path, opts: &[&str]) -> PathBuf {
    let img = dir.join("fs.img");
    let out = std::process::Command::new("mkfs.ext4")
        .args(["-F", "-q", "-E", "root_owner=0:0"])
        .args(opts)
        .args(["-d", tree.to_str().unwrap(), img.to_str().unwrap(), "16M"])
        .output()
        .unwrap_or_else(|e| panic!("mkfs.ext4 could not be run ({e}); install e2fsprogs"));
    assert!(
        out.status.success(),
        "mkfs.ext4 {opts:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    img
}

const MKFS_OPTS: &[&[&str]] = &[
    &["-b", "1024", "-g", "1024", "-N", "512"],
    &["-b", "4096", "-I", "128"],
    &["-b", "1024", "-O", "^extent,^64bit", "-N", "300"],
    &["-b", "4096", "-I", "256", "-O", "inline_data"],
    &["-b", "2048", "-O", "^has_journal", "-g", "2048"],
];

fn lazy_of(index: &Index, dir: &Path, cfg: &LazyConfig) -> Index {
    let path = dir.join("index.lz");
    let _ = std::fs::remove_file(&path);
    index.clone().into_lazy(&path, cfg).expect("into_lazy")
}

// ---- comparing answers ----------------------------------------------------------------------

/// A tiny deterministic generator for query orders and random probes.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

/// Every per-inode answer of both indexes for `ino`.
fn same_for_inode(a: &Index, b: &Index, disk: &dyn BlockSource, ino: u32) {
    assert_eq!(a.inode(ino), b.inode(ino), "inode {ino}");
    assert_eq!(a.file_extents(ino), b.file_extents(ino), "extents of {ino}");
    assert_eq!(
        a.metadata_blocks(ino),
        b.metadata_blocks(ino),
        "metadata of {ino}"
    );
    assert_eq!(a.runs(ino), b.runs(ino), "runs of {ino}");
    assert_eq!(a.read_dir(ino), b.read_dir(ino), "read_dir {ino}");
    let records = |x: &Index| {
        x.dir_records(ino).map(|v| {
            v.into_iter()
                .map(|(n, e)| (n, e.ino, e.file_type, e.block))
                .collect::<Vec<_>>()
        })
    };
    assert_eq!(records(a), records(b), "records of {ino}");
    assert_eq!(a.path_of(ino), b.path_of(ino), "path of {ino}");
    assert_eq!(a.primary(ino), b.primary(ino), "primary of {ino}");
    assert_eq!(a.names_of(ino), b.names_of(ino), "names of {ino}");
    assert_eq!(a.read_link(ino), b.read_link(ino), "link of {ino}");
    assert_eq!(a.inline_data(ino), b.inline_data(ino), "inline of {ino}");
    assert_eq!(a.inode_location(ino), b.inode_location(ino));
    let mut x = vec![0u8; 100_000];
    let mut y = vec![0u8; 100_000];
    let rx = a.read_file(disk, ino, 0, &mut x).map_err(|e| e.to_string());
    let ry = b.read_file(disk, ino, 0, &mut y).map_err(|e| e.to_string());
    assert_eq!(rx, ry, "read of {ino}");
    assert_eq!(x, y, "contents of {ino}");
}

/// Lookups in directory `dir`: each of its names, and names it may not have.
fn same_lookups(a: &Index, b: &Index, dir: u32, rng: &mut Rng) {
    for e in a.read_dir(dir).unwrap_or_default() {
        assert_eq!(a.lookup_in(dir, &e.name), b.lookup_in(dir, &e.name));
    }
    for _ in 0..4 {
        let n = name(rng.below((NAMES.len() * 3) as u64) as usize);
        assert_eq!(
            a.lookup_in(dir, n.as_bytes()),
            b.lookup_in(dir, n.as_bytes())
        );
    }
}

/// Every query of the public and crate API, over every inode, random inode numbers, every
/// block and every path, in a random order (twice, so evicted sections are read again).
fn same_answers(a: &Index, b: &Index, disk: &dyn BlockSource, seed: u64) {
    let mut rng = Rng(seed | 1);
    let all: Vec<u32> = a.inodes().collect();
    assert_eq!(all, b.inodes().collect::<Vec<_>>(), "inode lists");
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!(
        (
            sa.inodes,
            sa.directories,
            sa.regular_files,
            sa.symlinks,
            sa.entries,
            sa.runs
        ),
        (
            sb.inodes,
            sb.directories,
            sb.regular_files,
            sb.symlinks,
            sb.entries,
            sb.runs
        )
    );
    assert_eq!((a.fs_info(), a.warnings()), (b.fs_info(), b.warnings()));
    let count = a.fs_info().inodes_count;
    let mut probes: Vec<u32> = all.clone();
    probes.extend([0, 1, 2, 7, 8, 11, count, count + 1, u32::MAX]);
    probes.extend((0..32).map(|_| rng.below(u64::from(count) + 2) as u32));
    for round in 0..2 {
        rng.shuffle(&mut probes);
        for &ino in &probes {
            same_for_inode(a, b, disk, ino);
            if round == 0 {
                same_lookups(a, b, ino, &mut rng);
            }
        }
    }
    let blocks = a.fs_info().blocks_count;
    for block in 0..blocks + 3 {
        assert_eq!(a.owner(block), b.owner(block), "owner of block {block}");
    }
    for &ino in &all {
        if let Some(p) = a.path_of(ino) {
            assert_eq!(a.lookup(&p), b.lookup(&p), "lookup {p}");
            let up = format!("{p}/../.");
            assert_eq!(a.lookup(&up), b.lookup(&up), "lookup {up}");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, .. ProptestConfig::default() })]

    /// A lazy index (tiny sections, a cache of a few sections) answers every query exactly
    /// as the eager index it was made from.
    #[test]
    fn lazy_answers_equal_eager_answers(
        nodes in prop::collection::vec(node(), 1..90),
        opts in 0..MKFS_OPTS.len(),
        section_inodes in prop_oneof![1..8u32, 8..64u32, Just(256u32)],
        max_sections in 1..6usize,
        max_bytes in prop_oneof![Just(1u64), 1000..100_000u64, Just(1u64 << 30)],
        seed in any::<u64>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let tree = dir.path().join("tree");
        std::fs::create_dir(&tree).unwrap();
        build_tree(&tree, &nodes);
        let img = mkfs(dir.path(), &tree, MKFS_OPTS[opts]);
        let disk = FileSource::open(&img).unwrap();
        let eager = Index::crawl_with(&disk, None, &CrawlOptions { strict: true, no_checksums: false }).unwrap();
        let cfg = LazyConfig { section_inodes, max_sections, max_bytes, unlink: seed % 2 == 0 };
        let lazy = lazy_of(&eager, dir.path(), &cfg);
        prop_assert!(lazy.is_lazy());
        same_answers(&eager, &lazy, &disk, seed);
        let st = lazy.lazy_stats().unwrap();
        prop_assert!(st.sections_cached as usize <= max_sections);
        prop_assert_eq!(st.load_errors, 0);
        prop_assert!(st.loads >= st.sections, "every section was read: {:?}", st);
        prop_assert!(st.evictions > 0 || st.sections as usize <= max_sections, "{:?}", st);
        prop_assert_eq!(st.inodes_loaded, st.inodes);
        // A clone shares the file and answers the same, from a cache of its own.
        same_answers(&eager, &lazy.clone(), &disk, seed ^ 0x5555);
    }
}

/// The base image of the damaged-image test: a tree with hard links, long names, symlinks,
/// a 300-entry directory and files of every size.
fn base_image(dir: &Path, opts: &[&str]) -> Vec<u8> {
    let tree = dir.join("tree");
    std::fs::create_dir(&tree).unwrap();
    let mut nodes = Vec::new();
    for k in 0..300 {
        nodes.push(Node::File {
            parent: k % 7,
            name: k % 36,
            size: (k * 977) % 7000,
        });
        if k % 10 == 0 {
            nodes.push(Node::Dir {
                parent: k % 5,
                name: k % 36,
            });
            nodes.push(Node::HardLink {
                parent: k % 3,
                name: (k + 5) % 36,
                file: k,
            });
            nodes.push(Node::Symlink {
                parent: k % 4,
                name: (k + 9) % 36,
                target: k,
            });
        }
    }
    let big = tree.join("big");
    std::fs::create_dir(&big).unwrap();
    for k in 0..300 {
        std::fs::write(big.join(format!("entry-{k:04}-with-a-long-name")), b"x").unwrap();
    }
    build_tree(&tree, &nodes);
    std::fs::read(mkfs(dir, &tree, opts)).unwrap()
}

/// Lenient crawls of damaged images (random bytes flipped in inode tables, directory blocks
/// and extent trees) give odd indexes: entries to unknown inodes, unreachable subtrees, inodes
/// without block maps. Their lazy forms answer the same.
#[test]
fn lazy_answers_equal_eager_answers_on_damaged_images() {
    let dir = tempfile::tempdir().unwrap();
    for (o, opts) in [
        &["-b", "1024", "-N", "1200"][..],
        &["-b", "4096", "-O", "^extent,^64bit"],
    ]
    .into_iter()
    .enumerate()
    {
        let sub = dir.path().join(format!("o{o}"));
        std::fs::create_dir(&sub).unwrap();
        let base = base_image(&sub, opts);
        let clean = Index::crawl(&MemSource(base.clone()), None).unwrap();
        let bs = u64::from(clean.fs_info().block_size);
        let targets: Vec<u64> = (0..clean.fs_info().blocks_count)
            .filter(|&b| {
                matches!(
                    clean.owner(b),
                    Owner::InodeTable { .. }
                        | Owner::Directory { .. }
                        | Owner::ExtentTree { .. }
                        | Owner::IndirectBlock { .. }
                )
            })
            .collect();
        let mut rng = Rng(0x1234_5678 + o as u64);
        let mut compared = 0;
        for round in 0..40 {
            let mut img = base.clone();
            for _ in 0..1 + round % 12 {
                let b = targets[rng.below(targets.len() as u64) as usize];
                let at = (b * bs + rng.below(bs)) as usize;
                img[at] ^= 1 << rng.below(8);
            }
            let disk = MemSource(img);
            let lenient = CrawlOptions {
                strict: false,
                no_checksums: true,
            };
            let Ok(eager) = Index::crawl_with(&disk, None, &lenient) else {
                continue;
            };
            let cfg = LazyConfig {
                section_inodes: 1 + (round as u32 * 7) % 40,
                max_sections: 2,
                ..LazyConfig::default()
            };
            let lazy = lazy_of(&eager, dir.path(), &cfg);
            same_answers(&eager, &lazy, &disk, round as u64 + 1);
            compared += 1;
        }
        assert!(
            compared > 20,
            "only {compared} damaged images could be crawled"
        );
    }
}

/// A small image (made once) in a directory of its own, and its eager index.
fn small() -> (tempfile::TempDir, PathBuf, Index) {
    static BASE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let base = BASE.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        base_image(dir.path(), &["-b", "1024", "-N", "1200"])
    });
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("base.img");
    std::fs::write(&img, base).unwrap();
    let index = Index::crawl(&MemSource(base.clone()), None).unwrap();
    (dir, img, index)
}

#[test]
fn eviction_then_reload_gives_the_same_answers_and_is_counted() {
    let (dir, img, eager) = small();
    let disk = FileSource::open(&img).unwrap();
    let cfg = LazyConfig {
        section_inodes: 16,
        max_sections: 2,
        max_bytes: 1 << 30,
        unlink: false,
    };
    let lazy = lazy_of(&eager, dir.path(), &cfg);
    let start = lazy.lazy_stats().unwrap();
    assert_eq!(
        (start.loads, start.evictions, start.sections_cached),
        (0, 0, 0)
    );
    assert_eq!(start.resident_bytes, start.fixed_bytes);
    assert!(start.sections > 10, "{start:?}");
    assert_eq!(start.inodes, eager.stats().inodes as u64);
    let inodes: Vec<u32> = eager.inodes().collect();
    let first = inodes[inodes.len() / 2];
    let far = *inodes.last().unwrap();
    same_for_inode(&eager, &lazy, &disk, first);
    let one = lazy.lazy_stats().unwrap();
    assert!(one.loads >= 1 && one.load_ns > 0, "{one:?}");
    assert!(one.resident_bytes > one.fixed_bytes);
    assert!(
        one.inodes_loaded > 0 && one.inodes_loaded < one.inodes,
        "{one:?}"
    );
    // Three more sections push the first one out ...
    for ino in [2, 11, far] {
        same_for_inode(&eager, &lazy, &disk, ino);
    }
    let full = lazy.lazy_stats().unwrap();
    assert!(full.evictions >= 1, "{full:?}");
    assert!(full.sections_cached <= 2);
    // ... and it is read again, with the same answers.
    same_for_inode(&eager, &lazy, &disk, first);
    let again = lazy.lazy_stats().unwrap();
    assert!(again.loads > full.loads, "{again:?}");
    assert!(again.peak_resident_bytes >= again.resident_bytes);
    assert!(again.peak_resident_bytes > again.fixed_bytes);
    assert_eq!(again.load_errors, 0);
    // A byte bound below one section keeps exactly one.
    let tight = lazy_of(
        &eager,
        dir.path(),
        &LazyConfig {
            max_bytes: 1,
            ..cfg.clone()
        },
    );
    for &ino in inodes.iter().step_by(37) {
        same_for_inode(&eager, &tight, &disk, ino);
        assert_eq!(tight.lazy_stats().unwrap().sections_cached, 1);
    }
}

#[test]
fn the_section_file_is_private_and_removed_when_asked() {
    use std::os::unix::fs::PermissionsExt;
    let (dir, _img, eager) = small();
    let path = dir.path().join("p.lz");
    let lazy = eager
        .clone()
        .into_lazy(&path, &LazyConfig::default())
        .unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600);
    // Never overwritten.
    let e = eager
        .clone()
        .into_lazy(&path, &LazyConfig::default())
        .unwrap_err();
    assert!(e.to_string().contains("p.lz"), "{e}");
    drop(lazy);
    // Reopened from the file, then unlinked: the answers stay.
    let cfg = LazyConfig {
        unlink: true,
        ..LazyConfig::default()
    };
    let again = Index::open_lazy(&path, &cfg).unwrap();
    assert!(!path.exists());
    assert_eq!(
        again.path_of(again.lookup("/big").unwrap()).as_deref(),
        Some("/big")
    );
    assert!(again.to_bytes().is_err(), "a lazy index is not serialised");
}

fn expect_bad(path: &Path, needle: &str) {
    let e = Index::open_lazy(path, &LazyConfig::default()).expect_err("damaged file opened");
    let msg = e.to_string();
    assert!(
        msg.contains(&path.display().to_string()),
        "error does not name the file: {msg}"
    );
    assert!(msg.contains(needle), "{msg:?} does not mention {needle:?}");
}

#[test]
fn a_damaged_section_file_is_an_error_naming_it() {
    let (dir, _img, eager) = small();
    let path = dir.path().join("d.lz");
    drop(eager.into_lazy(&path, &LazyConfig::default()).unwrap());
    let good = std::fs::read(&path).unwrap();
    let bad = dir.path().join("bad.lz");
    let put = |b: &[u8]| std::fs::write(&bad, b).unwrap();
    put(&good[..good.len() - 1]);
    expect_bad(&bad, "does not end");
    put(&good[..20]);
    expect_bad(&bad, "too short");
    put(b"");
    expect_bad(&bad, "too short");
    let mut b = good.clone();
    b[0] ^= 1;
    put(&b);
    expect_bad(&bad, "magic");
    let mut b = good.clone();
    b[8] = 9;
    put(&b);
    expect_bad(&bad, "version");
    let mut b = good.clone();
    b[17] ^= 4;
    put(&b);
    expect_bad(&bad, "prologue");
    let mut b = good.clone();
    let last = b.len() - 3;
    b[last] ^= 0x10;
    put(&b);
    expect_bad(&bad, "header fails its checksum");
    let mut b = good.clone();
    b[100] ^= 0x10; // inside the first section
    put(&b);
    expect_bad(&bad, "fails its checksum");
    let e = Index::open_lazy(dir.path().join("missing.lz"), &LazyConfig::default()).unwrap_err();
    assert!(e.to_string().contains("missing.lz"), "{e}");
}

#[test]
fn a_section_damaged_after_opening_is_counted_not_a_panic() {
    use std::os::unix::fs::FileExt;
    let (dir, _img, eager) = small();
    let path = dir.path().join("late.lz");
    let lazy = eager
        .clone()
        .into_lazy(&path, &LazyConfig::default())
        .unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.write_all_at(&[0xAB; 64], 60).unwrap();
    assert_eq!(lazy.inode(2), None, "the root's section no longer reads");
    let st = lazy.lazy_stats().unwrap();
    assert_eq!(st.load_errors, 1);
    let msg = st.last_error.unwrap();
    assert!(msg.contains("late.lz") && msg.contains("checksum"), "{msg}");
    // The block map is resident: owners are still answered.
    for b in 0..eager.fs_info().blocks_count {
        assert_eq!(lazy.owner(b), eager.owner(b));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    /// Random damage anywhere in a section file: opening fails with an error naming the file,
    /// or (damage the checksums cannot see: none expected) the queries still do not panic.
    #[test]
    fn random_damage_never_panics(flips in prop::collection::vec((any::<u64>(), 0..8u8), 1..6)) {
        let (dir, img, eager) = small();
        let path = dir.path().join("r.lz");
        drop(eager.into_lazy(&path, &LazyConfig::default()).unwrap());
        let mut b = std::fs::read(&path).unwrap();
        let n = b.len() as u64;
        for (at, bit) in flips {
            b[(at % n) as usize] ^= 1 << bit;
        }
        std::fs::write(&path, &b).unwrap();
        match Index::open_lazy(&path, &LazyConfig::default()) {
            Err(e) => prop_assert!(e.to_string().contains("r.lz"), "{}", e),
            Ok(idx) => {
                let disk = FileSource::open(&img).unwrap();
                for ino in 0..idx.fs_info().inodes_count.min(2000) {
                    let _ = (idx.inode(ino), idx.path_of(ino), idx.read_dir(ino));
                    let _ = idx.read_file(&disk, ino, 0, &mut [0u8; 64]);
                }
            }
        }
    }
}
