//! Block devices: the [`BlockSource`] trait, a raw-image file source, an in-memory source and
//! a partition window.

use crate::error::{Error, Result};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Something that can be read at byte offsets: a raw disk image, a partition of one, a memory
/// buffer, later a live virtual disk.
pub trait BlockSource: Send + Sync {
    /// Fill `buf` from byte offset `off`. Reading past [`BlockSource::len`] is an error.
    fn read_at(&self, off: u64, buf: &mut [u8]) -> Result<()>;
    /// Size in bytes.
    fn len(&self) -> u64;
    /// True if the source has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

fn check_bounds(off: u64, len: usize, device_len: u64) -> Result<()> {
    let len = len as u64;
    match off.checked_add(len) {
        Some(end) if end <= device_len => Ok(()),
        _ => Err(Error::OutOfBounds {
            offset: off,
            len,
            device_len,
        }),
    }
}

/// A raw disk image in a file, opened read-only.
#[derive(Debug)]
pub struct FileSource {
    file: File,
    len: u64,
}

impl FileSource {
    /// Open `path` read-only.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|source| Error::Io {
            context: format!("opening {}", path.display()),
            source,
        })?;
        let len = file
            .metadata()
            .map_err(|source| Error::Io {
                context: format!("reading the size of {}", path.display()),
                source,
            })?
            .len();
        Ok(FileSource { file, len })
    }
}

impl BlockSource for FileSource {
    fn read_at(&self, off: u64, buf: &mut [u8]) -> Result<()> {
        check_bounds(off, buf.len(), self.len)?;
        self.file
            .read_exact_at(buf, off)
            .map_err(|source| Error::Io {
                context: format!("reading {} bytes at offset {off}", buf.len()),
                source,
            })
    }
    fn len(&self) -> u64 {
        self.len
    }
}

/// An in-memory image (tests, fuzzing).
#[derive(Debug, Clone)]
pub struct MemSource(pub Vec<u8>);

impl BlockSource for MemSource {
    fn read_at(&self, off: u64, buf: &mut [u8]) -> Result<()> {
        check_bounds(off, buf.len(), self.len())?;
        // Bounds were checked above, so these conversions and the slice cannot fail; use `get`
        // anyway so that a logic error turns into an error, not a panic.
        let start = usize::try_from(off).map_err(|_| Error::OutOfBounds {
            offset: off,
            len: buf.len() as u64,
            device_len: self.len(),
        })?;
        let src = self
            .0
            .get(start..start + buf.len())
            .ok_or(Error::OutOfBounds {
                offset: off,
                len: buf.len() as u64,
                device_len: self.len(),
            })?;
        buf.copy_from_slice(src);
        Ok(())
    }
    fn len(&self) -> u64 {
        self.0.len() as u64
    }
}

/// A byte window `[start, start + len)` of another source, e.g. one partition.
pub struct Window<'a> {
    inner: &'a dyn BlockSource,
    start: u64,
    len: u64,
}

impl<'a> Window<'a> {
    /// A window of `inner`; fails if it does not fit inside.
    pub fn new(inner: &'a dyn BlockSource, start: u64, len: u64) -> Result<Self> {
        check_bounds(start, 0, inner.len())?;
        match start.checked_add(len) {
            Some(end) if end <= inner.len() => Ok(Window { inner, start, len }),
            _ => Err(Error::OutOfBounds {
                offset: start,
                len,
                device_len: inner.len(),
            }),
        }
    }
}

impl BlockSource for Window<'_> {
    fn read_at(&self, off: u64, buf: &mut [u8]) -> Result<()> {
        check_bounds(off, buf.len(), self.len)?;
        self.inner.read_at(self.start + off, buf)
    }
    fn len(&self) -> u64 {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_and_window_bounds() {
        let m = MemSource((0u8..100).collect());
        let mut b = [0u8; 4];
        m.read_at(96, &mut b).expect("in bounds");
        assert_eq!(b, [96, 97, 98, 99]);
        assert!(m.read_at(97, &mut b).is_err());
        assert!(m.read_at(u64::MAX, &mut b).is_err());
        let w = Window::new(&m, 10, 20).expect("window");
        w.read_at(0, &mut b).expect("in window");
        assert_eq!(b[0], 10);
        assert!(w.read_at(17, &mut b).is_err());
        assert!(Window::new(&m, 90, 20).is_err());
    }
}
