//! Insights about one block request: what the classifier attaches to a request (the block
//! pipeline's `Insights`) for later stages (iCache, dedup), and the insight log that
//! `vmsight run --insights FILE` writes and `vmsight report` reads (JSON lines of
//! [`InsightRecord`], tagged by `op`).
//!
//! Insights belong to the *request*, never to the sector: sectors are reused for other files
//! and for metadata (Sky §3.3), so nothing here is remembered per sector by the classifier.
//!
//! I/O classes follow Sky's Table 6: 0 is the lowest priority (large or unknown files), 5 the
//! highest (file-system metadata), 32 means "payload is unique, skip dedup". Applications may
//! supply any class 0..=31 through libvmsight or the LD_PRELOAD shim; it overrides the implicit
//! class of that request.

use serde::{Deserialize, Serialize};
use std::sync::Arc;

/// Highest implicit class: file-system metadata.
pub const CLASS_METADATA: u8 = 5;
/// Default class: data of large or unknown files.
pub const CLASS_DEFAULT: u8 = 0;
/// Sky's hint that the payload is unique (dedup may skip it).
pub const CLASS_SKIP_DEDUP: u8 = 32;

/// An I/O pattern recognised from the syscall stream (Sky §3.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pattern {
    /// The written chunks repeat chunks the same process recently read (cp, dd, rsync, ...).
    Copy,
    /// Written by an encryption tool or into an encrypted-file name (gpg, openssl, .gpg, ...).
    Encrypt,
}

/// Whether the request carries file data or file-system metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Content {
    /// Every 4 KiB chunk matched file data seen at a syscall.
    Data,
    /// No chunk matched: file-system metadata, journal, or I/O of unmonitored processes.
    Metadata,
    /// Part matched, part did not.
    Mixed,
    /// Not placed: no checksum matched and the guest kernel's page says only that it is a
    /// process's anonymous memory (an `O_DIRECT` buffer) or could not be read. Treated as
    /// data of unknown size (the lowest class, deduplicated as usual), never as metadata.
    Unknown,
}

/// What the classifier knows about one request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestInsight {
    /// Effective I/O class used by policies (application hint if any, else metadata → 5,
    /// data → its file-size class).
    pub class: u8,
    /// Data or metadata (Sky §3.4).
    pub content: Content,
    /// File-size class of the file the data belongs to (Table 6), when known.
    pub size_class: Option<u8>,
    /// Recognised pattern, when any.
    pub pattern: Option<Pattern>,
    /// Class supplied by the application (libvmsight / shim), when any.
    pub app_class: Option<u8>,
    /// Guest process (TGID) whose syscall produced the data, when known.
    pub pid: Option<u32>,
    /// Guest path of the file, when known.
    pub file: Option<Arc<str>>,
    /// Byte offset in the file of the request's first byte, when known.
    pub file_offset: Option<u64>,
    /// The request writes the file system's journal (never cached by the priority policy).
    pub journal: bool,
    /// Class of each 4 KiB of the request, from its start, when they differ (a request the
    /// guest merged from blocks of several files); empty when every block has `class`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub block_classes: Vec<u8>,
}

impl RequestInsight {
    /// Class of the 4 KiB block `i` of the request (counted from its start).
    pub fn class_of_block(&self, i: usize) -> u8 {
        self.block_classes.get(i).copied().unwrap_or(self.class)
    }
}

/// What a deduplicating stage may do with a request (Sky §8), derived from its insight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DedupHint {
    /// Nothing known: the full lookup and insertion.
    None,
    /// Read by (or written by) a process copying a file: a read's chunks enter the in-memory
    /// hint cache, a write looks there before the on-disk index.
    Copy,
    /// A write whose payload is known to be unique (encrypted output, file-system metadata,
    /// application class 32): no lookup, no insertion.
    Unique,
}

impl RequestInsight {
    /// The dedup hint of the request as a whole (Sky §8.1): for reads, `Copy` when the
    /// reading process copies; for writes, `Unique` for encrypted output, metadata and the
    /// application class 32, `Copy` for a copying process, else `None`.
    pub fn dedup_hint(&self, write: bool) -> DedupHint {
        let copy = self.pattern == Some(Pattern::Copy);
        if !write {
            return if copy {
                DedupHint::Copy
            } else {
                DedupHint::None
            };
        }
        if self.class == CLASS_SKIP_DEDUP
            || self.app_class == Some(CLASS_SKIP_DEDUP)
            || self.pattern == Some(Pattern::Encrypt)
            || self.content == Content::Metadata
        {
            DedupHint::Unique
        } else if copy {
            DedupHint::Copy
        } else {
            DedupHint::None
        }
    }

    /// The dedup hint of the 4 KiB block `i` of a write: in a request of data and metadata
    /// (`Content::Mixed`), a block of the metadata class is `Unique` and the others follow the
    /// request.
    pub fn dedup_hint_of_block(&self, i: usize) -> DedupHint {
        let whole = self.dedup_hint(true);
        if self.content == Content::Mixed
            && self.app_class.is_none()
            && self.class_of_block(i) == CLASS_METADATA
            && !self.block_classes.is_empty()
        {
            return DedupHint::Unique;
        }
        whole
    }
}

impl RequestInsight {
    /// An insight for a request nothing is known about: metadata, class 5. Unmatched block
    /// I/O is metadata by Sky's rule.
    pub fn metadata() -> Self {
        Self {
            class: CLASS_METADATA,
            content: Content::Metadata,
            size_class: None,
            pattern: None,
            app_class: None,
            pid: None,
            file: None,
            file_offset: None,
            journal: false,
            block_classes: Vec::new(),
        }
    }
}

/// One line of `vmsight run --insights FILE` (JSON lines): a completed block request and its
/// classification. `vmsight report` reads these, plus the file events below.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "lowercase")]
pub enum InsightRecord {
    /// A read request.
    Read(BlockRecord),
    /// A write request.
    Write(BlockRecord),
    /// A discard or write-zeroes request (ends the lifetime of the blocks it covers).
    Discard(BlockRecord),
    /// A monitored process unlinked a file (ends the lifetime of the file's blocks).
    Unlink(FileRecord),
    /// A monitored process truncated a file to `size` (ends the lifetime of blocks beyond it).
    Truncate(FileRecord),
}

/// A block request in the insight log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockRecord {
    /// Host monotonic time in ns since the VM started.
    pub ts_ns: u64,
    /// Disk index (order of `--disk`, 0 = root disk).
    pub disk: u32,
    /// Byte offset on the disk.
    pub offset: u64,
    /// Length in bytes.
    pub len: u64,
    /// The classification.
    #[serde(flatten)]
    pub insight: RequestInsight,
}

/// A file-level event in the insight log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileRecord {
    /// Host monotonic time in ns since the VM started.
    pub ts_ns: u64,
    /// Guest path.
    pub file: String,
    /// New size (truncate); 0 for unlink.
    pub size: u64,
    /// Guest process (TGID).
    pub pid: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_json_has_op_tag_and_flat_insight() {
        let r = InsightRecord::Write(BlockRecord {
            ts_ns: 5,
            disk: 0,
            offset: 4096,
            len: 8192,
            insight: RequestInsight::metadata(),
        });
        let s = serde_json::to_string(&r).expect("serialises");
        assert!(s.contains("\"op\":\"write\""), "{s}");
        assert!(s.contains("\"class\":5"), "{s}");
        assert!(s.contains("\"content\":\"metadata\""), "{s}");
        let back: InsightRecord = serde_json::from_str(&s).expect("parses");
        assert_eq!(back, r);
    }
}
