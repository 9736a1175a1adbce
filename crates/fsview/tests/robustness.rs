//! Corrupt, truncated and malicious images: clear errors, no panics, bounded work.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use common::*;
use vmsight_fsview::*;

const STRICT: CrawlOptions = CrawlOptions {
    strict: true,
    no_checksums: true,
};
const LENIENT: CrawlOptions = CrawlOptions {
    strict: false,
    no_checksums: true,
};

/// A 4 KiB-block ext4 image (or a block-mapped one) of the standard tree, with its index.
fn image(extents: bool) -> (Vec<u8>, Index) {
    let fx = fixture();
    let img = fx.dir.path().join("r.img");
    let tree = fx.tree.to_str().expect("utf8").to_string();
    let feat = if extents { "extent" } else { "^extent,^64bit" };
    run(
        "mke2fs",
        &[
            "-q",
            "-F",
            "-t",
            "ext4",
            "-O",
            feat,
            "-b",
            "4096",
            "-d",
            &tree,
            img.to_str().expect("utf8"),
            "32M",
        ],
    );
    let bytes = std::fs::read(&img).expect("read image");
    let index = Index::crawl_with(&MemSource(bytes.clone()), None, &STRICT).expect("clean crawl");
    (bytes, index)
}

fn crawl(bytes: &[u8], opts: &CrawlOptions) -> Result<Index> {
    Index::crawl_with(&MemSource(bytes.to_vec()), None, opts)
}

fn expect_err(bytes: &[u8], needle: &str) -> Error {
    let e = crawl(bytes, &STRICT).expect_err("corruption must be an error");
    assert!(
        e.to_string().contains(needle),
        "error {e:?} does not mention {needle:?}"
    );
    e
}

fn inode_offset(index: &Index, ino: u32) -> usize {
    let (b, o) = index.inode_location(ino).expect("location");
    (b * u64::from(index.fs_info().block_size)) as usize + o as usize
}

fn put32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}
fn put16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_le_bytes());
}

#[test]
fn truncated_images() {
    let (bytes, _) = image(true);
    expect_err(&bytes[..bytes.len() / 2], "truncated");
    let e = expect_err(&bytes[..1500], "past the end of the device");
    assert!(matches!(e, Error::OutOfBounds { .. }));
    expect_err(&[], "past the end of the device");
}

#[test]
fn bad_superblock_magic() {
    let (mut bytes, _) = image(true);
    bytes[1024 + 56] = 0;
    let e = expect_err(&bytes, "0xef53");
    assert!(matches!(e, Error::BadMagic { .. }));
}

#[test]
fn superblock_with_billions_of_inodes() {
    let (bytes, _) = image(true);
    let mut b = bytes.clone();
    put32(&mut b, 1024, 3_000_000_000);
    expect_err(&b, "inode count 3000000000");
    let mut b = bytes.clone();
    put32(&mut b, 1024 + 40, u32::MAX); // inodes per group
    expect_err(&b, "inodes per group");
    let mut b = bytes.clone();
    put32(&mut b, 1024 + 4, u32::MAX); // blocks count
    expect_err(&b, "truncated");
    let mut b = bytes;
    put32(&mut b, 1024 + 24, 30); // log block size
    expect_err(&b, "block size");
}

#[test]
fn superblock_checksum_is_verified() {
    let (mut bytes, _) = image(true);
    bytes[1024 + 120] ^= 1; // volume name
    let e = crawl(&bytes, &CrawlOptions::default()).expect_err("checksum");
    assert!(e.to_string().contains("checksum mismatch"), "{e}");
}

#[test]
fn group_descriptor_pointing_outside() {
    let (mut bytes, index) = image(true);
    let gdt = (index.fs_info().first_data_block as usize + 1) * index.fs_info().block_size as usize;
    put32(&mut bytes, gdt + 8, 0xFFFF_FF00); // inode table of group 0
    expect_err(&bytes, "outside the file system");
}

#[test]
fn extent_tree_corruptions() {
    let (bytes, index) = image(true);
    let frag = index.lookup("/dir/fragmented").expect("fragmented");
    let base = inode_offset(&index, frag) + 40;
    assert_eq!(
        u16::from_le_bytes([bytes[base + 6], bytes[base + 7]]),
        1,
        "root depth"
    );
    let (child, _) = index.metadata_blocks(frag)[0];
    let child_off = (child * u64::from(index.fs_info().block_size)) as usize;

    // Absurd depth.
    let mut b = bytes.clone();
    put16(&mut b, base + 6, 100);
    expect_err(&b, "depth 100");

    // A loop: root claims depth 2, the child claims depth 1 and points to itself.
    let mut b = bytes.clone();
    put16(&mut b, base + 6, 2);
    put16(&mut b, child_off + 6, 1);
    put32(&mut b, child_off + 12 + 4, child as u32);
    put16(&mut b, child_off + 12 + 8, 0);
    expect_err(&b, "loops");

    // A leaf extent pointing past the end.
    let mut b = bytes.clone();
    put32(&mut b, child_off + 12 + 8, 0xFFFF_FFF0);
    expect_err(&b, "past the end");

    // Too many entries for the node.
    let mut b = bytes.clone();
    put16(&mut b, base + 2, 60);
    expect_err(&b, "entries");

    // Lenient: one warning, everything else indexed.
    let idx = crawl(&b, &LENIENT).expect("lenient crawl");
    assert_eq!(idx.warnings().len(), 1, "{:?}", idx.warnings());
    assert_eq!(idx.warnings()[0].ino, Some(frag));
    assert!(idx.file_extents(frag).is_empty());
    assert_eq!(
        idx.lookup("/dir/sub/deep/large"),
        index.lookup("/dir/sub/deep/large")
    );
    let large = index.lookup("/dir/sub/deep/large").expect("large");
    assert_eq!(idx.file_extents(large), index.file_extents(large));
}

#[test]
fn block_map_with_more_blocks_than_i_blocks() {
    let (mut bytes, index) = image(false);
    let large = index.lookup("/dir/sub/deep/large").expect("large");
    let off = inode_offset(&index, large);
    put32(&mut bytes, off + 28, 8); // i_blocks: one 4 KiB block
    expect_err(&bytes, "i_blocks");
    let off12 = off + 40 + 12 * 4;
    put32(&mut bytes, off12, 0xFFFF_FFFF); // indirect pointer past the end
    put32(&mut bytes, off + 28, 1 << 30);
    expect_err(&bytes, "outside the file system");
}

#[test]
fn directory_loop_is_detected_and_bounded() {
    let (mut bytes, index) = image(true);
    let deep = index.lookup("/dir/sub/deep").expect("deep");
    let dir = index.lookup("/dir").expect("dir");
    let bs = index.fs_info().block_size as usize;
    let blk = index.file_extents(deep)[0].disk_block as usize * bs;
    let pos = bytes[blk..blk + bs]
        .windows(5)
        .position(|w| w == b"large")
        .expect("entry")
        + blk
        - 8;
    put32(&mut bytes, pos, dir); // deep/large -> /dir (an ancestor)
    bytes[pos + 7] = 2; // file type: directory
    let e = expect_err(&bytes, "linked a second time");
    assert!(matches!(e, Error::DirectoryTree(_)));
    let idx = crawl(&bytes, &LENIENT).expect("lenient");
    assert!(
        idx.warnings().iter().any(|w| w.message.contains("loop")),
        "{:?}",
        idx.warnings()
    );
    assert_eq!(idx.path_of(dir).as_deref(), Some("/dir"));
    assert_eq!(idx.lookup("/dir/sub/deep/large/sub/deep/large"), Some(dir));
    assert_eq!(idx.path_of(deep).as_deref(), Some("/dir/sub/deep"));
}

#[test]
fn corrupt_directory_entry() {
    let (mut bytes, index) = image(true);
    let deep = index.lookup("/dir/sub/deep").expect("deep");
    let bs = index.fs_info().block_size as usize;
    let blk = index.file_extents(deep)[0].disk_block as usize * bs;
    put16(&mut bytes, blk + 4, 3); // rec_len of "."
    expect_err(&bytes, "record length");
}

#[test]
fn random_corruption_never_panics() {
    let (bytes, index) = image(true);
    let bs = u64::from(index.fs_info().block_size);
    // Metadata-heavy region: the first 2 MiB (superblock, GDT, bitmaps, inode tables, dirs).
    let region = (2 << 20).min(bytes.len() as u64);
    let mut seed = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut errors = 0;
    for round in 0..300 {
        let mut b = bytes.clone();
        let flips = 1 + next() % 16;
        for _ in 0..flips {
            let off = (next() % region) as usize;
            b[off] ^= (next() % 255 + 1) as u8;
        }
        for opts in [STRICT, LENIENT] {
            match crawl(&b, &opts) {
                Ok(idx) => {
                    for ino in idx.inodes().take(50).collect::<Vec<_>>() {
                        let _ = idx.path_of(ino);
                        let _ = idx.read_dir(ino);
                        let _ = idx.file_extents(ino);
                    }
                    for blk in (0..idx.fs_info().blocks_count).step_by(97) {
                        let _ = idx.owner(blk);
                    }
                    let _ = idx.lookup("/dir/sub/deep/large");
                    let bytes = idx.to_bytes().expect("encode");
                    Index::from_bytes(&bytes).expect("decode");
                }
                Err(e) => {
                    assert!(!e.to_string().is_empty());
                    errors += 1;
                }
            }
        }
        let _ = (round, bs);
    }
    eprintln!("random corruption: {errors} of 600 crawls returned errors, none panicked");
}

#[test]
fn stored_index_corruption_is_rejected_or_harmless() {
    let (_, index) = image(true);
    let bytes = index.to_bytes().expect("encode");
    assert_eq!(Index::from_bytes(&bytes).expect("decode"), index);
    let mut seed = 12345u64;
    for _ in 0..500 {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut b = bytes.clone();
        let off = 8 + (seed >> 33) as usize % (b.len() - 8);
        b[off] ^= 0x5A;
        if let Ok(idx) = Index::from_bytes(&b) {
            for ino in idx.inodes().take(20).collect::<Vec<_>>() {
                let _ = idx.path_of(ino);
                let _ = idx.read_dir(ino);
            }
            let _ = idx.owner(100);
        }
    }
    assert!(Index::from_bytes(&bytes[..bytes.len() / 2]).is_err());
}

#[test]
fn cross_linked_files_hit_the_global_cap() {
    let (mut bytes, index) = image(true);
    let large = index.lookup("/dir/sub/deep/large").expect("large");
    let src = inode_offset(&index, large);
    let iblock: Vec<u8> = bytes[src + 40..src + 100].to_vec();
    let iblocks: Vec<u8> = bytes[src + 28..src + 32].to_vec();
    let flags: Vec<u8> = bytes[src + 32..src + 36].to_vec();
    let many = index.lookup("/many").expect("many");
    for e in index.read_dir(many).expect("dir") {
        let off = inode_offset(&index, e.ino);
        bytes[off + 40..off + 100].copy_from_slice(&iblock);
        bytes[off + 28..off + 32].copy_from_slice(&iblocks);
        bytes[off + 32..off + 36].copy_from_slice(&flags);
    }
    // Fatal even in a lenient crawl: the whole file system is suspect.
    let e = crawl(&bytes, &LENIENT).expect_err("cross-linked");
    assert!(e.to_string().contains("cross-linked"), "{e}");
}
