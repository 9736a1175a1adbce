//! The ext4/jbd2 fuzz target on stable Rust: the committed corpus, then fixed-seed proptest
//! over mutations and random inputs (docs/fuzzing.md). The seeds are real: small ext4 images
//! made with mkfs.ext4 and the blocks the kernel wrote (journal transactions included) while a
//! workload ran on a loop mount.
#![allow(clippy::unwrap_used, clippy::expect_used)] // Test code: a failed unwrap is a failed test.

#[path = "../../../fuzz/common/driver.rs"]
mod driver;

use std::path::Path;
use std::process::Command;

use vmsight_fsview::fuzzing::{
    encode, ext4_journal, writes, Op, CRAWLED, EVENTS, JOURNAL, JOURNAL_ERROR, REFUSED, TXN_APPLIED,
};
use vmsight_fsview::{FileSource, Index};

const TARGET: &str = "ext4_journal";

fn run(cmd: &str, args: &[&str]) {
    let st = Command::new(cmd)
        .args(args)
        .status()
        .unwrap_or_else(|e| panic!("{cmd} could not be run ({e}); install e2fsprogs"));
    assert!(st.success(), "{cmd} {args:?} failed");
}

/// A 3 MiB ext4 image with 1 KiB blocks and a 1 MiB journal holding a small tree.
fn mkfs(dir: &Path, extra: &[&str]) -> std::path::PathBuf {
    let src = dir.join("src");
    std::fs::create_dir_all(src.join("sub")).unwrap();
    std::fs::write(src.join("a.txt"), b"alpha\n").unwrap();
    std::fs::write(src.join("sub/b.bin"), vec![b'b'; 3000]).unwrap();
    std::os::unix::fs::symlink("a.txt", src.join("link")).unwrap();
    let img = dir.join("fs.img");
    let mut args = vec!["-q", "-F", "-b", "1024", "-J", "size=1", "-N", "64"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["-d", src.to_str().unwrap(), img.to_str().unwrap(), "3M"]);
    run("mkfs.ext4", &args);
    img
}

/// Runs `script` on a loop mount of `img` (the kernel journals its changes).
fn on_loop_mount(dir: &Path, img: &Path, script: &str) {
    let mnt = dir.join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    run(
        "mount",
        &["-o", "loop", img.to_str().unwrap(), mnt.to_str().unwrap()],
    );
    let st = Command::new("sh")
        .args(["-c", script])
        .current_dir(&mnt)
        .status()
        .unwrap();
    run("umount", &[mnt.to_str().unwrap()]);
    assert!(st.success(), "workload failed");
}

/// The blocks of `after` that differ from `before`, journal blocks first (in journal order),
/// then the others in disk order: the stream a guest's kernel sent.
fn write_stream(before: &[u8], after: &[u8], index: &Index) -> Vec<Op> {
    let bs = index.fs_info().block_size as usize;
    let journal: Vec<u64> = index
        .file_extents(index.fs_info().journal_ino)
        .iter()
        .flat_map(|x| x.disk_block..x.disk_block + u64::from(x.len))
        .collect();
    let changed = |b: u64| {
        let r = b as usize * bs..(b as usize + 1) * bs;
        before[r.clone()] != after[r]
    };
    let all = (0..(after.len() / bs) as u64).filter(|&b| changed(b));
    let mut order: Vec<u64> = journal.iter().copied().filter(|&b| changed(b)).collect();
    order.extend(all.filter(|b| !journal.contains(b)));
    order
        .into_iter()
        .flat_map(|b| {
            let at = b as usize * bs;
            writes(at as u32, &after[at..at + bs])
        })
        .collect()
}

/// A seed: an image made with `mkfs_args`, changed by `script` on a loop mount.
fn seed(flags: u8, mkfs_args: &[&str], script: &str) -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let img = mkfs(dir.path(), mkfs_args);
    let before = std::fs::read(&img).unwrap();
    let index = Index::crawl(&FileSource::open(&img).unwrap(), None).unwrap();
    on_loop_mount(dir.path(), &img, script);
    let after = std::fs::read(&img).unwrap();
    let mut ops = write_stream(&before, &after, &index);
    ops.push(Op::Flush);
    ops.push(Op::Tick { secs: 400 });
    encode(flags, &before, &ops)
}

fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let base = || {
        let dir = tempfile::tempdir().unwrap();
        std::fs::read(mkfs(dir.path(), &[])).unwrap()
    };
    let img = base();
    let mut torn = img.clone();
    torn.truncate(img.len() / 3);
    vec![
        (
            "create-rename-remove",
            seed(
                4,
                &[],
                "echo hello > new.txt; mkdir d; mv a.txt d/; sync; rm sub/b.bin; chmod 600 new.txt; sync",
            ),
        ),
        (
            "append-and-symlink-no-csum",
            seed(
                0,
                &["-O", "^metadata_csum"],
                "yes x | head -c 20000 >> sub/b.bin; ln -s /very/long/target/path/for/a/slow/symlink/that/does/not/fit/in/the/inode/at/all/really sl; sync",
            ),
        ),
        (
            "strict-checksums-many-files",
            seed(
                3,
                &[],
                "for i in 1 2 3 4 5 6 7 8 9 10 11 12; do echo $i > f$i; done; sync; rm f3 f7; sync",
            ),
        ),
        ("mkfs-only", encode(0, &img, &[Op::Flush])),
        ("truncated-image", encode(1, &torn, &[Op::Tick { secs: 1 }])),
    ]
}

#[test]
fn generated_seeds_are_committed_and_reach_the_journal() {
    let seen = driver::check_seeds(TARGET, seeds(), ext4_journal);
    let want = CRAWLED | REFUSED | JOURNAL | TXN_APPLIED | EVENTS;
    assert_eq!(
        seen & want,
        want,
        "outcomes reached by the seeds: {seen:#b}"
    );
}

#[test]
fn corpus_and_mutations_neither_panic_nor_hang() {
    // JOURNAL_ERROR (a damaged journal the engine refuses) is left to the mutations.
    let corpus = CRAWLED | REFUSED | JOURNAL | TXN_APPLIED | EVENTS;
    driver::corpus_and_mutations(
        TARGET,
        ext4_journal,
        corpus,
        corpus | JOURNAL_ERROR,
        100_000,
        4096,
    );
}
