//! The index against e2fsprogs on real images made with mkfs.ext4 -d, mkfs.ext2, mke2fs -O
//! ^extent, inline_data, 1k/4k blocks, GPT and MBR partitions.
#![allow(clippy::unwrap_used)] // Test code: a failed unwrap is a failed test.

mod common;

use common::*;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use vmsight_fsview::*;

/// One directory listing from `debugfs ls -p`: name -> (ino, mode, uid, gid, size).
fn parse_ls(out: &str) -> BTreeMap<String, (u32, u32, u32, u32, Option<u64>)> {
    let mut m = BTreeMap::new();
    for line in out.lines() {
        let f: Vec<&str> = line.split('/').collect();
        if f.len() < 7 || f[5] == "." || f[5] == ".." || f[1] == "0" {
            continue;
        }
        let p = |s: &str| s.parse::<u32>().expect("number");
        m.insert(
            f[5].to_string(),
            (
                p(f[1]),
                u32::from_str_radix(f[2], 8).expect("mode"),
                p(f[3]),
                p(f[4]),
                f[6].parse().ok(),
            ),
        );
    }
    m
}

fn field(stat: &str, key: &str) -> u64 {
    let i = stat
        .find(key)
        .unwrap_or_else(|| panic!("no {key:?} in {stat}"));
    stat[i + key.len()..]
        .split_whitespace()
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad {key:?} in {stat}"))
}

/// Check the whole index against debugfs/dumpe2fs and the source tree.
/// `fx` is the source tree the image was made from (None for an external image: then file
/// contents are checked against `debugfs dump` for a sample and `block_step` samples icheck).
fn check_image(
    image: &Path,
    partition: Option<&Partition>,
    fx: Option<&Fixture>,
    expect_inline: bool,
    block_step: usize,
) {
    let src = FileSource::open(image).expect("open image");
    let index = Index::crawl_with(
        &src,
        partition,
        &CrawlOptions {
            strict: true,
            no_checksums: false,
        },
    )
    .unwrap_or_else(|e| panic!("crawl of {} failed: {e}", image.display()));
    // debugfs needs the file system alone: cut out the partition if any.
    let fsimg = match partition {
        Some(p) => {
            let out = image.with_extension("part");
            let mut buf = vec![0u8; p.size as usize];
            src.read_at(p.start, &mut buf).expect("read partition");
            std::fs::write(&out, &buf).expect("write partition image");
            out
        }
        None => image.to_path_buf(),
    };

    // 1. Walk the tree with debugfs ls -p; compare names, inodes, mode, owner, size, links.
    let mut todo = vec![("/".to_string(), 2u32)];
    let mut all: Vec<(String, u32)> = Vec::new();
    while let Some((dir, dino)) = todo.pop() {
        let ls = parse_ls(&debugfs(&fsimg, &[format!("ls -p \"{dir}\"")])[0]);
        let mine: BTreeMap<String, u32> = index
            .read_dir(dino)
            .unwrap_or_else(|| panic!("{dir} (inode {dino}) is not a directory in the index"))
            .iter()
            .map(|e| (String::from_utf8_lossy(&e.name).into_owned(), e.ino))
            .collect();
        assert_eq!(
            mine.keys().collect::<BTreeSet<_>>(),
            ls.keys().collect::<BTreeSet<_>>(),
            "entries of {dir} differ"
        );
        for (name, (ino, mode, uid, gid, size)) in &ls {
            let path = if dir == "/" {
                format!("/{name}")
            } else {
                format!("{dir}/{name}")
            };
            assert_eq!(mine[name], *ino, "inode of {path}");
            assert_eq!(index.lookup(&path), Some(*ino), "lookup {path}");
            let meta = index
                .inode(*ino)
                .unwrap_or_else(|| panic!("no inode {ino} ({path})"));
            assert_eq!(u32::from(meta.mode), *mode, "mode of {path}");
            assert_eq!((meta.uid, meta.gid), (*uid, *gid), "owner of {path}");
            if let Some(s) = size {
                assert_eq!(meta.size, *s, "size of {path}");
            }
            if meta.kind() == FileKind::Directory {
                todo.push((path.clone(), *ino));
            }
            all.push((path, *ino));
        }
    }
    assert!(
        fx.is_none() || all.len() >= 369,
        "only {} entries found",
        all.len()
    );

    // 2. stat + blocks for every inode: link count, size, data block list.
    let mut cmds = Vec::new();
    for (path, _) in &all {
        cmds.push(format!("stat \"{path}\""));
        cmds.push(format!("blocks \"{path}\""));
    }
    let outs = debugfs(&fsimg, &cmds);
    for (k, (path, ino)) in all.iter().enumerate() {
        let stat = &outs[2 * k];
        let meta = index.inode(*ino).expect("inode");
        assert_eq!(
            field(stat, "Links: "),
            u64::from(meta.links),
            "links of {path}"
        );
        assert_eq!(field(stat, "Size: "), meta.size, "size of {path}");
        assert_eq!(field(stat, "User: "), u64::from(meta.uid), "uid of {path}");
        let theirs: Vec<u64> = outs[2 * k + 1]
            .split_whitespace()
            .map(|b| b.parse().expect("block"))
            .collect();
        let mut mine: Vec<u64> = Vec::new();
        for e in index.file_extents(*ino) {
            mine.extend((0..u64::from(e.len)).map(|i| e.disk_block + i));
        }
        let mut theirs_sorted = theirs.clone();
        theirs_sorted.sort_unstable();
        // debugfs lists data blocks and, for block maps and extent trees, index blocks too.
        let mut mine_all = mine.clone();
        for (b, n) in index.metadata_blocks(*ino) {
            if !matches!(index.owner(b), Owner::XattrBlock { .. }) {
                mine_all.extend(b..b + u64::from(n));
            }
        }
        mine.sort_unstable();
        mine_all.sort_unstable();
        // debugfs `blocks` decodes a fast symlink's target text as block numbers: skip those.
        // Same for device numbers of device nodes.
        let fast_symlink = (meta.kind() == FileKind::Symlink && mine_all.is_empty())
            || matches!(meta.kind(), FileKind::CharDevice | FileKind::BlockDevice);
        assert!(
            fast_symlink || theirs_sorted == mine || theirs_sorted == mine_all,
            "blocks of {path}: debugfs {theirs_sorted:?}, index {mine:?} (+meta {mine_all:?})"
        );
        match (meta.kind(), fx) {
            (_, None) => {}
            (FileKind::Symlink, Some(fx)) => {
                let target = index.read_link(*ino).expect("symlink target");
                let real = std::fs::read_link(fx.tree.join(&path[1..])).expect("readlink");
                assert_eq!(
                    target,
                    real.as_os_str().as_encoded_bytes(),
                    "target of {path}"
                );
            }
            (FileKind::Regular, Some(fx)) => {
                let real = std::fs::read(fx.tree.join(&path[1..])).expect("read source");
                let mut buf = vec![0u8; real.len() + 10];
                let n = index.read_file(&src, *ino, 0, &mut buf).expect("read_file");
                assert_eq!(n as u64, meta.size, "read length of {path}");
                // mke2fs -d drops a trailing hole of a sparse file in some configurations
                // (seen with inline_data): the on-disk size is then shorter, the rest zeros.
                assert!(
                    n <= real.len() && real[n..].iter().all(|&b| b == 0),
                    "size of {path}"
                );
                assert!(buf[..n] == real[..n], "content of {path} differs");
            }
            _ => {}
        }
        assert!(index.path_of(*ino).is_some(), "no path for {path}");
    }
    if fx.is_some() {
        fixture_specific(&index, &fsimg, expect_inline);
    } else {
        dump_sample(&index, &src, &fsimg, &all);
    }

    // 3. icheck every block against owner().
    let fs = index.fs_info().clone();
    let blocks: Vec<u64> = (0..fs.blocks_count).step_by(block_step).collect();
    let mut cmds = Vec::new();
    for chunk in blocks.chunks(500) {
        cmds.push(format!(
            "icheck {}",
            chunk
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(" ")
        ));
    }
    let mut checked = 0;
    for out in debugfs(&fsimg, &cmds) {
        for line in out.lines().skip(1) {
            let mut it = line.split('\t');
            let b: u64 = it.next().and_then(|s| s.parse().ok()).expect("block");
            let who = it.next().expect("owner");
            let owner = index.owner(b);
            let owner_ino = match owner {
                Owner::Data { ino, .. }
                | Owner::Directory { ino, .. }
                | Owner::ExtentTree { ino }
                | Owner::IndirectBlock { ino }
                | Owner::XattrBlock { ino } => Some(ino),
                Owner::Journal { .. } => Some(fs.journal_ino),
                _ => None,
            };
            match who.parse::<u32>() {
                Ok(7) => assert!(
                    matches!(
                        owner,
                        Owner::ReservedGdt { .. } | Owner::IndirectBlock { ino: 7 }
                    ),
                    "block {b}: icheck says resize inode, index says {owner:?}"
                ),
                Ok(n) => assert_eq!(
                    owner_ino,
                    Some(n),
                    "block {b}: icheck says inode {n}, index says {owner:?}"
                ),
                Err(_) => assert_eq!(
                    owner_ino, None,
                    "block {b}: icheck finds no inode, index says {owner:?}"
                ),
            }
            checked += 1;
        }
    }
    assert_eq!(checked, blocks.len(), "icheck covered every sampled block");

    // 4. Fixed metadata against dumpe2fs.
    let dump = run("dumpe2fs", &[fsimg.to_str().expect("utf8")]);
    let mut group = 0u32;
    for line in dump.lines() {
        let l = line.trim();
        if let Some(g) = l
            .strip_prefix("Group ")
            .and_then(|r| r.split(':').next()?.parse().ok())
        {
            group = g;
        } else if let Some(rest) = l.strip_prefix("Block bitmap at ") {
            let b: u64 = rest
                .split_whitespace()
                .next()
                .and_then(|s| s.parse().ok())
                .expect("bb");
            assert_eq!(index.owner(b), Owner::BlockBitmap { group });
        } else if let Some(rest) = l.strip_prefix("Inode bitmap at ") {
            let b: u64 = rest
                .split_whitespace()
                .next()
                .and_then(|s| s.parse().ok())
                .expect("ib");
            assert_eq!(index.owner(b), Owner::InodeBitmap { group });
        } else if let Some(rest) = l.strip_prefix("Inode table at ") {
            let range = rest.split_whitespace().next().expect("range");
            let (a, z) = range.split_once('-').expect("a-b");
            let (a, z): (u64, u64) = (a.parse().expect("a"), z.parse().expect("z"));
            assert!(
                matches!(index.owner(a), Owner::InodeTable { group: g, first_ino } if g == group && first_ino == group * fs.inodes_per_group + 1)
            );
            assert!(matches!(index.owner(z), Owner::InodeTable { group: g, .. } if g == group));
        } else if let Some(b) = l
            .strip_prefix("Group descriptor at ")
            .and_then(|r| r.split_whitespace().next()?.parse::<u64>().ok())
        {
            assert_eq!(
                index.owner(b),
                Owner::GroupDescriptors { group },
                "meta_bg GDT block {b}"
            );
        }
        for (key, want) in [
            ("Group descriptors at ", Owner::GroupDescriptors { group }),
            ("Reserved GDT blocks at ", Owner::ReservedGdt { group }),
        ] {
            if let Some(range) = l.split(key).nth(1).and_then(|r| r.split([' ', ',']).next()) {
                let (a, z) = range.split_once('-').unwrap_or((range, range));
                let (a, z): (u64, u64) = (a.parse().expect("a"), z.parse().expect("z"));
                for b in a..=z {
                    assert_eq!(index.owner(b), want, "{key}{range}");
                }
            }
        }
        if l.starts_with("Primary superblock at ") || l.starts_with("Backup superblock at ") {
            let b: u64 = l
                .split_whitespace()
                .nth(3)
                .and_then(|s| s.trim_end_matches(',').parse().ok())
                .expect("sb");
            assert_eq!(
                index.owner(b),
                Owner::Superblock { group },
                "superblock of group {group}"
            );
        }
    }

    // 5. Serialisation round trip.
    let bytes = index.to_bytes().expect("encode");
    let back = Index::from_bytes(&bytes).expect("decode");
    assert!(back == index, "round trip changed the index");
    let st = index.stats();
    eprintln!(
        "{}: {} inodes, {} heap bytes ({:.1} B/inode), {} serialised bytes",
        image.display(),
        st.inodes,
        st.heap_bytes,
        st.bytes_per_inode(),
        bytes.len()
    );
    assert!(
        index.warnings().is_empty(),
        "warnings: {:?}",
        index.warnings()
    );
}

/// Make an ext4 file system of `size` from the tree and copy it into `disk` at `offset`.
fn place_fs(fx: &Fixture, disk: &Path, offset: u64, size: &str) {
    let fsimg = fx.dir.path().join("part-fs.img");
    let tree = fx.tree.to_str().expect("utf8").to_string();
    run(
        "mkfs.ext4",
        &["-q", "-F", "-d", &tree, fsimg.to_str().expect("utf8"), size],
    );
    htree_and_fsck(&fsimg);
    let bytes = std::fs::read(&fsimg).expect("read fs");
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(disk)
        .expect("open disk");
    f.write_all_at(&bytes, offset)
        .expect("write fs into the partition");
}

fn fixture_specific(index: &Index, fsimg: &Path, expect_inline: bool) {
    let p = index
        .path_of(index.lookup("/dir/sub/deep/large").expect("large"))
        .expect("path");
    assert_eq!(p, "/dir/sub/deep/large");
    // The tree really exercises extent-tree index blocks / (double) indirect blocks and htree.
    let frag = index.lookup("/dir/fragmented").expect("fragmented");
    let large = index.lookup("/dir/sub/deep/large").expect("large");
    let fs_features = index.fs_info().features;
    if fs_features[1] & 0x40 != 0 {
        assert!(
            index
                .metadata_blocks(frag)
                .iter()
                .any(|&(b, _)| index.owner(b) == Owner::ExtentTree { ino: frag }),
            "the fragmented file has no extent-tree block"
        );
    } else {
        let meta: u64 = index
            .metadata_blocks(large)
            .iter()
            .map(|&(_, n)| u64::from(n))
            .sum();
        let min = if index.fs_info().block_size == 1024 {
            3
        } else {
            1
        };
        assert!(
            meta >= min,
            "the large block-mapped file has only {meta} indirect blocks"
        );
        assert!(
            matches!(index.owner(index.metadata_blocks(large)[0].0), Owner::IndirectBlock { ino } if ino == large)
        );
    }
    if fs_features[0] & 0x20 != 0 {
        let st = &debugfs(fsimg, &["stat /many".to_string()])[0];
        let flags = st
            .split("Flags: 0x")
            .nth(1)
            .and_then(|s| u32::from_str_radix(s.split_whitespace().next()?, 16).ok());
        assert!(
            flags.is_some_and(|f| f & 0x1000 != 0),
            "/many is not an htree directory: {st}"
        );
    }
    if expect_inline {
        let ino = index.lookup("/small.txt").expect("small");
        assert_eq!(
            index.inline_data(ino).as_deref(),
            Some(&b"hello world\n"[..]),
            "inline data"
        );
    }
}

/// Compare `read_file` with `debugfs dump` for every 25th regular file.
fn dump_sample(index: &Index, src: &FileSource, fsimg: &Path, all: &[(String, u32)]) {
    let dir = tempfile::tempdir().expect("tempdir");
    let files: Vec<&(String, u32)> = all
        .iter()
        .filter(|(_, ino)| {
            index
                .inode(*ino)
                .is_some_and(|m| m.kind() == FileKind::Regular)
        })
        .step_by(25)
        .collect();
    let cmds: Vec<String> = files
        .iter()
        .enumerate()
        .map(|(i, (p, _))| format!("dump \"{p}\" {}", dir.path().join(i.to_string()).display()))
        .collect();
    debugfs(fsimg, &cmds);
    for (i, (path, ino)) in files.iter().enumerate() {
        let real = std::fs::read(dir.path().join(i.to_string())).expect("dumped file");
        let mut buf = vec![0u8; real.len() + 10];
        let n = index.read_file(src, *ino, 0, &mut buf).expect("read_file");
        assert!(
            n == real.len() && buf[..n] == real[..],
            "content of {path} differs from debugfs dump"
        );
    }
    eprintln!("{} files compared with debugfs dump", files.len());
}

/// The same checks on an existing image (e.g. the guest root disk), read-only:
/// `VMSIGHT_FSVIEW_IMAGE=/path/rootfs.img cargo test -p vmsight-fsview --test real_images -- --ignored`
#[test]
#[ignore = "needs VMSIGHT_FSVIEW_IMAGE=<raw ext4 image>"]
fn external_image() {
    let img = std::env::var("VMSIGHT_FSVIEW_IMAGE")
        .expect("set VMSIGHT_FSVIEW_IMAGE to a raw ext4 image");
    check_image(Path::new(&img), None, None, false, 37);
}

/// mkfs -d does not index directories: let e2fsck -D build the htree, then check the image.
fn htree_and_fsck(img: &Path) {
    let p = img.to_str().expect("utf8");
    {
        let st = std::process::Command::new("e2fsck")
            .args(["-fyD", p])
            .output()
            .unwrap_or_else(|e| panic!("required tool `e2fsck` could not be run ({e})"));
        assert!(
            matches!(st.status.code(), Some(0 | 1)),
            "e2fsck -fyD failed: {st:?}"
        );
        run("e2fsck", &["-fn", p]);
    }
}

fn mkfs_case(tool: &str, args: &[&str], size: &str, inline: bool) {
    let fx = fixture();
    let img = fx.dir.path().join("fs.img");
    let mut a: Vec<&str> = vec!["-q", "-F"];
    a.extend_from_slice(args);
    let tree = fx.tree.to_str().expect("utf8").to_string();
    a.extend_from_slice(&["-d", &tree, img.to_str().expect("utf8"), size]);
    run(tool, &a);
    htree_and_fsck(&img);
    check_image(&img, None, Some(&fx), inline, 1);
}

#[test]
fn ext4_4k() {
    mkfs_case("mkfs.ext4", &["-b", "4096"], "32M", false);
}

#[test]
fn ext4_1k() {
    mkfs_case("mkfs.ext4", &["-b", "1024"], "32M", false);
}

#[test]
fn ext4_2k_64bit_flexbg_csum() {
    mkfs_case(
        "mkfs.ext4",
        &["-b", "2048", "-O", "64bit,metadata_csum,flex_bg"],
        "32M",
        false,
    );
}

#[test]
fn ext4_meta_bg_sparse_super2() {
    mkfs_case(
        "mke2fs",
        &[
            "-t",
            "ext4",
            "-O",
            "meta_bg,^resize_inode,sparse_super2",
            "-b",
            "1024",
            "-E",
            "num_backup_sb=1",
        ],
        "300M",
        false,
    );
}

#[test]
fn ext2_1k() {
    mkfs_case("mkfs.ext2", &["-b", "1024"], "32M", false);
}

#[test]
fn ext3_4k() {
    mkfs_case("mkfs.ext3", &["-b", "4096"], "32M", false);
}

#[test]
fn ext4_blockmap_no_extents() {
    mkfs_case(
        "mke2fs",
        &["-t", "ext4", "-O", "^extent,^64bit", "-b", "1024"],
        "32M",
        false,
    );
}

#[test]
fn ext4_inline_data() {
    mkfs_case(
        "mke2fs",
        &["-t", "ext4", "-O", "inline_data", "-I", "256", "-b", "4096"],
        "32M",
        true,
    );
}

#[test]
fn gpt_partitioned() {
    let fx = fixture();
    let img = fx.dir.path().join("gpt.img");
    let p = img.to_str().expect("utf8");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(80 << 20))
        .expect("create");
    run(
        "sgdisk",
        &[
            "-n",
            "1:2048:+8M",
            "-t",
            "1:ef00",
            "-n",
            "2:0:+40M",
            "-t",
            "2:8300",
            "-c",
            "2:root",
            p,
        ],
    );
    let info = run("sgdisk", &["-i", "2", p]);
    let first: u64 = info
        .lines()
        .find_map(|l| l.strip_prefix("First sector: "))
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .expect("first sector");
    let src = FileSource::open(&img).expect("open");
    let table = read_partitions(&src).expect("gpt");
    assert_eq!(table.scheme, Scheme::Gpt);
    assert!(table.warnings.is_empty(), "{:?}", table.warnings);
    assert_eq!(table.partitions.len(), 2);
    let part = table.get(2).expect("p2").clone();
    assert_eq!(part.start, first * 512);
    assert_eq!(part.size, 40 << 20);
    match &part.kind {
        PartitionType::Gpt {
            type_guid, name, ..
        } => {
            assert_eq!(
                guid_string(type_guid),
                "0FC63DAF-8483-4772-8E79-3D69D8477DE4"
            );
            assert_eq!(name, "root");
        }
        k => panic!("unexpected {k:?}"),
    }
    place_fs(&fx, &img, part.start, "40M");
    check_image(&img, Some(&part), Some(&fx), false, 1);
    // A corrupted header CRC is reported, not fatal.
    let mut bytes = std::fs::read(&img).expect("read");
    bytes[512 + 8] ^= 0xFF; // revision field
    let t = read_partitions(&MemSource(bytes)).expect("still parses");
    assert!(
        t.warnings.iter().any(|w| w.contains("CRC")),
        "{:?}",
        t.warnings
    );
}

#[test]
fn mbr_partitioned_with_logical() {
    let fx = fixture();
    let img = fx.dir.path().join("mbr.img");
    let p = img.to_str().expect("utf8");
    std::fs::File::create(&img)
        .and_then(|f| f.set_len(100 << 20))
        .expect("create");
    let script = "label: dos\nstart=2048, size=16384, type=83\nstart=18432, size=81920, type=5\nstart=20480, size=73728, type=83\n";
    let out = std::process::Command::new("sfdisk")
        .arg(p)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin
                .take()
                .expect("stdin")
                .write_all(script.as_bytes())?;
            c.wait_with_output()
        })
        .unwrap_or_else(|e| panic!("required tool `sfdisk` could not be run ({e}); install fdisk"));
    assert!(
        out.status.success(),
        "sfdisk: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let src = FileSource::open(&img).expect("open");
    let table = read_partitions(&src).expect("mbr");
    assert_eq!(table.scheme, Scheme::Mbr);
    let numbers: Vec<usize> = table.partitions.iter().map(|p| p.number).collect();
    assert_eq!(numbers, vec![1, 2, 5], "{:?}", table.partitions);
    let part = table.get(5).expect("logical").clone();
    assert_eq!(part.start, 20480 * 512);
    assert_eq!(part.size, 73728 * 512);
    assert_eq!(part.kind, PartitionType::Mbr(0x83));
    place_fs(&fx, &img, part.start, "36M");
    check_image(&img, Some(&part), Some(&fx), false, 1);
}
