//! Guest paths to disk byte ranges, for the insight engine's copies without a user buffer
//! (`copy_file_range`, `sendfile`, `splice`; docs/insights.md, "Copies without a user
//! buffer").
//!
//! The engine knows absolute guest paths (`/mnt/dd/src.bin`); each writable disk's fsview
//! engine (`stream::EngineSlot`) knows its file system with paths relative to that file
//! system (`/src.bin`). Which disk is mounted where is learnt from, in this order of
//! preference: mounts seen in the trace (`/dev/vdb` on `/mnt/dd`: disk 1), the configuration
//! (`--disk …,mount=/mnt/dd`; the root disk on `/`), and otherwise guessed by trying the
//! path's suffixes (`/mnt/dd/src.bin`, `/dd/src.bin`, `/src.bin`), longest first, on every
//! disk in order, accepting a regular file whose size reaches the range's start.
//!
//! The blocks come from the crawl and are used only while the file's size, mode and times
//! are still those of the crawl (the live engine's view): a file created or rewritten since
//! the crawl is found but not mapped. A wrong mapping costs performance (reads hinted as a
//! copy), never data.
//!
//! Locking: [`CopyMap::ranges`] is called by the insight engine on the trace thread without
//! the engine's lock held; it takes one disk's engine read lock at a time and nothing else.

use std::sync::{Arc, Mutex, RwLock};

use vmsight_fsview::{FileExtent, FileKind, FsRead};
use vmsight_insight::blocks::virtio_disk;
use vmsight_insight::{DiskRange, FileBlocks, WHOLE_FILE};

use crate::config::VmConfig;
use crate::stream::{DiskStream, EngineSlot};

/// Most mounts remembered from the trace.
const MAX_SEEN_MOUNTS: usize = 64;

/// One disk whose file system the map can search.
pub struct MappedDisk {
    /// Disk index (0 = root disk).
    pub disk: u32,
    /// Its inference engine (empty until crawled; then updated from the write stream).
    pub slot: Arc<RwLock<EngineSlot>>,
    /// Where the guest mounts it, when configured (`/` for the root disk).
    pub mount: Option<String>,
}

/// The launcher's [`FileBlocks`]: every streamed disk's fsview engine.
pub struct CopyMap {
    disks: Vec<MappedDisk>,
    /// Mounts seen in the trace: (target, disk), newest last.
    seen: Mutex<Vec<(String, u32)>>,
}

impl std::fmt::Debug for CopyMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyMap")
            .field(
                "disks",
                &self.disks.iter().map(|d| d.disk).collect::<Vec<_>>(),
            )
            .finish()
    }
}

impl CopyMap {
    /// A map over `disks`.
    pub fn new(disks: Vec<MappedDisk>) -> Self {
        Self {
            disks,
            seen: Mutex::new(Vec::new()),
        }
    }

    /// A map over a VM's disk streams (writable disks), with the configured mount points.
    pub fn for_vm(cfg: &VmConfig, streams: &[DiskStream]) -> Self {
        Self::new(
            streams
                .iter()
                .map(|s| MappedDisk {
                    disk: s.index as u32,
                    slot: s.slot.clone(),
                    mount: if s.index == 0 {
                        Some("/".into())
                    } else {
                        cfg.disks.get(s.index - 1).and_then(|d| d.mount.clone())
                    },
                })
                .collect(),
        )
    }

    /// Known mount points other than `/`, longest first: the ones seen in the trace (newest
    /// first) before the configured ones. (The root disk's `/` decides nothing: a path there
    /// may be on a disk mounted where vmsight does not know; the suffix search tries the
    /// whole path first, on the root disk first.)
    fn prefixes(&self) -> Vec<(String, u32)> {
        let mut v: Vec<(String, u32)> = self
            .seen
            .lock()
            .map(|s| s.iter().rev().cloned().collect())
            .unwrap_or_default();
        v.extend(
            self.disks
                .iter()
                .filter_map(|d| d.mount.clone().map(|m| (m, d.disk))),
        );
        // Stable: among equal lengths, the seen mounts stay first.
        v.retain(|(p, _)| !p.trim_end_matches('/').is_empty());
        v.sort_by_key(|(p, _)| std::cmp::Reverse(p.len()));
        v
    }

    /// `fs_path` on disk `disk`: `None` if there is no regular file there whose size reaches
    /// `off`; else its ranges (empty when its blocks are not known).
    fn on_disk(&self, disk: u32, fs_path: &str, off: u64, len: u64) -> Option<Vec<DiskRange>> {
        let d = self.disks.iter().find(|d| d.disk == disk)?;
        let slot = d.slot.read().ok()?;
        let engine = slot.0.as_ref()?;
        let ino = engine.lookup(fs_path)?;
        let live = engine.stat(ino)?;
        if live.kind() != FileKind::Regular || live.size <= off {
            return None;
        }
        let index = engine.index();
        let unchanged = index.inode(ino).is_some_and(|c| {
            (c.mode, c.size, c.mtime, c.ctime) == (live.mode, live.size, live.mtime, live.ctime)
        });
        if !unchanged {
            // Created or rewritten since the crawl: the crawl's blocks may be stale.
            return Some(Vec::new());
        }
        let fs = index.fs_info();
        Some(map_extents(
            disk,
            fs.partition_start,
            u64::from(fs.block_size),
            &index.file_extents(ino),
            off,
            len,
            live.size,
        ))
    }
}

impl FileBlocks for CopyMap {
    fn ranges(&self, guest_path: &str, off: u64, len: u64) -> Vec<DiskRange> {
        let path = if guest_path.starts_with('/') {
            guest_path.to_string()
        } else {
            format!("/{guest_path}") // cwd unknown: only its suffixes can match
        };
        // Under a known mount point the file is on that disk or nowhere.
        for (prefix, disk) in self.prefixes() {
            if let Some(rest) = strip_mount(&path, &prefix) {
                return self.on_disk(disk, rest, off, len).unwrap_or_default();
            }
        }
        for suffix in suffixes(&path) {
            for d in &self.disks {
                if let Some(r) = self.on_disk(d.disk, suffix, off, len) {
                    return r;
                }
            }
        }
        Vec::new()
    }

    fn note_mount(&self, source: &str, target: &str) {
        let Some(disk) = virtio_disk(source).filter(|n| self.disks.iter().any(|d| d.disk == *n))
        else {
            return;
        };
        if let Ok(mut s) = self.seen.lock() {
            s.retain(|(t, _)| t != target);
            s.push((target.to_string(), disk));
            if s.len() > MAX_SEEN_MOUNTS {
                s.remove(0);
            }
        }
    }

    fn note_umount(&self, target: &str) {
        if let Ok(mut s) = self.seen.lock() {
            s.retain(|(t, _)| t != target);
        }
    }
}

/// The path inside a file system mounted on `prefix`, if `path` is under it.
fn strip_mount<'a>(path: &'a str, prefix: &str) -> Option<&'a str> {
    let prefix = prefix.trim_end_matches('/');
    if prefix.is_empty() {
        return Some(path);
    }
    match path.strip_prefix(prefix)? {
        "" => Some("/"),
        rest if rest.starts_with('/') => Some(rest),
        _ => None,
    }
}

/// `/a/b/c`, `/b/c`, `/c`: the absolute paths a file at `path` may have inside the file
/// system that holds it, longest first.
fn suffixes(path: &str) -> impl Iterator<Item = &str> {
    path.char_indices()
        .filter(|&(i, c)| c == '/' && i + 1 < path.len())
        .map(move |(i, _)| &path[i..])
}

/// The disk ranges of bytes `[off, off + len)` of a file of `size` bytes with data extents
/// `extents`, rounded out to whole blocks, in file order, adjacent ones merged.
fn map_extents(
    disk: u32,
    part: u64,
    bs: u64,
    extents: &[FileExtent],
    off: u64,
    len: u64,
    size: u64,
) -> Vec<DiskRange> {
    if bs == 0 {
        return Vec::new();
    }
    let end = if len == WHOLE_FILE {
        size
    } else {
        off.saturating_add(len).min(size)
    };
    let lo = off / bs * bs;
    let hi = end.div_ceil(bs).saturating_mul(bs);
    let mut out: Vec<DiskRange> = Vec::new();
    for x in extents.iter().filter(|x| !x.unwritten) {
        let (Some(fs), Some(n)) = (
            x.file_block.checked_mul(bs),
            u64::from(x.len).checked_mul(bs),
        ) else {
            continue;
        };
        let fe = fs.saturating_add(n);
        let (s, e) = (fs.max(lo), fe.min(hi));
        if s >= e {
            continue;
        }
        let Some(at) = x
            .disk_block
            .checked_mul(bs)
            .and_then(|b| b.checked_add(part))
            .and_then(|b| b.checked_add(s - fs))
        else {
            continue;
        };
        let Some(at_end) = at.checked_add(e - s) else {
            continue;
        };
        match out.last_mut() {
            Some(l) if l.bytes.end == at && l.file_offset + (l.bytes.end - l.bytes.start) == s => {
                l.bytes.end = at_end;
            }
            _ => out.push(DiskRange {
                disk,
                bytes: at..at_end,
                file_offset: s,
            }),
        }
    }
    out.sort_by_key(|r| r.file_offset);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;
    use vmsight_fsview::{Engine, EngineConfig, FileSource, Index};

    #[test]
    fn suffixes_mounts_and_device_names() {
        let v: Vec<&str> = suffixes("/mnt/dd/src.bin").collect();
        assert_eq!(v, ["/mnt/dd/src.bin", "/dd/src.bin", "/src.bin"]);
        assert_eq!(suffixes("/").count(), 0);
        assert_eq!(strip_mount("/mnt/dd/a", "/mnt/dd"), Some("/a"));
        assert_eq!(strip_mount("/mnt/dd", "/mnt/dd/"), Some("/"));
        assert_eq!(strip_mount("/mnt/ddx/a", "/mnt/dd"), None);
        assert_eq!(strip_mount("/etc/x", "/"), Some("/etc/x"));
        assert_eq!(virtio_disk("/dev/vda"), Some(0));
        assert_eq!(virtio_disk("/dev/vdb1"), Some(1));
        assert_eq!(virtio_disk("/dev/vdaa"), Some(26));
        assert_eq!(virtio_disk("/dev/sda"), None);
        assert_eq!(virtio_disk("/dev/vd1"), None);
        assert_eq!(virtio_disk("tmpfs"), None);
    }

    #[test]
    fn extents_are_clipped_rounded_and_merged() {
        let x = |file_block, disk_block, len| FileExtent {
            file_block,
            disk_block,
            len,
            unwritten: false,
        };
        // Blocks 0-1 at 100, 2-3 at 102 (contiguous), a hole at 4, 5 at 300; 1 KiB blocks.
        let ext = [x(0, 100, 2), x(2, 102, 2), x(5, 300, 1)];
        let r = map_extents(1, 1 << 20, 1024, &ext, 0, WHOLE_FILE, 5 * 1024 + 10);
        let part = 1 << 20;
        assert_eq!(
            r,
            vec![
                DiskRange {
                    disk: 1,
                    bytes: part + 100 * 1024..part + 104 * 1024,
                    file_offset: 0
                },
                DiskRange {
                    disk: 1,
                    bytes: part + 300 * 1024..part + 301 * 1024,
                    file_offset: 5 * 1024
                },
            ]
        );
        // A range inside the first run, rounded out to blocks.
        let r = map_extents(1, 0, 1024, &ext, 1500, 1000, 1 << 20);
        assert_eq!(r[0].bytes, 101 * 1024..103 * 1024);
        assert_eq!(r[0].file_offset, 1024);
        // Nonsense never panics.
        let bad = [x(u64::MAX, u64::MAX, u32::MAX)];
        assert!(map_extents(0, u64::MAX, 4096, &bad, 0, WHOLE_FILE, u64::MAX).is_empty());
        assert!(map_extents(0, 0, 0, &ext, 0, WHOLE_FILE, 100).is_empty());
    }

    struct Img {
        _dir: tempfile::TempDir,
        path: std::path::PathBuf,
    }

    /// An ext4 image of `files` (path, bytes) made with mkfs.ext4 -d.
    fn mkfs(block_size: &str, files: &[(&str, &[u8])]) -> Img {
        let dir = tempfile::tempdir().expect("tempdir");
        let tree = dir.path().join("tree");
        for (p, bytes) in files {
            let f = tree.join(p);
            std::fs::create_dir_all(f.parent().expect("parent")).expect("mkdir");
            std::fs::write(&f, bytes).expect("write");
        }
        let path = dir.path().join("fs.img");
        let st = std::process::Command::new("mkfs.ext4")
            .args(["-F", "-q", "-b", block_size, "-d"])
            .arg(&tree)
            .arg(&path)
            .arg("16M")
            .status()
            .unwrap_or_else(|e| panic!("mkfs.ext4 could not be run ({e}); install e2fsprogs"));
        assert!(st.success());
        Img { _dir: dir, path }
    }

    fn slot(img: &Img) -> Arc<RwLock<EngineSlot>> {
        let src = FileSource::open(&img.path).expect("open");
        let index = Index::crawl(&src, None).expect("crawl");
        let engine = Engine::new(Arc::new(src), index, EngineConfig::default()).expect("engine");
        Arc::new(RwLock::new(EngineSlot(Some(engine))))
    }

    /// The bytes of `ranges` read back from the image.
    fn read_back(img: &Img, ranges: &[DiskRange]) -> Vec<u8> {
        let f = std::fs::File::open(&img.path).expect("open");
        let mut out = Vec::new();
        for r in ranges {
            let mut b = vec![0u8; (r.bytes.end - r.bytes.start) as usize];
            f.read_exact_at(&mut b, r.bytes.start).expect("read");
            out.extend_from_slice(&b);
        }
        out
    }

    fn pattern(seed: u8, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| seed.wrapping_add((i * 13 + i / 4096) as u8))
            .collect()
    }

    #[test]
    fn files_resolve_by_suffix_mount_and_configuration_to_their_blocks() {
        for bs in ["4096", "1024"] {
            let src = pattern(1, 40_000);
            let decoy = pattern(2, 50_000);
            let root = mkfs(bs, &[("src.bin", &decoy), ("etc/hosts", b"x")]);
            let dd = mkfs(bs, &[("src.bin", &src), ("sub/other.txt", b"other")]);
            let disks = |mount: Option<&str>| {
                vec![
                    MappedDisk {
                        disk: 0,
                        slot: slot(&root),
                        mount: Some("/".into()),
                    },
                    MappedDisk {
                        disk: 1,
                        slot: slot(&dd),
                        mount: mount.map(str::to_string),
                    },
                ]
            };
            // Whole file, mount point configured: disk 1's blocks hold the file.
            let map = CopyMap::new(disks(Some("/mnt/dd")));
            let r = map.ranges("/mnt/dd/src.bin", 0, WHOLE_FILE);
            assert!(r.iter().all(|x| x.disk == 1), "{r:?}");
            assert_eq!(r[0].file_offset, 0);
            let back = read_back(&dd, &r);
            assert_eq!(&back[..src.len()], &src[..], "block size {bs}");
            assert!(back[src.len()..].iter().all(|b| *b == 0));
            // A range in the middle: whole blocks around it.
            let r = map.ranges("/mnt/dd/src.bin", 8192 + 100, 4000);
            let back = read_back(&dd, &r);
            let first = r[0].file_offset as usize;
            assert!(first <= 8192 + 100 && first + back.len() >= 8192 + 4100);
            assert_eq!(&back[..], &src[first..first + back.len()]);
            // Not there, a directory, past the end: nothing.
            assert!(map.ranges("/mnt/dd/missing", 0, WHOLE_FILE).is_empty());
            assert!(map.ranges("/mnt/dd/sub", 0, WHOLE_FILE).is_empty());
            assert!(map.ranges("/mnt/dd/src.bin", 40_000, 10).is_empty());

            // Without knowledge the shortest suffix finds the root disk's /src.bin first...
            let map = CopyMap::new(disks(None));
            let r = map.ranges("/mnt/dd/src.bin", 0, WHOLE_FILE);
            assert!(r.iter().all(|x| x.disk == 0), "{r:?}");
            // ...unless the longer suffix decides: /sub/other.txt exists on disk 1 only.
            let r = map.ranges("/mnt/dd/sub/other.txt", 0, WHOLE_FILE);
            assert_eq!(r.len(), 1);
            assert_eq!(r[0].disk, 1);
            assert_eq!(&read_back(&dd, &r)[..5], b"other");
            // A mount seen in the trace settles it.
            map.note_mount("/dev/vdb", "/mnt/dd");
            let r = map.ranges("/mnt/dd/src.bin", 0, WHOLE_FILE);
            assert!(!r.is_empty() && r.iter().all(|x| x.disk == 1), "{r:?}");
            map.note_umount("/mnt/dd");
            assert_eq!(map.ranges("/mnt/dd/src.bin", 0, WHOLE_FILE)[0].disk, 0);
            // A device that is not one of the disks is ignored.
            map.note_mount("/dev/vdz", "/mnt/dd");
            assert_eq!(map.ranges("/mnt/dd/src.bin", 0, WHOLE_FILE)[0].disk, 0);
        }
    }
}
