//! Who owns a page of guest RAM: the reverse mapping the guest kernel keeps in `struct page`.
//!
//! A virtio-blk request's buffers are guest physical pages. For file data the guest's block
//! layer hands the page cache's own pages to the device (reads fill them, writeback writes them
//! out); while the request is in flight the page is locked (read) or under writeback (write),
//! so its `mapping` and `index` are stable. `page->mapping` is the `struct address_space` of
//! the file whose data the page caches, `page->index` the page's offset in that file, and
//! `mapping->host` the file's inode. Metadata pages belong to the block device's own mapping
//! (ext2/ext4 buffer heads: an `S_IFBLK` inode), to a directory's mapping, or to no mapping
//! at all (XFS buffers, jbd2's frozen copies, btrfs' btree inode has no file type); an
//! anonymous page (bit 0 of `mapping`) is a process's memory, e.g. an `O_DIRECT` buffer.
//!
//! This is the guest kernel's own answer to "whose bytes are these", whatever wrote them:
//! `write(2)` of any size, io_uring, AIO, or stores into a shared file mapping. vmsight reads
//! it from the host with the kernel profile (`vmemmap_base`, `struct page`, `address_space`,
//! `inode` offsets from BTF); nothing runs in the guest. The guest keeps running while we
//! read, and its memory is untrusted: every value is bounds-checked, a failed read or an
//! implausible pointer is [`PageOwner::Unknown`], never a panic or a loop.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::{KernelError, KernelView};
use crate::profile::KernelProfile;

/// `i_mode` file type bits.
const S_IFMT: u16 = 0o170_000;
const S_IFREG: u16 = 0o100_000;
/// Low bits of `page->mapping` that mark an anonymous or movable (non-file) page.
const PAGE_MAPPING_FLAGS: u64 = 0b11;
/// Bytes of a guest page.
const PAGE: u64 = 4096;

/// Most inode paths remembered (the cache is emptied when full).
const MAX_PATHS: usize = 16_384;
/// Deepest path walked from an inode to its file system's root.
const MAX_DEPTH: usize = 256;

/// What the guest kernel says a physical page holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PageOwner {
    /// Page-cache data of a regular file.
    File {
        /// Guest `struct inode *` (the identity the plugin's checksum records carry too).
        inode: u64,
        /// `inode->i_ino`.
        ino: u64,
        /// File offset of the page (`page->index` pages).
        offset: u64,
        /// `inode->i_size` now.
        size: u64,
        /// The file's path from the root of its file system (through the inode's first
        /// dentry alias and `d_parent`), when the profile has the members and the file is
        /// still linked. Cached per inode: a rename shows late.
        path: Option<Arc<str>>,
    },
    /// Not file data: the block device's or a directory's page cache, or a kernel buffer with
    /// no mapping (journal copies, XFS/btrfs metadata buffers).
    Metadata,
    /// A process's anonymous memory (an `O_DIRECT` or similar user buffer): the guest does not
    /// say which file it is for.
    Anonymous,
    /// The page could not be read or its fields are implausible (racing, corrupt, or RAM the
    /// guest kernel does not describe).
    Unknown,
}

/// Member offsets and the `struct page` array base, resolved once.
#[derive(Debug, Clone, Copy)]
struct Layout {
    page_size: u64,
    page_mapping: u64,
    page_index: u64,
    mapping_host: u64,
    i_mode: u64,
    i_ino: u64,
    i_size: u64,
    /// `inode.i_dentry` and the offset of `d_alias` (first in the `dentry.d_u` union).
    alias: Option<(u64, u64)>,
}

impl Layout {
    fn resolve(p: &KernelProfile) -> Result<Layout, KernelError> {
        Ok(Layout {
            page_size: p.struct_size("page")?,
            page_mapping: p.member("page", "mapping")?.offset,
            page_index: p.member("page", "index")?.offset,
            mapping_host: p.member("address_space", "host")?.offset,
            i_mode: p.member("inode", "i_mode")?.offset,
            i_ino: p.member("inode", "i_ino")?.offset,
            i_size: p.member("inode", "i_size")?.offset,
            alias: p
                .member("inode", "i_dentry")
                .and_then(|i| Ok((i.offset, p.member("dentry", "d_u")?.offset)))
                .ok(),
        })
    }
}

/// Reads page ownership from guest memory (see the module documentation).
#[derive(Debug)]
pub struct PageOwners {
    view: KernelView,
    lay: Layout,
    /// `vmemmap_base`: the virtual address of the `struct page` of PFN 0.
    vmemmap: u64,
    /// Paths by (inode, i_ino).
    paths: Mutex<HashMap<(u64, u64), Arc<str>>>,
}

impl PageOwners {
    /// Resolves the profile members and reads `vmemmap_base` from the running kernel.
    pub fn new(view: KernelView, profile: &KernelProfile) -> Result<PageOwners, KernelError> {
        let lay = Layout::resolve(profile)?;
        let sym = profile.symbol("vmemmap_base")?;
        let mut b = [0u8; 8];
        view.read_kernel(sym, &mut b)?;
        let vmemmap = u64::from_le_bytes(b);
        if vmemmap < view.kernel_half() || lay.page_size == 0 || lay.page_size > 512 {
            return Err(KernelError::BadPointer {
                what: "vmemmap_base",
                value: vmemmap,
            });
        }
        Ok(PageOwners {
            view,
            lay,
            vmemmap,
            paths: Mutex::new(HashMap::new()),
        })
    }

    /// The owner of the guest physical page containing `gpa`.
    pub fn owner(&self, gpa: u64) -> PageOwner {
        self.read_owner(gpa).unwrap_or(PageOwner::Unknown)
    }

    fn read_owner(&self, gpa: u64) -> Option<PageOwner> {
        // Only RAM the guest has (a stray address would index beyond the page array).
        self.view.ram().layout().locate(gpa)?;
        let pfn = gpa / PAGE;
        let page = self
            .vmemmap
            .checked_add(pfn.checked_mul(self.lay.page_size)?)?;
        let mapping = self.u64_at(page + self.lay.page_mapping)?;
        if mapping == 0 {
            return Some(PageOwner::Metadata);
        }
        if mapping & PAGE_MAPPING_FLAGS != 0 {
            return Some(PageOwner::Anonymous);
        }
        if mapping < self.view.kernel_half() {
            return None;
        }
        let index = self.u64_at(page + self.lay.page_index)?;
        let inode = self.u64_at(mapping.checked_add(self.lay.mapping_host)?)?;
        if inode < self.view.kernel_half() {
            return None;
        }
        let mut m = [0u8; 2];
        self.view
            .read_kernel(inode.checked_add(self.lay.i_mode)?, &mut m)
            .ok()?;
        if u16::from_le_bytes(m) & S_IFMT != S_IFREG {
            return Some(PageOwner::Metadata);
        }
        let ino = self.u64_at(inode.checked_add(self.lay.i_ino)?)?;
        Some(PageOwner::File {
            inode,
            ino,
            offset: index.checked_mul(PAGE)?,
            size: self.u64_at(inode.checked_add(self.lay.i_size)?)?,
            path: self.path(inode, ino),
        })
    }

    /// The inode's path from its file system's root, cached.
    fn path(&self, inode: u64, ino: u64) -> Option<Arc<str>> {
        let mut cache = self.paths.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = cache.get(&(inode, ino)) {
            return Some(p.clone());
        }
        let p: Arc<str> = self.walk_path(inode)?.into();
        if cache.len() >= MAX_PATHS {
            cache.clear();
        }
        cache.insert((inode, ino), p.clone());
        Some(p)
    }

    /// `i_dentry.first` → its dentry → `d_parent` up to the root (`d_parent == self`).
    /// `None` for an unlinked file, a missing alias, or anything implausible.
    fn walk_path(&self, inode: u64) -> Option<String> {
        let (i_dentry, d_alias) = self.lay.alias?;
        let first = self.u64_at(inode.checked_add(i_dentry)?)?;
        let mut dentry = first.checked_sub(d_alias)?;
        if first == 0 || self.view.d_unlinked(dentry).ok()? {
            return None;
        }
        let mut parts: Vec<Vec<u8>> = Vec::new();
        for _ in 0..MAX_DEPTH {
            let parent = self
                .view
                .ptr_at(dentry + self.view.off.dentry_parent, "dentry.d_parent")
                .ok()?;
            if parent == dentry {
                let mut s = String::new();
                for p in parts.iter().rev() {
                    s.push('/');
                    s.push_str(&String::from_utf8_lossy(p));
                }
                return Some(if s.is_empty() { "/".into() } else { s });
            }
            parts.push(self.view.dentry_name(dentry).ok()?);
            dentry = parent;
        }
        None
    }

    fn u64_at(&self, va: u64) -> Option<u64> {
        let mut b = [0u8; 8];
        self.view.read_kernel(va, &mut b).ok()?;
        Some(u64::from_le_bytes(b))
    }
}
