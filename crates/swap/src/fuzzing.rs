//! Fuzz entry point of the swap region (see docs/fuzzing.md):
//!
//! - [`swap_region`]: the region vmsight shares with the guest module. The guest can write any
//!   byte of it at any time (header, index, slot states, free stack, slots), so the input
//!   interleaves guest scribbles with vmsight's own operations on the real [`SwapStore`]:
//!   block reads, writes and discards, evictions, resizes with their rebalance, trims and the
//!   evictor's step.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;

use vmsight_proto::sym::swapr::{self, Layout, PAGE};
use vmsight_proto::sym::SWAPHDR;

use crate::store::{OpError, Place, SwapStore};

#[path = "../../../fuzz/common/input.rs"]
mod input;
use input::{Input, Output};

/// Outcome bits of [`swap_region`]: a block read was served from a slot.
pub const SWAP_CACHE_READ: u32 = 1;
/// A block write went into a slot.
pub const SWAP_CACHE_WRITE: u32 = 2;
/// A block write went to the swap file (no usable free slot).
pub const SWAP_FILE_WRITE: u32 = 4;
/// vmsight noticed a region state the protocol does not allow (counted as corrupt).
pub const SWAP_CORRUPT: u32 = 8;
/// An eviction moved slots to the file.
pub const SWAP_EVICTED: u32 = 16;
/// A request was refused with its reason (a page beyond the disk, a cache beyond the slots).
pub const SWAP_REFUSED: u32 = 32;

/// Most operations of one input.
const MAX_SWAP_OPS: usize = 64;
/// Longest scribble.
const MAX_SCRIBBLE: usize = 256;
/// Header fields vmsight writes after creating the region.
const VMM_WRITES: [&str; 4] = ["lock", "free_top", "used", "limit"];

/// One step: the guest's or vmsight's.
#[derive(Debug, Clone)]
pub enum SwapOp {
    /// vmsight writes swap page `page` (a page of the byte `tag`). A `page` of `u16::MAX` is
    /// `u64::MAX`; otherwise it is taken modulo the disk's pages plus two (some beyond it).
    Write { page: u16, tag: u8 },
    /// vmsight reads swap page `page`.
    Read { page: u16 },
    /// vmsight discards swap page `page`.
    Discard { page: u16 },
    /// The guest writes `bytes` at `offset` (modulo the region's size, cut at its end).
    Scribble { offset: u32, bytes: Vec<u8> },
    /// The guest writes the 32-bit word `value` at word `word` (modulo the region).
    Word { word: u32, value: u32 },
    /// vmsight evicts up to `want % 8` slots.
    Evict { want: u8 },
    /// vmsight sets the cache to `pages % (slots + 2)` pages and rebalances.
    Resize { pages: u8 },
    /// vmsight gives back the memory of up to `max % 8` free slots, then runs the evictor's
    /// step.
    Trim { max: u8 },
}

/// Runs one swap region input; panics if a promise is broken. Returns the outcome bits.
///
/// Input: the disk's pages (`2 + b % 64`), the most slots (`1 + b % 16`) and the cache size
/// (`b % (slots + 1)`), then operations until the input ends. The guest's lock word is put
/// back to free before each of vmsight's operations (a guest holding it makes each operation
/// wait 2 s and fail with `Locked`, which `a_guest_holding_the_lock_makes_requests_fail_not_hang`
/// covers). Promises checked: no panic; a request fails only with `Range` for a page beyond
/// the disk; no operation changes a byte of the region outside vmsight's header words, the
/// index, the slot states, the free stack and the slots (the region's padding and the guest's
/// header fields stay as the guest left them), nor grows the swap file; a read from a slot
/// returns the slot the index names, a read from the file the file's page; a write to a slot
/// leaves the index naming a mapped slot of that page holding the data, and changes no other
/// slot; reads, discards and evictions change no slot's data; trims and resizes only zero
/// slots; the occupancy, evictions and trims stay within the slots.
pub fn swap_region(data: &[u8]) -> u32 {
    let mut inp = Input::new(data);
    let swap_pages = 2 + u64::from(inp.u8() % 64);
    let Some(layout) = Layout::new(swap_pages, 1 + u64::from(inp.u8() % 16)) else {
        panic!("a disk of {swap_pages} pages has a layout");
    };
    let cache = u64::from(inp.u8()) % (layout.slots + 1);
    let Some(mut rig) = Rig::new(layout, cache) else {
        return 0;
    };
    let mut seen = 0;
    for _ in 0..MAX_SWAP_OPS {
        if inp.is_empty() {
            break;
        }
        seen |= rig.step(&decode_swap_op(&mut inp));
    }
    if rig.store.counters.corrupt.load(Ordering::Relaxed) > 0 {
        seen |= SWAP_CORRUPT;
    }
    seen
}

/// The store under test and its swap file.
struct Rig {
    store: SwapStore,
    layout: Layout,
    file: File,
    /// See [`vmm_writes`].
    vmm_writes: Vec<std::ops::Range<u64>>,
}

/// An empty swap file in memory (a memfd: nothing to clean up, nothing on disk).
fn swap_file() -> Option<File> {
    use std::os::fd::FromRawFd;
    // SAFETY: memfd_create reads the NUL-terminated name and returns a new fd or -1.
    let fd = unsafe { libc::memfd_create(c"vmsight-fuzz-swap".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: fd was just created and is owned by nobody else.
    Some(unsafe { File::from_raw_fd(fd) })
}

impl Rig {
    fn new(layout: Layout, cache: u64) -> Option<Self> {
        let file = swap_file()?;
        file.set_len(layout.swap_pages * PAGE).ok()?;
        let ours = file.try_clone().ok()?;
        let store = match SwapStore::new("fuzz", file, layout, cache) {
            Ok(s) => s,
            Err(e) => panic!("a cache of {cache} pages in {} slots: {e}", layout.slots),
        };
        Some(Self {
            store,
            layout,
            file: ours,
            vmm_writes: vmm_writes(&layout),
        })
    }

    /// The swap page an operation names.
    fn page(&self, page: u16) -> u64 {
        if page == u16::MAX {
            u64::MAX
        } else {
            u64::from(page) % (self.layout.swap_pages + 2)
        }
    }

    fn step(&mut self, op: &SwapOp) -> u32 {
        match op {
            SwapOp::Scribble { offset, bytes } => {
                let at = u64::from(*offset) % self.layout.region_size;
                self.scribble(at, bytes);
                0
            }
            SwapOp::Word { word, value } => {
                let at = (u64::from(*word) * 4) % self.layout.region_size;
                self.scribble(at, &value.to_le_bytes());
                0
            }
            _ => self.vmm(op),
        }
    }

    /// One of vmsight's operations, with the region checked around it.
    fn vmm(&mut self, op: &SwapOp) -> u32 {
        self.free_lock();
        let before = self.snapshot();
        let (bits, may_change) = match op {
            SwapOp::Write { page, tag } => self.write(self.page(*page), *tag),
            SwapOp::Read { page } => (self.read(self.page(*page)), Slots::None),
            SwapOp::Discard { page } => {
                let p = self.page(*page);
                (self.refused(p, self.store.discard(p).err()), Slots::None)
            }
            SwapOp::Evict { want } => (self.evict(usize::from(*want % 8)), Slots::None),
            SwapOp::Resize { pages } => (self.resize(*pages), Slots::Zeroed),
            SwapOp::Trim { max } => {
                let max = usize::from(*max % 8);
                assert!(self.store.trim(max) <= max, "a trim stays within its batch");
                crate::evictor::step(&self.store);
                (0, Slots::Zeroed)
            }
            SwapOp::Scribble { .. } | SwapOp::Word { .. } => (0, Slots::None),
        };
        self.check_changes(&before, &self.snapshot(), may_change);
        let (free, used) = self.store.occupancy();
        assert!(free <= self.layout.slots && used <= self.layout.slots);
        let len = self.file.metadata().map_or(0, |m| m.len());
        assert_eq!(
            len,
            self.layout.swap_pages * PAGE,
            "the swap file never grows"
        );
        bits
    }

    fn write(&self, page: u64, tag: u8) -> (u32, Slots) {
        let data = vec![tag; PAGE as usize];
        match self.store.write(page, &data) {
            Ok(Place::Cache) => {
                let slot = self.mapped_slot(page);
                assert_eq!(
                    self.slot_data(slot),
                    data,
                    "the slot holds what was written"
                );
                (SWAP_CACHE_WRITE, Slots::One(slot))
            }
            Ok(Place::File) => {
                assert_eq!(
                    self.file_page(page),
                    data,
                    "the file holds what was written"
                );
                (SWAP_FILE_WRITE, Slots::None)
            }
            Err(e) => (self.refused(page, Some(e)), Slots::None),
        }
    }

    fn read(&self, page: u64) -> u32 {
        let mut buf = vec![0x5au8; PAGE as usize];
        match self.store.read(page, &mut buf) {
            Ok(Place::Cache) => {
                let slot = self.mapped_slot(page);
                assert_eq!(
                    buf,
                    self.slot_data(slot),
                    "a cached read is the indexed slot"
                );
                SWAP_CACHE_READ
            }
            Ok(Place::File) => {
                assert_eq!(
                    buf,
                    self.file_page(page),
                    "a missed read is the file's page"
                );
                0
            }
            Err(e) => self.refused(page, Some(e)),
        }
    }

    /// Checks a failure: only a page beyond the disk is refused, and it says so.
    fn refused(&self, page: u64, err: Option<OpError>) -> u32 {
        let beyond = page >= self.layout.swap_pages;
        match err {
            None => {
                assert!(!beyond, "page {page} is beyond the disk yet was served");
                0
            }
            Some(OpError::Range(p)) if p == page && beyond => SWAP_REFUSED,
            Some(e) => panic!("page {page} of {}: {e}", self.layout.swap_pages),
        }
    }

    fn evict(&self, want: usize) -> u32 {
        let n = self.store.evict(want);
        let bound = want as u64 + self.layout.slots;
        assert!(n as u64 <= bound, "{n} evictions for {want} wanted");
        if n > 0 {
            SWAP_EVICTED
        } else {
            0
        }
    }

    fn resize(&self, pages: u8) -> u32 {
        let pages = u64::from(pages) % (self.layout.slots + 2);
        match self.store.set_target(pages) {
            Ok(()) => {
                assert!(pages <= self.layout.slots);
                let over = self.store.rebalance();
                assert!(over <= self.layout.slots, "{over} slots over the size");
                0
            }
            Err(e) => {
                assert!(
                    pages > self.layout.slots,
                    "a size within the slots is taken: {e}"
                );
                assert!(
                    self.store.target() <= self.layout.slots,
                    "a refused size is not set"
                );
                SWAP_REFUSED
            }
        }
    }

    /// The slot the index names for `page`, checked to be a mapped (or evicting) slot of it.
    fn mapped_slot(&self, page: u64) -> u64 {
        let l = &self.layout;
        let v = self.word32(l.index_off + page * 4);
        assert!(
            v >= 1 && u64::from(v) <= l.slots,
            "index entry {v} of page {page}"
        );
        let slot = u64::from(v) - 1;
        let meta = self.word64(l.meta_off + slot * 8);
        let state = (meta & swapr::STATE_MASK) >> swapr::STATE_SHIFT;
        assert!(
            state == swapr::SLOT_MAPPED || state == swapr::SLOT_EVICTING,
            "slot {slot} of page {page} is in state {state}"
        );
        assert_eq!(
            meta & swapr::OFFSET_MASK,
            page,
            "slot {slot} holds page {page}"
        );
        slot
    }

    fn word32(&self, off: u64) -> u32 {
        match self.store.region().u32_at(off) {
            Some(w) => w.load(Ordering::Relaxed),
            None => panic!("offset {off} is a word of the region"),
        }
    }

    fn word64(&self, off: u64) -> u64 {
        match self.store.region().u64_at(off) {
            Some(w) => w.load(Ordering::Relaxed),
            None => panic!("offset {off} is a word of the region"),
        }
    }

    fn slot_data(&self, slot: u64) -> Vec<u8> {
        let mut buf = vec![0; PAGE as usize];
        assert!(self
            .store
            .region()
            .read_page(self.layout.slot_data(slot), &mut buf));
        buf
    }

    fn file_page(&self, page: u64) -> Vec<u8> {
        let mut buf = vec![0; PAGE as usize];
        let n = self.file.read_at(&mut buf, page * PAGE).unwrap_or(0);
        buf[n..].fill(0);
        buf
    }

    /// The guest lets go of the lock (see [`swap_region`]).
    fn free_lock(&self) {
        self.store
            .region()
            .hdr32("lock")
            .store(swapr::LOCK_FREE, Ordering::Release);
    }

    /// The guest writes `bytes` at `at`, page by page (cut at the region's end).
    fn scribble(&self, at: u64, bytes: &[u8]) {
        let region = self.store.region();
        let end = (at + bytes.len() as u64).min(self.layout.region_size);
        let mut page = vec![0; PAGE as usize];
        let mut off = at;
        while off < end {
            let base = off - off % PAGE;
            let upto = end.min(base + PAGE);
            assert!(region.read_page(base, &mut page));
            let (from, to) = ((off - base) as usize, (upto - base) as usize);
            let src = (off - at) as usize;
            page[from..to].copy_from_slice(&bytes[src..src + (to - from)]);
            assert!(region.write_page(base, &page));
            off = upto;
        }
    }

    /// The whole region.
    fn snapshot(&self) -> Vec<u8> {
        let mut out = vec![0; self.layout.region_size as usize];
        for (i, page) in out.chunks_exact_mut(PAGE as usize).enumerate() {
            assert!(self.store.region().read_page(i as u64 * PAGE, page));
        }
        out
    }

    /// Checks that vmsight changed only what it may (see [`swap_region`]).
    fn check_changes(&self, before: &[u8], after: &[u8], slots: Slots) {
        let pages = before
            .chunks_exact(PAGE as usize)
            .zip(after.chunks_exact(PAGE as usize));
        for (i, (b, a)) in pages.enumerate() {
            if b != a {
                self.check_page_changes(i as u64 * PAGE, b, a, slots);
            }
        }
    }

    /// [`Rig::check_changes`] for the region's page at `base`.
    fn check_page_changes(&self, base: u64, before: &[u8], after: &[u8], slots: Slots) {
        let l = &self.layout;
        if base >= l.data_off && base < l.data_off + l.slots * PAGE {
            let slot = (base - l.data_off) / PAGE;
            match slots {
                Slots::One(s) if s == slot => return,
                // Memory given back reads as zeros.
                Slots::Zeroed if after.iter().all(|&b| b == 0) => return,
                _ => panic!("{slots:?}: slot {slot}'s data changed"),
            }
        }
        for (i, (x, y)) in before.iter().zip(after).enumerate() {
            let off = base + i as u64;
            let vmm = self.vmm_writes.iter().any(|r| r.contains(&off));
            assert!(
                x == y || vmm,
                "{slots:?}: byte {off} of the region changed: {x:#x} -> {y:#x}"
            );
        }
    }
}

/// What vmsight writes besides the slots' data: its header words, the index, the slot states
/// and the free stack.
fn vmm_writes(l: &Layout) -> Vec<std::ops::Range<u64>> {
    let mut out: Vec<std::ops::Range<u64>> = VMM_WRITES
        .iter()
        .map(|f| {
            let at = SWAPHDR.at(f) as u64;
            at..at + 4
        })
        .collect();
    out.push(l.index_off..l.index_off + l.swap_pages * 4);
    out.push(l.meta_off..l.meta_off + l.slots * 8);
    out.push(l.stack_off..l.stack_off + l.slots * 4);
    out
}

/// Which slots' data an operation may change.
#[derive(Debug, Clone, Copy)]
enum Slots {
    None,
    One(u64),
    /// Any, to zeros (memory given back).
    Zeroed,
}

fn decode_swap_op(inp: &mut Input<'_>) -> SwapOp {
    match inp.u8() % 8 {
        0 => SwapOp::Write {
            page: inp.u16(),
            tag: inp.u8(),
        },
        1 => SwapOp::Read { page: inp.u16() },
        2 => SwapOp::Discard { page: inp.u16() },
        3 => SwapOp::Scribble {
            offset: inp.u32(),
            bytes: inp.chunk(MAX_SCRIBBLE).to_vec(),
        },
        4 => SwapOp::Word {
            word: inp.u32(),
            value: inp.u32(),
        },
        5 => SwapOp::Evict { want: inp.u8() },
        6 => SwapOp::Resize { pages: inp.u8() },
        _ => SwapOp::Trim { max: inp.u8() },
    }
}

/// Encodes a swap region input: the disk's pages, the most slots, the cache size (see
/// [`swap_region`]) and the operations.
pub fn encode_swap(pages: u8, slots: u8, cache: u8, ops: &[SwapOp]) -> Vec<u8> {
    let mut o = Output::default();
    o.u8(pages).u8(slots).u8(cache);
    for op in ops {
        match op {
            SwapOp::Write { page, tag } => o.u8(0).u16(*page).u8(*tag),
            SwapOp::Read { page } => o.u8(1).u16(*page),
            SwapOp::Discard { page } => o.u8(2).u16(*page),
            SwapOp::Scribble { offset, bytes } => o.u8(3).u32(*offset).chunk(bytes),
            SwapOp::Word { word, value } => o.u8(4).u32(*word).u32(*value),
            SwapOp::Evict { want } => o.u8(5).u8(*want),
            SwapOp::Resize { pages } => o.u8(6).u8(*pages),
            SwapOp::Trim { max } => o.u8(7).u8(*max),
        };
    }
    o.bytes
}
