//! Read access to a guest file system as the view sees it: the interface between whatever
//! knows the file system (a static crawl, the live inference engine) and whoever shows it
//! (the view server behind `vmsight mount`, tests).

use crate::block::BlockSource;
use crate::error::Result;
use crate::index::{FileKind, Index, InodeMeta};
use std::sync::Arc;

/// One directory entry as returned by [`FsRead::read_dir`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ViewEntry {
    /// Name bytes (no NUL, no slash).
    pub name: Vec<u8>,
    /// Target inode.
    pub ino: u32,
    /// Kind of the target.
    pub kind: FileKind,
}

/// A read-only, consistent view of one guest file system.
///
/// Implementations answer from the last *consistent* metadata version of each file (Gamma-Ray
/// §IV-B): a file whose metadata is being changed by an uncommitted transaction is shown as it
/// was before. Inode 2 is the root directory.
pub trait FsRead: Send + Sync {
    /// Metadata of `ino`, or `None` if it is not in use.
    fn stat(&self, ino: u32) -> Option<InodeMeta>;
    /// Entries of directory `ino` without `.` and `..`, sorted by name; `None` if `ino` is not a
    /// directory in use.
    fn read_dir(&self, ino: u32) -> Option<Vec<ViewEntry>>;
    /// Resolves `name` in directory `dir`.
    fn lookup_in(&self, dir: u32, name: &[u8]) -> Option<u32>;
    /// Target of symlink `ino`.
    fn read_link(&self, ino: u32) -> Option<Vec<u8>>;
    /// Reads file data of `ino` at `offset` into `buf`; returns the bytes read (short at end of
    /// file; holes read as zeros).
    fn read(&self, ino: u32, offset: u64, buf: &mut [u8]) -> Result<usize>;

    /// Resolves an absolute path (no symlinks followed; `..` handled lexically).
    fn lookup(&self, path: &str) -> Option<u32> {
        let mut stack: Vec<u32> = vec![2];
        for comp in path.split('/').filter(|c| !c.is_empty() && *c != ".") {
            if comp == ".." {
                if stack.len() > 1 {
                    stack.pop();
                }
                continue;
            }
            let cur = *stack.last()?;
            stack.push(self.lookup_in(cur, comp.as_bytes())?);
        }
        stack.last().copied()
    }
}

/// A crawl of an image that does not change: the index plus the disk it was made from.
pub struct StaticView {
    index: Index,
    disk: Arc<dyn BlockSource>,
}

impl StaticView {
    /// A view of `disk` as described by `index`.
    pub fn new(index: Index, disk: Arc<dyn BlockSource>) -> Self {
        Self { index, disk }
    }

    /// The index behind the view.
    pub fn index(&self) -> &Index {
        &self.index
    }
}

impl FsRead for StaticView {
    fn stat(&self, ino: u32) -> Option<InodeMeta> {
        self.index.inode(ino)
    }

    fn read_dir(&self, ino: u32) -> Option<Vec<ViewEntry>> {
        Some(
            self.index
                .read_dir(ino)?
                .into_iter()
                .map(|e| ViewEntry {
                    name: e.name.into_owned(),
                    ino: e.ino,
                    kind: e.kind,
                })
                .collect(),
        )
    }

    fn lookup_in(&self, dir: u32, name: &[u8]) -> Option<u32> {
        self.index.lookup_in(dir, name)
    }

    fn read_link(&self, ino: u32) -> Option<Vec<u8>> {
        self.index.read_link(ino).map(std::borrow::Cow::into_owned)
    }

    fn read(&self, ino: u32, offset: u64, buf: &mut [u8]) -> Result<usize> {
        self.index.read_file(self.disk.as_ref(), ino, offset, buf)
    }
}
