//! Where a guest file's bytes live on the virtual disks: the resolver the insight engine asks
//! when it follows a copy without a user buffer (`copy_file_range`, `sendfile`, `splice`), so
//! that the block reads of the source can be recognised (Sky §3.5, §8).
//!
//! The engine only knows guest paths (from the fd tables); the launcher knows the disks and
//! their file systems (`crates/launcher/src/copymap.rs`, over each disk's fsview engine). A
//! wrong answer costs performance (a read hinted as a copy, a chunk expected in vain), never
//! data: the ranges are hints.

use std::ops::Range;
use std::path::Path;

/// A run of a file's bytes on one virtual disk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskRange {
    /// Disk index (order of `--disk`, 0 = root disk), as the classifier stages number them.
    pub disk: u32,
    /// Byte range on the disk (virtual-disk offsets, as block requests carry them).
    pub bytes: Range<u64>,
    /// Offset in the file of `bytes.start`.
    pub file_offset: u64,
}

/// Length meaning "up to the end of the file" (an offset the plugin could not read: the
/// whole file is taken).
pub const WHOLE_FILE: u64 = u64::MAX;

/// Resolves guest files to disk byte ranges. Called by the insight engine on the trace thread,
/// never while the engine's lock is held, so an implementation may take its own locks (and
/// must never take the insight engine's).
pub trait FileBlocks: Send + Sync {
    /// The disk ranges holding bytes `[off, off + len)` of the regular file at the absolute
    /// guest path `guest_path`, in file order, rounded out to whole file-system blocks and
    /// clipped to the file's size (`len` may be [`WHOLE_FILE`]). Holes and unwritten extents
    /// have no range. Empty when the file is not found or its blocks are not known.
    fn ranges(&self, guest_path: &str, off: u64, len: u64) -> Vec<DiskRange>;

    /// A monitored process mounted `source` (e.g. `/dev/vdb1`) on the absolute guest path
    /// `target`.
    fn note_mount(&self, _source: &str, _target: &str) {}

    /// A monitored process unmounted `target`.
    fn note_umount(&self, _target: &str) {}
}

/// The disk of a virtio-blk device node: `/dev/vda` → 0, `/dev/vdb1` → 1 (devices are named
/// in the order of the disks: the root disk first, then `--disk` in order).
pub fn virtio_disk(source: &str) -> Option<u32> {
    let name = Path::new(source).file_name()?.to_str()?;
    let letters = name.strip_prefix("vd")?;
    let letters = letters.trim_end_matches(|c: char| c.is_ascii_digit());
    if letters.is_empty() || !letters.bytes().all(|b| b.is_ascii_lowercase()) {
        return None;
    }
    // vda..vdz, then vdaa.. (the kernel's sd-style naming).
    letters
        .bytes()
        .try_fold(0u32, |n, b| {
            n.checked_mul(26)?.checked_add(u32::from(b - b'a') + 1)
        })
        .map(|n| n - 1)
}
