//! The logical contents of a disk for the parts of vmsight that read a disk besides its
//! backend (the file-system crawl of the stream, the journal ranges of the classifier): the
//! image file itself, or, for a dedup volume, reads through the volume's worker (which owns
//! the volume, so they see every write it served).
//!
//! The disk device registers a volume when its backend starts and removes it when it ends;
//! everything else asks [`open`] with the disk's path.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use vmsight_dedup::DedupHandle;
use vmsight_fsview::{BlockSource, FileSource};

fn volumes() -> &'static Mutex<HashMap<PathBuf, DedupHandle>> {
    static V: OnceLock<Mutex<HashMap<PathBuf, DedupHandle>>> = OnceLock::new();
    V.get_or_init(Mutex::default)
}

/// The served volume at `path` reads through `handle` from now on.
pub fn register(path: &Path, handle: DedupHandle) {
    volumes()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(path.to_owned(), handle);
}

/// The volume at `path` is no longer served.
pub fn unregister(path: &Path) {
    volumes()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .remove(path);
}

/// Runs the garbage collection of the served volume at `path` (compared after
/// canonicalisation) on its worker; `None` if this process does not serve it.
pub fn gc(path: &Path) -> Option<vmsight_dedup::Result<u64>> {
    let want = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_owned());
    let handle = volumes()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .iter()
        .find(|(p, _)| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf()) == want)
        .map(|(_, h)| h.clone())?;
    Some(handle.gc())
}

/// The disk at `path` as a block source.
pub fn open(path: &Path) -> vmsight_fsview::Result<Arc<dyn BlockSource>> {
    let served = volumes()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(path)
        .cloned();
    match served {
        Some(h) => Ok(Arc::new(VolumeSource(h))),
        None => Ok(Arc::new(FileSource::open(path)?)),
    }
}

/// A served dedup volume read through its worker.
struct VolumeSource(DedupHandle);

impl BlockSource for VolumeSource {
    fn read_at(&self, off: u64, buf: &mut [u8]) -> vmsight_fsview::Result<()> {
        let end = off.saturating_add(buf.len() as u64);
        if end > self.0.capacity_bytes() {
            return Err(vmsight_fsview::Error::OutOfBounds {
                offset: off,
                len: buf.len() as u64,
                device_len: self.0.capacity_bytes(),
            });
        }
        self.0
            .read_at(off, buf)
            .map_err(|e| vmsight_fsview::Error::Io {
                context: format!("reading {} bytes at {off} of a dedup volume", buf.len()),
                source: std::io::Error::other(e),
            })
    }

    fn len(&self) -> u64 {
        self.0.capacity_bytes()
    }
}
